"""Per-thread CPU priority (work that runs beside the critical path yields the core to it) and OS thread names.

Used by the threaded rollout pool (``fuseflow.schedule.pool``) and by the rollout replica
processes on Ray (``fuseflow.controller.replica``): an async prefetch decodes while the actor trains.
"""

from __future__ import annotations

import os
import sys
import threading


def set_background(tid: int, background: bool) -> bool:
    """Move one thread to ``SCHED_IDLE`` (runs only on a core nothing else wants) or back; False where impossible.

    Why: async prefetch decodes beside training, the critical path. Measured per thread
    (``/proc/self/task/TID/schedstat``), training then spent 0.56-1.06 s of a 2.4-3.5 s update waiting
    in the run queue behind the rollout threads; nice 10 still left 0.2-0.6 s, SCHED_IDLE ~0.01 s.
    Linux schedules threads as tasks, so this is per thread; other platforms keep one priority.
    Entering SCHED_IDLE needs no privilege; leaving it may (then the thread keeps it until it
    ends, which pool threads do at the end of each step's generation).
    """
    if sys.platform != "linux" or not hasattr(os, "SCHED_IDLE"):
        return False
    policy = os.SCHED_IDLE if background else os.SCHED_OTHER
    try:
        os.sched_setscheduler(tid, policy, os.sched_param(0))
    except (PermissionError, ProcessLookupError, OSError):
        return False
    return True


def name_thread(name: str) -> bool:
    """Give the calling thread ``name`` (its first 15 bytes) in the OS; False where impossible.

    Why: Ray's threads all show as their process (``ray::WorkerHost``), so ``top -H`` and
    ``/proc/PID/task/TID/comm`` could not tell a replica's decode from its Ray call threads, nor a roles'
    process's serial lane from its background lane; a CPU split by thread (docs/ray_rollout.md, session 36)
    had to guess them. Python 3.11's ``threading`` names threads only
    for Python. Linux lets a thread rename itself through its ``comm`` file; other platforms keep the
    name they had. A process's main thread keeps its name too: ``ps`` and ``top`` show it as the process's.
    One call costs about 5 us here (an open and a write of the ``comm`` file).
    """
    tid = threading.get_native_id()
    if sys.platform != "linux" or tid == os.getpid():
        return False
    try:
        with open(f"/proc/self/task/{tid}/comm", "wb") as f:
            f.write(name.encode()[:15])
    except OSError:
        return False
    return True
