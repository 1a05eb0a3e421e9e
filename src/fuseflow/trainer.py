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

import json
import time
import uuid
import warnings
from functools import partial
from pathlib import Path

import torch

from fuseflow.algorithms import kl_penalty, masked_mean, rollout_mismatch
from fuseflow.checkpoint import copy_model_dir, latest_checkpoint, read_state, save_checkpoint
from fuseflow.config import Config
from fuseflow.controller.cluster import make_cluster
from fuseflow.controller.group import WorkerGroup
from fuseflow.data.batch import Batch
from fuseflow.evaluate import encode_prompts
from fuseflow.models import resolve_device
from fuseflow.models.source import model_dir, run_tokenizer
from fuseflow.recipes import LagrangeMultiplier, compute_advantages, kl_controller, observed_kl, recipe_for
from fuseflow.reward_model import RewardModel
from fuseflow.schedule.modes import make_strategy
from fuseflow.schedule.pipeline.roles import pipeline_roles, pipelined_rollout
from fuseflow.schedule.stages import CRITIC_PREFIX, Roles, Stages
from fuseflow.sft import ensure_sft_model, lr_at
from fuseflow.tasks import Task, make_task
from fuseflow.telemetry import MetricsLogger, Tracer
from fuseflow.workers.actor import ActorWorker, ReferenceWorker
from fuseflow.workers.build import (
    RoleContext,
    build_actor,
    build_critic,
    build_reference,
    build_reward,
    build_rollout_engine,
)
from fuseflow.workers.critic import CriticWorker
from fuseflow.workers.reward import RewardWorker


