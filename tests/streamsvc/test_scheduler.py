"""Scheduler: exact plans for hand-built states, admission, prompts, pause, batching, costs.

Times and costs are multiples of 1/16 s so every figure is exact in binary floating point:
a forward costs 1/16 s, a chunk (4 DENOISE + 1 COMMIT) 5/16 s, and at 16 fps the first
chunk (9 frames) plays 0.5625 s and a later one (12 frames) 0.75 s.
"""

from __future__ import annotations

import math

import pytest

from streamsvc.scheduler import (
    RECACHE_STAGE,
    Admission,
    CostModel,
    PlaybackModel,
    Plan,
    Scheduler,
    SchedulerConfig,
    SchedulerError,
    Stage,
    StreamRequest,
    WorkKind,
)

FPS = 16.0
COST = 0.0625  # one forward
CHUNK_WORK = 5 * COST  # one chunk's forwards
MARGIN = 0.25  # start_margin_s (the default, exact in binary)
# The forward-level baselines: no start rule (every stream runs ahead to the cap), no chunk-granular preference.
PLAIN = {"start_margin_s": math.inf, "chunk_granular": False}
D, C, R = WorkKind.DENOISE, WorkKind.COMMIT, WorkKind.RECACHE


def make(**overrides) -> Scheduler:
    """A scheduler with exact costs and margin; admission off unless a test is about it."""
    defaults = {"initial_forward_s": COST, "utilization_target": math.inf, "start_margin_s": MARGIN}
    return Scheduler(SchedulerConfig(**{**defaults, **overrides}))


def admit(sched: Scheduler, *ids: str, now: float = 0.0) -> None:
    for stream_id in ids:
        assert sched.admit(StreamRequest(stream_id, FPS), now).accepted


class Clock:
    """Runs plans one after another, each taking `cost` seconds, and records them."""

    def __init__(self, sched: Scheduler, now: float = 0.0, cost: float = COST) -> None:
        self.sched, self.now, self.cost = sched, now, cost
        self.delivered: list[tuple[float, str]] = []

    def step(self) -> Plan | None:
        plan = self.sched.next(self.now)
        if plan is not None:
            self.now += self.cost
            for stream_id in self.sched.complete(plan, self.now, self.cost):
                self.delivered.append((self.now, stream_id))
        return plan

    def run(self, n: int) -> list[tuple[WorkKind, tuple[str, ...], int]]:
        plans = []
        for _ in range(n):
            plan = self.step()
            assert plan is not None
            plans.append((plan.kind, plan.stream_ids, plan.step))
        return plans

    def ids(self, n: int) -> list[str]:
        return ["+".join(ids) for _, ids, _ in self.run(n)]

    def launch(self, n: int, elapsed_s: float | None = COST) -> list[Plan]:
        """Run `n` plans as the engine does: each counted done at its end (`cost` later) with its
        frames in flight (deliver=False) and `elapsed_s` as its measured cost (None: not known)."""
        plans = []
        for _ in range(n):
            plan = self.sched.next(self.now)
            assert plan is not None
            self.now += self.cost
            assert self.sched.complete(plan, self.now, elapsed_s, deliver=False) == []
            plans.append(plan)
        return plans


CHUNK = [(D, 0), (D, 1), (D, 2), (D, 3), (C, 4)]


# ----- configuration --------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"policy": "edf"}, "policy 'edf' is unknown; use one of slack, least_slack, round_robin, fifo"),
        ({"denoise_steps": 0}, "denoise_steps=0"),
        ({"buffer_cap_s": 0.0}, "buffer_cap_s=0.0"),
        ({"max_batch": 0}, "max_batch=0"),
        ({"utilization_target": 0.0}, "math.inf turns admission off"),
        ({"initial_forward_s": -1.0}, "initial_forward_s=-1.0"),
        ({"cost_percentile": 1.5}, "cost_percentile=1.5"),
        ({"cost_min_samples": 65}, "cost_min_samples=65"),
        ({"restart_margin_chunks": -1.0}, "restart_margin_chunks=-1.0"),
        ({"startup_slack_s": math.inf}, "startup_slack_s=inf"),
        ({"stall_guard_chunks": -0.5}, "or None for off"),
        ({"start_margin_s": -0.1}, "start_margin_s=-0.1: must be >= 0 s (e.g. 0.25), or math.inf for no start rule"),
        ({"latency_window": 0}, "latency_window=0"),
        ({"latency_min_samples": 33}, "latency_min_samples=33: must be in [0, latency_window=32]"),
        ({"degrade_steps": (4,)}, "degrade_steps=(4,): each must be in [1, 3], fewer than denoise_steps=4"),
        ({"pressure_hold_s": -1.0}, "pressure_hold_s=-1.0"),
        ({"degrade_margin_s": math.inf}, "degrade_margin_s=inf"),
    ],
)
def test_config_is_validated_with_the_value_and_the_fix(kwargs, needle):
    with pytest.raises(ValueError) as err:
        SchedulerConfig(**kwargs)
    assert needle in str(err.value)


def test_stream_request_is_validated():
    with pytest.raises(ValueError, match="fps=0"):
        StreamRequest("a", 0.0)
    with pytest.raises(ValueError, match="chunk_frames=0"):
        StreamRequest("a", FPS, chunk_frames=0)


# ----- admission --------------------------------------------------------------------------


