"""Turn a user's device string into a (device, dtype) pair, with one clear error for bad input."""

from __future__ import annotations

import re

import torch

ALLOWED_DEVICE_SPECS = "'auto', 'cpu', 'cuda' or 'cuda:N'"
_CUDA_RE = re.compile(r"^cuda(?::(\d+))?$")


def cpuinfo(key: str) -> str:
    """The first value of ``key`` in /proc/cpuinfo ("model name", "vendor_id", ...); "" where unreadable."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(key):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _cuda_dtype() -> torch.dtype:
    # bf16 halves memory and runs on tensor cores; pre-Ampere GPUs lack it and fp16 would
    # need loss scaling, so they get fp32 instead.
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32


def resolve_device(spec: str = "auto") -> tuple[torch.device, torch.dtype]:
    """Map a device spec to the device and the compute dtype that suits it.

    "auto" picks (cuda, bfloat16) when a GPU is visible, else (cpu, float32); CPUs get
    float32 because bf16 matmuls on CPU are slow and lossy for training.

    Example:
        >>> resolve_device("cpu")
        (device(type='cpu'), torch.float32)
    """
    if not isinstance(spec, str):
        raise ValueError(f"device spec must be a string ({ALLOWED_DEVICE_SPECS}), got {spec!r}")
    s = spec.strip().lower()
    if s == "auto":
        if torch.cuda.is_available():
            dev = torch.device("cuda", torch.cuda.current_device())
            return dev, _cuda_dtype()
        return torch.device("cpu"), torch.float32
    if s == "cpu":
        return torch.device("cpu"), torch.float32
    m = _CUDA_RE.match(s)
    if m is None:
        raise ValueError(f"device={spec!r} is not a valid device; use {ALLOWED_DEVICE_SPECS}")
    if not torch.cuda.is_available():
        raise ValueError(f"device={spec!r} asks for CUDA but no GPU is visible; use 'cpu' or 'auto'")
    index = int(m.group(1)) if m.group(1) is not None else torch.cuda.current_device()
    count = torch.cuda.device_count()
    if index >= count:
        raise ValueError(f"device={spec!r} but only {count} GPU(s) are visible (cuda:0..cuda:{count - 1})")
    dev = torch.device("cuda", index)
    return dev, _cuda_dtype()
