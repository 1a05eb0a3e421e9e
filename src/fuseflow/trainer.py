"""The RL controller program (GRPO and PPO), run in-process with the ``local`` layout.

``RLTrainer.step`` is the whole algorithm on one screen: generate, score, infer,
advantages, train, sync weights, each phase timed as a span in ``trace.json``.
Everything else here is set-up, checkpointing and bookkeeping around it.
"""

from __future__ import annotations

import json
import shutil
import time
import warnings
from pathlib import Path

import torch

from fuseflow.algorithms import gae, grpo, kl_penalty, masked_mean, masked_whiten
from fuseflow.checkpoint import latest_checkpoint, load_optimizer, read_state, save_checkpoint
from fuseflow.config import Config
from fuseflow.data.batch import Batch
from fuseflow.data.tokenizer import load_tokenizer
from fuseflow.evaluate import decode_response, encode_prompts, evaluate
from fuseflow.models import CausalLM, ValueModel, resolve_device
from fuseflow.rollout.base import SamplingParams
from fuseflow.rollout.sampler import Sampler, make_requests
from fuseflow.sft import ensure_sft_model, lr_at
from fuseflow.tasks import Task, make_task
from fuseflow.telemetry import MetricsLogger, Tracer
from fuseflow.workers.actor import ActorWorker, ReferenceWorker
from fuseflow.workers.common import samples_to_batch
from fuseflow.workers.critic import CriticWorker
from fuseflow.workers.reward import RewardWorker


class PromptStream:
    """Training prompts in a fresh seeded order each epoch; ``cursor`` (prompts consumed) is its whole state."""

    def __init__(self, n: int, seed: int, cursor: int = 0):
        self.n, self.seed, self.cursor = n, seed, cursor

    def take(self, k: int) -> list[int]:
        out = []
        for _ in range(k):
            epoch, i = divmod(self.cursor, self.n)
            perm = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + epoch))
            out.append(int(perm[i]))
            self.cursor += 1
        return out


