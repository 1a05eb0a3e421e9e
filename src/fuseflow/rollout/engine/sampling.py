"""Token choice for a batch of rows, each with its own parameters and its own generator.

The math is the foundation sampler's (`rollout/sampler.py`): temperature-scaled logits, optional
top-k/top-p mask, inverse-CDF sampling with exactly one uniform per token drawn from the request's
own generator, argmax for greedy rows. So a seed gives the same tokens here and there, whatever
the batch. The one shortcut: when no row uses top-k/top-p the mask is skipped (it would only drop
tokens whose probability is below float rounding, which can change a token with probability ~1e-7).

The returned log-prob is that of the chosen token under the temperature-scaled distribution
before any top-k/top-p mask: what the trainer's forward recomputes.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..sampler import filter_logits
from .sequence import Sequence


def sample_tokens(logits: Tensor, seqs: list[Sequence]) -> tuple[list[int], list[float]]:
    """Tokens and their log-probs for logits (B, V) fp32, row i belonging to seqs[i]."""
    dev = logits.device
    params = [s.params for s in seqs]
    temps = [p.temperature for p in params]
    scaled = logits if all(t == 1.0 for t in temps) else logits / torch.tensor(temps, device=dev).unsqueeze(-1)
    logp = scaled.log_softmax(-1)  # (B, V)
    u = torch.tensor([s.next_uniform() for s in seqs], device=dev)  # (B,) one draw per token
    greedy = [p.greedy for p in params]
    if all(greedy):
        token = logits.argmax(-1)
    else:
        if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
            top_k = torch.tensor([p.top_k for p in params], device=dev)
            top_p = torch.tensor([p.top_p for p in params], device=dev)
            scaled = filter_logits(scaled, top_k, top_p)
        cdf = scaled.softmax(-1).cumsum(-1)  # (B, V)
        token = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1)).squeeze(-1).clamp(max=logits.shape[-1] - 1)
        if any(greedy):
            token = torch.where(torch.tensor(greedy, device=dev), logits.argmax(-1), token)
    token_lp = logp.gather(-1, token.unsqueeze(-1)).squeeze(-1)
    return token.tolist(), token_lp.tolist()
