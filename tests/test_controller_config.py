"""The placement config surface: backend, pools, placement and per-role dp (no workers started)."""

import pytest

from fuseflow.config import ConfigError, load_config
from fuseflow.controller.placement import resolve_placement


def test_default_is_local_and_one_colocated_pool():
    cfg = load_config("default")
    assert cfg.backend == "local" and cfg.role_dp() == {"actor": 1, "reference": 1, "critic": 1, "reward": 1}
    p = cfg.resolved_placement()
    assert list(p.pools) == ["main"] and p.pools["main"].size == 1
    assert set(p.role_pool.values()) == {"main"} and list(p.role_pool) == ["actor", "reference", "critic", "reward"]


def test_acceptance_command_colocated_and_split():
    base = ["algorithm.name=ppo", "backend=ray", "actor.dp=2", "critic.dp=2", "trainer.steps=5"]
    colo = load_config("default", base).resolved_placement()
    assert {n: p.size for n, p in colo.pools.items()} == {"main": 2}
    assert colo.dp == {"actor": 2, "reference": 2, "critic": 2, "reward": 1}  # reference follows actor.dp
    split = load_config("default", [*base, "placement.critic=critic"]).resolved_placement()
    assert {n: p.size for n, p in split.pools.items()} == {"main": 2, "critic": 2}
    assert [r for r, q in split.role_pool.items() if q == "critic"] == ["critic"] and split.cpus_needed() == 4.0


def test_explicit_pool_resources():
    cfg = load_config("default", ["backend=ray", "actor.dp=4", "trainer.mini_batch_size=128",
                                  "pools.main.nodes=2", "pools.main.workers_per_node=2", "pools.main.gpus_per_worker=1"])
    main = cfg.resolved_placement().pools["main"]
    assert (main.nodes, main.workers_per_node, main.size, main.gpus_per_worker) == (2, 2, 4, 1.0)


@pytest.mark.parametrize("overrides, message", [
    (["actor.dp=2"], "actor.dp=2 needs backend=ray"),
    (["backend=ray", "actor.dp=2", "critic.dp=1"], "critic.dp=1 must equal the size of its pool 'main'"),
    (["backend=ray", "actor.dp=3"], "actor.dp=3 must divide trainer.mini_batch_size=128"),
    (["backend=ray", "pools.spare.nodes=1"], "pools.spare: no role is placed on it"),
    (["backend=ray", "actor.dp=2", "pools.main.workers_per_node=1"], "actor.dp=2 does not fit pool 'main'"),
    (["backend=ray", "pools.main.cpus=1"], "allowed keys here: nodes, workers_per_node, cpus_per_worker"),
    (["backend=slurm"], "backend: invalid value 'slurm'"),
])
def test_bad_placements_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("(", r"\(")):
        load_config("default", overrides)


def test_reference_may_use_fewer_ranks_than_its_pool():
    p = resolve_placement({}, {"actor": "main", "reference": "main"}, {"actor": 2, "reference": 1})
    assert p.pools["main"].size == 2 and p.dp["reference"] == 1


def test_unreachable_ray_address_is_a_one_line_error_before_any_training(tmp_path):
    from typer.testing import CliRunner

    from fuseflow.cli import app

    result = CliRunner().invoke(app, ["train", "--output", str(tmp_path / "run"), f"cache_dir={tmp_path}",
                                      "backend=ray", "ray.address=127.0.0.1:1", "task.train_size=50"])
    assert result.exit_code == 2, result.output
    assert "ray.address=127.0.0.1:1: no Ray cluster reachable there" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "sft").exists()  # failed before the SFT
