"""Per-step metrics to ``metrics.jsonl`` and TensorBoard event files."""

from __future__ import annotations

import json
import math
from pathlib import Path


class MetricsLogger:
    """Appends one JSON object per step; on resume, drops lines past the restored step.

    TensorBoard is optional at runtime: if it cannot be imported the JSONL log still works.
    """

    def __init__(self, run_dir: Path, resume_step: int | None = None, tensorboard: bool = True):
        self.path = Path(run_dir) / "metrics.jsonl"
        if resume_step is not None and self.path.exists():
            kept = [ln for ln in self.path.read_text().splitlines()
                    if ln.strip() and json.loads(ln).get("step", 0) <= resume_step]
            self.path.write_text("".join(ln + "\n" for ln in kept))
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))
            except ImportError:
                self._tb = None

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Append one step's metrics as a line of ``metrics.jsonl`` (a non-finite value is written as null) and, with
        TensorBoard, add the finite numbers as scalars."""
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)) and math.isfinite(v):
                    self._tb.add_scalar(k, v, step)

    def event(self, step: int, kind: str, **fields) -> None:
        """A non-step record (e.g. an automatic restart), kept in metrics.jsonl beside the steps.

        ``step`` orders it among the steps; ``read_metrics`` leaves such records out and
        ``read_events`` returns them.
        """
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, "event": kind, **{k: _plain(v) for k, v in fields.items()}}) + "\n")

    def close(self) -> None:
        """Flush and close the TensorBoard writer, if any (the JSONL file is closed after each line)."""
        if self._tb is not None:
            self._tb.close()


def read_metrics(run_dir: Path) -> list[dict]:
    """The per-step records of ``metrics.jsonl`` (events such as restarts left out)."""
    return [r for r in _records(run_dir) if "event" not in r]


def read_events(run_dir: Path, kind: str | None = None) -> list[dict]:
    """The event records of ``metrics.jsonl`` (``MetricsLogger.event``), optionally of one kind."""
    return [r for r in _records(run_dir) if "event" in r and (kind is None or r["event"] == kind)]


def _records(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def _plain(v):
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None  # JSON has no NaN; None marks a missing value
    return v
