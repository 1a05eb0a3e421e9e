"""The strategy interface every execution mode implements, and ``Sequential`` (verl's order, one rollout worker).

``Strategy``: ``make_experience`` (samples with rewards, old/reference log-probs and values),
``train`` (the step's updates), ``step_metrics`` and the checkpoint hooks. The pooled strategies
(``fuseflow.schedule.modes``) build on it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from fuseflow.controller.group import Future as GroupFuture
from fuseflow.data.batch import Batch

from .stages import Generated, Stages, overlap

SPAN_OF = {"old_logprobs": "old_logprob", "ref_logprobs": "reference", "values": "values",
           "cost_values": "cost_values"}  # trace span of each inference field (sequential order)


class Strategy:
    """The interface of an execution mode. Subclasses implement ``make_experience``."""

    replicas = 1  # rollout replicas held (reserved) for the whole step

    def __init__(self, stages: Stages):
        self.stages, self.s, self.tracer = stages, stages.cfg.schedule, stages.tracer
        self._mark: float | None = None  # when the step being billed began

    def make_experience(self, step: int) -> tuple[Batch, dict[str, float]]:
        """Samples for ``step`` with rewards, old/reference log-probs and values, and the mode's metrics."""
        raise NotImplementedError

    def train(self, step: int, updates: dict[str, Callable[[], GroupFuture]]) -> dict[str, Any]:
        """Run the step's updates (name -> starter of a group call); their results by name."""
        return overlap(self.tracer, step, updates)

    def step_metrics(self, step: int) -> dict[str, float]:
        """Per-step metrics of the mode; every mode reports ``time/rollout_worker_seconds``."""
        now = time.perf_counter()
        held = self.replicas * (now - (self._mark if self._mark is not None else now))
        self._mark = now
        return {"time/rollout_worker_seconds": held}

    def save(self, ckpt_dir) -> None:
        """Checkpoint writer for the mode's own state (none by default)."""

    def cursor(self) -> int:
        """Prompts consumed by finished steps (the data state of a checkpoint)."""
        return self.stages.stream.cursor

    def finish_prefetch(self) -> None:
        """Wait for background generation of the next step, if the mode runs one (async)."""

    def close(self) -> None:
        """Release what the mode holds."""

    def _begin(self) -> None:
        if self._mark is None:
            self._mark = time.perf_counter()


class Sequential(Strategy):
    """verl's order with one rollout worker: generate, score, then every inference stage, through the groups."""

    def make_experience(self, step: int) -> tuple[Batch, dict[str, float]]:
        self._begin()
        st = self.stages
        gen, metrics = st.collect(step, self._draw)
        batch, more = st.assemble(step, gen)
        calls = st.inference_calls(batch, st.roles.inference_stages)
        out = overlap(self.tracer, step, {SPAN_OF[f]: start for f, start in calls.items()})
        for f in calls:
            batch[f] = out[SPAN_OF[f]]
        return batch, metrics | more

    def _draw(self, step: int, rnd: int, n: int, offset: int) -> Generated:
        st, span = self.stages, self.tracer.span
        requests, prompts = st.requests_for(step, rnd, n, offset)
        prompt_of = {r.uid: p for r, p in zip(requests, prompts, strict=True)}
        with span("generate", step):
            gen = Generated.of(st.roles.actor.generate(requests), prompt_of, st.tokenizer)
        with span("reward", step):
            gen.merge([st.infer(gen.samples, ("reward",), prompt_of)])
        return gen



def update_threads(per_worker: int, workers: int) -> int:
    """Intra-op threads for an update that takes the idle workers' cores: theirs, never more than the machine's."""
    return min(per_worker * workers, available_cores())


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
