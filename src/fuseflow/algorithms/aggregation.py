"""Reduce a per-token loss matrix to the scalar that is back-propagated.

The point of this module is gradient accumulation that does not change results.
A mean taken per micro-batch and then averaged over micro-batches weights tokens
differently from a mean over the whole batch whenever micro-batches hold different
token counts (the known "gradient accumulation changes GRPO results" bug). Here the
caller passes the *global* normaliser (tokens or sequences in the whole optimizer
batch, over all data-parallel ranks); each micro-batch then returns its share, and
the shares simply add up to the whole-batch loss, whatever the split.
"""

from __future__ import annotations

import torch

from fuseflow.algorithms.masked import as_bool_mask

__all__ = ["AGG_MODES", "aggregate", "aggregation_counts"]

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")

Count = int | float | torch.Tensor


def aggregation_counts(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(num_tokens, num_seqs)`` of one (micro-)batch as 0-dim long tensors.

    ``num_seqs`` counts rows with at least one masked-in token: an empty response
    is not a sequence to average over. Sum these over every micro-batch of an
    optimizer step (and all-reduce with SUM across data-parallel ranks) to get the
    ``num_global_tokens`` / ``num_global_seqs`` that :func:`aggregate` expects.
    """
    m = as_bool_mask(mask, mask)
    if m.dim() != 2:
        raise ValueError(f"mask must be 2-D (B, T), got shape {tuple(m.shape)}")
    return m.sum(), m.any(dim=-1).sum()


def _denominator(given: Count | None, local: torch.Tensor, name: str, ref: torch.Tensor) -> torch.Tensor:
    if given is None:
        # Local mean: an empty micro-batch has loss 0, not NaN.
        return local.clamp(min=1).to(ref.dtype)
    value = torch.as_tensor(given, dtype=ref.dtype, device=ref.device)
    if value.dim() != 0:
        raise ValueError(f"{name} must be a scalar, got shape {tuple(value.shape)}")
    if not bool(value > 0):
        raise ValueError(f"{name}={float(value)} must be > 0 (the count over the whole optimizer batch)")
    return value


def aggregate(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    num_global_tokens: Count | None = None,
    num_global_seqs: Count | None = None,
    norm_len: int | None = None,
) -> torch.Tensor:
    """Reduce ``loss_mat`` (B, T) to a scalar over the tokens where ``mask`` is 1.

    Modes, with ``m`` the mask, ``N_tok`` the token count, ``N_seq`` the count of
    non-empty sequences and ``L`` the constant ``norm_len``:

    - ``token-mean``: ``sum_{i,t} m*l / N_tok`` (every token weighs the same; DAPO).
    - ``seq-mean-token-mean``: ``sum_i (sum_t m*l / sum_t m) / N_seq`` (original GRPO).
    - ``seq-mean-token-sum``: ``sum_i (sum_t m*l) / N_seq``.
    - ``seq-mean-token-sum-norm``: ``sum_{i,t} m*l / (N_seq * L)`` (Dr. GRPO: a constant
      length normaliser, so longer answers are not down-weighted). ``L`` should be the
      configured maximum response length; it defaults to ``T`` only when no global
      counts are given, since ``T`` may differ between padded micro-batches.

    Without global counts the denominators are the local ones (a plain mean). With
    them, summing the results over micro-batches and ranks gives the whole-batch
    value exactly: ``sum_k aggregate(mb_k, ..., N_global) == aggregate(batch)``.
    With DDP, which averages gradients over ranks, multiply by the world size (or
    all-reduce with SUM) to keep that identity.

    >>> l = torch.tensor([[1.0, 3.0], [5.0, 0.0]]); m = torch.tensor([[1, 1], [1, 0]])
    >>> aggregate(l, m, "token-mean"), aggregate(l, m, "seq-mean-token-mean")
    (tensor(3.), tensor(3.5000))
    """
    if mode not in AGG_MODES:
        raise ValueError(f"agg mode {mode!r} is not known; choose one of {', '.join(AGG_MODES)}")
    if loss_mat.dim() != 2:
        raise ValueError(f"loss_mat must be 2-D (B, T), got shape {tuple(loss_mat.shape)}")
    m = as_bool_mask(mask, loss_mat)
    zero = torch.zeros((), dtype=loss_mat.dtype, device=loss_mat.device)
    picked = torch.where(m, loss_mat, zero)  # (B, T)

    if mode == "token-mean":
        return picked.sum() / _denominator(num_global_tokens, m.sum(), "num_global_tokens", loss_mat)

    tok_per_seq = m.sum(dim=-1)  # (B,)
    seq_sum = picked.sum(dim=-1)  # (B,)
    n_seq = _denominator(num_global_seqs, (tok_per_seq > 0).sum(), "num_global_seqs", loss_mat)
    if mode == "seq-mean-token-mean":
        seq_loss = seq_sum / tok_per_seq.clamp(min=1).to(loss_mat.dtype)
        return seq_loss.sum() / n_seq
    if mode == "seq-mean-token-sum":
        return seq_sum.sum() / n_seq
    # seq-mean-token-sum-norm
    if norm_len is None:
        if num_global_seqs is not None:
            raise ValueError("agg mode 'seq-mean-token-sum-norm' with num_global_seqs needs norm_len "
                             "(the configured max response length); the padded width T of a micro-batch "
                             "varies between splits and would break gradient accumulation")
        norm_len = loss_mat.shape[-1]
    if norm_len <= 0:
        raise ValueError(f"norm_len={norm_len} must be a positive token count")
    return seq_sum.sum() / (n_seq * norm_len)
