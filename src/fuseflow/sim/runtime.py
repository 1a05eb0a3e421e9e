"""The local runtime's step, composed from priced stages by the runtime's own scheduling rules.

`fuseflow sim calibrate` prices each stage of a real run (`calibrate.price_stages`); this
module puts those prices together the way `fuseflow.schedule.modes` runs them on the
`local` backend, so a `fused` or `async` run is predicted by what its strategy does rather
than by the sequential sum:

- **sequential** (one rollout worker): every stage one after another.
- **pooled** (`schedule.rollout_workers` threads): the prompt groups are split evenly over
  the workers (`Pooled._shards`); each worker decodes its shard (the decode model gives each
  sample's finish time). With `fused`, finished samples go into token-budget micro-batches
  as they arrive (`policy.microbatch.TokenBudgetBatcher`: a batch closes at the budget, and
  a partial one is handed over when nothing is queued and a worker is idle); otherwise the
  inference stages run after the last sample, on length-sorted micro-batches
  (`policy.microbatch.group_by_length`). Micro-batches go first-come first-served to the
  earliest free consumer: a worker once its shard is decoded, and, with one worker, the
  controller thread from the start (it helps as a second inference worker).
- **async** (`max_staleness >= 1`): the next step's generation and its frozen stages
  (reference, reward) run while this step trains; the step then waits for the trained-model
  stages (old log-probs, values) on the workers and for the longer of training and that
  generation. With `max_staleness = 0` nothing runs ahead and the step is the pooled one.

Two rules of the runtime are not replayed: migration of the long tail between workers
(its trigger needs per-sample lengths the metrics do not hold; the default preset's
responses are all the same length, so it never fires there) and elastic's choice of the
worker count, which is read from the run's `elastic/replicas` metric instead.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fuseflow.policy.microbatch import TokenBudgetBatcher, group_by_length

# Stages whose models never train: an async prefetch runs them with its generation.
FROZEN = ("reference", "reward")
# Stages that need the just-trained models: run by `Pooled._complete` after training.
TRAINED = ("old_logprob", "values")
INFERENCE = FROZEN + TRAINED


@dataclass(frozen=True)
class RuntimeMode:
    """What of `schedule` decides how a step's stages overlap on the local backend."""

    mode: str = "sequential"
    workers: int = 1
    max_staleness: int = 1

    @property
    def flags(self) -> set[str]:
        """The flags of `mode` (its '+'-separated parts, e.g. {'fused', 'async'}); empty for sequential."""
        return set() if self.mode == "sequential" else set(self.mode.split("+"))

    @property
    def pooled(self) -> bool:
        """Sequential with one rollout worker is the plain strategy; anything else runs on the pool."""
        return bool(self.flags) or self.workers > 1

    @property
    def fused(self) -> bool:
        """Whether inference micro-batches are formed from samples as they finish decoding."""
        return "fused" in self.flags

    @property
    def ahead(self) -> bool:
        """Whether the next step's generation runs while this step trains."""
        return "async" in self.flags and self.max_staleness >= 1


class Consumers:
    """Threads that take inference micro-batches first-come first-served (``TaskQueue``)."""

    def __init__(self, free_at: Sequence[float]):
        self.heap = [(t, i) for i, t in enumerate(free_at)]
        heapq.heapify(self.heap)
        self.latest_start = float("-inf")  # the latest start of a task submitted so far
        self.end = 0.0

    def submit(self, at: float, seconds: float) -> None:
        """Queue a task at time `at`; the earliest free consumer runs it."""
        free, i = heapq.heappop(self.heap)
        start = max(at, free)
        self.latest_start = max(self.latest_start, start)
        self.end = max(self.end, start + seconds)
        heapq.heappush(self.heap, (start + seconds, i))

    def pending(self, at: float) -> bool:
        """Whether a task submitted so far has not started by time `at` (O(1): only the latest start matters)."""
        return self.latest_start > at


