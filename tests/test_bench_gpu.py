"""``fuseflow bench gpu --quick --device cpu`` end to end (so the GPU bench cannot rot on CPU-only CI),
plus the pieces it rests on: FLOP counts against the model's own matrices, shapes from the simulator's
specs, the hardware-table lookup and the weight-sync buckets."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from fuseflow.bench.gpu import config_from_spec, device_peak, resolve_shape
from fuseflow.cli import app
from fuseflow.controller.weight_sync import buckets
from fuseflow.models import CausalLM
from fuseflow.sim.modelspec import MODEL_PRESETS, from_hf_config

runner = CliRunner()


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-gpu") / "tmp.json"
    res = runner.invoke(app, ["bench", "gpu", "--quick", "--device", "cpu", "--out", str(out)])
    assert res.exit_code == 0, res.output
    return json.loads(out.read_text()), res.output


def _naive_train_flops(model: CausalLM, samples: int, seq: int) -> float:
    """3 x forward FLOPs from the module itself: 2 per weight of every nn.Linear per token, plus QK^T and AV
    (2 matmuls x 2 FLOPs x heads x head_dim) for each causal (query, key) pair."""
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    c = model.config
    pairs = sum(range(1, seq + 1))
    forward = 2 * linear * seq + 4 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * pairs
    return 3.0 * samples * forward


def test_quick_cpu_bench_writes_sensible_figures(quick):
    d, output = quick
    assert d["device"]["type"] == "cpu" and d["quick"] is True
    assert "fuseflow bench gpu" in output and "tiny" in output  # the Rich table
    row = d["shapes"]["tiny"]
    tr, ro, ws = row["train"], row["rollout"], row["weight_sync"]
    s = d["settings"]
    cfg, _, _ = resolve_shape("tiny")
    model = CausalLM.from_config(cfg)
    assert row["params"] == model.num_parameters()
    assert tr["model_flops_per_update"] == pytest.approx(
        _naive_train_flops(model, s["samples"], s["prompt_len"] + s["response_len"]), rel=1e-12)
    assert tr["update_seconds"] > 0 and len(tr["update_seconds_all"]) == s["timed"] and tr["loss_finite"]
    # CPU: MFU against the table's stated CPU peak, consistent with the achieved FLOP/s.
    assert d["hardware"] == "cpu" and d["peak_flops"] > 0
    assert tr["mfu"] == pytest.approx(tr["achieved_tflops"] * 1e12 / d["peak_flops"])
    assert 0 < tr["mfu"] < 1
    assert ro["fuseflow_tok_s"] > 0 and ro["hf_tok_s"] > 0 and ro["generated_tokens"] > 0
    assert ro["speedup"] == pytest.approx(ro["fuseflow_tok_s"] / ro["hf_tok_s"])
    assert ro["workload"] == "long_tail" and ro["p99_over_p50"] > 1
    assert ws["method"].startswith("gloo") and ws["verified"] is True
    assert ws["bytes"] == sum(p.numel() * p.element_size() for p in model.parameters())
    assert ws["seconds_per_gb"] == pytest.approx(ws["seconds"] / ws["gb"]) and ws["seconds"] > 0
    for phase in (tr, ro):
        assert 0 < phase["peak_memory_gb"] < 64
    c = d["calibrate"]
    assert c["ran"] is True and c["hardware"] == "cpu" and c["steps"] == s["train_steps"]
    assert all(0 < v <= 1 for k, v in c["fitted_efficiency"].items() if k.endswith(("mfu", "mbu")))
    assert c["median_step_seconds"]["measured"] > 0
    assert d["checks"]["train_mfu_qwen2.5-1.5b_on_H100"] is None  # not an H100, not the 1.5B shape
    assert d["checks"]["rollout_speedup_long_tail_min"] == pytest.approx(ro["speedup"])


@pytest.mark.parametrize("name", ["qwen2.5-0.5b", "qwen2.5-1.5b"])
def test_sim_shapes_become_decoders_with_the_spec_parameter_count(name):
    spec = MODEL_PRESETS[name]
    cfg = config_from_spec(spec)
    assert from_hf_config(cfg.to_hf_dict()).params == spec.params
    with torch.device("meta"):  # no memory: only shapes
        model = CausalLM(cfg)
    assert model.num_parameters() == spec.params
    assert round(spec.params / 1e9, 2) == {"qwen2.5-0.5b": 0.49, "qwen2.5-1.5b": 1.54}[name]  # HF model cards


def test_cpu_peak_comes_from_the_table():
    p = device_peak(torch.device("cpu"), torch.float32)
    assert p["hardware"] == "cpu" and p["peak_flops"] == 333e9 and "table" in p["peak_source"]


def test_buckets_split_by_dtype_and_size():
    ps = [torch.zeros(8), torch.zeros(8), torch.zeros(3, dtype=torch.bfloat16), torch.zeros(100), torch.zeros(1)]
    assert buckets(ps, bucket_bytes=64) == [[0, 1], [3], [4], [2]]
    assert sorted(i for b in buckets(ps, bucket_bytes=1) for i in b) == list(range(5))


@pytest.mark.parametrize("args,message", [
    (["--shapes", "nope"], "shape 'nope': unknown"),
    (["--slots", "0"], "--slots must be >= 1"),
    (["--model-path", "/no/such/dir"], "not a directory"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, message):
    res = runner.invoke(app, ["bench", "gpu", "--quick", "--device", "cpu", "--out", str(tmp_path / "x.json"), *args])
    assert res.exit_code == 2 and message in res.output and "Traceback" not in res.output
    assert not (tmp_path / "x.json").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error when no GPU is visible")
def test_cuda_without_a_gpu_is_a_clear_error(tmp_path):
    res = runner.invoke(app, ["bench", "gpu", "--quick", "--device", "cuda", "--out", str(tmp_path / "x.json")])
    assert res.exit_code == 2 and "no GPU is visible" in res.output
