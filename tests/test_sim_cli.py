"""The simulator's CLI commands, registered on a throwaway Typer app."""

from __future__ import annotations

import json

import pytest
import typer
from typer.testing import CliRunner

from fuseflow.sim.commands import register
from fuseflow.sim.scenarios import run_scenario


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
    (["plan", "--model", "[b]ig", "--gpus", "8"], "--model '[b]ig': unknown"),  # kept, not read as rich markup
])  # fmt: skip
def test_bad_input_is_one_line_and_exit_2(app, args, needle):
    # The simulator's commands report errors through fuseflow.console.fail, as every other
    # command does: one "error: ..." line on stderr, exit code 2.
    res = runner.invoke(app, args)
    assert res.exit_code == 2
    assert res.stderr.startswith("error: ") and needle in res.stderr and not res.stdout
    assert res.stderr.count("\n") == 1
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


def _plan_config(app, tmp_path, *extra: str):
    out = tmp_path / "plan.yaml"
    res = runner.invoke(app, ["plan", "--top", "1", "--prompt-len", "256", "--response-len", "256", *extra,
                              "--write-config", str(out)])  # fmt: skip
    assert res.exit_code == 0, res.output
    return out


@pytest.mark.parametrize("extra", [
    ("--model", "llama-70b", "--gpus", "256", "--gpu-type", "H100", "--policies", "sequential,async"),
    ("--model", "qwen2.5-7b", "--gpus", "16", "--gpu-type", "L40S", "--algorithm", "grpo",
     "--samples-per-prompt", "8", "--prompts", "64", "--policies", "sequential"),
])  # fmt: skip
def test_written_plan_loads_through_the_real_config(app, tmp_path, extra):
    import yaml

    from fuseflow.config import load_config

    out = _plan_config(app, tmp_path, *extra)
    text = out.read_text()
    tree = yaml.safe_load(text)
    cfg = load_config("default", base=tree)  # raises ConfigError on any key fuseflow rejects
    assert cfg.backend == "ray" and cfg.schedule.mode == "sequential"
    pools = cfg.resolved_placement().pools
    dp = cfg.role_dp()
    for role in ("actor", "critic"):  # a training role shards over its whole pool, an equal share per rank
        assert dp[role] == pools[getattr(cfg.placement, role)].size
        assert cfg.trainer.mini_batch_size % dp[role] == 0
    gpus = int(extra[extra.index("--gpus") + 1])
    assert sum(p.size for p in pools.values()) <= gpus
    assert text.startswith("# fuseflow plan: ") and "layouts" in text  # the TP/PP plan survives as comments


def test_written_plan_is_accepted_by_config_show(app, tmp_path):
    from fuseflow.cli import app as fuseflow_app

    out = _plan_config(app, tmp_path, "--model", "llama-7b", "--gpus", "16", "--gpu-type", "A100",
                       "--prompts", "64", "--policies", "sequential")  # fmt: skip
    res = runner.invoke(fuseflow_app, ["config", "show", "--config", str(out)])
    assert res.exit_code == 0, res.output
    assert "backend: ray" in res.output and "gpus_per_worker: 1.0" in res.output
    bad = tmp_path / "bad.yaml"
    bad.write_text("backend: ray\npools: {x: {nodes: 1}}\n")
    res = runner.invoke(fuseflow_app, ["config", "show", "--config", str(bad)])
    assert res.exit_code == 2 and "pools.x: no role is placed on it" in res.output


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


def test_simulate_scenario_json_has_policy_fields(app, tmp_path, monkeypatch):
    from fuseflow.sim import commands

    calls = []  # the callback behind the progress bar: one call per case, counted, with its name

    def recording(name, trace_dir, iterations, on_case):
        def both(done, total, case):
            calls.append((done, total, case))
            on_case(done, total, case)

        return run_scenario(name, trace_dir, iterations, both)

    monkeypatch.setattr(commands, "run_scenario", recording)
    out = tmp_path / "r.json"
    res = runner.invoke(app, ["simulate", "--scenario", "rlhfless", "--json", "--out", str(out)])
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert json.loads(res.stdout) == data  # the progress bar goes to stderr: stdout is the JSON alone
    assert calls == [(i + 1, 4, c["case"]) for i, c in enumerate(data["cases"])]
    for case in data["cases"]:
        for row in case["policies"].values():
            assert {"iteration_seconds", "samples_per_second", "gpu_seconds", "speedup_vs_sequential"} <= set(row)
        assert case["policies"]["sequential"]["speedup_vs_sequential"] == 1.0
        assert case["plan"]["generation"]["tp"] == 2  # verl's example layout is the baseline


def test_calibrate_command_on_synthetic_run(app, tmp_path):
    from test_sim_calibrate import fabricate

    fabricate(tmp_path, steps=6)
    res = runner.invoke(app, ["sim", "calibrate", str(tmp_path), "--json"])
    assert res.exit_code == 0, res.output
    # The progress bar goes to stderr; stdout is the JSON alone.
    assert abs(json.loads(res.stdout)["median_step_seconds"]["relative_error"]) < 0.1
    assert "calibrate: fit starts" in res.stderr

