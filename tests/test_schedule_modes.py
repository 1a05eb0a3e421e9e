"""Execution modes train alike: fused == sequential, async at max_staleness 0 == sequential, and every
async sample respects the staleness bound; migration mid-sample keeps the tokens."""

import json
import os
import sys
import threading

import pytest
import torch

from fuseflow.bench.trl import QUICK_OVERRIDES
from fuseflow.config import load_config
from fuseflow.models import CausalLM, ModelConfig
from fuseflow.policy.migration import MigrationPlan, Move
from fuseflow.rollout.base import SamplingParams
from fuseflow.rollout.engine import Engine, EngineConfig
from fuseflow.rollout.sampler import make_requests
from fuseflow.schedule.pool import RolloutPool, TaskQueue
from fuseflow.telemetry import Tracer
from fuseflow.trainer import RLTrainer
from spy import record_batches

PER_TOKEN = ("old_logprobs", "ref_logprobs", "values")


def _run(tmp_path, sft_cache, extra, steps=2, after_step=None):
    cfg = load_config("sort", [*QUICK_OVERRIDES, "algorithm.name=ppo", "algorithm.kl_in_reward=true",
                               f"trainer.steps={steps}", "trainer.eval_every=100", "trainer.save_every=100",
                               "trainer.eval_size=8", "task.eval_size=8", f"cache_dir={sft_cache}", *extra])
    tr = RLTrainer(cfg, tmp_path / "_".join(extra or ["seq"]).replace("=", "-").replace("+", "p"), log=lambda *_: None)
    batches, metrics = record_batches(tr), []
    try:
        for step in range(1, steps + 1):
            metrics.append(tr.step(step))
            if after_step is not None:
                after_step(tr)
    finally:
        tr.close()
    return batches, metrics


def _same_training(a, b):
    (ba, ma), (bb, mb) = a, b
    for x, y in zip(ba, bb, strict=True):
        assert torch.equal(x["input_ids"], y["input_ids"])  # token-identical samples, same order
        assert torch.equal(x["scores"], y["scores"])
        mask = x["response_mask"]  # padding positions hold whatever their micro-batch computed; never used
        for k in PER_TOKEN:
            assert torch.allclose(x[k] * mask, y[k] * mask, atol=1e-5), k
    for x, y in zip(ma, mb, strict=True):
        for k, v in x.items():
            if not k.startswith(("time/", "perf/", "trace/", "schedule/", "async/", "elastic/")):
                assert y[k] == pytest.approx(v, rel=1e-3, abs=1e-5), k


def test_fused_with_migration_trains_like_sequential(tmp_path, sft_cache):
    seq = _run(tmp_path, sft_cache, [])
    held = []  # a reserved mode bills whole steps: the pool's held spans are dropped every step
    fused = _run(tmp_path, sft_cache, ["schedule.mode=fused", "schedule.rollout_workers=2",
                                       "schedule.migration_threshold=0.9", "schedule.token_budget=256"],
                 after_step=lambda tr: held.append(len(tr.strategy.pool.held)))
    _same_training(seq, fused)
    assert held == [0, 0]
    assert all("trace/busy_fraction/rollout-1" in m for m in fused[1])
    # Intra-stage fusion: the critic's update ran on a track of its own, at the same time as the actor's.
    trace = json.loads((tmp_path / "schedule.mode-fused_schedule.rollout_workers-2_schedule.migration_threshold-0.9"
                        "_schedule.token_budget-256" / "trace.json").read_text())
    tracks = {e["args"]["name"]: e["tid"] for e in trace["traceEvents"] if e.get("ph") == "M"}
    spans = {(e["name"], e["tid"]): (e["ts"], e["ts"] + e["dur"]) for e in trace["traceEvents"]
             if e.get("ph") == "X" and e["args"]["step"] == 2 and e["name"].endswith("_update")}
    (a0, a1), (c0, c1) = spans[("actor_update", tracks["trainer"])], spans[("critic_update", tracks["training-critic"])]
    assert max(a0, c0) < min(a1, c1)  # the two spans overlap


