"""Cost model: seconds and bytes of each RL stage under a parallel layout (TP, PP, DP).

Formulas (all documented in docs/simulation.md, with sources):
- Compute-bound passes (training, log-prob/value inference, prefill):
  time = FLOPs / (GPUs x peak x efficiency). Forward = 2 FLOPs per matmul weight per
  token plus attention; backward = 2x forward; activation recomputation adds one
  more forward (Narayanan et al., SC'21).
- Decode is a roofline: each step reads the weights plus every active sequence's KV
  cache, so time = max(FLOPs / compute rate, bytes / memory rate) + latencies. The KV
  term grows with each sequence's length, which is why variable lengths matter.
- Collectives are ring all-reduces: 2(n-1)/n x bytes / (link bandwidth x efficiency).
  Megatron TP does 2 all-reduces per layer forward and 2 backward; PP sends one
  activation per micro-batch per stage boundary each way; DP reduce-scatters fp32
  gradients and all-gathers bf16 weights (distributed optimizer / FSDP).
- Pipeline bubbles: 1F1B runs m micro-batches in (m + p - 1) slots (Narayanan et al.).
- Memory: bf16 weights and gradients plus 12 bytes/param of fp32 Adam state (master,
  m, v; Rajbhandari et al., ZeRO, SC'20), activations per Korthikanti et al. (MLSys'23)
  with FlashAttention (34 x tokens x hidden bytes per layer), fp32 logits, KV cache.

A `Layout` places one role's model on `tp * pp * dp` devices. TP ranks are adjacent
(inside a node), then DP, then PP (Megatron's rank order), which fixes which links a
collective crosses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from fuseflow.policy.pipeline import fused_pipeline_bound

from .hardware import HardwareSpec
from .modelspec import ModelSpec

# Activation bytes per token per layer with FlashAttention and sequence parallelism,
# for 2-byte activations (Korthikanti et al. 2023, Table 2, "selective" row: 34 s b h / t).
ACT_BYTES_PER_TOKEN_LAYER = 34
# Micro-batch token budgets: enough tokens per GEMM to saturate a GPU (a few thousand
# rows), small enough to bound activation memory. Inference has no backward state so it
# can use a larger micro-batch.
TRAIN_MICRO_BATCH_TOKENS = 4096
INFER_MICRO_BATCH_TOKENS = 16384
# Gradients are reduced in fp32 even when training in bf16: Megatron-LM forces
# accumulate_allreduce_grads_in_fp32 for bf16 ("bfloat16 requires gradient accumulation and
# all-reduce to be done in fp32", arguments.py) and verl's FSDP defaults reduce_dtype to fp32.
GRAD_REDUCE_BYTES = 4


@dataclass(frozen=True)
class Layout:
    """How one role's model is parallelised on `tp * pp * dp` devices.

    zero=1: Adam state sharded over DP (Megatron distributed optimizer / ZeRO-1);
    zero=3: parameters, gradients and Adam state sharded over DP (ZeRO-3 / FSDP).
    recompute: full activation recomputation (stores one input per layer, one extra forward).
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    zero: int = 1
    recompute: bool = False

    def __post_init__(self) -> None:
        for f in ("tp", "pp", "dp"):
            if getattr(self, f) < 1:
                raise ValueError(f"layout.{f}={getattr(self, f)!r}: must be >= 1")
        if self.zero not in (1, 3):
            raise ValueError(f"layout.zero={self.zero!r}: must be 1 or 3")

    @property
    def gpus(self) -> int:
        """Devices the layout occupies: `tp * pp * dp`."""
        return self.tp * self.pp * self.dp

    def __str__(self) -> str:
        return f"tp{self.tp}.pp{self.pp}.dp{self.dp}.z{self.zero}{'.rc' if self.recompute else ''}"


