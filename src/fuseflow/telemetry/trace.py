"""Timeline spans in Chrome trace format (open ``trace.json`` in Perfetto or chrome://tracing)."""

from __future__ import annotations

import json
import os
import threading
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

KEEP_INSTANTS = 100  # steps whose instants (one per finished sample in pooled modes) a trace keeps


def step_of(event: dict) -> int:
    """The RL step a trace event belongs to (``args.step``; 0 without one)."""
    return int((event.get("args") or {}).get("step", 0))


class Tracer:
    """Records named spans per track and accumulates seconds per stage name.

    Each span is a complete event (``ph: "X"``) with microsecond ``ts``/``dur``; ``tid``
    is the track (one per worker once work runs on several), ``args.step`` the RL step.
    ``instant`` records a point in time (``ph: "i"``), e.g. a sample finishing generation,
    from which long-tail metrics are derived (see ``fuseflow.telemetry.gantt``).

    Events are held per step, so a step's lookups (``seconds_for``, ``events_for``) cost that step's
    events whatever the run's length. Instants are kept for the last ``keep_instants`` steps only (spans
    for every step): a pooled mode records one per finished sample, which over thousands of steps held
    hundreds of MB and made every step's scan of the whole list cost 120 ms by step 2000 (a
    microbenchmark at 256 instants and 20 spans a step).
    """

    def __init__(self, path: Path | None = None, tracks: dict[int, str] | None = None,
                 keep_instants: int = KEEP_INSTANTS):
        self.path = Path(path) if path else None
        self.keep_instants = keep_instants
        self._steps: dict[int, list[dict]] = {}  # step -> its events, in the order they were recorded
        self._instants_from = 0  # steps before this one hold their spans only
        self.tracks = tracks or {0: "trainer"}
        self.totals: dict[str, float] = defaultdict(float)
        self._t0 = time.perf_counter()
        self._lock = threading.Lock()  # strategies record spans from several worker threads
        if self.path and self.path.exists():  # resume: keep the spans already recorded
            try:
                old = json.loads(self.path.read_text())
                kept = [e for e in old.get("traceEvents", []) if e.get("ph") in ("X", "i")]
                self.tracks = {e["tid"]: e["args"]["name"] for e in old.get("traceEvents", [])
                               if e.get("ph") == "M" and e.get("name") == "thread_name"} | self.tracks
                for e in sorted(kept, key=step_of):
                    self._add(e)
                if kept:
                    end = max(e["ts"] + e.get("dur", 0.0) for e in kept)
                    self._t0 -= end / 1e6
            except (json.JSONDecodeError, KeyError):
                self._steps, self._instants_from = {}, 0

    @property
    def events(self) -> list[dict]:
        """Every event held, step by step (a copy)."""
        with self._lock:
            return [e for events in self._steps.values() for e in events]

    def events_for(self, step: int) -> list[dict]:
        """The events of ``step`` (a copy); costs the size of that step, not of the run."""
        with self._lock:
            return list(self._steps.get(step, ()))

    def _add(self, event: dict) -> None:
        """File ``event`` under its step (the caller holds the lock, or no other thread runs yet)."""
        step = step_of(event)
        events = self._steps.get(step)
        if events is None:  # a new step: steps keep_instants or more behind it keep their spans only
            events = self._steps[step] = []
            for old in range(self._instants_from, step - self.keep_instants + 1):
                if old in self._steps:
                    self._steps[old] = [e for e in self._steps[old] if e.get("ph") == "X"]
            self._instants_from = max(self._instants_from, step - self.keep_instants + 1)
        events.append(event)

    @contextmanager
    def span(self, name: str, step: int, track: int = 0, **args):
        """Time the ``with`` block as a span ``name`` of ``step`` on ``track`` (``args`` go into the event)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.record(name, step, track, start, time.perf_counter(), **args)

    def record(self, name: str, step: int, track: int, start: float, end: float, **args) -> None:
        """A span from ``start`` to ``end`` (``time.perf_counter()`` seconds); safe from any thread."""
        with self._lock:
            self.totals[name] += end - start
            self._add({"name": name, "ph": "X", "pid": 0, "tid": track,
                       "ts": round((start - self._t0) * 1e6, 1), "dur": round((end - start) * 1e6, 1),
                       "args": {"step": step, **args}})

    def instant(self, name: str, step: int, track: int = 0, **args) -> None:
        """A point event on ``track`` now (thread-scoped, as Perfetto shows it on that track's row)."""
        ts = round((time.perf_counter() - self._t0) * 1e6, 1)
        with self._lock:
            self._add({"name": name, "ph": "i", "s": "t", "pid": 0, "tid": track, "ts": ts,
                       "args": {"step": step, **args}})

    def name_track(self, track: int, name: str) -> None:
        """Label a track (e.g. ``rollout-1``) as workers appear; the label shows in Perfetto and Gantt plots."""
        self.tracks[track] = name

    def seconds_for(self, step: int) -> dict[str, float]:
        """Seconds per stage name spent in ``step``."""
        out: dict[str, float] = defaultdict(float)
        for e in self.events_for(step):
            if e.get("ph") == "X":
                out[e["name"]] += e["dur"] / 1e6
        return dict(out)

    def drop_after(self, step: int) -> None:
        """Forget the events of steps after ``step`` (a resumed run redoes them)."""
        with self._lock:
            self._steps = {s: events for s, events in self._steps.items() if s <= step}
            self._instants_from = min(self._instants_from, step + 1)

    def save(self) -> None:
        """Write the trace as Chrome trace-event JSON (``chrome://tracing``, Perfetto), atomically; a no-op without a path."""
        if not self.path:
            return
        meta = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": t, "args": {"name": n}}
                for t, n in self.tracks.items()]
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps({"traceEvents": meta + self.events, "displayTimeUnit": "ms"}))
        os.replace(tmp, self.path)
