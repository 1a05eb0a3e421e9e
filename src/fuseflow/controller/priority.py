"""Per-thread CPU priority: work that runs beside the critical path yields the core to it.

Used by the threaded rollout pool (``fuseflow.schedule.pool``) and by the rollout replica
processes on Ray (``fuseflow.controller.replica``): an async prefetch decodes while the actor trains.
"""

from __future__ import annotations

import os
import sys

# The GIL switch interval while rollout workers run as threads of this process (``schedule.pool``).
# A SCHED_IDLE worker may take the GIL while a training thread is inside a torch op, then wait for a
# core while holding it; the training thread gets the GIL back only after the interval (Python's
# default is 5 ms). Two update threads beside one SCHED_IDLE forward thread and two SCHED_IDLE busy
# processes (2-core VM, 10 ABBA rounds) took 1.209 s at 5 ms, 1.143 s at 1 ms and 1.152 s with no
# background thread. On the local backend's fusion bench, 12 ABBA pairs at 1 ms over 5 ms: async 1.054x
# (p 0.03), fused 1.042x (p 0.09), sequential 1.012x, fused+async 1.015x (docs/benchmarks.md). Replica
# processes on Ray showed no difference (docs/ray_rollout.md, session 31), so only threads get it.
GIL_SWITCH_SECONDS = 0.001


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
