"""`fuseflow bench fusion`'s figures: the bound, the rooms, the intervals and where a mode falls short."""

import statistics

import pytest


def test_bench_fusion_figures_match_their_docstring_examples():
    """speedup_bound, room_captured, repeat_spread and speedup_bound_placement on hand-computed inputs."""
    import doctest

    from fuseflow.bench import fusion

    result = doctest.testmod(fusion)
    assert result.attempted >= 4 and result.failed == 0


def test_bench_fusion_reports_every_mode(tmp_path, sft_cache):
    from fuseflow.bench.fusion import run_fusion

    out = run_fusion(steps=2, workers=2, quick=True, modes=("sequential", "fused+elastic"), trl_steps=0,
                     plot=tmp_path / "reward.png", work_dir=tmp_path, extra=[f"cache_dir={sft_cache}"],
                     log=lambda *_: None, repeats=2)
    assert set(out["modes"]) == {"sequential", "fused+elastic"}
    assert out["modes"]["sequential"]["speedup_vs_sequential"] == 1.0
    assert out["modes"]["sequential"]["speedup_vs_sequential_runs"] == [1.0, 1.0]
    # Each repeat's ratio pairs fused with the sequential run of the same repeat.
    seq, fused = out["modes"]["sequential"], out["modes"]["fused+elastic"]
    assert fused["speedup_vs_sequential_runs"] == [
        pytest.approx(f / s, rel=1e-2) for f, s in zip(fused["samples_per_second_runs"], seq["samples_per_second_runs"],
                                                       strict=True)]
    for r in out["modes"].values():  # the reported run is the lower median of the repeats
        assert len(r["samples_per_second_runs"]) == 2
        assert r["cpu_seconds_per_step_by_process"] in [  # the median run's own split is one of the repeats'
            {k: pytest.approx(v, abs=1e-4) for k, v in x.items()} for x in r["cpu_seconds_per_step_by_process_runs"]]
        assert round(r["samples_per_second"], 2) == min(r["samples_per_second_runs"])
        # From the unrounded figures: within what the runs' rounding to 0.01 samples/s allows.
        lo, hi = sorted(r["samples_per_second_runs"])
        assert (hi - 0.005) / (lo + 0.005) - 1 - 1e-6 <= r["repeat_spread"] <= (hi + 0.005) / (lo - 0.005) - 1 + 1e-6
    # The mean of the per-repeat ratios and its 95% interval (two repeats: t = 12.706 on one degree of freedom).
    a, b = fused["speedup_vs_sequential_runs"]
    assert fused["speedup_vs_sequential_mean"] == pytest.approx((a + b) / 2, abs=1e-6)
    assert fused["speedup_vs_sequential_ci95"] == [pytest.approx((a + b) / 2 - 12.706 * abs(a - b) / 2, abs=1e-5),
                                                   pytest.approx((a + b) / 2 + 12.706 * abs(a - b) / 2, abs=1e-5)]
    assert seq["speedup_vs_sequential_ci95"] == [1.0, 1.0]
    assert out["repeat_spread_max"] == max(r["repeat_spread"] for r in out["modes"].values())
    assert out["modes"][out["repeat_spread_mode"]]["repeat_spread"] == out["repeat_spread_max"]
    for r in out["modes"].values():
        assert r["samples_per_second"] > 0 and 0 < r["busy_fraction"] <= 1 and len(r["reward_per_step"]) == 2
        # Process CPU time over wall time x cores: positive, and no more than the cores allow.
        assert r["cpu_seconds_per_step"] > 0 and 0 < r["cpu_utilisation"] <= 1.02
        # Local: every thread is this process's, so the split by process holds the controller alone.
        assert r["cpu_seconds_per_step_by_process"] == {"controller": pytest.approx(r["cpu_seconds_per_step"])}
        # Every process's use of the same cores over the same steps: at least the run's own (to the ticks).
        assert r["cpu_utilisation"] - 0.05 <= r["machine_busy"] <= 1.0
    least = min(r["cpu_seconds_per_step"] for r in out["modes"].values())
    mean_step = seq["samples_per_step"] / seq["samples_per_second"]  # what samples/s, and so each ratio, uses
    assert out["speedup_bound"] == pytest.approx(mean_step * out["cores"] / least)
    assert out["modes"][out["speedup_bound_mode"]]["cpu_seconds_per_step"] == least
    for r in out["modes"].values():  # what each mode left between its speedup and the bound, which it adds up to
        lost = r["room_lost"]
        assert lost["idle"] == pytest.approx(1 - r["machine_busy"], abs=1e-6)
        assert lost["other_processes"] == pytest.approx(r["machine_busy"] - r["cpu_utilisation"], abs=1e-6)
        assert lost["extra_cpu"] >= 0 and (lost["extra_cpu"] == 0) == (r["cpu_seconds_per_step"] == least)
        assert 1 - sum(lost.values()) == pytest.approx(r["speedup_vs_sequential"] / out["speedup_bound"], abs=1e-5)
    if out["speedup_bound"] > 1:  # the share of the bound's room each mode took
        assert fused["room_captured"] == pytest.approx((fused["speedup_vs_sequential"] - 1)
                                                       / (out["speedup_bound"] - 1), abs=1e-5)
        assert seq["room_captured"] == 0.0
        assert fused["room_captured_mean"] == pytest.approx((fused["speedup_vs_sequential_mean"] - 1)
                                                            / (out["speedup_bound"] - 1), abs=1e-5)
        lo, hi = fused["room_captured_ci95"]
        assert lo <= fused["room_captured_mean"] <= hi
    # fused+elastic trains like sequential, so its rewards match step for step
    assert fused["reward_per_step"] == seq["reward_per_step"]
    # Worker-seconds: sequential holds both workers for its whole (timed) step; elastic only while they work.
    assert seq["worker_seconds"] == pytest.approx(2 * seq["step_wall_seconds"][1], rel=0.05)
    assert 0 < fused["worker_seconds"] < seq["worker_seconds"]
    assert fused["worker_seconds_vs_sequential"] == pytest.approx(fused["worker_seconds"] / seq["worker_seconds"])
    assert (tmp_path / "reward.png").stat().st_size > 0


