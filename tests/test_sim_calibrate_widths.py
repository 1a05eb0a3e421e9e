"""`trimmed_widths` prices each row at the width the real workers compute it at.

The reference is the workers' own path: a batch packed by `samples_to_batch`, inference
micro-batches through `sorted_inference` and training micro-batches through
`train_microbatches`, reading off the width of the trimmed tensors each row lands in.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from fuseflow.rollout.base import Sample
from fuseflow.sim.calibrate import trimmed_widths
from fuseflow.workers.common import samples_to_batch, sorted_inference, train_microbatches

NOT_DISTRIBUTED = SimpleNamespace(dist=SimpleNamespace(distributed=False), sharded=False)


def real_batch(prompt: list[int], response: list[int]):
    samples = [Sample(i, i, [5] * p, [7] * r, [0.0] * r, "stop") for i, (p, r) in enumerate(zip(prompt, response, strict=True))]
    return samples_to_batch(samples, pad_id=0, prompts=[""] * len(samples), responses=[""] * len(samples))


def worker_inference_widths(batch, budget: int) -> list[float]:
    # Each micro-batch reports its own trimmed width in every row; scatter puts rows back in order.
    def width(mb):
        return torch.full((len(mb), 1), float(mb["attention_mask"].shape[1]))  # (n, 1)

    return sorted_inference(batch, budget, width, NOT_DISTRIBUTED)[:, 0].tolist()


def worker_train_widths(batch, budget: int, max_rows: int) -> list[float]:
    widths = [0.0] * len(batch)
    for mb in train_microbatches(NOT_DISTRIBUTED, batch, budget, max_rows):
        for uid in mb.meta["uid"]:
            widths[uid] = float(mb["attention_mask"].shape[1])
    return widths


def test_hand_case_matches_the_workers():
    # Shortest first: [2, 3, 3] fits at width 3 (3 x 3 = 9 <= 12), adding 6 would need 4 x 6 = 24.
    # The old longest-first grouping gave [6, 6, 3, 3].
    assert trimmed_widths(np.array([6, 3, 3, 2]), budget=12, max_rows=8).tolist() == [6, 3, 3, 3]
    assert worker_inference_widths(real_batch([0] * 4, [6, 3, 3, 2]), 12) == [6, 3, 3, 3]
    # One group [3, 4, 4, 10] (40 <= 100) cut into pieces of 2 rows: (3, 4) at 4, (4, 10) at 10.
    assert trimmed_widths(np.array([3, 4, 10, 4]), budget=100, max_rows=2).tolist() == [4, 4, 10, 10]


def test_prompt_and_response_are_padded_separately():
    # Rows (prompt, response) (1, 5) and (5, 1): 6 tokens each, but one group of both is 5 + 5 wide.
    assert trimmed_widths(np.array([6, 6]), budget=100, max_rows=8, prompt=np.array([1, 5])).tolist() == [10, 10]
    assert trimmed_widths(np.array([6, 6]), budget=19, max_rows=8, prompt=np.array([1, 5])).tolist() == [6, 6]


@pytest.mark.parametrize("seed", range(8))
def test_random_lengths_match_the_workers(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 40))
    prompt = rng.integers(1, 12, n)  # (N,)
    response = np.minimum(rng.lognormal(1.5, 0.9, n).astype(int) + 1, 60)  # (N,) long-tailed
    budget = int(rng.choice([16, 64, 200, 1000]))
    max_rows = int(rng.integers(1, 10))
    batch = real_batch(prompt.tolist(), response.tolist())
    total = prompt + response
    assert trimmed_widths(total, budget, n, prompt=prompt).tolist() == worker_inference_widths(batch, budget)
    assert trimmed_widths(total, budget, max_rows, prompt=prompt).tolist() == worker_train_widths(
        batch, budget, max_rows
    )


@pytest.mark.parametrize("kwargs,needle", [
    ({"budget": 0, "max_rows": 4}, "budget must be >= 1"),
    ({"budget": 10, "max_rows": 0}, "max_rows must be >= 1"),
    ({"budget": 10, "max_rows": 4, "prompt": np.array([9, 0])}, "row 0 has prompt 9 of 3 tokens"),
    ({"budget": 10, "max_rows": 4, "prompt": np.array([1])}, "one length per row"),
])  # fmt: skip
def test_bad_arguments_are_named(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        trimmed_widths(np.array([3, 4]), **kwargs)
