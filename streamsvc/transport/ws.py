"""The WebSocket transport: a viewer's outbox (streamsvc/viewers/outbox.py) sent on its connection, in order.

Chunks go as binary messages (the framing of ``protocol.pack_chunk``, built once per chunk by the output stage),
messages as JSON text. A WebRTC viewer's chunks go to its track instead (``WebRtcTransport.feed``: the track paces
them) and its messages on its data channel once that is open; the WebSocket still carries its signaling. The
outbox's None ends it. A send blocks while the connection's buffers are full: the outbox fills behind it, up to its
bound (then the connection is closed as a slow client, streamsvc/door/guard.py).
"""

from __future__ import annotations

from collections.abc import Callable

from streamsvc.door.front import Connection, ConnectionClosed
from streamsvc.engine.output import ChunkOut
from streamsvc.wire import protocol as P


async def send_outbox(ws: Connection, viewer, on_chunk: Callable[[], None]) -> None:
    """Send `viewer`'s outbox (a session.Viewer's) on `ws` until its None, or until `ws` closes; `on_chunk()` after
    each chunk handed over."""
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
                    await ws.send(item.payload)
                on_chunk()
            elif rtc is None or not rtc.send_control(item):
                await ws.send(P.encode(item))
        except ConnectionClosed:
            return
