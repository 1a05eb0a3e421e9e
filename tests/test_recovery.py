"""Automatic recovery: a killed worker process restarts the worker groups from the last checkpoint,
and the run logs what an uninterrupted one logs; each restart shows in metrics.jsonl, trace.json and summary.

The Ray tests SIGKILL a real worker process (``ray::WorkerHost``), as the OOM killer or a lost node
would. Async prefetch runs only on ``backend=local`` so far (config validation refuses
``schedule.mode=async`` with ``backend=ray``); its restart is tested there, with the failure a dead
Ray process raises injected into the actor's update while the next step's generation is in flight.
"""

import functools
import json
import os
import signal
import threading
import time

import pytest
import torch

from fuseflow.bench.recovery import Killer, worker_pids
from fuseflow.bench.trl import QUICK_OVERRIDES
from fuseflow.config import load_config
from fuseflow.controller.group import WorkerFailure
from fuseflow.runner import train
from fuseflow.telemetry.metrics import read_events, read_metrics
from ray_fixtures import ray_cluster  # noqa: F401 - module-scoped fixture
from test_controller_train import TINY, _comparable, _file_task


def _kill_after(run, step: int, killed: list, times: int = 1, rank: int = 0):
    """SIGKILL one worker process of the run (``rank``-th by pid) once checkpoint ``step_{step}`` exists,
    then again at ``2 * step``, ... (``times`` in all)."""

    def kill():
        for k in range(times):
            target = run / "checkpoints" / f"step_{step * (k + 1)}"
            while not target.exists() or not worker_pids():
                time.sleep(0.05)
            pid = worker_pids()[rank]
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    threading.Thread(target=kill, daemon=True).start()


@pytest.mark.usefixtures("ray_cluster")
def test_a_killed_worker_restarts_and_the_run_matches_an_uninterrupted_one(tmp_path, sft_cache):
    args = [*TINY, *_file_task(tmp_path), f"cache_dir={sft_cache}", "backend=ray", "trainer.steps=6",
            "trainer.eval_every=3", "ray.collective_timeout_s=30"]
    full = train(load_config("default", args), tmp_path / "full")
    run, killed = tmp_path / "cut", []
    _kill_after(run, 2, killed)
    cut = train(load_config("default", [*args, "trainer.max_restarts=1"]), run)
    assert killed, "the worker was never killed"
    assert _comparable(read_metrics(run)) == _comparable(read_metrics(tmp_path / "full"))
    assert [e["step"] for e in cut["evals"]] == [0, 3, 6]
    for a, b in zip(cut["evals"], full["evals"], strict=True):
        assert a == pytest.approx(b)
    (event,) = read_events(run, "restart")
    assert event["resumed_from"] >= 2 and event["failed_step"] > event["resumed_from"]
    assert "its process died" in event["cause"] and event["seconds_lost"] > 0
    spans = [e for e in json.loads((run / "trace.json").read_text())["traceEvents"] if e.get("name") == "restart"]
    assert len(spans) == 1 and spans[0]["args"]["failed_step"] == event["failed_step"]
    assert cut["restarts"] == 1 and full["restarts"] == 0
    assert json.loads((run / "summary.json").read_text())["restarts"] == 1


@pytest.mark.slow  # ~130 s on 2 cores under load (two dp=2 runs)
@pytest.mark.usefixtures("ray_cluster")
def test_killing_one_rank_of_a_data_parallel_pool_restarts_the_pool_and_matches(tmp_path, sft_cache):
    """At actor.dp=2 the surviving rank waits in a collective for its dead peer: the restart must end it too,
    start two fresh processes with a new process group and continue exactly."""
    args = [*TINY, *_file_task(tmp_path), f"cache_dir={sft_cache}", "backend=ray", "actor.dp=2", "trainer.steps=4",
            "ray.collective_timeout_s=30", "pools.main.cpus_per_worker=0.5"]
    full = train(load_config("default", args), tmp_path / "full")
    run, killed = tmp_path / "cut", []
    _kill_after(run, 2, killed, rank=-1)
    cut = train(load_config("default", [*args, "trainer.max_restarts=1"]), run)
    assert len(killed) == 1 and cut["restarts"] == 1
    (event,) = read_events(run, "restart")
    assert event["resumed_from"] >= 2 and "its process died" in event["cause"]
    assert _comparable(read_metrics(run)) == _comparable(read_metrics(tmp_path / "full"))
    assert cut["evals"] == full["evals"]


@pytest.mark.slow  # ~80 s on 2 cores under load
@pytest.mark.usefixtures("ray_cluster")
def test_a_collective_that_times_out_restarts_the_pool(tmp_path, sft_cache):
    """A rank that hangs (SIGSTOP: alive, but silent) leaves its peer's collective to time out; that
    failure restarts the pool too, the hung process is killed with it, and the run completes."""
    run, stopped = tmp_path / "run", []
    args = [*TINY, *_file_task(tmp_path), f"cache_dir={sft_cache}", "backend=ray", "actor.dp=2", "trainer.steps=4",
            "ray.collective_timeout_s=5", "pools.main.cpus_per_worker=0.5", "trainer.max_restarts=1"]

    def stop_rank_1():  # rank 0 alone runs rank-zero calls (generate); rank 1 is needed only in collectives
        import ray

        while not (run / "checkpoints" / "step_2").exists():
            time.sleep(0.05)
        name = next(n for n in ray.util.list_named_actors() if n.startswith(f"fuseflow-{run.name}-")
                    and n.endswith("-main-1"))
        stopped.append(ray.get(ray.get_actor(name).ready.remote()))  # its pid
        os.kill(stopped[0], signal.SIGSTOP)

    threading.Thread(target=stop_rank_1, daemon=True).start()
    summary = train(load_config("default", args), run)
    assert stopped and summary["restarts"] == 1 and [r["step"] for r in read_metrics(run)] == [1, 2, 3, 4]
    (event,) = read_events(run, "restart")
    assert "Timed out" in event["cause"] and "rank 0" in event["cause"], event["cause"]  # the survivor's timeout
    assert stopped[0] not in worker_pids()  # the hung process went with the pool


