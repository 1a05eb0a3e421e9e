"""Trace tracks, trace-derived metrics and the Gantt plot / `fuseflow plot trace` command."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from fuseflow.cli import app
from fuseflow.telemetry import Tracer
from fuseflow.telemetry.gantt import (
    SAMPLE_DONE,
    busy_fraction,
    load_trace,
    long_tail_seconds,
    parse_trace,
    trace_step_metrics,
    union_seconds,
)


def X(name, tid, ts, dur, step=1, pid=0):  # microseconds, as in the file
    return {"name": name, "ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": dur, "args": {"step": step}}


def hand_trace() -> dict:
    meta = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": t, "args": {"name": n}}
            for t, n in ((0, "rollout-0"), (1, "rollout-1"), (2, "train"))]
    events = [X("generate", 0, 0, 10e6), X("generate", 1, 0, 4e6), X("reference", 1, 5e6, 2e6),
              X("values", 1, 6e6, 2e6),  # overlaps reference: counted once
              X("actor_update", 2, 10e6, 6e6),
              X("generate", 0, 20e6, 1e6, step=2)]
    inst = [{"name": SAMPLE_DONE, "ph": "i", "s": "t", "pid": 0, "tid": t, "ts": ts, "args": {"step": 1}}
            for t, ts in ((1, 3e6), (1, 4e6), (0, 10e6))]
    return {"traceEvents": meta + events + inst}


def test_union_seconds():
    assert union_seconds([(0, 2), (1, 3), (5, 6), (5.5, 5.7)]) == 4
    assert union_seconds([]) == 0


def test_busy_fraction_and_long_tail_hand_computed():
    tr = parse_trace(hand_trace())
    # Step 1 window: 0 .. 16 s. rollout-0 busy 10, rollout-1 busy 4 + (5..8)=3 -> 7, train 6.
    assert busy_fraction(tr, 1) == {"rollout-0": 10 / 16, "rollout-1": 7 / 16, "train": 6 / 16}
    assert busy_fraction(tr, 2) == {"rollout-0": 1.0}
    assert busy_fraction(tr, 2, tracks=[(0, 0), (0, 2)]) == {"rollout-0": 1.0, "train": 0.0}
    assert busy_fraction(tr, 9) == {}
    assert long_tail_seconds([3.0, 4.0, 10.0]) == 7.0 and long_tail_seconds([1.0]) == 0.0
    m = trace_step_metrics(tr, 1)
    assert m["trace/long_tail_seconds"] == pytest.approx(7.0)
    assert m["trace/busy_fraction_mean"] == pytest.approx((10 + 7 + 6) / 48)
    assert "trace/long_tail_seconds" not in trace_step_metrics(tr, 2)


def test_tracer_tracks_instants_and_resume(tmp_path):
    path = tmp_path / "trace.json"
    t = Tracer(path)
    t.name_track(3, "rollout-1")
    with t.span("generate", 1, track=3):
        pass
    t.instant(SAMPLE_DONE, 1, track=3, uid=7)
    with t.span("actor_update", 1):
        pass
    assert set(t.seconds_for(1)) == {"generate", "actor_update"}  # instants carry no duration
    t.save()
    tr = load_trace(tmp_path)
    assert tr.track_names == {(0, 0): "trainer", (0, 3): "rollout-1"}
    assert [s.track for s in tr.spans] == [(0, 3), (0, 0)] and tr.instants[0].track == (0, 3)
    resumed = Tracer(path)  # resume keeps spans, instants and track names
    assert len(resumed.events) == 3 and resumed.tracks[3] == "rollout-1"


def test_tracer_files_events_per_step_and_keeps_instants_of_recent_steps_only(tmp_path):
    t = Tracer(keep_instants=2)
    for step in range(1, 6):
        with t.span("generate", step, track=1):
            pass
        for uid in range(3):
            t.instant(SAMPLE_DONE, step, track=1, uid=uid)
    # a step's lookup sees that step alone
    assert [e["args"]["uid"] for e in t.events_for(5) if e["ph"] == "i"] == [0, 1, 2]
    assert set(t.seconds_for(4)) == {"generate"} and t.events_for(9) == []
    # steps 1-3 lie more than 2 steps behind step 5: their spans stay, their instants are gone
    by_step = {s: [e["ph"] for e in t.events if e["args"]["step"] == s] for s in range(1, 6)}
    assert by_step == {1: ["X"], 2: ["X"], 3: ["X"], 4: ["X", "i", "i", "i"], 5: ["X", "i", "i", "i"]}
    t.drop_after(4)
    assert t.events_for(5) == [] and len(t.events) == 3 + 4
    path = tmp_path / "trace.json"
    t.path = path
    t.save()
    resumed = Tracer(path, keep_instants=2)
    assert [e["ph"] for e in resumed.events] == ["X", "X", "X", "X", "i", "i", "i"]
    with resumed.span("generate", 6, track=1):  # a new step prunes again: step 4 keeps its span only
        pass
    assert [e["ph"] for e in resumed.events_for(4)] == ["X"]


def test_plot_trace_cli(tmp_path):
    (tmp_path / "trace.json").write_text(json.dumps(hand_trace()))
    res = CliRunner().invoke(app, ["plot", "trace", str(tmp_path)])
    assert res.exit_code == 0, res.output
    png = tmp_path / "plots" / "trace.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "3 tracks" in res.output
    res = CliRunner().invoke(app, ["plot", "trace", str(tmp_path), "--steps", "2", "--out", str(tmp_path / "s2.png")])
    assert res.exit_code == 0 and (tmp_path / "s2.png").is_file()
    res = CliRunner().invoke(app, ["plot", "trace", str(tmp_path), "--steps", "7"])
    assert res.exit_code == 2 and "no spans" in res.output
    res = CliRunner().invoke(app, ["plot", "trace", str(tmp_path / "missing")])
    assert res.exit_code == 2 and "no trace" in res.output
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "trace.json").write_text("{not json")
    res = CliRunner().invoke(app, ["plot", "trace", str(tmp_path / "bad")])
    assert res.exit_code == 2 and "not a Chrome trace" in res.output
