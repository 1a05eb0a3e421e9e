"""`fuseflow bench trl`: config, CLI errors, and (slow, needs the `bench` extra) a quick interleaved run."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from fuseflow.bench.trl import bench_config, run_trl_comparison
from fuseflow.cli import app


def test_bench_config_is_the_sort_preset_with_bench_settings():
    cfg = bench_config(["trainer.prompts_per_step=16"], steps=3)
    assert cfg.task.name == "sort" and cfg.algorithm.name == "grpo" and cfg.rollout.backend == "engine"
    assert cfg.trainer.steps == 3 and cfg.trainer.prompts_per_step == 16 and cfg.model.max_response_len == 72
    quick = bench_config(quick=True, steps=2)
    assert quick.trainer.prompts_per_step * quick.algorithm.group_size == 16


@pytest.mark.parametrize("args,msg", [(["--steps", "0"], "--steps and --threads must be >= 1"),
                                      (["trainer.nope=1"], "trainer.nope"),
                                      (["algorithm.name=ppo"], "must be grpo")])
def test_cli_errors_are_one_line(args, msg):
    res = CliRunner().invoke(app, ["bench", "trl", *args])
    assert res.exit_code == 2 and msg in res.output


@pytest.mark.slow
def test_quick_comparison_runs_both_sides_on_the_same_steps(tmp_path, sft_cache):
    pytest.importorskip("trl")
    cfg = bench_config([f"cache_dir={sft_cache}", "schedule.mode=fused", "schedule.rollout_workers=2"], quick=True,
                       steps=2)
    r = run_trl_comparison(cfg, threads=1, work_dir=tmp_path, log=lambda *_: None)
    assert (r["torch_threads"], r["trl_torch_threads"]) == (1, 2)  # TRL gets the cores of fuseflow's 2 workers
    assert torch.get_num_threads() == 1  # put back after TRL's steps
    f, t = r["fuseflow"], r["trl"]
    assert len(f["step_seconds"]) == len(t["step_seconds"]) == 2 and f["timed_steps"] == t["timed_steps"] == 1
    assert all(x > 0 for x in f["response_tokens_per_step"] + t["response_tokens_per_step"])
    assert len(f["reward_per_step"]) == len(t["reward_per_step"]) == 2
    assert all(0.0 <= x <= 1.0 for x in f["reward_per_step"] + t["reward_per_step"])
    assert r["speedup_vs_trl"] == pytest.approx(f["samples_per_second"] / t["samples_per_second"])
    # Headline figures skip the warm-up step: 16 samples over the second step's wall time.
    assert f["samples_per_second"] == pytest.approx(16 / f["step_seconds"][1], rel=1e-2)
    json.dumps(r)  # serialisable as written by --out


def test_bench_config_with_a_model_is_the_smollm_preset_on_it():
    cfg = bench_config(["trainer.prompts_per_step=4"], steps=3, model="some/model-dir")
    assert cfg.model.path == "some/model-dir" and cfg.task.name == "reasoning_gym" and not cfg.sft.enabled
    assert cfg.model.lora.enabled and cfg.rollout.backend == "engine" and cfg.trainer.prompts_per_step == 4
    assert cfg.trainer.steps == 3


@pytest.mark.slow
def test_quick_comparison_on_a_chat_model_with_lora(tmp_path):
    """The --model variant on a tiny random Llama with a chat tokenizer: conversational prompts, LoRA both sides."""
    pytest.importorskip("trl")
    pytest.importorskip("reasoning_gym")
    from fuseflow.data.tokenizer import load_tokenizer
    from fuseflow.models import CausalLM, ModelConfig
    from real_model_fixtures import chat_tokenizer_dir

    model_dir, _ = chat_tokenizer_dir(tmp_path / "model")
    tok = load_tokenizer(model_dir)
    mcfg = ModelConfig.preset("tiny", vocab_size=len(tok), num_hidden_layers=2, bos_token_id=tok.bos_token_id,
                              eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    CausalLM.from_config(mcfg, seed=0).save_pretrained(model_dir)
    cfg = bench_config([f"cache_dir={tmp_path / 'cache'}"], quick=True, steps=2, model=str(model_dir))
    r = run_trl_comparison(cfg, threads=1, work_dir=tmp_path / "work", log=lambda *_: None)
    assert r["benchmark"] == "grpo_reasoning_gym_vs_trl" and r["settings"]["lora"]["rank"] == 16
    assert r["settings"]["trl_prompts"] == "conversational (chat template)"
    f, t = r["fuseflow"], r["trl"]
    assert len(f["reward_per_step"]) == len(t["reward_per_step"]) == 2
    assert all(0 < x <= 8 * 8 for x in f["response_tokens_per_step"] + t["response_tokens_per_step"])
    assert r["speedup_vs_trl"] == pytest.approx(f["samples_per_second"] / t["samples_per_second"])


def test_time_of_work_between_steps_goes_to_the_next_step():
    """`bench trl` waits for async fuseflow's prefetch between steps; that is the next step's generation."""
    import time

    from fuseflow.bench.trl import _Timer

    t = _Timer()
    t.start()
    t.stop()
    t.for_next_step(lambda: time.sleep(0.05))
    t.start()
    t.stop()
    t.start()
    t.stop()
    assert t.wall[0] < 0.05 <= t.wall[1] and t.wall[2] < 0.05  # counted once, in the step after it
