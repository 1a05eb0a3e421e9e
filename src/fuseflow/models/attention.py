"""Attention for the decoder: the SDPA mask, grouped-query SDPA, and the packed layouts a forward may take.

``Unpadded`` and ``SharedPrefix`` describe where the N real tokens of a packed ``(1, N)`` input sit in
a padded batch: every op but attention runs on those N tokens, attention scatters to the padded layout
and gathers back (``DecoderModel.forward(unpadded=...)``). The engine's runner uses ``attend`` too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor


def build_attention_mask(attention_mask: Tensor | None, q_len: int, past_len: int) -> Tensor | None:
    """Boolean SDPA mask (B, 1, T, S), True = may attend; None means plain causal with no past.

    Query i sits at absolute column past_len + i (the T new tokens are the last T of S). Every query
    may also attend to itself, so a padding query is never fully masked (that would give NaN).
    Example (left-padded row [0, 1, 1], no past): rows are [1,0,0], [0,1,0], [0,1,1].
    """
    if attention_mask is None and past_len == 0:
        return None
    total = past_len + q_len
    device = attention_mask.device if attention_mask is not None else None
    q_pos = torch.arange(past_len, total, device=device)[:, None]  # (T, 1)
    k_pos = torch.arange(total, device=device)[None, :]  # (1, S)
    allowed = (k_pos <= q_pos)[None]  # (1, T, S)
    if attention_mask is not None:
        allowed = (allowed & attention_mask.bool()[:, None, :]) | (k_pos == q_pos)[None]  # (B, T, S)
    return allowed[:, None]  # (B|1, 1, T, S)


def _native_gqa_ok(q: Tensor, mask: Tensor | None) -> bool:
    # SDPA's enable_gqa is fast on CPU and in CUDA's flash kernel (half precision, no mask). With a mask
    # or in fp32, CUDA would pick the memory-efficient kernel, which lacks GQA, and silently fall back
    # to the O(T*S)-memory math kernel; expanding k/v heads keeps the efficient kernel there.
    return q.device.type == "cpu" or (mask is None and q.dtype in (torch.float16, torch.bfloat16))


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool) -> Tensor:
    """SDPA over q (B, H, T, hd) and k, v (B, H_kv, S, hd) with H a multiple of H_kv -> (B, H, T, hd)."""
    groups = q.shape[1] // k.shape[1]
    native = groups == 1 or _native_gqa_ok(q, mask)
    if not native:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=native and groups > 1
    )


@dataclass(frozen=True)
class Unpadded:
    """Where the N tokens of a packed ``(1, N)`` input sit in a padded ``(batch, width)`` layout.

    A forward given one runs embeddings, norms, the q/k/v/o projections, the MLP and the LM head on
    the N real tokens only (no compute on padding); attention alone scatters q, k and v to the padded
    layout (zeros at padding, which the mask hides) and gathers its output back. Build it from a
    (batch, width) 0/1 mask with ``from_mask``; the packed tokens are the mask's ones in row-major order.
    """

    index: Tensor  # (N,) flat positions in batch * width
    batch: int
    width: int

    @classmethod
    def from_mask(cls, mask: Tensor) -> Unpadded:
        """The ones of ``mask`` (batch, width), row by row."""
        b, w = mask.shape
        return cls(mask.reshape(-1).nonzero().squeeze(1), b, w)

    def pad(self, x: Tensor) -> Tensor:
        """(1, heads, N, d) -> (batch, heads, width, d), zeros at padding."""
        h, d = x.shape[1], x.shape[3]
        flat = x[0].transpose(0, 1)  # (N, heads, d)
        out = flat.new_zeros(self.batch * self.width, h, d).index_copy(0, self.index, flat)
        return out.view(self.batch, self.width, h, d).transpose(1, 2)

    def unpad(self, x: Tensor) -> Tensor:
        """(batch, heads, width, d) -> (1, heads, N, d): the real positions only."""
        h, d = x.shape[1], x.shape[3]
        flat = x.transpose(1, 2).reshape(self.batch * self.width, h, d).index_select(0, self.index)
        return flat.transpose(0, 1).unsqueeze(0)

    def attention(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None,
                  past: tuple[Tensor, Tensor] | None) -> tuple[Tensor, Tensor, Tensor]:
        """Attention of packed q (1, H, N, hd), k, v (1, H_kv, N, hd) on the padded layout, behind ``past``:
        the packed output and the padded keys and values (past included)."""
        q, k, v = self.pad(q), self.pad(k), self.pad(v)
        if past is not None:
            k, v = torch.cat((past[0], k), dim=2), torch.cat((past[1], v), dim=2)
        return self.unpad(attend(q, k, v, mask, is_causal=False)), k, v


@dataclass(frozen=True)
class SharedPrefix:
    """A packed ``(1, N)`` input of U distinct prompts' real tokens, then B responses' tokens.

    Row ``i`` of the padded ``(B, Tp + Tr)`` batch is prompt ``inverse[i]`` followed by its response;
    the packed input holds each prompt once (``prompt``: its (U, Tp) layout) and the responses
    (``response``: their (B, Tr) layout). Attention runs in two parts: each prompt causally on
    itself, and each response against its prompt's keys and values (repeated to the rows, which
    autograd sums back to the one prompt) and its own, at the positions the whole row gives them;
    every other op sees N real tokens. ``batch`` and ``width`` are the whole rows' layout, whose
    ``attention_mask`` the forward takes. Build it with ``from_masks``.

    Prompts computed before may be left out of the packed input: their (G, H_kv, Tp, hd) keys and
    values, left-padded, come as the forward's ``past_key_values`` and stand as prompts U..U+G-1.
    """

    prompt: Unpadded
    response: Unpadded
    inverse: Tensor  # (B,) each row's prompt
    prompt_mask: Tensor  # (U, 1, Tp, Tp) SDPA mask of the prompts
    response_mask: Tensor  # (B, 1, Tr, Tp + Tr) SDPA mask of the responses
    # When a list, each layer's attention appends its prompts' (keys, values), (U, H_kv, Tp, hd) each,
    # left-padded (a scoring forward keeps them for later forwards: workers.common.PromptCache).
    record: list | None = field(default=None, compare=False)

    @classmethod
    def from_masks(cls, prompt_mask: Tensor, response_mask: Tensor, inverse: Tensor,
                   record: list | None = None, given_mask: Tensor | None = None) -> SharedPrefix:
        """From the (U, Tp) masks of the distinct prompts (left-padded), the (B, Tr) masks of the
        responses and the (B,) prompt of each row; ``given_mask``: the (G, Tp) masks of the prompts
        whose keys and values the forward is given."""
        tp, tr = prompt_mask.shape[1], response_mask.shape[1]
        every = prompt_mask if given_mask is None else torch.cat([prompt_mask, given_mask])
        rows = torch.cat([every[inverse], response_mask.to(prompt_mask.dtype)], 1)
        return cls(Unpadded.from_mask(prompt_mask), Unpadded.from_mask(response_mask), inverse,
                   build_attention_mask(prompt_mask, tp, 0), build_attention_mask(rows, tr, tp), record)

    @property
    def index(self) -> Tensor:
        """(N,) one entry per packed token (its size is what the forward checks)."""
        return torch.cat([self.prompt.index, self.response.index])

    @property
    def batch(self) -> int:
        """B, the rows of the padded layout (one per response)."""
        return self.response.batch

    @property
    def width(self) -> int:
        """Tp + Tr, the padded row width (prompt columns then response columns)."""
        return self.prompt.width + self.response.width

    def attention(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None,
                  past: tuple[Tensor, Tensor] | None) -> tuple[Tensor, Tensor, Tensor]:
        """As `Unpadded.attention` (``mask`` is unused: the layout holds its own); ``past``: the given
        prompts' keys and values."""
        n = self.prompt.index.numel()
        kp, vp = self.prompt.pad(k[:, :, :n]), self.prompt.pad(v[:, :, :n])  # (U, H_kv, Tp, hd)
        out = q[:, :, :0]
        if n:
            out = self.prompt.unpad(attend(self.prompt.pad(q[:, :, :n]), kp, vp, self.prompt_mask, is_causal=False))
        if self.record is not None:
            self.record.append((kp, vp))
        if past is not None:
            kp, vp = torch.cat((kp, past[0].to(kp.dtype))), torch.cat((vp, past[1].to(vp.dtype)))
        k_rows, v_rows = kp.index_select(0, self.inverse), vp.index_select(0, self.inverse)  # (B, H_kv, Tp, hd)
        if self.response.index.numel():
            r = self.response
            k_rows = torch.cat((k_rows, r.pad(k[:, :, n:])), dim=2)
            v_rows = torch.cat((v_rows, r.pad(v[:, :, n:])), dim=2)
            out = torch.cat((out, r.unpad(attend(r.pad(q[:, :, n:]), k_rows, v_rows, self.response_mask, False))), 2)
        return out, k_rows, v_rows
