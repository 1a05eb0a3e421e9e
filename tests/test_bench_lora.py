"""`fuseflow bench lora` measures what it names: two processes, the same batch, adapters-only optimizer state."""

from __future__ import annotations

import pytest

from fuseflow.bench.lora import run_lora_bench
from fuseflow.data.tokenizer import load_tokenizer
from fuseflow.models import CausalLM, ModelConfig

pytest.importorskip("peft")


@pytest.mark.slow  # two spawned processes importing torch: ~30 s alone, minutes on a busy machine
def test_bench_lora_on_a_tiny_model(tmp_path):
    cfg = ModelConfig.preset("tiny", vocab_size=len(load_tokenizer(None)))
    CausalLM.from_config(cfg, seed=0).save_pretrained(tmp_path / "m")
    r = run_lora_bench(str(tmp_path / "m"), rows=4, prompt_len=4, response_len=4, steps=1, threads=1, rank=2,
                       engine_prompts=2, engine_tokens=4, repeats=1, log=lambda *_: None, group_size=2)
    assert r["settings"]["group_size"] == 2
    full, lora = r["variants"]["full"], r["variants"]["lora"]
    n = cfg.num_hidden_layers
    h, kv, i = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim, cfg.intermediate_size
    q = cfg.num_attention_heads * cfg.head_dim
    # rank 2 on q, k, v, o, gate, up, down: A (2, in) + B (out, 2) per module, counted by hand
    per_layer = 2 * ((h + q) + (h + kv) + (h + kv) + (q + h) + (h + i) + (h + i) + (i + h))
    assert lora["trainable_params"] == n * per_layer
    assert full["trainable_params"] == full["total_params"] == CausalLM.from_config(cfg).num_parameters()
    # Adam keeps two fp32 moments (and a scalar step) per trainable tensor
    assert lora["optimizer_state_mb"] == pytest.approx(2 * 4 * n * per_layer / 2**20, rel=0.01)
    assert full["optimizer_state_mb"] == pytest.approx(2 * 4 * full["total_params"] / 2**20, rel=0.01)
    assert lora["reference_shares_base"] and not full["reference_shares_base"]
    for v in (full, lora):
        assert v["peak_rss_mb"] >= v["rss_after_build_mb"] > v["rss_after_imports_mb"] > 0
    assert set(r["engine"]["tokens_per_second"]) == {"base", "lora_on_the_fly", "merged_copy"}
    assert all(t > 0 for t in r["engine"]["tokens_per_second"].values())
