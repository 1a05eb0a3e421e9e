"""Pipeline-parallel training of a run's roles (`actor.pp` / `critic.pp` > 1).

`PipelineRoles` trains the actor (and PPO's critic) of an `RLTrainer` on `actor.pp` stage
processes (`PipelineTrainer`: spawned gloo processes on this machine). Per optimizer step
it cuts each model's mini-batch into the same micro-batches the role worker would
(`train_microbatches`), runs them with a plan (PPO: the solver's fused actor/critic schedule
for the step's micro-batch counts, cached per count pair; GRPO and the other critic-free
algorithms: 1F1B of the actor) and the losses of the role workers (`actor_loss`,
`value_loss`), normalised by the mini-batch's counts, so accumulation is exact.

The role workers stay the owners of the run's models: the stages start from their weights and
optimizer state, and after each update the trained weights and optimizer state go back into
them, so generation, inference, weight sync and checkpoints work as with `pp=1`. A stage
process that dies raises `WorkerFailure` naming the role, stage and rank (one line).

On Ray the stage processes would be one pool's workers (one per stage, a GPU each, NCCL
point-to-point) with the weights handed back through the pool's rank 0; not wired: the config
accepts `pp > 1` with `backend=local` only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from fuseflow.controller.group import Done, Future, WorkerFailure, WorkerGroup
from fuseflow.data.batch import Batch
from fuseflow.models.config import ModelConfig
from fuseflow.schedule.pipeline.actions import Plan, one_f_one_b_plan, solved_plan
from fuseflow.schedule.pipeline.generate import PipelinedRollout
from fuseflow.schedule.pipeline.losses import ActorLoss, CriticLoss
from fuseflow.schedule.pipeline.problem import PipelineInstance
from fuseflow.schedule.pipeline.procs import StageFailure
from fuseflow.schedule.pipeline.train import ModelSpec, PipelineTrainer
from fuseflow.workers.common import (
    mean_metrics,
    position_ids,
    train_microbatches,
)
from fuseflow.workers.losses import minibatches


def _cpu(tree: Any) -> Any:
    """Tensors of a nested dict/list moved to the CPU (the stage processes run on gloo here)."""
    if isinstance(tree, Tensor):
        return tree.detach().cpu()
    if isinstance(tree, dict):
        return {k: _cpu(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_cpu(v) for v in tree]
    return tree


def to_named(opt_state: Mapping[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """A single-process optimizer state dict (one param group, parameters in `names` order) keyed by name."""
    return {"state": {names[i]: v for i, v in opt_state["state"].items()},
            "param_groups": [dict(opt_state["param_groups"][0])]}


def from_named(named: Mapping[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """The inverse of `to_named`: the single-process layout of a named optimizer state."""
    return {"state": {i: named["state"][n] for i, n in enumerate(names) if n in named["state"]},
            "param_groups": [{**named["param_groups"][0], "params": list(range(len(names)))}]}


def stage_cost(config: ModelConfig, kind: str, split: Sequence[int] | None, p: int) -> int:
    """Relative time of one forward on the slowest stage of a model: its layers' and head's matmul
    parameters (embedding lookups cost ~nothing), on the split the stages use (given, or balanced
    by parameter count as `build_stage` does). Used to weigh the solver's instance only."""
    from fuseflow.models.llama import CausalLM
    from fuseflow.models.value import ValueModel
    from fuseflow.schedule.pipeline.stage import balanced_split

    with torch.device("meta"):  # shapes only
        model = (CausalLM if kind == "actor" else ValueModel)(config)
    counts = list(split) if split else balanced_split(model, p)
    per_layer = sum(q.numel() for q in model.model.layers[0].parameters())
    head = config.hidden_size * (config.vocab_size if kind == "actor" else 1)
    return max(n * per_layer + (head if i == p - 1 else 0) for i, n in enumerate(counts))


