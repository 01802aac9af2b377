"""The port's limits as the front's hooks and each WebSocket's guard see them: no sockets (a fake connection),
an injected clock, the event loop only for the start deadline's timer."""

import asyncio
import resource
import subprocess
import sys

import pytest

from streamsvc.door.access import AccessConfig, Rate, Refusal
from streamsvc.door.guard import HOLD_S, POLICY_VIOLATION, Guard, socket_caps
from streamsvc.door.routes import WS_PATH, HttpRequest
from streamsvc.metrics import Metrics
from tests.clock import ManualClock as Clock


class FakeConnection:
    """What the guard needs of a front.Connection: close."""

    def __init__(self) -> None:
        self.closed_with: tuple[int, str] | None = None
        self.linger: bool | None = None

    async def close(self, code: int = 1000, reason: str = "", linger: bool = True) -> None:
        self.closed_with = (code, reason)
        self.linger = linger


def guard(fd_limit: int = 1024, **access) -> tuple[Guard, Clock]:
    clock = Clock()
    g = Guard(AccessConfig(**access), Metrics(), clock)
    g.listen(fd_limit)
    return g, clock


def request(path: str = "/healthz", remote: str = "10.0.0.1", **headers) -> HttpRequest:
    return HttpRequest("GET", path, headers, remote)


def refusals(g: Guard, reason: Refusal) -> float:
    return g.metrics.refusals.labels(reason.value)._value.get()


def header(reply, name: str) -> str | None:
    return dict(reply.headers).get(name)


@pytest.mark.parametrize("per_client, total, fd_limit, trust_proxy, caps", [
    (256, 298, 1024, False, (447, 447)),  # 298 + 149, under 1024 - 64
    (8, 298, 1024, False, (16, 447)),  # twice the per-address cap
    (256, 298, 1024, True, (447, 447)),  # behind a proxy: one peer, the total only
    (256, 1000, 1024, False, (512, 1000)),  # an explicit total past the fd room keeps its own value
    (4, 10, -1, False, (8, 26)),
])
def test_socket_caps(per_client, total, fd_limit, trust_proxy, caps):
    assert socket_caps(per_client, total, fd_limit, trust_proxy) == caps


def test_the_total_cap_follows_the_fd_limit_unless_given():
    assert guard(1024)[0].clients.total == (1024 - 128) // 3
    assert guard(1024, max_connections=50)[0].clients.total == 50


def test_http_requests_past_the_rate_get_429_with_retry_after_and_are_counted():
    g, clock = guard(http_rate=Rate(2.0, 3))
    assert [g.admit_request(request("/metrics")) for _ in range(3)] == [None] * 3
    refused = g.admit_request(request("/metrics"))
    assert refused.status == 429 and header(refused, "Retry-After") == "1" and b"--http-rate" in refused.body
    assert g.admit_request(request("/healthz", remote="10.0.0.2")) is None  # another address
    assert g.admit_request(request(WS_PATH)) is None  # upgrades have their own bucket
    clock.now += 0.5
    assert g.admit_request(request("/metrics")) is None
    assert refusals(g, Refusal.HTTP_RATE) == 1


def test_new_sockets_from_an_address_over_its_rate_are_held_until_it_refills():
    g, clock = guard(http_rate=Rate(2.0, 3), connect_rate=Rate(1.0, 2))
    assert g.hold_connection("10.0.0.1") == 0.0  # never seen: nothing held
    assert [g.admit_request(request("/metrics")) for _ in range(3)] == [None] * 3
    assert g.hold_connection("10.0.0.1") == HOLD_S  # its HTTP bucket is empty: its next sockets wait unread
    assert g.hold_connection("10.0.0.2") == 0.0  # another address is not
    clock.now += 0.5  # refilled by one request
    assert g.hold_connection("10.0.0.1") == 0.0
    assert g.admit_request(request(WS_PATH, remote="10.0.0.2")) is None
    assert g.admit_request(request(WS_PATH, remote="10.0.0.2")) is None
    assert g.hold_connection("10.0.0.2") == HOLD_S  # any bucket: its upgrades' too
    proxied, clock = guard(trust_proxy=True, http_rate=Rate(2.0, 1))
    assert proxied.admit_request(request("/metrics", remote="127.0.0.1")) is None
    assert proxied.hold_connection("127.0.0.1") == 0.0  # every peer is the proxy: never held


def test_upgrades_past_the_connect_rate_get_429():
    g, _ = guard(connect_rate=Rate(1.0, 2))
    assert g.admit_request(request(WS_PATH)) is None and g.admit_request(request(WS_PATH)) is None
    refused = g.admit_request(request(WS_PATH))
    assert refused.status == 429 and b"--connect-rate" in refused.body
    assert refusals(g, Refusal.CONNECT_RATE) == 1


def test_upgrades_past_the_caps_get_429_per_address_and_503_in_total_and_release():
    g, _ = guard(max_connections_per_client=2, max_connections=3, start_timeout_s=10)
    a, b, c = request(WS_PATH, "10.0.0.1"), request(WS_PATH, "10.0.0.2"), request(WS_PATH, "10.0.0.3")
    assert g.admit_upgrade(a) is None and g.admit_upgrade(a) is None
    refused = g.admit_upgrade(a)
    assert refused.status == 429 and header(refused, "Retry-After") == "10"
    assert b"--max-connections-per-client" in refused.body
    assert g.admit_upgrade(b) is None
    refused = g.admit_upgrade(c)
    assert refused.status == 503 and header(refused, "Retry-After") == "10"
    g.upgrade_ended(a)
    assert g.admit_upgrade(c) is None
    assert (refusals(g, Refusal.CLIENT_CONNECTIONS), refusals(g, Refusal.CONNECTIONS)) == (1, 1)


