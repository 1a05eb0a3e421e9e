"""Rollout workers on threads: the mechanism that the fused and async strategies drive.

Each worker owns one rollout ``Engine`` and one thread. A worker with unfinished samples
decodes; a worker with none takes inference tasks from a shared queue, so a worker freed
by finishing its share early, or by migration, computes inference instead of idling.

Why threads and not one Ray process per core: the actor, reference and critic models live
in the controller's process on the ``local`` backend, and the engine shares the actor's
weights in place. torch releases the GIL inside its ops, so two threads with one intra-op
thread each keep both cores of this machine busy without copying models between processes.
The price is Python-level contention (scheduling, sampling) on the GIL: two rollout threads
decode the fusion benchmark's step in 0.38 s where one takes 0.30 s. Processes were measured
too: sequential PPO on Ray with dp=2 per role ran at 86.6 samples/s against 121.9 on these
threads (``docs/benchmarks.md``, "Fusion and async"). Large activations also cost threads
more than processes: two models each taking six forward+backward+Adam steps of the tiny model
on 128 x 100 tokens ran 1.22x faster as two threads than one after the other, but about 1.75x
as two processes; forward+backward alone on 32 x 100 tokens reached 1.95x as two threads
(2-core machine, one intra-op thread each).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future

import torch

from fuseflow.controller.group import WorkerFailure, first_line
from fuseflow.controller.priority import set_background
from fuseflow.policy.migration import MigrationPlan, PendingSample, WorkerBudget
from fuseflow.rollout.base import RolloutRequest, Sample
from fuseflow.rollout.engine import Engine, EngineConfig

POLL_S = 0.002  # how long an idle worker waits for a task before looking at its engine again


class TaskQueue:
    """Inference tasks (callables) for whichever thread is free; ``close`` ends the step's supply.

    A thread blocked in ``take`` wakes the moment a task arrives or the queue is closed, so the
    threads that carry the step's last tasks end with it rather than at their next timeout.
    """

    def __init__(self) -> None:
        self._tasks: deque[tuple[Callable[[], object], Future]] = deque()
        self._cv = threading.Condition()
        self._closed = False

    def submit(self, fn: Callable[[], object]) -> Future:
        """Queue ``fn`` for the next free thread and wake one waiting in ``take``; returns the future that gets
        its result or its error."""
        fut: Future = Future()
        with self._cv:
            self._tasks.append((fn, fut))
            self._cv.notify()
        return fut

    def close(self) -> None:
        """No more tasks come this step: threads waiting in ``take`` return at once."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    def run_one(self, timeout: float = 0.0) -> bool:
        """Run one pending task on this thread; False when none came within ``timeout``."""
        task = self.take(timeout)
        if task is None:
            return False
        run_task(task)
        return True

    def take(self, timeout: float = 0.0) -> tuple[Callable[[], object], Future] | None:
        """The next pending task (``run_task`` runs it), or None when none came within ``timeout`` or the
        queue is closed and empty."""
        with self._cv:
            if timeout > 0:
                self._cv.wait_for(lambda: self._tasks or self._closed, timeout)
            return self._tasks.popleft() if self._tasks else None

    @property
    def closed(self) -> bool:
        """Whether ``close`` was called (tasks queued before it may still wait)."""
        return self._closed

    def empty(self) -> bool:
        """Whether no task waits for a thread (a task a thread has taken no longer counts, even while it runs)."""
        return not self._tasks

    def pending(self) -> int:
        """Tasks waiting for a thread."""
        return len(self._tasks)


def run_task(task: tuple[Callable[[], object], Future]) -> None:
    """Run one task taken from a ``TaskQueue``; its result or error goes to its future."""
    fn, fut = task
    try:
        fut.set_result(fn())
    except BaseException as e:  # handed to whoever waits on the future
        fut.set_exception(e)


