"""Pipeline-parallel PPO training of fuseflow's actor and critic: the glue between the
executor, the stage processes and fuseflow's losses.

`PipelineTrainer` starts one process per stage; each builds the whole models from their
seed, keeps its stage of the actor (model "A", stage = rank) and of the critic (model
"B", stage = p - 1 - rank: the opposite direction) and an AdamW per stage. `step(plan,
micro_batches)` runs one optimizer step with any plan: 1F1B, serial 1F1B or a solved
fused schedule. The losses are the ones the role workers use (`response_logprobs` +
the registered PPO policy loss; `value_loss`), normalised by the whole batch's token and
sequence counts so accumulation over micro-batches is exact. `reference_step` is the
same step in one process, the yardstick of the correctness tests.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Literal

import torch
from torch import Tensor

from fuseflow.algorithms import ppo_policy_loss, value_loss
from fuseflow.algorithms.aggregation import aggregation_counts
from fuseflow.data.batch import Batch, trim_padding
from fuseflow.models.config import ModelConfig
from fuseflow.models.llama import CausalLM
from fuseflow.models.value import ValueModel
from fuseflow.schedule.pipeline.actions import Plan, validate
from fuseflow.schedule.pipeline.executor import ROLES, LossFn, ModelStage, StepTimes, run_step
from fuseflow.schedule.pipeline.procs import Context, StageProcesses
from fuseflow.schedule.pipeline.stage import build_stage
from fuseflow.workers.common import position_ids, response_logprobs, response_slice
from fuseflow.workers.optim import adamw, clipped_step

MicroBatch = dict[str, Tensor]
# A model's loss for one step: micro-batches -> LossFn (a picklable callable; it may keep `records`,
# per-micro-batch metrics the last stage hands back with the step's results).
LossFactory = Callable[[Sequence[Mapping[str, Tensor]]], LossFn]


@dataclass(frozen=True)
class ModelSpec:
    """One trained model: `kind` "actor" (CausalLM, PPO policy loss) or "critic"
    (ValueModel, clipped value loss), built from `config` and `seed`; AdamW settings as
    the role workers'; `split` = layers per stage (None: balanced by parameter count)."""

    kind: Literal["actor", "critic"]
    config: ModelConfig
    seed: int = 0
    lr: float = 1e-3
    weight_decay: float = 0.0
    grad_clip: float | None = 1.0
    clip: float = 0.2  # PPO ratio clip (actor) or value clip (critic)
    temperature: float = 1.0
    split: tuple[int, ...] | None = None

    def build(self) -> CausalLM | ValueModel:
        """A fresh whole model from `config` and `seed` (CausalLM for the actor, ValueModel for the
        critic), so every process that builds it gets the same weights."""
        cls = CausalLM if self.kind == "actor" else ValueModel
        return cls.from_config(self.config, seed=self.seed)

    def optimizer(self, params) -> torch.optim.Optimizer:
        """AdamW over `params` with this spec's `lr` and `weight_decay` (the role workers' `adamw`)."""
        return adamw(params, self.lr, self.weight_decay)


def split_micro_batches(batch: Batch, rows: int) -> list[MicroBatch]:
    """Consecutive `rows`-row micro-batches, padding columns trimmed, with position ids.

    The batch holds `input_ids`/`attention_mask` (B, Tp+Tr) and `response_mask` (B, Tr)
    plus the loss fields: `old_logprobs`, `advantages` (actor), `values`, `returns` (critic).
    """
    out = []
    for i in range(0, len(batch), rows):
        mb = trim_padding(batch.select(list(range(i, min(i + rows, len(batch))))))
        fields = dict(mb.tensors)
        fields["position_ids"] = position_ids(fields["attention_mask"])
        out.append(fields)
    return out


def loss_fn(spec: ModelSpec, micro_batches: Sequence[Mapping[str, Tensor]]) -> LossFn:
    """The stage-output -> loss map of the last stage, normalised over all micro-batches."""
    n_tok = sum(aggregation_counts(mb["response_mask"])[0] for mb in micro_batches)
    n_seq = sum(aggregation_counts(mb["response_mask"])[1] for mb in micro_batches)
    if spec.kind == "actor":
        def actor(logits: Tensor, mb: Mapping[str, Tensor]) -> Tensor:
            # response_logprobs takes a model; hand it the logits this stage already computed.
            logp = response_logprobs(lambda *a, **k: SimpleNamespace(logits=logits), mb, spec.temperature)
            loss, _ = ppo_policy_loss(logp, mb["old_logprobs"], mb["advantages"], mb["response_mask"],
                                      spec.clip, spec.clip, agg="token-mean", num_global_tokens=n_tok,
                                      num_global_seqs=n_seq)
            return loss
        return actor

    def critic(values: Tensor, mb: Mapping[str, Tensor]) -> Tensor:
        v = values[:, response_slice(mb)]  # (B, Tr): value of the state before each response token
        loss, _ = value_loss(v, mb["values"], mb["returns"], mb["response_mask"], spec.clip, "token-mean",
                             n_tok, n_seq)
        return loss
    return critic