def test_admission_accepts_under_the_target_and_refuses_over_it_with_the_numbers():
    sched = make(utilization_target=0.9)

    def req(i: int) -> StreamRequest:  # 12 fps, 12 frames a chunk: 1 chunk/s, load 0.3125 each
        return StreamRequest(f"s{i}", fps=12.0, chunk_frames=12)

    assert sched.admit(req(0), 0.0) == Admission(accepted=True, reason=None, predicted_load=0.3125)
    assert sched.admit(req(1), 0.0) == Admission(accepted=True, reason=None, predicted_load=0.625)
    assert sched.stream_ids == ("s0", "s1")
    refused = sched.admit(req(2), 0.0)
    assert not refused.accepted
    assert refused.predicted_load == 0.625
    assert "compute:" in refused.reason
    assert "with 2 streams" in refused.reason and "needs 0.31" in refused.reason
    assert "1.00 chunks/s x 312.5 ms per chunk" in refused.reason
    assert "0.94 > target 0.90" in refused.reason
    assert "s2" not in sched
    sched.remove("s0")
    assert sched.admit(req(2), 1.0) == Admission(accepted=True, reason=None, predicted_load=0.625)


def test_kv_refusal_refuses_even_with_compute_to_spare():
    sched = make()
    adm = sched.admit(StreamRequest("a", FPS), 0.0, kv_refusal="KV cache needs 3.2 GiB but the pool has 1.0 GiB free")
    assert adm == Admission(
        accepted=False, reason="kv cache: KV cache needs 3.2 GiB but the pool has 1.0 GiB free", predicted_load=0.0
    )
    assert len(sched) == 0


def test_both_reasons_are_given_and_admission_off_admits_everything():
    sched = make(utilization_target=0.3)
    adm = sched.admit(StreamRequest("a", FPS), 0.0, kv_refusal="pool full")
    assert adm.reason.startswith("kv cache: pool full; compute: ")
    unlimited = make(utilization_target=math.inf)
    for i in range(50):
        assert unlimited.admit(StreamRequest(f"s{i}", FPS), 0.0).accepted


def test_a_chunk_longer_than_the_buffer_cap_is_refused():
    adm = make(buffer_cap_s=0.5).admit(StreamRequest("a", FPS), 0.0)
    assert not adm.accepted
    assert "a chunk of 0.750 s at 16 fps cannot fit the 0.5 s buffer cap; raise buffer_cap_s" in adm.reason


def test_the_start_rule_refuses_a_stream_whose_lead_and_chunk_do_not_fit_the_cap():
    sched = make(buffer_cap_s=1.5, utilization_target=10.0)
    assert sched.admit(StreamRequest("a", FPS), 0.0).accepted  # lead 0.3125 + 0.25, + 0.75 = 1.3125 <= 1.5
    refused = sched.admit(StreamRequest("b", FPS), 0.0)
    assert refused == Admission(
        accepted=False,
        reason=(
            "start rule: with 2 streams a chunk must start 0.875 s before its buffer runs dry (625.0 ms of "
            "predicted chunk latency, one chunk of every stream, + 0.25 s margin) and a 0.750 s chunk must fit "
            "above that: 1.625 s > the 1.5 s buffer cap; raise the buffer cap (--buffer-cap, buffer_cap_s) to "
            "1.63 s or try again when a stream closes"
        ),
        predicted_load=sched.predicted_load(),
    )
    assert sched.stream_ids == ("a",)
    # Batched two at a time, the two streams' chunks are one forward each: 0.3125 + 0.25 + 0.75 fits, once a
    # batch of two is measured to cost what one stream does (unmeasured, it counts as two forwards).
    batched = make(buffer_cap_s=1.5, utilization_target=10.0, max_batch=2)
    assert batched.admit(StreamRequest("a", FPS), 0.0).accepted and not batched.admit(StreamRequest("b", FPS), 0.0).accepted
    batched = make(buffer_cap_s=1.5, utilization_target=10.0, max_batch=2)
    for kind in (D, C):
        batched.seed_cost(kind, 2, COST)
    assert batched.admit(StreamRequest("a", FPS), 0.0).accepted and batched.admit(StreamRequest("b", FPS), 0.0).accepted
    assert not batched.admit(StreamRequest("c", FPS), 0.0).accepted  # 2 x 0.3125 + 0.25 + 0.75 > 1.5
    # Both reasons when both apply.
    both = make(buffer_cap_s=1.5, utilization_target=0.5)
    assert both.admit(StreamRequest("a", FPS), 0.0).accepted
    reason = both.admit(StreamRequest("b", FPS), 0.0).reason
    assert reason.startswith("start rule: with 2 streams") and "; compute: the device is 0.42 busy" in reason


def test_a_duplicate_id_is_a_contract_error():
    sched = make()
    admit(sched, "a")
    with pytest.raises(SchedulerError, match="'a' is already admitted"):
        sched.admit(StreamRequest("a", FPS), 0.0)


# ----- one stream ----------------------------------------------------------------------------


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
        kind=C, stream_ids=("a",), step=4, restart=(False,), prompt_seqs=(0,), chunk_index=(0,), steps=(4,)
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


# ----- the start rule, in-flight chunks --------------------------------------------------------


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


# ----- policies: exact orderings for hand-built states ---------------------------------------------


def test_fifo_serves_the_oldest_stream_until_it_reaches_the_cap():
    sched = make(policy="fifo", stall_guard_chunks=None, **PLAIN)
    admit(sched, "a", "b", "c")
    # a fills to the cap (three chunks), b gets the device until a drains to 1.25 s at t = 1.125.
    assert Clock(sched).ids(25) == ["a"] * 15 + ["b"] * 3 + ["a"] * 5 + ["b"] * 2


def test_round_robin_gives_one_forward_per_stream_in_turn():
    sched = make(policy="round_robin", stall_guard_chunks=None, **PLAIN)
    admit(sched, "a", "b", "c")
    clock = Clock(sched)
    plans = clock.run(15)
    assert [ids[0] for _, ids, _ in plans] == ["a", "b", "c"] * 5
    assert [step for _, _, step in plans] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 4]
    assert [sid for _, sid in clock.delivered] == ["a", "b", "c"]


