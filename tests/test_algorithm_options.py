"""Options wired from the config into a run: the adaptive KL controller, the policy-loss choice
(`ppo` or `decoupled`) in the actor, and a reward that comes from a reward model alone."""

from __future__ import annotations

import copy
import math
import typing

import pytest
import torch

from fuseflow.algorithms import (
    POLICY_LOSSES,
    AdaptiveKLController,
    FixedKLController,
    decoupled_policy_loss,
    get_policy_loss,
)
from fuseflow.config import AlgorithmConfig, load_config
from fuseflow.data.batch import Batch
from fuseflow.models import CausalLM, ModelConfig
from fuseflow.recipes import compute_advantages, kl_controller, observed_kl, recipe_for
from fuseflow.tasks import FileTask
from fuseflow.workers.actor import ActorWorker
from fuseflow.workers.common import response_logprobs
from fuseflow.workers.reward import RewardWorker


def _cfg(*extra):
    return load_config("default", ["trainer.prompts_per_step=2", "algorithm.group_size=4", "trainer.mini_batch_size=8",
                                   "trainer.micro_batch_size=4", "trainer.epochs=1", *extra])


# ------------------------------------------------------------------------------------ KL
def test_kl_controller_follows_the_config():
    fixed = kl_controller(_cfg().algorithm)
    assert isinstance(fixed, FixedKLController) and fixed.value == 0.01
    ada = kl_controller(_cfg("algorithm.kl_target=0.5", "algorithm.kl_horizon=64", "algorithm.kl_coef=0.2").algorithm)
    assert isinstance(ada, AdaptiveKLController) and (ada.value, ada.target, ada.horizon) == (0.2, 0.5, 64)
    ada.update(current_kl=0.6, n_steps=16)  # error 0.6/0.5 - 1 = 0.2 (at the clip): beta * (1 + 0.2 * 16/64)
    assert ada.value == pytest.approx(0.2 * 1.05)


def test_observed_kl_uses_the_estimator_the_coefficient_multiplies():
    # d = logp - logp_ref = [1, 0, 5]; the third token is masked out.
    batch = Batch({"old_logprobs": torch.tensor([[0.0, -1.0, 0.0]]), "ref_logprobs": torch.tensor([[-1.0, -1.0, -5.0]]),
                   "response_mask": torch.tensor([[1.0, 1.0, 0.0]])})
    in_reward = _cfg("algorithm.name=ppo").algorithm  # k1 in the token rewards
    assert observed_kl(batch, in_reward) == pytest.approx((1.0 + 0.0) / 2)
    as_loss = _cfg("algorithm.kl_kind=k3").algorithm  # grpo: k3 as a loss term, e^-d + d - 1
    assert observed_kl(batch, as_loss) == pytest.approx((math.exp(-1.0) + 1.0 - 1.0) / 2)


def test_compute_advantages_uses_the_step_coefficient_not_the_configured_one():
    g = torch.Generator().manual_seed(0)
    mask = (torch.arange(5) < torch.tensor([[5], [3], [4], [2]])).float()  # (B, T)

    def batch():
        return Batch({"response_mask": mask, "old_logprobs": -torch.rand(4, 5, generator=g),
                      "ref_logprobs": -torch.rand(4, 5, generator=g), "values": torch.randn(4, 5, generator=g),
                      "scores": torch.tensor([1.0, 0.0, 0.5, 1.0])}, {"group_id": [0, 0, 1, 1]})

    b1 = batch()
    b2 = Batch(dict(b1.tensors), dict(b1.meta))
    algo = _cfg("algorithm.name=ppo").algorithm
    compute_advantages(b1, recipe_for(algo), algo, kl_coef=0.3)
    compute_advantages(b2, recipe_for(algo), _cfg("algorithm.name=ppo", "algorithm.kl_coef=0.3").algorithm)
    assert torch.equal(b1["advantages"], b2["advantages"]) and torch.equal(b1["returns"], b2["returns"])
    b3 = Batch(dict(b1.tensors), dict(b1.meta))
    compute_advantages(b3, recipe_for(algo), algo)  # the configured 0.01 gives other returns
    assert not torch.allclose(b3["returns"], b1["returns"])


# ---------------------------------------------------------------------------- policy loss
def test_every_policy_loss_choice_is_registered():
    choices = typing.get_args(AlgorithmConfig.model_fields["policy_loss"].annotation)
    assert set(choices) == {"ppo", "decoupled"} and set(choices) <= set(POLICY_LOSSES)
    assert get_policy_loss("decoupled") is decoupled_policy_loss


