"""The engine against references: HF greedy generate, the training forward, the foundation sampler,
itself with sharing / caching / preemption / migration turned off, and the softmax (chi-square)."""

from __future__ import annotations

import math

import pytest
import torch

from fuseflow.models import CausalLM, ModelConfig
from fuseflow.rollout.base import RolloutRequest, SamplingParams
from fuseflow.rollout.engine import Engine, EngineConfig
from fuseflow.rollout.sampler import Sampler

V = 53


def _model(arch: str = "llama", seed: int = 0, **kw) -> CausalLM:
    # A wide init (0.2) spreads the logits, so float noise between implementations cannot flip an argmax.
    base = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2)
    return CausalLM.from_config(ModelConfig(architecture=arch, vocab_size=V, **{**base, **kw}), seed=seed).eval()


def _requests(n: int, seed: int = 0, greedy: bool = True, **params) -> list[RolloutRequest]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt = torch.randint(1, V, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist()
        max_new = int(torch.randint(1, 25, (1,), generator=g))
        out.append(RolloutRequest(i, prompt, SamplingParams(greedy=greedy, max_new_tokens=max_new, seed=100 + i,
                                                            **params)))
    return out


def _run(model, reqs, **cfg) -> dict[int, object]:
    return {s.uid: s for s in Engine(model, EngineConfig(**cfg)).generate(reqs)}


def _train_logprobs(model, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1] / temperature
    return logits.log_softmax(-1).gather(-1, torch.tensor(response)[:, None])[:, 0]


SMALL = dict(max_num_seqs=3, kv_budget_tokens=512, block_size=4, max_num_batched_tokens=24)


@pytest.mark.parametrize("arch,extra", [("llama", {}), ("qwen3", {"num_key_value_heads": 1, "head_dim": 8}),
                                        ("qwen2", {"tie_word_embeddings": True})])
def test_greedy_matches_transformers_generate(arch: str, extra: dict) -> None:
    from fuseflow.rollout.hf_backend import HFBackend

    model = _model(arch, **extra)
    reqs = _requests(10)  # 10 requests through 3 slots: slots are refilled mid-run
    ref = {s.uid: s.response_ids for s in HFBackend(model, pad_id=0, batch_size=4).generate(reqs)}
    got = _run(model, reqs, **SMALL)
    assert {u: s.response_ids for u, s in got.items()} == ref
    assert len({len(r.prompt_ids) for r in reqs}) > 5 and len({len(v) for v in ref.values()}) > 5


def test_logprobs_equal_the_training_forward() -> None:
    model = _model()
    reqs = _requests(8, greedy=False, temperature=0.7, top_k=20, top_p=0.9)
    for s in _run(model, reqs, **SMALL).values():
        want = _train_logprobs(model, s.prompt_ids, s.response_ids, 0.7)
        assert (torch.tensor(s.logprobs) - want).abs().max().item() < 1e-4


def test_seeded_samples_equal_the_foundation_sampler_and_ignore_batching() -> None:
    model = _model()
    reqs = _requests(8, greedy=False, temperature=1.3)
    # The foundation sampler, one request at a time, is the reference for each seed.
    ref = {r.uid: next(Sampler(model, pad_id=0).generate([r])).response_ids for r in reqs}
    for cfg in (SMALL, dict(max_num_seqs=8, kv_budget_tokens=512, block_size=16), dict(max_num_seqs=1)):
        assert {u: s.response_ids for u, s in _run(model, reqs, **cfg).items()} == ref


def test_group_samples_prefill_the_prompt_once_and_equal_unshared_output() -> None:
    model = _model()
    g = torch.Generator().manual_seed(3)
    reqs = []
    for p, plen in enumerate((13, 16)):  # partial last block (copied on fork) and block-aligned
        prompt = torch.randint(1, V, (plen,), generator=g).tolist()
        reqs += [RolloutRequest(4 * p + k, prompt, SamplingParams(max_new_tokens=9, seed=k), group_id=p)
                 for k in range(4)]
    engine = Engine(model, EngineConfig(max_num_seqs=8, kv_budget_tokens=512, block_size=4))
    shared = {s.uid: s.response_ids for s in engine.generate(reqs)}
    alone = {r.uid: next(Engine(model, EngineConfig(enable_prefix_cache=False)).generate([r])).response_ids
             for r in reqs}
    assert shared == alone
    assert len({tuple(v) for v in shared.values()}) == 8  # seeds differ, so the samples do
    st = engine.stats
    assert st["prefill_tokens_requested"] == 4 * (13 + 16) and st["prefill_tokens_computed"] == 13 + 16


def test_prefix_cache_reuses_a_shared_system_prompt() -> None:
    model = _model()
    system = list(range(1, 21))  # 20 tokens: 5 full blocks of 4
    reqs = [RolloutRequest(i, system + [30 + i, 40 + i], SamplingParams(greedy=True, max_new_tokens=5))
            for i in range(3)]
    cfg = dict(max_num_seqs=1, kv_budget_tokens=256, block_size=4)  # one at a time: later ones hit the cache
    engine = Engine(model, EngineConfig(**cfg))
    cached = {s.uid: s.response_ids for s in engine.generate(reqs)}
    assert cached == {u: s.response_ids for u, s in _run(model, reqs, **cfg, enable_prefix_cache=False).items()}
    assert engine.stats["prefix_cache_hit_tokens"] == 2 * 20
    assert engine.stats["prefill_tokens_computed"] == 22 + 2 * 2


def test_preemption_under_a_small_kv_budget_changes_nothing() -> None:
    model = _model()
    reqs = _requests(10, greedy=False)
    ref = {u: s.response_ids for u, s in _run(model, reqs, max_num_seqs=8).items()}
    engine = Engine(model, EngineConfig(max_num_seqs=8, kv_budget_tokens=128, block_size=4))  # pool: 16 blocks
    peak = 0
    out = {}
    for s in engine.generate(reqs):
        out[s.uid] = s.response_ids
        peak = max(peak, engine.num_blocks - engine.blocks.num_free)
    assert out == ref
    assert engine.stats["preemptions"] > 0 and peak <= 16
    assert engine.blocks.num_free == engine.num_blocks  # every block came back


@pytest.mark.parametrize("greedy", [True, False])
def test_abort_then_resume_on_another_engine_equals_uninterrupted(greedy: bool) -> None:
    model = _model()
    reqs = _requests(6, greedy=greedy, temperature=0.9)
    ref = _run(model, reqs, **SMALL)
    first = Engine(model, EngineConfig(**SMALL))
    for r in reqs:
        first.add(r)
    done = {}
    for _ in range(6):
        done.update({s.uid: s for s in first.step()})
    partials = first.abort([r.uid for r in reqs])
    assert not first.has_unfinished() and first.blocks.num_free == first.num_blocks
    assert any(p.response_ids for p in partials)  # some were mid-generation
    second = Engine(model, EngineConfig(max_num_seqs=2, block_size=8))
    done.update({s.uid: s for s in second.resume(partials)})
    assert {u: s.response_ids for u, s in done.items()} == {u: s.response_ids for u, s in ref.items()}
    for u, s in done.items():
        assert max(abs(a - b) for a, b in zip(s.logprobs, ref[u].logprobs, strict=True)) < 1e-4


def _chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of Pearson's chi-square test (upper regularized incomplete gamma)."""
    expected = probs * counts.sum()
    keep = expected > 0
    stat = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat.double() / 2))


