"""Calling the user's reward and cost functions: checked, timed out, and optionally in other processes.

A user's function is code fuseflow cannot trust: it may raise, return a string or ``inf``, hang,
or take its interpreter down. Every failure becomes one ``RewardError`` line naming the function,
the sample (its index in the call and its prompt) and the cause; NaN stays allowed (the step's
update is skipped with a warning, as before).

- ``reward.workers=0`` (default): calls run on a daemon thread of this process, which the caller
  watches against ``reward.timeout_s`` per call; a call past it ends the run (the thread is left
  behind, which is why it is a daemon: it cannot keep the process alive).
- ``reward.workers=N``: calls run in a pool of N spawned processes (``concurrent.futures``), each
  call under a ``SIGALRM`` timer in its process. A function that crashes its process is named by
  the shared slot its process was working on.

A batch function (``score_batch(prompts, responses, answers) -> list[float]``, as TRL reward
functions are written) is called once per chunk instead of once per sample; ``reward.batch``
says so, or by default a function whose name ends in ``_batch``.
"""

from __future__ import annotations

import math
import numbers
import signal
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from .base import RewardError

BATCH_SUFFIX = "_batch"


class UserFunction:
    """``spec`` (``file.py:fn`` or ``package.module:fn``) loaded once and called with every check.

    ``field`` is the config key naming it (``task.reward_fn``), ``what`` the signal it gives
    (``reward`` or ``cost``). Picklable: the function and any pool are rebuilt where it lands.
    """

    def __init__(self, spec: str, field: str, what: str, timeout_s: float = 30.0, workers: int = 0,
                 batch: bool | None = None):
        from .user import load_function

        self.spec, self.field, self.what = spec, field, what
        self.fn = load_function(spec, field)
        self.configure(timeout_s, workers, batch)

    def configure(self, timeout_s: float, workers: int, batch: bool | None) -> None:
        """Set ``reward.timeout_s``, ``reward.workers`` and ``reward.batch`` (None: by the function's name)."""
        self.timeout_s, self.workers = float(timeout_s), int(workers)
        self.batch = self.spec.rsplit(":", 1)[-1].endswith(BATCH_SUFFIX) if batch is None else batch
        self.close()

    @property
    def name(self) -> str:
        """The function's spec as the user wrote it (``file.py:fn`` or ``package.module:fn``), for messages."""
        return self.spec

    def __call__(self, prompts: list[str], responses: list[str], answers: list[str | None]) -> list[float]:
        """One checked value per sample; a failure raises ``RewardError`` (NaN passes through)."""
        n = len(prompts)
        if n == 0:
            return []
        raw = self._pooled(prompts, responses, answers) if self.workers else self._inline(prompts, responses, answers)
        return [self._check(v, i, prompts) for i, v in enumerate(raw)]

    # ---------------------------------------------------------------- checks
    def _fail(self, index: int | None, prompts: list[str], cause: str) -> RewardError:
        if index is None:
            where = f"a batch of {len(prompts)} samples"
        else:
            text = prompts[index]
            where = f"sample {index} (prompt {text[:40] + '...' if len(text) > 40 else text!r})"
        return RewardError(f"{self.what} function {self.spec} ({self.field}) on {where}: {cause}")

    def _check(self, value, index: int, prompts: list[str]) -> float:
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            v = float(value)
        elif hasattr(value, "item") and getattr(value, "ndim", getattr(value, "dim", lambda: 1)()) == 0:
            v = float(value.item())  # a 0-d numpy or torch scalar
        else:
            shown = repr(value)
            raise self._fail(index, prompts, f"returned {type(value).__name__} {shown[:40]}, not a number; "
                                              "return a float (NaN skips the step's update)")
        if math.isinf(v):
            raise self._fail(index, prompts, f"returned {v}; return a finite float (NaN skips the step's update)")
        return v

    def _raised(self, index: int | None, prompts: list[str], exc: BaseException) -> RewardError:
        text = " ".join(str(exc).split())[:200]
        return self._fail(index, prompts, f"raised {type(exc).__name__}" + (f": {text}" if text else ""))

    def _timed_out(self, index: int | None, prompts: list[str]) -> RewardError:
        return self._fail(index, prompts, f"took longer than reward.timeout_s={self.timeout_s:g}s per call; "
                                          "make it faster or raise reward.timeout_s")

    def _wrong_length(self, got, want: int, prompts: list[str]) -> RewardError:
        count = len(got) if hasattr(got, "__len__") else type(got).__name__
        return self._fail(None, prompts, f"returned {count} values for {want} samples; a batch function returns "
                                         "one float per sample")

    # ------------------------------------------------------------- in-process
    def _inline(self, prompts, responses, answers) -> list:
        fn = self._function()
        now = {"at": (0 if not self.batch else None, time.monotonic())}  # (index, start) of the current call
        out: list = []
        error: list = []
        done = threading.Event()

        def work():
            try:
                if self.batch:
                    out.append(fn(list(prompts), list(responses), list(answers)))
                else:
                    for i, args in enumerate(zip(prompts, responses, answers, strict=True)):
                        now["at"] = (i, time.monotonic())
                        out.append(fn(*args))
            except BaseException as e:  # noqa: BLE001 - user code: reported with its sample
                error.append((now["at"][0], e))
            finally:
                done.set()

        threading.Thread(target=work, daemon=True, name=f"fuseflow-{self.what}-fn").start()
        while not done.wait(max(0.0, now["at"][1] + self.timeout_s - time.monotonic())):
            index, started = now["at"]
            if time.monotonic() - started >= self.timeout_s:
                raise self._timed_out(index, prompts)
        if error:
            raise self._raised(error[0][0], prompts, error[0][1])
        if self.batch:
            values = out[0]
            if not hasattr(values, "__len__") or len(values) != len(prompts):
                raise self._wrong_length(values, len(prompts), prompts)
            return list(values)
        return out

    def _function(self):
        if self.fn is None:
            from .user import load_function

            self.fn = load_function(self.spec, self.field)
        return self.fn

    # ------------------------------------------------------------ process pool
    def _pooled(self, prompts, responses, answers) -> list:
        import multiprocessing as mp

        if self._pool is None:
            ctx = mp.get_context("spawn")  # fork would copy torch's threads and locks into the children
            self._slots = ctx.Array("l", [-2] * self.workers, lock=False)  # per process: sample in progress
            self._pids = ctx.Array("l", [0] * self.workers, lock=False)
            self._pool = ProcessPoolExecutor(self.workers, mp_context=ctx, initializer=_init_worker,
                                             initargs=(self.spec, self.field, self._slots, self._pids, ctx.Lock()))
        n = len(prompts)
        size = max(1, math.ceil(n / (4 * self.workers)))  # a few chunks per process balances uneven calls
        bounds = [(a, min(n, a + size)) for a in range(0, n, size)]
        futures = [self._pool.submit(_run_chunk, a, prompts[a:b], responses[a:b], answers[a:b], self.batch,
                                     self.timeout_s) for a, b in bounds]
        # The pool's processes, held here: a broken pool forgets them, and the dead one names the sample.
        self._procs = dict(getattr(self._pool, "_processes", None) or {}) or getattr(self, "_procs", {})
        # The workers time each call themselves; this guard only catches a call that ignores SIGALRM.
        guard = self.timeout_s * (1 if self.batch else size) + 30.0
        out: list = []
        try:
            for (a, b), fut in zip(bounds, futures, strict=True):
                kind, *rest = fut.result(timeout=guard)
                if kind == "ok":
                    values = rest[0]
                    if self.batch and (not hasattr(values, "__len__") or len(values) != b - a):
                        raise self._wrong_length(values, b - a, prompts)
                    out.extend(values)
                elif kind == "timeout":
                    raise self._timed_out(rest[0], prompts)
                else:
                    index, exc_type, text = rest
                    raise self._fail(index, prompts, f"raised {exc_type}" + (f": {text}" if text else ""))
        except BrokenProcessPool:
            index = self._crashed()
            self._abandon()
            # Only the sample is named: the exit code is not always known when the pool breaks (the
            # process may be reaped first), and a one-line message must not depend on that race.
            raise self._fail(index, prompts, "crashed its worker process (run it with reward.workers=0 to see "
                             "why)") from None
        except TimeoutError:
            self._abandon()
            raise self._timed_out(None, prompts) from None
        except RewardError:
            self._abandon()  # the other chunks may still be running (or hung): do not wait for them
            raise
        return out

    def _crashed(self) -> int | None:
        """The sample the crashed process was on (None when unknown)."""
        for p in list(getattr(self, "_procs", {}).values()):  # ProcessPoolExecutor._processes: read defensively
            p.join(timeout=2.0)  # the pool breaks as the process dies; its exit status can lag a moment
            code = p.exitcode
            if code is not None and code != -signal.SIGTERM:
                slot = next((s for s, pid in enumerate(self._pids) if pid == p.pid), None)
                index = self._slots[slot] if slot is not None else -1
                return index if index >= 0 else None
        busy = [i for i in self._slots if i >= 0]  # else: the one sample in progress, when only one was
        return busy[0] if len(busy) == 1 else None

    def _abandon(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            for p in list((getattr(pool, "_processes", None) or {}).values()):
                p.kill()  # a hung call never returns: kill rather than wait for it
            pool.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        """Stop the process pool, if one was started."""
        pool, self._pool = getattr(self, "_pool", None), None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)

    def __getstate__(self) -> dict:
        # The function is imported again where the object lands (a Ray worker, a pool process): the
        # file or module must be readable there, as the run's data is.
        return {k: v for k, v in self.__dict__.items() if k not in ("fn", "_pool", "_slots", "_pids", "_procs")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.fn, self._pool = None, None


# --------------------------------------------------------------- pool processes
_WORKER: dict = {}


class _Timeout(Exception):
    pass


def _on_alarm(signum, frame):
    raise _Timeout


def _init_worker(spec: str, field: str, slots, pids, lock) -> None:
    import os

    from .user import load_function

    with lock:  # take the first free slot: where this process reports the sample it is on
        slot = next(s for s, pid in enumerate(pids) if pid == 0)
        pids[slot] = os.getpid()
    _WORKER.update(fn=load_function(spec, field), slots=slots, slot=slot)
    signal.signal(signal.SIGALRM, _on_alarm)


def _run_chunk(start: int, prompts, responses, answers, batch: bool, timeout_s: float) -> tuple:
    """Score one chunk in a pool process: ("ok", values) | ("timeout", index) | ("error", index, type, text)."""
    fn, slots, slot = _WORKER["fn"], _WORKER["slots"], _WORKER["slot"]
    calls = [(None, (list(prompts), list(responses), list(answers)))] if batch else [
        (start + i, args) for i, args in enumerate(zip(prompts, responses, answers, strict=True))]
    out = []
    for index, args in calls:
        slots[slot] = start if index is None else index
        signal.setitimer(signal.ITIMER_REAL, timeout_s)
        try:
            value = fn(*args)
        except _Timeout:
            return ("timeout", index)
        except Exception as e:  # noqa: BLE001 - user code: reported with its sample
            return ("error", index, type(e).__name__, " ".join(str(e).split())[:200])
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        slots[slot] = -1
        if batch:
            return ("ok", list(value) if hasattr(value, "__len__") else value)
        out.append(value if isinstance(value, (int, float)) else _plain(value))
    return ("ok", out)


def _plain(value):
    # Values cross back by pickle: a 0-d tensor or numpy scalar becomes a float; anything else is
    # sent as it is and rejected by the caller's check with its type.
    try:
        return float(value.item()) if hasattr(value, "item") else value
    except (TypeError, ValueError):
        return value


