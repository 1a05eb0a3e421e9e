"""Gantt chart of a fused schedule: one row per device, one bar per task.

Model A is blue and model B orange; forwards are light, backwards dark, so the two
opposite-direction pipelines and the bubbles they fill are visible at a glance.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.patches import Patch

from fuseflow.schedule.pipeline.problem import PipelineInstance, Task
from fuseflow.telemetry.plots import plt, save_figure  # importing plots selects the Agg backend

_COLORS = {("A", False): "#9ecae1", ("A", True): "#2171b5", ("B", False): "#fdae6b", ("B", True): "#d94801"}


def gantt(inst: PipelineInstance, start: dict[Task, int], path: str | Path, title: str = "") -> Path:
    """Draw the schedule given by `start` to a PNG at `path` and return the path.

    Saved like every fuseflow PNG (telemetry.plots.save_figure): the folder is created and
    the figure closed, so a bench over many instances does not pile up open figures.
    """
    makespan = max(s + inst.duration(t) for t, s in start.items())
    fig, ax = plt.subplots(figsize=(min(40, 6 + makespan / 25), 1 + 0.45 * inst.n_devices))
    for t, s in start.items():
        d = inst.device(t.model, t.replica, t.stage)
        dur = inst.duration(t)
        ax.broken_barh([(s, dur)], (d - 0.4, 0.8), facecolors=_COLORS[(t.model, t.backward)], linewidth=0)
        if dur >= 4 and makespan <= 800:  # label only where the number stays readable
            ax.text(s + dur / 2, d, str(t.micro_batch), ha="center", va="center", fontsize=5)
    ax.set_ylim(inst.n_devices - 0.5, -0.5)
    ax.set_xlim(0, makespan)
    ax.set_yticks(range(inst.n_devices))
    ax.set_ylabel("device")
    ax.set_xlabel("time")
    ax.set_title(title or f"{inst.spec()}  makespan {makespan}")
    ax.legend(
        handles=[Patch(color=c, label=f"{m} {'backward' if b else 'forward'}") for (m, b), c in _COLORS.items()],
        loc="upper right",
        fontsize=7,
        ncol=4,
    )
    return save_figure(fig, Path(path))
