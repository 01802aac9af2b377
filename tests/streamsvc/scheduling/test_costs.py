"""Cost estimates: the prior, then a high percentile of the window; admission and the planner follow them."""

from __future__ import annotations

import pytest

from streamsvc.scheduling import CostModel
from tests.streamsvc.scheduling.helpers import C, CHUNK_WORK, COST, D, admit, make


def test_cost_model_prior_until_enough_samples_then_a_high_percentile_of_the_window():
    costs = CostModel(initial_forward_s=0.05, percentile=0.9, window=10, min_samples=4)
    assert costs.estimate(D) == 0.05
    costs.seed(D, 1, 0.1)  # the warm-up's median
    for seconds in (0.5, 0.01, 0.01):  # too few to replace the prior, however far off
        costs.observe(D, 1, seconds)
    assert costs.estimate(D) == 0.1
    costs.observe(D, 1, 0.02)
    assert costs.estimate(D) == 0.5  # 4 samples: the 90th percentile is the slowest
    for _ in range(9):
        costs.observe(D, 1, 0.02)
    assert costs.estimate(D) == 0.02  # the slow one left the window of 10
    assert costs.estimate(D, 2) == 0.04  # unmeasured batch size: two batch-1 forwards
    costs.observe(D, 2, 0.25)
    assert (costs.estimate(D, 2), costs.estimate(C)) == (0.25, 0.05)  # the first sample stands in for the prior


def test_costs_follow_a_slowdown_and_admission_uses_them():
    sched = make(cost_min_samples=4, cost_window=8)
    sched.seed_cost(D, 1, COST)
    admit(sched, "a")
    assert sched.predicted_load() == pytest.approx(CHUNK_WORK * 16 / 12)
    now = 0.0
    for _ in range(4):  # the device slows to 2x the warm-up's figure
        plan = sched.next(now)
        now += 2 * COST
        sched.complete(plan, now, 2 * COST if plan.kind is D else None)
    assert sched.costs.estimate(D) == 2 * COST
    assert sched.predicted_load() == pytest.approx((4 * 2 * COST + COST) * 16 / 12)
    with pytest.raises(ValueError, match="elapsed_s=-1"):
        sched.complete(sched.next(now), now, -1.0)


def test_observe_cost_feeds_the_cost_model():
    sched = make(cost_min_samples=2)
    sched.seed_cost(D, 1, 0.125)
    sched.observe_cost(D, 1, 0.25)
    assert sched.costs.estimate(D) == 0.125
    sched.observe_cost(D, 1, 0.5)
    sched.observe_cost(C, 2, 0.5)
    assert (sched.costs.estimate(D), sched.costs.estimate(C), sched.costs.estimate(C, 2)) == (0.5, COST, 0.5)
    assert sched.stats(0.0).forward_cost_s[D] == 0.5
    with pytest.raises(ValueError, match="seconds=-1"):
        sched.observe_cost(D, 1, -1.0)
    with pytest.raises(ValueError, match="batch=0"):
        sched.observe_cost(D, 0, 0.1)
    with pytest.raises(ValueError, match="seconds=0"):
        sched.seed_cost(D, 1, 0.0)
