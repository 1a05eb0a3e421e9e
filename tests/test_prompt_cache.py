"""The prompt cache of the scoring forwards: prompts run once per weights, whatever the micro-batches.

Scoring splits a step's samples into several forwards; a group's prompt in a later forward takes its
keys and values from the worker's ``PromptCache``. Outputs must equal one uncached forward over each
row (the naive reference of test_response_logprobs), the prompt tokens must not run again, and any
change of the weights (an optimizer step, a weight sync) must drop what was cached.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from fuseflow.workers.common import PromptCache, _prompt_key, prompt_cache, response_logprobs, response_values
from test_response_logprobs import GROUPED, PROMPT_LENS, _batch, _grouped_rows, _model, _naive, _value_model

# Rows 0, 3 and 6 of GROUPED, then rows 1, 2, 4 and 5: every prompt of the second part ran in the first.
FIRST, SECOND = [0, 3, 6], [1, 2, 4, 5]


def _count_tokens(model) -> list[int]:
    seen: list[int] = []
    model.model.embed_tokens.register_forward_hook(lambda m, i, o: seen.append(i[0].numel()))
    return seen


def test_a_later_forward_reuses_the_prompts_and_equals_the_unpadded_rows():
    rows, model = _grouped_rows(), _model()
    naive = _naive(model, rows, 0.7)
    cache, seen = PromptCache(), _count_tokens(model)
    with torch.no_grad():
        parts = {}
        for part in (FIRST, SECOND):
            logp, entropy = response_logprobs(model, _batch([rows[i] for i in part]), 0.7, with_entropy=True,
                                              share_prefix=True, prompt_cache=cache)
            parts.update({row: (logp[j], entropy[j]) for j, row in enumerate(part)})
    for i, (lp, ent) in enumerate(naive):
        n = len(lp)
        torch.testing.assert_close(parts[i][0][:n], lp, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(parts[i][1][:n], ent, rtol=1e-5, atol=1e-5)
    # First part: its three prompts once (one forward), then its responses but each one's last token.
    # Second part: no prompt token at all, only its responses' packed tokens.
    first_responses = sum(GROUPED[i][1] - 1 for i in FIRST)
    assert seen == [sum(PROMPT_LENS), first_responses, sum(GROUPED[i][1] - 1 for i in SECOND)]
    assert (cache.misses, cache.hits) == (3, 2)  # the second part holds two distinct prompts


def test_cached_values_equal_the_unpadded_rows():
    rows, vm = _grouped_rows(), _value_model()
    cache = PromptCache()
    with torch.no_grad():
        want = [vm(torch.tensor([p + r]))[0, len(p) - 1: len(p) + len(r) - 1] for p, r in rows]
        got = {}
        for part in (FIRST, SECOND):
            values = response_values(vm, _batch([rows[i] for i in part]), share_prefix=True, prompt_cache=cache)
            got.update({row: values[j] for j, row in enumerate(part)})
    for i, v in enumerate(want):
        torch.testing.assert_close(got[i][:len(v)], v, rtol=1e-5, atol=1e-5)
    assert cache.hits == 2


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
    assert _prompt_key([-1, -1, 4, 5]) == (4, 5)
    assert _prompt_key([-1, 4, -1, 5]) is None  # real tokens not one run: positions would not be 0, 1, ...


def test_a_worker_has_a_cache_only_when_it_shares_prompts():
    assert prompt_cache(SimpleNamespace(share_prefix=False)) is None
    worker = SimpleNamespace(share_prefix=True)
    cache = prompt_cache(worker)
    assert isinstance(cache, PromptCache) and prompt_cache(worker) is cache
    assert prompt_cache(SimpleNamespace(share_prefix=True, sharded=True)) is None
