"""What a viewer's messages and chunks go out on (an `Outlet`), and its outbox (streamsvc/viewers/outbox.py) sent
on it, in order.

An outlet is a viewer's WebSocket (`WebSocketOutlet`), or what takes its place where the viewer is reached another
way: a cluster replica's call back to the gateway that holds the viewer's socket (streamsvc/cluster/replica.py), a
WHEP session, whose player has its media and its data channel and reads no messages (streamsvc/door/whep.py).

Chunks go as binary messages (the framing of ``protocol.pack_chunk``, built once per chunk by the output stage),
messages as JSON text. A WebRTC viewer's chunks go to its track instead (``WebRtcTransport.feed``: the track paces
them) and its messages on its data channel once that is open; the outlet still carries its signaling. The
outbox's None ends it. A send blocks while the connection's buffers are full: the outbox fills behind it, up to its
bound (then the connection is closed as a slow client, streamsvc/door/guard.py).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Protocol

from streamsvc.door.front import Connection, ConnectionClosed
from streamsvc.engine.output import ChunkOut
from streamsvc.wire import protocol as P


class Outlet(Protocol):
    """Where what the server says to one viewer goes. Its sends raise ConnectionClosed once it is closed."""

    async def send(self, message) -> None:
        """One message of the protocol (a model of streamsvc/wire/protocol.py)."""
        ...

    async def send_chunk(self, payload: bytes) -> None:
        """One chunk, framed (``protocol.pack_chunk``)."""
        ...

    async def close(self, code: int = 1000, reason: str = "", linger: bool = True) -> None:
        """Nothing more goes out, nor is read (front.Connection.close's meaning of `linger`)."""
        ...

    def allow_messages(self, max_bytes: int) -> bool:
        """The viewer's messages may be up to `max_bytes` from now (a stream with input video); False: they may not."""
        ...

    def buffered(self) -> int:
        """Bytes written below the outbox and not yet sent: counted in its bound."""
        ...


class WebSocketOutlet:
    """A viewer's WebSocket (a door.front.Connection) as its outlet: messages as JSON text, chunks binary. `closing`
    runs its close (the server meters it: closing a flood's socket reads, and parses, what the peer still sends
    until its close frame)."""

    def __init__(self, ws: Connection,
                 closing: Callable[[Coroutine[Any, Any, None]], Awaitable[None]] | None = None) -> None:
        self.ws = ws
        self._closing = closing

    async def send(self, message) -> None:
        await self.ws.send(P.encode(message))

    async def send_chunk(self, payload: bytes) -> None:
        await self.ws.send(payload)

    async def close(self, code: int = 1000, reason: str = "", linger: bool = True) -> None:
        closing = self.ws.close(code, reason, linger=linger)
        await (closing if self._closing is None else self._closing(closing))

    def allow_messages(self, max_bytes: int) -> bool:
        return self.ws.allow_messages(max_bytes)

    def buffered(self) -> int:
        return self.ws.buffered()


async def send_outbox(outlet: Outlet, viewer, on_chunk: Callable[[], None]) -> None:
    """Send `viewer`'s outbox (a session.Viewer's) on `outlet` until its None, or until `outlet` closes; `on_chunk()`
    after each chunk handed over."""
    rtc = viewer.rtc
    while True:
        item = await viewer.outbox.get()
        if item is None:
            return
        try:
            if isinstance(item, ChunkOut):
                if rtc is not None:
                    rtc.feed(item)  # the track sends its frames (and the header) at the stream's pace
                else:
                    await outlet.send_chunk(item.payload)
                on_chunk()
            elif rtc is None or not rtc.send_control(item):
                await outlet.send(item)
        except ConnectionClosed:
            return
