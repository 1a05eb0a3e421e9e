"""The generation's receive loop (``schedule.streaming``) against fakes: no engine, no Ray.

``Feed`` decides which inference runs when (streamed micro-batches, partial hand-off, held critic
values behind the gate); ``receive`` takes the samples, triggers one migration in the tail and fails a
stuck or dead step with one line.
"""

import queue
import threading

import pytest

from fuseflow.policy.migration import PendingSample, WorkerBudget
from fuseflow.rollout.base import Sample
from fuseflow.schedule import streaming
from fuseflow.schedule.pool import TaskQueue
from fuseflow.schedule.streaming import Feed, by_length, receive
from fuseflow.schedule.updates import Gate


def _sample(uid: int, length: int, worker_tokens: int = 2) -> Sample:
    return Sample(uid, uid, [1] * worker_tokens, [2] * length, [0.0] * length, "stop")


def _feed(stream=("reference", "critic"), budget=100, idle=0, gate=None, held=(), served=None, foreground=None):
    tasks, calls = TaskQueue(), []
    feed = Feed(1, tasks, lambda group, names: calls.append(([x.uid for x in group], names)) or {}, stream, budget,
                lambda: idle, serve=served.append if served is not None else None, gate=gate, held=held,
                foreground=foreground or (lambda: None))
    return feed, tasks, calls


def _drain(tasks: TaskQueue) -> None:
    while tasks.run_one():
        pass


def test_a_closed_micro_batch_goes_to_inference_and_the_rest_waits_for_the_end():
    feed, tasks, calls = _feed(budget=40)  # rows x longest <= 40: two samples of 12+2 tokens fit, a third does not
    for uid in range(3):
        feed.add(_sample(uid, 12))
    _drain(tasks)
    assert calls == [([0, 1], ("reference", "critic"))]
    feed.finish([_sample(u, 12) for u in range(3)], after=("reference", "critic", "reward"))
    _drain(tasks)
    assert calls[1] == ([2], ("reference", "critic"))  # the last streamed micro-batch
    # not streamed: once every sample is in, in length-sorted micro-batches within the budget
    assert calls[2:] == [([0, 1], ("reward",)), ([2], ("reward",))]
    assert tasks.closed and len(feed.results) == 4


def test_an_idle_worker_gets_the_partial_micro_batch_only_when_nothing_else_waits():
    feed, tasks, calls = _feed(idle=0)
    feed.add(_sample(0, 5))
    assert tasks.empty()  # nobody idle: keep filling
    feed.idle_live = lambda: 1
    feed.add(_sample(1, 5))  # a worker is idle and nothing is queued: it gets what is there
    assert tasks.pending() == 1
    feed.add(_sample(2, 5))
    assert tasks.pending() == 1  # a task still waits: no second partial hand-off
    _drain(tasks)
    assert calls == [([0, 1], ("reference", "critic"))]


def test_held_stages_wait_for_the_gate_and_run_once_it_opens():
    gate, woke = Gate(), []
    feed, tasks, calls = _feed(budget=14, gate=gate, held=("critic",), foreground=lambda: woke.append(1))
    feed.add(_sample(0, 12))
    feed.add(_sample(1, 12))  # closes [0]: its reference now, its values held
    _drain(tasks)
    assert calls == [([0], ("reference",))] and feed.deferred
    feed.release()  # the gate is still shut: nothing changes
    assert not woke and feed.deferred
    gate.open(True)
    feed.release()
    _drain(tasks)
    assert woke == [1] and not feed.deferred and feed.gate is None
    assert calls[1] == ([0], ("critic",))
    feed.add(_sample(2, 12))  # after the gate: every stage at once
    _drain(tasks)
    assert calls[2] == ([1], ("reference", "critic"))


def test_finish_waits_for_the_gate_and_a_failed_update_stops_the_early_generation():
    gate = Gate()
    feed, tasks, calls = _feed(stream=("critic",), gate=gate, held=("critic",))
    feed.add(_sample(0, 5))
    threading.Timer(0.2, gate.open, args=(False,)).start()
    with pytest.raises(RuntimeError, match="step 1: an update of step 0 failed; its early generation stops"):
        feed.finish([_sample(0, 5)], after=("critic",))
    assert calls == []  # nothing ran without the critic's update


def test_an_elastic_feed_takes_back_workers_for_the_tasks_it_queues():
    served = []
    feed, _, _ = _feed(budget=14, idle=0, served=served)
    feed.add(_sample(0, 12))
    feed.add(_sample(1, 12))
    assert served == [1]


