"""The trainer runs unchanged on every rollout backend; per-request seeds give the same samples."""

import pytest

from fuseflow.config import load_config
from fuseflow.runner import train
from fuseflow.telemetry.metrics import read_metrics
from test_train_e2e import TINY


def test_the_engine_is_the_default_backend():
    assert load_config("default", []).rollout.backend == "engine"


@pytest.mark.parametrize("backend", ["engine", "hf"])
def test_backend_trains_like_the_sampler(tmp_path, sft_cache, backend):
    base = TINY + [f"cache_dir={sft_cache}", "trainer.steps=2"]
    train(load_config("default", base + ["rollout.backend=sampler"]), tmp_path / "sampler")
    train(load_config("default", base + [f"rollout.backend={backend}"]), tmp_path / backend)
    ref, got = read_metrics(tmp_path / "sampler"), read_metrics(tmp_path / backend)
    if backend == "engine":
        # Step 1 starts from identical weights and per-request seeds, so the engine must sample the
        # sampler's tokens: same rewards and lengths. (transformers `generate` uses its own global RNG.)
        for key in ("reward/mean", "rollout/response_length_mean", "rollout/response_length_max"):
            assert got[0][key] == ref[0][key], key
    assert [r["step"] for r in got] == [1, 2]
    for row in got:
        assert row["rollout/logprob_diff_max"] < 1e-4  # the backend's log-probs match the trainer's
