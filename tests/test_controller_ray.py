"""Worker groups on a local 2-CPU Ray cluster with fake workers: dispatch, futures, process groups, faults."""

import os
import time

import pytest

from controller_fakes import Echo, build_echo, make_batch
from fuseflow.controller.group import WorkerFailure, background, beside
from fuseflow.controller.placement import resolve_placement
from fuseflow.controller.ray_backend import ClusterError, RayCluster, check_address
from ray_fixtures import ray_cluster  # noqa: F401 - module-scoped fixture

pytestmark = pytest.mark.usefixtures("ray_cluster")


def _cluster(collective_timeout_s=60.0, cpus=0.5, dp=2, **placement):
    p = resolve_placement({}, placement or {"echo": "main"}, {r: dp for r in placement or ["echo"]})
    # Fractions of a CPU slot per worker, so several pools fit the 2-slot cluster at once.
    p = type(p)({n: type(v)(n, v.nodes, v.workers_per_node, cpus, 0.0) for n, v in p.pools.items()}, p.role_pool, p.dp)
    return RayCluster(p, start_timeout_s=60, collective_timeout_s=collective_timeout_s)


@pytest.fixture(scope="module")
def echo_cluster(ray_cluster):  # noqa: F811
    cluster = _cluster()
    yield cluster
    cluster.shutdown()


def test_dispatch_modes_across_processes(echo_cluster):
    group = echo_cluster.group("echo", Echo, build_echo)
    batch = make_batch(5, lengths=[4, 1, 1, 2, 3])
    assert group.row_ids(batch).tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    sent = group.history()
    assert [len(s[0][0]) for s in sent] == [3, 3]  # 5 rows, padded to 3 per rank
    assert sum(m > 0 for s in sent for m in s[0][1]) == 5
    who = group.whoami("t")
    assert [w[1:3] for w in who] == [(0, 2), (1, 2)] and who[0][3] != who[1][3]  # two processes
    assert group.only_rank_zero() == 0
    # Two ranks run collectives on the pool's process group: never from a second thread of a process.
    assert not group.runs_beside
    with beside(), pytest.raises(RuntimeError, match="cannot run beside"):
        group.sleep.future(0.1)
    with background():  # nor in the background lane: the ranks' one order instead, at normal priority
        assert group.sched_policy() == [os.SCHED_OTHER] * 2
    assert group.per_rank([1, 2]) == [10, 20]
    assert group.niceness() == [0, 0]  # not Ray's default 15: workers keep their share of a busy CPU
    # The pool's process group: an all-reduce inside the workers counts rows over both ranks.
    assert group.global_rows(batch) == {"rows": 5.0}
    with pytest.raises(WorkerFailure, match=r"echo worker rank 0 \(pool main\) failed in echo.fail: ValueError: bad"):
        group.fail("bad")


def test_futures_overlap_groups_on_split_pools(ray_cluster):  # noqa: F811
    cluster = _cluster(cpus=0.25, a="a", b="b")
    try:
        a = cluster.group("a", Echo, build_echo)
        b = cluster.group("b", Echo, build_echo)
        t0 = time.perf_counter()
        fa, fb = a.sleep.future(1.5), b.sleep.future(1.5)
        assert time.perf_counter() - t0 < 1.0 and not fa.done()  # submitting does not wait
        assert fa.result() == [1.5, 1.5] and fb.result() == [1.5, 1.5]
        # Both pools slept at the same time: far less than the 3 s of running them one after the other.
        assert time.perf_counter() - t0 < 2.8
        assert a.compute_seconds >= 1.5
    finally:
        cluster.shutdown()


