"""Every per-connection queue is bounded (issue 41, item 4), over loopback against the in-process server (tiny
preset, CPU): a viewer that does not read is closed (1008, counted), garbage input is a protocol error, error replies
and the replies to rate-limited messages are bounded, a stream the server ended stops its connection being read, and
/metrics counts the open connections. Every wait is bounded."""

import asyncio
import contextlib
import socket
import time

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from client.loadtest import scrape_metrics
from streamsvc.door.access import AccessConfig
from streamsvc.inputs import ws as input_ws
from streamsvc.viewers.outbox import OutboxLimits
from streamsvc.wire import protocol as P
from tests.client.servers import running, url
from tests.clock import ManualClock

T = 15.0  # bound on a step that should take a second or two on a busy 2-core host


def ws_connect(server, **kwargs):
    return connect(url(server), open_timeout=T, compression=None, max_size=None, ping_interval=None, **kwargs)


async def metrics(server) -> dict[str, float]:
    got = await asyncio.to_thread(scrape_metrics, f"http://127.0.0.1:{server.port}/metrics", T)
    assert got is not None, "no /metrics"
    return got


async def started(ws, **start) -> P.Ready:
    await ws.send(P.encode(P.Start(prompt="a red ball moving right", **start)))
    ready = P.parse_server(await asyncio.wait_for(ws.recv(), T))
    assert isinstance(ready, P.Ready), ready
    return ready


async def replies_until_closed(ws, bound_s: float = T) -> list:
    """The server's messages (chunks as bytes) until it closes `ws` (AssertionError if it has not by `bound_s`)."""
    got = []
    with contextlib.suppress(ConnectionClosed):
        async with asyncio.timeout(bound_s):
            while True:
                raw = await ws.recv()
                got.append(raw if isinstance(raw, bytes) else P.parse_server(raw))
    assert ws.close_code is not None, f"still open after {bound_s:g} s"
    return got


def small_send_buffers(server) -> None:
    """The server's sockets accepted from now on get a small kernel send buffer (Linux: an accepted socket inherits
    the listening one's). Loopback's buffers, megabytes, would take the tiny model's stream minutes to fill: this
    stands for a link that takes little at a time."""
    listening = server.front.socket
    listening.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)


async def test_a_viewer_that_does_not_read_is_closed_with_1008_once_its_backlog_passes_the_bound():
    async with running(outbox=OutboxLimits(max_items=8, max_bytes=24 << 10)) as server:
        small_send_buffers(server)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: a small window
        sock.connect(("127.0.0.1", server.port))
        async with ws_connect(server, sock=sock) as ws:
            ready = await started(ws)
            ws.transport.pause_reading()  # from here it reads nothing
            t0 = time.monotonic()
            for _ in range(int(60 / 0.1)):
                if (await metrics(server))["streamsvc_refusals_total{reason=slow_client}"] >= 1:
                    break
                await asyncio.sleep(0.1)
            waited_s = time.monotonic() - t0
            ws.transport.resume_reading()  # what it still gets: what was sent before the bound, then the close
            got = await replies_until_closed(ws)
            assert ws.close_code == 1008, (ws.close_code, ws.close_reason)
            assert ws.close_reason.startswith("slow client: ") and "(limits 8, 24576 bytes)" in ws.close_reason
            assert waited_s < 60 and sum(isinstance(m, bytes) for m in got) >= 1
        assert (await metrics(server))["streamsvc_refusals_total{reason=slow_client}"] == 1
        for _ in range(int(T / 0.1)):  # its viewer left: its stream ended
            if ready.stream_id not in server.sessions:
                break
            await asyncio.sleep(0.1)
        assert ready.stream_id not in server.sessions


