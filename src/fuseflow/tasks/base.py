"""The task contract: prompts, a verifiable reward and SFT demonstrations."""

from __future__ import annotations

import math
import random
from abc import ABC, abstractmethod
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Prompt:
    """One prompt of a task.

    text:   the prompt string fed to the model (the response continues it directly)
    answer: the reference answer the reward checks against, when the task has one
    meta:   task-specific extras (e.g. the operands), passed to the reward function
    """

    text: str
    answer: str | None = None
    meta: dict = field(default_factory=dict)


class Task(ABC):
    """A source of train/held-out prompts, a reward function and SFT demonstrations.

    Held-out prompts never appear among the training prompts, so held-out accuracy
    measures generalisation rather than memorisation.
    """

    name: str = "task"
    success_threshold: float = 1.0  # reward at or above this counts as a correct response
    has_cost: bool = False  # True when the task defines ``cost`` (a constraint signal for safe_ppo)
    # False for a user-data task given no reward function: a learned reward model (reward.model)
    # then supplies the whole reward, and ``score`` is NaN (nothing to log or to count as correct).
    has_reward: bool = True
    # Each subclass fills both lists in its __init__; they never share a prompt.
    _train: list[Prompt]
    _eval: list[Prompt]

    def train_prompts(self) -> list[Prompt]:
        """The prompts RL and SFT train on."""
        return self._train

    def eval_prompts(self) -> list[Prompt]:
        """The held-out prompts, disjoint from ``train_prompts``."""
        return self._eval

    @abstractmethod
    def reward(self, prompt: Prompt, response: str) -> float:
        """The reward of ``response`` to ``prompt``, usually in [0, 1] (``success_threshold`` marks correct).

        A subclass defines it; callers use ``score``, which checks the value and names the task on an error."""

    def demonstrations(self) -> list[tuple[Prompt, str]]:
        """(prompt, response) pairs for the SFT warm start; empty if the task has none."""
        return []

    def score(self, prompt: Prompt, response: str) -> float:
        """The reward, checked: an exception names the task, a non-finite value becomes NaN."""
        return self._checked(self.reward, "reward", prompt, response)

    def score_many(self, prompts: list[Prompt], responses: list[str]) -> list[float]:
        """``score`` of each pair; a task whose reward is user code overrides it to batch the calls."""
        return [self.score(p, r) for p, r in zip(prompts, responses, strict=True)]

    def cost_many(self, prompts: list[Prompt], responses: list[str]) -> list[float]:
        """``checked_cost`` of each pair (see ``score_many``)."""
        return [self.checked_cost(p, r) for p, r in zip(prompts, responses, strict=True)]

    def cost(self, prompt: Prompt, response: str) -> float:
        """A constraint signal next to the reward (lower is safer); tasks with ``has_cost`` override it."""
        raise NotImplementedError(f"task {self.name!r} defines no cost; safe_ppo needs a task with one")

    def checked_cost(self, prompt: Prompt, response: str) -> float:
        """The cost, checked like ``score``: an exception names the task, a non-finite value becomes NaN."""
        return self._checked(self.cost, "cost", prompt, response)

    def _checked(self, fn, what: str, prompt: Prompt, response: str) -> float:
        # Reward and cost functions may be user code: one failing call must say whose function it was.
        try:
            value = float(fn(prompt, response))
        except Exception as exc:  # noqa: BLE001 - user code; re-raised with context
            raise RewardError(f"{what} function of task {self.name!r} raised {type(exc).__name__}: {exc}") from exc
        return value if math.isfinite(value) else float("nan")

    def is_correct(self, prompt: Prompt, response: str) -> bool:
        """Whether the checked reward (``score``) is finite and reaches ``success_threshold``: held-out accuracy."""
        value = self.score(prompt, response)
        return math.isfinite(value) and value >= self.success_threshold


class GeneratedTask(Task):
    """A built-in task whose prompts come from a seeded generator, split into train and held-out.

    Subclasses set their own attributes, call ``super().__init__(seed, train_size,
    eval_size)`` and define ``draw``. Each split gets its own seeded stream, so the
    prompts depend only on the seed and the sizes.
    """

    def __init__(self, seed: int, train_size: int, eval_size: int):
        self.seed = seed
        self._train = self._make(train_size, held_out=False, salt=0)
        self._eval = self._make(eval_size, held_out=True, salt=1)

    @abstractmethod
    def draw(self, rng: random.Random) -> tuple[Prompt, bool | None]:
        """One random prompt and its split: True held-out, False train, None both (too few to split)."""

    def _make(self, n: int, held_out: bool, salt: int) -> list[Prompt]:
        rng = random.Random(self.seed * 1000 + salt)
        out: list[Prompt] = []
        while len(out) < n:
            prompt, split = self.draw(rng)
            if split is None or split == held_out:
                out.append(prompt)
        return out


class RewardError(RuntimeError):
    """The user's reward function raised; the message names the task and the error."""
