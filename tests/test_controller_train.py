"""The trainer on a local 2-CPU Ray cluster: PPO at dp=2 (colocated and split), dp=1 equals local,
one dp=2 optimizer step equals the single-process step, and a killed worker ends the run clearly."""

import json
import math
import threading
import time
from functools import partial

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from fuseflow.checkpoint import latest_checkpoint
from fuseflow.cli import app
from fuseflow.config import load_config, load_run_config
from fuseflow.controller.cluster import LocalCluster
from fuseflow.controller.group import WorkerFailure
from fuseflow.controller.ray_backend import RayCluster
from fuseflow.data.batch import Batch
from fuseflow.data.tokenizer import load_tokenizer
from fuseflow.models import CausalLM, ModelConfig
from fuseflow.runner import train
from fuseflow.tasks import make_task
from fuseflow.telemetry.metrics import read_metrics
from fuseflow.workers.actor import ActorWorker
from fuseflow.workers.build import RoleContext, build_actor, build_critic
from fuseflow.workers.critic import CriticWorker
from ray_fixtures import ray_cluster  # noqa: F401 - module-scoped fixture

pytestmark = pytest.mark.usefixtures("ray_cluster")

# Tiny and quick: a short SFT (cached for the session), 4 prompts x 4 samples per step, no periodic eval.
TINY = ["sft.max_steps=20", "sft.eval_every=10", "sft.eval_size=10", "task.eval_size=10", "trainer.prompts_per_step=4",
        "algorithm.group_size=4", "trainer.mini_batch_size=8", "trainer.micro_batch_size=4", "trainer.eval_size=8",
        "trainer.eval_every=100", "trainer.save_every=1", "trainer.epochs=1"]


def _file_task(tmp_path):
    """Reward = response length / 8: every sample scores differently, so advantages and losses are nonzero."""
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i}=", "answer": str(i % 10), "response": str(i % 10)}) + "\n"
                            for i in range(40)))
    (tmp_path / "rw.py").write_text("def score(prompt, response, answer):\n    return len(response) / 8.0\n")
    return ["task.name=file", f"task.path={data}", f"task.reward_fn={tmp_path / 'rw.py'}:score"]


def _comparable(rows):
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/"))} for r in rows]


@pytest.mark.parametrize("placement", ["colocated", "split"])
def test_ppo_dp2_three_steps(tmp_path, sft_cache, placement):
    # The fixture's cluster has 2 CPU slots: two pools of two workers take half a slot each.
    split = (["placement.critic=critic", "pools.main.cpus_per_worker=0.5", "pools.critic.cpus_per_worker=0.5"]
             if placement == "split" else [])
    run = tmp_path / "run"
    result = CliRunner().invoke(app, ["train", "--output", str(run), *TINY, *_file_task(tmp_path), f"cache_dir={sft_cache}",
                                      "algorithm.name=ppo", "backend=ray", "actor.dp=2", "critic.dp=2",
                                      "trainer.steps=3", *split])
    assert result.exit_code == 0, result.output
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for key in ("actor/pg_loss", "actor/grad_norm", "critic/loss", "critic/grad_norm", "time/worker_compute"):
        assert all(math.isfinite(r[key]) for r in rows), key
    assert all(r["critic/grad_norm"] > 0 and r["actor/grad_norm"] > 0 for r in rows)  # real gradients flowed
    ckpt = run / "checkpoints/step_3"
    ref, actor = load_file(str(run / "reference/model.safetensors")), load_file(str(ckpt / "actor/model.safetensors"))
    assert any(not torch.equal(ref[k], actor[k]) for k in ref)  # the gathered shards hold the trained weights
    assert CausalLM.from_pretrained(ckpt / "actor").config.vocab_size > 0
    for name in ("optim_actor.safetensors", "optim_critic.safetensors", "critic/model.safetensors"):
        assert (ckpt / name).exists(), name


