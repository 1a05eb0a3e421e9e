"""Llama-family decoder (Llama, Qwen2/2.5, Qwen3) with Hugging Face parameter names.

Module and parameter names mirror HF's `<Family>ForCausalLM` exactly (`model.layers.{i}.self_attn.q_proj.weight`,
...), so a state dict moves between this code and HF safetensors files without renaming. The code holds no
parallelization logic: sharding, offload or compilation wrap this module from outside (torchtitan style).

Attention masks follow the HF convention: `attention_mask` (B, S) has 1 for real tokens over all S =
past_len + T positions, so left-padded batches and KV caches work together.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from fuseflow.models import hf_io
from fuseflow.models.attention import SharedPrefix, Unpadded, attend, build_attention_mask
from fuseflow.models.config import ModelConfig


# ---------------------------------------------------------------------------------------------- KV cache
@dataclass(frozen=True)
class KVCache:
    """Per-layer keys and values of all past positions; forward returns a new cache, never mutates one.

    Immutability lets a caller keep a prefilled prompt cache and branch several continuations
    from it (prefix sharing) without copies. Rows can be dropped or repeated with `select`.
    """

    keys: tuple[Tensor, ...]  # per layer (B, n_kv, S, head_dim)
    values: tuple[Tensor, ...]  # per layer (B, n_kv, S, head_dim)

    @property
    def seq_len(self) -> int:
        """S, the number of cached positions (real or padding)."""
        return self.keys[0].shape[2]

    @property
    def batch_size(self) -> int:
        """B, the number of cached rows (samples)."""
        return self.keys[0].shape[0]

    def select(self, batch_indices: Tensor | list[int]) -> KVCache:
        """Keep (or repeat) rows: drop finished samples with `select(alive)`, fan out a prompt with
        `select([0, 0, 0, 0])`. Select the matching rows of `attention_mask` alongside."""
        idx = torch.as_tensor(batch_indices, dtype=torch.long, device=self.keys[0].device)
        if idx.ndim != 1:
            raise ValueError(f"batch_indices must be 1-D, got shape {tuple(idx.shape)}")
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.batch_size):
            raise ValueError(f"batch_indices must lie in [0, {self.batch_size}), got {idx.tolist()}")
        return KVCache(
            tuple(k.index_select(0, idx) for k in self.keys),
            tuple(v.index_select(0, idx) for v in self.values),
        )


@dataclass
class CausalLMOutput:
    logits: Tensor  # (B, T, V), or (B, logits_to_keep, V)
    past_key_values: KVCache | None = None  # set when use_cache=True
    hidden_states: Tensor | None = None  # (B, T, hidden) after the final norm; set when return_hidden=True


# ---------------------------------------------------------------------------------------------- building blocks
class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 and cast back (as HF does, so bf16 logits match)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_inv_freq(config: ModelConfig, device: torch.device | None = None) -> Tensor:
    """Inverse frequencies theta^(-2i/d) (head_dim/2,), with optional linear / llama3 rescaling.

    llama3 rescaling divides low frequencies (long wavelengths) by `factor`, keeps high ones,
    and blends linearly between the two wavelength cut-offs.
    """
    d = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d))
    rs = config.rope_scaling
    if rs is None:
        return inv
    if rs.rope_type == "linear":
        return inv / rs.factor
    wavelen = 2 * torch.pi / inv
    low_wl = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wl = rs.original_max_position_embeddings / rs.high_freq_factor
    scaled = torch.where(wavelen > low_wl, inv / rs.factor, inv)
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor
    )
    blended = (1 - smooth) * scaled / rs.factor + smooth * scaled
    medium = (wavelen >= high_wl) & (wavelen <= low_wl)
    return torch.where(medium, blended, scaled)


def rope_cos_sin(position_ids: Tensor, inv_freq: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos/sin tables (B, T, head_dim) for the half-split rotation; angles are computed in fp32."""
    freqs = position_ids[..., None].float() * inv_freq  # (B, T, head_dim/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (B, T, head_dim)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x (B, heads, T, head_dim) by position; HF's 'rotate_half' layout (first half / second half pairs)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


