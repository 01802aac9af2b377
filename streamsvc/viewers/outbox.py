"""A viewer's outbox (issue 41): the chunks and messages the server has for one connection and has not sent yet,
bounded.

Each viewer's chunks and messages wait here for its sender (streamsvc/transport/ws.py). A viewer that reads holds a
chunk or two here at most (one that joins mid-stream: the chunks from a keyframe on, session.GOP_CHUNKS at most). A
client that does not read, or cannot (a link slower than its stream), lets them pile up once its socket's buffers
are full. Past `OutboxLimits` (items; bytes, with what the connection itself holds unsent: `below`; or its oldest
item's wait, `max_wait_s`: a viewer that far behind is not watching live) the outbox overflows: it drops what it
holds, takes nothing more but its end (None), and calls its `on_overflow(reason)`, which closes the connection (1008,
counted as a `slow_client` close: streamsvc/door/guard.py). An item is always taken when nothing waits, here or in the
connection, so a chunk larger than the byte bound still reaches a viewer that reads.

Error replies are bounded apart (`OutboxLimits.error_replies`, a token bucket): a client that sends junk, or control
messages over its rate, as fast as it can gets at most so many `error` messages a second; the rest are dropped and
counted (`on_dropped`), and the next one sent is preceded by one `rate_limited` error that says how many were not.
(Its bad messages still count as protocol errors, which close the connection: streamsvc/door/guard.py.)

Pure logic but for the sender's wait (`get`): no sockets; the caller passes the clock.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from streamsvc.door.access import Rate, TokenBucket
from streamsvc.wire import protocol as P

MESSAGE_BYTES = 512  # what a message (not a chunk) counts against the byte bound: a JSON line, most far smaller


@dataclass(frozen=True)
class OutboxLimits:
    """What one viewer's outbox may hold before its connection is closed, and how fast it gets error replies."""

    # chunks and messages waiting (a viewer that reads: a few; one that joins: GOP_CHUNKS at once; a burst of replies
    # before its sender runs: a control message's burst and error_replies' at most)
    max_items: int = 1024
    max_bytes: int = 8 << 20  # their bytes (a chunk's payload, MESSAGE_BYTES a message) and its connection's unsent
    max_wait_s: float = 15.0  # how long the oldest may wait: a viewer further behind is not watching live
    # `error` messages a second, and a burst (a client that sends a burst of prompts over their rate still gets a
    # reply to each, in order: streamsvc/viewers/streams.py); more are dropped and counted
    error_replies: Rate = Rate(10.0, 50)

    def __post_init__(self) -> None:
        if self.max_items < 1 or self.max_bytes < 1 or not self.max_wait_s > 0:
            raise ValueError(f"max_items={self.max_items}, max_bytes={self.max_bytes}, max_wait_s={self.max_wait_s}: "
                             "give at least 1 item, 1 byte and a wait > 0")


def size_of(item) -> int:
    """What an item counts against the byte bound: a chunk (a `ChunkOut`) its payload, a message MESSAGE_BYTES."""
    payload = getattr(item, "payload", None)
    return len(payload) if isinstance(payload, (bytes, bytearray)) else MESSAGE_BYTES


class Outbox:
    """A viewer's chunks and messages in order, for one consumer (its sender): `put_nowait` (False: dropped),
    `get` (None: the end), `qsize`/`empty`/`get_nowait` as an asyncio.Queue's. See the module's doc."""

    def __init__(self, limits: OutboxLimits = OutboxLimits(), clock: Callable[[], float] = time.monotonic,
                 below: Callable[[], int] = lambda: 0, on_dropped: Callable[[], None] = lambda: None) -> None:
        self.limits = limits
        self._clock = clock  # the error replies' rate's time
        self._below = below  # bytes its connection holds written and unsent (above the kernel), counted in the bound
        self._on_dropped = on_dropped  # an error reply dropped (to count it)
        self._on_overflow: Callable[[str], None] = lambda reason: None
        self._items: deque[tuple[object, int, float]] = deque()  # (item, its size, when it came)
        self._bytes = 0
        self._ready = asyncio.Event()
        self._errors = TokenBucket(limits.error_replies, clock())
        self.errors_dropped = 0  # error replies dropped since the last one sent
        self.overflowed: str | None = None  # why it overflowed, once it has: it takes nothing more

    def on_overflow(self, callback: Callable[[str], None]) -> None:
        """Call `callback(reason)` when the outbox overflows (at once if it has already)."""
        self._on_overflow = callback
        if self.overflowed is not None:
            callback(self.overflowed)

    def put_nowait(self, item) -> bool:
        """Queue a chunk or a message (None: the end). False: dropped (an error reply over the rate, or anything
        once the outbox has overflowed, which this item may be what makes it)."""
        if item is None:
            if self.overflowed is None:
                self._append(None, 0)
            return True
        if self.overflowed is not None:
            return False
        if isinstance(item, P.Error) and not self._error_allowed():
            return False
        return self._admit(item)

    def _error_allowed(self) -> bool:
        """Whether an error reply goes out; the one that does after some were dropped has their summary before it."""
        if not self._errors.take(self._clock()):
            self.errors_dropped += 1
            self._on_dropped()
            return False
        if self.errors_dropped:
            rate, dropped = self.limits.error_replies, self.errors_dropped
            self.errors_dropped = 0
            return self._admit(P.Error(code=P.ErrorCode.RATE_LIMITED, message=(
                f"{dropped} error replies were not sent: this connection gets at most {rate.per_s:g} a second "
                f"(bursts of {rate.burst}); its messages still count as errors")))
        return True

    def _admit(self, item) -> bool:
        size, now = size_of(item), self._clock()
        over = self._over(size, now)
        if over is not None:
            self._overflow(over)
            return False
        self._append(item, size, now)
        return True

    def _over(self, size: int, now: float) -> str | None:
        """Why taking an item of `size` at `now` would pass the bounds; None while nothing waits, here or below."""
        below, limits = self._below(), self.limits
        if not (self._items or below):
            return None
        count, total = len(self._items) + 1, self._bytes + size + below
        if count > limits.max_items or total > limits.max_bytes:
            return (f"slow client: {count} messages, {total} bytes unsent (limits {limits.max_items}, "
                    f"{limits.max_bytes} bytes)")
        if self._items and now - self._items[0][2] > limits.max_wait_s:
            return (f"slow client: {count} messages unsent, the oldest for {now - self._items[0][2]:.1f} s "
                    f"(limit {limits.max_wait_s:g} s)")
        return None

    def _append(self, item, size: int, now: float = 0.0) -> None:
        self._items.append((item, size, now))
        self._bytes += size
        self._ready.set()

    def _overflow(self, reason: str) -> None:
        self.overflowed = reason
        self._items.clear()
        self._bytes = 0
        self._append(None, 0)  # its sender stops after what it is sending now
        self._on_overflow(self.overflowed)

    async def get(self):
        """The next item, waiting for one."""
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        return self.get_nowait()

    def get_nowait(self):
        if not self._items:
            raise asyncio.QueueEmpty
        item, size, _ = self._items.popleft()
        self._bytes -= size
        return item

    def qsize(self) -> int:
        return len(self._items)

    def empty(self) -> bool:
        return not self._items

    @property
    def bytes(self) -> int:
        """Bytes waiting (chunks' payloads, MESSAGE_BYTES a message)."""
        return self._bytes