def test_round_robin_skips_a_stream_at_the_cap_and_resumes_the_cycle_after_the_last_served():
    sched = make(policy="round_robin", stall_guard_chunks=None, **PLAIN)
    admit(sched, "a", "b", "c")
    sched.observe_buffer("b", 32, 0.0)  # 2 s buffered: at the cap
    assert Clock(sched).ids(6) == ["a", "c", "a", "c", "a", "c"]


def test_least_slack_interleaves_late_streams_and_slack_finishes_the_closest_first():
    plain = make(policy="least_slack", stall_guard_chunks=None, chunk_granular=False)
    admit(plain, "p", "q")
    assert Clock(plain).ids(10) == ["p", "q"] * 5  # both newcomers deliver at the very end

    slack = make(policy="slack", stall_guard_chunks=None)
    admit(slack, "p", "q")
    clock = Clock(slack)
    assert clock.ids(10) == ["p"] * 5 + ["q"] * 5
    assert clock.delivered == [(0.3125, "p"), (0.625, "q")]


def test_slack_serves_on_time_streams_least_slack_first():
    sched = make(policy="slack")
    admit(sched, "roomy", "tight")
    sched.observe_buffer("roomy", 14, 0.0)  # 0.875 s, at its lead (2 streams: 0.625 + 0.25): slack 0.5625
    sched.observe_buffer("tight", 12, 0.0)  # 0.75 s: slack 0.4375
    assert sched.stream_stats("tight", 0.0).slack_s == 0.4375
    assert Clock(sched).ids(6) == ["tight"] * 5 + ["roomy"]


def test_slack_puts_a_newcomer_before_streams_with_a_healthy_buffer():
    sched = make(policy="slack")
    admit(sched, "old")
    sched.observe_buffer("old", 16, 0.0)  # 1 s buffered
    admit(sched, "new")
    assert sched.stream_stats("new", 0.0).slack_s == -CHUNK_WORK
    clock = Clock(sched)
    # The first chunk (0.5625 s) leaves the newcomer under one chunk of slack, so it keeps going;
    # then old (0.375 s left at t = 0.625) is the one about to stall.
    assert clock.ids(11) == ["new"] * 10 + ["old"]
    assert clock.delivered == [(0.3125, "new"), (0.625, "new")]
    assert sched.stats(0.9375).stalls == 0


def test_a_waiting_newcomer_grows_more_urgent():
    sched = make(policy="slack")
    admit(sched, "a", now=0.0)
    assert sched.stream_stats("a", 0.5).slack_s == -0.5 - CHUNK_WORK
    relaxed = make(policy="slack", startup_slack_s=0.5)
    admit(relaxed, "a", now=0.0)
    assert relaxed.stream_stats("a", 0.25).slack_s == 0.25 - CHUNK_WORK


def test_guard_a_chunk_in_progress_of_a_stream_about_to_stall_goes_before_a_newcomer():
    sched = make(policy="slack")
    admit(sched, "old")
    sched.observe_buffer("old", 8, 0.0)  # 0.5 s: slack 0.1875, under one chunk of work
    clock = Clock(sched)
    assert clock.ids(1) == ["old"]  # its chunk is now in progress
    admit(sched, "new", now=clock.now)
    assert clock.ids(9) == ["old"] * 4 + ["new"] * 5
    assert sched.stream_stats("old", clock.now).stalls == 0


def test_guard_a_fresh_chunk_about_to_stall_still_yields_to_a_newcomer():
    sched = make(policy="slack")
    admit(sched, "old")
    sched.observe_buffer("old", 8, 0.0)
    admit(sched, "new")
    assert Clock(sched).ids(10) == ["new"] * 5 + ["old"] * 5


def test_guard_puts_streams_about_to_stall_before_work_ahead_for_baselines_too():
    sched = make(policy="fifo")
    admit(sched, "first", "second")
    sched.observe_buffer("first", 14, 0.0)  # 0.875 s, at its lead: due, slack 0.5625
    sched.observe_buffer("second", 8, 0.0)  # 0.5 s: about to stall (slack 0.1875 < one chunk of work)
    assert Clock(sched).ids(6) == ["second"] * 5 + ["first"]

    no_guard = make(policy="fifo", stall_guard_chunks=None)
    admit(no_guard, "first", "second")
    no_guard.observe_buffer("first", 14, 0.0)
    no_guard.observe_buffer("second", 8, 0.0)
    assert Clock(no_guard).ids(6) == ["first"] * 5 + ["second"]


def test_chunk_granular_a_chunk_in_progress_goes_first_unless_another_is_about_to_stall():
    def run(b_frames: int, **overrides) -> list[str]:
        sched = make(**overrides)
        admit(sched, "a", "b")
        sched.observe_buffer("a", 14, 0.0)  # 0.875 s: at its lead (0.625 + 0.25), due
        sched.observe_buffer("b", 32, 0.0)  # 2 s: not due
        clock = Clock(sched)
        assert clock.ids(4) == ["a"] * 4  # a's COMMIT is next: slack 0.625 - 0.0625 = 0.5625
        sched.observe_buffer("b", b_frames, clock.now)
        return clock.ids(5)

    # b at 0.75 s: due, slack 0.4375, less than a's but not under the guard (one chunk of work, 0.3125).
    assert run(12) == ["a"] + ["b"] * 4
    # Without: least slack first, a's slack shrinking as it waits while b's holds as b advances.
    assert run(12, chunk_granular=False) == ["b", "b", "a", "b", "b"]
    # b at 0.5625 s: slack 0.25, about to stall: the guard goes first.
    assert run(9) == ["b"] * 5


