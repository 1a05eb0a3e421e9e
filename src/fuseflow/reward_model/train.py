"""``fuseflow train-rm``: fit a Bradley-Terry reward model on preference pairs.

Bradley-Terry models ``P(chosen > rejected) = sigmoid(r(x, y_c) - r(x, y_r))``; the loss
is its negative log-likelihood ``-log sigmoid(r_c - r_r)`` averaged over pairs. The
best checkpoint by held-out pairwise accuracy is kept, and the mean/std of its scores
on training responses are saved so RL sees standardised rewards.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.nn.functional as F

from fuseflow.config import Config
from fuseflow.data.tokenizer import load_tokenizer
from fuseflow.models import CausalLM, ModelConfig, ValueModel, resolve_device
from fuseflow.sft import ensure_sft_model, lr_at, shuffled_batches
from fuseflow.tasks import DataError, make_task
from fuseflow.workers.optim import adamw, clipped_step, set_lr

from .data import load_pairs, split_pairs
from .model import RewardModel


def preference_data(cfg: Config) -> tuple[list[dict], list[dict], str]:
    """(train pairs, held-out pairs, source description) for ``cfg.rm``."""
    r = cfg.rm
    if r.data:
        pairs = load_pairs(r.data)
        if r.eval_data:
            return pairs, load_pairs(r.eval_data, "rm.eval_data"), r.data
        train, heldout = split_pairs(pairs, r.eval_frac)
        return train, heldout, r.data
    task = make_task(cfg.task)
    if not hasattr(task, "preference_pairs"):
        raise DataError(f"rm.data: no preference file given and task.name={cfg.task.name} has no synthetic "
                        "preferences; pass rm.data=FILE.jsonl (prompt, chosen, rejected) or use task.name=pref")
    n_eval = max(200, r.synthetic_pairs // 10)
    return (task.preference_pairs(r.synthetic_pairs, held_out=False, seed=cfg.seed),
            task.preference_pairs(n_eval, held_out=True, seed=cfg.seed), f"synthetic task {cfg.task.name}")


def new_reward_model(cfg: Config, tokenizer, device=None, dtype=None, progress=None, log=print) -> ValueModel:
    """The backbone named by ``rm.init`` ("sft", "random" or a causal-LM directory) with a zero scalar head."""
    init = cfg.rm.init
    if init == "random":
        # +1 position: the reward model reads prompt + response + eos.
        mcfg = ModelConfig.preset(cfg.model.size, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                                  max_position_embeddings=cfg.model.max_prompt_len + cfg.model.max_response_len + 1)
        return ValueModel.from_config(mcfg, seed=cfg.seed)
    if init == "sft":
        path, _ = ensure_sft_model(cfg, make_task(cfg.task), tokenizer, device, dtype, progress, log)
    else:
        path = Path(init).expanduser()
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"rm.init: {init} is not a model directory; use sft, random or a directory "
                                    "with config.json and model.safetensors")
    return ValueModel.from_causal_lm(CausalLM.from_pretrained(path))


def check_lengths(tokenizer, pairs: list[dict], limit: int, source: str) -> None:
    """A pair whose prompt + response + eos exceeds ``limit`` tokens is a DataError naming it."""
    for i, pair in enumerate(pairs, 1):
        n_prompt = len(tokenizer(pair["prompt"], add_special_tokens=False)["input_ids"])
        for side in ("chosen", "rejected"):
            n = n_prompt + len(tokenizer(pair[side], add_special_tokens=False)["input_ids"]) + 1
            if n > limit:
                raise DataError(f"{source}: pair {i} ({side}) has {n} tokens with eos, more than model.max_prompt_len "
                                f"+ model.max_response_len + 1 = {limit}; raise those limits or shorten it")


def _pair_scores(rm: RewardModel, pairs: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    prompts = [p["prompt"] for p in pairs]
    return rm.raw(prompts, [p["chosen"] for p in pairs]), rm.raw(prompts, [p["rejected"] for p in pairs])


@torch.no_grad()
def pairwise_accuracy(rm: RewardModel, pairs: list[dict], chunk: int = 256) -> float:
    """Share of pairs the model ranks the right way round (a tie counts one half)."""
    rm.model.eval()
    right = 0.0
    for i in range(0, len(pairs), chunk):
        rc, rr = _pair_scores(rm, pairs[i : i + chunk])
        right += float((rc > rr).sum()) + 0.5 * float((rc == rr).sum())
    return right / max(len(pairs), 1)


def train_reward_model(cfg: Config, out_dir: Path, progress=None, log=print) -> dict:
    """Train on ``cfg.rm``'s pairs, save the best model to ``out_dir``; returns its report (also saved)."""
    r = cfg.rm
    device, dtype = resolve_device(cfg.device)
    tokenizer = load_tokenizer(cfg.model.tokenizer)
    train, heldout, source = preference_data(cfg)
    limit = cfg.model.max_prompt_len + cfg.model.max_response_len + 1
    check_lengths(tokenizer, train, limit, source)
    check_lengths(tokenizer, heldout, limit, cfg.rm.eval_data or source)
    log(f"train-rm: {len(train)} training and {len(heldout)} held-out pairs from {source}")
    model = new_reward_model(cfg, tokenizer, device, dtype, progress, log)
    rm = RewardModel(model.to(device), tokenizer, device, dtype)
    opt = adamw(rm.model.parameters(), r.lr)
    draws = shuffled_batches(len(train), r.batch_size, cfg.seed)
    curve, best, best_state = [], -1.0, None
    bar = progress.add_task("train-rm", total=r.steps) if progress else None
    t0 = time.perf_counter()
    for step in range(1, r.steps + 1):
        batch = [train[i] for i in next(draws)]
        rm.model.train()
        set_lr(opt, lr_at(step - 1, r.steps, r.lr, r.warmup_steps, 0.1))
        rc, rr = _pair_scores(rm, batch)
        loss = -F.logsigmoid(rc - rr).mean()
        loss.backward()
        clipped_step(rm.model, opt, 1.0, "reward model")
        if step % r.eval_every == 0 or step == r.steps:
            acc = pairwise_accuracy(rm, heldout)
            curve.append({"step": step, "loss": float(loss.detach()), "heldout_accuracy": acc,
                          "seconds": time.perf_counter() - t0})
            if acc > best:
                best, best_state = acc, {k: v.detach().clone() for k, v in rm.model.state_dict().items()}
            if progress:
                progress.update(bar, completed=step,
                                description=f"train-rm loss {float(loss.detach()):.3f} held-out acc {acc:.3f}")
        elif progress:
            progress.update(bar, completed=step)
    rm.model.load_state_dict(best_state)
    meta = {"heldout_accuracy": best, "train_accuracy": pairwise_accuracy(rm, train[:2000]),
            "train_pairs": len(train), "heldout_pairs": len(heldout), "source": source, "steps": r.steps,
            "format": "prompt + response + eos, score at the eos", "curve": curve}
    with torch.no_grad():
        sample = train[:1000]
        raw = torch.cat(_pair_scores(rm, sample)).float()
    meta |= {"score_mean": float(raw.mean()), "score_std": float(raw.std().clamp(min=1e-6))}
    rm.save(out_dir, meta)
    return meta
