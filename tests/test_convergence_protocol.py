"""bench/convergence_protocol.py: the pure parts of the convergence benchmark (no training)."""

import math

import pytest

from bench import convergence_protocol as proto


def test_steps_to_reach_interpolates_between_eval_points() -> None:
    curve = [(0, 4.0), (25, 3.0), (50, 2.0), (75, 1.5)]
    assert proto.steps_to_reach(curve, 2.5) == pytest.approx(37.5)
    assert proto.steps_to_reach(curve, 2.0) == 50.0  # exactly at an eval point
    assert proto.steps_to_reach(curve, 5.0) == 0.0  # already there at the first point
    assert proto.steps_to_reach(curve, 1.0) is None  # never reached


def test_steps_to_reach_takes_the_first_crossing() -> None:
    curve = [(0, 3.0), (10, 1.9), (20, 2.2), (30, 1.5)]
    assert proto.steps_to_reach(curve, 2.0) == pytest.approx(10 * (1.0 / 1.1))


def test_value_at_interpolates_and_clamps() -> None:
    clock = [(0, 0.0), (25, 5.0), (50, 12.0)]
    assert proto.value_at(clock, 10) == pytest.approx(2.0)
    assert proto.value_at(clock, 37.5) == pytest.approx(8.5)
    assert proto.value_at(clock, -1) == 0.0
    assert proto.value_at(clock, 99) == 12.0
    with pytest.raises(ValueError):
        proto.value_at([], 1.0)


def test_seconds_to_reach_reads_the_clock_at_the_crossing_step() -> None:
    curve = [(0, 4.0), (25, 3.0), (50, 2.0)]
    clock = [(0, 0.0), (25, 10.0), (50, 30.0)]
    assert proto.seconds_to_reach(curve, clock, 2.5) == pytest.approx(20.0)  # step 37.5
    assert proto.seconds_to_reach(curve, clock, 1.0) is None


def test_ratios_against_the_baseline_run() -> None:
    curve = [(0, 4.0), (100, 2.0), (200, 1.0)]
    clock = [(0, 0.0), (100, 50.0), (200, 100.0)]
    r = proto.ratios_against(curve, clock, target=1.5, baseline_steps=400, baseline_seconds=150.0)
    assert r["steps"] == pytest.approx(150.0)
    assert r["seconds"] == pytest.approx(75.0)
    assert r["step_ratio"] == pytest.approx(150 / 400)
    assert r["wall_ratio"] == pytest.approx(75 / 150)
    never = proto.ratios_against(curve, clock, target=0.5, baseline_steps=400, baseline_seconds=150.0)
    assert never["step_ratio"] is None and never["wall_ratio"] is None


def test_pick_winner_lowest_finite_first_on_ties() -> None:
    a, b, c = (proto.Setting("adamw", lr, "wsd") for lr in (1e-3, 3e-3, 1e-2))
    assert proto.pick_winner({a: 2.1, b: 2.0, c: math.inf}) == b
    assert proto.pick_winner({a: 2.0, b: 2.0, c: math.nan}) == a
    with pytest.raises(ValueError):
        proto.pick_winner({a: math.inf, c: math.nan})


def test_at_grid_edge() -> None:
    grid = (0.01, 0.02, 0.04, 0.08)
    assert proto.at_grid_edge(0.01, grid) and proto.at_grid_edge(0.08, grid)
    assert not proto.at_grid_edge(0.02, grid)
    assert not proto.at_grid_edge(0.02, (0.02,))  # a one-point grid (--quick) has no edge to move


def test_spread_and_means() -> None:
    s = proto.spread([1.0, 2.0, 3.0])
    assert s == {"mean": 2.0, "std": pytest.approx(math.sqrt(2 / 3)), "min": 1.0, "max": 3.0}
    assert proto.mean_or_none([0.5, None]) is None
    assert proto.mean_or_none([]) is None
    assert proto.mean_or_none([0.5, 0.7]) == pytest.approx(0.6)
    assert proto.rel_diff(1.98, 2.0) == pytest.approx(-0.01)


def test_percentile_nearest_rank() -> None:
    values = list(range(1, 101))
    assert proto.percentile(values, 0.95) == 96
    assert proto.percentile(values, 0.5) == 51
    assert proto.percentile([3.0], 0.95) == 3.0


def test_ideal_clip_scales_each_head_by_its_own_previous_maximum() -> None:
    # head 0 was above tau (scaled by 10/20), head 1 below (left alone)
    assert proto.ideal_clip([20.0, 5.0], [22.0, 6.0], tau=10.0) == pytest.approx(1.1)
    # an unclipped head that jumps on the next batch decides the reading
    assert proto.ideal_clip([20.0, 9.0], [20.0, 12.0], tau=10.0) == pytest.approx(1.2)
    with pytest.raises(ValueError):
        proto.ideal_clip([1.0], [1.0, 2.0], tau=1.0)


