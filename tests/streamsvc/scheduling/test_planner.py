"""The planner: exact plans for one stream, the start rule, chunks in flight, prompts, batching, degrading."""

from __future__ import annotations

import math

import pytest

from streamsvc.scheduling import RECACHE_STAGE, Plan, Scheduler, SchedulerError, StreamRequest
from tests.streamsvc.scheduling.helpers import (
    CHUNK,
    CHUNK_WORK,
    COST,
    DEGRADE,
    FPS,
    MARGIN,
    C,
    Clock,
    D,
    R,
    admit,
    first_chunk,
    make,
)


# ----- one stream ---------------------------------------------------------------------------------


def test_a_chunk_is_four_denoise_steps_then_a_commit_that_delivers_it():
    sched = make()
    admit(sched, "a")
    clock = Clock(sched)
    plans = clock.run(10)
    assert [(k, s) for k, _, s in plans] == CHUNK + CHUNK
    assert clock.delivered == [(0.3125, "a"), (0.625, "a")]
    # 9 frames arrived at 0.3125, 12 at 0.625: 0.5625 - 0.3125 + 0.75 s left.
    assert sched.stream_stats("a", 0.625).buffered_s == 1.0
    assert sched.stream_stats("a", 0.625).ttff_s == 0.3125


def test_plan_fields_for_a_commit():
    sched = make()
    admit(sched, "a")
    Clock(sched).run(4)
    plan = sched.next(0.25)
    assert plan == Plan(
        kind=C, stream_ids=("a",), step=4, restart=(False,), prompt_seqs=(0,), chunk_index=(0,), steps=(4,),
        prompts=("",),  # the opening prompt's text (the request's: none here)
    )


def test_without_the_start_rule_a_stream_runs_ahead_to_the_cap_and_wake_at_says_when():
    sched = make(start_margin_s=math.inf)
    admit(sched, "a")
    clock = Clock(sched)
    clock.run(15)  # three chunks: buffer 0.5625 -> 1.0 -> 1.4375 s at t = 0.9375
    assert sched.stream_stats("a", clock.now).buffered_s == 1.4375
    assert sched.next(clock.now) is None  # 1.4375 + 0.75 > 2
    assert sched.wake_at(clock.now) == clock.now + 0.1875
    assert sched.next(clock.now + 0.125) is None
    assert sched.next(clock.now + 0.1875).stream_ids == ("a",)


def test_no_streams_no_plan():
    sched = make()
    assert sched.next(0.0) is None
    assert sched.wake_at(0.0) is None


# ----- the start rule, in-flight chunks -----------------------------------------------------------


def run_chunk(sched: Scheduler, now: float, stream_id: str = "a", hand_over: float = 0.0) -> tuple[float, float]:
    """From `now`, wait until the stream's chunk is due (wake_at), run its 5 forwards with the
    COMMIT's frames in flight for `hand_over` s; returns (delivery time, the chunk's latency)."""
    t = sched.wake_at(now)
    for _ in range(5):
        plan = sched.next(t)
        assert plan is not None and plan.stream_ids == (stream_id,)
        t += COST
        assert sched.complete(plan, t, COST, deliver=False) == []
    t += hand_over
    return t, sched.delivered(stream_id, t)


def test_before_samples_the_lead_is_one_chunk_of_every_stream_and_a_pending_recache_plus_the_margin():
    sched = make()
    admit(sched, "a")
    assert sched.lead_s("a") == CHUNK_WORK + MARGIN  # its own chunk: 0.5625
    admit(sched, "b")
    assert sched.lead_s("a") == 2 * CHUNK_WORK + MARGIN  # and one of b's: 0.875
    sched.remove("b")
    Clock(sched).run(5)  # a's first chunk: one latency sample, fewer than latency_min_samples
    sched.set_prompt("a", 0.3125)
    assert sched.lead_s("a") == CHUNK_WORK + COST + MARGIN  # a recache is pending: 0.625


def test_a_fresh_chunk_is_runnable_exactly_when_the_buffer_falls_to_the_lead():
    sched = make()
    admit(sched, "a")
    sched.observe_buffer("a", 16, 0.0)  # 1 s buffered, lead 0.5625
    assert sched.wake_at(0.0) == 0.4375
    assert sched.next(0.375) is None
    assert not sched.stream_stats("a", 0.375).runnable
    plan = sched.next(0.4375)
    assert (plan.kind, plan.stream_ids, plan.step) == (D, ("a",), 0)
    sched.complete(plan, 0.5, COST)
    # A chunk in progress goes on whatever the buffer.
    assert [(k, s) for k, _, s in Clock(sched, now=0.5).run(4)] == CHUNK[1:]


