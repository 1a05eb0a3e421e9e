"""LoRA on the Ray backend: a dp=2 step (replicated adapters, summed gradients) equals the single-process
step, and a short dp=2 run trains and checkpoints the adapter."""

from __future__ import annotations

import json
import math
from functools import partial

import pytest
import torch
from safetensors.torch import load_file

from fuseflow.config import load_config
from fuseflow.controller.cluster import LocalCluster
from fuseflow.controller.ray_backend import RayCluster
from fuseflow.data.batch import Batch
from fuseflow.data.tokenizer import load_tokenizer
from fuseflow.models import CausalLM, ModelConfig
from fuseflow.runner import train
from fuseflow.tasks import make_task
from fuseflow.telemetry.metrics import read_metrics
from fuseflow.workers.actor import ActorWorker
from fuseflow.workers.build import RoleContext, build_actor
from ray_fixtures import ray_cluster  # noqa: F401 - module-scoped fixture

pytestmark = pytest.mark.usefixtures("ray_cluster")
LORA = ["model.lora.enabled=true", "model.lora.rank=4", "model.lora.alpha=8"]


def _batch(n: int, vocab: int) -> Batch:
    g = torch.Generator().manual_seed(0)
    tp, tr = 5, 6
    rmask = (torch.arange(tr) < torch.tensor([1 + (3 * i) % tr for i in range(n)])[:, None]).float()
    attn = torch.cat([torch.ones(n, tp, dtype=torch.long), rmask.long()], dim=1)
    return Batch({"input_ids": torch.randint(1, vocab, (n, tp + tr), generator=g), "attention_mask": attn,
                  "response_mask": rmask, "advantages": torch.randn(n, tr, generator=g) * rmask},
                 {"uid": list(range(n)), "group_id": [i // 4 for i in range(n)]})


def test_one_lora_dp2_step_equals_the_single_process_step(tmp_path):
    base = ["trainer.prompts_per_step=3", "algorithm.group_size=4", "trainer.mini_batch_size=12",
            "trainer.micro_batch_size=2", "trainer.epochs=1", "algorithm.kl_in_reward=false",
            "algorithm.kl_coef=0.1", *LORA]
    cfg = load_config("default", base)
    tok = load_tokenizer(None)
    ref = tmp_path / "ref"
    CausalLM.from_config(ModelConfig.preset("tiny", vocab_size=len(tok)), seed=0).save_pretrained(ref)
    ctx = RoleContext(cfg, ref, None, make_task(cfg.task))
    lactor = LocalCluster().group("actor", ActorWorker, partial(build_actor, ctx))
    placement = load_config("default", [*base, "backend=ray", "actor.dp=2",
                                        "pools.main.cpus_per_worker=0.5"]).resolved_placement()
    cluster = RayCluster(placement, start_timeout_s=120, collective_timeout_s=60)
    try:
        ractor = cluster.group("actor", ActorWorker, partial(build_actor, ctx))
        batch = _batch(12, len(tok))
        batch["old_logprobs"] = lactor.compute_logprobs(batch)
        batch["behavior_logprobs"] = batch["old_logprobs"]
        batch["ref_logprobs"] = batch["old_logprobs"] - 0.05
        results = {}
        for name, actor in (("local", lactor), ("ray", ractor)):
            results[name] = actor.update(batch, 1e-2, 0.1, seed=3)
            actor.save(str(tmp_path / name))
        for k, v in results["local"].items():
            assert results["ray"][k] == pytest.approx(v, rel=1e-4, abs=1e-6), k
        a = load_file(str(tmp_path / "local/actor/adapter_model.safetensors"))
        b = load_file(str(tmp_path / "ray/actor/adapter_model.safetensors"))
        assert a.keys() == b.keys()
        assert max(float(v.abs().max()) for k, v in a.items() if "lora_B" in k) > 5e-3  # Adam's step ~ lr
        for k in a:  # each rank stepped on the summed gradient: the whole batch's. Adam's first step is
            # about lr * sign(g), so a near-zero gradient turns summation-order noise into a visible
            # difference: allow 2e-4, 50x below the step (the moments below are compared tightly).
            assert torch.allclose(a[k], b[k], atol=2e-4), (k, float((a[k] - b[k]).abs().max()))
        oa, ob = load_file(str(tmp_path / "local/optim_actor.safetensors")), load_file(str(tmp_path / "ray/optim_actor.safetensors"))
        assert oa.keys() == ob.keys() and all(torch.allclose(oa[k], ob[k], rtol=1e-3, atol=1e-8) for k in oa)
    finally:
        cluster.shutdown()


def test_lora_dp2_run_trains_and_saves_the_adapter(tmp_path, sft_cache):
    tiny = ["sft.max_steps=20", "sft.eval_every=10", "sft.eval_size=10", "task.eval_size=10",
            "trainer.prompts_per_step=4", "algorithm.group_size=4", "trainer.mini_batch_size=8",
            "trainer.micro_batch_size=4", "trainer.eval_size=8", "trainer.eval_every=2", "trainer.save_every=1",
            "trainer.epochs=1", "trainer.steps=2", "trainer.lr=2e-2", "algorithm.kl_coef=0.05",
            "algorithm.kl_in_reward=false"]
    data = tmp_path / "data.jsonl"  # reward = response length / 8: nonzero advantages from the first step
    data.write_text("".join(json.dumps({"prompt": f"q{i}=", "answer": str(i % 10), "response": str(i % 10)}) + "\n"
                            for i in range(40)))
    (tmp_path / "rw.py").write_text("def score(prompt, response, answer):\n    return len(response) / 8.0\n")
    tiny += ["task.name=file", f"task.path={data}", f"task.reward_fn={tmp_path / 'rw.py'}:score"]
    run = tmp_path / "run"
    train(load_config("default", [*tiny, *LORA, f"cache_dir={sft_cache}", "backend=ray", "actor.dp=2",
                                  "pools.main.cpus_per_worker=0.5"]), run)
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["actor/pg_loss"]) and r["actor/grad_norm"] > 0 for r in rows)
    assert rows[-1]["kl/ref_k3"] > 0  # the reference (the frozen base) differs from the trained policy
    assert rows[-1]["rollout/logprob_diff_max"] < 1e-4  # the engine's adapted forward matches training's
    ckpt = run / "checkpoints/step_2"
    assert (ckpt / "actor/adapter_model.safetensors").is_file() and not (ckpt / "actor/model.safetensors").exists()
