"""Held-out evaluation: greedy decoding, task reward and accuracy."""

from __future__ import annotations

import torch

from fuseflow.data.tokenizer import prompt_text, stop_token_ids
from fuseflow.rollout.base import RolloutRequest, SamplingParams
from fuseflow.rollout.sampler import Sampler
from fuseflow.tasks import Prompt, Task


def encode_prompts(tokenizer, prompts: list[Prompt], max_len: int) -> list[list[int]]:
    """Token ids of each prompt; a prompt over ``max_len`` tokens is a clear error, not a truncation.

    With a chat template on (``fuseflow.data.tokenizer.load_tokenizer``) each prompt is one user
    turn followed by the assistant header; the template writes its own special tokens, so none
    are added here.
    """
    ids = tokenizer([prompt_text(tokenizer, p.text) for p in prompts], add_special_tokens=False)["input_ids"]
    for p, x in zip(prompts, ids, strict=True):
        if len(x) > max_len:
            raise ValueError(f"prompt {p.text[:40]!r}... has {len(x)} tokens, more than model.max_prompt_len="
                             f"{max_len}; raise model.max_prompt_len or shorten the prompt")
        if not x:
            raise ValueError(f"prompt {p.text!r} encodes to no tokens")
    return ids


@torch.no_grad()
def evaluate(model, tokenizer, task: Task, prompts: list[Prompt], max_prompt_len: int, max_new_tokens: int,
             batch_size: int = 256) -> dict[str, float]:
    """Greedy accuracy, mean reward and mean response length on ``prompts``.

    A task without a reward function (a file task scored by a reward model) has no notion of
    a correct answer: only ``response_length`` is returned, never an accuracy of 0.
    """
    sampler = Sampler(model, tokenizer.pad_token_id, max_batch=batch_size)
    params = SamplingParams(greedy=True, max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids(tokenizer))
    ids = encode_prompts(tokenizer, prompts, max_prompt_len)
    reqs = [RolloutRequest(i, x, params) for i, x in enumerate(ids)]
    correct = reward = length = 0.0
    for s in sampler.generate(reqs):
        length += len(s.response_ids)
        if task.has_reward:
            r = task.score(prompts[s.uid], decode_response(tokenizer, s.response_ids))
            reward += r if r == r else 0.0
            correct += float(r == r and r >= task.success_threshold)
    n = max(len(prompts), 1)
    if not task.has_reward:
        return {"response_length": length / n}
    return {"accuracy": correct / n, "reward": reward / n, "response_length": length / n}


def decode_response(tokenizer, ids: list[int]) -> str:
    """Response text without the trailing stop token or pad, and without special tokens."""
    ends = (*stop_token_ids(tokenizer), tokenizer.pad_token_id)
    while ids and ids[-1] in ends:
        ids = ids[:-1]
    return tokenizer.decode(ids, skip_special_tokens=True)
