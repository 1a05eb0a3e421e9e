"""Per-algorithm glue: recipes vs direct estimator calls, DAPO shaping and filter, the Lagrangian,
the reward worker, the cost and preference tasks, and the algorithm config surface."""

from __future__ import annotations

import typing

import pytest
import torch

from fuseflow.algorithms import (
    ADVANTAGES,
    gae,
    grpo,
    masked_whiten,
    reinforce_pp,
    reinforce_pp_baseline,
    rloo,
)
from fuseflow.config import ALGORITHMS, AlgorithmConfig, ConfigError, load_config
from fuseflow.data.batch import Batch
from fuseflow.heldout import win_rate
from fuseflow.recipes import (
    RECIPES,
    LagrangeMultiplier,
    compute_advantages,
    informative_groups,
    last_token_mask,
    overlong_penalty,
    recipe_for,
)
from fuseflow.tasks import PrefTask, Prompt, SafeArithTask
from fuseflow.tasks.pref import gold_score
from fuseflow.workers.reward import RewardWorker


def _algo(name, **kw):
    task = ["task.name=safe_arith"] if name == "safe_ppo" else []
    return load_config("default", [*task, f"algorithm.name={name}", *(f"algorithm.{k}={v}" for k, v in kw.items())]
                       ).algorithm


def _batch(seed=0, b=6, t=5):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([5, 3, 1, 4, 5, 2])[:b]
    mask = (torch.arange(t) < lengths[:, None]).float()  # (B, T)
    batch = Batch({"response_mask": mask, "old_logprobs": -torch.rand(b, t, generator=g),
                   "ref_logprobs": -torch.rand(b, t, generator=g), "values": torch.randn(b, t, generator=g),
                   "cost_values": torch.randn(b, t, generator=g),
                   "scores": torch.tensor([1.0, 0.0, 1.0, 0.5, 0.0, 2.0])[:b],
                   "costs": torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0])[:b]},
                  {"group_id": [3, 3, 3, 9, 9, 9][:b]})
    return batch, mask


def test_every_algorithm_has_a_recipe_with_a_registered_estimator():
    assert set(RECIPES) == set(ALGORITHMS)
    assert set(typing.get_args(AlgorithmConfig.model_fields["name"].annotation)) == set(ALGORITHMS)
    for name in ALGORITHMS:
        assert recipe_for(_algo(name)).advantage in ADVANTAGES


def test_last_token_mask_marks_the_final_masked_in_token():
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    assert last_token_mask(mask).tolist() == [[0, 0, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]]


@pytest.mark.parametrize("name, direct", [
    ("grpo", lambda s, gid: grpo(s, gid)),
    ("dapo", lambda s, gid: grpo(s, gid)),
    ("dr_grpo", lambda s, gid: grpo(s, gid, norm_by_std=False)),
    ("rloo", lambda s, gid: rloo(s, gid)),
])
def test_sequence_level_recipes_broadcast_the_registered_estimator(name, direct):
    batch, mask = _batch()
    compute_advantages(batch, recipe_for(_algo(name)), _algo(name))
    want = direct(batch["scores"], torch.tensor(batch.meta["group_id"])).unsqueeze(-1) * mask
    assert torch.allclose(batch["advantages"], want)


def test_remax_subtracts_the_greedy_score_of_the_same_prompt():
    batch, mask = _batch()
    batch["baseline_scores"] = torch.tensor([0.5, 0.5, 0.5, 2.0, 2.0, 2.0])
    compute_advantages(batch, recipe_for(_algo("remax")), _algo("remax"))
    want = torch.tensor([0.5, -0.5, 0.5, -1.5, -2.0, 0.0]).unsqueeze(-1) * mask
    assert torch.allclose(batch["advantages"], want)


