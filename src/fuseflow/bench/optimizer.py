"""``fuseflow bench optimizer``: fuseflow's AdamW step (``workers.optim.adamw``) against torch's default.

Every trainable role, SFT, the reward model and the pipeline stages build their optimizer with
``adamw``, which takes torch's fused kernel where every tensor allows it. This bench times one
``step()`` of it and of ``torch.optim.AdamW`` with torch's own choice of implementation (on CPU a
Python loop over the tensors; on CUDA the ``foreach`` kernels), over the parameters of a model
shape, the same gradients for both, the arms alternating in ABBA pairs. Reported per shape: the
median seconds of each arm's steps, the median of the per-pair ratios (fuseflow / default), and the
largest difference between the two arms' weights after the same steps (the fused kernel rounds
differently, so it is small but not zero).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from . import cpu_name, write_result

DEFAULT_SHAPES = ("tiny", "small")


def shape_config(name: str, vocab: int):
    """The decoder config of ``name``: a size preset (``tiny``, ``small``) or a simulator model spec."""
    from fuseflow.models import ModelConfig
    from fuseflow.models.config import PRESETS
    from fuseflow.sim.modelspec import MODEL_PRESETS

    if name in PRESETS:
        return ModelConfig.preset(name, vocab_size=vocab)
    if name in MODEL_PRESETS:
        from .gpu import config_from_spec

        return config_from_spec(MODEL_PRESETS[name])
    raise ValueError(f"--shape {name!r}: unknown; choose one of {', '.join([*PRESETS, *MODEL_PRESETS])}")


def check_args(shapes: list[str], steps: int, vocab: int) -> None:
    """Every shape name and the step count, before any work."""
    if steps < 2 or steps % 2:
        raise ValueError(f"--steps must be an even number of at least 2, got {steps}")
    for s in shapes:
        shape_config(s, vocab)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(shape: str, device: torch.device, steps: int, vocab: int, tick=lambda: None) -> dict:
    """Time ``steps`` AdamW steps per arm (after one untimed step each) over one shape's parameters."""
    from fuseflow.models import CausalLM
    from fuseflow.workers.optim import adamw

    model = CausalLM.from_config(shape_config(shape, vocab), seed=0, device=device)
    base = [p.detach() for p in model.parameters()]
    del model
    g = torch.Generator(device="cpu").manual_seed(0)
    grads = [(torch.randn(p.shape, generator=g) * 1e-3).to(device) for p in base]
    arms = {}
    for name in ("default", "fuseflow"):
        params = [torch.nn.Parameter(p.clone()) for p in base]
        for p, gr in zip(params, grads, strict=True):
            p.grad = gr  # shared and read-only: both arms see the same gradients
        opt = (torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, betas=(0.9, 0.95)) if name == "default"
               else adamw(params, 1e-3, 0.01))
        opt.step()  # untimed: allocates the moments
        arms[name] = (params, opt, [])
    del base
    order = ["default", "fuseflow", "fuseflow", "default"] * (steps // 2)
    for name in order:
        params, opt, times = arms[name]
        _sync(device)
        t0 = time.perf_counter()
        opt.step()
        _sync(device)
        times.append(time.perf_counter() - t0)
        tick()
    a, b = arms["default"], arms["fuseflow"]
    pairs = [fb / fa for fa, fb in zip(a[2], b[2], strict=True)]
    with torch.no_grad():
        diff = max(float((x - y).abs().max()) for x, y in zip(a[0], b[0], strict=True))
        scale = max(float(x.abs().max()) for x in a[0])
    fused = bool(b[1].defaults.get("fused"))
    return {"shape": shape, "parameters": sum(p.numel() for p in a[0]), "tensors": len(a[0]),
            "fuseflow_implementation": "fused" if fused else "torch default",
            "default_seconds_median": statistics.median(a[2]), "fuseflow_seconds_median": statistics.median(b[2]),
            "default_seconds": [round(t, 5) for t in a[2]], "fuseflow_seconds": [round(t, 5) for t in b[2]],
            "time_ratio_fuseflow_vs_default": statistics.median(pairs),
            "max_abs_weight_difference": diff, "max_abs_weight": scale, "steps_per_arm": steps + 1}


def run_optimizer_bench(shapes: list[str], steps: int, device_spec: str, vocab: int, progress=None) -> dict:
    """Every shape in turn (one shape's two copies of weights and moments at a time)."""
    from fuseflow.models import resolve_device

    device, _ = resolve_device(device_spec)
    check_args(shapes, steps, vocab)
    task = progress.add_task("adamw steps", total=2 * steps * len(shapes)) if progress else None
    tick = (lambda: progress.advance(task)) if progress else (lambda: None)
    results = [time_steps(s, device, steps, vocab, tick) for s in shapes]
    return {"benchmark": "adamw_step", "device": str(device), "cpu": cpu_name(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "shapes": results}


def register(bench_app) -> None:
    """Add ``fuseflow bench optimizer`` to the ``bench`` Typer app."""
    import typer

    @bench_app.command("optimizer")
    def bench_optimizer(shapes: list[str] = typer.Option(list(DEFAULT_SHAPES), "--shape",
                                                         help="Model shapes: tiny, small, or a simulator spec "
                                                         "such as qwen2.5-0.5b (two copies of its weights and "
                                                         "Adam moments are held at once)."),
                        steps: int = typer.Option(10, "--steps", help="Timed steps per arm, an even number."),
                        device: str = typer.Option("auto", "--device", help="auto, cpu or cuda."),
                        vocab: int = typer.Option(49152, "--vocab", help="Vocabulary of the size presets."),
                        out: Path = typer.Option(None, "--out", "-o", help="Write the JSON here.")) -> None:
        """One AdamW step: fuseflow's (torch's fused kernel) against torch's default, per model shape."""
        from fuseflow.console import console, fail, make_progress

        try:
            check_args(shapes, steps, vocab)
            with make_progress(console) as progress:
                r = run_optimizer_bench(shapes, steps, device, vocab, progress)
        except (ValueError, RuntimeError) as e:
            fail(str(e))
        for s in r["shapes"]:
            console.print(f"{s['shape']:14s} {s['parameters'] / 1e6:8.1f}M params  default "
                          f"{s['default_seconds_median'] * 1e3:8.1f} ms  fuseflow ({s['fuseflow_implementation']}) "
                          f"{s['fuseflow_seconds_median'] * 1e3:8.1f} ms  x{s['time_ratio_fuseflow_vs_default']:.3f}"
                          f"  weights differ by <= {s['max_abs_weight_difference']:.1e}", soft_wrap=True)
        write_result(out, r)

