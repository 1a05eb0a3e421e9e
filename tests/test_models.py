"""Decoder, KV cache, value model, presets and device selection (no transformers needed here)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from fuseflow.models import (
    CausalLM,
    ModelConfig,
    RopeScaling,
    ValueModel,
    last_token_values,
    logprobs_of,
    resolve_device,
)
from fuseflow.models.llama import RMSNorm, build_attention_mask, rope_inv_freq

V = 37


def _cfg(arch: str = "qwen3", **kw) -> ModelConfig:
    base = dict(
        architecture=arch, vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, rope_theta=5000.0,
    )  # fmt: skip
    return ModelConfig(**{**base, **kw})


def _model(arch: str = "qwen3", seed: int = 0, **kw) -> CausalLM:
    # std 0.2 instead of 0.02 so logits vary a lot between positions and bugs show up as big diffs
    return CausalLM.from_config(_cfg(arch, initializer_range=0.2, **kw), seed=seed).eval()


def _left_padded(batch_lens: list[int], t: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (len(batch_lens), t), generator=g)  # (B, T)
    mask = torch.zeros(len(batch_lens), t, dtype=torch.long)  # (B, T)
    for row, n in enumerate(batch_lens):
        mask[row, t - n :] = 1
    return ids, mask


# ------------------------------------------------------------------------------------------ config and presets
def _naive_param_count(c: ModelConfig) -> int:
    attn = c.hidden_size * c.head_dim * (2 * c.num_attention_heads + 2 * c.num_key_value_heads)
    mlp = 3 * c.hidden_size * c.intermediate_size
    norms = 2 * c.hidden_size + (2 * c.head_dim if c.qk_norm else 0)
    head = 0 if c.tie_word_embeddings else c.vocab_size * c.hidden_size
    return c.num_hidden_layers * (attn + mlp + norms) + c.vocab_size * c.hidden_size + c.hidden_size + head


def test_preset_parameter_counts() -> None:
    counts = {}
    for name in ("tiny", "small"):
        cfg = ModelConfig.preset(name, vocab_size=40)
        counts[name] = CausalLM(cfg).num_parameters()
        assert counts[name] == _naive_param_count(cfg)
    print(f"preset parameter counts with a 40-token vocab: {counts}")
    assert counts == {"tiny": 792_704, "small": 20_476_416}
    qwen3_tiny = ModelConfig.preset("tiny", vocab_size=40, architecture="qwen3")
    assert CausalLM(qwen3_tiny).num_parameters() == 792_704 + 4 * 2 * 32  # per-layer q_norm + k_norm


def test_unknown_preset_lists_names() -> None:
    with pytest.raises(ValueError, match=r"unknown model preset 'huge'.*\['small', 'tiny'\]"):
        ModelConfig.preset("huge", vocab_size=40)


def test_config_derives_family_switches() -> None:
    c = _cfg("qwen3", num_key_value_heads=None)
    assert (c.head_dim, c.num_key_value_heads, c.qk_norm, c.attention_bias) == (8, 4, True, False)
    q2 = _cfg("qwen2")
    assert q2.attention_bias and not q2.o_proj_bias and not q2.qk_norm
    assert _cfg("llama", attention_bias=True).o_proj_bias
    with pytest.raises(ValueError, match="attention_bias=False is impossible"):
        _cfg("qwen2", attention_bias=False)
    with pytest.raises(ValueError, match="qk_norm=True does not match architecture='llama'"):
        _cfg("llama", qk_norm=True)
    with pytest.raises(ValueError, match="must be a multiple of num_key_value_heads=3"):
        _cfg(num_key_value_heads=3)
    with pytest.raises(ValueError, match="not divisible"):
        _cfg(hidden_size=30)
    with pytest.raises(Exception, match="frozen"):
        c.vocab_size = 3  # type: ignore[misc]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_hf_dict_round_trip(arch: str) -> None:
    c = _cfg(arch, head_dim=16, tie_word_embeddings=True, eos_token_id=[1, 2], bos_token_id=0,
             rope_scaling=RopeScaling(rope_type="llama3", factor=8.0, original_max_position_embeddings=64))  # fmt: skip
    d = c.to_hf_dict("bfloat16")
    assert d["architectures"] == [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                   "qwen3": "Qwen3ForCausalLM"}[arch]]  # fmt: skip
    assert (d["model_type"], d["torch_dtype"], d["dtype"]) == (arch, "bfloat16", "bfloat16")
    assert ModelConfig.from_hf_dict(json.loads(json.dumps(d))) == c


def test_unknown_architecture_is_a_clear_error(tmp_path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["MistralForCausalLM"], "model_type": "mistral"})
    )
    with pytest.raises(ValueError) as err:
        CausalLM.from_pretrained(tmp_path)
    msg = str(err.value)
    assert "MistralForCausalLM" in msg
    assert all(name in msg for name in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"))
    with pytest.raises(ValueError, match="rope_type='yarn' is not supported"):
        ModelConfig.from_hf_dict(
            {**_cfg().to_hf_dict(), "rope_parameters": {"rope_type": "yarn", "factor": 4.0}}
        )
    with pytest.raises(ValueError, match="no config.json"):
        CausalLM.from_pretrained(tmp_path / "missing")


# ------------------------------------------------------------------------------------------ exact math
def test_rmsnorm_hand_computed() -> None:
    norm = RMSNorm(2, eps=0.0)
    norm.weight.data = torch.tensor([1.0, 2.0])
    # rms([3, 4]) = sqrt(12.5)
    expected = torch.tensor([3.0, 8.0]) / math.sqrt(12.5)
    torch.testing.assert_close(norm(torch.tensor([3.0, 4.0])), expected)


def test_rope_frequencies_hand_computed() -> None:
    plain = _cfg(hidden_size=32, num_attention_heads=4, head_dim=8, rope_theta=10000.0)
    torch.testing.assert_close(rope_inv_freq(plain), torch.tensor([1.0, 0.1, 0.01, 0.001]))
    llama3 = plain.model_copy(update={"rope_scaling": RopeScaling(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16)})  # fmt: skip
    # wavelengths 2*pi/f = 6.28, 62.8, 628, 6283 vs cut-offs 16/4 = 4 and 16/1 = 16: the first is blended
    # with weight s = (16 / 6.283 - 1) / 3, the other three are divided by the factor 8.
    s = (16 / (2 * math.pi) - 1) / 3
    expected = torch.tensor([(1 - s) / 8 + s, 0.1 / 8, 0.01 / 8, 0.001 / 8])
    torch.testing.assert_close(rope_inv_freq(llama3), expected)


def test_attention_mask_hand_computed() -> None:
    m = build_attention_mask(torch.tensor([[0, 1, 1]]), q_len=3, past_len=0)[0, 0]
    assert m.tolist() == [[True, False, False], [False, True, False], [False, True, True]]
    # two cached positions (first one padding), two new queries aligned to the end of S=4
    m = build_attention_mask(torch.tensor([[0, 1, 1, 1]]), q_len=2, past_len=2)[0, 0]
    assert m.tolist() == [[False, True, True, False], [False, True, True, True]]
    assert build_attention_mask(None, q_len=3, past_len=0) is None


def test_logprobs_of_matches_naive() -> None:
    logits = torch.randn(2, 5, 7)
    tokens = torch.randint(0, 7, (2, 5))
    naive = torch.tensor(
        [[logits[b, t].log_softmax(-1)[tokens[b, t]].item() for t in range(5)] for b in range(2)]
    )
    torch.testing.assert_close(logprobs_of(logits, tokens), naive)
    with pytest.raises(ValueError, match="must share"):
        logprobs_of(logits, tokens[:, :4])


# ------------------------------------------------------------------------------------------ decoder behaviour
def test_init_is_seeded_and_hf_like() -> None:
    a, b, c = (CausalLM.from_config(_cfg(), seed=s) for s in (3, 3, 4))
    assert all(
        torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)
    assert abs(a.model.layers[0].mlp.up_proj.weight.std().item() - 0.02) < 0.002
    assert torch.equal(a.model.norm.weight, torch.ones(32))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_left_padding_does_not_change_real_logits(arch: str) -> None:
    lm = _model(arch, tie_word_embeddings=arch == "qwen2")
    ids, mask = _left_padded([6, 3], t=6)
    with torch.no_grad():
        batched = lm(ids, attention_mask=mask).logits  # (2, 6, V)
        alone = lm(ids[1:, 3:]).logits  # the short row with its padding removed
    assert torch.isfinite(batched).all()
    torch.testing.assert_close(batched[1, 3:], alone[0], atol=1e-5, rtol=0)


def test_padding_rows_give_finite_gradients() -> None:
    lm = _model()
    ids, mask = _left_padded([5, 1], t=5)
    out = lm(ids, attention_mask=mask).logits
    out.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in lm.parameters())


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_incremental_decoding_matches_full_forward(arch: str) -> None:
    lm = _model(arch)
    ids, mask = _left_padded([4, 7, 2], t=10)  # prompt = first 7 columns, then 3 decode steps
    with torch.no_grad():
        full = lm(ids, attention_mask=mask).logits  # (3, 10, V)
        out = lm(ids[:, :7], attention_mask=mask[:, :7], use_cache=True)
        steps = [out.logits]
        for t in range(7, 10):
            out = lm(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], past_key_values=out.past_key_values,
                     use_cache=True)  # fmt: skip
            steps.append(out.logits)
    incremental = torch.cat(steps, dim=1)
    real = mask.bool()
    diff = (incremental - full).abs()[real].max().item()
    assert diff < 1e-5, diff
    assert out.past_key_values.seq_len == 10 and out.past_key_values.keys[0].shape == (3, 2, 10, 8)


def test_cache_is_not_mutated_and_can_branch() -> None:
    lm = _model()
    ids, mask = _left_padded([5, 3], t=5)
    with torch.no_grad():
        pre = lm(ids, attention_mask=mask, use_cache=True).past_key_values
        nxt = torch.tensor([[1], [2]])
        m2 = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
        a = lm(nxt, attention_mask=m2, past_key_values=pre, use_cache=True).logits
        b = lm(nxt, attention_mask=m2, past_key_values=pre, use_cache=True).logits
    assert pre.seq_len == 5
    torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_select_keeps_decoding_exact() -> None:
    lm = _model()
    ids, mask = _left_padded([5, 2, 4], t=6)
    with torch.no_grad():
        full = lm(ids, attention_mask=mask).logits  # (3, 6, V)
        pre = lm(ids[:, :5], attention_mask=mask[:, :5], use_cache=True).past_key_values
        keep = [2, 0, 0]  # drop row 1, repeat row 0 (finished rows out, prompt fan-out)
        step = lm(ids[keep, 5:], attention_mask=mask[keep], past_key_values=pre.select(keep)).logits
    torch.testing.assert_close(step[:, 0], full[keep, 5], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match=r"batch_indices must lie in \[0, 3\)"):
        pre.select([3])


def test_bad_shapes_are_named() -> None:
    lm = _model()
    with pytest.raises(ValueError, match=r"attention_mask must be \(B, past_len \+ T\) = \(1, 3\)"):
        lm(torch.tensor([[1, 2, 3]]), attention_mask=torch.ones(1, 2))
    with pytest.raises(ValueError, match="input_ids must be"):
        lm(torch.tensor([1, 2, 3]))


def test_tied_embeddings_are_one_parameter(tmp_path) -> None:
    lm = _model(tie_word_embeddings=True)
    assert lm.lm_head.weight is lm.model.embed_tokens.weight
    lm.save_pretrained(tmp_path / "ck")
    from safetensors import safe_open

    with safe_open(tmp_path / "ck" / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in f.keys() and "model.embed_tokens.weight" in f.keys()
    back = CausalLM.from_pretrained(tmp_path / "ck")
    assert back.lm_head.weight is back.model.embed_tokens.weight
    assert all(p.requires_grad for p in back.parameters())


def test_save_is_atomic_and_keeps_other_files(tmp_path) -> None:
    target = tmp_path / "ck"
    _model(seed=1).save_pretrained(target)
    (target / "tokenizer.json").write_text("{}")
    (target / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"x": "old-00001.safetensors"}})
    )
    (target / "old-00001.safetensors").write_bytes(b"stale")
    lm = _model(seed=2)
    lm.save_pretrained(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # no temp dirs left behind
    assert sorted(p.name for p in target.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    back = CausalLM.from_pretrained(target)
    assert torch.equal(back.model.embed_tokens.weight, lm.model.embed_tokens.weight)


def test_load_errors_name_the_tensor(tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    _model().save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    state.pop("model.layers.1.mlp.up_proj.weight")
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing \['model.layers.1.mlp.up_proj.weight'\]"):
        CausalLM.from_pretrained(tmp_path)


def test_from_pretrained_casts_dtype(tmp_path) -> None:
    _model().save_pretrained(tmp_path)
    lm = CausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert {p.dtype for p in lm.parameters()} == {torch.bfloat16}
    lm.save_pretrained(tmp_path / "bf16")
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"


# ------------------------------------------------------------------------------------------ value model
def test_value_model_from_lm_and_round_trip(tmp_path) -> None:
    lm = _model("qwen2", tie_word_embeddings=True)
    critic = ValueModel.from_causal_lm(lm)
    ids, mask = _left_padded([4, 2], t=4)
    values = critic(ids, attention_mask=mask)
    assert values.shape == (2, 4) and values.dtype == torch.float32
    assert torch.equal(values, torch.zeros(2, 4))  # zero head: neutral baseline
    names = set(critic.state_dict())
    assert (
        "model.layers.0.self_attn.q_proj.bias" in names and {"value_head.weight", "value_head.bias"} <= names
    )
    with torch.no_grad():  # an independent copy: training the critic must not move the policy
        critic.model.norm.weight.add_(1.0)
        critic.value_head.weight.normal_()
    assert not torch.equal(critic.model.norm.weight, lm.model.norm.weight)

    critic.save_pretrained(tmp_path / "critic")
    cfg = json.loads((tmp_path / "critic" / "config.json").read_text())
    assert cfg["fuseflow_value_model"] is True and cfg["model_type"] == "qwen2"
    back = ValueModel.from_pretrained(tmp_path / "critic")
    torch.testing.assert_close(
        back(ids, attention_mask=mask), critic(ids, attention_mask=mask), atol=0, rtol=0
    )
    assert not torch.equal(back(ids, attention_mask=mask), torch.zeros(2, 4))

    lm.save_pretrained(tmp_path / "lm")
    with pytest.raises(ValueError, match="ValueModel.from_causal_lm"):
        ValueModel.from_pretrained(tmp_path / "lm")
    with pytest.raises(ValueError, match="ValueModel.from_pretrained"):
        CausalLM.from_pretrained(tmp_path / "critic")


def test_last_token_values_hand_computed() -> None:
    values = torch.tensor([[0.0, 5.0, 7.0, 0.0], [1.0, 2.0, 3.0, 4.0], [9.0, 8.0, 0.0, 0.0]])
    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    assert last_token_values(values, mask).tolist() == [7.0, 4.0, 9.0]
    with pytest.raises(ValueError, match="no real token"):
        last_token_values(values, torch.zeros(3, 4))


# ------------------------------------------------------------------------------------------ device
def test_resolve_device(monkeypatch) -> None:
    assert resolve_device("cpu") == (torch.device("cpu"), torch.float32)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device() == (torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match=r"device='gpu' is not a valid device; use 'auto', 'cpu', 'cuda'"):
        resolve_device("gpu")
    with pytest.raises(ValueError, match="no GPU is visible"):
        resolve_device("cuda:1")


def test_expanded_kv_heads_match_native_gqa(monkeypatch) -> None:
    # The CUDA path expands k/v heads instead of using enable_gqa; both must give the same attention.
    from fuseflow.models import attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 5, 8, generator=g) for h in (4, 2, 2))
    mask = build_attention_mask(torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]]), q_len=5, past_len=0)
    native = attention.attend(q, k, v, mask, is_causal=False)
    monkeypatch.setattr(attention, "_native_gqa_ok", lambda q, mask: False)
    expanded = attention.attend(q, k, v, mask, is_causal=False)
    # naive reference for head 3 of row 1 (uses kv head 1): softmax over allowed keys
    scores = (q[1, 3] @ k[1, 1].T) / math.sqrt(8)
    scores = scores.masked_fill(~mask[1, 0], float("-inf"))
    torch.testing.assert_close(native[1, 3], scores.softmax(-1) @ v[1, 1])
    torch.testing.assert_close(expanded, native)


def test_single_row_decode_with_left_padding_ignores_pad_keys():
    # Regression: a batch of one left-padded row once dropped its mask during decode, so the
    # query attended to the padding keys (seen as a 0.02 log-prob gap between sampler and trainer).
    torch.manual_seed(0)
    model = CausalLM.from_config(ModelConfig.preset("tiny", vocab_size=32), seed=3).eval()
    prompt, steps = [5, 6, 7], [8, 9, 10]
    ids = torch.tensor([[0, 0] + prompt])
    mask = torch.tensor([[0, 0, 1, 1, 1]])
    with torch.no_grad():
        full = model(torch.tensor([prompt + steps])).logits[0, len(prompt) - 1:]
        out = model(ids, attention_mask=mask, use_cache=True)
        got = [out.logits[0, -1]]
        for tok in steps:
            mask = torch.cat([mask, torch.ones(1, 1, dtype=torch.long)], dim=1)
            out = model(torch.tensor([[tok]]), attention_mask=mask, past_key_values=out.past_key_values,
                        use_cache=True)
            got.append(out.logits[0, -1])
    assert torch.allclose(torch.stack(got), full, atol=1e-5)
