"""actor.pp / critic.pp in a run: the training step on 2 stage processes equals the role workers' step.

Each test runs `RLTrainer` steps on a tiny model (no SFT: a model written here) with pp=1 and
pp=2 on the same seed and compares the actor's and critic's weights after the update (the
pipeline hands them back to the role workers, so these are what generation and
checkpoints see), the metrics, and what a dying stage process reports.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from fuseflow.config import load_config
from fuseflow.controller.group import WorkerFailure
from fuseflow.data.tokenizer import build_char_tokenizer
from fuseflow.models import CausalLM, ModelConfig
from fuseflow.trainer import RLTrainer
from spy import record_batches


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    """A tiny random model, a file task and a reward that varies with the response (non-zero advantages)."""
    root = tmp_path_factory.mktemp("pp-model")
    torch.manual_seed(0)
    CausalLM.from_config(ModelConfig.preset("tiny", vocab_size=len(build_char_tokenizer())), seed=0).save_pretrained(root / "model")
    rows = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(16)]
    (root / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "rw.py").write_text("def score(prompt, response, answer):\n    return (sum(map(ord, response)) % 3) / 2.0\n")
    return root / "model"


def run(tmp_path, model_path, algo: str, extra: list[str], steps: int = 1, then_die_at=None):
    """Train `steps` steps; returns (per-step metrics, actor weights, critic weights or None, failure).

    With `then_die_at=(rank, action)` one more step runs in which that stage process is killed
    (SIGKILL) before that action; `failure` is the WorkerFailure it raised.
    """
    cfg = load_config("default", [
        "sft.enabled=false", f"model.path={model_path}", "task.name=file", f"task.path={model_path.parent}/data.jsonl",
        f"task.reward_fn={model_path.parent}/rw.py:score", f"algorithm.name={algo}", "algorithm.group_size=4",
        "trainer.prompts_per_step=2", "trainer.mini_batch_size=4", "trainer.micro_batch_size=2",
        "trainer.epochs=2", "model.max_response_len=8", "trainer.eval_size=4", "task.eval_size=4",
        f"trainer.steps={steps + 1}", "trainer.save_every=100", "trainer.eval_every=100", "trainer.lr=1e-3",
        "schedule.pipeline_solver_seconds=2", *extra])
    tr = RLTrainer(cfg, tmp_path / "_".join([algo, *extra]).replace("=", "-"), log=lambda *_: None)
    failure, batches = None, record_batches(tr)
    try:
        metrics = [tr.step(s) for s in range(1, steps + 1)]
        metrics[0]["batches"] = batches
        actor = copy.deepcopy(tr.actor.trained_state())  # weights, optimizer state, parameter names
        critic = copy.deepcopy(tr.critics[0].trained_state()) if tr.critics else None
        if then_die_at is not None:
            tr.pipeline.die_at = then_die_at
            with pytest.raises(WorkerFailure) as err:
                tr.step(steps + 1)
            failure = err.value
    finally:
        tr.close()
    return metrics, actor, critic, failure


def same_weights(got, want):
    """Weights within 1e-5, and the optimizer state handed back (what a checkpoint saves) alike."""
    names = want["names"]
    (got, got_opt), (want, want_opt) = (got["weights"], got["optimizer"]), (want["weights"], want["optimizer"])
    assert set(got_opt["state"]) == set(want_opt["state"]) == set(range(len(names)))  # one Adam state each
    for i, st in want_opt["state"].items():
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.allclose(got_opt["state"][i][k], st[k], atol=1e-6, rtol=1e-4), (i, k)
    assert set(got) == set(want)
    for k in want:
        assert torch.allclose(got[k], want[k], atol=1e-5, rtol=0), f"{k}: max diff {(got[k] - want[k]).abs().max()}"


def same_metrics(got, want):
    for g, w in zip(got, want, strict=True):
        for k, v in w.items():
            if k == "batches":
                continue
            if k.startswith(("actor/", "critic/", "reward/", "rollout/")):
                assert g[k] == pytest.approx(v, rel=1e-4, abs=1e-5), k


def test_ppo_step_with_pp2_equals_pp1_and_a_dead_stage_is_one_line(tmp_path, model_path):
    """One PPO step (2 epochs x 2 mini-batches x 2 micro-batches, fused schedule) on 2 stages equals the
    role workers' step; in the next step stage process 1 is killed mid-step."""
    m1, a1, c1, _ = run(tmp_path, model_path, "ppo", [])
    m2, a2, c2, failure = run(tmp_path, model_path, "ppo", ["actor.pp=2", "critic.pp=2"], then_die_at=(1, 2))
    start = CausalLM.from_pretrained(model_path).state_dict()
    assert max(float((a1["weights"][k] - start[k]).abs().max()) for k in start) > 1e-4  # the weights moved
    same_weights(a2, a1)
    same_weights(c2, c1)
    assert float(c1["weights"]["value_head.weight"].abs().max()) > 1e-4  # the critic's zero head moved too
    same_metrics(m2, m1)
    assert m2[0]["pipeline/optimizer_steps"] == 4.0  # 2 epochs x 2 mini-batches, each one fused step
    text = str(failure)
    assert "\n" not in text
    assert "failed in actor.pipeline_update: stage process rank 1 (actor stage 1, critic stage 0, at action" in text
    assert "died (exit code -9)" in text, text


