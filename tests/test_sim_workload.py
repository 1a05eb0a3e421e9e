"""Workload length distributions: determinism, caps and per-prompt correlation."""

from __future__ import annotations

import numpy as np
import pytest

from fuseflow.sim.workload import LengthDist, Workload


def test_lengths_are_deterministic_and_capped():
    wl = Workload(prompts=200, samples_per_prompt=2, response_len=LengthDist("lognormal", max_len=300, median=100))
    a, b = wl.step(3), wl.step(3)
    assert np.array_equal(a.response_lens, b.response_lens) and a.n == 400
    assert a.response_lens.max() <= 300 and a.response_lens.min() >= 1
    assert not np.array_equal(a.response_lens, wl.step(4).response_lens)
    assert (a.prompt_lens[0::2] == a.prompt_lens[1::2]).all()  # one prompt per group


def test_fixed_and_trace_kinds(tmp_path):
    wl = Workload(prompts=5, response_len=LengthDist("fixed", max_len=77))
    assert (wl.step().response_lens == 77).all()
    path = tmp_path / "lens.txt"
    path.write_text("10\n20\n30\n")
    dist = LengthDist.from_file(path)
    wl = Workload(prompts=50, response_len=dist)
    assert set(wl.step().response_lens.tolist()) <= {10, 20, 30}


def test_prompt_share_makes_lengths_predictable():
    def corr(rho: float) -> float:
        b = Workload(prompts=2000, prompt_share=rho).step()
        return float(np.corrcoef(np.log(b.response_lens), np.log(b.predicted_lens))[0, 1])

    assert corr(0.0) < 0.1 and corr(0.9) > 0.8


def test_predictor_averages_the_groups_history():
    # rho = 0.5: one earlier response predicts log length with correlation 0.5; the geometric
    # mean of a group's 8 earlier responses (the assignment key) with 0.5 / sqrt(0.5 + 0.5 / 8)
    # = 0.67, while the per-sample history keeps the spread of lengths for the replay.
    def step(k: int):
        return Workload(prompts=4000 // k, samples_per_prompt=k, prompt_share=0.5, algorithm="grpo",
                        response_len=LengthDist("lognormal", max_len=10**9, median=300, sigma=0.8)).step()

    def corr(a, b) -> float:
        return float(np.corrcoef(np.log(a), np.log(b))[0, 1])

    b1, b8 = step(1), step(8)
    assert corr(b1.response_lens, b1.predicted_key) == pytest.approx(0.5, abs=0.05)
    assert corr(b8.response_lens, b8.predicted_key) == pytest.approx(0.67, abs=0.05)
    assert corr(b8.response_lens, b8.predicted_lens) == pytest.approx(0.5, abs=0.05)
    keys = b8.predicted_key.reshape(-1, 8)
    assert (keys == keys[:, :1]).all()  # one key per prompt
    assert np.log(b8.predicted_lens).std() == pytest.approx(np.log(b8.response_lens).std(), rel=0.05)
    assert np.log(b8.predicted_key).std() < 0.85 * np.log(b8.response_lens).std()


def test_bad_workloads_name_the_field():
    with pytest.raises(ValueError, match="prompt_share"):
        Workload(prompt_share=2.0)
    with pytest.raises(ValueError, match="algorithm"):
        Workload(algorithm="dpo")
    with pytest.raises(ValueError, match="trace"):
        LengthDist("trace")
