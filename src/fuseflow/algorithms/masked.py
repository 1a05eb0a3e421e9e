"""Masked reductions shared by every estimator and loss.

Every function here treats a masked-out entry as absent: whatever number sits
there (padding, an observation token, even NaN or inf) cannot change the result,
because entries are selected with ``torch.where`` before any arithmetic.
"""

from __future__ import annotations

import torch

__all__ = ["masked_mean", "masked_sum", "masked_whiten", "as_bool_mask", "check_same_shape"]


def as_bool_mask(mask: torch.Tensor, like: torch.Tensor, name: str = "mask") -> torch.Tensor:
    """Return ``mask`` as a bool tensor after checking it has the shape of ``like``.

    Accepts bool, integer or float masks (nonzero means "counts"), so callers can
    pass the float ``response_mask`` a batch usually carries.
    """
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(mask).__name__}")
    if mask.shape != like.shape:
        raise ValueError(f"{name} has shape {tuple(mask.shape)} but the data has shape {tuple(like.shape)}; "
                         "they must match")
    return mask if mask.dtype == torch.bool else mask != 0


def check_same_shape(**tensors: torch.Tensor) -> None:
    """Raise a ValueError naming the arguments when the given tensors differ in shape."""
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    if len(set(shapes.values())) > 1:
        listed = ", ".join(f"{k}={s}" for k, s in shapes.items())
        raise ValueError(f"shape mismatch: {listed}; these arguments must all have the same shape")


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``x`` over entries where ``mask`` is nonzero (all dims when ``dim`` is None)."""
    m = as_bool_mask(mask, x)
    picked = torch.where(m, x, torch.zeros((), dtype=x.dtype, device=x.device))
    return picked.sum() if dim is None else picked.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over entries where ``mask`` is nonzero.

    An all-masked slice has mean 0 rather than NaN, so an empty response (e.g. one
    cut to zero tokens) contributes nothing instead of poisoning a batch metric.

    >>> masked_mean(torch.tensor([[1.0, 2.0, 9.0]]), torch.tensor([[1, 1, 0]]))
    tensor(1.5000)
    """
    m = as_bool_mask(mask, x)
    total = masked_sum(x, m, dim)
    count = m.sum() if dim is None else m.sum(dim=dim)
    return total / count.clamp(min=1).to(total.dtype)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """Normalise the masked-in entries of ``x`` to zero mean and unit variance.

    Statistics are taken over all masked-in entries jointly (the whole batch, not per
    row), with the unbiased (n-1) variance; with fewer than two entries the variance
    is taken as 0. Masked-out entries come back as 0. With ``shift_mean=False`` the
    mean is added back after scaling (only the scale is normalised), which keeps the
    sign of a reward signal.

    Formula: ``(x - mean) / sqrt(var + eps)`` on masked-in entries.
    """
    m = as_bool_mask(mask, x)
    n = m.sum()
    mean = masked_mean(x, m)
    centered = torch.where(m, x - mean, torch.zeros((), dtype=x.dtype, device=x.device))
    var = (centered * centered).sum() / (n - 1).clamp(min=1).to(x.dtype)
    var = torch.where(n > 1, var, torch.zeros_like(var))
    out = centered * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(m, out, torch.zeros((), dtype=x.dtype, device=x.device))