@dataclass(frozen=True)
class StageCost:
    """Predicted seconds of one stage, with the parts it is made of (for breakdowns)."""

    seconds: float
    parts: dict[str, float] = field(default_factory=dict)
    bubble: float = 0.0  # pipeline-idle seconds inside `seconds` (what intra-stage fusion can fill)
    slot: float = 0.0  # seconds of one (stage, micro-batch) slot
    # Training only (0 elsewhere): recorded by `train_cost` so that `fused_train_seconds` can
    # reuse them instead of dividing them back out of the float totals above.
    steps: int = 0  # optimizer steps (mini-batches x epochs)
    micro_batches: int = 0  # micro-batches per optimizer step on each pipeline (DP rank)


# ------------------------------------------------------------------------ links
def link_bw(hw: HardwareSpec, span: int) -> float:
    """Bandwidth of a collective whose ranks sit within `span` consecutive devices."""
    return hw.intra_bw if span <= hw.gpus_per_node else hw.inter_bw


def allreduce_seconds(hw: HardwareSpec, nbytes: float, ranks: int, bw: float) -> float:
    """Ring all-reduce: each rank sends and receives 2(n-1)/n of the buffer."""
    if ranks <= 1:
        return 0.0
    eff = hw.efficiency
    return 2.0 * (ranks - 1) / ranks * nbytes / (bw * eff.comm) + eff.collective_latency_s


def allgather_seconds(hw: HardwareSpec, full_bytes: float, ranks: int, bw: float) -> float:
    """Ring all-gather (or reduce-scatter) of a buffer of `full_bytes`: (n-1)/n of it per rank."""
    if ranks <= 1:
        return 0.0
    eff = hw.efficiency
    return (ranks - 1) / ranks * full_bytes / (bw * eff.comm) + eff.collective_latency_s


def p2p_seconds(hw: HardwareSpec, nbytes: float, bw: float) -> float:
    """One point-to-point send (pipeline activations, KV migration)."""
    return nbytes / (bw * hw.efficiency.comm) + hw.efficiency.collective_latency_s


# ------------------------------------------------------------------------ memory
def optimizer_bytes_per_param(hw: HardwareSpec) -> int:
    """Adam state: fp32 master copy + m + v with bf16 weights; only m + v when training in fp32."""
    return 12 if hw.param_bytes < 4 else 8


def model_state_bytes(model: ModelSpec, hw: HardwareSpec, lay: Layout, trainable: bool) -> float:
    """Per-device bytes of weights (+ gradients and Adam state when trainable)."""
    shard = model.params / (lay.tp * lay.pp)
    b = hw.param_bytes
    if not trainable:
        return shard * b / (lay.dp if lay.zero == 3 else 1)
    opt = optimizer_bytes_per_param(hw) * shard / lay.dp
    weights_grads = 2 * b * shard / (lay.dp if lay.zero == 3 else 1)
    return weights_grads + opt


def train_activation_bytes(model: ModelSpec, hw: HardwareSpec, lay: Layout, mb_tokens: float) -> float:
    """Peak activation bytes per device for one micro-batch of `mb_tokens` tokens under 1F1B.

    The first pipeline stage holds p micro-batches of L/p layers: L layers' worth of
    one micro-batch, whatever p is. Recomputation keeps only each layer's input (2
    bytes x hidden per token) plus one layer's working set. Logits are fp32 on the last stage.
    """
    scale = hw.param_bytes / 2
    per_layer = ACT_BYTES_PER_TOKEN_LAYER * mb_tokens * model.hidden / lay.tp * scale
    if lay.recompute:
        stored = model.layers * 2 * mb_tokens * model.hidden * scale + per_layer
    else:
        stored = model.layers * per_layer
    logits = mb_tokens * model.vocab * 4 / lay.tp if model.head == "lm" else 0.0
    return stored + logits


def infer_activation_bytes(model: ModelSpec, hw: HardwareSpec, lay: Layout, mb_tokens: float) -> float:
    """Transient bytes of a forward-only pass: one layer's working set plus fp32 logits."""
    per_layer = ACT_BYTES_PER_TOKEN_LAYER * mb_tokens * model.hidden / lay.tp * hw.param_bytes / 2
    logits = mb_tokens * model.vocab * 4 / lay.tp if model.head == "lm" else 0.0
    return per_layer + logits