class Attention(nn.Module):
    """Grouped-query attention with optional q/k/v bias and per-head qk RMSNorm (applied before RoPE)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c = config
        self.n_heads, self.n_kv, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=c.o_proj_bias)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None, past: tuple[Tensor, Tensor] | None,
        unpadded: Unpadded | SharedPrefix | None = None,
    ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.n_kv, self.head_dim)
        v = self.v_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)  # (B, n_kv, T, hd)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), cos, sin)  # (B, n_heads, T, hd)
        k = apply_rope(k.transpose(1, 2), cos, sin)  # (B, n_kv, T, hd)
        if unpadded is not None:  # packed (1, N) tokens: attention runs on the padded layout
            out, k, v = unpadded.attention(q, k, v, mask, past)
        else:
            if past is not None:
                k, v = torch.cat((past[0], k), dim=2), torch.cat((past[1], v), dim=2)  # (B, n_kv, S, hd)
            out = attend(q, k, v, mask, is_causal=mask is None and past is None)  # (B, n_heads, T, hd)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1)), (k, v)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None, past: tuple[Tensor, Tensor] | None,
        unpadded: Unpadded | SharedPrefix | None = None,
    ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        attn, kv = self.self_attn(self.input_layernorm(x), cos, sin, mask, past, unpadded)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), kv


class DecoderModel(nn.Module):
    """The backbone (HF `LlamaModel`): embeddings, decoder layers, final norm. Shared by LM and value model."""

    # Recompute each layer's activations in the backward pass instead of keeping them (see
    # set_activation_checkpointing); only forwards that build a graph are affected.
    activation_checkpointing = False

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        input_ids: Tensor,  # (B, T)
        attention_mask: Tensor | None = None,  # (B, past_len + T), 1 = real token
        position_ids: Tensor | None = None,  # (B, T)
        past_key_values: KVCache | None = None,
        use_cache: bool = False,
        unpadded: Unpadded | SharedPrefix | None = None,
    ) -> tuple[Tensor, KVCache | None]:
        """Final-norm hidden states (B, T, hidden) and, if use_cache, the extended cache.

        With ``unpadded``, ``input_ids`` and ``position_ids`` are the packed (1, N) real tokens of a
        (B, T) = (unpadded.batch, unpadded.width) batch; ``attention_mask`` and ``past_key_values``
        keep their padded (B, ...) shapes, and the hidden states come back packed (1, N, hidden).
        A ``SharedPrefix`` layout's ``past_key_values`` are those of prompts it leaves out (see there).
        """
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be (B, T), got shape {tuple(input_ids.shape)}")
        b, t = input_ids.shape
        if unpadded is not None:
            if (b, t) != (1, unpadded.index.numel()):
                raise ValueError(f"packed input_ids must be (1, {unpadded.index.numel()}), got {(b, t)}")
            if position_ids is None or tuple(position_ids.shape) != (b, t) or attention_mask is None:
                raise ValueError("a packed (unpadded) forward needs position_ids of the input's (1, N) shape "
                                 "and the padded batch's attention_mask")
            b, t = unpadded.batch, unpadded.width
        shared = isinstance(unpadded, SharedPrefix)  # its past holds prompts the input leaves out, not rows
        past_len = 0 if past_key_values is None or shared else past_key_values.seq_len
        if past_key_values is not None and not shared and past_key_values.batch_size != b:
            raise ValueError(f"past_key_values has batch {past_key_values.batch_size} but input_ids has {b}")
        if attention_mask is not None and tuple(attention_mask.shape) != (b, past_len + t):
            raise ValueError(
                f"attention_mask must be (B, past_len + T) = ({b}, {past_len + t}), got {tuple(attention_mask.shape)}"
            )
        if position_ids is None:
            if attention_mask is None:
                position_ids = torch.arange(past_len, past_len + t, device=input_ids.device).expand(b, t)
            else:  # left padding: real tokens get positions 0, 1, ... whatever the padding before them
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, past_len:]
        elif unpadded is None and tuple(position_ids.shape) != (b, t):
            raise ValueError(f"position_ids must be (B, T) = ({b}, {t}), got {tuple(position_ids.shape)}")

        h = self.embed_tokens(input_ids)  # (B, T, hidden)
        cos, sin = rope_cos_sin(position_ids, rope_inv_freq(self.config, h.device), h.dtype)
        # A SharedPrefix layout holds its own masks.
        mask = None if shared else build_attention_mask(attention_mask, t, past_len)
        if mask is not None and t == 1 and (attention_mask is None or bool(attention_mask.all())):
            mask = None  # single query and every key is real: causal order needs no mask
        keys, values = [], []
        recompute = self.activation_checkpointing and torch.is_grad_enabled()
        for i, layer in enumerate(self.layers):
            past = None if past_key_values is None else (past_key_values.keys[i], past_key_values.values[i])
            if recompute:  # a shared prompt's keys and values (past) and the cache it returns work alike
                h, (k, v) = checkpoint(layer, h, cos, sin, mask, past, unpadded, use_reentrant=False)
            else:
                h, (k, v) = layer(h, cos, sin, mask, past, unpadded)
            if use_cache:
                keys.append(k)
                values.append(v)
        cache = KVCache(tuple(keys), tuple(values)) if use_cache else None
        return self.norm(h), cache


def set_activation_checkpointing(model: nn.Module, enabled: bool) -> None:
    """Turn activation checkpointing on or off in every decoder of ``model`` (peft-wrapped or sharded too).

    On, a training forward keeps only each decoder layer's input and recomputes the layer in the
    backward pass: its activations (many times the hidden state per token and layer: the largest
    share of a LoRA step's memory) are never all alive at once, for about one more forward
    pass of compute. Forwards without autograd (scoring, generation) are unchanged.
    """
    for sub in model.modules():
        if isinstance(sub, DecoderModel):
            sub.activation_checkpointing = enabled


@torch.no_grad()
def init_weights(module: nn.Module, std: float, seed: int) -> None:
    """HF-style init: Linear/Embedding weights ~ N(0, std), biases 0, norm weights 1; seeded, global RNG untouched."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for sub in module.modules():
        if isinstance(sub, (nn.Linear, nn.Embedding)):
            w = torch.empty(sub.weight.shape, dtype=torch.float32).normal_(0.0, std, generator=gen)
            sub.weight.copy_(w)
            if getattr(sub, "bias", None) is not None:
                sub.bias.zero_()
        elif isinstance(sub, RMSNorm):
            sub.weight.fill_(1.0)


# ---------------------------------------------------------------------------------------------- causal LM
class CausalLM(nn.Module):
    """Decoder plus LM head; `state_dict()` keys equal HF's `<Family>ForCausalLM` keys.

    Example:
        >>> lm = CausalLM.from_config(ModelConfig.preset("tiny", vocab_size=40), seed=0)
        >>> lm(torch.tensor([[1, 2, 3]])).logits.shape
        torch.Size([1, 3, 40])
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share one Parameter between embeddings and LM head when the config ties them."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: Tensor,  # (B, T)
        attention_mask: Tensor | None = None,  # (B, past_len + T), 1 = real token; left padding allowed
        position_ids: Tensor | None = None,  # (B, T); default cumsum(attention_mask) - 1
        past_key_values: KVCache | None = None,
        use_cache: bool = False,
        return_hidden: bool = False,
        logits_to_keep: int | Tensor = 0,
        unpadded: Unpadded | SharedPrefix | None = None,
    ) -> CausalLMOutput:
        """Logits for every position (or only the last `logits_to_keep`, which saves the LM-head matmul
        during generation; a 1-D tensor keeps those positions, as in transformers), plus the new cache
        and final hidden states on request. ``unpadded``: a packed (1, N) input of a padded batch (see
        `DecoderModel.forward`); the logits are then (1, N, V)."""
        h, cache = self.model(input_ids, attention_mask, position_ids, past_key_values, use_cache, unpadded)
        if isinstance(logits_to_keep, Tensor):
            logits = self.head(h[:, logits_to_keep])
        else:
            logits = self.head(h[:, -logits_to_keep:] if logits_to_keep > 0 else h)
        return CausalLMOutput(
            logits=logits, past_key_values=cache, hidden_states=h if return_hidden else None
        )

    def head(self, h: Tensor) -> Tensor:
        """Logits (..., V) of final-norm hidden states (..., hidden): the LM head alone."""
        return self.lm_head(h)

    def num_parameters(self, trainable_only: bool = False) -> int:
        """Distinct parameters (tied embeddings counted once)."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not trainable_only)

    @classmethod
    def from_config(
        cls,
        config: ModelConfig,
        seed: int = 0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> CausalLM:
        """Random init (N(0, initializer_range) like HF) for training from scratch; same seed, same weights."""
        model = cls(config)
        init_weights(model, config.initializer_range, seed)
        return model.to(device=device, dtype=dtype)

    @classmethod
    def from_pretrained(
        cls, path: str | Path, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> CausalLM:
        """Load a HF Llama/Qwen2/Qwen3 directory (config.json + model.safetensors, or sharded with an index).

        dtype None keeps the stored dtype; device "auto" resolves like `resolve_device("auto")`.
        """
        hf_cfg = hf_io.read_hf_config(path)
        if hf_cfg.get(hf_io.VALUE_MODEL_KEY):
            raise ValueError(f"{path} holds a fuseflow value model; load it with ValueModel.from_pretrained")
        config = ModelConfig.from_hf_dict(hf_cfg)
        with torch.device("meta"):
            model = cls(config)
        skip = {"lm_head.weight"} if config.tie_word_embeddings else set()
        device, dtype = hf_io.resolve_load_target(device, dtype)
        hf_io.load_state_into(
            model, hf_io.read_safetensors(path, device), device=device, dtype=dtype, skip=skip
        )
        model.tie_weights()
        return model

    def save_pretrained(self, path: str | Path) -> None:
        """Write config.json + model.safetensors that HF's AutoModelForCausalLM loads; atomic (temp dir, rename)."""
        state = self.state_dict()
        if self.config.tie_word_embeddings:
            state.pop("lm_head.weight")  # HF re-ties on load; storing it twice would double the file
        dtype = hf_io.dtype_name(self.model.embed_tokens.weight.dtype)
        hf_io.save_checkpoint(path, self.config.to_hf_dict(dtype), state)


def logprobs_of(logits: Tensor, tokens: Tensor) -> Tensor:
    """log softmax(logits)[token] per position: (B, T, V), (B, T) -> (B, T) in fp32.

    Align before calling: logits at position t predict token t+1, so pass `logits[:, :-1]`
    with `input_ids[:, 1:]`. Uses cross-entropy, which never materializes the (B, T, V) log-softmax.
    """
    if logits.shape[:-1] != tokens.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and tokens {tuple(tokens.shape)} must share (B, T)")
    flat = logits.reshape(-1, logits.shape[-1]).float()
    return -F.cross_entropy(flat, tokens.reshape(-1), reduction="none").view(tokens.shape)