@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.6, top_k=5),
                                    dict(temperature=1.5, top_p=0.8)])
def test_sampling_frequencies_follow_the_filtered_softmax(params: dict) -> None:
    model = _model(initializer_range=0.05)  # a flatter distribution: many tokens are likely
    prompt = [3, 1, 4, 1, 5]
    n = 3000
    reqs = [RolloutRequest(i, prompt, SamplingParams(max_new_tokens=1, seed=i, **params)) for i in range(n)]
    engine = Engine(model, EngineConfig(max_num_seqs=512, max_num_batched_tokens=1024))
    counts = torch.zeros(V, dtype=torch.float64)
    for s in engine.generate(reqs):
        counts[s.response_ids[0]] += 1
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1].double() / params["temperature"]
    probs = logits.softmax(-1)
    order = probs.argsort(descending=True)
    keep = torch.ones(V, dtype=torch.bool)
    if params.get("top_k"):
        keep[order[params["top_k"]:]] = False
    if params.get("top_p"):
        mass_before = probs[order].cumsum(0) - probs[order]
        keep[order[mass_before >= params["top_p"]]] = False
    probs = torch.where(keep, probs, 0.0)
    probs /= probs.sum()
    assert counts[~keep].sum() == 0
    assert _chi_square_p(counts, probs) > 1e-3
    # The same test must reject a wrong distribution (the unfiltered uniform one).
    assert _chi_square_p(counts, torch.full((V,), 1.0 / V, dtype=torch.float64)) < 1e-6
    assert math.isfinite(float(counts.sum()))