def test_behind_a_trusted_proxy_caps_count_the_forwarded_address():
    g, _ = guard(max_connections_per_client=1, trust_proxy=True)
    one = request(WS_PATH, "10.9.9.9", **{"X-Forwarded-For": "203.0.113.1"})
    two = request(WS_PATH, "10.9.9.9", **{"X-Forwarded-For": "203.0.113.2"})
    assert g.admit_upgrade(one) is None and g.admit_upgrade(two) is None
    assert g.admit_upgrade(one).status == 429
    for _ in range(g.sockets.total):  # every socket comes from the proxy: only the total holds
        assert g.admit_connection("10.9.9.9") is None
    assert g.admit_connection("10.9.9.9") is not None


def test_sockets_past_the_hard_cap_are_dropped_and_released_ones_come_back():
    g, _ = guard(max_connections_per_client=2)
    assert [g.admit_connection("10.0.0.1") for _ in range(4)] == [None] * 4  # twice the per-address cap
    assert "client_connections" in g.admit_connection("10.0.0.1")
    g.connection_closed("10.0.0.1")
    assert g.admit_connection("10.0.0.1") is None
    assert g.admit_connection("10.0.0.2") is None


async def test_a_websocket_without_start_is_closed_at_its_deadline():
    g, _ = guard(start_timeout_s=0.05)
    idle, started = FakeConnection(), FakeConnection()
    idle_guard, started_guard = g.connection(idle, "10.0.0.1"), g.connection(started, "10.0.0.1")
    started_guard.started()
    await asyncio.sleep(0.2)
    await idle_guard.done()
    await started_guard.done()
    assert idle.closed_with == (POLICY_VIOLATION, "no start or watch within 0.05 s")
    assert idle.linger is True  # an idle client is no flood: its close is a normal one
    assert idle_guard.closing is Refusal.START_TIMEOUT
    assert started.closed_with is None
    assert refusals(g, Refusal.START_TIMEOUT) == 1


async def test_protocol_errors_close_the_connection_at_the_limit():
    g, clock = guard(max_protocol_errors=3)
    conn = FakeConnection()
    cg = g.connection(conn, "10.0.0.1")
    assert cg.protocol_error() and cg.protocol_error()
    assert cg.protocol_error() is False
    await cg.done()
    assert conn.closed_with == (POLICY_VIOLATION, "3 protocol errors within 10 s")
    assert conn.linger is False  # a flood: nothing more of it is read
    assert g.admit_request(request(WS_PATH)).status == 429  # and its address reconnects at the rate, no burst
    assert refusals(g, Refusal.PROTOCOL_ERRORS) == 1
    slow = g.connection(FakeConnection(), "10.0.0.2")
    for _ in range(10):  # one mistake every 6 s is a person, not a flood
        clock.now += 6.0
        assert slow.protocol_error()
    await slow.done()


async def test_messages_before_start_past_the_address_rate_close_the_connection():
    g, _ = guard(connect_rate=Rate(1.0, 2))
    first, second = FakeConnection(), FakeConnection()
    one, two = g.connection(first, "10.0.0.1"), g.connection(second, "10.0.0.1")
    assert one.message() and two.message()  # one each: the address's burst
    assert one.message() is False  # the address's bucket is shared by its connections
    await one.done()
    await two.done()
    assert first.closed_with == (POLICY_VIOLATION, "too many messages before start or watch")
    assert first.linger is False
    assert second.closed_with is None


def test_refusal_log_lines_are_rate_limited(caplog):
    g, clock = guard(http_rate=Rate(1.0, 1))
    with caplog.at_level("INFO", logger="streamsvc.guard"):
        for _ in range(100):
            g.admit_request(request("/metrics"))
        clock.now += 10.0
        g.admit_request(request("/metrics"))
        g.admit_request(request("/metrics"))
    lines = [r.getMessage() for r in caplog.records if "refused or closed" in r.getMessage()]
    assert len(lines) == 2 and "98 more since" in lines[1]
    assert refusals(g, Refusal.HTTP_RATE) == 100


def test_serve_flags_reach_the_access_config():
    from streamsvc.cli import _access_config, build_parser

    args = build_parser().parse_args(["serve", "--max-connections-per-client", "8", "--max-connections", "100",
                                      "--start-timeout", "2.5", "--http-rate", "3", "--http-burst", "7",
                                      "--connect-rate", "4", "--max-protocol-errors", "6"])
    config = _access_config(args)
    assert (config.max_connections_per_client, config.max_connections, config.start_timeout_s) == (8, 100, 2.5)
    assert (config.http_rate, config.connect_rate, config.max_protocol_errors) == (Rate(3, 7), Rate(4, 8), 6)
    defaults = _access_config(build_parser().parse_args(["serve"]))
    assert defaults == AccessConfig()  # the flags' defaults are the config's
    with pytest.raises(ValueError, match="--max-connections-per-client 0"):
        _access_config(build_parser().parse_args(["serve", "--max-connections-per-client", "0"]))


def test_serve_raises_the_soft_fd_limit_to_the_hard_one():
    code = "import logging, resource; logging.basicConfig(level=logging.INFO); " \
           "from streamsvc.door.guard import raise_fd_limit; " \
           "print(raise_fd_limit(), resource.getrlimit(resource.RLIMIT_NOFILE))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True,
                         preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, 512)))
    assert out.stdout.split("\n")[0] == "512 (512, 512)"
    assert "file descriptors: soft limit 512, raised from 256 (hard 512)" in out.stderr
