"""Automatic recovery of an async run on Ray: a rollout replica process is SIGKILLed while the next
step's samples are being prefetched; the run restarts from the checkpoint that holds the prefetched
samples and logs what an uninterrupted run logs (issue 21; the replicas are issue 17's)."""

import os
import signal
import threading
import time

import pytest
import torch

pytest.importorskip("fuseflow.controller.replica")  # Ray rollout replicas: async runs on Ray only with them

from fuseflow.bench.recovery import descendant_titles  # noqa: E402
from fuseflow.bench.trl import QUICK_OVERRIDES  # noqa: E402
from fuseflow.config import load_config  # noqa: E402
from fuseflow.runner import train  # noqa: E402
from fuseflow.telemetry.metrics import read_events, read_metrics  # noqa: E402
from ray_fixtures import ray_cluster  # noqa: E402, F401 - module-scoped fixture

pytestmark = pytest.mark.usefixtures("ray_cluster")


def _replica_pids() -> list[int]:
    """Pids of the ``ray::RolloutReplica`` processes descended from this one (this test's cluster)."""
    return sorted(pid for pid, title in descendant_titles().items() if title.startswith("ray::RolloutReplica"))


@pytest.mark.slow  # two 4-step Ray runs with two replica processes each
def test_a_killed_replica_of_an_async_ray_run_restarts_and_matches(tmp_path, sft_cache):
    from safetensors.torch import load_file

    cfg = load_config("sort", [*QUICK_OVERRIDES, "algorithm.name=ppo", "trainer.steps=4", "trainer.eval_every=2",
                               "trainer.save_every=1", "trainer.eval_size=8", "task.eval_size=8",
                               f"cache_dir={sft_cache}", "backend=ray", "pools.main.cpus_per_worker=0.5",
                               "schedule.mode=async", "schedule.rollout_workers=2", "placement.rollout=rollout",
                               "pools.rollout.cpus_per_worker=0.5", "ray.collective_timeout_s=30",
                               "trainer.max_restarts=1"])
    full = train(cfg, tmp_path / "full")
    run, killed = tmp_path / "cut", []

    def kill_a_replica():  # once step_2 is saved, step 3 trains while step 4 is generated ahead
        while not (run / "checkpoints" / "step_2").exists() or len(_replica_pids()) < 2:
            time.sleep(0.02)
        killed.append(_replica_pids()[-1])
        os.kill(killed[0], signal.SIGKILL)

    threading.Thread(target=kill_a_replica, daemon=True).start()
    cut = train(cfg, run)
    assert killed and cut["restarts"] == 1 and full["restarts"] == 0
    (event,) = read_events(run, "restart")
    assert event["resumed_from"] >= 2 and "its process died" in event["cause"], event
    # schedule/ counts where work ran (e.g. which replica took a log-prob batch), which timing decides.
    keep = lambda rows: [{k: v for k, v in r.items()  # noqa: E731
                          if not k.startswith(("time/", "perf/", "trace/", "rollout/weight", "schedule/"))}
                         for r in rows]
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert keep(rows) == keep(read_metrics(tmp_path / "full"))
    assert cut["evals"] == full["evals"]
    a = load_file(str(tmp_path / "full/checkpoints/step_4/actor/model.safetensors"))
    b = load_file(str(tmp_path / "cut/checkpoints/step_4/actor/model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
