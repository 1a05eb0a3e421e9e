"""Held-out measures beyond accuracy: cost rate, learned-RM score and gold win rate vs the SFT model.

RLHF against a learned reward model can raise that model's score while the true
preference does not follow (over-optimisation). So a run with ``reward.model`` logs
both: the RM's score of the policy's held-out responses, and how often the task's own
(gold) rule prefers them to the SFT model's responses to the same prompts. Those
responses are sampled as in training (a few per prompt, fixed seeds): a policy trained
on a high-entropy imitation is judged by what it generates, not by its greedy mode.
"""

from __future__ import annotations

import torch

from fuseflow.data.tokenizer import stop_token_ids
from fuseflow.evaluate import decode_response, encode_prompts
from fuseflow.rollout.base import RolloutRequest, SamplingParams
from fuseflow.rollout.sampler import Sampler, make_requests
from fuseflow.tasks import Prompt, Task


@torch.no_grad()
def greedy_responses(model, tokenizer, prompts: list[Prompt], max_prompt_len: int, max_new_tokens: int,
                     batch_size: int = 256) -> list[str]:
    """The greedy response text to each prompt, in order."""
    sampler = Sampler(model, tokenizer.pad_token_id, max_batch=batch_size)
    params = SamplingParams(greedy=True, max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids(tokenizer))
    ids = encode_prompts(tokenizer, prompts, max_prompt_len)
    out = [""] * len(prompts)
    for s in sampler.generate(RolloutRequest(i, x, params) for i, x in enumerate(ids)):
        out[s.uid] = decode_response(tokenizer, s.response_ids)
    return out


@torch.no_grad()
def sampled_responses(model, tokenizer, prompts: list[Prompt], max_prompt_len: int, max_new_tokens: int,
                      temperature: float, n: int, seed: int, batch_size: int = 256) -> list[str]:
    """``n`` sampled responses per prompt, prompt-major (``[p0 x n, p1 x n, ...]``), seeded per sample.

    The same seeds on two models give paired samples, so their comparison is not noisier than it must be.
    """
    sampler = Sampler(model, tokenizer.pad_token_id, max_batch=batch_size)
    params = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens,
                            stop_token_ids=stop_token_ids(tokenizer))
    requests = make_requests(encode_prompts(tokenizer, prompts, max_prompt_len), params, n, seed)
    out = [""] * len(requests)
    for s in sampler.generate(requests):
        out[s.uid] = decode_response(tokenizer, s.response_ids)
    return out


def win_rate(task: Task, prompts: list[Prompt], responses: list[str], baseline: list[str]) -> float:
    """Share of prompts where the task's rule scores ``responses`` above ``baseline`` (a tie counts 1/2)."""
    wins = 0.0
    for p, r, b in zip(prompts, responses, baseline, strict=True):
        s, t = task.score(p, r), task.score(p, b)
        wins += 1.0 if s > t else 0.5 if s == t else 0.0
    return wins / max(len(prompts), 1)


def cost_rate(task: Task, prompts: list[Prompt], responses: list[str]) -> float:
    """Mean cost of ``responses`` (a NaN cost counts 0)."""
    costs = [task.checked_cost(p, r) for p, r in zip(prompts, responses, strict=True)]
    return sum(c for c in costs if c == c) / max(len(prompts), 1)


def preference_eval(task: Task, prompts: list[Prompt], responses: list[str], sft_responses: list[str],
                    reward_model) -> dict[str, float]:
    """``rm_score`` of the responses, the gold rule's mean ``gold_score`` and ``gold_win_rate`` vs the SFT model.

    A task without a reward function (``has_reward`` False) has no gold rule: only ``rm_score``.
    """
    out = {"rm_score": float(reward_model.score([p.text for p in prompts], responses).mean())}
    if task.has_reward:
        gold = [task.score(p, r) for p, r in zip(prompts, responses, strict=True)]
        out |= {"gold_score": sum(g for g in gold if g == g) / max(len(gold), 1),
                "gold_win_rate": win_rate(task, prompts, responses, sft_responses)}
    return out
