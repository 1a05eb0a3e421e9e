"""Token-budget micro-batches: the one rule for cutting inference work, runtime and simulator alike.

Two forms of one rule (padded size = rows x longest row <= budget):
- ``TokenBudgetBatcher`` cuts a stream of finished samples in arrival order (fused mode: short
  samples finish first, so arrival order is already roughly by length);
- ``group_by_length`` sorts a whole batch by length first and then cuts it; the workers
  (``fuseflow.data.batch.length_sorted_chunks``) and the calibration
  (``fuseflow.sim.calibrate.trimmed_widths``) both call it, so a prediction never drifts from
  what the workers run.

Running one forward per sample wastes the matmuls; waiting for many adds latency. Padding is most
of the cost on long-tailed tasks: a ``Batch`` is as wide as its longest prompt plus its longest
response, and on ``sort`` that is about 3.8x the real tokens; sorting by length and trimming each
micro-batch to its own widths brings that to about 1.4x.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")


def sample_tokens(sample) -> int:
    """Real tokens of a finished sample (anything with ``prompt_ids`` and ``response_ids``): its width
    in an inference forward."""
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
        """Add ``item``; return the micro-batch it closed, or None. When one more row would make the padded size
        (rows x longest, in tokens) exceed ``budget``, the items before it are returned and ``item`` starts the
        next micro-batch. Raises ValueError for an item of fewer than one token."""
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


def group_by_length(prompt_len: Sequence[int], resp_len: Sequence[int], budget: int) -> list[list[int]]:
    """Row indices in groups of similar length whose padded size stays within ``budget`` tokens.

    Rows go shortest first (ties by index); a group closes when one more row would make rows x
    (longest prompt + longest response) exceed ``budget``, since prompts and responses are padded
    separately. A row longer than the budget forms a group of its own.

    >>> group_by_length([1, 1, 1, 1], [5, 2, 2, 1], budget=12)
    [[3, 1, 2], [0]]
    """
    if budget < 1:
        raise ValueError(f"micro-batch token budget must be >= 1, got {budget}")
    order = sorted(range(len(prompt_len)), key=lambda i: (prompt_len[i] + resp_len[i], i))
    groups: list[list[int]] = []
    cur: list[int] = []
    lp = lr = 0
    for i in order:
        p, r = max(lp, prompt_len[i]), max(lr, resp_len[i])
        if cur and (len(cur) + 1) * (p + r) > budget:
            groups.append(cur)
            cur, p, r = [], prompt_len[i], resp_len[i]
        cur.append(i)
        lp, lr = p, r
    if cur:
        groups.append(cur)
    return groups
