"""Workloads: how many samples an RL step makes and how long their prompts and responses are.

Response lengths of RL rollouts are long-tailed: most answers stop early and a few run
to the length cap (RLHFuse, Fig. 2; RLHFless, Sec. 2). The default is a log-normal
capped at `max_len`, whose log-variance is split between a per-prompt part (some
prompts are hard and all their samples run long) and a per-sample part. That split
is what makes lengths predictable from a prompt's history, as RLHFless exploits.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np


@dataclass(frozen=True)
class LengthDist:
    """A token-length distribution.

    kind="fixed": every length is `max_len`.
    kind="lognormal": median `median`, log-std `sigma`, clipped to [1, max_len].
    kind="uniform": uniform integers in [min_len, max_len].
    kind="trace": resampled from `values` (e.g. lengths measured on a real run).
    """

    kind: Literal["fixed", "lognormal", "uniform", "trace"] = "lognormal"
    max_len: int = 1024
    median: float = 256.0
    sigma: float = 0.8
    min_len: int = 1
    values: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_len < 1:
            raise ValueError(f"lengths.max_len={self.max_len}: must be >= 1")
        if self.kind == "lognormal" and (self.median <= 0 or self.sigma < 0):
            raise ValueError(f"lengths: lognormal needs median > 0 and sigma >= 0, got {self.median}, {self.sigma}")
        if self.kind == "trace" and not self.values:
            raise ValueError("lengths.kind=trace needs values (a non-empty list of token counts)")
        if self.kind == "uniform" and not 1 <= self.min_len <= self.max_len:
            raise ValueError(f"lengths.min_len={self.min_len}: must be in [1, max_len={self.max_len}]")

    @classmethod
    def from_file(cls, path: str | Path, max_len: int | None = None) -> LengthDist:
        """Lengths from a JSON list or a text file with one integer per line."""
        text = Path(path).read_text()
        vals = json.loads(text) if text.lstrip().startswith("[") else [int(x) for x in text.split()]
        vals = tuple(int(v) for v in vals if int(v) > 0)
        if not vals:
            raise ValueError(f"length trace {path}: no positive integers found")
        return cls(kind="trace", max_len=max_len or max(vals), values=vals)

    def sample(self, z_prompt: np.ndarray, z_sample: np.ndarray, rho: float, rng: np.random.Generator) -> np.ndarray:
        """Lengths for standard-normal draws split into a per-prompt and a per-sample part.

        log L = log median + sigma (sqrt(rho) z_prompt + sqrt(1 - rho) z_sample).
        Non-lognormal kinds map the same mixed normal through its quantile, so the
        per-prompt correlation carries over to them too.
        """
        z = np.sqrt(rho) * z_prompt + np.sqrt(1.0 - rho) * z_sample  # (N,)
        if self.kind == "fixed":
            out = np.full(z.shape, self.max_len, dtype=float)
        elif self.kind == "lognormal":
            out = self.median * np.exp(self.sigma * z)
        else:
            u = 0.5 * (1.0 + _erf(z / np.sqrt(2.0)))  # normal CDF -> uniform quantile
            if self.kind == "uniform":
                out = self.min_len + u * (self.max_len - self.min_len + 1)
            else:
                vals = np.sort(np.asarray(self.values, dtype=float))
                out = vals[np.minimum((u * len(vals)).astype(int), len(vals) - 1)]
        return np.clip(np.floor(out), self.min_len, self.max_len).astype(np.int64)


def _erf(x: np.ndarray) -> np.ndarray:
    # Abramowitz-Stegun 7.1.26 (|error| < 1.5e-7): numpy has no erf and this avoids scipy.
    sign = np.sign(x)
    x = np.abs(x)
    t = 1.0 / (1.0 + 0.3275911 * x)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    return sign * (1.0 - poly * np.exp(-x * x))


@dataclass(frozen=True)
class StepBatch:
    """The lengths of one RL step's samples, in prompt-group order.

    prompt_lens: (N,) prompt tokens per sample (equal within a group).
    response_lens: (N,) true response tokens per sample.
    predicted_lens: (N,) the prompt's responses of an earlier step, one per sample (the
        predictor's history: k responses per prompt, k = samples per prompt). Replaying
        the step on them keeps the spread of lengths, so the longest is not understated.
    predicted_key: (N,) their geometric mean over the group: the best guess of a sample's
        length, shared by the group, used to assign groups to workers.
    group: (N,) prompt index of each sample.
    """

    prompt_lens: np.ndarray
    response_lens: np.ndarray
    predicted_lens: np.ndarray
    group: np.ndarray
    predicted_key: np.ndarray

    @property
    def n(self) -> int:
        """Number of samples in the step."""
        return len(self.response_lens)

    @property
    def seq_lens(self) -> np.ndarray:
        """(N,) total tokens per sample: prompt plus response."""
        return self.prompt_lens + self.response_lens


@dataclass(frozen=True)
class Workload:
    """One RL step's shape: batch, lengths, algorithm and optimizer schedule.

    algorithm="ppo" trains a critic and (by default) scores with a reward model;
    "grpo" has no critic; `reward_model=False` means a rule-based (CPU) reward.
    `prompt_share` (rho) is the fraction of log-length variance that belongs to the prompt.
    `rollout_logprobs=True`: the actor's old log-probs come from the rollout's sampling
    pass, so inference runs only reference, critic and reward (RLHFuse's six-task
    workflow); False: the actor recomputes them with a forward pass (verl, fuseflow).
    """

    prompts: int = 512
    samples_per_prompt: int = 1
    prompt_len: LengthDist = field(default_factory=lambda: LengthDist("fixed", max_len=1024))
    response_len: LengthDist = field(default_factory=LengthDist)
    algorithm: Literal["ppo", "grpo"] = "ppo"
    reward_model: bool = True
    mini_batches: int = 4
    epochs: int = 1
    prompt_share: float = 0.5
    seed: int = 0
    rollout_logprobs: bool = False

    def __post_init__(self) -> None:
        if self.prompts < 1 or self.samples_per_prompt < 1:
            raise ValueError(f"workload: prompts={self.prompts} and samples_per_prompt must be >= 1")
        if self.algorithm not in ("ppo", "grpo"):
            raise ValueError(f"workload.algorithm={self.algorithm!r}: choose ppo or grpo")
        if not 0.0 <= self.prompt_share <= 1.0:
            raise ValueError(f"workload.prompt_share={self.prompt_share}: must be in [0, 1]")
        if self.mini_batches < 1 or self.epochs < 1:
            raise ValueError("workload.mini_batches and workload.epochs must be >= 1")

    @property
    def samples(self) -> int:
        """Samples per step: `prompts * samples_per_prompt`."""
        return self.prompts * self.samples_per_prompt

    @property
    def has_critic(self) -> bool:
        """Whether the algorithm trains a critic (PPO does, GRPO does not)."""
        return self.algorithm == "ppo"

    def step(self, index: int = 0) -> StepBatch:
        """Deterministic lengths for step `index` (same seed and index -> same batch)."""
        rng = np.random.default_rng([self.seed, index])
        k = self.samples_per_prompt
        z_prompt = np.repeat(rng.standard_normal(self.prompts), k)  # (N,)
        z_sample = rng.standard_normal(self.samples)  # (N,)
        # The predictor saw the k responses of an earlier step to the same prompt (RLHFless
        # predicts from a prompt's length history). Their geometric mean keeps the prompt's
        # part and averages the per-sample part (the log-mean of k draws has std 1/sqrt(k)).
        z_hist = rng.standard_normal((self.prompts, k))  # (P, k)
        z_history = z_hist.reshape(-1)  # (N,)
        z_key = np.repeat(z_hist.mean(axis=1), k)  # (N,)
        p_rng = np.random.default_rng([self.seed, index, 1])
        plen = np.repeat(self.prompt_len.sample(p_rng.standard_normal(self.prompts), np.zeros(self.prompts), 1.0,
                                                p_rng), k)  # fmt: skip
        rlen = self.response_len.sample(z_prompt, z_sample, self.prompt_share, rng)
        pred = self.response_len.sample(z_prompt, z_history, self.prompt_share, rng)
        key = self.response_len.sample(z_prompt, z_key, self.prompt_share, rng)
        group = np.repeat(np.arange(self.prompts), k)
        return StepBatch(plen, rlen, pred, group, key)
