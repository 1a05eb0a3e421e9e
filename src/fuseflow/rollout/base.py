"""The rollout interface: requests in, finished samples out.

Any backend (the simple sampler here, the continuous-batching engine later) takes
``RolloutRequest``s and yields ``Sample``s. Per-request seeds make each sample's
tokens independent of how requests are batched, so execution modes that reorder or
migrate requests still produce the same samples.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. ``greedy`` ignores temperature/top-p/top-k for the choice."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    greedy: bool = False
    max_new_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0
    stop: tuple[str, ...] = ()  # stop strings (engine backend; needs a tokenizer to detokenize)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str) or any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be a tuple of non-empty strings, got {self.stop!r}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0 or self.max_new_tokens < 1:
            raise ValueError(f"top_k must be >= 0 and max_new_tokens >= 1, got {self.top_k}, {self.max_new_tokens}")


@dataclass
class RolloutRequest:
    uid: int
    prompt_ids: list[int]
    params: SamplingParams
    group_id: int = 0


@dataclass
class Sample:
    """One finished trajectory.

    response_ids: sampled tokens, including the stop token when one ended it
    logprobs:     log-prob of each sampled token under the temperature-scaled
                  distribution (what the trainer recomputes), one per response token
    finish_reason: "stop" (a stop token or stop string) or "length" (max_new_tokens reached)
    """

    uid: int
    group_id: int
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    policy_version: int = 0
    meta: dict = field(default_factory=dict)
    t_first_token: float | None = None  # time.perf_counter() when the first response token was sampled
    t_finish: float | None = None  # time.perf_counter() when the sample finished


class RolloutBackend(ABC):
    """Generates samples for requests with the current policy weights."""

    policy_version: int = 0

    @abstractmethod
    def generate(self, requests: Iterable[RolloutRequest]) -> Iterator[Sample]:
        """Yield one ``Sample`` per request (in completion order, which may differ from input order)."""

    def update_weights(self, version: int) -> None:
        """Called after each actor update; in-process backends share the weights and only bump the version."""
        self.policy_version = version


class StreamingBackend(RolloutBackend):
    """A backend that takes requests one by one and steps until idle (fuseflow's engine, vLLM).

    Subclasses provide ``add`` (a request, or a ``PartialState`` to resume), ``step`` (the samples
    that finished in one step) and ``has_unfinished``; generation and resumption are the same loop.
    """

    @abstractmethod
    def add(self, request) -> None:
        """Queue a request, or a partial state exported by ``abort`` to resume."""

    @abstractmethod
    def step(self) -> list[Sample]:
        """Advance every live request once; the samples that finished."""

    @abstractmethod
    def has_unfinished(self) -> bool:
        """Whether any request is still queued or decoding."""

    def generate(self, requests: Iterable) -> Iterator[Sample]:
        """Add the requests (or partial states) and step until idle, yielding every sample the moment it
        finishes (completion order). Samples aborted meanwhile are not yielded."""
        for r in requests:
            self.add(r)
        while self.has_unfinished():
            yield from self.step()

    def resume(self, partials: Iterable) -> Iterator[Sample]:
        """Continue samples exported by ``abort`` (from this or another backend with the same weights)."""
        return self.generate(partials)

