"""Property tests (hypothesis) for the algorithm library.

- values on masked-out positions change no result, metric or gradient;
- aggregation, and the gradient of an aggregated loss, are the same however the batch
  is split into micro-batches and data-parallel ranks (given the global counts);
- group estimators do not depend on sample order or on how group ids are labelled.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fuseflow.algorithms import (
    AGG_MODES,
    aggregate,
    aggregation_counts,
    decoupled_policy_loss,
    dr_grpo,
    gae,
    grpo,
    masked_mean,
    masked_whiten,
    ppo_policy_loss,
    reinforce_pp,
    reinforce_pp_baseline,
    rloo,
    value_loss,
)

F64 = torch.float64
SETTINGS = settings(max_examples=25, deadline=None)


@st.composite
def batches(draw, max_b=6, max_t=8):
    """A (B, T) mask drawn by hypothesis (so it shrinks) plus a seed for the tensors."""
    b = draw(st.integers(1, max_b))
    t = draw(st.integers(1, max_t))
    rows = draw(st.lists(st.lists(st.booleans(), min_size=t, max_size=t), min_size=b, max_size=b))
    seed = draw(st.integers(0, 2**31 - 1))
    return torch.tensor(rows, dtype=torch.bool), torch.Generator().manual_seed(seed)


def rand(g, shape, scale=1.0):
    return torch.randn(*shape, generator=g, dtype=F64) * scale


def corrupt(x, mask, fill):
    """Overwrite masked-out entries; ``fill`` is a number (nan, inf, 1e30)."""
    return torch.where(mask, x, torch.full_like(x, fill))


FILLS = st.sampled_from([float("nan"), float("inf"), -1e30, 123.0])


def assert_same(a, b):
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, tuple):
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        torch.testing.assert_close(torch.as_tensor(a), torch.as_tensor(b), rtol=0, atol=0)


# ---------- masked positions are inert ----------

@SETTINGS
@given(batches(), FILLS)
def test_masked_positions_do_not_change_advantages(case, fill):
    m, g = case
    r, v = rand(g, m.shape), rand(g, m.shape)
    scores, gids = rand(g, (m.shape[0],)), torch.randint(0, 3, (m.shape[0],), generator=g)
    rc, vc = corrupt(r, m, fill), corrupt(v, m, fill)
    assert_same(gae(r, v, m, 0.9, 0.8), gae(rc, vc, m, 0.9, 0.8))
    assert_same(reinforce_pp(r, m, 0.9), reinforce_pp(rc, m, 0.9))
    assert_same(reinforce_pp_baseline(r, m, 0.9, scores, gids), reinforce_pp_baseline(rc, m, 0.9, scores, gids))
    assert_same(masked_whiten(r, m), masked_whiten(rc, m))
    assert_same(masked_mean(r, m, dim=-1), masked_mean(rc, m, dim=-1))


@SETTINGS
@given(batches(), FILLS, st.sampled_from(AGG_MODES), st.booleans())
def test_masked_positions_do_not_change_losses_or_gradients(case, fill, agg, seq_adv):
    m, g = case
    lp, old, behav = rand(g, m.shape, 0.5), rand(g, m.shape, 0.5), rand(g, m.shape, 0.5)
    adv = rand(g, (m.shape[0],)) if seq_adv else rand(g, m.shape)
    vals, old_vals, rets = rand(g, m.shape), rand(g, m.shape), rand(g, m.shape)

    def run(lp, old, behav, adv, vals, old_vals, rets):
        lp, vals = lp.clone().requires_grad_(), vals.clone().requires_grad_()
        results = [
            ppo_policy_loss(lp, old, adv, m, clip_high=0.28, dual_clip=3.0, agg=agg),
            decoupled_policy_loss(lp, old, behav, adv, m, agg=agg),
            value_loss(vals, old_vals, rets, m, agg=agg),
        ]
        total = sum(loss for loss, _ in results)
        grads = torch.autograd.grad(total, (lp, vals))
        return [(loss.detach(), met) for loss, met in results], total.detach(), grads

    clean = run(lp, old, behav, adv, vals, old_vals, rets)
    cadv = adv if seq_adv else corrupt(adv, m, fill)
    dirty = run(*(corrupt(x, m, fill) for x in (lp, old, behav)), cadv,
                *(corrupt(x, m, fill) for x in (vals, old_vals, rets)))
    for (l1, m1), (l2, m2) in zip(clean[0], dirty[0], strict=True):
        assert_same(l1, l2)
        assert_same(m1, m2)
    assert_same(clean[2], dirty[2])
    assert torch.isfinite(clean[1])


# ---------- split invariance: micro-batches x data-parallel ranks ----------

@st.composite
def splits(draw, n_rows):
    """Partition rows 0..n-1 into ranks, each into micro-batches, as nested index lists."""
    perm = draw(st.permutations(list(range(n_rows))))
    cuts = sorted(draw(st.lists(st.integers(0, n_rows), max_size=4)))
    chunks = [perm[a:b] for a, b in zip([0, *cuts], [*cuts, n_rows], strict=True)]
    chunks = [c for c in chunks if c] or [perm]
    n_ranks = draw(st.integers(1, len(chunks)))
    return [chunks[r::n_ranks] for r in range(n_ranks)]


def trimmed(rows, m):
    """Row indices and the column width a dynamic-padding micro-batch would use."""
    idx = torch.tensor(rows)
    cols = m[idx].any(dim=0).nonzero()
    width = int(cols.max()) + 1 if cols.numel() else 1
    return idx, width


@SETTINGS
@given(batches(max_b=8), st.data())
def test_aggregate_is_split_invariant_with_global_counts(case, data):
    m, g = case
    loss = rand(g, m.shape)
    plan = data.draw(splits(m.shape[0]))
    n_tok, n_seq = aggregation_counts(m)
    if n_tok == 0:
        return
    norm_len = m.shape[1]
    for mode in AGG_MODES:
        full = aggregate(loss, m, mode, norm_len=norm_len)
        total = torch.zeros((), dtype=F64)
        for rank in plan:
            # Each rank sums its micro-batches; ranks are then summed (an all-reduce SUM).
            for rows in rank:
                idx, w = trimmed(rows, m)
                total = total + aggregate(loss[idx, :w], m[idx, :w], mode, n_tok, n_seq, norm_len)
        torch.testing.assert_close(total, full)


@SETTINGS
@given(batches(max_b=8), st.data(), st.sampled_from(AGG_MODES))
def test_accumulated_gradient_equals_full_batch_gradient(case, data, mode):
    m, g = case
    n_tok, n_seq = aggregation_counts(m)
    if n_tok == 0:
        return
    lp = rand(g, m.shape, 0.5).requires_grad_()
    old, adv = rand(g, m.shape, 0.5), rand(g, (m.shape[0],))
    vals, old_vals, rets = rand(g, m.shape).requires_grad_(), rand(g, m.shape), rand(g, m.shape)
    kw = {"agg": mode, "norm_len": m.shape[1]}

    full = ppo_policy_loss(lp, old, adv, m, **kw)[0] + value_loss(vals, old_vals, rets, m, **kw)[0]
    full_grads = torch.autograd.grad(full, (lp, vals))

    gkw = {**kw, "num_global_tokens": n_tok, "num_global_seqs": n_seq}
    for rank in data.draw(splits(m.shape[0])):
        for rows in rank:
            idx, w = trimmed(rows, m)
            mb = (ppo_policy_loss(lp[idx, :w], old[idx, :w], adv[idx], m[idx, :w], **gkw)[0]
                  + value_loss(vals[idx, :w], old_vals[idx, :w], rets[idx, :w], m[idx, :w], **gkw)[0])
            mb.backward()  # accumulates into lp.grad / vals.grad like gradient accumulation
    torch.testing.assert_close(lp.grad, full_grads[0])
    torch.testing.assert_close(vals.grad, full_grads[1])


# ---------- group estimators: order and labels do not matter ----------

@SETTINGS
@given(st.lists(st.tuples(st.integers(-3, 3), st.floats(-5, 5, allow_nan=False)), min_size=1, max_size=12),
       st.randoms(use_true_random=False))
def test_group_estimators_are_order_and_label_invariant(samples, rnd):
    gids = torch.tensor([s[0] for s in samples])
    scores = torch.tensor([s[1] for s in samples], dtype=F64)
    perm = list(range(len(samples)))
    rnd.shuffle(perm)
    p = torch.tensor(perm)
    for fn in (grpo, dr_grpo, rloo):
        base = fn(scores, gids)
        torch.testing.assert_close(fn(scores[p], gids[p]), base[p], atol=1e-9, rtol=1e-9)
        # (gids * 7) % 11 relabels -3..3 one-to-one but in a different order.
        torch.testing.assert_close(fn(scores, (gids * 7) % 11), base, atol=1e-9, rtol=1e-9)


@SETTINGS
@given(st.lists(st.floats(-5, 5, allow_nan=False), min_size=2, max_size=8))
def test_grpo_group_has_zero_mean(xs):
    adv = grpo(torch.tensor(xs, dtype=F64), torch.zeros(len(xs), dtype=torch.long))
    assert float(adv.sum()) == pytest.approx(0.0, abs=1e-6)
