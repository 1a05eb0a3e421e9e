"""``Batch``: what crosses every stage and worker boundary.

A batch is a dict of tensors sharing the batch dimension plus per-sample metadata
lists. Sequences use one layout everywhere (as verl does): the prompt left-padded to
``Tp`` tokens followed by the response right-padded to ``Tr`` tokens, so response
token ``j`` sits at column ``Tp + j`` and is predicted by the logits at ``Tp + j - 1``.

Tensor fields (B = samples, Tp = prompt width, Tr = response width):
    input_ids          (B, Tp+Tr) long   prompt (left-padded) + response (right-padded)
    attention_mask     (B, Tp+Tr) long   1 on real tokens
    response_mask      (B, Tr)    float  1 on response tokens that count (incl. eos)
    behavior_logprobs  (B, Tr)    float  log-prob of each sampled token under the sampler
    old_logprobs       (B, Tr)    float  same tokens under the actor before this update
    ref_logprobs       (B, Tr)    float  same tokens under the frozen reference
    values             (B, Tr)    float  critic values (PPO)
    scores             (B,)       float  sequence reward from the task
    token_rewards      (B, Tr)    float  per-token reward (score on the last token, KL penalty)
    advantages         (B, Tr)    float
    returns            (B, Tr)    float  value targets (PPO)
Metadata lists (length B): uid, group_id, prompt, response, finish_reason, policy_version.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass
class Batch:
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: dict[str, list] = field(default_factory=dict)

    def __post_init__(self) -> None:
        sizes = {k: v.shape[0] for k, v in self.tensors.items()} | {k: len(v) for k, v in self.meta.items()}
        if len(set(sizes.values())) > 1:
            raise ValueError(f"Batch fields disagree on batch size: {sizes}")

    def __len__(self) -> int:
        for v in self.tensors.values():
            return v.shape[0]
        for v in self.meta.values():
            return len(v)
        return 0

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        if self.tensors and value.shape[0] != len(self):
            raise ValueError(f"field {key!r} has batch size {value.shape[0]}, batch has {len(self)}")
        self.tensors[key] = value

    def __contains__(self, key: str) -> bool:
        return key in self.tensors or key in self.meta

    def select(self, indices: Sequence[int] | torch.Tensor) -> Batch:
        """The samples at ``indices``, in that order."""
        idx = torch.as_tensor(indices, dtype=torch.long)
        il = idx.tolist()
        return Batch({k: v[idx.to(v.device)] for k, v in self.tensors.items()},
                     {k: [v[i] for i in il] for k, v in self.meta.items()})

    def split(self, size: int) -> list[Batch]:
        """Consecutive chunks of ``size`` samples (the last may be smaller)."""
        n = len(self)
        return [self.select(range(i, min(i + size, n))) for i in range(0, n, size)]

    @staticmethod
    def concat(batches: Sequence[Batch]) -> Batch:
        """Stack batches with the same fields; widths must already agree (see ``pad_to``)."""
        if not batches:
            raise ValueError("Batch.concat needs at least one batch")
        keys = batches[0].tensors.keys()
        return Batch({k: torch.cat([b.tensors[k] for b in batches]) for k in keys},
                     {k: [x for b in batches for x in b.meta[k]] for k in batches[0].meta})

    def chunk_by_token_budget(self, budget: int) -> list[Batch]:
        """Consecutive chunks whose padded size (rows x longest real length) stays within ``budget``.

        Used for inference micro-batches: a chunk always holds at least one sample.
        """
        lengths = self.tensors["attention_mask"].sum(-1).tolist()
        chunks, start, longest = [], 0, 0
        for i, n in enumerate(lengths):
            longest_if = max(longest, n)
            if i > start and longest_if * (i - start + 1) > budget:
                chunks.append(self.select(range(start, i)))
                start, longest_if = i, n
            longest = longest_if
        chunks.append(self.select(range(start, len(self))))
        return chunks

    def to(self, device: torch.device | str) -> Batch:
        return Batch({k: v.to(device) for k, v in self.tensors.items()}, dict(self.meta))


def pad_sequences(seqs: Sequence[Sequence[int]], pad_id: int, left: bool, width: int | None = None) -> torch.Tensor:
    """(B, width) long tensor of ``seqs`` padded on the left or right with ``pad_id``."""
    width = max((len(s) for s in seqs), default=0) if width is None else width
    out = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    for i, s in enumerate(seqs):
        if len(s) > width:
            raise ValueError(f"sequence {i} has {len(s)} tokens, more than the width {width}")
        if s:
            if left:
                out[i, width - len(s):] = torch.as_tensor(s)
            else:
                out[i, : len(s)] = torch.as_tensor(s)
    return out


def unpad(row: torch.Tensor, mask: torch.Tensor) -> list:
    """The entries of one row where ``mask`` is set, as a python list."""
    return row[mask.bool()].tolist()
