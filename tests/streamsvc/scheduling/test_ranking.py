"""The ranking: exact orderings of the policies and the stall guard for hand-built states."""

from __future__ import annotations

from tests.streamsvc.scheduling.helpers import CHUNK_WORK, PLAIN, Clock, admit, make


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
