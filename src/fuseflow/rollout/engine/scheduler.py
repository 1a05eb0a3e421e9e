"""Policy: which sequences run in the next step, admission within the KV budget, preemption, groups.

Every step schedules one row per running sequence: a decoding sequence contributes its one new
token, a prefilling one a chunk of its prompt (bounded by the per-step token budget). Waiting
sequences are admitted, oldest first, while slots, token budget and KV blocks allow. When a
decoding sequence needs a block and none is free, the newest running sequence is preempted: its
blocks are freed and it goes back to the front of the queue, to be recomputed later (its full
blocks usually survive in the prefix cache, so the recompute is mostly cache hits).

Requests that sit next to each other in the queue with the same prompt (the n samples of a GRPO
group) are admitted together: the first one prefills the prompt, the others fork from it, sharing
its full blocks and copying its partially filled last block.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import islice

from ..base import Sample
from .kv import BlockManager
from .sequence import Sequence


@dataclass
class StepPlan:
    """What the runner computes in one step.

    rows:      (sequence, t): compute tokens[num_computed : num_computed + t]; decoding rows (t == 1,
               completing) come first, and the runner may reorder them among themselves
    completes: per row, whether it reaches the sequence's last token (its logits are then needed)
    forks:     (follower, leader): the follower samples its first token from the leader's logits
    copies:    (src, dst) blocks to copy after the forward (a fork's partially filled prompt block)
    """

    rows: list[tuple[Sequence, int]] = field(default_factory=list)
    completes: list[bool] = field(default_factory=list)
    forks: list[tuple[Sequence, Sequence]] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)

    def sampling_rows(self) -> list[tuple[Sequence, int]]:
        """(sequence, logits row) for every sequence that samples a token after this step."""
        out, row_of = [], {}
        for (seq, _), done in zip(self.rows, self.completes, strict=True):
            if done:
                row_of[id(seq)] = len(out)
                out.append((seq, len(out)))
        return out + [(f, row_of[id(leader)]) for f, leader in self.forks]


@dataclass
class SchedulerStats:
    """Counters over the engine's lifetime (prefill requested vs computed shows what sharing saved)."""

    prefill_tokens_requested: int = 0  # tokens each admitted sample needed in its KV cache
    prefill_tokens_computed: int = 0  # tokens actually run through the model in prefill rows
    prefix_cache_hit_tokens: int = 0  # tokens found in the prefix cache
    group_shared_tokens: int = 0  # tokens forked from a same-prompt group leader
    generated_tokens: int = 0
    steps: int = 0
    preemptions: int = 0


class Scheduler:
    """Queues and block accounting; never touches tensors (the runner does)."""

    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 detokenize: Callable[[list[int]], str] | None = None):
        self.blocks, self.max_num_seqs, self.max_num_batched_tokens = blocks, max_num_seqs, max_num_batched_tokens
        self.detokenize = detokenize
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: the last one is the newest
        self.stats = SchedulerStats()
        self.uids: set[int] = set()  # uids waiting or running
        self._order = 0
        # Keep a little headroom at admission so the next decode steps rarely need a preemption.
        self.watermark = blocks.num_blocks // 100

    def add(self, seq: Sequence) -> None:
        """Queue a sequence at the back (uids must be unique among waiting and running ones)."""
        if seq.uid in self.uids:
            raise ValueError(f"request uid {seq.uid} is already in this engine; uids must be unique")
        self.uids.add(seq.uid)
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        """Whether any sequence waits or runs."""
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------------------------ scheduling
    def schedule(self) -> StepPlan:
        """Rows of the next step: every decoding sequence, then prefill chunks, then admissions."""
        plan = StepPlan()
        budget = self.max_num_batched_tokens  # >= max_num_seqs, so decoding rows always fit
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            if seq.leader is None and len(seq.tokens) - seq.num_computed == 1:  # followers wait for the leader
                if not self._reserve(seq):
                    continue  # seq itself was preempted; running[i] is now the next one
                budget -= self._add_row(plan, seq, budget)
            i += 1
        for seq in self.running:  # prompts (or preempted samples) still being prefilled, oldest first
            if budget > 0 and seq.leader is None and len(seq.tokens) - seq.num_computed > 1:
                budget -= self._add_row(plan, seq, budget)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            group = self._group_of(seq, self.max_num_seqs - len(self.running) - 1)
            partial_block = seq.num_prompt % self.blocks.block_size != 0
            headroom = self.watermark if self.running else 0  # alone, a request may use the whole pool
            if not self.blocks.can_allocate(seq.tokens, len(group) * partial_block + headroom):
                break
            self.waiting.popleft()
            for _ in group:
                self.waiting.popleft()
            self._admit(seq, group)
            budget -= self._add_row(plan, seq, budget)
        # Decoding rows (one token, the last one) first: the runner attends over them in one call.
        rows = sorted(zip(plan.rows, plan.completes, strict=True), key=lambda rc: not (rc[0][1] == 1 and rc[1]))
        plan.rows, plan.completes = [r for r, _ in rows], [c for _, c in rows]
        return plan

    def _add_row(self, plan: StepPlan, seq: Sequence, budget: int) -> int:
        remaining = len(seq.tokens) - seq.num_computed
        t = min(remaining, budget)
        plan.rows.append((seq, t))
        plan.completes.append(t == remaining)
        if t == remaining and seq.followers:
            for f in seq.followers:
                plan.forks.append((f, seq))
                if f.num_prompt % self.blocks.block_size:  # the partially filled last prompt block is copied
                    plan.copies.append((seq.block_table[len(f.block_table) - 1], f.block_table[-1]))
        return t

    def _group_of(self, seq: Sequence, room: int) -> list[Sequence]:
        """Fresh sequences right behind `seq` in the queue with the same prompt (at most `room`)."""
        group: list[Sequence] = []
        if len(seq.tokens) != seq.num_prompt:
            return group
        for other in islice(self.waiting, 1, room + 1):
            if len(other.tokens) != other.num_prompt or other.tokens != seq.tokens:
                break
            group.append(other)
        return group

    def _admit(self, seq: Sequence, group: list[Sequence]) -> None:
        seq.block_table, seq.block_hashes, cached = self.blocks.allocate_prompt(seq.tokens)
        seq.num_computed, seq.prefill_len = cached, len(seq.tokens)
        st = self.stats
        st.prefill_tokens_requested += len(seq.tokens) * (1 + len(group))
        st.prefix_cache_hit_tokens += cached
        st.group_shared_tokens += len(seq.tokens) * len(group)
        self._order += 1
        seq.order = self._order
        self.running.append(seq)
        for f in group:
            f.block_table, _ = self.blocks.fork(seq.block_table, f.num_prompt)
            f.leader, f.num_computed, f.prefill_len = seq, 0, f.num_prompt
            self._order += 1
            f.order = self._order
            self.running.append(f)
        seq.followers = group

    def _reserve(self, seq: Sequence) -> bool:
        """Make room for seq's next token, preempting the newest sequences; False if seq itself went."""
        while len(seq.block_table) * self.blocks.block_size < len(seq.tokens):
            if self.blocks.num_free == 0:
                victim = max((s for s in self.running if s.block_table), key=lambda s: s.order)
                self.preempt(victim)
                if victim is seq:
                    return False
                continue
            seq.block_table.append(self.blocks.append_block())
        return True

    def preempt(self, seq: Sequence) -> None:
        """Free seq's blocks and put it back at the front of the queue (with its followers)."""
        self.stats.preemptions += 1
        for f in self._detach(seq):
            self.waiting.appendleft(f)
        self.waiting.appendleft(seq)

    def _detach(self, seq: Sequence) -> list[Sequence]:
        """Remove seq from running and free its blocks; returns its un-forked followers, also freed."""
        followers = list(seq.followers)
        for s in [seq, *followers]:
            self.blocks.release(s.block_table)
            s.block_table, s.block_hashes, s.num_computed, s.followers = [], [], 0, []
            if s.leader is not None and s.leader is not seq:
                s.leader.followers.remove(s)
            s.leader = None
        ids = {id(s) for s in followers} | {id(seq)}
        self.running = [s for s in self.running if id(s) not in ids]
        return followers[::-1]

    def abort(self, uids: set[int]) -> list[Sequence]:
        """Take sequences with these uids out of the engine (freeing their blocks); returns them."""
        self.uids -= uids
        out = [s for s in self.waiting if s.uid in uids]
        self.waiting = deque(s for s in self.waiting if s.uid not in uids)
        for seq in [s for s in self.running if s.uid in uids]:
            if any(s is seq for s in self.running):
                for f in self._detach(seq):  # followers lost their leader: they start over
                    (out.append(f) if f.uid in uids else self.waiting.appendleft(f))
                out.append(seq)
        return out

    # ------------------------------------------------------------------------------------ results
    def postprocess(self, plan: StepPlan, tokens: list[int], logprobs: list[float], version: int) -> list[Sample]:
        """Advance sequences by the computed rows and sampled tokens; free and return finished samples."""
        st = self.stats
        st.steps += 1
        for seq, t in plan.rows:
            st.prefill_tokens_computed += max(0, min(seq.num_computed + t, seq.prefill_len) - seq.num_computed)
            seq.num_computed += t
            self._register_full_blocks(seq)
        for f, leader in plan.forks:
            f.leader, f.num_computed = None, f.num_prompt
            f.block_hashes = leader.block_hashes[: f.num_prompt // self.blocks.block_size]
            leader.followers = []
        now = time.perf_counter()
        finished: list[Sample] = []
        for (seq, _), tok, lp in zip(plan.sampling_rows(), tokens, logprobs, strict=True):
            seq.tokens.append(tok)
            seq.logprobs.append(lp)
            if seq.t_first_token is None:
                seq.t_first_token, seq.policy_version = now, version
            reason = self._finish_reason(seq, tok)
            if reason is not None:
                finished.append(self._finish(seq, reason, version, now))
        st.generated_tokens += len(tokens)
        if finished:
            self.running = [s for s in self.running if s.block_table]
        return finished

    def _register_full_blocks(self, seq: Sequence) -> None:
        bs = self.blocks.block_size
        for j in range(len(seq.block_hashes), seq.num_computed // bs):
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            seq.block_hashes.append(self.blocks.register(seq.block_table[j], parent,
                                                         tuple(seq.tokens[j * bs : (j + 1) * bs])))

    def _finish_reason(self, seq: Sequence, tok: int) -> str | None:
        if tok in seq.stop_set:
            return "stop"
        if seq.params.stop and self.detokenize is not None:
            text = self.detokenize(seq.response)
            if any(s in text for s in seq.params.stop):
                return "stop"
        if len(seq.tokens) >= seq.max_len:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str, version: int, now: float) -> Sample:
        self.blocks.release(seq.block_table)
        seq.block_table = []  # marks it finished; postprocess drops it from running
        self.uids.discard(seq.uid)
        return Sample(seq.uid, seq.request.group_id, list(seq.request.prompt_ids), seq.response,
                      seq.logprobs, reason, seq.policy_version if seq.policy_version is not None else version,
                      meta={"policy_version_end": version, "t_submit": seq.t_submit}, t_first_token=seq.t_first_token,
                      t_finish=now)
