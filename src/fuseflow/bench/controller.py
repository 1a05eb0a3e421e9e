"""``fuseflow bench controller``: what running the roles on Ray costs against running them in-process.

Three trainers on the same config (default preset: GRPO on addition) take the same RL
steps in turn, step by step, so machine load hits them alike:

- ``local``: every role in this process (the embedded default);
- ``ray_dp1``: every role on one Ray worker process (batches cross a process boundary);
- ``ray_dp2``: actor and reference data-parallel over two Ray workers (FSDP actor).

Per step each trainer records its wall time, its workers' compute time (the slowest rank
of each call) and the difference, the controller's own overhead. The first step of each
is a warm-up and is left out; the table reports medians. The Ray overhead at dp=1 is
``(ray_dp1 - local) / ray_dp1`` of the step time.

On a machine shared with other work, wall time also counts the time other processes
held the cores. So each step's CPU time is recorded too: this process's CPU time plus
the CPU time the Ray workers report for their calls (Ray's own daemons not included).
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from . import cpu_name, write_result

VARIANTS = {"local": [], "ray_dp1": ["backend=ray"], "ray_dp2": ["backend=ray", "actor.dp=2"]}


def run_controller_bench(overrides: list[str] | None = None, steps: int = 16, threads: int = 1,
                         preset: str = "default", work_dir: str | Path | None = None, log=print) -> dict:
    """Run the three variants for ``steps`` steps each (interleaved); return the figures as a dict."""
    import ray

    from fuseflow.config import load_config
    from fuseflow.controller.ray_backend import start_local_ray
    from fuseflow.trainer import RLTrainer

    if steps < 2:
        raise ValueError(f"steps must be >= 2 (the first is a warm-up), got {steps}")
    torch.set_num_threads(threads)
    cfgs = {name: load_config(preset, [*(overrides or []), f"trainer.steps={steps}", *extra])
            for name, extra in VARIANTS.items()}
    tmp = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="fuseflow-bench-controller-"))
    # One Ray for both Ray variants (each trainer joins it), with CPU slots for both pools at once.
    slots = sum(c.resolved_placement().cpus_needed() for c in cfgs.values() if c.backend == "ray")
    started = not ray.is_initialized()
    if started:
        start_local_ray(max(os.cpu_count() or 1, int(slots + 0.999)), env_vars={"OMP_NUM_THREADS": str(threads)})
    trainers, rows = {}, {name: [] for name in VARIANTS}
    load = []
    try:
        for name, cfg in cfgs.items():
            t0 = time.perf_counter()
            trainers[name] = RLTrainer(cfg, tmp / name, log=log)
            log(f"{name}: set up in {time.perf_counter() - t0:.1f}s")
        for step in range(1, steps + 1):
            load.append(os.getloadavg()[0])
            for name, trainer in trainers.items():
                c0, w0 = time.process_time(), _worker_cpu(trainer)
                m = trainer.step(step)
                cpu = time.process_time() - c0 + _worker_cpu(trainer) - w0
                rows[name].append({"time/cpu_seconds": cpu} | {k: m[k] for k in (
                    "time/step_seconds", "time/worker_compute", "time/controller_overhead", "reward/mean")})
                log(f"step {step} {name}: {m['time/step_seconds']:.2f}s (workers {m['time/worker_compute']:.2f}s, "
                    f"controller {m['time/controller_overhead']:.3f}s)")
    finally:
        for trainer in trainers.values():
            trainer.close()
        if started:
            ray.shutdown()
        if not work_dir:
            shutil.rmtree(tmp, ignore_errors=True)
    return summarize(rows, cfgs["local"], steps, threads, load)


def _worker_cpu(trainer) -> float:
    """CPU seconds reported by the trainer's remote workers so far (0 for in-process groups)."""
    return sum(g.compute_cpu_seconds for g in (trainer.actor, trainer.reference, trainer.reward, *trainer.critics))


