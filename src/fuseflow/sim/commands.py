"""CLI commands of the simulator: `simulate`, `plan` and `sim calibrate`.

`register(app)` adds them to the top-level Typer app, so `fuseflow.cli` owns the app
and this module owns only its commands. Bad input is one line naming the option, the value
and what is allowed, then exit code 2, printed by `fuseflow.console.fail` like every
other command's errors.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import typer
import yaml
from rich.console import Console

from fuseflow.console import fail, make_progress

from .hardware import get_hardware, hardware_names
from .modelspec import get_model, model_names
from .placement import Problem
from .plan_config import plan_config_tree
from .policies import parse_policy
from .scenarios import SCENARIOS, run_scenario
from .search import search
from .workload import LengthDist, Workload


@contextmanager
def _progress_bar(description: str, lazy: bool = False) -> Iterator[Callable[..., None]]:
    """A progress bar for a long command, as ``update(done, total, description=None)``.

    It writes to stderr, so `--json` output on stdout stays one parseable document. ``lazy``
    shows it only from its first update, for a command whose input errors surface once work
    has begun (`sim calibrate` loads the run): they then stay one line.
    """
    progress = make_progress(Console(stderr=True))
    bar = progress.add_task(description, total=None)
    if not lazy:
        progress.start()

    def update(done: int, total: int, text: str | None = None) -> None:
        if not progress.live.is_started:
            progress.start()
        progress.update(bar, completed=done, total=total, description=text or description)

    try:
        yield update
    finally:
        if progress.live.is_started:
            progress.stop()


def _emit(data: dict, as_json: bool, out: Path | None, text: str) -> None:
    blob = json.dumps(data, indent=2, default=_jsonable)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(blob + "\n")
    typer.echo(blob if as_json else text)


def _jsonable(x):
    if hasattr(x, "item"):
        return x.item()
    return str(x)


def simulate_cmd(
    scenario: str = typer.Option(..., "--scenario", help=f"one of: {', '.join(SCENARIOS)}"),
    as_json: bool = typer.Option(False, "--json", help="print the full result as JSON"),
    out: Path | None = typer.Option(None, "--out", help="also write the JSON result to this file"),
    trace_dir: Path | None = typer.Option(None, "--trace-dir", help="write Chrome traces and Gantt PNGs here"),
    iterations: int = typer.Option(1, "--iterations", help="RL steps simulated per policy"),
) -> None:
    """Replay a published setting (rlhfuse, hybridflow, rlhfless) under each execution policy."""
    if scenario not in SCENARIOS:
        fail(f"--scenario {scenario!r}: unknown; choose one of: {', '.join(SCENARIOS)}")
    if iterations < 1:
        fail(f"--iterations {iterations}: must be >= 1")
    with _progress_bar(f"simulate {scenario}") as update:
        result = run_scenario(scenario, trace_dir, iterations,
                              lambda done, total, case: update(done, total, f"simulate {scenario}: {case}"))
    lines = [f"scenario {scenario} on {result['hardware']}"]
    for case in result["cases"]:
        pols = ", ".join(f"{p}: {v['iteration_seconds']:.2f}s x{v['speedup_vs_sequential']:.2f} "
                         f"{v['gpu_seconds']:.0f} GPU-s" for p, v in case.get("policies", {}).items())  # fmt: skip
        extra = f" best placement: {case['best_placement']}" if "best_placement" in case else ""
        lines.append(f"  {case['case']}: {pols or 'infeasible'}{extra}")
    lines.append("summary: " + json.dumps(result["summary"], default=_jsonable))
    _emit(result, as_json, out, "\n".join(lines))


def plan_cmd(
    model: str = typer.Option(..., "--model", help=f"preset ({', '.join(model_names())}) or config.json path"),
    gpus: int = typer.Option(..., "--gpus", help="number of devices"),
    gpu_type: str = typer.Option("H100", "--gpu-type", help=f"one of: {', '.join(hardware_names())}"),
    as_json: bool = typer.Option(False, "--json", help="print the plans as JSON"),
    top: int = typer.Option(3, "--top", help="how many plans to show"),
    write_config: Path | None = typer.Option(None, "--write-config", help="write the best plan as a YAML config"),
    algorithm: str = typer.Option("ppo", "--algorithm", help="ppo (critic + reward model) or grpo"),
    critic: str | None = typer.Option(None, "--critic-model", help="critic/reward size (default: the actor's)"),
    prompts: int = typer.Option(512, "--prompts", help="prompts per RL step"),
    samples_per_prompt: int = typer.Option(1, "--samples-per-prompt", help="responses per prompt"),
    prompt_len: int = typer.Option(1024, "--prompt-len", help="prompt tokens (max of a log-normal)"),
    response_len: int = typer.Option(1024, "--response-len", help="response cap (long-tailed log-normal)"),
    policies: str = typer.Option("sequential,fused,async", "--policies", help="comma-separated policies to try"),
    lengths_file: Path | None = typer.Option(None, "--response-lengths",
                                             help="measured response lengths (JSON list or one per line)"),
) -> None:
    """Search placements, layouts and execution policies for an RL job; print the best plans."""
    try:
        spec = get_model(model)
    except ValueError:
        fail(f"--model {model!r}: unknown; choose one of: {', '.join(model_names())} or a config.json path")
    try:
        hw = get_hardware(gpu_type)
    except ValueError:
        fail(f"--gpu-type {gpu_type!r}: unknown; choose one of: {', '.join(hardware_names())}")
    for name, value in (("--gpus", gpus), ("--top", top), ("--prompts", prompts),
                        ("--samples-per-prompt", samples_per_prompt), ("--prompt-len", prompt_len),
                        ("--response-len", response_len)):  # fmt: skip
        if value <= 0:
            fail(f"{name} {value}: must be > 0")
    if algorithm not in ("ppo", "grpo"):
        fail(f"--algorithm {algorithm!r}: unknown; choose ppo or grpo")
    crit = None
    if critic is not None:
        try:
            crit = get_model(critic)
        except ValueError:
            fail(f"--critic-model {critic!r}: unknown; choose one of: {', '.join(model_names())}")
    resp = LengthDist("lognormal", max_len=response_len, median=response_len / 4, sigma=0.8)
    if lengths_file is not None:
        try:
            resp = LengthDist.from_file(lengths_file, max_len=response_len)
        except (OSError, ValueError) as err:
            fail(f"--response-lengths {str(lengths_file)!r}: {err}")
    wl = Workload(
        prompts=prompts, samples_per_prompt=samples_per_prompt, algorithm=algorithm, reward_model=algorithm == "ppo",
        prompt_len=LengthDist("lognormal", max_len=prompt_len, median=prompt_len / 4, sigma=0.5), response_len=resp,
    )  # fmt: skip
    pols = tuple(p.strip() for p in policies.split(",") if p.strip())
    for pol in pols or ("",):
        try:
            parse_policy(pol)
        except ValueError:
            fail(f"--policies {pol!r}: unknown; use sequential or a '+' join of fused, async, elastic")
    try:
        problem = Problem.build(spec, hw, gpus, wl, critic=crit)
        cands, stats = search(problem, policies=pols, top=top)
    except ValueError as err:
        fail(str(err))
    data = {
        "model": spec.name, "gpus": gpus, "gpu_type": hw.name, "algorithm": algorithm,
        "workload": {"prompts": prompts, "samples_per_prompt": samples_per_prompt,
                     "prompt_len_max": prompt_len, "response_len_max": response_len},
        "plans": [c.to_dict() for c in cands], "search": stats,
    }  # fmt: skip
    if write_config is not None:
        _write_plan_config(write_config, problem, cands[0])
    lines = [f"{spec.name} on {gpus} x {hw.name} ({algorithm}), searched in {stats['seconds']}s:"]
    for i, c in enumerate(data["plans"], 1):
        sets = " | ".join(f"{'+'.join(s['roles'])}:{s['gpus']}" for s in c["sets"])
        lines.append(f"  {i}. {c['iteration_seconds']:.2f}s/step with {c['policy']}; {c['placement']} [{sets}]; "
                     f"generation tp{c['generation']['tp']} pp{c['generation']['pp']}; "
                     f"layouts {c['layouts']}; peak GB/GPU {c['memory_gb_per_gpu']}")  # fmt: skip
    _emit(data, as_json, None, "\n".join(lines))


def _write_plan_config(path: Path, problem: Problem, cand) -> None:
    """Write the plan as a fuseflow config after checking it with the real config model.

    The import is here, in the CLI glue, so the simulator proper never depends on the
    config layer; a plan that fuseflow cannot run exits 2 with the config's own message.
    """
    from fuseflow.config import ConfigError, load_config

    tree, notes = plan_config_tree(problem, cand)
    try:
        load_config("default", base=tree)
    except ConfigError as err:
        fail(f"--write-config: this plan is not a valid fuseflow config: {err}")
    path.parent.mkdir(parents=True, exist_ok=True)
    header = "".join(f"# {line}\n" for line in notes)
    path.write_text(header + yaml.safe_dump(tree, sort_keys=False))


def calibrate_cmd(
    run_dir: Path = typer.Argument(..., help="a fuseflow run directory (config.yaml, metrics.jsonl, trace.json)"),
    hardware: str = typer.Option("cpu", "--hardware", help=f"hardware spec to fit: {', '.join(hardware_names())}"),
    as_json: bool = typer.Option(False, "--json", help="print the result as JSON"),
    predict: Path | None = typer.Option(None, "--predict", help="also predict this other run with the fitted factors"),
) -> None:
    """Fit efficiency factors to a run's trace and predict its median step time."""
    from .calibrate import calibrate

    try:
        get_hardware(hardware)
        with _progress_bar("calibrate: fit starts", lazy=True) as update:
            result = calibrate(run_dir, hardware, predict, update)
    except ValueError as err:
        fail(str(err))
    med = result["median_step_seconds"]
    text = (f"fitted {result['fitted_efficiency']}\n"
            f"median step ({result['mode']}, {result['rollout_workers']} rollout worker(s)): "
            f"measured {med['measured']:.3f}s, predicted {med['predicted']:.3f}s "
            f"({100 * med['relative_error']:+.1f}%)")  # fmt: skip
    if "held_out" in result:
        text += f"\nheld-out (fit even steps, test odd): {100 * result['held_out']['relative_error']:+.1f}%"
    if "other_run" in result:
        o = result["other_run"]
        text += (f"\n{o['run_dir']}: measured {o['measured']:.3f}s, predicted {o['predicted']:.3f}s "
                 f"({100 * o['relative_error']:+.1f}%)")  # fmt: skip
    _emit(result, as_json, None, text)


def register(app: typer.Typer) -> None:
    """Add `simulate`, `plan` and the `sim` group (with `calibrate`) to a Typer app."""
    app.command("simulate")(simulate_cmd)
    app.command("plan")(plan_cmd)
    sim = typer.Typer(help="Cluster simulator utilities.", no_args_is_help=True)
    sim.command("calibrate")(calibrate_cmd)
    app.add_typer(sim, name="sim")
