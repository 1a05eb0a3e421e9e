"""Sort a list of digits; list lengths are long-tailed.

Prompt ``"sort 3,1,2:"`` -> response ``"1,2,3"``. Reward is the fraction of
positions that hold the right digit (over the longer of the two lists), so partial
credit guides RL. Lengths follow a discretised log-normal (median 3 items, capped at
``max_items``): most responses are a few tokens and a few run 10x longer, the
long-tail generation workload that fusion and migration target.
"""

from __future__ import annotations

import math
import random

from .base import GeneratedTask, Prompt


def long_tail_length(rng: random.Random, max_items: int) -> int:
    """A list length in ``[1, max_items]``, log-normal around 3: most lists are short and a few long, so the
    responses have the long tail that migration and fusion are for."""
    return max(1, min(max_items, round(math.exp(rng.gauss(math.log(3.0), 0.9)))))


class SortTask(GeneratedTask):
    name = "sort"

    def __init__(self, seed: int = 1234, train_size: int = 20000, eval_size: int = 500, max_items: int = 32):
        self.max_items = max_items
        super().__init__(seed, train_size, eval_size)

    def draw(self, rng: random.Random) -> tuple[Prompt, bool | None]:
        items = [rng.randint(0, 9) for _ in range(long_tail_length(rng, self.max_items))]
        prompt = Prompt(f"sort {','.join(map(str, items))}:", ",".join(map(str, sorted(items))), {"items": items})
        # Lists of 4+ items are split by a hash so no held-out list is trained on; shorter
        # lists are too few to split and appear in both (the tail is what generalises).
        return prompt, (hash_items(items) % 10 == 0) if len(items) >= 4 else None

    def reward(self, prompt: Prompt, response: str) -> float:
        """The fraction of positions where the response's comma-separated items match the sorted list, over the
        longer of the two (so extra or missing items cost reward)."""
        want = prompt.answer.split(",")
        got = response.strip().split(",") if response.strip() else []
        hits = sum(1 for w, g in zip(want, got, strict=False) if w == g)
        return hits / max(len(want), len(got))

    def demonstrations(self) -> list[tuple[Prompt, str]]:
        return [(p, p.answer) for p in self._train]


def hash_items(items: list[int]) -> int:
    """A fixed polynomial hash of a list, the same on every machine and Python version. ``SortTask.draw`` holds out
    the lists of 4+ items whose hash is 0 mod 10 (about one in ten); shorter lists are in both splits."""
    h = 0
    for x in items:
        h = (h * 31 + x + 1) % 1_000_003
    return h