def summarize(rows: dict[str, list[dict]], cfg, steps: int, threads: int, load: list[float]) -> dict:
    """Medians over the timed steps (all but the first), ratios to ``local`` and the acceptance check."""
    med = {name: {key.split("/")[1]: statistics.median(r[key] for r in rs[1:])
                  for key in ("time/step_seconds", "time/worker_compute", "time/controller_overhead",
                              "time/cpu_seconds")}
           for name, rs in rows.items()}
    local, ray1 = med["local"]["step_seconds"], med["ray_dp1"]["step_seconds"]
    ray_overhead = (ray1 - local) / ray1
    cpu_local, cpu_ray1 = med["local"]["cpu_seconds"], med["ray_dp1"]["cpu_seconds"]
    return {
        "benchmark": "controller", "date": time.strftime("%Y-%m-%d"), "machine": _machine(), "torch_threads": threads,
        "load_average_per_step": [round(x, 2) for x in load],
        "settings": {"preset": cfg.preset, "algorithm": cfg.algorithm.name, "task": cfg.task.name,
                     "model": cfg.model.size, "samples_per_step": cfg.trainer.prompts_per_step * cfg.algorithm.group_size,
                     "rollout_backend": cfg.rollout.backend, "steps": steps, "warmup_steps_excluded": 1},
        "variants": {name: {**{k: round(v, 4) for k, v in med[name].items()},
                            "controller_overhead_frac": round(med[name]["controller_overhead"]
                                                              / med[name]["step_seconds"], 4),
                            "step_seconds_all": [round(r["time/step_seconds"], 3) for r in rows[name]],
                            "reward_per_step": [round(r["reward/mean"], 4) for r in rows[name]]}
                     for name in rows},
        "ratios": {"ray_dp1_vs_local": round(ray1 / local, 4),
                   "ray_dp2_vs_local": round(med["ray_dp2"]["step_seconds"] / local, 4),
                   "ray_dp1_vs_local_cpu": round(cpu_ray1 / cpu_local, 4),
                   "ray_dp2_vs_local_cpu": round(med["ray_dp2"]["cpu_seconds"] / cpu_local, 4)},
        "ray_overhead_frac_dp1": round(ray_overhead, 4),
        "ray_overhead_frac_dp1_cpu": round((cpu_ray1 - cpu_local) / cpu_ray1, 4),
        "acceptance": {"ray_overhead_dp1_at_most_20pct": ray_overhead <= 0.20},
    }


def _machine() -> str:
    return f"{cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__}"


def register(bench_app) -> None:
    """Add ``fuseflow bench controller`` to the ``bench`` Typer app."""
    import typer

    @bench_app.command("controller")
    def bench_controller(overrides: list[str] = typer.Argument(None, help="Dotted overrides on the preset."),
                         out: Path = typer.Option(None, "--out", "-o", help="Write the JSON here."),
                         steps: int = typer.Option(16, "--steps", help="RL steps per variant (the first is a warm-up)."),
                         threads: int = typer.Option(1, "--threads", help="torch threads per process."),
                         preset: str = typer.Option("default", "--preset", "-p", help="Config preset.")) -> None:
        """Step time of local vs Ray (dp=1) vs Ray (dp=2), as ratios, with the controller's overhead per step."""
        from fuseflow.config import ConfigError
        from fuseflow.console import console, fail

        try:
            result = run_controller_bench(overrides, steps, threads, preset, log=console.print)
        except (ConfigError, ValueError, FileNotFoundError) as e:
            fail(str(e))
        for name, v in result["variants"].items():
            console.print(f"{name:8s} step {v['step_seconds']:.2f}s  workers {v['worker_compute']:.2f}s  "
                          f"controller {v['controller_overhead']:.3f}s ({100 * v['controller_overhead_frac']:.1f}%)  "
                          f"CPU {v['cpu_seconds']:.2f}s")
        r = result["ratios"]
        console.print(f"ray/local at dp=1: {r['ray_dp1_vs_local']:.3f}x wall, {r['ray_dp1_vs_local_cpu']:.3f}x CPU; "
                      f"Ray overhead {100 * result['ray_overhead_frac_dp1']:.1f}% of the step (CPU time: "
                      f"{100 * result['ray_overhead_frac_dp1_cpu']:.1f}%); dp=2/local: {r['ray_dp2_vs_local']:.3f}x",
                      soft_wrap=True)
        write_result(out, result)
