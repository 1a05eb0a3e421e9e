"""Execution modes as one strategy object that takes over ``RLTrainer.make_experience``.

The algorithm program (``RLTrainer.step``) is unchanged; this decides when generation,
reward, reference/old log-probs and critic values run, and on which worker thread:

- ``sequential`` with ``rollout_workers > 1``: generation split over the rollout workers,
  then inference micro-batches on all of them, then training (verl's order on N workers).
- ``fused``: every finished sample joins a token-budget micro-batch that goes to inference at
  once, while generation goes on; a worker with no samples left runs inference; once the
  unfinished samples drop to the threshold they migrate onto the fewest workers
  (``migration.plan_migration``) and the freed workers run inference.
- ``async``: the rollout decodes with a copy of the actor's weights, so generation for step
  t+1 (admitted by ``StalenessGate``) runs during training of step t; old log-probs and
  critic values are computed afterwards with the current models (the decoupled loss's
  proximal policy); the frozen reference and reward may run during training.
- ``fused+async``: both.

Fused and async modes also run the training stage side by side (RLHFuse's intra-stage
fusion): the actor's and critics' updates only share the batch, so each runs on a thread of
its own instead of one after the other, and in async modes a core that one update leaves
early goes to the next step's generation (``Strategy.train``).

Sample tokens never depend on the mode (per-request seeds, exported sampler state on
migration); inference values differ only by float summation order (micro-batch widths).
"""

from __future__ import annotations

import copy
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fuseflow.controller.group import Future as GroupFuture
from fuseflow.data.batch import Batch, scatter_rows
from fuseflow.evaluate import decode_response
from fuseflow.policy.microbatch import TokenBudgetBatcher
from fuseflow.policy.migration import plan_migration, resolve_threshold, should_migrate
from fuseflow.rollout.base import RolloutRequest, Sample
from fuseflow.rollout.engine import EngineConfig
from fuseflow.telemetry.gantt import parse_trace, trace_step_metrics

from .pending import load_pending, save_pending
from .pool import RolloutPool, TaskQueue
from .staleness import check_staleness, staleness_metrics

FROZEN = ("reference", "reward")  # stages whose models never train: may run while the actor trains
WAIT_S = 600.0  # longest wait for one sample before the step is declared stuck


def make_strategy(trainer) -> Strategy | None:
    """The strategy for ``schedule``; None keeps the trainer's own in-order stages (one rollout worker)."""
    s = trainer.cfg.schedule
    if s.mode == "sequential" and s.rollout_workers == 1:
        return None
    return Strategy(trainer)


@dataclass
class Generated:
    """One step's samples plus whatever inference already ran on them, keyed by uid."""

    samples: list[Sample]  # in uid order (the order of a sequential run's batch)
    prompts: list  # task Prompt per sample
    texts: list[str]
    rows: dict[str, dict[int, torch.Tensor]] = field(default_factory=dict)  # field -> uid -> (Tr_i,) or ()
    migrated: int = 0

    @classmethod
    def of(cls, samples: list[Sample], prompt_of: dict, tokenizer, migrated: int = 0) -> Generated:
        """Samples (in uid order) with their task prompts (by uid) and decoded responses, no inference yet."""
        return cls(samples, [prompt_of[x.uid] for x in samples],
                   [decode_response(tokenizer, x.response_ids) for x in samples], migrated=migrated)

    def merge(self, results: list[Future]) -> None:
        """Add the per-uid rows of finished inference tasks (``Strategy._infer`` results)."""
        for fut in results:
            for name, by_uid in fut.result().items():
                self.rows.setdefault(name, {}).update(by_uid)