def test_colocated_roles_run_beside_each_other_only_when_asked(ray_cluster):  # noqa: F811
    cluster = _cluster(cpus=0.25, dp=1, a="main", b="main")  # both roles in the same process
    try:
        a = cluster.group("a", Echo, build_echo)
        b = cluster.group("b", Echo, build_echo)
        t0 = time.perf_counter()
        fa, fb = a.sleep.future(1.0), b.sleep.future(1.0)
        assert fa.result() == [1.0] and fb.result() == [1.0]
        assert time.perf_counter() - t0 >= 2.0  # one process's calls run one after the other
        t0 = time.perf_counter()
        fa = a.sleep.future(1.0)
        with beside():
            fb = b.sleep.future(1.0)
        assert fa.result() == [1.0] and fb.result() == [1.0]
        assert time.perf_counter() - t0 < 1.8  # b's call took a lane of its own

        # Background calls: a lane of their own, under SCHED_IDLE (cores nothing else wants).
        t0 = time.perf_counter()
        fa = a.sleep.future(1.0)
        with background():
            fb = b.sleep.future(1.0)
            policy = b.sched_policy.future()
        assert fa.result() == [1.0] and fb.result() == [1.0]
        assert time.perf_counter() - t0 < 1.8
        assert policy.result() == [os.SCHED_IDLE] and a.sched_policy() == [os.SCHED_OTHER]
        # Each lane's thread carries its OS name (controller.priority.name_thread), for per-thread tools.
        with beside():
            beside_name = b.thread_name.future()
        with background():
            background_name = b.thread_name.future()
        assert beside_name.result() == ["lane-beside"] and background_name.result() == ["lane-background"]
        assert a.thread_name() == ["lane-serial"]

        # Lent threads (the cores of idle rollout replicas) and given back.
        cores, node = len(os.sched_getaffinity(0)), ray_cluster.get_runtime_context().get_node_id()
        a.lend_threads({"another-node": 1})
        assert a.threads() == [1]  # cores of another node are not this process's to take
        a.lend_threads({node: 1})
        assert a.threads() == [min(2, cores)] and b.threads() == [min(2, cores)]  # the process's
        a.lend_threads({node: 2}, at_once=2)  # two pools train at once: half the lent cores, half the process's
        assert a.threads() == [max(1, min(2, cores // 2))]
        a.lend_threads({})
        assert a.threads() == [1]

    finally:
        cluster.shutdown()


def test_a_collective_that_times_out_names_the_waiting_rank(ray_cluster):  # noqa: F811
    cluster = _cluster(collective_timeout_s=3.0, cpus=0.25)
    try:
        group = cluster.group("echo", Echo, build_echo)
        t0 = time.perf_counter()
        with pytest.raises(WorkerFailure, match=r"echo worker rank 0 .* failed in echo.stall_then_reduce"):
            group.stall_then_reduce(1, 20.0)
        assert time.perf_counter() - t0 < 15.0  # the 3 s collective timeout, not rank 1's 20 s stall
    finally:
        cluster.shutdown()


def test_a_killed_worker_ends_the_call_at_once(echo_cluster):
    import ray

    group = echo_cluster.group("echo", Echo, build_echo)
    pending = group.sleep.future(30.0)
    time.sleep(1.0)
    t0 = time.perf_counter()
    ray.kill(echo_cluster.host("main", 1), no_restart=True)
    with pytest.raises(WorkerFailure, match=r"echo worker rank 1 \(pool main\) failed in echo.sleep: its process died"):
        pending.result()
    assert time.perf_counter() - t0 < 10.0


def test_unreachable_address_is_one_line():
    with pytest.raises(ClusterError, match=r"ray.address=127.0.0.1:1: no Ray cluster reachable there") as e:
        check_address("127.0.0.1:1", timeout_s=5)
    assert "\n" not in str(e.value)
    with pytest.raises(ClusterError, match="expected HOST:PORT"):
        check_address("nonsense", timeout_s=5)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads /proc (Linux)")
def test_a_local_cluster_runs_without_the_daemons_it_has_no_use_for():
    from fuseflow.bench.recovery import descendant_titles
    from fuseflow.controller.ray_backend import stop_idle_daemons

    titles = descendant_titles().values()
    assert any("raylet" in t for t in titles)  # the cluster this module started descends from this process
    assert not [t for t in titles if "log_monitor.py" in t or ("autoscaler" in t and "monitor.py" in t)]
    assert stop_idle_daemons() == []  # already stopped: a second call finds nothing to stop