def reference_step(spec: ModelSpec, micro_batches: Sequence[MicroBatch]) -> dict[str, Tensor]:
    """One single-process optimizer step of `spec`'s model over `micro_batches`
    (accumulate, clip, AdamW, as the role workers do); returns the new state dict."""
    model = spec.build()
    opt = spec.optimizer(model.parameters())
    fn = loss_fn(spec, micro_batches)
    for mb in micro_batches:
        out = model(mb["input_ids"], attention_mask=mb["attention_mask"], position_ids=mb["position_ids"])
        fn(out.logits if spec.kind == "actor" else out, mb).backward()
    clipped_step(model, opt, float("inf") if spec.grad_clip is None else spec.grad_clip, spec.kind)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ------------------------------------------------------------------------------------ in the stage processes
def _device() -> torch.device:
    # NCCL ranks each take one GPU (written for NCCL, run here only on CPU with gloo).
    if torch.distributed.get_backend() == "nccl":
        dev = torch.device("cuda", torch.distributed.get_rank() % torch.cuda.device_count())
        torch.cuda.set_device(dev)
        return dev
    return torch.device("cpu")


def _setup(rank: int, world: int, specs: Mapping[str, ModelSpec]) -> dict[str, Any]:
    stages = {}
    device = _device()
    for model, spec in specs.items():
        stage = rank if model == "A" else world - 1 - rank
        module = build_stage(spec.build(), stage, world, list(spec.split) if spec.split else None).to(device)
        stages[model] = (stage, module, spec.optimizer(module.parameters()))
    return {"specs": dict(specs), "stages": stages, "world": world}


def _step(state, rank: int, ctx: Context, plan: Plan, mbs: Mapping[str, list[MicroBatch]],
          timeout: float, die_at: tuple[int, int] | None, losses: Mapping[str, LossFactory] | None = None,
          lrs: Mapping[str, float] | None = None) -> dict[str, Any]:
    world = plan.n_devices
    stages = {}
    for model in plan.micro_batches:
        stage, module, opt = state["stages"][model]
        spec = state["specs"][model]
        device = next(module.parameters()).device
        mbs = {**mbs, model: [{k: v.to(device) for k, v in mb.items()} for mb in mbs[model]]}
        fn = losses[model](mbs[model]) if losses and model in losses else loss_fn(spec, mbs[model])
        if lrs and model in lrs:
            for group in opt.param_groups:
                group["lr"] = lrs[model]
        stages[model] = ModelStage(module, stage, world, mbs[model], fn, opt, spec.grad_clip, ROLES[model])

    def on_action(i: int) -> None:
        ctx.on_action(i)
        if die_at is not None and die_at == (rank, i):  # fault injection for the tests: a real death
            os.kill(os.getpid(), signal.SIGKILL)

    times = run_step(plan, rank, stages, timeout, on_action)
    last = {m: st for m, st in stages.items() if st.stage == world - 1}
    return {"times": times, "losses": {m: st.losses for m, st in last.items()},
            "metrics": {m: list(getattr(st.loss_fn, "records", [])) for m, st in last.items()},
            "grad_norm": {m: st.grad_norm for m, st in stages.items()}}


def _load(state, rank: int, ctx: Context, model: str, weights: Mapping[str, Tensor],
          optimizer: Mapping[str, Any] | None) -> None:
    """This rank's stage of `model` takes its slice of the full `weights` and of the named optimizer
    state (`optimizer`: `param_groups` plus `state` by parameter name; None: weights only)."""
    _, module, opt = state["stages"][model]
    own = module.state_dict()
    module.load_state_dict({k: weights[k] for k in own})
    if optimizer is None:
        return
    names = [n for n, _ in module.named_parameters()]
    alias = {"lm_head.weight": "model.embed_tokens.weight"} if module.config.tie_word_embeddings else {}
    by_name = optimizer["state"]
    opt.load_state_dict({
        "state": {i: by_name[alias.get(n, n)] for i, n in enumerate(names) if alias.get(n, n) in by_name},
        "param_groups": [{**optimizer["param_groups"][0], "params": list(range(len(names)))}],
    })


