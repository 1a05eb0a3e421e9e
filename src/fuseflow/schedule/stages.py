"""The stages every execution mode shares: drawing requests, scoring, inference, assembling the ``Batch``.

A strategy (``fuseflow.schedule.modes``) decides *when* and *where* each stage runs; this module
is *what* runs, written once: the seeded requests of a step, the reward (with DAPO's overlong
shaping), the inference calls that fill ``old_logprobs``, ``ref_logprobs`` and the critics'
values, ReMax's greedy baseline, DAPO's dynamic sampling (``Stages.collect``) and the packing of
finished samples into a ``Batch``. ``Stages`` holds the worker groups (``Roles``) and the data it
needs, never the trainer.

Inference results travel as per-uid rows (``Generated.rows``: field -> uid -> tensor), so a
stage may run on any micro-batch of a step's samples, in any order, and the step's batch is
still assembled in the order a sequential run gives it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fuseflow.controller.group import Future, WorkerGroup
from fuseflow.data.batch import Batch, pad_rows, unpad
from fuseflow.data.tokenizer import stop_token_ids
from fuseflow.evaluate import decode_response
from fuseflow.recipes import informative_groups, overlong_penalty
from fuseflow.rollout.base import RolloutRequest, Sample, SamplingParams
from fuseflow.rollout.sampler import make_requests
from fuseflow.workers.common import samples_to_batch

REWARD_FIELDS = ("scores", "correct", "fn_scores", "rm_scores", "costs")  # RewardOutput's (B,) fields
CRITIC_PREFIX = {"critic": "", "cost_critic": "cost_"}  # the batch fields each critic reads and fills
FROZEN = ("reference", "reward")  # stages whose models never train: may run while the actor trains


def field_of(stage: str) -> str:
    """The batch field a stage fills (used to see which stages already ran)."""
    return {"old_logprob": "old_logprobs", "reference": "ref_logprobs", "reward": "scores",
            "critic": "values", "cost_critic": "cost_values"}[stage]


def overlap(tracer, step: int, calls: dict[str, Callable[[], Future]]) -> dict[str, Any]:
    """Start every call, then collect each: on Ray, groups on different pools compute at the same time.

    Each call's span covers its start and its wait (in-process calls run as they start);
    colocated groups share processes, so their calls still run one after another.
    """
    futures = {}
    for name, start in calls.items():
        with tracer.span(name, step):
            futures[name] = start()
    out = {}
    for name, future in futures.items():
        with tracer.span(name, step):
            out[name] = future.result()
    return out


@dataclass
class Roles:
    """The worker groups a strategy drives (the trainer builds them on the configured backend)."""

    actor: WorkerGroup
    reference: WorkerGroup
    reward: WorkerGroup
    critics: list[WorkerGroup]
    rollout: Any = None  # backend=ray: the rollout replica processes (controller.replica.ReplicaSet); local: None
    old_from_rollout: bool = False  # algorithm.old_logprobs=rollout: no old-log-prob stage (see Stages.assemble)

    @property
    def inference_stages(self) -> tuple[str, ...]:
        """Every stage that runs on finished samples before training, by name."""
        old = () if self.old_from_rollout else ("old_logprob",)
        return (*old, "reference", "reward", *(c.role for c in self.critics))


@dataclass
class Generated:
    """Samples plus whatever inference already ran on them, keyed by uid."""

    samples: list[Sample]  # in uid order (the order of a sequential run's batch)
    prompts: list  # task Prompt per sample
    texts: list[str]  # decoded responses (no special tokens)
    rows: dict[str, dict[int, torch.Tensor]] = field(default_factory=dict)  # field -> uid -> (Tr_i,) or ()
    migrated: int = 0
    packed: Batch | None = None  # these samples as a Batch without inference fields (``Stages.pack``)

    @classmethod
    def of(cls, samples: list[Sample], prompt_of: dict, tokenizer, migrated: int = 0) -> Generated:
        """Samples (put in uid order) with their task prompts (by uid) and decoded responses."""
        samples = sorted(samples, key=lambda x: x.uid)
        return cls(samples, [prompt_of[x.uid] for x in samples],
                   [decode_response(tokenizer, x.response_ids) for x in samples], migrated=migrated)

    def merge(self, results: Sequence) -> None:
        """Add per-uid rows: dicts, or futures of dicts (``Stages.infer`` results run as tasks)."""
        for r in results:
            for name, by_uid in (r.result() if hasattr(r, "result") else r).items():
                self.rows.setdefault(name, {}).update(by_uid)

    def select(self, uids: list[int]) -> Generated:
        """These samples (in this order) with their rows."""
        at = {x.uid: i for i, x in enumerate(self.samples)}
        idx = [at[u] for u in uids]
        return Generated([self.samples[i] for i in idx], [self.prompts[i] for i in idx],
                         [self.texts[i] for i in idx],
                         {k: {u: v[u] for u in uids} for k, v in self.rows.items()}, self.migrated)

    @staticmethod
    def concat(parts: Sequence[Generated]) -> Generated:
        """All ``parts`` as one, in the given order (not re-sorted by uid), with their rows merged by uid and
        their ``migrated`` counts summed; ``packed`` is not carried over."""
        out = Generated([], [], [], {}, sum(p.migrated for p in parts))
        for p in parts:
            out.samples += p.samples
            out.prompts += p.prompts
            out.texts += p.texts
            out.merge([p.rows])
        return out


# One draw round: (step, round, prompts to draw, group offset) -> the round's samples, with at least the
# reward rows; the strategy draws the requests itself (``Stages.requests_for``) or had drawn them (async).
Draw = Callable[[int, int, int, int], Generated]


class Stages:
    """What each RL step computes before advantages, for any strategy.

    ``roles``: the worker groups; ``train_prompts``/``train_ids``: the task's training prompts
    and their token ids; ``stream``: the seeded prompt order (``PromptStream``, its cursor is
    the data state of a checkpoint); ``tracer``: spans per stage.
    """

    def __init__(self, cfg, roles: Roles, tokenizer, train_prompts: list, train_ids: list[list[int]], stream,
                 tracer, recipe):
        self.cfg, self.roles, self.tokenizer, self.recipe = cfg, roles, tokenizer, recipe
        self.train_prompts, self.train_ids, self.stream, self.tracer = train_prompts, train_ids, stream, tracer

    @property
    def sampling(self) -> SamplingParams:
        """The rollout's sampling parameters (a request's seed is set per request)."""
        r = self.cfg.rollout
        return SamplingParams(r.temperature, r.top_p, r.top_k, False, self.cfg.model.max_response_len,
                              stop_token_ids(self.tokenizer))

    # ------------------------------------------------------------------ drawing
    def requests_for(self, step: int, rnd: int, n: int, offset: int) -> tuple[list[RolloutRequest], list]:
        """``n`` fresh prompts x ``group_size`` seeded requests for ``step`` and each request's task prompt.

        Seeds depend on the step and draw round only (round 0 keeps the seeds of a run without
        dynamic sampling), so every schedule mode draws the same tokens for the same step. Group
        ids start at ``offset`` and uids at ``offset * group_size``, unique across a step's rounds.
        """
        cfg, g = self.cfg, self.cfg.algorithm.group_size
        idx = self.stream.take(n)
        prompts = [self.train_prompts[i] for i in idx for _ in range(g)]
        requests = make_requests([self.train_ids[i] for i in idx], self.sampling, g,
                                 seed=cfg.seed * 100_003 + step + rnd * 10_000_019, group_offset=offset)
        return [dataclasses.replace(r, uid=r.uid + offset * g) for r in requests], prompts

    # ------------------------------------------------------------------ scoring and inference
    def shaping(self, samples: Sequence[Sample]) -> torch.Tensor:
        """Per-sample score shaping (B,): DAPO's overlong penalty, zeros when it is off."""
        a = self.cfg.algorithm
        lengths = torch.tensor([len(s.response_ids) for s in samples])
        return overlong_penalty(lengths, self.cfg.model.max_response_len, a.overlong_buffer, a.overlong_penalty)

    def score(self, samples: Sequence[Sample], prompts: list, texts: list[str]) -> dict[str, torch.Tensor]:
        """The reward group's (B,) fields for these samples, the shaping added to ``scores``."""
        out = self.roles.reward.score(prompts, texts)
        out.scores = out.scores + self.shaping(samples)
        return {k: getattr(out, k) for k in REWARD_FIELDS if getattr(out, k) is not None}

    def pack(self, gen: Generated) -> Batch:
        """``gen``'s samples as a ``Batch`` without inference fields, built once and kept on ``gen``: a pooled
        strategy packs them as soon as generation ends, while the step's last inference still runs, so that
        ``assemble`` (the controller's serial path between that inference and training) only adds fields."""
        if gen.packed is None:
            gen.packed = self.to_batch(gen.samples, gen.prompts, gen.texts, {})
        return gen.packed

    def to_batch(self, samples: list, prompts: list, texts: list[str], fields: dict[str, torch.Tensor]) -> Batch:
        """Finished samples packed as a ``Batch``; ``fields`` are per-sample (B,) values to add."""
        batch = samples_to_batch(samples, self.tokenizer.pad_token_id, [p.text for p in prompts], texts)
        batch.meta["task_prompt"] = prompts  # the task's Prompt objects (answers, metadata) per sample
        for k, v in fields.items():
            batch[k] = v
        return batch

    def inference_calls(self, batch: Batch, names: Sequence[str],
                        old_logprob: Callable[[Batch], Future | None] | None = None,
                        ref_logprob: Callable[[Batch], Future | None] | None = None
                        ) -> dict[str, Callable[[], Future]]:
        """Starters of the model inference stages in ``names`` on ``batch``, keyed by the field each fills.

        ``old_logprob``: another place that holds the actor's current weights (the rollout replicas on
        Ray), called with the batch and the actor group's own call: it starts the log-probs where it
        can (a free replica, else that call, which a replica may take over later) or returns None, and
        the actor group then computes them. ``ref_logprob``: the same for the reference log-probs (a
        replica's copy of the reference) and the reference group.
        """
        r = self.roles
        calls = {}
        # The critics first: on Ray their values run only in the roles' process, whose lane runs calls in
        # order; log-probs queued behind them can still be taken over by a replica that comes free.
        for c in r.critics:
            if c.role in names:
                calls[f"{CRITIC_PREFIX[c.role]}values"] = lambda c=c: c.compute_values.future(batch)
        if "old_logprob" in names:
            own = r.actor.compute_logprobs.future
            calls["old_logprobs"] = lambda: (old_logprob(batch, own) if old_logprob else None) or own(batch)
        if "reference" in names:
            own_ref = r.reference.compute_logprobs.future
            calls["ref_logprobs"] = lambda: (ref_logprob(batch, own_ref) if ref_logprob else None) or own_ref(batch)
        return calls

    def infer(self, samples: list[Sample], names: Sequence[str], prompt_of: dict,
              old_logprob: Callable[[Batch], Future | None] | None = None,
              ref_logprob: Callable[[Batch], Future | None] | None = None) -> dict[str, dict]:
        """Run the stages ``names`` on one micro-batch of samples; per-uid rows (token fields cut to each
        response). Runs on whichever thread calls it (a rollout worker that is free, in pooled modes);
        ``old_logprob`` and ``ref_logprob`` as in ``inference_calls``."""
        prompts = [prompt_of[x.uid] for x in samples]
        texts = [decode_response(self.tokenizer, x.response_ids) for x in samples]
        started = {}
        if any(name != "reward" for name in names):  # every model stage starts before any is waited for
            mb = self.to_batch(samples, prompts, texts, {})
            calls = self.inference_calls(mb, names, old_logprob, ref_logprob)
            started = {k: start() for k, start in calls.items()}
        per_sample = self.score(samples, prompts, texts) if "reward" in names else {}
        per_token = {k: f.result() for k, f in started.items()}
        rows: dict[str, dict[int, torch.Tensor]] = {}
        for i, x in enumerate(samples):
            n = len(x.response_ids)
            for k, v in per_token.items():
                rows.setdefault(k, {})[x.uid] = v[i, :n]
            for k, v in per_sample.items():
                rows.setdefault(k, {})[x.uid] = v[i]
        return rows

    # ------------------------------------------------------------------ DAPO's dynamic sampling
    def collect(self, step: int, draw: Draw) -> tuple[Generated, dict[str, float]]:
        """``prompts_per_step`` groups for ``step``, each round generated and scored by ``draw``.

        With ``algorithm.dynamic_sampling`` (DAPO), groups whose scores are all equal carry
        no group-relative signal and are dropped; more prompts are drawn, sized by the keep
        rate so far, for at most ``max_extra_draws`` more rounds. A batch still short after
        that is topped up with dropped groups, so its shape never changes. The choice depends
        only on scores, so every mode keeps the same groups.
        """
        a, need = self.cfg.algorithm, self.cfg.trainer.prompts_per_step
        kept: list[list[int]] = []  # uids of each kept group, in draw order
        spare: list[list[int]] = []
        parts: list[Generated] = []
        drawn = 0
        for rnd in range(1 + (a.max_extra_draws if a.dynamic_sampling else 0)):
            n = need if rnd == 0 else min(need, math.ceil((need - len(kept)) / max(len(kept) / drawn, 0.1)))
            gen = draw(step, rnd, n, drawn)
            parts.append(gen)
            drawn += n
            groups: dict[int, list[int]] = {}
            for s in gen.samples:
                groups.setdefault(s.group_id, []).append(s.uid)
            scores = torch.stack([gen.rows["scores"][s.uid] for s in gen.samples])
            useful = (informative_groups(scores, [s.group_id for s in gen.samples]) if a.dynamic_sampling
                      else dict.fromkeys(groups, True))
            for g, uids in groups.items():
                (kept if useful[g] else spare).append(uids)
            if len(kept) >= need:
                break
        topped_up = max(0, need - len(kept))
        chosen = [u for uids in kept[:need] + spare[:topped_up] for u in uids]
        gen = Generated.concat(parts).select(chosen) if len(parts) > 1 or a.dynamic_sampling else parts[0]
        metrics = {}
        if a.dynamic_sampling:
            metrics = {"dapo/prompts_drawn": float(drawn), "dapo/groups_dropped": float(drawn - len(kept)),
                       "dapo/groups_topped_up": float(topped_up), "dapo/draw_rounds": float(len(parts))}
        return gen, metrics

    # ------------------------------------------------------------------ assembly
    def assemble(self, step: int, gen: Generated) -> tuple[Batch, dict[str, float]]:
        """The step's ``Batch`` from samples whose every stage has run (rows in ``gen``), in ``gen``'s order."""
        uids = [x.uid for x in gen.samples]
        batch = self.pack(gen)
        width = batch["response_mask"].shape[1]
        for k, by_uid in gen.rows.items():
            if k in REWARD_FIELDS:  # (B,)
                batch[k] = torch.stack([by_uid[u] for u in uids])
            else:  # (B, Tr), each row cut to its response
                batch[k] = pad_rows([by_uid[u] for u in uids], width)
        if self.roles.old_from_rollout:  # the engine's sampling log-probs, under this step's weights
            batch["old_logprobs"] = batch["behavior_logprobs"].clone()
        metrics: dict[str, float] = {}
        if self.cfg.algorithm.overlong_buffer:
            metrics["reward/overlong_penalty"] = float(self.shaping(gen.samples).mean())
        if self.recipe.greedy_baseline:
            with self.tracer.span("greedy_baseline", step):
                batch["baseline_scores"] = self.greedy_baseline(batch)
        return batch, metrics

    def greedy_baseline(self, batch: Batch) -> torch.Tensor:
        """ReMax baseline (B,): the score of one greedy response per prompt, shared by its group."""
        first: dict[int, int] = {}
        for i, gid in enumerate(batch.meta["group_id"]):
            first.setdefault(gid, i)
        tp = batch["input_ids"].shape[1] - batch["response_mask"].shape[1]
        params = dataclasses.replace(self.sampling, greedy=True)
        requests = [RolloutRequest(k, unpad(batch["input_ids"][i, :tp], batch["attention_mask"][i, :tp]), params, gid)
                    for k, (gid, i) in enumerate(first.items())]
        samples = self.roles.actor.generate(requests)
        texts = [decode_response(self.tokenizer, s.response_ids) for s in samples]
        prompts = [batch.meta["task_prompt"][i] for i in first.values()]
        scores = self.score(samples, prompts, texts)["scores"]  # (G,)
        by_group = dict(zip(first, scores.tolist(), strict=True))
        return torch.tensor([by_group[gid] for gid in batch.meta["group_id"]])
