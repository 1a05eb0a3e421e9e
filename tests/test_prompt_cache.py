"""The prompt cache of the scoring forwards: prompts run once per weights, whatever the micro-batches.

Scoring splits a step's samples into several forwards; a group's prompt in a later forward takes its
keys and values from the worker's ``PromptCache``. Outputs must equal one uncached forward over each
row (the naive reference of test_response_logprobs), the prompt tokens must not run again, and any
change of the weights (an optimizer step, a weight sync) must drop what was cached.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from fuseflow.workers.common import (
    PromptCache,
    _prompt_cache_keys,
    prompt_cache,
    response_logprobs,
    response_values,
)
from test_response_logprobs import GROUPED, PROMPT_LENS, _batch, _grouped_rows, _model, _naive, _value_model

# Calls over rows of GROUPED: prompts 0 and 1 run in the first; the second runs prompt 2 and is
# given 0 and 1; the third is given every prompt it has, and so is the fourth, a single row.
PARTS = [[0, 1, 3, 4], [2, 5, 6], [0, 6], [5]]


def _count_tokens(model) -> list[int]:
    seen: list[int] = []
    model.model.embed_tokens.register_forward_hook(lambda m, i, o: seen.append(i[0].numel()))
    return seen


def test_later_forwards_reuse_the_prompts_and_equal_the_unpadded_rows():
    rows, model = _grouped_rows(), _model()
    naive = _naive(model, rows, 0.7)
    cache, seen = PromptCache(), _count_tokens(model)
    with torch.no_grad():
        for part in PARTS:
            logp, entropy = response_logprobs(model, _batch([rows[i] for i in part]), 0.7, with_entropy=True,
                                              share_prefix=True, prompt_cache=cache)
            for j, row in enumerate(part):
                n = len(naive[row][0])
                torch.testing.assert_close(logp[j, :n], naive[row][0], rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(entropy[j, :n], naive[row][1], rtol=1e-5, atol=1e-5)
                assert not logp[j, n:].any()
    # One forward per call: the prompts not run before, then each response but its last token.
    ran = [[0, 1], [2], [], []]
    want = [sum(PROMPT_LENS[u] for u in r) + sum(GROUPED[i][1] - 1 for i in part) for r, part in zip(ran, PARTS, strict=True)]
    assert seen == want == [31, 21, 6, 3]
    assert (cache.misses, cache.hits) == (3, 5)


def test_cached_values_equal_the_unpadded_rows():
    rows, vm = _grouped_rows(), _value_model()
    cache = PromptCache()
    with torch.no_grad():
        want = [vm(torch.tensor([p + r]))[0, len(p) - 1: len(p) + len(r) - 1] for p, r in rows]
        for part in PARTS:
            values = response_values(vm, _batch([rows[i] for i in part]), share_prefix=True, prompt_cache=cache)
            for j, row in enumerate(part):
                torch.testing.assert_close(values[j, :len(want[row])], want[row], rtol=1e-5, atol=1e-5)
    assert (cache.misses, cache.hits) == (3, 5)


def test_an_optimizer_step_drops_the_cached_prompts():
    rows, model = _grouped_rows(), _model()
    batch = _batch(rows)
    cache = PromptCache()
    with torch.no_grad():
        before = response_logprobs(model, batch, 1.0, share_prefix=True, prompt_cache=cache)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    response_logprobs(model, batch, 1.0)[batch["response_mask"].bool()].sum().backward()
    opt.step()
    with torch.no_grad():
        after = response_logprobs(model, batch, 1.0, share_prefix=True, prompt_cache=cache)
        fresh = response_logprobs(model, batch, 1.0, share_prefix=True)
    assert cache.hits == 0 and cache.misses == 6  # every prompt ran again under the new weights
    assert not torch.allclose(after, before)
    torch.testing.assert_close(after, fresh, rtol=0, atol=0)


def test_a_weight_sync_into_the_model_drops_the_cached_prompts():
    # The replicas receive weights through _broadcast_buckets; its writes must count as a change.
    from fuseflow.controller.weight_sync import _broadcast_buckets

    rows, model, source = _grouped_rows(), _model(), _model()
    with torch.no_grad():
        for p in source.parameters():
            p.add_(0.01)
    flat = torch.cat([p.detach().reshape(-1) for p in source.parameters()])
    batch, cache = _batch(rows), PromptCache()
    with torch.no_grad():
        response_logprobs(model, batch, 1.0, share_prefix=True, prompt_cache=cache)
        _broadcast_buckets(list(model.parameters()), lambda f: f.copy_(flat[:f.numel()]), False, 2**40)
        after = response_logprobs(model, batch, 1.0, share_prefix=True, prompt_cache=cache)
        want = response_logprobs(source, batch, 1.0, share_prefix=True)
    assert cache.hits == 0
    torch.testing.assert_close(after, want, rtol=0, atol=0)


def test_the_cache_keeps_to_its_bytes_dropping_the_least_recently_used():
    rows, model = _grouped_rows(), _model()
    big = PromptCache()
    with torch.no_grad():
        response_logprobs(model, _batch(rows), 1.0, share_prefix=True, prompt_cache=big)
    sizes = {k: e.nbytes for k, e in big.entries.items()}
    assert len(sizes) == 3 and big.nbytes == sum(sizes.values())
    small = PromptCache(max_bytes=max(sizes.values()) + min(sizes.values()))
    with torch.no_grad():
        response_logprobs(model, _batch(rows), 1.0, share_prefix=True, prompt_cache=small)
        assert small.nbytes <= small.max_bytes and 1 <= len(small.entries) < 3
        kept = set(small.entries)
        # Still exact with prompts dropped: they run again.
        got = response_logprobs(model, _batch(rows), 1.0, share_prefix=True, prompt_cache=small)
    torch.testing.assert_close(got, response_logprobs(model, _batch(rows), 1.0, share_prefix=True).detach())
    assert small.hits == len(kept)


def test_training_forwards_and_unusual_prompts_do_not_use_the_cache():
    rows, model = _grouped_rows(), _model()
    cache = PromptCache()
    response_logprobs(model, _batch(rows), 1.0, share_prefix=True, prompt_cache=cache)  # autograd on
    assert cache.hits == cache.misses == 0
    ids = torch.tensor([[0, 0, 4, 5], [7, 8, 9, 6]])
    assert _prompt_cache_keys(ids, torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])) == [(4, 5), (7, 8, 9, 6)]
    # Real tokens not one run at the end: positions would not be 0, 1, ...
    assert _prompt_cache_keys(ids, torch.tensor([[0, 1, 0, 1], [1, 1, 1, 1]])) is None


def test_a_worker_has_a_cache_only_when_it_shares_prompts():
    assert prompt_cache(SimpleNamespace(share_prefix=False)) is None
    worker = SimpleNamespace(share_prefix=True)
    cache = prompt_cache(worker)
    assert isinstance(cache, PromptCache) and prompt_cache(worker) is cache
    assert prompt_cache(SimpleNamespace(share_prefix=True, sharded=True)) is None
    assert prompt_cache(SimpleNamespace(share_prefix=True, cache_prompts=False)) is None
