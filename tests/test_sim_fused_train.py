"""Fused actor/critic training: train_cost records its step shape, fused_train_seconds reads it."""

from __future__ import annotations

import numpy as np
import pytest

from fuseflow.policy.pipeline import fused_pipeline_bound
from fuseflow.sim.costmodel import (
    Layout,
    StageCost,
    fused_train_seconds,
    infer_cost,
    train_cost,
)  # fmt: skip
from test_sim_costmodel import HW, TOY  # the toy spec with round numbers: counts check by hand


def test_train_cost_records_steps_and_micro_batches_by_hand():
    # 64 samples over dp=2 and 2 mini-batches: 16 per rank per step; 400 // 100 = 4 samples
    # per micro-batch -> 4 micro-batches; 2 mini-batches x 3 epochs = 6 optimizer steps.
    cost = train_cost(
        TOY, HW, Layout(pp=2, dp=2), np.full(64, 100.0), mini_batches=2, epochs=3, mb_tokens=400
    )
    assert (cost.steps, cost.micro_batches) == (6, 4)
    # The recorded counts are the ones the totals were built from: 6 x (4 + 2 - 1) slots.
    rest = cost.parts["dp_comm"] + cost.parts["optimizer"]
    assert cost.seconds - rest == pytest.approx(6 * (4 + 2 - 1) * cost.slot)
    assert cost.bubble == pytest.approx(6 * (2 - 1) * cost.slot)
    # 30 samples, 4 per micro-batch: ceil(30 / 4) = 8 micro-batches (the last one short).
    ragged = train_cost(TOY, HW, Layout(pp=4), np.full(30, 100.0), mb_tokens=400)
    assert (ragged.steps, ragged.micro_batches) == (1, 8)
    # Inference has no optimizer step; StageCost built without the fields keeps the defaults.
    assert infer_cost(TOY, HW, Layout(pp=2), np.full(8, 100.0)).steps == 0


def test_fused_train_seconds_reads_the_recorded_step_shape():
    # Hand-built costs whose totals do not encode m (seconds=100): only the recorded fields
    # can tell fused_train_seconds that each of the 2 steps runs A with m=4 on 4 stages
    # (slot 6, forward f=2) and C with m=8 on 2 stages (slot 3, f=1).
    # Bound per step: work 4x6 + 8x3 = 48; 1F1B paths (4+3)x6 = 42 and (8+1)x3 = 27;
    # device 2 (A stage 2, C stage 1) adds arrival min(4, 1) = 1 and tail min(8, 2) = 2 -> 51.
    a = StageCost(
        100.0, {"dp_comm": 1.0, "optimizer": 2.0}, bubble=2 * 3 * 6.0, slot=6.0, steps=2, micro_batches=4
    )
    c = StageCost(
        100.0, {"dp_comm": 0.5, "optimizer": 0.5}, bubble=2 * 1 * 3.0, slot=3.0, steps=2, micro_batches=8
    )
    assert fused_pipeline_bound(4, 2, 4, 8, 6.0, 3.0) == pytest.approx(51.0)
    assert fused_train_seconds(a, c, 4, 2) == pytest.approx(2 * 51.0 + 3.0 + 1.0)
    assert fused_train_seconds(c, a, 2, 4) == pytest.approx(2 * 51.0 + 3.0 + 1.0)  # deeper pipeline plays A
    # Never worse than the two pipelines one after the other (1 + 100 < 106).
    short = StageCost(1.0, a.parts, bubble=a.bubble, slot=a.slot, steps=2, micro_batches=4)
    assert fused_train_seconds(short, c, 4, 2) == pytest.approx(101.0)


def test_fused_train_seconds_on_train_costs_equals_the_bound_by_hand():
    # 64 samples, 2 mini-batches: 32 per step, 4 per micro-batch -> m = 8 for both, 2 steps.
    seq = np.full(64, 100.0)
    a = train_cost(TOY, HW, Layout(pp=4), seq, mini_batches=2, mb_tokens=400)
    c = train_cost(TOY.as_value_model(), HW, Layout(pp=2), seq, mini_batches=2, mb_tokens=400)
    assert (a.steps, a.micro_batches, c.steps, c.micro_batches) == (2, 8, 2, 8)
    rest = sum(x.parts["dp_comm"] + x.parts["optimizer"] for x in (a, c))
    want = 2 * fused_pipeline_bound(4, 2, 8, 8, a.slot, c.slot) + rest
    assert want < a.seconds + c.seconds  # the bound, not the sequential fallback, is what is checked
    assert fused_train_seconds(a, c, 4, 2) == pytest.approx(want, rel=1e-12)


def test_fused_train_seconds_needs_recorded_steps():
    # A pipelined cost that does not say how many steps it holds cannot be fused.
    bare = StageCost(10.0, {}, bubble=2.0, slot=1.0)
    good = train_cost(TOY, HW, Layout(pp=2), np.full(32, 100.0), mb_tokens=400)
    with pytest.raises(ValueError, match=r"a\.steps=0"):
        fused_train_seconds(bare, good, 2, 2)
    with pytest.raises(ValueError, match=r"c\.steps=0"):
        fused_train_seconds(good, bare, 2, 2)
    # Unpipelined costs never need the fields: the stages simply run one after the other.
    assert fused_train_seconds(StageCost(3.0), StageCost(4.0), 1, 1) == pytest.approx(7.0)