# ------------------------------------------------------------------------ training / inference
def _micro_batches(n_rank: float, mean_len: float, mb_tokens: int) -> tuple[int, float]:
    """(micro-batches per rank, samples per micro-batch) for `n_rank` samples on one DP rank."""
    per_mb = max(1, int(mb_tokens // max(mean_len, 1.0)))
    m = max(1, math.ceil(n_rank / per_mb))
    return m, n_rank / m


def train_cost(
    model: ModelSpec, hw: HardwareSpec, lay: Layout, seq_lens: np.ndarray,
    mini_batches: int = 1, epochs: int = 1, mb_tokens: int = TRAIN_MICRO_BATCH_TOKENS,
) -> StageCost:  # fmt: skip
    """Seconds of one PPO update (epochs x mini-batches optimizer steps) over `seq_lens`.

    Per mini-batch the pipeline runs (m + p - 1) slots (1F1B); each slot is one
    micro-batch's forward and backward on one stage, plus its TP all-reduces, layer
    launch latencies and the activation send to the next stage. A slot's compute is a
    roofline: FLOPs at `train_mfu`, but never less than streaming the stage's weights once
    per pass (forward, and dgrad + wgrad in backward) plus the fp32 gradient accumulation,
    which binds when a micro-batch has only a few tokens per device.
    Data parallelism (Megatron distributed optimizer for zero=1, FSDP for zero=3) reduces
    fp32 gradients (`GRAD_REDUCE_BYTES`) and all-gathers bf16 weights: zero=1 reduce-scatters
    once per step, hidden behind the last micro-batch's backward, and all-gathers the
    updated weights, hidden behind the next step's first forward (Megatron's
    overlap_grad_reduce / overlap_param_gather); zero=3 gathers twice and reduce-scatters
    once per micro-batch, hidden behind that micro-batch's compute. Only the excess counts.
    """
    seq_lens = np.asarray(seq_lens, dtype=float)  # (N,) tokens per sample (prompt + response)
    eff, b = hw.efficiency, hw.param_bytes
    mean_len = float(seq_lens.mean())
    n_rank = len(seq_lens) / (mini_batches * lay.dp)
    m, per_mb = _micro_batches(n_rank, mean_len, mb_tokens)
    mb_tok = per_mb * mean_len
    fwd = per_mb * mean_sequence_flops(model, seq_lens)
    passes = 4 if lay.recompute else 3
    stage_params = model.params / (lay.tp * lay.pp)
    flops_time = passes * fwd / (lay.tp * lay.pp * hw.peak_flops * eff.train_mfu)
    # Weight-streaming floor: each pass reads the stage's weights; backward also reads and
    # writes the fp32 gradient accumulator (2 x 4 bytes per parameter).
    stream = stage_params * (passes * b + 2 * GRAD_REDUCE_BYTES) / (hw.mem_bw * eff.decode_mbu)
    compute = max(flops_time, stream)
    layers_stage = model.layers / lay.pp
    latency = passes * layers_stage * eff.layer_latency_s
    tp_bw = link_bw(hw, lay.tp)
    tp_comm = (6 if lay.recompute else 4) * layers_stage * allreduce_seconds(hw, mb_tok * model.hidden * b, lay.tp, tp_bw)
    pp_comm = 2 * p2p_seconds(hw, mb_tok * model.hidden * b / lay.tp, link_bw(hw, lay.gpus)) if lay.pp > 1 else 0.0
    dp_bw = link_bw(hw, lay.tp * lay.dp)
    gather = allgather_seconds(hw, stage_params * b, lay.dp, dp_bw)  # bf16 weights
    reduce = allgather_seconds(hw, stage_params * GRAD_REDUCE_BYTES, lay.dp, dp_bw)  # fp32 gradients
    zero3_exposed = 0.0
    if lay.zero == 3 and lay.dp > 1:
        # FSDP: gather weights for forward and backward, reduce-scatter gradients, per
        # micro-batch, prefetched while the previous layer computes.
        zero3_exposed = max(0.0, 2 * gather + reduce - compute)
    slot = compute + latency + tp_comm + pp_comm + zero3_exposed
    pipeline = (m + lay.pp - 1) * slot
    if lay.zero == 3:
        grad_sync = 0.0  # already reduce-scattered per micro-batch
    else:
        backward, forward = compute * (passes - 1) / passes, compute / passes
        grad_sync = max(0.0, reduce - backward) + max(0.0, gather - forward)
    opt_params = stage_params / lay.dp
    opt_step = 2 * opt_params * (2 * b + optimizer_bytes_per_param(hw)) / (hw.mem_bw * eff.decode_mbu)
    steps = mini_batches * epochs
    total = steps * (pipeline + grad_sync + opt_step)
    parts = {
        "compute": steps * m * compute, "latency": steps * m * latency, "tp_comm": steps * m * tp_comm,
        "pp_comm": steps * m * pp_comm, "zero3_comm": steps * m * zero3_exposed,
        "bubble": steps * (lay.pp - 1) * slot, "dp_comm": steps * grad_sync, "optimizer": steps * opt_step,
    }  # fmt: skip
    return StageCost(total, parts, bubble=parts["bubble"], slot=slot, steps=steps, micro_batches=m)


def infer_cost(
    model: ModelSpec, hw: HardwareSpec, lay: Layout, seq_lens: np.ndarray, mb_tokens: int = INFER_MICRO_BATCH_TOKENS,
) -> StageCost:  # fmt: skip
    """Seconds of a forward-only pass (log-probs, values, reward scores) over `seq_lens`."""
    seq_lens = np.asarray(seq_lens, dtype=float)  # (N,)
    if len(seq_lens) == 0:
        return StageCost(0.0, {})
    eff, b = hw.efficiency, hw.param_bytes
    mean_len = float(seq_lens.mean())
    n_rank = len(seq_lens) / lay.dp
    m, per_mb = _micro_batches(n_rank, mean_len, mb_tokens)
    mb_tok = per_mb * mean_len
    fwd = per_mb * mean_sequence_flops(model, seq_lens)
    stage_params = model.params / (lay.tp * lay.pp)
    # Roofline per micro-batch: FLOPs, or streaming the stage's weights once if that is slower.
    compute = max(fwd / (lay.tp * lay.pp * hw.peak_flops * eff.infer_mfu),
                  stage_params * b / (hw.mem_bw * eff.decode_mbu))  # fmt: skip
    layers_stage = model.layers / lay.pp
    latency = layers_stage * eff.layer_latency_s
    tp_comm = 2 * layers_stage * allreduce_seconds(hw, mb_tok * model.hidden * b, lay.tp, link_bw(hw, lay.tp))
    pp_comm = p2p_seconds(hw, mb_tok * model.hidden * b / lay.tp, link_bw(hw, lay.gpus)) if lay.pp > 1 else 0.0
    zero3 = 0.0
    if lay.zero == 3 and lay.dp > 1:
        zero3 = max(0.0, allgather_seconds(hw, stage_params * b, lay.dp, link_bw(hw, lay.tp * lay.dp)) - compute)
    slot = compute + latency + tp_comm + pp_comm + zero3
    total = (m + lay.pp - 1) * slot
    parts = {"compute": m * compute, "latency": m * latency, "tp_comm": m * tp_comm, "pp_comm": m * pp_comm,
             "zero3_comm": m * zero3, "bubble": (lay.pp - 1) * slot}  # fmt: skip
    return StageCost(total, parts, bubble=parts["bubble"], slot=slot)


def mean_sequence_flops(model: ModelSpec, seq_lens: np.ndarray) -> float:
    """Mean forward FLOPs per causal sequence (matmuls linear in length, attention quadratic)."""
    seq_lens = np.asarray(seq_lens, dtype=float)  # (N,)
    return model.forward_flops(float(seq_lens.mean()), float((seq_lens * (seq_lens + 1) / 2).mean()))


def fused_train_seconds(a: StageCost, c: StageCost, pp_a: int, pp_c: int) -> float:
    """Actor and critic training interleaved on the same devices in opposite pipeline directions.

    fuseflow's fused-schedule solver reaches the four-term lower bound on all six of
    RLHFuse's instances and comes within 0.5% of it on 16-device ones (docs/benchmarks.md),
    so each optimizer step costs `fused_pipeline_bound` of the two pipelines instead of
    the sum of two 1F1B pipelines; gradient sync and the optimizer stay as they were. The
    bound needs one stage count to divide the other (the deeper pipeline plays A); other
    shapes keep the bidirectional-pipeline closed form (Chimera, Li & Hoefler SC'21):
    (p-2)/2 idle slots per pipeline instead of 1F1B's p-1.
    `a` and `c` are what `train_cost` returns: the optimizer steps and micro-batches per
    step it records fix the shape of each fused step (no division back out of the totals).
    """
    if pp_a < 2 or pp_c < 2:
        return a.seconds + c.seconds
    for name, cost in (("a", a), ("c", c)):
        if cost.bubble > 0 and cost.steps < 1:
            raise ValueError(f"{name}.steps={cost.steps!r} with a pipeline bubble of {cost.bubble!r} s: "
                             "pass the StageCost that train_cost returns, which records its optimizer steps")  # fmt: skip
    if pp_c > pp_a:
        a, c, pp_a, pp_c = c, a, pp_c, pp_a
    if pp_a % pp_c == 0 and a.steps > 0 and a.steps == c.steps:
        rest_a = a.parts.get("dp_comm", 0.0) + a.parts.get("optimizer", 0.0)
        rest_c = c.parts.get("dp_comm", 0.0) + c.parts.get("optimizer", 0.0)
        step = fused_pipeline_bound(pp_a, pp_c, a.micro_batches, c.micro_batches, a.slot, c.slot)
        return min(a.steps * step + rest_a + rest_c, a.seconds + c.seconds)
    busy = a.seconds - a.bubble + c.seconds - c.bubble
    fused_bubble = 0.5 * (a.steps * max(pp_a - 2, 0) * a.slot + c.steps * max(pp_c - 2, 0) * c.slot)
    return busy + fused_bubble


# ------------------------------------------------------------------------ generation
@dataclass(frozen=True)
class DecodeModel:
    """Per-step decode cost of one rollout replica (tp x pp devices), vectorised over steps.

    One decode round advances every active sequence by one token. With pipelined
    generation (pp > 1) the batch is cut into k = min(pp, n) micro-batches that flow
    through the stages, so each round reads the weights once per micro-batch slot:
    round = max(FLOPs / (k tp R), (W / tp + KV / (k tp)) / B) + L x latency + TP/PP comm.
    With pp = 1 this is the usual max(FLOPs / (tp R), (W + KV) / (tp B)).
    """

    model: ModelSpec
    hw: HardwareSpec
    tp: int = 1
    pp: int = 1

    @property
    def gpus(self) -> int:
        """Devices of one rollout replica: `tp * pp`."""
        return self.tp * self.pp

    def coefficients(self, n):
        """Round cost as max(c0 + c1 ctx, m0 + m1 ctx) + fixed for `n` active sequences.

        `ctx` is the total context the round's tokens attend; works on floats and arrays.
        """
        m, hw, eff = self.model, self.hw, self.hw.efficiency
        n = np.asarray(n, dtype=float)
        k = np.minimum(self.pp, np.maximum(n, 1.0))
        rate = k * self.tp * hw.peak_flops * eff.infer_mfu
        c0 = n * 2.0 * m.matmul_params / rate
        c1 = 4.0 * m.layers * m.heads * m.head_dim / rate
        bw = hw.mem_bw * eff.decode_mbu
        m0 = m.weight_bytes(hw.param_bytes) / self.tp / bw + 0.0 * n
        m1 = m.kv_bytes_per_token(hw.param_bytes) / (k * self.tp) / bw
        fixed = m.layers * eff.layer_latency_s + 0.0 * n
        if self.tp > 1:
            link = link_bw(hw, self.tp)
            fixed = fixed + 2 * m.layers * (2.0 * (self.tp - 1) / self.tp * (n / k) * m.hidden * hw.param_bytes
                                             / (link * eff.comm) + eff.collective_latency_s)  # fmt: skip
        if self.pp > 1:
            fixed = fixed + (self.pp - 1) * p2p_seconds(hw, (n / k) * m.hidden * hw.param_bytes, link_bw(hw, self.gpus))
        return c0, c1, m0, m1, fixed

    def step_seconds(self, n: np.ndarray, ctx_sum: np.ndarray) -> np.ndarray:
        """Seconds of decode rounds with `n` active sequences attending `ctx_sum` keys in total."""
        ctx_sum = np.asarray(ctx_sum, dtype=float)  # (S,) sum of context lengths per round
        c0, c1, m0, m1, fixed = self.coefficients(n)  # each (S,) or scalar
        return np.maximum(c0 + c1 * ctx_sum, m0 + m1 * ctx_sum) + fixed

    @cached_property
    def _scalar(self) -> tuple[float, ...]:
        """Constants of `coefficients` for the scalar fast path (the search calls it ~1e6 times)."""
        m, hw, eff = self.model, self.hw, self.hw.efficiency
        bw = hw.mem_bw * eff.decode_mbu
        tp_unit = 0.0
        tp_lat = 0.0
        if self.tp > 1:
            tp_unit = 2 * m.layers * 2.0 * (self.tp - 1) / self.tp * m.hidden * hw.param_bytes / (link_bw(hw, self.tp) * eff.comm)
            tp_lat = 2 * m.layers * eff.collective_latency_s
        pp_unit = pp_lat = 0.0
        if self.pp > 1:
            link = link_bw(hw, self.gpus)
            pp_unit = (self.pp - 1) * m.hidden * hw.param_bytes / (link * eff.comm)
            pp_lat = (self.pp - 1) * eff.collective_latency_s
        return (
            self.tp * hw.peak_flops * eff.infer_mfu, 2.0 * m.matmul_params, 4.0 * m.layers * m.heads * m.head_dim,
            m.weight_bytes(hw.param_bytes) / self.tp / bw, m.kv_bytes_per_token(hw.param_bytes) / self.tp / bw,
            m.layers * eff.layer_latency_s + tp_lat + pp_lat, tp_unit + pp_unit,
        )  # fmt: skip

    def segment_seconds(self, n: int, ctx0: float, rounds: int) -> float:
        """Closed-form sum of `rounds` rounds with `n` sequences whose context starts at ctx0.

        Each round adds n to the context, so both roofline arms are linear in the round
        index j; the sum of their maximum splits at the crossover into two arithmetic series.
        """
        rate, flop_tok, flop_ctx, w_time, kv_time, fixed0, per_seq = self._scalar
        k = min(self.pp, max(n, 1))
        c0, c1 = n * flop_tok / (k * rate), flop_ctx / (k * rate)
        m0, m1 = w_time, kv_time / k
        fixed = fixed0 + per_seq * n / k
        a1, b1 = c0 + c1 * ctx0, c1 * n  # compute arm: a1 + b1 j
        a2, b2 = m0 + m1 * ctx0, m1 * n  # memory arm: a2 + b2 j

        def series(a: float, b: float, lo: int, hi: int) -> float:
            return (hi - lo) * a + b * (hi - lo) * (lo + hi - 1) / 2.0 if hi > lo else 0.0

        if b1 == b2:
            body = rounds * max(a1, a2)
        else:
            x = (a2 - a1) / (b1 - b2)  # arms cross at j = x
            if b1 > b2:  # memory-bound first, compute-bound from the crossover on
                j0 = min(max(math.ceil(x), 0), rounds)
                body = series(a2, b2, 0, j0) + series(a1, b1, j0, rounds)
            else:
                j0 = min(max(math.floor(x) + 1, 0), rounds)
                body = series(a1, b1, 0, j0) + series(a2, b2, j0, rounds)
        return body + rounds * fixed

    def prefill_seconds(self, prompt_lens: np.ndarray) -> float:
        """Seconds to prefill a batch of prompts together (compute-bound forward)."""
        prompt_lens = np.asarray(prompt_lens, dtype=float)  # (P,)
        if len(prompt_lens) == 0:
            return 0.0
        return self.prefill_sums(float(prompt_lens.sum()), float((prompt_lens * (prompt_lens + 1) / 2).sum()))

    def prefill_sums(self, tokens: float, attended: float) -> float:
        """`prefill_seconds` from the batch's token count and its causal (query, key) pair count."""
        if tokens <= 0:
            return 0.0
        m, hw, eff = self.model, self.hw, self.hw.efficiency
        compute = m.forward_flops(tokens, attended) / (self.gpus * hw.peak_flops * eff.infer_mfu)
        memory = self._scalar[3] / self.pp  # every device reads its weight shard once
        tp_comm = 2 * m.layers * allreduce_seconds(hw, tokens * m.hidden * hw.param_bytes, self.tp, link_bw(hw, self.tp))
        return max(compute, memory) + m.layers * eff.layer_latency_s + tp_comm

    def weight_bytes_per_gpu(self) -> float:
        """Weight bytes each device of the replica holds: the model in `hw.param_bytes`, split evenly
        over its `tp * pp` devices."""
        return self.model.weight_bytes(self.hw.param_bytes) / self.gpus

    def kv_bytes_per_token_per_gpu(self) -> float:
        """KV-cache bytes one token takes on each device of the replica (all layers' K and V in
        `hw.param_bytes`, split evenly over its `tp * pp` devices)."""
        return self.model.kv_bytes_per_token(self.hw.param_bytes) / self.gpus


# ------------------------------------------------------------------------ weight movement
def reshard_seconds(model: ModelSpec, hw: HardwareSpec, train: Layout, gen_tp: int, gen_pp: int) -> float:
    """Actor weights from the training layout to the generation layout on the same devices.

    HybridFlow's 3D-HybridEngine (Sheng et al., EuroSys'25, Table 2): each device
    all-gathers (t p - t_g p_g) / (t_g p_g t p) of the model M; zero when generation is
    at least as sharded as training (each device keeps a slice of what it holds).
    With ZeRO-3 the DP shards are gathered first: an extra (dp-1)/dp of the stage shard.
    """
    tpx, tgx = train.tp * train.pp, gen_tp * gen_pp
    m_bytes = model.weight_bytes(hw.param_bytes)
    vol = m_bytes * (tpx - tgx) / (tgx * tpx) if tgx < tpx else 0.0
    secs = vol / (link_bw(hw, tpx) * hw.efficiency.comm) if vol > 0 else 0.0
    if train.zero == 3 and train.dp > 1:
        secs += allgather_seconds(hw, m_bytes / tpx, train.dp, link_bw(hw, tpx * train.dp))
    return secs


def broadcast_seconds(model: ModelSpec, hw: HardwareSpec, gen_gpus: int, replicas: int, train_gpus: int) -> float:
    """New weights from the trainer's devices to a separate rollout pool over the network.

    Every rollout device receives its 1/gen_gpus shard; senders share the load, so the
    time is the larger of the per-receiver and the per-sender network time.
    """
    m_bytes = model.weight_bytes(hw.param_bytes)
    bw = hw.inter_bw * hw.efficiency.comm
    receive = m_bytes / gen_gpus / bw
    send = m_bytes * replicas / max(train_gpus, 1) / bw
    return max(receive, send) + hw.efficiency.collective_latency_s
