"""Every bad input in reliability_cases answers one line on stderr, exit 2, no traceback, nothing half-written;
and docs/reliability.md shows exactly those lines (regenerate it with reliability_cases.py)."""

from pathlib import Path

import pytest

from reliability_cases import CASES, run_case

DOC = Path(__file__).resolve().parents[1] / "docs" / "reliability.md"


# All cases took about 55 s here (2 cores): config and file errors take milliseconds, the cases that
# reach a run (a tiny model, no SFT) a few seconds each.
@pytest.mark.parametrize("case", [pytest.param(c, id=c.what) for c in CASES])
def test_bad_input_is_one_line_on_stderr_and_exit_2(case, tmp_path):
    out = run_case(case, tmp_path / "case")
    assert out.exception is None or isinstance(out.exception, SystemExit), repr(out.exception)
    assert out.exit_code == 2, (out.stdout, out.stderr)
    assert "Traceback" not in out.stdout + out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr
    assert "error:" not in out.stdout  # errors never go to stdout
    run = out.tmp / "run"
    if run.exists():  # only a run that completed a checkpoint may stay, with nothing partial in it
        ckpts = run / "checkpoints"
        assert (ckpts / "latest").is_file() and (ckpts / (ckpts / "latest").read_text().strip()).is_dir()
        assert not [p for p in ckpts.iterdir() if p.name.startswith(".")], list(ckpts.iterdir())
    cache = out.tmp / "cache"
    assert not cache.exists() or not [p for p in cache.rglob("*") if ".tmp" in p.name]
    assert f"`{out.message().replace('|', chr(92) + '|')}`" in DOC.read_text(), (
        "docs/reliability.md is out of date; regenerate it: PYTHONPATH=src python tests/reliability_cases.py "
        f"docs/reliability.md\n{out.message()}")


def test_the_doc_lists_at_least_40_bad_inputs():
    rows = [ln for ln in DOC.read_text().splitlines() if ln.startswith("| ") and ln[2].isdigit()]
    assert len(rows) == len(CASES) >= 40
