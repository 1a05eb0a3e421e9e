"""elastic and fused+elastic train exactly like sequential; DAPO's dynamic sampling keeps the same groups in
every mode; elastic bills only the time its replicas are held."""

from __future__ import annotations

import pytest
import torch

from fuseflow.bench.trl import QUICK_OVERRIDES
from fuseflow.config import load_config
from fuseflow.trainer import RLTrainer
from test_schedule_modes import _run, _same_training


def test_elastic_and_fused_elastic_train_like_sequential(tmp_path, sft_cache):
    seq = _run(tmp_path, sft_cache, [])
    for mode in ("elastic", "fused+elastic"):
        run = _run(tmp_path, sft_cache, [f"schedule.mode={mode}", "schedule.rollout_workers=2",
                                         "schedule.migration_threshold=0.9", "schedule.token_budget=256"])
        _same_training(seq, run)
        for m in run[1]:
            assert 1 <= m["elastic/replicas"] <= 2
            assert m["elastic/length_abs_error"] >= 0 and m["elastic/tail_seconds"] >= 0
            # Held time only: never more than both replicas for the whole step.
            assert 0 < m["time/rollout_worker_seconds"] <= 2 * m["time/step_seconds"]
    for m in seq[1]:  # one reserved replica, held for the whole step
        assert m["time/rollout_worker_seconds"] == pytest.approx(m["time/step_seconds"], rel=0.05, abs=0.05)


def _dapo(tmp_path, sft_cache, extra):
    cfg = load_config("sort", [*QUICK_OVERRIDES, "algorithm.name=dapo", "algorithm.max_extra_draws=2",
                               "trainer.steps=2", "trainer.eval_every=100", "trainer.save_every=100",
                               "trainer.eval_size=8", "task.eval_size=8", f"cache_dir={sft_cache}", *extra])
    tr = RLTrainer(cfg, tmp_path / ("dapo-" + "_".join(extra).replace("=", "-").replace("+", "p")),
                   log=lambda *_: None)
    batches, metrics = [], []
    try:
        for step in (1, 2):
            batch, m = tr.make_experience(step)
            batches.append(batch)
            metrics.append(m)
    finally:
        tr.close()
    return batches, metrics


def test_dynamic_sampling_keeps_the_same_groups_in_every_mode(tmp_path, sft_cache):
    seq = _dapo(tmp_path, sft_cache, [])
    assert any(m["dapo/draw_rounds"] > 1 for m in seq[1]), "the test needs a step that draws again"
    for extra in (["schedule.mode=fused", "schedule.rollout_workers=2"],
                  ["schedule.mode=elastic", "schedule.rollout_workers=2"],
                  ["schedule.mode=async", "schedule.max_staleness=0"]):
        other = _dapo(tmp_path, sft_cache, extra)
        for x, y in zip(seq[0], other[0], strict=True):
            assert x.meta["uid"] == y.meta["uid"] and torch.equal(x["input_ids"], y["input_ids"]), extra
            assert torch.equal(x["scores"], y["scores"])
            mask = x["response_mask"]
            for k in ("old_logprobs", "ref_logprobs"):
                assert torch.allclose(x[k] * mask, y[k] * mask, atol=1e-5), (extra, k)
        for a, b in zip(seq[1], other[1], strict=True):
            assert {k: v for k, v in a.items() if k.startswith("dapo/")} == \
                   {k: v for k, v in b.items() if k.startswith("dapo/")}, extra
