"""Pipeline-parallel executor: plan validation, exactness against one process, failures.

The multi-process tests start 2 gloo stage processes once per module (about 5 s) and run
every plan through them; each compares one optimizer step with `reference_step`, the
same step in a single process on the same micro-batches.
"""

from __future__ import annotations

import time

import pytest
import torch

from fuseflow.data.batch import Batch
from fuseflow.models.config import ModelConfig
from fuseflow.schedule.pipeline.actions import (
    InvalidPlan,
    Plan,
    one_f_one_b_plan,
    solved_plan,
    validate,
)
from fuseflow.schedule.pipeline.problem import PipelineInstance, Task
from fuseflow.schedule.pipeline.procs import StageFailure
from fuseflow.schedule.pipeline.stage import split_layers
from fuseflow.schedule.pipeline.train import ModelSpec, PipelineTrainer, reference_step, split_micro_batches

CFG = ModelConfig.preset("tiny", vocab_size=40)  # tied embeddings: exercises the tied-gradient sum
SPECS = {"A": ModelSpec("actor", CFG, seed=1, lr=1e-2, grad_clip=0.5),
         "B": ModelSpec("critic", CFG, seed=2, lr=1e-2, grad_clip=None)}


def make_batch(rows: int = 8, seed: int = 0) -> Batch:
    """Left-padded prompts and right-padded responses of varying lengths, with PPO fields."""
    g = torch.Generator().manual_seed(seed)
    tp, tr = 5, 6
    ids = torch.randint(1, 40, (rows, tp + tr), generator=g)
    p_len = torch.randint(2, tp + 1, (rows,), generator=g)
    r_len = torch.randint(1, tr + 1, (rows,), generator=g)
    cols = torch.arange(tp + tr)
    attn = ((cols >= tp - p_len[:, None]) & (cols < tp + r_len[:, None])).long()
    resp = attn[:, tp:].float()
    return Batch({
        "input_ids": ids * attn, "attention_mask": attn, "response_mask": resp,
        "old_logprobs": -torch.rand(rows, tr, generator=g) * 4, "advantages": torch.randn(rows, generator=g),
        "values": torch.randn(rows, tr, generator=g) * 0.1, "returns": torch.randn(rows, tr, generator=g),
    }, {})


@pytest.fixture(scope="module")
def trainer():
    with PipelineTrainer(SPECS, 2, timeout=30) as pt:
        yield pt


def fused_plan(m_a: int, m_b: int) -> Plan:
    plan = solved_plan(PipelineInstance(2, 2, m_a, m_b, 3, 2, 1.0, 1.0), seconds=5)
    assert solved_plan(PipelineInstance(2, 2, m_a, m_b, 3, 2, 1.0, 1.0), seconds=5) is plan  # cached per shape
    return plan


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], start: dict[str, torch.Tensor]):
    assert set(got) == set(want)
    moved = 0.0
    for k in want:
        assert torch.allclose(got[k], want[k], atol=1e-5, rtol=0), f"{k}: max diff {(got[k] - want[k]).abs().max()}"
        moved = max(moved, float((want[k] - start[k]).abs().max()))
    assert moved > 1e-3  # the step changed the weights, so equality is not trivial


@pytest.mark.parametrize("kind", ["1f1b", "fused", "serial", "fused-capped"])
def test_one_step_matches_single_process(trainer, kind):
    batch = make_batch(8, seed={"1f1b": 0, "fused": 1, "serial": 2, "fused-capped": 3}[kind])
    mbs = {"A": split_micro_batches(batch, 2), "B": split_micro_batches(batch, 2)}  # 4 micro-batches each
    if kind == "1f1b":
        # Actor alone in 1F1B, then the critic alone: each model's own pipeline.
        plans = [one_f_one_b_plan(2, {"A": 4}), one_f_one_b_plan(2, {"B": 4})]
    elif kind == "fused-capped":  # at most 2 micro-batches held per device (uncapped: 3)
        plans = [solved_plan(PipelineInstance(2, 2, 4, 4, 3, 2, 1.0, 1.0), seconds=5, memory_cap=2.0)]
        assert max(_held(seq) for seq in plans[0].order) == 2
    else:
        plans = [fused_plan(4, 4) if kind == "fused" else one_f_one_b_plan(2, {"A": 4, "B": 4})]
    trainer.reset()
    before = trainer.state_dicts()
    for plan in plans:
        out = trainer.step(plan, {m: mbs[m] for m in plan.micro_batches})
        assert len(out) == 2
    after = trainer.state_dicts()
    for model in ("A", "B"):
        assert_same(after[model], reference_step(SPECS[model], mbs[model]), before[model])
    # Tied copies stayed equal on the two stages.
    assert torch.equal(after["A"]["model.embed_tokens.weight"], after["A"]["lm_head.weight"])


