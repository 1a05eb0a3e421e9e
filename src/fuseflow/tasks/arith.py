"""Multi-digit addition with an exact-answer reward.

Operands are zero-padded to ``max_digits`` and the sum to ``max_digits + 1`` digits,
so every digit sits at a fixed column: ``"047+385="`` -> ``"0432"``. The SFT
demonstrations come from two annotators: a careful one, and a careless one who adds
column by column but ignores carries (``047+385`` -> ``0322``), as people do when
rushing. ``demo_error_rate`` is the careless annotator's share. Imitation learns the
mixture; the exact-answer reward is what tells RL which annotator was right.
"""

from __future__ import annotations

import random
import zlib

from .base import GeneratedTask, Prompt


def carryless_sum(a: int, b: int) -> int:
    """Column-wise sum modulo 10, i.e. addition with every carry dropped."""
    out, place = 0, 1
    while a or b:
        out += ((a % 10 + b % 10) % 10) * place
        a, b, place = a // 10, b // 10, place * 10
    return out


def _held_out(a: int, b: int) -> bool:
    # A fixed hash of the problem decides the split, so train and held-out never share one.
    # (crc32, not arithmetic on a and b, which would correlate the split with carries.)
    return zlib.crc32(f"{a}+{b}".encode()) % 10 == 0


class ArithTask(GeneratedTask):
    name = "arith"

    def __init__(self, seed: int = 1234, train_size: int = 20000, eval_size: int = 500,
                 max_digits: int = 3, demo_error_rate: float = 0.6):
        self.max_digits, self.demo_error_rate = max_digits, demo_error_rate
        super().__init__(seed, train_size, eval_size)

    def _operand(self, rng: random.Random) -> int:
        digits = rng.randint(1, self.max_digits)
        return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)

    def draw(self, rng: random.Random) -> tuple[Prompt, bool]:
        a, b = self._operand(rng), self._operand(rng)
        return Prompt(self.question(a, b), self.answer(a + b), {"a": a, "b": b}), _held_out(a, b)

    def question(self, a: int, b: int) -> str:
        """The prompt for ``a + b``, both operands zero-padded to ``max_digits``."""
        return f"{a:0{self.max_digits}d}+{b:0{self.max_digits}d}="

    def answer(self, total: int) -> str:
        """The expected response: the sum zero-padded to ``max_digits + 1`` digits."""
        return f"{total:0{self.max_digits + 1}d}"

    def reward(self, prompt: Prompt, response: str) -> float:
        """1.0 when the stripped response is exactly the zero-padded sum, else 0.0."""
        return 1.0 if response.strip() == prompt.answer else 0.0

    def demonstrations(self) -> list[tuple[Prompt, str]]:
        rng = random.Random(self.seed * 1000 + 2)
        demos = []
        for p in self._train:
            careless = rng.random() < self.demo_error_rate
            a, b = p.meta["a"], p.meta["b"]
            demos.append((p, self.answer(carryless_sum(a, b) if careless else a + b)))
        return demos


class SafeArithTask(ArithTask):
    """Addition where an answer containing ``forbidden_digit`` is "unsafe" and costs 1.

    The reward is unchanged (exact answer), so about a quarter of the correct answers
    (those whose sum contains the digit) earn reward 1 *and* cost 1: the helpful answer
    and the safe one disagree, as in Safe-RLHF. An unconstrained policy keeps the
    imitation's cost rate; a cost limit below it binds, and the policy must give up
    reward on those prompts (answer without the digit) to meet it.
    """

    name = "safe_arith"
    has_cost = True

    def __init__(self, seed: int = 1234, train_size: int = 20000, eval_size: int = 500,
                 max_digits: int = 3, demo_error_rate: float = 0.6, forbidden_digit: int = 7):
        super().__init__(seed, train_size, eval_size, max_digits, demo_error_rate)
        self.forbidden = str(forbidden_digit)

    def cost(self, prompt: Prompt, response: str) -> float:
        return 1.0 if self.forbidden in response else 0.0