def test_the_lead_is_the_p95_of_recent_chunk_latencies_plus_the_margin():
    sched = make(lead_percentile=0.95)
    admit(sched, "a")
    # 20 chunks with a hand-over of 1/16 s but two, each started when run_chunk finds it due.
    hand_overs = [0.0625] * 18 + [0.25, 0.1875]
    t, latencies = 0.0, []
    for i, hand_over in enumerate(hand_overs):
        if i >= 2:  # the buffer after a delivery is above the lead: due when it drains to it
            due = sched.wake_at(t)
            assert sched.stream_stats("a", due).buffered_s == sched.lead_s("a")
            t = due - COST
            assert sched.next(t) is None
        t, latency = run_chunk(sched, t, hand_over=hand_over)
        latencies.append(latency)
    # The first chunk's 9 frames (0.5625 s) were at the lead (0.5625) when committed at 0.3125: the second
    # chunk was due then, and waited out the hand-over. The others: 5 forwards + the hand-over.
    assert latencies == [0.375, 0.4375] + [CHUNK_WORK + h for h in hand_overs[2:]]
    # Nearest-rank p95 of 20: the 19th smallest, 0.5 (not the largest, 0.5625).
    assert sched.stream_stats("a", t).latency_p95_s == 0.5
    assert sched.lead_s("a") == 0.5 + MARGIN
    # An admission brings queueing the samples did not see: the prediction is a floor until 3 new samples.
    admit(sched, "b", now=t)
    assert sched.lead_s("a") == 2 * CHUNK_WORK + MARGIN


def test_the_latency_window_is_bounded():
    sched = make(latency_window=4, latency_min_samples=0, lead_percentile=0.95)
    admit(sched, "a")
    t, latencies = 0.0, []
    for hand_over in [0.0, 0.0625, 0.0625, 0.25, 0.0625, 0.0625, 0.0625]:
        t, latency = run_chunk(sched, t, hand_over=hand_over)
        latencies.append(latency)
    assert latencies == [0.3125, 0.375, 0.375, 0.5625, 0.375, 0.375, 0.375]
    assert sched.lead_s("a") == 0.5625 + MARGIN  # the p95 of 4 samples is their largest
    t, _ = run_chunk(sched, t, hand_over=0.0625)
    assert sched.lead_s("a") == 0.375 + MARGIN  # the slow one left the window


def test_by_default_the_lead_is_the_median_latency_plus_the_margin():
    sched = make(latency_window=4, latency_min_samples=0)
    admit(sched, "a")
    t = 0.0
    for hand_over in [0.0, 0.0625, 0.25, 0.25]:  # latencies 0.3125, 0.375, 0.5625, 0.5625
        t, _ = run_chunk(sched, t, hand_over=hand_over)
    assert sched.lead_s("a") == 0.375 + MARGIN  # nearest-rank median of 4: the 2nd smallest


def test_latency_counts_queueing_behind_another_streams_chunk():
    sched = make()
    admit(sched, "a", "b")
    sched.observe_buffer("a", 14, 0.0)  # 0.875 s: at its lead (0.625 + 0.25), due now
    sched.observe_buffer("b", 15, 0.0)  # 0.9375 s: due at 0.0625, while a's chunk runs
    clock = Clock(sched)
    assert clock.ids(10) == ["a"] * 5 + ["b"] * 5
    assert clock.delivered == [(0.3125, "a"), (0.625, "b")]
    assert sched.stream_stats("a", 0.625).latency_p95_s == 0.3125
    assert sched.stream_stats("b", 0.625).latency_p95_s == 0.5625  # due at 0.0625, 0.25 of it queueing


def test_a_stream_with_a_new_prompt_runs_ahead_as_far_as_the_cap_allows():
    sched = make()
    admit(sched, "a")
    Clock(sched).run(5)  # first chunk at 0.3125, latency 0.3125
    sched.observe_buffer("a", 16, 0.3125)  # 1 s: above the lead (0.5625)
    assert sched.next(0.3125) is None
    sched.set_prompt("a", 0.3125)
    t, plans = 0.3125, []
    for _ in range(6):
        plan = sched.next(t)
        plans.append((plan.kind, plan.step))
        t += COST
        sched.complete(plan, t, COST, deliver=False)
    assert plans == [(R, RECACHE_STAGE)] + CHUNK
    # Its latency runs from the prompt (due under the cap then): recache + chunk. It ran ahead of its
    # lead, so it is not a sample of the start rule: the p95 is still the first chunk's.
    assert sched.delivered("a", 0.6875) == 0.375
    assert sched.stream_stats("a", 0.6875).latency_p95_s == 0.3125
    clock = Clock(sched, now=0.6875)
    # The cap still bounds it: buffered + the next chunk <= 2 s.
    sched.observe_buffer("a", 22, 0.6875)  # 1.375 s
    sched.set_prompt("a", 0.6875)
    assert clock.run(1) == [(R, ("a",), RECACHE_STAGE)]  # a recache adds no video: always runnable
    assert sched.next(0.75) is None  # 1.3125 + 0.75 > 2
    assert sched.wake_at(0.75) == 0.8125


