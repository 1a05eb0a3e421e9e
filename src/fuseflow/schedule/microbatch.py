"""Inference micro-batches formed by a token budget while samples stream in (fused mode).

In ``fused`` mode reference, critic, reward and old-log-prob inference start on samples as
they finish generating instead of waiting for the whole batch. Running one forward per
sample wastes the matmuls; waiting for many adds latency. A micro-batch is released the
moment one more sample would push its padded size (rows x longest sample) over the budget,
which is the rule ``Batch.chunk_by_token_budget`` applies to a whole batch, so streaming
and batch-at-once inference see the same micro-batches for the same arrival order.

Padding is most of the cost on long-tailed tasks: a ``Batch`` is as wide as its longest
prompt plus its longest response, and on ``sort`` that is about 3.8x the real tokens.
``length_sorted_microbatches`` sorts a whole batch by length, cuts it by the budget and trims
each micro-batch to its own widths (about 1.4x real tokens on ``sort``); ``scatter_rows``
puts the per-sample outputs back in batch order. Streamed samples need no sorting: short
ones finish first, so arrival order is already roughly by length.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Generic, TypeVar

import torch

from fuseflow.data.batch import Batch
from fuseflow.rollout.base import Sample

T = TypeVar("T")


def sample_tokens(sample: Sample) -> int:
    """Real tokens of a finished sample (prompt + response): its width in an inference forward."""
    return len(sample.prompt_ids) + len(sample.response_ids)


class TokenBudgetBatcher(Generic[T]):
    """Collects streamed items into micro-batches whose padded size stays within ``budget`` tokens.

    ``add`` returns the micro-batch that the new item closed (or None); ``flush`` returns what
    is left at the end of the stream; ``take`` hands over the partial micro-batch early, for
    an inference worker that would otherwise sit idle. A single item larger than the budget
    still forms a micro-batch of its own (it cannot be split).

    >>> b = TokenBudgetBatcher(budget=10, length=len)
    >>> b.add("abcd"), b.add("ab"), b.add("abc")
    (None, None, ['abcd', 'ab'])
    >>> b.flush()
    ['abc']
    """

    def __init__(self, budget: int, length: Callable[[T], int] = sample_tokens):
        if budget < 1:
            raise ValueError(f"micro-batch token budget must be >= 1, got {budget}")
        self.budget, self.length = budget, length
        self._items: list[T] = []
        self._longest = 0

    def __len__(self) -> int:
        return len(self._items)

    @property
    def padded_tokens(self) -> int:
        """Padded size of the micro-batch being filled (rows x longest)."""
        return len(self._items) * self._longest

    def add(self, item: T) -> list[T] | None:
        n = self.length(item)
        if n < 1:
            raise ValueError(f"an item of {n} tokens cannot be batched; every sample has at least one token")
        closed = None
        if self._items and (len(self._items) + 1) * max(self._longest, n) > self.budget:
            closed = self.take()
        self._items.append(item)
        self._longest = max(self._longest, n)
        return closed

    def take(self) -> list[T]:
        """The partial micro-batch, now (empty list when nothing is pending)."""
        out, self._items, self._longest = self._items, [], 0
        return out

    def flush(self) -> list[T] | None:
        """The last micro-batch at the end of the stream, or None when nothing is pending."""
        return self.take() or None


def stream_microbatches(items: Iterable[T], budget: int, length: Callable[[T], int] = sample_tokens
                        ) -> Iterator[list[T]]:
    """Micro-batches of ``items`` in arrival order, each yielded as soon as it is closed."""
    batcher = TokenBudgetBatcher(budget, length)
    for item in items:
        closed = batcher.add(item)
        if closed:
            yield closed
    last = batcher.flush()
    if last:
        yield last


# ------------------------------------------------------------------ whole batches, by length
PROMPT_FIELDS = ("input_ids", "attention_mask")  # (B, Tp+Tr): prompt columns first, then response columns


def trim_padding(batch: Batch) -> Batch:
    """The batch without its all-padding columns: prompt columns on the left, response columns on the right.

    The layout is kept (prompt left-padded to the new ``Tp``, response right-padded to the new
    ``Tr``), so response token ``j`` still sits at column ``Tp + j``; masked columns carry no
    attention weight and positions come from the mask, so model outputs are unchanged.
    Every ``(B, Tr)`` field is cut to the new ``Tr``; ``(B,)`` fields are kept.
    """
    mask = batch["attention_mask"]  # (B, Tp+Tr)
    tr = batch["response_mask"].shape[1]
    tp = mask.shape[1] - tr
    prompt_real = mask[:, :tp].sum(-1)  # (B,)
    resp_real = mask[:, tp:].sum(-1)  # (B,)
    new_tp = int(prompt_real.max()) if len(batch) else 0
    new_tr = max(int(resp_real.max()) if len(batch) else 0, 1)  # keep one response column so shapes stay valid
    cols = torch.cat([torch.arange(tp - new_tp, tp), torch.arange(tp, tp + new_tr)])
    out = {}
    for k, v in batch.tensors.items():
        if k in PROMPT_FIELDS or (v.dim() >= 2 and v.shape[1] == tp + tr):
            out[k] = v[:, cols]
        elif v.dim() >= 2 and v.shape[1] == tr:
            out[k] = v[:, :new_tr]
        else:
            out[k] = v
    return Batch(out, {k: list(v) for k, v in batch.meta.items()})


def length_sorted_microbatches(batch: Batch, budget: int) -> list[tuple[list[int], Batch]]:
    """Micro-batches of ``batch`` sorted by length, each within ``budget`` padded tokens after trimming.

    Returns ``(indices, micro_batch)`` pairs; ``indices`` are the rows of ``batch`` in the micro-batch.
    A micro-batch's cost is rows x (longest prompt + longest response) in it; a sample larger
    than the budget forms its own. For inference only: training mini-batches must keep their
    sampled composition (PPO shuffles them), which sorting would change.
    """
    if budget < 1:
        raise ValueError(f"micro-batch token budget must be >= 1, got {budget}")
    mask = batch["attention_mask"]  # (B, Tp+Tr)
    tr = batch["response_mask"].shape[1]
    prompt_len = mask[:, : mask.shape[1] - tr].sum(-1).tolist()
    resp_len = mask[:, mask.shape[1] - tr:].sum(-1).tolist()
    order = sorted(range(len(batch)), key=lambda i: (prompt_len[i] + resp_len[i], i))
    chunks: list[list[int]] = []
    cur: list[int] = []
    lp = lr = 0
    for i in order:
        np_, nr = max(lp, prompt_len[i]), max(lr, resp_len[i])
        if cur and (len(cur) + 1) * (np_ + nr) > budget:
            chunks.append(cur)
            cur, np_, nr = [], prompt_len[i], resp_len[i]
        cur.append(i)
        lp, lr = np_, nr
    if cur:
        chunks.append(cur)
    return [(idx, trim_padding(batch.select(idx))) for idx in chunks]


def scatter_rows(parts: Sequence[tuple[Sequence[int], torch.Tensor]], rows: int, width: int,
                 fill: float = 0.0) -> torch.Tensor:
    """(rows, width) tensor with each part's (n, w <= width) rows written at its indices, right-padded.

    >>> scatter_rows([([1], torch.tensor([[5.0]])), ([0], torch.tensor([[1.0, 2.0]]))], 2, 3)
    tensor([[1., 2., 0.],
            [5., 0., 0.]])
    """
    if not parts:
        return torch.full((rows, width), fill)
    first = parts[0][1]
    out = torch.full((rows, width), fill, dtype=first.dtype, device=first.device)
    for idx, values in parts:
        if values.shape[1] > width:
            raise ValueError(f"a part is {values.shape[1]} wide, more than the target width {width}")
        out[torch.as_tensor(list(idx), dtype=torch.long), : values.shape[1]] = values
    return out
