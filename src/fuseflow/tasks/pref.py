"""A synthetic preference task for RLHF: responses judged by a hidden gold rule.

Prompt ``"gdab:"``: four distinct letters, all from one half of ``a..p`` (``a..h`` or
``i..p``), the prompt's *topic*. The response is a string of letters. A hidden gold
rule scores it:

    gold = (distinct letters of the topic's half it uses)
           - 0.5 * (characters outside that half) - 0.5 * (adjacent repeated characters)

so for ``"gdab:"`` (topic ``a..h``) ``"hbfa"`` scores 4 and ``"hhzq"`` scores
1 - 1 - 0.5 = -0.5; the maximum is 8 (all eight letters of the half, once each). The
SFT demonstrations are unjudged random strings over all 16 letters that ignore the
topic, so the SFT policy is diverse and mediocre (mean gold about 0.9). The RL trainer
is meant not to see this rule: `fuseflow train-rm` learns a reward model from pairs it
labels, and RL optimises that learned model (``reward.model``). The gold rule stays the
judge of held-out win rates, so over-optimising the learned model shows.
"""

from __future__ import annotations

import random
import zlib

from .base import GeneratedTask, Prompt

LETTERS = "abcdefghijklmnop"
HALVES = (LETTERS[:8], LETTERS[8:])
WORD_LEN = 4


def topic_letters(word: str) -> str:
    """The half of the alphabet a prompt word is drawn from."""
    return HALVES[0] if word[0] in HALVES[0] else HALVES[1]


def gold_score(word: str, response: str) -> float:
    """The hidden rule: topic letters covered, minus off-topic and doubled characters.

    >>> gold_score("gdab", "hbfa"), gold_score("gdab", "hhzq")
    (4.0, -0.5)
    """
    topic = topic_letters(word)
    covered = len(set(topic) & set(response))
    off_topic = sum(1 for c in response if c not in topic)
    repeats = sum(1 for a, b in zip(response[:-1], response[1:], strict=True) if a == b)
    return covered - 0.5 * off_topic - 0.5 * repeats


def sample_response(rng: random.Random, min_len: int = 2, max_len: int = 8) -> str:
    """One unjudged demonstration: uniform letters of ``a..p``, blind to the prompt."""
    return "".join(rng.choice(LETTERS) for _ in range(rng.randint(min_len, max_len)))


class PrefTask(GeneratedTask):
    name = "pref"
    success_threshold = 4.0  # e.g. four distinct topic letters and nothing else (the maximum is 8)

    def __init__(self, seed: int = 1234, train_size: int = 20000, eval_size: int = 500):
        super().__init__(seed, train_size, eval_size)

    def draw(self, rng: random.Random) -> tuple[Prompt, bool]:
        word = "".join(rng.sample(HALVES[rng.random() < 0.5], WORD_LEN))
        # A hash of the word decides the split, so no held-out prompt is trained on.
        return Prompt(f"{word}:", None, {"word": word}), zlib.crc32(word.encode()) % 10 == 0

    def reward(self, prompt: Prompt, response: str) -> float:
        """The gold rule's score of the stripped response for the prompt's word (``gold_score``)."""
        return gold_score(prompt.meta["word"], response.strip())

    def demonstrations(self) -> list[tuple[Prompt, str]]:
        rng = random.Random(self.seed * 1000 + 2)
        return [(p, sample_response(rng)) for p in self._train]

    def preference_pairs(self, n: int, held_out: bool, seed: int) -> list[dict]:
        """``n`` synthetic pairs {prompt, chosen, rejected}: two demonstrations, the gold rule picks.

        Ties are redrawn, so every pair carries a preference.
        """
        rng = random.Random(seed * 7919 + (1 if held_out else 0))
        prompts = self._eval if held_out else self._train
        pairs = []
        while len(pairs) < n:
            p = rng.choice(prompts)
            a, b = sample_response(rng), sample_response(rng)
            ga, gb = gold_score(p.meta["word"], a), gold_score(p.meta["word"], b)
            if ga != gb:
                pairs.append({"prompt": p.text, "chosen": a if ga > gb else b, "rejected": b if ga > gb else a})
        return pairs
