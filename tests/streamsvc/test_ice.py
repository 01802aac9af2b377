"""What streamsvc/transport/ice.py hooks in aioice, by name, and its cap on peer-reflexive candidates on a real aioice
agent (gathered on loopback; no STUN server, no network)."""

from __future__ import annotations

import aioice
import aioice.ice
from aioice import stun

from streamsvc.transport import aioice_hooks
from streamsvc.transport.ice import PeerReflexiveCap


def test_the_hooks_the_prflx_cap_needs_are_in_this_aioice():
    connection = aioice.Connection(ice_controlling=False)
    assert all(hasattr(connection, name) for name in aioice_hooks.CONNECTION_HOOKS)
    assert PeerReflexiveCap(2).install(connection)
    assert connection.check_incoming.__name__ == "capped_check_incoming"
    assert aioice.Connection.check_incoming.__name__ == "check_incoming"  # other connections keep aioice's own


async def test_checks_from_new_addresses_past_the_cap_are_dropped_and_known_ones_go_on(monkeypatch):
    monkeypatch.setattr(aioice.ice, "get_host_addresses", lambda use_ipv4, use_ipv6: ["127.0.0.1"])
    connection = aioice.Connection(ice_controlling=False)
    connection.remote_username, connection.remote_password = "peer", "peer-password-of-22-chars"
    dropped: list = []
    cap = PeerReflexiveCap(3, on_dropped=dropped.append)
    assert cap.install(connection)
    try:
        await connection.gather_candidates()
        connection._early_checks_done = True  # as connect() leaves it: checks are handled as they come
        protocol = connection._protocols[0]
        check = stun.Message(message_method=stun.Method.BINDING, message_class=stun.Class.REQUEST)
        check.attributes["PRIORITY"] = 1853824767
        for port in range(40000, 40040):  # an authenticated check from each of 40 new addresses
            connection.check_incoming(check, ("127.0.0.1", port), protocol)
        prflx = [(c.host, c.port) for c in connection._remote_candidates if c.type == "prflx"]
        assert prflx == [("127.0.0.1", 40000), ("127.0.0.1", 40001), ("127.0.0.1", 40002)]
        assert cap.dropped == 37 and dropped[0] == ("127.0.0.1", 40003)
        connection.check_incoming(check, ("127.0.0.1", 40001), protocol)  # a known address: aioice's as before
        assert cap.dropped == 37 and len(connection._check_list) == 3
    finally:
        await connection.close()
