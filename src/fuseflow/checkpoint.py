"""Atomic, pickle-free checkpoints of a training run.

A checkpoint is a directory ``checkpoints/step_N/`` holding the models as Hugging
Face safetensors directories, each optimizer's tensors in safetensors with its
scalars in JSON, the RNG states and the trainer state (step, data cursor, KL
coefficient). It is written under a temporary name and renamed into place, so a
crash mid-write never leaves a half checkpoint; ``checkpoints/latest`` names the
newest complete one. A write that fails (a full disk) removes its own temporary
directory and raises ``CheckpointWriteError``; the previous checkpoint stays latest.
``prune_checkpoints`` applies ``trainer.keep_checkpoints`` once a new one is complete.
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from fuseflow.data.files import read_json


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
    meta = read_json(prefix.with_suffix(".json"))
    tensors = load_file(str(prefix.with_suffix(".safetensors")))
    state: dict[int, dict] = {}
    for key, v in list(tensors.items()) + list(meta["scalars"].items()):
        pid, name = key.split(".", 1)
        state.setdefault(int(pid), {})[name] = v
    return {"state": state, "param_groups": meta["param_groups"]}


def rng_state() -> tuple[dict[str, torch.Tensor], dict]:
    """This process's random state for a checkpoint: torch's CPU and every CUDA device's generator as tensors
    (for safetensors), Python's ``random`` as plain JSON."""
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda{i}"] = s
    version, internal, gauss = random.getstate()
    return tensors, {"python": [version, list(internal), gauss]}


