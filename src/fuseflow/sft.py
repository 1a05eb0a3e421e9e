"""SFT warm start: train the policy on task demonstrations before RL.

RL needs a policy that sometimes succeeds. ``ensure_sft_model`` trains one from the
task's demonstrations, stopping when held-out accuracy stops improving (so the
baseline RL is compared with is not under-trained), and caches the result under a
hash of everything that determines it, so a second run reuses it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
from pathlib import Path

import torch
from filelock import FileLock, Timeout

from fuseflow.config import Config
from fuseflow.data.batch import Batch, prompt_response
from fuseflow.data.files import read_json
from fuseflow.data.tokenizer import stop_token_ids
from fuseflow.evaluate import encode_prompts, evaluate
from fuseflow.models import CausalLM, ModelConfig
from fuseflow.models.source import model_dir
from fuseflow.tasks import Task
from fuseflow.tasks.user import function_file
from fuseflow.workers.common import autocast, response_logprobs
from fuseflow.workers.optim import adamw, clipped_step, set_lr

SFT_VERSION = 1  # bump when the SFT recipe changes, to invalidate cached models


def shuffled_batches(n: int, size: int, seed: int):
    """Endless batches of indices into ``n`` items: a fresh seeded shuffle per pass, whose tail
    shorter than ``size`` is skipped, so every batch is full. Shared by SFT and reward-model training."""
    g = torch.Generator().manual_seed(seed)
    order, pos = torch.randperm(n, generator=g), 0
    while True:
        if pos + size > len(order):
            order, pos = torch.randperm(n, generator=g), 0
        yield order[pos : pos + size].tolist()
        pos += size


def lr_at(step: int, total: int, base: float, warmup: int, min_ratio: float) -> float:
    """Linear warmup then cosine decay to ``min_ratio * base`` at ``total``."""
    if step < warmup:
        return base * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return base * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def sft_cache_dir(cfg: Config) -> Path:
    """Cache directory of the SFT model for ``cfg``: keyed by the config sections that shape it and by
    the files they name (``inputs_digest``), so an edited data file trains a new model instead of reusing
    the old one. ``reward.model`` is left out: SFT never reads the reward model."""
    inputs = sft_inputs(cfg)  # none for the built-in tasks, whose keys (and caches) stay as they were
    files = f"-{inputs_digest(inputs)}" if inputs else ""
    key = cfg.digest("task", "model", "sft") + f"{files}-s{cfg.seed}-v{SFT_VERSION}"
    return Path(cfg.cache_dir).expanduser() / "sft" / key


def sft_inputs(cfg: Config) -> list[Path]:
    """Files and directories the SFT model is trained from: data, reward code (which picks the best
    model by held-out accuracy), tokenizer and starting model. A reward given as ``package.module``
    is not covered: its code is the installed package's."""
    t, m = cfg.task, cfg.model
    paths = [t.path, t.eval_path, function_file(t.reward_fn) if t.reward_fn else None, m.tokenizer, m.path]
    return [Path(p).expanduser() for p in paths if p]


# Content, not mtime, for files up to 64 MiB (data, code, tokenizers): a re-checkout or `touch` still hits
# the cache and any edit misses it. Bigger ones (model weights) go by size and mtime, so none is read each run.
HASH_LIMIT = 64 << 20


def inputs_digest(paths: list[Path]) -> str:
    """Stable hash of the files under ``paths`` (each a file or a directory; a missing one counts as such)."""
    h = hashlib.sha256()
    for root in paths:
        files = sorted(f for f in root.rglob("*") if f.is_file()) if root.is_dir() else [root]
        h.update(f"{root}\0".encode())
        for f in files:
            if not f.is_file():
                h.update(b"missing\0")
                continue
            st = f.stat()
            if st.st_size > HASH_LIMIT:
                part = f"{st.st_size}:{st.st_mtime_ns}"
            else:
                part = hashlib.sha256(f.read_bytes()).hexdigest()
            h.update(f"{f.relative_to(root) if f != root else ''}:{part}\0".encode())
    return h.hexdigest()[:16]


def demo_batch(tokenizer, pairs, max_prompt_len: int, max_response_len: int) -> Batch:
    """A training batch of (prompt, response) pairs: prompts left-padded to the batch's longest (one over
    ``max_prompt_len`` tokens raises ValueError), each response cut to ``max_response_len - 1`` tokens plus the stop
    token (end-of-turn, or eos without a chat template) and right-padded; the loss on response tokens only
    (``response_mask``)."""
    prompt_ids = encode_prompts(tokenizer, [p for p, _ in pairs], max_prompt_len)
    resp_ids = tokenizer([r for _, r in pairs], add_special_tokens=False)["input_ids"]
    end = stop_token_ids(tokenizer)[0]  # a chat model ends its turn with the template's end-of-turn token
    resp_ids = [r[: max_response_len - 1] + [end] for r in resp_ids]
    ids, mask, r_mask = prompt_response(prompt_ids, resp_ids, tokenizer.pad_token_id)
    return Batch({"input_ids": ids, "attention_mask": mask, "response_mask": r_mask.float()})