async def test_garbage_input_messages_are_protocol_errors_and_close_the_connection_with_few_replies():
    async with running(AccessConfig(max_protocol_errors=5)) as server:
        async with ws_connect(server) as ws:
            await started(ws, input=True)
            sent = 0
            with contextlib.suppress(ConnectionClosed):
                for _ in range(20_000):  # 8-byte messages that are not input, as fast as the socket takes them
                    await ws.send(b"\x00garbage")
                    sent += 1
            got = await replies_until_closed(ws)
            errors = [m for m in got if isinstance(m, P.Error)]
            assert ws.close_code == 1008 and ws.close_reason == "5 protocol errors within 10 s"
            assert [e.code for e in errors] == [P.ErrorCode.BAD_CHUNK] * 5, (sent, errors[:3], len(errors))
        figures = await metrics(server)
        assert figures["streamsvc_refusals_total{reason=protocol_errors}"] == 1
        assert figures["streamsvc_protocol_errors_total"] == 5


async def test_control_messages_over_the_rate_get_a_bounded_number_of_replies():
    clock = ManualClock()  # frozen: no bucket refills until the test moves it
    async with running(clock=clock) as server:  # control: 5 a second, bursts of 10; errors: 10 a second, 50
        async with ws_connect(server) as ws:
            await started(ws)
            for _ in range(200):
                await ws.send(P.encode(P.Take(secret="not-the-steer-secret")))  # each one refused: an error
            await ws.send(P.encode(P.Close()))
            got = [m for m in await replies_until_closed(ws) if not isinstance(m, bytes)]
            errors = [m for m in got if isinstance(m, P.Error)]
            assert len(errors) == 50, [e.code for e in errors]  # 10 not_steerer, 40 rate_limited; 150 dropped
            assert {e.code for e in errors} == {P.ErrorCode.NOT_STEERER, P.ErrorCode.RATE_LIMITED}
        assert (await metrics(server))["streamsvc_error_replies_dropped_total"] == 150
        async with ws_connect(server) as ws:  # the next error after some were dropped is preceded by their count
            await started(ws)
            for _ in range(55):
                await ws.send(P.encode(P.Take(secret="x")))
            for _ in range(int(T / 0.05)):  # the server has taken them all (the last 5 replies dropped)
                if server.metrics.replies_dropped._value.get() == 155:
                    break
                await asyncio.sleep(0.05)
            clock.now += 1.0
            await ws.send(P.encode(P.Take(secret="x")))
            await ws.send(P.encode(P.Close()))
            errors = [m for m in await replies_until_closed(ws) if isinstance(m, P.Error)]
            assert len(errors) == 52 and errors[50].code is P.ErrorCode.RATE_LIMITED, [e.code for e in errors]
            assert errors[50].message.startswith("5 error replies were not sent")


async def test_a_stream_the_server_ended_stops_its_connection_being_read(monkeypatch):
    unpacked = []
    unpack = input_ws.unpack_input

    def counting(raw):
        unpacked.append(len(raw))
        return unpack(raw)

    monkeypatch.setattr(input_ws, "unpack_input", counting)
    async with running() as server:
        async with ws_connect(server) as ws:
            ready = await started(ws, input=True)
            await server.streams.end(server.sessions[ready.stream_id], "ended by the server")
            before = len(unpacked)
            with contextlib.suppress(ConnectionClosed):
                for _ in range(2000):  # it goes on sending input after the end
                    await ws.send(b"\x00garbage")
                    await asyncio.sleep(0.001)
            got = await replies_until_closed(ws)
            assert any(isinstance(m, P.Closed) and m.reason == "ended by the server" for m in got)
            assert ws.close_code == 1000 and ws.close_reason == "ended by the server"
            assert len(unpacked) - before <= 1, len(unpacked) - before  # at most the one that found it ended


async def test_metrics_count_the_open_connections():
    async with running() as server:
        assert (await metrics(server))["streamsvc_connections{kind=websocket}"] == 0
        async with ws_connect(server), ws_connect(server) as second:
            await started(second)
            figures = await metrics(server)
            assert figures["streamsvc_connections{kind=websocket}"] == 2
            assert figures["streamsvc_connections{kind=webrtc}"] == 0 and figures["streamsvc_connections{kind=whip}"] == 0
        for _ in range(int(T / 0.1)):
            if (await metrics(server))["streamsvc_connections{kind=websocket}"] == 0:
                break
            await asyncio.sleep(0.1)
        assert (await metrics(server))["streamsvc_connections{kind=websocket}"] == 0


pytestmark = pytest.mark.slow
