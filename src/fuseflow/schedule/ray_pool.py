"""Rollout replicas on Ray behind the same interface as the threaded ``RolloutPool``.

The pooled strategies (``fuseflow.schedule.modes``) call ``run``, ``migrate``, ``pending``,
``join``, ``set_weights`` ... and cannot tell which pool they drive. Here each worker is a
replica process (``fuseflow.controller.replica``) with its own engine and weights copy:

- ``run`` starts one Ray streaming generator per replica with a shard; a controller thread per
  stream blocks on its next item (the samples finished since the last; no polling) and hands each
  sample on as it arrives. A stream ends
  when its engine runs dry: the replica is then released (elastic bills held time per stream).
- Inference tasks (``TaskQueue``) run on a few controller threads that only wait on the
  inference groups' Ray futures; the models live in the inference roles' processes, so a micro-batch
  goes out the moment it fills, whatever the replicas are doing (streamed and prefetch micro-batches
  run in those processes' background lane, on cores the decode and training leave idle; see
  ``controller.group.background``). A replica with nothing to decode
  takes the stages its models can run: the old log-probs (``logprobs_future``) while its
  weights are the actor's, and the reference log-probs (a frozen copy it loaded once); the
  critic and the reward stay in the roles' processes. Log-probs sent to a roles' lane because no
  replica was free are taken over by the next replica that comes free while they still wait there
  (``_Stealable``): at a fused step's end that lane holds the critic's values too, and is the tail.
- ``migrate`` aborts samples on their source replica and adds the exported ``PartialState`` to
  the target over Ray, starting a stream there if none runs.
- ``set_weights`` broadcasts the actor's weights from its rank-0 process (``ReplicaSet.sync``).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from fuseflow.controller.dispatch import from_wire, to_wire
from fuseflow.controller.group import Future
from fuseflow.controller.host import Withdrawn
from fuseflow.policy.migration import MigrationPlan, PendingSample, WorkerBudget
from fuseflow.rollout.base import RolloutRequest, Sample

from .pool import TaskQueue, run_task

TAKE_S = 0.05  # longest an idle dispatcher blocks on the task queue (a task or its closing wakes it at once)


def dispatchers(replicas: int) -> int:
    """Controller threads that carry a pool's inference tasks to the inference groups: one per replica plus
    one for the roles' lane, so that each can have a task in flight.

    A dispatcher waits on its task's calls. With two for two replicas (before 2026-11-28) both could wait
    on the roles' lane (a fused+async prefetch's streamed values) while the synced replicas had old
    log-probs queued for them: these started 32-148 ms after the decode ended (three traced steps), 12-19
    ms with three dispatchers, and five alternating pairs of 12-step fused+async runs were 1-5% faster
    with three (docs/ray_rollout.md, session 24).

    >>> dispatchers(2)
    3
    """
    return replicas + 1


class RayRolloutPool:
    """``ReplicaSet`` replicas as pool workers; ``actor`` is the actor group (the weights' source)."""

    threaded = False

    def __init__(self, replicas, actor, tracer, first_track: int):
        self.replicas, self.actor, self.tracer = replicas, actor, tracer
        self.config = replicas.config
        self.tracks = [first_track + i for i in range(len(replicas))]
        for i, t in enumerate(self.tracks):
            tracer.name_track(t, f"rollout-{i}")
        self.migrated = 0
        # The last sync's seconds and seconds per MB, and with vLLM replicas their push into vLLM
        # (`controller.replica.sync_metrics`); the strategy adds `time/rollout_weight_sync` and the MB.
        self.sync_metrics: dict[str, float] = {}
        self.errors: dict[int, BaseException] = {}
        self.live: dict[int, int] = {}  # replica -> streams running on it now
        self.held: list[tuple[int, float, float]] = []  # (replica, start, end) of every stream
        self._step_log: deque[tuple[int, float]] = deque(maxlen=4096)
        self._logs_asked: list = []  # the replicas' step_log calls of the last join, not read yet
        self.policy_version = replicas.version
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._busy_dispatchers = 0
        self._scoring: set[int] = set()  # replicas computing log-probs now
        self.scored = 0  # micro-batches whose old log-probs a replica computed
        self.scored_ref = 0  # ... and whose reference log-probs
        self._dispatchers = 0
        self._args: tuple | None = None  # (step, on_sample, tasks, background) of the running generation
        self._stealable: list[_Stealable] = []  # log-prob calls waiting in a roles' lane, oldest first
        self.stolen = 0  # of those, how many a replica took over

    def __len__(self) -> int:
        return len(self.replicas)

    def lendable_cores(self) -> dict[str, int]:
        """Cores per Ray node that the replicas leave to the roles' processes while they all sit idle
        (a sequential mode's updates; a fused step's inference once its generation has ended)."""
        return self.replicas.cores_by_node

    # ------------------------------------------------------------------ weights
    def set_weights(self, version: int, source: Callable[[], dict] | None = None) -> int:
        """Every replica takes the actor's current weights as ``version`` (``source`` is for in-process
        copies); returns the bytes each replica received."""
        sent, _seconds = self.replicas.sync(version, self.actor)
        self.sync_metrics = dict(self.replicas.sync_metrics)
        self.policy_version = version
        return sent

    # ------------------------------------------------------------------ one step's generation
    def run(self, step: int, shards: list[list[RolloutRequest]], on_sample: Callable[[int, Sample], None],
            tasks: TaskQueue, background: bool = False, release_when_idle: bool = False) -> None:
        """Stream each non-empty shard on its replica; dispatchers carry ``tasks`` until it is closed and drained."""
        if len(shards) != len(self):
            raise ValueError(f"{len(shards)} request shards for {len(self)} rollout replicas")
        self._args = (step, on_sample, tasks, background)
        with self._lock:
            self._stealable.clear()
        for i, shard in enumerate(shards):
            if shard:
                self._stream(i, shard)
        for _ in range(dispatchers(len(self))):
            self._spawn(self._dispatch, tasks, name="inference-dispatch")

    def serve(self, k: int) -> None:
        """Nothing to start: inference runs in the inference roles' processes, not on replicas."""

    def busy_workers(self) -> int:
        """Replicas streaming now."""
        with self._lock:
            return len(self.live)

    def idle_live(self) -> int:
        """How many would take a partial micro-batch now: 0 while one is in flight; else, in a foreground
        generation, the replicas with nothing to decode or score, and in a background one (an async
        prefetch) the waiting dispatchers.

        Why 0 while one flies: the inference roles' processes are busy, so finished samples had better
        wait and join one larger micro-batch than queue behind it in small ones (a Ray call per stage
        each); once the flight lands, what gathered meanwhile goes out together. Why free replicas in
        the foreground: while every replica decodes, the roles' background lane computes only on
        cores the decode leaves idle, so a partial micro-batch sent then just waits there. The step's
        first finished sample used to go out alone that way, four Ray calls and forwards for one
        sample; samples now gather until the token budget closes a micro-batch or a replica comes free.
        """
        with self._lock:
            if self._busy_dispatchers:
                return 0
            if self._args is not None and not self._args[3]:
                return len(self._free_replicas()) if self._dispatchers else 0
            return self._dispatchers

    def join(self) -> None:
        """Wait for the step's streams and dispatchers; collect the replicas' measured engine steps."""
        while True:
            with self._lock:  # every listed thread has started (``_spawn``); the list joined below is a copy,
                threads = [t for t in self._threads if t.is_alive()]  # since threads spawn more meanwhile
                self._threads = list(threads)
            if not threads:
                break
            for t in threads:
                t.join()
        if not self.errors:  # asked now, read when needed: no round trip between the step's end and training
            self._read_logs()
            self._logs_asked = [h.step_log.remote() for h in self.replicas.handles]

    @property
    def step_log(self) -> deque[tuple[int, float]]:
        """The replicas' measured engine steps, (rows, seconds) each, up to the last step's end."""
        self._read_logs()
        return self._step_log

    def _read_logs(self) -> None:
        asked, self._logs_asked = self._logs_asked, []
        for i, ref in enumerate(asked):
            self._step_log.extend(self.replicas.get(i, ref, "step_log"))

    def restore_priority(self) -> None:
        """Training ended: background decode threads in the replicas go back to normal priority."""
        self.replicas.call("restore_priority")

    def foreground(self) -> None:
        """The running generation leaves the background (an early start whose updates have ended): its
        replicas decode at normal priority, and partial micro-batches and stolen log-probs go by free
        replicas, as in a foreground generation."""
        with self._lock:
            if self._args is None or not self._args[3]:
                return
            self._args = (*self._args[:3], False)
        self.restore_priority()

    def check_alive(self, step: int) -> None:
        """Raise the first replica failure (a dead process, or its engine's error), naming the replica."""
        if self.errors:
            i = min(self.errors)
            raise self.replicas.failure(i, "stream", self.errors[i])

    def _stream(self, i: int, requests: list) -> None:
        step, on_sample, tasks, background = self._args
        gen = self.replicas.handles[i].stream.remote(requests, background)
        with self._lock:
            self.live[i] = self.live.get(i, 0) + 1
        self._spawn(self._consume, i, gen, step, on_sample, tasks, name=f"rollout-{i}")

    def _consume(self, i: int, gen, step: int, on_sample, tasks: TaskQueue) -> None:
        import ray

        t0 = time.perf_counter()
        try:
            with self.tracer.span("generate", step, track=self.tracks[i]):
                for ref in gen:  # blocks until the replica yields its next finished samples
                    for s in ray.get(ref):
                        self.tracer.instant("sample_done", step, track=self.tracks[i], uid=s.uid)
                        on_sample(i, s)
        except BaseException as e:  # noqa: BLE001 - the controller raises it (check_alive)
            self.errors[i] = e
            tasks.close()  # the step is lost: dispatchers finish what they hold and end
        finally:
            with self._lock:
                self.live[i] -= 1
                if not self.live[i]:
                    del self.live[i]
            self.held.append((i, t0, time.perf_counter()))
            self._steal_soon()

    def _dispatch(self, tasks: TaskQueue) -> None:
        with self._lock:
            self._dispatchers += 1
        try:
            while True:
                task = tasks.take(TAKE_S)
                if task is None:
                    if tasks.closed and tasks.empty():
                        return
                    continue
                with self._lock:
                    self._busy_dispatchers += 1
                try:
                    run_task(task)
                finally:
                    with self._lock:
                        self._busy_dispatchers -= 1
        finally:
            with self._lock:
                self._dispatchers -= 1

    def _spawn(self, fn, *args, name: str) -> None:
        """Start ``fn(*args)`` on a thread that ``join`` waits for. Started under the lock: ``join`` drops
        threads that are not alive, and joining one not yet started raises (``RuntimeError: cannot join
        thread before it is started``, twice in benchmark runs, when ``join`` iterated the very list that
        a thread then appended to)."""
        t = threading.Thread(target=fn, args=args, daemon=True, name=name)
        with self._lock:
            self._threads.append(t)
            t.start()

    def logprobs_future(self, batch, reference: bool = False,
                        lane: Callable[[object], Future] | None = None) -> Future | None:
        """Old log-probs of ``batch`` (``reference``: the reference's) started on a replica with nothing to
        decode or score. When every replica is busy: ``lane(batch)``, the actor's (or the reference
        group's) own call, which a replica that comes free takes over while it still waits in its lane
        (not in a background generation, whose replicas leave the cores to training); None without
        ``lane``. Old log-probs are only valid while the replicas hold the actor's current weights: the
        strategy checks the version; the reference never changes."""
        if not (self.replicas.scores_reference if reference else self.replicas.scores):
            return None
        with self._lock:
            free = self._free_replicas()
            if free:
                self._scoring.add(free[0])
        if free:
            return self._score(free[0], batch, reference)
        if lane is None:
            return None
        future = lane(batch)
        if future.withdraw is None or (self._args is not None and self._args[3]):
            return future
        waiting = _Stealable(batch, reference, future)
        with self._lock:
            self._stealable.append(waiting)
        return waiting

    def _free_replicas(self) -> list[int]:
        """Replicas with nothing to decode or score (call under the lock)."""
        return [i for i in range(len(self)) if i not in self.live and i not in self._scoring]

    def _score(self, i: int, batch, reference: bool) -> _Scored:
        """Start the log-probs on replica ``i`` (already marked as scoring)."""
        step = self._args[0] if self._args else 0
        return _Scored(self, i, step, self.replicas.handles[i].compute_logprobs.remote(to_wire(batch), reference),
                       reference)

    def _steal_soon(self) -> None:
        """A replica came free: let it take over log-probs still waiting in a roles' lane. On a thread of
        its own, since this runs on Ray's callback thread (which must not block) or a stream's."""
        with self._lock:
            if not self._stealable:
                return
        self._spawn(self._steal, name="steal")

    def _steal(self) -> None:
        """While a replica is free, withdraw the newest waiting log-prob call from its lane and start it on
        that replica. The newest first: a lane runs its calls in order, so it is the likeliest not to
        have started; once one has, the older ones in its lane have too, and the steal stops."""
        while True:
            with self._lock:
                free = self._free_replicas()
                if not free or not self._stealable:
                    return
                i, waiting = free[0], self._stealable.pop()
                self._scoring.add(i)
            try:
                withdrawn = waiting.lane.withdraw()
            except Exception:  # noqa: BLE001 - the lane's call goes on; its own result reports a failure
                withdrawn = False
            if not withdrawn:
                with self._lock:
                    self._scoring.discard(i)
                return
            try:
                waiting.take(self._score(i, waiting.batch, waiting.reference))
            except Exception as e:  # noqa: BLE001 - the withdrawn call must still end: its result raises this
                with self._lock:
                    self._scoring.discard(i)
                waiting.take(_Raises(e))
                return
            with self._lock:
                self.stolen += 1

    # ------------------------------------------------------------------ migration
    def pending(self) -> dict[int, list[PendingSample]]:
        """Unfinished samples per replica (one call to each)."""
        return dict(enumerate(self.replicas.call("pending")))

    def budgets(self) -> dict[int, WorkerBudget]:
        """Each replica's capacity for the migration plan, by replica index: ``max_num_seqs`` sequence slots and
        the KV-cache tokens its engine reported at start (``ReplicaSet.kv_tokens``; no call to the replicas)."""
        return {i: WorkerBudget(self.config.max_num_seqs, kv) for i, kv in enumerate(self.replicas.kv_tokens)}

    def migrate(self, plan: MigrationPlan, step: int) -> int:
        """Abort the moved samples on their source replicas and resume them on their targets (their
        ``PartialState`` travels over Ray: tokens, log-probs, sampler state); returns how many moved."""
        by_src: dict[int, dict[int, int]] = {}
        for m in plan.moves:
            by_src.setdefault(m.src, {})[m.uid] = m.dst
        exported = {src: self.replicas.handles[src].abort.remote(list(dests)) for src, dests in by_src.items()}
        by_dst: dict[int, list] = {}
        for src, ref in exported.items():
            for state in self.replicas.get(src, ref, "abort"):
                by_dst.setdefault(by_src[src][state.uid], []).append(state)
        moved = 0
        for dst, states in by_dst.items():
            running = self.replicas.get(dst, self.replicas.handles[dst].add.remote(states), "add")
            if not running:  # its stream ended: start one for the samples it received
                self._stream(dst, [])
            moved += len(states)
        if moved:
            self.tracer.instant("migrate", step, track=self.tracks[0], moved=moved, freed=list(plan.freed))
        self.migrated += moved
        return moved


class _Scored(Future):
    """A replica's log-probs in flight. The replica is free to score again the moment its result is
    ready, not when the caller collects it: a dispatcher collects only after the micro-batch's other
    calls (its reward, in the roles' background lane) have returned, which can be long after."""

    def __init__(self, pool: RayRolloutPool, i: int, step: int, ref, reference: bool = False):
        self.pool, self.i, self.step, self.ref, self.reference = pool, i, step, ref, reference
        self.refs = [ref]
        self._value: tuple | None = None
        self.t0 = time.perf_counter()
        self._freed = False  # read and set under the pool's lock
        ref.future().add_done_callback(lambda _f: self._free())

    def _free(self) -> None:
        """Runs once (on Ray's callback thread, or in ``result``): the replica takes work again."""
        with self.pool._lock:
            if self._freed:
                return
            self._freed = True
            self.pool._scoring.discard(self.i)
        t1 = time.perf_counter()
        self.pool.held.append((self.i, self.t0, t1))  # elastic bills a replica while it scores
        self.pool.tracer.record("inference", self.step, self.pool.tracks[self.i], self.t0, t1)
        self.pool._steal_soon()

    def done(self) -> bool:
        import ray

        return bool(ray.wait([self.ref], timeout=0)[0])

    def result(self):
        if self._value is None:
            try:
                out, _seconds = self.pool.replicas.get(self.i, self.ref, "compute_logprobs")
            finally:
                self._free()
            if self.reference:
                self.pool.scored_ref += 1
            else:
                self.pool.scored += 1
            self._value = (from_wire(out),)
        return self._value[0]


class _Stealable(Future):
    """Log-probs sent to a roles' lane (``lane``, a one-rank group call that can be withdrawn) that a
    replica may take over (``RayRolloutPool._steal``); the result is the lane's, or the replica's once
    the lane's call was withdrawn (it then never computes)."""

    def __init__(self, batch, reference: bool, lane: Future):
        self.batch, self.reference, self.lane = batch, reference, lane
        self.moved: Future | None = None
        self._taken = threading.Event()

    def take(self, moved: Future) -> None:
        """The lane's call was withdrawn: ``moved`` (a replica's) computes the result instead."""
        self.moved = moved
        self._taken.set()

    def done(self) -> bool:
        return self.moved.done() if self.moved is not None else self.lane.done()

    def result(self):
        if self.moved is None:
            out = self.lane.result()
            if not isinstance(out, Withdrawn):
                return out
            self._taken.wait()  # withdrawn: the steal is about to hand over the replica's call
        return self.moved.result()


class _Raises(Future):
    """A call that failed before it went out: its result raises the error."""

    def __init__(self, error: BaseException):
        self.error = error

    def done(self) -> bool:
        return True

    def result(self):
        raise self.error
