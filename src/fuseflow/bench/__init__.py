"""End-to-end benchmarks that drive whole RL runs (``fuseflow bench controller``, ``fusion``, ``trl``).

Subsystem benchmarks live next to their subsystem (``rollout/bench.py``,
``schedule/pipeline/bench.py``); the ones here run the trainer itself, and sometimes
another framework beside it, so they sit above the programs layer. The helpers below
are what every one of them records and writes.
"""

from __future__ import annotations

import json
import platform
from pathlib import Path


def cpu_name() -> str:
    """The CPU model as /proc/cpuinfo names it (``platform`` says only "x86_64" on Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def write_result(out: Path | None, result: dict) -> None:
    """Write a benchmark's JSON to ``out`` (its folder created), when the user asked for a file."""
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