def _actor_batch(model, seed=0, b=8, tp=3, tr=5):
    g = torch.Generator().manual_seed(seed)
    r_len = torch.tensor([5, 2, 4, 1, 5, 3, 4, 5])[:b]
    p_len = torch.tensor([3, 2, 1, 3, 2, 3, 1, 2])[:b]
    p_mask = (torch.arange(tp) >= tp - p_len[:, None]).long()  # left-padded prompt
    r_mask = (torch.arange(tr) < r_len[:, None]).long()  # right-padded response
    ids = torch.randint(3, model.config.vocab_size, (b, tp + tr), generator=g) * torch.cat([p_mask, r_mask], 1)
    batch = Batch({"input_ids": ids, "attention_mask": torch.cat([p_mask, r_mask], 1),
                   "response_mask": r_mask.float(), "advantages": torch.randn(b, tr, generator=g) * r_mask})
    with torch.no_grad():
        batch["old_logprobs"] = response_logprobs(model, batch, 1.0)
    batch["ref_logprobs"] = batch["old_logprobs"] - 0.1
    return batch


def _update(model, batch, *extra):
    cfg = _cfg(*extra)
    actor = ActorWorker(copy.deepcopy(model), None, torch.device("cpu"), torch.float32, cfg.algorithm, cfg.trainer,
                        1.0, 5)
    metrics = actor.update(batch, lr=1e-3, kl_coef=0.01, seed=0)
    return metrics, actor.model


def test_actor_decoupled_loss_is_ppo_when_behaviour_equals_proximal_and_weights_tokens_otherwise():
    model = CausalLM.from_config(ModelConfig.preset("tiny", vocab_size=40), seed=3)
    batch = _actor_batch(model)
    batch["behavior_logprobs"] = batch["old_logprobs"].clone()
    ppo, ppo_model = _update(model, batch)
    dec, dec_model = _update(model, batch, "algorithm.policy_loss=decoupled")
    # Means over length-sorted micro-batches are token-weighted in fp32, so 1.0 comes back within rounding.
    assert dec["actor/is_weight_mean"] == pytest.approx(1.0, abs=1e-6) and dec["actor/is_cap_frac"] == 0.0
    assert {k: v for k, v in dec.items() if not k.startswith("actor/is_")} == ppo
    assert all(torch.equal(a, b) for a, b in zip(ppo_model.parameters(), dec_model.parameters(), strict=True))
    # A behaviour policy 0.5 nats less likely on every token: each weight is e^0.5, the loss scales by it.
    batch["behavior_logprobs"] = batch["old_logprobs"] - 0.5
    shifted, _ = _update(model, batch, "algorithm.policy_loss=decoupled", "algorithm.is_cap=null")
    assert shifted["actor/is_weight_mean"] == pytest.approx(math.exp(0.5))
    assert shifted["actor/pg_loss"] == pytest.approx(math.exp(0.5) * ppo["actor/pg_loss"], rel=1e-5)
    capped, _ = _update(model, batch, "algorithm.policy_loss=decoupled", "algorithm.is_cap=1.5")
    assert capped["actor/is_cap_frac"] == pytest.approx(1.0) and capped["actor/is_weight_mean"] == pytest.approx(1.5)
    assert capped["actor/pg_loss"] == pytest.approx(1.5 * ppo["actor/pg_loss"], rel=1e-5)


# ---------------------------------------------------------------------- reward model alone
class _LengthRM:
    def score(self, prompts, responses):
        return torch.tensor([float(len(r)) for r in responses])


def test_file_task_without_a_reward_function_is_scored_by_the_reward_model_alone(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "say hi:", "response": "hi"}\n' * 3)
    task = FileTask(str(data), None)
    p = task.train_prompts()[0]
    assert not task.has_reward and math.isnan(task.score(p, "hi")) and not task.is_correct(p, "hi")
    out = RewardWorker(task, _LengthRM(), fn_weight=0.0).score([p, p], ["hi", "hello"])
    assert out.scores.tolist() == [2.0, 5.0] and out.correct.tolist() == [0.0, 0.0]
    assert torch.isnan(out.fn_scores).all()
    with pytest.raises(ValueError, match="has no reward function.*fn_weight=1.0"):
        RewardWorker(task, _LengthRM(), fn_weight=1.0)
    with pytest.raises(ValueError, match="reward model not set"):
        RewardWorker(task, None, fn_weight=0.0)
