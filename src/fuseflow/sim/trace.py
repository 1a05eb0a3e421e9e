"""Timeline outputs of a simulation: a Chrome trace (open in Perfetto) and a Gantt PNG.

The trace uses the same event shape as fuseflow's real runs ("X" events in
microseconds, `args.step`), one process per device set and one thread per track,
so a simulated and a measured timeline can be opened side by side.
"""

from __future__ import annotations

import json
from pathlib import Path

from .engine import TraceEvent

COLORS = {
    "generate": "#4C72B0", "migrate": "#8172B2", "load_weights": "#937860", "reference": "#55A868",
    "values": "#64B5CD", "reward": "#CCB974", "old_logprob": "#8C8C8C", "advantages": "#DA8BC3",
    "actor_update": "#C44E52", "critic_update": "#DD8452", "actor_update+critic_update": "#A04040",
    "weight_sync": "#222222",
}  # fmt: skip


def chrome_trace(events: list[TraceEvent]) -> dict:
    """Chrome trace JSON object: {"traceEvents": [...]} with process/thread names."""
    lanes = {lane: i for i, lane in enumerate(dict.fromkeys(e.lane for e in events))}
    tracks: dict[tuple[str, str], int] = {}
    out = [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": lane}} for lane, pid in lanes.items()]
    for e in events:
        key = (e.lane, e.track)
        if key not in tracks:
            tracks[key] = len(tracks)
            out.append({"name": "thread_name", "ph": "M", "pid": lanes[e.lane], "tid": tracks[key],
                        "args": {"name": e.track}})  # fmt: skip
        out.append({
            "name": e.name, "ph": "X", "ts": e.start * 1e6, "dur": e.dur * 1e6, "pid": lanes[e.lane],
            "tid": tracks[key], "args": {"step": e.step, "gpus": e.gpus},
        })  # fmt: skip
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def write_trace(events: list[TraceEvent], path: str | Path) -> Path:
    """Write `chrome_trace(events)` as JSON (open it in Perfetto or chrome://tracing)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(events)))
    return path


def write_gantt(events: list[TraceEvent], path: str | Path, title: str = "", max_tracks: int = 40) -> Path:
    """A Gantt chart: one row per (set, track); rollout replicas beyond `max_tracks` rows are merged."""
    from fuseflow.telemetry.plots import plt, save_figure  # importing plots selects the Agg backend

    rows: dict[tuple[str, str], int] = {}
    per_lane: dict[str, int] = {}
    for e in events:
        key = (e.lane, e.track)
        if key in rows:
            continue
        n = per_lane.get(e.lane, 0)
        if n >= max_tracks:
            rows[key] = rows[(e.lane, "...")] if (e.lane, "...") in rows else len(rows)
            rows.setdefault((e.lane, "..."), rows[key])
        else:
            rows[key] = len(set(rows.values()))
        per_lane[e.lane] = n + 1
    labels: dict[int, str] = {}
    for (lane, track), r in rows.items():
        labels.setdefault(r, f"{lane}:{track}")
    height = max(3.0, 0.22 * len(labels) + 1.5)
    fig, ax = plt.subplots(figsize=(12, height))
    seen = set()
    for e in events:
        if e.dur <= 0:
            continue
        label = e.name if e.name not in seen else None
        seen.add(e.name)
        ax.barh(rows[(e.lane, e.track)], e.dur, left=e.start, height=0.8,
                color=COLORS.get(e.name, "#999999"), label=label)  # fmt: skip
    ax.set_yticks(list(labels), [labels[r] for r in labels], fontsize=6)
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title(title)
    ax.legend(loc="upper right", fontsize=7)
    return save_figure(fig, path)
