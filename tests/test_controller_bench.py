"""`fuseflow bench controller`: the summary arithmetic by hand, and (slow) the command end to end."""

import json

import pytest

from fuseflow.bench.controller import summarize
from fuseflow.config import load_config


def _rows(steps, cpu):
    return [{"time/step_seconds": s, "time/worker_compute": s - 0.1, "time/controller_overhead": 0.1,
             "time/cpu_seconds": c, "reward/mean": 0.5} for s, c in zip(steps, cpu, strict=True)]


def test_summary_uses_medians_after_the_warmup_step():
    rows = {"local": _rows([9.0, 1.0, 2.0, 1.2], [9.0, 1.0, 1.0, 1.0]),  # timed median 1.2
            "ray_dp1": _rows([9.0, 1.5, 1.4, 1.45], [9.0, 1.25, 1.25, 1.25]),  # timed median 1.45
            "ray_dp2": _rows([9.0, 0.6, 0.6, 0.6], [9.0, 2.0, 2.0, 2.0])}
    out = summarize(rows, load_config("default"), steps=4, threads=1, load=[1.0] * 4)
    assert out["variants"]["local"]["step_seconds"] == 1.2 and out["variants"]["ray_dp1"]["step_seconds"] == 1.45
    assert out["ratios"]["ray_dp1_vs_local"] == pytest.approx(1.45 / 1.2, abs=1e-4)
    assert out["ratios"]["ray_dp2_vs_local"] == 0.5
    assert out["ray_overhead_frac_dp1"] == pytest.approx(0.25 / 1.45, abs=1e-4)  # 17%: under the 20% bar
    assert out["ray_overhead_frac_dp1_cpu"] == pytest.approx(0.25 / 1.25)
    assert out["variants"]["ray_dp1"]["controller_overhead_frac"] == pytest.approx(0.1 / 1.45, abs=1e-4)
    assert out["acceptance"]["ray_overhead_dp1_at_most_20pct"] is True
    rows["ray_dp1"] = _rows([9.0, 1.6, 1.6, 1.6], [9.0, 1.0, 1.0, 1.0])
    assert summarize(rows, load_config("default"), 4, 1, [1.0] * 4)["acceptance"][
        "ray_overhead_dp1_at_most_20pct"] is False
    with pytest.raises(ValueError, match="steps must be >= 2"):
        from fuseflow.bench.controller import run_controller_bench

        run_controller_bench(steps=1)


@pytest.mark.slow
def test_bench_command_end_to_end(tmp_path, sft_cache):
    from typer.testing import CliRunner

    from fuseflow.cli import app

    out = tmp_path / "bench.json"
    result = CliRunner().invoke(app, ["bench", "controller", "--out", str(out), "--steps", "3", f"cache_dir={sft_cache}",
                                      "sft.max_steps=20", "sft.eval_every=10", "sft.eval_size=10", "task.eval_size=10",
                                      "trainer.prompts_per_step=4", "algorithm.group_size=4",
                                      "trainer.mini_batch_size=16", "trainer.micro_batch_size=8"])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert set(data["variants"]) == {"local", "ray_dp1", "ray_dp2"}
    # Same seed, same prompts: the dp=1 Ray trainer earns the local trainer's rewards.
    assert data["variants"]["ray_dp1"]["reward_per_step"] == pytest.approx(data["variants"]["local"]["reward_per_step"])
