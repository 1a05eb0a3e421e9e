"""Inference micro-batches formed by a token budget while samples stream in (fused mode).

In ``fused`` mode reference, critic, reward and old-log-prob inference start on samples as
they finish generating instead of waiting for the whole batch. Running one forward per
sample wastes the matmuls; waiting for many adds latency. A micro-batch is released the
moment one more sample would push its padded size (rows x longest sample) over the budget,
which is the rule ``Batch.chunk_by_token_budget`` applies to a whole batch, so streaming
and batch-at-once inference see the same micro-batches for the same arrival order.

Padding is most of the cost on long-tailed tasks: a ``Batch`` is as wide as its longest
prompt plus its longest response, and on ``sort`` that is about 3.8x the real tokens.
``fuseflow.data.batch.length_sorted_chunks`` sorts a whole batch by length and cuts it by the
budget, and ``trim_padding`` trims each micro-batch to its own widths (about 1.4x real tokens on ``sort``);
``fuseflow.data.batch.scatter_rows`` puts the per-sample outputs back in batch order. Streamed samples need no sorting: short
ones finish first, so arrival order is already roughly by length.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Generic, TypeVar

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