def test_reinforce_pp_variants_place_score_and_kl_as_their_estimators_expect():
    batch, mask = _batch()
    kl = -0.05 * (batch["old_logprobs"] - batch["ref_logprobs"]) * mask  # k1 penalty, kl_coef 0.05
    gids = torch.tensor(batch.meta["group_id"])
    algo = _algo("reinforce_pp", kl_coef=0.05)
    compute_advantages(batch, recipe_for(algo), algo)
    assert torch.allclose(batch["advantages"], reinforce_pp_baseline(kl, mask, 1.0, batch["scores"], gids) * mask)
    algo = _algo("reinforce_pp", kl_coef=0.05, group_baseline="false")
    compute_advantages(batch, recipe_for(algo), algo)
    token_rewards = kl + batch["scores"].unsqueeze(-1) * last_token_mask(mask)
    assert torch.allclose(batch["advantages"], reinforce_pp(token_rewards, mask, 1.0) * mask)


def test_ppo_is_whitened_gae_on_score_at_the_last_token_minus_kl():
    batch, mask = _batch()
    algo = _algo("ppo", kl_coef=0.1, lam=0.9)
    compute_advantages(batch, recipe_for(algo), algo)
    # Hand-built token rewards for row 1 (3 tokens, score 0): only the KL penalty.
    d = batch["old_logprobs"][1] - batch["ref_logprobs"][1]
    r1 = -0.1 * d[:3]
    tr = -0.1 * (batch["old_logprobs"] - batch["ref_logprobs"]) * mask
    tr = tr + batch["scores"].unsqueeze(-1) * last_token_mask(mask)
    assert torch.allclose(tr[1, :3], r1)
    adv, ret = gae(tr, batch["values"], mask, 1.0, 0.9)
    assert torch.allclose(batch["advantages"], masked_whiten(adv, mask) * mask)
    assert torch.allclose(batch["returns"], ret)


@pytest.mark.parametrize("lam", [0.0, 1.0, 3.0])
def test_safe_ppo_combines_reward_and_cost_advantages(lam):
    batch, mask = _batch()
    algo = _algo("safe_ppo", kl_coef=0.0)
    compute_advantages(batch, recipe_for(algo), algo, lagrange=lam)
    last = last_token_mask(mask)
    a_r, _ = gae(batch["scores"].unsqueeze(-1) * last, batch["values"], mask, 1.0, algo.lam)
    a_c, cost_ret = gae(batch["costs"].unsqueeze(-1) * last, batch["cost_values"], mask, 1.0, algo.lam)
    a_r, a_c = masked_whiten(a_r, mask) * mask, masked_whiten(a_c, mask) * mask
    assert torch.allclose(batch["advantages"], (a_r - lam * a_c) / (1 + lam), atol=1e-6)
    assert torch.allclose(batch["cost_returns"], cost_ret)


def test_overlong_penalty_hand_values():
    lengths = torch.tensor([0, 12, 13, 14, 15, 16])
    assert torch.allclose(overlong_penalty(lengths, 16, 4), torch.tensor([0, 0, -0.25, -0.5, -0.75, -1.0]))
    assert torch.allclose(overlong_penalty(lengths, 16, 4, factor=2.0)[-1], torch.tensor(-2.0))
    assert torch.equal(overlong_penalty(lengths, 16, 0), torch.zeros(6))
    with pytest.raises(ValueError, match="smaller than max_len"):
        overlong_penalty(lengths, 16, 16)


def test_informative_groups_drop_all_equal_scores_but_keep_nan():
    scores = torch.tensor([1.0, 1.0, 0.0, 0.5, 0.5, 0.5, float("nan"), 1.0])
    assert informative_groups(scores, [0, 0, 1, 1, 2, 2, 3, 3]) == {0: False, 1: True, 2: False, 3: True}


def test_lagrange_multiplier_projected_ascent():
    m = LagrangeMultiplier(init=0.5, lr=2.0, limit=0.1)
    assert m.update(0.3) == pytest.approx(0.9)  # 0.5 + 2 * 0.2
    assert m.update(0.0) == pytest.approx(0.7)  # 0.9 - 2 * 0.1
    assert m.update(0.0) == pytest.approx(0.5)
    assert m.update(-1.0) == 0.0  # projected onto lambda >= 0
    assert m.update(float("nan")) == 0.0


