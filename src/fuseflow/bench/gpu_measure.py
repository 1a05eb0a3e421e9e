"""The three measurements of ``fuseflow bench gpu`` for one model shape: training, rollout, weight sync.

Each function builds what it measures from a ``ModelConfig`` (random weights, seed 0) on the
given device, frees it before returning, and reports the peak memory of its own phase
(``torch.cuda.max_memory_allocated`` after a reset on CUDA; on CPU the process's
``ru_maxrss``, which only grows, so it is the peak of the process so far).
"""

from __future__ import annotations

import gc
import json
import resource
import statistics
import time
from pathlib import Path

import torch

from fuseflow.models import CausalLM, ModelConfig
from fuseflow.sim.modelspec import ModelSpec

GB = 1e9


def sync(device: torch.device) -> None:
    """Wait for queued kernels, so a wall-clock interval covers the work it names."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device: torch.device) -> None:
    """Start a new phase for ``peak_memory_gb`` (CUDA's peak counters; nothing to reset on CPU)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gb(device: torch.device) -> dict:
    """Peak memory of the phase since ``reset_peak`` (CUDA), or of the process so far (CPU)."""
    if device.type == "cuda":
        return {"peak_memory_gb": torch.cuda.max_memory_allocated(device) / GB,
                "peak_memory_kind": "torch.cuda.max_memory_allocated (this phase)"}
    return {"peak_memory_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GB,
            "peak_memory_kind": "ru_maxrss (this process so far)"}


def free(device: torch.device) -> None:
    """Drop the last phase's tensors before the next one: a garbage collection, and on CUDA the cached blocks."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- training (GRPO update)
def grpo_batch(vocab: int, samples: int, prompt_len: int, response_len: int, seed: int = 0):
    """A ``Batch`` in the layout of one GRPO step: random tokens, every row full length (no padding),
    unit-variance advantages; the log-prob fields are filled by the caller from the model."""
    from fuseflow.data.batch import Batch

    g = torch.Generator().manual_seed(seed)
    seq = prompt_len + response_len
    return Batch({
        "input_ids": torch.randint(1, vocab, (samples, seq), generator=g),  # (B, Tp+Tr)
        "attention_mask": torch.ones(samples, seq, dtype=torch.long),  # (B, Tp+Tr)
        "response_mask": torch.ones(samples, response_len),  # (B, Tr)
        "advantages": torch.randn(samples, response_len, generator=g),  # (B, Tr)
    }, {"uid": list(range(samples)), "group_id": [i // 8 for i in range(samples)]})


def bench_train(model_cfg: ModelConfig, spec: ModelSpec, device: torch.device, dtype: torch.dtype,
                peak_flops: float | None, samples: int, micro: int, prompt_len: int, response_len: int,
                warmup: int, timed: int) -> dict:
    """Time ``ActorWorker.update`` (the GRPO policy loss, KL term, AdamW step) on one fixed batch.

    The model trains as the actor does: fp32 master weights, bf16 autocast on CUDA. Model FLOPs
    per update are 3x the forward FLOPs of ``ModelSpec.sequence_forward_flops`` per sequence
    (backward = 2x forward; recomputation and the optimizer not counted, as MFU is defined).
    MFU divides the achieved FLOP/s by ``peak_flops``; None when no peak is known.
    """
    from fuseflow.config import AlgorithmConfig, TrainerConfig
    from fuseflow.workers.actor import ActorWorker

    free(device)
    reset_peak(device)
    model = CausalLM.from_config(model_cfg, seed=0, device=device)
    algo = AlgorithmConfig(name="grpo")
    trainer = TrainerConfig(mini_batch_size=samples, micro_batch_size=micro, epochs=1, lr=1e-6)
    worker = ActorWorker(model, None, device, dtype, algo, trainer, temperature=1.0, norm_len=response_len)
    seq = prompt_len + response_len
    worker.token_budget = micro * seq  # micro-batches of `micro` full-length rows
    batch = grpo_batch(model_cfg.vocab_size, samples, prompt_len, response_len)
    old = worker.compute_logprobs(batch)  # the old_logprob stage, so the ratios start at 1
    for key in ("old_logprobs", "behavior_logprobs", "ref_logprobs"):
        batch[key] = old.clone()
    times = []
    for i in range(warmup + timed):
        sync(device)
        t0 = time.perf_counter()
        metrics = worker.update(batch, trainer.lr, algo.kl_coef, seed=i)
        sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    seconds = statistics.median(times)
    flops = samples * 3.0 * spec.sequence_forward_flops(seq)
    out = {"samples": samples, "micro_batch": micro, "prompt_len": prompt_len, "response_len": response_len,
           "warmup_updates": warmup, "timed_updates": timed, "update_seconds_all": [round(t, 4) for t in times],
           "update_seconds": seconds, "model_flops_per_update": flops, "achieved_tflops": flops / seconds / 1e12,
           "train_tokens_per_second": samples * seq / seconds, "mfu": flops / seconds / peak_flops if peak_flops else None,
           "loss_finite": all(torch.isfinite(torch.tensor(v)).item() for v in metrics.values()),
           **peak_memory_gb(device)}
    del worker, model, batch, old
    free(device)
    return out


# ---------------------------------------------------------------- rollout (engine vs transformers generate)
def bench_rollout(model_cfg: ModelConfig, device: torch.device, dtype: torch.dtype, slots: int, quick: bool,
                  repeats: int, log=print) -> dict:
    """``rollout.bench.bench_workload`` on the long-tail workload, with the model in the inference dtype."""
    from fuseflow.rollout.bench import VOCAB, bench_workload

    if model_cfg.vocab_size < VOCAB:
        raise ValueError(f"the rollout workload draws token ids below {VOCAB}; the model's vocab_size is "
                         f"{model_cfg.vocab_size}")
    free(device)
    reset_peak(device)
    model = CausalLM.from_config(model_cfg, seed=0, device=device, dtype=dtype).eval()
    with torch.inference_mode():
        r = bench_workload(model, "long_tail", slots, quick, repeats, "wall", log)
    keep = ("fuseflow_tok_s", "hf_tok_s", "speedup", "fuseflow_torch_linear_tok_s", "fuseflow_wall_s", "hf_wall_s",
            "requests", "generated_tokens", "response_len_p50", "response_len_p99", "response_len_max",
            "p99_over_p50", "preemptions")
    out = {"workload": "long_tail", "slots": slots, "repeats": repeats, **{k: r[k] for k in keep},
           **peak_memory_gb(device)}
    del model
    free(device)
    return out


# ---------------------------------------------------------------- weight sync (trainer -> replica)
def bench_weight_sync(model_cfg: ModelConfig, device: torch.device, dtype: torch.dtype, iters: int,
                      work_dir: Path, timeout_s: float = 300.0) -> dict:
    """Seconds per GB to send the policy's weights (in the inference dtype) from a trainer to a replica.

    Two processes and a broadcast (``controller.weight_sync``): NCCL with one GPU each when two
    GPUs are visible, gloo on CPU. NCCL refuses two ranks on one GPU, so with a single GPU the
    replica is colocated and the sync is a device copy in one process; ``method`` says which ran.
    ``verified``: the replica's weights differed before and equal the trainer's after.
    """
    if device.type == "cuda" and torch.cuda.device_count() < 2:
        return _colocated_copy(model_cfg, device, dtype, iters)
    import torch.multiprocessing as mp

    from fuseflow.controller.weight_sync import free_port

    backend = "nccl" if device.type == "cuda" else "gloo"
    out_path = Path(work_dir) / "weight_sync.json"
    mp.spawn(_sync_rank, args=(free_port(), backend, model_cfg.model_dump_json(), str(dtype).split(".")[-1], iters,
                               str(out_path), timeout_s), nprocs=2, join=True)
    return json.loads(out_path.read_text())


def _sync_rank(rank: int, port: int, backend: str, cfg_json: str, dtype_name: str, iters: int, out_path: str,
               timeout_s: float) -> None:
    """One rank of the weight-sync measurement (rank 0: the trainer, rank 1: the replica)."""
    import torch.distributed as dist

    from fuseflow.controller.weight_sync import broadcast_parameters, init_group

    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    init_group(backend, rank, 2, port, timeout_s)
    try:
        cfg = ModelConfig.model_validate_json(cfg_json)
        model = CausalLM.from_config(cfg, seed=rank, device=device, dtype=getattr(torch, dtype_name))
        params = list(model.parameters())
        before = _sums_agree(params, device)
        times, sent = [], 0
        for _ in range(iters + 1):  # the first is a warm-up: NCCL sets up its channels on the first call
            dist.barrier()
            sync(device)
            t0 = time.perf_counter()
            sent = broadcast_parameters(params, src=0)
            sync(device)
            dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # the sync is done when the slower side is
            times.append(float(dt))
        after = _sums_agree(params, device)
        if rank == 0:
            med = statistics.median(times[1:])
            Path(out_path).write_text(json.dumps({
                "method": f"{backend} broadcast, 2 processes", "bytes": sent, "gb": sent / GB, "iters": iters,
                "seconds_all": [round(t, 5) for t in times[1:]], "seconds": med, "seconds_per_gb": med / (sent / GB),
                "verified": (not before) and after}))
    finally:
        dist.destroy_process_group()


def _sums_agree(params: list[torch.Tensor], device: torch.device) -> bool:
    """Whether both ranks hold the same weights, by per-tensor float64 sums (a differing tensor changes its sum)."""
    import torch.distributed as dist

    mine = torch.stack([p.detach().double().sum() for p in params]).to(device)
    other = [torch.empty_like(mine) for _ in range(2)]
    dist.all_gather(other, mine)
    return bool(torch.equal(other[0], other[1]))


@torch.no_grad()
def _colocated_copy(model_cfg: ModelConfig, device: torch.device, dtype: torch.dtype, iters: int) -> dict:
    from fuseflow.models.parallelize import copy_full_weights

    free(device)
    src = CausalLM.from_config(model_cfg, seed=0, device=device, dtype=dtype)
    dst = CausalLM.from_config(model_cfg, seed=1, device=device, dtype=dtype)
    pairs = list(zip(src.parameters(), dst.parameters(), strict=True))
    before = all(torch.equal(a, b) for a, b in pairs)
    sent = sum(p.numel() * p.element_size() for p in src.parameters())
    times = []
    for _ in range(iters + 1):
        sync(device)
        t0 = time.perf_counter()
        copy_full_weights(src, dst)
        sync(device)
        times.append(time.perf_counter() - t0)
    after = all(torch.equal(a, b) for a, b in pairs)
    med = statistics.median(times[1:])
    del src, dst, pairs
    free(device)
    return {"method": "colocated device copy, 1 process (one GPU visible; NCCL needs one GPU per rank)",
            "bytes": sent, "gb": sent / GB, "iters": iters, "seconds_all": [round(t, 5) for t in times[1:]],
            "seconds": med, "seconds_per_gb": med / (sent / GB), "verified": (not before) and after}
