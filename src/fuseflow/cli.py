"""The ``fuseflow`` command line.

Every command takes dotted ``key=value`` overrides on top of a preset. Bad input
(config, data, a missing file, a failing reward function) prints one line and exits
with 2; Ctrl-C says which checkpoint is intact and how to resume.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import typer

from fuseflow.config import ConfigError, load_config, load_run_config, preset_names
from fuseflow.config_tree import read_config_file
from fuseflow.console import console, fail
from fuseflow.controller.group import WorkerFailure

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="RL post-training of language models (GRPO, PPO) with fine-grained scheduling.")
config_app = typer.Typer(no_args_is_help=True, help="Inspect the resolved config.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks: write JSON, compare side by side as ratios.")
app.add_typer(config_app, name="config")
app.add_typer(bench_app, name="bench")

OVERRIDES = typer.Argument(None, help="Dotted overrides, e.g. trainer.steps=50 algorithm.name=ppo")
PRESET = typer.Option("default", "--preset", "-p", help="Config preset shipped with fuseflow.")
CONFIG_FILE = typer.Option(None, "--config", "-c", help="A YAML config tree (a run's config.yaml, your own, or one "
                           "written by `fuseflow plan --write-config`) used instead of the preset; keys it leaves "
                           "out take their defaults, overrides apply on top.")


def _user_errors():
    from fuseflow.checkpoint import CheckpointWriteError
    from fuseflow.controller.ray_backend import ClusterError
    from fuseflow.tasks import DataError, RewardError

    return (ConfigError, DataError, RewardError, FileNotFoundError, ValueError, ClusterError, CheckpointWriteError)


def _load(preset: str, overrides: list[str] | None, config: Path | None):
    """The config from ``--config FILE`` (its own preset name kept) or from a preset, plus overrides."""
    if config is None:
        return load_config(preset, overrides)
    return load_config(preset, overrides, base=read_config_file(config, f"--config {config}"))


@config_app.command("show")
def config_show(overrides: list[str] = OVERRIDES, preset: str = PRESET, config: Path = CONFIG_FILE) -> None:
    """Print the resolved config as YAML."""
    try:
        cfg = _load(preset, overrides, config)
    except ConfigError as e:
        fail(str(e))
    typer.echo(cfg.to_yaml(), nl=False)


@app.command()
def train(overrides: list[str] = OVERRIDES, preset: str = PRESET,
          output: Path = typer.Option(None, "--output", "-o", help="Run directory (default runs/<preset>-<time>)."),
          resume: Path = typer.Option(None, "--resume", help="Continue the run in this directory."),
          config: Path = CONFIG_FILE) -> None:
    """SFT warm start (cached), held-out eval, RL, held-out eval; writes a run directory."""
    from fuseflow.runner import train as run_train

    run_dir, created = None, False
    try:
        if resume is not None:
            if config is not None:
                fail(f"--config {config} with --resume {resume}: a resumed run keeps its own config.yaml; "
                     "pass overrides instead, or start a new run with --config")
            cfg = load_run_config(resume, overrides)
            run_dir = resume
        else:
            cfg = _load(preset, overrides, config)
            run_dir = Path(output or cfg.output or f"runs/{cfg.preset}-{time.strftime('%Y%m%d-%H%M%S')}")
            if (run_dir / "checkpoints").is_dir():
                fail(f"--output {run_dir} already holds a run; continue it with --resume {run_dir} "
                     "or choose another directory")
            created = not run_dir.exists()
        console.print(f"fuseflow train: {cfg.algorithm.name} on {cfg.task.name}, run directory {run_dir}")
        run_train(cfg, run_dir, resume=resume is not None, console=console)
    except KeyboardInterrupt:
        _interrupted(run_dir)
    except _user_errors() as e:
        _drop_unstarted(run_dir, created)
        fail(str(e))
    except WorkerFailure as e:  # names the role, rank and last checkpoint; not the user's input: exit 1
        fail(str(e), code=1)


def _drop_unstarted(run_dir: Path | None, created: bool) -> None:
    """Remove a run directory this command created when the run failed before its first checkpoint.

    Bad input found during set-up (a data file, a reward function, the cluster) would otherwise
    leave a directory that looks like a run but holds no step: a second try with the same
    ``--output`` must start clean, and nothing half-written should be mistaken for a result.
    """
    import shutil

    from fuseflow.checkpoint import latest_checkpoint

    if created and run_dir is not None and run_dir.is_dir() and latest_checkpoint(run_dir) is None:
        shutil.rmtree(run_dir, ignore_errors=True)


def _interrupted(run_dir: Path) -> None:
    from fuseflow.checkpoint import latest_checkpoint

    ckpt = latest_checkpoint(run_dir) if run_dir else None
    kept = f"checkpoint {ckpt.name} is intact" if ckpt else "no checkpoint had been written yet"
    fail(f"interrupted; {kept}. Resume with: fuseflow train --resume {run_dir}", code=130)


@app.command()
def sft(overrides: list[str] = OVERRIDES, preset: str = PRESET,
        output: Path = typer.Option(None, "--output", "-o", help="Also copy the SFT model here."),
        config: Path = CONFIG_FILE) -> None:
    """Train (or reuse from the cache) the SFT warm-start model for a config."""
    import shutil

    from fuseflow.console import make_progress
    from fuseflow.models import resolve_device
    from fuseflow.models.source import run_tokenizer
    from fuseflow.preflight import check_inputs
    from fuseflow.sft import ensure_sft_model
    from fuseflow.tasks import make_task

    try:
        cfg = _load(preset, overrides, config)
        check_inputs(cfg)
        device, dtype = resolve_device(cfg.device)
        with make_progress(console) as progress:
            path, curve = ensure_sft_model(cfg, make_task(cfg.task), run_tokenizer(cfg, console.print), device,
                                           dtype, progress, console.print)
        best = max(curve, key=lambda c: c["accuracy"]) if curve and "accuracy" in curve[0] else None
        if best:
            console.print(f"SFT model: {path} (best held-out accuracy {best['accuracy']:.3f} at step {best['step']})")
        if output:
            shutil.copytree(path, output, dirs_exist_ok=True)
            console.print(f"Copied to {output}")
    except KeyboardInterrupt:
        fail("interrupted; the SFT cache is only written when training completes", code=130)
    except _user_errors() as e:
        fail(str(e))


@app.command("train-rm")
def train_rm(overrides: list[str] = OVERRIDES,
             preset: str = typer.Option("rlhf", "--preset", "-p", help="Config preset shipped with fuseflow."),
             output: Path = typer.Option(None, "--output", "-o",
                                         help="Reward-model directory (default: reward.model of the config).")) -> None:
    """Train a Bradley-Terry reward model on preference pairs (rm.data=FILE, or the synthetic `pref` task)."""
    from fuseflow.console import make_progress
    from fuseflow.reward_model import train_reward_model

    try:
        cfg = load_config(preset, overrides)
        out = Path(output or cfg.reward.model or f"runs/rm-{time.strftime('%Y%m%d-%H%M%S')}")
        with make_progress(console) as progress:
            report = train_reward_model(cfg, out, progress, console.print)
    except KeyboardInterrupt:
        fail("interrupted; no reward model was written", code=130)
    except _user_errors() as e:
        fail(str(e))
    console.print(f"Reward model: {out} (held-out pairwise accuracy {report['heldout_accuracy']:.3f} on "
                  f"{report['heldout_pairs']} pairs; train {report['train_accuracy']:.3f}). "
                  f"Use it with: fuseflow train reward.model={out}")


@app.command()
def export(run_dir: Path = typer.Argument(..., help="A run directory made by fuseflow train."),
           out_dir: Path = typer.Argument(..., help="Where to write the Hugging Face model (or peft adapter) directory."),
           step: int = typer.Option(None, "--step", help="Checkpoint step (default: the latest)."),
           merge: bool = typer.Option(False, "--merge", help="LoRA runs: write the base with the adapters merged "
                                      "in (a plain HF model) instead of the peft adapter."),
           check: int = typer.Option(0, "--check", help="Then decode N held-out prompts greedily in transformers "
                                     "(and peft, for an adapter) and check they give the engine's tokens.")) -> None:
    """Write a checkpoint's policy as a Hugging Face model directory (a LoRA run: its peft adapter) with its tokenizer."""
    from fuseflow.checkpoint import find_checkpoint
    from fuseflow.data.tokenizer import load_tokenizer
    from fuseflow.models import CausalLM

    try:
        if check < 0:
            raise ValueError(f"--check {check}: the number of prompts must be >= 0")
        ckpt = find_checkpoint(run_dir, step)
        tok_dir = ckpt / "actor"
        tokenizer = load_tokenizer(tok_dir if (tok_dir / "tokenizer.json").exists() else None)
        from fuseflow.models.lora import is_adapter_dir

        if is_adapter_dir(ckpt / "actor"):
            what = _export_lora(ckpt / "actor", run_dir / "reference", out_dir, merge)
        else:
            CausalLM.from_pretrained(ckpt / "actor").save_pretrained(out_dir)
            what = "transformers.AutoModelForCausalLM.from_pretrained"
        tokenizer.save_pretrained(str(out_dir))
    except _user_errors() as e:
        fail(str(e))
    console.print(f"Exported {ckpt} to {out_dir} (load with {what})")
    if check:
        from fuseflow.export_check import check_export

        r = check_export(run_dir, ckpt, out_dir, check, log=console.print)
        loaders = [k for k in r if k in ("peft", "transformers")]
        for name in loaders:
            console.print(f"{name}: {r[name]}/{r['prompts']} prompts give the engine's greedy tokens "
                          f"({sum(r['engine_tokens'])} tokens)")
        if any(r[name] != r["prompts"] for name in loaders):
            fail("the exported model's greedy tokens differ from the engine's (see above)", code=1)