def test_committed_chunks_in_flight_count_toward_the_rule_until_delivered():
    sched = make(lead_percentile=0.95)
    admit(sched, "a")
    clock = Clock(sched)
    clock.launch(5)
    st = sched.stream_stats("a", 0.3125)
    assert (st.buffered_s, st.in_flight_s, st.chunks_delivered, st.ttff_s) == (0.0, 0.5625, 0, None)
    # 0.5625 s in flight is at the lead: the next chunk starts, in flight too.
    assert all(plan.chunk_index == (1,) for plan in clock.launch(5))
    # 1.3125 s in flight: above the lead, though the viewer's buffer is empty. Nothing drains it
    # but deliveries: no wake-up by time.
    assert sched.next(0.625) is None and sched.wake_at(0.625) is None
    assert sched.delivered("a", 0.6875) == 0.6875  # due at admission
    st = sched.stream_stats("a", 0.6875)
    assert (st.buffered_s, st.in_flight_s, st.chunks_delivered, st.ttff_s) == (0.5625, 0.75, 1, 0.6875)
    # One sample: the lead is 0.6875 + 0.25; 1.3125 s buffered and in flight drain to it at 1.0625.
    assert sched.lead_s("a") == 0.9375 and sched.wake_at(0.6875) == 1.0625
    assert sched.delivered("a", 0.75) == 0.4375  # due when the first was committed, 0.3125
    assert sched.wake_at(0.75) == 1.0625  # all of it buffered now: the same time
    with pytest.raises(SchedulerError, match="'a' has no chunk in flight"):
        sched.delivered("a", 0.75)


def test_a_chunk_is_not_delivered_before_the_ones_in_flight():
    sched = make()
    admit(sched, "a")
    clock = Clock(sched)
    clock.launch(5)
    clock.run(4)
    commit = sched.next(clock.now)
    with pytest.raises(SchedulerError, match="'a' has 1 chunk\\(s\\) in flight: deliver=True would credit"):
        sched.complete(commit, clock.now + COST, COST)
    assert sched.complete(commit, clock.now + COST, COST, deliver=False) == []  # still outstanding: nothing moved
    assert sched.stream_stats("a", clock.now + COST).in_flight_s == 0.5625 + 0.75


def test_in_flight_chunks_count_toward_the_cap():
    sched = make()
    admit(sched, "a")
    Clock(sched).run(5)
    sched.observe_buffer("a", 12, 0.3125)  # 0.75 s buffered
    clock = Clock(sched, now=0.3125)
    sched.set_prompt("a", 0.3125)
    assert clock.run(1) == [(R, ("a",), RECACHE_STAGE)]
    clock.launch(5)  # the new prompt's chunk, committed at 0.6875 and kept in flight
    sched.set_prompt("a", clock.now)  # steering again: only the cap bounds it
    assert clock.run(1) == [(R, ("a",), RECACHE_STAGE)]
    # 0.3125 s buffered + 0.75 s in flight + 0.75 s chunk <= 2: runnable; 0.25 more in flight would not be.
    assert sched.stream_stats("a", clock.now).runnable
    sched.observe_buffer("a", 10, clock.now)  # 0.625 s + 0.75 + 0.75 > 2
    assert sched.next(clock.now) is None
    assert sched.wake_at(clock.now) == clock.now + 0.125


def test_delivered_for_a_removed_stream_returns_none():
    sched = make()
    admit(sched, "a")
    Clock(sched).launch(5, elapsed_s=None)
    assert sched.remove("a")
    assert sched.delivered("a", 0.5) is None
    assert sched.delivered("never", 0.5) is None


def test_complete_without_a_cost_sample_leaves_the_estimate():
    sched = make()
    admit(sched, "a")
    plan = sched.next(0.0)
    sched.complete(plan, 0.5, None)
    assert sched.costs.estimate(D) == COST
    assert sched.stream_stats("a", 0.5).runnable  # the state advanced: step 1 is next
    assert sched.next(0.5).step == 1


def test_dry_at_counts_the_chunks_in_flight_before_the_newest():
    sched = make(start_margin_s=math.inf)  # every chunk runs ahead to the cap
    admit(sched, "a")
    assert sched.dry_at("a") is None  # not playing yet
    clock = Clock(sched)
    for _ in range(5):
        sched.complete(sched.next(clock.now), clock.now, None, deliver=False)
    sched.delivered("a", 0.3125)  # 9 frames: dry at 0.875
    assert sched.dry_at("a") == 0.875
    for _ in range(5):  # the next chunk in flight: the viewer runs dry at 0.875 unless it arrives
        sched.complete(sched.next(0.5), 0.5, None, deliver=False)
    assert sched.dry_at("a") == 0.875
    for _ in range(5):  # one more behind it: the first in flight's 12 frames come first
        sched.complete(sched.next(0.5), 0.5, None, deliver=False)
    assert sched.dry_at("a") == 0.875 + 0.75