def test_the_tail_asks_workers_for_their_samples_only_while_two_hold_some(tmp_path, sft_cache, monkeypatch):
    """Migration can free a worker only while two or more hold unfinished samples; once the tail is on one,
    the strategy stops asking the pool (on Ray each ask is a round trip to every replica process)."""
    run, pending = RolloutPool.run, RolloutPool.pending
    steps: list[dict] = []  # per generation: samples per worker, the order they were delivered, asks

    def spy_run(self, step, shards, on_sample, *args, **kwargs):
        if any(shards):
            steps.append({"shards": [len(x) for x in shards], "delivered": [], "asks": 0})

        def seen(w, s):
            steps[-1]["delivered"].append(w)
            on_sample(w, s)

        return run(self, step, shards, seen, *args, **kwargs)

    def spy_pending(self):
        steps[-1]["asks"] += 1
        return pending(self)

    from ray_hooks import hold_tail

    build = RolloutPool.__init__

    def held(self, *args, **kwargs):  # each worker holds its tail until the controller migrates (at most 30 s),
        build(self, *args, **kwargs)  # so the tail is on both workers when the trigger fires, whatever the load
        for engine in self.engines:
            hold_tail(engine)

    monkeypatch.setattr(RolloutPool, "__init__", held)
    monkeypatch.setattr(RolloutPool, "run", spy_run)
    monkeypatch.setattr(RolloutPool, "pending", spy_pending)
    _batches, metrics = _run(tmp_path, sft_cache, ["schedule.mode=fused", "schedule.rollout_workers=2",
                                                   "schedule.migration_threshold=0.9"], steps=3)
    for g in steps:  # the strategy reads samples in delivery order: at most one ask per sample after
        left, could = list(g["shards"]), 0  # which two workers still owed samples
        for w in g["delivered"]:
            left[w] -= 1
            could += sum(k > 0 for k in left) > 1
        assert g["asks"] <= could, g
    assert any(g["asks"] for g in steps)
    assert all(m["schedule/migrated_samples"] > 0 for m in metrics)  # the tail still migrates


def test_async_with_staleness_zero_equals_sequential(tmp_path, sft_cache):
    seq = _run(tmp_path, sft_cache, [])
    asy = _run(tmp_path, sft_cache, ["schedule.mode=async", "schedule.max_staleness=0"])
    _same_training(seq, asy)


def test_async_samples_respect_the_staleness_bound(tmp_path, sft_cache, monkeypatch):
    from fuseflow.controller.group import started_background
    from fuseflow.schedule.stages import Stages

    lanes, infer = set(), Stages.infer

    def spy(self, samples, names, *args, **kwargs):
        lanes.add((tuple(names), started_background()))
        return infer(self, samples, names, *args, **kwargs)

    monkeypatch.setattr(Stages, "infer", spy)
    batches, metrics = _run(tmp_path, sft_cache, ["schedule.mode=fused+async", "schedule.max_staleness=1",
                                                  "schedule.rollout_workers=2"], steps=3)
    # Inference streamed while step 1 decodes, and the prefetches' frozen stages while the previous step
    # trains, start in the background lane; the old log-probs and values that wait for training do not.
    assert lanes == {(("old_logprob", "reference", "reward", "critic"), True), (("reference", "reward"), True),
                     (("old_logprob", "critic"), False)}
    for step, batch in enumerate(batches, start=1):
        ages = [(step - 1) - v for v in batch.meta["policy_version"]]
        assert all(0 <= a <= 1 for a in ages), (step, ages)
        if step > 1:  # generated during the previous step's training, by the policy before it
            assert set(ages) == {1}
        assert metrics[step - 1]["async/staleness_max"] == max(ages)


