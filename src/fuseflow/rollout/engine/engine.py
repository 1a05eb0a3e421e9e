"""The continuous-batching rollout engine: `generate` streams samples as they finish.

    step():  plan = scheduler.schedule()          # policy: who runs, admission, preemption
             logits = runner.forward(plan)         # mechanism: one packed forward on the paged KV
             runner.copy_blocks(plan.copies)       # forks of shared prompts get their last block
             tokens = sample_tokens(logits, ...)   # per-request generators, one uniform per token
             return scheduler.postprocess(...)     # advance, finish, free blocks

Abort exports a sample's state (`PartialState`); `resume` (on this or another engine with the
same weights) continues it, giving the same tokens as an uninterrupted run.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass

import torch
from torch import Tensor

from fuseflow.models.llama import CausalLM

from ..base import RolloutRequest, Sample, StreamingBackend
from .kv import BlockManager
from .runner import LINEAR_KERNELS, ModelRunner
from .sampling import sample_tokens
from .scheduler import Scheduler
from .sequence import PartialState, Sequence


@dataclass(frozen=True)
class EngineConfig:
    """Capacity of one engine.

    max_num_seqs:           slots: sequences decoded together in one step
    kv_budget_tokens:       all KV memory of the engine, in tokens (all layers): the paged pool plus
                            the decode copy. The pool gets (1 - decode_cache_fraction) of it, rounded
                            down to whole blocks; admission and preemption keep every sample inside
                            the pool
    decode_cache_fraction:  share of kv_budget_tokens for the contiguous copy of the decoding rows'
                            KV, which lets decode attention read the cache in place instead of
                            gathering blocks every step; rows it has no room for attend from the
                            pool. 0 turns the copy off (fully paged). Since the copy duplicates
                            pool content, half and half suits a pool full of decoding rows
    linear_kernel:          "auto" (oneDNN's linear on CPU where it works, except fp32 on an Intel
                            CPU, where MKL measured faster or even; else torch), "onednn" or "torch" (plain
                            F.linear); see runner.Linears for why
    block_size:             tokens per KV block (the unit of allocation and of prefix caching)
    max_num_batched_tokens: tokens computed per step (decode rows + prefill chunks); longer
                            prompts are prefilled in chunks
    enable_prefix_cache:    reuse the KV of full blocks whose leading tokens match (hash lookup)
    """

    max_num_seqs: int = 64
    kv_budget_tokens: int = 16384
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    enable_prefix_cache: bool = True
    decode_cache_fraction: float = 0.5
    linear_kernel: str = "auto"

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "kv_budget_tokens", "block_size", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.linear_kernel not in LINEAR_KERNELS:
            raise ValueError(f"EngineConfig.linear_kernel must be auto, onednn or torch, got {self.linear_kernel!r}")
        if not 0 <= self.decode_cache_fraction < 1:
            raise ValueError(f"EngineConfig.decode_cache_fraction must be in [0, 1), got {self.decode_cache_fraction}")
        if self.pool_tokens < self.block_size:
            raise ValueError(f"EngineConfig.kv_budget_tokens={self.kv_budget_tokens} leaves {self.pool_tokens} "
                             f"tokens for the pool (decode_cache_fraction={self.decode_cache_fraction}), below one "
                             f"block (block_size={self.block_size}); raise it")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"EngineConfig.max_num_batched_tokens={self.max_num_batched_tokens} must be >= "
                             f"max_num_seqs={self.max_num_seqs} (every running sequence decodes one token per step)")


    @property
    def decode_cache_tokens(self) -> int:
        """Tokens of the budget held by the decode copy."""
        return int(self.kv_budget_tokens * self.decode_cache_fraction)

    @property
    def pool_tokens(self) -> int:
        """Tokens of the budget held by the paged pool (before rounding down to whole blocks)."""
        return self.kv_budget_tokens - self.decode_cache_tokens


class Engine(StreamingBackend):
    """Continuous batching over a paged KV cache, on a `CausalLM` shared with the trainer (no copy).

    >>> engine = Engine(model, EngineConfig(max_num_seqs=32))                      # doctest: +SKIP
    >>> for sample in engine.generate(requests):  # each one as soon as it is done  # doctest: +SKIP
    ...     score(sample)

    `tokenizer` (anything with `decode(ids) -> str`) is needed only for stop strings.
    """

    def __init__(self, model: CausalLM, config: EngineConfig | None = None, tokenizer=None):
        self.model, self.config, self.tokenizer = model, config or EngineConfig(), tokenizer
        c = self.config
        self.num_blocks = c.pool_tokens // c.block_size
        detok: Callable[[list[int]], str] | None = None if tokenizer is None else tokenizer.decode
        self.blocks = BlockManager(self.num_blocks, c.block_size, c.enable_prefix_cache)
        self.scheduler = Scheduler(self.blocks, c.max_num_seqs, c.max_num_batched_tokens, detok)
        self.runner = ModelRunner(model, self.num_blocks, c.block_size, c.max_num_seqs, c.decode_cache_tokens,
                                  c.linear_kernel)
        self.policy_version = 0
        self._lock = threading.RLock()

    # ------------------------------------------------------------------------------------ main loop
    def add(self, item: RolloutRequest | PartialState) -> None:
        """Queue a new request, or a `PartialState` to continue."""
        partial = item if isinstance(item, PartialState) else None
        req = partial.request if partial is not None else item
        self._validate(req, partial)
        with self._lock:
            self.scheduler.add(Sequence(req, partial))

    def step(self) -> list[Sample]:
        """Run one scheduled forward over all live rows; returns the samples that finished."""
        with self._lock:
            plan = self.scheduler.schedule()
            if not plan.rows:
                if self.scheduler.has_unfinished():  # cannot happen by construction; never spin silently
                    raise RuntimeError(f"engine stalled: {len(self.scheduler.waiting)} requests wait but none "
                                       f"fits in {self.blocks.num_free} free KV blocks with nothing running")
                return []
            logits = self.runner.forward(plan)  # (R, V)
            self.runner.copy_blocks(plan.copies)
            rows = plan.sampling_rows()
            seqs = [s for s, _ in rows]
            index = [r for _, r in rows]
            if index != list(range(logits.shape[0])):
                logits = logits[torch.tensor(index, device=logits.device)]
            tokens, logprobs = sample_tokens(logits, seqs)
            done = self.scheduler.postprocess(plan, tokens, logprobs, self.policy_version)
            self._release_if_idle()
            return done

    def has_unfinished(self) -> bool:
        """Whether any request is still waiting or running."""
        return self.scheduler.has_unfinished()

    def abort(self, uids: Iterable[int]) -> list[PartialState]:
        """Stop these samples (waiting or running) and return their state; unknown uids are ignored."""
        with self._lock:
            out = [s.to_partial() for s in self.scheduler.abort(set(uids))]
            self._release_if_idle()
            return out

    # ------------------------------------------------------------------------------------ for the pool
    def running_rows(self) -> int:
        """Sequences decoding now (the rollout pool logs it per step)."""
        return len(self.scheduler.running)

    def pending_samples(self) -> list[tuple[int, int, int, int]]:
        """(uid, response tokens so far, tokens still allowed, tokens held) of each unfinished sample."""
        with self._lock:
            return [(s.uid, len(s.response), s.max_len - len(s.tokens), len(s.tokens))
                    for s in [*self.scheduler.running, *self.scheduler.waiting]]

    def kv_capacity_tokens(self) -> int:
        """Tokens the paged KV pool holds."""
        return self.num_blocks * self.config.block_size

    def _release_if_idle(self) -> None:
        """With no request left, the decode copy of the KV cache holds nothing worth keeping."""
        if not self.scheduler.has_unfinished():
            self.runner.decode_cache.reset()

    # ------------------------------------------------------------------------------------ weights, stats
    def update_weights(self, version: int | None = None, state_dict: Mapping[str, Tensor] | None = None) -> None:
        """Move to new weights: in-process the model is shared, so only the version moves (pass
        `state_dict` when the weights come from another process). The prefix cache is emptied, since
        its KV came from the old weights; samples in flight keep their KV (their per-token log-probs
        record what was actually sampled)."""
        with self._lock:
            if state_dict is not None:
                missing, unexpected = self.model.load_state_dict(dict(state_dict), strict=False)
                tied = {"lm_head.weight"} if self.model.config.tie_word_embeddings else set()
                if unexpected or set(missing) - tied:
                    raise ValueError(f"update_weights: state_dict does not match the model: missing "
                                     f"{sorted(set(missing) - tied)}, unexpected {sorted(unexpected)}")
            self.blocks.clear_cache()
            self.policy_version = self.policy_version + 1 if version is None else version

    @property
    def stats(self) -> dict[str, int]:
        """Lifetime counters: prefill tokens requested vs computed, cache hits, preemptions, steps."""
        return asdict(self.scheduler.stats)

    def _validate(self, req: RolloutRequest, partial: PartialState | None) -> None:
        p, n = req.params, len(req.prompt_ids)
        if n == 0:
            raise ValueError(f"request {req.uid}: prompt_ids is empty; give at least one token")
        vocab = self.model.config.vocab_size
        ids = req.prompt_ids + (partial.response_ids if partial else [])
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"request {req.uid}: token ids must lie in [0, {vocab}), got {min(ids)}..{max(ids)}")
        limit = self.model.config.max_position_embeddings
        if n + p.max_new_tokens > limit:
            raise ValueError(f"request {req.uid}: prompt ({n}) + max_new_tokens ({p.max_new_tokens}) exceeds the "
                             f"model's max_position_embeddings={limit}; shorten the prompt or max_new_tokens")
        if self.blocks.blocks_for(n + p.max_new_tokens) > self.num_blocks:
            raise ValueError(f"request {req.uid}: prompt + max_new_tokens = {n + p.max_new_tokens} tokens exceeds "
                             f"the KV pool ({self.num_blocks * self.config.block_size} tokens of "
                             f"EngineConfig.kv_budget_tokens={self.config.kv_budget_tokens}); raise the budget")
        if partial is not None and len(partial.response_ids) >= p.max_new_tokens:
            raise ValueError(f"request {req.uid}: partial state already has max_new_tokens={p.max_new_tokens} "
                             "tokens; nothing to resume")
        if p.stop and self.tokenizer is None:
            raise ValueError(f"request {req.uid}: stop strings {p.stop!r} need a tokenizer; pass "
                             "Engine(..., tokenizer=tok)")