def test_a_stall_widens_every_lead_by_the_late_margin_for_the_hold():
    sched = make(late_margin_s=0.25, late_margin_hold_s=10.0)
    admit(sched, "a", "b")

    def plan_at(now: float) -> None:  # the margin in force is decided when the scheduler plans
        plan = sched.next(now)
        if plan is not None:
            sched.cancel(plan)

    plan_at(0.0)
    lead = sched.lead_s("b")
    sched.mark_late("a", 0.5, "a chunk encoded cheaper")  # late, but nobody stalled: the margin stays
    plan_at(0.5)
    assert sched.lead_s("b") == lead
    first_chunk(sched)  # a's first chunk: 9 frames at 0.3125
    sched.observe_buffer("a", 0, 1.0)  # its viewer ran dry
    plan_at(1.0)
    assert sched.lead_s("b") == lead + 0.25
    plan_at(10.9)
    assert sched.lead_s("b") == lead + 0.25
    plan_at(11.0)
    assert sched.lead_s("b") == lead  # nobody stalled for the hold: back to the plain margin


def test_pause_keeps_generating_until_the_buffer_reaches_the_lead_then_stops():
    sched = make()
    admit(sched, "a")
    clock = Clock(sched)
    clock.run(5)  # 0.5625 s buffered at 0.3125: at the lead (0.3125 + 0.25), so one more chunk
    sched.pause("a", clock.now)
    clock.run(5)  # nothing is consumed: 1.3125 s
    assert sched.stream_stats("a", clock.now + 10.0).buffered_s == 1.3125
    assert sched.next(clock.now + 10.0) is None  # above the lead, 0.5625
    assert sched.wake_at(clock.now + 10.0) is None
    sched.resume("a", 20.0)
    assert sched.wake_at(20.0) == 20.75  # drained to the lead
    assert sched.next(20.6875) is None and sched.next(20.75).stream_ids == ("a",)
    assert sched.stream_stats("a", 20.0).stalls == 0


# ----- prompts ------------------------------------------------------------------------------------


def test_a_flood_of_prompts_between_two_chunks_plans_the_first_now_and_the_newest_after_the_next_chunk():
    """Prompts are coalesced in the scheduler: of twenty prompts between two chunks, the first is planned at once (its
    recache runs its text), the others wait for the next commit and only the newest of them is planned then. Each
    has its own version; the scheduler keeps no text of those replaced."""
    sched = make()
    admit(sched, "a")
    clock = Clock(sched)
    clock.run(5)
    sched.observe_buffer("a", 12, clock.now)
    assert [sched.set_prompt("a", clock.now, f"prompt {k}") for k in range(1, 21)] == list(range(1, 21))
    assert set(sched._streams["a"].prompt_texts) == {0, 1, 20}
    plan = sched.next(clock.now)
    assert (plan.kind, plan.prompt_seqs, plan.prompts) == (R, (1,), ("prompt 1",))
    sched.complete(plan, clock.now + COST, COST)
    clock.now += COST
    plans = clock.launch(5)  # the chunk under "prompt 1"
    assert [(p.kind, p.prompts) for p in plans] == [(D, ("prompt 1",))] * 4 + [(C, ("prompt 1",))]
    plan = sched.next(clock.now)
    assert (plan.kind, plan.prompt_seqs, plan.prompts) == (R, (20,), ("prompt 20",))


def test_a_new_prompt_adds_a_recache_before_the_next_chunk():
    sched = make()
    admit(sched, "a")
    clock = Clock(sched)
    clock.run(5)
    sched.observe_buffer("a", 12, clock.now)  # 0.75 s: room for the recache (slack 0.375 after it)
    assert sched.set_prompt("a", clock.now, "a blue square") == 1
    assert sched.stream_stats("a", clock.now).prompt_pending
    plan = sched.next(clock.now)
    assert plan == Plan(  # the plan carries the prompt's text: the engine keeps none
        kind=R, stream_ids=("a",), step=RECACHE_STAGE, restart=(False,), prompt_seqs=(1,), chunk_index=(1,), steps=(4,),
        prompts=("a blue square",),
    )
    sched.complete(plan, clock.now + COST, COST)
    clock.now += COST
    assert not sched.stream_stats("a", clock.now).prompt_pending
    assert [(p.kind, p.step, p.prompt_seqs, p.prompts) for p in [sched.next(clock.now)]] == [
        (D, 0, (1,), ("a blue square",))]


def test_a_stream_that_committed_nothing_uses_the_new_prompt_without_a_recache():
    sched = make()
    admit(sched, "a")
    sched.set_prompt("a", 0.0)
    plan = sched.next(0.0)
    assert (plan.kind, plan.step, plan.prompt_seqs) == (D, 0, (1,))


