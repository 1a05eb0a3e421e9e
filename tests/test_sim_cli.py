"""The simulator's CLI commands, registered on a throwaway Typer app."""

from __future__ import annotations

import json

import pytest
import typer
from typer.testing import CliRunner

from fuseflow.sim.commands import register


@pytest.fixture(scope="module")
def app() -> typer.Typer:
    app = typer.Typer()
    register(app)
    return app


runner = CliRunner()


@pytest.mark.parametrize("args,needle", [
    (["plan", "--model", "llama-71b", "--gpus", "8"], "--model 'llama-71b': unknown; choose one of: llama-7b"),
    (["plan", "--model", "llama-7b", "--gpus", "8", "--gpu-type", "X100"], "--gpu-type 'X100': unknown; choose one of"),
    (["plan", "--model", "llama-7b", "--gpus", "0"], "--gpus 0: must be > 0"),
    (["plan", "--model", "llama-7b", "--gpus", "-4"], "--gpus -4: must be > 0"),
    (["plan", "--model", "llama-7b", "--gpus", "8", "--policies", "fused,turbo"], "--policies 'turbo': unknown"),
    (["simulate", "--scenario", "nope"], "--scenario 'nope': unknown; choose one of: rlhfuse, hybridflow, rlhfless"),
    (["sim", "calibrate", "/no/such/run"], "run_dir '/no/such/run': not a directory"),
])  # fmt: skip
def test_bad_input_is_one_line_and_exit_2(app, args, needle):
    res = runner.invoke(app, args)
    assert res.exit_code == 2
    assert needle in res.output
    assert "Traceback" not in res.output


def test_plan_json_and_write_config(app, tmp_path):
    out = tmp_path / "plan.yaml"
    res = runner.invoke(app, ["plan", "--model", "llama-7b", "--gpus", "8", "--gpu-type", "A100", "--json",
                              "--top", "2", "--prompts", "32", "--response-len", "256", "--prompt-len", "256",
                              "--write-config", str(out)])  # fmt: skip
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert 1 <= len(data["plans"]) <= 2 and data["plans"][0]["iteration_seconds"] > 0
    assert "placement:" in out.read_text() and "prompts_per_step: 32" in out.read_text()


def test_plan_uses_a_length_trace(app, tmp_path):
    lens = tmp_path / "lens.txt"
    args = ["plan", "--model", "llama-7b", "--gpus", "8", "--gpu-type", "A100", "--json", "--top", "1",
            "--prompts", "32", "--prompt-len", "128", "--policies", "sequential", "--response-lengths", str(lens)]
    times = []
    for n in (64, 512):
        lens.write_text("\n".join([str(n)] * 10))
        res = runner.invoke(app, args)
        assert res.exit_code == 0, res.output
        times.append(json.loads(res.output)["plans"][0]["iteration_seconds"])
    assert times[1] > 2 * times[0]  # 8x longer responses cost much more
    lens.write_text("none here")
    res = runner.invoke(app, args)
    assert res.exit_code == 2 and "--response-lengths" in res.output


def test_simulate_scenario_json_has_policy_fields(app, tmp_path):
    out = tmp_path / "r.json"
    res = runner.invoke(app, ["simulate", "--scenario", "rlhfless", "--json", "--out", str(out)])
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    for case in data["cases"]:
        for row in case["policies"].values():
            assert {"iteration_seconds", "samples_per_second", "gpu_seconds", "speedup_vs_sequential"} <= set(row)
        assert case["policies"]["sequential"]["speedup_vs_sequential"] == 1.0


def test_calibrate_command_on_synthetic_run(app, tmp_path):
    from test_sim_calibrate import fabricate

    fabricate(tmp_path, steps=6)
    res = runner.invoke(app, ["sim", "calibrate", str(tmp_path), "--json"])
    assert res.exit_code == 0, res.output
    assert abs(json.loads(res.output)["median_step_seconds"]["relative_error"]) < 0.1