def test_grpo_steps_with_pp2_equal_pp1(tmp_path, model_path):
    """GRPO (no critic): the actor alone in 1F1B; two steps, so the second starts from handed-back state."""
    m1, a1, _, _ = run(tmp_path, model_path, "grpo", [], steps=2)
    m2, a2, c2, _ = run(tmp_path, model_path, "grpo", ["actor.pp=2"], steps=2)
    assert c2 is None
    same_weights(a2, a1)
    same_metrics(m2, m1)


@pytest.mark.slow  # 4 stage processes (training and generation): ~20 s at load 5
def test_grpo_with_pp2_and_pipelined_generation_equals_pp1_on_the_engine(tmp_path, model_path):
    """The actor generates on 2 other stage processes with 2 batches in flight; two steps, so the second
    generates with the weights pushed after the first update."""
    m1, a1, _, _ = run(tmp_path, model_path, "grpo", [], steps=2)
    m2, a2, c2, _ = run(tmp_path, model_path, "grpo", ["actor.pp=2", "rollout.pipeline_stages=2"], steps=2)
    assert c2 is None
    for b1, b2 in zip(m1[0]["batches"], m2[0]["batches"], strict=True):  # the samples are token-identical
        assert torch.equal(b1["input_ids"], b2["input_ids"]) and torch.equal(b1["response_mask"], b2["response_mask"])
        assert torch.allclose(b1["behavior_logprobs"], b2["behavior_logprobs"], atol=1e-5)
        assert b1.meta["finish_reason"] == b2.meta["finish_reason"]
    assert not torch.equal(m1[0]["batches"][0]["input_ids"], m1[0]["batches"][1]["input_ids"])
    same_weights(a2, a1)
    same_metrics(m2, m1)


def held_peak(plan) -> int:
    """Most micro-batches (of both models) a device holds between a forward and its backward."""
    peak = 0
    for seq in plan.order:
        held = 0
        for t in seq:
            held += -1 if t.backward else 1
            peak = max(peak, held)
    return peak


def test_the_run_plans_with_the_configured_solver_time_and_memory_cap():
    """`schedule.pipeline_memory_cap` reaches the solver as a hard cap; plans are cached per count pair."""
    from fuseflow.schedule.pipeline.roles import PipelineRoles

    def roles(cap):
        cfg = load_config("default", ["algorithm.name=ppo", "actor.pp=2", "critic.pp=2",
                                      "schedule.pipeline_solver_seconds=1",
                                      *([f"schedule.pipeline_memory_cap={cap}"] if cap else [])])
        r = PipelineRoles.__new__(PipelineRoles)  # the planning part only: no stage processes
        r.cfg, r.plans, r.cost = cfg, {}, {"A": 12, "B": 10}
        return r

    free, capped = roles(None), roles(1)
    plan = free.plan({"A": 4, "B": 4})
    assert free.plan({"A": 4, "B": 4}) is plan and held_peak(plan) >= 2  # overlap holds several
    assert held_peak(capped.plan({"A": 4, "B": 4})) == 1  # capped: one micro-batch at a time
    assert free.plan({"A": 3, "B": 5}).micro_batches == {"A": 3, "B": 5}
