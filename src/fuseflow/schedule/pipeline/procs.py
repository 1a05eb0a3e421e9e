"""Stage processes: one process per pipeline rank, driven by commands from the parent.

A torchrun-style group on one machine: the parent spawns `n` processes (spawn start
method, so CUDA and OpenMP start clean), they join one torch.distributed group through a
file store in a fresh temp dir (no fixed port to collide on), build their state once with
`setup`, then run commands. A command is a top-level function `fn(state, rank, ctx, *args)`.

The parent never waits blindly: it polls every rank's pipe and liveness. If a process
dies, the call ends within a second or two with one line naming the rank, what it holds
(role and stage, from `describe`) and the action it was running, read from shared memory
the executor updates before each action. Survivors are stopped, so nothing hangs.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any


class StageFailure(RuntimeError):
    """A stage process died or failed during a command; the message is one line. `rank`: whose."""

    def __init__(self, message: str, rank: int | None = None):
        super().__init__(message)
        self.rank = rank


class Context:
    """Handed to every command: the shared slot where this rank records its current action."""

    def __init__(self, rank: int, current: Any):
        self.rank, self._current = rank, current

    def on_action(self, i: int) -> None:
        """Record that this rank is about to run action `i` of its list (-1: none), so the parent can
        say what a rank that died was doing."""
        self._current[self.rank] = i


def _main(rank, world, backend, init_file, conn, setup, setup_args, threads, timeout, current):  # pragma: no cover
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout))
        state = setup(rank, world, *setup_args)
        conn.send(("ok", None))
    except Exception as err:
        conn.send(("error", f"rank {rank}: setup failed: {type(err).__name__}: {err}"))
        return
    ctx = Context(rank, current)
    while True:
        msg = conn.recv()
        if msg is None:
            break
        fn, args = msg
        try:
            conn.send(("ok", fn(state, rank, ctx, *args)))
        except Exception as err:  # reported as one line; an unexpected error's traceback goes to stderr
            if type(err).__name__ != "StageError":
                traceback.print_exc()
            text = str(err).strip().splitlines()[0] if str(err).strip() else ""
            conn.send(("error", f"{type(err).__name__}: {text}" if type(err).__name__ != "StageError" else text))
    dist.destroy_process_group()


class StageProcesses:
    """`n` stage processes (see module docstring). Use as a context manager.

    `describe(rank, action_index)` turns a rank and the index of the action it was running
    (-1 when none) into words, e.g. "actor stage 1, critic stage 0, at A F2 s1".
    """

    def __init__(
        self,
        n: int,
        setup: Callable[..., Any],
        setup_args: Sequence[Any] = (),
        backend: str = "gloo",
        threads: int = 1,
        timeout: float = 60.0,
        describe: Callable[[int, int], str] | None = None,
    ):
        ctx = mp.get_context("spawn")
        self.n, self.timeout, self.describe = n, timeout, describe or (lambda r, i: "")
        self.dir = tempfile.mkdtemp(prefix="fuseflow-pp-")
        self.current = ctx.Array("i", [-1] * n, lock=False)
        self.conns, self.procs = [], []
        for rank in range(n):
            parent, child = ctx.Pipe()
            p = ctx.Process(
                target=_main, daemon=True,
                args=(rank, n, backend, os.path.join(self.dir, "store"), child, setup, tuple(setup_args), threads,
                      timeout, self.current),
            )
            p.start()
            self.conns.append(parent)
            self.procs.append(p)
        self._collect("setup", timeout)

    def __enter__(self) -> StageProcesses:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def call(self, fn: Callable[..., Any], args: Sequence[Any] = (), per_rank: Sequence[Sequence[Any]] | None = None,
             timeout: float | None = None) -> list[Any]:
        """Run `fn(state, rank, ctx, *args)` (or `*per_rank[rank]`) on every rank; results by rank."""
        for rank, conn in enumerate(self.conns):
            self.current[rank] = -1
            conn.send((fn, tuple(per_rank[rank]) if per_rank is not None else tuple(args)))
        return self._collect(getattr(fn, "__name__", "command"), timeout or self.timeout)

    def _where(self, rank: int) -> str:
        text = self.describe(rank, self.current[rank])
        return f"rank {rank}" + (f" ({text})" if text else "")

    def _collect(self, what: str, timeout: float) -> list[Any]:
        results: list[Any] = [None] * self.n
        pending = set(range(self.n))
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        first_problem = None
        while pending:
            for rank in sorted(pending):
                conn, proc = self.conns[rank], self.procs[rank]
                msg = None
                if conn.poll():
                    try:
                        msg = conn.recv()
                    except (EOFError, OSError):  # the pipe closed: the process is gone
                        proc.join(timeout=1.0)
                if msg is not None:
                    pending.discard(rank)
                    status, value = msg
                    if status == "ok":
                        results[rank] = value
                    else:
                        errors[rank] = value
                elif not proc.is_alive():
                    pending.discard(rank)
                    errors[rank] = f"died (exit code {proc.exitcode})"
            if errors and first_problem is None:
                first_problem = time.monotonic()
            # After a first failure give the others a moment to reveal a death (the root cause).
            if first_problem is not None and (time.monotonic() - first_problem > 2.0 or not pending):
                break
            if time.monotonic() > deadline:
                for rank in pending:
                    errors[rank] = f"no answer to {what} after {timeout:g} s"
                break
            time.sleep(0.005)
        if errors:
            dead = [r for r, e in errors.items() if e.startswith("died")]
            rank = dead[0] if dead else min(errors)
            where = self._where(rank)
            self.close(force=True)
            if dead:
                raise StageFailure(f"stage process {where} {errors[rank]} during {what}", rank)
            raise StageFailure(f"{what} failed on {where}: {errors[rank]}", rank)
        return results

    def close(self, force: bool = False) -> None:
        """Stop every process (politely unless `force`) and remove the store directory."""
        for conn, proc in zip(self.conns, self.procs, strict=True):
            if proc.is_alive() and not force:
                try:
                    conn.send(None)
                except (BrokenPipeError, OSError):
                    pass
        for proc in self.procs:
            proc.join(timeout=0 if force else 10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        for conn in self.conns:
            conn.close()
        self.conns, self.procs = [], []
        shutil.rmtree(self.dir, ignore_errors=True)
