"""One stream's life on the event loop: an explicit state machine, its prompt versions and its outbox."""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field

from streamsvc import protocol as P
from streamsvc.access import TokenBucket


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


class PromptGate:
    """Coalesces a stream's prompts, so that a flood of them costs one recache per chunk at most.

    A prompt goes to the engine at once when none went since the stream's last chunk; otherwise it
    waits for the next chunk, and a newer one replaces it: of the prompts that arrive between two
    chunks only the newest is recached. Every set_prompt is answered, in the order of the requests
    (clients pair replies with their prompts by order): a prompt that waited, or was replaced while
    waiting, is acked with the version of the prompt that went to the engine in its place, and the
    replies to later set_prompts (a rate-limit error) wait behind that ack.
    """

    def __init__(self) -> None:
        self.waiting: str | None = None  # the prompt for the engine at the next chunk
        self._sent_since_chunk = False
        self._held: list[P.Error | None] = []  # replies owed until `waiting` has its version; None: its ack

    def submit(self, prompt: str) -> bool:
        """True: send ``prompt`` to the engine now. False: it waits for the next chunk."""
        if not self._sent_since_chunk and self.waiting is None:
            self._sent_since_chunk = True
            return True
        self.waiting = prompt
        self._held.append(None)
        return False

    def refuse(self, error: P.Error) -> list[P.Error]:
        """A set_prompt answered by ``error``: what to send now (nothing while an earlier ack is owed)."""
        if self.waiting is None:
            return [error]
        self._held.append(error)
        return []

    def chunk_done(self) -> str | None:
        """The stream finished a chunk: the waiting prompt, to send to the engine now, or None."""
        prompt, self.waiting = self.waiting, None
        self._sent_since_chunk = prompt is not None
        return prompt

    def answered(self, reply: P.Ack | P.Error) -> list[P.Ack | P.Error]:
        """Every reply held behind the prompt ``chunk_done`` gave, in request order, now that the engine
        answered it with ``reply`` (its ack, or the error that failed it)."""
        held, self._held = self._held, []
        return [reply if r is None else r for r in held]


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
    token: str | None = None  # the access token it was opened with (its stream counts against the token's limit)
    address: str = ""  # the client address its stream counts against
    control_rate: TokenBucket | None = None  # control messages it may still send (stats apart)
    stats_rate: TokenBucket | None = None  # stats messages it may still send
    prompts: PromptGate = field(default_factory=PromptGate)
    # held while a set_prompt is decided and answered, so replies keep the order of the requests
    steering: asyncio.Lock = field(default_factory=asyncio.Lock)
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
