"""Gantt charts and per-step metrics from a run's ``trace.json`` (Chrome trace format).

One row per track (a worker or thread: ``pid``/``tid`` of the events), one bar per span,
so stage overlap (fused and async modes) and long-tail migration show at a glance; the
same file opens in Perfetto for zooming. The metric functions are pure: they take parsed
events and return numbers, so the controller can log them each step and tests can check
them against hand-computed intervals.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .trace import step_of

SAMPLE_DONE = "sample_done"  # instant event name marking a sample that finished generating


@dataclass(frozen=True)
class Span:
    name: str
    track: tuple[int, int]  # (pid, tid)
    start: float  # seconds from the trace origin
    end: float
    step: int


@dataclass(frozen=True)
class Instant:
    name: str
    track: tuple[int, int]
    t: float
    step: int


@dataclass
class Trace:
    spans: list[Span] = field(default_factory=list)
    instants: list[Instant] = field(default_factory=list)
    track_names: dict[tuple[int, int], str] = field(default_factory=dict)

    def tracks(self) -> list[tuple[int, int]]:
        """Every track with an event or a name, in (pid, tid) order."""
        keys = {s.track for s in self.spans} | {i.track for i in self.instants} | set(self.track_names)
        return sorted(keys)

    def name(self, track: tuple[int, int]) -> str:
        """A track's name as the tracer recorded it, or ``track P:T`` when it was never named."""
        return self.track_names.get(track, f"track {track[0]}:{track[1]}")

    def steps(self) -> list[int]:
        """The steps that have any span or instant in the trace, ascending."""
        return sorted({s.step for s in self.spans} | {i.step for i in self.instants})


def parse_trace(data: dict | list) -> Trace:
    """A ``Trace`` from Chrome-trace JSON (the object form with ``traceEvents``, or a bare event list)."""
    events = data.get("traceEvents", []) if isinstance(data, dict) else data
    out = Trace()
    for e in events:
        ph, track = e.get("ph"), (int(e.get("pid", 0)), int(e.get("tid", 0)))
        step = step_of(e)
        if ph == "X":
            start = float(e["ts"]) / 1e6
            out.spans.append(Span(e.get("name", ""), track, start, start + float(e.get("dur", 0.0)) / 1e6, step))
        elif ph in ("i", "I"):
            out.instants.append(Instant(e.get("name", ""), track, float(e["ts"]) / 1e6, step))
        elif ph == "M" and e.get("name") == "thread_name":
            out.track_names[track] = str(e["args"]["name"])
    return out


def load_trace(path: str | Path) -> Trace:
    """Parse ``trace.json``; a missing or unreadable file is a clear error."""
    p = Path(path)
    if p.is_dir():
        p = p / "trace.json"
    if not p.is_file():
        raise FileNotFoundError(f"no trace at {p}; a run directory written by `fuseflow train` holds trace.json")
    try:
        return parse_trace(json.loads(p.read_text()))
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{p} is not a Chrome trace file ({type(exc).__name__}: {exc})") from exc


# ----------------------------------------------------------------------------------- metrics
def union_seconds(intervals: Iterable[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (nested or overlapping spans count once)."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def step_window(trace: Trace, step: int) -> tuple[float, float] | None:
    """(first span start, last span end) of ``step`` over all tracks, or None when it has no spans."""
    spans = [s for s in trace.spans if s.step == step]
    if not spans:
        return None
    return min(s.start for s in spans), max(s.end for s in spans)


def busy_fraction(trace: Trace, step: int, tracks: Sequence[tuple[int, int]] | None = None) -> dict[str, float]:
    """Per track, the fraction of the step's wall-clock window it spent inside spans.

    The window runs from the step's first span start to its last span end over all tracks,
    so a worker idle during the long tail shows a low fraction. Tracks with no span in the
    step report 0.0 when listed in ``tracks`` (default: tracks with spans in the step).
    """
    window = step_window(trace, step)
    if window is None:
        return {}
    lo, hi = window
    per_track: dict[tuple[int, int], list[tuple[float, float]]] = defaultdict(list)
    for s in trace.spans:
        if s.step == step:
            per_track[s.track].append((max(s.start, lo), min(s.end, hi)))
    keys = list(tracks) if tracks is not None else sorted(per_track)
    width = hi - lo
    return {trace.name(k): (union_seconds(per_track.get(k, [])) / width if width > 0 else 0.0) for k in keys}


def long_tail_seconds(finish_times: Iterable[float]) -> float:
    """Time from the first finished sample to the last (0.0 for fewer than two samples)."""
    ts = list(finish_times)
    return max(ts) - min(ts) if len(ts) > 1 else 0.0


def trace_step_metrics(trace: Trace, step: int) -> dict[str, float]:
    """Per-step metrics for ``metrics.jsonl``: busy fraction per track, mean busy fraction, long-tail time."""
    busy = busy_fraction(trace, step)
    out = {f"trace/busy_fraction/{name}": v for name, v in busy.items()}
    if busy:
        out["trace/busy_fraction_mean"] = sum(busy.values()) / len(busy)
    done = [i.t for i in trace.instants if i.step == step and i.name == SAMPLE_DONE]
    if done:
        out["trace/long_tail_seconds"] = long_tail_seconds(done)
    return out


# -------------------------------------------------------------------------------------- plot
def plot_gantt(trace: Trace, out: str | Path, steps: Sequence[int] | None = None, title: str | None = None) -> Path:
    """Write a Gantt PNG: one row per track, bars coloured by span name, ticks for sample finishes."""
    from .plots import plt, save_figure  # importing plots selects the Agg backend

    keep = set(steps) if steps is not None else None
    spans = [s for s in trace.spans if keep is None or s.step in keep]
    instants = [i for i in trace.instants if keep is None or i.step in keep]
    if not spans:
        raise ValueError(f"no spans to plot{f' for steps {sorted(keep)}' if keep else ''}; "
                         f"the trace has steps {trace.steps()}")
    tracks = sorted({s.track for s in spans} | {i.track for i in instants})
    row = {t: i for i, t in enumerate(tracks)}
    t0 = min(s.start for s in spans)
    names = sorted({s.name for s in spans})
    cmap = plt.get_cmap("tab20")
    color = {n: cmap(i % 20) for i, n in enumerate(names)}
    fig, ax = plt.subplots(figsize=(12, 1.6 + 0.55 * max(len(tracks), len(names) / 3)))
    # Longest first, so spans nested inside others are drawn on top and stay visible.
    for s in sorted(spans, key=lambda s: s.start - s.end):
        ax.broken_barh([(s.start - t0, max(s.end - s.start, 1e-6))], (row[s.track] - 0.4, 0.8),
                       facecolors=color[s.name], edgecolors="black", linewidth=0.3)
    for i in instants:
        ax.plot([i.t - t0] * 2, [row[i.track] - 0.45, row[i.track] + 0.45], color="black", linewidth=0.6)
    for step in sorted({s.step for s in spans}):
        lo = min(s.start for s in spans if s.step == step) - t0
        ax.axvline(lo, color="gray", linestyle=":", linewidth=0.8)
        ax.text(lo, -0.5, f" step {step}", fontsize=7, color="gray", va="top")
    ax.set_yticks(range(len(tracks)), [trace.name(t) for t in tracks])
    ax.set_ylim(len(tracks) - 0.45, -0.65)  # first track on top
    ax.set_xlabel("seconds")
    ax.set_title(title or "timeline (one row per worker)")
    handles = [plt.Rectangle((0, 0), 1, 1, facecolor=color[n]) for n in names]
    ax.legend(handles, names, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    return save_figure(fig, out)
