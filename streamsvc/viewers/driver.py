"""One viewer's protocol carried out against the server, whatever carries the viewer's messages.

A door hands each message of a viewer to `ViewerDriver.receive` (a WebSocket's, or the ones a gateway relays to a
cluster replica; `receive_message` for one that came parsed, as a WHEP POST's start and offer) and gives an `Outlet`
(streamsvc/transport/ws.py) for what goes back. The driver runs the viewer's `ViewerProtocol`
(streamsvc/viewers/protocol.py) and carries out its actions in order: the server admits the viewer or refuses it
(`ViewerHost.admit`), its stream carries out its requests (streamsvc/viewers/streams.py), its input video is decoded
(streamsvc/inputs/ws.py), its outbox goes out on the outlet. The door calls `close` when nothing more comes: the
viewer leaves its stream, and its last messages (`closed`) go out.

Its `ConnectionGuard` (streamsvc/door/guard.py), where the door has one, bounds what comes before a start or
watch and the viewer's protocol errors, and closes an outlet whose viewer does not read.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterable
from typing import Protocol

from streamsvc.door.cpumeter import CpuMeter
from streamsvc.door.entry import Client, Refused
from streamsvc.door.front import ConnectionClosed
from streamsvc.door.guard import ConnectionGuard
from streamsvc.inputs.ws import Upstream, allow_input
from streamsvc.metrics import Metrics
from streamsvc.transport.ws import Outlet, send_outbox
from streamsvc.viewers.protocol import Admit, Input, Send, State, Violation, ViewerProtocol, Watch
from streamsvc.viewers.session import Role, Viewer
from streamsvc.viewers.streams import Streams
from streamsvc.wire import protocol as P

SENDER_GRACE_S = 2.0  # a viewer's last messages may take this long to go out once it left


class ViewerHost(Protocol):
    """What a driver asks of the server (streamsvc/viewers/server.py)."""

    streams: Streams
    metrics: Metrics
    streamless: CpuMeter  # the event loop's CPU on viewers without a stream

    async def admit(self, client: Client, msg: P.Start | P.Watch, outlet: Outlet) -> Viewer | Refused:
        """Open a stream for a start, or join one for a watch: the viewer (its `ready` first in its outbox), or the
        refusal."""
        ...

    def chunk_sent(self, viewer: Viewer) -> None:
        """A chunk of `viewer`'s went to its transport."""
        ...

    async def disconnect(self, viewer: Viewer) -> None:
        """`viewer` is done and its outbox sent: its WebRTC peer connection, if any, closes."""
        ...


