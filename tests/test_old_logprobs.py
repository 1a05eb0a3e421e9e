"""algorithm.old_logprobs=rollout: the engine's sampling log-probs stand in for the old-log-prob forward."""

from __future__ import annotations

import pytest

from fuseflow.config import load_config
from fuseflow.trainer import RLTrainer

TINY = ["sft.max_steps=40", "sft.eval_every=20", "sft.eval_size=20", "task.train_size=400", "task.eval_size=20",
        "trainer.steps=2", "trainer.prompts_per_step=4", "algorithm.group_size=4", "trainer.mini_batch_size=8",
        "trainer.micro_batch_size=4", "trainer.eval_size=20", "trainer.epochs=2"]


def _two_steps(tmp_path, cache, source: str):
    cfg = load_config("default", TINY + [f"cache_dir={cache}", f"algorithm.old_logprobs={source}"])
    tr = RLTrainer(cfg, tmp_path / source, log=lambda *_: None)
    try:
        start = {k: v.detach().clone() for k, v in tr.actor.rollout_weights().items()}
        metrics = [tr.step(1), tr.step(2)]
        weights = {k: v.detach().clone() for k, v in tr.actor.rollout_weights().items()}
    finally:
        tr.close()
    moved = max(float((weights[k] - start[k]).abs().max()) for k in start)
    assert moved > 1e-4, moved  # the updates did something
    return metrics, weights


def test_rollout_logprobs_train_as_the_recomputed_ones(tmp_path, sft_cache):
    rec, w_rec = _two_steps(tmp_path, sft_cache, "recompute")
    roll, w_roll = _two_steps(tmp_path, sft_cache, "rollout")
    # The old-log-prob forward ran in one run only; the recomputed log-probs matched the engine's.
    assert all("time/old_logprob" in m for m in rec) and not any("time/old_logprob" in m for m in roll)
    assert all(m["rollout/logprob_diff_max"] < 1e-4 for m in rec)
    assert not any("rollout/logprob_diff_max" in m for m in roll)  # it would be 0 by construction
    # Same samples (same seeds, and step 2's policy differs from the other run's only by float rounding)...
    for a, b in zip(rec, roll, strict=True):
        assert a["rollout/response_length_mean"] == b["rollout/response_length_mean"]
        assert a["reward/mean"] == b["reward/mean"]
        assert a["kl/ref_k3"] == pytest.approx(b["kl/ref_k3"], abs=1e-5)
        assert a["actor/clip_frac"] == b["actor/clip_frac"]
    # ...and the same weights after two updates of two epochs each, to float rounding.
    assert w_rec.keys() == w_roll.keys()
    worst = max(float((w_rec[k] - w_roll[k]).abs().max()) for k in w_rec)
    assert worst < 1e-5, worst


@pytest.mark.parametrize(("overrides", "text"), [
    (["rollout.backend=hf"], "rollout.backend=hf is not it"),
    (["schedule.mode=async", "schedule.rollout_workers=2", "algorithm.policy_loss=decoupled"],
     "trains on samples of an older policy"),
    (["algorithm.rollout_is=tis"], "which is 1 when algorithm.old_logprobs=rollout"),
])
def test_rollout_logprobs_bad_settings(overrides, text):
    with pytest.raises(ValueError, match=text):
        load_config("default", ["algorithm.old_logprobs=rollout", *overrides])


def test_default_recomputes():
    assert load_config("default", []).algorithm.old_logprobs == "recompute"
    assert load_config("smollm", []).algorithm.old_logprobs == "rollout"
    with pytest.raises(ValueError):
        load_config("default", ["algorithm.old_logprobs=sampler"])
