"""Discrete-event simulation of RL iterations (SimPy) under the execution policies.

Processes per iteration: a rollout that releases finished samples at their decode
finish times, one inference process per device set hosting inference roles, host-side
reward/advantages, one training process per set, and a weight sync. Devices are
counted per set (`GpuPool`), so colocated stages queue for the same devices while
stages on different sets run at once; fused inference takes whatever devices the
rollout has freed. Stage durations come from `costmodel`; decode timing from
`generation`, which is exact per round.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace

import simpy

from fuseflow.policy.migration import PendingSample, WorkerBudget, plan_migration, trigger_count

from .costmodel import INFER_MICRO_BATCH_TOKENS, fused_train_seconds, infer_cost
from .generation import (
    Seq,
    round_robin,
    run_replica,
    simulate_generation,
)  # fmt: skip
from .placement import INFER_STAGE, TRAIN_STAGE, Plan, PlanCosts, Problem, estimate, make_seqs
from .policies import MIGRATE_GRID, Policy, choose_workers


@dataclass
class TraceEvent:
    """One box of the timeline: `name` ran on `gpus` devices of `lane` from `start` for `dur` seconds."""

    name: str
    lane: str
    track: str
    start: float
    dur: float
    gpus: int
    step: int


@dataclass
class SimResult:
    """Per-iteration figures of one policy (means over the simulated iterations)."""

    policy: str
    iteration_seconds: float
    samples_per_second: float
    tokens_per_second: float
    gpu_seconds: float
    gpu_busy_fraction: float
    gen_plus_inference_seconds: float
    stages: dict[str, float]
    events: list[TraceEvent] = field(default_factory=list, repr=False)
    info: dict = field(default_factory=dict)

    def summary(self) -> dict:
        """The result without its timeline events (for JSON output)."""
        keys = ("policy", "iteration_seconds", "samples_per_second", "tokens_per_second", "gpu_seconds",
                "gpu_busy_fraction", "gen_plus_inference_seconds", "stages", "info")  # fmt: skip
        return {k: getattr(self, k) for k in keys}


class GpuPool:
    """Devices of one set, granted first-come first-served.

    `acquire(n)` waits for n free devices; `acquire(n, greedy=True)` waits for n and
    then takes every free device (fused inference soaking up what the rollout freed).
    """

    def __init__(self, env: simpy.Environment, total: int):
        self.env, self.total, self.free = env, total, total
        self._waiters: deque = deque()

    def acquire(self, n: int, greedy: bool = False) -> simpy.Event:
        """Request `n` devices; the event fires with the count granted: `n` (capped at the pool's size,
        so any request can be met) or, with `greedy`, every free device once `n` are free.

        Requests are granted strictly in arrival order: a later one waits behind an earlier one
        even when it would fit.
        """
        ev = self.env.event()
        self._waiters.append((ev, min(n, self.total), greedy))
        self._grant()
        return ev

    def release(self, n: int) -> None:
        """Give `n` devices back and grant the waiting requests that now fit, in arrival order."""
        self.free += n
        self._grant()

    def _grant(self) -> None:
        while self._waiters and self.free >= self._waiters[0][1]:
            ev, n, greedy = self._waiters.popleft()
            got = self.free if greedy else n
            self.free -= got
            ev.succeed(got)


class _Run:
    def __init__(self, problem: Problem, plan: Plan, policy: Policy, iterations: int):
        self.p, self.plan, self.pol, self.k = problem, plan, policy, iterations
        self.env = simpy.Environment()
        self.pools = {s.name: GpuPool(self.env, s.gpus) for s in plan.sets}
        self.events: list[TraceEvent] = []
        self.marks: list[dict] = [dict() for _ in range(iterations)]
        self.sync_done = [self.env.event() for _ in range(iterations)]
        self.train_done = [self.env.event() for _ in range(iterations)]
        self.rollout_billed = 0.0
        self.gen_free: dict[int, float] = {}
        self.info: dict = {}
        self._cache: dict[int, tuple] = {}

    # ---------------------------------------------------------------- helpers
    def batch(self, k: int) -> tuple:
        if k not in self._cache:
            b = self.p.workload.step(k)
            self._cache[k] = (b, estimate(self.p, self.plan, b))
        return self._cache[k]

    def box(self, name: str, lane: str, track: str, start: float, dur: float, gpus: int, step: int) -> None:
        self.events.append(TraceEvent(name, lane, track, start, dur, gpus, step))

    def run(self) -> None:
        for k in range(self.k):
            self.env.process(self.iteration(k))
        self.env.run()

    # ---------------------------------------------------------------- one iteration
    def iteration(self, k: int):
        env, pol = self.env, self.pol
        dep = k - 1 - (pol.staleness if pol.async_ else 0)
        if dep >= 0:
            yield self.sync_done[dep]
        batch, costs = self.batch(k)
        self.marks[k]["start"] = env.now
        inf_sets = [s for s in self.plan.sets if any(self.p.runs_inference(r) for r in s.roles)]
        stores = {s.name: simpy.Store(env) for s in inf_sets}
        procs = [env.process(self.rollout(k, batch, costs, list(stores.values())))]
        procs += [env.process(self.inference(k, s, batch, costs, stores[s.name])) for s in inf_sets]
        yield simpy.AllOf(env, procs)
        self.marks[k]["inference_end"] = env.now
        if k > 0:
            yield self.train_done[k - 1]
        # Host work: advantages, plus the rule-based reward when there is no reward model.
        host = self.p.hw.efficiency.host_seconds_per_sample * batch.n * (1 if self.p.reward else 2)
        self.box("advantages", "host", "host", env.now, host, 0, k)
        yield env.timeout(host)
        self.marks[k]["train_start"] = env.now
        train_sets = [s for s in self.plan.sets if any(r in costs.train for r in s.roles)]
        yield simpy.AllOf(env, [env.process(self.train(k, s, costs)) for s in train_sets])
        self.marks[k]["train_end"] = env.now
        self.train_done[k].succeed()
        yield env.process(self.sync(k, costs))
        self.marks[k]["end"] = env.now
        self.sync_done[k].succeed()

    # ---------------------------------------------------------------- rollout
    def rollout(self, k: int, batch, costs: PlanCosts, stores: list):
        env = self.env
        if self.pol.elastic:
            timeline = self.elastic_timeline(k, batch, costs)
            pool, held = None, 0
        else:
            gen_set = self.plan.set_of("rollout")
            pool = self.pools[gen_set.name]
            held = costs.replicas * costs.decode.gpus
            yield pool.acquire(held)
            timeline = self.fused_timeline(k, batch, costs, gen_set.name) if self.pol.fused else \
                self.plain_timeline(k, batch, costs, gen_set.name)  # fmt: skip
        # When the rollout will have given back all its devices: fused inference on the
        # same set only starts a partial-device chunk that finishes before then.
        self.gen_free[k] = max((t for t, kind, _ in timeline if kind == "release"), default=env.now)
        last = env.now
        # Apply everything that happens at one instant together, so a greedy consumer
        # sees all the devices freed at that instant rather than the first replica's.
        at: dict[float, list] = {}
        for t, kind, value in timeline:
            at.setdefault(t, []).append((kind, value))
        for t in sorted(at):
            if t > env.now:
                yield env.timeout(t - env.now)
            freed = 0
            for kind, value in at[t]:
                if kind == "finish":
                    last = t
                    for st in stores:
                        st.put(value)
                else:
                    freed += value
            if pool is not None and freed:
                pool.release(freed)
                held -= freed
        if pool is not None and held:
            pool.release(held)
        self.marks[k]["generate_end"] = last

    def plain_timeline(self, k, batch, costs: PlanCosts, lane: str) -> list:
        t0 = self.env.now
        runs = simulate_generation(costs.decode, round_robin(make_seqs(batch), costs.replicas), costs.kv_cap, t0)
        end = max(r.end for r in runs)
        for i, r in enumerate(runs):
            self.box("generate", lane, f"replica{i}", t0, r.end - t0, costs.decode.gpus, k)
        return [(t, "finish", sid) for r in runs for sid, t in r.finishes] + [(end, "release", 0)]

    def fused_timeline(self, k, batch, costs: PlanCosts, lane: str) -> list:
        """Run, migrate the long tail onto fewer replicas, release freed replicas early."""
        dm, cap, t0 = costs.decode, costs.kv_cap, self.env.now
        parts = round_robin(list(range(batch.n)), costs.replicas)
        seqs = make_seqs(batch)
        full = simulate_generation(dm, [[_copy(seqs[i]) for i in p] for p in parts], cap, t0)
        times = sorted(t for r in full for _, t in r.finishes)
        # The runtime's trigger (policy.migration.trigger_count); 0 streams samples but never migrates.
        left_n = trigger_count(batch.n, self.pol.migrate_frac) if self.pol.migrate_frac else 0
        tl: list = []
        keep: list[int] = []
        if left_n >= 1 and costs.replicas > 1 and left_n < batch.n:
            t_mig = times[batch.n - left_n - 1]
            first = [run_replica(dm, [_copy(seqs[i]) for i in p], t0, cap, until=t_mig) for p in parts]
            if any(r.leftover for r in first):
                keep, incoming, mig = self.plan_tail(first, costs, batch)
        if not keep:  # nothing to migrate (one replica, tiny threshold, equal lengths, or no fewer replicas fit)
            for i, r in enumerate(full):
                self.box("generate", lane, f"replica{i}", t0, r.end - t0, dm.gpus, k)
                tl += [(t, "finish", sid) for sid, t in r.finishes] + [(r.end, "release", dm.gpus)]
            return tl
        total_left = sum(len(r.leftover) for r in first)
        keep_n = len(keep)
        resume = t_mig + mig
        self.info.setdefault("migrations", []).append(
            {"step": k, "at_seconds": t_mig - t0, "remaining": total_left, "kept_replicas": keep_n,
             "of_replicas": costs.replicas, "transfer_seconds": mig})  # fmt: skip
        for i, r in enumerate(first):
            tl += [(t, "finish", sid) for sid, t in r.finishes]
            if i not in keep:
                stop = r.end if not r.leftover else resume
                self.box("generate", lane, f"replica{i}", t0, min(r.end, t_mig) - t0, dm.gpus, k)
                if r.leftover:
                    self.box("migrate", lane, f"replica{i}", t_mig, mig, dm.gpus, k)
                tl.append((stop, "release", dm.gpus))
        for i in keep:
            self.box("generate", lane, f"replica{i}", t0, t_mig - t0, dm.gpus, k)
            self.box("migrate", lane, f"replica{i}", t_mig, mig, dm.gpus, k)
            r = run_replica(dm, first[i].leftover + incoming[i], resume, cap)
            self.box("generate", lane, f"replica{i}", resume, r.end - resume, dm.gpus, k)
            tl += [(t, "finish", sid) for sid, t in r.finishes] + [(r.end, "release", dm.gpus)]
        return tl

    def plan_tail(self, first: list, costs: PlanCosts, batch) -> tuple[list[int], dict[int, list], float]:
        """Where the tail goes: the runtime's own plan (``policy.migration.plan_migration``).

        Each replica's budget is its KV room (``kv_cap`` sequences of the longest prompt plus
        ``max_len`` tokens) and a sample's remaining tokens are what the runtime assumes too,
        ``max_len`` less those done. Returns the kept replicas, the samples each receives and
        the KV transfer seconds (empty when the tail fits on no fewer replicas).
        """
        dm, max_len = costs.decode, self.p.workload.response_len.max_len
        seq_tokens = int(batch.prompt_lens.max()) + max_len
        pending = {i: [PendingSample(s.id, s.done, max(0, max_len - s.done), s.prompt + s.done) for s in r.leftover]
                   for i, r in enumerate(first)}
        budgets = {i: WorkerBudget(costs.kv_cap, costs.kv_cap * seq_tokens) for i in range(len(first))}
        plan = plan_migration(pending, budgets)
        if not plan.feasible or not plan.freed:
            return [], {}, 0.0
        by_id = {s.id: s for r in first for s in r.leftover}
        incoming: dict[int, list] = {i: [] for i in plan.targets}
        for mv in plan.moves:
            incoming[mv.dst].append(by_id[mv.uid])
        kv_tok = dm.model.kv_bytes_per_token(dm.hw.param_bytes)
        bw = dm.gpus * dm.hw.inter_bw * dm.hw.efficiency.comm
        mig = max((sum(kv_tok * (s.prompt + s.done) for s in incoming[i] if s.prefilled) / bw
                   for i in plan.targets), default=0.0)  # fmt: skip
        keep = [i for i in plan.targets if first[i].leftover or incoming[i]]
        return keep, incoming, mig

    def elastic_timeline(self, k, batch, costs: PlanCosts) -> list:
        """Serverless rollout workers: shape, count and assignment from predicted lengths, billed while busy."""
        p, t0 = self.p, self.env.now
        ch = choose_workers(p.actor, p.hw, make_seqs(batch), batch.predicted_lens.astype(float), p.gpus,
                            float(batch.prompt_lens.max()), p.workload.response_len.max_len,
                            self.plan.set_of("actor").gpus, self.pol.slowdown_budget, self.rest_seconds(costs),
                            batch.predicted_key.astype(float))  # fmt: skip
        dm = ch.decode
        runs = simulate_generation(dm, ch.assignment, ch.cap, t0 + ch.startup, share_prefix=True)
        tl: list = []
        for i, r in enumerate(runs):
            if not r.finishes:
                continue
            self.box("load_weights", "rollout-pool", f"worker{i}", t0, ch.startup, dm.gpus, k)
            self.box("generate", "rollout-pool", f"worker{i}", t0 + ch.startup, r.end - t0 - ch.startup, dm.gpus, k)
            self.rollout_billed += (r.end - t0) * dm.gpus
            tl += [(t, "finish", sid) for sid, t in r.finishes]
        self.info.setdefault("elastic_workers", []).append(f"{ch.workers} x tp{dm.tp}.pp{dm.pp}")
        return tl

    def rest_seconds(self, costs: PlanCosts) -> float:
        """Predicted step seconds outside the rollout: inference, host, training (max over sets)."""
        per_set = [sum((costs.infer[r].seconds if r in costs.infer else 0.0)
                       + (costs.train[r].seconds if r in costs.train else 0.0) for r in s.roles)
                   for s in self.plan.sets]  # fmt: skip
        host = self.p.hw.efficiency.host_seconds_per_sample * self.p.workload.samples
        return max(per_set, default=0.0) + host

    # ---------------------------------------------------------------- inference / train / sync
    def inference(self, k: int, s, batch, costs: PlanCosts, store: simpy.Store):
        env, pool = self.env, self.pools[s.name]
        roles = [r for r in s.roles if self.p.runs_inference(r)]
        if not self.pol.fused:
            for _ in range(batch.n):
                yield store.get()
            yield pool.acquire(s.gpus)
            for r in roles:
                d = costs.infer[r].seconds
                self.box(INFER_STAGE[r], s.name, INFER_STAGE[r], env.now, d, s.gpus, k)
                yield env.timeout(d)
            pool.release(s.gpus)
            return
        need = max(self.plan.layout(r).tp * self.plan.layout(r).pp for r in roles)
        shares_rollout = not self.pol.elastic and s is self.plan.set_of("rollout")
        queue: list[int] = []
        done = 0
        per_mb = max(1, int(INFER_MICRO_BATCH_TOKENS // float(batch.seq_lens.mean())))
        while done < batch.n:
            if not queue:
                queue.append((yield store.get()))
            queue += store.items[:]
            store.items.clear()
            # Reserved devices idle for free, so chunks are whatever has arrived. Under
            # pay-per-use billing (elastic) a chunk waits until every data-parallel rank gets a
            # full micro-batch (or the last sample has arrived), as an idle rank is billed too.
            devices = max(pool.free, need) if shares_rollout else s.gpus
            full = max(max(1, devices // (self.plan.layout(r).tp * self.plan.layout(r).pp)) for r in roles) * per_mb
            if self.pol.elastic and len(queue) < full and done + len(queue) < batch.n:
                queue.append((yield store.get()))
                continue
            got = yield pool.acquire(need, greedy=True)
            queue += store.items[:]
            store.items.clear()
            chunk = queue
            if shares_rollout and got < s.gpus:
                # Partial devices while the rollout still runs: take the largest chunk that
                # ends before the rollout frees the whole set, else wait for the whole set.
                room = self.gen_free[k] - env.now
                n_fit = self._fit(roles, got, batch, queue, room)
                if n_fit == 0:
                    pool.release(got)
                    got = yield pool.acquire(s.gpus, greedy=True)
                    queue += store.items[:]
                    store.items.clear()
                    n_fit = len(queue)
                chunk = queue[:n_fit]
            queue = queue[len(chunk):]
            lens = batch.seq_lens[chunk]
            for r in roles:
                lay = self.plan.layout(r)
                dp = got // (lay.tp * lay.pp)
                d = infer_cost(self.p.model(r), self.p.hw, replace(lay, dp=dp), lens).seconds
                self.box(INFER_STAGE[r], s.name, INFER_STAGE[r], env.now, d, dp * lay.tp * lay.pp, k)
                yield env.timeout(d)
            pool.release(got)
            done += len(chunk)

    def _fit(self, roles: list[str], got: int, batch, queue: list[int], room: float) -> int:
        """Most queued samples whose inference on `got` devices takes at most `room` seconds."""

        def dur(n: int) -> float:
            total = 0.0
            for r in roles:
                lay = self.plan.layout(r)
                dp = got // (lay.tp * lay.pp)
                total += infer_cost(self.p.model(r), self.p.hw, replace(lay, dp=dp), batch.seq_lens[queue[:n]]).seconds
            return total

        lo, hi = 0, len(queue)
        while lo < hi:  # durations grow with the chunk, so bisect on the count
            mid = (lo + hi + 1) // 2
            if dur(mid) <= room:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def train(self, k: int, s, costs: PlanCosts):
        env, pool = self.env, self.pools[s.name]
        roles = [r for r in s.roles if r in costs.train]
        yield pool.acquire(s.gpus)
        if self.pol.fused and len(roles) == 2:
            a, c = costs.train["actor"], costs.train["critic"]
            d = fused_train_seconds(a, c, self.plan.layout("actor").pp, self.plan.layout("critic").pp)
            self.box("actor_update+critic_update", s.name, "train", env.now, d, s.gpus, k)
            yield env.timeout(d)
        else:
            for r in roles:
                d = costs.train[r].seconds
                self.box(TRAIN_STAGE[r], s.name, "train", env.now, d, s.gpus, k)
                yield env.timeout(d)
        pool.release(s.gpus)

    def sync(self, k: int, costs: PlanCosts):
        if self.pol.elastic:
            return  # workers load the new weights when they start (counted as their startup)
        s = self.plan.set_of("rollout")
        pool = self.pools[s.name]
        yield pool.acquire(s.gpus)
        self.box("weight_sync", s.name, "sync", self.env.now, costs.sync_seconds, s.gpus, k)
        yield self.env.timeout(costs.sync_seconds)
        pool.release(s.gpus)


def _copy(s: Seq) -> Seq:
    return Seq(s.id, s.prompt, s.target, s.group, s.done, s.prefilled)


def simulate(problem: Problem, plan: Plan, policy: Policy, iterations: int = 2) -> SimResult:
    """Simulate `iterations` RL steps of `plan` under `policy` and summarise them.

    Fused with `migrate_frac=None` tries each threshold of MIGRATE_GRID and keeps the
    fastest, as RLHFuse tunes its threshold per workload.
    """
    if policy.fused and policy.migrate_frac is None:
        runs = [simulate(problem, plan, replace(policy, migrate_frac=f), iterations) for f in MIGRATE_GRID]
        best = min(runs, key=lambda r: r.iteration_seconds)
        best.info["migrate_frac"] = best.info.get("migrate_frac")
        return best
    # Async needs a longer horizon: generation runs ahead, so the first steps fill the
    # pipeline and the last ones drain it; steady state is read between them.
    iterations = max(iterations, policy.staleness + 7) if policy.async_ else iterations
    run = _Run(problem, plan, policy, iterations)
    run.run()
    return _summarise(run, problem, plan, policy)


def _summarise(run: _Run, problem: Problem, plan: Plan, policy: Policy) -> SimResult:
    marks, k = run.marks, run.k
    if policy.async_:
        lo, hi = policy.staleness + 2, k - 2  # skip the fill (first steps) and the drain (last steps)
        iter_s = (marks[hi]["end"] - marks[lo]["end"]) / (hi - lo)
    else:
        iter_s = (marks[-1]["end"] - marks[0]["start"]) / k
    n = problem.workload.samples
    tokens = sum(float(run.batch(i)[0].response_lens.sum()) for i in range(k)) / k
    busy = sum(e.dur * e.gpus for e in run.events) / k
    if policy.elastic:
        rest = sum(e.dur * e.gpus for e in run.events if e.lane != "rollout-pool") / k
        gpu_s = run.rollout_billed / k + rest
    else:
        gpu_s = sum(s.gpus for s in plan.sets) * iter_s
    mean = lambda a, b: sum(m[b] - m[a] for m in marks) / k  # noqa: E731
    stages = {
        "generate": mean("start", "generate_end"),
        "gen_plus_inference": mean("start", "inference_end"),
        "train": mean("train_start", "train_end"),
        "weight_sync": mean("train_end", "end"),
    }
    run.info["migrate_frac"] = policy.migrate_frac if policy.fused else None
    return SimResult(
        policy=policy.name, iteration_seconds=iter_s, samples_per_second=n / iter_s,
        tokens_per_second=tokens / iter_s, gpu_seconds=gpu_s, gpu_busy_fraction=min(1.0, busy / gpu_s),
        gen_plus_inference_seconds=stages["gen_plus_inference"], stages=stages, events=run.events, info=run.info,
    )  # fmt: skip
