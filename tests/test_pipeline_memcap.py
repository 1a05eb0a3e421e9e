"""Peak memory as a hard cap on the fused schedule solver (memcap.py)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from fuseflow.schedule.pipeline.memcap import InfeasibleCap, least_peak, one_at_a_time
from fuseflow.schedule.pipeline.problem import PipelineInstance, check_timed, device_peaks, order_from_times
from fuseflow.schedule.pipeline.solver import solve

INST = PipelineInstance.parse("4,4,4,4,3,2,1.5,1")


@pytest.fixture(scope="module")
def free():
    return solve(INST, seconds=5)


def test_one_at_a_time_holds_one_micro_batch():
    start = one_at_a_time(INST)
    assert check_timed(INST, start) == []
    # Hand-computed: never more than one micro-batch held, so the peak is the heavier model's 1.5.
    assert max(device_peaks(INST, order_from_times(INST, start))) == least_peak(INST) == 1.5


@pytest.mark.parametrize("cap", [1.5, 2.5, 4.0])
def test_capped_solve_respects_the_cap(cap, free):
    res = solve(INST, seconds=5, memory_cap=cap)
    assert check_timed(INST, res.start) == []
    assert res.peak_memory <= cap
    # Recomputed from the order, not trusted from the result.
    assert max(device_peaks(INST, order_from_times(INST, res.start))) <= cap
    assert res.makespan >= free.makespan  # a cap can only cost time
    if cap < free.peak_memory:
        assert res.makespan > free.makespan or res.peak_memory < free.peak_memory


def test_cap_at_the_uncapped_peak_keeps_the_makespan(free):
    res = solve(INST, seconds=5, memory_cap=free.peak_memory)
    assert res.makespan == free.makespan and res.peak_memory <= free.peak_memory


def test_infeasible_cap_is_one_clear_error():
    with pytest.raises(InfeasibleCap, match=r"memory cap 1.4 is infeasible .* use --memory-cap >= 1.5"):
        solve(INST, seconds=5, memory_cap=1.4)


def test_cli_memory_cap(tmp_path):
    from fuseflow.cli import app

    runner = CliRunner()
    bad = runner.invoke(app, ["bench", "pipeline", "--instance", INST.spec(), "--memory-cap", "1"])
    assert bad.exit_code == 2
    assert "error: memory cap 1 is infeasible" in bad.output and "Traceback" not in bad.output
    out = tmp_path / "one.json"
    ok = runner.invoke(app, ["bench", "pipeline", "--instance", INST.spec(), "--memory-cap", "2.5",
                             "--seconds", "5", "--out", str(out)])
    assert ok.exit_code == 0, ok.output
    rec = json.loads(out.read_text())
    assert rec["memory_cap"] == 2.5 and rec["peak_memory"] <= 2.5 and rec["valid"]
