"""The calibration's replay of the local runtime's strategies, against hand-composed timelines."""

from __future__ import annotations

import json

import pytest
import yaml

from fuseflow.sim.calibrate import load_run, predict_step, step_shapes
from fuseflow.sim.hardware import get_hardware
from fuseflow.sim.runtime import RuntimeMode, rollout_phase, step_seconds

HALF = lambda rows, names: 0.5 * len(rows) * len(names)  # noqa: E731  seconds per row per stage


def test_streamed_micro_batches_start_before_the_last_sample():
    # One worker plus the controller as helper; one row per micro-batch (budget 4, rows of 4 tokens).
    # Streamed: row 0 closes at t=1 and runs on the helper (1-1.5); row 1 closes at t=5 (5-5.5);
    # row 2 is flushed at t=5 to the worker, free at 5 (5-5.5): 5.5. After the last sample: three
    # rows from t=5 on two consumers: 5-5.5, 5-5.5, 5.5-6.
    finishes = [[(0, 1.0), (1, 1.0), (2, 5.0)]]
    width = [4, 4, 4]
    fused = rollout_phase(finishes, width, 4, HALF, ("reference",), ("reference",), helper=True)
    after = rollout_phase(finishes, width, 4, HALF, (), ("reference",), helper=True)
    assert fused == pytest.approx(5.5)
    assert after == pytest.approx(6.0)


def test_partial_micro_batch_goes_to_an_idle_worker():
    # Two workers; worker 1 is done at t=1 and nothing is queued, so rows 0 and 1 go to it as they
    # arrive instead of waiting for the budget (12 tokens = 3 rows): 1-1.5, 2-2.5; row 2 (t=4) runs 4-4.5.
    finishes = [[(2, 4.0)], [(0, 1.0), (1, 2.0)]]
    assert rollout_phase(finishes, [4, 4, 4], 12, HALF, ("x",), ("x",), helper=False) == pytest.approx(4.5)


def test_modes_compose_stages_as_their_strategies_run_them():
    priced = {"generate": 1.0, "reference": 0.5, "old_logprob": 0.5, "advantages": 0.1, "actor_update": 2.0,
              "weight_sync": 0.0}  # fmt: skip
    finishes, width = [[(0, 1.0)]], [4]
    seq = step_seconds(RuntimeMode("sequential", 1), priced, finishes, width, 4, HALF)
    assert seq == pytest.approx(4.1)
    # Async, staleness 1: old log-probs (0.5) then the longer of training (2.1) and the next step's
    # generation plus its reference (1.0 + 0.5).
    ahead = step_seconds(RuntimeMode("async", 1, 1), priced, finishes, width, 4, HALF)
    assert ahead == pytest.approx(0.5 + 2.1)
    # Staleness 0 runs nothing ahead: generation, both stages on one micro-batch (1.0), training.
    lock = step_seconds(RuntimeMode("async", 1, 0), priced, finishes, width, 4, HALF)
    assert lock == pytest.approx(1.0 + 1.0 + 2.1)
    # When generation is the longer side, async is bound by it.
    slow = step_seconds(RuntimeMode("async", 1, 1), priced, [[(0, 3.0)]], width, 4, HALF)
    assert slow == pytest.approx(0.5 + 3.5)


def _run_dir(tmp_path, mode: str, workers: int, tracks: dict[int, float]):
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({
        "model": {"size": "tiny"}, "algorithm": {"name": "grpo", "group_size": 4},
        "trainer": {"mini_batch_size": 16, "micro_batch_size": 8},
        "schedule": {"mode": mode, "rollout_workers": workers, "token_budget": 256},
        "rollout": {"backend": "engine"},
    }))  # fmt: skip
    cfg = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
           "intermediate_size": 64, "vocab_size": 40, "tie_word_embeddings": True}  # fmt: skip
    (tmp_path / "model_config.json").write_text(json.dumps(cfg))
    events = [{"name": "generate", "ph": "X", "ts": 0, "dur": d * 1e6, "pid": 0, "tid": tid, "args": {"step": 1}}
              for tid, d in tracks.items()]  # fmt: skip
    events += [{"name": "inference", "ph": "X", "ts": 0, "dur": 2e5, "pid": 0, "tid": tid, "args": {"step": 1}}
               for tid in tracks]  # fmt: skip
    (tmp_path / "trace.json").write_text(json.dumps({"traceEvents": events}))
    (tmp_path / "metrics.jsonl").write_text(json.dumps({
        "step": 1, "time/step_seconds": 1.0, "rollout/num_samples": 16, "rollout/prompt_length_mean": 8.0,
        "rollout/response_length_mean": 5.0, "rollout/response_length_max": 9}) + "\n")  # fmt: skip
    return tmp_path


def test_pooled_run_reads_workers_shards_and_per_track_stages(tmp_path):
    run = load_run(_run_dir(tmp_path, "fused", 2, {1: 0.3, 2: 0.5}))
    rec = run.steps[0]
    # Workers decode side by side: the step's generate is the longest track; inference boxes add up.
    assert rec.stages["generate"] == pytest.approx(0.5)
    assert rec.stages["inference"] == pytest.approx(0.4)
    shapes = step_shapes(run, rec)
    # 16 samples in groups of 4 over 2 workers: whole groups, 8 each.
    assert [len(s) for s in shapes.shards] == [8, 8]
    assert set(shapes.shards[0]) == set(range(8))
    hw = get_hardware("cpu")
    fused = predict_step(run, shapes, hw)
    run.mode = RuntimeMode("sequential", 1)
    seq_shapes = step_shapes(run, rec)
    assert len(seq_shapes.shards) == 1
    # Two workers decode half the batch each and stream inference: never slower than one worker's sum.
    assert fused < predict_step(run, seq_shapes, hw)


def test_pipelined_generation_is_the_layout_that_fits_when_a_replica_does_not():
    from dataclasses import replace

    from fuseflow.sim.generation import Seq, generation_layouts
    from fuseflow.sim.modelspec import get_model

    model = get_model("qwen2.5-3b")  # 12.3 GB of fp32 weights on the cpu spec
    seqs = [Seq(i, 32, 16) for i in range(32)]
    roomy = generation_layouts(model, get_hardware("cpu"), 2, seqs, 16)  # 16 GB devices: both fit
    assert roomy["tp1.pp1 x2"]["fits"] and roomy["tp1.pp2 x1"]["fits"]
    # Memory-bound decode reads the weights once per round either way: pipelining is no faster here.
    assert roomy["tp1.pp2 x1"]["seconds"] >= roomy["tp1.pp1 x2"]["seconds"] * 0.99
    small = replace(get_hardware("cpu"), mem_capacity=10e9)  # 8 GB usable: half the weights fit, not all
    tight = generation_layouts(model, small, 2, seqs, 16)
    assert not tight["tp1.pp1 x2"]["fits"] and tight["tp1.pp1 x2"]["seconds"] is None
    assert tight["tp1.pp2 x1"]["fits"] and tight["tp1.pp2 x1"]["seconds"] > 0
