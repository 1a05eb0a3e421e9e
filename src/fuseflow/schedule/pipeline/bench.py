"""`fuseflow bench pipeline`: solve fused-pipeline instances and compare with the yardsticks.

The suite is RLHFuse's six 8-device instances (FlexFusion's published results next to
ours) plus four 16-device instances with up to 64 micro-batches and uneven mA:mB ratios,
which only have to come within 2% of their lower bound. The heavy imports (the solver,
OR-Tools, matplotlib) happen inside the command so `fuseflow --help` stays fast.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

from fuseflow.schedule.pipeline.problem import PipelineInstance, Task

# RLHFuse's instances and FlexFusion's results, as published in the issue:
# lower bound, makespan, peak memory after memory optimisation, search time.
FLEXFUSION: dict[str, tuple[int, int, float, str]] = {
    "8,4,32,16,5,4,1.95,2": (708, 708, 19.70, "918 s on many CPUs"),
    "8,4,16,8,5,4,1.95,2": (372, 372, 15.75, "473 s"),
    "8,4,8,4,5,4,1.95,2": (225, 225, 15.60, "20 s"),
    "8,8,32,32,5,2,1.95,1": (702, 702, 20.50, "4979 s"),
    "8,8,16,16,5,2,1.95,1": (366, 366, 18.55, "1416 s"),
    "8,8,8,8,5,2,1.95,1": (225, 225, 15.60, "167 s"),
}
LARGE = [
    "16,8,64,32,5,4,1.95,2",
    "16,16,64,64,5,2,1.95,1",
    "16,8,32,64,5,4,1.95,2",
    "16,4,64,16,5,4,1.95,2",
]
SUITE = list(FLEXFUSION) + LARGE


def schedule_json(inst: PipelineInstance, start: dict[Task, int]) -> list[dict[str, Any]]:
    """Per device, its tasks in time order: model, replica, stage, phase, micro-batch, start, end."""
    rows: list[dict[str, Any]] = []
    for d in range(inst.n_devices):
        tasks = sorted(inst.tasks_on(d), key=lambda t: start[t])
        rows.append(
            {
                "device": d,
                "tasks": [
                    {
                        "model": t.model,
                        "replica": t.replica,
                        "stage": t.stage,
                        "phase": "backward" if t.backward else "forward",
                        "micro_batch": t.micro_batch,
                        "start": start[t],
                        "end": start[t] + inst.duration(t),
                    }
                    for t in tasks
                ],
            }
        )
    return rows


def run_instance(
    inst: PipelineInstance,
    seconds: float,
    seed: int = 0,
    plot_dir: Path | None = None,
    progress=None,
    memory_cap: float | None = None,
) -> dict[str, Any]:
    """Solve one instance (peak memory capped at `memory_cap` if given) and gather
    everything the report needs (see the CLI help)."""
    from fuseflow.schedule.pipeline.baselines import greedy_fused, serial_1f1b
    from fuseflow.schedule.pipeline.bounds import lower_bound
    from fuseflow.schedule.pipeline.problem import check_timed
    from fuseflow.schedule.pipeline.solver import solve

    lb = lower_bound(inst)
    serial = serial_1f1b(inst)
    greedy = greedy_fused(inst)
    res = solve(inst, seconds=seconds, seed=seed, progress=progress, memory_cap=memory_cap)
    problems = check_timed(inst, res.start)
    spec = inst.spec()
    out: dict[str, Any] = {
        "instance": spec,
        "lower_bound": lb.value,
        "lower_bound_terms": {
            "critical_path": lb.critical_path,
            "average_work": lb.average_work,
            "busiest_device": lb.busiest_device,
            "arrival_work_tail": lb.arrival_work_tail,
        },
        "makespan": res.makespan,
        "gap_to_lower_bound_pct": round(100 * (res.makespan / lb.value - 1), 3),
        "memory_cap": memory_cap,
        "peak_memory": round(res.peak_memory, 4),
        "sum_of_peaks": round(sum(res.device_peaks), 4),
        "device_peaks": [round(p, 4) for p in res.device_peaks],
        "serial_1f1b_makespan": serial.makespan,
        "serial_1f1b_peak_memory": round(serial.peak_memory, 4),
        "greedy_makespan": greedy.makespan,
        "greedy_peak_memory": round(greedy.peak_memory, 4),
        "speedup_vs_serial_1f1b": round(serial.makespan / res.makespan, 4),
        "solve_seconds": res.seconds,
        "deterministic": res.deterministic,
        "valid": not problems and (memory_cap is None or res.peak_memory <= memory_cap + 1e-9),
        "problems": problems[:5],
        "history": [list(h) for h in res.history],
        "flexfusion": None,
        "gantt": None,
    }
    if spec in FLEXFUSION:
        ff_lb, ff_span, ff_peak, ff_time = FLEXFUSION[spec]
        out["flexfusion"] = {"makespan": ff_span, "peak_memory": ff_peak, "search": ff_time}
    if plot_dir is not None:
        from fuseflow.schedule.pipeline.plot import gantt

        name = "pipeline_" + spec.replace(",", "_").replace(".", "p") + ".png"
        title = f"{spec}  makespan {res.makespan} (bound {lb.value})  peak memory {res.peak_memory:g}"
        out["gantt"] = str(gantt(inst, res.start, Path(plot_dir) / name, title))
    out["schedule"] = schedule_json(inst, res.start)
    return out


def _parse_instances(text: str | None) -> list[PipelineInstance]:
    specs = SUITE if not text else [text]
    return [PipelineInstance.parse(s) for s in specs]


def register(bench_app: typer.Typer) -> None:
    """Add the `pipeline` command to a Typer app (the CLI's `bench` group)."""

    @bench_app.command("pipeline")
    def pipeline(
        instance: str = typer.Option(
            None, "--instance", help="pA,pB,mA,mB,fA,fB,memA,memB (default: the 10-instance suite)."
        ),
        seconds: float = typer.Option(60.0, "--seconds", help="Time limit per instance."),
        out: Path = typer.Option(None, "--out", help="Write the results as JSON here."),
        plot_dir: Path = typer.Option(None, "--plot-dir", help="Write a Gantt PNG per instance here."),
        seed: int = typer.Option(0, "--seed", help="Random seed of the solver."),
        memory_cap: float = typer.Option(
            None, "--memory-cap", help="Hard cap on every device's peak activation memory (makespan is traded for it)."
        ),
        execute: bool = typer.Option(
            False, "--execute", help="Run serial-1F1B and the solved fused schedule on 2 stage processes "
            "(actor + critic PPO steps) and compare measured makespans with each other and the prediction."
        ),
        model: str = typer.Option("small", "--model", help="With --execute: model preset of actor and critic."),
        micro_batches: int = typer.Option(4, "--micro-batches", help="With --execute: micro-batches per model."),
        repeats: int = typer.Option(3, "--repeats", help="With --execute: measured steps per schedule."),
    ) -> None:
        """Fused actor/critic pipeline schedules vs serial 1F1B, greedy and FlexFusion."""
        from rich.console import Console
        from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        console = Console(stderr=True)
        if execute:
            _execute(console, model, micro_batches, repeats, seconds, memory_cap, instance, out)
            return
        try:
            instances = _parse_instances(instance)
        except ValueError as err:
            console.print(f"[bold red]error:[/] --instance: {err}", highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None
        if not seconds > 0:
            console.print(f"[bold red]error:[/] --seconds={seconds} is invalid: it must be > 0", highlight=False)
            raise typer.Exit(2)
        if memory_cap is not None:
            from fuseflow.schedule.pipeline.memcap import InfeasibleCap, check_cap

            try:
                for inst in instances:
                    check_cap(inst, memory_cap)
            except InfeasibleCap as err:
                console.print(f"[bold red]error:[/] {err}", highlight=False, soft_wrap=True)
                raise typer.Exit(2) from None
        results = []
        columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn())
        with Progress(*columns, console=console, transient=True) as bar:
            task = bar.add_task("", total=len(instances))
            for inst in instances:
                label = inst.spec()
                bar.update(task, description=f"{label}: starting")

                def report(stage: str, makespan: int, peak: float, label: str = label) -> None:
                    bar.update(task, description=f"{label}: {stage} makespan {makespan} peak {peak:g}")

                results.append(run_instance(inst, seconds, seed=seed, plot_dir=plot_dir, progress=report,
                                            memory_cap=memory_cap))
                bar.advance(task)
        _print_table(results)
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            payload: Any = results[0] if instance else results
            out.write_text(json.dumps(payload, indent=1))
        if not all(r["valid"] for r in results):
            raise typer.Exit(1)


def _execute(console, model: str, micro_batches: int, repeats: int, seconds: float, memory_cap: float | None,
             instance: str | None, out: Path | None) -> None:
    from fuseflow.models.config import PRESETS
    from fuseflow.schedule.pipeline import execbench

    problems = [
        (instance is not None, "--instance does not apply to --execute (its instance comes from measured times)"),
        (model not in PRESETS, f"--model={model!r} is unknown; choose one of {sorted(PRESETS)}"),
        (micro_batches < 1, f"--micro-batches={micro_batches} is invalid: it must be >= 1"),
        (repeats < 1, f"--repeats={repeats} is invalid: it must be >= 1"),
        (not seconds > 0, f"--seconds={seconds} is invalid: it must be > 0"),
        (memory_cap is not None and memory_cap < 1, f"--memory-cap={memory_cap} is infeasible here: one "
         "micro-batch holds 1 unit in the executed instance; use --memory-cap >= 1"),
    ]
    for bad, msg in problems:
        if bad:
            console.print(f"[bold red]error:[/] {msg}", highlight=False, soft_wrap=True)
            raise typer.Exit(2)
    with console.status("") as status:
        rec = execbench.run(model=model, micro_batches=micro_batches, repeats=repeats, solver_seconds=seconds,
                            memory_cap=memory_cap, progress=status.update)
    med, pred = rec["median_makespan_s"], rec["predicted_makespan_s"]
    with console.status("") as status:
        rec.update(execbench.run_generation(model=model, repeats=repeats, progress=status.update))
    print(f"pipelined generation {rec['pipelined_generation_speedup']:.3f}x the tok/s of unpipelined on 2 stages, "
          f"{rec['pipelined_vs_replicas']:.3f}x that of 2 data-parallel replicas")
    print(f"serial-1F1B {med['serial']:.3f} s (predicted {pred['serial']:.3f}), fused {med['fused']:.3f} s "
          f"(predicted {pred['fused']:.3f}): fused speedup {rec['fused_speedup_vs_serial']:.3f}x, "
          f"prediction error {100 * rec['prediction_error']:+.1f}%")
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(rec, indent=1))


def _print_table(results: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="fused pipeline schedules")
    for col in ("instance", "bound", "makespan", "peak mem", "FF makespan", "FF peak", "serial 1F1B", "greedy",
                "speedup", "seconds", "valid"):
        table.add_column(col, justify="right")
    for r in results:
        ff = r["flexfusion"] or {}
        table.add_row(
            r["instance"], str(r["lower_bound"]), str(r["makespan"]), f"{r['peak_memory']:g}",
            str(ff.get("makespan", "-")), f"{ff['peak_memory']:g}" if ff else "-",
            str(r["serial_1f1b_makespan"]), str(r["greedy_makespan"]), f"{r['speedup_vs_serial_1f1b']:.3f}",
            f"{r['solve_seconds']:.1f}", "yes" if r["valid"] else "NO",
        )
    console = Console()
    if not console.is_terminal:  # files and pipes get the whole table, not an 80-column squeeze
        console = Console(width=170)
    console.print(table)
