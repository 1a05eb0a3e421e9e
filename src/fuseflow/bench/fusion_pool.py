"""`fuseflow bench fusion-pool`: the repeats of several `bench fusion` runs as one sample.

One run's repeats share the machine's phase of the moment; on a shared machine the room a run captures
moves with that phase (docs/ray_rollout.md, session 30). Runs at other times of day, pooled repeat by
repeat with each repeat's room over its own run's bound, give a verdict that holds across phases.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from . import write_result
from .fusion import has_room_target, least_cpu_mode, mean_interval, room_captured, room_lost

LOST = ("idle", "other_processes", "extra_cpu")


def pool_runs(runs: list[dict]) -> dict:
    """Several ``run_fusion`` results (their JSON) as one sample: every repeat's ratio to the ``sequential`` run
    of its repeat, and its room over its own run's ``speedup_bound``, pooled per mode with the mean and a
    two-sided 95% t-interval (why pool: the module's docstring). ``runs_by_modes`` counts the runs per set of
    modes run: a run's bound comes from its own modes, so runs of fewer modes read more room. ``room_lost_mean``
    averages each mode's ``room_lost`` (``bench.fusion.room_lost``, recomputed from the median run's figures)
    over the ``room_lost_runs`` runs that measured ``machine_busy``.

    >>> seq = {"speedup_vs_sequential": 1.0}
    >>> one = {"benchmark": "ppo_sort_fusion", "speedup_bound": 1.2,
    ...        "modes": {"sequential": seq, "fused": {"speedup_vs_sequential_runs": [1.1, 1.2]}}}
    >>> two = {"benchmark": "ppo_sort_fusion", "speedup_bound": 1.5,
    ...        "modes": {"sequential": seq, "fused": {"speedup_vs_sequential_runs": [1.2]}}}
    >>> pool_runs([one, two])["modes"]["fused"]["room_captured_per_repeat"]
    [0.5, 1.0, 0.4]
    """
    if not runs:
        raise ValueError("no runs to pool")
    modes: dict[str, dict] = {}
    for i, run in enumerate(runs):
        if run.get("benchmark") != "ppo_sort_fusion" or "modes" not in run:
            raise ValueError(f"run {i + 1} is not a `fuseflow bench fusion` result")
        if "speedup_bound" not in run or "sequential" not in run["modes"]:
            raise ValueError(f"run {i + 1} has no sequential mode, so no ratios or bound to pool")
        bound = run["speedup_bound"]
        least = (run["modes"][least_cpu_mode(run["modes"])]["cpu_seconds_per_step"]  # older JSON may lack it
                 if all("cpu_seconds_per_step" in r for r in run["modes"].values()) else None)
        for name, r in run["modes"].items():
            if name == "sequential":
                continue
            m = modes.setdefault(name, {"runs": 0, "speedup_vs_sequential_per_repeat": [],
                                        "room_captured_per_repeat": [], "worker_seconds_vs_sequential_per_run": [],
                                        "room_lost_per_run": []})
            m["runs"] += 1
            if least is not None and (lost := room_lost(r, least)) is not None:
                m["room_lost_per_run"].append(lost)
            ratios = r.get("speedup_vs_sequential_runs") or [r["speedup_vs_sequential"]]
            m["speedup_vs_sequential_per_repeat"] += ratios
            if bound > 1.0:
                m["room_captured_per_repeat"] += [room_captured(x, bound) for x in ratios]
            if "worker_seconds_vs_sequential" in r:
                m["worker_seconds_vs_sequential_per_run"].append(round(r["worker_seconds_vs_sequential"], 6))
    for m in modes.values():
        for key, values in (("speedup_vs_sequential", m["speedup_vs_sequential_per_repeat"]),
                            ("room_captured", m["room_captured_per_repeat"])):
            if (ci := mean_interval(values)) is not None:
                m[f"{key}_mean"], m[f"{key}_ci95"] = ci[0], [ci[1], ci[2]]
        if m["room_lost_per_run"]:
            n = m["room_lost_runs"] = len(m["room_lost_per_run"])
            m["room_lost_mean"] = {k: round(sum(x[k] for x in m["room_lost_per_run"]) / n, 6) for k in LOST}
    return {"benchmark": "ppo_sort_fusion_pooled", "runs": len(runs),
            "speedup_bounds": [round(r["speedup_bound"], 6) for r in runs],
            "runs_by_modes": dict(Counter(",".join(r["modes"]) for r in runs)), "modes": modes}


def register(bench_app) -> None:
    """Add ``fuseflow bench fusion-pool`` to the ``bench`` Typer app."""
    import typer

    @bench_app.command("fusion-pool")
    def bench_fusion_pool(files: list[Path] = typer.Argument(..., help="JSON files that `bench fusion -o` wrote."),
                          out: Path = typer.Option(None, "--out", "-o", help="Write the pooled JSON here.")) -> None:
        """Pool the repeats of several `bench fusion` runs: each mode's mean ratio and room, with 95% intervals."""
        import json

        from fuseflow.console import console, fail

        try:
            runs = [json.loads(f.read_text()) for f in files]
            result = pool_runs(runs)
        except (OSError, ValueError, KeyError, TypeError) as e:  # a JSONDecodeError is a ValueError
            fail(f"cannot pool {', '.join(map(str, files))}: {e}")
        console.print(f"{result['runs']} runs, bounds {', '.join(f'x{b:.2f}' for b in result['speedup_bounds'])}",
                      soft_wrap=True)
        if len(result["runs_by_modes"]) > 1:
            console.print("runs of different modes: "
                          + "; ".join(f"{n} of {k}" for k, n in result["runs_by_modes"].items())
                          + ". A run's bound is the least CPU of its own modes, so a run of fewer modes may read more "
                          "room", soft_wrap=True)
        for name, m in result["modes"].items():
            line = f"{name:12s} {len(m['speedup_vs_sequential_per_repeat'])} repeats"
            if "speedup_vs_sequential_mean" in m:
                lo, hi = m["speedup_vs_sequential_ci95"]
                line += f"  x{m['speedup_vs_sequential_mean']:.3f} ({lo:.3f}-{hi:.3f})"
            if "room_captured_mean" in m and has_room_target(name):
                lo, hi = m["room_captured_ci95"]
                line += f"  room {m['room_captured_mean']:.2f} ({lo:.2f} to {hi:.2f})"
            if m["worker_seconds_vs_sequential_per_run"]:
                ws = m["worker_seconds_vs_sequential_per_run"]
                line += f"  worker-s x{min(ws):.2f}-{max(ws):.2f}"
            if "room_lost_mean" in m:
                lost = m["room_lost_mean"]
                line += (f"  short of the bound by idle {lost['idle']:.3f}, others {lost['other_processes']:.3f}, "
                         f"extra CPU {lost['extra_cpu']:.3f} ({m['room_lost_runs']} runs)")
            console.print(line, soft_wrap=True)
        write_result(out, result)