def _export_lora(adapter_dir: Path, base_dir: Path, out_dir: Path, merge: bool) -> str:
    """A LoRA checkpoint: the peft adapter (its base: the run's reference model), or the merged model."""
    from fuseflow.models import CausalLM
    from fuseflow.models.lora import apply_lora, load_adapter, merged_model, read_adapter_spec, save_adapter

    if not (base_dir / "config.json").is_file():
        raise FileNotFoundError(f"{base_dir}: the run's base model is missing; a LoRA checkpoint needs it")
    model = apply_lora(CausalLM.from_pretrained(base_dir), read_adapter_spec(adapter_dir))
    load_adapter(model, adapter_dir)
    if merge:
        merged_model(model).save_pretrained(out_dir)
        return "transformers.AutoModelForCausalLM.from_pretrained"
    save_adapter(model, out_dir, base_path=base_dir.resolve())
    return f"peft.PeftModel.from_pretrained on the base {base_dir}"


@app.command("presets")
def presets() -> None:
    """List the config presets."""
    for name in preset_names():
        typer.echo(name)


def _register_plugins() -> None:
    # Subsystems own their commands; the CLI only mounts them.
    from fuseflow.bench.controller import register as register_controller
    from fuseflow.bench.fusion import register as register_fusion
    from fuseflow.bench.fusion_pool import register as register_fusion_pool
    from fuseflow.bench.gpu import register as register_gpu
    from fuseflow.bench.lora import register as register_lora
    from fuseflow.bench.optimizer import register as register_optimizer
    from fuseflow.bench.recovery import register as register_recovery
    from fuseflow.bench.scoring import register as register_scoring
    from fuseflow.bench.trl import register as register_trl
    from fuseflow.rollout.bench import register as register_rollout
    from fuseflow.schedule.pipeline.bench import register as register_pipeline
    from fuseflow.sim.commands import register as register_sim
    from fuseflow.telemetry.commands import register as register_plot

    register_sim(app)
    register_plot(app)
    register_pipeline(bench_app)
    register_rollout(bench_app)
    register_trl(bench_app)
    register_controller(bench_app)
    register_fusion(bench_app)
    register_fusion_pool(bench_app)
    register_gpu(bench_app)
    register_lora(bench_app)
    register_optimizer(bench_app)
    register_recovery(bench_app)
    register_scoring(bench_app)


_register_plugins()


def main() -> None:
    """The ``fuseflow`` console script."""
    app(prog_name="fuseflow")


if __name__ == "__main__":
    sys.exit(main())
