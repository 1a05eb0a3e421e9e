"""Dispatch and collect with fake workers, in-process (no Ray): split, order, padding, futures."""

import time

import pytest
import torch

from controller_fakes import Echo, InlineGroup, build_echo, make_batch
from fuseflow.controller.cluster import LocalCluster
from fuseflow.controller.dispatch import (
    balanced_split,
    contiguous_split,
    from_wire,
    plan_for,
    restore,
    shard,
    to_wire,
)
from fuseflow.controller.worker import register
from fuseflow.data.batch import Batch


def test_balanced_split_by_hand():
    # weights 5,1,1,1,4,2 over 2 ranks of 3: LPT gives {5,1,1} and {1,4,2}, both summing to 7.
    plan = balanced_split([5, 1, 1, 1, 4, 2], 2)
    assert plan.parts == ((0, 1, 2), (3, 4, 5)) and plan.pad == (0, 0)
    # 5 rows over 3 ranks: two rows of padding make every rank hold 2 rows.
    plan = balanced_split([1, 1, 1, 1, 1], 3)
    assert [len(p) + d for p, d in zip(plan.parts, plan.pad, strict=True)] == [2, 2, 2] and sum(plan.pad) == 1
    assert sorted(i for p in plan.parts for i in p) == list(range(5))


def test_balanced_split_is_balanced_on_random_weights():
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        n, k = int(torch.randint(1, 40, (1,), generator=g)), int(torch.randint(1, 5, (1,), generator=g))
        w = torch.randint(1, 100, (n,), generator=g).tolist()
        plan = balanced_split(w, k)
        sizes = {len(p) + d for p, d in zip(plan.parts, plan.pad, strict=True)}
        assert sizes == {-(-n // k)}  # every rank padded to ceil(n/k)
        assert sorted(i for p in plan.parts for i in p) == list(range(n))
        loads = [sum(w[i] for i in p) for p in plan.parts]
        naive = [sum(w[r::k]) for r in range(k)]  # round-robin, the split it should beat or match
        assert max(loads) - min(loads) <= max(max(naive) - min(naive), max(w))


def test_contiguous_split_keeps_runs():
    assert contiguous_split(7, 3).parts == ((0, 1, 2), (3, 4), (5, 6))
    assert contiguous_split(2, 3).parts == ((0,), (1,), ())


def test_shard_pads_with_zero_loss_weight_and_restore_undoes_it():
    batch = make_batch(5, lengths=[3, 1, 2, 2, 1])
    plan = plan_for(batch, 2)
    pieces = shard(batch, plan)
    assert [len(p) for p in pieces] == [3, 3]
    padded = [p for p, d in zip(pieces, plan.pad, strict=True) if d][0]
    assert padded["response_mask"][-1].sum() == 0 and padded["attention_mask"][-1].sum() > 0  # still a valid row
    back = restore([p["row"] * 10 for p in pieces], plan)
    assert back.tolist() == [0, 10, 20, 30, 40]
    assert restore(pieces, plan).meta["uid"] == batch.meta["uid"]


def test_dp_split_restores_order_and_drops_padding():
    group = InlineGroup([Echo(), Echo(), Echo()])
    batch = make_batch(7)
    assert group.row_ids(batch).tolist() == list(range(7))
    sent = [w.seen[0] for w in group.workers]
    assert [len(uids) for uids, _ in sent] == [3, 3, 3]  # 7 rows + 2 padding rows
    real = sorted(u for uids, mask in sent for u, m in zip(uids, mask, strict=True) if m > 0)
    assert real == sorted(batch.meta["uid"])
    out = group.as_batch(batch)
    assert out.meta["uid"] == batch.meta["uid"] and out["double"].tolist() == [2 * i for i in range(7)]
    # A list is cut into contiguous runs, no padding.
    assert group.first_items(list("abcde")) == [(0, "a"), (0, "b"), (1, "c"), (1, "d"), (2, "e")]


def test_other_modes():
    group = InlineGroup([Echo(), Echo()])
    assert [(t, r, k) for t, r, k, _ in group.whoami("x")] == [("x", 0, 2), ("x", 1, 2)]
    assert group.only_rank_zero() == 0 and group.called[-1] == [0]
    assert group.per_rank([1, 2], y=[3, 4]) == [13, 24]
    with pytest.raises(ValueError, match="argument 0 must be a list with one value per rank"):
        group.per_rank(5)
    with pytest.raises(AttributeError, match="not_registered is not a registered worker method"):
        group.not_registered()
    with pytest.raises(ValueError, match="mode='broadcast' is not known"):
        register("broadcast")
    with pytest.raises(ValueError, match="collect='concat' restores a dp_split"):
        register("one_to_all", collect="concat")


def test_local_backend_is_a_plain_call_and_futures_are_eager():
    group = LocalCluster().group("echo", Echo, build_echo)
    batch = make_batch(4)
    fut = group.row_ids.future(batch)
    assert fut.done() and fut.result().tolist() == [0, 1, 2, 3]
    assert group.worker.seen[0][0] == batch.meta["uid"]  # the whole batch, not split or copied
    assert group.compute_seconds > 0 and group.calls == 1
    with pytest.raises(ValueError, match="boom"):  # in-process errors surface unchanged
        group.fail("boom")


def test_local_call_overhead_is_small():
    group = LocalCluster().group("echo", Echo, build_echo)
    t0 = time.perf_counter()
    for _ in range(200):
        group.whoami("x")
    per_call = (time.perf_counter() - t0) / 200
    assert per_call < 2e-3, per_call  # a dict lookup and a method call, not a serialization


def test_wire_roundtrip_keeps_dtypes():
    batch = Batch({"a": torch.arange(6).view(2, 3), "b": torch.randn(2).bfloat16(), "c": torch.ones(2, dtype=torch.bool)},
                  {"uid": ["x", "y"]})
    wire = to_wire({"batch": batch, "t": (torch.tensor([1.5]), 3)})
    back = from_wire(wire)
    for k in batch.tensors:
        assert back["batch"][k].dtype == batch[k].dtype and torch.equal(back["batch"][k], batch[k])
    assert back["batch"].meta == batch.meta and back["t"][1] == 3