class _Pool:
    """Two workers; ``pending`` holds what each still decodes (as the rollout pool reports it)."""

    def __init__(self, pending=None, busy=2):
        self._pending, self.busy, self.migrated_with, self.checked, self.asked = pending or {}, busy, None, 0, 0
        self.queried = 0  # calls of ``pending`` (on Ray a round trip to every replica)

    def check_alive(self, step):
        self.checked += 1

    def busy_workers(self):
        return self.busy

    def pending(self):
        self.queried += 1
        return self._pending

    def budgets(self):
        return {0: WorkerBudget(4, 1000), 1: WorkerBudget(4, 1000)}

    def migrate(self, plan, step):
        self.asked += 1
        self.migrated_with = plan
        return len(plan.moves)


def test_receive_takes_every_sample_and_migrates_once_in_the_tail():
    arrived = queue.Queue()
    for w, uid in [(0, 0), (1, 1), (0, 2), (1, 3), (0, 4), (1, 5)]:
        arrived.put((w, _sample(uid, 5)))
    pool = _Pool({0: [PendingSample(9, 10, 20, 30)], 1: [PendingSample(8, 10, 20, 30)]})
    feed, _, _ = _feed()
    done, migrated, last = receive(pool, 1, 6, arrived, feed, [3, 3], threshold=0.5)
    assert [x.uid for x in done] == list(range(6))
    # At 3 of 6 left (threshold 0.5) both workers still decode: one migration, never a second ask after it.
    assert migrated == 1 and pool.asked == 1 and len(pool.migrated_with.moves) == 1
    assert set(last) == {0, 1}


def test_receive_stops_asking_once_one_worker_holds_every_unfinished_sample():
    """The workers run ahead of the samples the controller has taken: by its count both still decode, but
    the first answer shows one worker holding all that is left. Samples only leave workers during a
    generation, so no later answer can free one: one ask, no migration, where every later sample
    used to ask again (a round trip to every replica each, in the step's tail)."""
    arrived = queue.Queue()
    for w, uid in [(0, 0), (1, 1), (0, 2), (1, 3), (0, 4), (1, 5)]:
        arrived.put((w, _sample(uid, 5)))
    pool = _Pool({0: [], 1: [PendingSample(8, 10, 20, 30)]})
    feed, _, _ = _feed()
    done, migrated, _ = receive(pool, 1, 6, arrived, feed, [3, 3], threshold=0.5)
    assert [x.uid for x in done] == list(range(6))
    assert pool.queried == 1 and migrated == 0 and pool.asked == 0


def test_receive_fails_in_one_line_when_the_workers_stop():
    pool = _Pool(busy=0)
    feed, _, _ = _feed()
    with pytest.raises(RuntimeError, match=r"^step 1: rollout workers stopped with 2 of 2 samples unfinished$"):
        receive(pool, 1, 2, queue.Queue(), feed, [1, 1], threshold=None)
    assert pool.checked  # a dead worker's own error would have been raised first


def test_receive_fails_when_no_sample_comes_within_the_wait(monkeypatch):
    monkeypatch.setattr(streaming, "WAIT_S", 0.2)
    feed, _, _ = _feed()
    with pytest.raises(RuntimeError, match="rollout workers stopped with 1 of 1"):
        receive(_Pool(busy=2), 1, 1, queue.Queue(), feed, [1, 0], threshold=None)


def test_receive_releases_the_held_stages_when_the_gate_opens_mid_generation():
    gate, arrived = Gate(), queue.Queue()
    feed, tasks, calls = _feed(budget=14, gate=gate, held=("critic",))
    arrived.put((0, _sample(0, 12)))
    arrived.put((0, _sample(1, 12)))

    def later():
        gate.open(True)  # wakes the loop, which releases the held values before the last sample
        threading.Timer(0.2, arrived.put, args=((1, _sample(2, 12)),)).start()

    threading.Timer(0.2, later).start()
    done, _, _ = receive(_Pool(), 1, 3, arrived, feed, [2, 1], threshold=None)
    _drain(tasks)
    assert len(done) == 3
    assert ([0], ("critic",)) in calls and feed.gate is None


def test_by_length_sorts_and_cuts_by_the_budget():
    samples = [_sample(0, 30), _sample(1, 2), _sample(2, 28), _sample(3, 3)]
    assert [[x.uid for x in g] for g in by_length(samples, 64)] == [[1, 3], [2, 0]]
