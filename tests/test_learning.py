"""A short real run shows learning: RL reward rises and held-out accuracy beats the SFT start."""

from fuseflow.config import load_config
from fuseflow.runner import train
from fuseflow.telemetry.metrics import read_metrics


def test_grpo_run_learns(tmp_path, sft_cache):
    cfg = load_config("default", [
        f"cache_dir={sft_cache}", "task.max_digits=2", "task.train_size=3000", "task.eval_size=200",
        "sft.max_steps=400", "sft.eval_every=100", "sft.eval_size=200",
        "trainer.steps=24", "trainer.prompts_per_step=16", "trainer.mini_batch_size=128",
        "trainer.micro_batch_size=128", "trainer.eval_size=200", "trainer.eval_every=12", "trainer.save_every=24",
    ])
    summary = train(cfg, tmp_path / "run")
    rewards = [r["reward/mean"] for r in read_metrics(tmp_path / "run")]
    early, late = sum(rewards[:6]) / 6, sum(rewards[-6:]) / 6
    assert late > early + 0.1, (early, late)
    assert summary["accuracy_after"] > summary["accuracy_before"] + 0.1, summary
