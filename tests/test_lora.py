"""LoRA on fuseflow's decoder: peft's math and file format, frozen base, adapters-only optimizer, engine."""

from __future__ import annotations

import pytest
import torch

from fuseflow.config import load_config
from fuseflow.data.batch import Batch
from fuseflow.models import CausalLM, ModelConfig
from fuseflow.models.lora import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    LoraSpec,
    adapter_state_dict,
    apply_lora,
    base_view,
    load_adapter,
    lora_layers,
    merged_model,
    read_adapter_spec,
    save_adapter,
)

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

# SmolLM2's shape in miniature: GQA (4 heads over 2 kv heads) and tied embeddings.
CFG = ModelConfig.preset("tiny", vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
SPEC = LoraSpec(rank=4, alpha=12.0, dropout=0.0)
IDS = torch.tensor([[3, 9, 4, 17, 5, 30, 2], [8, 1, 22, 40, 6, 11, 7]])


def _adapted(seed: int = 0, spec: LoraSpec = SPEC, b_scale: float = 0.3) -> CausalLM:
    """A LoRA model whose B is random (not zero), so the adapters change the output."""
    model = apply_lora(CausalLM.from_config(CFG, seed=0), spec, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for layer in lora_layers(model).values():
            b = layer.lora_B["default"].weight
            b.copy_(torch.randn(b.shape, generator=g) * b_scale)
    return model.eval()


def test_adapters_start_as_the_identity_and_follow_peft_conventions():
    base = CausalLM.from_config(CFG, seed=0).eval()
    before = base(IDS).logits
    model = apply_lora(base, SPEC, seed=0).eval()
    assert torch.equal(model(IDS).logits, before)  # B = 0: exactly the base model
    layers = lora_layers(model)
    assert len(layers) == 7 * CFG.num_hidden_layers  # attention and MLP projections by default
    q = layers["model.layers.0.self_attn.q_proj"]
    assert q.lora_A["default"].weight.shape == (4, 32) and q.lora_B["default"].weight.shape == (32, 4)
    assert not q.lora_B["default"].weight.any() and q.lora_A["default"].weight.any()
    assert q.scaling["default"] == 12.0 / 4
    names = set(adapter_state_dict(model))
    assert "base_model.model.model.layers.1.mlp.down_proj.lora_A.weight" in names
    assert len(names) == 2 * len(layers)
    # The same seed gives the same adapters; the global RNG is left untouched.
    fresh = CausalLM.from_config(CFG, seed=0)
    state = torch.get_rng_state()
    again = apply_lora(fresh, SPEC, seed=0)
    assert torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(a, b) for a, b in zip(adapter_state_dict(model).values(),
                                                  adapter_state_dict(again).values(), strict=True))


def test_forward_is_base_plus_scaled_low_rank_product():
    model = _adapted()
    layer = lora_layers(model)["model.layers.1.mlp.up_proj"]
    x = torch.randn(5, 32)
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    w = layer.base_layer.weight
    naive = torch.zeros(5, w.shape[0])
    for i in range(5):  # y_i = W x_i + (alpha / r) * B (A x_i), one row at a time
        naive[i] = w @ x[i] + (12.0 / 4) * (b @ (a @ x[i]))
    assert torch.allclose(layer(x), naive, atol=1e-5)


def _ops(fn):
    """(result, names of the torch functions ``fn`` called)."""
    seen = []

    class Spy(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    with Spy():
        out = fn()
    return out, seen


def test_scoring_forward_uses_the_merged_product_and_training_keeps_peft():
    model = _adapted()
    layer = lora_layers(model)["model.layers.1.mlp.up_proj"]  # in 32, out 64: merged from 22 rows up
    a, b, w = layer.lora_A["default"].weight, layer.lora_B["default"].weight, layer.base_layer.weight
    x = torch.randn(40, 32)
    naive = x @ w.T + 3.0 * (x @ a.T) @ b.T
    with torch.no_grad():
        scored, ops = _ops(lambda: layer(x))
    torch.testing.assert_close(scored, naive, rtol=1e-5, atol=1e-5)
    assert "addmm" in ops  # W + s B A, formed for the one product
    with torch.no_grad():
        few, ops = _ops(lambda: layer(x[:8]))  # 8 rows: the thin products are cheaper
    torch.testing.assert_close(few, naive[:8], rtol=1e-5, atol=1e-5)
    assert "addmm" not in ops
    trained, ops = _ops(lambda: layer(x))  # autograd on: peft's path, gradients reach A and B
    assert "addmm" not in ops
    trained.square().sum().backward()
    assert a.grad.abs().sum() > 0 and b.grad.abs().sum() > 0 and w.grad is None
    # The whole model: the same logits either way, on a batch big enough for every layer to merge.
    ids = torch.randint(0, CFG.vocab_size, (4, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        scored = model(ids).logits
    torch.testing.assert_close(scored, model(ids).logits.detach(), rtol=1e-5, atol=1e-5)


def test_merged_weights_are_w_plus_scale_b_a_and_give_the_same_logits():
    model = _adapted()
    merged = merged_model(model).eval()
    for name, layer in lora_layers(model).items():
        w = layer.base_layer.weight
        want = w + 3.0 * layer.lora_B["default"].weight @ layer.lora_A["default"].weight
        got = merged.get_submodule(name).weight
        assert torch.allclose(got, want, atol=1e-6), name
        assert got.data_ptr() != w.data_ptr()  # a copy: the base is untouched
    assert merged.lm_head.weight is merged.model.embed_tokens.weight  # still tied
    assert torch.allclose(merged(IDS).logits, model(IDS).logits, atol=1e-5)
    assert not (merged(IDS).logits - CausalLM.from_config(CFG, seed=0)(IDS).logits).abs().max() < 1e-3


def test_only_adapters_get_gradients_and_the_base_view_shares_the_frozen_tensors():
    model = _adapted().train()
    model(IDS).logits.logsumexp(-1).mean().backward()
    for name, p in model.named_parameters():
        if ".lora_" in name:
            assert p.requires_grad and p.grad is not None and p.grad.abs().sum() > 0, name
        else:
            assert not p.requires_grad and p.grad is None, name
    view = base_view(model)
    base = CausalLM.from_config(CFG, seed=0).eval()
    assert torch.equal(view(IDS).logits, base(IDS).logits)  # the base, without the adapters
    ptrs = {p.data_ptr() for n, p in model.named_parameters() if ".lora_" not in n}
    assert {p.data_ptr() for p in view.parameters()} == ptrs  # the same storage: no second copy


def test_saved_adapter_loads_back_and_in_peft_with_the_same_logits(tmp_path):
    model = _adapted(seed=3)
    base_dir = tmp_path / "base"
    CausalLM.from_config(CFG, seed=0).save_pretrained(base_dir)
    save_adapter(model, tmp_path / "adapter", base_path=base_dir)
    assert (tmp_path / "adapter" / ADAPTER_WEIGHTS).is_file() and (tmp_path / "adapter" / ADAPTER_CONFIG).is_file()
    assert read_adapter_spec(tmp_path / "adapter") == SPEC
    other = apply_lora(CausalLM.from_pretrained(base_dir), SPEC, seed=9).eval()
    load_adapter(other, tmp_path / "adapter")
    assert torch.equal(other(IDS).logits, model(IDS).logits)

    hf = transformers.LlamaForCausalLM.from_pretrained(str(base_dir)).eval()
    peft_model = peft.PeftModel.from_pretrained(hf, str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        theirs = peft_model(input_ids=IDS).logits
    assert torch.allclose(theirs, model(IDS).logits, atol=1e-5)
    with torch.no_grad(), peft_model.disable_adapter():
        assert not torch.allclose(peft_model(input_ids=IDS).logits, theirs, atol=1e-3)  # the adapter mattered


def test_a_wrong_adapter_is_reported(tmp_path):
    save_adapter(_adapted(), tmp_path / "a")
    narrow = apply_lora(CausalLM.from_config(CFG, seed=0), LoraSpec(4, 12.0, targets=("q_proj",)))
    with pytest.raises(ValueError, match="does not match the model's LoRA targets"):
        load_adapter(narrow, tmp_path / "a")
    with pytest.raises(ValueError, match="'qproj' matches no module"):
        apply_lora(CausalLM.from_config(CFG, seed=0), LoraSpec(4, 8.0, targets=("qproj",)))


def test_engine_runs_the_adapted_weights_without_merging():
    from fuseflow.rollout.base import RolloutRequest, SamplingParams
    from fuseflow.rollout.engine import Engine, EngineConfig

    model = _adapted(seed=5, b_scale=1.0)
    merged = merged_model(model).eval()
    before = {n: p.clone() for n, p in model.named_parameters()}
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=4)
    reqs = [RolloutRequest(i, [1 + i, 5, 9 + i], params) for i in range(4)]

    def run(m):
        return sorted(Engine(m, EngineConfig(max_num_seqs=4)).generate(reqs), key=lambda s: s.uid)

    ours, theirs, plain = run(model), run(merged), run(base_view(model))
    for a, b in zip(ours, theirs, strict=True):
        assert a.response_ids == b.response_ids
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)
    assert [s.response_ids for s in ours] != [s.response_ids for s in plain]  # the adapters are applied
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # nothing merged in place


def _update_batch(n: int = 8, tp: int = 4, tr: int = 5) -> Batch:
    g = torch.Generator().manual_seed(0)
    rmask = (torch.arange(tr) < torch.tensor([1 + i % tr for i in range(n)])[:, None]).float()
    attn = torch.cat([torch.ones(n, tp, dtype=torch.long), rmask.long()], dim=1)
    lp = -torch.rand(n, tr, generator=g) * rmask
    return Batch({"input_ids": torch.randint(1, 48, (n, tp + tr), generator=g), "attention_mask": attn,
                  "response_mask": rmask, "advantages": torch.randn(n, tr, generator=g) * rmask,
                  "old_logprobs": lp, "behavior_logprobs": lp, "ref_logprobs": lp},
                 {"uid": list(range(n)), "group_id": [i // 4 for i in range(n)]})


def test_actor_optimizer_holds_only_the_adapters():
    from fuseflow.workers.actor import ActorWorker

    cfg = load_config("default", ["trainer.mini_batch_size=8", "trainer.micro_batch_size=4", "trainer.epochs=1",
                                  "algorithm.kl_coef=0.1", "algorithm.kl_in_reward=false"])
    model = apply_lora(CausalLM.from_config(CFG, seed=0), SPEC, seed=0)
    frozen = {n: p.clone() for n, p in model.named_parameters() if not p.requires_grad}
    worker = ActorWorker(model, None, torch.device("cpu"), torch.float32, cfg.algorithm, cfg.trainer, 1.0, 5)
    worker.update(_update_batch(), 1e-2, 0.1, seed=0)
    adapters = [p for n, p in model.named_parameters() if ".lora_" in n]
    state = worker.optimizer.state_dict()["state"]
    assert len(state) == len(adapters) == 2 * 7 * CFG.num_hidden_layers
    n_state = sum(v.numel() for st in state.values() for k, v in st.items() if k in ("exp_avg", "exp_avg_sq"))
    assert n_state == 2 * sum(p.numel() for p in adapters)  # Adam's two moments of the adapters, nothing else
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)
    assert any(p.abs().sum() > 0 for n, p in model.named_parameters() if "lora_B" in n)  # B moved off zero