class ViewerDriver:
    """One viewer's connection, whatever carries it (see the module docstring)."""

    def __init__(self, host: ViewerHost, client: Client, outlet: Outlet, guard: ConnectionGuard | None = None) -> None:
        self.host = host
        self.client = client
        self.outlet = outlet
        self.guard = guard
        self.protocol = ViewerProtocol()
        self.viewer: Viewer | None = None  # once a start or watch is admitted
        self.refusal: P.Error | None = None  # the last start or watch refused
        self._upstream: Upstream | None = None  # its input video, if it steers a stream that takes it from it
        self._sender: asyncio.Task | None = None

    @property
    def streamless(self) -> bool:
        """Whether it has no stream yet (its CPU is no stream's)."""
        return self.viewer is None

    @property
    def closed(self) -> bool:
        """Nothing more of it is read: its stream ended, it left, or it broke the protocol once too often."""
        return self.protocol.state is State.CLOSED or self.viewer is not None and self.viewer.closed

    async def receive(self, data: str | bytes) -> bool:
        """A message of the viewer's, text or binary; False once nothing more of it is read."""
        if not self._arrived():
            return False
        await self._carry_out(self.protocol.receive(data))
        return not self.closed

    async def receive_message(self, msg) -> bool:
        """A message of the viewer's that came parsed (a door of another protocol made it); as `receive`."""
        if not self._arrived():
            return False
        await self._carry_out(self.protocol.receive_message(msg))
        return not self.closed

    async def serve(self, messages: AsyncIterable[str | bytes]) -> None:
        """Each of `messages` (the viewer's, in order) to `receive` until they end, the connection closes or nothing
        more of them is read (its stream ended, or it left: its sender closes the outlet); then `close`."""
        try:
            async for data in messages:
                if not await self.receive(data):
                    break
        except ConnectionClosed:
            pass
        finally:
            await self.close()

    async def close(self, reason: str = "client disconnected") -> None:
        """Nothing more comes from the viewer: it leaves its stream, its last messages go out, its guard is done."""
        if self.viewer is not None:
            await self.host.streams.leave(self.viewer, reason)
        if self._upstream is not None:  # its input decoder goes with the connection
            self._upstream.close()
        if self._sender is not None:  # its last messages (`closed`), then the outlet closes (guard.ended)
            with contextlib.suppress(asyncio.TimeoutError, ConnectionClosed):
                await asyncio.wait_for(self._sender, timeout=SENDER_GRACE_S)
            self._sender.cancel()
        if self.guard is not None:
            await self.guard.done()  # a close under way finishes

    def _arrived(self) -> bool:
        """A message came: whether it is read."""
        if self.closed:
            return False
        if self.viewer is None:
            self.host.streamless.event()  # a junk flood's parsing is mostly the front's: counted, if not timed
            return self.guard is None or self.guard.message()
        self.protocol.role(self.viewer.role is Role.STEER)  # (a handover or a take moves the steer token)
        return True

    async def _carry_out(self, actions: list) -> None:
        pending = deque(actions)
        while pending and self.protocol.state is not State.CLOSED:
            action = pending.popleft()
            if isinstance(action, Send):
                if self.viewer is not None:
                    self.viewer.send(action.message)
                else:
                    await self.outlet.send(action.message)
            elif isinstance(action, Violation):
                self.host.metrics.errors.inc()
                if self.guard is not None and not self.guard.protocol_error():
                    self.protocol.closed()
            elif isinstance(action, Input):
                try:
                    await self._upstream.receive(action.data)  # input video: decoded into its stream's input
                except P.ProtocolError:  # it broke the framing (answered): a protocol error
                    pending.appendleft(Violation())
            elif isinstance(action, (Admit, Watch)):
                pending.extend(await self._admit(action.start if isinstance(action, Admit) else action.watch))
            else:  # Control: a request of its stream
                await self.host.streams.control(self.viewer, action.message)
                if self.viewer.closed:
                    self.protocol.closed()

    async def _admit(self, msg: P.Start | P.Watch) -> list:
        """The server's answer to a start or watch; the protocol's actions that follow it."""
        admitted = await self.host.admit(self.client, msg, self.outlet)
        if isinstance(admitted, Refused):
            self.refusal = admitted.error
            with contextlib.suppress(ConnectionClosed):
                await admitted.send(self.outlet)
            return self.protocol.refused()
        viewer = self.viewer = admitted
        self._upstream = Upstream.for_viewer(viewer)
        if self._upstream is not None:  # before its ready goes out: its input messages may be larger than control ones
            allow_input(self.outlet)
        if self.guard is not None:
            self.guard.started()
            viewer.outbox.on_overflow(self.guard.backlogged)  # a client that does not read is closed
        self._sender = asyncio.create_task(self._send(), name=f"send-{viewer.viewer_id}")
        return self.protocol.admitted(viewer.stream_id, viewer.role is Role.STEER,
                                      takes_input=self._upstream is not None)

    async def _send(self) -> None:
        """Sends the viewer's outbox; once it ends (the viewer is done), its WebRTC peer connection closes, then its
        outlet (nothing more it sends is read)."""
        viewer = self.viewer
        try:
            await send_outbox(self.outlet, viewer, lambda: self.host.chunk_sent(viewer))
        finally:
            await self.host.disconnect(viewer)
            reason = viewer.session.close_reason or "left the stream"
            if self.guard is not None:
                self.guard.ended(reason)
            else:
                with contextlib.suppress(ConnectionClosed):
                    await self.outlet.close(1000, reason, linger=False)