def _optimizer(state, rank: int, ctx: Context, model: str) -> dict[str, Any]:
    """This rank's optimizer state of `model` by parameter name."""
    _, module, opt = state["stages"][model]
    sd = opt.state_dict()
    names = [n for n, _ in module.named_parameters()]
    return {"state": {names[i]: v for i, v in sd["state"].items()}, "param_groups": sd["param_groups"]}


def _reset(state, rank: int, ctx: Context) -> None:
    state.update(_setup(rank, state["world"], state["specs"]))


def _state(state, rank: int, ctx: Context) -> dict[str, dict[str, Tensor]]:
    return {m: {k: v.detach().cpu().clone() for k, v in mod.state_dict().items()}
            for m, (_, mod, _) in state["stages"].items()}


class PipelineTrainer:
    """`n_stages` processes training the models of `specs` ({"A": actor, "B": critic}, or one).

    Example:
        with PipelineTrainer({"A": spec}, 2) as pt:
            pt.step(one_f_one_b_plan(2, {"A": 4}), {"A": split_micro_batches(batch, 2)})
    """

    def __init__(self, specs: Mapping[str, ModelSpec], n_stages: int, backend: str = "gloo", threads: int = 1,
                 timeout: float = 60.0):
        self.specs, self.n = dict(specs), n_stages
        self.plan: Plan | None = None
        self.timeout = timeout
        self.procs = StageProcesses(n_stages, _setup, (self.specs,), backend, threads, timeout, self._describe)

    def __enter__(self) -> PipelineTrainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _describe(self, rank: int, action: int) -> str:
        held = ", ".join(f"{ROLES[m]} stage {rank if m == 'A' else self.n - 1 - rank}" for m in sorted(self.specs))
        if self.plan is not None and 0 <= action < len(self.plan.order[rank]):
            held += f", at action {self.plan.order[rank][action].label()}"
        return held

    def step(self, plan: Plan, micro_batches: Mapping[str, list[MicroBatch]],
             die_at: tuple[int, int] | None = None, losses: Mapping[str, LossFactory] | None = None,
             lrs: Mapping[str, float] | None = None) -> list[dict[str, Any]]:
        """One optimizer step of every model in `plan`; per rank its `StepTimes`, the losses
        (and loss `metrics` records) of the stages it ends and each model's `grad_norm`.
        `losses` replaces a model's default loss (`loss_fn`), `lrs` sets its learning rate.
        Raises InvalidPlan before running a bad plan and StageFailure (one line) if a
        process dies or a wait times out."""
        validate(plan)
        if plan.n_devices != self.n:
            raise ValueError(f"plan has {plan.n_devices} devices; this trainer runs {self.n} stages")
        for model, m in plan.micro_batches.items():
            if model not in self.specs or len(micro_batches.get(model, ())) != m:
                raise ValueError(f"plan wants {m} micro-batches of model {model}; "
                                 f"got {len(micro_batches.get(model, ()))}")
        self.plan = plan
        return self.procs.call(_step, (plan, dict(micro_batches), self.timeout, die_at, losses, lrs))

    def reset(self) -> None:
        """Rebuild every stage from its model's seed, with fresh optimizers."""
        self.procs.call(_reset)

    def load(self, model: str, weights: Mapping[str, Tensor], optimizer: Mapping[str, Any] | None = None) -> None:
        """Every stage of `model` takes its slice of a full state dict and of a named optimizer state."""
        self.procs.call(_load, (model, dict(weights), optimizer))

    def optimizer_state(self, model: str) -> dict[str, Any]:
        """`model`'s optimizer state by parameter name, gathered from its stages (tied copy once)."""
        out: dict[str, Any] = {"state": {}, "param_groups": None}
        for per_rank in self.procs.call(_optimizer, (model,)):
            for name, v in per_rank["state"].items():
                out["state"].setdefault("model.embed_tokens.weight" if name == "lm_head.weight" and
                                        self.specs[model].config.tie_word_embeddings else name, v)
            out["param_groups"] = out["param_groups"] or per_rank["param_groups"]
        return out

    def state_dicts(self) -> dict[str, dict[str, Tensor]]:
        """Each model's full state dict, gathered from its stages (tied copies included)."""
        out: dict[str, dict[str, Tensor]] = {}
        for per_rank in self.procs.call(_state):
            for model, sd in per_rank.items():
                out.setdefault(model, {}).update(sd)
        return out

    def close(self) -> None:
        """Stop the stage processes and remove their store directory (`StageProcesses.close`)."""
        self.procs.close()


def makespan(results: Sequence[Mapping[str, Any]]) -> float:
    """Measured makespan of a step: the latest rank's last action end (common barrier start)."""
    return max(r["times"].compute_end for r in results)


__all__ = ["ModelSpec", "PipelineTrainer", "StepTimes", "makespan", "reference_step", "split_micro_batches"]
