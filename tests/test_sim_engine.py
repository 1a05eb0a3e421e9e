"""Decode replicas, the discrete-event simulation and the execution policies."""

from __future__ import annotations

import numpy as np
import pytest
import simpy

from fuseflow.sim.costmodel import Layout
from fuseflow.sim.engine import GpuPool, simulate
from fuseflow.sim.generation import Seq, run_replica, sorted_chunks
from fuseflow.sim.hardware import get_hardware
from fuseflow.sim.modelspec import get_model
from fuseflow.sim.placement import DeviceSet, Plan, Problem, estimate, generation_seconds
from fuseflow.sim.policies import Policy, choose_workers, parse_policy
from fuseflow.sim.workload import LengthDist, Workload


class FakeDecode:
    """Round = 1 + 0.1 x active sequences seconds; each admission batch prefills in 0.5 s."""

    def segment_seconds(self, n, ctx0, k):
        return k * (1.0 + 0.1 * n)

    def step_seconds(self, n, ctx):
        return 1.0 + 0.1 * np.asarray(n, dtype=float) + 0.0 * np.asarray(ctx)

    def prefill_sums(self, tokens, attended):
        return 0.5 if tokens > 0 else 0.0


def test_replica_timeline_by_hand():
    # Both admitted: prefill 0.5; 1 round with 2 active (1.2) -> seq 0 at 1.7; 2 rounds with 1 (2.2) -> 3.9.
    run = run_replica(FakeDecode(), [Seq(0, 8, 1), Seq(1, 8, 3)])
    assert run.finishes == [(0, pytest.approx(1.7)), (1, pytest.approx(3.9))]
    # One at a time: 0.5 + 1.1 -> 1.6, then prefill 0.5 + 3 x 1.1 -> 5.4.
    run = run_replica(FakeDecode(), [Seq(0, 8, 1), Seq(1, 8, 3)], cap=1)
    assert [t for _, t in run.finishes] == [pytest.approx(1.6), pytest.approx(5.4)]
    # Stopped at 3.0: seq 1 has finished 1 + 1 rounds (rounds end at 1.7, 2.8, 3.9).
    run = run_replica(FakeDecode(), [Seq(0, 8, 1), Seq(1, 8, 3)], until=3.0)
    assert [s.id for s in run.leftover] == [1] and run.leftover[0].done == 2 and run.end == pytest.approx(2.8)


def test_prefix_sharing_prefills_a_group_once():
    calls = []

    class Counting(FakeDecode):
        def prefill_sums(self, tokens, attended):
            calls.append(tokens)
            return 0.0

    run_replica(Counting(), [Seq(i, 10, 2, group=0) for i in range(4)], share_prefix=True)
    run_replica(Counting(), [Seq(i, 10, 2, group=0) for i in range(4)], share_prefix=False)
    assert calls == [10.0, 40.0]


