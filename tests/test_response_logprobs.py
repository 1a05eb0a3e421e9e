"""``response_logprobs`` (LM head at the response positions only) against a naive per-row reference.

The reference runs each row alone, without any padding, over all its positions, and reads the
log-softmax at the positions that predict its response tokens. The batched call must give the
same log-probs, entropies and parameter gradients on rows whose prompt and response lengths
all differ (left-padded prompts, right-padded responses), at temperature 1 and below it.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fuseflow.data.batch import Batch, pad_sequences
from fuseflow.models import CausalLM, ModelConfig
from fuseflow.workers.common import response_logprobs

# (prompt length, response length) per row: every padding pattern, a 1-token prompt and a 1-token response.
ROWS = [(5, 7), (1, 3), (9, 1), (3, 7), (6, 4)]


def _model(vocab=37):
    return CausalLM.from_config(ModelConfig.preset("tiny", vocab_size=vocab), seed=5)


def _rows(vocab=37):
    g = torch.Generator().manual_seed(11)
    return [(torch.randint(1, vocab, (p,), generator=g).tolist(), torch.randint(1, vocab, (r,), generator=g).tolist())
            for p, r in ROWS]


def _batch(rows) -> Batch:
    prompts, responses = [p for p, _ in rows], [r for _, r in rows]
    p_mask = pad_sequences([[1] * len(x) for x in prompts], 0, left=True)
    r_mask = pad_sequences([[1] * len(x) for x in responses], 0, left=False)
    ids = torch.cat([pad_sequences(prompts, 0, left=True), pad_sequences(responses, 0, left=False)], 1)
    return Batch({"input_ids": ids, "attention_mask": torch.cat([p_mask, r_mask], 1), "response_mask": r_mask.float()})


def _naive(model, rows, temperature):
    """Per row, unpadded: (log-probs, entropies) of its response tokens from the full logits."""
    out = []
    for prompt, response in rows:
        ids = torch.tensor([prompt + response])
        logp_all = (model(ids).logits[0].float() / temperature).log_softmax(-1)  # (T, V), every position
        pred = logp_all[len(prompt) - 1: len(prompt) + len(response) - 1]  # position t predicts token t + 1
        logp = pred.gather(-1, torch.tensor(response)[:, None]).squeeze(-1)
        out.append((logp, -(pred.exp() * pred).sum(-1)))
    return out


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _matches_naive(model, rows, temperature, **kwargs):
    """``response_logprobs(..., **kwargs)`` on the padded batch against ``_naive``: log-probs, entropies and
    the gradient of a weighted sum over the real tokens (a different weight each) must agree.
    Returns the batched log-probs and entropies and both gradient dicts."""
    batch = _batch(rows)
    mask = batch["response_mask"].bool()
    weights = torch.linspace(0.5, 2.0, int(mask.sum()))

    logp, entropy = response_logprobs(model, batch, temperature, with_entropy=True, **kwargs)
    (logp[mask] * weights).sum().backward()
    batched = _grads(model)
    model.zero_grad(set_to_none=True)

    ref = _naive(model, rows, temperature)
    torch.cat([lp for lp, _ in ref]).mul(weights).sum().backward()
    naive = _grads(model)

    for i, (lp, ent) in enumerate(ref):
        n = len(lp)
        torch.testing.assert_close(logp[i, :n], lp.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(entropy[i, :n], ent.detach(), rtol=1e-5, atol=1e-5)
    assert set(batched) == set(naive) and len(naive) > 4
    for name in naive:
        torch.testing.assert_close(batched[name], naive[name], rtol=1e-4, atol=1e-5, msg=name)
    return logp, entropy, batched, naive


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_batched_logprobs_entropy_and_grads_equal_the_unpadded_rows(temperature):
    rows = _rows()
    logp, entropy, batched, naive = _matches_naive(_model(), rows, temperature)
    assert logp.shape == entropy.shape == _batch(rows)["response_mask"].shape
    assert not entropy.requires_grad  # a metric: its (B, Tr, V) intermediates are not kept for backward
    assert "model.layers.0.self_attn.q_proj.weight" in naive


def test_a_model_returning_every_position_gives_the_same_logprobs():
    # The pipeline's last stage hands response_logprobs logits it already computed for every position.
    rows, model = _rows(), _model()
    batch = _batch(rows)
    with torch.no_grad():
        kept = response_logprobs(model, batch, 0.7)
        full_logits = model(batch["input_ids"], attention_mask=batch["attention_mask"]).logits  # (B, T, V)
        full = response_logprobs(lambda *a, **k: SimpleNamespace(logits=full_logits), batch, 0.7)
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(kept[mask], full[mask], rtol=1e-5, atol=1e-6)


def test_activation_checkpointing_gives_the_same_logprobs_and_grads():
    # Recomputing each layer in the backward pass changes what is stored, not what is computed.
    from fuseflow.models.llama import set_activation_checkpointing

    batch = _batch(_rows())
    mask = batch["response_mask"].bool()
    out = []
    for on in (False, True):
        model = _model()
        set_activation_checkpointing(model, on)
        assert model.model.activation_checkpointing is on
        saved = []  # bytes autograd keeps for the backward pass

        def pack(t, saved=saved):
            saved.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logp = response_logprobs(model, batch, 0.7)
        logp[mask].sum().backward()
        out.append((logp.detach(), _grads(model), sum(saved)))
    (lp0, g0, kept0), (lp1, g1, kept1) = out
    assert kept1 < 0.5 * kept0, (kept0, kept1)  # the layers' activations were not kept
    torch.testing.assert_close(lp1, lp0, rtol=0, atol=0)
    assert set(g0) == set(g1) and len(g0) > 10
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-6, atol=1e-7, msg=name)


# Shared prompts (GRPO's groups): rows 0-2 share one prompt, rows 3-5 another, row 6 has its own.
GROUPED = [(0, 5), (0, 1), (0, 3), (1, 2), (1, 6), (1, 4), (2, 3)]
PROMPT_LENS = [12, 9, 14]


def _grouped_rows(vocab=37):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]
    return [(prompts[p], torch.randint(1, vocab, (r,), generator=g).tolist()) for p, r in GROUPED]


def test_shared_prompts_finds_the_groups_and_declines_a_small_saving():
    from fuseflow.workers.common import shared_prompts

    first, inverse = shared_prompts(_batch(_grouped_rows()))
    assert [first[i].item() for i in inverse.tolist()] == [0, 0, 0, 3, 3, 3, 6]
    # Distinct prompts: nothing to share.
    assert shared_prompts(_batch(_rows())) is None  # distinct prompts, 17% of the tokens are padding
    # Distinct prompts, but most response columns are padding: unpadding alone saves enough.
    tail = [([1, 2, 3][: i + 1], [5] * (24 if i == 0 else 2)) for i in range(3)]
    first, inverse = shared_prompts(_batch(tail))
    assert first.tolist() == [0, 1, 2] and sorted(inverse.tolist()) == [0, 1, 2]
    # One shared 2-token prompt before long responses: 2 + 2 * 29 tokens against 2 * 31 saves too little.
    g = torch.Generator().manual_seed(0)
    rows = [([4, 5], torch.randint(1, 37, (30,), generator=g).tolist()) for _ in range(2)]
    assert shared_prompts(_batch(rows)) is None


@pytest.mark.parametrize("variant", ["plain", "lora", "checkpointing"])
def test_shared_prefix_logprobs_entropy_and_grads_equal_the_unpadded_rows(variant):
    from fuseflow.models.llama import set_activation_checkpointing
    from fuseflow.models.lora import LoraSpec, apply_lora

    rows, model = _grouped_rows(), _model()
    if variant == "lora":
        model = apply_lora(model, LoraSpec(rank=4, alpha=8.0, dropout=0.0), seed=1)
        with torch.no_grad():  # B starts at zero; make the adapters count
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.05)
    set_activation_checkpointing(model, variant == "checkpointing")
    _matches_naive(model, rows, 0.7, share_prefix=True)


def test_shared_prefix_with_one_token_responses_equals_the_unpadded_rows():
    # Every response a single token: only the prompts' last positions give logits (no packed response).
    from fuseflow.workers.common import shared_prompts

    rows = [(p, r[:1]) for p, r in _grouped_rows()]
    assert shared_prompts(_batch(rows)) is not None
    _matches_naive(_model(), rows, 1.0, share_prefix=True)


def test_shared_prefix_runs_each_prompt_once_and_no_response_padding():
    # The saving is real: the prompt tokens go through the decoder once per distinct prompt, and of the
    # responses only the tokens that predict a next real token, with no padding anywhere.
    rows, model = _grouped_rows(), _model()
    batch = _batch(rows)
    seen = []
    model.model.embed_tokens.register_forward_hook(lambda m, i, o: seen.append(i[0].numel()))
    with torch.no_grad():
        response_logprobs(model, batch, 1.0)
        response_logprobs(model, batch, 1.0, share_prefix=True)
    tp, tr = max(PROMPT_LENS), max(r for _, r in GROUPED)
    assert seen[0] == len(rows) * (tp + tr)  # one forward over every padded row
    # One forward: the three prompts' real tokens, then each response's but its last.
    assert seen[1:] == [sum(PROMPT_LENS) + sum(r - 1 for _, r in GROUPED)]


def test_the_actor_shares_prompts_in_scoring_and_training_with_the_same_result(tmp_path):
    # schedule.shared_prefix reaches the actor's scoring and its update: fewer tokens through the
    # decoder, the same log-probs, gradient norm and loss.
    from fuseflow.config import load_config
    from fuseflow.controller.worker import DistInfo
    from fuseflow.data.tokenizer import load_tokenizer
    from fuseflow.tasks import make_task
    from fuseflow.workers.build import RoleContext, build_actor

    vocab = len(load_tokenizer(None))
    CausalLM.from_config(ModelConfig.preset("tiny", vocab_size=vocab), seed=0).save_pretrained(tmp_path / "m")
    rows = _grouped_rows(vocab=min(vocab, 37))
    rows.append((rows[-1][0], rows[0][1]))  # 8 rows, 3 prompts
    groups = [p for p, _ in GROUPED] + [2]
    out = {}
    for share in (False, True):
        cfg = load_config("default", ["task.train_size=16", "task.eval_size=4", "trainer.prompts_per_step=4", "algorithm.group_size=2", "trainer.mini_batch_size=8",
                                      "trainer.micro_batch_size=8", "algorithm.kl_in_reward=false",
                                      f"schedule.shared_prefix={str(share).lower()}"])
        actor = build_actor(RoleContext(cfg, tmp_path / "m", None, make_task(cfg.task)), DistInfo())
        tokens = []
        actor.plain.model.embed_tokens.register_forward_hook(lambda m, i, o, tokens=tokens: tokens.append(i[0].numel()))
        batch = _batch(rows)
        batch.meta.update(uid=list(range(len(rows))), group_id=groups)
        mask = batch["response_mask"]
        batch["advantages"] = torch.linspace(-1, 1, len(rows))[:, None] * mask
        logp = actor.compute_logprobs(batch)
        batch["old_logprobs"] = batch["behavior_logprobs"] = logp
        batch["ref_logprobs"] = logp - 0.1 * mask
        metrics = actor.update(batch, 1e-3, 0.05, seed=0)
        out[share] = (logp, metrics, sum(tokens))
    (lp0, m0, t0), (lp1, m1, t1) = out[False], out[True]
    assert t1 < 0.8 * t0, (t0, t1)
    real = batch["response_mask"].bool()
    torch.testing.assert_close(lp1[real], lp0[real], rtol=1e-5, atol=1e-5)
    assert not lp1[~real].any()  # nothing is computed past a response
    for key in ("actor/grad_norm", "actor/pg_loss"):
        assert m1[key] == pytest.approx(m0[key], rel=1e-4, abs=1e-6), key


def test_an_unpadded_forward_equals_the_padded_one_at_the_real_tokens():
    # Packed (1, N) tokens of a right-padded batch behind a shared cache: the hidden states, the
    # returned cache at the real positions and the gradients equal the padded forward's.
    from fuseflow.models.attention import Unpadded

    model, g = _model(), torch.Generator().manual_seed(2)
    prompt = torch.randint(1, 37, (2, 6), generator=g)
    p_mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    resp = torch.randint(1, 37, (2, 5), generator=g)
    r_mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    mask = torch.cat([p_mask, r_mask], 1)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    head = model(prompt, attention_mask=p_mask, position_ids=pos[:, :6], use_cache=True)
    padded = model(resp, attention_mask=mask, position_ids=pos[:, 6:], past_key_values=head.past_key_values,
                   use_cache=True, return_hidden=True)
    unpad = Unpadded.from_mask(r_mask)
    assert unpad.index.tolist() == [0, 1, 2, 5, 6, 7, 8, 9]
    packed = model(resp.reshape(-1)[unpad.index][None], attention_mask=mask,
                   position_ids=pos[:, 6:].reshape(-1)[unpad.index][None], past_key_values=head.past_key_values,
                   use_cache=True, return_hidden=True, unpadded=unpad)
    real = r_mask.bool()
    assert packed.logits.shape == (1, 8, 37)
    torch.testing.assert_close(packed.logits[0], padded.logits[real], rtol=1e-5, atol=1e-5)
    k_real = torch.cat([p_mask, r_mask], 1).bool()
    for kp, kq in zip(packed.past_key_values.keys, padded.past_key_values.keys, strict=True):
        torch.testing.assert_close(kp.transpose(1, 2)[k_real], kq.transpose(1, 2)[k_real], rtol=1e-5, atol=1e-5)
    w = torch.linspace(0.1, 1.0, 37)
    (packed.logits[0] * w).sum().backward(retain_graph=True)  # the prompt's graph serves both
    got = _grads(model)
    model.zero_grad(set_to_none=True)
    (padded.logits[real] * w).sum().backward()
    want = _grads(model)
    assert set(got) == set(want) and len(want) > 10
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5, msg=name)
    with pytest.raises(ValueError, match="packed"):
        model(resp.reshape(-1)[unpad.index][None], attention_mask=mask, past_key_values=head.past_key_values,
              unpadded=unpad)


def test_training_microbatches_hold_few_prompts_each():
    # A GRPO mini-batch of 16 rows from 4 prompts (3, 6, 3 and 4 rows, interleaved) in micro-batches of
    # at most 8 rows: no prompt's rows are split between micro-batches (a cut in order of first
    # appearance, 3 + 5 | 1 + 3 + 4, would run prompt 1 twice).
    from fuseflow.controller.worker import DistInfo
    from fuseflow.workers.common import _prompt_bins, train_microbatches

    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(1, 37, (6,), generator=g).tolist() for _ in range(4)]
    order = [0, 1, 2, 3, 1, 0, 1, 3, 2, 1, 3, 0, 1, 2, 3, 1]
    rows = [(prompts[p], [7] * (1 + i % 5)) for i, p in enumerate(order)]
    batch = _batch(rows)
    bins = _prompt_bins(batch, list(range(16)), 8)
    assert sorted(r for b in bins for r in b) == list(range(16))
    assert all(len(b) <= 8 for b in bins)
    homes = {p: {i for i, b in enumerate(bins) if any(order[r] == p for r in b)} for p in range(4)}
    assert all(len(h) == 1 for h in homes.values()), bins
    assert _prompt_bins(batch, [1, 4, 6, 9, 12], 2) == [[1, 4], [6, 9], [12]]  # one group larger than a bin
    worker = SimpleNamespace(dist=DistInfo())
    mbs = train_microbatches(worker, batch, 4096, 8, by_prompt=True)
    assert sum(len(mb) for mb in mbs) == 16 and all(len(mb) <= 8 for mb in mbs)


def _value_model(vocab=37):
    from fuseflow.models import ValueModel

    vm = ValueModel.from_causal_lm(_model(vocab))
    with torch.no_grad():  # a zero head would make every value 0 and every backbone gradient 0
        vm.value_head.weight.normal_(0, 0.5)
        vm.value_head.bias.fill_(0.1)
    return vm


@pytest.mark.parametrize("rows", ["grouped", "distinct"])
def test_critic_values_and_grads_equal_the_unpadded_rows_with_and_without_sharing(rows):
    # The critic's packed forward (shared prompts once, responses unpadded) against each row alone:
    # V before every response token, and the gradient of a weighted sum of them.
    from fuseflow.workers.common import response_values, shared_prompts

    rows = _grouped_rows() if rows == "grouped" else _rows()
    batch = _batch(rows)
    mask = batch["response_mask"].bool()
    weights = torch.linspace(-1.0, 2.0, int(mask.sum()))
    vm = _value_model()
    naive = []
    for prompt, response in rows:  # position t holds V of the state before token t + 1
        naive.append(vm(torch.tensor([prompt + response]))[0, len(prompt) - 1: len(prompt) + len(response) - 1])
    torch.cat(naive).mul(weights).sum().backward()
    want = _grads(vm)
    for share in (False, True):
        vm.zero_grad(set_to_none=True)
        values = response_values(vm, batch, share_prefix=share)
        assert values.shape == mask.shape and values.dtype == torch.float32
        (values[mask] * weights).sum().backward()
        for i, v in enumerate(naive):
            torch.testing.assert_close(values[i, :len(v)], v.detach(), rtol=1e-5, atol=1e-5)
        got = _grads(vm)
        assert set(got) == set(want) and "value_head.weight" in got and len(got) > 10
        for name in want:  # to float rounding, relative to the largest entry (the head's weights make them large)
            err = float((got[name] - want[name]).abs().max())
            assert err <= 1e-5 * float(want[name].abs().max()) + 1e-7, (name, err)
        if share and shared_prompts(batch) is not None:
            assert not values[~mask].any()  # nothing is computed past a response
    assert (shared_prompts(batch) is not None) == (len(rows) == len(GROUPED))  # both paths ran


def test_the_critic_shares_prompts_in_scoring_and_training_with_the_same_result(tmp_path):
    # schedule.shared_prefix reaches the critic's values and its update: fewer tokens through the
    # decoder, the same values (at real tokens), loss and gradient norm.
    from fuseflow.config import load_config
    from fuseflow.controller.worker import DistInfo
    from fuseflow.data.tokenizer import load_tokenizer
    from fuseflow.tasks import make_task
    from fuseflow.workers.build import RoleContext, build_critic

    vocab = len(load_tokenizer(None))
    CausalLM.from_config(ModelConfig.preset("tiny", vocab_size=vocab), seed=0).save_pretrained(tmp_path / "m")
    rows = _grouped_rows(vocab=min(vocab, 37))
    out = {}
    for share in (False, True):
        cfg = load_config("default", ["task.train_size=16", "task.eval_size=4", "algorithm.name=ppo",
                                      "trainer.mini_batch_size=8", "trainer.micro_batch_size=8",
                                      f"schedule.shared_prefix={str(share).lower()}"])
        critic = build_critic(RoleContext(cfg, tmp_path / "m", None, make_task(cfg.task)), DistInfo())
        with torch.no_grad():
            critic.model.value_head.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
        tokens = []
        critic.model.model.embed_tokens.register_forward_hook(lambda m, i, o, tokens=tokens: tokens.append(i[0].numel()))
        batch = _batch(rows)
        mask = batch["response_mask"]
        values = critic.compute_values(batch)
        batch["values"] = values
        batch["returns"] = torch.linspace(-1, 1, len(rows))[:, None] * mask
        metrics = critic.update(batch, 1e-3, seed=0)
        out[share] = (values, metrics, sum(tokens))
    (v0, m0, t0), (v1, m1, t1) = out[False], out[True]
    assert t1 < 0.8 * t0, (t0, t1)
    real = mask.bool()
    torch.testing.assert_close(v1[real], v0[real], rtol=1e-5, atol=1e-5)
    for key in ("critic/loss", "critic/grad_norm"):
        assert m1[key] == pytest.approx(m0[key], rel=1e-4, abs=1e-6), key
