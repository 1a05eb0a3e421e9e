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

from .base import Prompt, Task


def long_tail_length(rng: random.Random, max_items: int) -> int:
    return max(1, min(max_items, round(math.exp(rng.gauss(math.log(3.0), 0.9)))))


class SortTask(Task):
    name = "sort"

    def __init__(self, seed: int = 1234, train_size: int = 20000, eval_size: int = 500, max_items: int = 32):
        self.seed, self.max_items = seed, max_items
        self._train = self._make(train_size, held_out=False, salt=0)
        self._eval = self._make(eval_size, held_out=True, salt=1)

    def _make(self, n: int, held_out: bool, salt: int) -> list[Prompt]:
        rng = random.Random(self.seed * 1000 + salt)
        out: list[Prompt] = []
        while len(out) < n:
            items = [rng.randint(0, 9) for _ in range(long_tail_length(rng, self.max_items))]
            text = ",".join(map(str, items))
            # Lists of 4+ items are split by a hash so no held-out list is trained on; shorter
            # lists are too few to split and appear in both (the tail is what generalises).
            if len(items) >= 4 and (hash_items(items) % 10 == 0) != held_out:
                continue
            out.append(Prompt(f"sort {text}:", ",".join(map(str, sorted(items))), {"items": items}))
        return out

    def reward(self, prompt: Prompt, response: str) -> float:
        want = prompt.answer.split(",")
        got = response.strip().split(",") if response.strip() else []
        hits = sum(1 for w, g in zip(want, got, strict=False) if w == g)
        return hits / max(len(want), len(got))

    def demonstrations(self) -> list[tuple[Prompt, str]]:
        return [(p, p.answer) for p in self._train]


def hash_items(items: list[int]) -> int:
    h = 0
    for x in items:
        h = (h * 31 + x + 1) % 1_000_003
    return h