def test_two_chunks_in_progress_about_to_stall_do_not_alternate():
    # Guard: 0.625 s of slack; lead: 0.625 + 0.5 s; without chunk_granular, to start both chunks.
    sched = make(stall_guard_chunks=2.0, start_margin_s=0.5, chunk_granular=False)
    admit(sched, "a", "b")
    sched.observe_buffer("a", 17, 0.0)  # 1.0625 s: slack 0.75
    sched.observe_buffer("b", 32, 0.0)
    clock = Clock(sched)
    assert clock.ids(1) == ["a"]
    sched.observe_buffer("b", 16, clock.now)  # 1 s: slack 0.6875, less than a's
    assert clock.ids(1) == ["b"]
    sched.observe_buffer("a", 8, clock.now)  # 0.5 s: slack 0.25
    sched.observe_buffer("b", 9, clock.now)  # 0.5625 s: slack 0.3125
    # Both in the guard with 4 forwards left. Least slack first would alternate (b's slack falls while
    # a runs, then a's while b runs) and both would deliver late; the one closer to its commit goes on.
    assert clock.ids(8) == ["a"] * 4 + ["b"] * 4
    assert clock.delivered == [(0.375, "a"), (0.625, "b")]
    assert sched.stats(clock.now).stalls == 0


def test_guard_makes_round_robin_finish_chunks_of_streams_about_to_stall():
    sched = make(policy="round_robin")
    admit(sched, "a", "b", "c")
    assert Clock(sched).ids(15) == ["a"] * 5 + ["b"] * 5 + ["c"] * 5


# ----- prompts --------------------------------------------------------------------------------


def test_a_new_prompt_adds_a_recache_before_the_next_chunk():
    sched = make()
    admit(sched, "a")
    clock = Clock(sched)
    clock.run(5)
    sched.observe_buffer("a", 12, clock.now)  # 0.75 s: room for the recache (slack 0.375 after it)
    assert sched.set_prompt("a", clock.now) == 1
    assert sched.stream_stats("a", clock.now).prompt_pending
    plan = sched.next(clock.now)
    assert plan == Plan(
        kind=R, stream_ids=("a",), step=RECACHE_STAGE, restart=(False,), prompt_seqs=(1,), chunk_index=(1,), steps=(4,)
    )
    sched.complete(plan, clock.now + COST, COST)
    clock.now += COST
    assert not sched.stream_stats("a", clock.now).prompt_pending
    assert [(p.kind, p.step, p.prompt_seqs) for p in [sched.next(clock.now)]] == [(D, 0, (1,))]


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


def test_a_prompt_during_a_recache_in_flight_needs_another_recache():
    sched = make()
    admit(sched, "a")
    clock = Clock(sched)
    clock.run(5)
    sched.observe_buffer("a", 16, clock.now)  # 1 s: room for two recaches
    sched.set_prompt("a", clock.now)
    plan = sched.next(clock.now)
    assert plan.kind is R and plan.prompt_seqs == (1,)
    sched.set_prompt("a", clock.now)  # arrives while the recache runs
    sched.complete(plan, clock.now + COST, COST)
    clock.now += COST
    plan = sched.next(clock.now)
    assert (plan.kind, plan.prompt_seqs) == (R, (2,))


# ----- pause, buffer reports ----------------------------------------------------------------------


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


def test_observe_buffer_replaces_the_model():
    sched = make()
    admit(sched, "a")
    clock = Clock(sched)
    clock.run(5)
    sched.observe_buffer("a", 4, 0.5)  # the viewer has 0.25 s left, not the modelled 0.375
    assert sched.stream_stats("a", 0.5).buffered_s == 0.25
    assert sched.stream_stats("a", 1.0).stall_s == 0.25
    with pytest.raises(ValueError, match="buffered_frames=-1"):
        sched.observe_buffer("a", -1, 1.0)


def test_stats_model_stalls_and_queue():
    sched = make()
    admit(sched, "a", "b")
    clock = Clock(sched)
    clock.run(5)  # a's first chunk at 0.3125: 0.5625 s, runs dry at 0.875
    stats = sched.stats(1.0)
    assert stats.streams == 2 and stats.queue_length == 2
    assert [(s.stream_id, s.buffered_s, s.stalls, s.stall_s) for s in stats.per_stream] == [
        ("a", 0.0, 1, 0.125),
        ("b", 0.0, 0, 0.0),
    ]
    assert (stats.stalls, stats.stall_s) == (1, 0.125)
    assert stats.forward_cost_s[D] == COST


# ----- batching --------------------------------------------------------------------------------


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


def test_admission_counts_a_streams_share_of_a_measured_batch():
    sched = make(max_batch=4, utilization_target=1.0, confirm_chunks=0)  # no tranches: the compute check alone
    admit(sched, "a", "b")  # 4/3 chunks/s x 0.3125 s each: 0.83; batches of 2 unmeasured count as 2 forwards
    assert sched.predicted_load() == pytest.approx(2 * 4 / 3 * CHUNK_WORK)
    refused = sched.admit(StreamRequest("c", FPS), 0.0)
    assert not refused.accepted and "1.25 > target 1.00" in refused.reason
    for kind in (D, C):
        sched.seed_cost(kind, 3, 1.5 * COST)  # measured: a batch of 3 costs 1.5 forwards, half a forward each
    adm = sched.admit(StreamRequest("c", FPS), 0.0)
    assert adm.accepted and adm.predicted_load == pytest.approx(3 * 4 / 3 * CHUNK_WORK / 2)
    assert "312.5 ms per chunk" in sched.admit(StreamRequest("d", FPS), 0.0).reason  # batch 4: not measured yet