@dataclass
class PipelineRoles:
    """The actor (and critic) of a run trained on `cfg.actor.pp` stage processes (module docstring).

    `updates(...)` gives the trainer's step its update calls: one, "pipeline_update", that
    trains every model of the step; its result maps the model's metric names as the role
    workers' `update` would (`actor/...`, `critic/...`), plus `pipeline/...` timings.
    """

    cfg: Any
    actor: WorkerGroup
    critic: WorkerGroup | None
    die_at: tuple[int, int] | None = None  # tests: SIGKILL a rank at this action of the next step
    plans: dict[tuple[int, ...], Plan] = field(default_factory=dict)

    def __post_init__(self) -> None:
        cfg, p = self.cfg, self.cfg.actor.pp
        self.groups = {"A": self.actor, **({"B": self.critic} if self.critic is not None else {})}
        config = ModelConfig.from_hf_dict(self.actor.model_config())
        split = tuple(cfg.actor.pp_split) if cfg.actor.pp_split else None
        layers = config.num_hidden_layers
        if p > layers:
            raise ValueError(f"actor.pp={p}: the model has {layers} decoder layers and every stage needs one; "
                             f"use actor.pp<={layers}")
        if split and sum(split) != layers:
            raise ValueError(f"actor.pp_split={list(split)} sums to {sum(split)}; the model has {layers} decoder "
                             "layers")
        t = cfg.trainer
        specs = {"A": ModelSpec("actor", config, lr=t.lr, weight_decay=t.weight_decay, grad_clip=t.grad_clip,
                                split=split)}
        if self.critic is not None:
            specs["B"] = ModelSpec("critic", config, lr=t.critic_lr, weight_decay=t.weight_decay,
                                   grad_clip=t.grad_clip, split=split)
        self.cost = {m: stage_cost(config, s.kind, split, p) for m, s in specs.items()}
        self.trainer = PipelineTrainer(specs, p, threads=1, timeout=120.0)
        self.names: dict[str, list[str]] = {}  # each model's trainable parameters in its optimizer's order
        try:
            for model, group in self.groups.items():
                state = group.trained_state()
                self.names[model] = state["names"]
                self.trainer.load(model, _cpu(state["weights"]), _cpu(to_named(state["optimizer"], state["names"])))
        except BaseException:
            self.trainer.close()
            raise

    def plan(self, counts: Mapping[str, int]) -> Plan:
        """The step's plan for these micro-batch counts: fused (solved, cached per counts) or 1F1B."""
        key = tuple(counts[m] for m in sorted(counts))
        if key not in self.plans:
            p, s = self.cfg.actor.pp, self.cfg.schedule
            if "B" not in counts:
                self.plans[key] = one_f_one_b_plan(p, counts)
            else:
                unit = min(self.cost.values()) / 10
                inst = PipelineInstance(p, p, counts["A"], counts["B"], max(1, round(self.cost["A"] / unit)),
                                        max(1, round(self.cost["B"] / unit)), 1.0, 1.0)
                self.plans[key] = solved_plan(inst, s.pipeline_solver_seconds, s.pipeline_memory_cap)
        return self.plans[key]

    def updates(self, batch: Batch, actor_lr: float, critic_lr: float, kl_coef: float,
                actor_seed: int, critic_seed: int) -> dict[str, Any]:
        """The step's update calls for `Strategy.train`: {"pipeline_update": starter of a Future}."""
        def start() -> Future:
            return Done(self.update(batch, actor_lr, critic_lr, kl_coef, actor_seed, critic_seed))
        return {"pipeline_update": start}

    def _micro_batches(self, batch: Batch, idx: Tensor) -> list[dict[str, Tensor]]:
        t = self.cfg.trainer
        out = []
        for mb in train_microbatches(None, batch.select(idx), self.cfg.schedule.token_budget, t.micro_batch_size):
            fields = dict(mb.tensors)
            fields["position_ids"] = position_ids(fields["attention_mask"])
            out.append(fields)
        return out

    def update(self, batch: Batch, actor_lr: float, critic_lr: float, kl_coef: float, actor_seed: int,
               critic_seed: int) -> dict[str, float]:
        """Epochs of mini-batch steps of every model on the stages; weights and optimizer state go back
        to the role workers. Raises WorkerFailure (one line) if a stage process dies."""
        try:
            return self._update(batch, actor_lr, critic_lr, kl_coef, actor_seed, critic_seed)
        except StageFailure as err:
            raise WorkerFailure("actor", err.rank if err.rank is not None else 0, "pipeline_update",
                                str(err)) from None

    def _update(self, batch: Batch, actor_lr: float, critic_lr: float, kl_coef: float, actor_seed: int,
                critic_seed: int) -> dict[str, float]:
        cfg, t, n = self.cfg, self.cfg.trainer, len(batch)
        losses = {"A": ActorLoss(cfg.algorithm, kl_coef, cfg.rollout.temperature, cfg.model.max_response_len)}
        lrs = {"A": actor_lr, "B": critic_lr}
        order = {"A": minibatches(n, t.mini_batch_size, t.epochs, actor_seed)}
        if "B" in self.groups:
            losses["B"] = CriticLoss(cfg.algorithm, cfg.model.max_response_len)
            order["B"] = minibatches(n, t.mini_batch_size, t.epochs, critic_seed)
        records, makespans = [], []
        for i in range(len(order["A"])):
            mbs = {m: self._micro_batches(batch, order[m][i]) for m in order}
            plan = self.plan({m: len(v) for m, v in mbs.items()})
            out = self.trainer.step(plan, mbs, die_at=self.die_at, losses=losses, lrs=lrs)
            rec: dict[str, float] = {}
            for r in out:
                for recs in r["metrics"].values():
                    for m in recs:
                        for k, v in m.items():
                            rec[k] = rec.get(k, 0.0) + v
            for model, norm in out[0]["grad_norm"].items():
                rec[f"{'actor' if model == 'A' else 'critic'}/grad_norm"] = norm
            records.append(rec)
            makespans.append(max(r["times"].end for r in out))
        weights = self.trainer.state_dicts()
        for model, group in self.groups.items():
            group.load_trained(weights[model], from_named(self.trainer.optimizer_state(model), self.names[model]))
        return mean_metrics(records) | {"pipeline/step_seconds": sum(makespans),
                                        "pipeline/optimizer_steps": float(len(makespans))}

    def close(self) -> None:
        """Stop the stage processes (`PipelineTrainer.close`); the role workers keep the weights and
        optimizer state of the last update."""
        self.trainer.close()


def pipeline_roles(cfg: Any, actor: WorkerGroup, critics: Sequence[WorkerGroup]) -> PipelineRoles | None:
    """The run's pipeline-parallel training, or None when `actor.pp` is 1 (the role workers train)."""
    if cfg.actor.pp == 1:
        return None
    return PipelineRoles(cfg, actor, critics[0] if critics else None)


def pipelined_rollout(cfg: Any, actor: WorkerGroup, pad_id: int) -> PipelinedRollout | None:
    """`rollout.pipeline_stages=2`: the actor generates on 2 stage processes from now on (its weights
    pushed there at each weight sync); None when it is 1 (the configured rollout backend generates)."""
    if cfg.rollout.pipeline_stages == 1:
        return None
    rollout = PipelinedRollout(actor.rollout_model(), pad_id)
    actor.use_rollout(rollout)
    return rollout


__all__ = ["PipelineRoles", "pipelined_rollout", "from_named", "pipeline_roles", "to_named"]
