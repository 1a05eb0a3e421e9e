"""The CUDA path: parity with transformers, the engine, FSDP2 over NCCL, short RL runs, weight sync.

Every test here carries the ``gpu`` marker and skips itself without CUDA, so ``make test`` on a CPU
machine only reports them skipped and ``make test-gpu`` (``pytest -m gpu``) runs them where a GPU is.
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run with make test-gpu on a GPU)")]

transformers = pytest.importorskip("transformers")

CUDA = torch.device("cuda")


def _hf_llama(tmp_path, seed: int = 0):
    """A random LlamaForCausalLM (GQA, untied) saved as safetensors: the checkpoint both sides load."""
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                                   num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512,
                                   rope_theta=500000.0, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():  # non-unit norms, so the norm weights matter too
        for p in model.parameters():
            if p.ndim == 1:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(tmp_path / "ckpt", safe_serialization=True)
    return tmp_path / "ckpt"


def _forward_backward(model, ids):
    """(logits, {name: grad}) of the mean next-token loss; our model's keys equal HF's."""
    model.zero_grad(set_to_none=True)
    logits = model(ids).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                                             ids[:, 1:].reshape(-1))
    loss.backward()
    return logits.detach().float(), {n: p.grad.detach().float() for n, p in model.named_parameters()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_backward_parity_with_transformers_llama(tmp_path, dtype):
    from fuseflow.models import CausalLM

    path = _hf_llama(tmp_path)
    ids = torch.randint(0, 1024, (4, 128), generator=torch.Generator().manual_seed(1)).to(CUDA)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation="sdpa").to(CUDA)
    ours = CausalLM.from_pretrained(path, device=CUDA, dtype=dtype)
    hf_logits, hf_grads = _forward_backward(hf, ids)
    our_logits, our_grads = _forward_backward(ours, ids)
    assert set(our_grads) == set(hf_grads)
    if dtype == torch.float32:
        assert _rel(our_logits, hf_logits) < 1e-4
        assert max(_rel(our_grads[n], hf_grads[n]) for n in hf_grads) < 1e-3
    else:
        # bf16 rounds differently in different kernels: both sides must sit as close to an fp32
        # reference as each other, not bit-equal.
        ref = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).to(CUDA)
        ref_logits, ref_grads = _forward_backward(ref, ids)
        err_ours, err_hf = _rel(our_logits, ref_logits), _rel(hf_logits, ref_logits)
        assert err_ours < 2 * err_hf + 1e-3, (err_ours, err_hf)
        for n in ref_grads:
            assert _rel(our_grads[n], ref_grads[n]) < 2 * _rel(hf_grads[n], ref_grads[n]) + 2e-2, n


def test_engine_greedy_tokens_equal_transformers_generate_on_cuda():
    from fuseflow.models import CausalLM, ModelConfig
    from fuseflow.rollout.base import RolloutRequest, SamplingParams
    from fuseflow.rollout.engine import Engine, EngineConfig
    from fuseflow.rollout.hf_backend import HFBackend

    # fp32 and a wide init (0.2): the logits are spread, so kernel differences cannot flip an argmax.
    cfg = ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2)
    model = CausalLM.from_config(cfg, seed=0, device=CUDA).eval()
    g = torch.Generator().manual_seed(0)
    reqs = [RolloutRequest(i, torch.randint(1, 512, (int(torch.randint(1, 60, (1,), generator=g)),), generator=g).tolist(),
                           SamplingParams(greedy=True, max_new_tokens=int(torch.randint(1, 40, (1,), generator=g))))
            for i in range(24)]
    ref = {s.uid: s.response_ids for s in HFBackend(model, pad_id=0, batch_size=8).generate(reqs)}
    engine = Engine(model, EngineConfig(max_num_seqs=6, kv_budget_tokens=4096, block_size=16))
    got = {s.uid: s.response_ids for s in engine.generate(reqs)}
    assert got == ref
    assert len({len(v) for v in ref.values()}) > 5


def test_fsdp2_at_dp1_over_nccl_trains_like_the_plain_model():
    import torch.distributed as dist

    from fuseflow.controller.weight_sync import free_port, init_group
    from fuseflow.models import CausalLM, ModelConfig
    from fuseflow.models.parallelize import copy_full_weights, full_optimizer_state, is_sharded, shard_fsdp

    init_group("nccl", 0, 1, free_port(), timeout_s=120)
    try:
        cfg = ModelConfig.preset("small", vocab_size=256)
        plain = CausalLM.from_config(cfg, seed=0, device=CUDA)
        sharded = shard_fsdp(copy.deepcopy(plain), "cuda", 1)
        assert all(is_sharded(p) for p in sharded.parameters())
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (plain, sharded)]
        g = torch.Generator().manual_seed(0)
        for _ in range(3):
            ids = torch.randint(0, 256, (4, 64), generator=g).to(CUDA)
            for m, opt in zip((plain, sharded), opts, strict=True):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = m(ids).logits
                loss = torch.nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, 256), ids[:, 1:].reshape(-1))
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        gathered = CausalLM.from_config(cfg, seed=1, device=CUDA)
        copy_full_weights(sharded, gathered)
        for (n, a), b in zip(plain.named_parameters(), gathered.parameters(), strict=True):
            assert torch.allclose(a, b, atol=1e-5, rtol=1e-4), n
        state = full_optimizer_state(opts[1])
        assert len(state["state"]) == len(list(plain.parameters()))
    finally:
        dist.destroy_process_group()


def _tiny_run_overrides(cache, preset_steps: int = 5) -> list[str]:
    return ["device=cuda", "sft.max_steps=40", "sft.eval_every=20", "sft.eval_size=20", "task.train_size=400",
            "task.eval_size=20", f"trainer.steps={preset_steps}", "trainer.prompts_per_step=4", "algorithm.group_size=4",
            "trainer.mini_batch_size=8", "trainer.micro_batch_size=4", "trainer.eval_size=20", "trainer.eval_every=5",
            "trainer.save_every=5", f"cache_dir={cache}"]


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_five_rl_steps_of_the_default_preset_on_cuda(tmp_path, sft_cache, algorithm):
    from fuseflow.config import load_config
    from fuseflow.runner import train
    from fuseflow.telemetry.metrics import read_metrics

    cfg = load_config("default", _tiny_run_overrides(sft_cache) + [f"algorithm.name={algorithm}"])
    summary = train(cfg, tmp_path / "run")
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    for r in rows:
        for key in ("reward/mean", "actor/entropy", "kl/ref_k3", "perf/tokens_per_second"):
            assert math.isfinite(r[key]), (key, r[key])
        # The engine samples in the training model's weights; bf16 autocast in training moves log-probs a little.
        assert r["rollout/logprob_diff_max"] < 0.5
    assert summary["steps"] == 5
    assert (tmp_path / "run/checkpoints/step_5/actor/model.safetensors").is_file()


def test_weight_sync_colocated_on_one_gpu_copies_every_weight(tmp_path):
    from fuseflow.bench.gpu_measure import _colocated_copy
    from fuseflow.models import ModelConfig

    r = _colocated_copy(ModelConfig.preset("small", vocab_size=4096), CUDA, torch.bfloat16, iters=2)
    assert r["verified"] and r["seconds_per_gb"] > 0


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank: 2 GPUs for 2 processes")
def test_weight_sync_over_nccl_between_two_processes(tmp_path):
    from fuseflow.bench.gpu_measure import bench_weight_sync
    from fuseflow.models import ModelConfig

    r = bench_weight_sync(ModelConfig.preset("small", vocab_size=4096), CUDA, torch.bfloat16, 2, tmp_path)
    assert r["method"].startswith("nccl") and r["verified"] and r["seconds_per_gb"] > 0


def test_bench_gpu_quick_on_cuda(tmp_path):
    from typer.testing import CliRunner

    from fuseflow.cli import app

    out = tmp_path / "gpu.json"
    res = CliRunner().invoke(app, ["bench", "gpu", "--quick", "--device", "cuda", "--out", str(out)])
    assert res.exit_code == 0, res.output
    d = json.loads(out.read_text())
    assert d["device"]["type"] == "cuda"
    row = d["shapes"]["tiny"]
    assert row["train"]["loss_finite"] and row["rollout"]["fuseflow_tok_s"] > 0 and row["weight_sync"]["verified"]
    if d["hardware"] is not None and d["peak_flops"] is not None:
        assert 0 < row["train"]["mfu"] < 1
