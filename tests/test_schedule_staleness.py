"""Bounded staleness: admission gate, checker and histogram."""

from __future__ import annotations

import threading
import time

import pytest

from fuseflow.schedule.staleness import (
    StalenessError,
    StalenessGate,
    check_staleness,
    min_version_for,
    staleness_histogram,
    staleness_metrics,
    staleness_of,
)


def test_version_arithmetic():
    # Step s trains version s-1; with k=1 its samples may come from version s-2.
    assert min_version_for(1, 0) == 0 and min_version_for(5, 0) == 4 and min_version_for(5, 1) == 3
    assert staleness_of([4, 3, 4], step=5) == [0, 1, 0]
    with pytest.raises(StalenessError, match="newer than version 4"):
        staleness_of([5], step=5)
    with pytest.raises(ValueError, match="1-based"):
        min_version_for(0, 1)
    with pytest.raises(ValueError, match="max_staleness"):
        min_version_for(3, -1)


def test_checker_names_offending_samples():
    check_staleness([3, 4, 4], step=5, max_staleness=1)
    with pytest.raises(StalenessError, match=r"1 samples exceed schedule.max_staleness=1.*samples \[12\]"):
        check_staleness([3, 2, 4], step=5, max_staleness=1, uids=[11, 12, 13])
    with pytest.raises(StalenessError, match="max_staleness=0"):
        check_staleness([3], step=5, max_staleness=0)


def test_histogram_and_metrics():
    assert staleness_histogram([4, 3, 4, 4], step=5, max_staleness=2) == {0: 3, 1: 1, 2: 0}
    assert staleness_histogram([1], step=5, max_staleness=1) == {0: 0, 1: 0, 3: 1}  # violations stay visible
    m = staleness_metrics([4, 3, 4, 4], step=5, max_staleness=1)
    assert m == {"async/staleness_frac_0": 0.75, "async/staleness_frac_1": 0.25,
                 "async/staleness_mean": 0.25, "async/staleness_max": 1.0}
    assert staleness_metrics([], step=5, max_staleness=1) == {}


def test_gate_defers_and_admits():
    gate = StalenessGate(max_staleness=1)
    assert gate.furthest_step() == 2
    assert gate.try_admit(1) == 0 and gate.try_admit(2) == 0
    assert gate.try_admit(3) is None
    gate.publish(1)
    assert gate.try_admit(3) == 1 and gate.furthest_step() == 3
    with pytest.raises(ValueError, match="backwards"):
        gate.publish(0)
    assert [(r.step, r.version) for r in gate.records] == [(1, 0), (2, 0), (3, 1)]


def test_gate_blocks_until_publish_then_times_out_with_a_message():
    gate = StalenessGate(max_staleness=0, timeout_s=5.0)
    got = []
    t = threading.Thread(target=lambda: got.append(gate.admit(2)))
    t.start()
    time.sleep(0.05)
    assert got == []  # still waiting for version 1
    gate.publish(1)
    t.join(timeout=5)
    assert got == [1] and gate.records[-1].waited_seconds > 0
    with pytest.raises(StalenessError, match="needs policy version >= 2"):
        gate.admit(3, timeout_s=0.05)


def test_async_loop_with_gate_never_trains_on_stale_samples():
    """A generator thread running ahead of a trainer thread: every trained batch respects the bound."""
    steps = 8
    for k in (0, 1, 2):
        gate = StalenessGate(max_staleness=k, timeout_s=10.0)
        queue: list[tuple[int, list[int]]] = []
        cond = threading.Condition()
        ahead = []

        def generate(gate=gate, queue=queue, cond=cond, ahead=ahead):
            for s in range(1, steps + 1):
                v = gate.admit(s)
                ahead.append(s - 1 - v)
                with cond:
                    queue.append((s, [v] * 4))
                    cond.notify_all()

        gen = threading.Thread(target=generate)
        gen.start()
        for s in range(1, steps + 1):
            with cond:
                cond.wait_for(lambda s=s, queue=queue: any(q[0] == s for q in queue), timeout=10)
                versions = next(v for q, v in queue if q == s)
            check_staleness(versions, s, k)
            time.sleep(0.002)  # "training"
            gate.publish(s)
        gen.join(timeout=10)
        assert max(ahead) <= k
        if k > 0:  # generation did run ahead of training at some point (the overlap async mode exists for)
            assert max(ahead) >= 1