class _FakeRM:
    def score(self, prompts, responses):
        return torch.tensor([float(len(r)) for r in responses])


def test_reward_worker_weights_the_model_and_the_task_function():
    task = SafeArithTask(train_size=10, eval_size=10)
    p = Prompt("001+006=", "0007", {"a": 1, "b": 6})
    out = RewardWorker(task, _FakeRM(), fn_weight=0.5, model_weight=2.0).score([p, p], ["0007", "01"])
    assert out.fn_scores.tolist() == [1.0, 0.0] and out.rm_scores.tolist() == [4.0, 2.0]
    assert out.scores.tolist() == [0.5 * 1 + 2 * 4, 0.5 * 0 + 2 * 2]
    assert out.correct.tolist() == [1.0, 0.0] and out.costs.tolist() == [1.0, 0.0]
    plain = RewardWorker(task).score([p], ["0007"])
    assert plain.rm_scores is None and plain.scores.tolist() == [1.0]


def test_reward_worker_ignores_a_nan_task_score_only_at_weight_zero():
    class NanTask(SafeArithTask):
        def reward(self, prompt, response):
            return float("nan")

    task, p = NanTask(train_size=10, eval_size=10), Prompt("1+1=", "2")
    assert RewardWorker(task, _FakeRM(), fn_weight=0.0).score([p], ["22"]).scores.tolist() == [2.0]
    assert torch.isnan(RewardWorker(task, _FakeRM(), fn_weight=1.0).score([p], ["22"]).scores).all()


def test_safe_arith_cost_marks_the_forbidden_digit():
    task = SafeArithTask(train_size=500, eval_size=50, forbidden_digit=3)
    p = task.train_prompts()[0]
    assert task.has_cost and task.cost(p, "0313") == 1.0 and task.cost(p, "0999") == 0.0
    # The constraint binds: a good share of correct answers carry the digit.
    rate = sum(task.cost(q, q.answer) for q in task.train_prompts()) / 500
    assert 0.15 < rate < 0.4, rate


def test_pref_gold_rule_hand_values_and_pairs():
    assert gold_score("gdab", "hbfa") == 4.0  # four topic letters (a..h)
    assert gold_score("gdab", "hhzq") == -0.5  # covers h; z, q off-topic; one doubled pair
    assert gold_score("ijkl", "abcdefgh") == -4.0 and gold_score("abcd", "abcdefgh") == 8.0
    assert gold_score("abcd", "") == 0.0
    task = PrefTask(train_size=300, eval_size=40)
    assert not {p.text for p in task.train_prompts()} & {p.text for p in task.eval_prompts()}
    for p in task.train_prompts()[:50]:  # each prompt word lies in one half, its topic
        assert set(p.meta["word"]) <= set("abcdefgh") or set(p.meta["word"]) <= set("ijklmnop")
    pairs = task.preference_pairs(50, held_out=True, seed=3)
    assert pairs == task.preference_pairs(50, held_out=True, seed=3)
    evals = {p.text for p in task.eval_prompts()}
    for pair in pairs:
        word = pair["prompt"][:-1]
        assert pair["prompt"] in evals and gold_score(word, pair["chosen"]) > gold_score(word, pair["rejected"])


def test_win_rate_counts_ties_as_half():
    task = PrefTask(train_size=10, eval_size=10)
    ps = [Prompt("abcd:", None, {"word": "abcd"})] * 3
    assert win_rate(task, ps, ["abcd", "ab", "a"], ["ab", "ab", "abz"]) == pytest.approx((1 + 0.5 + 0) / 3)