def rollout_phase(
    finishes: Sequence[Sequence[tuple[int, float]]], width: Sequence[int], budget: int,
    chunk_seconds: Callable[[list[int], tuple[str, ...]], float], stream: tuple[str, ...],
    after: tuple[str, ...], helper: bool,
) -> float:  # fmt: skip
    """Seconds from the rollout's start until every sample is decoded and its stages have run.

    `finishes[w]` holds worker w's (sample, finish seconds) pairs; `width[i]` is sample i's
    tokens (prompt + response); `chunk_seconds(rows, names)` prices the stages `names` on one
    micro-batch. Stages in `stream` run on micro-batches as samples arrive, stages in `after`
    (and not streamed) once all have arrived. `helper`: the controller thread takes tasks too.
    """
    ends = [max((t for _, t in f), default=0.0) for f in finishes]
    pool = Consumers(ends + ([0.0] if helper else []))
    arrivals = sorted((t, i) for f in finishes for i, t in f)
    last = arrivals[-1][0] if arrivals else 0.0
    if stream:
        batcher: TokenBudgetBatcher[int] = TokenBudgetBatcher(budget, length=lambda i: int(width[i]))
        for t, i in arrivals:
            closed = batcher.add(i)
            if closed:
                pool.submit(t, chunk_seconds(closed, stream))
            elif not pool.pending(t) and len(batcher) and any(e <= t for e in ends):
                rows = batcher.take()  # a worker would sit idle: hand it what there is
                pool.submit(t, chunk_seconds(rows, stream))
        if len(batcher):
            rows = batcher.take()
            pool.submit(last, chunk_seconds(rows, stream))
    rest = tuple(x for x in after if x not in stream)
    if rest and arrivals:
        order = [i for _, i in arrivals]
        for group in group_by_length([0] * len(order), [int(width[i]) for i in order], budget):
            pool.submit(last, chunk_seconds([order[g] for g in group], rest))
    return max(last, pool.end)


def by_length_seconds(n: int, width: Sequence[int], budget: int, workers: int,
                      chunk_seconds: Callable[[list[int], tuple[str, ...]], float], names: tuple[str, ...]) -> float:
    """Seconds of `names` on all `n` samples as length-sorted micro-batches on `workers` idle workers."""
    if not names or n == 0:
        return 0.0
    pool = Consumers([0.0] * max(1, workers))
    for group in group_by_length([0] * n, [int(w) for w in width], budget):
        pool.submit(0.0, chunk_seconds(group, names))
    return pool.end


def step_seconds(
    mode: RuntimeMode, priced: dict[str, float], finishes: Sequence[Sequence[tuple[int, float]]],
    width: Sequence[int], budget: int, chunk_seconds: Callable[[list[int], tuple[str, ...]], float],
) -> float:  # fmt: skip
    """One steady-state step of `mode` on the local backend, from its priced stages.

    `priced` holds whole-batch stage seconds (`calibrate.price_stages`); the rollout is
    replayed from `finishes` (per worker) with micro-batches priced by `chunk_seconds`.
    Example: sequential is ``sum(priced.values())``.
    """
    if not mode.pooled:
        return sum(priced.values())
    names = tuple(x for x in INFERENCE if x in priced)
    serial = sum(priced.get(x, 0.0) for x in ("advantages", "critic_update", "actor_update", "weight_sync"))
    if mode.ahead:
        frozen = tuple(x for x in names if x in FROZEN)
        gen = rollout_phase(finishes, width, budget, chunk_seconds, frozen if mode.fused else (), frozen, helper=False)
        trained = tuple(x for x in names if x in TRAINED)
        complete = by_length_seconds(len(width), width, budget, len(finishes), chunk_seconds, trained)
        return complete + max(gen, serial)
    phase = rollout_phase(finishes, width, budget, chunk_seconds, names if mode.fused else (), names,
                          helper=len(finishes) == 1)  # fmt: skip
    return phase + serial
