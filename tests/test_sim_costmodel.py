"""Cost-model formulas against hand-computed values, and memory feasibility."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fuseflow.policy.pipeline import fused_pipeline_bound
from fuseflow.sim.costmodel import (
    DecodeModel,
    Layout,
    allreduce_seconds,
    fused_train_seconds,
    infer_cost,
    model_state_bytes,
    reshard_seconds,
    train_cost,
)  # fmt: skip
from fuseflow.sim.hardware import Efficiency, HardwareSpec, get_hardware, load_hardware
from fuseflow.sim.modelspec import ModelSpec, from_hf_config, get_model

# Round numbers so every expected value below can be checked by hand.
HW = HardwareSpec("toy", peak_flops=1e12, mem_bw=1e11, mem_capacity=1e12, intra_bw=1e10, inter_bw=1e9,
                  gpus_per_node=8, param_bytes=2, usable_memory_fraction=1.0,
                  efficiency=Efficiency(train_mfu=0.5, infer_mfu=0.5, decode_mbu=0.5, comm=1.0,
                                        layer_latency_s=0.0, collective_latency_s=0.0))  # fmt: skip
TOY = ModelSpec("toy", hidden=8, layers=2, heads=2, kv_heads=1, ffn=16, vocab=10)


def test_parameter_counts_match_published_sizes():
    # Exact counts of the Hugging Face checkpoints (sum of tensor sizes).
    assert get_model("llama-7b").params == 6_738_415_616
    assert get_model("llama-70b").params == 68_976_648_192
    assert get_model("qwen2.5-7b").params == 7_615_616_512


def test_toy_counts_and_flops_by_hand():
    # layer: q 8x8 + k,v 2x(8x4) + o 8x8 = 192, MLP 3x8x16 = 384, norms 16 -> 592
    assert TOY.layer_params == 592
    assert TOY.params == 2 * 592 + 10 * 8 + 8 + 10 * 8
    assert TOY.matmul_params == 2 * 576 + 80
    # 3 tokens attending 6 keys in total: 2 x 1232 x 3 + 4 x 2 layers x 2 heads x 4 dims x 6
    assert TOY.forward_flops(3, 6) == 2 * 1232 * 3 + 4 * 2 * 2 * 4 * 6
    assert TOY.kv_bytes_per_token(2) == 2 * 2 * 1 * 4 * 2
    assert TOY.as_value_model().head_params == 9


def test_from_hf_config_reads_gqa_and_tied_head():
    spec = from_hf_config({"hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
                           "num_key_value_heads": 2, "intermediate_size": 384, "vocab_size": 40,
                           "tie_word_embeddings": True})  # fmt: skip
    assert (spec.kv_heads, spec.head_dim, spec.head_params) == (2, 32, 0)
    with pytest.raises(ValueError, match="missing keys"):
        from_hf_config({"hidden_size": 8})


def test_train_cost_single_device_by_hand():
    seq = np.full(8, 100.0)
    cost = train_cost(TOY, HW, Layout(), seq, mini_batches=1, epochs=1)
    fwd = 8 * TOY.forward_flops(100, 100 * 101 / 2)  # one micro-batch of all 8 samples
    compute = 3 * fwd / (1e12 * 0.5)  # forward + backward (2x forward) = 6N per token
    adam = 2 * TOY.params * (2 * 2 + 12) / (1e11 * 0.5)  # read + write weights, grads, Adam state
    assert cost.seconds == pytest.approx(compute + adam)
    rc = train_cost(TOY, HW, Layout(recompute=True), seq)
    assert rc.parts["compute"] == pytest.approx(4 / 3 * compute)  # recomputation adds one forward


def test_pipeline_bubble_is_1f1b():
    seq = np.full(64, 100.0)
    lay = Layout(pp=2)
    cost = train_cost(TOY, HW, lay, seq, mb_tokens=400)  # 4 samples per micro-batch -> m = 16
    assert cost.bubble == pytest.approx((2 - 1) * cost.slot)
    assert cost.seconds - cost.parts["optimizer"] == pytest.approx((16 + 2 - 1) * cost.slot)


def test_fused_pipeline_bound_reproduces_rlhfuse_instances():
    # The issue-8 bounds (and FlexFusion's makespans): slot = 3f (forward + backward).
    assert fused_pipeline_bound(8, 4, 32, 16, 15, 12) == pytest.approx(708)
    assert fused_pipeline_bound(8, 8, 32, 32, 15, 6) == pytest.approx(702)
    assert fused_pipeline_bound(8, 4, 8, 4, 15, 12) == pytest.approx(225)  # A's own 1F1B binds


def test_fused_pipeline_bound_agrees_with_the_schedulers_bound():
    # The cost model keeps a float copy of the solver's integer bound; pin them together.
    from fuseflow.schedule.pipeline import PipelineInstance, lower_bound

    rng = np.random.default_rng(0)
    for _ in range(300):
        p_a = int(rng.choice([1, 2, 4, 6, 8, 12, 16]))
        p_c = int(rng.choice([d for d in range(1, p_a + 1) if p_a % d == 0]))
        m_a, m_c, f_a, f_c = (int(x) for x in rng.integers(1, 40, 4))
        want = lower_bound(PipelineInstance(p_a, p_c, m_a, m_c, f_a, f_c, 1.0, 1.0)).value
        assert fused_pipeline_bound(p_a, p_c, m_a, m_c, 3 * f_a, 3 * f_c) == pytest.approx(want), (p_a, p_c)


def test_fused_training_prices_the_pipeline_bound_and_never_loses():
    # 32 samples, 4 per micro-batch: 8 micro-batches of one slot on 4 stages, one step.
    a = train_cost(TOY, HW, Layout(pp=4), np.full(32, 100.0), mb_tokens=400)
    c = train_cost(TOY, HW, Layout(pp=4), np.full(32, 100.0), mb_tokens=400)
    fused = fused_train_seconds(a, c, 4, 4)
    rest = 2 * (a.parts["dp_comm"] + a.parts["optimizer"])
    # Same slot s for both: devices hold 16 slots of work; device 1 (A stage 1, C stage 2)
    # adds arrival min(s/3, 2s/3) and tail min(2s/3, 4s/3): 16s + s/3 + 2s/3 = 17s.
    assert fused == pytest.approx(17 * a.slot + rest)
    assert fused < a.seconds + c.seconds  # two 1F1B pipelines: 2 x (8 + 3) slots
    flat = train_cost(TOY, HW, Layout(), np.full(32, 100.0))
    assert fused_train_seconds(flat, flat, 1, 1) == pytest.approx(2 * flat.seconds)
    # Stage counts that do not divide each other keep the bidirectional closed form.
    c3 = train_cost(TOY, HW, Layout(pp=3), np.full(32, 100.0), mb_tokens=400)
    closed = a.seconds - a.bubble + c3.seconds - c3.bubble + 0.5 * (2 * a.slot + 1 * c3.slot)
    assert fused_train_seconds(a, c3, 4, 3) == pytest.approx(closed)


def test_infer_cost_is_one_forward():
    seq = np.full(4, 50.0)
    cost = infer_cost(TOY, HW, Layout(), seq)
    assert cost.seconds == pytest.approx(4 * TOY.forward_flops(50, 50 * 51 / 2) / (1e12 * 0.5))


def test_collectives_and_resharding():
    assert allreduce_seconds(HW, 1e9, 4, 1e10) == pytest.approx(2 * 3 / 4 * 1e9 / 1e10)
    assert allreduce_seconds(HW, 1e9, 1, 1e10) == 0.0
    big = get_model("llama-7b")
    m_bytes = big.params * 2
    # HybridFlow: training tp8 -> generation tp2 gathers (8 - 2) / (2 x 8) of the model per device.
    assert reshard_seconds(big, HW, Layout(tp=8), 2, 1) == pytest.approx(m_bytes * 6 / 16 / 1e10)
    assert reshard_seconds(big, HW, Layout(tp=2), 8, 1) == 0.0


def test_decode_roofline_by_hand():
    dm = DecodeModel(TOY, HW)
    w = TOY.params * 2
    # One sequence with 10 keys: memory-bound, reads the weights and 10 tokens of KV.
    mem = (w + 10 * TOY.kv_bytes_per_token(2)) / (1e11 * 0.5)
    flops = 2 * TOY.matmul_params + 4 * 2 * 2 * 4 * 10
    assert dm.step_seconds(np.array([1.0]), np.array([10.0]))[0] == pytest.approx(max(mem, flops / 5e11))
    # Huge batch: compute-bound.
    n, ctx = 1e6, 1e6
    comp = (n * 2 * TOY.matmul_params + 4 * 2 * 2 * 4 * ctx) / 5e11
    assert dm.step_seconds(np.array([n]), np.array([ctx]))[0] == pytest.approx(comp)


@pytest.mark.parametrize("tp,pp", [(1, 1), (4, 1), (2, 4)])
def test_segment_sum_matches_naive_loop(tp, pp):
    dm = DecodeModel(get_model("llama-13b"), get_hardware("H100"), tp, pp)
    for n, ctx0, k in [(3, 3000.0, 500), (200, 2e5, 1000), (64, 64 * 300.0, 2000), (1, 100.0, 7)]:
        naive = sum(float(dm.step_seconds(np.array([n], float), np.array([ctx0 + n * j]))[0]) for j in range(k))
        assert dm.segment_seconds(n, ctx0, k) == pytest.approx(naive, rel=1e-9)


def test_memory_by_hand_and_feasibility():
    m = get_model("llama-7b")
    p = m.params
    assert model_state_bytes(m, HW, Layout(tp=2, dp=4), trainable=True) == pytest.approx(p / 2 * 4 + 12 * p / 2 / 4)
    assert model_state_bytes(m, HW, Layout(tp=2, dp=4, zero=3), trainable=True) == pytest.approx(16 * p / 8)
    assert model_state_bytes(m, HW, Layout(), trainable=False) == pytest.approx(2 * p)
    h100 = get_hardware("H100")
    assert model_state_bytes(get_model("llama-70b"), h100, Layout(), True) > h100.usable_memory
    assert model_state_bytes(m, h100, Layout(), False) < h100.usable_memory


def test_hardware_lookup_and_file(tmp_path):
    assert get_hardware("h100").name == "H100"
    with pytest.raises(ValueError, match="choose one of"):
        get_hardware("B200")
    path = tmp_path / "b200.json"
    path.write_text(json.dumps({"name": "B200", "peak_flops": 2.25e15, "mem_bw": 8e12, "mem_capacity": 192e9,
                                "intra_bw": 9e11, "inter_bw": 1e11, "efficiency": {"train_mfu": 0.35}}))  # fmt: skip
    spec = load_hardware(path)
    assert spec.efficiency.train_mfu == 0.35 and spec.efficiency.infer_mfu == 0.5
    with pytest.raises(ValueError, match="efficiency.train_mfu"):
        Efficiency(train_mfu=1.5)


def test_data_parallel_reduces_fp32_gradients_and_gathers_weights_by_hand():
    # 8 samples of 4 tokens on 4 DP ranks: one micro-batch of 2 samples per rank, so little
    # compute that the slot is weight-streaming bound and the DP collectives show.
    big = get_model("llama-7b")
    p = big.params
    cost = train_cost(big, HW, Layout(dp=4), np.full(8, 4.0))
    stream = p * (3 * 2 + 2 * 4) / (1e11 * 0.5)  # 3 passes of bf16 weights + fp32 grad read/write
    assert cost.parts["compute"] == pytest.approx(stream)
    reduce = 3 / 4 * p * 4 / 1e10  # reduce-scatter of fp32 gradients, hidden behind the backward
    gather = 3 / 4 * p * 2 / 1e10  # all-gather of bf16 weights, hidden behind the next forward
    expected = (reduce - 2 / 3 * stream) + (gather - 1 / 3 * stream)
    assert cost.parts["dp_comm"] == pytest.approx(expected)
    # FSDP: two weight gathers and one gradient reduce-scatter per micro-batch.
    z3 = train_cost(big, HW, Layout(dp=4, zero=3), np.full(8, 4.0))
    assert z3.parts["zero3_comm"] == pytest.approx(2 * gather + reduce - stream)
    assert z3.parts["dp_comm"] == 0.0


def test_forward_is_a_roofline_over_weight_streaming():
    big = get_model("llama-7b")
    few = infer_cost(big, HW, Layout(), np.full(2, 4.0))  # 8 tokens: bound by reading 13.5 GB
    assert few.seconds == pytest.approx(big.params * 2 / (1e11 * 0.5))
    many = infer_cost(big, HW, Layout(), np.full(4, 1000.0))  # 4000 tokens: FLOP-bound
    assert many.seconds == pytest.approx(4 * big.forward_flops(1000, 1000 * 1001 / 2) / (1e12 * 0.5))
