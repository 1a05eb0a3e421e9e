"""Runs one device's action list of a `Plan` over torch.distributed point-to-point.

Why not `torch.distributed.pipelining`: its schedules, `_PipelineScheduleRuntime`
included, drive *one* pipeline: one chain of stage indices with one input, one loss and
one `step()` that runs the whole action list of that chain. RLHFuse's fused schedule
interleaves the actions of two models with their own inputs and losses, flowing in
opposite directions over the same ranks; two schedule objects cannot interleave their
actions inside a step, and one schedule cannot hold two chains. So this executor is ours,
in the same shape: forward/backward actions, activations and gradients sent point-to-point.

Every process holds every micro-batch's inputs (token ids, masks, loss fields: small), so
only activations (forward) and their gradients (backward) travel. Messages between two
ranks are received in the order the sender sends them: a rank that needs a message
posts receives for every earlier message on that channel first. That keeps NCCL (which
matches point-to-point messages in order) and gloo correct for any valid plan, and it
never blocks: sends are asynchronous and receives are only waited on when needed.
Every wait has a timeout whose error names the role, stage and rank.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from fuseflow.schedule.pipeline.actions import Plan, Task
from fuseflow.schedule.pipeline.stage import StageModule, tied_name

ROLES = {"A": "actor", "B": "critic"}

# loss_fn(stage output, micro-batch fields) -> scalar share of the whole batch's loss
LossFn = Callable[[Tensor, Mapping[str, Tensor]], Tensor]


class StageError(RuntimeError):
    """A stage could not finish its step (a peer died or a wait timed out); one line."""


@dataclass
class ModelStage:
    """What one process holds of one model: its stage, the micro-batches, loss and optimizer.

    `micro_batches[k]` holds `input_ids` (B_k, T_k), `attention_mask` (B_k, T_k),
    `position_ids` (B_k, T_k) and whatever fields `loss_fn` reads.
    """

    module: StageModule
    stage: int
    n_stages: int
    micro_batches: list[Mapping[str, Tensor]]
    loss_fn: LossFn
    optimizer: torch.optim.Optimizer
    grad_clip: float | None = None
    role: str = "actor"
    losses: list[float] = field(default_factory=list)  # per micro-batch loss share (last stage only)
    grad_norm: float = 0.0  # the global gradient norm of the last optimizer step (before clipping)

    def hidden_shape(self, mb: int) -> tuple[int, int, int]:
        """Shape (B, T, hidden) of micro-batch `mb`'s activations between stages (and of their
        gradients): the shape of the buffers that receive them."""
        b, t = self.micro_batches[mb]["input_ids"].shape
        return b, t, self.module.config.hidden_size

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of this stage's parameters; receive buffers and the tied embedding's gradient all-reduce are
        allocated in it (the gradient norm's all-reduce is float64)."""
        return next(self.module.parameters()).dtype

    @property
    def device(self) -> torch.device:
        """Device that holds this stage's parameters; receive and all-reduce buffers are allocated on it."""
        return next(self.module.parameters()).device


@dataclass
class StepTimes:
    """Wall times of one step on one rank, seconds from a common barrier."""

    actions: list[tuple[str, float, float]]  # (label, start, end) in run order
    compute_end: float  # when the last action ended
    end: float  # after the optimizer step


class _Channels:
    """Point-to-point messages of one rank, received in each sender's order (module docstring)."""

    def __init__(self, plan: Plan, rank: int, stages: Mapping[str, ModelStage], timeout: float):
        self.plan, self.rank, self.stages, self.timeout = plan, rank, stages, timeout
        # Per source rank, the actions there whose message comes here, in that rank's order.
        self.incoming: dict[int, list[Task]] = {}
        for src, seq in enumerate(plan.order):
            if src != rank:
                self.incoming[src] = [t for t in seq if self.destination(t) == rank]
        self.posted: dict[Task, tuple[Tensor, dist.Work]] = {}
        self.next_post = {src: 0 for src in self.incoming}
        self.sends: list[tuple[Tensor, dist.Work]] = []

    def destination(self, t: Task) -> int | None:
        """Where the output of action `t` goes: the next stage (forward) or the previous (backward)."""
        if t.backward:
            return self.plan.device(t.model, t.stage - 1) if t.stage > 0 else None
        last = self.plan.n_devices - 1
        return self.plan.device(t.model, t.stage + 1) if t.stage < last else None

    def send(self, t: Task, tensor: Tensor) -> None:
        dst = self.destination(t)
        if dst is not None:
            tensor = tensor.detach().contiguous()
            self.sends.append((tensor, dist.isend(tensor, dst)))

    def recv(self, t: Task, waiter: str) -> Tensor:
        """The message that action `t` (on another rank) sent here; `waiter` names who waits."""
        src = self.plan.device(t.model, t.stage)
        queue = self.incoming[src]
        while t not in self.posted:
            m = queue[self.next_post[src]]
            st = self.stages[m.model]
            buf = torch.empty(st.hidden_shape(m.micro_batch), dtype=st.dtype, device=st.device)
            self.posted[m] = (buf, dist.irecv(buf, src))
            self.next_post[src] += 1
        buf, work = self.posted.pop(t)
        self._wait(work, f"{waiter} waiting for {t.label()} from rank {src}")
        return buf

    def flush(self, who: str) -> None:
        for _, work in self.sends:
            self._wait(work, f"{who} waiting for its sends to complete")
        self.sends.clear()

    def _wait(self, work: dist.Work, what: str) -> None:
        try:
            ok = work.wait(timeout=timedelta(seconds=self.timeout))
        except Exception as err:  # gloo raises on a closed connection or a timeout
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise StageError(f"{what}: {first}") from None
        if ok is False:
            raise StageError(f"{what}: timed out after {self.timeout:g} s")


