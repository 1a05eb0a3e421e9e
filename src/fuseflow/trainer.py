"""The RL controller program: one process drives the role worker groups.

``RLTrainer.step`` is the whole algorithm on one screen: generate, score, infer,
advantages, train, sync weights, each phase timed as a span in ``trace.json``. The
eight algorithms (``algorithm.name``) share it: each is a ``Recipe`` (see
``fuseflow.recipes``) naming its registered estimator and the roles it needs.

Each role (actor, reference, critic, reward) is a ``WorkerGroup`` built on the configured
backend: ``local`` runs each role once in this process (plain method calls), ``ray`` runs
it on a pool of worker processes, data-parallel with FSDP when ``<role>.dp > 1``. The
program is the same on both; distribution lives in ``fuseflow.controller``.
Everything else here is set-up, checkpointing and bookkeeping around it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import time
import uuid
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from fuseflow.algorithms import kl_penalty, masked_mean
from fuseflow.checkpoint import latest_checkpoint, read_state, save_checkpoint
from fuseflow.config import Config
from fuseflow.controller.cluster import make_cluster
from fuseflow.controller.group import Future, WorkerGroup
from fuseflow.data.batch import Batch, unpad
from fuseflow.data.tokenizer import stop_token_ids
from fuseflow.evaluate import decode_response, encode_prompts
from fuseflow.models import resolve_device
from fuseflow.models.source import model_dir, run_tokenizer
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
from fuseflow.rollout.sampler import make_requests
from fuseflow.schedule.modes import make_strategy
from fuseflow.sft import ensure_sft_model, lr_at
from fuseflow.tasks import Task, make_task
from fuseflow.telemetry import MetricsLogger, Tracer
from fuseflow.workers.actor import ActorWorker, ReferenceWorker
from fuseflow.workers.build import RoleContext, build_actor, build_critic, build_reference, build_reward
from fuseflow.workers.common import samples_to_batch
from fuseflow.workers.critic import CriticWorker
from fuseflow.workers.reward import RewardOutput, RewardWorker

CRITIC_PREFIX = {"critic": "", "cost_critic": "cost_"}  # the batch fields each critic reads and fills
REWARD_FIELDS = ("scores", "correct", "fn_scores", "rm_scores", "costs")  # RewardOutput's (B,) fields


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
        self.tokenizer = run_tokenizer(cfg, log)  # model.path's own tokenizer (a GGUF converts here, once)
        self.train_prompts = self.task.train_prompts()
        self.train_ids = encode_prompts(self.tokenizer, self.train_prompts, cfg.model.max_prompt_len)
        self.eval_prompts = self.task.eval_prompts()[: cfg.trainer.eval_size]
        # Started first, so a wrong ray.address fails before minutes of SFT.
        self.cluster = make_cluster(cfg, run_name=f"{self.run_dir.name}-{uuid.uuid4().hex[:6]}")
        try:
            self._setup_workers(resume)
        except BaseException:
            self.cluster.shutdown()
            raise
        self.tracer = Tracer(self.run_dir / "trace.json")
        self.metrics = MetricsLogger(self.run_dir, resume_step=self.start_step if resume else None)
        if resume:
            self.tracer.drop_after(self.start_step)
        self.strategy = make_strategy(self)  # schedule.mode: None runs make_experience's stages in order

    # ----------------------------------------------------------------- set-up
    def _setup_workers(self, resume: bool) -> None:
        cfg, ref_dir = self.cfg, self.run_dir / "reference"
        # Load the reward model first: a wrong reward.model path should fail before minutes of SFT.
        rm = (RewardModel.load(cfg.reward.model, self.device, self.dtype, cfg.reward.batch_size)
              if cfg.reward.model else None)
        if not ref_dir.is_dir():
            if cfg.sft.enabled:
                sft_dir, curve = ensure_sft_model(cfg, self.task, self.tokenizer, self.device, self.dtype,
                                                  self.progress, self.log)
            elif cfg.model.path:
                sft_dir, curve = model_dir(cfg), []
            else:
                raise ValueError("sft.enabled=false needs model.path=DIR (a trained model to start RL from)")
            shutil.copytree(sft_dir, ref_dir.with_suffix(".tmp"), dirs_exist_ok=True)
            (ref_dir.with_suffix(".tmp") / "sft_curve.json").write_text(json.dumps(curve))
            ref_dir.with_suffix(".tmp").rename(ref_dir)
        self.sft_curve = json.loads((ref_dir / "sft_curve.json").read_text())
        ckpt = latest_checkpoint(self.run_dir) if resume else None
        self.resumed_from = ckpt  # the schedule strategy reads its own part (an async prefetch) from it
        a = cfg.algorithm
        if self.recipe.cost_critic and not self.task.has_cost:
            raise ValueError(f"algorithm.name={a.name} needs a task with a cost; task {self.task.name!r} has none")
        # In-process workers reuse the loaded reward model; remote ones load their own from reward.model.
        ctx = RoleContext(cfg, ref_dir, ckpt, self.task, rm if cfg.backend == "local" else None)
        group = self.cluster.group
        self.actor: WorkerGroup = group("actor", ActorWorker, partial(build_actor, ctx))
        self.reference: WorkerGroup = group("reference", ReferenceWorker, partial(build_reference, ctx))
        self.reward: WorkerGroup = group("reward", RewardWorker, partial(build_reward, ctx))
        self.has_reward_model = rm is not None
        self.critics: list[WorkerGroup] = [  # safe_ppo's cost critic shares the critic's pool and dp
            group(name, CriticWorker, partial(build_critic, ctx, name=name, prefix=CRITIC_PREFIX[name]),
                  placed_as="critic")
            for name, wanted in (("critic", self.recipe.critic), ("cost_critic", self.recipe.cost_critic)) if wanted]
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
            self.log(f"Resumed from {ckpt} (step {self.start_step})")  # the workers loaded models and optimizers

    def trainable_groups(self) -> list[WorkerGroup]:
        return [self.actor, *self.critics]

    def worker_seconds(self) -> float:
        """Seconds the workers have spent computing so far (the slowest rank of each call)."""
        return sum(g.compute_seconds for g in (self.actor, self.reference, self.reward, *self.critics))

    # ------------------------------------------------------------ the RL step
    def step(self, step: int) -> dict[str, float]:
        """One RL iteration: generate, score, infer, advantages, train, sync weights."""
        cfg, span = self.cfg, self.tracer.span
        t0, busy0 = time.perf_counter(), self.worker_seconds()
        batch, metrics = self.make_experience(step)  # generate, reward, old/ref log-probs, values
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
        else:  # critics, then the actor; side by side on pools of their own (split placement) or when fused
            updates = {f"{c.role}_update": partial(c.update.future, batch, lr(cfg.trainer.critic_lr),
                                                   seed=cfg.seed + 7 * step) for c in self.critics}
            updates["actor_update"] = partial(self.actor.update.future, batch, lr(cfg.trainer.lr), kl_coef,
                                              seed=cfg.seed + step)
            train = self.strategy.train if self.strategy else self.overlap
            for m in train(step, updates).values():
                metrics |= m
            metrics["train/skipped_update"] = 0.0
        with span("weight_sync", step):
            self.actor.sync_weights(step)  # in-process: shared weights, the version moves on
        metrics |= self.strategy.step_metrics(step) if self.strategy else {}  # busy fractions, long tail
        seconds, busy = time.perf_counter() - t0, self.worker_seconds() - busy0
        n_tokens = float(batch["response_mask"].sum())
        metrics |= {f"time/{name}": sec for name, sec in self.tracer.seconds_for(step).items()}
        metrics |= {"time/step_seconds": seconds, "time/worker_compute": busy,
                    "time/controller_overhead": max(0.0, seconds - busy),
                    "perf/samples_per_second": len(batch) / seconds,
                    "perf/tokens_per_second": n_tokens / seconds, "train/lr": lr(cfg.trainer.lr)}
        return metrics

    def make_experience(self, step: int) -> tuple[Batch, dict[str, float]]:
        """Generate, score and infer: the stages a scheduling strategy (fused, async) may take over."""
        if self.strategy is not None:
            return self.strategy.make_experience(step)
        batch, metrics = self.rollout(step)  # spans generate + reward; dapo's dynamic sampling draws more
        if self.recipe.greedy_baseline:
            with self.tracer.span("greedy_baseline", step):
                batch["baseline_scores"] = self.greedy_baseline(batch, step)
        # Reward critic: "values"; safe_ppo's cost critic: "cost_values".
        calls = {"old_logprob": partial(self.actor.compute_logprobs.future, batch),
                 "reference": partial(self.reference.compute_logprobs.future, batch)}
        calls |= {f"{CRITIC_PREFIX[c.role]}values": partial(c.compute_values.future, batch) for c in self.critics}
        out = self.overlap(step, calls)
        batch["old_logprobs"], batch["ref_logprobs"] = out.pop("old_logprob"), out.pop("reference")
        for key, values in out.items():
            batch[key] = values
        return batch, metrics

    def overlap(self, step: int, calls: dict[str, Callable[[], Future]]) -> dict[str, Any]:
        """Start every call, then collect each: on Ray, groups on different pools compute at the same time.

        Each call's span covers its start and its wait (in-process calls run as they start);
        colocated groups share processes, so their calls still run one after another.
        """
        futures = {}
        for name, start in calls.items():
            with self.tracer.span(name, step):
                futures[name] = start()
        out = {}
        for name, future in futures.items():
            with self.tracer.span(name, step):
                out[name] = future.result()
        return out

    @property
    def sampling(self) -> SamplingParams:
        r = self.cfg.rollout
        return SamplingParams(r.temperature, r.top_p, r.top_k, False, self.cfg.model.max_response_len,
                              stop_token_ids(self.tokenizer))

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
        fields = {k: torch.cat([getattr(o, k) for o in outs])[chosen] for k in REWARD_FIELDS
                  if getattr(outs[0], k) is not None}
        batch = self.to_batch(samples, prompts, texts, fields)
        metrics = {}
        if a.dynamic_sampling:
            metrics = {"dapo/prompts_drawn": float(drawn), "dapo/groups_dropped": float(drawn - len(kept)),
                       "dapo/groups_topped_up": float(topped_up), "dapo/draw_rounds": float(len(outs))}
        if a.overlong_buffer:
            metrics["reward/overlong_penalty"] = float(self.shaping(samples).mean())
        return batch, metrics

    def _draw(self, step: int, rnd: int, n: int, offset: int) -> tuple[list, list, list[str], RewardOutput]:
        """Generate and score ``n`` fresh prompts x ``group_size`` samples (group ids from ``offset``)."""
        span, g = self.tracer.span, self.cfg.algorithm.group_size
        requests, prompts = self.requests_for(step, rnd, n, offset)
        with span("generate", step):
            samples = [dataclasses.replace(s, uid=s.uid + offset * g) for s in self.actor.generate(requests)]
            texts = [decode_response(self.tokenizer, s.response_ids) for s in samples]
        with span("reward", step):
            out = self.reward.score(prompts, texts)
            out.scores = out.scores + self.shaping(samples)
        return samples, prompts, texts, out

    def requests_for(self, step: int, rnd: int, n: int, offset: int) -> tuple[list[RolloutRequest], list]:
        """``n`` fresh prompts x ``group_size`` seeded requests for ``step`` and each request's task prompt.

        Seeds depend on the step and draw round only (round 0 keeps the seeds of a run without
        dynamic sampling), so every schedule mode draws the same tokens for the same step.
        """
        cfg, g = self.cfg, self.cfg.algorithm.group_size
        idx = self.stream.take(n)
        prompts = [self.train_prompts[i] for i in idx for _ in range(g)]
        requests = make_requests([self.train_ids[i] for i in idx], self.sampling, g,
                                 seed=cfg.seed * 100_003 + step + rnd * 10_000_019, group_offset=offset)
        return requests, prompts

    def to_batch(self, samples: list, prompts: list, texts: list[str], fields: dict[str, torch.Tensor]) -> Batch:
        """Finished, scored samples packed as a ``Batch``; ``fields`` are per-sample (B,) reward outputs."""
        batch = samples_to_batch(samples, self.tokenizer.pad_token_id, [p.text for p in prompts], texts)
        batch.meta["task_prompt"] = prompts  # the task's Prompt objects (answers, metadata) per sample
        for k, v in fields.items():
            batch[k] = v
        return batch

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
        prompt_lengths = batch["attention_mask"].sum(-1) - lengths  # (B,)
        kl = kl_penalty(batch["old_logprobs"], batch["ref_logprobs"], "k3")
        diff = ((batch["behavior_logprobs"] - batch["old_logprobs"]).abs() * mask).max()
        out = {"reward/mean": float(torch.nan_to_num(batch["scores"]).mean()),
               "rollout/response_length_mean": float(lengths.mean()),
               "rollout/response_length_max": float(lengths.max()),
               "rollout/response_length_min": float(lengths.min()),
               "rollout/prompt_length_mean": float(prompt_lengths.float().mean()),
               "rollout/prompt_length_max": float(prompt_lengths.max()),
               "rollout/num_samples": float(len(batch)), "rollout/logprob_diff_max": float(diff),
               "rollout/stop_frac": sum(r == "stop" for r in batch.meta["finish_reason"]) / len(batch),
               "kl/ref_k3": float(masked_mean(kl, mask))}
        if self.task.has_reward:  # a task scored by a reward model alone has no correct answer
            out["reward/accuracy"] = float(batch["correct"].mean())
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
        """Held-out greedy accuracy (and cost); with a reward model, RM score and gold win rate vs SFT."""
        with self.tracer.span("evaluate", step):
            ev = self.actor.evaluate()
            if self.has_reward_model:  # sampled and paired by seed with the SFT model's samples
                if self.sft_responses is None:
                    self.sft_responses = self.reference.sample_heldout()
                ev |= self.reward.preference_eval(self.actor.sample_heldout(), self.sft_responses)
        self.evals = [e for e in self.evals if e["step"] != step] + [{"step": step, **ev}]
        return ev

    def save(self, step: int) -> Path:
        """A checkpoint: each trainable group writes its model and optimizer from its own processes."""
        # An async run has drawn the next step's prompts already: a resume draws them again and
        # takes that step's samples from the checkpoint (Strategy.save).
        cursor = self.strategy.cursor() if self.strategy else self.stream.cursor
        state = {"cursor": cursor, "evals": self.evals, "kl_coef": self.kl_ctl.value}
        if self.lagrange:
            state["lagrange"] = self.lagrange.value
        writers = [lambda d, g=g: g.save(str(d)) for g in self.trainable_groups()]
        writers += [self.strategy.save] if self.strategy else []
        path = save_checkpoint(self.run_dir, step, state, writers)
        self.tracer.save()
        return path

    def close(self) -> None:
        if self.strategy:
            self.strategy.close()
        self.tracer.save()
        self.metrics.close()
        self.cluster.shutdown()

