"""End-to-end benchmarks that drive whole RL runs (``fuseflow bench controller``, ``fusion``, ``trl``).

Subsystem benchmarks live next to their subsystem (``rollout/bench.py``,
``schedule/pipeline/bench.py``); the ones here run the trainer itself, and sometimes
another framework beside it, so they sit above the programs layer. The helpers below
are what every one of them records and writes.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

from fuseflow.models.device import cpuinfo


def cpu_name() -> str:
    """The CPU model as /proc/cpuinfo names it (``platform`` says only "x86_64" on Linux)."""
    return cpuinfo("model name") or platform.processor() or platform.machine()


def machine_times() -> tuple[float, float]:
    """CPU seconds so far of the cores this process may run on, ``(busy, all)``, whoever used them (psutil's
    per-CPU times). Idle and I/O wait are not busy; time stolen by the hypervisor is (the cores were not
    free for this run). Guest time is left out: the kernel already counts it in user time."""
    import psutil

    cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    return busy_and_total(psutil.cpu_times(percpu=True), cores, online_cpus())


def online_cpus() -> list[int] | None:
    """The numbers of Linux's online CPUs, in order; None where that list cannot be read.

    psutil's per-CPU times follow /proc/stat, which lists only online CPUs: with one taken offline,
    entry ``i`` is no longer CPU ``i``, and these numbers say which CPU each entry is.
    """
    try:
        return parse_cpu_list(Path("/sys/devices/system/cpu/online").read_text())
    except (OSError, ValueError):
        return None


def parse_cpu_list(text: str) -> list[int]:
    """A kernel CPU list (``0-2,5``, as in /sys/devices/system/cpu/online) as CPU numbers.

    >>> parse_cpu_list("0-2,5")
    [0, 1, 2, 5]
    """
    out: list[int] = []
    for part in text.strip().split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def busy_and_total(per_cpu: list, cores: set[int] | None, numbers: list[int] | None = None) -> tuple[float, float]:
    """``(busy, all)`` seconds summed over the CPUs numbered in ``cores`` (None: all) of psutil's per-CPU
    times (named tuples with ``idle`` and, on Linux, ``iowait``, ``guest`` and ``guest_nice``). ``numbers``:
    each entry's CPU number (``online_cpus``); None, or a list of another length, numbers them 0, 1, ..."""
    if numbers is None or len(numbers) != len(per_cpu):
        numbers = list(range(len(per_cpu)))
    busy = total = 0.0
    for i, t in zip(numbers, per_cpu, strict=True):
        if cores is not None and i not in cores:
            continue
        every = sum(t) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)
        busy += every - t.idle - getattr(t, "iowait", 0.0)
        total += every
    return busy, total


def machine_busy(before: tuple[float, float], after: tuple[float, float]) -> float | None:
    """The busy share of the cores between two ``machine_times`` readings (None if no time passed). Beside
    ``cpu_utilisation`` (the run's own processes) it shows what the rest took: Ray's daemons, the OS, other
    users of a shared machine.

    >>> machine_busy((10.0, 40.0), (25.0, 60.0))
    0.75
    """
    spent = after[1] - before[1]
    if spent <= 0:
        return None
    # Busy time is part of all time; the two deltas of large float sums may round past each other.
    return min(1.0, max(0.0, (after[0] - before[0]) / spent))


def write_result(out: Path | None, result: dict) -> None:
    """Write a benchmark's JSON to ``out`` (its folder created), when the user asked for a file."""
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