def _who(st: ModelStage, rank: int) -> str:
    return f"{st.role} stage {st.stage} (rank {rank})"


def run_step(
    plan: Plan,
    rank: int,
    stages: Mapping[str, ModelStage],
    timeout: float = 60.0,
    on_action: Callable[[int], None] | None = None,
) -> StepTimes:
    """Run this rank's actions of `plan`, then every model's optimizer step.

    Gradients accumulate over micro-batches in `.grad` (each loss is already the
    micro-batch's share of the whole batch's loss, so the sum is exact). Before stepping,
    tied embedding copies sum their gradients and the gradient norm is reduced over all
    ranks, so clipping matches a single-process `clip_grad_norm_`. Collective: every rank
    of the default group calls it with the same plan. `on_action(i)` is called before
    action i (and with -1 at the end), so a supervisor can tell what a dead rank was doing.
    """
    ch = _Channels(plan, rank, stages, timeout)
    held: dict[Task, tuple[Tensor | None, Tensor]] = {}  # forward's (input, output) until its backward
    for st in stages.values():
        st.losses = [0.0] * len(st.micro_batches)
    dist.barrier()
    t0 = time.perf_counter()
    log = []
    for i, t in enumerate(plan.order[rank]):
        if on_action:
            on_action(i)
        st = stages[t.model]
        mb = st.micro_batches[t.micro_batch]
        who = _who(st, rank)
        a = time.perf_counter() - t0
        if not t.backward:
            if st.stage == 0:
                x = mb["input_ids"]
            else:
                x = ch.recv(t._replace(stage=t.stage - 1), who).requires_grad_(True)
            out = st.module(x, mb["attention_mask"], mb["position_ids"])
            if st.stage == st.n_stages - 1:
                out = st.loss_fn(out, mb)
                st.losses[t.micro_batch] = float(out.detach())
            else:
                ch.send(t, out)
            held[t] = (x if st.stage > 0 else None, out)
        else:
            x, out = held.pop(t._replace(backward=False))
            if st.stage == st.n_stages - 1:
                out.backward()
            else:
                out.backward(ch.recv(t._replace(stage=t.stage + 1), who))
            if x is not None:
                ch.send(t, x.grad)
        log.append((t.label(), a, time.perf_counter() - t0))
    compute_end = time.perf_counter() - t0
    if on_action:
        on_action(-1)
    ch.flush(f"rank {rank}")
    for model in sorted(stages):
        stages[model].grad_norm = optimizer_step(stages[model])
    return StepTimes(log, compute_end, time.perf_counter() - t0)


def optimizer_step(st: ModelStage) -> float:
    """Sum tied-embedding gradients, clip by the global norm, step, zero: returns the norm.

    Collective over the default group: every rank holds one stage of each model it
    steps. A non-finite norm skips the step on every rank alike (as `clipped_step`).
    """
    params = [p for p in st.module.parameters() if p.grad is not None]
    tied = tied_name(st.module)
    tied_param = dict(st.module.named_parameters()).get(tied) if tied else None
    # Everyone joins the tied all-reduce (zeros where no copy lives) so calls stay matched.
    if st.module.config.tie_word_embeddings and not st.module.is_value:
        shape = (st.module.config.vocab_size, st.module.config.hidden_size)
        g = tied_param.grad if tied_param is not None and tied_param.grad is not None else None
        buf = g if g is not None else torch.zeros(shape, dtype=st.dtype, device=st.device)
        dist.all_reduce(buf)
        if tied_param is not None and g is None:
            tied_param.grad = buf
            params.append(tied_param)
    # Count the tied matrix once (on the first stage) in the global norm.
    counted = [p for p in params if not (tied_param is not None and p is tied_param and st.module.last
                                         and not st.module.first)]
    sq = torch.zeros((), dtype=torch.float64, device=st.device)
    for p in counted:
        sq += p.grad.detach().double().pow(2).sum()
    dist.all_reduce(sq)
    norm = math.sqrt(float(sq))
    if not math.isfinite(norm):
        st.optimizer.zero_grad(set_to_none=True)
        return norm
    if st.grad_clip is not None:
        coef = min(1.0, st.grad_clip / (norm + 1e-6))
        for p in params:
            p.grad.mul_(coef)
    st.optimizer.step()
    st.optimizer.zero_grad(set_to_none=True)
    return norm
