"""Pipelined generation (Pipe-RLHF): the policy split into 2 stages across processes, with
several batches in flight so that while stage 2 decodes batch k, stage 1 decodes k+1.

Generation is memory-bound and sequential per token, so a model split over 2 processes
with a single batch leaves one of them idle while the other computes; with `groups`
batches in flight both stay busy. The requests are split into `groups` static batches;
each decode round, stage 0 runs a batch's new tokens through its layers and sends the
hidden states to stage 1, which finishes the forward, samples with the engine's sampler
(`rollout.engine.sampling.sample_tokens`, one draw per token from each request's own
seeded generator) and sends back the tokens and which rows go on. Both ranks visit the
batches in the same round-robin order and drop a batch once it has no live row, so the
message order on each channel is the same on both ends. Finished rows leave the batch
and the KV cache, as in the foundation sampler.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from fuseflow.rollout.base import RolloutBackend, RolloutRequest, Sample
from fuseflow.rollout.engine.sampling import sample_tokens
from fuseflow.rollout.engine.sequence import Sequence
from fuseflow.schedule.pipeline.procs import Context
from fuseflow.schedule.pipeline.stage import StageModule


def split_groups(n: int, groups: int) -> list[list[int]]:
    """Request indices of each in-flight batch: `groups` contiguous, near-equal slices."""
    size, extra = divmod(n, groups)
    out, start = [], 0
    for g in range(groups):
        stop = start + size + (1 if g < extra else 0)
        if stop > start:
            out.append(list(range(start, stop)))
        start = stop
    return out


def _prompt_batch(reqs: list[RolloutRequest], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids and mask (B, W), as the sampler lays out a prefill."""
    width = max(len(r.prompt_ids) for r in reqs)
    ids = torch.full((len(reqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(reqs), width), dtype=torch.long)
    for i, r in enumerate(reqs):
        ids[i, width - len(r.prompt_ids):] = torch.as_tensor(r.prompt_ids)
        mask[i, width - len(r.prompt_ids):] = 1
    return ids, mask


class _Batch:
    """One in-flight batch on one rank: its mask, positions, KV cache and live rows."""

    def __init__(self, reqs: list[RolloutRequest], pad_id: int):
        self.ids, self.mask = _prompt_batch(reqs, pad_id)
        self.pos = (self.mask.cumsum(-1) - 1).clamp(min=0)  # (B, W) prefill positions
        self.cache: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.seqs = [Sequence(r) for r in reqs]  # live rows (used on the last stage)

    @property
    def live(self) -> int:
        return self.mask.shape[0]

    def advance(self, keep: torch.Tensor) -> None:
        """Keep rows `keep` (B,) bool, extend the mask by one real column, move positions on."""
        if not bool(keep.all()):
            idx = keep.nonzero().squeeze(-1)
            self.mask, self.pos = self.mask[idx], self.pos[idx]
            self.cache = [(k.index_select(0, idx), v.index_select(0, idx)) for k, v in self.cache]
            self.seqs = [s for s, k in zip(self.seqs, keep.tolist(), strict=True) if k]
        self.pos = self.pos[:, -1:] + 1
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=-1)


def _finish(seq: Sequence, tok: int) -> str | None:
    """The engine scheduler's finish rule (stop token or length; no stop strings here)."""
    if tok in seq.stop_set:
        return "stop"
    if len(seq.tokens) >= seq.max_len:
        return "length"
    return None


@torch.no_grad()
def run_pipelined(stage: StageModule, rank: int, reqs: list[RolloutRequest], pad_id: int, groups: int,
                  timeout: float = 60.0, overlap: bool = True) -> tuple[list[Sample], float]:
    """This rank's part of pipelined generation on 2 ranks; (samples, seconds).

    Rank 0 holds the first stage, rank 1 the last; samples come back on rank 1 in request
    order (rank 0 returns none). With `overlap=False` the same `groups` batches run one
    after another (no inter-batch pipelining: one stage idles while the other computes).
    """
    batches = [_Batch([reqs[i] for i in idx], pad_id) for idx in split_groups(len(reqs), groups)]
    done: dict[int, Sample] = {}
    stage.eval()
    dist.barrier()
    t0 = time.perf_counter()
    for part in [batches] if overlap else [[b] for b in batches]:
        _decode(stage, rank, part, done, timedelta(seconds=timeout))
    seconds = time.perf_counter() - t0
    return [done[r.uid] for r in reqs] if rank == 1 else [], seconds


