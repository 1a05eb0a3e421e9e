"""``fuseflow bench scoring``: a recorded step's scoring calls, replayed with the prompt cache on and off."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from fuseflow.bench.scoring import run_scoring_bench
from fuseflow.cli import app


def test_quick_replay_records_the_steps_calls_and_counts_both_arms(sft_cache):
    r = run_scoring_bench("sort", "fused", step=2, repeats=2, quick=True, overrides=[f"cache_dir={sft_cache}"],
                          log=lambda *_: None)
    # PPO scores every sample three times (critic values, reference and old log-probs): each call is one
    # of them over some of the step's 16 samples.
    assert r["calls"] >= 3 and sum(r["samples_per_call"]) == 3 * 16
    assert len(r["time_ratio_pairs"]) == 1 and r["time_ratio_cache_vs_none"] > 0
    assert all(len(r[arm]["seconds_runs"]) == 1 and r[arm]["seconds_median"] > 0 for arm in ("cache", "no_cache"))
    # The cache never runs more tokens: a prompt runs at most once per worker.
    assert 0 < r["cache"]["tokens"] <= r["no_cache"]["tokens"]
    assert r["tokens_ratio_cache_vs_none"] == r["cache"]["tokens"] / r["no_cache"]["tokens"]
    json.dumps(r)


def test_bad_input_is_one_line_with_exit_2():
    runner = CliRunner()
    res = runner.invoke(app, ["bench", "scoring", "--repeats", "3"])
    assert res.exit_code == 2 and "even number" in res.output
    res = runner.invoke(app, ["bench", "scoring", "--preset", "nope"])
    assert res.exit_code == 2 and "--preset must be sort or smollm" in res.output
