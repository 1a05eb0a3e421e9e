"""`fuseflow plot ...`: figures drawn from an existing run directory."""

from __future__ import annotations

from pathlib import Path

import typer


def _parse_steps(text: str | None) -> list[int] | None:
    """``"3"`` -> [3], ``"2-4"`` -> [2, 3, 4], ``"1,5"`` -> [1, 5]; None keeps every step."""
    if not text:
        return None
    steps: list[int] = []
    try:
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            steps += list(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise ValueError(f"--steps {text!r} is invalid; give steps like 3, 2-4 or 1,5") from None
    return steps


def register(app: typer.Typer) -> None:
    """Add ``fuseflow plot`` (``trace`` and ``compare``) to the CLI app."""
    plot_app = typer.Typer(no_args_is_help=True, help="Plots drawn from a run directory.")
    app.add_typer(plot_app, name="plot")

    @plot_app.command("trace")
    def plot_trace(run_dir: Path = typer.Argument(..., help="A run directory (or a trace.json file)."),
                   out: Path = typer.Option(None, "--out", "-o", help="PNG path (default RUN_DIR/plots/trace.png)."),
                   steps: str = typer.Option(None, "--steps", help="Only these steps, e.g. 3, 2-4 or 1,5.")) -> None:
        """Render trace.json as a Gantt chart: one row per worker, so overlap and migration show."""
        from fuseflow.console import console, fail
        from fuseflow.telemetry.gantt import busy_fraction, load_trace, plot_gantt

        try:
            trace = load_trace(run_dir)
            chosen = _parse_steps(steps)
            base = run_dir if run_dir.is_dir() else run_dir.parent
            path = plot_gantt(trace, out or base / "plots" / "trace.png", chosen)
        except (FileNotFoundError, ValueError) as e:
            fail(str(e))
        last = (chosen or trace.steps())[-1]
        busy = ", ".join(f"{k} {v:.0%}" for k, v in busy_fraction(trace, last).items())
        console.print(f"Wrote {path} ({len(trace.tracks())} tracks); busy in step {last}: {busy}", soft_wrap=True)

    @plot_app.command("compare")
    def plot_compare_cmd(runs: list[Path] = typer.Argument(..., help="Run directories to draw side by side."),
                         metric: str = typer.Option("reward/mean", "--metric", "-m", help="A metrics.jsonl key."),
                         out: Path = typer.Option(Path("compare.png"), "--out", "-o", help="PNG path."),
                         smooth: int = typer.Option(1, "--smooth", help="Moving average over this many steps.")
                         ) -> None:
        """One metric against step for several runs, e.g. reward per step of schedule.mode A/B runs."""
        from fuseflow.console import console, fail
        from fuseflow.telemetry.plots import plot_compare

        try:
            path, series = plot_compare(runs, metric, out, smooth)
        except ValueError as e:
            fail(str(e))
        means = ", ".join(f"{k} {sum(v) / len(v):.3f}" for k, v in series.items())
        console.print(f"Wrote {path}; mean {metric} over steps: {means}", soft_wrap=True)
