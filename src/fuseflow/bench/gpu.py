"""``fuseflow bench gpu``: what the CUDA path achieves, in one command, on whatever device is present.

For each model shape (a pretrained checkpoint given with ``--model-path``, then random-weight
shapes from the simulator's model specs: ``qwen2.5-0.5b`` and ``qwen2.5-1.5b``; ``--quick`` uses
the ``tiny`` preset) it measures (see ``gpu_measure``):

- training MFU of a GRPO update (``ActorWorker.update``): model FLOPs from ``ModelSpec`` over the
  device's peak bf16 FLOP/s from the simulator's hardware table (``sim.hardware``). A GPU that
  the table lacks gets MFU null; on CPU the table's ``cpu`` entry (fp32 peak of the 2-core
  development machine) is the reference, and the JSON says so;
- rollout tokens/s of fuseflow's engine against transformers ``generate`` on the long-tail
  workload of ``fuseflow bench rollout``;
- weight-sync seconds per GB from a trainer process to a replica;
- peak memory of each phase.

Then it runs a short ``fuseflow train`` (default preset, GRPO on addition, SFT off) on the same
device and fits ``fuseflow sim calibrate`` to that run directory, so the simulator's efficiency
factors come from this device; when the device is not in the hardware table, the JSON says that
calibration did not run and why.
"""

from __future__ import annotations

import io
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

import torch

from fuseflow.models import ModelConfig, resolve_device
from fuseflow.models.hf_io import read_hf_config
from fuseflow.sim.hardware import HARDWARE
from fuseflow.sim.modelspec import MODEL_PRESETS, ModelSpec, from_hf_config

from . import cpu_name, write_result
from .gpu_measure import bench_rollout, bench_train, bench_weight_sync

FULL_SHAPES = ("qwen2.5-0.5b", "qwen2.5-1.5b")
QUICK_SHAPES = ("tiny",)
TARGETS = {"train_mfu_qwen2.5-1.5b_on_H100": 0.40, "rollout_speedup_long_tail": 5.0}

# Per-shape settings. Full: a GRPO step's worth of long rows (16 samples of 1024 tokens, 4 per
# micro-batch); quick: small enough that the whole CPU path runs in well under a minute.
FULL = dict(samples=16, micro=4, prompt_len=256, response_len=768, warmup=1, timed=3, rollout_repeats=2,
            sync_iters=5, train_steps=8)
QUICK = dict(samples=8, micro=4, prompt_len=16, response_len=48, warmup=1, timed=2, rollout_repeats=1,
             sync_iters=3, train_steps=4)


def config_from_spec(spec: ModelSpec) -> ModelConfig:
    """The decoder config of a simulator model spec (Qwen-style specs have q/k/v biases)."""
    return ModelConfig(architecture="qwen2" if spec.qkv_bias else "llama", vocab_size=spec.vocab,
                       hidden_size=spec.hidden, intermediate_size=spec.ffn, num_hidden_layers=spec.layers,
                       num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads, head_dim=spec.head_dim,
                       tie_word_embeddings=spec.tied_embeddings, max_position_embeddings=4096)


def resolve_shape(name: str, model_path: Path | None = None) -> tuple[ModelConfig, ModelSpec, str]:
    """(decoder config, spec for FLOPs, source) of a shape name: ``pretrained``, ``tiny`` or a sim preset."""
    from fuseflow.rollout.bench import VOCAB

    if name == "pretrained":
        if model_path is None:
            raise ValueError("shape 'pretrained' needs --model-path DIR (a Hugging Face model directory)")
        cfg = ModelConfig.from_hf_dict(read_hf_config(model_path))
        source = f"pretrained config {model_path} (random weights of its shape)"
    elif name == "tiny":
        cfg, source = ModelConfig.preset("tiny", vocab_size=VOCAB), "tiny preset, random weights"
    elif name in MODEL_PRESETS:
        cfg, source = config_from_spec(MODEL_PRESETS[name]), "sim model spec, random weights"
    else:
        raise ValueError(f"shape {name!r}: unknown; choose pretrained, tiny or one of {', '.join(MODEL_PRESETS)}")
    return cfg, from_hf_config(cfg.to_hf_dict(), name=name), source


