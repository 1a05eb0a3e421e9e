"""LoRA runs end to end: exact resume, adapter checkpoints, the shared frozen base, export, bad input."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from fuseflow.cli import app
from fuseflow.config import load_config
from fuseflow.controller.cluster import LocalCluster
from fuseflow.models import CausalLM
from fuseflow.models.lora import apply_lora, load_adapter, lora_layers, read_adapter_spec
from fuseflow.runner import train
from fuseflow.tasks import make_task
from fuseflow.telemetry.metrics import read_metrics
from fuseflow.workers.actor import ActorWorker, ReferenceWorker
from fuseflow.workers.build import RoleContext, build_actor, build_reference

peft = pytest.importorskip("peft")
runner = CliRunner()

# test_train_e2e's tiny run (so the session's SFT cache is shared: model.lora is not part of its key).
TINY = ["sft.max_steps=40", "sft.eval_every=20", "sft.eval_size=20", "task.train_size=400", "task.eval_size=20",
        "trainer.steps=4", "trainer.prompts_per_step=4", "algorithm.group_size=4", "trainer.mini_batch_size=8",
        "trainer.micro_batch_size=4", "trainer.eval_size=20", "trainer.eval_every=2", "trainer.save_every=1",
        "trainer.epochs=2"]
LORA = ["model.lora.enabled=true", "model.lora.rank=4", "model.lora.alpha=8", "trainer.lr=2e-2",
        "algorithm.kl_coef=0.05", "algorithm.kl_in_reward=false"]


def _comparable(rows):
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/"))} for r in rows]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, sft_cache):
    """An uninterrupted 4-step LoRA run (shared by the resume and export tests)."""
    cfg = load_config("default", [*TINY, f"cache_dir={sft_cache}", *LORA])
    run = tmp_path_factory.mktemp("lora") / "full"
    train(cfg, run)
    return cfg, run


def test_lora_resume_gives_the_same_metrics_and_adapter(lora_run, tmp_path):
    cfg, full = lora_run
    train(cfg, tmp_path / "cut", stop_after=2)
    train(cfg, tmp_path / "cut", resume=True)
    a, b = _comparable(read_metrics(full)), _comparable(read_metrics(tmp_path / "cut"))
    assert [r["step"] for r in b] == [1, 2, 3, 4] and a == b
    assert a[-1]["kl/ref_k3"] > 0 and a[-1]["actor/grad_norm"] > 0  # the adapters moved away from the base
    for name in ("actor/adapter_model.safetensors", "optim_actor.safetensors"):
        x, y = load_file(str(full / "checkpoints/step_4" / name)), load_file(str(tmp_path / "cut/checkpoints/step_4" / name))
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), name
    ckpt = full / "checkpoints/step_4"
    assert not (ckpt / "actor/model.safetensors").exists()  # the adapter only: the base is run/reference
    adapter = load_file(str(ckpt / "actor/adapter_model.safetensors"))
    optim = load_file(str(ckpt / "optim_actor.safetensors"))
    # Adam's moments of the adapters, nothing of the frozen base.
    moments = [v for k, v in optim.items() if k.endswith(("exp_avg", "exp_avg_sq"))]
    assert len(moments) == 2 * len(adapter) and sum(v.numel() for v in moments) == 2 * sum(
        v.numel() for v in adapter.values())


def test_the_reference_is_the_actors_frozen_base(lora_run):
    cfg, run = lora_run
    ctx = RoleContext(cfg, run / "reference", run / "checkpoints/step_4", make_task(cfg.task))
    cluster = LocalCluster()
    actor = cluster.group("actor", ActorWorker, lambda d: build_actor(ctx, d)).worker
    ref = cluster.group("reference", ReferenceWorker, lambda d: build_reference(ctx, d)).worker
    base = {p.data_ptr() for n, p in actor.model.named_parameters() if ".lora_" not in n}
    assert {p.data_ptr() for p in ref.model.parameters()} == base  # the same tensors: no second copy
    saved = CausalLM.from_pretrained(run / "reference")
    assert all(torch.equal(p, saved.state_dict()[n]) for n, p in ref.model.state_dict().items())
    assert sum(p.numel() for p in actor.optimizer.param_groups[0]["params"]) == sum(
        p.numel() for n, p in actor.model.named_parameters() if ".lora_" in n)


def test_export_writes_the_peft_adapter_and_the_merged_model(lora_run, tmp_path):
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    from fuseflow.data.tokenizer import load_tokenizer
    from fuseflow.rollout.base import RolloutRequest, SamplingParams
    from fuseflow.rollout.engine import Engine, EngineConfig

    cfg, run = lora_run
    ckpt = run / "checkpoints/step_4/actor"
    ours = apply_lora(CausalLM.from_pretrained(run / "reference"), read_adapter_spec(ckpt))
    load_adapter(ours, ckpt)
    ours.eval()
    assert any(p.abs().sum() > 0 for n, p in ours.named_parameters() if "lora_B" in n)
    tok = load_tokenizer(None)
    ids = torch.tensor([tok.encode("12+34=")])

    result = runner.invoke(app, ["export", str(run), str(tmp_path / "adapter"), "--check", "3"])
    assert result.exit_code == 0, result.output
    # peft on LlamaForCausalLM, and transformers' own adapter loading, decode as the engine does.
    assert "peft: 3/3 prompts give" in result.output and "transformers: 3/3 prompts give" in result.output
    assert json.loads((tmp_path / "adapter/adapter_config.json").read_text())["r"] == 4
    hf = LlamaForCausalLM.from_pretrained(str(run / "reference")).eval()
    with torch.no_grad():
        peft_logits = peft.PeftModel.from_pretrained(hf, str(tmp_path / "adapter")).eval()(input_ids=ids).logits
        assert torch.allclose(peft_logits, ours(ids).logits, atol=1e-5)

    result = runner.invoke(app, ["export", str(run), str(tmp_path / "merged"), "--merge", "--check", "3"])
    assert result.exit_code == 0, result.output
    assert "transformers: 3/3 prompts give the engine's greedy tokens" in result.output
    assert not (tmp_path / "merged/adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
    prompts = [tok.encode(p) for p in ("12+34=", "7+58=", "301+9=")]
    params = SamplingParams(greedy=True, max_new_tokens=8)
    engine = sorted(Engine(ours, EngineConfig(max_num_seqs=4)).generate(
        RolloutRequest(i, p, params) for i, p in enumerate(prompts)), key=lambda s: s.uid)
    for p, s in zip(prompts, engine, strict=True):
        with torch.no_grad():
            out = merged.generate(torch.tensor([p]), max_new_tokens=len(s.response_ids), do_sample=False,
                                  eos_token_id=None, pad_token_id=0)
        assert out[0, len(p):].tolist() == s.response_ids


@pytest.mark.parametrize("override, message", [
    ("model.lora.rank=0", "model.lora: rank=0 must be a positive integer"),
    ("model.lora.rank=-2", "model.lora: rank=-2 must be a positive integer"),
    ("model.lora.targets=[q_proj,qkv]", "model.lora: targets: 'qkv' matches no module of the decoder; choose from q_proj"),
    ("model.lora.targets=[]", "model.lora: targets is empty"),
    ("rollout.backend=hf", "rollout.backend=hf keeps a second full copy"),
])
def test_bad_lora_settings_are_one_line(override, message):
    result = runner.invoke(app, ["config", "show", "model.lora.enabled=true", override])
    assert result.exit_code == 2
    assert message in result.output and len(result.output.strip().splitlines()) == 1, result.output


def test_lora_settings_reach_the_adapters():
    cfg = load_config("default", ["model.lora.enabled=true", "model.lora.rank=2", "model.lora.alpha=6",
                                  "model.lora.dropout=0.1", "model.lora.targets=[v_proj,down_proj]"])
    from fuseflow.models import ModelConfig
    from fuseflow.workers.build import lora_spec_of

    spec = lora_spec_of(cfg)
    model = apply_lora(CausalLM.from_config(ModelConfig.preset("tiny", vocab_size=16)), spec)
    layers = lora_layers(model)
    assert {n.rsplit(".", 1)[-1] for n in layers} == {"v_proj", "down_proj"}
    layer = next(iter(layers.values()))
    assert layer.r["default"] == 2 and layer.scaling["default"] == 3.0 and layer.lora_dropout["default"].p == 0.1
    assert lora_spec_of(load_config("default", [])) is None


def test_export_check_notices_other_weights(lora_run, tmp_path):
    """--check compares tokens for real: a merged model with perturbed weights decodes differently."""
    from safetensors.torch import save_file

    from fuseflow.checkpoint import find_checkpoint
    from fuseflow.export_check import check_export

    _, run = lora_run
    out = tmp_path / "merged"
    assert runner.invoke(app, ["export", str(run), str(out), "--merge"]).exit_code == 0
    weights = load_file(str(out / "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    noisy = {k: v + 0.5 * torch.randn(v.shape, generator=g) for k, v in weights.items()}
    save_file(noisy, str(out / "model.safetensors"), metadata={"format": "pt"})
    r = check_export(run, find_checkpoint(run, None), out, 4, log=lambda *_: None)
    assert r["prompts"] == 4 and r["transformers"] < 4
    result = runner.invoke(app, ["export", str(run), str(tmp_path / "again"), "--check", "-1"])
    assert result.exit_code == 2 and "--check -1" in result.output and not (tmp_path / "again").exists()