def test_max_batch_bounds_the_group():
    sched = make(policy="round_robin", stall_guard_chunks=None, max_batch=2, chunk_granular=False)
    admit(sched, "a", "b", "c")
    assert Clock(sched).run(3) == [(D, ("a", "b"), 0), (D, ("c",), 0), (D, ("a", "b"), 1)]


# ----- degrading -------------------------------------------------------------------------------

DEGRADE = {"degrade_steps": (3, 2), "degrade_margin_s": 0.125}  # the margin exact in binary


def first_chunk(sched: Scheduler) -> float:
    """Run stream "a"'s first chunk (delivered at 0.3125: 9 frames, dry at 0.875); returns the time."""
    clock = Clock(sched)
    assert clock.run(5) == [(k, ("a",), s) for k, s in CHUNK]
    return clock.now


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


# ----- cost estimate ----------------------------------------------------------------------------


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


# ----- the plan contract -------------------------------------------------------------------------


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


# ----- playback model --------------------------------------------------------------------------------


def test_playback_model_counts_stalls_exactly():
    pb = PlaybackModel(fps=FPS)
    pb.advance(1.0)
    assert (pb.started, pb.stalls) == (False, 0)  # nothing plays before the first frames
    pb.deliver(9, 1.0)
    assert (pb.seconds(1.0), pb.seconds(1.5)) == (0.5625, 0.0625)
    pb.advance(2.0)
    assert (pb.stalls, pb.dry_since, pb.stall_seconds(2.0)) == (1, 1.5625, 0.4375)
    pb.deliver(12, 2.5)
    assert (pb.closed_stall_s, pb.seconds(2.5), pb.dry_at()) == (0.9375, 0.75, 3.25)
    pb.pause(3.0)
    assert pb.seconds(10.0) == 0.25 and pb.dry_at() is None
    pb.resume(10.0)
    assert pb.dry_at() == 10.25
    assert (pb.stall_count(11.0), pb.stall_seconds(11.0)) == (2, 1.6875)


def test_a_dry_spell_shorter_than_the_grace_is_no_stall():
    pb = PlaybackModel(fps=FPS, grace_s=0.2)  # the viewer holds 0.2 s beyond the model (a WebRTC track's queue)
    pb.deliver(9, 1.0)  # dry at 1.5625
    pb.advance(1.7)
    assert (pb.dry_since, pb.seconds(1.7), pb.stalls, pb.stall_count(1.7)) == (1.5625, 0.0, 0, 0)  # planning sees it
    pb.deliver(12, 1.75)  # 0.1875 s dry: within the grace
    assert (pb.stalls, pb.closed_stall_s, pb.dry_since) == (0, 0.0, None)
    pb.observe(0, 2.0)  # the track's queue is empty
    assert (pb.stalls, pb.stall_count(2.1), pb.stall_count(2.2)) == (0, 0, 1)
    pb.advance(2.25)  # past the grace: a stall, counted once
    pb.advance(2.5)
    assert (pb.stalls, pb.stall_seconds(2.5)) == (1, 0.3)
    pb.deliver(12, 2.75)
    assert (pb.stalls, pb.closed_stall_s) == (1, 0.55)  # the stall's time past its grace


def test_a_report_with_a_grace_counts_as_a_stall_only_once_the_dry_spell_outlasts_it():
    sched = make(late_hold_s=1.0, confirm_chunks=0, late_margin_s=0.25, utilization_target=0.9)
    admit(sched, "a")
    now = first_chunk(sched)
    lead = sched.lead_s("a")
    sched.observe_buffer("a", 0, now, grace_s=0.15)  # a WebRTC track sent its last frame
    assert sched.admit(StreamRequest("b", FPS), now).accepted  # no stall yet: admission stays open
    sched.remove("b")
    assert sched.stream_stats("a", now).slack_s < 0  # but the stream plans as dry
    clock = Clock(sched, now)
    clock.run(5)  # its next chunk arrives 0.3125 s later: past the grace
    assert sched.stats(clock.now).stalls == 1
    assert "reached its viewer 0.31 s after the buffer ran dry" in sched.admit(StreamRequest("c", FPS), clock.now).reason
    sched.cancel(sched.next(clock.now))  # the margin in force is decided when the scheduler plans
    assert sched.lead_s("a") == lead + 0.25
    quick = make(late_hold_s=1.0, confirm_chunks=0, utilization_target=0.9)
    admit(quick, "a")
    now = first_chunk(quick)
    quick.observe_buffer("a", 0, now, grace_s=0.5)
    Clock(quick, now).run(5)  # within the grace: the viewer never saw it
    assert quick.stats(now + 0.3125).stalls == 0
    assert quick.admit(StreamRequest("c", FPS), now + 0.3125).accepted
    with pytest.raises(ValueError, match="grace_s"):
        quick.observe_buffer("a", 0, now, grace_s=-1.0)


# ----- admission by the whole pipeline, the closed loop, tranches, the last resort -------------------


def test_a_slow_output_stage_refuses_new_streams_with_the_device_to_spare():
    sched = make(utilization_target=0.9, output_capacity=1.0, output_target=0.5, confirm_chunks=0, initial_forward_s=1 / 256)
    sched.seed_stage(Stage.OUTPUT, 0.125)  # x264 + packing: 0.125 s a chunk, 4/3 chunks/s a stream: 0.17 each
    admit(sched, "a", "b", "c")
    refused = sched.admit(StreamRequest("d", FPS), 0.0)
    assert not refused.accepted
    assert refused.reason.startswith("output: 1 output worker(s) would be 0.67 busy with 4 streams (125.0 ms per chunk)")
    assert "compute" not in refused.reason  # the device alone would take it: 4 x 4/3 x 5/256 s = 0.1
    for _ in range(8):  # serving measures cheaper encodes (p90 of the last 64): room again
        sched.observe_stage(Stage.OUTPUT, 0.0625)
    assert sched.admit(StreamRequest("d", FPS), 0.0).accepted
    assert sched.stats(0.0).stage_load[Stage.OUTPUT] == pytest.approx(4 * 4 / 3 * 0.0625)