def new_model(cfg: Config, tokenizer) -> CausalLM:
    """The model SFT starts from: the pretrained ``model.path`` when set, otherwise a fresh ``model.size`` model
    sized to the tokenizer and seeded by ``cfg.seed``."""
    if cfg.model.path:
        return CausalLM.from_pretrained(model_dir(cfg))
    mcfg = ModelConfig.preset(cfg.model.size, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                              eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                              max_position_embeddings=cfg.model.max_prompt_len + cfg.model.max_response_len)
    return CausalLM.from_config(mcfg, seed=cfg.seed)


def train_sft(cfg: Config, task: Task, tokenizer, device, dtype, progress=None) -> tuple[CausalLM, list[dict]]:
    """Train on demonstrations with early stopping on held-out greedy accuracy; returns the best model.

    A task without a reward function has no held-out accuracy to stop on: it trains all
    ``sft.max_steps`` and keeps the last model (its curve records the loss only).
    """
    demos = task.demonstrations()
    if not demos:
        raise ValueError(f"task {task.name!r} has no demonstrations for SFT; add a 'response' column to the data, "
                         "or start from a trained model with model.path=DIR and sft.enabled=false")
    s = cfg.sft
    model = new_model(cfg, tokenizer).to(device)
    opt = adamw(model.parameters(), s.lr)
    draws = shuffled_batches(len(demos), s.batch_size, cfg.seed)
    eval_prompts = task.eval_prompts()[: s.eval_size]
    curve, best, best_state, since_best = [], -1.0, None, 0
    task_id = progress.add_task("SFT", total=s.max_steps) if progress else None
    t0 = time.perf_counter()
    for step in range(1, s.max_steps + 1):
        pairs = [demos[i] for i in next(draws)]
        batch = demo_batch(tokenizer, pairs, cfg.model.max_prompt_len, cfg.model.max_response_len).to(device)
        set_lr(opt, lr_at(step - 1, s.max_steps, s.lr, s.warmup_steps, 0.1))
        model.train()
        with autocast(device, dtype):
            logp = response_logprobs(model, batch, 1.0)
        mask = batch["response_mask"]
        loss = -(logp * mask).sum() / mask.sum()
        loss.backward()
        clipped_step(model, opt, 1.0, "sft")
        if step % s.eval_every == 0 or step == s.max_steps:
            row = {"step": step, "loss": float(loss.detach())}
            if task.has_reward:  # without one there is nothing to select on: the last model is kept
                ev = evaluate(model, tokenizer, task, eval_prompts, cfg.model.max_prompt_len,
                              cfg.model.max_response_len)
                row |= {"accuracy": ev["accuracy"], "reward": ev["reward"]}
                if ev["accuracy"] > best:
                    best, since_best = ev["accuracy"], 0
                    best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
                else:
                    since_best += 1
            curve.append(row | {"seconds": time.perf_counter() - t0})
            if progress:
                acc = f" held-out acc {row['accuracy']:.3f}" if "accuracy" in row else ""
                progress.update(task_id, completed=step, description=f"SFT loss {row['loss']:.3f}{acc}")
            if since_best >= s.patience:
                break
        elif progress:
            progress.update(task_id, completed=step)
    if progress:
        progress.update(task_id, completed=s.max_steps, visible=False)
    if best_state is not None:
        model.load_state_dict(best_state)
    return model, curve


def ensure_sft_model(cfg: Config, task: Task, tokenizer, device, dtype, progress=None, log=print) -> tuple[Path, list]:
    """Directory of the SFT model for this config: from the cache, or trained now and cached.

    Returns (model_dir, sft_curve). The directory also holds the tokenizer.
    """
    cache = sft_cache_dir(cfg)
    if (cache / "sft_curve.json").is_file():
        log(f"SFT: reusing cached model {cache}")
        return cache, read_json(cache / "sft_curve.json")
    cache.parent.mkdir(parents=True, exist_ok=True)
    # Runs that share a cache (two `fuseflow train` at once, parallel test workers) train each model
    # once: the first takes the lock and trains, the others wait for it and reuse its model.
    lock = FileLock(str(cache) + ".lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log(f"SFT: another process is training this warm-start model ({cache}); waiting for it")
        lock.acquire()
    try:
        if (cache / "sft_curve.json").is_file():
            log(f"SFT: reusing cached model {cache}")
            return cache, read_json(cache / "sft_curve.json")
        return _train_and_cache(cfg, task, tokenizer, device, dtype, progress, log, cache)
    finally:
        lock.release()


def _train_and_cache(cfg: Config, task: Task, tokenizer, device, dtype, progress, log, cache: Path
                     ) -> tuple[Path, list]:
    """Train the SFT model and move it into ``cache`` in one rename (a crash leaves no half-written model)."""
    log("SFT: training the warm-start model on task demonstrations (cached for later runs)")
    model, curve = train_sft(cfg, task, tokenizer, device, dtype, progress)
    tmp = cache.with_name(cache.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(str(tmp))
    (tmp / "sft_curve.json").write_text(json.dumps(curve))
    shutil.rmtree(cache, ignore_errors=True)
    os.replace(tmp, cache)
    return cache, curve