def test_speedup_bound_spreads_the_least_cpu_work_over_the_cores():
    from fuseflow.bench.fusion import speedup_bound

    # sequential: 256 samples at 128/s is a 2.0 s mean step (its median is not what samples/s uses)
    modes = {"sequential": {"samples_per_step": 256, "samples_per_second": 128.0, "step_seconds": 1.5,
                            "cpu_seconds_per_step": 3.6},
             "fused": {"step_seconds": 1.9, "cpu_seconds_per_step": 3.2}}
    assert speedup_bound(modes, 2) == pytest.approx(2.0 / 1.6)  # fused's 3.2 CPU-s on 2 cores: 1.6 s a step
    assert speedup_bound(modes, 4) == pytest.approx(2.0 / 0.8)
    assert speedup_bound({"fused": modes["fused"]}, 2) is None  # nothing to compare against


def test_mean_interval_uses_students_t():
    from fuseflow.bench.fusion import mean_interval

    assert mean_interval([1.07]) is None  # one repeat: no interval
    # Six repeats, 1.05 -+ d three times each: mean 1.05, sample sd exactly 0.04
    d = 0.04 * (5 / 6) ** 0.5
    vals = [1.05 - d, 1.05 + d] * 3
    mean, lo, hi = mean_interval(vals)
    assert mean == pytest.approx(1.05)
    assert hi - mean == pytest.approx(2.571 * 0.04 / 6 ** 0.5, abs=2e-6)  # t(0.975, 5 dof) = 2.571
    assert mean - lo == pytest.approx(hi - mean, abs=2e-6)
    # Beyond 30 degrees of freedom the quantile stays at 30's (2.042), never the narrower normal 1.960.
    many = [1.0, 1.2] * 40
    mean, lo, hi = mean_interval(many)
    assert hi - mean == pytest.approx(2.042 * statistics.stdev(many) / 80 ** 0.5, abs=2e-6)


def test_room_captured_is_the_share_of_the_bounds_gain():
    from fuseflow.bench.fusion import room_captured

    assert room_captured(1.15, 1.3) == pytest.approx(0.5)
    assert room_captured(0.97, 1.3) == pytest.approx(-0.1)  # slower than sequential
    assert room_captured(1.1, 1.0) is None  # the bound leaves no room