def test_hf_backend_logprobs_match_the_training_forward_and_stop_tokens_cut() -> None:
    from fuseflow.rollout.hf_backend import HFBackend

    model = _model()
    reqs = _requests(5, greedy=False, temperature=0.7)
    backend = HFBackend(model, pad_id=0, batch_size=3)
    for s in backend.generate(reqs):
        want = _train_logprobs(model, s.prompt_ids, s.response_ids, 0.7)
        assert (torch.tensor(s.logprobs) - want).abs().max().item() < 1e-4
    free = next(backend.generate([RolloutRequest(0, [5, 6, 7], SamplingParams(greedy=True, max_new_tokens=12))]))
    stop = free.response_ids[4]
    cut = next(backend.generate([RolloutRequest(0, [5, 6, 7], SamplingParams(greedy=True, max_new_tokens=12,
                                                                             stop_token_ids=(stop,)))]))
    assert cut.response_ids == free.response_ids[: free.response_ids.index(stop) + 1] and cut.finish_reason == "stop"
    with torch.no_grad():
        model.lm_head.weight.mul_(-1.0)
    backend.update_weights(3)  # copies the source model's new weights into the HF copy
    after = next(backend.generate([RolloutRequest(0, [5, 6, 7], SamplingParams(greedy=True, max_new_tokens=12))]))
    assert after.policy_version == 3 and after.response_ids != free.response_ids


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_linear_kernel_and_decode_copy_are_speed_choices_only(arch: str, monkeypatch) -> None:
    # oneDNN vs torch matmuls, and decode attention over the contiguous copy vs straight from the pool
    # (decode_cache_fraction=0), must give the same greedy tokens and log-probs within float noise.
    # This model's matmuls are all below oneDNN's break-even size: lower it so "auto" really uses oneDNN.
    from fuseflow.rollout.engine.runner import Linears

    monkeypatch.setattr(Linears, "ONEDNN_MIN_MACS", 0)
    model = _model(arch)
    reqs = _requests(9, greedy=True)
    ref = _run(model, reqs, **SMALL, linear_kernel="torch", decode_cache_fraction=0.0)
    for cfg in (dict(linear_kernel="auto"), dict(linear_kernel="torch"), dict(linear_kernel="auto",
                                                                             decode_cache_fraction=0.0)):
        got = _run(model, reqs, **SMALL, **cfg)
        assert {u: s.response_ids for u, s in got.items()} == {u: s.response_ids for u, s in ref.items()}, cfg
        for u, s in got.items():
            assert max(abs(a - b) for a, b in zip(s.logprobs, ref[u].logprobs, strict=True)) < 1e-4
