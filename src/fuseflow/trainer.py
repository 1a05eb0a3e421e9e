"""The RL controller program, run in-process with the ``local`` layout.

``RLTrainer.step`` is the whole algorithm on one screen: generate, score, infer,
advantages, train, sync weights, each phase timed as a span in ``trace.json``. The
eight algorithms (``algorithm.name``) share it: each is a ``Recipe`` (see
``fuseflow.recipes``) naming its registered estimator and the roles it needs.
Everything else here is set-up, checkpointing and bookkeeping around it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import time
import warnings
from pathlib import Path

import torch

from fuseflow.algorithms import kl_penalty, masked_mean
from fuseflow.checkpoint import latest_checkpoint, load_optimizer, read_state, save_checkpoint
from fuseflow.config import Config
from fuseflow.data.batch import Batch, unpad
from fuseflow.data.tokenizer import load_tokenizer
from fuseflow.evaluate import decode_response, encode_prompts, evaluate
from fuseflow.heldout import cost_rate, greedy_responses, preference_eval, sampled_responses
from fuseflow.models import CausalLM, ValueModel, resolve_device
from fuseflow.recipes import (
    LagrangeMultiplier,
    compute_advantages,
    informative_groups,
    kl_controller,
    observed_kl,
    overlong_penalty,
    recipe_for,
)
from fuseflow.reward_model import RewardModel
from fuseflow.rollout.base import RolloutRequest, SamplingParams
from fuseflow.rollout.sampler import Sampler, make_requests
from fuseflow.sft import ensure_sft_model, lr_at
from fuseflow.tasks import Task, make_task
from fuseflow.telemetry import MetricsLogger, Tracer
from fuseflow.workers.actor import ActorWorker, ReferenceWorker
from fuseflow.workers.common import samples_to_batch
from fuseflow.workers.critic import CriticWorker
from fuseflow.workers.reward import RewardOutput, RewardWorker

EVAL_SAMPLES = 4  # sampled responses per held-out prompt when judging a reward-model run


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
        self.recipe = recipe_for(cfg.algorithm)
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
        # Load the reward model first: a wrong reward.model path should fail before minutes of SFT.
        rm = (RewardModel.load(cfg.reward.model, self.device, self.dtype, cfg.reward.batch_size)
              if cfg.reward.model else None)
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
        self.actor = ActorWorker(actor, self._rollout_backend(actor), self.device, self.dtype, a, t,
                                 cfg.rollout.temperature, norm_len)
        self.reference = ReferenceWorker(reference, self.device, self.dtype, cfg.rollout.temperature,
                                         t.micro_batch_size)
        self.reward = RewardWorker(self.task, rm, cfg.reward.fn_weight, cfg.reward.model_weight)
        if self.recipe.cost_critic and not self.task.has_cost:
            raise ValueError(f"algorithm.name={a.name} needs a task with a cost; task {self.task.name!r} has none")

        def critic(name: str, prefix: str) -> CriticWorker:
            model = (ValueModel.from_pretrained(ckpt / name) if ckpt
                     else ValueModel.from_causal_lm(CausalLM.from_pretrained(ref_dir)))
            return CriticWorker(model.to(self.device), self.device, self.dtype, a, t, norm_len, prefix, name)

        self.critic = critic("critic", "") if self.recipe.critic else None
        self.cost_critic = critic("cost_critic", "cost_") if self.recipe.cost_critic else None
        self.critics = [c for c in (self.critic, self.cost_critic) if c]
        self.lagrange = (LagrangeMultiplier(a.lambda_init, a.lambda_lr, a.cost_limit) if self.recipe.cost_critic
                         else None)
        self.kl_ctl = kl_controller(a)  # fixed kl_coef, or adaptive toward algorithm.kl_target
        self.start_step, self.stream = 0, PromptStream(len(self.train_prompts), cfg.seed)
        self.evals: list[dict] = []
        self.sft_responses: list[str] | None = None  # sampled held-out responses of the SFT model (win rates)
        if ckpt:
            state = read_state(ckpt)
            self.start_step, self.stream.cursor, self.evals = state["step"], state["cursor"], state["evals"]
            if self.lagrange:
                self.lagrange.value = state["lagrange"]
            self.kl_ctl.value = state.get("kl_coef", self.kl_ctl.value)
            for worker in self.trainable_workers():
                load_optimizer(worker.optimizer, ckpt / f"optim_{worker.role}")
            self.log(f"Resumed from {ckpt} (step {self.start_step})")

    def trainable_workers(self) -> list:
        return [self.actor, *self.critics]

    def _rollout_backend(self, actor: CausalLM):
        """The configured rollout backend over the actor's own weights (in-process: no copy, except hf)."""
        r, pad = self.cfg.rollout, self.tokenizer.pad_token_id
        if r.backend == "engine":
            from fuseflow.rollout.engine import Engine, EngineConfig

            return Engine(actor, EngineConfig(max_num_seqs=r.max_num_seqs, kv_budget_tokens=r.kv_budget_tokens),
                          tokenizer=self.tokenizer)
        if r.backend == "hf":
            from fuseflow.rollout.hf_backend import HFBackend

            return HFBackend(actor, pad_id=pad, batch_size=r.max_num_seqs)
        return Sampler(actor, pad)

    # ------------------------------------------------------------ the RL step
    def step(self, step: int) -> dict[str, float]:
        """One RL iteration: generate, score, infer, advantages, train, sync weights."""
        cfg, span = self.cfg, self.tracer.span
        t0 = time.perf_counter()
        batch, metrics = self.rollout(step)  # spans generate + reward; dapo's dynamic sampling draws more
        if self.recipe.greedy_baseline:
            with span("greedy_baseline", step):
                batch["baseline_scores"] = self.greedy_baseline(batch, step)
        with span("old_logprob", step):
            batch["old_logprobs"] = self.actor.compute_logprobs(batch)
        with span("reference", step):
            batch["ref_logprobs"] = self.reference.compute_logprobs(batch)
        for critic in self.critics:  # reward critic: "values"; safe_ppo's cost critic: "cost_values"
            with span(f"{critic.prefix}values", step):
                batch[f"{critic.prefix}values"] = critic.compute_values(batch)
        with span("advantages", step):
            lagrange = self.lagrange.update(float(batch["costs"].nanmean())) if self.lagrange else None
            kl_coef = self.kl_ctl.value  # this step's; the controller then moves it for the next one
            compute_advantages(batch, self.recipe, cfg.algorithm, lagrange, kl_coef)
            self.kl_ctl.update(observed_kl(batch, cfg.algorithm), len(batch))
        metrics |= self.rollout_metrics(batch) | ({"cost/lambda": lagrange} if self.lagrange else {})
        metrics["kl/coef"] = kl_coef
        lr = lambda base: lr_at(step - 1, cfg.trainer.steps, base, cfg.trainer.warmup_steps,  # noqa: E731
                                cfg.trainer.min_lr_ratio)
        if torch.isnan(batch["scores"]).any():
            warnings.warn(f"step {step}: the reward function returned NaN for "
                          f"{int(torch.isnan(batch['scores']).sum())} samples; skipping this update", stacklevel=2)
            metrics["train/skipped_update"] = 1.0
        else:
            for critic in self.critics:
                with span(f"{critic.role}_update", step):
                    metrics |= critic.update(batch, lr(cfg.trainer.critic_lr), seed=cfg.seed + 7 * step)
            with span("actor_update", step):
                metrics |= self.actor.update(batch, lr(cfg.trainer.lr), kl_coef, seed=cfg.seed + step)
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

    # --------------------------------------------------- rollout and scoring
    def rollout(self, step: int) -> tuple[Batch, dict[str, float]]:
        """``prompts_per_step`` groups, generated and scored, packed as a ``Batch``.

        With ``algorithm.dynamic_sampling`` (DAPO), groups whose scores are all equal carry
        no group-relative signal and are dropped; more prompts are drawn, sized by the keep
        rate so far, for at most ``max_extra_draws`` more rounds. A batch still short after
        that is topped up with dropped groups, so its shape never changes.
        """
        a, need = self.cfg.algorithm, self.cfg.trainer.prompts_per_step
        kept: list[list[int]] = []  # sample indices of each kept group, in draw order
        spare: list[list[int]] = []
        pool: list[tuple] = []  # (sample, prompt, text) of every drawn sample
        outs: list[RewardOutput] = []
        drawn = 0
        for rnd in range(1 + (a.max_extra_draws if a.dynamic_sampling else 0)):
            n = need if rnd == 0 else min(need, math.ceil((need - len(kept)) / max(len(kept) / drawn, 0.1)))
            base = len(pool)
            samples, prompts, texts, out = self._draw(step, rnd, n, drawn)
            pool += list(zip(samples, prompts, texts, strict=True))
            outs.append(out)
            drawn += n
            groups: dict[int, list[int]] = {}
            for i, s in enumerate(samples):
                groups.setdefault(s.group_id, []).append(base + i)
            useful = (informative_groups(out.scores, [s.group_id for s in samples]) if a.dynamic_sampling
                      else dict.fromkeys(groups, True))
            for g, idx in groups.items():
                (kept if useful[g] else spare).append(idx)
            if len(kept) >= need:
                break
        topped_up = max(0, need - len(kept))
        chosen = [i for idx in kept[:need] + spare[:topped_up] for i in idx]
        samples, prompts, texts = (list(x) for x in zip(*[pool[i] for i in chosen], strict=True))
        batch = samples_to_batch(samples, self.tokenizer.pad_token_id, [p.text for p in prompts], texts)
        batch.meta["task_prompt"] = prompts  # the task's Prompt objects (answers, metadata) per sample
        merged = {k: torch.cat([getattr(o, k) for o in outs])[chosen] for k in ("scores", "correct", "fn_scores")}
        for k in ("rm_scores", "costs"):
            if getattr(outs[0], k) is not None:
                merged[k] = torch.cat([getattr(o, k) for o in outs])[chosen]
        for k, v in merged.items():
            batch[k] = v
        metrics = {}
        if a.dynamic_sampling:
            metrics = {"dapo/prompts_drawn": float(drawn), "dapo/groups_dropped": float(drawn - len(kept)),
                       "dapo/groups_topped_up": float(topped_up), "dapo/draw_rounds": float(len(outs))}
        if a.overlong_buffer:
            metrics["reward/overlong_penalty"] = float(self.shaping(samples).mean())
        return batch, metrics

    def _draw(self, step: int, rnd: int, n: int, offset: int) -> tuple[list, list, list[str], RewardOutput]:
        """Generate and score ``n`` fresh prompts x ``group_size`` samples (group ids from ``offset``)."""
        cfg, span, g = self.cfg, self.tracer.span, self.cfg.algorithm.group_size
        idx = self.stream.take(n)
        prompts = [self.train_prompts[i] for i in idx for _ in range(g)]
        with span("generate", step):
            # Round 0 keeps the seeds of a run without dynamic sampling; later rounds get fresh ones.
            requests = make_requests([self.train_ids[i] for i in idx], self.sampling, g,
                                     seed=cfg.seed * 100_003 + step + rnd * 10_000_019, group_offset=offset)
            samples = [dataclasses.replace(s, uid=s.uid + offset * g) for s in self.actor.generate(requests)]
            texts = [decode_response(self.tokenizer, s.response_ids) for s in samples]
        with span("reward", step):
            out = self.reward.score(prompts, texts)
            out.scores = out.scores + self.shaping(samples)
        return samples, prompts, texts, out

    def shaping(self, samples: list) -> torch.Tensor:
        """Per-sample score shaping (B,): DAPO's overlong penalty, zeros when it is off."""
        a = self.cfg.algorithm
        lengths = torch.tensor([len(s.response_ids) for s in samples])
        return overlong_penalty(lengths, self.cfg.model.max_response_len, a.overlong_buffer, a.overlong_penalty)

    def greedy_baseline(self, batch: Batch, step: int) -> torch.Tensor:
        """ReMax baseline (B,): the score of one greedy response per prompt, shared by its group."""
        first: dict[int, int] = {}
        for i, gid in enumerate(batch.meta["group_id"]):
            first.setdefault(gid, i)
        tp = batch["input_ids"].shape[1] - batch["response_mask"].shape[1]
        params = dataclasses.replace(self.sampling, greedy=True)
        requests = [RolloutRequest(k, unpad(batch["input_ids"][i, :tp], batch["attention_mask"][i, :tp]), params, gid)
                    for k, (gid, i) in enumerate(first.items())]
        samples = self.actor.generate(requests)
        texts = [decode_response(self.tokenizer, s.response_ids) for s in samples]
        prompts = [batch.meta["task_prompt"][i] for i in first.values()]
        scores = self.reward.score(prompts, texts).scores + self.shaping(samples)  # (G,)
        by_group = dict(zip(first, scores.tolist(), strict=True))
        return torch.tensor([by_group[gid] for gid in batch.meta["group_id"]])

    def rollout_metrics(self, batch: Batch) -> dict[str, float]:
        mask = batch["response_mask"]
        lengths = mask.sum(-1)
        kl = kl_penalty(batch["old_logprobs"], batch["ref_logprobs"], "k3")
        diff = ((batch["behavior_logprobs"] - batch["old_logprobs"]).abs() * mask).max()
        out = {"reward/mean": float(torch.nan_to_num(batch["scores"]).mean()),
               "reward/accuracy": float(batch["correct"].mean()),
               "rollout/response_length_mean": float(lengths.mean()),
               "rollout/response_length_max": float(lengths.max()),
               "rollout/response_length_min": float(lengths.min()),
               "rollout/prompt_length_mean": float(batch["attention_mask"].sum(-1).float().mean() - lengths.mean()),
               "rollout/num_samples": float(len(batch)), "rollout/logprob_diff_max": float(diff),
               "rollout/stop_frac": sum(r == "stop" for r in batch.meta["finish_reason"]) / len(batch),
               "kl/ref_k3": float(masked_mean(kl, mask))}
        if "rm_scores" in batch:  # learned RM and the task function (hidden gold rule) side by side
            out["reward/rm_score"] = float(batch["rm_scores"].mean())
            if self.task.has_reward:
                out["reward/fn_score"] = float(torch.nan_to_num(batch["fn_scores"]).mean())
        if "costs" in batch:
            out["cost/mean"] = float(torch.nan_to_num(batch["costs"]).mean())
        if "baseline_scores" in batch:
            out["reward/greedy_baseline"] = float(batch["baseline_scores"].mean())
        return out

    # ------------------------------------------------------------ bookkeeping
    def evaluate(self, step: int) -> dict[str, float]:
        with self.tracer.span("evaluate", step):
            ev = evaluate(self.actor.model, self.tokenizer, self.task, self.eval_prompts, self.cfg.model.max_prompt_len,
                          self.cfg.model.max_response_len)
            if self.task.has_cost:  # greedy, like accuracy
                greedy = greedy_responses(self.actor.model, self.tokenizer, self.eval_prompts,
                                          self.cfg.model.max_prompt_len, self.cfg.model.max_response_len)
                ev["cost"] = cost_rate(self.task, self.eval_prompts, greedy)
            if self.reward.model is not None:  # sampled and paired by seed with the SFT model's samples
                if self.sft_responses is None:
                    self.sft_responses = self._sampled(self.reference.model)
                prompts = [p for p in self.eval_prompts for _ in range(EVAL_SAMPLES)]
                ev |= preference_eval(self.task, prompts, self._sampled(self.actor.model), self.sft_responses,
                                      self.reward.model)
        self.evals = [e for e in self.evals if e["step"] != step] + [{"step": step, **ev}]
        return ev

    def _sampled(self, model) -> list[str]:
        cfg = self.cfg
        return sampled_responses(model, self.tokenizer, self.eval_prompts, cfg.model.max_prompt_len,
                                 cfg.model.max_response_len, cfg.rollout.temperature, EVAL_SAMPLES, seed=cfg.seed + 99)

    def save(self, step: int) -> Path:
        workers = self.trainable_workers()
        state = {"cursor": self.stream.cursor, "evals": self.evals, "kl_coef": self.kl_ctl.value}
        if self.lagrange:
            state["lagrange"] = self.lagrange.value
        path = save_checkpoint(self.run_dir, step, {w.role: w.model for w in workers},
                               {w.role: w.optimizer for w in workers}, state, tokenizer=self.tokenizer)
        self.tracer.save()
        return path

    def close(self) -> None:
        self.tracer.save()
        self.metrics.close()

