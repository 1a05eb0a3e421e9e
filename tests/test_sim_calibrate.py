"""Calibration recovers known efficiency factors from a synthetic run directory."""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml

from fuseflow.sim import calibrate as calibrate_mod
from fuseflow.sim.calibrate import (
    StepRecord,
    calibrate,
    fit,
    load_run,
    predict_stages,
    step_lengths,
)
from fuseflow.sim.hardware import get_hardware

TINY = {"hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 384, "vocab_size": 40, "tie_word_embeddings": True}  # fmt: skip
TRUE = {"train_mfu": 0.12, "infer_mfu": 0.2, "layer_latency_s": 4e-4, "host_seconds_per_sample": 5e-5}


def fabricate(run_dir, algorithm: str = "ppo", steps: int = 12, noise: float = 0.03, longer: int = 0) -> float:
    """Write a run dir whose stage times come from known factors; returns the true median step time."""
    (run_dir / "config.yaml").write_text(yaml.safe_dump({
        "model": {"size": "tiny"}, "algorithm": {"name": algorithm},
        "trainer": {"mini_batch_size": 64, "micro_batch_size": 32, "epochs": 1},
    }))  # fmt: skip
    (run_dir / "model_config.json").write_text(json.dumps(TINY))
    from fuseflow.sim.calibrate import RunData
    from fuseflow.sim.modelspec import from_hf_config

    run = RunData(from_hf_config(TINY), algorithm, 64, 32, 1, [])
    hw = get_hardware("cpu").with_efficiency(**TRUE)
    rng = np.random.default_rng(0)
    events, metrics, totals = [], [], []
    t = 0.0
    for k in range(steps):
        rec = StepRecord(k, 128, 20.0 + 3 * (k % 4), 6.0 + 2.0 * (k % 5) + longer, 16 + 4 * (k % 3) + 2 * longer, 0.0)
        stages = predict_stages(run, rec, hw)
        total = 0.0
        for name, secs in stages.items():
            secs = secs * (1 + noise * rng.uniform(-1, 1)) if secs > 0 else 1e-6
            events.append({"name": name, "ph": "X", "ts": t * 1e6, "dur": secs * 1e6, "pid": 0, "tid": 0,
                           "args": {"step": k}})  # fmt: skip
            t += secs
            total += secs
        totals.append(total * 1.02)  # logging and data loading outside the traced stages
        metrics.append({"step": k, "time/step_seconds": total * 1.02, "rollout/num_samples": rec.samples,
                        "rollout/prompt_length_mean": rec.prompt_mean, "rollout/response_length_mean": rec.response_mean,
                        "rollout/response_length_max": rec.response_max})  # fmt: skip
    (run_dir / "trace.json").write_text(json.dumps({"traceEvents": events}))
    (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(m) for m in metrics) + "\n")
    return float(np.median(totals))


def test_step_lengths_keep_mean_and_max():
    prompt, resp = step_lengths(StepRecord(0, 10, 12.0, 5.0, 14, 1.0))
    assert resp.max() == 14 and resp.sum() == 50 and (prompt == 12).all()


def test_calibration_recovers_factors_and_step_time(tmp_path):
    true_median = fabricate(tmp_path)
    out = calibrate(tmp_path, "cpu")
    eff = out["fitted_efficiency"]
    for key in ("train_mfu", "infer_mfu", "layer_latency_s"):
        assert eff[key] == pytest.approx(TRUE[key], rel=0.15), key
    assert out["median_step_seconds"]["measured"] == pytest.approx(true_median)
    assert abs(out["median_step_seconds"]["relative_error"]) < 0.05
    assert abs(out["held_out"]["relative_error"]) < 0.08


def test_fit_builds_each_step_shape_once(tmp_path, monkeypatch):
    # The shapes do not depend on the factors, so the optimiser's thousands of loss
    # evaluations must reuse them: one build per step record, not one per evaluation.
    fabricate(tmp_path, steps=3)
    run = load_run(tmp_path)
    calls = []
    real = calibrate_mod.step_shapes
    monkeypatch.setattr(calibrate_mod, "step_shapes", lambda r, rec: calls.append(rec.step) or real(r, rec))
    fitted = fit(run, get_hardware("cpu"))
    assert sorted(calls) == [0, 1, 2]
    assert fitted.efficiency.train_mfu == pytest.approx(TRUE["train_mfu"], rel=0.15)


