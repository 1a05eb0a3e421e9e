"""`fuseflow bench fusion-pool`: several `bench fusion` runs pooled per repeat, each over its own bound."""

import json

import pytest
from typer.testing import CliRunner


def _run(bound, fused, elastic_ws=None):
    modes = {"sequential": {"speedup_vs_sequential": 1.0, "speedup_vs_sequential_runs": [1.0] * len(fused),
                            "worker_seconds_vs_sequential": 1.0},
             "fused": {"speedup_vs_sequential": sorted(fused)[(len(fused) - 1) // 2],
                       "speedup_vs_sequential_runs": fused, "worker_seconds_vs_sequential": 0.9}}
    if elastic_ws is not None:
        modes["elastic"] = {"speedup_vs_sequential": 0.95, "worker_seconds_vs_sequential": elastic_ws}
    return {"benchmark": "ppo_sort_fusion", "speedup_bound": bound, "modes": modes}


def test_pool_runs_matches_its_docstring_example():
    import doctest

    from fuseflow.bench import fusion_pool

    result = doctest.testmod(fusion_pool)
    assert result.attempted >= 1 and result.failed == 0


def test_pool_runs_takes_each_repeat_over_its_own_runs_bound():
    from fuseflow.bench.fusion_pool import pool_runs

    out = pool_runs([_run(1.2, [1.1, 1.2, 1.05]), _run(1.5, [1.2, 1.3], elastic_ws=0.4)])
    fused = out["modes"]["fused"]
    assert out["runs"] == 2 and out["speedup_bounds"] == [1.2, 1.5] and "sequential" not in out["modes"]
    assert out["runs_by_modes"] == {"sequential,fused": 1, "sequential,fused,elastic": 1}
    assert fused["runs"] == 2 and fused["speedup_vs_sequential_per_repeat"] == [1.1, 1.2, 1.05, 1.2, 1.3]
    # (1.1-1)/0.2, (1.2-1)/0.2, (1.05-1)/0.2, then over 0.5: 0.4, 0.6
    assert fused["room_captured_per_repeat"] == pytest.approx([0.5, 1.0, 0.25, 0.4, 0.6])
    # Mean 0.55; deviations -0.05, 0.45, -0.3, -0.15, 0.05 square to 0.32, so the sample sd is sqrt(0.32 / 4);
    # t on 4 degrees of freedom is 2.776
    half = 2.776 * (0.32 / 4) ** 0.5 / 5 ** 0.5
    assert fused["room_captured_mean"] == pytest.approx(0.55, abs=1e-6)
    assert fused["room_captured_ci95"] == pytest.approx([0.55 - half, 0.55 + half], abs=1e-5)
    assert fused["speedup_vs_sequential_mean"] == pytest.approx(1.17, abs=1e-6)
    assert fused["worker_seconds_vs_sequential_per_run"] == [0.9, 0.9]
    # A mode in one run only, with no per-repeat ratios: its one ratio, no interval from a single value.
    elastic = out["modes"]["elastic"]
    assert elastic["runs"] == 1 and elastic["speedup_vs_sequential_per_repeat"] == [0.95]
    assert "speedup_vs_sequential_ci95" not in elastic and elastic["worker_seconds_vs_sequential_per_run"] == [0.4]


def test_pool_runs_refuses_what_it_cannot_pool():
    from fuseflow.bench.fusion_pool import pool_runs

    with pytest.raises(ValueError, match="no runs"):
        pool_runs([])
    with pytest.raises(ValueError, match="run 2 is not a `fuseflow bench fusion` result"):
        pool_runs([_run(1.2, [1.1, 1.2]), {"benchmark": "controller"}])
    no_seq = _run(1.2, [1.1])
    del no_seq["speedup_bound"], no_seq["modes"]["sequential"]
    with pytest.raises(ValueError, match="run 1 has no sequential mode"):
        pool_runs([no_seq])


def test_fusion_pool_cli_writes_json_and_fails_in_one_line(tmp_path):
    from fuseflow.cli import app

    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_run(1.2, [1.1, 1.2])))
    b.write_text(json.dumps(_run(1.5, [1.2, 1.3])))
    out = tmp_path / "pooled.json"
    r = CliRunner().invoke(app, ["bench", "fusion-pool", str(a), str(b), "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert "fused" in r.output and "4 repeats" in r.output and "runs of different modes" not in r.output
    c = tmp_path / "c.json"  # a run with elastic as well: its bound may come from elastic's CPU
    c.write_text(json.dumps(_run(1.5, [1.2], elastic_ws=0.4)))
    r = CliRunner().invoke(app, ["bench", "fusion-pool", str(a), str(c)])
    assert r.exit_code == 0 and "runs of different modes: 1 of sequential,fused; 1 of sequential,fused,elastic" in r.output
    assert json.loads(out.read_text())["modes"]["fused"]["room_captured_per_repeat"] == pytest.approx(
        [0.5, 1.0, 0.4, 0.6])
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    for args in ([str(tmp_path / "missing.json")], [str(bad)]):
        r = CliRunner().invoke(app, ["bench", "fusion-pool", *args])
        assert r.exit_code == 2
        assert "cannot pool" in r.output and len(r.output.strip().splitlines()) == 1


def test_fusion_pool_prints_no_room_for_elastic(tmp_path):
    """Elastic's target is worker-seconds, not speed: its room stays in the JSON but is not printed."""
    from fuseflow.cli import app

    files = []
    for i, bound in enumerate((1.2, 1.5)):
        run = _run(bound, [1.1, 1.2], elastic_ws=0.4)
        run["modes"]["elastic"]["speedup_vs_sequential_runs"] = [0.95, 1.0]
        files.append(tmp_path / f"{i}.json")
        files[-1].write_text(json.dumps(run))
    out = tmp_path / "pooled.json"
    r = CliRunner().invoke(app, ["bench", "fusion-pool", *map(str, files), "-o", str(out)])
    assert r.exit_code == 0, r.output
    lines = {line.split()[0]: line for line in r.output.splitlines() if line.startswith(("fused ", "elastic "))}
    assert "room" in lines["fused"] and "room" not in lines["elastic"] and "worker-s x0.40-0.40" in lines["elastic"]
    assert "room_captured_mean" in json.loads(out.read_text())["modes"]["elastic"]


def test_pool_runs_averages_where_each_mode_left_the_room():
    """room_lost from each run's median figures (its own least CPU), averaged over the runs that measured it."""
    from fuseflow.bench.fusion_pool import pool_runs

    def run(seq_cpu, fused_cpu, fused_u, fused_busy):
        r = _run(1.2, [1.1])
        r["modes"]["sequential"] |= {"cpu_seconds_per_step": seq_cpu, "cpu_utilisation": 0.9, "machine_busy": 0.95}
        r["modes"]["fused"] |= {"cpu_seconds_per_step": fused_cpu, "cpu_utilisation": fused_u,
                                "machine_busy": fused_busy}
        return r

    old = _run(1.3, [1.2])  # an older JSON without the CPU figures: pooled for its ratios, not for room_lost
    out = pool_runs([run(2.0, 1.6, 0.96, 0.98), run(1.5, 2.0, 0.8, 0.9), old])
    fused = out["modes"]["fused"]
    # Run 1: fused is the least (1.6): idle 0.02, others 0.02, extra 0. Run 2: sequential is (1.5): idle 0.1,
    # others 0.1, extra 0.8 x (1 - 1.5 / 2.0) = 0.2.
    assert fused["room_lost_per_run"] == [pytest.approx({"idle": 0.02, "other_processes": 0.02, "extra_cpu": 0.0}),
                                          pytest.approx({"idle": 0.1, "other_processes": 0.1, "extra_cpu": 0.2})]
    assert fused["room_lost_runs"] == 2 and fused["runs"] == 3
    assert fused["room_lost_mean"] == pytest.approx({"idle": 0.06, "other_processes": 0.06, "extra_cpu": 0.1})
    assert "room_lost_mean" not in pool_runs([old])["modes"]["fused"]
