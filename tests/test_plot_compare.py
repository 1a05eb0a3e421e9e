"""`fuseflow plot compare`: one metric against step for several runs, with clear errors."""

import json

import pytest
from typer.testing import CliRunner

from fuseflow.cli import app
from fuseflow.telemetry.plots import moving_average, plot_compare

runner = CliRunner()


def _run(path, rewards):
    path.mkdir()
    (path / "metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, "reward/mean": r, "kl": 0.1}) + "\n"
                                                for i, r in enumerate(rewards)))
    return path


def test_compare_writes_a_png_with_each_runs_series(tmp_path):
    a, b = _run(tmp_path / "sequential", [0.1, 0.3, 0.5, 0.7]), _run(tmp_path / "async", [0.2, 0.2, 0.6, 0.6])
    path, series = plot_compare([a, b], "reward/mean", tmp_path / "out" / "cmp.png", smooth=2)
    assert path.stat().st_size > 0
    assert series == {"sequential": [0.1, 0.3, 0.5, 0.7], "async": [0.2, 0.2, 0.6, 0.6]}
    assert moving_average([0.1, 0.3, 0.5, 0.7], 2) == pytest.approx([0.1, 0.2, 0.4, 0.6])  # the drawn --smooth line
    assert moving_average([1.0, 3.0, 5.0], 1) == [1.0, 3.0, 5.0]
    result = runner.invoke(app, ["plot", "compare", str(a), str(b), "--out", str(tmp_path / "c.png")])
    assert result.exit_code == 0, result.output
    assert "sequential 0.400" in result.output and "async 0.400" in result.output  # means over steps


def test_compare_errors_name_the_run_and_the_metric(tmp_path):
    a = _run(tmp_path / "a", [0.1])
    result = runner.invoke(app, ["plot", "compare", str(a), "--metric", "reward/median", "-o", str(tmp_path / "x.png")])
    assert result.exit_code != 0
    assert "no metric 'reward/median'" in result.output and "reward/mean" in result.output
    result = runner.invoke(app, ["plot", "compare", str(tmp_path / "missing"), "-o", str(tmp_path / "x.png")])
    assert result.exit_code != 0 and "no metrics.jsonl" in result.output
    result = runner.invoke(app, ["plot", "compare", str(a), "--smooth", "0", "-o", str(tmp_path / "x.png")])
    assert result.exit_code != 0 and "--smooth must be >= 1" in result.output
