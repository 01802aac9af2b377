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
``on_dropped(addr)``. ``aiortc_hooks.ice_connections(pc)`` finds the agents of a peer connection (aiortc's
``RTCIceTransport`` keeps each).

What this uses of aioice below its API (the connection's check hook, its remote candidates and their addresses) is
reached through streamsvc/transport/aioice_hooks.py, which names it (``CONNECTION_HOOKS``, ``HOOKED``: aioice 0.13's,
aiortc 1.16's); ``install`` returns False (the prflx candidates are then unbounded, a warning says so) if a later
aioice lacks it, and ``tests/streamsvc/test_hooks.py`` and ``tests/streamsvc/test_ice.py`` fail loudly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from streamsvc.transport import aioice_hooks

log = logging.getLogger("streamsvc.webrtc")



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
        missing = aioice_hooks.missing(connection, aioice_hooks.CONNECTION_HOOKS)
        if missing:
            log.warning("aioice %s lacks %s: a peer's peer-reflexive ICE candidates are not capped",
                        aioice_hooks.aioice_version(), ", ".join(missing))
            return False

        def cap(check_incoming):
            def capped_check_incoming(message, addr, protocol) -> None:
                candidates = aioice_hooks.remote_candidates(connection)
                known = any(aioice_hooks.candidate_address(c) == (addr[0], addr[1]) for c in candidates)
                if not known and sum(c.type == "prflx" for c in candidates) >= self.cap:
                    self.dropped += 1
                    self._on_dropped(addr)
                    return
                check_incoming(message, addr, protocol)

            return capped_check_incoming

        aioice_hooks.wrap_check_incoming(connection, cap)
        return True

