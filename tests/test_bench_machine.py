"""The machine's CPU readings every benchmark may record (``fuseflow.bench``: ``machine_times``), and
`bench fusion`'s CPU clock of the run's own processes."""

import pytest


def test_machine_busy_matches_its_docstring_example():
    import doctest

    from fuseflow import bench

    result = doctest.testmod(bench)
    assert result.attempted >= 1 and result.failed == 0


def test_busy_and_total_by_hand():
    """Idle and I/O wait are not busy, steal is, guest time is not counted twice; only the given cores."""
    from collections import namedtuple

    from fuseflow.bench import busy_and_total, parse_cpu_list

    T = namedtuple("T", "user nice system idle iowait irq softirq steal guest guest_nice")
    cpu0 = T(user=3.0, nice=0.5, system=1.0, idle=4.0, iowait=1.0, irq=0.25, softirq=0.25, steal=1.0, guest=2.0,
             guest_nice=0.0)  # all = 13.0 - 2.0 guest = 11.0; busy = 11.0 - 4.0 - 1.0 = 6.0
    cpu1 = T(1.0, 0.0, 1.0, 8.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)  # all 10.0, busy 2.0
    assert busy_and_total([cpu0, cpu1], None) == (8.0, 21.0)
    assert busy_and_total([cpu0, cpu1], {1}) == (2.0, 10.0)
    # CPU 1 offline: the entries are CPUs 0 and 2 (sysfs lists them as "0,2"), so core 2 is the second entry.
    assert parse_cpu_list("0,2\n") == [0, 2] and parse_cpu_list("0-1,4-5\n") == [0, 1, 4, 5]
    assert busy_and_total([cpu0, cpu1], {2}, [0, 2]) == (2.0, 10.0)
    assert busy_and_total([cpu0, cpu1], {1}, [0, 2]) == (0.0, 0.0)
    Mac = namedtuple("Mac", "user nice system idle")  # no iowait or guest fields (macOS)
    assert busy_and_total([Mac(1.0, 0.0, 1.0, 2.0)], None) == (2.0, 4.0)


def test_machine_times_count_every_process_on_this_process_cores():
    """Busy core-seconds grow by at least what this process burns; idle ones make up the rest."""
    import time

    from fuseflow.bench import machine_busy, machine_times
    from fuseflow.schedule.modes import available_cores

    before, t0, c0 = machine_times(), time.perf_counter(), time.process_time()
    while time.process_time() - c0 < 0.5:  # one core busy for 0.5 s
        pass
    after, wall, burnt = machine_times(), time.perf_counter() - t0, time.process_time() - c0
    # On a fully busy machine the two deltas are equal; their sums of large floats may differ in the last bits.
    assert -1e-6 <= after[0] - before[0] <= after[1] - before[1] + 1e-6
    # The cores' time is wall time on each of them (to the kernel's 10 ms ticks).
    assert after[1] - before[1] == pytest.approx(wall * available_cores(), abs=0.05 * available_cores() + 0.05)
    assert machine_busy(before, after) >= burnt / (wall * available_cores()) - 0.05
    assert machine_busy(after, after) is None  # no time passed


def test_machine_busy_is_a_share_even_when_float_sums_round_past_it():
    """A fully busy machine reads 1.0, not 1.0000000001 from the rounding of two large sums (CI saw busy and
    all deltas of 41093.16 - 41091.63 and 69069.01 - 69067.48)."""
    from fuseflow.bench import machine_busy

    busy = machine_busy((41091.630000000005, 69067.48000000001), (41093.16000000001, 69069.01000000001))
    assert busy == 1.0


def test_bench_cpu_clock_splits_the_run_by_process_kind():
    """The bench's CPU clock counts a role's process and a replica's apart from this one, each from /proc."""
    import os
    import subprocess
    import sys
    import time
    import types

    from fuseflow.bench.fusion import _cpu_clock

    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < {}: pass\nprint(1, flush=True)\n" \
           "import sys; sys.stdin.read()"
    role = subprocess.Popen([sys.executable, "-c", burn.format(0.6)], stdout=subprocess.PIPE, stdin=subprocess.PIPE)
    replica = subprocess.Popen([sys.executable, "-c", burn.format(0.2)], stdout=subprocess.PIPE, stdin=subprocess.PIPE)
    try:
        trainer = types.SimpleNamespace(cluster=types.SimpleNamespace(pids={"default": [role.pid]}),
                                        replicas=types.SimpleNamespace(pids=[replica.pid]))
        clock = _cpu_clock(trainer)
        role.stdout.readline(), replica.stdout.readline()  # both have burnt their CPU and now wait
        out = clock()
        assert set(out) == {"controller", "roles", "replicas"}
        # /proc's count is sampled at the clock tick and ran up to 2 ticks under process_time here
        # (0.207 s burnt read 0.19 s; CI once read 0.19 for 0.2): allow 5 ticks
        slack = 5 / os.sysconf("SC_CLK_TCK")
        assert 0.6 - slack <= out["roles"] <= 2.0 and 0.2 - slack <= out["replicas"] <= out["roles"] - 0.2
        assert out["controller"] == pytest.approx(time.process_time(), abs=0.05)
        local = _cpu_clock(types.SimpleNamespace(cluster=object(), replicas=None))()
        assert set(local) == {"controller"}
    finally:
        for p in (role, replica):
            p.kill()
            p.wait()
