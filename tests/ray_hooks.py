"""Test hooks that run inside Ray replica processes (the tests directory is on their PYTHONPATH).

``held_tail`` builds a replica's engine as ``fuseflow`` does and makes its long tail wait for
the controller: once the engine has finished a sample and still holds unfinished ones, it
decodes no further until the controller migrates (``abort`` on the source, ``add`` of
``PartialState`` on the target) or ``HOLD_S`` passes. Without it, whether a replica is still
decoding when the controller sees the trigger count depends on process timing (on a loaded
machine a replica could finish its whole share first, and the policy then rightly does not
migrate). Holding only delays decoding: the tokens are those of an unheld run.
"""

from __future__ import annotations

import threading
import time

from fuseflow.rollout.base import RolloutRequest

SLOW_S = 1.0  # ``slow_update``'s wait before each update
HOLD_S = 30.0  # longest hold; the test fails (no migration) rather than hangs if the controller never acts


def held_tail(build, ctx):
    """``build(ctx)``'s (engine, scorers...), the engine holding its tail as the module says."""
    engine, *scorers = build(ctx)
    return hold_tail(engine), *scorers


def hold_tail(engine):
    """Make ``engine`` (patched in place, and returned) hold its tail as the module says; also for the
    local backend's worker threads, whose engines the test wraps after the pool builds them."""
    step, add, abort = engine.step, engine.add, engine.abort
    state = {"finished": 0, "release": threading.Event()}

    def held_step():
        if state["finished"] and engine.has_unfinished():
            state["release"].wait(HOLD_S)
            state["release"].set()  # one hold per stream
        done = step()
        state["finished"] += len(done)
        return done

    def held_add(item):
        if isinstance(item, RolloutRequest):  # a new step's request: hold its tail again
            state["finished"], state["release"] = 0, threading.Event()
        else:  # migrated samples arrived: decode them
            state["release"].set()
        add(item)

    def held_abort(uids):
        state["release"].set()
        return abort(uids)

    engine.step, engine.add, engine.abort = held_step, held_add, held_abort
    return engine


def slow_update(build, *args, **kwargs):
    """``build(*args, **kwargs)``'s worker, whose ``update`` waits ``SLOW_S`` before it trains: the model
    keeps its old weights that long (the fused test's early next generation must not use them)."""
    worker = build(*args, **kwargs)
    update = worker.update

    def slow(*a, **k):
        time.sleep(SLOW_S)
        return update(*a, **k)

    worker.update = slow
    return worker