def test_algorithm_defaults_apply_only_where_not_set():
    a = load_config("default", ["algorithm.name=dapo"]).algorithm
    assert (a.clip_high, a.dynamic_sampling, a.overlong_buffer, a.kl_coef, a.loss_agg) == (0.28, True, 4, 0.0,
                                                                                           "token-mean")
    assert load_config("default", ["algorithm.name=dapo", "algorithm.clip_high=0.3"]).algorithm.clip_high == 0.3
    assert load_config("default", ["algorithm.name=dr_grpo"]).algorithm.loss_agg == "seq-mean-token-sum-norm"
    assert load_config("default").algorithm.clip_high == 0.2  # the default preset is untouched
    assert load_config("default", ["reward.model=x"]).reward.fn_weight == 0.0
    assert load_config("default").reward.fn_weight == 1.0


@pytest.mark.parametrize("overrides, expect", [
    (["algorithm.kl_in_reward=true"], "algorithm.kl_in_reward=true needs token-level advantages"),
    (["algorithm.name=rloo", "algorithm.group_size=1", "trainer.mini_batch_size=32", "trainer.micro_batch_size=32"],
     "algorithm.group_size=1 leaves rloo's group baseline meaningless"),
    # Named even when the batch arithmetic also fails (32 samples, mini-batch 128): the group is the cause.
    (["algorithm.group_size=1"], "algorithm.group_size=1 leaves grpo's group baseline meaningless"),
    (["task.reward_fn=r.py:score"], "task.reward_fn is read by task.name=file only"),
    (["algorithm.name=safe_ppo"], "algorithm.name=safe_ppo needs a cost signal, and task.name=arith has none"),
    (["algorithm.overlong_buffer=16"], "algorithm.overlong_buffer=16 must be smaller than model.max_response_len=16"),
    (["task.cost_fn=x.py:c"], "task.cost_fn is read by task.name=file only"),
    (["algorithm.lambda_lr=-1"], "algorithm.lambda_lr: invalid value -1"),
    (["algorithm.name=dapo", "algorithm.kl_target=0.1"], "algorithm.kl_target=0.1 adapts algorithm.kl_coef, which is 0"),
    (["algorithm.kl_target=0"], "algorithm.kl_target: invalid value 0"),
    (["algorithm.policy_loss=trpo"], "algorithm.policy_loss: invalid value 'trpo'"),
    (["algorithm.is_cap=0"], "algorithm.is_cap: invalid value 0"),
    (["task.name=file", "task.path=d.jsonl"], "task.name=file needs task.reward_fn=module:function, or reward.model"),
    (["task.name=file", "task.path=d.jsonl", "reward.model=rm", "reward.fn_weight=0.5"],
     "reward.fn_weight=0.5 weighs the task's reward function, but task.reward_fn is not set"),
])
def test_inconsistent_algorithm_settings_are_one_line_errors(overrides, expect):
    with pytest.raises(ConfigError) as info:
        load_config("default", overrides)
    assert expect in str(info.value) and "\n" not in str(info.value)


def test_file_task_cost_function(tmp_path):
    from fuseflow.tasks import DataError, FileTask

    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "say hi:", "answer": "hi"}\n' * 3)
    (tmp_path / "fns.py").write_text("def reward(p, r, a):\n    return float(r == a)\n"
                                     "def cost(p, r, a):\n    return float(len(r))\n")
    task = FileTask(str(data), f"{tmp_path / 'fns.py'}:reward", cost_fn=f"{tmp_path / 'fns.py'}:cost")
    p = task.train_prompts()[0]
    assert task.has_cost and task.checked_cost(p, "hello") == 5.0 and task.score(p, "hi") == 1.0
    assert not FileTask(str(data), f"{tmp_path / 'fns.py'}:reward").has_cost
    with pytest.raises(DataError, match="task.cost_fn: .* has no function 'nope'"):
        FileTask(str(data), f"{tmp_path / 'fns.py'}:reward", cost_fn=f"{tmp_path / 'fns.py'}:nope")
    cfg = load_config("default", ["task.name=file", f"task.path={data}", f"task.reward_fn={tmp_path}/fns.py:reward",
                                  f"task.cost_fn={tmp_path}/fns.py:cost", "algorithm.name=safe_ppo"])
    assert cfg.algorithm.name == "safe_ppo" and cfg.algorithm.kl_in_reward
