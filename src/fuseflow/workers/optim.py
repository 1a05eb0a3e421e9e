"""The optimizer step shared by every trainable role, SFT, the reward model and the pipeline stages."""

from __future__ import annotations

import math
import warnings

import torch

# Devices with torch's fused AdamW kernel that fuseflow runs on.
FUSED_ADAMW_DEVICES = ("cpu", "cuda")


def adamw(params, lr: float, weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.95)) -> torch.optim.AdamW:
    """AdamW over ``params`` (every role, SFT, the reward model and the pipeline stages use it).

    torch's fused kernel where every tensor is floating point on CPU or CUDA: one pass over each tensor instead
    of a dozen, 0.19-0.24 of the step time of torch's default per-tensor loop at 0.8M-494M parameters on a 2-core
    CPU (``fuseflow bench optimizer``; docs/benchmarks.md, "The fused AdamW step"); its results differ from the
    loop's in the last bits. Elsewhere torch's default implementation.
    """
    params = list(params)
    fused = all(p.is_floating_point() and p.device.type in FUSED_ADAMW_DEVICES for p in params)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=betas, fused=fused or None)


def clipped_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, max_norm: float, role: str) -> float:
    """Clip gradients and step; a non-finite gradient skips the step with a warning (weights stay intact)."""
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
    if not math.isfinite(norm):
        warnings.warn(f"{role}: non-finite gradient norm ({norm}); skipping this optimizer step", stacklevel=2)
        optimizer.zero_grad(set_to_none=True)
        return norm
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set every param group's learning rate (the schedule's value for this step)."""
    for group in optimizer.param_groups:
        group["lr"] = lr
