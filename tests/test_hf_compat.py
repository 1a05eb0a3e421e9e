"""Logit equality with Hugging Face transformers, both directions, for Llama, Qwen2 and Qwen3.

HF runs with attn_implementation="eager" (the plain-math reference). HF's forward does not derive
position ids from the attention mask (its generate() does), so the left-padded cases pass the same
cumsum(mask) - 1 positions explicitly; only real-token positions are compared.
"""

from __future__ import annotations

import json

import pytest
import torch

from fuseflow.models import CausalLM

transformers = pytest.importorskip("transformers")

V = 61
_BASE = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4)
CASES = {
    # GQA (4 heads over 2 kv heads), large rope_theta, untied
    "llama-gqa": ("LlamaForCausalLM", "LlamaConfig", dict(num_key_value_heads=2, rope_theta=500000.0)),
    # tied embeddings, q/k/v/o bias, Llama-3.1-style rope rescaling
    "llama-tied-bias-rope3": ("LlamaForCausalLM", "LlamaConfig", dict(
        num_key_value_heads=4, attention_bias=True, tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
    # q/k/v bias (always on in Qwen2), tied, GQA
    "qwen2-bias-tied": ("Qwen2ForCausalLM", "Qwen2Config", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    # qk-norm, explicit head_dim != hidden / heads, one kv head (MQA), rope_theta 1e6
    "qwen3-qknorm": ("Qwen3ForCausalLM", "Qwen3Config", dict(num_key_value_heads=1, head_dim=16, rope_theta=1e6)),
}  # fmt: skip


def _hf_model(case: str, seed: int = 0):
    cls_name, cfg_name, extra = CASES[case]
    torch.manual_seed(seed)
    cfg = getattr(transformers, cfg_name)(**_BASE, **extra)
    cfg._attn_implementation = "eager"
    model = getattr(transformers, cls_name)(cfg).eval()
    # Random weights of a larger scale than HF's init, and non-unit norms / biases, so that every
    # parameter (including norm weights and biases) visibly affects the logits.
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2) if p.ndim > 1 else p.uniform_(0.5, 1.5)
    return model


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, V, (3, 12), generator=g)  # (B, T)
    mask = torch.ones(3, 12, dtype=torch.long)  # row 0 full, rows 1-2 left-padded
    mask[1, :4] = 0
    mask[2, :9] = 0
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def _max_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return (a - b).abs()[mask.bool()].max().item()


@pytest.mark.parametrize("case", list(CASES))
def test_hf_to_ours_to_hf_same_logits(case: str, tmp_path) -> None:
    hf = _hf_model(case)
    hf.save_pretrained(tmp_path / "hf")
    ours = CausalLM.from_pretrained(tmp_path / "hf").eval()
    assert set(ours.state_dict()) == set(hf.state_dict())
    ids, mask, pos = _batch()
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        got = ours(ids, attention_mask=mask).logits
        plain_ref = hf(input_ids=ids).logits
        plain_got = ours(ids).logits
    d_pad, d_plain = _max_diff(ref, got, mask), (plain_ref - plain_got).abs().max().item()
    print(f"{case}: HF->ours max |dlogit| left-padded {d_pad:.2e}, unpadded {d_plain:.2e}")
    assert d_pad < 1e-4 and d_plain < 1e-4

    ours.save_pretrained(tmp_path / "ours")
    saved = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert saved["architectures"] == [CASES[case][0]] and saved["dtype"] == "float32"
    back = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "ours", attn_implementation="eager"
    ).eval()
    assert type(back).__name__ == CASES[case][0]
    with torch.no_grad():
        again = back(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    d_back = _max_diff(again, got, mask)
    print(f"{case}: ours->HF max |dlogit| {d_back:.2e}")
    assert d_back < 1e-4


def test_sharded_checkpoint_loads(tmp_path) -> None:
    hf = _hf_model("qwen3-qknorm", seed=1)
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file() and not (
        tmp_path / "model.safetensors"
    ).exists()
    ours = CausalLM.from_pretrained(tmp_path)
    ids, mask, pos = _batch()
    with torch.no_grad():
        d = _max_diff(
            hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits, ours(ids, mask).logits, mask
        )
    assert d < 1e-4


def test_wrong_sizes_in_checkpoint_are_reported(tmp_path) -> None:
    _hf_model("llama-gqa").save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 40}))
    with pytest.raises(
        ValueError, match=r"mlp\.down_proj\.weight: checkpoint shape \(32, 48\) != config shape"
    ):
        CausalLM.from_pretrained(tmp_path)
