"""``fuseflow bench recovery``: a Ray run whose worker processes are killed, against an uninterrupted one.

Two runs of the same config and seed, one after the other (never side by side, so they do not
share the cores):

- ``full``: ``fuseflow train backend=ray`` as a user would start it;
- ``killed``: the same run, while a watcher thread SIGKILLs one Ray worker process (a
  ``ray::WorkerHost`` descended from this process) each time the run logs step ``kill_every``,
  ``2 * kill_every``, ... With ``trainer.max_restarts`` the run tears the worker groups down,
  starts them again and resumes from its last checkpoint by itself.

The result holds each run's held-out accuracy at every evaluation, whether every logged metric
(timings aside) is equal, the restart records (failed step, checkpoint resumed from, cause,
seconds lost), wall times and the machine's load average. The kill is a real ``SIGKILL`` of the
process, as the kernel's OOM killer or a preempted node would deliver, not Ray's ``ray.kill``.
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import threading
import time
from pathlib import Path

from . import cpu_name, write_result

WORKER_TITLE = "ray::WorkerHost"  # the process title Ray gives an actor of fuseflow's host class


def descendant_titles(root: int | None = None) -> dict[int, str]:
    """Command line of every process descended from process ``root`` (this one by default), by pid.

    Read from /proc so that other Ray clusters on the machine (other users, other tests) are
    never touched: a local cluster's raylet and daemons are children of the driver that started it.
    """
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue  # exited meanwhile
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    found, todo = {}, [root or os.getpid()]
    while todo:
        for pid in children.get(todo.pop(), []):
            todo.append(pid)
            try:
                found[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                pass  # exited meanwhile
    return found


def worker_pids(root: int | None = None) -> list[int]:
    """Pids of the Ray worker hosts descended from process ``root`` (this one by default), sorted."""
    return sorted(pid for pid, title in descendant_titles(root).items() if title.startswith(WORKER_TITLE))


class Killer(threading.Thread):
    """SIGKILLs one worker process each time ``metrics.jsonl`` of ``run_dir`` first reaches a target step."""

    def __init__(self, run_dir: Path, targets: list[int], log=print):
        super().__init__(daemon=True)
        self.path, self.targets, self.log = Path(run_dir) / "metrics.jsonl", list(targets), log
        self.kills: list[dict] = []
        self.done = threading.Event()

    def run(self) -> None:
        while self.targets and not self.done.is_set():
            if _last_step(self.path) >= self.targets[0]:
                pids = worker_pids()
                if pids:  # none while the run is between tear-down and start-up: try again shortly
                    pid = pids[len(self.kills) % len(pids)]  # a different host each time when there are several
                    os.kill(pid, signal.SIGKILL)
                    self.kills.append({"at_step": self.targets.pop(0), "pid": pid, "workers": len(pids),
                                       "load_1min": round(os.getloadavg()[0], 2)})
                    self.log(f"killed worker process {pid} (of {len(pids)}) at step {self.kills[-1]['at_step']}")
            self.done.wait(0.05)


def _last_step(path: Path) -> int:
    """The largest step logged in ``metrics.jsonl`` so far (0 before the first)."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return 0
    steps = [json.loads(ln)["step"] for ln in lines if ln.strip() and '"event"' not in ln]
    return max(steps, default=0)


