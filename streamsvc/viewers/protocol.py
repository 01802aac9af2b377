"""One viewer's side of the wire, as a state machine: events in, actions out (sans-I/O, as websockets' protocol).

The protocol decides what a viewer's message means where its connection stands; a driver does it. It holds no
socket, no engine and no clock: each event returns the actions to take, in order, and a test asserts them exactly.

States: ``new`` (nothing asked yet), ``admitting`` (a ``start`` or ``watch`` is being decided), ``steering`` or
``watching`` (admitted; its role can change with a handover or a take), ``closed`` (nothing more of it is read).

Events: a message that came (`receive`: text, or binary input video; `receive_on_channel`: text on a WebRTC
viewer's data channel, where only its stream's requests belong), `admitted` (with its role, and whether its
stream takes input from it), `refused` (it may ask again), `role` (a handover or a take moved the steer token),
`closed` (its stream ended, or it left).

Actions:

- `Send`: a message to the viewer (an error that answers what it sent).
- `Admit` / `Watch`: open a stream for its ``start``, or join one for its ``watch``; the driver answers `admitted`
  or `refused`.
- `Control`: a request of an admitted viewer (set_prompt, pause, resume, stats, record, handover, take,
  set_strength, offer, close): its stream carries it out (streamsvc/viewers/streams.py).
- `Input`: a binary message of the viewer that started a stream taking its input: a frame of its camera.
- `Violation`: it broke the protocol (already answered by a `Send`); the driver counts it, and past its limit
  closes the connection (streamsvc/door/guard.py).

Messages that come while a ``start`` or ``watch`` is decided wait (at most `MAX_HELD` of them; past it each is a
violation) and come out, in order, with `admitted`'s actions.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from streamsvc.wire import protocol as P

MAX_HELD = 16  # messages held while a start or watch is decided


class State(enum.Enum):
    NEW = "new"
    ADMITTING = "admitting"
    STEERING = "steering"
    WATCHING = "watching"
    CLOSED = "closed"


@dataclass(frozen=True)
class Send:
    message: P.Error


@dataclass(frozen=True)
class Admit:
    start: P.Start


@dataclass(frozen=True)
class Watch:
    watch: P.Watch


@dataclass(frozen=True)
class Control:
    message: object  # a parsed client message other than start and watch


@dataclass(frozen=True)
class Input:
    data: bytes


@dataclass(frozen=True)
class Violation:
    pass


Action = Send | Admit | Watch | Control | Input | Violation


class ViewerProtocol:
    """One connection's viewer (see the module docstring)."""

    def __init__(self) -> None:
        self.state = State.NEW
        self.stream_id: str | None = None  # the stream it was admitted to
        self.takes_input = False  # it started a stream that takes its input video: its binary messages are frames
        self._held: list = []  # what came while admitting (text, binary, or a message that came parsed)

    @classmethod
    def on_channel(cls, stream_id: str) -> ViewerProtocol:
        """The protocol of an admitted WebRTC viewer's data channel, for `receive_on_channel` (which of its requests
        its role allows is its stream's to decide: a watcher's and a steerer's channel are the same here)."""
        protocol = cls()
        protocol.admitted(stream_id, steers=False)
        return protocol

    def receive(self, data: str | bytes) -> list[Action]:
        """A message came (text or binary)."""
        if self.state is State.CLOSED:
            return []
        if self.state is State.ADMITTING:
            return self._hold(data)
        if isinstance(data, bytes) and self.takes_input:  # (a steerer's that handed the token on: still its camera)
            return [Input(data)]
        try:
            msg = P.parse_client(data)
        except P.ProtocolError as e:
            return [Send(e.to_message()), Violation()]
        return self.receive_message(msg)

    def receive_message(self, msg) -> list[Action]:
        """A message that came parsed: a client message made by a door that speaks another protocol (a WHEP POST's
        start and offer), or one `receive` parsed."""
        if self.state is State.CLOSED:
            return []
        if self.state is State.ADMITTING:
            return self._hold(msg)
        if isinstance(msg, (P.Start, P.Watch)):
            if self.state is not State.NEW:
                doing = "steers" if self.state is State.STEERING else "watches"
                return [Send(P.Error(code=P.ErrorCode.ALREADY_STARTED, message=(
                    f"this connection already {doing} stream {self.stream_id}; open another connection for another "
                    "stream"))), Violation()]
            self.state = State.ADMITTING
            return [Admit(msg) if isinstance(msg, P.Start) else Watch(msg)]
        if self.state is State.NEW:
            return [Send(P.Error(code=P.ErrorCode.NOT_STARTED, message=f"send 'start' or 'watch' before '{msg.type}'")),
                    Violation()]
        return [Control(msg)]

    def receive_on_channel(self, text: str) -> list[Action]:
        """A message on an admitted WebRTC viewer's data channel: its stream's requests only (a start, a watch or an
        offer belongs on the WebSocket that signals the peer connection)."""
        if self.state not in (State.STEERING, State.WATCHING):
            return []
        try:
            msg = P.parse_client(text)
        except P.ProtocolError as e:
            return [Send(e.to_message()), Violation()]
        if isinstance(msg, (P.Start, P.Watch, P.Offer)):
            return [Send(P.Error(code=P.ErrorCode.INVALID_FIELD,
                                 message=f"send '{msg.type}' on the WebSocket, not on the data channel")), Violation()]
        return [Control(msg)]

    def admitted(self, stream_id: str, steers: bool, takes_input: bool = False) -> list[Action]:
        """Its start or watch was admitted to `stream_id` (it steers, or watches); what came meanwhile, as if it came
        now."""
        self.state = State.STEERING if steers else State.WATCHING
        self.stream_id, self.takes_input = stream_id, steers and takes_input
        return self._replay()

    def refused(self) -> list[Action]:
        """Its start or watch was refused (the refusal went out): it may ask again."""
        self.state = State.NEW
        return self._replay()

    def role(self, steers: bool) -> None:
        """The steer token moved (a handover or a take): it steers now, or watches."""
        if self.state in (State.STEERING, State.WATCHING):
            self.state = State.STEERING if steers else State.WATCHING

    def closed(self) -> None:
        """Its stream ended or it left: nothing more of it is read."""
        self.state = State.CLOSED
        self._held.clear()

    def _hold(self, item) -> list[Action]:
        if len(self._held) >= MAX_HELD:
            return [Send(P.Error(code=P.ErrorCode.RATE_LIMITED, message=(
                f"more than {MAX_HELD} messages before the answer to start or watch: dropped"))), Violation()]
        self._held.append(item)
        return []

    def _replay(self) -> list[Action]:
        held, self._held = self._held, []
        return [action for data in held for action in (
            self.receive(data) if isinstance(data, (str, bytes)) else self.receive_message(data))]