class RolloutPool:
    """``n`` rollout workers over one model (the actor's own weights, or a rollout copy in async mode).

    ``tracks[i]`` is worker ``i``'s trace track; ``generate`` spans and ``inference`` spans
    land there, so Perfetto shows per worker when it decoded, when it ran inference and
    when it sat idle.
    """

    def __init__(self, model: torch.nn.Module, n: int, config: EngineConfig, tokenizer, tracer, first_track: int,
                 make_engine: Callable[[torch.nn.Module], Engine] | None = None):
        if n < 1:
            raise ValueError(f"schedule.rollout_workers must be >= 1, got {n}")
        self.model, self.config, self.tracer = model, config, tracer
        # make_engine: another backend with the engine's interface (rollout.backend=vllm); default fuseflow's.
        self.engines = [make_engine(model) if make_engine else Engine(model, config, tokenizer=tokenizer)
                        for _ in range(n)]
        self.sync_metrics: dict[str, float] = {}  # the last update_weights' (backends that copy weights)
        self.tracks = [first_track + i for i in range(n)]
        for i, t in enumerate(self.tracks):
            tracer.name_track(t, f"rollout-{i}")
        self.migrated = 0
        self.errors: dict[int, BaseException] = {}  # worker -> the error that ended its thread
        self._background: set[int] = set()  # native ids of running workers started in the background
        self._bg_lock = threading.Lock()
        # Elastic: which workers hold a thread now, and (worker, start, end) of every thread that ended:
        # a worker is held (billed) from its thread's start to its end.
        self.live: dict[int, threading.Thread] = {}
        self.held: list[tuple[int, float, float]] = []
        self._live_lock = threading.Lock()
        # (live rows, seconds) of recent engine steps: what the elastic rule fits its decode cost to.
        self.step_log: deque[tuple[int, float]] = deque(maxlen=4096)
        self._args: tuple | None = None  # the running step's (step, on_sample, tasks, background, release_when_idle)

    def __len__(self) -> int:
        return len(self.engines)

    def lendable_cores(self) -> dict[str, int]:
        """None to lend to worker processes: these workers are this process's threads (the strategy sets them)."""
        return {}

    threaded = True  # workers are threads of the controller (the Ray pool's are processes)

    def update_weights(self, version: int) -> None:
        """The weights changed in place (or were copied in): stamp the version, drop stale prefix KV."""
        for e in self.engines:
            e.update_weights(version)
        self.sync_metrics = dict(getattr(self.engines[0], "sync_metrics", {}))

    @property
    def policy_version(self) -> int:
        """The weights' version the engines hold."""
        return self.engines[0].policy_version

    def set_weights(self, version: int, source: Callable[[], dict] | None = None) -> int:
        """Move the engines to ``version``: shared weights need only the stamp; a copy (async) takes
        ``source()``'s tensors in place. Returns the bytes copied."""
        copied = 0
        if source is not None:
            with torch.no_grad():
                src = source()
                for k, v in self.model.state_dict().items():
                    v.copy_(src[k])
                    copied += v.numel() * v.element_size()
        self.update_weights(version)
        return copied

    def idle_live(self) -> int:
        """Held workers whose engine has nothing to decode (they take inference tasks)."""
        return sum(1 for i in list(self.live) if not self.engines[i].has_unfinished())

    # ------------------------------------------------------------------ one step's generation
    def run(self, step: int, shards: list[list[RolloutRequest]], on_sample: Callable[[int, Sample], None],
            tasks: TaskQueue, background: bool = False, release_when_idle: bool = False) -> None:
        """Start the workers on their shards; each calls ``on_sample(worker, sample)`` as samples finish.

        Reserved workers (the default) all start, run inference tasks whenever their engine is
        idle, and stop once ``tasks`` is closed and drained and their engine has nothing left
        (migration may hand them more). With ``release_when_idle`` (elastic) only workers with a
        non-empty shard start, and each ends (is released) as soon as its engine is idle and no
        task is waiting; ``serve`` and ``migrate`` start workers again when work comes.
        ``background`` starts them under ``SCHED_IDLE`` (see ``set_background``): work that runs
        beside training (async prefetch) then yields the CPU to it until ``restore_priority``.
        """
        if len(shards) != len(self.engines):
            raise ValueError(f"{len(shards)} request shards for {len(self.engines)} rollout workers")
        for engine, shard in zip(self.engines, shards, strict=True):
            for r in shard:
                engine.add(r)
        self._args = (step, on_sample, tasks, background, release_when_idle)
        for i, shard in enumerate(shards):
            if shard or not release_when_idle:
                self._start(i)

    def serve(self, k: int) -> None:
        """Elastic: start up to ``k`` more workers (idle engines) to run the waiting inference tasks."""
        with self._live_lock:
            free = [i for i in range(len(self.engines)) if i not in self.live]
        for i in free[:max(0, k)]:
            self._start(i)

    def busy_workers(self) -> int:
        """Workers whose thread runs now."""
        with self._live_lock:
            return len(self.live)

    def join(self) -> None:
        """Wait until every worker thread of the step has ended."""
        while True:
            with self._live_lock:
                threads = list(self.live.values())
            if not threads:
                return
            for th in threads:
                th.join()

    def _start(self, i: int) -> None:
        with self._live_lock:
            if i in self.live:
                return
            th = threading.Thread(target=self._loop, args=(i, *self._args), daemon=True, name=f"rollout-{i}")
            self.live[i] = th
        th.start()

    def restore_priority(self) -> None:
        """Training ended: running background workers go back to normal scheduling (if the OS allows),
        so the rest of their generation no longer yields to other processes on the machine."""
        with self._bg_lock:
            for tid in list(self._background):
                if set_background(tid, False):
                    self._background.discard(tid)

    def _loop(self, i: int, step: int, on_sample, tasks: TaskQueue, background: bool = False,
              release_when_idle: bool = False) -> None:
        tid, t0 = threading.get_native_id(), time.perf_counter()
        if background and set_background(tid, True):
            with self._bg_lock:
                self._background.add(tid)
        try:
            self._work(i, step, on_sample, tasks, release_when_idle)
        except BaseException as e:  # noqa: BLE001 - kept for the controller, which raises it (check_alive)
            self.errors[i] = e
            tasks.close()  # the step is lost: the other workers finish what they hold and end
            with self._live_lock:
                self.live.pop(i, None)
        finally:
            with self._bg_lock:
                self._background.discard(tid)
            self.held.append((i, t0, time.perf_counter()))

    def _work(self, i: int, step: int, on_sample, tasks: TaskQueue, release_when_idle: bool) -> None:
        engine, track = self.engines[i], self.tracks[i]
        while True:
            if engine.has_unfinished():
                with self.tracer.span("generate", step, track=track):
                    while engine.has_unfinished():
                        rows, t0 = engine.running_rows(), time.perf_counter()
                        done = engine.step()
                        self.step_log.append((rows, time.perf_counter() - t0))
                        for s in done:
                            self.tracer.instant("sample_done", step, track=track, uid=s.uid)
                            on_sample(i, s)
                continue
            with self._live_lock:  # leaving and migrate's hand-over are atomic: no sample is left unrun
                if (tasks.empty() and (release_when_idle or tasks.closed)
                        and not engine.has_unfinished()):
                    self.live.pop(i, None)
                    return
            t0 = time.perf_counter()
            if tasks.run_one(POLL_S):
                self.tracer.record("inference", step, track, t0, time.perf_counter())

    def check_alive(self, step: int) -> None:
        """Raise the error of a worker whose thread died, naming the worker.

        Why: the surviving workers keep polling for tasks, so waiting for samples alone would
        hang until the step's timeout; the controller calls this while it waits.
        """
        if self.errors:
            i = min(self.errors)
            e = self.errors[i]
            # One line, as a replica process's failure on Ray: the runner adds the last checkpoint.
            cause = e.cause if isinstance(e, WorkerFailure) else f"{type(e).__name__}: {first_line(e)}"
            raise WorkerFailure("rollout", i, "step", cause, f"trace track rollout-{i}, step {step}") from e

    # ------------------------------------------------------------------ migration
    def pending(self) -> dict[int, list[PendingSample]]:
        """Unfinished samples per worker, with their KV held now and tokens still allowed."""
        out: dict[int, list[PendingSample]] = {}
        for i, e in enumerate(self.engines):
            out[i] = [PendingSample(*row) for row in e.pending_samples()]
        return out

    def budgets(self) -> dict[int, WorkerBudget]:
        """Each worker's capacity for the migration plan, by worker index: ``max_num_seqs`` sequence slots and
        its engine's KV-cache capacity in tokens."""
        c = self.config
        return {i: WorkerBudget(c.max_num_seqs, e.kv_capacity_tokens()) for i, e in enumerate(self.engines)}

    def migrate(self, plan: MigrationPlan, step: int) -> int:
        """Abort the moved samples on their sources and resume them on their targets; returns how many moved.

        The exported state carries the sampling generator, so a moved sample draws the same
        tokens as it would have where it started.
        """
        moved = 0
        by_src: dict[int, dict[int, int]] = {}
        for m in plan.moves:
            by_src.setdefault(m.src, {})[m.uid] = m.dst
        for src, dests in by_src.items():
            for state in self.engines[src].abort(dests):
                dst = dests[state.uid]
                with self._live_lock:
                    self.engines[dst].add(state)
                    idle = dst not in self.live
                if idle and self._args is not None and self._args[-1]:  # elastic: a released worker is
                    self._start(dst)  # taken again for the samples it receives
                moved += 1
        if moved:
            self.tracer.instant("migrate", step, track=self.tracks[0], moved=moved, freed=list(plan.freed))
        self.migrated += moved
        return moved