def test_restart_abandons_a_chunk_in_progress_when_the_buffer_allows():
    sched = make()
    admit(sched, "a")
    clock = Clock(sched)
    clock.run(5)  # first chunk delivered: 0.5625 s, at the lead of a lone stream (0.3125 + 0.25)
    clock.run(2)  # steps 0 and 1 of the next chunk under prompt 0
    sched.observe_buffer("a", 20, clock.now)  # the viewer reports 1.25 s: with the next chunk just at the cap
    sched.set_prompt("a", clock.now)
    plan = sched.next(clock.now)
    assert (plan.kind, plan.restart, plan.prompt_seqs) == (R, (True,), (1,))
    sched.complete(plan, clock.now + COST, COST)
    clock.now += COST
    # 1.1875 s buffered, above the lead: the new prompt's chunk starts anyway, as the cap allows.
    assert sched.lead_s("a") == 0.5625
    assert [(k, s) for k, _, s in clock.run(5)] == CHUNK
    assert clock.delivered[-1] == (clock.now, "a")


def test_no_restart_when_redoing_the_chunk_would_leave_too_little_slack():
    sched = make()
    admit(sched, "a")
    clock = Clock(sched)
    clock.run(5)
    clock.run(2)
    sched.observe_buffer("a", 12, clock.now)  # 0.75 s: after a redo 0.75 - 0.375 < 2 chunks of work
    sched.set_prompt("a", clock.now)
    plan = sched.next(clock.now)
    assert (plan.kind, plan.step, plan.restart, plan.prompt_seqs) == (D, 2, (False,), (0,))
    sched.cancel(plan)
    # The chunk finishes under prompt 0, then the recache comes.
    assert [(k, s) for k, _, s in clock.run(4)] == [(D, 2), (D, 3), (C, 4), (R, RECACHE_STAGE)]


def test_with_prompt_cut_a_chunk_in_progress_is_abandoned_when_the_recaches_headroom_is_left():
    """The same buffer as above: with a cut, the chunk's frames would be dropped anyway, so redoing it must leave only
    the headroom a RECACHE must (the start margin), not two chunks of work."""
    sched = make(prompt_cut=True)
    admit(sched, "a")
    clock = Clock(sched)
    clock.run(5)
    clock.run(2)
    sched.observe_buffer("a", 12, clock.now)  # 0.75 s: after a redo 0.75 - 0.375 >= the margin (0.25)
    sched.set_prompt("a", clock.now)
    plan = sched.next(clock.now)
    assert (plan.kind, plan.restart, plan.prompt_seqs) == (R, (True,), (1,))
    sched.cancel(plan)
    sched.observe_buffer("a", 9, clock.now)  # 0.5625 s: 0.1875 left after the redo, under the margin
    plan = sched.next(clock.now)
    assert (plan.kind, plan.step, plan.restart, plan.prompt_seqs) == (D, 2, (False,), (0,))


def test_with_prompt_cut_the_lead_keeps_a_switchs_reserve():
    """A steerable stream keeps a RECACHE and a chunk of work beyond its lead, once it has committed frames (its
    first chunk is not held back for it); without a cut the reserve would only delay the new prompt."""
    for cut, reserve in ((False, 0.0), (True, COST + CHUNK_WORK)):
        sched = make(prompt_cut=cut)
        admit(sched, "a")
        assert sched.lead_s("a") == pytest.approx(CHUNK_WORK + MARGIN)  # before the first chunk: none
        clock = Clock(sched)
        clock.run(5)
        assert sched.lead_s("a") == 0.5625 + reserve
        clock.run(5)  # the second chunk: 1 s buffered at 0.625; the third is due once it falls to the lead
        assert clock.now == 0.625 and sched.stream_stats("a", clock.now).buffered_s == 1.0
        assert sched.wake_at(clock.now) == clock.now + 1.0 - sched.lead_s("a")


def test_restart_on_prompt_off_finishes_the_chunk_first():
    sched = make(restart_on_prompt=False)
    admit(sched, "a")
    clock = Clock(sched)
    clock.run(5)
    clock.run(2)
    sched.observe_buffer("a", 20, clock.now)
    sched.set_prompt("a", clock.now)
    assert [(k, s) for k, _, s in clock.run(4)] == [(D, 2), (D, 3), (C, 4), (R, RECACHE_STAGE)]


def test_a_recache_that_would_cause_a_stall_waits_one_chunk():
    sched = make()
    admit(sched, "a")
    clock = Clock(sched)
    clock.run(5)
    # 0.5 s: with the recache slack 0.125, under the start margin (what estimates do not see: the
    # hand-over, a forward queued ahead, jitter); without it 0.1875.
    sched.observe_buffer("a", 8, clock.now)
    sched.set_prompt("a", clock.now)
    plan = sched.next(clock.now)
    assert (plan.kind, plan.step, plan.prompt_seqs) == (D, 0, (0,))  # the old prompt, no recache
    sched.complete(plan, clock.now + COST, COST)
    clock.now += COST
    clock.run(4)
    sched.observe_buffer("a", 6, clock.now)  # as tight again: the prompt does not wait twice
    plan = sched.next(clock.now)
    assert (plan.kind, plan.prompt_seqs) == (R, (1,))


