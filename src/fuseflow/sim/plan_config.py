"""Turn a searched plan into a fuseflow config (`fuseflow plan --write-config`).

fuseflow's executor places roles on Ray resource pools and shards each training role over
its whole pool with data parallelism (FSDP); it has no tensor or pipeline parallelism and
runs its rollout inside the actor. So the written config keeps what the executor can run:

- one pool per device set of the plan, one worker per GPU (`gpus_per_worker: 1`), whole
  nodes when a set spans more than one;
- `placement`: each fuseflow role on the pool of its set;
- per-role `dp`: the pool size, which fuseflow requires to divide `trainer.mini_batch_size`
  (every rank takes an equal share), so a set whose GPU count does not divide it gets the
  largest count that does, and the rest of its GPUs stay idle;
- `schedule.mode: sequential` (fuseflow's fused and async modes run on the local backend
  only) and the batch keys of the workload.

Everything the executor cannot express (TP/PP layouts, a separate rollout set, the
generation layout, the simulated policy and predicted time) goes into the header as
comments, so the file is both a runnable config and a record of the plan. This module
builds plain data and imports nothing from fuseflow's config layer; the CLI validates
the tree with the real `Config` before writing it.
"""

from __future__ import annotations

import math

import numpy as np

from .costmodel import TRAIN_MICRO_BATCH_TOKENS
from .placement import Problem

# Simulator role names -> fuseflow config role names ("rollout" runs inside the actor).
CONFIG_ROLE = {"actor": "actor", "critic": "critic", "ref": "reference", "reward": "reward"}


def _pool_size(gpus: int, mini: int, per_node: int) -> int:
    """Largest worker count <= gpus that divides `mini` and fills whole nodes past one node."""
    for size in range(min(gpus, mini), 0, -1):
        if mini % size == 0 and (size <= per_node or size % per_node == 0):
            return size
    return 1


def _pool_name(roles: tuple[str, ...]) -> str:
    return "_".join(CONFIG_ROLE[r] for r in roles)  # callers pass config roles only


def plan_config_tree(problem: Problem, cand) -> tuple[dict, list[str]]:
    """(config tree, header comment lines) for a search candidate (`search.Candidate`).

    The tree holds only keys of fuseflow's config; validate it with
    `fuseflow.config.load_config(base=tree)`.
    """
    wl, plan = problem.workload, cand.plan
    policy, res = cand.best()
    mini = max(1, wl.samples // wl.mini_batches)
    mean_len = float(np.mean(wl.step(0).seq_lens))
    per_mb = max(1, int(TRAIN_MICRO_BATCH_TOKENS // mean_len))
    micro = max(d for d in range(1, mini + 1) if mini % d == 0 and d <= per_mb)
    per_node = problem.hw.gpus_per_node
    pools: dict[str, dict] = {}
    placement: dict[str, str] = {}
    dp: dict[str, int] = {}
    notes = [f"fuseflow plan: {problem.actor.name} on {problem.gpus} x {problem.hw.name}, {wl.algorithm}",
             f"simulated policy {policy}: {res.iteration_seconds:.2f} s per step; peak GB per GPU "
             f"{ {k: round(v, 1) for k, v in cand.memory_gb.items()} }",
             f"generation layout: tp{plan.gen[0]} pp{plan.gen[1]} per rollout replica"]  # fmt: skip
    for s in plan.sets:
        lays = ", ".join(f"{r} {plan.layout(r)}" for r in s.roles if r != "rollout")
        notes.append(f"set {'+'.join(s.roles)}: {s.gpus} GPUs" + (f"; layouts {lays}" if lays else ""))
        roles = tuple(r for r in s.roles if r in CONFIG_ROLE)
        if not roles:
            notes.append(f"  fuseflow runs the rollout inside the actor: these {s.gpus} GPUs are not used")
            continue
        size = 1 if roles == ("reward",) else _pool_size(s.gpus, mini, per_node)
        if size < s.gpus:
            notes.append(f"  {size} of its {s.gpus} GPUs are used: fuseflow's data parallel size must divide "
                         f"trainer.mini_batch_size={mini}")  # fmt: skip
        nodes = max(1, math.ceil(size / per_node))
        name = _pool_name(roles)
        pools[name] = {"nodes": nodes, "workers_per_node": size // nodes, "gpus_per_worker": 1.0}
        for r in roles:
            placement[CONFIG_ROLE[r]] = name
            if r != "reward":
                dp[CONFIG_ROLE[r]] = size
    for role in ("critic", "reference", "reward"):
        # GRPO has no critic and a rule reward has no model, but fuseflow places every
        # role; the unused ones go with the actor rather than onto a pool of their own.
        placement.setdefault(role, placement["actor"])
    if policy != "sequential":
        notes.append(f"schedule.mode is sequential: fuseflow runs {policy} on the local backend only")
    if plan.gen[1] > 1:
        notes.append(f"pipelined generation (pp{plan.gen[1]}): fuseflow runs it with rollout.pipeline_stages=2 on "
                     "the local backend only; this config generates unpipelined")
    notes.append("set model.path to the actor's checkpoint" + (" and reward.model to the reward model"
                                                               if "reward" in problem.roles else ""))
    tree = {
        "algorithm": {"name": wl.algorithm, "group_size": wl.samples_per_prompt},
        "model": {"max_prompt_len": wl.prompt_len.max_len, "max_response_len": wl.response_len.max_len},
        "trainer": {"prompts_per_step": wl.prompts, "mini_batch_size": mini, "micro_batch_size": micro,
                    "epochs": wl.epochs},
        "backend": "ray",
        "pools": pools,
        "placement": placement,
        "actor": {"dp": dp["actor"]},
        **{role: {"dp": dp[role]} for role in ("critic", "reference") if role in dp},
        "schedule": {"mode": "sequential"},
    }  # fmt: skip
    return tree, notes
