"""``bound_heap_retention``: freed megabyte-sized blocks (a step's activations) go back to the kernel instead of staying resident."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

# In a fresh process: raise glibc's dynamic mmap threshold the way a training step does (free an 8 MB
# block), allocate 300 tensors of 1 MB, free every other one, and report how many MB stayed resident.
SCRIPT = textwrap.dedent("""
    import resource, sys
    from pathlib import Path
    from fuseflow.memory import bound_heap_retention

    def rss():
        return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize() / 2**20

    if sys.argv[1] == "bound":
        assert bound_heap_retention()
    big = bytearray(8 * 2**20)
    del big
    before = rss()
    kept = [bytearray(b"x") * 2**20 for _ in range(300)]  # 1 MB each, every page written
    del kept[::2]
    print(rss() - before)
""")


def _retained(mode: str, env=None) -> float:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True, env=env)
    return float(out.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_tensors_leave_the_resident_set_once_the_threshold_is_fixed():
    import os

    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    dynamic, bound = _retained("dynamic", env), _retained("bound", env)
    # 150 live tensors of 1 MB either way; with the dynamic threshold the 150 freed ones stay resident too.
    assert dynamic > 250, dynamic
    assert 140 < bound < 200, bound


def test_a_user_setting_wins(monkeypatch):
    from fuseflow.memory import bound_heap_retention

    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert bound_heap_retention() is False
