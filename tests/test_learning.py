"""A short real run shows learning: RL reward rises and held-out accuracy beats the SFT start."""

from fuseflow.config import load_config
from fuseflow.runner import train
from fuseflow.telemetry.metrics import read_metrics


def test_grpo_run_learns(tmp_path, sft_cache):
    # The default task and recipe, with a fixed-length SFT and a short RL phase so it fits CI.
    cfg = load_config("default", [
        f"cache_dir={sft_cache}", "task.eval_size=200", "sft.max_steps=900", "sft.eval_every=300",
        "sft.eval_size=200", "trainer.steps=24", "trainer.eval_size=200", "trainer.eval_every=24",
        "trainer.save_every=24",
    ])
    summary = train(cfg, tmp_path / "run")
    rewards = [r["reward/mean"] for r in read_metrics(tmp_path / "run")]
    early, late = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert late > early + 0.08, (early, late, rewards)
    assert summary["accuracy_after"] > summary["accuracy_before"] + 0.1, summary