def test_migrated_samples_keep_their_tokens():
    model = CausalLM.from_config(ModelConfig.preset("tiny", vocab_size=40), seed=0).eval()
    params = SamplingParams(max_new_tokens=24)
    requests = make_requests([[1, 2, 3], [4, 5], [6, 7, 8, 9]], params, 2, seed=5)
    want = {s.uid: s.response_ids for s in Engine(model, EngineConfig(max_num_seqs=8)).generate(requests)}
    pool = RolloutPool(model, 2, EngineConfig(max_num_seqs=8), None, Tracer(), first_track=1)
    for r in make_requests([[1, 2, 3], [4, 5], [6, 7, 8, 9]], params, 2, seed=5):
        pool.engines[r.uid % 2].add(r)
    got = {}
    for _ in range(5):  # part-way through, on both engines
        for e in pool.engines:
            got |= {s.uid: s.response_ids for s in e.step()}
    on_src = [p.uid for p in pool.pending()[0]]
    assert on_src, "worker 0 should still hold unfinished samples"
    moved = pool.migrate(MigrationPlan((1,), (0,), tuple(Move(u, 0, 1) for u in on_src), True), step=1)
    assert moved == len(on_src) and not pool.engines[0].has_unfinished()
    tasks = TaskQueue()
    tasks.close()
    pool.run(1, [[], []], lambda _w, s: got.setdefault(s.uid, s.response_ids), tasks)
    pool.join()
    assert got == want


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread scheduling policy is Linux-only")
def test_background_workers_yield_the_cpu_until_training_ends():
    model = CausalLM.from_config(ModelConfig.preset("tiny", vocab_size=40), seed=0).eval()
    pool = RolloutPool(model, 1, EngineConfig(max_num_seqs=8), None, Tracer(), first_track=1)
    seen, release = [], threading.Event()

    def task():  # runs on the worker thread: its policy while "training" runs, then after restore
        seen.append(os.sched_getscheduler(0))
        release.wait(10)
        seen.append(os.sched_getscheduler(0))

    tasks = TaskQueue()
    done = tasks.submit(task)
    tasks.close()
    pool.run(1, [[]], lambda _w, _s: None, tasks, background=True)
    while not seen:
        threading.Event().wait(0.001)
    pool.restore_priority()  # root may leave SCHED_IDLE; without the privilege the worker keeps it
    release.set()
    pool.join()
    done.result()
    assert seen[0] == os.SCHED_IDLE
    assert seen[1] in ((os.SCHED_OTHER,) if os.geteuid() == 0 else (os.SCHED_OTHER, os.SCHED_IDLE))
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the controller thread is never demoted


def test_schedule_config_errors_name_the_field():
    from fuseflow.config import ConfigError

    assert load_config("sort", ["schedule.mode=async"]).algorithm.policy_loss == "decoupled"
    for bad, words in ((["schedule.migration_threshold=1.5"], "migration_threshold=1.5"),
                       (["schedule.mode=async", "algorithm.policy_loss=ppo"], "policy_loss=decoupled"),
                       (["schedule.mode=fused", "rollout.backend=sampler"], "rollout.backend=engine"),
                       (["schedule.mode=fused", "backend=ray"], "placement.rollout=NAME"),
                       (["schedule.rollout_workers=2", "backend=ray"], "placement.rollout=NAME"),
                       (["schedule.mode=elastic"], "schedule.rollout_workers >= 2"),
                       (["schedule.mode=fused+elastic", "schedule.rollout_workers=1"], "rollout_workers >= 2"),
                       (["schedule.mode=elastic", "schedule.rollout_workers=2", "schedule.elastic_slowdown=-1"],
                        "elastic_slowdown"),
                       (["schedule.predictor_window=0"], "predictor_window"),
                       (["schedule.max_staleness=-1"], "max_staleness")):
        with pytest.raises(ConfigError, match=words):
            load_config("sort", bad)