def test_dp1_ray_gives_the_local_metrics(tmp_path, sft_cache):
    args = [*TINY, *_file_task(tmp_path), f"cache_dir={sft_cache}", "trainer.steps=2", "trainer.eval_every=2"]
    local = train(load_config("default", args), tmp_path / "local")
    remote = train(load_config("default", [*args, "backend=ray"]), tmp_path / "ray")
    a, b = _comparable(read_metrics(tmp_path / "local")), _comparable(read_metrics(tmp_path / "ray"))
    assert [sorted(r) for r in a] == [sorted(r) for r in b]
    for ra, rb in zip(a, b, strict=True):
        for k in ra:
            assert ra[k] == pytest.approx(rb[k], rel=1e-4, abs=1e-5), k
    assert len(local["evals"]) == len(remote["evals"]) == 2
    for ea, eb in zip(local["evals"], remote["evals"], strict=True):
        assert ea == pytest.approx(eb)


def _update_batch(n: int, vocab: int, lengths: list[int] | None = None) -> Batch:
    """``n`` sequences with uneven response lengths and random advantages/returns (a synthetic PPO batch)."""
    g = torch.Generator().manual_seed(0)
    tp, tr = 5, max(lengths or [6])
    lengths = torch.tensor(lengths or [1 + (3 * i) % tr for i in range(n)])
    rmask = (torch.arange(tr) < lengths[:, None]).float()  # (B, Tr)
    attn = torch.cat([torch.ones(n, tp, dtype=torch.long), rmask.long()], dim=1)  # (B, Tp+Tr)
    return Batch({"input_ids": torch.randint(1, vocab, (n, tp + tr), generator=g), "attention_mask": attn,
                  "response_mask": rmask, "advantages": torch.randn(n, tr, generator=g) * rmask,
                  "returns": torch.randn(n, tr, generator=g) * rmask},
                 {"uid": list(range(n)), "group_id": [i // 4 for i in range(n)]})


def test_one_dp2_optimizer_step_equals_the_single_process_step(tmp_path):
    # One optimizer step (mini-batch = the whole batch) accumulated over micro-batches of 2. A small
    # token budget gives ranks different numbers of length-sorted inference micro-batches (below).
    base = ["algorithm.name=ppo", "trainer.prompts_per_step=3", "algorithm.group_size=4", "trainer.mini_batch_size=12",
            "trainer.micro_batch_size=2", "trainer.epochs=1", "algorithm.kl_in_reward=false", "algorithm.kl_coef=0.1",
            "schedule.token_budget=32"]
    cfg = load_config("default", base)
    tok = load_tokenizer(None)
    ref = tmp_path / "ref"
    CausalLM.from_config(ModelConfig.preset("tiny", vocab_size=len(tok)), seed=0).save_pretrained(ref)
    ctx = RoleContext(cfg, ref, None, make_task(cfg.task))
    local = LocalCluster()
    lactor = local.group("actor", ActorWorker, partial(build_actor, ctx))
    lcritic = local.group("critic", CriticWorker, partial(build_critic, ctx))
    placement = load_config("default", [*base, "backend=ray", "actor.dp=2",
                                        "pools.main.cpus_per_worker=0.5"]).resolved_placement()
    cluster = RayCluster(placement, start_timeout_s=120, collective_timeout_s=60)
    try:
        ractor = cluster.group("actor", ActorWorker, partial(build_actor, ctx))
        rcritic = cluster.group("critic", CriticWorker, partial(build_critic, ctx))
        # Responses of 13, 5, 5, 5, 1, 1 tokens: the token-balanced split gives rank 0 {13, 5, 1} (two
        # micro-batches within 32 padded tokens) and rank 1 {5, 5, 1} (one). The sharded actor and
        # critic must still run the same number of forwards on both ranks, or they wait on each other.
        uneven = _update_batch(6, len(tok), lengths=[13, 5, 5, 5, 1, 1])
        m = uneven["response_mask"]  # outputs on padding depend on the micro-batch's width; compare real tokens
        assert torch.allclose(ractor.compute_logprobs(uneven) * m, lactor.compute_logprobs(uneven) * m, atol=1e-5)
        assert torch.allclose(rcritic.compute_values(uneven) * m, lcritic.compute_values(uneven) * m, atol=1e-5)
        batch = _update_batch(12, len(tok))
        batch["old_logprobs"] = lactor.compute_logprobs(batch)
        m = batch["response_mask"]
        assert torch.allclose(ractor.compute_logprobs(batch) * m, batch["old_logprobs"] * m, atol=1e-5)
        batch["ref_logprobs"] = batch["old_logprobs"] - 0.05
        batch["behavior_logprobs"] = batch["old_logprobs"]
        batch["values"] = lcritic.compute_values(batch)
        assert torch.allclose(rcritic.compute_values(batch) * m, batch["values"] * m, atol=1e-5)
        results = {}
        for name, actor, critic in (("local", lactor, lcritic), ("ray", ractor, rcritic)):
            metrics = actor.update(batch, 1e-3, 0.1, seed=3) | critic.update(batch, 1e-3, seed=3)
            actor.save(str(tmp_path / name))
            critic.save(str(tmp_path / name))
            results[name] = metrics
        for k, v in results["local"].items():
            assert results["ray"][k] == pytest.approx(v, rel=1e-4, abs=1e-6), k
        start = load_file(str(ref / "model.safetensors"))
        moved = max(float((start[k] - v).abs().max()) for k, v in load_file(
            str(tmp_path / "local/actor/model.safetensors")).items())
        assert moved > 5e-4  # Adam's first step moves weights by about lr = 1e-3
        for part in ("actor", "critic"):
            a = load_file(str(tmp_path / "local" / part / "model.safetensors"))
            b = load_file(str(tmp_path / "ray" / part / "model.safetensors"))
            for k in a:
                # Adam's first step is lr * g / (|g| + eps): an element with a near-zero gradient turns
                # summation-order noise into a visible difference, so allow 2e-5, 50x below the step.
                assert torch.allclose(a[k], b[k], atol=2e-5), (part, k, float((a[k] - b[k]).abs().max()))
        # The optimizer states match too, in the single-process layout (so a dp=2 run resumes at dp=1).
        oa, ob = load_file(str(tmp_path / "local/optim_actor.safetensors")), load_file(str(tmp_path / "ray/optim_actor.safetensors"))
        assert oa.keys() == ob.keys() and all(torch.allclose(oa[k], ob[k], rtol=1e-3, atol=1e-8) for k in oa)
    finally:
        cluster.shutdown()


def test_a_killed_worker_ends_the_run_naming_role_rank_and_checkpoint(tmp_path, sft_cache):
    import ray

    run = tmp_path / "run"
    cfg = load_config("default", [*TINY, *_file_task(tmp_path), f"cache_dir={sft_cache}", "algorithm.name=ppo",
                                  "backend=ray", "actor.dp=2", "trainer.steps=50", "ray.collective_timeout_s=30", "trainer.max_restarts=0",
                                  "pools.main.cpus_per_worker=0.5"])
    killed: dict[str, float] = {}

    def kill_after_first_checkpoint():
        while not (run / "checkpoints/latest").exists():
            time.sleep(0.2)
        name = next(n for n in ray.util.list_named_actors() if n.startswith(f"fuseflow-{run.name}-")
                    and n.endswith("-main-1"))
        killed["at"] = time.perf_counter()
        ray.kill(ray.get_actor(name), no_restart=True)

    threading.Thread(target=kill_after_first_checkpoint, daemon=True).start()
    with pytest.raises(WorkerFailure) as err:
        train(cfg, run)
    waited = time.perf_counter() - killed["at"]
    message = str(err.value)
    assert "rank 1 (pool main)" in message and "its process died" in message, message
    assert "last checkpoint: step_" in message and f"fuseflow train --resume {run}" in message, message
    assert waited < 30.0, waited  # within the collective timeout, not a hang
    assert not [n for n in ray.util.list_named_actors() if n.startswith(f"fuseflow-{run.name}-")]  # cleaned up
    # The advertised resume works: fresh workers load the gathered checkpoint (FSDP-sharded again).
    done = json.loads((latest_checkpoint(run) / "state.json").read_text())["step"]
    train(load_run_config(run, [f"trainer.steps={done + 1}"]), run, resume=True)
    assert [r["step"] for r in read_metrics(run)][-2:] == [done, done + 1]
