"""A viewer's outbox (issue 41, item 4): bounded in items and bytes (its connection's unsent bytes counted), an
overflow that drops everything and says why once, and error replies at a rate of their own. Exact values, a manual
clock, no sockets."""

import asyncio
from types import SimpleNamespace

import pytest

from streamsvc.door.access import Rate
from streamsvc.viewers.outbox import MESSAGE_BYTES, Outbox, OutboxLimits
from streamsvc.wire import protocol as P
from tests.clock import ManualClock


def chunk(size: int):
    return SimpleNamespace(payload=bytes(size))


def error(k: int = 0) -> P.Error:
    return P.Error(code=P.ErrorCode.BAD_CHUNK, message=f"bad {k}")


def drain(outbox: Outbox) -> list:
    return [outbox.get_nowait() for _ in range(outbox.qsize())]


def test_items_past_the_bound_overflow_it_once_and_it_keeps_only_its_end():
    reasons = []
    outbox = Outbox(OutboxLimits(max_items=3, max_bytes=1 << 20))
    outbox.on_overflow(reasons.append)
    assert all(outbox.put_nowait(chunk(100)) for _ in range(3)) and outbox.bytes == 300
    assert not outbox.put_nowait(P.Ack(request="pause"))  # the fourth
    assert reasons == ["slow client: 4 messages, 812 bytes unsent (limits 3, 1048576 bytes)"]
    assert outbox.overflowed == reasons[0] and outbox.bytes == 0
    assert not outbox.put_nowait(chunk(1)) and not outbox.put_nowait(P.Closed(reason="x"))
    outbox.put_nowait(None)
    assert drain(outbox) == [None] and reasons == reasons[:1]  # its sender stops; told once
    late = []
    outbox.on_overflow(late.append)  # a callback set after the overflow hears of it at once
    assert late == reasons


def test_bytes_count_what_the_connection_holds_unsent_and_one_item_is_always_taken_when_nothing_waits():
    unsent = [0]
    limits = OutboxLimits(max_items=64, max_bytes=1000)
    outbox = Outbox(limits, below=lambda: unsent[0])
    assert outbox.put_nowait(chunk(5000))  # larger than the bound, but nothing waits: a viewer that reads gets it
    assert outbox.get_nowait().payload == bytes(5000) and outbox.empty()
    assert outbox.put_nowait(chunk(600)) and not outbox.put_nowait(P.Ack(request="pause"))  # 600 + 512 > 1000
    assert outbox.overflowed == "slow client: 2 messages, 1112 bytes unsent (limits 64, 1000 bytes)"
    outbox = Outbox(limits, below=lambda: unsent[0])
    assert outbox.put_nowait(chunk(400)) and outbox.put_nowait(chunk(400)) and outbox.overflowed is None
    drain(outbox)
    unsent[0] = 700  # its socket's buffer holds this much: the outbox is empty, yet the next chunk is too much
    assert not outbox.put_nowait(chunk(400))
    assert outbox.overflowed == "slow client: 1 messages, 1100 bytes unsent (limits 64, 1000 bytes)"


def test_a_viewer_whose_oldest_item_waited_past_the_bound_overflows():
    clock = ManualClock()
    outbox = Outbox(OutboxLimits(max_wait_s=15.0), clock)
    assert outbox.put_nowait(chunk(10))
    clock.now += 10.0
    assert outbox.put_nowait(chunk(10))
    outbox.get_nowait()  # the sender took the first: the oldest is now 10 s old
    clock.now += 6.0
    assert outbox.put_nowait(chunk(10))
    clock.now += 9.5
    assert not outbox.put_nowait(chunk(10))
    assert outbox.overflowed == "slow client: 3 messages unsent, the oldest for 15.5 s (limit 15 s)"


def test_a_message_counts_message_bytes():
    outbox = Outbox(OutboxLimits(max_items=64, max_bytes=3 * MESSAGE_BYTES))
    assert all(outbox.put_nowait(P.Ack(request="pause")) for _ in range(3)) and outbox.overflowed is None
    assert not outbox.put_nowait(P.Ack(request="pause")) and outbox.overflowed is not None


def test_error_replies_are_rate_limited_and_a_summary_precedes_the_next_one():
    clock, dropped = ManualClock(), []
    outbox = Outbox(OutboxLimits(error_replies=Rate(2.0, 3)), clock, on_dropped=lambda: dropped.append(1))
    sent = [outbox.put_nowait(error(k)) for k in range(50)]
    assert sent == [True] * 3 + [False] * 47 and len(dropped) == 47 and outbox.errors_dropped == 47
    assert outbox.put_nowait(P.Ack(request="pause"))  # anything else goes on
    clock.now += 0.5  # one more error reply due
    assert outbox.put_nowait(error(50)) and not outbox.put_nowait(error(51))
    out = drain(outbox)
    assert [m.message for m in out[:3]] == ["bad 0", "bad 1", "bad 2"] and isinstance(out[3], P.Ack)
    summary, last = out[4:]
    assert summary.code is P.ErrorCode.RATE_LIMITED and summary.message.startswith("47 error replies were not sent")
    assert "at most 2 a second (bursts of 3)" in summary.message and last.message == "bad 50"
    assert outbox.errors_dropped == 1


async def test_get_waits_for_an_item():
    outbox = Outbox()
    getter = asyncio.ensure_future(outbox.get())
    await asyncio.sleep(0)
    assert not getter.done()
    outbox.put_nowait(P.Ack(request="pause"))
    assert isinstance(await asyncio.wait_for(getter, 1), P.Ack)


def test_limits_are_checked():
    with pytest.raises(ValueError, match="give at least 1 item"):
        OutboxLimits(max_items=0)
    with pytest.raises(ValueError, match="max_wait_s=0"):
        OutboxLimits(max_wait_s=0)
