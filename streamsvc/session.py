"""One stream's life on the event loop: an explicit state machine, its prompt versions and its outbox."""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field


class SessionState(enum.Enum):
    STARTING = "starting"  # admitted, no chunk delivered yet
    PLAYING = "playing"  # chunks arrive before the viewer's buffer runs dry
    STALLED = "stalled"  # the viewer's buffer ran dry
    PAUSED = "paused"  # the viewer paused; generation stops once the buffer is full
    CLOSED = "closed"  # ended: KV cache freed, no more messages


_ALLOWED = {
    SessionState.STARTING: {SessionState.PLAYING, SessionState.PAUSED, SessionState.CLOSED},
    SessionState.PLAYING: {SessionState.STALLED, SessionState.PAUSED, SessionState.CLOSED},
    SessionState.STALLED: {SessionState.PLAYING, SessionState.PAUSED, SessionState.CLOSED},
    SessionState.PAUSED: {SessionState.PLAYING, SessionState.STARTING, SessionState.CLOSED},
    SessionState.CLOSED: set(),
}


class InvalidState(RuntimeError):
    """A transition the state machine does not allow; the message says the state."""


@dataclass
class Session:
    """A stream as the server sees it. Transports read `outbox`; the engine feeds it."""

    stream_id: str
    fps: int
    prompt: str
    created_at: float = field(default_factory=time.monotonic)
    state: SessionState = SessionState.STARTING
    prompt_version: int = 0  # newest version acknowledged to the client
    chunks_sent: int = 0
    first_chunk_at: float | None = None
    close_reason: str | None = None
    client_stalls: int = 0  # stalls the client has reported (stats messages)
    # messages for the transport, in order: bytes (binary chunk), a protocol model, or None (end)
    outbox: asyncio.Queue = field(default_factory=asyncio.Queue)
    _paused_from: SessionState = SessionState.PLAYING

    def transition(self, new: SessionState) -> None:
        if new is self.state:
            return
        if new not in _ALLOWED[self.state]:
            raise InvalidState(f"session {self.stream_id} is {self.state.value}; it cannot become {new.value}")
        if new is SessionState.PAUSED:
            self._paused_from = self.state
        self.state = new

    @property
    def closed(self) -> bool:
        return self.state is SessionState.CLOSED

    def pause(self) -> None:
        self.transition(SessionState.PAUSED)

    def resume(self) -> None:
        if self.state is SessionState.PAUSED:
            self.transition(SessionState.PLAYING if self._paused_from is not SessionState.STARTING else SessionState.STARTING)

    def delivered(self, now: float) -> None:
        """A chunk went out to the transport."""
        self.chunks_sent += 1
        if self.first_chunk_at is None:
            self.first_chunk_at = now
        if self.state in (SessionState.STARTING, SessionState.STALLED):
            self.transition(SessionState.PLAYING)

    def buffer_report(self, buffered_s: float) -> None:
        """The engine's model (or the client) says how much the viewer has buffered."""
        if self.state is SessionState.PLAYING and buffered_s <= 0:
            self.transition(SessionState.STALLED)
        elif self.state is SessionState.STALLED and buffered_s > 0:
            self.transition(SessionState.PLAYING)

    def close(self, reason: str) -> bool:
        """Returns False if it was already closed."""
        if self.closed:
            return False
        self.close_reason = reason
        self.transition(SessionState.CLOSED)
        return True

    @property
    def ttff_s(self) -> float | None:
        return None if self.first_chunk_at is None else self.first_chunk_at - self.created_at
