"""Reward data parallelism (``reward.dp``): the config surface, splitting ``score`` over k workers and
putting every ``RewardOutput`` field back in sample order, in-process and on a local Ray cluster."""

from __future__ import annotations

import dataclasses
import time
from functools import partial

import pytest
import torch

from controller_fakes import InlineGroup
from fuseflow.config import ConfigError, load_config
from fuseflow.controller.dispatch import balanced_split, restore, shard
from fuseflow.controller.group import LocalGroup
from fuseflow.controller.worker import DistInfo, dispatch_of, register
from fuseflow.data.tokenizer import build_char_tokenizer
from fuseflow.models import ModelConfig, ValueModel
from fuseflow.reward_model import RewardModel
from fuseflow.tasks import Prompt, SafeArithTask
from fuseflow.workers.reward import RewardOutput, RewardWorker
from ray_fixtures import ray_cluster  # noqa: F401 - module-scoped fixture, used by the Ray test only

FIELDS = ("scores", "correct", "fn_scores", "rm_scores", "costs")


# ------------------------------------------------------------------------------ config
def test_reward_dp_defaults_to_one_and_is_part_of_role_dp():
    cfg = load_config("default")
    assert cfg.reward.dp == 1 and cfg.role_dp()["reward"] == 1
    # Unlike reference and critic, the reward does not follow actor.dp.
    wide = load_config("default", ["backend=ray", "actor.dp=2"])
    assert wide.role_dp() == {"actor": 2, "reference": 2, "critic": 2, "reward": 1}
    assert load_config("default", ["backend=ray", "reward.dp=2", "actor.dp=2"]).role_dp()["reward"] == 2


def test_a_reward_pool_is_sized_by_reward_dp():
    # A pool not listed in `pools` gets reward.dp 1-CPU workers; the training pool keeps actor.dp.
    p = load_config("default", ["backend=ray", "reward.dp=3", "placement.reward=rm"]).resolved_placement()
    assert {n: v.size for n, v in p.pools.items()} == {"main": 1, "rm": 3}
    assert [r for r, q in p.role_pool.items() if q == "rm"] == ["reward"] and p.dp["reward"] == 3 and p.cpus_needed() == 4.0
    # Colocated with a dp=2 actor: the reward uses both processes of the shared pool.
    colo = load_config("default", ["backend=ray", "reward.dp=2", "actor.dp=2"]).resolved_placement()
    assert {n: v.size for n, v in colo.pools.items()} == {"main": 2} and colo.dp["reward"] == 2