class RLTrainer:
    """Owns the workers of one run and drives them step by step."""

    def __init__(self, cfg: Config, run_dir: Path, resume: bool = False, log=print, progress=None):
        self.cfg, self.run_dir, self.log, self.progress = cfg, Path(run_dir), log, progress
        self.device, self.dtype = resolve_device(cfg.device)
        self.task: Task = make_task(cfg.task)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.tokenizer = load_tokenizer(cfg.model.tokenizer)
        self.train_prompts = self.task.train_prompts()
        self.train_ids = encode_prompts(self.tokenizer, self.train_prompts, cfg.model.max_prompt_len)
        self.eval_prompts = self.task.eval_prompts()[: cfg.trainer.eval_size]
        self._setup_models(resume)
        self.tracer = Tracer(self.run_dir / "trace.json")
        self.metrics = MetricsLogger(self.run_dir, resume_step=self.start_step if resume else None)
        if resume:
            self.tracer.drop_after(self.start_step)

    # ----------------------------------------------------------------- set-up
    def _setup_models(self, resume: bool) -> None:
        cfg, ref_dir = self.cfg, self.run_dir / "reference"
        if not ref_dir.is_dir():
            if cfg.sft.enabled:
                sft_dir, curve = ensure_sft_model(cfg, self.task, self.tokenizer, self.device, self.dtype,
                                                  self.progress, self.log)
            elif cfg.model.path:
                sft_dir, curve = Path(cfg.model.path), []
            else:
                raise ValueError("sft.enabled=false needs model.path=DIR (a trained model to start RL from)")
            shutil.copytree(sft_dir, ref_dir.with_suffix(".tmp"), dirs_exist_ok=True)
            (ref_dir.with_suffix(".tmp") / "sft_curve.json").write_text(json.dumps(curve))
            ref_dir.with_suffix(".tmp").rename(ref_dir)
        self.sft_curve = json.loads((ref_dir / "sft_curve.json").read_text())
        ckpt = latest_checkpoint(self.run_dir) if resume else None
        actor_dir = ckpt / "actor" if ckpt else ref_dir
        actor = CausalLM.from_pretrained(actor_dir).to(self.device)
        reference = CausalLM.from_pretrained(ref_dir).to(self.device)
        t, a = cfg.trainer, cfg.algorithm
        norm_len = cfg.model.max_response_len
        self.actor = ActorWorker(actor, Sampler(actor, self.tokenizer.pad_token_id), self.device, self.dtype, a, t,
                                 cfg.rollout.temperature, norm_len)
        self.reference = ReferenceWorker(reference, self.device, self.dtype, cfg.rollout.temperature,
                                         t.micro_batch_size)
        self.reward = RewardWorker(self.task)
        self.critic = None
        if a.name == "ppo":
            critic = (ValueModel.from_pretrained(ckpt / "critic") if ckpt
                      else ValueModel.from_causal_lm(CausalLM.from_pretrained(ref_dir)))
            self.critic = CriticWorker(critic.to(self.device), self.device, self.dtype, a, t, norm_len)
        self.start_step, self.stream = 0, PromptStream(len(self.train_prompts), cfg.seed)
        self.evals: list[dict] = []
        if ckpt:
            state = read_state(ckpt)
            self.start_step, self.stream.cursor, self.evals = state["step"], state["cursor"], state["evals"]
            load_optimizer(self.actor.optimizer, ckpt / "optim_actor")
            if self.critic:
                load_optimizer(self.critic.optimizer, ckpt / "optim_critic")
            self.log(f"Resumed from {ckpt} (step {self.start_step})")

    # ------------------------------------------------------------ the RL step
    def step(self, step: int) -> dict[str, float]:
        """One RL iteration: generate, score, infer, advantages, train, sync weights."""
        cfg, span = self.cfg, self.tracer.span
        t0 = time.perf_counter()
        idx = self.stream.take(cfg.trainer.prompts_per_step)
        prompts = [self.train_prompts[i] for i in idx for _ in range(cfg.algorithm.group_size)]
        with span("generate", step):
            requests = make_requests([self.train_ids[i] for i in idx], self.sampling, cfg.algorithm.group_size,
                                     seed=cfg.seed * 100_003 + step)
            samples = self.actor.generate(requests)
            texts = [decode_response(self.tokenizer, s.response_ids) for s in samples]
            batch = samples_to_batch(samples, self.tokenizer.pad_token_id, [p.text for p in prompts], texts)
        with span("reward", step):
            batch["scores"], correct = self.reward.score(batch, prompts)
        with span("old_logprob", step):
            batch["old_logprobs"] = self.actor.compute_logprobs(batch)
        with span("reference", step):
            batch["ref_logprobs"] = self.reference.compute_logprobs(batch)
        if self.critic:
            with span("values", step):
                batch["values"] = self.critic.compute_values(batch)
        with span("advantages", step):
            self.compute_advantages(batch)
        metrics = self.rollout_metrics(batch, correct)
        lr = lambda base: lr_at(step - 1, cfg.trainer.steps, base, cfg.trainer.warmup_steps,  # noqa: E731
                                cfg.trainer.min_lr_ratio)
        if torch.isnan(batch["scores"]).any():
            warnings.warn(f"step {step}: the reward function returned NaN for "
                          f"{int(torch.isnan(batch['scores']).sum())} samples; skipping this update", stacklevel=2)
            metrics["train/skipped_update"] = 1.0
        else:
            if self.critic:
                with span("critic_update", step):
                    metrics |= self.critic.update(batch, lr(cfg.trainer.critic_lr), seed=cfg.seed + 7 * step)
            with span("actor_update", step):
                metrics |= self.actor.update(batch, lr(cfg.trainer.lr), cfg.algorithm.kl_coef, seed=cfg.seed + step)
            metrics["train/skipped_update"] = 0.0
        with span("weight_sync", step):
            self.actor.rollout.update_weights(step)  # in-process: shared weights, the version moves on
        seconds = time.perf_counter() - t0
        n_tokens = float(batch["response_mask"].sum())
        metrics |= {f"time/{name}": sec for name, sec in self.tracer.seconds_for(step).items()}
        metrics |= {"time/step_seconds": seconds, "perf/samples_per_second": len(batch) / seconds,
                    "perf/tokens_per_second": n_tokens / seconds, "train/lr": lr(cfg.trainer.lr)}
        return metrics

    @property
    def sampling(self) -> SamplingParams:
        r = self.cfg.rollout
        return SamplingParams(r.temperature, r.top_p, r.top_k, False, self.cfg.model.max_response_len,
                              (self.tokenizer.eos_token_id,))

    def compute_advantages(self, batch: Batch) -> None:
        """GRPO: group-relative score, one per sequence. PPO: GAE on token rewards, whitened."""
        a, mask = self.cfg.algorithm, batch["response_mask"]
        scores = torch.nan_to_num(batch["scores"], nan=0.0)
        if a.name == "grpo":
            adv = grpo(scores, torch.tensor(batch.meta["group_id"]), norm_by_std=a.norm_by_std)
            batch["advantages"] = adv.unsqueeze(-1) * mask
            return
        last = (mask.cumsum(-1) == mask.sum(-1, keepdim=True)) & mask.bool()  # (B, Tr) the final token
        token_rewards = scores.unsqueeze(-1) * last
        if a.kl_in_reward and a.kl_coef > 0:
            token_rewards = token_rewards - a.kl_coef * kl_penalty(batch["old_logprobs"], batch["ref_logprobs"],
                                                                   "k1") * mask
        adv, returns = gae(token_rewards, batch["values"], mask, a.gamma, a.lam)
        batch["advantages"], batch["returns"] = masked_whiten(adv, mask) * mask, returns

    def rollout_metrics(self, batch: Batch, correct: torch.Tensor) -> dict[str, float]:
        mask = batch["response_mask"]
        lengths = mask.sum(-1)
        kl = kl_penalty(batch["old_logprobs"], batch["ref_logprobs"], "k3")
        diff = ((batch["behavior_logprobs"] - batch["old_logprobs"]).abs() * mask).max()
        return {"reward/mean": float(torch.nan_to_num(batch["scores"]).mean()), "reward/accuracy": float(correct.mean()),
                "rollout/response_length_mean": float(lengths.mean()),
                "rollout/response_length_max": float(lengths.max()),
                "rollout/response_length_min": float(lengths.min()),
                "rollout/prompt_length_mean": float(batch["attention_mask"].sum(-1).float().mean() - lengths.mean()),
                "rollout/num_samples": float(len(batch)), "rollout/logprob_diff_max": float(diff),
                "rollout/stop_frac": sum(r == "stop" for r in batch.meta["finish_reason"]) / len(batch),
                "kl/ref_k3": float(masked_mean(kl, mask))}

    # ------------------------------------------------------------ bookkeeping
    def evaluate(self, step: int) -> dict[str, float]:
        with self.tracer.span("evaluate", step):
            ev = evaluate(self.actor.model, self.tokenizer, self.task, self.eval_prompts, self.cfg.model.max_prompt_len,
                          self.cfg.model.max_response_len)
        self.evals = [e for e in self.evals if e["step"] != step] + [{"step": step, **ev}]
        return ev

    def save(self, step: int) -> Path:
        models = {"actor": self.actor.model} | ({"critic": self.critic.model} if self.critic else {})
        opts = {"actor": self.actor.optimizer} | ({"critic": self.critic.optimizer} if self.critic else {})
        path = save_checkpoint(self.run_dir, step, models, opts, {"cursor": self.stream.cursor, "evals": self.evals},
                               tokenizer=self.tokenizer)
        self.tracer.save()
        return path

    def close(self) -> None:
        self.tracer.save()
        self.metrics.close()

