"""Response-length prediction and length-aware assignment of prompts to rollout replicas (RLHFless).

A prompt's responses have similar lengths from one epoch to the next, so the lengths a prompt
got before predict what it gets now (``LengthPredictor``). Groups of samples of one prompt are
then dealt to replicas longest first in contiguous chunks (``assign_by_length``): replicas that
hold only short samples finish early and can be released, and a group stays on one replica so
its shared prompt prefix is prefilled once there.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Sequence


class LengthPredictor:
    """Per-prompt response length from the prompt's earlier observations, with a fallback.

    ``observe(keys, lengths)`` records one step: the mean response length of each prompt (key)
    seen in it. ``predict(keys)`` gives each prompt the mean of its last ``window``
    observations; a prompt never seen gets the mean length of the most recent step observed,
    or ``default`` before any step.

    >>> p = LengthPredictor(window=2, default=8.0)
    >>> p.predict(["a"])
    [8.0]
    >>> p.observe(["a", "a", "b"], [4, 6, 10]); p.observe(["a"], [9])
    >>> p.predict(["a", "b", "c"])
    [7.0, 10.0, 9.0]
    """

    def __init__(self, window: int, default: float):
        if window < 1:
            raise ValueError(f"length predictor window must be >= 1 (earlier observations per prompt), got {window}")
        self.window, self.default = window, float(default)
        self.history: dict[Hashable, deque[float]] = {}
        self.last_mean: float | None = None

    def observe(self, keys: Sequence[Hashable], lengths: Sequence[float]) -> None:
        """Record one step's response lengths (one per sample, keyed by its prompt)."""
        if len(keys) != len(lengths):
            raise ValueError(f"{len(keys)} keys for {len(lengths)} lengths")
        if not keys:
            return
        per: dict[Hashable, list[float]] = {}
        for k, n in zip(keys, lengths, strict=True):
            per.setdefault(k, []).append(float(n))
        for k, ns in per.items():
            self.history.setdefault(k, deque(maxlen=self.window)).append(sum(ns) / len(ns))
        self.last_mean = sum(map(float, lengths)) / len(lengths)

    def predict(self, keys: Sequence[Hashable]) -> list[float]:
        """Predicted response length per key."""
        fallback = self.default if self.last_mean is None else self.last_mean
        return [sum(h) / len(h) if (h := self.history.get(k)) else fallback for k in keys]


def assign_by_length(predicted: Sequence[float], groups: Sequence[int], replicas: int) -> list[list[int]]:
    """Indices of items per replica: groups longest first, in contiguous chunks of about equal predicted tokens.

    ``predicted[i]`` is item i's predicted length and ``groups[i]`` its group (items of one group,
    e.g. the samples of one prompt, stay together). Groups are ordered by their longest
    prediction (ties: first appearance) and cut into ``replicas`` consecutive chunks, each
    closed once it holds its share of the total predicted tokens. Replicas with the short
    groups finish first and can be released; the long groups share the last replicas, where on
    memory-bound decode they cost little more together than apart. A replica may get nothing
    when there are fewer groups than replicas.

    >>> assign_by_length([1, 1, 9, 9, 5, 5], [0, 0, 1, 1, 2, 2], 2)
    [[2, 3], [4, 5, 0, 1]]
    """
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    if len(predicted) != len(groups):
        raise ValueError(f"{len(predicted)} predictions for {len(groups)} group ids")
    members: dict[int, list[int]] = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    order = sorted(members.values(), key=lambda idx: -max(predicted[i] for i in idx))  # stable: ties keep order
    total = sum(max(float(p), 1.0) for p in predicted)
    out: list[list[int]] = [[] for _ in range(replicas)]
    r, filled = 0, 0.0
    for idx in order:
        if r < replicas - 1 and out[r] and filled >= (r + 1) * total / replicas:
            r += 1
        out[r].extend(idx)
        filled += sum(max(float(predicted[i]), 1.0) for i in idx)
    return out
