"""Data-parallel sharding of the decoder models with FSDP2, kept out of the model code.

``shard_fsdp`` wraps each decoder layer, then the root (embeddings, final norm, heads),
over every rank of the default process group: parameters, gradients and optimizer state
are split across ranks and gathered layer by layer in forward and backward. FSDP2
averages gradients over ranks; callers that normalise losses by global token counts
scale the loss by the world size so the result is the whole-batch gradient.

The other helpers move between the sharded layout and full tensors in the format of a
single-process run, so checkpoints, weight sync and resume are the same on every backend.
All of them are collectives: every rank of the group must call them in the same order.
"""

from __future__ import annotations

import torch
from torch import nn


def shard_fsdp(model: nn.Module, device_type: str, world_size: int) -> nn.Module:
    """Shard ``model`` (a ``CausalLM`` or ``ValueModel``) in place over ``world_size`` ranks and return it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device_type, (world_size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def is_sharded(t: torch.Tensor) -> bool:
    """Whether ``t`` is a ``DTensor`` (a parameter of an FSDP2-sharded model, each rank holding a slice)
    rather than a plain full tensor."""
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if is_sharded(t) else t


@torch.no_grad()
def copy_full_weights(src: nn.Module, dst: nn.Module) -> None:
    """Copy the (possibly sharded) parameters of ``src`` into the plain model ``dst`` with the same names."""
    params = dict(dst.named_parameters())
    for name, p in src.named_parameters():
        params[name].copy_(_full(p.detach()).to(params[name].device))


def full_optimizer_state(opt: torch.optim.Optimizer) -> dict:
    """``opt.state_dict()`` with every sharded state tensor gathered: the single-process layout."""
    sd = opt.state_dict()
    # clone: the result must not alias live state (Adam's ``step`` tensor is updated in place).
    state = {pid: {k: _full(v).detach().cpu().clone() if torch.is_tensor(v) else v for k, v in st.items()}
             for pid, st in sd["state"].items()}
    return {"state": state, "param_groups": sd["param_groups"]}


def load_full_optimizer_state(opt: torch.optim.Optimizer, sd: dict) -> None:
    """Load a single-process optimizer state into ``opt``, sharding each tensor like its parameter."""
    from torch.distributed.tensor import distribute_tensor

    params = [p for g in opt.param_groups for p in g["params"]]
    state = {}
    for pid, st in sd["state"].items():
        p = params[int(pid)]
        state[pid] = {k: distribute_tensor(v.to(p.device), p.device_mesh, p.placements)
                      if torch.is_tensor(v) and is_sharded(p) and v.shape == p.shape else v
                      for k, v in st.items()}
    opt.load_state_dict({"state": state, "param_groups": sd["param_groups"]})