def device_peak(device: torch.device, dtype: torch.dtype) -> dict:
    """The hardware-table entry for ``device`` and its peak FLOP/s for ``dtype``, or None with the reason.

    Only exact matches count: the H100 entry is the SXM5 part, so a PCIe or NVL H100 (lower clocks)
    gets no peak rather than a wrong one.
    """
    if device.type == "cpu":
        hw = HARDWARE["cpu"]
        return {"hardware": "cpu", "peak_flops": hw.peak_flops,
                "peak_source": "sim hardware table 'cpu': fp32 peak of the 2-core AMD EPYC development machine "
                               f"({hw.peak_flops / 1e9:.0f} GFLOP/s); on another CPU the MFU figure is only indicative"}
    name = torch.cuda.get_device_name(device)
    lowered = name.lower()
    match = [k for k in HARDWARE if k != "cpu" and k.lower() in lowered]
    if not match or any(v in lowered for v in ("pcie", "nvl")):
        return {"hardware": None, "peak_flops": None,
                "peak_source": f"{name!r} is not in the sim hardware table ({', '.join(HARDWARE)}): MFU not reported"}
    if dtype != torch.bfloat16:
        return {"hardware": match[0], "peak_flops": None,
                "peak_source": f"the table holds bf16 peaks; this GPU trains in {dtype}: MFU not reported"}
    hw = HARDWARE[match[0]]
    return {"hardware": match[0], "peak_flops": hw.peak_flops,
            "peak_source": f"sim hardware table {match[0]!r}: {hw.peak_flops / 1e12:.0f} TFLOP/s bf16 dense"}