@pytest.mark.slow  # ~40 s on 2 cores
@pytest.mark.usefixtures("ray_cluster")
def test_restarts_beyond_the_budget_end_the_run_saying_so(tmp_path, sft_cache):
    run, killed = tmp_path / "run", []
    args = [*TINY, *_file_task(tmp_path), f"cache_dir={sft_cache}", "backend=ray", "trainer.steps=40",
            "trainer.max_restarts=1", "ray.collective_timeout_s=30"]
    _kill_after(run, 1, killed, times=2)
    with pytest.raises(WorkerFailure, match=r"its process died .*after 1 automatic restart\(s\) "
                                            r"\(trainer.max_restarts=1\); last checkpoint: step_\d+; resume with"):
        train(load_config("default", args), run)
    assert len(killed) == 2 and len(read_events(run, "restart")) == 1


def test_an_async_run_restarts_from_the_checkpoint_that_holds_its_prefetched_samples(tmp_path, sft_cache,
                                                                                     monkeypatch):
    """The actor's update of step 3 fails while step 4's samples are being generated ahead.

    The restart must stop the prefetching thread, resume from step_2 (whose checkpoint holds step 3's
    prefetched samples) and give every metric and weight of the uninterrupted run.
    """
    from safetensors.torch import load_file

    from fuseflow.workers.actor import ActorWorker

    cfg = load_config("sort", [*QUICK_OVERRIDES, "algorithm.name=ppo", "trainer.steps=4", "trainer.eval_every=2",
                               "trainer.save_every=2", "trainer.eval_size=8", "task.eval_size=8",
                               f"cache_dir={sft_cache}", "schedule.mode=async", "trainer.max_restarts=1"])
    full = train(cfg, tmp_path / "full")
    update, failed = ActorWorker.update, []

    @functools.wraps(update)  # keeps the worker-method registration
    def dies_once_at_step_3(self, batch, lr, kl_coef, seed):
        if seed == cfg.seed + 3 and not failed:  # the trainer seeds step t's update with seed + t
            failed.append(seed)
            raise WorkerFailure("actor", 0, "update", "its process died (injected)")
        return update(self, batch, lr, kl_coef, seed)

    monkeypatch.setattr(ActorWorker, "update", dies_once_at_step_3)
    cut = train(cfg, tmp_path / "cut")
    assert failed and cut["restarts"] == 1 and full["restarts"] == 0
    (event,) = read_events(tmp_path / "cut", "restart")
    assert (event["failed_step"], event["resumed_from"]) == (3, 2) and "injected" in event["cause"]
    keep = lambda rows: [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/", "trace/"))}  # noqa: E731
                         for r in rows]
    rows = read_metrics(tmp_path / "cut")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[2]["async/staleness_max"] == 1  # step 3 trained on the checkpointed samples, not regenerated ones
    assert keep(rows) == keep(read_metrics(tmp_path / "full"))
    assert cut["evals"] == full["evals"]
    a = load_file(str(tmp_path / "full/checkpoints/step_4/actor/model.safetensors"))
    b = load_file(str(tmp_path / "cut/checkpoints/step_4/actor/model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.usefixtures("ray_cluster")
def test_the_killer_finds_only_this_process_s_ray_workers_and_kills_at_the_logged_step(tmp_path):
    """``fuseflow bench recovery``'s watcher: it SIGKILLs a descendant ``ray::WorkerHost`` once step N is logged."""
    import ray

    from fuseflow.controller.host import WorkerHost

    host = ray.remote(num_cpus=0)(WorkerHost).remote("pool", 0, 1)
    pids = [ray.get(host.ready.remote())]  # the host's own pid
    assert worker_pids() == pids
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    killer = Killer(tmp_path, [2], log=lambda *_: None)
    killer.start()
    time.sleep(0.5)
    assert killer.kills == []  # step 2 not logged yet
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": 1, "event": "restart"}) + "\n" + json.dumps({"step": 2}) + "\n")
    killer.join(timeout=10)
    assert [k["at_step"] for k in killer.kills] == [2] and killer.kills[0]["pid"] == pids[0]
    deadline = time.time() + 10
    while worker_pids() and time.time() < deadline:
        time.sleep(0.1)
    assert worker_pids() == []


@pytest.mark.parametrize("argv, message", [
    (["--steps", "40", "--kill-every", "50"], "error: --kill-every=50 must be smaller than --steps=40"),
    (["--max-restarts", "2"], "error: 3 kills need --max-restarts>=3 (got 2)"),
    (["trainer.stepz=3"], "error: trainer.stepz: unknown key"),
])
def test_bench_recovery_bad_input_is_one_line_before_any_run(argv, message, tmp_path):
    from typer.testing import CliRunner

    from fuseflow.cli import app

    result = CliRunner().invoke(app, ["bench", "recovery", "--work-dir", str(tmp_path / "w"), *argv])
    assert result.exit_code == 2 and result.stderr.startswith(message), result.output
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "w").exists()
