"""Execution modes as strategies over the stages and the worker groups (``schedule.mode``).

Every strategy has one small interface (``Strategy``): ``make_experience`` (samples with
rewards, old/reference log-probs and values), ``train`` (the step's updates), ``step_metrics``
and the checkpoint hooks. It receives the ``Stages`` (and through them the worker groups),
never the trainer, so the algorithm program (``RLTrainer.step``) is the same in every mode:

- ``sequential`` with one rollout worker (``Sequential``): verl's order through the actor
  group's own rollout, on any backend.
- ``sequential`` with ``rollout_workers > 1``: generation split over the rollout workers,
  then inference micro-batches on all of them, then training (verl's order on N workers).
- ``fused``: every finished sample joins a token-budget micro-batch that goes to inference at
  once, while generation goes on; a worker with no samples left runs inference; once the
  unfinished samples drop to the threshold they migrate onto the fewest workers
  (``policy.migration``) and the freed workers run inference. On replica processes the next
  step's generation starts as soon as the actor has trained (its weights synced), beside the
  critics' updates and the step's bookkeeping; its critic values wait until the critics have
  trained (``Updates.run``'s gate), so it is exactly the step the sequential order gives.
- ``async``: the rollout decodes with a copy of the actor's weights, so generation for step
  t+1 runs during training of step t (admitted by the staleness bound); old log-probs and
  critic values are computed afterwards with the current models (the decoupled loss's
  proximal policy); the frozen reference and reward may run during training.
- ``elastic`` (RLHFless): each step the replica count comes from the cost-aware rule on
  predicted response lengths (``policy.elastic``, ``policy.lengths``), prompts are dealt to
  replicas by predicted length with each group on one replica (its prompt prefix is prefilled
  once there), and a replica is released the moment it has no work; worker-seconds bill the
  time each replica is held.
- ``fused+async``, ``fused+elastic``: both. On replica processes a fused+async prefetch streams the
  reference and reward while the step trains and the critics' values once its updates have ended; once
  its decode is done too, it syncs the replicas to the trained actor, and they compute the old
  log-probs at once instead of after the prefetch's streamed inference.

The receive loop of a generation (streamed micro-batches, the early start's held critic values,
the migration trigger) is ``schedule.streaming``; the updates' order is ``schedule.updates``.
Every mode runs on either pool: threads of this process (``pool``, backend=local) or replica
processes on Ray (``ray_pool``, backend=ray with ``placement.rollout``); the strategy code is the same.
The reserved modes hold all ``rollout_workers`` for the whole step (as a reserved device set is
billed); ``time/rollout_worker_seconds`` reports that, and ``elastic`` reports the held time.
Sample tokens never depend on the mode (per-request seeds, exported sampler state on
migration); inference values differ only by float summation order (micro-batch widths).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, wait
from contextlib import nullcontext
from functools import partial
from pathlib import Path
from typing import Any

from fuseflow.controller.group import Future as GroupFuture
from fuseflow.controller.group import background
from fuseflow.data.batch import Batch
from fuseflow.policy.migration import resolve_threshold
from fuseflow.rollout.base import RolloutRequest, Sample
from fuseflow.rollout.engine import EngineConfig
from fuseflow.telemetry.gantt import parse_trace, trace_step_metrics

from .base import SPAN_OF, Sequential, Strategy, available_cores, update_threads
from .elastic import ReplicaChooser
from .pending import load_pending, save_pending
from .pool import RolloutPool, TaskQueue
from .ray_pool import RayRolloutPool
from .stages import FROZEN, Generated, Stages, field_of
from .staleness import check_staleness, min_version_for, staleness_metrics
from .streaming import WAIT_S, Feed, by_length, receive
from .updates import Gate, Updates

__all__ = ["MODES", "SPAN_OF", "Sequential", "Strategy", "Pooled", "available_cores", "make_strategy",
           "update_threads"]


class Pooled(Strategy):
    """Rollout workers that generate and run inference: threads of this process (``schedule.pool``) on the
    local backend, replica processes on Ray (``schedule.ray_pool``, when the roles carry a ``rollout``).

    Subclasses switch on ``fused`` (streamed inference, migration, side-by-side updates),
    ``asynchronous`` (generation one step ahead on a weight copy) and ``elastic``.
    """

    fused = asynchronous = elastic = False

    def __init__(self, stages: Stages, resumed_from: Path | None, start_step: int):
        super().__init__(stages)
        cfg, s = stages.cfg, self.s
        r = cfg.rollout
        if stages.roles.rollout is not None:  # replica processes with weights of their own
            self.pool: RolloutPool | RayRolloutPool = RayRolloutPool(stages.roles.rollout, stages.roles.actor,
                                                                     self.tracer, first_track=1)
        else:  # async decodes while the actor trains, so the rollout needs weights of its own
            # The model builders, imported only where the workers are threads of this process.
            from fuseflow.workers.build import engine_factory

            model = stages.roles.actor.rollout_model(copy=self.asynchronous)
            self.pool = RolloutPool(model, s.rollout_workers, EngineConfig(r.max_num_seqs, r.kv_budget_tokens),
                                    stages.tokenizer, self.tracer, first_track=1, make_engine=engine_factory(cfg))
        self.replicas = 0 if self.elastic else len(self.pool)
        self.infer_track = s.rollout_workers + 1
        self.tracer.name_track(self.infer_track, "inference")
        self.names = stages.roles.inference_stages
        self.critic_stages = tuple(c.role for c in stages.roles.critics)  # stages that wait for the critics' updates
        self.version = start_step  # policy version the rollout holds
        self.prefetch: tuple[int, Future, int] | None = None  # (step, result, stream cursor before its draw)
        self.history: list[list[int]] = []  # response lengths of earlier steps (auto threshold)
        self.updates = Updates(self.tracer, [stages.roles.actor, *stages.roles.critics], self.pool,
                               self.infer_track + 1, side_by_side=self.fused or self.asynchronous,
                               beside_generation=self.asynchronous)
        self.chooser = ReplicaChooser(s, cfg.model.max_response_len / 2) if self.elastic else None
        # Fused on replica processes: the next step starts decoding once the actor has trained (``_start_early``).
        # Not on threads (they would share this process's GIL with the critics' updates) nor with elastic's
        # per-step replica count, whose billing spans one step.
        self.early = self.fused and not (self.asynchronous or self.elastic or self.pool.threaded)
        # Fused+async on replica processes: a prefetch streams the critics' values once this step's updates
        # have ended (``_trained``), and syncs the replicas as soon as its decode is done too, so that they
        # compute the old log-probs then instead of after its streamed inference (``_generate``).
        self.stream_prefetch = self.fused and self.asynchronous and not self.pool.threaded
        self._trained: Gate | None = None
        self._prefetch_sync: dict[str, float] = {}  # that sync's figures, reported with the step it served
        self._gen_seconds = 0.0
        self._sync: dict[str, float] = {}  # the step's weight transfer to the rollout (seconds, MB per replica)
        self._scored = self._scored_ref = self._stolen = 0
        if resumed_from is not None:
            self._restore(resumed_from)

    # ------------------------------------------------------------------ the step's experience
    def make_experience(self, step: int) -> tuple[Batch, dict[str, float]]:
        self._begin()
        s = self.s
        # Training is over: a prefetch still decoding gets full priority (on Ray a round trip to every
        # replica, so only when a prefetch may be decoding). An early start has it once the updates ended.
        if self.prefetch is not None and not (self.early or self.stream_prefetch):
            self.pool.restore_priority()
        gen, metrics = self.stages.collect(step, self._draw)
        if self._prefetch_sync:
            self._sync, self._prefetch_sync = self._prefetch_sync, {}
        self._set_weights(step - 1)
        # Async: old log-probs and values need the just-trained models, so they run after the
        # previous step's training; running them here, on every worker and before the next step's
        # generation starts, keeps them off the critical path's single controller thread and lets
        # that generation overlap this step's training instead of this inference. Otherwise every
        # stage already ran during generation (a prefetch restored into a non-async mode aside).
        self._complete(step, gen)
        if self.asynchronous and step < self.stages.cfg.trainer.steps:
            self._start_prefetch(step + 1)
        batch, more = self.stages.assemble(step, gen)
        metrics |= more | {"schedule/migrated_samples": float(gen.migrated)} | self.pool.sync_metrics
        if self.asynchronous:
            versions = batch.meta["policy_version"]
            check_staleness(versions, step, s.max_staleness, batch.meta["uid"])
            metrics |= staleness_metrics(versions, step, s.max_staleness)
        self.history = [*self.history[-4:], [len(x.response_ids) for x in gen.samples]]
        return batch, metrics

    def _draw(self, step: int, rnd: int, n: int, offset: int) -> Generated:
        """One draw round: the prefetched generation of round 0, or a fresh one on the workers."""
        if rnd == 0 and self.prefetch is not None and self.prefetch[0] == step:
            gen = self.prefetch[1].result()  # generated during the previous step's training
            self.prefetch = None
            return gen
        self._set_weights(step - 1)
        drawn = self.stages.requests_for(step, rnd, n, offset)
        # With dynamic sampling only the reward must run before the kept groups are known.
        after = ("reward",) if self.stages.cfg.algorithm.dynamic_sampling else self.names
        return self._generate(step, drawn, stream=self.names if self.fused else (), after=after, foreground=True)

    def _set_weights(self, version: int) -> None:
        """Give the (idle) rollout the actor's weights at ``version``: in-process they are shared (async
        copies them); replica processes receive a broadcast from the actor's rank 0."""
        if (sync := self._sync_weights(version)) is not None:
            self._sync = sync

    def _sync_weights(self, version: int) -> dict[str, float] | None:
        """``_set_weights``'s transfer; its figures, or None when the rollout holds ``version`` already."""
        if version == self.pool.policy_version and self.version == version:
            return None
        t0 = time.perf_counter()
        sent = self.pool.set_weights(version, self.stages.roles.actor.rollout_weights if self.asynchronous else None)
        # The pool's own figures win: an in-process vLLM's push (its MB, seconds per MB, buckets) is the
        # transfer even where the weights themselves are shared (0 bytes copied).
        self.version = version
        return ({"time/rollout_weight_sync": time.perf_counter() - t0, "rollout/weight_sync_mb": sent / 2**20}
                | self.pool.sync_metrics)

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
        if self.version < min_version_for(step, self.s.max_staleness):
            return  # max_staleness=0: the next step waits for this step's weights (sequential order)
        if self.stream_prefetch:
            gate = self._trained = Gate()
            held = self.critic_stages
            self._prefetch(step, lambda drawn: self._generate(step, drawn, stream=(*FROZEN, *held), after=self.names,
                                                              foreground=False, gate=gate, held=held, sync=True))
            return
        stream = FROZEN if self.fused else ()
        self._prefetch(step, lambda drawn: self._generate(step, drawn, stream=stream, after=FROZEN, foreground=False))

    def _start_early(self, step: int, gate: Gate) -> None:
        """The actor has trained: sync the replicas and start decoding ``step`` now, beside the critics'
        updates (under SCHED_IDLE until ``gate`` opens), with its critic values held until then. A failed
        sync fails that step, not this one (whose checkpoint is still to be written)."""
        try:
            self._set_weights(step - 1)
        except Exception as e:  # noqa: BLE001 - raised by the next step, which takes this result
            failed: Future = Future()
            failed.set_exception(e)
            self.prefetch = (step, failed, self.stages.stream.cursor)
            return
        after = ("reward",) if self.stages.cfg.algorithm.dynamic_sampling else self.names
        held = self.critic_stages
        self._prefetch(step, lambda drawn: self._generate(step, drawn, stream=self.names, after=after,
                                                          foreground=False, gate=gate, held=held))

    def _prefetch(self, step: int, generate: Callable[[tuple], Generated]) -> None:
        """Draw ``step``'s first round now and run ``generate(drawn)`` on a thread: ``self.prefetch``."""
        cursor = self.stages.stream.cursor
        drawn = self.stages.requests_for(step, 0, self.stages.cfg.trainer.prompts_per_step, 0)
        fut: Future = Future()

        def run() -> None:
            try:
                fut.set_result(generate(drawn))
            except BaseException as e:
                fut.set_exception(e)

        threading.Thread(target=run, daemon=True, name=f"prefetch-{step}").start()
        self.prefetch = (step, fut, cursor)

    # ------------------------------------------------------------------ generation + streamed inference
    def _generate(self, step: int, drawn: tuple[list[RolloutRequest], list], stream: tuple[str, ...],
                  after: tuple[str, ...], foreground: bool, gate: Gate | None = None,
                  held: tuple[str, ...] = (), sync: bool = False) -> Generated:
        """Decode ``drawn`` on the rollout workers; stages in ``stream`` run per micro-batch as samples
        finish, stages in ``after`` (and not streamed) run once all are done, both on free workers.
        With a ``gate`` (an early start, or a fused+async prefetch), stages in ``held`` wait until it
        opens, and the workers then leave the background (they started in it). ``sync`` (a prefetch):
        once every sample is in and the gate is open, the workers take the actor's trained weights, so
        that they can compute the old log-probs of ``after``."""
        requests, prompts = drawn
        tasks, arrived = TaskQueue(), queue.Queue()
        prompt_of = {r.uid: p for r, p in zip(requests, prompts, strict=True)}
        shards = self.chooser.shards(requests, self.pool) if self.chooser else self._shards(requests)
        left = [len(shard) for shard in shards]  # unfinished samples per worker (until a migration moves some)
        t_start = time.perf_counter()
        # A background (prefetch) generation runs beside training, the critical path: its workers
        # run under SCHED_IDLE so that training keeps its core (measured in docs/benchmarks.md).
        self.pool.run(step, shards, lambda w, smp: arrived.put((w, smp)), tasks, background=not foreground,
                      release_when_idle=self.elastic)
        # With one rollout worker thread the controller thread is the second core's inference worker.
        helps = foreground and len(self.pool) == 1 and self.pool.threaded
        ref_logprob = self._replica_ref_logprobs()
        # Inference that runs while this generation decodes (streamed) or while training goes on (a
        # prefetch) is background work in the roles' processes: it takes only the cores that the
        # critical path leaves idle (``controller.group.background``).
        lane = background if stream or not foreground else nullcontext

        def infer(group: list[Sample], names: tuple[str, ...]) -> dict:
            with lane():  # the replicas' version decides at each call (``sync`` changes it mid-generation)
                return self.stages.infer(group, names, prompt_of, self._replica_logprobs(step), ref_logprob)

        feed = Feed(step, tasks, infer, stream, self.s.token_budget, self._idle_live,
                    serve=self.pool.serve if self.elastic else None, gate=gate, held=held,
                    foreground=self.pool.foreground if gate is not None else lambda: None)
        done, migrated, last_finish = receive(self.pool, step, len(requests), arrived, feed, left, self._threshold(),
                                              partial(self._help, step, tasks) if helps else None)
        self._gen_seconds = time.perf_counter() - t_start
        if sync and gate is not None:
            gate.wait()
            if gate.ok:  # else ``feed.finish`` raises the failed update's error
                self._prefetch_sync = self._sync_weights(step - 1) or {}
        if self.chooser and last_finish:
            self.chooser.info["elastic/tail_seconds"] = max(last_finish.values()) - min(last_finish.values())
        feed.finish(done, after)
        while helps and self._help(step, tasks):
            pass
        # Every sample is in: pack them while the workers finish the step's inference.
        gen = Generated.of(done, prompt_of, self.stages.tokenizer, migrated)
        self.stages.pack(gen)
        self.pool.join()
        self.pool.check_alive(step)
        if self.chooser:
            self.chooser.observe(requests, done)
        gen.merge(feed.results)
        return gen

    def _complete(self, step: int, gen: Generated) -> None:
        """Stages not run yet on some samples, as length-sorted micro-batches on the idle rollout workers."""
        missing = tuple(name for name in self.names if any(x.uid not in gen.rows.get(field_of(name), {})
                                                             for x in gen.samples))
        if not missing:
            return
        prompt_of = {x.uid: p for x, p in zip(gen.samples, gen.prompts, strict=True)}
        tasks, old_logprob, ref_logprob = TaskQueue(), self._replica_logprobs(step), self._replica_ref_logprobs()
        results = [tasks.submit(lambda g=g: self.stages.infer(g, missing, prompt_of, old_logprob, ref_logprob))
                   for g in by_length(gen.samples, self.s.token_budget)]
        tasks.close()
        self.pool.run(step, [[] for _ in range(len(self.pool))], lambda _w, _s: None, tasks,
                      release_when_idle=self.elastic)
        if self.elastic:
            self.pool.serve(len(results))
        self.pool.join()
        self.pool.check_alive(step)
        gen.merge(results)

    def _help(self, step: int, tasks: TaskQueue) -> bool:
        t0 = time.perf_counter()
        ran = tasks.run_one()
        if ran:
            self.tracer.record("inference", step, self.infer_track, t0, time.perf_counter())
        return ran

    def _replica_logprobs(self, step: int) -> Callable | None:
        """Replica processes may compute step ``step``'s old log-probs while they hold the weights the
        actor has now (version ``step - 1``); None on threads (they run the actor's call themselves)."""
        if self.pool.threaded or self.pool.policy_version != step - 1:
            return None
        return lambda batch, own: self.pool.logprobs_future(batch, lane=own)

    def _replica_ref_logprobs(self) -> Callable | None:
        """Replica processes may compute reference log-probs at any time (a frozen copy each); None on threads."""
        if self.pool.threaded:
            return None
        return lambda batch, own: self.pool.logprobs_future(batch, reference=True, lane=own)

    def _idle_live(self) -> int:
        """Workers that would take an inference task now (threads: held ones with nothing to decode)."""
        return self.pool.idle_live()

    def _threshold(self) -> float | None:
        """Migration threshold for this step, or None when there is nothing to migrate between."""
        if not self.fused or len(self.pool) < 2:
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

    # ------------------------------------------------------------------ training
    def train(self, step: int, updates: dict[str, Callable[[], GroupFuture]]) -> dict[str, Any]:
        """Run the step's updates (name -> starter of a group call); their results by name. Side by side
        in fused and async modes, else one after the other on every idle core (``schedule.updates``)."""
        early = self.early and step < self.stages.cfg.trainer.steps
        trained, self._trained, ok = self._trained, None, False
        try:
            out = self.updates.run(step, updates, partial(self._start_early, step + 1) if early else None)
            ok = True
            return out
        finally:
            if trained is not None:  # a streaming prefetch's held stages may go (or, after a failure, stop)
                trained.open(ok)

    # ------------------------------------------------------------------ bookkeeping
    def step_metrics(self, step: int) -> dict[str, float]:
        """Busy fraction per worker track, long-tail seconds, worker-seconds (and elastic's choice)."""
        mark = self._mark
        out = super().step_metrics(step) | self._sync
        self._sync = {}
        if not self.pool.threaded:  # micro-batches whose old log-probs a free replica process computed
            out["schedule/replica_logprob_batches"] = float(self.pool.scored - self._scored)
            out["schedule/replica_ref_batches"] = float(self.pool.scored_ref - self._scored_ref)
            # ... of which a replica took over from the roles' lane, where they waited
            out["schedule/replica_stolen_batches"] = float(self.pool.stolen - self._stolen)
            self._scored, self._scored_ref, self._stolen = self.pool.scored, self.pool.scored_ref, self.pool.stolen
        if self.elastic:  # held time of the threads that ended since the step began (clipped to it)
            held = [(t1 - max(t0, mark)) for _w, t0, t1 in self.pool.held if t1 > mark]
            out["time/rollout_worker_seconds"] = sum(held)
            out |= self.chooser.info
            self.chooser.rest = max(0.0, (time.perf_counter() - mark) - self._gen_seconds)
        self.pool.held.clear()  # read by elastic only; emptied every step so it never piles up
        events = self.tracer.events_for(step)
        meta = [{"ph": "M", "name": "thread_name", "pid": 0, "tid": k, "args": {"name": v}}
                for k, v in self.tracer.tracks.items()]
        return out | trace_step_metrics(parse_trace(meta + events), step)

    def save(self, ckpt_dir) -> None:
        """Checkpoint writer: a pending async prefetch's samples (waited for), so a resume continues exactly.
        An early start's are not saved, nor waited for (its failure must not cost the checkpoint of the step
        that trained): a resume draws its prompts again and decodes them, token for token, from the saved
        weights. Only samples are saved: a resume computes their inference again in length-sorted
        micro-batches, so after fused+async's streamed ones its values agree to float summation order,
        as in any fused run."""
        if self.prefetch is not None and not self.early:
            save_pending(Path(ckpt_dir), self.prefetch[0], self.prefetch[1].result().samples)

    def _restore(self, ckpt_dir) -> None:
        """Take the checkpoint's prefetched samples as the next step's, drawing its prompts again."""
        pending = load_pending(Path(ckpt_dir))
        if pending is None:
            return
        step, samples = pending
        st, cursor = self.stages, self.stages.stream.cursor
        requests, prompts = st.requests_for(step, 0, st.cfg.trainer.prompts_per_step, 0)
        by_uid = {r.uid: (r, p) for r, p in zip(requests, prompts, strict=True)}
        if sorted(by_uid) != sorted(x.uid for x in samples) or any(
                by_uid[x.uid][0].prompt_ids != x.prompt_ids for x in samples):
            raise ValueError(f"{ckpt_dir}: the saved samples of step {step} do not match this config's prompts "
                             "(were trainer.prompts_per_step, algorithm.group_size or the task changed?)")
        prompt_of = {uid: p for uid, (_r, p) in by_uid.items()}
        gen = Generated.of(samples, prompt_of, st.tokenizer)
        gen.merge([st.infer(gen.samples, ("reward",), prompt_of)])
        fut: Future = Future()
        fut.set_result(gen)
        self.prefetch = (step, fut, cursor)

    def cursor(self) -> int:
        """Prompts consumed by finished steps: a pending prefetch's draw is redone on resume."""
        return self.prefetch[2] if self.prefetch is not None else self.stages.stream.cursor

    def close(self) -> None:
        if self._trained is not None:  # no update will open it: the prefetch must not wait for one
            self._trained.open(False)
            self._trained = None
        if self.prefetch is not None:
            try:
                self.prefetch[1].result(timeout=WAIT_S)
            except Exception:  # noqa: BLE001 - the run is ending; its samples are not used
                pass
            self.prefetch = None


class Fused(Pooled):
    fused = True


class Async(Pooled):
    asynchronous = True


class FusedAsync(Pooled):
    fused = asynchronous = True


class Elastic(Pooled):
    elastic = True


class FusedElastic(Pooled):
    fused = elastic = True


MODES: dict[str, type[Pooled]] = {"sequential": Pooled, "fused": Fused, "async": Async, "fused+async": FusedAsync,
                                  "elastic": Elastic, "fused+elastic": FusedElastic}


def make_strategy(stages: Stages, resumed_from: Path | None = None, start_step: int = 0) -> Strategy:
    """The strategy for ``schedule``: ``Sequential`` for one rollout worker, else the mode's pooled strategy."""
    s = stages.cfg.schedule
    if s.mode == "sequential" and s.rollout_workers == 1 and stages.roles.rollout is None:
        return Sequential(stages)
    return MODES[s.mode](stages, resumed_from, start_step)

