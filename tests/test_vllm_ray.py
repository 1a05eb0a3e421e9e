"""rollout.backend=vllm inside the Ray rollout replicas: each replica process runs vLLM's engine.

The same 2-slot local Ray cluster as tests/test_ray_rollout.py; every test is marked `vllm` (CI
deselects them; `make test-vllm` runs them). A run starts vLLM in both replica processes (10-40 s
each on this machine), so each test is one short run.
"""

from __future__ import annotations

import os
import signal
from functools import partial

import pytest
import torch

from fuseflow.rollout.base import RolloutRequest, SamplingParams
from ray_fixtures import ray_cluster  # noqa: F401 - module-scoped fixture
from test_ray_rollout import REPLICAS, _run, run_with_replica_killed

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("ray_cluster")]
VLLM = ["rollout.backend=vllm", "ray.start_timeout_s=600"]  # vLLM's start-up under load


def _stream(handle, requests) -> dict:
    """Samples of a replica's streams (decoded by its vLLM engine), by uid: one stream per request, so a
    replica that holds its tail (``ray_hooks.held_tail``) never waits for a migration that no one makes."""
    import ray

    return {s.uid: s for r in requests for ref in handle.stream.remote([r]) for s in ray.get(ref)}


def _max_diff(model, samples: dict, temperature: float) -> float:
    """Largest gap between the samples' behaviour log-probs and ``model``'s (the trainer's computation)."""
    out = 0.0
    for s in samples.values():
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(s.prompt_ids) - 1:-1].float() / temperature
        ref = logits.log_softmax(-1).gather(-1, ids[0, len(s.prompt_ids):, None]).squeeze(-1)
        out = max(out, float((ref - torch.tensor(s.logprobs)).abs().max()))
    return out


def test_fused_vllm_replicas_train_and_follow_each_weight_sync(tmp_path, sft_cache, monkeypatch):
    pytest.importorskip("vllm")
    import fuseflow.trainer
    from fuseflow.models import CausalLM
    from ray_hooks import held_tail

    # Each replica holds its tail until the controller migrates (as in test_ray_rollout's fused test), so
    # migration happens whatever the machine's load; without it a replica could finish its share first.
    monkeypatch.setattr(fuseflow.trainer, "build_rollout_engine",
                        partial(held_tail, fuseflow.trainer.build_rollout_engine))

    seen: dict = {}

    def after(tr):
        """After step 2's update the replicas still hold version 1: vLLM's log-probs are off the
        trainer's new weights until a sync, and within 1e-4 of them after it."""
        seen["backends"] = [i["backend"] for i in tr.replicas._info()]
        seen["pids"] = set(tr.replicas.pids)
        model = CausalLM.from_pretrained(tr.run_dir / "reference").eval()
        model.load_state_dict(tr.actor.rollout_weights(), strict=False)  # the trainer's weights after step 2
        t = tr.cfg.rollout.temperature
        reqs = [RolloutRequest(100 + i, list(tr.train_ids[i]), SamplingParams(temperature=t, max_new_tokens=8,
                                                                             seed=i)) for i in range(4)]
        handle = tr.replicas.handles[1]
        old = _stream(handle, reqs)
        tr.strategy.pool.set_weights(2)
        new = _stream(handle, reqs)
        seen["old"], seen["new"] = _max_diff(model, old, t), _max_diff(model, new, t)
        seen["versions"] = ({s.policy_version for s in old.values()}, {s.policy_version for s in new.values()})
        seen["sync"] = dict(tr.strategy.pool.sync_metrics)

    batches, metrics = _run(tmp_path, sft_cache, [*VLLM, "schedule.mode=fused", *REPLICAS,
                                                  "schedule.migration_threshold=0.9", "schedule.token_budget=256"],
                            after=after)
    assert seen["backends"] == ["VLLMBackend", "VLLMBackend"] and len(seen["pids"]) == 2
    for batch, m in zip(batches, metrics, strict=True):  # every sample arrives, once
        assert len(batch) == 16 and sorted(set(batch.meta["uid"])) == sorted(batch.meta["uid"])
        assert torch.isfinite(torch.tensor(m["actor/pg_loss"]))
    assert [set(b.meta["policy_version"]) for b in batches] == [{0}, {1}]
    # Step 2 was decoded by vLLM after step 1's sync: its behaviour log-probs are the trainer's old ones.
    assert metrics[1]["rollout/logprob_diff_max"] < 1e-4
    assert metrics[1]["rollout/weight_sync_mb"] > 0 and metrics[1]["rollout/vllm_push_s_per_mb"] > 0
    assert seen["versions"] == ({1}, {2})
    assert seen["old"] > 1e-3, seen  # the trainer moved on: a replica without the sync would be caught
    assert seen["new"] < 1e-4, seen  # the sync reached vLLM (full state dict, tied head included)
    assert seen["sync"]["rollout/vllm_push_buckets"] >= 1 and seen["sync"]["rollout/weight_sync_s_per_mb"] > 0
    assert sum(m["schedule/migrated_samples"] for m in metrics) > 0  # aborted on one vLLM, re-prefilled on the other


def test_a_killed_vllm_replica_ends_the_run_with_one_line(tmp_path, sft_cache, monkeypatch):
    pytest.importorskip("vllm")
    # SIGKILL to the process with vLLM's engine in it, mid-generation of step 2.
    run_with_replica_killed(tmp_path, sft_cache, monkeypatch, VLLM,
                            lambda pool: os.kill(pool.replicas.pids[1], signal.SIGKILL))


@pytest.mark.parametrize("mode", ["fused+async", "elastic"])
def test_async_and_elastic_vllm_replicas_train(tmp_path, sft_cache, mode):
    pytest.importorskip("vllm")
    batches, metrics = _run(tmp_path, sft_cache, [*VLLM, f"schedule.mode={mode}",
                                                  *REPLICAS], steps=3)
    for step, (batch, m) in enumerate(zip(batches, metrics, strict=True), start=1):
        assert len(batch) == 16 and sorted(set(batch.meta["uid"])) == sorted(batch.meta["uid"])
        ages = {(step - 1) - v for v in batch.meta["policy_version"]}
        if mode == "elastic":  # on-policy: decoded after the previous step's sync
            assert ages == {0} and m["rollout/logprob_diff_max"] < 1e-4, (step, ages)
            assert 0 < m["time/rollout_worker_seconds"] <= 2 * m["time/step_seconds"]
        else:  # decoded on the replicas during the previous step's training, with the weights synced before it
            assert ages == ({0} if step == 1 else {1}), (step, ages)
    assert all(m["rollout/vllm_push_s_per_mb"] > 0 for m in metrics[1:])