def run_recovery_bench(overrides: list[str] | None = None, steps: int = 200, kill_every: int = 50,
                       max_restarts: int = 4, save_every: int = 5, preset: str = "default",
                       work_dir: str | Path | None = None, log=print, console=None) -> dict:
    """Run the uninterrupted and the killed run (in that order); return the comparison as a dict."""
    from fuseflow.config import load_config
    from fuseflow.runner import train
    from fuseflow.telemetry.metrics import read_events, read_metrics

    targets = list(range(kill_every, steps, kill_every))
    if not targets:
        raise ValueError(f"--kill-every={kill_every} must be smaller than --steps={steps}")
    if len(targets) > max_restarts:
        raise ValueError(f"{len(targets)} kills need --max-restarts>={len(targets)} (got {max_restarts})")
    cfg = load_config(preset, [*(overrides or []), "backend=ray", f"trainer.steps={steps}",
                               f"trainer.save_every={save_every}", f"trainer.max_restarts={max_restarts}"])
    root = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="fuseflow-bench-recovery-"))
    runs, walls, load = {}, {}, {"start": round(os.getloadavg()[0], 2)}
    for name in ("full", "killed"):
        killer = Killer(root / name, targets if name == "killed" else [], log)
        killer.start()
        t0 = time.perf_counter()
        try:
            runs[name] = train(cfg, root / name, console=console)
        finally:
            killer.done.set()
            killer.join()
        walls[name] = round(time.perf_counter() - t0, 1)
        load[f"after_{name}"] = round(os.getloadavg()[0], 2)
        log(f"{name}: {walls[name]:.0f}s, held-out accuracy {runs[name]['accuracy_after']}")
    keep = lambda rows: [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/", "trace/"))}  # noqa: E731
                         for r in rows]
    rows = {name: read_metrics(root / name) for name in runs}
    restarts = read_events(root / "killed", "restart")
    acc = {name: runs[name]["accuracy_after"] for name in runs}
    return {
        "benchmark": "recovery", "date": time.strftime("%Y-%m-%d"),
        "machine": f"{cpu_name()}, {os.cpu_count()} cores", "work_dir": str(root),
        "settings": {"preset": cfg.preset, "algorithm": cfg.algorithm.name, "task": cfg.task.name,
                     "backend": cfg.backend, "steps": steps, "save_every": save_every, "kill_every": kill_every,
                     "max_restarts": max_restarts, "seed": cfg.seed, "overrides": list(overrides or [])},
        "kills": killer.kills,
        "restarts": [{k: e[k] for k in ("failed_step", "resumed_from", "seconds_lost", "restart_seconds", "cause")}
                     for e in restarts],
        "summary_restarts": {name: runs[name]["restarts"] for name in runs},
        "steps_logged": {name: [r["step"] for r in rows[name]][-1] if rows[name] else 0 for name in runs},
        "accuracy_before": {name: runs[name]["accuracy_before"] for name in runs},
        "accuracy_after": acc,
        "evals": {name: [[e["step"], e.get("accuracy")] for e in runs[name]["evals"]] for name in runs},
        "wall_seconds": walls,
        "seconds_lost_total": round(sum(e["seconds_lost"] for e in restarts), 1),
        "load_average_1min": load,
        "metrics_equal": keep(rows["full"]) == keep(rows["killed"]),
        "acceptance": {"completed": bool(rows["killed"]) and rows["killed"][-1]["step"] == steps,
                       "restarts_equal_kills": len(restarts) == len(killer.kills) == len(targets),
                       "same_heldout_accuracy": acc["full"] == acc["killed"]},
    }


def register(bench_app) -> None:
    """Add ``fuseflow bench recovery`` to the ``bench`` Typer app."""
    import typer

    @bench_app.command("recovery")
    def bench_recovery(overrides: list[str] = typer.Argument(None, help="Dotted overrides on the preset."),
                       out: Path = typer.Option(None, "--out", "-o", help="Write the JSON here."),
                       steps: int = typer.Option(200, "--steps", help="RL steps of each run."),
                       kill_every: int = typer.Option(50, "--kill-every", help="Kill a worker at these multiples."),
                       max_restarts: int = typer.Option(4, "--max-restarts", help="trainer.max_restarts of both runs."),
                       save_every: int = typer.Option(5, "--save-every", help="trainer.save_every of both runs."),
                       work_dir: Path = typer.Option(None, "--work-dir", help="Keep both run directories here."),
                       preset: str = typer.Option("default", "--preset", "-p", help="Config preset.")) -> None:
        """Kill a Ray worker process every N steps; compare with an uninterrupted run of the same seed."""
        from fuseflow.config import ConfigError
        from fuseflow.console import console, fail

        try:
            result = run_recovery_bench(overrides, steps, kill_every, max_restarts, save_every, preset, work_dir,
                                        log=console.print, console=console)
        except (ConfigError, ValueError, FileNotFoundError) as e:
            fail(str(e))
        for r in result["restarts"]:
            console.print(f"restart: failed at step {r['failed_step']}, resumed from step {r['resumed_from']}, "
                          f"{r['seconds_lost']:.1f}s lost", highlight=False)
        a = result["accuracy_after"]
        console.print(f"held-out accuracy: uninterrupted {a['full']}, killed {a['killed']}; every metric equal: "
                      f"{result['metrics_equal']}; wall {result['wall_seconds']}", highlight=False, soft_wrap=True)
        write_result(out, result)
