"""Built-in tasks with verifiable rewards, and user data (see ``make_task``)."""

from __future__ import annotations

from .arith import ArithTask, SafeArithTask
from .base import GeneratedTask, Prompt, RewardError, Task
from .pref import PrefTask
from .sort import SortTask
from .user import DataError, FileTask, load_function, load_rows, read_rows

__all__ = ["ArithTask", "SafeArithTask", "SortTask", "PrefTask", "FileTask", "GeneratedTask", "Prompt", "Task", "RewardError",
           "DataError", "load_function", "load_rows", "read_rows", "make_task"]


def make_task(cfg) -> Task:
    """The task named by a ``TaskConfig``."""
    if cfg.name == "arith":
        return ArithTask(cfg.seed, cfg.train_size, cfg.eval_size, cfg.max_digits, cfg.demo_error_rate)
    if cfg.name == "safe_arith":
        return SafeArithTask(cfg.seed, cfg.train_size, cfg.eval_size, cfg.max_digits, cfg.demo_error_rate,
                             cfg.forbidden_digit)
    if cfg.name == "sort":
        return SortTask(cfg.seed, cfg.train_size, cfg.eval_size, cfg.max_items)
    if cfg.name == "pref":
        return PrefTask(cfg.seed, cfg.train_size, cfg.eval_size)
    if cfg.name == "reasoning_gym":
        from .reasoning_gym import ReasoningGymTask  # imports reasoning-gym (an optional package) on use only

        return ReasoningGymTask(cfg.dataset, cfg.config, cfg.seed, cfg.train_size, cfg.eval_size, cfg.instruction)
    if cfg.name == "file":
        return FileTask(cfg.path, cfg.reward_fn, cfg.eval_path, cfg.eval_size, cfg.success_threshold, cfg.cost_fn)
    raise ValueError(f"task.name: unknown task {cfg.name!r}; choose arith, safe_arith, sort, pref, file or "
                     "reasoning_gym")