def _held(seq) -> int:
    held = most = 0
    for t in seq:
        held += -1 if t.backward else 1
        most = max(most, held)
    return most


def test_split_layers_balances_parameters():
    # Hand-checked: 4 unit layers, 2 extra units on the last stage -> [3, 1] (max 3, not 4).
    assert split_layers([1, 1, 1, 1], 2, last_extra=2) == [3, 1]
    assert split_layers([1, 1, 1, 1], 2) == [2, 2]
    assert split_layers([5, 1, 1, 1], 2) == [1, 3]
    with pytest.raises(ValueError, match="cannot split 2 layers into 3"):
        split_layers([1, 1], 3)


def test_validate_names_device_and_action():
    good = one_f_one_b_plan(2, {"A": 2})
    validate(good)
    d0, d1 = good.order
    # Stage 1 runs its backward before its forward: the gradient cannot exist yet.
    swapped = Plan((d0, (d1[1], d1[0]) + d1[2:]), {"A": 2})
    with pytest.raises(InvalidPlan, match=r"^deadlock: device 1 waits at action A B0 s1 for A F0 s1"):
        validate(swapped)
    # Device 0 wants B0's gradient before sending F1, device 1 wants F1 before sending B0's... a cycle.
    cyc = Plan(((Task("A", 0, 0, 0, False), Task("A", 0, 0, 0, True), Task("A", 0, 1, 0, False),
                 Task("A", 0, 1, 0, True)),
                (Task("A", 0, 1, 1, False), Task("A", 0, 1, 1, True), Task("A", 0, 0, 1, False),
                 Task("A", 0, 0, 1, True))), {"A": 2})
    with pytest.raises(InvalidPlan, match=r"deadlock: device 0 waits at action A B0 s0 for A B0 s1 on device 1"):
        validate(cyc)
    with pytest.raises(InvalidPlan, match=r"^device 0: action A F0 s1 belongs on device 1"):
        validate(Plan(((Task("A", 0, 0, 1, False),) + d0[1:], d1), {"A": 2}))
    with pytest.raises(InvalidPlan, match=r"^device 1: action A B1 s1 is missing"):
        validate(Plan((d0, d1[:-1]), {"A": 2}))
    with pytest.raises(InvalidPlan, match=r"^device 0: action A F0 s0 appears twice"):
        validate(Plan((d0 + d0[:1], d1), {"A": 2}))


def test_fused_plan_runs_opposite_directions():
    plan = fused_plan(4, 4)
    validate(plan)
    # Each device interleaves both models (not one after the other as serial 1F1B does).
    for seq in plan.order:
        models = [t.model for t in seq]
        switches = sum(a != b for a, b in zip(models, models[1:], strict=False))
        assert switches >= 3
    assert {t.stage for t in plan.order[0] if t.model == "B"} == {1}


def test_invalid_plan_is_refused_before_running(trainer):
    bad = Plan(tuple(reversed(one_f_one_b_plan(2, {"A": 1}).order)), {"A": 1})
    with pytest.raises(InvalidPlan, match="device 0: action A F0 s1 belongs on device 1"):
        trainer.step(bad, {"A": split_micro_batches(make_batch(2), 2)})


def test_dead_stage_process_is_one_line_never_a_hang():
    batch = make_batch(8)
    mbs = {"A": split_micro_batches(batch, 2), "B": split_micro_batches(batch, 2)}
    plan = fused_plan(4, 4)
    with PipelineTrainer(SPECS, 2, timeout=20) as pt:
        t0 = time.monotonic()
        with pytest.raises(StageFailure) as err:
            pt.step(plan, mbs, die_at=(1, 5))
        assert time.monotonic() - t0 < 10  # well inside the 20 s wait timeout: the death is seen, not waited out
    msg = str(err.value)
    assert "\n" not in msg
    action = plan.order[1][5].label()
    assert msg.startswith(f"stage process rank 1 (actor stage 1, critic stage 0, at action {action}) died"), msg
