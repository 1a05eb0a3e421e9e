"""Plan search: HybridFlow's placement algorithm with Pipe-RLHF's hierarchy on top.

Level 1 (HybridFlow, Sheng et al. EuroSys'25, Alg. 1): enumerate set partitions of the
roles, allocations of devices to the sets (in units of whole nodes when the cluster is
large), and per set the parallel layouts of its roles that fit in memory. A plan's
analytic cost is the sum over stages (generate, inference, train, sync) of the max
over sets, colocated roles adding up within a set.

Level 2 (Pipe-RLHF): the rollout may get a set of its own, so generation can overlap
training (async), and each stage picks its own strategy (generation TP x PP, training
TP/PP/DP/ZeRO/recompute). The most promising plans of level 1 are then replayed by the
discrete-event simulator under each execution policy, which prices what the analytic
sum cannot: streaming, migration, overlap and bubbles.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from itertools import product

from .costmodel import (
    DecodeModel,
    Layout,
    StageCost,
    broadcast_seconds,
    fused_train_seconds,
    infer_cost,
    reshard_seconds,
    train_cost,
)  # fmt: skip
from .engine import SimResult, simulate
from .generation import kv_capacity_seqs, round_robin, simulate_generation
from .placement import (
    DeviceSet,
    Plan,
    Problem,
    candidate_layouts,
    compositions,
    gen_layouts,
    make_seqs,
    role_memory,
    set_partitions,
)  # fmt: skip
from .policies import Policy, parse_policy

MAX_UNITS = 32  # devices are allocated in units of N / 32 (rounded to a power of two) at most


@dataclass
class SetChoice:
    """The best layouts found for one device set, and its stage times (seconds)."""

    roles: tuple[str, ...]
    gpus: int
    layouts: dict[str, Layout]
    gen: tuple[int, int] | None = None
    infer: float = 0.0
    train: float = 0.0
    train_fused: float = 0.0
    gen_time: float = 0.0
    sync: float = 0.0
    memory: float = 0.0


@dataclass
class Candidate:
    """One plan with its analytic stage costs, peak memory and DES results per policy."""

    plan: Plan
    analytic: dict[str, float]
    memory_gb: dict[str, float]
    sims: dict[str, SimResult] = field(default_factory=dict)

    def best(self) -> tuple[str, SimResult]:
        """The policy with the lowest simulated iteration time, with its result; raises ValueError if
        no policy has been simulated yet."""
        return min(self.sims.items(), key=lambda kv: kv[1].iteration_seconds)

    def to_dict(self) -> dict:
        """JSON-ready summary: the plan's `describe()`, the best policy's iteration seconds and
        samples/s, memory per GPU (GB) by device set, the analytic costs (seconds) and every
        simulated policy's iteration seconds."""
        policy, res = self.best()
        return {
            **self.plan.describe(),
            "policy": policy,
            "iteration_seconds": round(res.iteration_seconds, 4),
            "samples_per_second": round(res.samples_per_second, 3),
            "memory_gb_per_gpu": {k: round(v, 2) for k, v in self.memory_gb.items()},
            "analytic_seconds": {k: round(v, 4) for k, v in self.analytic.items()},
            "policies": {p: round(r.iteration_seconds, 4) for p, r in self.sims.items()},
        }


def unit_size(gpus: int, gpus_per_node: int) -> int:
    """Allocation granularity: the smallest power of two giving at most MAX_UNITS units.

    Keeps the allocation count at C(MAX_UNITS - 1, k - 1) per k-set structure whatever
    the cluster size (1024 devices are allocated in blocks of 4 nodes).
    """
    unit = 1
    while gpus // unit > MAX_UNITS and gpus % (unit * 2) == 0:
        unit *= 2
    return unit


