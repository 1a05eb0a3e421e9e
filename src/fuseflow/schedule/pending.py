"""A prefetched step's samples, kept in a checkpoint so that an async run resumes exactly.

In the async modes a checkpoint taken after step k finds step k+1 already generated, by the
policy before step k's update. A resume that generated step k+1 again would decode with the
newer weights and draw other tokens, so the resumed run would part from the uninterrupted one.
The checkpoint therefore holds those samples: token ids and behaviour log-probs as safetensors
(flat tensors cut by per-sample lengths), the scalars as JSON, no pickle.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from fuseflow.rollout.base import Sample

NAME = "prefetch"  # checkpoint files: prefetch.safetensors + prefetch.json


def save_pending(ckpt_dir: Path, step: int, samples: list[Sample]) -> None:
    """Write ``samples`` (the generation for ``step``) into ``ckpt_dir``."""
    tensors = {"prompt_ids": torch.tensor([t for x in samples for t in x.prompt_ids], dtype=torch.long),
               "response_ids": torch.tensor([t for x in samples for t in x.response_ids], dtype=torch.long),
               "logprobs": torch.tensor([p for x in samples for p in x.logprobs], dtype=torch.float32)}
    save_file(tensors, str(Path(ckpt_dir) / f"{NAME}.safetensors"))
    meta = {"step": step, "uid": [x.uid for x in samples], "group_id": [x.group_id for x in samples],
            "prompt_len": [len(x.prompt_ids) for x in samples], "response_len": [len(x.response_ids) for x in samples],
            "finish_reason": [x.finish_reason for x in samples], "policy_version": [x.policy_version for x in samples]}
    (Path(ckpt_dir) / f"{NAME}.json").write_text(json.dumps(meta))


def load_pending(ckpt_dir: Path) -> tuple[int, list[Sample]] | None:
    """``(step, samples)`` saved by ``save_pending`` in ``ckpt_dir``, or None when it holds none."""
    path = Path(ckpt_dir) / f"{NAME}.json"
    if not path.is_file():
        return None
    meta = json.loads(path.read_text())
    t = load_file(str(Path(ckpt_dir) / f"{NAME}.safetensors"))
    # logprobs are float32 on the wire: exactly what the engine computed (it samples in fp32).
    prompts = torch.split(t["prompt_ids"], meta["prompt_len"])
    responses = torch.split(t["response_ids"], meta["response_len"])
    logprobs = torch.split(t["logprobs"], meta["response_len"])
    samples = [Sample(uid, gid, p.tolist(), r.tolist(), lp.tolist(), reason, version)
               for uid, gid, p, r, lp, reason, version in zip(
                   meta["uid"], meta["group_id"], prompts, responses, logprobs, meta["finish_reason"],
                   meta["policy_version"], strict=True)]
    return meta["step"], samples
