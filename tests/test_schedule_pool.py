"""Units of the rollout pools' machinery: the inference task queue's wake-ups, a Ray replica's log-prob
call freeing the replica when its result is ready, and a replica that comes free taking over log-probs
still waiting in the roles' lane."""

import threading
import time
from concurrent.futures import Future
from types import SimpleNamespace

import torch

from fuseflow.controller.host import Withdrawn, WorkerHost
from fuseflow.schedule.pool import TaskQueue
from fuseflow.schedule.ray_pool import RayRolloutPool, _Scored, _Stealable
from fuseflow.telemetry import Tracer


def test_a_thread_waiting_for_a_task_wakes_when_one_arrives_or_the_queue_closes():
    tasks, got = TaskQueue(), []
    waiter = threading.Thread(target=lambda: got.append(tasks.take(30.0)))
    waiter.start()
    tasks.submit(lambda: 1)
    waiter.join(5.0)
    assert not waiter.is_alive() and got[0] is not None
    waiter = threading.Thread(target=lambda: got.append(tasks.take(30.0)))
    waiter.start()
    t0 = time.perf_counter()
    tasks.close()
    waiter.join(5.0)
    assert not waiter.is_alive() and got[1] is None and time.perf_counter() - t0 < 1.0
    assert tasks.closed and tasks.empty()


def test_a_replica_scores_again_once_its_log_probs_are_ready_not_when_they_are_collected():
    """A dispatcher collects a replica's log-probs only after the micro-batch's reward returns from the
    roles' process; the replica must take the next micro-batch before that, and bill only its compute."""
    class Ref:
        def __init__(self):
            self.fut = Future()

        def future(self):
            return self.fut

    ref = Ref()
    pool = SimpleNamespace(_lock=threading.Lock(), _scoring={1}, held=[], tracer=Tracer(), tracks=[1, 2], scored=0,
                           scored_ref=0, replicas=SimpleNamespace(get=lambda i, r, m: (torch.ones(1, 2).numpy(), 0.1)),
                           _steal_soon=lambda: None)
    scored = _Scored(pool, 1, step=3, ref=ref)
    assert pool._scoring == {1} and not pool.held  # computing
    ref.fut.set_result(None)  # Ray has the result; nobody collected it yet
    assert pool._scoring == set() and len(pool.held) == 1
    assert [e["name"] for e in pool.tracer.events] == ["inference"]
    assert scored.result().tolist() == [[1.0, 1.0]] and pool.scored == 1
    assert len(pool.held) == 1 and len(pool.tracer.events) == 1  # billed and traced once


def test_a_call_withdrawn_before_it_starts_never_computes_and_a_started_one_cannot_be_withdrawn():
    host, ran = WorkerHost("roles", 0, 1), []
    host.roles["reference"] = SimpleNamespace(compute_logprobs=lambda x: ran.append(x) or x)
    assert host.withdraw(5, "background")
    out, seconds, _cpu = host.call("reference", "compute_logprobs", (1,), {}, ticket=5, lane="background")
    assert isinstance(out, Withdrawn) and seconds == 0.0 and ran == []
    assert host.call("reference", "compute_logprobs", (2,), {}, ticket=7, lane="background")[0] == 2 and ran == [2]
    assert not host.withdraw(7, "background")  # it ran
    assert not host.withdraw(6, "background")  # a later ticket of its lane started: it may have too
    assert host.withdraw(6, "serial")  # another lane's tickets say nothing about this one
    assert host.call("reference", "compute_logprobs", (3,), {}, ticket=9)[0] == 3  # no withdrawal: it runs


class _Ref:
    """A Ray ObjectRef stand-in: its ``future()`` resolves when the test says the result is ready."""

    def __init__(self, value):
        self.value, self.fut = value, Future()

    def future(self):
        return self.fut


class _Lane:
    """A roles' lane call that may be withdrawn (``started``: it no longer can)."""

    def __init__(self, value, started: bool):
        self.value, self.started, self.asked = value, started, 0

    def withdraw(self) -> bool:
        self.asked += 1
        return not self.started

    def result(self):
        return self.value if self.started else Withdrawn()

    def done(self) -> bool:
        return self.started


class _Replicas:
    def __init__(self, n: int):
        self.config, self.version, self.scores, self.scores_reference = None, 0, True, True
        self.started: list[tuple[int, bool, _Ref]] = []
        self.handles = [SimpleNamespace(compute_logprobs=SimpleNamespace(remote=lambda wire, ref, i=i: self._start(i, ref)),
                                        step_log=SimpleNamespace(remote=lambda i=i: [(i, 0.5)]))
                        for i in range(n)]

    def __len__(self) -> int:
        return len(self.handles)

    def _start(self, i: int, reference: bool) -> _Ref:
        self.started.append((i, reference, _Ref(torch.full((1, 2), float(i)).numpy())))
        return self.started[-1][2]

    def get(self, i, ref, method):
        return ref if method == "step_log" else (ref.value, 0.01)


