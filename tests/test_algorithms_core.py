"""Exact-math tests for masked reductions and loss aggregation (fuseflow.algorithms)."""

from __future__ import annotations

import doctest
import importlib
import statistics

import pytest
import torch

from fuseflow.algorithms import aggregate, aggregation_counts, masked_mean, masked_sum, masked_whiten

# Rows: full, half, empty. The 7.0 and the zeros sit on masked-out positions.
LOSS = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 0.0, 0.0], [7.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]])


def naive_aggregate(loss, mask, mode, n_tok=None, n_seq=None, norm_len=None):
    """Per-token python loops, written independently of the vectorised code."""
    rows = []
    for i in range(loss.shape[0]):
        rows.append([float(loss[i, t]) for t in range(loss.shape[1]) if mask[i, t]])
    nonempty = [r for r in rows if r]
    n_tok = n_tok if n_tok is not None else max(sum(len(r) for r in rows), 1)
    n_seq = n_seq if n_seq is not None else max(len(nonempty), 1)
    if mode == "token-mean":
        return sum(sum(r) for r in rows) / n_tok
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in nonempty) / n_seq
    if mode == "seq-mean-token-sum":
        return sum(sum(r) for r in nonempty) / n_seq
    return sum(sum(r) for r in nonempty) / (n_seq * (norm_len or loss.shape[1]))


def test_masked_mean_and_sum_hand_values():
    assert masked_sum(LOSS, MASK).item() == 21.0
    assert masked_mean(LOSS, MASK).item() == pytest.approx(3.5)
    torch.testing.assert_close(masked_mean(LOSS, MASK, dim=-1), torch.tensor([2.5, 5.5, 0.0], dtype=torch.float64))
    torch.testing.assert_close(masked_sum(LOSS, MASK, dim=0), torch.tensor([6.0, 8.0, 3.0, 4.0], dtype=torch.float64))


def test_masked_mean_ignores_nan_on_masked_positions():
    x = torch.tensor([[1.0, float("nan")], [float("inf"), 3.0]])
    m = torch.tensor([[True, False], [False, True]])
    assert masked_mean(x, m).item() == 2.0


def test_masked_whiten_hand_values():
    x = torch.tensor([[1.0, 2.0, 99.0], [3.0, -5.0, 5.0]], dtype=torch.float64)
    m = torch.tensor([[1, 1, 0], [1, 0, 1]])
    # Masked-in values 1, 2, 3, 5: mean 2.75, unbiased var (3.0625+.5625+.0625+5.0625)/3 = 2.9166...
    std = (8.75 / 3) ** 0.5
    expected = torch.tensor([[(1 - 2.75) / std, (2 - 2.75) / std, 0.0], [(3 - 2.75) / std, 0.0, (5 - 2.75) / std]],
                            dtype=torch.float64)
    torch.testing.assert_close(masked_whiten(x, m, eps=0.0), expected)
    torch.testing.assert_close(masked_whiten(x, m, shift_mean=False, eps=0.0), torch.where(m.bool(), expected + 2.75, 0.0))
    assert statistics.stdev([1.0, 2.0, 3.0, 5.0]) == pytest.approx(std)


def test_masked_whiten_single_entry_is_zero_not_nan():
    out = masked_whiten(torch.tensor([[4.0, 1.0]]), torch.tensor([[1, 0]]))
    assert torch.equal(out, torch.zeros(1, 2))


def test_mask_shape_mismatch_is_a_clear_error():
    with pytest.raises(ValueError, match="mask has shape"):
        masked_mean(LOSS, MASK[:, :2])


@pytest.mark.parametrize(
    "mode, expected",
    [("token-mean", 21 / 6), ("seq-mean-token-mean", (2.5 + 5.5) / 2), ("seq-mean-token-sum", 21 / 2),
     ("seq-mean-token-sum-norm", 21 / (2 * 4))],
)
def test_aggregate_hand_values(mode, expected):
    # The empty third row counts as neither tokens nor a sequence.
    assert aggregate(LOSS, MASK, mode).item() == pytest.approx(expected)


def test_aggregate_global_counts_and_norm_len_hand_values():
    assert aggregate(LOSS, MASK, "token-mean", num_global_tokens=12).item() == pytest.approx(21 / 12)
    assert aggregate(LOSS, MASK, "seq-mean-token-sum", num_global_seqs=7).item() == pytest.approx(21 / 7)
    assert aggregate(LOSS, MASK, "seq-mean-token-mean", num_global_seqs=4).item() == pytest.approx(8 / 4)
    got = aggregate(LOSS, MASK, "seq-mean-token-sum-norm", num_global_seqs=3, norm_len=8)
    assert got.item() == pytest.approx(21 / (3 * 8))


def test_aggregation_counts():
    n_tok, n_seq = aggregation_counts(MASK)
    assert (int(n_tok), int(n_seq)) == (6, 2)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_aggregate_matches_naive_loop_on_random_inputs(mode):
    g = torch.Generator().manual_seed(3)
    for _ in range(5):
        loss = torch.randn(6, 9, generator=g, dtype=torch.float64)
        mask = torch.rand(6, 9, generator=g) < 0.6
        assert aggregate(loss, mask, mode).item() == pytest.approx(naive_aggregate(loss, mask, mode))
        got = aggregate(loss, mask, mode, num_global_tokens=40, num_global_seqs=11, norm_len=12)
        assert got.item() == pytest.approx(naive_aggregate(loss, mask, mode, 40, 11, 12))


def test_aggregate_empty_batch_is_zero():
    assert aggregate(torch.ones(2, 3), torch.zeros(2, 3), "token-mean").item() == 0.0
    assert aggregate(torch.ones(2, 3), torch.zeros(2, 3), "seq-mean-token-mean").item() == 0.0


def test_aggregate_errors_name_the_problem():
    with pytest.raises(ValueError, match="token-mean, seq-mean-token-mean"):
        aggregate(LOSS, MASK, "mean")
    with pytest.raises(ValueError, match="num_global_tokens=0.0 must be > 0"):
        aggregate(LOSS, MASK, "token-mean", num_global_tokens=0)
    with pytest.raises(ValueError, match="needs norm_len"):
        aggregate(LOSS, MASK, "seq-mean-token-sum-norm", num_global_seqs=3)
    with pytest.raises(ValueError, match="2-D"):
        aggregate(LOSS[0], MASK[0], "token-mean")


def test_per_microbatch_mean_differs_from_full_batch():
    # Shows the accumulation bug exists, so the split-invariance properties can fail:
    # averaging local token-means of unequal micro-batches is not the global mean.
    local = (aggregate(LOSS[:1], MASK[:1]) + aggregate(LOSS[1:], MASK[1:])) / 2
    assert local.item() != pytest.approx(aggregate(LOSS, MASK).item())
    glob = aggregate(LOSS[:1], MASK[:1], num_global_tokens=6) + aggregate(LOSS[1:], MASK[1:], num_global_tokens=6)
    assert glob.item() == pytest.approx(aggregate(LOSS, MASK).item())


@pytest.mark.parametrize("module", ["advantages", "aggregation", "masked", "kl"])
def test_docstring_examples_hold(module):
    mod = importlib.import_module(f"fuseflow.algorithms.{module}")
    result = doctest.testmod(mod, extraglobs={"torch": torch}, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0
