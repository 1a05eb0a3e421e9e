"""Mechanism: one forward over all scheduled rows, on the paged KV pool, with the model's own modules.

All new tokens of a step (one per decoding row, a chunk per prefilling row) are packed into one
(N, hidden) matrix, so every linear layer runs once per step with no padding. Only attention is
per-row: decoding rows held by the decode copy (`kv.DecodeCache`) attend over it in place, in a
few batched matmuls over runs of rows of similar length; all other rows (prefill chunks, decoding
rows the copy has no room for) attend over their blocks gathered from the pool, padded to the
longest chunk, in one SDPA call. Per-step state (write indices, masks, views) is built once and
shared by all layers, since on a CPU the count of small ops per layer costs as much as the
attention itself. The runner reads the weights of the `CausalLM` it was given on every call, so
a trainer updating that model in place is seen at once (no copy).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from fuseflow.models.attention import attend
from fuseflow.models.device import cpuinfo
from fuseflow.models.llama import CausalLM, rope_cos_sin, rope_inv_freq
from fuseflow.models.lora import lora_parts

from .kv import DecodeCache, KVPool
from .scheduler import StepPlan

LINEAR_KERNELS = ("auto", "onednn", "torch")  # EngineConfig.linear_kernel


def _rope(x: Tensor, cos: Tensor, sin_signed: Tensor) -> Tensor:
    """Rotate x (N, heads, hd) by cos and sign-folded sin (N, 1, hd).

    The model's rotate_half(x) = cat(-x2, x1) equals roll(x, hd/2) with the first half negated;
    the sign is folded into the sin table, so the values are bit-identical with fewer ops.
    """
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin_signed)


class Linears:
    """The runner's matmuls: y = x W^T + b, optionally fused with a residual add or a SiLU.

    On CPU, PyTorch sends fp32 `F.linear` to MKL, which on this project's AMD machine ran a decode
    step's small-M products (32 rows x 512 -> 1152) at ~55 GFLOPS; oneDNN's linear (the kernel
    behind PyTorch's CPU compiler) ran the same products in full fp32 at ~150, but costs ~25 us more
    per call, so products under `ONEDNN_MIN_MACS` stay on torch (measured break-even). On an Intel
    CPU MKL takes its own fast paths: there it was faster than oneDNN on the tiny and small layers at
    1-1024 rows and within 7% either way on SmolLM2's (docs/benchmarks.md), so fp32 stays on torch
    (`mkl_preferred`). oneDNN is called on the model's own weight tensors (no copy, nothing packed and
    kept: a trainer's in-place update is seen at once). `kernel`: "onednn"; "auto" (oneDNN where
    `onednn_available` says it works, a CPU build with it, fp32 or bf16, unless `mkl_preferred`);
    "torch" (plain `F.linear` always).
    """

    ONEDNN_MIN_MACS = 1_500_000  # rows x in x out below which torch's call is cheaper

    def __init__(self, kernel: str, device: torch.device, dtype: torch.dtype):
        if kernel not in LINEAR_KERNELS:
            raise ValueError(f"linear kernel must be auto, onednn or torch, got {kernel!r}")
        ok = onednn_available(device, dtype)
        if kernel == "onednn" and not ok:
            raise ValueError(f"linear kernel 'onednn' is not available for {device.type} / {dtype}; use auto or torch")
        self.onednn = kernel == "onednn" or (kernel == "auto" and ok and not mkl_preferred(device, dtype))

    def _dnnl(self, x: Tensor, w: Tensor) -> bool:
        return self.onednn and x.shape[0] * w.shape[0] * w.shape[1] >= self.ONEDNN_MIN_MACS

    def __call__(self, x: Tensor, layer: torch.nn.Linear) -> Tensor:
        if self._dnnl(x, layer.weight):
            y = torch.ops.mkldnn._linear_pointwise(x, layer.weight, layer.bias, "none", [], "")
        else:
            y = F.linear(x, layer.weight, layer.bias)
        return _add_lora(y, x, layer)

    def silu(self, x: Tensor, layer: torch.nn.Linear) -> Tensor:
        """silu(x W^T + b)."""
        if lora_parts(layer) is not None:  # the adapter's term goes in before the activation
            return F.silu(self(x, layer))
        if self._dnnl(x, layer.weight):
            return torch.ops.mkldnn._linear_pointwise(x, layer.weight, layer.bias, "swish", [], "")
        return F.silu(F.linear(x, layer.weight, layer.bias))

    def add(self, h: Tensor, x: Tensor, layer: torch.nn.Linear) -> Tensor:
        """h + x W^T + b, as one fused op (h is not modified)."""
        if self._dnnl(x, layer.weight):
            y = torch.ops.mkldnn._linear_pointwise.binary(x, h, layer.weight, layer.bias, "add")
        elif layer.bias is None:
            y = torch.addmm(h, x, layer.weight.t())
        else:
            y = h + F.linear(x, layer.weight, layer.bias)
        return _add_lora(y, x, layer)


def _add_lora(y: Tensor, x: Tensor, layer: torch.nn.Module) -> Tensor:
    """y + scaling * (x A^T) B^T for a LoRA-adapted layer (in place on the fresh output y), else y.

    The adapted weights are never formed: two thin products per layer instead of a merged copy of
    W, and the base W (shared with the reference) is never written. Inference: no dropout.
    """
    parts = lora_parts(layer)
    if parts is None:
        return y
    a, b, scaling = parts
    return y.addmm_(F.linear(x, a), b.t(), alpha=scaling)


def mkl_preferred(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether plain `F.linear` (MKL) is the faster kernel here, as measured: fp32 on an Intel CPU."""
    return device.type == "cpu" and dtype == torch.float32 and cpu_vendor() == "GenuineIntel"


