"""The `hf` rollout backend: plain `transformers` `generate` on a Hugging Face copy of our weights.

It is the comparison baseline for the engine (and a check that our checkpoints serve in HF
unchanged): requests are cut into static, left-padded batches, and each batch runs until its
longest request is done. Sampling uses HF's own logits processors and the global torch RNG,
seeded from the first request of each batch, so a sample here depends on its batch (unlike the
engine, whose per-request generators make it independent of batching).
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import torch
from torch import Tensor

from fuseflow.models.llama import CausalLM

from .base import RolloutBackend, RolloutRequest, Sample, SamplingParams


def _batch_key(p: SamplingParams) -> tuple:
    # Requests may share a static batch only if HF can run them with one set of generate() options.
    return (p.greedy, p.temperature, p.top_p, p.top_k, tuple(sorted(p.stop_token_ids)))


class HFBackend(RolloutBackend):
    """transformers `generate` over static batches of at most `batch_size` requests.

    Built from our `CausalLM` (weights go through `save_pretrained` into a temporary directory and
    back with `AutoModelForCausalLM.from_pretrained`, so what runs is exactly what HF would load),
    or from an HF checkpoint directory. The HF model is a copy: `update_weights()` copies the
    source model's current weights into it.

    >>> backend = HFBackend(model, pad_id=0, batch_size=32)     # doctest: +SKIP
    >>> samples = list(backend.generate(requests))              # doctest: +SKIP
    """

    def __init__(self, model: CausalLM | None = None, *, path: str | Path | None = None, pad_id: int = 0,
                 batch_size: int = 64, attn_implementation: str = "sdpa"):
        from transformers import AutoModelForCausalLM

        if (model is None) == (path is None):
            raise ValueError("HFBackend needs exactly one of model= (a CausalLM) or path= (an HF checkpoint dir)")
        if batch_size < 1:
            raise ValueError(f"HFBackend batch_size must be >= 1, got {batch_size}")
        self.source, self.pad_id, self.batch_size = model, pad_id, batch_size
        self.policy_version = 0
        if model is not None:
            p = next(model.parameters())
            with tempfile.TemporaryDirectory() as tmp:
                model.save_pretrained(tmp)
                self.hf = AutoModelForCausalLM.from_pretrained(tmp, dtype=p.dtype, attn_implementation=attn_implementation)
            self.hf.to(p.device)
        else:
            self.hf = AutoModelForCausalLM.from_pretrained(str(path), attn_implementation=attn_implementation)
        self.hf.eval()
        # Stop tokens come from each request, never from the checkpoint's generation defaults.
        self.hf.generation_config.eos_token_id = None
        self.hf.generation_config.pad_token_id = pad_id

    def update_weights(self, version: int | None = None, state_dict: Mapping[str, Tensor] | None = None) -> None:
        """Copy new weights into the HF model: `state_dict`, or else the source model's current ones."""
        if state_dict is None:
            if self.source is None:
                raise ValueError("update_weights: this backend was built from a path; pass state_dict=")
            state_dict = self.source.state_dict()
        with torch.no_grad():
            self.hf.load_state_dict(dict(state_dict), strict=False)
        self.policy_version = self.policy_version + 1 if version is None else version

    def generate(self, requests: Iterable[RolloutRequest]) -> Iterator[Sample]:
        batch: list[RolloutRequest] = []
        for r in requests:
            if batch and (len(batch) == self.batch_size or _batch_key(r.params) != _batch_key(batch[0].params)):
                yield from self._run(batch)
                batch = []
            batch.append(r)
        if batch:
            yield from self._run(batch)

    @torch.no_grad()
    def _run(self, reqs: list[RolloutRequest]) -> list[Sample]:
        dev = self.hf.device
        width = max(len(r.prompt_ids) for r in reqs)
        ids = torch.full((len(reqs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(reqs), width), dtype=torch.long)
        for i, r in enumerate(reqs):
            if not r.prompt_ids:
                raise ValueError(f"request {r.uid}: prompt_ids is empty; give at least one token")
            ids[i, width - len(r.prompt_ids):] = torch.as_tensor(r.prompt_ids)
            mask[i, width - len(r.prompt_ids):] = 1
        p = reqs[0].params
        opts: dict = {"do_sample": not p.greedy}
        if not p.greedy:
            opts.update(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k or None)
        if p.stop_token_ids:
            opts["eos_token_id"] = list(p.stop_token_ids)
        with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
            torch.manual_seed(p.seed)
            out = self.hf.generate(ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=max(
                r.params.max_new_tokens for r in reqs), min_new_tokens=0, pad_token_id=self.pad_id,
                return_dict_in_generate=True, output_logits=True, **opts)
        new = out.sequences[:, width:]  # (B, steps)
        logits = torch.stack(out.logits, dim=1).float()  # (B, steps, V), before any processor
        logp = (logits / p.temperature).log_softmax(-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
        samples = []
        for i, r in enumerate(reqs):
            toks, reason = new[i].tolist()[: r.params.max_new_tokens], "length"
            for j, t in enumerate(toks):
                if t in r.params.stop_token_ids:
                    toks, reason = toks[: j + 1], "stop"
                    break
            samples.append(Sample(r.uid, r.group_id, list(r.prompt_ids), toks, logp[i, : len(toks)].tolist(),
                                  reason, self.policy_version))
        return samples