def test_a_prompt_during_a_recache_in_flight_takes_the_next_chunk():
    """One prompt switch a chunk (prompts are coalesced in the scheduler): the chunk after the recache runs under the
    prompt recached, and the one that came meanwhile (the newest of any more) gets the recache after that chunk."""
    sched = make()
    admit(sched, "a")
    clock = Clock(sched)
    clock.run(5)
    sched.observe_buffer("a", 16, clock.now)  # 1 s: room for two recaches
    sched.set_prompt("a", clock.now, "one")
    plan = sched.next(clock.now)
    assert plan.kind is R and plan.prompt_seqs == (1,)
    sched.set_prompt("a", clock.now, "two")  # arrives while the recache runs
    sched.complete(plan, clock.now + COST, COST)
    clock.now += COST
    assert sched.stream_stats("a", clock.now).prompt_pending is False  # not before the next chunk
    plans = clock.launch(5)  # the chunk: 4 steps and its commit, under "one", no restart
    assert [(p.kind, p.prompt_seqs, p.prompts, p.restart) for p in plans] == [
        (D, (1,), ("one",), (False,))] * 4 + [(C, (1,), ("one",), (False,))]
    plan = sched.next(clock.now)
    assert (plan.kind, plan.prompt_seqs, plan.prompts) == (R, (2,), ("two",))


def test_fifty_prompts_in_a_chunk_restart_it_once_and_the_newest_takes_the_next():
    """A flood while a chunk runs: the first prompt may restart the chunk (slack allows), no later one does; the
    chunk after runs under the newest of them, after one recache."""
    sched = make()
    admit(sched, "a")
    clock = Clock(sched)
    clock.run(5)
    clock.run(2)  # steps 0 and 1 of the next chunk under prompt 0
    sched.observe_buffer("a", 20, clock.now)  # 1.25 s: room to redo the chunk (as the restart test above)
    kinds, restarts = [], 0
    for k in range(50):
        sched.set_prompt("a", clock.now, f"prompt {k}")
        plan = sched.next(clock.now)
        clock.now += COST
        if plan is None:
            continue
        sched.complete(plan, clock.now, COST, deliver=False)
        kinds.append(plan.kind)
        restarts += any(plan.restart)
        if plan.kind is C:
            break
    assert restarts == 1 and kinds.count(R) == 1
    plan = sched.next(clock.now)
    assert plan.kind is R and plan.prompts == ("prompt " + str(plan.prompt_seqs[0] - 1),)
    assert plan.prompt_seqs[0] > 1  # a newer one than the prompt that restarted the chunk


# ----- batching -----------------------------------------------------------------------------------


def test_batching_groups_only_the_same_kind_and_step():
    sched = make(policy="fifo", stall_guard_chunks=None, max_batch=3, chunk_granular=False)
    admit(sched, "a")
    clock = Clock(sched)
    assert clock.run(1) == [(D, ("a",), 0)]
    admit(sched, "b", "c", now=clock.now)
    assert clock.run(4) == [(D, ("a",), 1), (D, ("a",), 2), (D, ("a",), 3), (C, ("a",), 4)]
    assert clock.run(1) == [(D, ("a", "b", "c"), 0)]
    sched.observe_buffer("a", 20, clock.now)
    sched.set_prompt("a", clock.now)  # a restarts: a recache, then its step 0 alone, then all at step 1
    assert clock.run(3) == [(R, ("a",), RECACHE_STAGE), (D, ("a",), 0), (D, ("a", "b", "c"), 1)]


def test_max_batch_bounds_the_group():
    sched = make(policy="round_robin", stall_guard_chunks=None, max_batch=2, chunk_granular=False)
    admit(sched, "a", "b", "c")
    assert Clock(sched).run(3) == [(D, ("a", "b"), 0), (D, ("c",), 0), (D, ("a", "b"), 1)]


# ----- degrading ----------------------------------------------------------------------------------


def test_a_stream_with_slack_to_spare_never_degrades():
    sched = make(**DEGRADE)
    admit(sched, "a")
    clock = Clock(sched)
    steps = []
    while len(steps) < 50:  # 10 chunks, idle until the lead in between
        plan = clock.step()
        if plan is None:
            clock.now = sched.wake_at(clock.now)
        else:
            steps.append(plan.steps)
    assert set(steps) == {(4,)} and len(clock.delivered) == 10
    assert sched.stats(clock.now).degraded_chunks == 0 and not sched.stats(clock.now).pressure


