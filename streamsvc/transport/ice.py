"""Bounds on what a WebRTC peer's ICE makes the server hold: peer-reflexive candidates below aiortc, in aioice.

An offer's candidates are checked and capped before aiortc sees them (streamsvc/transport/sdp.py, at most
``WebRtcConfig.max_remote_candidates``). aioice learns candidates another way too: each authenticated STUN check
from an address it does not know becomes a peer-reflexive ("prflx") remote candidate (RFC 8445 section 7.3.1.3), with
a candidate pair, a check of its own (a task, STUN retransmissions) and a line in aioice's log. A peer that knows its
session's ICE password (every peer does: it is in the answer) can send checks from as many source ports as it likes,
each one more candidate, pair and check the server keeps for the session's life.

``PeerReflexiveCap.install(connection)`` bounds one aioice ``Connection`` (one peer connection's ICE agent, ours
only): it wraps that instance's ``check_incoming`` (called for an authenticated check, after aioice has answered it)
so that a check from an unknown address is dropped once the connection holds ``cap`` peer-reflexive candidates; a
check from a known address (signalled, or learned within the cap) goes on as aioice would have it. Each drop calls
``on_dropped(addr)``. ``ice_connections(pc)`` finds the agents of a peer connection (aiortc's ``RTCIceTransport``
keeps each).

What this uses of aioice (``_HOOKS``, and ``Candidate.type``, ``.port``, ``._network_host``) is aioice 0.13's
(aiortc 1.16's); ``install`` returns False (the prflx candidates are then unbounded, a warning says so) if a later
aioice lacks it, and ``tests/streamsvc/test_ice.py`` fails loudly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

log = logging.getLogger("streamsvc.webrtc")

_HOOKS = ("check_incoming", "_remote_candidates")


class PeerReflexiveCap:
    """At most `cap` peer-reflexive remote candidates on one aioice connection (see the module's docstring)."""

    def __init__(self, cap: int, on_dropped: Callable[[tuple[str, int]], None] = lambda addr: None) -> None:
        if cap < 0:
            raise ValueError(f"cap={cap}: give 0 or more peer-reflexive candidates")
        self.cap = cap
        self._on_dropped = on_dropped
        self.dropped = 0  # checks dropped: from an unknown address, past the cap

    def install(self, connection) -> bool:
        """Bound this ``aioice.Connection`` from now on. False: this aioice lacks the hooks."""
        missing = [name for name in _HOOKS if not hasattr(connection, name)]
        if missing:
            log.warning("aioice %s lacks %s: a peer's peer-reflexive ICE candidates are not capped", _aioice_version(),
                        ", ".join(missing))
            return False
        check_incoming = connection.check_incoming

        def capped_check_incoming(message, addr, protocol) -> None:
            candidates = connection._remote_candidates
            known = any(getattr(c, "_network_host", c.host) == addr[0] and c.port == addr[1] for c in candidates)
            if not known and sum(c.type == "prflx" for c in candidates) >= self.cap:
                self.dropped += 1
                self._on_dropped(addr)
                return
            check_incoming(message, addr, protocol)

        connection.check_incoming = capped_check_incoming
        return True


def ice_connections(pc) -> list:
    """The aioice ``Connection`` of each of an aiortc peer connection's transports (one under BUNDLE)."""
    dtls = [t.receiver.transport for t in pc.getTransceivers()] + ([pc.sctp.transport] if pc.sctp else [])
    found = {}
    for transport in dtls:
        connection = getattr(transport.transport, "_connection", None)  # RTCDtlsTransport -> RTCIceTransport -> it
        if connection is not None:
            found[id(connection)] = connection
    return list(found.values())


def _aioice_version() -> str:
    try:
        from importlib.metadata import version

        return version("aioice")
    except Exception:  # noqa: BLE001 - only for the warning's text
        return "(unknown version)"
