"""Cost estimates: the prior, then a high percentile of the window; admission and the planner follow them."""

from __future__ import annotations

import pytest

from streamsvc.scheduling import CostModel, SchedulerConfig, SendSampler, without_streamless
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


def test_a_batch_size_between_two_measured_ones_costs_the_line_between_them_and_above_them_one_by_one():
    costs = CostModel(initial_forward_s=0.05, percentile=0.9, window=10, min_samples=2)
    costs.seed(D, 1, 0.002)
    assert costs.estimate(D, 12) == 0.024  # nothing measured above it: one by one
    costs.seed(D, 16, 0.0095)
    assert costs.estimate(D, 12) == pytest.approx(0.002 + 0.0075 * 11 / 15)
    costs.seed(D, 8, 0.0057)  # a nearer size below: the line from it
    assert costs.estimate(D, 12) == pytest.approx(0.0057 + 0.0038 * 4 / 8)
    assert costs.estimate(D, 20) == 0.04  # above every measured size
    assert costs.estimate(C, 4) == 0.2  # another kind: its own sizes (none: the initial guess, one by one)
    costs.seed(D, 2, 0.01)  # never more than one by one, whatever the line says
    assert costs.estimate(D, 3) == 0.006


# ----- issue 33: what clients without a stream cost is theirs, not a stage's ---------------------


def test_reset_goes_back_to_the_seeds_and_forgets_every_measurement():
    costs = CostModel(initial_forward_s=0.05, percentile=0.9, window=10, min_samples=2)
    costs.seed(D, 1, 0.1)
    for _ in range(2):
        costs.observe(D, 1, 0.5)
        costs.observe(C, 2, 0.25)
    assert (costs.estimate(D), costs.estimate(C, 2)) == (0.5, 0.25)
    costs.reset()
    assert (costs.estimate(D), costs.estimate(C, 2), costs.estimate(C)) == (0.1, 0.1, 0.05)  # seed, 2 x guess, guess
    costs.observe(D, 1, 0.5)
    assert costs.estimate(D) == 0.1  # one sample after the reset: the seed stands until there are min_samples


def test_without_streamless_subtracts_a_small_share_and_drops_a_sample_mostly_someone_elses():
    assert without_streamless(0.5, 0.125, max_share=0.25) == 0.375
    assert without_streamless(0.5, 0.0, max_share=0.25) == 0.5
    assert without_streamless(0.5, -1.0, max_share=0.25) == 0.5  # a meter read out of order counts as nothing
    assert without_streamless(0.5, 0.25, max_share=0.25) is None  # half of it: the rest would be a guess
    assert without_streamless(0.0, 0.0, max_share=0.25) == 0.0
    # more connections and requests than units of work: their unseen part (accept, parse, reply) would be in it
    assert without_streamless(0.5, 0.0, max_share=0.25, events=9, units=8) is None
    assert without_streamless(0.5, 0.0, max_share=0.25, events=8, units=8) == 0.5
    assert without_streamless(0.03, 0.0, max_share=0.25, events=2) is None  # a forward: 1 unit


def test_the_sends_samples_leave_out_a_flood_before_the_first_chunk_and_while_chunks_go():
    # issue 33: a client without a stream flooded a fresh server for 6 s (5.9 s of the loop's CPU, about half of
    # it in our handlers, the meter's); the first 8 chunks sent were charged all of it: 737 ms a chunk.
    sampler = SendSampler(min_chunks=8, max_share=0.25)
    readings = [  # (loop CPU, its stream-less part, chunks sent) at the end of each period
        ((0.0, 0.0, 0), None),  # the server starts
        ((5.9, 2.9, 0), None),  # the flood, no chunk: this period is no chunk's
        ((5.91, 2.9, 2), None), ((5.92, 2.9, 4), None), ((5.93, 2.9, 6), None),  # a viewer plays: 2 chunks a period
        ((5.94, 2.9, 8), 0.005),  # 8 chunks: 0.04 s of CPU over them
        ((6.94, 3.9, 16), None),  # a flood while chunks go: all stream-less, the sample is dropped
        ((7.04, 3.91, 24), (0.1 - 0.01) / 8),  # a trickle of /metrics: subtracted
        ((8.04, 3.91, 24), None),  # a period with no chunk (the viewer paused): charged to none
        ((8.05, 3.91, 32), 0.01 / 8),
    ]
    for (cpu, streamless, chunks), sample in readings:
        got = sampler.read(cpu, streamless, chunks)
        assert got == (None if sample is None else pytest.approx(sample)), (cpu, streamless, chunks)
    # a flood of requests refused at the front, whose CPU our handlers hardly see: 425 events over 8 chunks, dropped
    assert sampler.read(8.55, 3.92, 40, events=425) is None
    assert sampler.read(8.56, 3.92, 48, events=427) == pytest.approx(0.01 / 8)  # 2 events over 8 chunks: kept
    with pytest.raises(ValueError, match="min_chunks=0"):
        SendSampler(min_chunks=0, max_share=0.25)
    with pytest.raises(ValueError, match="streamless_max_share=0"):
        SchedulerConfig(streamless_max_share=0)
