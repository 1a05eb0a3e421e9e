"""PNG plots of a run directory: reward/accuracy, response lengths, stage times, SFT curve."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on training machines
import matplotlib.pyplot as plt  # noqa: E402

from .metrics import read_metrics  # noqa: E402


def stage_seconds_per_step(trace_path: Path) -> dict[int, dict[str, float]]:
    """{step: {stage: seconds}} from the spans of ``trace.json``."""
    if not trace_path.exists():
        return {}
    out: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for e in json.loads(trace_path.read_text()).get("traceEvents", []):
        if e.get("ph") == "X":
            out[e["args"].get("step", 0)][e["name"]] += e["dur"] / 1e6
    return out


def plot_run(run_dir: Path, evals: list[dict], sft_curve: list[dict]) -> list[Path]:
    """Write ``plots/*.png`` for a run and return their paths."""
    run_dir = Path(run_dir)
    out_dir = run_dir / "plots"
    out_dir.mkdir(exist_ok=True)
    rows = read_metrics(run_dir)
    steps = [r["step"] for r in rows]
    written = []

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r.get("reward/mean") for r in rows], label="train reward (sampled)")
    if any("reward/accuracy" in r for r in rows):
        ax.plot(steps, [r.get("reward/accuracy") for r in rows], label="train accuracy (sampled)", alpha=0.7)
    ev = sorted((e for e in evals if "accuracy" in e), key=lambda e: e["step"])
    if ev:
        ax.plot([e["step"] for e in ev], [e["accuracy"] for e in ev], "o-", label="held-out accuracy (greedy)")
    ax.set(xlabel="RL step", ylabel="value", title="Reward and accuracy")
    if ev:  # accuracies are fractions; a reward model's scores are unbounded and keep their own range
        ax.set_ylim(0, 1.05)
    ax.legend()
    written.append(save_figure(fig, out_dir / "reward.png"))

    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label in (("mean", "mean"), ("max", "max"), ("min", "min")):
        ax.plot(steps, [r.get(f"rollout/response_length_{key}") for r in rows], label=label)
    ax.set(xlabel="RL step", ylabel="tokens", title="Response length")
    ax.legend()
    written.append(save_figure(fig, out_dir / "response_length.png"))

    per_step = stage_seconds_per_step(run_dir / "trace.json")
    stages = [s for s in ("generate", "reward", "old_logprob", "reference", "values", "advantages",
                          "critic_update", "actor_update", "weight_sync")
              if any(s in v for v in per_step.values())]
    if per_step and stages:
        fig, ax = plt.subplots(figsize=(7, 4))
        xs = sorted(k for k in per_step if k > 0)
        bottom = [0.0] * len(xs)
        for s in stages:
            ys = [per_step[x].get(s, 0.0) for x in xs]
            ax.bar(xs, ys, bottom=bottom, label=s, width=1.0)
            bottom = [b + y for b, y in zip(bottom, ys, strict=True)]
        ax.set(xlabel="RL step", ylabel="seconds", title="Time per stage")
        ax.legend(fontsize=7)
        written.append(save_figure(fig, out_dir / "stage_time.png"))

    if sft_curve and "accuracy" in sft_curve[0]:
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot([c["step"] for c in sft_curve], [c["accuracy"] for c in sft_curve], "o-", label="held-out accuracy")
        ax2 = ax.twinx()
        ax2.plot([c["step"] for c in sft_curve], [c["loss"] for c in sft_curve], color="gray", alpha=0.6,
                 label="train loss")
        ax.set(xlabel="SFT step", ylabel="held-out accuracy (greedy)", title="SFT warm start (early-stopped)")
        ax2.set_ylabel("loss")
        ax.legend(loc="lower right")
        written.append(save_figure(fig, out_dir / "sft_curve.png"))
    return written


def moving_average(ys: list[float], window: int) -> list[float]:
    """Trailing mean over the last ``window`` values (fewer at the start): [1, 3, 5], 2 -> [1, 2, 4]."""
    return [sum(ys[max(0, i - window + 1):i + 1]) / (i + 1 - max(0, i - window + 1)) for i in range(len(ys))]


def save_figure(fig, path: Path) -> Path:
    """Lay out, write (folder created) and close a figure: every fuseflow PNG is saved this way."""
    path = Path(path)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path



def plot_compare(runs: list[Path], metric: str, out: Path, smooth: int = 1) -> tuple[Path, dict[str, list[float]]]:
    """One PNG with ``metric`` against step for several runs (e.g. ``schedule.mode`` A/B); the series.

    ``smooth > 1`` draws a trailing moving average over that many steps on top of the raw
    points, which is how "within noise" is judged by eye. Raises ``ValueError`` naming the run
    when one has no metrics or lacks ``metric`` (listing the metrics it has).
    """
    if smooth < 1:
        raise ValueError(f"--smooth must be >= 1, got {smooth}")
    data: dict[str, tuple[list[int], list[float]]] = {}
    for run in runs:
        rows = read_metrics(run)
        if not rows:
            raise ValueError(f"{run}: no metrics.jsonl (is it a run directory?)")
        have = [r for r in rows if r.get(metric) is not None]
        if not have:
            known = sorted({k for r in rows for k in r if k != "step"})
            raise ValueError(f"{run}: no metric {metric!r}; it has: {', '.join(known)}")
        label = Path(run).name
        while label in data:  # two runs with the same directory name
            label += "'"
        data[label] = ([r["step"] for r in have], [float(r[metric]) for r in have])
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, (xs, ys) in data.items():
        if smooth == 1:
            ax.plot(xs, ys, marker=".", label=label)
            continue
        line = ax.plot(xs, ys, marker=".", linestyle="", alpha=0.45)[0]
        avg = moving_average(ys, smooth)
        ax.plot(xs, avg, color=line.get_color(), label=f"{label} ({smooth}-step mean)")
    ax.set_xlabel("step")
    ax.set_ylabel(metric)
    ax.legend()
    return save_figure(fig, out), {label: ys for label, (_, ys) in data.items()}