def test_the_send_stage_has_a_target_of_its_own():
    sched = make(send_target=0.25, confirm_chunks=0, initial_forward_s=1 / 256)
    sched.seed_stage(Stage.SEND, 0.0625)  # 4/3 chunks/s x 0.0625 = 0.083 a stream
    admit(sched, "a", "b", "c")
    refused = sched.admit(StreamRequest("d", FPS), 0.0)
    assert "send: the event loop would be 0.33 busy with 4 streams" in refused.reason
    with pytest.raises(ValueError, match="observe_cost"):
        sched.observe_stage(Stage.DEVICE, 0.1)


def test_watchers_count_in_the_send_stage_only():
    sched = make(send_target=0.5, confirm_chunks=0, initial_forward_s=1 / 256)
    sched.seed_stage(Stage.SEND, 0.015)  # 4/3 chunks/s x 0.015 = 0.02 a viewer: room for 25
    admit(sched, "a")
    device = sched.predicted_load()
    accepted = [sched.admit_viewer("a").accepted for _ in range(30)]
    assert accepted == [True] * 24 + [False] * 6  # the steerer and 24 watchers: 25 x 0.02 = 0.5
    assert sched.stage_load(Stage.SEND) == pytest.approx(25 * 4 / 3 * 0.015)
    output_s = sched.stage_costs.estimate(Stage.OUTPUT)
    assert sched.predicted_load() == device and sched.stage_load(Stage.OUTPUT) == pytest.approx(4 / 3 * output_s)
    refused = sched.admit_viewer("a")
    assert refused.reason.startswith("send: the event loop would be 0.52 busy sending to 26 viewers (15.00 ms")
    refused = sched.admit(StreamRequest("b", FPS), 0.0)  # a new stream's steerer is one more viewer too
    assert not refused.accepted and "send: the event loop would be 0.52 busy with 2 streams" in refused.reason
    sched.viewer_left("a")
    assert sched.admit(StreamRequest("b", FPS), 0.0).accepted
    with pytest.raises(SchedulerError):
        sched.admit_viewer("nobody")


def test_a_burst_of_40_on_a_pipeline_with_room_for_10_admits_at_most_10():
    # Room for 10 in steady state: each stream needs 4/3 chunks/s x 5 forwards x 1/128 s = 0.052 of the device.
    sched = make(utilization_target=0.55, initial_forward_s=1 / 128)
    sched.seed_stage(Stage.OUTPUT, 0.01)
    accepted = [sched.admit(StreamRequest(f"s{i}", FPS), 0.001 * i) for i in range(40)]
    assert 1 <= sum(a.accepted for a in accepted) <= 10
    assert all(a.reason for a in accepted if not a.accepted)
    first = sum(a.accepted for a in accepted)
    # The tranche: one chunk (0.039 s) + 0.55 x 0.5625 s of the device over 0.039 s a chunk: 8 starting at once
    assert first == 8 and "starting: 8 streams" in accepted[8].reason and "the device starts 8 at once" in accepted[8].reason
    # Once a tranche has delivered two chunks each (and nobody was late), the next: up to the 10 of steady state.
    clock = Clock(sched, 0.05, cost=1 / 128)
    admitted = [f"s{i}" for i in range(8)]
    for tranche in (2,):
        while min(sched.stream_stats(sid, clock.now).chunks_delivered for sid in admitted) < 2:
            if clock.step() is None:
                clock.now = sched.wake_at(clock.now)
        assert sched.stats(clock.now).stalls == 0
        more = [sched.admit(StreamRequest(f"t{len(admitted) + i}", FPS), clock.now) for i in range(40)]
        assert sum(a.accepted for a in more) == tranche  # the tranche shrinks as the device fills
        admitted += [f"t{len(admitted) + i}" for i, a in enumerate(more) if a.accepted]
    assert len(sched) == 10 and "compute:" in more[-1].reason  # 10 in all: the device's target


def test_a_late_stream_closes_admission_until_it_has_been_on_time_for_the_hold():
    sched = make(utilization_target=0.9, late_hold_s=2.0, confirm_chunks=0)
    admit(sched, "a")
    now = first_chunk(sched)  # delivered at 0.3125: 9 frames, dry at 0.875
    plan = sched.next(1.5)  # the device was away: the next chunk reaches the viewer at 1.8125, 0.94 s late
    clock = Clock(sched, 1.5)
    sched.complete(plan, 1.5 + COST, COST)
    clock.now = 1.5 + COST
    clock.run(4)
    assert sched.stream_stats("a", clock.now).stalls == 1
    refused = sched.admit(StreamRequest("b", FPS), clock.now)
    assert not refused.accepted and refused.reason.startswith("closed loop: stream a was late 0.0 s ago (chunk 1 reached")
    assert sched.stats(clock.now).late
    assert not sched.admit(StreamRequest("b", FPS), clock.now + 1.9).accepted
    assert sched.admit(StreamRequest("b", FPS), clock.now + 2.0).accepted
    del now


def test_a_viewer_reporting_an_empty_buffer_or_a_cheaper_encode_closes_admission():
    sched = make(late_hold_s=1.0, confirm_chunks=0, utilization_target=0.9)
    admit(sched, "a")
    now = first_chunk(sched)
    sched.observe_buffer("a", 0, now)
    assert "its viewer reported an empty buffer" in sched.admit(StreamRequest("b", FPS), now).reason
    assert sched.admit(StreamRequest("b", FPS), now + 1.0).accepted
    sched.mark_late("b", now + 1.5, "chunk 3 encoded cheaper to meet its deadline")
    assert "stream b was late 0.5 s ago (chunk 3 encoded cheaper" in sched.admit(StreamRequest("c", FPS), now + 2.0).reason