def test_sorted_chunks_groups_long_prompts_together():
    seqs = [Seq(i, 4, 1, group=i // 2) for i in range(8)]
    keys = np.array([1, 1, 9, 9, 5, 5, 2, 2], dtype=float)
    parts = sorted_chunks(seqs, keys, 2)
    # Predicted tokens 18 (group 1), 10, 4, 2 of 34: group 1 fills the first replica's half alone.
    assert [[s.id for s in p] for p in parts] == [[2, 3], [4, 5, 6, 7, 0, 1]]


def test_gpu_pool_greedy_takes_everything_free():
    env = simpy.Environment()
    pool = GpuPool(env, 8)
    got = []

    def proc():
        yield pool.acquire(6)
        ev = pool.acquire(2, greedy=True)
        got.append((yield ev))
        pool.release(6 + got[0])

    env.process(proc())
    env.run()
    assert got == [2] and pool.free == 8


def _problem(samples=16, resp=LengthDist("fixed", max_len=32), gpus=8, algo="ppo") -> Problem:
    wl = Workload(prompts=samples, prompt_len=LengthDist("fixed", max_len=64), response_len=resp, algorithm=algo,
                  mini_batches=2)  # fmt: skip
    return Problem.build(get_model("llama-7b"), get_hardware("H100"), gpus, wl)


def _colocated(p: Problem, gen=(2, 1)) -> Plan:
    lay = Layout(1, 1, p.gpus, zero=3)
    return Plan((DeviceSet(p.roles, p.gpus),), tuple((r, lay) for r in p.roles), gen)


def test_sequential_timeline_matches_hand_composition():
    p = _problem()
    plan = _colocated(p)
    batch = p.workload.step(0)
    costs = estimate(p, plan, batch)
    assert costs.feasible, costs.why
    res = simulate(p, plan, parse_policy("sequential"), iterations=1)
    boxes = {e.name: e for e in res.events if e.name != "generate"}
    t = generation_seconds(costs, batch)
    for name, role in (("old_logprob", "actor"), ("values", "critic"), ("reference", "ref"), ("reward", "reward")):
        assert boxes[name].start == pytest.approx(t) and boxes[name].dur == pytest.approx(costs.infer[role].seconds)
        t += costs.infer[role].seconds
    t += p.hw.efficiency.host_seconds_per_sample * batch.n
    for name, role in (("actor_update", "actor"), ("critic_update", "critic")):
        assert boxes[name].start == pytest.approx(t)
        t += costs.train[role].seconds
    assert boxes["weight_sync"].start == pytest.approx(t)
    assert res.iteration_seconds == pytest.approx(t + costs.sync_seconds)
    assert res.gpu_seconds == pytest.approx(8 * res.iteration_seconds)


def test_split_sets_run_inference_in_parallel():
    p = _problem()
    sets = (DeviceSet(("actor", "ref"), 4), DeviceSet(("critic", "reward"), 4))
    lay = Layout(1, 1, 4, zero=3)
    plan = Plan(sets, tuple((r, lay) for r in p.roles), (2, 1))
    costs = estimate(p, plan, p.workload.step(0))
    res = simulate(p, plan, parse_policy("sequential"), iterations=1)
    gen_end = res.stages["generate"]
    a = costs.infer["actor"].seconds + costs.infer["ref"].seconds
    c = costs.infer["critic"].seconds + costs.infer["reward"].seconds
    assert res.stages["gen_plus_inference"] == pytest.approx(gen_end + max(a, c))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fused_never_slower_than_sequential(seed):
    tail = LengthDist("lognormal", max_len=512, median=64, sigma=1.0)
    wl = Workload(prompts=64, prompt_len=LengthDist("fixed", max_len=64), response_len=tail, seed=seed, mini_batches=2)
    p = Problem.build(get_model("llama-7b"), get_hardware("H100"), 16, wl)
    plan = _colocated(p, gen=(1, 1))
    seq = simulate(p, plan, parse_policy("sequential"))
    fus = simulate(p, plan, parse_policy("fused"))
    assert fus.gen_plus_inference_seconds <= seq.gen_plus_inference_seconds * (1 + 1e-9)
    assert fus.iteration_seconds <= seq.iteration_seconds * (1 + 1e-9)


def test_async_overlaps_generation_with_training_on_a_separate_rollout():
    p = _problem(samples=32, gpus=16)
    lay = Layout(1, 1, 8, zero=3)
    plan = Plan((DeviceSet(p.roles, 8), DeviceSet(("rollout",), 8)), tuple((r, lay) for r in p.roles), (1, 1))
    seq = simulate(p, plan, parse_policy("sequential"))
    asy = simulate(p, plan, parse_policy("async"))
    # Per step the rollout set generates and receives weights; the other set does inference,
    # host work and training. Overlap cannot beat the busier set.
    rollout_side = seq.stages["generate"] + seq.stages["weight_sync"]
    train_side = seq.iteration_seconds - rollout_side
    assert asy.iteration_seconds < seq.iteration_seconds
    assert asy.iteration_seconds == pytest.approx(max(rollout_side, train_side))


def test_elastic_choice_respects_budget_and_bills_less_than_reserved():
    wl = Workload(prompts=8, samples_per_prompt=8, algorithm="grpo", reward_model=False, mini_batches=2,
                  prompt_len=LengthDist("fixed", max_len=64),
                  response_len=LengthDist("lognormal", max_len=1024, median=100, sigma=1.0))  # fmt: skip
    p = Problem.build(get_model("qwen2.5-3b"), get_hardware("L40S"), 8, wl)
    b = wl.step(0)
    from fuseflow.sim.placement import make_seqs

    ch = choose_workers(p.actor, p.hw, make_seqs(b), b.predicted_lens.astype(float), 8, 64.0, 1024, 8, 0.1, rest=5.0)
    assert ch.workers * ch.decode.gpus <= 8
    res = simulate(p, _colocated(p, gen=(1, 1)), Policy(elastic=True))
    seq = simulate(p, _colocated(p, gen=(1, 1)), Policy())
    assert res.gpu_seconds < seq.gpu_seconds
    assert res.info["elastic_workers"]


def test_trace_and_gantt_outputs(tmp_path):
    import json

    from fuseflow.sim.trace import write_gantt, write_trace

    p = _problem()
    res = simulate(p, _colocated(p), parse_policy("fused"), iterations=1)
    trace = json.loads(write_trace(res.events, tmp_path / "t.json").read_text())
    boxes = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(boxes) == len(res.events)
    assert {"generate", "old_logprob", "actor_update+critic_update", "weight_sync"} <= {e["name"] for e in boxes}
    assert all(e["dur"] >= 0 and "step" in e["args"] for e in boxes)
    assert write_gantt(res.events, tmp_path / "g.png").stat().st_size > 1000
