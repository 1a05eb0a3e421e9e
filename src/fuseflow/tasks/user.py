"""User data: JSONL or Parquet prompts plus a reward function named by the user.

Each row needs a ``prompt`` column; ``answer`` (passed to the reward) and
``response`` (an SFT demonstration) are optional. The reward function is given as
``package.module:function`` or ``path/to/file.py:function`` and is called as
``fn(prompt: str, response: str, answer: str | None) -> float``, or, for a batch function
(``reward.batch=true`` or a name ending in ``_batch``), as
``fn(prompts: list[str], responses: list[str], answers: list[str | None]) -> list[float]``;
``fuseflow.tasks.calls`` checks every value and enforces ``reward.timeout_s``. It may be left out
when a learned reward model (``reward.model``) supplies the reward. An optional cost
function (``task.cost_fn``, same signature) gives safe_ppo its constraint signal.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import zlib
from collections.abc import Callable
from pathlib import Path

from .base import Prompt, Task
from .calls import UserFunction


class DataError(ValueError):
    """Bad user data: a missing file, an empty dataset or a missing column."""


def read_rows(path: str | Path, field: str = "task.path", columns: str = "a 'prompt' column",
              what: str = "dataset") -> list[dict]:
    """Raw rows of a ``.jsonl`` or ``.parquet`` file: the one reader of user data files.

    ``field`` (the config key that named the file) and ``columns`` (what a row needs)
    phrase the errors; a missing file, an unknown suffix, bad JSON or no rows at all is
    a ``DataError``. Checking the columns is the caller's job (``load_rows``, and
    ``fuseflow.reward_model.load_pairs`` for preference pairs).
    """
    p = Path(path).expanduser()
    if not p.is_file():
        raise DataError(f"{field}: {path} does not exist; pass a .jsonl or .parquet file with {columns}")
    if p.suffix == ".jsonl":
        rows = []
        for i, line in enumerate(p.read_text().splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise DataError(f"{field}: {path}:{i}: not valid JSON ({exc.msg}, column {exc.colno})") from None
    elif p.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = pq.read_table(p).to_pylist()
    else:
        raise DataError(f"{field}: {path} has suffix {p.suffix!r}; use .jsonl or .parquet")
    if not rows:
        raise DataError(f"{field}: {path} has no rows; the {what} is empty")
    return rows


def load_rows(path: str | Path, field: str = "task.path") -> list[dict]:
    """Rows of a ``.jsonl`` or ``.parquet`` prompt file, each with a non-empty ``prompt`` string."""
    rows = read_rows(path, field)
    missing = [i for i, r in enumerate(rows) if not isinstance(r, dict) or not isinstance(r.get("prompt"), str)
               or not r["prompt"]]
    if missing:
        raise DataError(f"{field}: {path}: row {missing[0] + 1} has no 'prompt' string ({len(missing)} such rows)")
    return rows


def function_file(spec: str) -> Path | None:
    """The file a ``path/to/file.py:function`` spec imports from; None for ``package.module:function``."""
    target = spec.rsplit(":", 1)[0] if ":" in spec else ""
    return Path(target).expanduser() if target.endswith(".py") else None


def load_function(spec: str, field: str = "task.reward_fn") -> Callable:
    """Import ``package.module:function`` or ``path/to/file.py:function`` (``field`` names it in errors)."""
    if ":" not in spec:
        raise DataError(f"{field}: {spec!r} should look like package.module:function or file.py:function")
    target, name = spec.rsplit(":", 1)
    path = function_file(spec)
    if path is not None:
        if not path.is_file():
            raise DataError(f"{field}: file {target} does not exist")
        mod_spec = importlib.util.spec_from_file_location(f"fuseflow_user_{path.stem}", path)
        module = importlib.util.module_from_spec(mod_spec)
        try:
            mod_spec.loader.exec_module(module)
        except SyntaxError as exc:  # the file's own line, not importlib's 50-line traceback
            raise DataError(f"{field}: {target}:{exc.lineno}: syntax error: {exc.msg}") from None
        except Exception as exc:  # noqa: BLE001 - user code run at import: one line naming it
            raise DataError(f"{field}: importing {target} raised {type(exc).__name__}: "
                            f"{' '.join(str(exc).split())[:200]}") from None
    else:
        try:
            module = importlib.import_module(target)
        except SyntaxError as exc:
            raise DataError(f"{field}: {exc.filename}:{exc.lineno}: syntax error: {exc.msg}") from None
        except ImportError as exc:
            raise DataError(f"{field}: cannot import {target!r} ({exc})") from None
        except Exception as exc:  # noqa: BLE001 - user code run at import: one line naming it
            raise DataError(f"{field}: importing {target} raised {type(exc).__name__}: "
                            f"{' '.join(str(exc).split())[:200]}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise DataError(f"{field}: {target} has no function {name!r}")
    return fn


class FileTask(Task):
    """Prompts from the user's file; the reward from ``reward_fn``, or from a reward model alone.

    ``reward_fn=None`` is allowed for RLHF on user prompts (``reward.model`` gives the whole
    reward): the task then has ``has_reward = False`` and ``score`` is NaN.
    """

    name = "file"

    def __init__(self, path: str, reward_fn: str | None, eval_path: str | None = None,
                 eval_size: int = 500, success_threshold: float = 1.0, cost_fn: str | None = None):
        self.success_threshold = success_threshold
        self._fn = UserFunction(reward_fn, "task.reward_fn", "reward") if reward_fn else None
        self.has_reward = self._fn is not None
        self._cost_fn = UserFunction(cost_fn, "task.cost_fn", "cost") if cost_fn else None
        self.has_cost = self._cost_fn is not None
        rows = load_rows(path)
        if eval_path:
            train_rows, eval_rows = rows, load_rows(eval_path, "task.eval_path")
        else:
            # Hold out a stable ~10% by hashing the prompt text, at most eval_size rows.
            held = [zlib.crc32(r["prompt"].encode()) % 10 == 0 for r in rows]
            eval_rows = [r for r, h in zip(rows, held, strict=True) if h][:eval_size]
            train_rows = [r for r, h in zip(rows, held, strict=True) if not h] or rows
        self._train = [self._prompt(r) for r in train_rows]
        self._eval = [self._prompt(r) for r in eval_rows] or self._train[: min(eval_size, len(self._train))]
        self._demos = [(self._prompt(r), str(r["response"])) for r in train_rows if r.get("response")]

    @staticmethod
    def _prompt(row: dict) -> Prompt:
        answer = row.get("answer")
        return Prompt(row["prompt"], None if answer is None else str(answer), {})

    def configure_calls(self, timeout_s: float, workers: int, batch: bool | None) -> None:
        """Apply ``reward.timeout_s``, ``reward.workers`` and ``reward.batch`` to the user's functions."""
        for fn in (self._fn, self._cost_fn):
            if fn is not None:
                fn.configure(timeout_s, workers, batch)

    def close(self) -> None:
        """Stop the reward functions' process pools, if any."""
        for fn in (self._fn, self._cost_fn):
            if fn is not None:
                fn.close()

    def reward(self, prompt: Prompt, response: str) -> float:
        """The user's reward function's value for ``(prompt, response)``, checked as ``score`` checks it; NaN when
        the task has no reward function (a reward model then gives the whole reward)."""
        return self.score(prompt, response)

    def score(self, prompt: Prompt, response: str) -> float:
        return self.score_many([prompt], [response])[0]

    def score_many(self, prompts: list[Prompt], responses: list[str]) -> list[float]:
        if self._fn is None:
            return [float("nan")] * len(prompts)  # no rule to judge by: the reward model is the only reward
        return self._fn([p.text for p in prompts], list(responses), [p.answer for p in prompts])

    def cost(self, prompt: Prompt, response: str) -> float:
        return self.cost_many([prompt], [response])[0]

    def checked_cost(self, prompt: Prompt, response: str) -> float:
        return self.cost(prompt, response)

    def cost_many(self, prompts: list[Prompt], responses: list[str]) -> list[float]:
        if self._cost_fn is None:
            return super().cost_many(prompts, responses)
        return self._cost_fn([p.text for p in prompts], list(responses), [p.answer for p in prompts])

    def demonstrations(self) -> list[tuple[Prompt, str]]:
        return self._demos
