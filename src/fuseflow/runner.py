"""Runs ``fuseflow train``: evaluation before and after RL, progress, checkpoints, summary and plots."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from fuseflow.checkpoint import latest_checkpoint, prune_checkpoints
from fuseflow.config import Config
from fuseflow.console import make_progress
from fuseflow.controller.group import WorkerFailure
from fuseflow.memory import bound_heap_retention
from fuseflow.preflight import check_inputs
from fuseflow.telemetry.metrics import read_events, read_metrics
from fuseflow.telemetry.plots import plot_run, stage_seconds_per_step
from fuseflow.trainer import RLTrainer


def train(cfg: Config, run_dir: Path, resume: bool = False, console: Console | None = None,
          stop_after: int | None = None) -> dict:
    """Run (or resume) RL training into ``run_dir``; returns the summary written to ``summary.json``.

    ``stop_after`` ends the run early after that step, as an interruption would (used by tests).
    """
    console = console or Console()
    started = time.perf_counter()  # trainer.time_limit_minutes counts from here
    if cfg.trainer.release_freed_memory:
        bound_heap_retention()  # freed activations go back to the kernel (see fuseflow.memory)
    check_inputs(cfg)  # the files the config names, before the run directory exists
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if not resume:
        _write_atomic(run_dir / "config.yaml", cfg.to_yaml())
    with make_progress(console) as progress:
        trainer = RLTrainer(cfg, run_dir, resume=resume, log=console.print, progress=progress)
        restarts, budget = 0, max_restarts(cfg)
        bar = progress.add_task("RL", total=cfg.trainer.steps, completed=trainer.start_step)
        while True:
            # "saved": when the newest checkpoint was complete; "started": when this run began
            clock = {"saved": time.perf_counter(), "started": started}
            try:
                _run_steps(trainer, cfg, run_dir, progress, bar, clock, console, stop_after)
                break
            except WorkerFailure as e:  # a worker died or a collective timed out
                failed_at, step = time.perf_counter(), trainer.current_step
                trainer.close()
                ckpt = latest_checkpoint(run_dir)
                if restarts >= budget:  # say what survives and how to go on
                    kept = f"last checkpoint: {ckpt.name}" if ckpt else "no checkpoint had been written yet"
                    spent = f"after {restarts} automatic restart(s) (trainer.max_restarts={budget}); " if budget else ""
                    raise e.noted(f"{spent}{kept}; resume with: fuseflow train --resume {run_dir}") from None
                restarts += 1
                # escape: a worker's error text may hold brackets (gloo's "[/path/unbound_buffer.cc:78]")
                console.print(f"[yellow]restart {restarts}/{budget}:[/] {escape(str(e))}; starting the workers again from "
                              f"{ckpt.name if ckpt else 'the start'}", highlight=False)
                # Same config, same placement, fresh processes; the exact-resume path reloads the checkpoint.
                trainer = RLTrainer(cfg, run_dir, resume=True, log=console.print, progress=progress)
                now = time.perf_counter()
                lost = now - clock["saved"]  # the steps redone since the checkpoint, plus tear-down and start-up
                trainer.metrics.event(trainer.start_step, "restart", failed_step=step, resumed_from=trainer.start_step,
                                      cause=str(e), seconds_lost=round(lost, 3), restart_seconds=round(now - failed_at, 3))
                trainer.tracer.record("restart", trainer.start_step, 0, now - lost, now, failed_step=step, cause=str(e))
                progress.update(bar, completed=trainer.start_step)
            except BaseException:
                trainer.close()
                raise
        trainer.close()
    if hasattr(trainer.task, "close"):
        trainer.task.close()  # a reward process pool (reward.workers)
    summary = summarize(run_dir, trainer.evals, cfg, trainer.sft_curve)
    _write_atomic(run_dir / "summary.json", json.dumps(summary, indent=2))
    plot_run(run_dir, trainer.evals, trainer.sft_curve)
    print_summary(console, summary, run_dir)
    return summary


def max_restarts(cfg: Config) -> int:
    """``trainer.max_restarts``, or its default: 3 on Ray (worker processes can die alone), 0 locally."""
    if cfg.trainer.max_restarts is not None:
        return cfg.trainer.max_restarts
    return 3 if cfg.backend == "ray" else 0


def _run_steps(trainer: RLTrainer, cfg: Config, run_dir: Path, progress, bar, clock: dict, console: Console,
               stop_after: int | None) -> None:
    """The RL steps from the trainer's start step to ``trainer.steps``: step, evaluate, log, save."""
    t = cfg.trainer
    trainer.current_step = trainer.start_step
    (run_dir / "model_config.json").write_text(json.dumps(trainer.actor.model_config(), indent=1))
    deadline = None if t.time_limit_minutes is None else clock["started"] + 60 * t.time_limit_minutes
    eval_seconds = 0.0  # the longest held-out evaluation seen: what the final one is expected to take
    if not any(e["step"] == 0 for e in trainer.evals):
        t0 = time.perf_counter()
        ev = trainer.evaluate(0)
        eval_seconds = time.perf_counter() - t0
        if "accuracy" in ev:
            start = "SFT model" if cfg.sft.enabled else f"model.path={cfg.model.path}"
            console.print(f"Held-out accuracy before RL ({start}): {ev['accuracy']:.3f}")
    for step in range(trainer.start_step + 1, t.steps + 1):
        trainer.current_step = step
        t0 = time.perf_counter()
        m = trainer.step(step)
        now = time.perf_counter()
        # Out of time when another step like this one plus the final evaluation would end past the deadline.
        last = step == t.steps or (deadline is not None and now + (now - t0) + eval_seconds > deadline)
        if step % t.eval_every == 0 or last:
            m |= {f"eval/{k}": v for k, v in trainer.evaluate(step).items()}
            eval_seconds = max(eval_seconds, time.perf_counter() - now)
        trainer.metrics.log(step, m)
        if step % t.save_every == 0 or last:
            trainer.save(step)
            clock["saved"] = time.perf_counter()
            prune_checkpoints(run_dir, t.keep_checkpoints, trainer.evals)  # only once the new one is complete
        progress.update(bar, completed=step, description=(
            f"RL step {step} reward {m['reward/mean']:.3f} "
            + (f"acc {m['reward/accuracy']:.3f} " if "reward/accuracy" in m else "")
            + f"{m['perf/tokens_per_second']:.0f} tok/s"))
        if stop_after is not None and step >= stop_after:
            break
        if last and step < t.steps:
            console.print(f"trainer.time_limit_minutes={t.time_limit_minutes:g}: stopped after step {step} of "
                          f"{t.steps} ({(time.perf_counter() - clock['started']) / 60:.1f} minutes)")
            break


