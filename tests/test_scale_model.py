"""The scale model (benchmarks/scale_model.py) and the rig it takes rank 0's
costs from (benchmarks/scale.py): the model's arithmetic without processes, the
rig once at N = 3 so that a protocol change cannot break it unseen (it did once)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import scale  # noqa: E402
import scale_model as model  # noqa: E402

COSTS = {"a0": 200.0, "a1": 40.0, "hop": 25.0, "cpu_r": [(0.0, 100.0), (10.0, 300.0), (20.0, 300.0)]}


def test_levels_of_a_tree_cover_every_rank() -> None:
    assert [model.levels(n, 4) for n in (1, 2, 4, 5, 16, 17, 64, 1024)] == [0, 1, 1, 2, 2, 3, 3, 5]


def test_the_star_grows_with_n_and_the_tree_with_its_levels() -> None:
    assert model.star_us(1024, COSTS) - model.star_us(512, COSTS) == pytest.approx(512 * 40.0)
    assert model.tree_us(1024, 4, COSTS) == pytest.approx(200 + 5 * (2 * 25 + 4 * 40))
    assert model.tree_us(256, 4, COSTS) == model.tree_us(129, 4, COSTS)


def test_a_replicas_cpu_is_interpolated_by_its_wait_and_flat_beyond() -> None:
    assert model.cpu_r(COSTS["cpu_r"], 5_000) == pytest.approx(200.0)
    assert model.cpu_r(COSTS["cpu_r"], 50_000) == 300.0


def test_on_few_cores_all_ranks_cpu_bounds_the_time() -> None:
    path = model.star_us(64, COSTS)
    here = model.here_us(64, path, 0.0, COSTS, cores=2)
    assert here >= (path + 63 * 300.0) / 2 - 1  # the replicas wait long enough to wake cold
    assert model.here_us(2, model.star_us(2, COSTS), 0.0, COSTS, cores=64) == model.star_us(2, COSTS)


def test_the_rig_runs_at_three() -> None:
    row = scale.measure(3, 20)
    assert row["n"] == 3 and row["us_per_op"] > 0
