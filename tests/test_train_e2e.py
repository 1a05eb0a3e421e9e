"""End-to-end runs of `fuseflow train` on tiny configs: resume, export, bad input, Ctrl-C."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from fuseflow.cli import app
from fuseflow.config import load_config
from fuseflow.models import CausalLM
from fuseflow.runner import train
from fuseflow.telemetry.metrics import read_metrics

runner = CliRunner()

# A run small enough for CI: a short SFT, a few RL steps on a small batch.
TINY = ["sft.max_steps=40", "sft.eval_every=20", "sft.eval_size=20", "task.train_size=400", "task.eval_size=20",
        "trainer.steps=4", "trainer.prompts_per_step=4", "algorithm.group_size=4", "trainer.mini_batch_size=8",
        "trainer.micro_batch_size=4", "trainer.eval_size=20", "trainer.eval_every=2", "trainer.save_every=1",
        "trainer.epochs=2"]


def _cfg(cache, *extra, preset="default"):
    return load_config(preset, TINY + [f"cache_dir={cache}", *extra])


def _comparable(rows):
    # Wall-clock figures differ between runs; everything else must match exactly.
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/"))} for r in rows]


@pytest.mark.parametrize("preset", ["default", "ppo"])
def test_resume_gives_the_same_metrics_as_an_uninterrupted_run(tmp_path, sft_cache, preset):
    cfg = _cfg(sft_cache, preset=preset)
    train(cfg, tmp_path / "full")
    train(cfg, tmp_path / "cut", stop_after=2)
    assert [r["step"] for r in read_metrics(tmp_path / "cut")] == [1, 2]
    train(cfg, tmp_path / "cut", resume=True)
    full, cut = _comparable(read_metrics(tmp_path / "full")), _comparable(read_metrics(tmp_path / "cut"))
    assert [r["step"] for r in cut] == [1, 2, 3, 4]
    assert full == cut
    a = load_file(str(tmp_path / "full/checkpoints/step_4/actor/model.safetensors"))
    b = load_file(str(tmp_path / "cut/checkpoints/step_4/actor/model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((tmp_path / "cut/summary.json").read_text())["steps"] == 4


def test_run_directory_contents_and_export(tmp_path, sft_cache):
    cfg = _cfg(sft_cache, "trainer.steps=2")
    summary = train(cfg, tmp_path / "run")
    run = tmp_path / "run"
    for name in ("config.yaml", "metrics.jsonl", "trace.json", "summary.json", "checkpoints/latest",
                 "plots/reward.png", "plots/stage_time.png", "plots/sft_curve.png", "plots/response_length.png"):
        assert (run / name).exists(), name
    assert list((run / "tensorboard").iterdir())
    for key in ("accuracy_before", "accuracy_after", "reward_first", "reward_last", "steps", "wall_seconds",
                "samples_per_second", "tokens_per_second", "stage_seconds"):
        assert key in summary
    assert {"generate", "reference", "reward", "advantages", "actor_update"} <= set(summary["stage_seconds"])
    trace = json.loads((run / "trace.json").read_text())["traceEvents"]
    assert {e["args"]["step"] for e in trace if e["ph"] == "X" and e["name"] == "generate"} == {1, 2}
    row = read_metrics(run)[-1]
    assert row["rollout/logprob_diff_max"] < 1e-4  # sampler and trainer agree on log-probs
    # arith prompts are fixed-width ("047+385=" plus BOS), so the longest prompt is also the mean one.
    assert row["rollout/prompt_length_max"] == pytest.approx(row["rollout/prompt_length_mean"]) and row["rollout/prompt_length_max"] > 0
    for key in ("reward/mean", "kl/ref_k3", "actor/entropy", "actor/clip_frac", "rollout/response_length_mean",
                "time/generate", "time/actor_update", "perf/tokens_per_second"):
        assert math.isfinite(row[key]), key

    out = tmp_path / "hf"
    result = runner.invoke(app, ["export", str(run), str(out)])
    assert result.exit_code == 0, result.output
    hf = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    ours = CausalLM.from_pretrained(run / "checkpoints/step_2/actor").eval()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        assert torch.allclose(hf(ids).logits, ours(ids).logits, atol=1e-4)
    assert (out / "tokenizer.json").exists()


def _file_task(tmp_path, reward_body, prompt_len=6, rows=40):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": "q" * prompt_len + f"{i}=", "answer": str(i % 10),
                                        "response": str(i % 10)}) + "\n" for i in range(rows)))
    (tmp_path / "rw.py").write_text(f"def score(prompt, response, answer):\n    {reward_body}\n")
    return ["task.name=file", f"task.path={data}", f"task.reward_fn={tmp_path / 'rw.py'}:score"]


def _invoke(tmp_path, sft_cache, *args):
    return runner.invoke(app, ["train", "--output", str(tmp_path / "run"), *TINY, f"cache_dir={sft_cache}",
                               "sft.max_steps=4", "sft.eval_every=2", *args])


def _one_line_error(result, text):
    assert result.exit_code == 2, result.output
    assert text in result.output and "Traceback" not in result.output


def test_missing_and_empty_data_files(tmp_path, sft_cache):
    args = _file_task(tmp_path, "return 1.0")
    _one_line_error(_invoke(tmp_path, sft_cache, *args[:1], f"task.path={tmp_path / 'nope.jsonl'}", args[2]),
                    "does not exist")
    (tmp_path / "empty.jsonl").write_text("")
    _one_line_error(_invoke(tmp_path, sft_cache, args[0], f"task.path={tmp_path / 'empty.jsonl'}", args[2]),
                    "dataset is empty")


def test_prompt_longer_than_the_maximum(tmp_path, sft_cache):
    args = _file_task(tmp_path, "return 1.0", prompt_len=80)
    _one_line_error(_invoke(tmp_path, sft_cache, *args, "model.max_prompt_len=32"), "model.max_prompt_len=32")


def test_reward_function_that_raises(tmp_path, sft_cache):
    _one_line_error(_invoke(tmp_path, sft_cache, *_file_task(tmp_path, "raise RuntimeError('bad reward')")),
                    "raised RuntimeError: bad reward")


def test_nan_reward_skips_the_update_and_keeps_weights(tmp_path, sft_cache):
    result = _invoke(tmp_path, sft_cache, *_file_task(tmp_path, "return float('nan')"), "trainer.steps=1")
    assert result.exit_code == 0, result.output
    assert read_metrics(tmp_path / "run")[0]["train/skipped_update"] == 1.0
    ref = load_file(str(tmp_path / "run/reference/model.safetensors"))
    actor = load_file(str(tmp_path / "run/checkpoints/step_1/actor/model.safetensors"))
    assert all(torch.equal(ref[k], actor[k]) for k in ref)


def test_ctrl_c_mid_step_keeps_the_last_checkpoint(tmp_path, sft_cache, monkeypatch):
    from fuseflow.trainer import RLTrainer

    real_step = RLTrainer.step

    def step(self, n):
        if n == 3:
            raise KeyboardInterrupt
        return real_step(self, n)

    monkeypatch.setattr(RLTrainer, "step", step)
    result = _invoke(tmp_path, sft_cache)
    assert result.exit_code == 130, result.output
    assert "checkpoint step_2 is intact" in result.output and "--resume" in result.output
    monkeypatch.setattr(RLTrainer, "step", real_step)
    result = runner.invoke(app, ["train", "--resume", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2, 3, 4]


def test_output_dir_with_a_run_is_not_overwritten(tmp_path, sft_cache):
    assert _invoke(tmp_path, sft_cache, "trainer.steps=1").exit_code == 0
    _one_line_error(_invoke(tmp_path, sft_cache, "trainer.steps=1"), "already holds a run")