def test_a_replica_that_comes_free_takes_over_the_newest_log_probs_waiting_in_the_roles_lane():
    replicas = _Replicas(2)
    pool = RayRolloutPool(replicas, actor=None, tracer=Tracer(), first_track=1)
    pool._args = (3, None, None, False)  # a foreground generation
    pool.live = {0: 1, 1: 1}  # both replicas decode: the log-probs go to the roles' lane
    batch = SimpleNamespace()  # to_wire passes it through
    older, newer = _Lane(torch.zeros(1, 2), started=True), _Lane(None, started=False)
    ref = pool.logprobs_future(batch, reference=True, lane=lambda b: older)
    old = pool.logprobs_future(batch, lane=lambda b: newer)
    assert isinstance(ref, _Stealable) and isinstance(old, _Stealable) and replicas.started == []

    del pool.live[1]  # replica 1's stream ends
    pool._steal_soon()
    pool.join()
    # The newest waiting call moved to replica 1; the older one stays: replica 0 still decodes.
    assert newer.asked == 1 and older.asked == 0 and [(i, r) for i, r, _ in replicas.started] == [(1, False)]
    assert pool._scoring == {1} and pool.stolen == 1
    replicas.started[0][2].fut.set_result(None)  # its result is ready: replica 1 is free again
    pool.join()
    # Replica 1 asked for the older call, which had started in the lane: it stays there.
    assert older.asked == 1 and pool._scoring == set() and len(replicas.started) == 1
    assert old.result().tolist() == [[1.0, 1.0]] and ref.result().tolist() == [[0.0, 0.0]]
    assert pool.scored == 1 and pool.scored_ref == 0
    assert list(pool.step_log) == [(0, 0.5), (1, 0.5)] * 2  # both joins' engine steps, read when asked for


def test_a_background_generation_leaves_log_probs_in_the_lane():
    pool = RayRolloutPool(_Replicas(1), actor=None, tracer=Tracer(), first_track=1)
    pool._args = (3, None, None, True)  # a prefetch: training holds the cores
    pool.live = {0: 1}
    lane = _Lane(torch.zeros(1, 2), started=False)
    assert pool.logprobs_future(SimpleNamespace(), reference=True, lane=lambda b: lane) is lane


class _StepEngine:
    """An engine whose steps finish the given uids (a list per step); a step marked "boom" raises. Each step
    waits until the test lets it go, so the test decides what has finished when the stream reads."""

    def __init__(self, steps):
        self.steps, self.model = list(steps), torch.nn.Linear(1, 1)
        self.go = threading.Semaphore(0)
        self.ran = 0

    def add(self, request):
        pass

    def has_unfinished(self):
        return bool(self.steps)

    def running_rows(self):
        return 1

    def step(self):
        self.go.acquire()
        self.ran += 1
        uids = self.steps.pop(0)
        if uids == "boom":
            raise RuntimeError("engine failed")
        return [SimpleNamespace(uid=u) for u in uids]


def _drain(stream, engine, steps_before_read):
    """Let ``steps_before_read[k]`` engine steps run before the stream's k-th read; the uids of each item.
    (The decode thread starts at the first read, and the steps after those let go block: the first
    item holds the first ``steps_before_read[0]`` steps' samples, whenever it is read.)"""
    items, target = [], 0
    for k, n in enumerate(steps_before_read):
        target += n
        for _ in range(n):
            engine.go.release()
        deadline = time.perf_counter() + 10
        while k and engine.ran < target and time.perf_counter() < deadline:
            time.sleep(0.001)
        time.sleep(0.05)  # the last step's samples reach the queue
        items.append([s.uid for s in next(stream)])
    return items


def test_a_replica_stream_sends_every_sample_finished_since_its_last_item_in_one_item():
    from fuseflow.controller.replica import RolloutReplica

    engine = _StepEngine([[0, 1], [], [2], [3, 4], [5]])
    replica = RolloutReplica(lambda: engine, 0)
    stream = replica.stream([])
    # Step 1 finishes two samples: one item. Steps 2-4 run before the next read: 2, 3 and 4 in one item.
    assert _drain(stream, engine, [1, 3, 1]) == [[0, 1], [2, 3, 4], [5]]
    assert next(stream, None) is None  # the engine ran dry: the stream ends
    assert not replica._running


def test_a_replica_stream_yields_what_finished_before_its_engine_failed_then_raises():
    from fuseflow.controller.replica import RolloutReplica

    engine = _StepEngine([[0], [1], "boom"])
    replica = RolloutReplica(lambda: engine, 0)
    stream = replica.stream([])
    assert _drain(stream, engine, [1, 2]) == [[0], [1]]  # the failing step came with sample 1's
    try:
        next(stream)
    except RuntimeError as e:
        assert "engine failed" in str(e)
    else:
        raise AssertionError("the engine's error did not reach the stream")


