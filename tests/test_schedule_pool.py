"""Units of the rollout pools' machinery: the inference task queue's wake-ups, and a Ray replica's
log-prob call freeing the replica when its result is ready."""

import threading
import time
from concurrent.futures import Future
from types import SimpleNamespace

import torch

from fuseflow.schedule.pool import TaskQueue
from fuseflow.schedule.ray_pool import _Scored
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
                           scored_ref=0, replicas=SimpleNamespace(get=lambda i, r, m: (torch.ones(1, 2).numpy(), 0.1)))
    scored = _Scored(pool, 1, step=3, ref=ref)
    assert pool._scoring == {1} and not pool.held  # computing
    ref.fut.set_result(None)  # Ray has the result; nobody collected it yet
    assert pool._scoring == set() and len(pool.held) == 1
    assert [e["name"] for e in pool.tracer.events] == ["inference"]
    assert scored.result().tolist() == [[1.0, 1.0]] and pool.scored == 1
    assert len(pool.held) == 1 and len(pool.tracer.events) == 1  # billed and traced once
