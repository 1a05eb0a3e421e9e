"""Weight transfer from a trainer process to rollout replicas: one torch.distributed broadcast per bucket.

A replica in another process (or on another GPU) holds its own copy of the policy; after an
update the trainer's rank sends every parameter to it. Parameters are packed per dtype into
flat buckets of at most ``bucket_bytes`` (``torch._utils._flatten_dense_tensors``, what DDP
and Megatron use), so a model of hundreds of tensors costs a few large collectives instead of
hundreds of small ones, each paying NCCL's launch latency. Every rank must call
``broadcast_parameters`` with the same parameter list (same names, shapes and dtypes, in the
same order); the process group's timeout bounds each broadcast.
"""

from __future__ import annotations

import datetime
import socket
from collections.abc import Iterable

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

DEFAULT_BUCKET_BYTES = 256 << 20


def free_port() -> int:
    """A TCP port free right now on this host, for a process group's rendezvous (never a fixed port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_group(backend: str, rank: int, world_size: int, port: int, timeout_s: float = 300.0) -> None:
    """Join a process group over TCP on localhost; ``timeout_s`` bounds the rendezvous and every collective."""
    import torch.distributed as dist

    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))


def buckets(params: list[torch.Tensor], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[list[int]]:
    """Indices of ``params`` grouped by (dtype, device), each group cut into runs of at most ``bucket_bytes``.

    A tensor larger than the bucket gets a bucket of its own. Order within a bucket follows ``params``.

    Example:
        >>> ps = [torch.zeros(4), torch.zeros(4), torch.zeros(2, dtype=torch.float16)]
        >>> buckets(ps, bucket_bytes=16)
        [[0], [1], [2]]
        >>> buckets(ps, bucket_bytes=32)
        [[0, 1], [2]]
    """
    out: list[list[int]] = []
    open_: dict[tuple, tuple[list[int], int]] = {}
    for i, p in enumerate(params):
        key, size = (p.dtype, p.device), p.numel() * p.element_size()
        idx, used = open_.get(key, ([], 0))
        if idx and used + size > bucket_bytes:
            out.append(idx)
            idx, used = [], 0
        idx.append(i)
        open_[key] = (idx, used + size)
    out.extend(idx for idx, _ in open_.values() if idx)
    return out


@torch.no_grad()
def broadcast_parameters(params: Iterable[torch.Tensor], src: int = 0, group=None,
                         bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> int:
    """Overwrite ``params`` on every rank with rank ``src``'s values; returns the bytes sent per receiver.

    A collective: every rank of ``group`` calls it with matching parameter lists. Tensors must sit
    where the backend moves them (CUDA for NCCL, CPU for gloo).
    """
    import torch.distributed as dist

    return _broadcast_buckets(params, lambda flat: dist.broadcast(flat, src=src, group=group),
                              dist.get_rank(group) == src, bucket_bytes)


@torch.no_grad()
def _broadcast_buckets(params: Iterable[torch.Tensor], send, is_src: bool, bucket_bytes: int) -> int:
    # detach(), not .data: a write through it counts in the parameter's version (a PromptCache's check).
    params = [p.detach() for p in params]
    sent = 0
    for idx in buckets(params, bucket_bytes):
        chunk = [params[i] for i in idx]
        flat = _flatten_dense_tensors(chunk)
        send(flat)
        if not is_src:
            for p, new in zip(chunk, _unflatten_dense_tensors(flat, chunk), strict=True):
                p.copy_(new)
        sent += flat.numel() * flat.element_size()
    return sent


class WeightGroup:
    """A process group of its own between one weight source (rank 0) and the rollout replicas.

    Why not the default group: the trainer's rank 0 already belongs to its pool's group (or to
    none), and ``new_group`` would need every rank of that world to take part. A group built on its
    own ``TCPStore`` (rank 0 serves it, on a port picked free at run time) joins exactly the source
    and the replicas; gloo on CPU, NCCL on GPU. ``timeout_s`` bounds the rendezvous and every
    broadcast, so a replica that is gone fails the sync instead of hanging it.
    """

    def __init__(self, addr: str, port: int, rank: int, world_size: int, timeout_s: float, device: str = "cpu"):
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=timeout_s)
        self.rank, self.world_size = rank, world_size
        self.store = dist.TCPStore(addr, port, world_size, is_master=rank == 0, timeout=timeout)
        if device == "cuda":  # written for GPUs, not run on this CPU-only machine
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(self.store, rank, world_size, opts)
        else:
            self.pg = dist.ProcessGroupGloo(self.store, rank, world_size, timeout)

    def broadcast(self, params: Iterable[torch.Tensor], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> int:
        """Rank 0's ``params`` onto every rank (all ranks call it with matching lists); bytes per receiver."""
        return _broadcast_buckets(params, lambda flat: self.pg.broadcast(flat, 0).wait(), self.rank == 0,
                                  bucket_bytes)


def signature(model: torch.nn.Module) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, dtype) of every parameter in broadcast order: both ends of a sync must agree on it."""
    return [(n, tuple(p.shape), str(p.dtype)) for n, p in model.named_parameters()]