def device_info(device: torch.device, dtype: torch.dtype) -> dict:
    """What a result was measured on: device type and name, dtype, torch/transformers/Python versions,
    and the GPU count, CUDA version and memory (CUDA) or the core and torch-thread counts (CPU)."""
    import transformers

    info = {"type": device.type, "dtype": str(dtype).split(".")[-1], "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version()}
    if device.type == "cuda":
        info |= {"name": torch.cuda.get_device_name(device), "count": torch.cuda.device_count(),
                 "cuda": torch.version.cuda, "memory_gb": torch.cuda.get_device_properties(device).total_memory / 1e9}
    else:
        info |= {"name": cpu_name(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    return info


def calibrate_on_train_run(device_spec: str, hardware: str | None, steps: int, quick: bool, work_dir: Path) -> dict:
    """A short ``fuseflow train`` on this device, then ``sim.calibrate.calibrate`` fitted to its run directory."""
    from rich.console import Console

    from fuseflow.config import load_config
    from fuseflow.runner import train
    from fuseflow.sim.calibrate import calibrate

    # RL starts from an SFT model (a short warm start here, cached in the work directory); calibration
    # reads only the RL steps' metrics and trace.
    overrides = [f"device={device_spec}", f"trainer.steps={steps}", "trainer.eval_size=8", "task.eval_size=20",
                 "task.train_size=256", "trainer.eval_every=1000", "trainer.save_every=1000", "sft.eval_size=20",
                 f"cache_dir={work_dir / 'cache'}"]
    overrides += (["sft.max_steps=20", "sft.eval_every=20", "trainer.prompts_per_step=4", "algorithm.group_size=4",
                   "trainer.mini_batch_size=8", "trainer.micro_batch_size=8"] if quick
                  else ["sft.max_steps=100", "sft.eval_every=50", "model.size=small"])
    run_dir = work_dir / "train-run"
    t0 = time.perf_counter()
    train(load_config("default", overrides), run_dir, console=Console(file=io.StringIO()))
    out = {"train_overrides": overrides, "train_wall_seconds": time.perf_counter() - t0}
    if hardware is None:
        return out | {"ran": False, "reason": "this device is not in the sim hardware table, so there is no "
                                              "spec whose efficiency factors could be fitted"}
    try:
        fitted = calibrate(run_dir, hardware)
    except ValueError as e:  # the run directory lacks what calibration reads
        return out | {"ran": False, "reason": str(e)}
    fitted.pop("run_dir", None)  # a temporary directory
    return out | {"ran": True, **fitted}


def run_gpu_bench(device_spec: str = "auto", quick: bool = False, shapes: tuple[str, ...] | None = None,
                  model_path: Path | None = None, slots: int = 32, work_dir: Path | None = None,
                  calibrate: bool = True, threads: int | None = None, log=print, progress=None) -> dict:
    """Every measurement on every shape, plus the calibration run; the JSON-ready result."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    if threads:
        torch.set_num_threads(threads)
    device, dtype = resolve_device(device_spec)
    if shapes is None:
        shapes = QUICK_SHAPES if quick else (("pretrained",) if model_path else ()) + FULL_SHAPES
    resolved = {name: resolve_shape(name, model_path) for name in shapes}  # bad names fail before any work
    s = QUICK if quick else FULL
    peak = device_peak(device, dtype)
    tmp = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="fuseflow-bench-gpu-"))
    tmp.mkdir(parents=True, exist_ok=True)
    bar = progress.add_task("bench gpu", total=3 * len(shapes) + int(calibrate)) if progress else None
    t_start = time.perf_counter()
    result = {"benchmark": "gpu", "date": time.strftime("%Y-%m-%d"), "quick": quick, "device": device_info(device, dtype),
              **peak, "targets": TARGETS, "settings": s, "shapes": {}}
    try:
        for name, (cfg, spec, source) in resolved.items():
            row = result["shapes"][name] = {"source": source, "params": spec.params,
                                            "architecture": cfg.architecture}
            for phase in ("train", "rollout", "weight_sync"):
                log(f"{name}: {phase}")
                t_phase = time.perf_counter()
                if phase == "train":
                    row[phase] = bench_train(cfg, spec, device, dtype, peak["peak_flops"], s["samples"], s["micro"],
                                             s["prompt_len"], s["response_len"], s["warmup"], s["timed"])
                elif phase == "rollout":
                    row[phase] = bench_rollout(cfg, device, dtype, slots, quick, s["rollout_repeats"], log)
                else:
                    row[phase] = bench_weight_sync(cfg, device, dtype, s["sync_iters"], tmp)
                row[phase]["phase_wall_seconds"] = time.perf_counter() - t_phase
                if progress:
                    progress.advance(bar)
        if calibrate:
            log("calibrate: short train run")
            result["calibrate"] = calibrate_on_train_run(device_spec, peak["hardware"], s["train_steps"], quick, tmp)
            if progress:
                progress.advance(bar)
        else:
            result["calibrate"] = {"ran": False, "reason": "--no-calibrate"}
    finally:
        if not work_dir:
            shutil.rmtree(tmp, ignore_errors=True)
    result["checks"] = checks(result)
    result["wall_seconds"] = time.perf_counter() - t_start
    return result


def checks(result: dict) -> dict:
    """Targets met (True/False) where they apply; None where the run cannot tell (another device or shape)."""
    rows = result["shapes"]
    big = rows.get("qwen2.5-1.5b", {}).get("train", {})
    on_h100 = result.get("hardware") == "H100"
    speedups = [r["rollout"]["speedup"] for r in rows.values() if "rollout" in r]
    return {"train_mfu_qwen2.5-1.5b_on_H100": (big["mfu"] >= TARGETS["train_mfu_qwen2.5-1.5b_on_H100"]
                                               if on_h100 and big.get("mfu") is not None else None),
            "rollout_speedup_long_tail_min": min(speedups) if speedups else None,
            "rollout_speedup_long_tail": (min(speedups) >= TARGETS["rollout_speedup_long_tail"]
                                          if speedups else None)}


def table(result: dict):
    """The result as a Rich table, one row per shape."""
    from rich.table import Table

    d = result["device"]
    t = Table(title=f"fuseflow bench gpu on {d['name']} ({d['dtype']}){' --quick' if result['quick'] else ''}")
    for col in ("shape", "params", "MFU", "train tok/s", "engine tok/s", "hf tok/s", "x hf", "sync s/GB", "mem GB"):
        t.add_column(col, justify="left" if col == "shape" else "right")
    for name, r in result["shapes"].items():
        tr, ro, ws = r["train"], r["rollout"], r["weight_sync"]
        mem = max(tr["peak_memory_gb"], ro["peak_memory_gb"])
        t.add_row(name, f"{r['params'] / 1e6:.1f}M", "n/a" if tr["mfu"] is None else f"{tr['mfu']:.3f}",
                  f"{tr['train_tokens_per_second']:.0f}", f"{ro['fuseflow_tok_s']:.0f}", f"{ro['hf_tok_s']:.0f}",
                  f"{ro['speedup']:.2f}x", f"{ws['seconds_per_gb']:.3f}", f"{mem:.2f}")
    return t


def summary_line(result: dict) -> str:
    """One line on the console for the ``calibrate`` part of ``bench gpu``'s result: the fitted efficiencies
    and the measured against predicted median step, or why calibration did not run."""
    c = result["calibrate"]
    if not c.get("ran"):
        return f"calibrate: not run ({c.get('reason')})"
    eff = c["fitted_efficiency"]
    step = c["median_step_seconds"]
    return (f"calibrate on {c['hardware']}: train_mfu {eff['train_mfu']:.3g}, infer_mfu {eff['infer_mfu']:.3g}, "
            f"decode_mbu {eff['decode_mbu']:.3g}; median step {step['measured']:.2f}s measured, "
            f"{step['predicted']:.2f}s predicted")


def register(bench_app) -> None:
    """Add ``gpu`` to the ``fuseflow bench`` Typer app."""
    import typer

    @bench_app.command("gpu")
    def bench_gpu(
        out: Path = typer.Option(..., "--out", "-o", help="Where to write the JSON result."),
        quick: bool = typer.Option(False, "--quick", help="Tiny shape and workloads: the CPU path in CI."),
        device: str = typer.Option("auto", "--device", help="auto, cpu, cuda or cuda:N."),
        shapes: str = typer.Option(None, "--shapes", help="Comma-separated shapes (default: pretrained if "
                                   f"--model-path, then {', '.join(FULL_SHAPES)}; --quick: tiny)."),
        model_path: Path = typer.Option(None, "--model-path", help="A Hugging Face model directory: adds the "
                                        "'pretrained' shape (its config, random weights)."),
        slots: int = typer.Option(32, "--slots", help="Engine sequence slots = HF static batch size."),
        work_dir: Path = typer.Option(None, "--work-dir", help="Keep the calibration run directory here "
                                      "(default: a temporary directory, removed)."),
        calibrate: bool = typer.Option(True, "--calibrate/--no-calibrate", help="Run the short train + calibrate."),
        threads: int = typer.Option(0, "--threads", help="torch intra-op threads (0: torch's default; use 1 on "
                                    "a CPU shared with other work)."),
    ) -> None:
        """Training MFU, rollout tok/s vs transformers, weight-sync s/GB and peak memory; JSON to --out."""
        from fuseflow.console import console, fail, make_progress

        names = tuple(x.strip() for x in shapes.split(",") if x.strip()) if shapes else None
        try:
            resolve_device(device)
            if slots < 1 or threads < 0:
                raise ValueError(f"--slots must be >= 1 and --threads >= 0, got {slots} and {threads}")
            if model_path is not None and not model_path.is_dir():
                raise ValueError(f"--model-path {model_path}: not a directory; pass a Hugging Face model directory")
            for name in names or ():
                if name != "pretrained":
                    resolve_shape(name)
            with make_progress(console) as progress:
                result = run_gpu_bench(device, quick, names, model_path, slots, work_dir, calibrate, threads or None,
                                       log=console.print, progress=progress)
        except (ValueError, FileNotFoundError) as e:
            fail(str(e))
        write_result(out, result)
        console.print(table(result))
        console.print(summary_line(result), soft_wrap=True)
        console.print(f"wrote {out} ({result['wall_seconds']:.0f}s)")

