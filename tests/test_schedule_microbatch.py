"""Streaming inference micro-batches by token budget."""

from __future__ import annotations

import pytest
import torch

from fuseflow.data.batch import Batch, length_sorted_chunks, scatter_rows, trim_padding
from fuseflow.policy.microbatch import TokenBudgetBatcher, sample_tokens
from fuseflow.rollout.base import Sample


def _stream(items, budget, length):
    b = TokenBudgetBatcher(budget, length)
    out = [c for x in items if (c := b.add(x))]
    last = b.flush()
    return out + ([last] if last else [])


def test_hand_case():
    lengths = [4, 2, 3, 9, 1, 12, 2]
    chunks = _stream(lengths, budget=10, length=lambda n: n)
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


# ------------------------------------------------------------------ whole batches, by length
def _batch(prompts: list[list[int]], responses: list[list[int]]) -> Batch:
    from fuseflow.workers.common import samples_to_batch

    samples = [Sample(uid=i, group_id=0, prompt_ids=p, response_ids=r, logprobs=[0.0] * len(r), finish_reason="stop")
               for i, (p, r) in enumerate(zip(prompts, responses, strict=True))]
    batch = samples_to_batch(samples, 0, ["p"] * len(samples), ["r"] * len(samples))
    batch["scores"] = torch.arange(len(samples), dtype=torch.float)  # a (B,) field rides along untouched
    return batch


def test_trim_padding_hand_case():
    wide = _batch([[7, 8, 9], [5], [4, 4, 4, 4, 4]], [[1], [2, 3], [6, 6, 6, 6]])  # Tp=5, Tr=4
    assert wide["input_ids"].shape == (3, 9)
    t = trim_padding(wide.select([0, 1]))
    assert t["input_ids"].tolist() == [[7, 8, 9, 1, 0], [0, 0, 5, 2, 3]]
    assert t["attention_mask"].tolist() == [[1, 1, 1, 1, 0], [0, 0, 1, 1, 1]]
    assert t["response_mask"].tolist() == [[1, 0], [1, 1]] and t["behavior_logprobs"].shape == (2, 2)
    assert t["scores"].tolist() == [0.0, 1.0] and t.meta["uid"] == [0, 1]


def sorted_microbatches(b: Batch, budget: int) -> list[tuple[list[int], Batch]]:
    """(indices, trimmed micro-batch) pairs, as the workers build them."""
    return [(idx, trim_padding(b.select(idx))) for idx in length_sorted_chunks(b, budget)]


def test_length_sorted_microbatches_cover_rows_once_within_budget():
    # Long-tailed like `sort`: most samples short, every tenth long.
    lens = [(30, 35) if i % 10 == 9 else (2 + i % 6, 1 + i % 5) for i in range(40)]
    b = _batch([[3] * p for p, _ in lens], [[4] * r for _, r in lens])
    parts = sorted_microbatches(b, budget=300)
    flat = [i for idx, _ in parts for i in idx]
    assert sorted(flat) == list(range(40))
    totals = [lens[i][0] + lens[i][1] for i in flat]
    assert totals == sorted(totals)  # sorted by length
    for idx, mb in parts:
        assert mb["input_ids"].shape[1] == max(lens[i][0] for i in idx) + max(lens[i][1] for i in idx)
        assert len(idx) == 1 or mb["input_ids"].numel() <= 300
    # Far fewer padded tokens than the whole batch at its full width (40 x 65 = 2600).
    assert sum(mb["input_ids"].numel() for _, mb in parts) < 0.5 * b["input_ids"].numel()
    with pytest.raises(ValueError, match="budget"):
        sorted_microbatches(b, 0)


def test_sorted_trimmed_inference_equals_full_batch_logprobs():
    from fuseflow.models import CausalLM, ModelConfig
    from fuseflow.workers.common import response_logprobs

    torch.manual_seed(0)
    model = CausalLM.from_config(ModelConfig.preset("tiny", vocab_size=50, max_position_embeddings=128), seed=0).eval()
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(4, 50, (int(torch.randint(2, 40, (1,), generator=gen)),), generator=gen).tolist()
               for _ in range(12)]
    responses = [torch.randint(4, 50, (int(torch.randint(1, 30, (1,), generator=gen)),), generator=gen).tolist()
                 for _ in range(12)]
    b = _batch(prompts, responses)
    with torch.no_grad():
        full = response_logprobs(model, b, 1.0)  # (B, Tr)
        parts = [(idx, response_logprobs(model, mb, 1.0)) for idx, mb in sorted_microbatches(b, 400)]
    assert len(parts) > 1
    got = scatter_rows(parts, len(b), b["response_mask"].shape[1])
    mask = b["response_mask"].bool()
    assert torch.allclose(got[mask], full[mask], atol=1e-5)
    narrow = [(idx, v.shape[1]) for idx, v in parts if v.shape[1] < full.shape[1]]
    assert narrow and all((got[idx, w:] == 0).all() for idx, w in narrow)  # beyond a part's width: the fill


def test_scatter_rows():
    out = scatter_rows([([2, 0], torch.tensor([[1.0, 2.0], [3.0, 4.0]])), ([1], torch.tensor([[9.0]]))], 3, 3, -1.0)
    assert out.tolist() == [[3.0, 4.0, -1.0], [9.0, -1.0, -1.0], [1.0, 2.0, -1.0]]
    with pytest.raises(ValueError, match="wide"):
        scatter_rows([([0], torch.zeros(1, 4))], 1, 3)
