"""Reading and writing Hugging Face checkpoint directories (config.json + safetensors, never pickle).

Writes are atomic: files are written into a temp directory next to the target and renamed into
place, so a crash mid-save never leaves a half-written checkpoint that later loads as garbage.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from fuseflow.data.files import BadFileError, read_json
from fuseflow.models.device import resolve_device

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
# Extra config.json key marking a fuseflow value (critic / reward) model directory.
VALUE_MODEL_KEY = "fuseflow_value_model"
# Buffers some old Llama checkpoints stored; they are recomputed here, never loaded.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """The parsed config.json of a checkpoint directory, with a clear error when it is missing."""
    file = Path(path) / CONFIG_NAME
    if not file.is_file():
        raise ValueError(f"no {CONFIG_NAME} in {path!s}; expected a Hugging Face model directory")
    config = read_json(file)
    if not isinstance(config, dict):
        raise BadFileError(f"{file} is not a model config: expected a JSON object, got {type(config).__name__}")
    return config


def read_safetensors(path: str | Path, device: torch.device | str = "cpu") -> dict[str, Tensor]:
    """All tensors of `model.safetensors`, or of every shard listed in `model.safetensors.index.json`."""
    root = Path(path)
    dev = str(device)
    if (root / WEIGHTS_NAME).is_file():
        return load_file(root / WEIGHTS_NAME, device=dev)
    if (root / INDEX_NAME).is_file():
        index = read_json(root / INDEX_NAME)
        if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
            raise BadFileError(f"{root / INDEX_NAME} has no 'weight_map' object; it does not index any shards")
        shards = sorted(set(index["weight_map"].values()))
        state: dict[str, Tensor] = {}
        for shard in shards:
            state.update(load_file(root / shard, device=dev))
        return state
    raise ValueError(
        f"no {WEIGHTS_NAME} or {INDEX_NAME} in {path!s}; only safetensors weights are loaded (never pickle .bin)"
    )


def resolve_load_target(
    device: torch.device | str | None, dtype: torch.dtype | None
) -> tuple[torch.device, torch.dtype | None]:
    """None -> cpu; "auto" -> resolve_device("auto"), whose dtype is used when dtype is None."""
    if device is None:
        return torch.device("cpu"), dtype
    if isinstance(device, str) and device.strip().lower() == "auto":
        dev, auto_dtype = resolve_device("auto")
        return dev, dtype or auto_dtype
    return torch.device(device), dtype


@torch.no_grad()
def load_state_into(
    model: nn.Module,
    state: dict[str, Tensor],
    *,
    device: torch.device,
    dtype: torch.dtype | None,
    skip: set[str] | frozenset[str] = frozenset(),
) -> None:
    """Assign `state` into a model built on the meta device (no random init, no second copy).

    Keys in `skip` (tied aliases) may be present or absent and are ignored. Any other missing,
    unexpected or mis-shaped tensor is an error naming the keys, not a silent partial load.
    """
    expected = {k: v for k, v in model.state_dict().items() if k not in skip}
    state = {k: v for k, v in state.items() if k not in skip and not k.endswith(_IGNORED_SUFFIXES)}
    missing = sorted(expected.keys() - state.keys())
    unexpected = sorted(state.keys() - expected.keys())
    if missing or unexpected:
        raise ValueError(
            f"checkpoint does not match the model config: missing {missing[:8]}"
            f"{'...' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}"
        )
    for k, v in state.items():
        if v.shape != expected[k].shape:
            raise ValueError(
                f"{k}: checkpoint shape {tuple(v.shape)} != config shape {tuple(expected[k].shape)}"
            )
    converted = {
        k: v.to(device=device, dtype=dtype if (dtype is not None and v.is_floating_point()) else v.dtype)
        for k, v in state.items()
    }
    model.load_state_dict(converted, strict=False, assign=True)


def dtype_name(dtype: torch.dtype) -> str:
    """'bfloat16' for torch.bfloat16: the spelling HF uses in config.json."""
    return str(dtype).removeprefix("torch.")


def save_checkpoint(path: str | Path, hf_config: dict[str, Any], state: dict[str, Tensor]) -> None:
    """Write config.json + model.safetensors into `path` atomically.

    A new directory appears in one rename. Into an existing directory (which may already hold
    tokenizer files) each file is renamed into place, weights before config, and stale shards
    of an earlier sharded save are removed so loaders cannot pick up old weights.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists() and not target.is_dir():
        raise ValueError(f"cannot save a checkpoint to {target!s}: it exists and is not a directory")
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
        save_file(tensors, tmp / WEIGHTS_NAME, metadata={"format": "pt"})
        with open(tmp / CONFIG_NAME, "w", encoding="utf-8") as f:
            json.dump(hf_config, f, indent=2, sort_keys=True)
            f.write("\n")
        if not target.exists():
            try:
                os.replace(tmp, target)
                return
            except OSError:  # someone created it meanwhile: fall through to per-file replace
                pass
        _drop_stale_shards(target)
        for name in (WEIGHTS_NAME, CONFIG_NAME):
            os.replace(tmp / name, target / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _drop_stale_shards(target: Path) -> None:
    index = target / INDEX_NAME
    if not index.is_file():
        return
    with open(index, encoding="utf-8") as f:
        shards = set(json.load(f).get("weight_map", {}).values())
    index.unlink()
    for shard in shards:
        if Path(shard).name == shard:  # only plain file names inside the checkpoint directory
            (target / shard).unlink(missing_ok=True)
