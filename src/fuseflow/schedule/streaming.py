"""One generation's receive loop: finished samples become inference tasks while decoding goes on.

``Pooled._generate`` (``fuseflow.schedule.modes``) starts the rollout workers on their shards and
hands the rest here:

- ``Feed`` turns finished samples into inference tasks on the workers' queue: the streamed stages
  run per token-budget micro-batch as it closes (a worker that would sit idle gets the samples
  gathered so far), the remaining stages run once every sample is in, in length-sorted micro-batches.
  In an early start (fused on replica processes: the next step decodes while the critics still
  train) the ``held`` stages (critic values) of every micro-batch wait until the step's updates
  have ended (the ``Gate``), and the workers then leave the background.
- ``receive`` takes the samples as they finish and, once the unfinished ones drop to the migration
  threshold, asks the pool for a migration plan (``policy.migration``). A worker that stops, or no
  sample for ``WAIT_S`` seconds, fails the step with one line; it never hangs.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from concurrent.futures import Future

from fuseflow.policy.microbatch import TokenBudgetBatcher, group_by_length
from fuseflow.policy.migration import plan_migration, should_migrate, trigger_count
from fuseflow.rollout.base import Sample

from .pool import TaskQueue
from .updates import Gate

WAIT_S = 600.0  # longest wait for one sample before the step is declared stuck


class Feed:
    """A generation's inference tasks: ``add`` each finished sample, ``finish`` once all are in.

    ``infer(group, names)`` runs stages ``names`` on ``group``; ``stream`` are the stages run per
    micro-batch of at most ``budget`` tokens while decoding goes on; ``idle_live()`` counts the workers
    that would take a task now; ``serve(k)`` (elastic) takes back released workers for ``k`` tasks;
    ``gate``/``held`` as in the module docstring, with ``foreground()`` called once the gate opens.
    """

    def __init__(self, step: int, tasks: TaskQueue, infer: Callable[[list[Sample], tuple[str, ...]], dict],
                 stream: tuple[str, ...], budget: int, idle_live: Callable[[], int],
                 serve: Callable[[int], None] | None = None, gate: Gate | None = None, held: tuple[str, ...] = (),
                 foreground: Callable[[], None] = lambda: None):
        self.step, self.tasks, self.infer, self.stream, self.budget = step, tasks, infer, stream, budget
        self.idle_live, self.serve, self.gate, self.held, self.foreground = idle_live, serve, gate, held, foreground
        self.batcher: TokenBudgetBatcher[Sample] = TokenBudgetBatcher(budget)
        self.results: list[Future] = []
        self.deferred: list[list[Sample]] = []  # micro-batches whose ``held`` stages wait for the gate

    def submit(self, group: list[Sample], names: tuple[str, ...]) -> None:
        """Queue stages ``names`` on ``group`` (the held ones deferred while the gate is shut)."""
        if self.gate is not None and not self.gate.is_open() and any(x in self.held for x in names):
            self.deferred.append(group)
            names = tuple(x for x in names if x not in self.held)
            if not names:
                return
        self.results.append(self.tasks.submit(lambda: self.infer(group, names)))
        if self.serve is not None:
            self.serve(self.tasks.pending() - self.idle_live())  # take a released worker back for it

    def add(self, sample: Sample) -> None:
        """A sample finished: close its micro-batch, or hand a worker that would sit idle what is there."""
        if not self.stream:
            return
        closed = self.batcher.add(sample)
        if closed:
            self.submit(closed, self.stream)
        else:
            self.hand_partial()

    def hand_partial(self) -> None:
        """A worker would sit idle: hand it the samples gathered so far."""
        if self.stream and self.tasks.empty() and len(self.batcher) and self.idle_live():
            self.submit(self.batcher.take(), self.stream)

    def release(self) -> None:
        """Once the gate is open: full priority, and the held stages of the micro-batches that wait."""
        if self.gate is None or not self.gate.is_open():
            return
        if not self.gate.ok:
            raise RuntimeError(f"step {self.step}: an update of step {self.step - 1} failed; "
                               "its early generation stops")
        self.gate = None
        self.foreground()
        for group in self.deferred:
            self.submit(group, self.held)
        self.deferred.clear()

    def finish(self, done: list[Sample], after: tuple[str, ...]) -> None:
        """Every sample is in: the last streamed micro-batch, the held stages once the gate opens, then
        the stages of ``after`` not streamed, in length-sorted micro-batches; closes the task queue."""
        if self.stream and len(self.batcher):
            self.submit(self.batcher.take(), self.stream)
        if self.gate is not None:
            self.gate.wait()
            self.release()
        rest = tuple(x for x in after if x not in self.stream)
        if rest:
            for group in by_length(done, self.budget):
                self.submit(group, rest)
        self.tasks.close()


def receive(pool, step: int, n: int, arrived: queue.Queue, feed: Feed, left: list[int], threshold: float | None,
            help_one: Callable[[], bool] | None = None) -> tuple[list[Sample], int, dict[int, float]]:
    """Take ``n`` samples from ``arrived`` (``(worker, sample)``; ``None`` wakes the loop for the gate) and feed
    them to ``feed``; migrate once (``threshold``). ``left``: unfinished samples per worker. ``help_one``: the
    controller thread runs one inference task when it can (one rollout thread), polling instead of blocking.

    Returns the samples in finishing order, how many migrated and each worker's last finishing time."""
    done: list[Sample] = []
    migrated, last_finish = 0, {}
    settled = False  # an answer showed fewer than two workers decoding: no migration can free one now
    if feed.gate is not None:
        feed.gate.on_open(lambda: arrived.put(None))  # wakes the loop below
    deadline = time.perf_counter() + WAIT_S
    while len(done) < n:
        try:
            item = arrived.get_nowait() if help_one else arrived.get(timeout=0.05)
        except queue.Empty:
            pool.check_alive(step)
            feed.hand_partial()  # a worker may have come free with no new sample to prompt it
            if help_one is not None:
                if help_one():
                    continue
                time.sleep(0.001)
            if time.perf_counter() > deadline or pool.busy_workers() == 0:
                raise RuntimeError(f"step {step}: rollout workers stopped with {n - len(done)} of {n} samples "
                                   "unfinished") from None
            continue
        if item is None:
            feed.release()
            continue
        w, smp = item
        deadline = time.perf_counter() + WAIT_S
        done.append(smp)
        left[w] -= 1
        last_finish[w] = time.perf_counter()
        feed.add(smp)
        # Migration frees a worker only while two or more hold unfinished samples: otherwise asking them
        # (a round trip to every replica process, each answered between its engine steps) is skipped.
        # The workers run ahead of ``left`` (samples in flight to this loop): once an answer shows fewer
        # than two decoding, none will again in this generation (samples only leave a worker), so the
        # loop stops asking instead of asking again for every sample still in flight.
        if (threshold is not None and not migrated and not settled and n - len(done) <= trigger_count(n, threshold)
                and sum(k > 0 for k in left) > 1):
            pending, budgets = pool.pending(), pool.budgets()
            if sum(bool(v) for v in pending.values()) < 2:
                settled = True
            elif should_migrate(pending, budgets, n, threshold):
                migrated = pool.migrate(plan_migration(pending, budgets), step)
    return done, migrated, last_finish


def by_length(samples: list[Sample], budget: int) -> list[list[Sample]]:
    """Whole-batch inference micro-batches: samples sorted by length, cut by the token budget."""
    groups = group_by_length([len(x.prompt_ids) for x in samples], [len(x.response_ids) for x in samples], budget)
    return [[samples[i] for i in g] for g in groups]
