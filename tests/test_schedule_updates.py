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

    def lend_threads(self, cores):
        self.log.append((self.name, "lend", dict(cores)))

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