def test_hold_stats_targets() -> None:
    actual = [1.0] * 90 + [1.1] * 10
    ideal = [1.0] * 90 + [1.09] * 10
    h = proto.hold_stats(actual, ideal, median_target=1.05, p95_factor=1.02)
    assert h["median"] == 1.0 and h["p95"] == 1.1 and h["ideal_p95"] == 1.09
    assert h["median_ok"] and h["p95_ok"]
    worse = proto.hold_stats([1.06] * 100, [1.0] * 100, median_target=1.05, p95_factor=1.02)
    assert not worse["median_ok"] and not worse["p95_ok"]
    assert proto.hold_stats([], [], 1.05, 1.02) == {"steps": 0, "median_ok": False, "p95_ok": False}


def test_plan_tunes_on_the_first_seed_then_interleaves_the_winners() -> None:
    grids = {"adamw": (1e-3, 3e-3), "muon": (0.02,), "muonclip": (0.02,)}
    runs = proto.plan_runs(grids, ("wsd", "cosine"), (0, 1, 2), 400)
    stage1 = [r for r in runs if r.stage == 1]
    stage2 = [r for r in runs if r.stage == 2]
    assert len(stage1) == (2 + 1 + 1) * 2 and {r.seed for r in stage1} == {0}
    assert [r.contender for r in stage1[:4]] == ["adamw"] * 4  # AdamW first: the others take its tuned lr
    assert [(r.seed, r.contender) for r in stage2] == [(s, c) for s in (0, 1, 2) for c in grids]
    est = proto.estimate_seconds(runs, {"adamw": 0.1, "muon": 0.2, "muonclip": 0.2}, overhead_s=1.0)
    assert est == pytest.approx(400 * (0.1 * 4 + 0.2 * 4) + 400 * 3 * (0.1 + 0.2 + 0.2) + len(runs))


def test_plan_interleaves_muons_horizons_with_each_seeds_winners() -> None:
    grids = {"adamw": (3e-3, 6e-3), "muon": (0.02,)}
    runs = proto.plan_runs(grids, ("wsd",), (0, 1), 400, horizons=(200, 300))
    later = [(r.stage, r.seed, r.contender, r.steps) for r in runs if r.stage > 1]
    assert later == [
        (2, 0, "adamw", 400),
        (3, 0, "muon", 200),
        (3, 0, "muon", 300),  # Muon's one setting: stage 1 ran it
        (2, 1, "adamw", 400),
        (2, 1, "muon", 400),
        (3, 1, "muon", 200),
        (3, 1, "muon", 300),
    ]


def test_plan_of_the_family_runs_every_challengers_horizons_and_prices_them_as_muon() -> None:
    grids = {"muon": (0.01, 0.02), "normuon": (0.01, 0.02), "muon-per-head": (0.01, 0.02)}
    runs = proto.plan_runs(grids, ("wsd",), (0, 1), 400, horizons=(300,), challengers=("normuon", "muon-per-head"))
    later = [(r.stage, r.seed, r.contender, r.steps) for r in runs if r.stage == 3]
    assert later == [(3, s, c, 300) for s in (0, 1) for c in ("normuon", "muon-per-head")]
    est = proto.estimate_seconds(runs, {"adamw": 0.1, "muon": 0.2})  # the variants take Muon's figure
    assert est == pytest.approx(0.2 * sum(r.steps for r in runs))


def test_horizon_steps_are_eval_points_shorter_than_the_run() -> None:
    assert proto.horizon_steps([0.5, 0.6, 0.7, 0.8], 400, 25) == [200, 250, 275, 325]
    assert proto.horizon_steps([0.61, 0.62, 1.0, 0.01], 400, 25) == [250]  # repeats, the full run and 0 dropped


def test_horizon_ratios_take_the_shortest_scheduled_run_that_reaches_the_target() -> None:
    runs = [(400, 1.60, 40.0), (200, 1.90, 21.0), (300, 1.70, 31.0), (250, 1.80, 26.0)]
    r = proto.horizon_ratios(runs, target=1.75, baseline_steps=400, baseline_seconds=36.0)
    assert r["steps"] == pytest.approx(275.0)  # between the 250- and 300-step runs
    assert r["seconds"] == pytest.approx(28.5)
    assert r["step_ratio"] == pytest.approx(275 / 400) and r["wall_ratio"] == pytest.approx(28.5 / 36)
    assert proto.horizon_ratios(runs, 1.5, 400, 36.0)["steps"] is None  # not even the full run reaches it
    assert proto.horizon_ratios(runs, 2.0, 400, 36.0)["steps"] == 200  # the shortest run: an upper bound


def test_setting_label() -> None:
    assert proto.Setting("muon", 0.04, "cosine").label == "muon lr=0.04 cosine"
    assert proto.describe(None) == "-" and proto.describe(0.12345) == "0.123"
