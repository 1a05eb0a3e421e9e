"""Reward models: Bradley-Terry training beats chance on the synthetic task, the directory round-trips,
and bad preference files are one-line errors."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from fuseflow.cli import app
from fuseflow.config import load_config
from fuseflow.data.tokenizer import build_char_tokenizer
from fuseflow.models import ModelConfig, ValueModel
from fuseflow.reward_model import RewardModel, encode_texts, load_pairs, pairwise_accuracy, train_reward_model
from fuseflow.runner import train
from fuseflow.tasks import DataError
from fuseflow.telemetry.metrics import read_metrics

runner = CliRunner()

# Random init keeps the test free of an SFT run; a few hundred steps on synthetic pairs.
FAST = ["task.name=pref", "task.train_size=2000", "task.eval_size=200", "rm.init=random", "rm.synthetic_pairs=3000",
        "rm.steps=150", "rm.batch_size=32", "rm.eval_every=50", "rm.lr=2e-3"]


def test_encode_texts_appends_eos_and_left_pads():
    tok = build_char_tokenizer()
    ids, mask = encode_texts(tok, ["ab:", "a:"], ["cd", "c"])
    assert ids.shape == (2, 6) and mask.tolist() == [[1] * 6, [0, 0, 1, 1, 1, 1]]
    assert ids[0, -1] == tok.eos_token_id and ids[1, -1] == tok.eos_token_id
    assert tok.decode(ids[1, 2:-1].tolist()) == "a:c"


def test_bradley_terry_beats_chance_on_the_synthetic_task_and_round_trips(tmp_path):
    cfg = load_config("rlhf", FAST)
    report = train_reward_model(cfg, tmp_path / "rm")
    assert report["heldout_pairs"] == 300 and report["train_pairs"] == 3000
    # 300 held-out pairs: chance is 0.5 with a standard deviation of 0.029.
    assert report["heldout_accuracy"] > 0.6, report["curve"]
    loaded = RewardModel.load(tmp_path / "rm", batch_size=7)
    assert json.loads((tmp_path / "rm/reward_model.json").read_text())["heldout_accuracy"] == report["heldout_accuracy"]
    from fuseflow.reward_model.train import preference_data

    _, heldout, _ = preference_data(cfg)
    assert pairwise_accuracy(loaded, heldout) == pytest.approx(report["heldout_accuracy"])
    prompts = [p["prompt"] for p in heldout[:20]]
    chosen = [p["chosen"] for p in heldout[:20]]
    # Scores are standardised by the saved mean/std and do not depend on the scoring batch size.
    want = (loaded.raw(prompts, chosen) - report["score_mean"]) / report["score_std"]
    assert torch.allclose(loaded.score(prompts, chosen), want.detach(), atol=1e-5)


def test_scores_do_not_depend_on_padding_or_batch_size():
    tok = build_char_tokenizer()
    model = ValueModel.from_config(ModelConfig.preset("tiny", vocab_size=len(tok)), seed=1)
    torch.nn.init.normal_(model.value_head.weight, std=0.5)
    rm = RewardModel(model, tok, batch_size=1)
    prompts, responses = ["abcd:", "ab:", "a:"], ["dcba", "b", "abcabc"]
    one_by_one = rm.score(prompts, responses)
    rm.batch_size = 3
    assert torch.allclose(one_by_one, rm.score(prompts, responses), atol=1e-5)


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("rows, suffix, expect", [
    ([], ".jsonl", "preference dataset is empty"),
    (['{"prompt": "a"'], ".jsonl", ":1: not valid JSON"),
    ([{"prompt": "a:", "chosen": "b"}], ".jsonl", "row 1 has no non-empty string 'rejected'"),
    ([{"prompt": "a:", "chosen": "b", "rejected": "c"}, {"prompt": "", "chosen": "b", "rejected": "c"}], ".jsonl",
     "row 2 has no non-empty string 'prompt'"),
    ([{"prompt": "a:", "chosen": "b", "rejected": "b"}], ".jsonl", "row 1 has chosen == rejected"),
    ([{"prompt": "a:", "chosen": 3, "rejected": "b"}], ".jsonl", "row 1 has no non-empty string 'chosen'"),
    ([{"prompt": "a:", "chosen": "b", "rejected": "c"}], ".csv", "has suffix '.csv'; use .jsonl or .parquet"),
])
def test_bad_preference_files_are_clear(tmp_path, rows, suffix, expect):
    path = _write(tmp_path / f"pairs{suffix}", rows)
    with pytest.raises(DataError, match=None) as info:
        load_pairs(path)
    assert expect in str(info.value)


def test_parquet_pairs_load(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": "ab:", "chosen": "ab", "rejected": "zz"}, {"prompt": "cd:", "chosen": "dc", "rejected": "c"}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    assert load_pairs(tmp_path / "p.parquet") == rows


@pytest.mark.parametrize("make, expect", [
    (lambda d: [f"rm.data={d / 'missing.jsonl'}"], "missing.jsonl does not exist"),
    (lambda d: [f"rm.data={_write(d / 'e.jsonl', [])}"], "preference dataset is empty"),
    (lambda d: [f"rm.data={_write(d / 'l.jsonl', [{'prompt': 'a' * 90, 'chosen': 'b', 'rejected': 'c'}] * 30)}",
                "rm.eval_data=" + str(_write(d / 'v.jsonl', [{'prompt': 'a', 'chosen': 'b', 'rejected': 'c'}]))],
     "pair 1 (chosen) has 92 tokens with eos, more than model.max_prompt_len + model.max_response_len + 1 = 81"),
    (lambda d: ["task.name=arith"], "task.name=arith has no synthetic preferences"),
])
def test_train_rm_cli_errors_are_one_line(tmp_path, make, expect):
    result = runner.invoke(app, ["train-rm", "--output", str(tmp_path / "rm"), "rm.init=random", "rm.steps=1",
                                 *make(tmp_path)])
    assert result.exit_code == 2, result.output
    assert expect in result.output.replace("\n", " ") and "Traceback" not in result.output
    assert not (tmp_path / "rm").exists()


def test_train_rm_cli_writes_a_directory_the_trainer_loads(tmp_path):
    result = runner.invoke(app, ["train-rm", "--output", str(tmp_path / "rm"), "rm.init=random", "rm.steps=2",
                                 "rm.eval_every=1", "rm.synthetic_pairs=64", "task.train_size=200",
                                 "task.eval_size=50"])
    assert result.exit_code == 0, result.output
    out = result.output.replace("\n", " ")  # rich wraps long lines at the terminal width (a long tmp path)
    assert "held-out pairwise accuracy" in out and "reward.model=" in out
    rm = RewardModel.load(tmp_path / "rm")
    assert rm.meta["train_pairs"] == 64 and len(rm.meta["curve"]) == 2
    assert rm.score(["abcd:"], ["abcd"]).shape == (1,)


def test_trainer_rejects_a_directory_that_is_not_a_reward_model(tmp_path):
    with pytest.raises(ValueError, match="is not a reward-model directory.*fuseflow train-rm"):
        RewardModel.load(tmp_path)
    result = runner.invoke(app, ["train", "--preset", "rlhf", "--output", str(tmp_path / "run"),
                                 f"reward.model={tmp_path / 'nope'}", f"cache_dir={tmp_path / 'cache'}"])
    # Checked before any work (fuseflow.preflight): names the setting and how to make such a directory.
    assert result.exit_code == 2 and f"reward.model={tmp_path / 'nope'}: does not exist; pass a directory written by " \
        "`fuseflow train-rm --output DIR`" in result.stderr
    assert not (tmp_path / "cache").exists()  # it failed before training any SFT model


@pytest.mark.slow
def test_ppo_on_the_learned_reward_model_beats_the_sft_model_by_the_gold_rule(tmp_path, sft_cache):
    from rich.console import Console

    common = [f"cache_dir={sft_cache}", "task.eval_size=200", "trainer.eval_size=200"]
    report = train_reward_model(load_config("rlhf", common), tmp_path / "rm")
    assert report["heldout_accuracy"] > 0.85, report["curve"]
    cfg = load_config("rlhf", [*common, f"reward.model={tmp_path / 'rm'}", "trainer.eval_every=20"])
    summary = train(cfg, tmp_path / "run", console=Console(quiet=True))
    rows = read_metrics(tmp_path / "run")
    assert all(r["reward/mean"] == r["reward/rm_score"] for r in rows)  # fn_weight 0: the gold rule is only logged
    # Step 0 compares the SFT model with itself on paired samples.
    assert summary["gold_win_rate_before"] == 0.5
    # The learned score rises, and the hidden gold rule agrees on held-out prompts.
    assert summary["rm_score_after"] > summary["rm_score_before"] + 0.5, summary["evals"]
    assert summary["gold_win_rate_after"] > 0.7, summary["evals"]
    assert summary["gold_score_after"] > summary["gold_score_before"] + 1.0, summary["evals"]


def test_file_task_run_with_a_reward_model_and_no_reward_function(tmp_path, sft_cache):
    from rich.console import Console

    tok = build_char_tokenizer()
    model = ValueModel.from_config(ModelConfig.preset("tiny", vocab_size=len(tok)), seed=1)
    torch.nn.init.normal_(model.value_head.weight, std=0.5)
    RewardModel(model, tok).save(tmp_path / "rm", {"score_mean": 0.0, "score_std": 1.0})
    data = _write(tmp_path / "d.jsonl", [{"prompt": f"q{i}=", "response": str(i % 10)} for i in range(60)])
    tiny = ["sft.max_steps=6", "sft.eval_every=1", "sft.patience=2", "sft.eval_size=8", "trainer.steps=2",
            "trainer.prompts_per_step=4",
            "algorithm.group_size=4", "trainer.mini_batch_size=8", "trainer.micro_batch_size=4",
            "trainer.eval_size=8", "trainer.eval_every=2", "trainer.save_every=2"]
    base = ["task.name=file", f"task.path={data}", f"cache_dir={sft_cache}", *tiny]
    result = runner.invoke(app, ["train", "--output", str(tmp_path / "bad"), *base])
    assert result.exit_code == 2 and "needs task.reward_fn=module:function, or reward.model=DIR" in result.output
    train(load_config("default", [*base, f"reward.model={tmp_path / 'rm'}"]), tmp_path / "run",
          console=Console(quiet=True))
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    # The reward is the reward model's score alone; with no task function there is nothing else to log.
    assert all(r["reward/mean"] == pytest.approx(r["reward/rm_score"]) and "reward/fn_score" not in r for r in rows)
    assert len({r["reward/mean"] for r in rows}) > 1 and all(r["train/skipped_update"] == 0.0 for r in rows)
    summary = json.loads((tmp_path / "run/summary.json").read_text())
    evals = summary["evals"]
    assert "rm_score" in evals[-1] and "gold_win_rate" not in evals[-1]
    # No correct answer to count: no accuracy anywhere (not a misleading 0), and SFT had nothing to
    # early-stop on, so it trained all 6 steps instead of stopping after `patience` flat evals.
    assert all("reward/accuracy" not in r for r in rows) and all("accuracy" not in e for e in evals)
    assert summary["accuracy_before"] is None and summary["accuracy_gain"] is None
    sft_curve = json.loads((tmp_path / "run/reference/sft_curve.json").read_text())
    assert sft_curve[-1]["step"] == 6 and all("accuracy" not in c for c in sft_curve)
