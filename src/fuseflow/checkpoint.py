"""Atomic, pickle-free checkpoints of a training run.

A checkpoint is a directory ``checkpoints/step_N/`` holding the models as Hugging
Face safetensors directories, each optimizer's tensors in safetensors with its
scalars in JSON, the RNG states and the trainer state (step, data cursor, KL
coefficient). It is written under a temporary name and renamed into place, so a
crash mid-write never leaves a half checkpoint; ``checkpoints/latest`` names the
newest complete one.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def save_optimizer_state(sd: dict, prefix: Path) -> None:
    """Write an optimizer ``state_dict()`` (local, or gathered from FSDP shards) without pickle.

    ``prefix.safetensors`` holds the per-parameter tensors, ``prefix.json`` the param groups and scalars.
    """
    tensors, scalars = {}, {}
    for pid, st in sd["state"].items():
        for k, v in st.items():
            if torch.is_tensor(v):
                tensors[f"{pid}.{k}"] = v.detach().cpu().contiguous()
            else:
                scalars[f"{pid}.{k}"] = v
    save_file(tensors, str(prefix.with_suffix(".safetensors")))
    prefix.with_suffix(".json").write_text(json.dumps({"param_groups": sd["param_groups"], "scalars": scalars}))


def load_optimizer_state(prefix: Path) -> dict:
    """The optimizer ``state_dict()`` that ``save_optimizer_state`` wrote at ``prefix``."""
    meta = json.loads(prefix.with_suffix(".json").read_text())
    tensors = load_file(str(prefix.with_suffix(".safetensors")))
    state: dict[int, dict] = {}
    for key, v in list(tensors.items()) + list(meta["scalars"].items()):
        pid, name = key.split(".", 1)
        state.setdefault(int(pid), {})[name] = v
    return {"state": state, "param_groups": meta["param_groups"]}


def rng_state() -> tuple[dict[str, torch.Tensor], dict]:
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda{i}"] = s
    version, internal, gauss = random.getstate()
    return tensors, {"python": [version, list(internal), gauss]}


def set_rng_state(tensors: dict[str, torch.Tensor], plain: dict) -> None:
    torch.set_rng_state(tensors["torch"])
    if torch.cuda.is_available():
        states = [tensors[k] for k in sorted(tensors) if k.startswith("cuda")]
        if states:
            torch.cuda.set_rng_state_all(states)
    version, internal, gauss = plain["python"]
    random.setstate((version, tuple(internal), gauss))


def save_checkpoint(run_dir: Path, step: int, state: dict, writers: list) -> Path:
    """Write ``checkpoints/step_{step}`` atomically and point ``checkpoints/latest`` at it.

    ``writers`` are callables ``writer(dir)`` that write their own part (a model, its optimizer,
    the tokenizer) into the checkpoint directory before it is renamed into place, so worker groups
    save from their own processes; ``state`` (step, data cursor, ...) goes to ``state.json``.
    """
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step}"
    tmp = root / f".step_{step}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    for write in writers:
        write(tmp)
    rng_tensors, rng_plain = rng_state()
    save_file(rng_tensors, str(tmp / "rng.safetensors"))
    (tmp / "state.json").write_text(json.dumps({"step": step, **state, "rng": rng_plain}))
    _fsync_tree(tmp)
    if final.exists():  # a re-run of this step after resume: replace the old one
        shutil.rmtree(final)
    os.replace(tmp, final)
    latest_tmp = root / ".latest.tmp"
    latest_tmp.write_text(final.name)
    os.replace(latest_tmp, root / "latest")
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of a run, or None."""
    root = Path(run_dir) / "checkpoints"
    pointer = root / "latest"
    if pointer.is_file() and (root / pointer.read_text().strip()).is_dir():
        return root / pointer.read_text().strip()
    steps = sorted((int(p.name[5:]), p) for p in root.glob("step_*") if p.name[5:].isdigit()) if root.is_dir() else []
    return steps[-1][1] if steps else None


def find_checkpoint(run_dir: Path, step: int | None) -> Path:
    """``checkpoints/step_{step}``, or the latest when ``step`` is None; a clear error when missing."""
    if step is None:
        ckpt = latest_checkpoint(run_dir)
        if ckpt is None:
            raise FileNotFoundError(f"{run_dir}: no checkpoints yet (checkpoints/step_N); nothing to load")
        return ckpt
    ckpt = Path(run_dir) / "checkpoints" / f"step_{step}"
    if not ckpt.is_dir():
        have = sorted(p.name for p in (Path(run_dir) / "checkpoints").glob("step_*"))
        raise FileNotFoundError(f"{run_dir}: no checkpoint for step {step}; have: {', '.join(have) or 'none'}")
    return ckpt


def read_state(ckpt: Path) -> dict:
    state = json.loads((ckpt / "state.json").read_text())
    set_rng_state(load_file(str(ckpt / "rng.safetensors")), state.pop("rng"))
    return state


def _fsync_tree(path: Path) -> None:
    for p in path.rglob("*"):
        if p.is_file():
            with p.open("rb") as f:
                os.fsync(f.fileno())
