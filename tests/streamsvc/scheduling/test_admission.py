"""Admission: every refusal rule with its numbers, through the Scheduler and on its own."""

from __future__ import annotations

import math

import pytest

from streamsvc.scheduling import (
    Admission,
    AdmissionControl,
    CostEstimates,
    Late,
    SchedulerConfig,
    SchedulerError,
    Stage,
    StreamLoad,
    StreamRequest,
)
from tests.streamsvc.scheduling.helpers import (
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


# ----- the device, the start rule, the KV pool ----------------------------------------------------


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


# ----- the whole pipeline, the closed loop, tranches ----------------------------------------------


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


def test_a_viewers_queue_on_the_server_running_dry_or_a_cheaper_encode_closes_admission():
    sched = make(late_hold_s=1.0, confirm_chunks=0, utilization_target=0.9)
    admit(sched, "a")
    now = first_chunk(sched)
    sched.observe_buffer("a", 0, now)  # an exact report: the server's own (a WebRTC track's queue)
    assert "its viewer's queue on the server ran dry" in sched.admit(StreamRequest("b", FPS), now).reason
    assert sched.admit(StreamRequest("b", FPS), now + 1.0).accepted
    sched.mark_late("b", now + 1.5, "chunk 3 encoded cheaper to meet its deadline")
    assert "stream b was late 0.5 s ago (chunk 3 encoded cheaper" in sched.admit(StreamRequest("c", FPS), now + 2.0).reason


def test_a_degraded_chunk_closes_admission():
    sched = make(**DEGRADE, utilization_target=0.9, confirm_chunks=0)
    admit(sched, "a")
    now = first_chunk(sched) + 0.25
    assert sched.next(now).steps == (2,)
    assert "a chunk ran 2 of 4 steps to stay ahead" in sched.admit(StreamRequest("b", FPS), now).reason


def test_admission_counts_the_recaches_of_the_last_seconds_as_the_streams_steering_load():
    sched = make(utilization_target=0.9, confirm_chunks=0, initial_forward_s=1 / 64)
    admit(sched, "a", "b")
    base = sched.predicted_load()  # 2 x 4/3 chunks/s x 5/64 s
    clock = Clock(sched, cost=1 / 64)
    clock.run(10)  # both first chunks
    for _ in range(4):  # four prompt switches of a, each once the chunk after the last one is done: four recaches
        sched.set_prompt("a", clock.now)
        kinds = []
        for _ in range(200):
            plan = clock.step()
            if plan is None:
                clock.now += 1 / 64
            elif "a" in plan.stream_ids:
                kinds.append(plan.kind)
                if R in kinds and plan.kind is C:
                    break
        assert R in kinds and kinds[-1] is C
    assert sched.predicted_load() == pytest.approx(base + 4 / 10 * (1 / 64))
    adm = sched.admit(StreamRequest("c", FPS), clock.now)
    assert adm.predicted_load == pytest.approx(base * 3 / 2 + 4 / 10 * (1 / 64) * 3 / 2)  # c steers as a and b do
    sched.stats(clock.now + 10.1)  # ten seconds on, those recaches are forgotten
    assert sched.predicted_load() == pytest.approx(base * 3 / 2)


# ----- issue 33: no estimate raised outside any stream keeps an empty server refusing ---------------


def poisoned(**overrides):
    """A scheduler seeded by a warm-up (a chunk 5/64 s on the device, 1 ms on the output stage and the send) whose
    one stream "a" had its send and device samples raised by a flood: 656.8 ms a chunk sent, 493 ms a forward."""
    sched = make(**{"utilization_target": 0.9, "confirm_chunks": 0, "cost_min_samples": 2, **overrides})
    for kind in (D, C):
        sched.seed_cost(kind, 1, 1 / 64)
    for stage in (Stage.OUTPUT, Stage.SEND):
        sched.seed_stage(stage, 0.001)
    admit(sched, "a")
    for _ in range(2):
        sched.observe_stage(Stage.SEND, 0.6568)
        sched.observe_cost(D, 1, 0.493)
    return sched


def test_an_empty_server_admits_by_the_warm_ups_figures_whatever_was_measured_before():
    # The lock-out of issue 33: once its one viewer left, every start was refused with no stream open, for good:
    # nothing ran, so no sample could bring the estimates down.
    sched = poisoned()
    refused = sched.admit(StreamRequest("b", FPS), 1.0)
    assert "send: the event loop would be 1.75 busy with 2 streams (656.8 ms per chunk) > target 0.50" in refused.reason
    assert "compute: the device is 2.65 busy with 1 streams" in refused.reason
    sched.remove("a")
    sched.observe_stage(Stage.SEND, 0.6568)  # a sample taken as the stream left, after the server emptied
    sched.observe_cost(D, 1, 0.493)  # its forward in flight, retired after
    for t in (2.0, 32.0):
        assert sched.admit(StreamRequest("b", FPS), t).accepted
        assert (sched.stage_costs.estimate(Stage.SEND), sched.costs.estimate(D)) == (0.001, 1 / 64)
        sched.remove("b")
    # with a stream running, the estimates follow what it measures
    admit(sched, "c", now=40.0)
    for _ in range(2):
        sched.observe_stage(Stage.SEND, 0.25)
    assert sched.stage_costs.estimate(Stage.SEND) == 0.25


def test_an_empty_server_admits_though_its_last_stream_was_late_a_moment_ago():
    # A flood late in a stream's life made it late (a degraded chunk); it left, and the next start on the empty server
    # was refused by the closed loop for the stream that had gone.
    sched = make(utilization_target=0.9, confirm_chunks=0, late_hold_s=2.0)
    admit(sched, "a")
    sched.mark_late("a", 1.0, "a chunk ran 3 of 4 steps to stay ahead")
    assert "closed loop: stream a was late 0.3 s ago" in sched.admit(StreamRequest("b", FPS), 1.3).reason
    sched.remove("a")
    assert sched.admit(StreamRequest("b", FPS), 1.3).accepted
    assert "closed loop" in sched.admit(StreamRequest("c", FPS), 1.4).reason  # b is admitted: the loop holds again


def test_a_parked_stream_comes_back_to_an_empty_server_by_the_warm_ups_figures():
    sched = poisoned()
    sched.hold("a")
    sched.park("a", 1.0)
    assert len(sched) == 0
    assert sched.unpark("a", 2.0).accepted
    assert sched.stage_costs.estimate(Stage.SEND) == 0.001


def test_an_empty_server_still_refuses_what_its_warm_up_measured_too_slow():
    # A model too slow for its device (a 14B model on one GPU) is rightly refused, by the warm-up's own figures.
    sched = make(utilization_target=0.9)
    sched.seed_cost(D, 1, 0.25)
    refused = sched.admit(StreamRequest("a", FPS), 0.0)
    assert not refused.accepted and "compute: the device is 0.00 busy with 0 streams and this one needs 1.42" in refused.reason
    for _ in range(8):  # whatever samples came in with no stream open
        sched.observe_cost(D, 1, 0.001)
    assert not sched.admit(StreamRequest("a", FPS), 1.0).accepted


# ----- admission alone: loads, costs and the clock in, an Admission out ---------------------------


def gate(**overrides) -> AdmissionControl:
    """Admission on its own, with exact costs (no Scheduler, no planner)."""
    config = SchedulerConfig(**{"initial_forward_s": COST, "start_margin_s": MARGIN, **overrides})
    return AdmissionControl(config, CostEstimates(config))


def loads(n: int, *, fps: float = 12.0, delivered: int = 2) -> list[StreamLoad]:
    """`n` admitted streams at `fps` (12 frames a chunk), each having delivered `delivered` chunks."""
    return [StreamLoad(StreamRequest(f"s{i}", fps, chunk_frames=12), chunks_delivered=delivered) for i in range(n)]


def test_admission_alone_admits_a_stream_to_an_empty_server():
    # 1 chunk/s x 5 forwards of 1/16 s: 0.3125 of the device.
    assert gate().admit(StreamRequest("a", 12.0, chunk_frames=12), [], now=0.0) == Admission(
        accepted=True, reason=None, predicted_load=0.3125
    )


def test_admission_alone_refuses_over_the_device_target_with_the_compute_reason():
    control = gate(buffer_cap_s=3.0)  # a cap the start rule cannot reach: the compute rule alone
    refused = control.admit(StreamRequest("c", 12.0, chunk_frames=12), loads(2), now=0.0)
    assert refused == Admission(
        accepted=False,
        reason=(
            "compute: the device is 0.62 busy with 2 streams and this one needs 0.31 (1.00 chunks/s x 312.5 ms per "
            "chunk), 0.94 > target 0.90; try again when a stream closes"
        ),
        predicted_load=0.625,
    )
    assert control.admit(StreamRequest("c", 12.0, chunk_frames=12), loads(1), now=0.0).accepted


def test_admission_alone_passes_the_kv_pools_reason_through_and_closes_the_loop_after_lateness():
    control = gate()
    req = StreamRequest("b", 12.0, chunk_frames=12)
    late = Late(at=1.0, stream_id="a", what="chunk 3 encoded cheaper to meet its deadline")
    refused = control.admit(req, loads(1), now=1.5, late=late, kv_refusal="pool full")
    assert refused.reason == (
        "kv cache: pool full; closed loop: stream a was late 0.5 s ago (chunk 3 encoded cheaper to meet its deadline); "
        "admission reopens once every stream has been on time for 2 s"
    )
    assert control.closed(late, 2.9) and not control.closed(late, 3.0)
    assert control.admit(req, loads(1), now=3.0, late=late).accepted
    # with no stream admitted the closed loop keeps nobody on time: an empty server admits (issue 33)
    assert control.admit(req, [], now=1.5, late=late).accepted


def test_admission_alone_admits_a_burst_in_tranches_of_what_the_first_chunks_leave_room_for():
    # 16 fps, 5 forwards of 1/64 s a chunk: the first chunk plays 0.5625 s, and in that time at the 0.9 target the
    # device makes 0.5625 x 0.9 / 0.078125 = 6.48 more chunks: 7 streams start at once, the 8th waits.
    control = gate(initial_forward_s=1 / 64)
    req = StreamRequest("new", FPS)
    starting = loads(7, fps=FPS, delivered=0)
    assert control.admit(req, loads(6, fps=FPS, delivered=0), now=1.0).accepted
    refused = control.admit(req, starting, now=1.0)
    assert refused.reason == (
        "starting: 7 streams admitted in the last 1.0 s have not yet delivered 2 chunks, and the device starts 7 at "
        "once (78.1 ms per chunk, each stream's next chunk due within 0.56 s of its first, 0.00 busy with the "
        "others, target 0.90); try again in a second"
    )
    confirmed = loads(7, fps=FPS, delivered=2)  # the same streams, each with two chunks delivered: room confirmed
    admitted = control.admit(req, confirmed, now=1.0)
    assert admitted.accepted and admitted.predicted_load == pytest.approx(8 * 4 / 3 * 5 / 64)


def test_a_lone_first_frame_goes_out_with_the_second_chunk_and_the_tranche_counts_both():
    # chunks of one latent frame: a first chunk of 1 frame, then 4. The first delivery is chunks 0 and 1 (5 frames,
    # 0.3125 s at 16 fps), and each newcomer's costs two chunks of 5 forwards of 1/256 s: one first delivery and the
    # 0.9 target's share of that window, 0.9 x 0.3125 / 0.039 = 7.2 more: 8 streams start at once, the 9th waits.
    req = StreamRequest("new", FPS, first_chunk_frames=1, chunk_frames=4)
    assert req.first_delivery == (2, 5) and StreamRequest("d", FPS).first_delivery == (1, 9)
    control = gate(initial_forward_s=1 / 256)
    starting = [StreamLoad(StreamRequest(f"s{i}", FPS, first_chunk_frames=1, chunk_frames=4), chunks_delivered=0)
                for i in range(8)]
    assert control.admit(req, starting[:7], now=1.0).accepted
    refused = control.admit(req, starting, now=1.0)
    assert not refused.accepted and "the device starts 8 at once" in refused.reason
    assert "next chunk due within 0.31 s of its first" in refused.reason