@functools.cache
def cpu_vendor() -> str:
    """The CPU's vendor id from /proc/cpuinfo ("GenuineIntel", "AuthenticAMD", ...); "" where unreadable."""
    return cpuinfo("vendor_id")


def onednn_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN's linear runs here and agrees with `F.linear` (probed once per device/dtype)."""
    return _probe_onednn(device.type, dtype)


@functools.cache
def _probe_onednn(device_type: str, dtype: torch.dtype) -> bool:
    if device_type != "cpu" or dtype not in (torch.float32, torch.bfloat16) or not torch.backends.mkldnn.is_available():
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        x, w = torch.randn(3, 8, generator=gen).to(dtype), torch.randn(5, 8, generator=gen).to(dtype)
        got = torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
        return torch.allclose(got.float(), F.linear(x, w).float(), rtol=1e-2, atol=1e-2)
    except (AttributeError, RuntimeError):
        return False


def _norm(norm: torch.nn.Module, x: Tensor) -> Tensor:
    """The model's RMSNorm; in fp32 as one fused op (the same math, measured 4x faster on CPU)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.eps)
    return norm(x)


def split_rows(lens: list[int], overhead: int = 256, depth: int = 2) -> list[tuple[int, int]]:
    """Cut rows into contiguous segments, each attended over its own longest length.

    One attention call over all rows reads every row's keys up to the longest row; splitting
    where long rows meet short ones saves those reads. A split is taken when it saves more than
    `overhead` row-positions (the cost of one more call), recursively up to 2**depth segments.

    >>> split_rows([500, 480, 20, 30, 10])
    [(0, 2), (2, 5)]
    """
    segments = [(0, len(lens))]
    for _ in range(depth):
        nxt = []
        for a, b in segments:
            best, cut = (b - a) * max(lens[a:b]) - overhead, None
            head = 0
            tails = [0] * (b - a + 1)
            for i in range(b - 1, a - 1, -1):
                tails[i - a] = max(tails[i - a + 1], lens[i])
            for k in range(a + 1, b):
                head = max(head, lens[k - 1])
                cost = (k - a) * head + (b - k) * tails[k - a]
                if cost < best:
                    best, cut = cost, k
            nxt += [(a, b)] if cut is None else [(a, cut), (cut, b)]
        segments = nxt
    return segments


class _DecodeStep:
    """Per-step state of the rows attended through the decode copy, shared by every layer.

    m:        rows 0..m-1 of the step (the copy's rows 0..m-1)
    index:    (L, m * 2 * n_kv * hd) where each layer's new keys and values go in the copy
    q:        (m, H, hd) buffer the layer's rotated queries are copied into (contiguous, so views below work)
    segments: (keys, values, q view, output view, bias) per run of rows attended over one key span:
              keys (L, n * n_kv, hd, S) and values (L, n * n_kv, S, hd) views of the copy, q (n * n_kv, group, hd),
              output (n * n_kv, group, hd) view of the step's attention output, bias (n * n_kv, 1, S)
    """

    def __init__(self, m: int, index: Tensor, q: Tensor, segments: list):
        self.m, self.index, self.q, self.segments = m, index, q, segments


class ModelRunner:
    """Runs `StepPlan`s on a `CausalLM` and owns the KV pool and the decode copy."""

    def __init__(self, model: CausalLM, num_blocks: int, block_size: int, max_num_seqs: int,
                 decode_cache_tokens: int = 0, linear_kernel: str = "auto"):
        self.model = model
        c = model.config
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.linears = Linears(linear_kernel, self.device, self.dtype)
        self.block_size, self.n_heads, self.n_kv, self.head_dim = (block_size, c.num_attention_heads,
                                                                    c.num_key_value_heads, c.head_dim)
        self.pool = KVPool(c.num_hidden_layers, num_blocks, block_size, c.num_key_value_heads, c.head_dim,
                           self.dtype, self.device)
        self.decode_cache = DecodeCache(self.pool, max_num_seqs, decode_cache_tokens, granularity=block_size)
        # The model computes the same element-wise rope tables per call; precomputing all positions
        # once gives bit-identical values and saves a few ops per layer per step.
        pos = torch.arange(c.max_position_embeddings, device=self.device)[None]
        cos, sin = rope_cos_sin(pos, rope_inv_freq(c, self.device), self.dtype)
        sign = torch.ones(c.head_dim, dtype=self.dtype, device=self.device)
        sign[: c.head_dim // 2] = -1
        self.cos_sin = torch.stack((cos[0], sin[0] * sign), dim=1)  # (max_pos, 2, hd); sin carries rotate_half's sign

    def _inputs(self, plan: StepPlan) -> tuple[list[int], list[int], list[int]]:
        bs, ids, pos, slots = self.block_size, [], [], []
        for seq, t in plan.rows:
            start, table = seq.num_computed, seq.block_table
            if t == 1:
                ids.append(seq.tokens[start])
                pos.append(start)
                slots.append(table[start // bs] * bs + start % bs)
                continue
            ids += seq.tokens[start : start + t]
            rng = range(start, start + t)
            pos += rng
            slots += [table[p // bs] * bs + p % bs for p in rng]
        return ids, pos, slots

    def _tables(self, rows: list[tuple]) -> Tensor:
        width = max(len(seq.block_table) for seq, _ in rows)
        return torch.tensor([seq.block_table + [0] * (width - len(seq.block_table)) for seq, _ in rows],
                            device=self.device)  # (B, nb); padding entries point at block 0 and are masked

    @torch.no_grad()
    def forward(self, plan: StepPlan) -> Tensor:
        """Logits (R, V) in fp32 of the last token of every row that `completes`, in row order.

        Decoding rows held by the decode copy come first (the plan's rows are reordered to match
        the copy's rows); every other row (prefill chunks, decoding rows the copy has no room for)
        attends over its blocks gathered from the pool.
        """
        dev, H, hd = self.device, self.n_heads, self.head_dim
        n_dec = 0  # decoding rows come first
        while n_dec < len(plan.rows) and plan.rows[n_dec][1] == 1 and plan.completes[n_dec]:
            n_dec += 1
        n = sum(t for _, t in plan.rows)
        o = torch.empty(n, H * hd, dtype=self.dtype, device=dev)  # attention output, reused by every layer
        dec = self._decode_step(plan, n_dec, o) if n_dec else None  # may reorder the decoding rows
        m = dec.m if dec is not None else 0
        paged = plan.rows[m:]
        pre_meta = self._prefill_meta(paged) if paged else None
        ids, pos, slots = self._inputs(plan)
        slots_t = torch.tensor(slots, device=dev)
        cs = self.cos_sin[torch.tensor(pos, device=dev)]  # (N, 2, hd)
        cos, sin = cs[:, :1], cs[:, 1:]  # (N, 1, hd)

        mdl, lin = self.model.model, self.linears
        h = mdl.embed_tokens(torch.tensor(ids, device=dev))  # (N, D)
        for li, layer in enumerate(mdl.layers):
            a = layer.self_attn
            x = _norm(layer.input_layernorm, h)
            q = lin(x, a.q_proj).view(n, H, hd)
            k = lin(x, a.k_proj).view(n, self.n_kv, hd)
            v = lin(x, a.v_proj).view(n, self.n_kv, hd)
            if hasattr(a, "q_norm"):
                q, k = _norm(a.q_norm, q), _norm(a.k_norm, k)
            qk = _rope(torch.cat((q, k), dim=1), cos, sin)  # (N, H + n_kv, hd): one rotation for queries and keys
            kv = torch.stack((qk[:, H:], v), dim=1)  # (N, 2, n_kv, hd)
            self.pool.write_kv(li, slots_t, kv)
            if dec is not None:
                self._attend_decode(li, qk, kv, dec)  # fills o[:m]
            if pre_meta is not None:
                o[m:] = self._attend_prefill(li, qk[m:, :H], kv[m:, 0], kv[m:, 1], pre_meta)
            h = lin.add(h, o, a.o_proj)
            mlp, x = layer.mlp, _norm(layer.post_attention_layernorm, h)
            h = lin.add(h, lin.silu(x, mlp.gate_proj) * lin(x, mlp.up_proj), mlp.down_proj)
        if n > len(plan.rows) or not all(plan.completes):  # keep the last token of completing rows only
            last, end = [], 0
            for (_, t), done in zip(plan.rows, plan.completes, strict=True):
                end += t
                if done:
                    last.append(end - 1)
            h = h[torch.tensor(last, device=dev)]
        return lin(_norm(mdl.norm, h), self.model.lm_head).float()

    # ---------------------------------------------------------------------------------- attention
    def _decode_step(self, plan: StepPlan, n_dec: int, o: Tensor) -> _DecodeStep | None:
        rows = plan.rows[:n_dec]
        lens = [seq.num_computed + 1 for seq, _ in rows]  # positions after this step
        slot = self.decode_cache.sync([seq for seq, _ in rows], [seq.max_len for seq, _ in rows])
        # Rows in the copy first, in the order of their copy rows (row i reads copy row i); the rest after.
        held = sorted((i for i in range(n_dec) if slot[i] is not None), key=slot.__getitem__)
        plan.rows[:n_dec] = [rows[i] for i in held] + [rows[i] for i in range(n_dec) if slot[i] is None]
        m = len(held)
        if not m:
            return None
        lens = [lens[i] for i in held]
        dev, kv, hd = self.device, self.n_kv, self.head_dim
        index = self.decode_cache.write_index(torch.tensor(lens, device=dev) - 1)
        q = torch.empty(m, self.n_heads, hd, dtype=self.dtype, device=dev)
        segments = []
        for a, b in split_rows(lens):
            span, rows_n = max(lens[a:b]), b - a
            lens_t = torch.tensor(lens[a:b], device=dev)
            bias = torch.zeros(rows_n, span, dtype=self.dtype, device=dev)
            bias.masked_fill_(torch.arange(span, device=dev)[None] >= lens_t[:, None], float("-inf"))
            # (rows * n_kv, 1, S): 0 where a key exists, -inf past the row's end; the same for every layer.
            bias = bias[:, None].expand(rows_n, kv, span).reshape(-1, 1, span)
            keys, values = self.decode_cache.view(a, b, span)
            segments.append((keys, values, q[a:b].view(rows_n * kv, -1, hd), o[a:b].view(rows_n * kv, -1, hd), bias))
        return _DecodeStep(m, index, q, segments)

    def _attend_decode(self, layer: int, qk: Tensor, kv: Tensor, dec: _DecodeStep) -> None:
        """Store the copied rows' new KV in the copy and attend over it in place, writing o[:m].

        Grouped-query attention as two batched matmuls per run of rows: each kv head's keys are read
        once for all its query heads (measured faster on CPU than SDPA for one query per row).
        """
        m = dec.m
        self.decode_cache.write(dec.index[layer], kv[:m])
        dec.q.copy_(qk[:m, : self.n_heads])
        for keys, values, q, out, bias in dec.segments:
            scores = torch.baddbmm(bias, q, keys[layer], alpha=self.head_dim ** -0.5)  # (n * n_kv, group, S)
            torch.bmm(scores.softmax(-1), values[layer], out=out)

    def _prefill_meta(self, rows: list[tuple]) -> dict:
        starts = [seq.num_computed for seq, _ in rows]
        lens = [t for _, t in rows]
        if len(rows) == 1 and starts[0] == 0:
            return {"self_only": True}  # one fresh prompt: plain causal attention over its own tokens
        dev, width = self.device, max(lens)
        tables = self._tables(rows)
        span = torch.arange(tables.shape[1] * self.block_size, device=dev)  # key positions (S,)
        qi = torch.arange(width, device=dev)  # query offsets (T,)
        start_t = torch.tensor(starts, device=dev)[:, None, None]
        len_t = torch.tensor(lens, device=dev)[:, None, None]
        # Query i of row r sits at position start_r + i; padded queries (i >= t_r) see key 0 only.
        allowed = span[None, None] <= start_t + qi[None, :, None]  # (B, T, S)
        allowed = torch.where(qi[None, :, None] < len_t, allowed, span[None, None] == 0)
        index = torch.cat([torch.arange(r * width, r * width + t, device=dev) for r, t in enumerate(lens)])
        return {"self_only": False, "tables": tables, "mask": allowed[:, None], "index": index, "width": width}

    def _attend_prefill(self, layer: int, q: Tensor, k: Tensor, v: Tensor, meta: dict) -> Tensor:
        n, H, hd = q.shape
        if meta["self_only"]:
            out = attend(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], None,
                         is_causal=True)  # (1, H, T, hd)
            return out[0].transpose(0, 1).reshape(n, H * hd)
        tables, index, width = meta["tables"], meta["index"], meta["width"]
        b = tables.shape[0]
        qp = q.new_zeros(b * width, H, hd).index_copy_(0, index, q).view(b, width, H, hd).transpose(1, 2)
        kk, vv = self.pool.gather(layer, tables)
        out = attend(qp, kk, vv, meta["mask"], is_causal=False)  # (B, H, T, hd)
        return out.transpose(1, 2).reshape(b * width, H * hd).index_select(0, index)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks src -> dst in every layer for the ``(src, dst)`` pairs of ``plan.copies``: a fork
        of a shared prompt gets its own copy of the partially filled last prompt block (called after the forward)."""
        self.pool.copy_blocks(pairs)