@pytest.mark.parametrize("mode,want,side_by_side", [("sequential", 2, False), ("async", 1, True)])
def test_updates_get_the_idle_workers_cores(tmp_path, sft_cache, mode, want, side_by_side):
    """Sequential: nothing else runs during the updates, so each uses both workers' cores in turn;
    async: the two updates run side by side on a core each (the next step's generation takes
    whatever core one leaves)."""
    cfg = load_config("sort", [*QUICK_OVERRIDES, "algorithm.name=ppo", "trainer.steps=1", "trainer.eval_every=100",
                               "trainer.save_every=100", f"cache_dir={sft_cache}", f"schedule.mode={mode}",
                               "schedule.rollout_workers=2"])
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tr = RLTrainer(cfg, tmp_path / mode, log=lambda *_: None)
        seen, names = [], set()
        for w in (tr.actor.worker, tr.critics[0].worker):
            inner = w.update
            w.update = lambda *a, _inner=inner, **k: (seen.append(torch.get_num_threads()),
                                                      names.add(threading.current_thread().name), _inner(*a, **k))[2]
        try:
            tr.step(1)
        finally:
            tr.close()
        want = min(want, len(os.sched_getaffinity(0)))  # capped at the cores this process may use
        assert seen == [want, want]
        assert (len(names) == 2) == side_by_side  # two threads when the updates run side by side
        assert torch.get_num_threads() == 1  # restored once training is over
    finally:
        torch.set_num_threads(before)