@pytest.mark.parametrize(
    "late_by, steps",
    [
        (0.0, 4),  # started at its lead: 0.5625 s left, 0.3125 of work, 0.25 to spare
        (0.1875, 3),  # 0.375 s left: 4 steps would leave 0.0625, 3 steps (0.25 s of work) leave the margin
        (0.25, 2),  # 0.3125 s left: 2 steps (0.1875 s) leave 0.125
        (0.3125, 2),  # 0.25 s left: nothing leaves the margin, the fewest steps
    ],
)
def test_a_late_chunk_runs_the_most_steps_that_leave_the_margin(late_by, steps):
    sched = make(**DEGRADE)
    admit(sched, "a")
    now = first_chunk(sched) + late_by  # the device was busy elsewhere
    plan = sched.next(now)
    assert (plan.kind, plan.step, plan.steps) == (D, 0, (steps,))
    clock = Clock(sched, now)
    sched.complete(plan, now + COST, COST)
    clock.now = now + COST
    rest = clock.run(steps)
    assert rest == [(D, ("a",), k) for k in range(1, steps)] + [(C, ("a",), 4)]
    assert sched.stream_stats("a", clock.now).degraded_chunks == (steps < 4)
    assert sched.stats(clock.now).pressure == (steps < 4)


def test_a_chunk_in_progress_is_cut_short_when_it_falls_behind():
    sched = make(**DEGRADE)
    admit(sched, "a")
    now = first_chunk(sched)
    plans = Clock(sched, now).launch(2)  # steps 0 and 1 on time, 4 steps planned
    assert [p.steps for p in plans] == [(4,), (4,)]
    late = now + 2 * COST + 0.2  # then the device stalls for 0.2 s: 0.2375 s left, 3 forwards of work
    plan = sched.next(late)
    assert (plan.kind, plan.step, plan.steps) == (C, 4, (2,))  # cut at the 2 steps it has run: commit now
    sched.complete(plan, late + COST, COST)
    assert sched.stream_stats("a", late + COST).degraded_chunks == 1
    wake = sched.wake_at(late + COST)  # the next chunk starts at its lead, with slack again: all its steps
    assert sched.next(wake).steps == (4,)


def test_no_degrading_when_off_or_for_a_stream_that_cannot_stall():
    off = make()
    admit(off, "a")
    now = first_chunk(off) + 0.3
    assert off.next(now).steps == (4,)
    waiting = make(**DEGRADE)  # a newcomer far past its start-up slack: nothing plays, nothing can stall
    admit(waiting, "a")
    assert waiting.next(5.0).steps == (4,)
    paused = make(**DEGRADE)
    admit(paused, "a")
    now = first_chunk(paused)
    paused.pause("a", now)
    assert paused.next(now + 0.3).steps == (4,)


def test_under_pressure_a_steering_stream_waits_for_its_lead_and_its_recache_only_for_that_recache():
    sched = make(**DEGRADE, pressure_hold_s=2.0, buffer_cap_s=3.0)
    admit(sched, "a", "b")
    clock = Clock(sched)
    clock.run(10)  # both first chunks: a's delivered at 0.3125 (0.25 s left now), b's at 0.625
    sched.observe_buffer("b", 24, clock.now)  # b has 1.5 s: above its lead, under the cap's 2.25
    sched.set_prompt("b", clock.now)  # b steers: it may run ahead of its lead to the cap
    assert sched.stream_stats("b", clock.now).runnable and not sched.stats(clock.now).pressure
    plan = sched.next(clock.now)  # a is about to stall: the fewest steps
    assert (plan.stream_ids, plan.steps) == (("a",), (2,))
    sched.complete(plan, clock.now + COST, COST)
    now = clock.now + COST
    stats = sched.stream_stats("b", now)
    assert sched.stats(now).pressure and not stats.runnable  # b waits
    assert stats.lead_s == 0.9375 and stats.buffered_s == 1.4375
    # its RECACHE may go its own cost and the headroom (the margin) before the lead: at 0.9375 + 0.0625 + 0.25 s
    assert not sched.stream_stats("b", now + 0.1875 - 0.0625).runnable
    assert sched.stream_stats("b", now + 0.1875).runnable
    assert not sched.stats(clock.now + 2.1).pressure


# ----- the plan contract --------------------------------------------------------------------------


def test_one_plan_at_a_time():
    sched = make()
    admit(sched, "a")
    plan = sched.next(0.0)
    with pytest.raises(SchedulerError, match="still outstanding"):
        sched.next(0.0)
    sched.cancel(plan)
    assert sched.next(0.0) == plan  # cancelled: nothing advanced
    other = Plan(kind=C, stream_ids=("a",), step=4, restart=(False,), prompt_seqs=(0,), chunk_index=(0,), steps=(4,))
    with pytest.raises(SchedulerError, match="not the outstanding plan"):
        sched.complete(other, 0.0, COST)


def test_a_stream_removed_or_replaced_while_its_plan_runs_is_skipped():
    sched = make()
    admit(sched, "a", "b")
    plan = sched.next(0.0)
    assert plan.stream_ids == ("a",)
    assert sched.remove("a") and not sched.remove("a")
    admit(sched, "a")  # the same id, another stream
    assert sched.complete(plan, COST, COST) == []
    assert [(k, ids, st) for k, ids, st in Clock(sched, now=COST).run(6)] == [(D, ("b",), i) for i in range(4)] + [
        (C, ("b",), 4),
        (D, ("a",), 0),  # the new "a" starts afresh
    ]
    with pytest.raises(SchedulerError, match="'zz' is not admitted"):
        sched.set_prompt("zz", 0.0)


