"""`fuseflow bench fusion`: PPO on the long-tailed `sort` task in each execution mode, plus GRPO vs TRL.

Every mode runs the same config (model, batch, seed, steps) with PPO's four inference stages
(critic values, reference and old log-probs, reward) computed per sample, on
``schedule.rollout_workers`` rollout/inference workers (2 by default, one per core of the
2-core reference machine; threads of one process, see ``fuseflow.schedule.pool``). The
``sequential`` baseline runs verl's order on the same workers: generation split over them,
then inference micro-batches on all of them, then training.

Figures per mode exclude the first step (warm-up): ``step_seconds`` is the median wall time
between consecutive step ends (in async modes a step's generation ran during the previous
one), ``samples_per_second`` is samples over the summed wall time, ``busy_fraction`` the mean
over steps of the workers' busy fraction from the trace. ``cpu_seconds_per_step`` is the process's
CPU time per timed step (all threads) and ``cpu_utilisation`` that over wall time times the cores
this process may use: the trace's busy fraction misses the intra-op threads that ``sequential``
trains on. ``machine_busy`` is the share of those cores that was busy over the timed steps whoever used
them (Ray's daemons, the OS and other users too): its gap to ``cpu_utilisation`` is CPU the run's own
processes could not have had, its gap to 1 is idle time. ``speedup_bound`` is the most any schedule of the least CPU work measured here could
gain over ``sequential`` on those cores: sequential's mean step over (least CPU-seconds per step /
cores), the mean as in samples/s; ``speedup_bound_mode`` names the mode with that least CPU work. A run of
fewer modes (no ``async`` or elastic ones, which often spend the least) has a lower bound, so its modes show more
room (docs/ray_rollout.md, session 33). ``worker_seconds`` is the mean per timed step of
``time/rollout_worker_seconds``: the reserved modes hold every rollout worker for the whole step,
``elastic`` only while a worker has generation or inference to run (RLHFless's billing).
With ``repeats > 1`` every mode runs
that many times in alternating order and reports its (lower) median run; ``repeat_spread`` is its
fastest repeat over its slowest, minus 1, and ``repeat_spread_max`` the largest over the modes (the
run's noise floor on a shared machine).

``backend="ray"`` runs every mode (``sequential`` included) with ``workers`` rollout replica processes
on a pool of their own (``placement.rollout``), the roles in one more process; CPU seconds then sum
the controller's and every worker process's (``/proc``; ``cpu_seconds_per_step_by_process`` splits
them into ``controller``, ``roles`` and ``replicas``), and ``weight_sync_seconds_per_mb`` is the
mean over all modes' syncs of the broadcast's seconds per MB sent to each replica. On Ray every mode
also reports ``roles_busy_seconds_per_step``: the seconds per timed step the roles' worker processes
spent in calls (``time/worker_compute``: updates, critic values, the reward, and whatever log-probs the
replicas did not take). Where the roles share one process of one slot (the default here), those calls
run one at a time, so no schedule on that placement makes a step shorter than the least of them:
``speedup_bound_placement`` is sequential's mean step over that least busy time, reported beside
``speedup_bound`` (which assumes the least CPU work spreads over every core). ``room_captured`` per mode is
``(speedup_vs_sequential - 1) / (speedup_bound - 1)``. With ``repeats > 1`` every mode also reports the mean
of its per-repeat ratios (``speedup_vs_sequential_runs``; each repeat's CPU split as
``cpu_seconds_per_step_by_process_runs``) as ``speedup_vs_sequential_mean`` with a two-sided 95% t-interval
``speedup_vs_sequential_ci95``, and ``room_captured_mean`` / ``room_captured_ci95`` from them (the run's bound
held fixed). ``room_lost`` per mode splits what its median run left between its speedup and the bound into
the idle share, other processes' share and its CPU beyond the least mode's. ``speedup_vs_trl`` comes from
``bench.trl.run_trl_comparison`` with fuseflow in the fastest mode measured here.
"""

from __future__ import annotations