EXTRA_EVALS = ("cost", "rm_score", "gold_score", "gold_win_rate")


def summarize(run_dir: Path, evals: list[dict], cfg: Config, sft_curve: list[dict]) -> dict:
    """The run's headline figures; later benchmarks read these names."""
    rows = read_metrics(run_dir)
    ev = sorted(evals, key=lambda e: e["step"])
    k = max(1, min(5, len(rows) // 4 or 1))  # mean over a few steps: one step's reward is noisy
    rewards = [r["reward/mean"] for r in rows]
    seconds = sum(r["time/step_seconds"] for r in rows)
    samples = sum(r["rollout/num_samples"] for r in rows)
    tokens = sum(r["rollout/num_samples"] * r["rollout/response_length_mean"] for r in rows)
    stages: dict[str, float] = {}
    for per_stage in stage_seconds_per_step(run_dir / "trace.json").values():
        for name, s in per_stage.items():
            stages[name] = stages.get(name, 0.0) + s
    # Held-out extras, when the run has them: cost rate (safe_ppo), learned-RM score and gold win rate (RLHF).
    extras = {f"{key}_{when}": e[key] for key in EXTRA_EVALS for when, e in (("before", ev[0] if ev else {}),
                                                                          ("after", ev[-1] if ev else {})) if key in e}
    return extras | {
        "preset": cfg.preset, "algorithm": cfg.algorithm.name, "task": cfg.task.name,
        # None where the task has no correct answer (scored by a reward model alone)
        "accuracy_before": ev[0].get("accuracy") if ev else None,
        "accuracy_after": ev[-1].get("accuracy") if ev else None,
        "accuracy_gain": (ev[-1]["accuracy"] - ev[0]["accuracy"]) if ev and "accuracy" in ev[0] else None,
        "reward_first": sum(rewards[:k]) / k if rows else None,
        "reward_last": sum(rewards[-k:]) / k if rows else None,
        "reward_window_steps": k,
        "steps": rows[-1]["step"] if rows else 0,
        "wall_seconds": seconds,
        "samples_per_second": samples / seconds if seconds else 0.0,
        "tokens_per_second": tokens / seconds if seconds else 0.0,
        "stage_seconds": {k2: round(v, 3) for k2, v in sorted(stages.items())},
        "sft_steps": sft_curve[-1]["step"] if sft_curve else 0,
        "sft_best_accuracy": max((c["accuracy"] for c in sft_curve if "accuracy" in c), default=None),
        "restarts": len(read_events(run_dir, "restart")),  # automatic restarts (trainer.max_restarts)
        "evals": ev,
    }


def print_summary(console: Console, s: dict, run_dir: Path) -> None:
    """Print a finished run's summary (``summary.json``'s ``s``) as a table: accuracy before and after, rewards,
    throughput, any extra held-out evaluations and the seconds per stage, then where the run's files are."""
    table = Table(title=f"fuseflow run summary ({s['algorithm']} on {s['task']})")
    table.add_column("metric")
    table.add_column("value", justify="right")
    fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else "n/a" if v is None else str(v)  # noqa: E731
    for key in ("accuracy_before", "accuracy_after", "accuracy_gain", "reward_first", "reward_last", "steps",
                "wall_seconds", "samples_per_second", "tokens_per_second"):
        table.add_row(key, fmt(s[key]))
    for key in EXTRA_EVALS:
        for when in ("before", "after"):
            if f"{key}_{when}" in s:
                table.add_row(f"{key}_{when}", fmt(s[f"{key}_{when}"]))
    for stage, sec in s["stage_seconds"].items():
        table.add_row(f"  seconds in {stage}", fmt(sec))
    console.print(table)
    console.print(f"Run directory: {run_dir}  (summary.json, metrics.jsonl, trace.json, plots/, checkpoints/)")


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