def test_a_degraded_chunk_closes_admission():
    sched = make(**DEGRADE, utilization_target=0.9, confirm_chunks=0)
    admit(sched, "a")
    now = first_chunk(sched) + 0.25
    assert sched.next(now).steps == (2,)
    assert "a chunk ran 2 of 4 steps to stay ahead" in sched.admit(StreamRequest("b", FPS), now).reason


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


def run_late(sched: Scheduler, until: float, away: float) -> Clock:
    """Serve `streams` until `until`, the device away for `away` s after each chunk (a throttled device)."""
    clock = Clock(sched)
    while clock.now < until:
        plan = clock.step()
        if plan is None:
            clock.now = sched.wake_at(clock.now) or clock.now + COST
        elif plan.kind is C:
            clock.now += away
    return clock


def test_the_newest_stream_is_ended_only_after_degradation_ran_out():
    # Degradation absorbs the device being away 0.1 s after every chunk: chunks run fewer steps, and though the
    # start-up stalls twice, the fewest steps always leave the margin, so no stream is named.
    mild = make(**DEGRADE, start_margin_s=0.0625)
    admit(mild, "a", "b")
    clock = run_late(mild, 6.0, away=0.1)
    assert mild.stats(clock.now).degraded_chunks > 0
    assert mild.overloaded(clock.now) is None
    # Away for long after every chunk: chunks run with 2 steps (the fewest) and the viewers still stall.
    sched = make(**DEGRADE, overload_stalls=2, overload_window_s=4.0)
    admit(sched, "a", "b")
    clock = run_late(sched, 3.0, away=0.5)
    named = sched.overloaded(clock.now)
    assert named == "b"  # the newest
    assert sched.stats(clock.now).degraded_chunks > 0 and sched.stats(clock.now).stalls >= 2
    assert sched.overloaded(clock.now) is None  # the evidence is spent: the next needs stalls of its own


def test_stalls_without_degradation_running_out_end_nobody():
    sched = make(**DEGRADE)
    admit(sched, "a", "b")
    first_chunk(sched)
    for t in (1.0, 1.5, 2.0):
        sched._stalled(sched._get("a"), t, "test")  # stalls the degrade never had a chance against
    assert sched.overloaded(2.0) is None
    one = make()
    admit(one, "a")
    assert one.overloaded(0.0) is None


def test_admission_counts_the_recaches_of_the_last_seconds_as_the_streams_steering_load():
    sched = make(utilization_target=0.9, confirm_chunks=0, initial_forward_s=1 / 64)
    admit(sched, "a", "b")
    base = sched.predicted_load()  # 2 x 4/3 chunks/s x 5/64 s
    clock = Clock(sched, cost=1 / 64)
    clock.run(10)  # both first chunks
    for _ in range(4):  # four prompt switches of a: four recaches
        sched.set_prompt("a", clock.now)
        clock.run(2)
    assert sched.predicted_load() == pytest.approx(base + 4 / 10 * (1 / 64))
    adm = sched.admit(StreamRequest("c", FPS), clock.now)
    assert adm.predicted_load == pytest.approx(base * 3 / 2 + 4 / 10 * (1 / 64) * 3 / 2)  # c steers as a and b do
    sched.stats(clock.now + 10.1)  # ten seconds on, those recaches are forgotten
    assert sched.predicted_load() == pytest.approx(base * 3 / 2)


def test_a_report_from_across_the_network_lowers_the_model_but_never_raises_it():
    sched = make()
    admit(sched, "a")
    now = first_chunk(sched)  # 9 frames delivered at 0.3125
    sched.observe_buffer("a", 9, now + 0.25, at_most=True)  # sent when the viewer had 9, arriving 0.25 s later
    assert sched.stream_stats("a", now + 0.25).buffered_s == 0.5625 - 0.25  # the model's: 4 frames played since
    sched.observe_buffer("a", 2, now + 0.25, at_most=True)  # the viewer is behind the model: it wins
    assert sched.stream_stats("a", now + 0.25).buffered_s == 0.125
    sched.observe_buffer("a", 0, now + 0.3125, at_most=True)
    assert sched.stream_stats("a", now + 0.3125).stalls == 1
    sched.observe_buffer("a", 9, now + 0.5)  # an exact report (the server's own WebRTC track) sets it
    assert sched.stream_stats("a", now + 0.5).buffered_s == 0.5625


def test_a_report_of_the_first_chunk_that_comes_before_the_scheduler_hears_of_it_does_not_count_it_twice():
    sched = make()
    admit(sched, "a")
    clock = Clock(sched)
    clock.launch(5)  # the first chunk's forwards: its 9 frames in flight
    now = clock.now + 0.01
    sched.observe_buffer("a", 9, now, at_most=True)  # the viewer got it before the engine told the scheduler
    assert sched.stream_stats("a", now).buffered_s == 0  # nothing delivered in the model yet: the report waits
    sched.delivered("a", now)
    assert sched.stream_stats("a", now).buffered_s == 0.5625  # the chunk once, not 18 frames


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


# ----- parking (a paused stream's cache in host memory) ----------------------------------------


def admit12(sched: Scheduler, *ids: str, now: float = 0.0) -> None:
    """12 fps, 12 frames a chunk: 1 chunk/s, load 0.3125 each."""
    for stream_id in ids:
        assert sched.admit(StreamRequest(stream_id, fps=12.0, chunk_frames=12), now).accepted


