"""Timeline spans in Chrome trace format (open ``trace.json`` in Perfetto or chrome://tracing)."""

from __future__ import annotations

import json
import os
import threading
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path


class Tracer:
    """Records named spans per track and accumulates seconds per stage name.

    Each span is a complete event (``ph: "X"``) with microsecond ``ts``/``dur``; ``tid``
    is the track (one per worker once work runs on several), ``args.step`` the RL step.
    ``instant`` records a point in time (``ph: "i"``), e.g. a sample finishing generation,
    from which long-tail metrics are derived (see ``fuseflow.telemetry.gantt``).
    """

    def __init__(self, path: Path | None = None, tracks: dict[int, str] | None = None):
        self.path = Path(path) if path else None
        self.events: list[dict] = []
        self.tracks = tracks or {0: "trainer"}
        self.totals: dict[str, float] = defaultdict(float)
        self._t0 = time.perf_counter()
        self._lock = threading.Lock()  # strategies record spans from several worker threads
        if self.path and self.path.exists():  # resume: keep the spans already recorded
            try:
                old = json.loads(self.path.read_text())
                self.events = [e for e in old.get("traceEvents", []) if e.get("ph") in ("X", "i")]
                self.tracks = {e["tid"]: e["args"]["name"] for e in old.get("traceEvents", [])
                               if e.get("ph") == "M" and e.get("name") == "thread_name"} | self.tracks
                if self.events:
                    end = max(e["ts"] + e.get("dur", 0.0) for e in self.events)
                    self._t0 -= end / 1e6
            except (json.JSONDecodeError, KeyError):
                self.events = []

    @contextmanager
    def span(self, name: str, step: int, track: int = 0, **args):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.record(name, step, track, start, time.perf_counter(), **args)

    def record(self, name: str, step: int, track: int, start: float, end: float, **args) -> None:
        """A span from ``start`` to ``end`` (``time.perf_counter()`` seconds); safe from any thread."""
        with self._lock:
            self.totals[name] += end - start
            self.events.append({"name": name, "ph": "X", "pid": 0, "tid": track,
                                "ts": round((start - self._t0) * 1e6, 1), "dur": round((end - start) * 1e6, 1),
                                "args": {"step": step, **args}})

    def instant(self, name: str, step: int, track: int = 0, **args) -> None:
        """A point event on ``track`` now (thread-scoped, as Perfetto shows it on that track's row)."""
        ts = round((time.perf_counter() - self._t0) * 1e6, 1)
        with self._lock:
            self.events.append({"name": name, "ph": "i", "s": "t", "pid": 0, "tid": track, "ts": ts,
                                "args": {"step": step, **args}})

    def name_track(self, track: int, name: str) -> None:
        """Label a track (e.g. ``rollout-1``) as workers appear; the label shows in Perfetto and Gantt plots."""
        self.tracks[track] = name

    def seconds_for(self, step: int) -> dict[str, float]:
        """Seconds per stage name spent in ``step``."""
        out: dict[str, float] = defaultdict(float)
        for e in self.events:
            if e.get("ph") == "X" and e["args"].get("step") == step:
                out[e["name"]] += e["dur"] / 1e6
        return dict(out)

    def drop_after(self, step: int) -> None:
        self.events = [e for e in self.events if e["args"].get("step", 0) <= step]

    def save(self) -> None:
        if not self.path:
            return
        meta = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": t, "args": {"name": n}}
                for t, n in self.tracks.items()]
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps({"traceEvents": meta + self.events, "displayTimeUnit": "ms"}))
        os.replace(tmp, self.path)