class Searcher:
    """Enumerates plans for one problem; caches per-(roles, devices) choices across allocations."""

    def __init__(self, problem: Problem):
        self.p = problem
        self.batch = problem.workload.step(0)
        self.seq = self.batch.seq_lens
        self.mean_len = float(self.seq.mean())
        self._opts: dict = {}
        self._sets: dict = {}
        self._gen: dict = {}
        self.evaluated = 0

    # ---------------------------------------------------------------- per role / per set
    def role_options(self, role: str, gpus: int) -> list[tuple]:
        """Pareto-optimal (seconds, state bytes, transient bytes, layout, infer, train) for a role."""
        key = (role, gpus)
        if key in self._opts:
            return self._opts[key]
        p, model = self.p, self.p.model(role)
        wl = p.workload
        opts = []
        for lay in candidate_layouts(model, p.hw, gpus, p.trainable(role)):
            state, act = role_memory(p, role, lay, self.mean_len)
            if state + act > p.hw.usable_memory:
                continue
            inf = infer_cost(model, p.hw, lay, self.seq) if p.runs_inference(role) else StageCost(0.0)
            tr = train_cost(model, p.hw, lay, self.seq, wl.mini_batches, wl.epochs) if p.trainable(role) else None
            opts.append((inf.seconds + (tr.seconds if tr else 0.0), state, act, lay, inf, tr))
        opts.sort(key=lambda o: o[0])
        front: list[tuple] = []
        for o in opts:
            if not any(f[0] <= o[0] and f[1] <= o[1] and f[2] <= o[2] for f in front):
                front.append(o)
        self._opts[key] = front[:6]
        return self._opts[key]

    def gen_seconds(self, tg: int, pg: int, gpus: int, cap: int) -> float:
        """Generation makespan; a binding KV cap is rounded down onto a ~10% geometric grid so
        that the many memory levels of different layout combinations share one replay
        (slightly pessimistic; the DES replays the exact cap). Priced as `generation_layouts`."""
        replicas = gpus // (tg * pg)
        need = math.ceil(self.batch.n / replicas)
        # A cap that holds a replica's whole share is not binding: exact (rounding it down would add
        # a decode wave that does not happen; 39% on a 32-sequence batch at cap 32 -> 30).
        cap = need if cap >= need else cap
        if cap > 8 and cap < need:
            cap = int(8 * 1.1 ** math.floor(math.log(cap / 8) / math.log(1.1)))
        key = (tg, pg, replicas, cap)
        if key not in self._gen:
            dm = DecodeModel(self.p.actor, self.p.hw, tg, pg)
            runs = simulate_generation(dm, round_robin(make_seqs(self.batch), replicas), cap)
            self._gen[key] = max(r.end for r in runs)
        return self._gen[key]

    def best_set(self, roles: tuple[str, ...], gpus: int, gen_here: bool) -> SetChoice | None:
        """Fastest feasible layouts for the roles of one set (sum of their stage times)."""
        key = (roles, gpus, gen_here)
        if key in self._sets:
            return self._sets[key]
        p, hw = self.p, self.p.hw
        model_roles = [r for r in roles if r != "rollout"]
        options = [self.role_options(r, gpus) for r in model_roles]
        best: SetChoice | None = None
        best_total = math.inf
        w_bytes = p.actor.weight_bytes(hw.param_bytes)
        prompt_max = float(self.batch.prompt_lens.max())
        for combo in product(*options):
            states = sum(o[1] for o in combo)
            trans = max((o[2] for o in combo), default=0.0)
            if states + trans > hw.usable_memory:
                continue
            lays = {r: o[3] for r, o in zip(model_roles, combo, strict=True)}
            infer = sum(o[4].seconds for o in combo)
            trains = {r: o[5] for r, o in zip(model_roles, combo, strict=True) if o[5] is not None}
            train = sum(t.seconds for t in trains.values())
            fused = train
            if len(trains) == 2:
                fused = fused_train_seconds(trains["actor"], trains["critic"], lays["actor"].pp, lays["critic"].pp)
            gen_pick, gen_t, sync, gen_mem = None, 0.0, 0.0, 0.0
            if gen_here:
                gen_best = math.inf
                for tg, pg in gen_layouts(p.actor, hw, gpus):
                    gen_bytes = w_bytes / (tg * pg)
                    if "actor" in lays:
                        a = lays["actor"]
                        extra = max(0.0, gen_bytes - w_bytes / (a.tp * a.pp * (a.dp if a.zero == 3 else 1)))
                        rs = reshard_seconds(p.actor, hw, a, tg, pg)
                    else:
                        extra, rs = gen_bytes, 0.0
                    dm = DecodeModel(p.actor, hw, tg, pg)
                    cap = kv_capacity_seqs(dm, hw.usable_memory - states - extra, prompt_max,
                                           p.workload.response_len.max_len)  # fmt: skip
                    if cap < 1:
                        continue
                    g = self.gen_seconds(tg, pg, gpus, cap) + rs
                    if g < gen_best:
                        gen_best, gen_pick, gen_t, sync, gen_mem = g, (tg, pg), g - rs, rs, extra
                if gen_pick is None:
                    continue
            total = infer + train + gen_t + sync
            self.evaluated += 1
            if total < best_total:
                best_total = total
                # Peak memory: resident states plus the larger of training activations and the
                # generation weights (the KV cache then takes whatever is left).
                best = SetChoice(roles, gpus, lays, gen_pick, infer, train, fused, gen_t, sync,
                                 states + max(trans, gen_mem))  # fmt: skip
        self._sets[key] = best
        return best

    # ---------------------------------------------------------------- whole plans
    def structures(self) -> list[tuple[tuple[str, ...], ...]]:
        """Set partitions of the roles, each with the rollout on the actor's set or on its own."""
        out = []
        for part in set_partitions(self.p.roles):
            blocks = tuple(tuple(sorted(b, key=self.p.roles.index)) for b in part)
            out.append(blocks)
            out.append((*blocks, ("rollout",)))
        return out

    def enumerate(self, kinds: set[str] | None = None) -> list[Candidate]:
        """Best allocation of every structure (its cheapest analytic plan), sorted by analytic cost."""
        p = self.p
        unit = unit_size(p.gpus, p.hw.gpus_per_node)
        units = p.gpus // unit
        host = p.hw.efficiency.host_seconds_per_sample * self.batch.n * (1 if p.reward else 2)
        found: list[Candidate] = []
        for blocks in self.structures():
            if len(blocks) > units or (kinds and structure_kind(blocks) not in kinds):
                continue
            separate = ("rollout",) in blocks
            best = None
            for alloc in compositions(units, len(blocks)):
                choices = []
                for b, a in zip(blocks, alloc, strict=True):
                    c = self.best_set(b, a * unit, b == ("rollout",) or ("actor" in b and not separate))
                    if c is None:
                        break
                    choices.append(c)
                if len(choices) < len(blocks):
                    continue
                cand = self._combine(choices, separate, host)
                if best is None or cand.analytic["sequential"] < best.analytic["sequential"]:
                    best = cand
            if best is not None:
                found.append(best)
        found.sort(key=lambda c: c.analytic["sequential"])
        return found

    def _combine(self, choices: list[SetChoice], separate: bool, host: float) -> Candidate:
        p = self.p
        gen_c = next(c for c in choices if c.gen is not None)
        actor_c = next(c for c in choices if "actor" in c.roles)
        if separate:
            tg, pg = gen_c.gen
            sync = broadcast_seconds(p.actor, p.hw, tg * pg, gen_c.gpus // (tg * pg), actor_c.gpus)
        else:
            sync = actor_c.sync
        gen = gen_c.gen_time
        infer = max(c.infer for c in choices)
        train = max(c.train for c in choices)
        train_fused = max(c.train_fused for c in choices)
        seq = gen + infer + host + train + sync
        asy = max(gen + sync, infer + host + train + sync) if separate else seq
        layouts = tuple((r, lay) for c in choices for r, lay in c.layouts.items())
        plan = Plan(tuple(DeviceSet(c.roles, c.gpus) for c in choices), layouts, gen_c.gen)
        analytic = {"generate": gen, "inference": infer, "host": host, "train": train, "train_fused": train_fused,
                    "sync": sync, "sequential": seq, "async": asy}  # fmt: skip
        return Candidate(plan, analytic, {"+".join(c.roles): c.memory / 1e9 for c in choices})


def structure_kind(blocks: tuple[tuple[str, ...], ...]) -> str:
    """HybridFlow's placement name of a structure (see `Plan.kind`)."""
    return Plan(tuple(DeviceSet(b, 1) for b in blocks), ()).kind


def search(
    problem: Problem, policies: tuple[str, ...] = ("sequential", "fused", "async"), top: int = 5,
    refine: int = 6, kinds: set[str] | None = None, iterations: int = 1,
) -> tuple[list[Candidate], dict]:  # fmt: skip
    """Search plans and rank them by simulated iteration time under the given policies.

    Returns (the `top` candidates, statistics). The `refine` best structures by
    analytic sequential cost and by analytic async cost are replayed in the DES.
    """
    t0 = time.perf_counter()
    s = Searcher(problem)
    found = s.enumerate(kinds)
    if not found:
        raise ValueError(f"no feasible plan: {problem.actor.name} does not fit on {problem.gpus} x {problem.hw.name}")
    by_async = sorted(found, key=lambda c: c.analytic["async"])
    pool = {id(c): c for c in found[:refine] + by_async[:refine]}
    pols: list[Policy] = [parse_policy(x) for x in policies]
    for cand in pool.values():
        for pol in pols:
            if pol.async_ and not cand.plan.rollout_separate:
                continue  # async on shared devices only reorders work; skip the wasted replay
            cand.sims[pol.name] = simulate(problem, cand.plan, pol, iterations)
    ranked = sorted((c for c in pool.values() if c.sims), key=lambda c: c.best()[1].iteration_seconds)
    stats = {"structures": len(s.structures()), "set_choices_evaluated": s.evaluated,
             "candidates_simulated": len(pool), "seconds": round(time.perf_counter() - t0, 2)}  # fmt: skip
    return ranked[:top], stats