@pytest.mark.parametrize("overrides, message", [
    (["reward.dp=2"], "reward.dp=2 needs backend=ray"),
    (["reward.dp=0"], "reward.dp: invalid value 0"),
    (["backend=ray", "reward.dp=-1"], "reward.dp: invalid value -1"),
    # The shared default pool grows to 2 workers: the error blames reward.dp, not the actor.
    (["backend=ray", "reward.dp=2"], "reward.dp=2 makes pool 'main' 2 workers, but actor.dp=1 must equal"),
    (["backend=ray", "reward.dp=3", "placement.reward=rm", "pools.rm.workers_per_node=2"],
     "reward.dp=3 does not fit pool 'rm'"),
    # Pools sized over 2 nodes round up (3 -> 4 workers), so no role's dp equals the pool's size.
    (["backend=ray", "actor.dp=2", "reward.dp=3", "pools.main.nodes=2"],
     "reward.dp=3 makes pool 'main' 4 workers, but actor.dp=2 must equal"),
    (["backend=ray", "actor.dp=3", "pools.main.nodes=2", "trainer.prompts_per_step=12", "trainer.mini_batch_size=12",
      "trainer.micro_batch_size=4"], "actor.dp=3 must equal the size of its pool 'main' (4 workers)"),
])
def test_bad_reward_dp_is_a_one_line_error_naming_it(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config("default", overrides)
    assert message in str(e.value) and "\n" not in str(e.value)


# ------------------------------------------------------------------------------ dispatch
def test_score_is_split_over_the_group_and_preference_eval_is_not():
    assert dispatch_of(RewardWorker, "score").mode == "dp_split"
    assert dispatch_of(RewardWorker, "score").split_args == 2
    assert dispatch_of(RewardWorker, "preference_eval").mode == "rank_zero"


def test_register_split_args_needs_dp_split_and_a_positive_count():
    with pytest.raises(ValueError, match="split_args=2 .* needs mode='dp_split'"):
        register("rank_zero", split_args=2)
    with pytest.raises(ValueError, match="split_args=0 must be an int >= 1"):
        register("dp_split", split_args=0)


def test_restore_puts_dataclass_fields_back_and_keeps_all_none_fields():
    plan = balanced_split([1.0] * 3, 2)  # LPT deals rows 0, 2 to rank 0 and row 1 to rank 1 (plus a padding row)
    assert plan.parts == ((0, 2), (1,)) and plan.pad == (0, 1)
    ranks = [RewardOutput(torch.tensor([1.0, 3.0]), torch.tensor([0.0, 1.0]), torch.tensor([5.0, 7.0])),
             RewardOutput(torch.tensor([2.0, 9.0]), torch.tensor([1.0, 9.0]), torch.tensor([6.0, 9.0]))]
    out = restore(ranks, plan)
    assert isinstance(out, RewardOutput) and out.rm_scores is None and out.costs is None
    assert out.scores.tolist() == [1.0, 2.0, 3.0] and out.correct.tolist() == [0.0, 1.0, 1.0]
    assert out.fn_scores.tolist() == [5.0, 6.0, 7.0]  # rank 1's padding row (9.0) dropped
    with pytest.raises(ValueError, match="some ranks returned None"):
        restore([None, torch.zeros(1)], plan)


def test_a_list_cut_by_a_padded_plan_is_padded_too():
    # split_args with a Batch first: the list beside it must stay row-aligned with the Batch's padding.
    plan = balanced_split([1.0] * 5, 2)
    pieces = shard(["a", "b", "c", "d", "e"], plan)
    assert [len(p) for p in pieces] == [3, 3]
    assert restore(pieces, plan) == ["a", "b", "c", "d", "e"]


def _tiny_rm(batch_size: int) -> RewardModel:
    tok = build_char_tokenizer()
    model = ValueModel.from_config(ModelConfig.preset("tiny", vocab_size=len(tok)), seed=1)
    torch.nn.init.normal_(model.value_head.weight, std=0.5)
    return RewardModel(model.eval(), tok, batch_size=batch_size, meta={"score_mean": 0.1, "score_std": 2.0})


def _samples(task: SafeArithTask, n: int) -> tuple[list[Prompt], list[str]]:
    """n prompts with right, wrong, forbidden-digit and garbage answers in turn."""
    prompts = task.train_prompts()[:n]
    kinds = [lambda p: p.answer, lambda p: "0", lambda p: p.answer + "7", lambda p: "x?"]
    return prompts, [kinds[i % 4](p) for i, p in enumerate(prompts)]


def _assert_same(got: RewardOutput, want: RewardOutput, rm_atol: float = 0.0) -> None:
    for f in ("correct", "fn_scores", "costs"):
        assert torch.equal(getattr(got, f), getattr(want, f)), f
    if want.rm_scores is None:
        assert got.rm_scores is None and torch.equal(got.scores, want.scores)
    else:
        # Reward-model batches are cut differently per rank: equal up to float rounding only.
        for f in ("rm_scores", "scores"):
            assert getattr(got, f).shape == getattr(want, f).shape
            assert torch.allclose(getattr(got, f), getattr(want, f), atol=rm_atol, rtol=0.0), f


@pytest.mark.parametrize("n", [7, 6, 1, 0])
def test_two_workers_score_like_one_in_sample_order(n):
    task = SafeArithTask(train_size=40, eval_size=4)
    prompts, responses = _samples(task, n)
    want = RewardWorker(task).score(prompts, responses)
    group = InlineGroup([RewardWorker(task), RewardWorker(task)])
    got = group.score(prompts, responses)
    assert group.sent == [[-(-n // 2), n // 2]]  # contiguous halves, the odd sample on rank 0
    _assert_same(got, want)
    assert got.scores.shape == (n,) and got.costs.shape == (n,)
    # One worker (the local backend's group) still runs the method once, unsplit.
    assert torch.equal(LocalGroup("reward", RewardWorker(task)).score(prompts, responses).scores, want.scores)


def test_two_workers_with_a_reward_model_score_like_one():
    task = SafeArithTask(train_size=40, eval_size=4)
    prompts, responses = _samples(task, 9)
    rm = _tiny_rm(batch_size=4)
    want = RewardWorker(task, rm, fn_weight=0.5, model_weight=2.0).score(prompts, responses)
    group = InlineGroup([RewardWorker(task, rm, fn_weight=0.5, model_weight=2.0) for _ in range(3)])
    got = group.score(prompts, responses)
    assert group.sent == [[3, 3, 3]]
    _assert_same(got, want, rm_atol=1e-5)
    assert torch.allclose(got.scores, 0.5 * got.fn_scores + 2.0 * got.rm_scores)


def test_prompts_and_responses_of_different_lengths_are_a_clear_error():
    task = SafeArithTask(train_size=40, eval_size=4)
    group = InlineGroup([RewardWorker(task), RewardWorker(task)])
    prompts, responses = _samples(task, 4)
    with pytest.raises(ValueError, match=r"reward\.score .* need one row per sample each, got lengths \[4, 3\]"):
        group.score(prompts, responses[:3])
    assert group.sent == []  # nothing was dispatched
    # One worker (the local backend) fails the same way instead of deep inside score's zip.
    with pytest.raises(ValueError, match=r"need one row per sample each, got lengths \[4, 3\]"):
        LocalGroup("reward", RewardWorker(task)).score(prompts, responses[:3])
    with pytest.raises(TypeError, match=r"argument 1 is split over the ranks and must be a Batch or a list, got str"):
        group.score(prompts, "abcd")


# ------------------------------------------------------------------------------ Ray
def test_reward_dp2_on_ray_scores_like_one_worker(ray_cluster, tmp_path):  # noqa: F811
    from fuseflow.controller.ray_backend import RayCluster
    from fuseflow.tasks import make_task
    from fuseflow.workers.build import RoleContext, build_reward

    _tiny_rm(batch_size=4).save(tmp_path / "rm", {"score_mean": 0.1, "score_std": 2.0})
    cfg = load_config("default", ["backend=ray", "task.name=safe_arith", "task.train_size=40", "task.eval_size=4",
                                  "trainer.eval_size=4", "reward.dp=2", "placement.reward=reward",
                                  f"reward.model={tmp_path / 'rm'}", "reward.fn_weight=0.5", "reward.batch_size=4"])
    task = make_task(cfg.task)
    ctx = RoleContext(cfg, tmp_path, None, task)
    placement = cfg.resolved_placement()
    assert placement.pools["reward"].size == 2
    # Start the reward pool alone, at half a CPU slot per worker, so it fits the 2-slot test cluster.
    pool = dataclasses.replace(placement.pools["reward"], cpus_per_worker=0.5)
    only_reward = type(placement)({"reward": pool}, {"reward": "reward"}, {"reward": 2})
    t0 = time.perf_counter()
    cluster = RayCluster(only_reward, start_timeout_s=120, collective_timeout_s=60)
    try:
        group = cluster.group("reward", RewardWorker, partial(build_reward, ctx))
        assert group.world_size == 2
        sent, submit = [], group._submit
        group._submit = lambda name, ranks, per_rank, collect: (
            sent.append([len(a[0]) for a, _ in per_rank]), submit(name, ranks, per_rank, collect))[1]
        one = build_reward(ctx, DistInfo())  # what a single worker returns, in this process
        for n in (7, 8):
            prompts, responses = _samples(task, n)
            _assert_same(group.score(prompts, responses), one.score(prompts, responses), rm_atol=1e-5)
        assert sent == [[4, 3], [4, 4]]
    finally:
        cluster.shutdown()
    print(f"reward dp=2 on Ray: {time.perf_counter() - t0:.1f}s from start to shutdown")


@pytest.mark.slow
def test_a_run_with_reward_dp2_on_ray_gives_the_local_metrics(ray_cluster, tmp_path, sft_cache):  # noqa: F811
    import json

    from fuseflow.runner import train
    from fuseflow.telemetry.metrics import read_metrics

    _tiny_rm(batch_size=4).save(tmp_path / "rm", {"score_mean": 0.1, "score_std": 2.0})
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i}=", "answer": str(i % 10), "response": str(i % 10)}) + "\n"
                            for i in range(40)))
    (tmp_path / "rw.py").write_text("def score(prompt, response, answer):\n    return len(response) / 8.0\n")
    args = ["sft.max_steps=20", "sft.eval_every=10", "sft.eval_size=10", "task.eval_size=10",
            "trainer.prompts_per_step=4", "algorithm.group_size=4", "trainer.mini_batch_size=8",
            "trainer.micro_batch_size=4", "trainer.eval_size=8", "trainer.eval_every=100", "trainer.steps=2",
            "task.name=file", f"task.path={data}", f"task.reward_fn={tmp_path / 'rw.py'}:score",
            f"reward.model={tmp_path / 'rm'}", "reward.fn_weight=0.5", "reward.batch_size=4", f"cache_dir={sft_cache}"]
    train(load_config("default", args), tmp_path / "local")
    # The 2-slot test cluster: the main pool's worker takes one slot, the two reward workers half each.
    train(load_config("default", [*args, "backend=ray", "reward.dp=2", "placement.reward=reward",
                                  "pools.reward.cpus_per_worker=0.5"]), tmp_path / "ray")
    a, b = read_metrics(tmp_path / "local"), read_metrics(tmp_path / "ray")
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2]
    for ra, rb in zip(a, b, strict=True):
        for k in ra:
            if not k.startswith(("time/", "perf/")):
                assert ra[k] == pytest.approx(rb[k], rel=1e-4, abs=1e-5), k
    assert all("reward/rm_score" in r for r in b)
