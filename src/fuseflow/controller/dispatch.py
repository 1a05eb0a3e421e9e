"""Dispatch and collect: how one call's input is cut per rank and its outputs put back.

``dp_split`` of a ``Batch`` balances token counts (each rank's share of the work) and
pads every rank to the same number of rows. Equal sizes matter for more than balance:
ranks of a sharded (FSDP) model meet in a collective at every forward, so a rank with
one micro-batch fewer would leave the others waiting. Padding rows repeat a real row
with ``response_mask`` zeroed: losses normalised by global token counts give them no
weight, and their outputs are dropped on collection.

Across processes, tensors travel as numpy arrays (``to_wire``/``from_wire``): Ray stores
numpy buffers out of band and reads them without a copy, while torch tensors are pickled.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fuseflow.data.batch import Batch

# The field that gives a row its weight in every loss; zero on padding rows.
LOSS_MASK = "response_mask"


@dataclass(frozen=True)
class SplitPlan:
    """Which original rows each rank gets: ``parts[r]`` (real rows) then ``pad[r]`` padding rows."""

    parts: tuple[tuple[int, ...], ...]
    pad: tuple[int, ...]
    n: int  # rows before splitting

    @property
    def world_size(self) -> int:
        """Number of ranks the rows are split over (one entry of ``parts`` and of ``pad`` each)."""
        return len(self.parts)


def balanced_split(weights: Sequence[float], k: int) -> SplitPlan:
    """Split rows into ``k`` parts of ``ceil(n/k)`` rows (after padding), balancing the summed weights.

    Heaviest row first, each to the lightest part that still has room (LPT with a size
    cap); rows keep their original order inside a part.

    >>> balanced_split([5, 1, 1, 1, 4, 2], 2).parts
    ((0, 1, 2), (3, 4, 5))
    """
    if k < 1:
        raise ValueError(f"balanced_split: k={k} must be >= 1")
    n = len(weights)
    cap = max(1, math.ceil(n / k))
    parts: list[list[int]] = [[] for _ in range(k)]
    load = [0.0] * k
    for i in sorted(range(n), key=lambda j: (-float(weights[j]), j)):
        r = min((r for r in range(k) if len(parts[r]) < cap), key=lambda r: (load[r], r))
        parts[r].append(i)
        load[r] += float(weights[i])
    return SplitPlan(tuple(tuple(sorted(p)) for p in parts), tuple(cap - len(p) for p in parts), n)


def contiguous_split(n: int, k: int) -> SplitPlan:
    """Consecutive runs of rows, sizes differing by at most one, no padding.

    Lists of rollout requests are split this way: requests of one prompt group sit
    together, so a rank's engine can share their prompt prefix.
    """
    if k < 1:
        raise ValueError(f"contiguous_split: k={k} must be >= 1")
    base, extra = divmod(n, k)
    parts, start = [], 0
    for r in range(k):
        size = base + (r < extra)
        parts.append(tuple(range(start, start + size)))
        start += size
    return SplitPlan(tuple(parts), (0,) * k, n)


def plan_for(arg: Any, k: int) -> SplitPlan:
    """The split of a ``dp_split`` argument: token-balanced for a ``Batch``, contiguous for a list."""
    if isinstance(arg, Batch):
        if "attention_mask" in arg.tensors:
            weights = arg["attention_mask"].sum(-1).tolist()
        else:
            weights = [1.0] * len(arg)
        return balanced_split(weights, k)
    if isinstance(arg, (list, tuple)):
        return contiguous_split(len(arg), k)
    raise TypeError(f"dp_split needs a Batch or a list as the first argument, got {type(arg).__name__}")


def shard(arg: Any, plan: SplitPlan) -> list[Any]:
    """One piece of ``arg`` per rank, in plan order, with padding rows appended.

    A list cut by a Batch's padded plan (``split_args``) pads with a repeat of a real item,
    so it stays row-aligned with the Batch; a list's own (contiguous) plan has no padding.
    """
    if isinstance(arg, Batch):
        return [_pad_batch(arg, part, pad) for part, pad in zip(plan.parts, plan.pad, strict=True)]
    return [[arg[i] for i in part] + ([arg[part[0] if part else 0]] * pad if pad else [])
            for part, pad in zip(plan.parts, plan.pad, strict=True)]


def _pad_batch(batch: Batch, part: Sequence[int], pad: int) -> Batch:
    if not pad:
        return batch.select(list(part))
    # A rank with no real rows (fewer rows than ranks) pads with row 0, so its shapes stay valid.
    filler = part[0] if part else 0
    out = batch.select(list(part) + [filler] * pad)
    if LOSS_MASK in out.tensors:
        mask = out[LOSS_MASK].clone()
        mask[len(part):] = 0
        out.tensors[LOSS_MASK] = mask
    return out


def restore(results: Sequence[Any], plan: SplitPlan) -> Any:
    """Undo ``shard``: drop each rank's padding rows and put rows back in the original order.

    Results may be tensors (rows on dim 0), ``Batch``es, lists, or dicts/tuples/dataclasses
    of those (a dataclass is restored field by field; a field that is None on every rank,
    such as an optional output, stays None).
    """
    if len(results) != plan.world_size:
        raise ValueError(f"restore: {len(results)} results for a split over {plan.world_size} ranks")
    first = results[0]
    if first is None or any(r is None for r in results):
        if all(r is None for r in results):
            return None
        raise ValueError("restore: some ranks returned None and others a value for the same output")
    if dataclasses.is_dataclass(first) and not isinstance(first, type):
        return dataclasses.replace(first, **{f.name: restore([getattr(r, f.name) for r in results], plan)
                                             for f in dataclasses.fields(first) if f.init})
    if isinstance(first, dict):
        return {k: restore([r[k] for r in results], plan) for k in first}
    if isinstance(first, tuple):
        return tuple(restore([r[i] for r in results], plan) for i in range(len(first)))
    kept = [_head(r, len(part)) for r, part in zip(results, plan.parts, strict=True)]
    order = [i for part in plan.parts for i in part]
    inverse = [0] * plan.n
    for pos, i in enumerate(order):
        inverse[i] = pos
    if isinstance(first, torch.Tensor):
        return torch.cat(kept)[torch.as_tensor(inverse, dtype=torch.long)]
    if isinstance(first, Batch):
        return Batch.concat(kept).select(inverse)
    if isinstance(first, list):
        flat = [x for r in kept for x in r]
        return [flat[p] for p in inverse]
    raise TypeError(f"restore: cannot put back results of type {type(first).__name__} (tensor, Batch, list, "
                    "dict or tuple of those)")


def _head(result: Any, n: int) -> Any:
    if isinstance(result, Batch):
        return result.select(range(n))
    if isinstance(result, (torch.Tensor, list)):
        if len(result) < n:
            raise ValueError(f"restore: a rank returned {len(result)} rows for {n} real inputs")
        return result[:n]
    raise TypeError(f"restore: cannot put back results of type {type(result).__name__}")


# ------------------------------------------------------------------------------ wire
@dataclass
class WireTensor:
    """A tensor as a numpy array plus its torch dtype (bf16 travels as its raw 16 bits)."""

    array: np.ndarray
    dtype: str


@dataclass
class WireBatch:
    tensors: dict[str, WireTensor]
    meta: dict[str, list]


def to_wire(obj: Any) -> Any:
    """Replace every tensor in ``obj`` (nested in Batch/dict/list/tuple) by a numpy-backed ``WireTensor``."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu()
        if t.dtype == torch.bfloat16:
            return WireTensor(t.view(torch.int16).numpy(), "bfloat16")
        return WireTensor(t.numpy(), str(t.dtype).removeprefix("torch."))
    if isinstance(obj, Batch):
        return WireBatch({k: to_wire(v) for k, v in obj.tensors.items()}, obj.meta)
    if isinstance(obj, dict):
        return {k: to_wire(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_wire(v) for v in obj)
    return obj


def from_wire(obj: Any) -> Any:
    """Inverse of ``to_wire``. Arrays are copied: Ray hands out read-only views of its shared store."""
    if isinstance(obj, WireTensor):
        if obj.dtype == "bfloat16":
            return torch.from_numpy(obj.array.copy()).view(torch.bfloat16)
        return torch.from_numpy(obj.array.copy())
    if isinstance(obj, WireBatch):
        return Batch({k: from_wire(v) for k, v in obj.tensors.items()}, obj.meta)
    if isinstance(obj, dict):
        return {k: from_wire(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(from_wire(v) for v in obj)
    return obj
