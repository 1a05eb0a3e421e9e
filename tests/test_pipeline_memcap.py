"""Peak memory as a hard cap on the fused schedule solver (memcap.py)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from fuseflow.schedule.pipeline.memcap import InfeasibleCap, capped_serial, least_peak, one_at_a_time
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


def test_capped_serial_limits_in_flight():
    # cap 3 lets A (1.5 each) hold 2 and B (1 each) hold 3 micro-batches on a stage.
    start = capped_serial(INST, 3.0)
    assert check_timed(INST, start) == []
    peaks = device_peaks(INST, order_from_times(INST, start))
    assert max(peaks) == 3.0
    assert capped_serial(INST, 1.0) is None  # one A micro-batch (1.5) does not fit


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


def test_execute_bad_input_is_one_line():
    from fuseflow.cli import app

    runner = CliRunner()
    for args, text in ((["--model", "huge"], "--model='huge' is unknown"),
                       (["--micro-batches", "0"], "--micro-batches=0 is invalid"),
                       (["--instance", INST.spec()], "--instance does not apply to --execute")):
        res = runner.invoke(app, ["bench", "pipeline", "--execute", *args])
        assert res.exit_code == 2 and f"error: {text}" in res.output, res.output


@pytest.mark.slow
def test_execute_record_is_consistent():
    from fuseflow.schedule.pipeline import execbench

    rec = execbench.run(model="tiny", vocab=64, micro_batches=2, rows=1, prompt=4, response=4, repeats=1,
                        solver_seconds=2)
    med, pred = rec["median_makespan_s"], rec["predicted_makespan_s"]
    meas = rec["measured_makespan_s"]
    assert rec["fused_speedup_vs_serial"] == round(meas["serial"][0] / meas["fused"][0], 4)
    assert rec["fused_speedup_of_medians"] == round(med["serial"] / med["fused"], 4)
    assert rec["prediction_error_unscaled"] == round(med["fused"] / pred["fused"] - 1, 4)
    assert rec["prediction_error"] == round(med["fused"] / (pred["fused"] * rec["load_scale"][0]) - 1, 4)
    assert len(rec["measured_makespan_s"]["fused"]) == 1 and len(rec["fused_plan"]) == 2
    assert len(rec["parallel_capacity"]) == 2 and all(c > 0 for c in rec["parallel_capacity"])
    assert rec["solver"]["makespan"] >= rec["solver"]["lower_bound"]


@pytest.mark.slow
def test_executor_realises_the_fused_overlap_with_sleeping_stages():
    """Stages that sleep (no CPU contention): the executor's makespans follow the plan's."""
    from fuseflow.models.config import ModelConfig
    from fuseflow.schedule.pipeline import sleepbench
    from fuseflow.schedule.pipeline.actions import one_f_one_b_plan, simulate, solved_plan
    from fuseflow.schedule.pipeline.execbench import ppo_batch
    from fuseflow.schedule.pipeline.train import split_micro_batches

    times = {(m, s, bw): 0.1 if bw else 0.05 for m in "AB" for s in (0, 1) for bw in (False, True)}
    mbs = {m: split_micro_batches(ppo_batch(8, 4, 4, 64), 2) for m in "AB"}
    plans = {"serial": one_f_one_b_plan(2, {"A": 4, "B": 4}),
             "fused": solved_plan(PipelineInstance(2, 2, 4, 4, 5, 5, 1, 1), 5)}
    want = {k: simulate(p, times)[0] for k, p in plans.items()}  # 1.45 s and 1.2 s
    got = sleepbench.run(ModelConfig.preset("tiny", vocab_size=64), times, plans, mbs, 2)["sleep_median_makespan_s"]
    for k in plans:
        assert want[k] <= got[k] < want[k] * 1.15, (k, got[k], want[k])
    assert got["serial"] / got["fused"] > 1.1