def test_a_foreground_generation_sends_a_partial_micro_batch_only_when_a_replica_is_free():
    """While every replica decodes, a partial micro-batch would only wait in the roles' idle lane (the step's
    first sample went out alone that way); it goes once a replica has nothing to decode or score. A prefetch
    keeps the dispatchers' count: its replicas never take the old log-probs."""
    pool = RayRolloutPool(_Replicas(2), actor=None, tracer=Tracer(), first_track=1)
    pool._dispatchers = 2
    pool._args = (3, None, None, False)
    pool.live = {0: 1, 1: 1}
    assert pool.idle_live() == 0
    del pool.live[1]  # replica 1's share is done
    assert pool.idle_live() == 1
    pool._scoring.add(1)  # ... and it scores a micro-batch
    assert pool.idle_live() == 0
    pool._scoring.clear()
    pool._busy_dispatchers = 1  # a micro-batch is in flight: what finishes meanwhile joins the next one
    assert pool.idle_live() == 0
    pool._busy_dispatchers, pool._args = 0, (3, None, None, True)
    pool.live = {0: 1, 1: 1}
    assert pool.idle_live() == 2


def test_the_critics_values_start_before_the_log_probs_a_replica_could_take():
    """On Ray the roles' lane runs calls in order: the values, which only it can compute, go first, so the
    log-probs queued behind them stay open to a replica that comes free."""
    from fuseflow.schedule.stages import Roles, Stages

    order = []

    def group(role, method):
        return SimpleNamespace(role=role, **{method: SimpleNamespace(future=lambda b: order.append(role))})

    stages = Stages.__new__(Stages)
    stages.roles = Roles(actor=group("actor", "compute_logprobs"), reference=group("reference", "compute_logprobs"),
                         reward=None, critics=[group("critic", "compute_values")])
    calls = stages.inference_calls(SimpleNamespace(), ("old_logprob", "reference", "reward", "critic"))
    assert list(calls) == ["values", "old_logprobs", "ref_logprobs"]
    for start in calls.values():
        start()
    assert order == ["critic", "actor", "reference"]


def test_a_replica_computes_log_probs_on_a_thread_of_its_own_under_sched_idle():
    """A free replica's log-probs yield the core to the other replica's decode and share what is left with
    the critic's values in the roles' idle lane; Ray's call thread keeps its normal priority."""
    import os

    import pytest

    from fuseflow.controller.replica import RolloutReplica

    if not hasattr(os, "SCHED_IDLE"):
        pytest.skip("SCHED_IDLE is Linux's")
    seen = []

    def score(batch):
        seen.append((threading.get_native_id(), os.sched_getscheduler(0)))
        return batch * 2

    scorer = SimpleNamespace(compute_logprobs=score)
    replica = RolloutReplica(lambda: (_StepEngine([]), scorer, scorer), 0)
    for reference in (False, True):
        out, _seconds = replica.compute_logprobs(torch.ones(2), reference)
        assert out.array.tolist() == [2.0, 2.0]
    (tid, policy), (tid2, _) = seen
    assert tid == tid2 != threading.get_native_id() and policy == os.SCHED_IDLE
    assert os.sched_getscheduler(0) != os.SCHED_IDLE


def test_join_waits_for_threads_spawned_while_it_joins_even_when_they_start_late(monkeypatch):
    """A log-prob result frees a replica on Ray's callback thread, which spawns a steal thread while the
    controller joins the pool: join must neither join it before it has started (``RuntimeError: cannot join
    thread before it is started``) nor return before it ends."""
    pool = RayRolloutPool(_Replicas(2), actor=None, tracer=Tracer(), first_track=1)
    real_start, ended = threading.Thread.start, []

    def slow_start(self):  # a thread that takes a while to start, as on a loaded machine
        if self.name == "late":
            time.sleep(0.2)
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", slow_start)
    pool._spawn(lambda: (time.sleep(0.1), ended.append("stream")), name="stream")

    def callback():  # not one of the pool's threads
        time.sleep(0.05)
        pool._spawn(lambda: (time.sleep(0.05), ended.append("late")), name="late")

    outside = threading.Thread(target=callback)
    real_start(outside)
    pool.join()
    outside.join()
    assert ended == ["stream", "late"]


def test_every_replica_and_the_roles_lane_can_each_have_an_inference_task_in_flight():
    """A dispatcher waits on its task's calls: with two replicas, three tasks run at once (one per replica and
    one for the roles' lane), so a replica that comes free gets the queued log-probs while another task still
    waits on the roles' lane. A fourth waits for a dispatcher."""
    pool = RayRolloutPool(_Replicas(2), actor=None, tracer=Tracer(), first_track=1)
    tasks, running, go, lock = TaskQueue(), [], threading.Event(), threading.Lock()

    def task(k):
        with lock:
            running.append(k)
        assert go.wait(10)
        return k

    futures = [tasks.submit(lambda k=k: task(k)) for k in range(4)]
    tasks.close()
    pool.run(3, [[], []], lambda w, s: None, tasks)
    deadline = time.monotonic() + 10
    while len(running) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # a fourth dispatcher, if there were one, would have taken the last task by now
    assert sorted(running) == [0, 1, 2]
    go.set()
    pool.join()
    assert [f.result() for f in futures] == [0, 1, 2, 3]
