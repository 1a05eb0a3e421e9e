"""Built-in tasks with verifiable rewards, and user data (see ``make_task``)."""

from __future__ import annotations

from .arith import ArithTask
from .base import Prompt, RewardError, Task
from .sort import SortTask
from .user import DataError, FileTask, load_function, load_rows

__all__ = ["ArithTask", "SortTask", "FileTask", "Prompt", "Task", "RewardError", "DataError",
           "load_function", "load_rows", "make_task"]


def make_task(cfg) -> Task:
    """The task named by a ``TaskConfig``."""
    if cfg.name == "arith":
        return ArithTask(cfg.seed, cfg.train_size, cfg.eval_size, cfg.max_digits, cfg.demo_error_rate)
    if cfg.name == "sort":
        return SortTask(cfg.seed, cfg.train_size, cfg.eval_size, cfg.max_items)
    if cfg.name == "file":
        return FileTask(cfg.path, cfg.reward_fn, cfg.eval_path, cfg.eval_size, cfg.success_threshold)
    raise ValueError(f"task.name: unknown task {cfg.name!r}; choose arith, sort or file")