def _decode(stage: StageModule, rank: int, batches: list[_Batch], done: dict[int, Sample], wait: timedelta) -> None:
    """Decode `batches` to the end, round-robin (module docstring); finished samples go to `done`."""
    hidden = stage.config.hidden_size
    sends: list[tuple[torch.Tensor, Any]] = []
    active = list(range(len(batches)))
    first_round = True
    while active:
        for g in list(active):
            b = batches[g]
            if rank == 0:
                if not first_round:
                    msg = torch.empty((2, b.live), dtype=torch.long)
                    dist.irecv(msg, 1).wait(timeout=wait)
                    tok, keep = msg[0], msg[1].bool()
                    if not bool(keep.any()):
                        active.remove(g)
                        continue
                    b.advance(keep)
                    x = tok[keep].unsqueeze(-1)  # (B_live, 1)
                else:
                    x = b.ids
                h, b.cache = stage.forward_cached(x, b.mask, b.pos, b.cache)
                h = h.contiguous()
                sends.append((h, dist.isend(h, 1)))
            else:
                width = b.ids.shape[1] if first_round else 1
                h = torch.empty((b.live, width, hidden), dtype=next(stage.parameters()).dtype)
                dist.irecv(h, 0).wait(timeout=wait)
                logits, b.cache = stage.forward_cached(h, b.mask, b.pos, b.cache)
                toks, lps = sample_tokens(logits, b.seqs)
                keep = []
                for seq, t, lp in zip(b.seqs, toks, lps, strict=True):
                    seq.tokens.append(t)
                    seq.logprobs.append(lp)
                    reason = _finish(seq, t)
                    if reason is not None:
                        r = seq.request
                        done[r.uid] = Sample(r.uid, r.group_id, list(r.prompt_ids), seq.response, seq.logprobs,
                                             reason, 0)
                    keep.append(reason is None)
                keep_t = torch.tensor(keep)
                msg = torch.stack([torch.tensor(toks), keep_t.long()])
                sends.append((msg, dist.isend(msg, 0)))
                if not bool(keep_t.any()):
                    active.remove(g)
                else:
                    b.advance(keep_t)
        first_round = False
        if len(sends) > 64:  # bound the buffers held by completed sends
            for _, work in sends:
                work.wait(timeout=wait)
            sends.clear()
    for _, work in sends:
        work.wait(timeout=wait)


def generate_command(state, rank: int, ctx: Context, reqs: list[RolloutRequest], pad_id: int, groups: int,
                     timeout: float, overlap: bool = True) -> tuple[list[Sample], float]:
    """Stage-process command (see procs.py): pipelined generation with the actor's stage."""
    _, module, _ = state["stages"]["A"]
    return run_pipelined(module, rank, reqs, pad_id, groups, timeout, overlap)


def replica_command(state, rank: int, ctx: Context, reqs: list[RolloutRequest], pad_id: int
                    ) -> tuple[list[Sample], float]:
    """Stage-process command: this rank generates its share of `reqs` alone on a whole
    copy of the actor (2 data-parallel replicas), with the foundation sampler."""
    from fuseflow.rollout.sampler import Sampler

    sampler = Sampler(state["specs"]["A"].build(), pad_id)
    mine = reqs[rank::2]
    dist.barrier()
    t0 = time.perf_counter()
    out = list(sampler.generate(mine))
    return out, time.perf_counter() - t0


class PipelinedRollout(RolloutBackend):
    """A run's rollout (`rollout.pipeline_stages=2`): the actor's weights on 2 stage processes, `groups`
    batches in flight, samples token-identical to the engine's for the same seeds.

    `model` is the actor's live model (the role worker's); its weights go to the stages when this
    starts and at every `update_weights` (the weight sync after each update). Example:
        rollout = PipelinedRollout(actor_model, pad_id=0); samples = list(rollout.generate(requests))
    """

    def __init__(self, model, pad_id: int, groups: int = 2, timeout: float = 120.0):
        from fuseflow.schedule.pipeline.train import ModelSpec, PipelineTrainer

        self.model, self.pad_id, self.groups, self.timeout = model, pad_id, groups, timeout
        self.stages = PipelineTrainer({"A": ModelSpec("actor", model.config)}, 2, timeout=timeout)
        self.update_weights(0)

    def generate(self, requests: Iterable[RolloutRequest]) -> Iterator[Sample]:
        reqs = list(requests)
        if not reqs:
            return iter(())
        _, (samples, _) = self.stages.procs.call(generate_command, (reqs, self.pad_id, self.groups, self.timeout))
        return iter([dataclasses.replace(s, policy_version=self.policy_version) for s in samples])

    def update_weights(self, version: int) -> None:
        """Push the actor's current weights to the stages (a state dict through the command pipes)."""
        self.stages.load("A", {k: v.detach().cpu() for k, v in self.model.state_dict().items()})
        self.policy_version = version

    def close(self) -> None:
        """Stop the 2 stage processes that hold the actor's weights (`PipelineTrainer.close`)."""
        self.stages.close()