class Strategy:
    """Runs make_experience for one trainer in the configured mode (see the module docstring)."""

    def __init__(self, trainer):
        cfg, s = trainer.cfg, trainer.cfg.schedule
        self.t, self.s = trainer, s
        actor = trainer.actor.worker  # the local backend (checked by the config) runs roles in this process
        # Async decodes while the actor trains, so the rollout needs weights of its own.
        model = copy.deepcopy(actor.plain).eval().requires_grad_(False) if s.asynchronous else actor.plain
        r = cfg.rollout
        self.pool = RolloutPool(model, s.rollout_workers, EngineConfig(r.max_num_seqs, r.kv_budget_tokens),
                                trainer.tokenizer, trainer.tracer, first_track=1)
        self.infer_track = s.rollout_workers + 1
        trainer.tracer.name_track(self.infer_track, "inference")
        self.stages = ("old_logprob", "reference", "reward", *(c.role for c in trainer.critics))
        self.version = trainer.start_step  # policy version the rollout holds
        self.prefetch: tuple[int, Future, int] | None = None  # (step, result, stream cursor before its draw)
        self.history: list[list[int]] = []  # response lengths of earlier steps (auto threshold)
        self.migrated: dict[int, int] = {}
        self.train_tracks: dict[str, int] = {}  # update name -> trace track of the thread that runs it
        if trainer.resumed_from is not None:
            self._restore(trainer.resumed_from)

    # ------------------------------------------------------------------ the step's experience
    def make_experience(self, step: int) -> tuple[Batch, dict[str, float]]:
        """Samples for ``step`` with rewards, old/reference log-probs and values, and the mode's metrics."""
        s, t = self.s, self.t
        self.pool.restore_priority()  # training is over: a prefetch still decoding gets full priority
        if self.prefetch is not None and self.prefetch[0] == step:
            gen = self.prefetch[1].result()  # generated during the previous step's training
            self.prefetch = None
        else:
            self._set_weights(step - 1)
            gen = self._generate(step, self.t.requests_for(step, 0, t.cfg.trainer.prompts_per_step, 0),
                                 stream=self.stages if s.fused else (), after=self.stages, foreground=True)
        self._set_weights(step - 1)
        # Async: old log-probs and values need the just-trained models, so they run after the
        # previous step's training; running them here, on both workers and before the next step's
        # generation starts, keeps them off the critical path's single controller thread and lets
        # that generation overlap this step's training instead of this inference. Otherwise every
        # stage already ran during generation (a prefetch restored into a non-async mode aside).
        self._complete(step, gen)
        if s.asynchronous and step < t.cfg.trainer.steps:
            self._start_prefetch(step + 1)
        batch, metrics = self._assemble(step, gen)
        if s.asynchronous:
            versions = batch.meta["policy_version"]
            check_staleness(versions, step, s.max_staleness, batch.meta["uid"])
            metrics |= staleness_metrics(versions, step, s.max_staleness)
        self.migrated[step] = gen.migrated
        self.history = [*self.history[-4:], [len(x.response_ids) for x in gen.samples]]
        return batch, metrics

    def _set_weights(self, version: int) -> None:
        """Give the (idle) rollout the actor's weights at ``version``; async copies them, otherwise they are shared."""
        if version == self.pool.engines[0].policy_version and self.version == version:
            return
        if self.s.asynchronous:
            with torch.no_grad():
                src = self.t.actor.worker.plain.state_dict()
                for k, v in self.pool.model.state_dict().items():
                    v.copy_(src[k])
        self.pool.update_weights(version)
        self.version = version

    def finish_prefetch(self) -> None:
        """Wait until the next step's background generation (async modes) has finished, if one runs.

        Why: a benchmark that times fuseflow's steps one at a time with other work in between
        (`bench trl`) must count that generation in fuseflow's time, not in the gap. Its errors
        are not raised here but by the next step, which takes its result.
        """
        if self.prefetch is not None:
            wait([self.prefetch[1]])

    def _start_prefetch(self, step: int) -> None:
        """Start generating ``step`` now if the staleness bound allows it with the rollout's weights."""
        need = (step - 1) - self.s.max_staleness
        if self.version < need:
            return  # max_staleness=0: the next step waits for this step's weights (sequential order)
        cursor = self.t.stream.cursor
        requests = self.t.requests_for(step, 0, self.t.cfg.trainer.prompts_per_step, 0)
        stream = FROZEN if self.s.fused else ()
        fut: Future = Future()

        def run() -> None:
            try:
                fut.set_result(self._generate(step, requests, stream=stream, after=FROZEN, foreground=False))
            except BaseException as e:
                fut.set_exception(e)

        threading.Thread(target=run, daemon=True, name=f"prefetch-{step}").start()
        self.prefetch = (step, fut, cursor)

    # ------------------------------------------------------------------ generation + streamed inference
    def _generate(self, step: int, drawn: tuple[list[RolloutRequest], list], stream: tuple[str, ...],
                  after: tuple[str, ...], foreground: bool) -> Generated:
        """Decode ``drawn`` on the rollout workers; stages in ``stream`` run per micro-batch as samples
        finish, stages in ``after`` (and not streamed) run once all are done, both on free workers."""
        requests, prompts = drawn
        n, tasks, arrived = len(requests), TaskQueue(), queue.Queue()
        prompt_of = {r.uid: p for r, p in zip(requests, prompts, strict=True)}
        # A background (prefetch) generation runs beside training, the critical path: its workers
        # run under SCHED_IDLE so that training keeps its core (measured in docs/benchmarks.md).
        threads = self.pool.run(step, self._shards(requests), lambda _w, smp: arrived.put(smp), tasks,
                                background=not foreground)
        # With one rollout worker the controller thread is the second core's inference worker.
        helps = foreground and len(self.pool) == 1
        batcher: TokenBudgetBatcher[Sample] = TokenBudgetBatcher(self.s.token_budget)
        results: list[Future] = []
        done: list[Sample] = []
        migrated = 0
        threshold = self._threshold()
        submit = lambda group, names: results.append(  # noqa: E731
            tasks.submit(lambda: self._infer(step, group, names, prompt_of)))
        deadline = time.perf_counter() + WAIT_S
        while len(done) < n:
            try:
                smp = arrived.get_nowait() if helps else arrived.get(timeout=0.05)
            except queue.Empty:
                self.pool.check_alive(step)
                if helps and self._help(step, tasks):
                    continue
                if helps:
                    time.sleep(0.001)
                if time.perf_counter() > deadline or not any(th.is_alive() for th in threads):
                    raise RuntimeError(f"step {step}: rollout workers stopped with {n - len(done)} of {n} samples "
                                       "unfinished") from None
                continue
            deadline = time.perf_counter() + WAIT_S
            done.append(smp)
            if stream:
                closed = batcher.add(smp)
                if closed:
                    submit(closed, stream)
                elif tasks.empty() and len(batcher) and self._idle_worker():
                    submit(batcher.take(), stream)  # a worker would sit idle: hand it what there is
            if threshold is not None and not migrated:
                pending, budgets = self.pool.pending(), self.pool.budgets()
                if should_migrate(pending, budgets, n, threshold):
                    migrated = self.pool.migrate(plan_migration(pending, budgets), step)
        if stream and len(batcher):
            submit(batcher.take(), stream)
        rest = tuple(x for x in after if x not in stream)
        if rest:
            for group in _by_length(done, self.s.token_budget):
                submit(group, rest)
        tasks.closed.set()
        while helps and self._help(step, tasks):
            pass
        for th in threads:
            th.join()
        self.pool.check_alive(step)
        done.sort(key=lambda x: x.uid)
        gen = Generated.of(done, prompt_of, self.t.tokenizer, migrated)
        gen.merge(results)
        return gen

    def _complete(self, step: int, gen: Generated) -> None:
        """Stages not run during generation, as length-sorted micro-batches on the idle rollout workers."""
        missing = tuple(name for name in self.stages if _field_of(name) not in gen.rows)
        if not missing:
            return
        prompt_of = {x.uid: p for x, p in zip(gen.samples, gen.prompts, strict=True)}
        tasks = TaskQueue()
        results = [tasks.submit(lambda g=g: self._infer(step, g, missing, prompt_of))
                   for g in _by_length(gen.samples, self.s.token_budget)]
        tasks.closed.set()
        for th in self.pool.run(step, [[] for _ in range(len(self.pool))], lambda _w, _s: None, tasks):
            th.join()
        self.pool.check_alive(step)
        gen.merge(results)

    def _help(self, step: int, tasks: TaskQueue) -> bool:
        t0 = time.perf_counter()
        ran = tasks.run_one()
        if ran:
            self.t.tracer.record("inference", step, self.infer_track, t0, time.perf_counter())
        return ran

    def _idle_worker(self) -> bool:
        return any(not e.has_unfinished() for e in self.pool.engines)

    def _threshold(self) -> float | None:
        """Migration threshold for this step, or None when there is nothing to migrate between."""
        if not self.s.fused or len(self.pool) < 2:
            return None
        return resolve_threshold(self.s.migration_threshold, self.history, len(self.pool),
                                 self.pool.config.max_num_seqs)

    def _shards(self, requests: list[RolloutRequest]) -> list[list[RolloutRequest]]:
        """Whole groups (shared prompts stay on one engine's prefix cache), split as evenly as possible."""
        groups: dict[int, list[RolloutRequest]] = {}
        for r in requests:
            groups.setdefault(r.group_id, []).append(r)
        gl, k = list(groups.values()), len(self.pool)
        bounds = [round(i * len(gl) / k) for i in range(k + 1)]
        return [[r for g in gl[bounds[i]:bounds[i + 1]] for r in g] for i in range(k)]

    def _infer(self, step: int, samples: list[Sample], names: tuple[str, ...], prompt_of: dict) -> dict:
        """Run ``names`` on one micro-batch of samples; per-uid rows (token fields cut to each response)."""
        t = self.t
        prompts = [prompt_of[x.uid] for x in samples]
        texts = [decode_response(t.tokenizer, x.response_ids) for x in samples]
        mb = t.to_batch(samples, prompts, texts, {})
        per_token: dict[str, torch.Tensor] = {}
        per_sample: dict[str, torch.Tensor] = {}
        if "old_logprob" in names:
            per_token["old_logprobs"] = t.actor.compute_logprobs(mb)
        if "reference" in names:
            per_token["ref_logprobs"] = t.reference.compute_logprobs(mb)
        for c in t.critics:
            if c.role in names:
                per_token[("cost_" if c.role == "cost_critic" else "") + "values"] = c.compute_values(mb)
        if "reward" in names:
            out = t.reward.score(prompts, texts)
            out.scores = out.scores + t.shaping(samples)
            per_sample = {k: getattr(out, k) for k in ("scores", "correct", "fn_scores", "rm_scores", "costs")
                          if getattr(out, k) is not None}
        rows: dict[str, dict[int, torch.Tensor]] = {}
        for i, x in enumerate(samples):
            n = len(x.response_ids)
            for k, v in per_token.items():
                rows.setdefault(k, {})[x.uid] = v[i, :n]
            for k, v in per_sample.items():
                rows.setdefault(k, {})[x.uid] = v[i]
        return rows

    # ------------------------------------------------------------------ assembly
    def _assemble(self, step: int, gen: Generated) -> tuple[Batch, dict[str, float]]:
        """The step's ``Batch`` in sequential order, from samples whose every stage has run."""
        t = self.t
        uids = [x.uid for x in gen.samples]
        per_sample = {k: torch.stack([gen.rows[k][u] for u in uids]) for k in
                      ("scores", "correct", "fn_scores", "rm_scores", "costs") if k in gen.rows}
        batch = t.to_batch(gen.samples, gen.prompts, gen.texts, per_sample)
        width = batch["response_mask"].shape[1]
        for k, by_uid in gen.rows.items():
            if k not in per_sample:
                batch[k] = scatter_rows([([i], by_uid[u].unsqueeze(0)) for i, u in enumerate(uids)], len(uids), width)
        metrics: dict[str, float] = {"schedule/migrated_samples": float(gen.migrated)}
        a = t.cfg.algorithm
        if a.overlong_buffer:
            metrics["reward/overlong_penalty"] = float(t.shaping(gen.samples).mean())
        if t.recipe.greedy_baseline:
            with t.tracer.span("greedy_baseline", step):
                batch["baseline_scores"] = t.greedy_baseline(batch, step)
        return batch, metrics

    # ------------------------------------------------------------------ training
    def train(self, step: int, updates: dict[str, Callable[[], GroupFuture]]) -> dict[str, Any]:
        """Run the step's updates (name -> starter of a group call); their results by name.

        Fused and async modes with several updates (PPO's actor and critic) run every update
        but the last (the actor's) on a thread of its own, the last on the controller thread:
        the models never touch each other's parameters and the mini-batch shuffles are seeded
        per update, so results equal the one-after-another order. ``sequential`` keeps that
        order (``RLTrainer.overlap``), verl's, with each update on the cores of all rollout
        workers (they are idle then), as does ``fused`` with a single update (GRPO); ``async``
        with a single update trains on the controller thread alone, beside the next step's
        generation. Measured on the fusion benchmark (docs/benchmarks.md): async PPO with its
        updates side by side 121-125 samples/s, one after the other on one thread 90-92.
        """
        side_by_side = (self.s.fused or self.s.asynchronous) and len(updates) > 1
        if self.s.asynchronous and not side_by_side:
            return self.t.overlap(step, updates)  # one core trains, the others generate the next step
        if not side_by_side:
            # Nothing else runs now: each update gets the idle rollout workers' cores as intra-op
            # threads (verl trains each model on all devices, one model after the other).
            own = torch.get_num_threads()
            torch.set_num_threads(update_threads(own, len(self.pool)))
            try:
                return self.t.overlap(step, updates)
            finally:
                torch.set_num_threads(own)
        names = list(updates)
        results: dict[str, Future] = {name: Future() for name in names}
        threads = []
        for name in names[:-1]:
            if name not in self.train_tracks:  # a thread's track is named once, when first used
                self.train_tracks[name] = self.infer_track + 1 + len(self.train_tracks)
                self.t.tracer.name_track(self.train_tracks[name], f"training-{name.removesuffix('_update')}")
            track = self.train_tracks[name]
            threads.append(threading.Thread(target=self._run_update, args=(step, name, updates[name], track,
                                                                           results[name]), daemon=True,
                                            name=f"train-{name}"))
        for th in threads:
            th.start()
        self._run_update(step, names[-1], updates[names[-1]], 0, results[names[-1]])
        for th in threads:
            th.join()
        return {name: results[name].result() for name in names}  # re-raises a failed update's error

    def _run_update(self, step: int, name: str, start: Callable[[], GroupFuture], track: int, out: Future) -> None:
        with self.t.tracer.span(name, step, track=track):
            try:
                out.set_result(start().result())
            except BaseException as e:  # noqa: BLE001 - handed to the controller thread, which re-raises it
                out.set_exception(e)

    # ------------------------------------------------------------------ bookkeeping
    def step_metrics(self, step: int) -> dict[str, float]:
        """Per-step trace metrics: busy fraction per worker track, long-tail seconds."""
        events = [e for e in list(self.t.tracer.events) if e.get("args", {}).get("step") == step]
        meta = [{"ph": "M", "name": "thread_name", "pid": 0, "tid": k, "args": {"name": v}}
                for k, v in self.t.tracer.tracks.items()]
        return trace_step_metrics(parse_trace(meta + events), step)

    def save(self, ckpt_dir) -> None:
        """Checkpoint writer: a pending prefetch's samples (waited for), so a resume continues exactly."""
        if self.prefetch is not None:
            save_pending(Path(ckpt_dir), self.prefetch[0], self.prefetch[1].result().samples)

    def _restore(self, ckpt_dir) -> None:
        """Take the checkpoint's prefetched samples as the next step's, drawing its prompts again."""
        pending = load_pending(Path(ckpt_dir))
        if pending is None:
            return
        step, samples = pending
        t, cursor = self.t, self.t.stream.cursor
        requests, prompts = t.requests_for(step, 0, t.cfg.trainer.prompts_per_step, 0)
        by_uid = {r.uid: (r, p) for r, p in zip(requests, prompts, strict=True)}
        if sorted(by_uid) != sorted(x.uid for x in samples) or any(
                by_uid[x.uid][0].prompt_ids != x.prompt_ids for x in samples):
            raise ValueError(f"{ckpt_dir}: the saved samples of step {step} do not match this config's prompts "
                             "(were trainer.prompts_per_step, algorithm.group_size or the task changed?)")
        samples.sort(key=lambda x: x.uid)
        gen = Generated.of(samples, {uid: p for uid, (_r, p) in by_uid.items()}, t.tokenizer)
        fut: Future = Future()
        fut.set_result(gen)
        self.prefetch = (step, fut, cursor)

    def cursor(self) -> int:
        """Prompts consumed by finished steps: a pending prefetch's draw is redone on resume."""
        return self.prefetch[2] if self.prefetch is not None else self.t.stream.cursor

    def close(self) -> None:
        if self.prefetch is not None:
            try:
                self.prefetch[1].result(timeout=WAIT_S)
            except Exception:  # noqa: BLE001 - the run is ending; its samples are not used
                pass
            self.prefetch = None


def update_threads(per_worker: int, workers: int) -> int:
    """Intra-op threads for an update that takes the idle workers' cores: theirs, never more than the machine's."""
    return min(per_worker * workers, available_cores())


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _field_of(stage: str) -> str:
    """The batch field a stage fills (used to see which stages already ran)."""
    return {"old_logprob": "old_logprobs", "reference": "ref_logprobs", "reward": "scores",
            "critic": "values", "cost_critic": "cost_values"}[stage]


def _by_length(samples: list[Sample], budget: int) -> list[list[Sample]]:
    """Whole-batch inference micro-batches: samples sorted by length, cut by the token budget."""
    ordered = sorted(samples, key=lambda x: (len(x.prompt_ids) + len(x.response_ids), x.uid))
    batcher: TokenBudgetBatcher[Sample] = TokenBudgetBatcher(budget)
    out = [g for x in ordered if (g := batcher.add(x))]
    last = batcher.flush()
    return out + ([last] if last else [])

