"""A sweep's pure parts (app.services.search): grid and seeded random trials, values set at spec paths,
and the ASHA rule."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from app.services import search

SPACE = {
    "optimizer.lr": {"log_uniform": [1e-3, 1e-1]},
    "optimizer.name": {"values": ["muon", "muonclip", "adamw"]},
    "train.batch_size": {"int_uniform": [4, 8]},
    "optimizer.momentum": {"uniform": [0.8, 0.99]},
}


def test_the_grid_is_every_combination_the_first_path_varying_slowest():
    space = {"a.x": {"values": [1, 2]}, "b": {"values": ["p", "q", "r"]}}
    assert search.grid(space) == [
        {"a.x": 1, "b": "p"},
        {"a.x": 1, "b": "q"},
        {"a.x": 1, "b": "r"},
        {"a.x": 2, "b": "p"},
        {"a.x": 2, "b": "q"},
        {"a.x": 2, "b": "r"},
    ]


def test_random_trials_repeat_with_the_seed_whatever_the_order_of_the_space():
    first = search.sample(SPACE, 20, seed=7)
    assert first == search.sample(dict(reversed(list(SPACE.items()))), 20, seed=7)
    assert first != search.sample(SPACE, 20, seed=8)
    for trial in first:
        assert list(trial) == list(SPACE)
        assert 1e-3 <= trial["optimizer.lr"] <= 1e-1
        assert trial["optimizer.name"] in ("muon", "muonclip", "adamw")
        assert isinstance(trial["train.batch_size"], int) and 4 <= trial["train.batch_size"] <= 8
        assert 0.8 <= trial["optimizer.momentum"] <= 0.99


def test_log_uniform_spreads_evenly_over_decades():
    lrs = [t["optimizer.lr"] for t in search.sample({"optimizer.lr": {"log_uniform": [1e-4, 1e-0]}}, 4000, seed=1)]
    per_decade = [sum(1 for lr in lrs if 10**-d <= lr < 10 ** (-d + 1)) for d in (4, 3, 2, 1)]
    assert all(800 < n < 1200 for n in per_decade), per_decade


def test_values_are_set_at_their_paths_on_a_copy():
    base = {"model": {"arch": "gpt"}, "optimizer": None}
    spec = search.with_params(base, {"optimizer.lr": 0.1, "train.steps": 5, "model.arch": "mlp"})
    assert spec == {"model": {"arch": "mlp"}, "optimizer": {"lr": 0.1}, "train": {"steps": 5}}
    assert base == {"model": {"arch": "gpt"}, "optimizer": None}
    with pytest.raises(search.BadPath, match=r"model\.arch\.x"):
        search.with_params(base, {"model.arch.x": 1})


def test_asha_keeps_the_top_one_in_eta_of_the_results_so_far():
    assert [search.asha_keep(n, 3) for n in range(1, 10)] == [1, 1, 1, 1, 1, 2, 2, 2, 3]
    # min: the first result always continues; a later one only if it is within the top k so far.
    assert search.replay([5.0, 6.0, 4.0, 4.5, 7.0, 4.2], eta=3, mode="min") == [True, False, True, False, False, True]
    assert search.replay([5.0, 6.0, 4.0], eta=3, mode="max") == [True, True, False]
    assert search.replay([1.0, 1.0], eta=2, mode="min") == [True, True]  # a tie continues
    assert search.replay([1.0, math.nan, math.inf], eta=2, mode="max") == [True, False, False]  # never the best
    assert search.replay([math.nan, 1.0], eta=2, mode="min") == [True, True]


def test_the_promote_form_lets_nobody_on_before_eta_results_are_in():
    assert [search.asha_keep(n, 3, at_least_one=False) for n in range(1, 10)] == [0, 0, 1, 1, 1, 2, 2, 2, 3]
    # The first two results wait whatever they are; later ones go on within the top floor(n / 3).
    values = [4.0, 6.0, 5.0, 4.5, 7.0, 4.2]
    assert search.replay(values, eta=3, mode="min", stop_once=False) == [False, False, False, False, False, True]
    assert search.replay([1.0, 2.0, 0.5], eta=3, mode="min", stop_once=False) == [False, False, True]


def test_promotable_waiting_results_are_the_rungs_top_k_best_first():
    values = [4.0, 6.0, 5.0, 4.5, 7.0, 4.2]  # keep floor(6 / 3) = 2: 4.0 and 4.2
    assert search.promotable(values, waiting=[0, 1, 2, 3, 4], eta=3, mode="min", at_least_one=False) == [0]
    assert search.promotable(values, waiting=[1, 2, 3], eta=3, mode="min", at_least_one=False) == []
    assert search.promotable(values, waiting=[5, 0], eta=3, mode="min", at_least_one=False) == [0, 5]
    assert search.promotable(values[:2], waiting=[0, 1], eta=3, mode="min", at_least_one=False) == []
    # Once nothing else can run, a rung with fewer than eta results promotes its best.
    assert search.promotable(values[:2], waiting=[0, 1], eta=3, mode="min", at_least_one=True) == [0]
    assert search.promotable([1.0, 1.0, math.nan], waiting=[2, 1, 0], eta=2, mode="max", at_least_one=True) == [0, 1]


def test_the_best_is_the_first_of_the_best_finite_values():
    assert search.best({"a": 2.0, "b": 1.0, "c": 1.0, "d": None, "e": math.nan}, "min") == "b"
    assert search.best({"a": 2.0, "b": 1.0}, "max") == "a"
    assert search.best({"a": None}, "min") is None


def test_the_example_sweep_validates_and_so_does_every_trial():
    import yaml

    from app.schemas.sweep import SweepSpec
    from app.services.sweeps import trial_params, trial_spec

    root = Path(__file__).resolve().parents[1]
    for path in sorted((root / "examples" / "sweeps").glob("*.yaml")):
        spec = SweepSpec.model_validate(yaml.safe_load(path.read_text()))
        params = trial_params(spec)
        assert len(params) == spec.max_trials
        for number, trial in enumerate(params):
            job = trial_spec(spec, number, trial)
            assert job.optimizer.lr == trial["optimizer.lr"] and job.name == f"{spec.name} #{number}"
