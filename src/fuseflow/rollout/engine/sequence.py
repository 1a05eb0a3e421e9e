"""Records the engine keeps per sample: the live `Sequence` and the exportable `PartialState`."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..base import RolloutRequest


@dataclass
class PartialState:
    """A sample stopped mid-generation, enough for any engine on the same weights to continue it.

    The KV cache is not sent: the resuming engine recomputes it (one prefill of prompt + response,
    cheaper still when its prefix cache holds the prompt). The generator state makes seeded sampling
    continue exactly where it left off, so resumed output equals uninterrupted output.

    request:       the original request (its max_new_tokens counts the tokens already generated)
    response_ids:  tokens sampled so far, (n,)
    logprobs:      their behaviour log-probs, (n,)
    rng_state:     `torch.Generator.get_state()` bytes after the last draw (None: not started)
    policy_version: policy version when the first token was sampled
    t_first_token: perf_counter time of the first token (None: none yet)
    """

    request: RolloutRequest
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    rng_state: bytes | None = None
    policy_version: int | None = None
    t_first_token: float | None = None

    @property
    def uid(self) -> int:
        """The request's uid: the sample's id on every engine (abort, migration and resume name it by it)."""
        return self.request.uid


class Sequence:
    """One sample in flight: its tokens, its blocks, and its own random generator.

    tokens        prompt + response so far; the KV of tokens[:num_computed] is in the cache
    block_table   physical blocks holding positions [0, len(block_table) * block_size)
    block_hashes  prefix hash of each full block registered so far (a prefix of block_table)
    leader        for a follower of a group: the sequence whose prompt prefill it will fork from
    followers     for a leader: same-prompt sequences admitted with it, waiting for its prefill
    order         admission counter; the highest is the newest (the first to be preempted)
    """

    __slots__ = ("request", "params", "tokens", "num_prompt", "logprobs", "generator", "block_table",
                 "block_hashes", "num_computed", "leader", "followers", "order", "t_submit", "t_first_token",
                 "policy_version", "stop_set", "max_len", "prefill_len", "_uniforms", "_drawn_from", "_used")

    def __init__(self, request: RolloutRequest, partial: PartialState | None = None):
        self.request, self.params = request, request.params
        self.tokens: list[int] = list(request.prompt_ids)
        self.num_prompt = len(self.tokens)
        self.logprobs: list[float] = []
        self.generator = torch.Generator().manual_seed(self.params.seed)
        self._uniforms: list[float] = []  # drawn ahead from generator; _used of them consumed
        self._drawn_from: torch.Tensor | None = None  # generator state before that draw
        self._used = 0
        self.policy_version: int | None = None
        self.t_first_token: float | None = None
        if partial is not None:
            self.tokens += partial.response_ids
            self.logprobs = list(partial.logprobs)
            if partial.rng_state is not None:
                self.generator.set_state(torch.frombuffer(bytearray(partial.rng_state), dtype=torch.uint8))
            self.policy_version, self.t_first_token = partial.policy_version, partial.t_first_token
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []
        self.num_computed = 0
        self.prefill_len = 0  # len(tokens) at admission: positions below it are prefill, above it decode
        self.leader: Sequence | None = None
        self.followers: list[Sequence] = []
        self.order = 0
        self.t_submit = time.perf_counter()
        self.stop_set = frozenset(self.params.stop_token_ids)
        self.max_len = self.num_prompt + self.params.max_new_tokens

    @property
    def uid(self) -> int:
        """The request's uid: the sample's id on every engine (abort, migration and resume name it by it)."""
        return self.request.uid

    @property
    def response(self) -> list[int]:
        """Token ids sampled so far (``tokens`` after the prompt, a new list), those a resumed ``PartialState``
        brought included."""
        return self.tokens[self.num_prompt :]

    def next_uniform(self) -> float:
        """The next U[0, 1) draw of this sample's generator (one per sampled token).

        Draws come in chunks, one `torch.rand(n)` call instead of n scalar calls per step (the same
        stream: CPU `rand(n)` equals n scalar draws, pinned by a test); `rng_state` rewinds to the
        exact draw count, so an exported state continues where the tokens stopped.
        """
        if self._used == len(self._uniforms):
            self._drawn_from = self.generator.get_state()
            n = min(64, max(1, self.max_len - len(self.tokens)))
            self._uniforms, self._used = torch.rand(n, generator=self.generator).tolist(), 0
        self._used += 1
        return self._uniforms[self._used - 1]

    def rng_state(self) -> bytes:
        """Generator state after exactly the draws consumed so far (`torch.Generator.get_state()` bytes)."""
        gen = self.generator
        if self._used < len(self._uniforms) and self._drawn_from is not None:
            gen = torch.Generator()
            gen.set_state(self._drawn_from)
            if self._used:
                torch.rand(self._used, generator=gen)
        return gen.get_state().numpy().tobytes()

    def to_partial(self) -> PartialState:
        """This sample as a ``PartialState`` (request, response so far, log-probs, generator state; not its KV),
        which any engine on the same weights resumes to the same tokens. Before the first sampled token its
        ``rng_state`` is None: the request's seed restarts the same stream."""
        state = None if not self.logprobs else self.rng_state()
        return PartialState(self.request, self.response, list(self.logprobs), state, self.policy_version,
                            self.t_first_token)
