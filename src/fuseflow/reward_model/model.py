"""A trained reward model as a directory: backbone + scalar head, tokenizer, and its report.

Layout of a reward-model directory (written by ``fuseflow train-rm``)::

    config.json, model.safetensors   the ValueModel (HF safetensors; backbone loadable by HF)
    tokenizer.json, ...              the tokenizer it reads text with
    reward_model.json                held-out pairwise accuracy, score mean/std, training curve

A sequence is scored as ``prompt tokens + response tokens + eos``, read at the eos
(``last_token_values``); training and RL scoring share ``encode_texts`` so they agree.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from fuseflow.data.batch import length_mask, pad_sequences
from fuseflow.data.files import read_json
from fuseflow.data.tokenizer import load_tokenizer
from fuseflow.models import ValueModel, last_token_values
from fuseflow.workers.common import autocast, position_ids

META_FILE = "reward_model.json"


def encode_texts(tokenizer, prompts: list[str], responses: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded (input_ids, attention_mask), each (B, T), of ``prompt + response + eos``.

    Prompt and response are tokenized separately, as the policy produces them.
    """
    p_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    r_ids = tokenizer(responses, add_special_tokens=False)["input_ids"]
    seqs = [p + r + [tokenizer.eos_token_id] for p, r in zip(p_ids, r_ids, strict=True)]
    ids = pad_sequences(seqs, tokenizer.pad_token_id, left=True)
    mask = length_mask(torch.tensor([len(s) for s in seqs]), ids.shape[1], left=True).long()
    return ids, mask


class RewardModel:
    """Scores (prompt, response) texts with a Bradley-Terry model, standardised by its training scores.

    ``raw(...)`` is the differentiable score used in training; ``score(...)`` is the
    no-grad standardised score ``(raw - mean) / std`` the RL reward worker uses, so
    rewards are on a unit scale whatever the model learned.
    """

    def __init__(self, model: ValueModel, tokenizer, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, batch_size: int = 64, meta: dict | None = None):
        self.model, self.tokenizer, self.device, self.dtype = model, tokenizer, torch.device(device), dtype
        self.batch_size, self.meta = batch_size, dict(meta or {})

    @classmethod
    def load(cls, path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
             batch_size: int = 64) -> RewardModel:
        """Load a directory written by ``save``; a wrong path is a ValueError that says how to make one."""
        p = Path(path).expanduser()
        if not (p / META_FILE).is_file():
            raise ValueError(f"reward.model: {path} is not a reward-model directory (no {META_FILE}); "
                             "train one with `fuseflow train-rm --output DIR` and pass reward.model=DIR")
        meta = read_json(p / META_FILE, f"reward.model={path}")
        model = ValueModel.from_pretrained(p).to(device).eval().requires_grad_(False)
        return cls(model, load_tokenizer(p), device, dtype, batch_size, meta)

    def save(self, path: str | Path, meta: dict) -> None:
        """Write the model and tokenizer as ``save_pretrained`` does, plus ``meta`` (how it was trained) in its JSON file."""
        p = Path(path)
        self.model.save_pretrained(p)
        self.tokenizer.save_pretrained(str(p))
        self.meta = dict(meta)
        (p / META_FILE).write_text(json.dumps(self.meta, indent=1))

    def raw(self, prompts: list[str], responses: list[str]) -> torch.Tensor:
        """Unstandardised scores (B,), with gradients when the model trains."""
        ids, mask = encode_texts(self.tokenizer, prompts, responses)
        ids, mask = ids.to(self.device), mask.to(self.device)
        with autocast(self.device, self.dtype):
            values = self.model(ids, attention_mask=mask, position_ids=position_ids(mask))  # (B, T)
        return last_token_values(values, mask)

    @torch.no_grad()
    def score(self, prompts: list[str], responses: list[str]) -> torch.Tensor:
        """Standardised scores (B,) on the CPU, computed ``batch_size`` samples at a time."""
        was_training = self.model.training
        self.model.eval()
        try:
            out = [self.raw(prompts[i : i + self.batch_size], responses[i : i + self.batch_size]).float().cpu()
                   for i in range(0, len(prompts), self.batch_size)]
        finally:
            self.model.train(was_training)
        raw = torch.cat(out) if out else torch.zeros(0)
        return (raw - self.meta.get("score_mean", 0.0)) / self.meta.get("score_std", 1.0)