def test_a_held_stream_commits_its_chunk_then_parks_costing_no_load_and_getting_no_plans():
    sched = make(utilization_target=0.9)
    admit12(sched, "a", "b")
    clock = Clock(sched)
    assert clock.run(2) == [(D, ("a",), 0), (D, ("a",), 1)]
    sched.hold("a")
    assert sched.set_prompt("a", clock.now) == 1  # held: the chunk in progress is not restarted for it
    assert not sched.parkable("a")
    with pytest.raises(SchedulerError, match="'a' cannot be parked now: it is at step 2 of its chunk"):
        sched.park("a", clock.now)
    # a's chunk goes on to its commit; then b's, never a's next one (nor its RECACHE)
    assert clock.run(5) == [(D, ("a",), 2), (D, ("a",), 3), (C, ("a",), 4), (D, ("b",), 0), (D, ("b",), 1)]
    assert sched.parkable("a") and sched.predicted_load() == 0.625
    sched.park("a", clock.now)
    assert sched.predicted_load() == 0.3125 and len(sched) == 1 and "a" in sched and sched.is_parked("a")
    assert sched.parked_ids == ("a",) and sched.stream_ids == ("b",)
    stats = sched.stats(clock.now)
    assert (stats.streams, stats.parked, [s.stream_id for s in stats.per_stream]) == (1, 1, ["b"])
    assert clock.run(4) == [(D, ("b",), 2), (D, ("b",), 3), (C, ("b",), 4), (D, ("b",), 0)]
    assert not sched.parkable("a")


def test_a_parked_stream_keeps_its_counters_and_comes_back_with_its_prompt_applied():
    sched = make()
    admit12(sched, "a")
    clock = Clock(sched)
    clock.run(5)  # chunk 0 under prompt 0
    sched.hold("a")
    sched.park("a", clock.now)  # between chunks already
    assert sched.set_prompt("a", 3.0) == 1  # steering a parked stream: applied after it comes back
    assert sched.next(3.0) is None and sched.wake_at(3.0) is None
    assert sched.stream_stats("a", 3.0).buffered_s == 0.75  # paused while parked: 9 frames at 12 fps
    assert sched.unpark("a", 10.0) == Admission(accepted=True, reason=None, predicted_load=0.3125)
    assert not sched.is_parked("a") and sched.parked_ids == ()
    clock.now = 10.0
    plans = clock.launch(6)
    assert [(p.kind, p.step, p.prompt_seqs, p.chunk_index) for p in plans] == [
        (R, RECACHE_STAGE, (1,), (1,)), (D, 0, (1,), (1,)), (D, 1, (1,), (1,)), (D, 2, (1,), (1,)),
        (D, 3, (1,), (1,)), (C, 4, (1,), (1,)),
    ]


def test_unpark_rechecks_admission_and_a_refused_stream_stays_parked():
    sched = make(utilization_target=0.9)
    admit12(sched, "a", "b")
    sched.hold("a")
    sched.park("a", 0.0)  # before its first chunk
    admit12(sched, "c")  # takes a's room
    refused = sched.unpark("a", 1.0, kv_refusal="KV cache needs 3.2 GiB but the pool has 1.0 GiB free")
    assert not refused.accepted and refused.predicted_load == 0.625
    assert refused.reason.startswith("kv cache: KV cache needs 3.2 GiB but the pool has 1.0 GiB free; start rule: ")
    assert "compute: the device is 0.62 busy with 2 streams and this one needs 0.31" in refused.reason
    assert sched.is_parked("a") and sched.stream_ids == ("b", "c")
    sched.remove("c")
    assert sched.unpark("a", 2.0, kv_refusal="pool full") == Admission(False, "kv cache: pool full", 0.3125)
    assert sched.unpark("a", 2.0) == Admission(accepted=True, reason=None, predicted_load=0.625)
    assert sched.stream_ids == ("b", "a")


def test_a_parked_stream_is_still_credited_its_chunk_in_flight_and_keeps_its_viewers():
    sched = make(send_target=math.inf)
    admit12(sched, "a")
    assert sched.admit_viewer("a").accepted
    clock = Clock(sched)
    clock.launch(5)  # chunk 0 committed, in flight
    sched.hold("a")
    sched.park("a", clock.now)
    assert sched.delivered("a", 1.0) == 1.0 - 0.0  # due at admission, delivered at 1.0
    assert sched.stream_stats("a", 5.0).buffered_s == 0.75 and sched.stream_stats("a", 5.0).chunks_delivered == 1
    sched.viewer_left("a")
    assert sched.unpark("a", 5.0).accepted
    assert sched._streams["a"].viewers == 1  # the steerer: its watcher left while it was parked
    assert sched.stream_stats("a", 5.5).buffered_s == 0.25  # playing again


def test_parking_used_against_its_contract_says_why():
    sched = make()
    admit12(sched, "a")
    with pytest.raises(SchedulerError, match="'a' cannot be parked now: it is not held"):
        sched.park("a", 0.0)
    with pytest.raises(SchedulerError, match="'a' is not parked"):
        sched.unpark("a", 0.0)
    plan = sched.next(0.0)
    sched.hold("a")
    assert not sched.parkable("a")  # in the outstanding plan
    sched.cancel(plan)
    sched.park("a", 0.0)
    with pytest.raises(SchedulerError, match="'a' is parked: unpark it instead"):
        sched.hold("a")
    with pytest.raises(SchedulerError, match="already admitted"):
        sched.admit(StreamRequest("a", FPS), 0.0)
    assert sched.remove("a") and "a" not in sched and not sched.remove("a")


def test_a_hold_let_go_before_parking_lets_the_stream_go_on():
    sched = make()
    admit12(sched, "a")
    sched.hold("a")
    assert sched.next(0.0) is None and sched.wake_at(0.0) is None
    sched.hold("a", False)
    assert sched.next(0.0).stream_ids == ("a",)
