"""Automatic recovery on Ray: a killed worker process restarts the worker groups from the last checkpoint,
and the run logs what an uninterrupted one logs; each restart shows in metrics.jsonl, trace.json and summary."""

import json
import threading
import time

import pytest

from fuseflow.config import load_config
from fuseflow.controller.group import WorkerFailure
from fuseflow.runner import train
from fuseflow.telemetry.metrics import read_events, read_metrics
from ray_fixtures import ray_cluster  # noqa: F401 - module-scoped fixture
from test_controller_train import TINY, _comparable, _file_task

pytestmark = pytest.mark.usefixtures("ray_cluster")


def _kill_after(run, step: int, killed: list, times: int = 1):
    """Kill the run's worker process once checkpoint ``step_{step}`` exists (then again at later ones)."""
    import ray

    def kill():
        for k in range(times):
            target = run / "checkpoints" / f"step_{step * (k + 1)}"
            while not target.exists():
                time.sleep(0.05)
            name = next(n for n in ray.util.list_named_actors() if n.startswith(f"fuseflow-{run.name}-"))
            ray.kill(ray.get_actor(name), no_restart=True)
            killed.append(name)

    threading.Thread(target=kill, daemon=True).start()


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


@pytest.mark.slow  # ~40 s on 2 cores
def test_restarts_beyond_the_budget_end_the_run_saying_so(tmp_path, sft_cache):
    run, killed = tmp_path / "run", []
    args = [*TINY, *_file_task(tmp_path), f"cache_dir={sft_cache}", "backend=ray", "trainer.steps=40",
            "trainer.max_restarts=1", "ray.collective_timeout_s=30"]
    _kill_after(run, 1, killed, times=2)
    with pytest.raises(WorkerFailure, match=r"its process died .*after 1 automatic restart\(s\) "
                                            r"\(trainer.max_restarts=1\); last checkpoint: step_\d+; resume with"):
        train(load_config("default", args), run)
    assert len(killed) == 2 and len(read_events(run, "restart")) == 1
