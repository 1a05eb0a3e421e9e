"""The user's reward functions: every misbehaviour is one RewardError naming function, sample and cause."""

import math
import time

import pytest

from fuseflow.tasks import DataError, FileTask, Prompt, RewardError
from fuseflow.tasks.calls import UserFunction

FNS = '''
import math, os, time

def score(prompt, response, answer):
    return float(response == answer)

def boom(prompt, response, answer):
    if prompt == "p2":
        raise ValueError("bad answer format")
    return 1.0

def text(prompt, response, answer):
    return "1.0"

def infinite(prompt, response, answer):
    return math.inf if prompt == "p1" else 0.5

def nan(prompt, response, answer):
    return math.nan

def slow(prompt, response, answer):
    if prompt == "p1":
        time.sleep(60)
    return 1.0

def crash(prompt, response, answer):
    if prompt == "p3":
        os._exit(3)
    return 1.0

def score_batch(prompts, responses, answers):
    return [float(r == a) for r, a in zip(responses, answers)]

def short_batch(prompts, responses, answers):
    return [1.0]
'''

P = [f"p{i}" for i in range(6)]
R = ["1", "2", "3", "3", "5", "0"]
A = ["1", "0", "3", "4", "5", "0"]


@pytest.fixture()
def fns(tmp_path):
    path = tmp_path / "fns.py"
    path.write_text(FNS)
    return lambda name, **kw: UserFunction(f"{path}:{name}", "task.reward_fn", "reward", **kw)


def test_values_and_nan_pass_through(fns):
    assert fns("score")(P, R, A) == [1.0, 0.0, 1.0, 0.0, 1.0, 1.0]
    assert all(math.isnan(v) for v in fns("nan")(P, R, A))  # NaN: the trainer skips the update with a warning


@pytest.mark.parametrize("name, cause", [
    ("boom", r"on sample 2 \(prompt 'p2'\): raised ValueError: bad answer format$"),
    ("text", r"on sample 0 \(prompt 'p0'\): returned str '1.0', not a number; "),
    ("infinite", r"on sample 1 \(prompt 'p1'\): returned inf; return a finite float"),
    ("short_batch", r"on a batch of 6 samples: returned 1 values for 6 samples; "),
])
def test_each_misbehaviour_is_one_line_naming_function_and_sample(fns, name, cause):
    with pytest.raises(RewardError, match=rf"^reward function .*fns.py:{name} \(task.reward_fn\) {cause}") as e:
        fns(name)(P, R, A)
    assert "\n" not in str(e.value)


def test_a_call_past_the_timeout_ends_within_it(fns):
    t0 = time.perf_counter()
    with pytest.raises(RewardError, match=r"sample 1 \(prompt 'p1'\): took longer than reward.timeout_s=0.5s per call"):
        fns("slow", timeout_s=0.5)(P, R, A)
    assert time.perf_counter() - t0 < 5.0


def test_batch_function_is_detected_by_name_or_flag(fns):
    assert fns("score_batch").batch and not fns("score").batch
    assert fns("score_batch")(P, R, A) == fns("score")(P, R, A)
    assert fns("score", batch=False)(P, R, A) == [1.0, 0.0, 1.0, 0.0, 1.0, 1.0]


def test_process_pool_gives_the_in_process_values_and_survives_a_crash(fns):
    pooled = fns("score", workers=2)
    try:
        assert pooled(P * 5, R * 5, A * 5) == fns("score")(P * 5, R * 5, A * 5)
    finally:
        pooled.close()
    with pytest.raises(RewardError, match=r"fns.py:crash .* on sample 3 \(prompt 'p3'\): crashed its worker process "
                                          r"\(run it with reward.workers=0 to see why\)"):
        fns("crash", workers=2)(P, R, A)
    t0 = time.perf_counter()
    with pytest.raises(RewardError, match=r"sample 1 \(prompt 'p1'\): took longer than reward.timeout_s=1s per call"):
        fns("slow", workers=2, timeout_s=1.0)(P, R, A)
    assert time.perf_counter() - t0 < 15.0  # the slow call is cut off in its process, not waited for
    with pytest.raises(RewardError, match=r"on sample 2 \(prompt 'p2'\): raised ValueError: bad answer format"):
        fns("boom", workers=1)(P, R, A)


def test_a_reward_file_with_a_syntax_error_is_one_line(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def score(prompt, response, answer)\n    return 1.0\n")
    with pytest.raises(DataError, match=rf"^task.reward_fn: {bad}:1: syntax error: expected ':'$"):
        UserFunction(f"{bad}:score", "task.reward_fn", "reward")
    bad.write_text("import nosuchmodule_xyz\n")
    with pytest.raises(DataError, match=r"task.reward_fn: importing .*bad.py raised ModuleNotFoundError"):
        UserFunction(f"{bad}:score", "task.reward_fn", "reward")


def test_file_task_scores_through_the_checked_function(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": "2"}\n')
    (tmp_path / "fns.py").write_text(FNS)
    task = FileTask(str(data), f"{tmp_path}/fns.py:score_batch")
    prompts = [Prompt("a", "1"), Prompt("b", "2")]
    assert task.score_many(prompts, ["1", "x"]) == [1.0, 0.0]
    assert task.score(prompts[0], "1") == 1.0 and task.is_correct(prompts[1], "2")
