"""The executor with stand-in stages that sleep for measured action times: what fused
scheduling gains when the stages do not share CPU cores (as on GPUs, one per stage).

On a machine whose 2 stage processes get less than 2 cores between them (this shared VM:
`parallel_capacity` 1.0 to 1.9), a stage's idle bubble hands its CPU to the other stage,
so serial 1F1B loses little and fusion has little to fill. A sleeping stage occupies no
core: the plan, the dependencies, the point-to-point messages and the executor's own
overhead are all real, only the compute is replaced by its measured duration. Its numbers
are reported under their own `sleep_*` names, never as the training benchmark's.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from fuseflow.models.config import ModelConfig
from fuseflow.schedule.pipeline.actions import Plan
from fuseflow.schedule.pipeline.executor import ModelStage, run_step
from fuseflow.schedule.pipeline.procs import Context, StageProcesses

Times = Mapping[tuple[str, int, bool], float]


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, fwd: float, bwd: float) -> Tensor:
        time.sleep(fwd)
        ctx.bwd = bwd
        return x.clone()

    @staticmethod
    def backward(ctx, grad: Tensor):
        time.sleep(ctx.bwd)
        return grad, None, None


class SleepStage(nn.Module):
    """A stage whose forward sleeps `fwd` s and backward `bwd` s; shapes as a real stage's."""

    def __init__(self, config: ModelConfig, first: bool, last: bool, fwd: float, bwd: float):
        super().__init__()
        self.config, self.first, self.last, self.fwd, self.bwd = config, first, last, fwd, bwd
        self.is_value = True  # no tied embedding to reduce
        self.w = nn.Parameter(torch.ones(()))

    def forward(self, x: Tensor, attention_mask: Tensor, position_ids: Tensor) -> Tensor:
        if self.first:
            x = torch.zeros(*x.shape, self.config.hidden_size)  # (B, T, hidden)
        return _Sleep.apply(x * self.w, self.fwd, self.bwd)


def _setup(rank: int, world: int, config: ModelConfig, times: Times) -> dict[str, Any]:
    stages = {}
    for model in ("A", "B"):
        s = rank if model == "A" else world - 1 - rank
        mod = SleepStage(config, s == 0, s == world - 1, times[(model, s, False)], times[(model, s, True)])
        stages[model] = (s, mod, torch.optim.SGD(mod.parameters(), lr=0.0))
    return stages


def _step(stages, rank: int, ctx: Context, plan: Plan, mbs) -> float:
    run = {m: ModelStage(mod, s, plan.n_devices, mbs[m], lambda out, mb: out.mean(), opt)
           for m, (s, mod, opt) in stages.items()}
    return run_step(plan, rank, run, 60.0, ctx.on_action).compute_end


def run(config: ModelConfig, times: Times, plans: Mapping[str, Plan], mbs, repeats: int = 3) -> dict[str, Any]:
    """Measured makespans of `plans` (alternating) with sleeping stages; medians."""
    out: dict[str, list[float]] = {k: [] for k in plans}
    with StageProcesses(2, _setup, (config, dict(times))) as procs:
        for _ in range(repeats):
            for name, plan in plans.items():
                out[name].append(max(procs.call(_step, (plan, mbs))))
    return {"sleep_makespan_s": out, "sleep_median_makespan_s": {k: statistics.median(v) for k, v in out.items()}}