def test_calibrate_builds_each_step_shape_once(tmp_path, monkeypatch):
    # Both fits (all steps, even steps) and all predictions (all steps, odd steps) price
    # the same steps: one shared build per step, where each use used to build its own.
    fabricate(tmp_path, algorithm="grpo", steps=4)
    calls = []
    real = calibrate_mod.step_shapes
    monkeypatch.setattr(calibrate_mod, "step_shapes", lambda r, rec: calls.append(rec.step) or real(r, rec))
    ticks = []
    out = calibrate(tmp_path, "cpu", on_progress=lambda done, total: ticks.append((done, total)))
    assert sorted(calls) == [0, 1, 2, 3]
    assert ticks == [(i, 2 * calibrate_mod.FIT_STARTS) for i in range(1, 2 * calibrate_mod.FIT_STARTS + 1)]
    assert "held_out" in out and out["steps"] == 4
    run = load_run(tmp_path)
    with pytest.raises(ValueError, match="one StepShapes per step record: got 1 for 4"):
        fit(run, get_hardware("cpu"), shapes=[real(run, run.steps[0])])


def test_missing_files_are_named(tmp_path):
    with pytest.raises(ValueError, match="missing config.yaml"):
        load_run(tmp_path)
    fabricate(tmp_path, steps=2)
    (tmp_path / "model_config.json").unlink()
    with pytest.raises(ValueError, match="model_config.json"):
        load_run(tmp_path)


def test_factors_fitted_on_one_run_predict_another(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    fabricate(tmp_path / "a", algorithm="grpo", steps=8)
    fabricate(tmp_path / "b", algorithm="grpo", steps=4, longer=20)  # responses 20 tokens longer, caps 40 longer
    (tmp_path / "b" / "trace.json").unlink()  # predicting needs only the config and metrics
    out = calibrate(tmp_path / "a", "cpu", predict_dir=tmp_path / "b")
    assert out["other_run"]["measured"] > 1.3 * out["median_step_seconds"]["measured"]
    assert abs(out["other_run"]["relative_error"]) < 0.05


def test_trimmed_micro_batches_price_less_than_padding(tmp_path):
    # A run with schedule.token_budget groups rows by length: one long response no longer
    # widens every row, so inference and training cost less than on the padded batch.
    fabricate(tmp_path, steps=2)
    padded = load_run(tmp_path)
    cfg = yaml.safe_load((tmp_path / "config.yaml").read_text())
    cfg["schedule"] = {"token_budget": 4096}
    cfg["rollout"] = {"backend": "engine"}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    trimmed = load_run(tmp_path)
    assert padded.token_budget is None and trimmed.token_budget == 4096 and not trimmed.padded_prompts
    hw = get_hardware("cpu").with_efficiency(**TRUE)
    rec = StepRecord(0, 128, 20.0, 6.0, 60, 0.0, prompt_max=30.0)
    a, b = predict_stages(padded, rec, hw), predict_stages(trimmed, rec, hw)
    for stage in ("reference", "old_logprob", "actor_update", "critic_update"):
        assert b[stage] < a[stage], stage
    assert b["generate"] <= a["generate"]  # the engine starts each row at its own prompt length


def test_nelder_mead_finds_a_known_minimum():
    # Rosenbrock in 2-D (minimum 0 at (1, 1), a curved valley) and a shifted quadratic in 4-D.
    from fuseflow.sim.calibrate import nelder_mead

    rosen = lambda x: (1 - x[0]) ** 2 + 100 * (x[1] - x[0] ** 2) ** 2  # noqa: E731
    x = nelder_mead(rosen, np.array([-1.2, 1.0]), iters=2000, tol=1e-14)
    assert np.allclose(x, [1.0, 1.0], atol=1e-3)
    target = np.array([0.5, -2.0, 3.0, 1.5])
    x = nelder_mead(lambda x: float(np.sum((x - target) ** 2)), np.zeros(4), iters=2000, tol=1e-14)
    assert np.allclose(x, target, atol=1e-4)


def test_rollout_logprobs_run_has_no_old_logprob_stage(tmp_path):
    # algorithm.old_logprobs=rollout in a run's config: the prediction drops that forward, and only it.
    fabricate(tmp_path)
    cfg = yaml.safe_load((tmp_path / "config.yaml").read_text())
    rec = StepRecord(0, 128, 20.0, 6.0, 16, 0.0)
    hw = get_hardware("cpu").with_efficiency(**TRUE)
    recompute = predict_stages(load_run(tmp_path), rec, hw)
    cfg["algorithm"]["old_logprobs"] = "rollout"
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    rollout = predict_stages(load_run(tmp_path), rec, hw)
    assert recompute["old_logprob"] > 0 and "old_logprob" not in rollout
    assert rollout == {k: v for k, v in recompute.items() if k != "old_logprob"}