def test_with_prompt_cut_a_new_prompts_first_chunk_leaves_its_viewer_holding_it_alone_and_the_next_runs_ahead():
    sched = make(prompt_cut=True)
    admit(sched, "a")
    Clock(sched).run(5)  # first chunk at 0.3125
    sched.observe_buffer("a", 16, 0.3125)  # 1 s buffered: above the lead
    sched.set_prompt("a", 0.3125)
    t = 0.3125
    for _ in range(6):  # the recache and the new prompt's first chunk
        plan = sched.next(t)
        t += COST
        sched.complete(plan, t, COST, deliver=False)
    assert sched.cuts("a")  # the engine's header says so
    sched.delivered("a", t)  # it cut: the older frames are dropped, the viewer holds these 12 (0.75 s)
    assert sched.stream_stats("a", t).buffered_s == 0.75
    # and the chunk after it runs ahead at once (to the cap), though 0.75 s is above the lead
    assert sched.next(t).kind is D
    plain = make()  # no cut: the same chunk comes after the buffered second
    admit(plain, "a")
    Clock(plain).run(5)
    plain.observe_buffer("a", 16, 0.3125)
    plain.set_prompt("a", 0.3125)
    t = 0.3125
    for _ in range(6):
        plan = plain.next(t)
        t += COST
        plain.complete(plan, t, COST, deliver=False)
    assert not plain.cuts("a")
    plain.delivered("a", t)
    assert plain.stream_stats("a", t).buffered_s == pytest.approx(1.0 - 0.375 + 0.75)



def test_a_stream_steered_for_hours_keeps_a_handful_of_prompt_texts_and_switches_within_two_chunks():
    """Over a long stream's life (here 2,000 forwards, a prompt before every one, its viewer's reports keeping it
    short of its lead, a pause and a resume) the scheduler keeps the texts a plan may still run under, a few a
    stream, and nothing once it is removed. A stream near its lead may make one chunk under its cache's prompt
    rather than recache first, not more: under the flood each commit planned a newer prompt, each counted as one
    not yet waited for, and the stream ran every chunk under its first prompt while the texts of those planned
    piled up (one a chunk)."""
    per_stream_prompts = 5  # the cache's, the chunk's, the one planned before and the newest; the one waiting
    sched = make()
    admit(sched, "a", "b")
    clock = Clock(sched)
    most, versions = {}, []  # versions: the prompt each of a's chunks ran under
    for k in range(2000):
        sched.set_prompt("a", clock.now, f"prompt {k}")
        if k % 7 == 0:
            sched.set_prompt("b", clock.now, f"other {k}")
        sched.observe_buffer("a", 8, clock.now)  # short of its lead (0.5625 s): a recache would (nearly) stall it
        if k == 1000:
            sched.pause("a", clock.now)
        if k == 1200:
            sched.resume("a", clock.now)
        plan = clock.step()
        if plan is None:
            clock.now += COST
        elif plan.kind is D and plan.step == 0 and "a" in plan.stream_ids:
            versions.append(plan.prompt_seqs[plan.stream_ids.index("a")])
        for name, n in sched.table_sizes().items():
            most[name] = max(most.get(name, 0), n)
    assert len(versions) > 100  # it went on making chunks
    assert all(versions[i + 2] > versions[i] for i in range(len(versions) - 2)), versions[:20]
    assert 2 <= most["scheduler.prompt_texts"] <= 2 * per_stream_prompts
    assert most["scheduler.streams"] == 2 and most["scheduler.chunks_in_flight"] == 0  # (delivered at once here)
    sched.remove("a")
    sched.remove("b")
    assert set(sched.table_sizes().values()) == {0}


def test_the_prompt_texts_a_stream_keeps_are_those_a_plan_may_still_run_under():
    """Whatever its plans do, a stream keeps the texts of its cache's prompt, its chunk's, the one planned before
    (a recache of it may be under way), the newest and the one waiting, no more: here prompts come and commits
    follow while its cache and chunk stay under its first prompt (the old rule kept every version since those)."""
    from collections import deque

    from streamsvc.scheduling.playback import PlaybackModel
    from streamsvc.scheduling.stream import ScheduledStream

    s = ScheduledStream(StreamRequest("a", FPS), order=0, admitted_at=0.0, playback=PlaybackModel(FPS),
                        latencies=deque(maxlen=8), prompt_texts={0: "first"})
    for k in range(1, 200):
        s.new_prompt(f"prompt {k}", now=float(k))
        s.new_prompt(f"prompt {k} again", now=float(k))  # waits for the next commit
        assert len(s.prompt_texts) <= 5 and s.cache_seq in s.prompt_texts and s.prompt_seq in s.prompt_texts
        s.chunk_committed(now=k + 0.5)  # plans the one that waited
    assert s.prompt_texts[s.prompt_seq] == "prompt 199 again" and s.prompt_texts[0] == "first"