class PromptStream:
    """Training prompts in a fresh seeded order each epoch; ``cursor`` (prompts consumed) is its whole state."""

    def __init__(self, n: int, seed: int, cursor: int = 0):
        self.n, self.seed, self.cursor = n, seed, cursor
        self._perm: tuple[int, list[int]] | None = None  # (epoch, its order): drawn once per epoch

    def take(self, k: int) -> list[int]:
        """The next ``k`` prompt indices, advancing ``cursor``; an epoch boundary starts the next epoch's order."""
        out = []
        for _ in range(k):
            epoch, i = divmod(self.cursor, self.n)
            if self._perm is None or self._perm[0] != epoch:
                gen = torch.Generator().manual_seed(self.seed + epoch)
                self._perm = (epoch, torch.randperm(self.n, generator=gen).tolist())
            out.append(self._perm[1][i])
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
        # schedule.mode: when and where generation, inference and training run; the step below is the same.
        roles = Roles(self.actor, self.reference, self.reward, self.critics, self.replicas,
                      old_from_rollout=cfg.algorithm.old_logprobs == "rollout")
        self.stages = Stages(cfg, roles, self.tokenizer, self.train_prompts, self.train_ids, self.stream,
                             self.tracer, self.recipe)
        self.strategy = make_strategy(self.stages, self.resumed_from, self.start_step)

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
            copy_model_dir(sft_dir, ref_dir.with_suffix(".tmp"), cfg.cache_dir)
            # A new file, not a write into the (possibly hard-linked) cached one.
            (ref_dir.with_suffix(".tmp") / "sft_curve.json").unlink(missing_ok=True)
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
        # backend=ray with placement.rollout: rollout replica processes, each with its own engine and weights
        # (they start now and load their models while the roles below are built).
        self.replicas = self.cluster.rollout_replicas(partial(build_rollout_engine, ctx))
        group = self.cluster.group
        self.actor: WorkerGroup = group("actor", ActorWorker, partial(build_actor, ctx))
        self.reference: WorkerGroup = group("reference", ReferenceWorker, partial(build_reference, ctx))
        self.reward: WorkerGroup = group("reward", RewardWorker, partial(build_reward, ctx))
        self.has_reward_model = rm is not None
        self.critics: list[WorkerGroup] = [  # safe_ppo's cost critic shares the critic's pool and dp
            group(name, CriticWorker, partial(build_critic, ctx, name=name, prefix=CRITIC_PREFIX[name]),
                  placed_as="critic")
            for name, wanted in (("critic", self.recipe.critic), ("cost_critic", self.recipe.cost_critic)) if wanted]
        if self.replicas is not None:
            # The weight group (the actor's rank 0 and every replica) forms now, not in step 2's first sync:
            # a replica that cannot join fails before any step, and no step pays the rendezvous (step 2's
            # first sync took 26-41 ms against 8-14 ms for later ones, and 446 ms in one run of 13).
            self.replicas.connect(self.actor)
        # actor.pp > 1: the training step runs on pipeline stage processes (schedule/pipeline/roles.py).
        self.pipeline = pipeline_roles(cfg, self.actor, self.critics)
        # rollout.pipeline_stages=2: generation on 2 stage processes, batches in flight (Pipe-RLHF).
        self.pipelined_rollout = pipelined_rollout(cfg, self.actor, self.tokenizer.pad_token_id)
        self.lagrange = (LagrangeMultiplier(a.lambda_init, a.lambda_lr, a.cost_limit) if self.recipe.cost_critic
                         else None)
        self.kl_ctl = kl_controller(a)  # fixed kl_coef, or adaptive toward algorithm.kl_target
        self._sync = None  # the step's actor.sync_weights, started behind the actor's update (update_calls)
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
        """The worker groups whose weights train and are checkpointed: the actor, then each critic."""
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
        else:
            for m in self.strategy.train(step, self.update_calls(step, batch, lr, kl_coef)).values():
                metrics |= m
            metrics["train/skipped_update"] = 0.0
        with span("weight_sync", step):  # in-process: shared weights (vLLM: pushed, timed)
            sync, self._sync = self._sync, None
            metrics |= (sync or self.actor.sync_weights.future(step)).result() or {}
        metrics |= self.strategy.step_metrics(step)  # worker-seconds, busy fractions, long tail
        seconds, busy = time.perf_counter() - t0, self.worker_seconds() - busy0
        n_tokens = float(batch["response_mask"].sum())
        metrics |= {f"time/{name}": sec for name, sec in self.tracer.seconds_for(step).items()}
        metrics |= {"time/step_seconds": seconds, "time/worker_compute": busy,
                    "time/controller_overhead": max(0.0, seconds - busy),
                    "perf/samples_per_second": len(batch) / seconds,
                    "perf/tokens_per_second": n_tokens / seconds, "train/lr": lr(cfg.trainer.lr)}
        return metrics

    def update_calls(self, step: int, batch: Batch, lr, kl_coef: float) -> dict:
        """The step's training calls for the strategy: each critic's update, then the actor's (side by side
        on pools of their own, or when fused); with ``actor.pp > 1`` one call that trains them all on the
        pipeline's stage processes. Mini-batch shuffles are seeded per model and step either way."""
        cfg = self.cfg
        if self.pipeline is not None:
            return self.pipeline.updates(batch, lr(cfg.trainer.lr), lr(cfg.trainer.critic_lr), kl_coef,
                                         actor_seed=cfg.seed + step, critic_seed=cfg.seed + 7 * step)
        updates = {f"{c.role}_update": partial(c.update.future, batch, lr(cfg.trainer.critic_lr),
                                               seed=cfg.seed + 7 * step) for c in self.critics}

        def actor_update():
            future = self.actor.update.future(batch, lr(cfg.trainer.lr), kl_coef, seed=cfg.seed + step)
            # Queued right behind the update in the actor's lane: on Ray the weights reach the rollout
            # without a round trip to this controller in between (``step`` collects it).
            self._sync = self.actor.sync_weights.future(step)
            return future

        updates["actor_update"] = actor_update
        return updates

    def make_experience(self, step: int) -> tuple[Batch, dict[str, float]]:
        """Generate, score and infer (old/reference log-probs, values): the part ``schedule.mode`` schedules."""
        return self.strategy.make_experience(step)

    def rollout_metrics(self, batch: Batch) -> dict[str, float]:
        """The step's rollout statistics from its batch: reward (and accuracy where the task has one), response and
        prompt lengths, the stop fraction, the k3 KL to the reference and the train/rollout log-prob mismatch."""
        mask = batch["response_mask"]
        lengths = mask.sum(-1)
        prompt_lengths = batch["attention_mask"].sum(-1) - lengths  # (B,)
        kl = kl_penalty(batch["old_logprobs"], batch["ref_logprobs"], "k3")
        out = {"reward/mean": float(torch.nan_to_num(batch["scores"]).mean()),
               "rollout/response_length_mean": float(lengths.mean()),
               "rollout/response_length_max": float(lengths.max()),
               "rollout/response_length_min": float(lengths.min()),
               "rollout/prompt_length_mean": float(prompt_lengths.float().mean()),
               "rollout/prompt_length_max": float(prompt_lengths.max()),
               "rollout/num_samples": float(len(batch)),
               "rollout/stop_frac": sum(r == "stop" for r in batch.meta["finish_reason"]) / len(batch),
               "kl/ref_k3": float(masked_mean(kl, mask))}
        # Train/rollout mismatch: ~0 on the engine in the trainer's dtype, visible on vLLM or bf16 rollouts;
        # not measured when the old log-probs are the rollout's own (algorithm.old_logprobs=rollout).
        if not self.stages.roles.old_from_rollout:
            mismatch = rollout_mismatch(batch["behavior_logprobs"], batch["old_logprobs"], mask)
            out |= {f"rollout/{k}": v for k, v in mismatch.items()}
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
        cursor = self.strategy.cursor()
        state = {"cursor": cursor, "evals": self.evals, "kl_coef": self.kl_ctl.value}
        if self.lagrange:
            state["lagrange"] = self.lagrange.value
        writers = [lambda d, g=g: g.save(str(d)) for g in self.trainable_groups()]
        writers.append(self.strategy.save)
        path = save_checkpoint(self.run_dir, step, state, writers)
        self.tracer.save()
        return path

    def close(self) -> None:
        """End the run's work: the strategy's pools and threads, any pipeline, the trace and metrics files, then the
        cluster's workers. Call it once, also after a failure."""
        self.strategy.close()
        for pipeline in (self.pipeline, self.pipelined_rollout):
            if pipeline is not None:
                pipeline.close()
        self.tracer.save()
        self.metrics.close()
        self.cluster.shutdown()

