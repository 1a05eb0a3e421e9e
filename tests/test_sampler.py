"""The first rollout backend against naive references: greedy, log-probs, seeds, filtering."""

import torch

from fuseflow.models import CausalLM, ModelConfig
from fuseflow.rollout.base import RolloutRequest, SamplingParams
from fuseflow.rollout.sampler import Sampler, filter_logits, make_requests
from fuseflow.workers.common import response_logprobs, samples_to_batch


def _model(seed=0):
    cfg = ModelConfig.preset("tiny", vocab_size=24, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, eos_token_id=2, pad_token_id=0)
    return CausalLM.from_config(cfg, seed=seed).eval()


PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]


def test_greedy_matches_naive_full_forward_loop():
    model = _model()
    params = SamplingParams(greedy=True, max_new_tokens=6)
    out = list(Sampler(model, pad_id=0).generate([RolloutRequest(i, p, params) for i, p in enumerate(PROMPTS)]))
    for s, prompt in zip(out, PROMPTS, strict=True):
        seq = list(prompt)
        with torch.no_grad():
            for _ in range(6):
                seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
        assert s.response_ids == seq[len(prompt):] and s.finish_reason == "length"


def test_logprobs_equal_training_forward():
    model = _model(1)
    params = SamplingParams(temperature=0.7, max_new_tokens=8, stop_token_ids=(2,))
    samples = list(Sampler(model, 0).generate(make_requests(PROMPTS, params, group_size=3, seed=4)))
    batch = samples_to_batch(samples, 0, [""] * len(samples), [""] * len(samples))
    with torch.no_grad():
        lp = response_logprobs(model, batch, temperature=0.7)
    mask = batch["response_mask"].bool()
    assert torch.allclose(lp[mask], batch["behavior_logprobs"][mask], atol=1e-4)


def test_per_request_seed_makes_samples_independent_of_batching():
    model = _model(2)
    params = SamplingParams(temperature=1.0, max_new_tokens=8)
    reqs = make_requests(PROMPTS, params, group_size=2, seed=11)
    together = {s.uid: s.response_ids for s in Sampler(model, 0).generate(reqs)}
    alone = {s.uid: s.response_ids for r in reqs for s in Sampler(model, 0).generate([r])}
    small = {s.uid: s.response_ids for s in Sampler(model, 0, max_batch=2).generate(reqs[::-1])}
    assert together == alone == small
    assert len({tuple(v) for v in together.values()}) > 1  # samples do differ from one another


def test_stop_token_and_lengths():
    model = _model(3)
    first = list(Sampler(model, 0).generate([RolloutRequest(0, PROMPTS[0], SamplingParams(greedy=True,
                                                                                        max_new_tokens=4))]))[0]
    stop = first.response_ids[1]
    s = list(Sampler(model, 0).generate([RolloutRequest(0, PROMPTS[0], SamplingParams(
        greedy=True, max_new_tokens=4, stop_token_ids=(stop,)))]))[0]
    cut = first.response_ids.index(stop) + 1
    assert s.response_ids == first.response_ids[:cut] and s.finish_reason == "stop"


def test_filter_logits_hand_case():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]]))
    out = filter_logits(logits, top_k=torch.tensor([2, 0]), top_p=torch.tensor([1.0, 0.8]))
    keep = torch.isfinite(out)
    assert keep[0].tolist() == [True, True, False, False]  # top-2
    assert keep[1].tolist() == [True, True, False, False]  # nucleus 0.8 reached by 0.5 + 0.3


def test_sampling_frequencies_follow_softmax():
    model = _model(5)
    with torch.no_grad():
        probs = model(torch.tensor([PROMPTS[1]])).logits[0, -1].softmax(-1)
    reqs = [RolloutRequest(i, PROMPTS[1], SamplingParams(max_new_tokens=1, seed=i)) for i in range(4000)]
    counts = torch.zeros_like(probs)
    for s in Sampler(model, 0, max_batch=1000).generate(reqs):
        counts[s.response_ids[0]] += 1
    expected = probs * 4000
    big = expected > 20
    chi2 = (((counts - expected) ** 2) / expected)[big].sum()
    assert chi2 < 2 * int(big.sum()) + 20  # far below what a wrong distribution gives
