"""Placements: which roles share which devices, with which layouts, and what that costs.

HybridFlow's plan space: the RL roles (actor, critic, reference, reward) are split
into colocated sets (a set partition), each set gets a number of devices, and each
role gets a parallel layout on its set. Colocated roles run one after another on
their set; different sets run at the same time. Generation runs on the actor's set
(switching the actor to a generation layout) unless the plan gives the rollout a set
of its own (Pipe-RLHF / async style), in which case new weights are sent over the network.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

from .costmodel import (
    INFER_MICRO_BATCH_TOKENS,
    TRAIN_MICRO_BATCH_TOKENS,
    DecodeModel,
    Layout,
    StageCost,
    broadcast_seconds,
    infer_activation_bytes,
    infer_cost,
    model_state_bytes,
    reshard_seconds,
    train_activation_bytes,
    train_cost,
)  # fmt: skip
from .generation import Seq, kv_capacity_seqs, round_robin, simulate_generation
from .hardware import HardwareSpec
from .modelspec import ModelSpec
from .workload import StepBatch, Workload

ROLES = ("actor", "critic", "ref", "reward")
INFER_STAGE = {"actor": "old_logprob", "critic": "values", "ref": "reference", "reward": "reward"}
TRAIN_STAGE = {"actor": "actor_update", "critic": "critic_update"}


# ------------------------------------------------------------------------ enumeration
def set_partitions(items: tuple) -> Iterator[list[tuple]]:
    """All ways to split `items` into non-empty unordered blocks (Bell(n) of them).

    >>> sum(1 for _ in set_partitions(("a", "b", "c", "d")))
    15
    """
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in set_partitions(rest):
        yield [(first,), *part]
        for i in range(len(part)):
            yield [*part[:i], (first, *part[i]), *part[i + 1 :]]


def compositions(total: int, k: int) -> Iterator[tuple[int, ...]]:
    """Ordered ways to write `total` as k positive integers (C(total-1, k-1) of them)."""
    for cuts in itertools.combinations(range(1, total), k - 1):
        bounds = (0, *cuts, total)
        yield tuple(bounds[i + 1] - bounds[i] for i in range(k))


def candidate_layouts(model: ModelSpec, hw: HardwareSpec, gpus: int, trainable: bool) -> list[Layout]:
    """Layouts of `model` on exactly `gpus` devices: TP inside a node, PP dividing the layers."""
    out = []
    for tp in (1, 2, 4, 8):
        if tp > hw.gpus_per_node or model.heads % tp:
            continue
        for pp in (1, 2, 4, 8, 16):
            if pp > model.layers or gpus % (tp * pp):
                continue
            dp = gpus // (tp * pp)
            for zero in (1, 3) if dp > 1 else (1,):
                for rc in (False, True) if trainable else (False,):
                    out.append(Layout(tp, pp, dp, zero, rc))
    return out


def gen_layouts(model: ModelSpec, hw: HardwareSpec, gpus: int) -> list[tuple[int, int]]:
    """(tp, pp) of rollout replicas that tile `gpus` devices."""
    return [(tp, pp) for tp in (1, 2, 4, 8) for pp in (1, 2, 4)
            if tp <= hw.gpus_per_node and model.heads % tp == 0 and gpus % (tp * pp) == 0]  # fmt: skip


# ------------------------------------------------------------------------ problem and plan
@dataclass(frozen=True)
class Problem:
    """What to run where: models per role, device type and count, and the workload."""

    hw: HardwareSpec
    actor: ModelSpec
    ref: ModelSpec
    critic: ModelSpec | None
    reward: ModelSpec | None
    workload: Workload
    gpus: int

    @classmethod
    def build(cls, actor: ModelSpec, hw: HardwareSpec, gpus: int, workload: Workload,
              critic: ModelSpec | None = None, reward: ModelSpec | None = None) -> Problem:  # fmt: skip
        """Critic and reward models are value-headed trunks (default: the critic's or actor's size)."""
        if gpus <= 0:
            raise ValueError(f"gpus={gpus}: must be > 0")
        crit = (critic or actor).as_value_model() if workload.has_critic else None
        rew = (reward or critic or actor).as_value_model() if workload.reward_model else None
        return cls(hw, actor, actor, crit, rew, workload, gpus)

    @property
    def roles(self) -> tuple[str, ...]:
        """Roles that have a model, in `ROLES` order: actor and ref always, critic and reward if present."""
        return tuple(r for r in ROLES if self.model(r) is not None)

    def model(self, role: str) -> ModelSpec | None:
        """Model of `role` ("rollout" runs the actor); None for a critic or reward model the workload
        does not have. Raises KeyError for an unknown role."""
        return {"actor": self.actor, "rollout": self.actor, "ref": self.ref, "critic": self.critic,
                "reward": self.reward}[role]  # fmt: skip

    @staticmethod
    def trainable(role: str) -> bool:
        """Whether `role` is trained (actor, critic) rather than only run forward."""
        return role in TRAIN_STAGE

    def runs_inference(self, role: str) -> bool:
        """Whether `role` has a forward pass in the inference stage (the actor not when
        the rollout's own log-probs are kept, `Workload.rollout_logprobs`)."""
        if role == "actor" and self.workload.rollout_logprobs:
            return False
        return role in INFER_STAGE and role in self.roles


@dataclass(frozen=True)
class DeviceSet:
    """Devices shared by colocated roles ('rollout' alone marks a separate generation pool)."""

    roles: tuple[str, ...]
    gpus: int

    @property
    def name(self) -> str:
        """The set's roles joined by '+', e.g. `actor+ref`: its key for device pools and reports."""
        return "+".join(self.roles)


@dataclass(frozen=True)
class Plan:
    """A placement with a layout per role and the rollout replicas' (tp, pp)."""

    sets: tuple[DeviceSet, ...]
    layouts: tuple[tuple[str, Layout], ...]
    gen: tuple[int, int] = (1, 1)

    def layout(self, role: str) -> Layout:
        """The parallel layout of `role`; raises KeyError if the plan gives it none."""
        return dict(self.layouts)[role]

    def set_of(self, role: str) -> DeviceSet:
        """The set a role runs on; the rollout runs on the actor's set unless it has its own."""
        if role == "rollout" and not self.rollout_separate:
            role = "actor"
        for s in self.sets:
            if role in s.roles:
                return s
        raise KeyError(role)

    @property
    def rollout_separate(self) -> bool:
        """Whether the rollout has a device set of its own (new weights then go over the network)
        instead of generating on the actor's set."""
        return any("rollout" in s.roles for s in self.sets)

    @property
    def kind(self) -> str:
        """HybridFlow's names: colocate (one set), standalone (one role per set), split (other)."""
        model_sets = [s for s in self.sets if s.roles != ("rollout",)]
        if len(model_sets) == 1:
            return "colocate" + ("+rollout" if self.rollout_separate else "")
        if all(len(s.roles) == 1 for s in model_sets):
            return "standalone" + ("+rollout" if self.rollout_separate else "")
        return "split" + ("+rollout" if self.rollout_separate else "")

    def describe(self) -> dict:
        """JSON-ready summary (placement kind, sets, layouts, generation layout)."""
        return {
            "placement": self.kind,
            "sets": [{"roles": list(s.roles), "gpus": s.gpus} for s in self.sets],
            "layouts": {r: str(lay) for r, lay in self.layouts},
            "generation": {"tp": self.gen[0], "pp": self.gen[1]},
        }


@dataclass
class PlanCosts:
    """Stage costs of one plan on one step's batch (what both the search and the DES use)."""

    infer: dict[str, StageCost] = field(default_factory=dict)  # role -> forward pass cost
    train: dict[str, StageCost] = field(default_factory=dict)  # trainable role -> update cost
    set_memory: dict[str, float] = field(default_factory=dict)  # set name -> peak bytes per device
    kv_cap: int = 0  # sequences per rollout replica the KV memory allows
    replicas: int = 0
    decode: DecodeModel | None = None
    sync_seconds: float = 0.0
    feasible: bool = True
    why: str = ""


def role_memory(problem: Problem, role: str, lay: Layout, batch_mean_len: float) -> tuple[float, float]:
    """(resident state bytes, peak transient bytes) per device for one role."""
    model, hw = problem.model(role), problem.hw
    trainable = problem.trainable(role)
    state = model_state_bytes(model, hw, lay, trainable)
    mb_train = max(TRAIN_MICRO_BATCH_TOKENS, batch_mean_len)
    mb_inf = max(INFER_MICRO_BATCH_TOKENS, batch_mean_len)
    act = infer_activation_bytes(model, hw, lay, mb_inf)
    if trainable:
        act = max(act, train_activation_bytes(model, hw, lay, mb_train))
    return state, act


def gen_extra_bytes(problem: Problem, plan: Plan) -> float:
    """Generation weights beyond what the training shards already hold (zero when resharding in place)."""
    w = problem.actor.weight_bytes(problem.hw.param_bytes)
    gen_bytes = w / (plan.gen[0] * plan.gen[1])
    if plan.rollout_separate:
        return gen_bytes
    lay = plan.layout("actor")
    held = w / (lay.tp * lay.pp * (lay.dp if lay.zero == 3 else 1))
    return max(0.0, gen_bytes - held)


def estimate(problem: Problem, plan: Plan, batch: StepBatch) -> PlanCosts:
    """Stage costs, memory and feasibility of `plan` for one step's lengths."""
    hw, wl = problem.hw, problem.workload
    seq = batch.seq_lens
    mean_len = float(seq.mean())
    out = PlanCosts()
    for role in problem.roles:
        lay, model = plan.layout(role), problem.model(role)
        if problem.runs_inference(role):
            out.infer[role] = infer_cost(model, hw, lay, seq)
        if problem.trainable(role):
            out.train[role] = train_cost(model, hw, lay, seq, wl.mini_batches, wl.epochs)
    gen_set = plan.set_of("rollout")
    for s in plan.sets:
        states, trans = 0.0, 0.0
        for role in s.roles:
            if role == "rollout":
                continue
            st, act = role_memory(problem, role, plan.layout(role), mean_len)
            states, trans = states + st, max(trans, act)
        out.set_memory[s.name] = states + trans
        if states + trans > hw.usable_memory:
            out.feasible, out.why = False, f"set {s.name}: {(states + trans) / 1e9:.1f} GB > {hw.usable_memory / 1e9:.1f}"
        if s is gen_set:
            dm = DecodeModel(problem.actor, hw, *plan.gen)
            free = hw.usable_memory - states - gen_extra_bytes(problem, plan)
            out.decode, out.replicas = dm, s.gpus // dm.gpus
            out.kv_cap = kv_capacity_seqs(dm, free, float(batch.prompt_lens.max()), wl.response_len.max_len)
            out.set_memory[s.name] = states + max(trans, gen_extra_bytes(problem, plan))
            if out.kv_cap < 1:
                out.feasible, out.why = False, f"set {s.name}: no KV-cache room for one sequence"
    if plan.rollout_separate:
        out.sync_seconds = broadcast_seconds(problem.actor, hw, out.decode.gpus, out.replicas,
                                             plan.set_of("actor").gpus)  # fmt: skip
    else:
        out.sync_seconds = reshard_seconds(problem.actor, hw, plan.layout("actor"), *plan.gen)
    return out


def make_seqs(batch: StepBatch) -> list[Seq]:
    """Fresh decode records for a step's samples (ids are sample indices)."""
    cols = zip(batch.prompt_lens.tolist(), batch.response_lens.tolist(), batch.group.tolist(), strict=True)
    return [Seq(i, p, r, g) for i, (p, r, g) in enumerate(cols)]


def generation_seconds(costs: PlanCosts, batch: StepBatch) -> float:
    """Makespan of sequential generation: round-robin over replicas, continuous batching."""
    runs = simulate_generation(costs.decode, round_robin(make_seqs(batch), costs.replicas), costs.kv_cap)
    return max((r.end for r in runs), default=0.0)