def test_async_resume_continues_exactly(tmp_path, sft_cache):
    """A checkpoint holds the prefetched step's samples: the resumed run matches the uninterrupted one."""
    from safetensors.torch import load_file

    from fuseflow.runner import train
    from fuseflow.telemetry.metrics import read_metrics

    cfg = load_config("sort", [*QUICK_OVERRIDES, "algorithm.name=ppo", "trainer.steps=3", "trainer.eval_every=100",
                               "trainer.save_every=1", "trainer.eval_size=8", "task.eval_size=8",
                               f"cache_dir={sft_cache}", "schedule.mode=async"])
    train(cfg, tmp_path / "full")
    train(cfg, tmp_path / "cut", stop_after=2)
    assert (tmp_path / "cut/checkpoints/step_2/prefetch.json").is_file()  # step 3 was generated already
    train(cfg, tmp_path / "cut", resume=True)
    keep = lambda rows: [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/", "trace/"))}  # noqa: E731
                         for r in rows]
    full, cut = keep(read_metrics(tmp_path / "full")), keep(read_metrics(tmp_path / "cut"))
    assert [r["step"] for r in cut] == [1, 2, 3]
    assert cut[2]["async/staleness_max"] == 1  # trained on the saved samples, not regenerated ones
    assert full == cut
    a = load_file(str(tmp_path / "full/checkpoints/step_3/actor/model.safetensors"))
    b = load_file(str(tmp_path / "cut/checkpoints/step_3/actor/model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_pending_samples_round_trip(tmp_path):
    from fuseflow.rollout.base import Sample
    from fuseflow.schedule.pending import load_pending, save_pending

    lp = torch.randn(7).tolist()  # fp32 values: stored exactly
    samples = [Sample(3, 1, [5, 6, 7], [8, 9, 2], lp[:3], "stop", 4), Sample(0, 0, [5], [], [], "length", 3),
               Sample(1, 0, [5, 9], [4, 4, 4, 2], lp[3:], "stop", 4)]
    assert load_pending(tmp_path) is None
    save_pending(tmp_path, 12, samples)
    step, back = load_pending(tmp_path)
    assert step == 12
    assert [(x.uid, x.group_id, x.prompt_ids, x.response_ids, x.logprobs, x.finish_reason, x.policy_version)
            for x in back] == [(x.uid, x.group_id, x.prompt_ids, x.response_ids, x.logprobs, x.finish_reason,
                                x.policy_version) for x in samples]


def test_a_failing_side_by_side_update_reaches_the_controller(tmp_path, sft_cache):
    """Fused modes run the critic's update on a thread of its own; its error must not be lost."""
    cfg = load_config("sort", [*QUICK_OVERRIDES, "algorithm.name=ppo", "trainer.steps=1", "trainer.eval_every=100",
                               "trainer.save_every=100", f"cache_dir={sft_cache}", "schedule.mode=fused",
                               "schedule.rollout_workers=2"])
    tr = RLTrainer(cfg, tmp_path / "run", log=lambda *_: None)

    def broken(*_a, **_k):
        raise FloatingPointError("critic diverged")

    tr.critics[0].worker.update = broken
    try:
        with pytest.raises(FloatingPointError, match="critic diverged"):
            tr.step(1)
    finally:
        tr.close()


def test_a_dead_rollout_worker_fails_the_step_at_once(tmp_path, sft_cache, monkeypatch):
    """A rollout thread that dies mid-generation ends the step with its error, naming the worker.

    Before: the surviving worker kept polling for tasks, so the controller waited out the
    step's timeout (600 s) and then reported only "rollout workers stopped", without the cause.
    """
    import time

    from fuseflow.schedule import streaming

    monkeypatch.setattr(streaming, "WAIT_S", 60.0)  # the old behaviour then fails the timing check below
    cfg = load_config("sort", [*QUICK_OVERRIDES, "algorithm.name=ppo", "trainer.steps=1", "trainer.eval_every=100",
                               "trainer.save_every=100", f"cache_dir={sft_cache}", "schedule.mode=fused",
                               "schedule.rollout_workers=2"])
    tr = RLTrainer(cfg, tmp_path / "run", log=lambda *_: None)
    engine = tr.strategy.pool.engines[0]
    real_step, calls = engine.step, []

    def dying_step():
        calls.append(1)
        if len(calls) == 3:
            raise MemoryError("KV pool exhausted")
        return real_step()

    engine.step = dying_step
    t0 = time.perf_counter()
    try:
        with pytest.raises(RuntimeError, match="rollout worker rank 0 .*MemoryError: KV pool exhausted") as err:
            tr.step(1)
    finally:
        tr.close()
    assert isinstance(err.value.__cause__, MemoryError)
    assert time.perf_counter() - t0 < 30.0


def test_finish_prefetch_waits_for_the_next_steps_generation(tmp_path, sft_cache, monkeypatch):
    """`bench trl` times fuseflow's steps one by one: the async prefetch must finish inside that time."""
    import threading

    from fuseflow.schedule import modes

    real = modes.Pooled._generate
    release = threading.Event()

    def slow_background(self, step, drawn, stream, after, foreground):
        if not foreground:
            release.wait(60.0)  # the prefetch is held until the test lets it go, however slow the machine
        return real(self, step, drawn, stream, after, foreground)

    monkeypatch.setattr(modes.Pooled, "_generate", slow_background)
    cfg = load_config("sort", [*QUICK_OVERRIDES, "algorithm.name=ppo", "trainer.steps=2", "trainer.eval_every=100",
                               "trainer.save_every=100", f"cache_dir={sft_cache}", "schedule.mode=async"])
    tr = RLTrainer(cfg, tmp_path / "run", log=lambda *_: None)
    try:
        tr.step(1)
        pending = tr.strategy.prefetch[1]
        assert not pending.done()
        release.set()
        tr.strategy.finish_prefetch()
        assert pending.done() and pending.exception() is None
    finally:
        release.set()
        tr.close()


def test_an_early_start_whose_weight_sync_fails_fails_the_next_step_not_this_one():
    """Fused on Ray syncs the replicas inside step t's training (``_start_early``): a failure there must reach
    the next step, which takes its result, so step t still ends and writes its checkpoint."""
    from types import SimpleNamespace

    from fuseflow.schedule.modes import Fused
    from fuseflow.schedule.updates import Gate

    strategy = object.__new__(Fused)  # only what _start_early reads
    strategy.stages, strategy.prefetch = SimpleNamespace(stream=SimpleNamespace(cursor=12)), None

    def sync(version):
        raise RuntimeError(f"rollout worker rank 1 failed in receive_weights (version {version})")

    strategy._set_weights = sync
    strategy._start_early(3, Gate())  # does not raise
    step, result, cursor = strategy.prefetch
    assert (step, cursor) == (3, 12)  # a resume draws step 3's prompts again
    with pytest.raises(RuntimeError, match="receive_weights"):
        result.result()

