"""The config sections of distribution and scheduling: the Ray backend, resource pools, where each role
runs, each role's scale, and the execution mode (``fuseflow.config.Config`` holds them; the checks that
span sections are in ``fuseflow.config_checks``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from fuseflow.config_tree import Section


class RayConfig(Section):
    # "auto" or "HOST:PORT" joins a cluster started with `ray start --head`; None starts a local
    # one for the run (and shuts it down after).
    address: str | None = None
    num_cpus: int | None = Field(None, gt=0)  # local cluster's CPU slots; default: enough for the pools
    start_timeout_s: float = Field(120.0, gt=0)  # joining, placing the pools, starting workers and groups
    collective_timeout_s: float = Field(300.0, gt=0)  # one collective (all-reduce, FSDP gather) before it fails


class PoolConfig(Section):
    """A resource pool: ``nodes x workers_per_node`` worker processes (see fuseflow.controller.placement)."""

    nodes: int = Field(1, ge=1)
    workers_per_node: int | None = Field(None, ge=1)  # default: the largest dp of the roles placed on it
    cpus_per_worker: float = Field(1.0, gt=0)
    gpus_per_worker: float = Field(0.0, ge=0)


class PlacementConfig(Section):
    """Role -> pool name. Roles on one pool share its processes (colocated); other pools run beside it."""

    actor: str = "main"  # the policy and its rollout engine
    reference: str = "main"
    critic: str = "main"  # also safe_ppo's cost critic
    reward: str = "main"  # the reward function and reward model (reward.dp workers)
    # backend=ray: the pool whose bundles hold the rollout replica processes (schedule.rollout_workers of
    # them, each with its own engine and weights copy); needed by every mode but one-worker sequential.
    rollout: str | None = None


class ActorScale(Section):
    dp: int = Field(1, ge=1)  # data-parallel workers (FSDP shards over them); >1 needs backend=ray
    # Pipeline stages of the training step (one process each, schedule/pipeline/); 1: no pipeline.
    pp: int = Field(1, ge=1)
    pp_split: list[int] | None = None  # decoder layers per stage; None: balanced by parameter count


class RoleScale(Section):
    dp: int | None = Field(None, ge=1)  # None: the same as actor.dp


class CriticScale(RoleScale):
    # Pipeline stages of the critic's training; with actor.pp > 1 it must equal actor.pp (PPO trains both
    # on the same stage processes with a fused schedule, the critic's stages in the opposite direction).
    pp: int = Field(1, ge=1)


class ScheduleConfig(Section):
    """How the steps of one RL iteration execute (``fuseflow.schedule``); the algorithm is unchanged.

    sequential: verl's order. fused: samples go to inference as they finish while generation
    goes on, and the long tail migrates onto fewer rollout workers. async: generation for step
    t+1 overlaps training of step t, at most ``max_staleness`` versions behind (the decoupled
    loss is then the default). Generation runs one step ahead, so samples are at most one
    version old: a bound above 1 is respected but does not prefetch further. elastic
    (RLHFless): each step uses as many of the ``rollout_workers`` as the cost-aware rule picks
    from predicted response lengths, deals prompts to them by predicted length and releases
    each as soon as it has no work. fused+async, fused+elastic: both.
    """

    mode: Literal["sequential", "fused", "async", "fused+async", "elastic", "fused+elastic"] = "sequential"
    max_staleness: int = Field(1, ge=0)  # async: versions a trained-on sample may lag the trained policy
    # fused: migrate the tail once unfinished samples <= this fraction of the batch; "auto" picks it from
    # the previous steps' response lengths (fuseflow.policy.migration.auto_threshold).
    migration_threshold: float | Literal["auto"] = 0.2
    # Padded tokens (rows x widest row) per inference and training forward; rows are grouped by length
    # and trimmed, so a long-tailed batch wastes little compute on padding.
    token_budget: int = Field(4096, gt=0)
    # Scoring and training forwards run each distinct prompt of a micro-batch once and its responses,
    # unpadded, against the prompt's cached keys and values, where that saves at least a quarter of the
    # tokens (GRPO's groups, long-tailed responses; fuseflow.workers.common.shared_prompts).
    shared_prefix: bool = True
    # With shared_prefix, a worker keeps the keys and values of the prompts its scoring forwards ran
    # (under the same weights, up to 256 MB) and later forwards of the step are given them instead of
    # running the prompt again (fuseflow.workers.common.PromptCache; `fuseflow bench scoring`).
    prompt_cache: bool = True
    rollout_workers: int = Field(1, ge=1)  # engines that generate side by side (one thread each); elastic's most
    # elastic: the cheapest replica count whose step is at most (1 + elastic_slowdown) x the fastest count's.
    elastic_slowdown: float = Field(0.1, ge=0.0)
    # elastic: a prompt's predicted response length is the mean of its last predictor_window observations
    # (one per step it was drawn in); a prompt never seen gets the last step's mean length.
    predictor_window: int = Field(4, ge=1)
    # actor.pp > 1: seconds the pipeline solver may search for each new (actor, critic) micro-batch count
    # pair (schedules are cached per pair), and a hard cap on each stage's peak activation memory in
    # micro-batches held (None: the solver minimises it without a cap; a cap trades makespan for memory).
    pipeline_solver_seconds: float = Field(10.0, gt=0)
    pipeline_memory_cap: float | None = Field(None, ge=1.0)

    @model_validator(mode="after")
    def _threshold_is_a_fraction(self) -> ScheduleConfig:
        t = self.migration_threshold
        if t != "auto" and not 0.0 < t < 1.0:
            raise ValueError(f"schedule.migration_threshold={t} must be a fraction in (0, 1) or 'auto'")
        if self.elastic and self.rollout_workers < 2:
            raise ValueError(f"schedule.mode={self.mode} chooses how many rollout workers each step uses; it needs "
                             f"schedule.rollout_workers >= 2 (got {self.rollout_workers})")
        return self

    @property
    def fused(self) -> bool:
        """True for ``fused``, ``fused+async`` and ``fused+elastic``: inference streams during generation."""
        return self.mode.split("+")[0] == "fused"

    @property
    def asynchronous(self) -> bool:
        """True for ``async`` and ``fused+async``: the next step generates while this one trains."""
        return "async" in self.mode.split("+")

    @property
    def elastic(self) -> bool:
        """True for ``elastic`` and ``fused+elastic``: replicas are chosen per step and released when idle."""
        return "elastic" in self.mode.split("+")
