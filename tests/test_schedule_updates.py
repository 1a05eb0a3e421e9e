"""The pooled modes' update runner (``schedule.updates.Updates``) over stub groups: the order updates start
in, which lane they take, the cores lent to them and given back, and whose error reaches the controller."""

import pytest

from fuseflow.schedule.modes import MODES
from fuseflow.schedule.updates import Updates
from fuseflow.telemetry import Tracer


class _StubGroup:
    """A role's group as ``Updates`` sees it: records lent threads and whether calls start ``beside()``."""

    def __init__(self, name, log, fail=False, ranks=1):
        self.name, self.log, self.fail, self.runs_beside = name, log, fail, ranks == 1

    def lend_threads(self, cores, at_once=1):
        self.log.append((self.name, "lend", dict(cores)) if at_once == 1 else (self.name, "lend", dict(cores), at_once))

    def starter(self):
        from fuseflow.controller.group import Done, started_beside

        def start():
            self.log.append((self.name, "start", started_beside()))
            if self.fail:
                raise FloatingPointError(f"{self.name} diverged")
            return Done({f"{self.name}/loss": 1.0})
        return start


def _stub_updates(cls, log, fail=False, ranks=1):
    """The update runner a pooled mode ``cls`` builds, over stub groups and a 2-worker pool that lends 2 cores."""
    actor, critic = _StubGroup("actor", log, fail, ranks), _StubGroup("critic", log, ranks=ranks)
    pool = type("Pool", (), {"__len__": lambda self: 2, "lendable_cores": lambda self: {"node-a": 2}})()
    runner = Updates(Tracer(), [actor, critic], pool, 4, side_by_side=cls.fused or cls.asynchronous,
                     beside_generation=cls.asynchronous)
    return runner, {"critic_update": critic.starter(), "actor_update": actor.starter()}


@pytest.mark.parametrize("mode", ["sequential", "fused"])
def test_updates_lend_replica_cores_in_order_and_start_side_by_side_calls_beside(mode):
    """On Ray the updates run in the roles' processes: in sequential order they get the replicas' cores
    (lent before, given back after); fused starts every update but the actor's in the ``beside`` lane."""
    log: list = []
    s, updates = _stub_updates(MODES[mode], log)
    out = s.run(1, updates)
    assert out == {"critic_update": {"critic/loss": 1.0}, "actor_update": {"actor/loss": 1.0}}
    starts = sorted(e for e in log if e[1] == "start")
    lends = [e for e in log if e[1] == "lend"]
    if mode == "sequential":
        assert starts == [("actor", "start", False), ("critic", "start", False)]
        assert lends == [("actor", "lend", {"node-a": 2}), ("critic", "lend", {"node-a": 2}),
                         ("actor", "lend", {}), ("critic", "lend", {})]
    else:
        assert starts == [("actor", "start", False), ("critic", "start", True)]
        assert lends == []


def test_updates_on_several_ranks_go_out_in_one_order_even_when_fused():
    """Ranks of a role share their pool's process group: two threads must not run collectives in one process."""
    log: list = []
    s, updates = _stub_updates(MODES["fused"], log, ranks=2)
    s.run(1, updates)
    assert [e for e in log if e[1] == "start"] == [("critic", "start", False), ("actor", "start", False)]


def test_a_failed_update_keeps_its_own_error_not_the_threads_given_back():
    log: list = []
    s, updates = _stub_updates(MODES["sequential"], log, fail=True)
    with pytest.raises(FloatingPointError, match="actor diverged"):
        s.run(1, updates)
    assert [e for e in log if e[1] == "lend"] == [("actor", "lend", {"node-a": 2}), ("critic", "lend", {"node-a": 2})]


class _Blocked:
    """A group future whose result waits for ``release`` (an update still training)."""

    def __init__(self, release, value, fail=False):
        self.release, self.value, self.fail = release, value, fail

    def result(self):
        assert self.release.wait(10)
        if self.fail:
            raise FloatingPointError("critic diverged")
        return self.value


@pytest.mark.parametrize("critic_fails", [False, True])
def test_side_by_side_updates_call_actor_trained_while_the_critic_still_trains(critic_fails):
    """Fused: ``actor_trained`` runs once the actor's update has returned, before the critic's has; its gate
    opens when both have ended and says whether both succeeded (the next step's held values wait on it)."""
    import threading

    from fuseflow.controller.group import Done

    log, release, seen = [], threading.Event(), {}
    s, _ = _stub_updates(MODES["fused"], log)
    updates = {"critic_update": lambda: _Blocked(release, {"critic/loss": 2.0}, critic_fails),
               "actor_update": lambda: Done({"actor/loss": 1.0})}

    def actor_trained(gate):
        seen["open_at_call"] = gate.is_open()
        gate.on_open(lambda: seen.setdefault("opened", gate.ok))
        release.set()  # the critic ends only now, after the hook ran

    if critic_fails:
        with pytest.raises(FloatingPointError, match="critic diverged"):
            s.run(1, updates, actor_trained)
    else:
        assert s.run(1, updates, actor_trained) == {"critic_update": {"critic/loss": 2.0},
                                                    "actor_update": {"actor/loss": 1.0}}
    assert seen == {"open_at_call": False, "opened": not critic_fails}


def test_in_order_updates_call_actor_trained_after_all_with_the_gate_open():
    log, seen = [], []
    s, updates = _stub_updates(MODES["sequential"], log)
    s.run(1, updates, lambda gate: seen.append((gate.is_open(), gate.ok, len([e for e in log if e[1] == "start"]))))
    assert seen == [(True, True, 2)]


def test_a_failed_actor_update_starts_nothing_early():
    log, seen = [], []
    s, updates = _stub_updates(MODES["fused"], log, fail=True)
    with pytest.raises(FloatingPointError, match="actor diverged"):
        s.run(1, updates, seen.append)
    assert seen == []


def test_groups_on_different_pools_share_the_lent_cores_in_order():
    """Sequential on Ray: groups on two pools train at once, so they share the replicas' idle cores (each
    taking all of them oversubscribed a 2-core machine: steps of 4.6-10.8 s against 1.3-1.7 s)."""
    log: list = []
    s, updates = _stub_updates(MODES["sequential"], log)
    for g, pool in zip(s.trainers, ("main", "crit"), strict=True):
        g.pool = pool
    s.run(1, updates)
    assert [e for e in log if e[1] == "lend"] == [("actor", "lend", {"node-a": 2}, 2), ("critic", "lend", {"node-a": 2}, 2),
                                                 ("actor", "lend", {}), ("critic", "lend", {})]