import itertools
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from fuseflow.config import load_config
from fuseflow.schedule.modes import available_cores

from . import cpu_name, machine_busy, machine_times, write_result
from .trl import BENCH_OVERRIDES, QUICK_OVERRIDES, bench_config, run_trl_comparison

MODES = ("sequential", "fused", "async", "fused+async", "elastic", "fused+elastic")
PPO = ("algorithm.name=ppo", "algorithm.kl_in_reward=true", "trainer.eval_every=1000", "trainer.save_every=1000")


# Every mode on replica processes (sequential too); the roles share one process of one CPU slot. Two
# slots (two torch threads) were tried once: steps of 74-142 s at load 20+ on this shared 2-core
# machine, against 4-10 s with one slot at load ~15 (docs/ray_rollout.md), so it keeps one.
RAY = ("backend=ray", "placement.rollout=rollout")


def fusion_overrides(mode: str, workers: int, steps: int, quick: bool, extra: list[str] | None = None,
                     backend: str = "local") -> list[str]:
    """The benchmark's config for one mode: the `sort` bench settings, PPO, the mode and worker count."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if backend not in ("local", "ray"):
        raise ValueError(f"--backend must be local or ray, got {backend!r}")
    base = QUICK_OVERRIDES if quick else BENCH_OVERRIDES
    return [*base, *PPO, f"trainer.steps={steps}", f"schedule.mode={mode}", f"schedule.rollout_workers={workers}",
            *(RAY if backend == "ray" else ()), *(extra or [])]


def run_mode(mode: str, workers: int, steps: int, quick: bool, work_dir: Path, extra: list[str] | None = None,
             log=print, backend: str = "local") -> dict:
    """Train ``steps`` PPO steps in ``mode``; per-step wall times, rewards and busy fractions."""
    from fuseflow.trainer import RLTrainer

    cfg = load_config("sort", fusion_overrides(mode, workers, steps, quick, extra, backend))
    tr = RLTrainer(cfg, work_dir / mode.replace("+", "_"), log=log)
    walls, cpus, rewards, busy, migrated, stale, held, syncs, roles = [], [], [], [], [], [], [], [], []
    clock = _cpu_clock(tr)
    machine = []  # the cores' (busy, all) seconds at each step's end
    try:
        last, last_cpu = time.perf_counter(), clock()
        for step in range(1, steps + 1):
            m = tr.step(step)
            now, now_cpu = time.perf_counter(), clock()
            machine.append(machine_times())
            walls.append(now - last)
            cpus.append({k: v - last_cpu[k] for k, v in now_cpu.items()})
            last, last_cpu = now, now_cpu
            rewards.append(m["reward/mean"])
            busy.append(_workers_busy(m, workers))
            migrated.append(m.get("schedule/migrated_samples", 0.0))
            stale.append(m.get("async/staleness_mean", 0.0))
            held.append(m["time/rollout_worker_seconds"])
            roles.append(m["time/worker_compute"])
            if m.get("rollout/weight_sync_mb"):
                syncs.append(m["time/rollout_weight_sync"] / m["rollout/weight_sync_mb"])
            log(f"{mode} step {step}: {walls[-1]:.1f}s reward {rewards[-1]:.3f} busy {busy[-1]:.2f}")
    finally:
        tr.close()
    n = cfg.trainer.prompts_per_step * cfg.algorithm.group_size
    timed = walls[1:] if len(walls) > 1 else walls
    timed_cpus = cpus[1:] if len(cpus) > 1 else cpus
    by_kind = {k: sum(c[k] for c in timed_cpus) / len(timed) for k in timed_cpus[0]}  # CPU-s per timed step
    cpu = sum(by_kind.values())
    return {"step_seconds": statistics.median(timed), "samples_per_second": n * len(timed) / sum(timed),
            "busy_fraction": statistics.mean(busy[1:] if len(busy) > 1 else busy),
            "cpu_seconds_per_step": cpu, "cpu_seconds_per_step_by_process": by_kind,
            "cpu_utilisation": cpu * len(timed) / (sum(timed) * available_cores()),
            "worker_seconds": statistics.mean(held[1:] if len(held) > 1 else held),
            "step_wall_seconds": [round(x, 3) for x in walls], "reward_per_step": rewards,
            "migrated_samples_per_step": migrated, "staleness_mean_per_step": stale, "samples_per_step": n,
            "weight_sync_seconds_per_mb_per_step": syncs,
            "roles_busy_seconds_per_step": statistics.mean(roles[1:] if len(roles) > 1 else roles),
            **({"machine_busy": b} if len(machine) > 1 and (b := machine_busy(machine[0], machine[-1])) is not None
               else {})}


def _cpu_clock(trainer):
    """CPU seconds so far of the run's processes by kind: ``controller`` (this one), and on Ray ``roles``
    (every role's process) and ``replicas`` (every rollout replica's), read from ``/proc``."""
    kinds = {"roles": [p for ps in getattr(trainer.cluster, "pids", {}).values() for p in ps],
             "replicas": list(trainer.replicas.pids) if trainer.replicas is not None else []}
    tick = os.sysconf("SC_CLK_TCK")

    def clock() -> dict[str, float]:
        out = {"controller": time.process_time()}
        for kind, pids in kinds.items():
            if not pids:
                continue
            out[kind] = 0.0
            for pid in pids:  # utime + stime (fields 14 and 15 of /proc/PID/stat), in clock ticks
                try:
                    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                    out[kind] += (int(fields[11]) + int(fields[12])) / tick
                except (OSError, IndexError, ValueError):
                    pass
        return out

    return clock


def speedup_bound(modes: dict[str, dict], cores: int) -> float | None:
    """Upper bound on any schedule's speedup over ``sequential``: its mean step (the one its samples/s
    comes from) over the least CPU work per step measured in any mode, spread perfectly over ``cores``.
    None without a sequential run.

    >>> speedup_bound({"sequential": {"samples_per_step": 256, "samples_per_second": 128.0,
    ...                               "cpu_seconds_per_step": 3.6},
    ...                "fused": {"cpu_seconds_per_step": 3.2}}, 2)
    1.25
    """
    if "sequential" not in modes:
        return None
    seq = modes["sequential"]
    least = modes[least_cpu_mode(modes)]["cpu_seconds_per_step"]
    return seq["samples_per_step"] / seq["samples_per_second"] / (least / cores)


def least_cpu_mode(modes: dict[str, dict]) -> str:
    """The mode with the least CPU work per step: the one that sets ``speedup_bound``.

    >>> least_cpu_mode({"sequential": {"cpu_seconds_per_step": 3.6}, "fused": {"cpu_seconds_per_step": 3.2}})
    'fused'
    """
    return min(modes, key=lambda m: modes[m]["cpu_seconds_per_step"])


def room_lost(mode: dict, least_cpu: float) -> dict[str, float] | None:
    """Where a mode's step falls short of the bound, as shares of the machine that add up to
    ``1 - speedup / speedup_bound``: ``idle`` (1 - ``machine_busy``), ``other_processes`` (``machine_busy`` -
    ``cpu_utilisation``: Ray's daemons, the OS, other users) and ``extra_cpu`` (``cpu_utilisation`` x (1 -
    ``least_cpu`` / its CPU-seconds a step): the CPU it spends beyond the least mode's). It is an identity of
    the run's own figures: speedup over the bound is ``cpu_utilisation x least_cpu / cpu_seconds_per_step``,
    since both sides are samples/s x least CPU-seconds a step / (samples a step x cores).
    None without ``machine_busy`` (fewer than two timed steps).

    >>> room_lost({"machine_busy": 0.98, "cpu_utilisation": 0.96, "cpu_seconds_per_step": 1.6}, 1.5)
    {'idle': 0.02, 'other_processes': 0.02, 'extra_cpu': 0.06}
    """
    if "machine_busy" not in mode:
        return None
    u, busy = mode["cpu_utilisation"], mode["machine_busy"]
    return {"idle": round(1 - busy, 6), "other_processes": round(busy - u, 6),
            "extra_cpu": round(u * (1 - least_cpu / mode["cpu_seconds_per_step"]), 6)}


def bound_caveat(modes_run) -> str | None:
    """What a run that left modes out should say beside its bound: the bound is the least CPU of the modes it
    ran, and a left-out mode may have spent less (async or an elastic mode did in 43 of 56 full runs on file),
    so its rooms may read high. None when every mode ran.

    >>> bound_caveat(["sequential", "fused", "fused+async"])
    'this run left out async, elastic, fused+elastic: its bound may be lower, and its rooms higher, than a run of every mode'
    """
    left = [m for m in MODES if m not in modes_run]
    if not left:
        return None
    return (f"this run left out {', '.join(left)}: its bound may be lower, and its rooms higher, than a run of "
            "every mode")


def has_room_target(mode: str) -> bool:
    """Whether a mode's room is worth printing: not ``sequential`` (the baseline) nor ``elastic``, which keeps
    sequential's order and releases idle replicas (its target is worker-seconds at a speed within 10% of
    sequential's). Their rooms stay in the JSON.

    >>> [m for m in MODES if has_room_target(m)]
    ['fused', 'async', 'fused+async', 'fused+elastic']
    """
    return mode not in ("sequential", "elastic")


def room_captured(speedup: float, bound: float) -> float | None:
    """The share of the gain the bound leaves room for that a mode took: ``(speedup - 1) / (bound - 1)``
    (issue 17's targets are stated in it); None when the bound leaves no room.

    >>> room_captured(1.1, 1.25)
    0.4
    """
    if bound <= 1.0:
        return None
    return round((speedup - 1.0) / (bound - 1.0), 6)


# Student's t quantile 0.975 by degrees of freedom (1-30), for two-sided 95% intervals over a few repeats;
# above 30 the value at 30 (slightly wider than the limit, 1.960). A table: torch's StudentT has no inverse
# CDF, and scipy is not a dependency for one constant per repeat count.
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def mean_interval(values: list[float]) -> tuple[float, float, float] | None:
    """Mean of ``values`` and its two-sided 95% t-interval, ``(mean, low, high)``; None under two values.
    Used on a mode's per-repeat ratios to ``sequential`` (each paired with the sequential run of its
    repeat), so a verdict reads against what the repeats allow, not one median run.

    >>> mean_interval([1.0, 1.1, 1.2])
    (1.1, 0.851566, 1.348434)
    """
    if len(values) < 2:
        return None
    mean = statistics.fmean(values)
    half = T975[min(len(values) - 1, len(T975)) - 1] * statistics.stdev(values) / len(values) ** 0.5
    return round(mean, 6), round(mean - half, 6), round(mean + half, 6)


def repeat_spread(runs: list[float]) -> float | None:
    """How far one mode's repeats lie apart: fastest over slowest samples/s, minus 1 (None with one run).
    On a shared machine this is the noise floor of the run: differences between modes smaller than the
    largest spread say nothing.

    >>> repeat_spread([167.6, 149.3])
    0.122572
    """
    if len(runs) < 2 or min(runs) <= 0:
        return None
    return round(max(runs) / min(runs) - 1.0, 6)


def speedup_bound_placement(modes: dict[str, dict]) -> float | None:
    """Upper bound on any schedule's speedup over ``sequential`` when the roles' calls run one at a time
    (one roles process): sequential's mean step over the least roles-busy seconds per step of any mode.
    None without a sequential run.

    >>> speedup_bound_placement({"sequential": {"samples_per_step": 256, "samples_per_second": 64.0,
    ...                                         "roles_busy_seconds_per_step": 3.0},
    ...                          "fused": {"roles_busy_seconds_per_step": 2.5}})
    1.6
    """
    if "sequential" not in modes:
        return None
    seq = modes["sequential"]
    least = min(r["roles_busy_seconds_per_step"] for r in modes.values())
    return seq["samples_per_step"] / seq["samples_per_second"] / least


def _workers_busy(m: dict, workers: int) -> float:
    """Mean busy fraction of the rollout/inference worker tracks (the controller thread included when it helps)."""
    vals = [v for k, v in m.items() if k.startswith("trace/busy_fraction/") and
            (k.split("/")[-1].startswith("rollout-") or k.endswith("/inference"))]
    return sum(vals) / len(vals) if vals else m.get("trace/busy_fraction_mean", 0.0)


def plot_reward_vs_time(modes: dict[str, dict], out: Path) -> Path:
    """One PNG: mean reward per step against cumulative wall-clock seconds, one line per mode."""
    from fuseflow.telemetry.plots import plt, save_figure

    fig, ax = plt.subplots(figsize=(7, 4))
    for mode, r in modes.items():
        ax.plot(list(itertools.accumulate(r["step_wall_seconds"])), r["reward_per_step"], marker="o", label=mode)
    ax.set_xlabel("wall-clock seconds")
    ax.set_ylabel("mean reward")
    ax.set_title("PPO on sort: reward vs wall-clock per execution mode")
    ax.legend()
    return save_figure(fig, out)


def run_fusion(steps: int = 6, workers: int = 2, quick: bool = False, modes: tuple[str, ...] = MODES,
               trl_steps: int = 0, threads: int = 1, plot: Path | None = None, work_dir: Path | None = None,
               extra: list[str] | None = None, log=print, repeats: int = 1, backend: str = "local") -> dict:
    """Every mode in turn (``repeats`` times, median run), then (``trl_steps > 0``) GRPO vs TRL with
    fuseflow in the fastest mode."""
    if steps < 2:
        raise ValueError(f"--steps must be >= 2 (the first step is a warm-up), got {steps}")
    if repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {repeats}")
    if work_dir is None:
        with tempfile.TemporaryDirectory(prefix="fuseflow-bench-fusion-") as scratch:
            return run_fusion(steps, workers, quick, modes, trl_steps, threads, plot, Path(scratch), extra, log,
                              repeats, backend)
    fusion_overrides(modes[0], workers, steps, quick, extra, backend)  # checks the backend before any work
    if backend == "ray":
        import ray

        if not ray.is_initialized():  # one local cluster for every mode's run (each would start its own)
            from fuseflow.controller.ray_backend import start_local_ray

            start_local_ray(max(os.cpu_count() or 1, workers + 1), env_vars={"OMP_NUM_THREADS": str(threads)})
            try:
                return run_fusion(steps, workers, quick, modes, trl_steps, threads, plot, work_dir, extra, log,
                                  repeats, backend)
            finally:
                ray.shutdown()
    torch.set_num_threads(threads)
    # Repeats alternate the mode order (ABBA...), so load that drifts during a run on a shared
    # machine favours no mode; each mode reports its median run and every run's samples/s.
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for rep in range(repeats):
        for m in (modes if rep % 2 == 0 else modes[::-1]):
            runs[m].append(run_mode(m, workers, steps, quick, Path(work_dir) / f"rep{rep}", extra, log, backend))
    results = {}
    for m, rs in runs.items():
        ordered = sorted(rs, key=lambda r: r["samples_per_second"])
        results[m] = ordered[(len(ordered) - 1) // 2] | {
            "samples_per_second_runs": [round(r["samples_per_second"], 2) for r in rs],
            "cpu_seconds_per_step_by_process_runs": [
                {k: round(v, 4) for k, v in r["cpu_seconds_per_step_by_process"].items()} for r in rs]}
        if (spread := repeat_spread([r["samples_per_second"] for r in rs])) is not None:
            results[m]["repeat_spread"] = spread
    base = results.get("sequential", next(iter(results.values())))["samples_per_second"]
    seq_held = results.get("sequential", next(iter(results.values())))["worker_seconds"]
    for r in results.values():
        r["speedup_vs_sequential"] = r["samples_per_second"] / base
        r["worker_seconds_vs_sequential"] = r["worker_seconds"] / seq_held
    if "sequential" in runs:  # per-repeat ratios: each mode against the sequential run of the same repeat
        for m, r in results.items():
            r["speedup_vs_sequential_runs"] = [round(x["samples_per_second"] / b["samples_per_second"], 3)
                                               for x, b in zip(runs[m], runs["sequential"], strict=True)]
    out = {"benchmark": "ppo_sort_fusion", "backend": backend, "device": "cpu", "torch_threads": threads,
           "cpu": cpu_name(), "torch": torch.__version__,
           "settings": {"steps": steps, "warmup_steps_excluded": 1, "rollout_workers": workers, "quick": quick,
                        "repeats": repeats,
                        "overrides": fusion_overrides("sequential", workers, steps, quick, extra, backend)},
           "modes": results, "cores": available_cores()}
    syncs = [x for rs in runs.values() for r in rs for x in r["weight_sync_seconds_per_mb_per_step"]]
    if syncs:
        out["weight_sync_seconds_per_mb"] = statistics.mean(syncs)
    spreads = {m: r["repeat_spread"] for m, r in results.items() if "repeat_spread" in r}
    if spreads:
        widest = max(spreads, key=spreads.get)
        out["repeat_spread_max"], out["repeat_spread_mode"] = spreads[widest], widest
    for r in results.values():
        if (ci := mean_interval(r.get("speedup_vs_sequential_runs", []))) is not None:
            r["speedup_vs_sequential_mean"], r["speedup_vs_sequential_ci95"] = ci[0], [ci[1], ci[2]]
    bound = speedup_bound(results, out["cores"])
    if bound is not None:
        out["speedup_bound"] = bound
        out["speedup_bound_mode"] = least_cpu_mode(results)
        least = results[out["speedup_bound_mode"]]["cpu_seconds_per_step"]
        for r in results.values():
            if (lost := room_lost(r, least)) is not None:
                r["room_lost"] = lost
            if (room := room_captured(r["speedup_vs_sequential"], bound)) is not None:
                r["room_captured"] = room
                if "speedup_vs_sequential_mean" in r:  # the run's bound taken as fixed
                    r["room_captured_mean"] = room_captured(r["speedup_vs_sequential_mean"], bound)
                    r["room_captured_ci95"] = [room_captured(x, bound) for x in r["speedup_vs_sequential_ci95"]]
    placed = speedup_bound_placement(results) if backend == "ray" else None
    if placed is not None:
        out["speedup_bound_placement"] = placed
    if plot is not None:
        out["plot"] = str(plot_reward_vs_time(results, plot))
    if trl_steps:
        best = max(results, key=lambda m: results[m]["samples_per_second"])
        trl_cfg = bench_config([f"schedule.mode={best}", f"schedule.rollout_workers={workers}", *(extra or [])],
                               quick, trl_steps)
        trl = run_trl_comparison(trl_cfg, threads, Path(work_dir) / "trl", log)
        out["speedup_vs_trl"] = trl["speedup_vs_trl"]
        out["trl_comparison"] = trl
    return out


def _room_of_the_repeats(r: dict) -> str:
    """The room from the mean of a mode's repeats and its 95% interval, as printed after its median run's
    room; empty for a mode without them (one repeat)."""
    if "room_captured_mean" not in r:
        return ""
    lo, hi = r["room_captured_ci95"]
    return f" (mean of the repeats {r['room_captured_mean']:.2f}, 95% interval {lo:.2f} to {hi:.2f})"


def register(bench_app) -> None:
    """Add ``fuseflow bench fusion`` to the ``bench`` Typer app."""
    import typer

    @bench_app.command("fusion")
    def bench_fusion(overrides: list[str] = typer.Argument(None, help="Dotted overrides on every mode's config."),
                     out: Path = typer.Option(None, "--out", "-o", help="Write the JSON here (PNG beside it)."),
                     steps: int = typer.Option(6, "--steps", help="PPO steps per mode (the first is a warm-up)."),
                     workers: int = typer.Option(2, "--workers", help="Rollout/inference workers (threads)."),
                     trl_steps: int = typer.Option(4, "--trl-steps", help="GRPO steps vs TRL (0 skips TRL)."),
                     mode: list[str] = typer.Option(None, "--mode", help="Only these modes (repeatable)."),
                     repeats: int = typer.Option(1, "--repeats", help="Runs per mode, order alternating; median."),
                     quick: bool = typer.Option(False, "--quick", help="A seconds-scale run (tests, smoke checks)."),
                     backend: str = typer.Option("local", "--backend",
                                                 help="local (worker threads) or ray (replica processes).")
                     ) -> None:
        """PPO on `sort` in every execution mode; samples/s and worker-seconds per mode; GRPO vs TRL."""
        from fuseflow.config import ConfigError
        from fuseflow.console import console, fail

        plot = out.with_suffix(".png") if out else None
        try:
            if workers < 1 or trl_steps < 0:
                raise ValueError(f"--workers must be >= 1 and --trl-steps >= 0, got {workers} and {trl_steps}")
            result = run_fusion(steps, workers, quick, tuple(mode or MODES), trl_steps, 1, plot, None, overrides,
                                console.print, repeats, backend)
        except (ConfigError, ValueError, ImportError, FileNotFoundError) as e:
            fail(str(e))
        for name, r in result["modes"].items():
            console.print(f"{name:12s} {r['samples_per_second']:.2f} samples/s  x{r['speedup_vs_sequential']:.2f}  "
                          f"step {r['step_seconds']:.1f}s  busy {r['busy_fraction']:.2f}  "
                          f"worker-s {r['worker_seconds']:.2f} (x{r['worker_seconds_vs_sequential']:.2f})  "
                          f"cpu {r['cpu_utilisation']:.2f} of {result['cores']} cores"
                          + (f" (all processes {r['machine_busy']:.2f})" if "machine_busy" in r else ""),
                          soft_wrap=True)
        if "speedup_bound" in result:
            console.print(f"any schedule of the least CPU work above ({result['speedup_bound_mode']}'s): at most "
                          f"x{result['speedup_bound']:.2f} over sequential", soft_wrap=True)
            rooms = [f"{n} {r['room_captured']:.2f}{_room_of_the_repeats(r)}" for n, r in result["modes"].items()
                     if has_room_target(n) and "room_captured" in r]
            if rooms:
                console.print(f"share of that room captured: {', '.join(rooms)}", soft_wrap=True)
            lost = [f"{n} {1 - sum(r['room_lost'].values()):.3f} (idle {r['room_lost']['idle']:.3f}, others "
                    f"{r['room_lost']['other_processes']:.3f}, extra CPU {r['room_lost']['extra_cpu']:.3f})"
                    for n, r in result["modes"].items() if "room_lost" in r]
            if lost:
                console.print("speedup over that bound, 1 less the machine's idle share, other processes' share "
                              "and this mode's CPU beyond the least mode's: " + ", ".join(lost), soft_wrap=True)
            if (caveat := bound_caveat(result["modes"])) is not None:
                console.print(caveat, soft_wrap=True)
        if "speedup_bound_placement" in result:
            console.print(f"with the roles' calls one at a time (one roles process): at most "
                          f"x{result['speedup_bound_placement']:.2f}", soft_wrap=True)
        if "repeat_spread_max" in result:
            console.print(f"repeats of one mode differed by up to {result['repeat_spread_max']:.0%} "
                          f"({result['repeat_spread_mode']}): differences between modes smaller than that are "
                          "within this machine's noise", soft_wrap=True)
        if "weight_sync_seconds_per_mb" in result:
            console.print(f"weight sync {result['weight_sync_seconds_per_mb']:.4f} s/MB per replica", soft_wrap=True)
        if "speedup_vs_trl" in result:
            console.print(f"speedup_vs_trl {result['speedup_vs_trl']:.2f}x", soft_wrap=True)
        write_result(out, result)
