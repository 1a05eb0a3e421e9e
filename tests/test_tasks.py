"""Tokenizer and tasks: HF round trip, disjoint splits, long tails, rewards, user data errors."""

import json
import math
import statistics

import pytest
from transformers import AutoTokenizer

from fuseflow.data.tokenizer import build_char_tokenizer, load_tokenizer
from fuseflow.tasks import ArithTask, DataError, FileTask, Prompt, RewardError, SortTask
from fuseflow.tasks.arith import carryless_sum


def test_char_tokenizer_round_trips_through_autotokenizer(tmp_path):
    tok = build_char_tokenizer()
    tok.save_pretrained(str(tmp_path))
    loaded = AutoTokenizer.from_pretrained(str(tmp_path))
    text = "sort 3,1,2: 47+385=432 Hello!"
    ids = loaded(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)  # one token per character
    assert ids == tok(text, add_special_tokens=False)["input_ids"]
    assert loaded.decode(ids) == text
    assert (loaded.pad_token_id, loaded.bos_token_id, loaded.eos_token_id) == (0, 1, 2)
    assert load_tokenizer(str(tmp_path)).eos_token_id == 2


def test_user_tokenizer_dir_missing_is_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="model.tokenizer"):
        load_tokenizer(str(tmp_path / "nope"))


def test_carryless_sum_hand_values():
    assert carryless_sum(47, 385) == 322
    assert carryless_sum(999, 1) == 990
    assert carryless_sum(123, 456) == 579


def test_arith_held_out_is_disjoint_and_rewards_exact():
    t = ArithTask(train_size=3000, eval_size=300)
    train = {p.text for p in t.train_prompts()}
    assert not any(p.text in train for p in t.eval_prompts())
    p = Prompt("47+385=", "432", {"a": 47, "b": 385})
    assert t.reward(p, "432") == 1.0 and t.reward(p, "322") == 0.0 and t.reward(p, "4321") == 0.0


def test_arith_demonstrations_have_the_stated_error_rate():
    t = ArithTask(train_size=4000, demo_error_rate=0.6)
    demos = t.demonstrations()
    carry = [(p, r) for p, r in demos if int(p.answer) != carryless_sum(p.meta["a"], p.meta["b"])]
    wrong = sum(r != p.answer for p, r in carry) / len(carry)
    assert abs(wrong - 0.6) < 0.04  # only problems with a carry can be wrong
    assert all(r == p.answer for p, r in demos if (p, r) not in carry)
    assert all(r == p.answer for p, r in ArithTask(train_size=500, demo_error_rate=0.0).demonstrations())


def test_sort_lengths_are_long_tailed_and_reward_is_positional():
    t = SortTask(train_size=5000)
    lengths = [len(p.answer) for p in t.train_prompts()]
    assert max(lengths) >= 10 * statistics.median(lengths)
    p = Prompt("sort 3,1,2:", "1,2,3", {"items": [3, 1, 2]})
    assert t.reward(p, "1,2,3") == 1.0
    assert t.reward(p, "1,3,2") == pytest.approx(1 / 3)
    assert t.reward(p, "1,2,3,4") == pytest.approx(3 / 4)  # extra items are penalised
    assert t.reward(p, "") == 0.0


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_file_task_jsonl_and_parquet_with_reward_from_file(tmp_path):
    rows = [{"prompt": f"q{i}=", "answer": str(i), "response": str(i)} for i in range(50)]
    _write_jsonl(tmp_path / "d.jsonl", rows)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    (tmp_path / "rw.py").write_text("def score(prompt, response, answer):\n    return float(response == answer)\n")
    for name in ("d.jsonl", "d.parquet"):
        t = FileTask(str(tmp_path / name), f"{tmp_path / 'rw.py'}:score")
        assert len(t.train_prompts()) + len(t.eval_prompts()) >= 50
        p = t.train_prompts()[0]
        assert t.score(p, p.answer) == 1.0 and t.score(p, "x") == 0.0
        assert len(t.demonstrations()) == len(t.train_prompts())


def test_file_task_bad_inputs(tmp_path):
    (tmp_path / "rw.py").write_text("def score(p, r, a):\n    return 1.0\n")
    fn = f"{tmp_path / 'rw.py'}:score"
    with pytest.raises(DataError, match="does not exist"):
        FileTask(str(tmp_path / "missing.jsonl"), fn)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match="empty"):
        FileTask(str(tmp_path / "empty.jsonl"), fn)
    _write_jsonl(tmp_path / "noprompt.jsonl", [{"question": "x"}])
    with pytest.raises(DataError, match="no 'prompt'"):
        FileTask(str(tmp_path / "noprompt.jsonl"), fn)
    _write_jsonl(tmp_path / "ok.jsonl", [{"prompt": "a"}])
    with pytest.raises(DataError, match="no function 'nope'"):
        FileTask(str(tmp_path / "ok.jsonl"), f"{tmp_path / 'rw.py'}:nope")
    with pytest.raises(DataError, match="should look like"):
        FileTask(str(tmp_path / "ok.jsonl"), "no_colon")
    with pytest.raises(DataError, match="cannot import"):
        FileTask(str(tmp_path / "ok.jsonl"), "no_such_module_xyz:f")


def test_reward_errors_and_nan_are_reported(tmp_path):
    (tmp_path / "rw.py").write_text("def boom(p, r, a):\n    raise KeyError('oops')\n"
                                    "def nan(p, r, a):\n    return float('nan')\n")
    _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a"}])
    t = FileTask(str(tmp_path / "d.jsonl"), f"{tmp_path / 'rw.py'}:boom")
    with pytest.raises(RewardError, match="raised KeyError"):
        t.score(t.train_prompts()[0], "x")
    t = FileTask(str(tmp_path / "d.jsonl"), f"{tmp_path / 'rw.py'}:nan")
    assert math.isnan(t.score(t.train_prompts()[0], "x")) and not t.is_correct(t.train_prompts()[0], "x")
