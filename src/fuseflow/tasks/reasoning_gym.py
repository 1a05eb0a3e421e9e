"""Tasks from reasoning-gym: procedural generators of problems with verifiable answers.

``task.name=reasoning_gym task.dataset=basic_arithmetic task.config={min_digits: 2, max_digits: 2}``
draws prompts from ``reasoning_gym.create_dataset(dataset, seed=..., size=..., **config)``; the
config (difficulty, operators, ...) goes to the dataset unchanged, which checks it.

Held-out and train prompts are disjoint. reasoning-gym makes item ``i`` of a dataset with
seed ``s`` from ``Random(s + i)``, so two seeds a few apart yield the same items shifted:
the held-out items use seeds ``S .. S+eval_size-1`` and the train items start at
``S + eval_size``, and any train question whose text equals a held-out one is dropped as well
(small problem spaces repeat questions under different seeds).

The reward is the dataset's own scorer (``score_answer``; some give partial credit), applied
to the text inside the last ``<answer>...</answer>`` when the response has one, else to the
whole stripped response. Since a chat model often answers in a sentence ("17 + 25 = 42"),
an exact-answer check is the fallback: the stripped response, or the last number in it,
equal to the reference answer scores 1. The reward is the larger of the two.
"""

from __future__ import annotations

import re
from typing import Any

from .base import Prompt, Task
from .user import DataError

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def last_number(text: str) -> str | None:
    """The last number written in ``text`` (thousands separators dropped), or None.

    >>> last_number("17 + 25 = 42."), last_number("about 1,234 apples"), last_number("none")
    ('42', '1234', None)
    """
    found = _NUMBER.findall(text.replace(",", ""))
    return found[-1] if found else None


def exact_answer(response: str, answer: str) -> float:
    """1.0 when the stripped response, or the last number in it, equals ``answer``; else 0.0."""
    r, a = response.strip(), answer.strip()
    if r == a:
        return 1.0
    return 1.0 if last_number(r) is not None and last_number(r) == a else 0.0


def _import_reasoning_gym():
    try:
        import reasoning_gym
    except ImportError:
        raise DataError("task.name=reasoning_gym needs the reasoning-gym package: pip install reasoning-gym "
                        "(or pip install 'fuseflow[real]')") from None
    return reasoning_gym


def make_dataset(name: str, config: dict[str, Any], seed: int, size: int):
    """``reasoning_gym.create_dataset`` with one-line errors for an unknown name or a rejected setting."""
    rg = _import_reasoning_gym()
    from reasoning_gym.factory import DATASETS

    if name not in DATASETS:
        known = sorted(DATASETS)
        picks = [n for n in ("basic_arithmetic", "chain_sum", "gsm_symbolic", "leg_counting", "word_sorting")
                 if n in DATASETS] or known[:5]
        raise DataError(f"task.dataset: reasoning-gym has no dataset {name!r}; it has {len(known)}, e.g. "
                        f"{', '.join(picks)}")
    reserved = {"seed", "size"} & config.keys()
    if reserved:
        raise DataError(f"task.config: {sorted(reserved)[0]} is set by fuseflow (task.seed, task.train_size, "
                        "task.eval_size); remove it from task.config")
    try:
        return rg.create_dataset(name, seed=seed, size=size, **config)
    except TypeError as exc:  # an unknown keyword of the dataset's config dataclass
        bad = re.search(r"unexpected keyword argument '([^']+)'", str(exc))
        what = f"{bad.group(1)!r} is not a setting of {name}" if bad else str(exc)
        raise DataError(f"task.config: {what}") from None
    except (AssertionError, ValueError) as exc:  # the dataset's own validation of the values
        raise DataError(f"task.config: {name} rejects {config}: {exc}") from None


class ReasoningGymTask(Task):
    """Train and held-out prompts from one reasoning-gym dataset, scored by its own ``score_answer``."""

    name = "reasoning_gym"

    def __init__(self, dataset: str, config: dict[str, Any] | None = None, seed: int = 1234,
                 train_size: int = 20000, eval_size: int = 500, instruction: str = ""):
        self.dataset_name, self.config, self.instruction = dataset, dict(config or {}), instruction
        eval_ds = make_dataset(dataset, self.config, seed, eval_size)
        self._eval = [self._prompt(e) for e in eval_ds]
        held = {p.text for p in self._eval}
        # Seeds from seed + eval_size on never reproduce a held-out item; the text check catches equal
        # questions drawn from different seeds. Draw extra items to make up for the dropped ones.
        self._train: list[Prompt] = []
        start, tries = seed + eval_size, 0
        while len(self._train) < train_size and tries < 4:
            want = train_size - len(self._train)
            ds = make_dataset(dataset, self.config, start, want + want // 4 + 8)
            for e in ds:
                text = self._text(e)
                if text not in held and len(self._train) < train_size:
                    self._train.append(self._prompt(e))
            start, tries = start + len(ds), tries + 1
        if not self._train:
            raise DataError(f"task.dataset={dataset}: every generated question is also a held-out one; widen "
                            "task.config or lower task.eval_size")
        self._scorer = eval_ds  # score_answer depends on the dataset class, not on its seed

    def _text(self, entry: dict) -> str:
        return f"{entry['question']}{self.instruction}"

    def _prompt(self, entry: dict) -> Prompt:
        # The whole item rides along: the dataset's scorer may read its metadata, not only the answer.
        return Prompt(self._text(entry), str(entry["answer"]), {"entry": entry})

    def reward(self, prompt: Prompt, response: str) -> float:
        """reasoning-gym's own score of the answer (the ``<answer>`` tag's content when there is one, else the
        stripped response), or 1.0 when the stripped response or the last number in it equals the reference answer,
        whichever is higher."""
        from reasoning_gym.utils import extract_answer

        entry = prompt.meta["entry"]
        tagged = extract_answer(response)
        scored = self._scorer.score_answer(tagged if tagged is not None else response.strip(), entry)
        return max(float(scored or 0.0), exact_answer(response, prompt.answer))
