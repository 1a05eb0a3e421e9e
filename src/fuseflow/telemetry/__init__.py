"""Metrics (JSONL + TensorBoard), Chrome-trace timelines and plots for a run directory."""

from .metrics import MetricsLogger
from .trace import Tracer

__all__ = ["MetricsLogger", "Tracer"]
