"""The first rollout backend: batched sampling with a KV cache on our decoder.

Prompts are left-padded and prefilled together; each decode step runs only the rows
still generating (finished rows are dropped from the batch and the cache). Each
request draws its random numbers from its own generator seeded by its ``seed``, so
a sample does not depend on which other requests shared its batch.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from .base import RolloutBackend, RolloutRequest, Sample, SamplingParams


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask logits (B, V) outside each row's top-k (0 = off) and top-p nucleus with -inf."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    rank = torch.arange(vocab, device=logits.device).expand_as(logits)
    k = torch.where(top_k > 0, top_k, vocab).unsqueeze(-1)  # (B, 1)
    drop = rank >= k
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
    # Keep the smallest prefix whose mass reaches top_p: drop a token once the mass before it does.
    mass_before = probs.cumsum(-1) - probs
    drop |= mass_before >= top_p.unsqueeze(-1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


class Sampler(RolloutBackend):
    """Static-batch sampler over a ``CausalLM`` that it shares with the trainer (no weight copy).

    >>> sampler = Sampler(model, pad_id=tok.pad_token_id)          # doctest: +SKIP
    >>> samples = list(sampler.generate([RolloutRequest(0, ids, SamplingParams(seed=1))]))  # doctest: +SKIP
    """

    def __init__(self, model: torch.nn.Module, pad_id: int, max_batch: int = 512):
        self.model, self.pad_id, self.max_batch = model, pad_id, max_batch
        self.policy_version = 0

    def generate(self, requests: Iterable[RolloutRequest]) -> Iterator[Sample]:
        reqs = list(requests)
        for i in range(0, len(reqs), self.max_batch):
            yield from self._generate_batch(reqs[i : i + self.max_batch])

    @torch.no_grad()
    def _generate_batch(self, reqs: list[RolloutRequest]) -> list[Sample]:
        model = self.model
        device = next(model.parameters()).device
        was_training = model.training
        model.eval()
        try:
            return self._decode(reqs, device)
        finally:
            model.train(was_training)

    def _decode(self, reqs: list[RolloutRequest], device: torch.device) -> list[Sample]:
        B = len(reqs)
        width = max(len(r.prompt_ids) for r in reqs)
        ids = torch.full((B, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((B, width), dtype=torch.long)
        for i, r in enumerate(reqs):
            if not r.prompt_ids:
                raise ValueError(f"request {r.uid}: empty prompt")
            ids[i, width - len(r.prompt_ids):] = torch.as_tensor(r.prompt_ids)
            mask[i, width - len(r.prompt_ids):] = 1
        ids, mask = ids.to(device), mask.to(device)
        p = [r.params for r in reqs]
        temp = torch.tensor([x.temperature for x in p], device=device).unsqueeze(-1)
        top_k = torch.tensor([x.top_k for x in p], device=device)
        top_p = torch.tensor([x.top_p for x in p], device=device)
        greedy = torch.tensor([x.greedy for x in p], device=device)
        max_new = [x.max_new_tokens for x in p]
        stops = [set(x.stop_token_ids) for x in p]
        gens = [torch.Generator().manual_seed(x.seed) for x in p]

        out_tokens: list[list[int]] = [[] for _ in reqs]
        out_lp: list[list[float]] = [[] for _ in reqs]
        reasons: list[str | None] = [None] * B
        live = list(range(B))  # request index of each row still in the batch
        pos = mask.sum(-1, keepdim=True) - 1  # (B, 1) position of the last prompt token
        output = self.model(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                            use_cache=True)
        cache, logits = output.past_key_values, output.logits[:, -1].float()
        while live:
            rows = torch.tensor(live, device=device)
            scaled = logits / temp[rows]
            logp = scaled.log_softmax(-1)
            filtered = filter_logits(scaled, top_k[rows], top_p[rows])
            # Inverse-CDF sampling with one uniform per row from that request's own generator.
            u = torch.stack([torch.rand((), generator=gens[r]) for r in live]).to(device)
            cdf = filtered.softmax(-1).cumsum(-1)
            sampled = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1)).squeeze(-1)
            sampled = sampled.clamp(max=logits.shape[-1] - 1)
            token = torch.where(greedy[rows], logits.argmax(-1), sampled)
            token_lp = logp.gather(-1, token.unsqueeze(-1)).squeeze(-1)
            keep = []
            for j, (r, t, lp) in enumerate(zip(live, token.tolist(), token_lp.tolist(), strict=True)):
                out_tokens[r].append(t)
                out_lp[r].append(lp)
                if t in stops[r]:
                    reasons[r] = "stop"
                elif len(out_tokens[r]) >= max_new[r]:
                    reasons[r] = "length"
                else:
                    keep.append(j)
            if not keep:
                break
            if len(keep) < len(live):  # drop finished rows so decode cost follows live rows only
                keep_t = torch.tensor(keep, device=device)
                cache = cache.select(keep_t)
                mask, pos, token = mask[keep_t], pos[keep_t], token[keep_t]
                live = [live[j] for j in keep]
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)
            pos = pos + 1
            output = self.model(token.unsqueeze(-1), attention_mask=mask, position_ids=pos,
                                past_key_values=cache, use_cache=True)
            cache, logits = output.past_key_values, output.logits[:, -1].float()
        return [Sample(r.uid, r.group_id, list(r.prompt_ids), out_tokens[i], out_lp[i], reasons[i],
                       self.policy_version) for i, r in enumerate(reqs)]


def make_requests(prompt_ids: list[list[int]], params: SamplingParams, group_size: int, seed: int,
                  group_offset: int = 0) -> list[RolloutRequest]:
    """``group_size`` requests per prompt, each with its own seed derived from (seed, uid)."""
    reqs = []
    for g, ids in enumerate(prompt_ids):
        for k in range(group_size):
            uid = g * group_size + k
            sp = SamplingParams(params.temperature, params.top_p, params.top_k, params.greedy,
                                params.max_new_tokens, params.stop_token_ids, seed=(seed * 1_000_003 + uid) % (2**63))
            reqs.append(RolloutRequest(uid, ids, sp, group_offset + g))
    return reqs