def cuda_states(tensors: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """The ``cuda{i}`` generator states of ``rng_state``'s tensors in device order (``cuda10`` after ``cuda9``,
    not after ``cuda1`` as sorting the keys as text would put it)."""
    return [tensors[k] for k in sorted((k for k in tensors if k.startswith("cuda")), key=lambda k: int(k[4:]))]


def set_rng_state(tensors: dict[str, torch.Tensor], plain: dict) -> None:
    """Restore what ``rng_state`` returned, so a resumed run draws the numbers the uninterrupted one would."""
    torch.set_rng_state(tensors["torch"])
    if torch.cuda.is_available():
        states = cuda_states(tensors)
        if states:
            torch.cuda.set_rng_state_all(states)
    version, internal, gauss = plain["python"]
    random.setstate((version, tuple(internal), gauss))


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (e.g. the disk is full); the previous one is intact."""


def save_checkpoint(run_dir: Path, step: int, state: dict, writers: list) -> Path:
    """Write ``checkpoints/step_{step}`` atomically and point ``checkpoints/latest`` at it.

    ``writers`` are callables ``writer(dir)`` that write their own part (a model, its optimizer,
    the tokenizer) into the checkpoint directory before it is renamed into place, so worker groups
    save from their own processes; ``state`` (step, data cursor, ...) goes to ``state.json``.
    A full disk (``ENOSPC``/``EDQUOT``, raised here or reported by a worker) removes the partial
    directory and raises ``CheckpointWriteError`` naming the checkpoint that is still intact.
    """
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step}"
    tmp = root / f".step_{step}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        tmp.mkdir()
        for write in writers:
            write(tmp)
        rng_tensors, rng_plain = rng_state()
        save_file(rng_tensors, str(tmp / "rng.safetensors"))
        (tmp / "state.json").write_text(json.dumps({"step": step, **state, "rng": rng_plain}))
        _fsync_tree(tmp)
    except Exception as e:
        shutil.rmtree(tmp, ignore_errors=True)  # frees the space the partial write took
        if _disk_full(e):
            prev = latest_checkpoint(run_dir)
            kept = f"checkpoint {prev.name} is intact" if prev else "no earlier checkpoint exists"
            raise CheckpointWriteError(
                f"checkpoint step_{step} could not be written: no space left on the device holding "
                f"{root}; {kept}. Free space (or lower trainer.keep_checkpoints) and resume with: "
                f"fuseflow train --resume {run_dir}") from None
        raise
    if final.exists():  # a re-run of this step after resume: replace the old one
        shutil.rmtree(final)
    os.replace(tmp, final)
    latest_tmp = root / ".latest.tmp"
    latest_tmp.write_text(final.name)
    os.replace(latest_tmp, root / "latest")
    return final


def _disk_full(e: BaseException) -> bool:
    # Locally an OSError carries errno; from a Ray worker it arrives as a WorkerFailure whose text holds it.
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return "No space left on device" in str(e) or "[Errno 28]" in str(e)


def checkpoint_steps(run_dir: Path) -> list[int]:
    """Steps of the complete checkpoints of a run, ascending (temporary directories are not counted)."""
    root = Path(run_dir) / "checkpoints"
    return sorted(int(p.name[5:]) for p in root.glob("step_*") if p.name[5:].isdigit()) if root.is_dir() else []


def checkpoints_to_keep(steps: list[int], keep: int | None, evals: list[dict]) -> set[int]:
    """``trainer.keep_checkpoints``: the last ``keep`` steps plus the best by held-out accuracy.

    ``keep=None`` keeps all. The best is the checkpointed step with the highest held-out
    ``accuracy`` in ``evals`` (the later one on a tie); a task without accuracy keeps only the last.

    >>> sorted(checkpoints_to_keep([10, 20, 30, 40], 2, [{"step": 20, "accuracy": 0.9}, {"step": 40, "accuracy": 0.5}]))
    [20, 30, 40]
    """
    if keep is None:
        return set(steps)
    kept = set(steps[-keep:]) if keep else set()
    scored = [(e["accuracy"], e["step"]) for e in evals if e.get("step") in steps and e.get("accuracy") is not None]
    if scored:
        kept.add(max(scored)[1])
    return kept


def prune_checkpoints(run_dir: Path, keep: int | None, evals: list[dict]) -> list[int]:
    """Delete the checkpoints ``checkpoints_to_keep`` leaves out; returns their steps.

    Called only after a new checkpoint is complete, and never deletes the one ``latest`` names.
    Each is first renamed to a temporary name, so a crash mid-delete leaves nothing that looks
    like a complete checkpoint.
    """
    steps = checkpoint_steps(run_dir)
    latest = latest_checkpoint(run_dir)
    kept = checkpoints_to_keep(steps, keep, evals) | ({int(latest.name[5:])} if latest else set())
    root = Path(run_dir) / "checkpoints"
    dropped = [s for s in steps if s not in kept]
    for s in dropped:
        trash = root / f".step_{s}.deleting"
        os.replace(root / f"step_{s}", trash)
        shutil.rmtree(trash, ignore_errors=True)
    return dropped


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
    """The trainer state saved in ``ckpt`` (``state.json``), with the random state restored from it as a side effect."""
    state = read_json(ckpt / "state.json")
    set_rng_state(load_file(str(ckpt / "rng.safetensors")), state.pop("rng"))
    return state


def _fsync_tree(path: Path) -> None:
    for p in path.rglob("*"):
        if p.is_file():
            with p.open("rb") as f:
                os.fsync(f.fileno())


def copy_model_dir(src: Path, dst: Path, cache_dir: str | Path) -> None:
    """Copy a model directory into a run (its ``reference/``), hard-linking files that come from fuseflow's cache.

    The cache (``cache_dir``: SFT models, converted GGUF files) is written only through temporary names and
    renames, so a file there never changes in place and a link to it is as safe as a copy, without 540 MB of
    SmolLM2 per run. A user's own model directory is copied: saving into it again (``save_file`` truncates the
    same inode) must not change the reference of a run that already started. A link that fails (another
    file system, a file system without links) falls back to a copy.
    """
    cache = Path(cache_dir).expanduser().resolve()
    in_cache = Path(src).resolve().is_relative_to(cache)

    def link_or_copy(s: str, d: str) -> None:
        try:
            os.link(s, d)
        except OSError:
            shutil.copy2(s, d)

    shutil.copytree(src, dst, dirs_exist_ok=True, copy_function=link_or_copy if in_cache else shutil.copy2)
