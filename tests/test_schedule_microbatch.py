"""Streaming inference micro-batches by token budget."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fuseflow.data.batch import Batch
from fuseflow.rollout.base import Sample
from fuseflow.schedule.microbatch import TokenBudgetBatcher, sample_tokens, stream_microbatches


def test_hand_case():
    lengths = [4, 2, 3, 9, 1, 12, 2]
    chunks = list(stream_microbatches(lengths, budget=10, length=lambda n: n))
    # [4,2] costs 8; +3 -> 12. [3] then +9 -> 18. [9] then +1 -> 18. [1] +12 -> 24. [12] alone (over budget). [2].
    assert chunks == [[4, 2], [3], [9], [1], [12], [2]]
    assert all(len(c) * max(c) <= 10 or len(c) == 1 for c in chunks)


def test_closes_at_once_and_take_hands_over_partial():
    b = TokenBudgetBatcher(budget=6, length=len)
    assert b.add("abc") is None and b.padded_tokens == 3
    assert b.add("ab") is None and b.padded_tokens == 6 and len(b) == 2
    assert b.add("a") == ["abc", "ab"]
    assert b.take() == ["a"] and b.take() == [] and b.flush() is None


def test_sample_tokens_and_errors():
    s = Sample(uid=0, group_id=0, prompt_ids=[1, 2, 3], response_ids=[4, 5], logprobs=[0.0, 0.0], finish_reason="stop")
    assert sample_tokens(s) == 5
    with pytest.raises(ValueError, match="budget"):
        TokenBudgetBatcher(0)
    with pytest.raises(ValueError, match="0 tokens"):
        TokenBudgetBatcher(5, length=len).add("")


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=30), st.integers(1, 120))
def test_same_chunks_as_batch_chunk_by_token_budget(lengths, budget):
    """Streaming in arrival order gives exactly the micro-batches Batch.chunk_by_token_budget forms."""
    width = max(lengths)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)  # (B, T)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    batch = Batch({"attention_mask": mask}, {"uid": list(range(len(lengths)))})
    want = [c.meta["uid"] for c in batch.chunk_by_token_budget(budget)]
    got = list(stream_microbatches(range(len(lengths)), budget, length=lambda i: lengths[i]))
    assert got == want
