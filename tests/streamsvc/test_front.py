"""The port (streamsvc/door/front.py, aiohttp) over loopback, with the real routes (streamsvc/door/routes.py) and no
engine: WebSocket limits (1009, the handshake deadline), bad request targets, recordings served in bounded pieces with
Range and a per-client cap, request bodies, the metrics' token, the connection hook.

Raw sockets where a client library would not send what a hostile client sends. Every wait is bounded."""

import asyncio
import base64
import contextlib
import http
import logging
import os
import struct
from pathlib import Path

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from streamsvc.door import front as F
from streamsvc.door.access import AccessConfig
from streamsvc.door.front import FrontConfig, Handlers, HttpFront
from streamsvc.door.routes import HttpReply, HttpRequest, RangeNotSatisfiable, Routes, byte_range, reply
from streamsvc.metrics import Metrics
from streamsvc.wire import protocol as P

T = 10.0  # bound on anything that takes well under a second
NAME = "s0-20250101T000000-0123456789abcdef0123456789abcdef.mp4"  # a recording's link (its id and secret)


class Store:
    """What the routes ask of a RecordingStore: the files its links name."""

    def __init__(self, files: dict[str, Path]) -> None:
        self.files = files

    def in_progress(self, name: str) -> bool:
        return False

    def path(self, name: str) -> Path | None:
        return self.files.get(name)


async def echo(conn) -> None:
    async for message in conn:
        await conn.send(message)


@contextlib.asynccontextmanager
async def serving(tmp_path: Path, files: dict[str, Path] | None = None, access: AccessConfig = AccessConfig(),
                  **config):
    """A front on a free port serving the routes (a player in tmp_path/static, `files` as recordings) and an echo
    WebSocket; yields (front, routes)."""
    static = tmp_path / "static"
    static.mkdir(exist_ok=True)
    (static / "index.html").write_text("<html>player</html>")
    routes = Routes(access, str(static), Store(files or {}), Metrics(), ready=lambda: True,
                    refresh_metrics=lambda: None)
    handlers = config.pop("handlers", None) or Handlers(route=routes.handle, websocket=echo,
                                                        client=lambda r: r.remote or "")
    front = HttpFront(FrontConfig(port=0, max_message_bytes=P.MAX_MESSAGE_BYTES, **config), handlers)
    await front.start()
    try:
        yield front, routes
    finally:
        await asyncio.wait_for(front.stop(), T)


async def raw_request(port: int, head: bytes, source: str = "127.0.0.1") -> tuple[int, dict[str, str], bytes]:
    """Send `head` (a whole request) on a new socket; the status, headers and body of the answer."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0)), T)
    try:
        writer.write(head)
        raw = await asyncio.wait_for(reader.read(), T)  # the front closes a connection it could not read a request of
    finally:
        writer.close()
    top, _, body = raw.partition(b"\r\n\r\n")
    status_line, *lines = top.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    return int(status_line.split()[1]), headers, body


def get(port: int, target: str, *headers: str) -> bytes:
    return (f"GET {target} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n" + "".join(
        h + "\r\n" for h in headers) + "\r\n").encode()


# ---------------------------------------------------------------- WebSocket


async def raw_upgrade(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    key = base64.b64encode(os.urandom(16)).decode()
    writer.write(f"GET /ws HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                 f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode())
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), T)
    assert head.startswith(b"HTTP/1.1 101"), head
    return reader, writer


async def close_code(reader: asyncio.StreamReader) -> int:
    """The code of the server's close frame (the first frame it sends here)."""
    first, length = await asyncio.wait_for(reader.readexactly(2), T)
    assert first == 0x88 and 2 <= length <= 125, (first, length)
    return struct.unpack("!H", (await asyncio.wait_for(reader.readexactly(length), T))[:2])[0]


async def test_a_message_at_the_limit_is_served_one_past_it_closes_the_connection_with_1009(tmp_path):
    async with serving(tmp_path) as (front, _):
        async with connect(f"ws://127.0.0.1:{front.port}/ws", max_size=None, compression=None) as ws:
            at_limit = "x" * P.MAX_MESSAGE_BYTES
            await ws.send(at_limit)
            assert await asyncio.wait_for(ws.recv(), T) == at_limit
            await ws.send(b"y" * (P.MAX_MESSAGE_BYTES + 1))
            with pytest.raises(ConnectionClosed):
                await asyncio.wait_for(ws.recv(), T)
            assert ws.close_code == 1009


async def test_a_frame_declaring_2_to_the_63_bytes_is_refused_at_its_header_with_1009(tmp_path):
    async with serving(tmp_path) as (front, _):
        reader, writer = await raw_upgrade(front.port)
        # FIN + binary; masked, 64-bit length 2^63 - 1; a mask; and no payload at all
        writer.write(bytes([0x82, 0xFF]) + struct.pack("!Q", 2**63 - 1) + os.urandom(4))
        assert await close_code(reader) == 1009
        writer.close()


async def test_a_connection_without_a_request_head_is_dropped_at_the_deadline_and_others_are_served(tmp_path):
    async with serving(tmp_path, handshake_timeout_s=0.5) as (front, _):
        silent = await asyncio.open_connection("127.0.0.1", front.port)
        slow = await asyncio.open_connection("127.0.0.1", front.port)
        slow[1].write(b"GET /ws HTTP/1.1\r\nHost: x\r\n")  # a head that never ends
        async with connect(f"ws://127.0.0.1:{front.port}/ws", compression=None) as ws:  # served meanwhile
            await ws.send("hi")
            assert await asyncio.wait_for(ws.recv(), T) == "hi"
            loop = asyncio.get_running_loop()
            began = loop.time()
            for reader, _ in (silent, slow):
                assert await asyncio.wait_for(reader.read(), T) == b""  # closed by the server
            assert loop.time() - began < 3.0
            await asyncio.sleep(0.7)  # an upgraded connection has no such deadline
            await ws.send("still")
            assert await asyncio.wait_for(ws.recv(), T) == "still"
        for _, writer in (silent, slow):
            writer.close()


async def test_stop_closes_open_websockets_with_1001(tmp_path):
    async with serving(tmp_path) as (front, _):
        ws = await connect(f"ws://127.0.0.1:{front.port}/ws", compression=None)
        await asyncio.wait_for(front.stop(), T)
        with pytest.raises(ConnectionClosed):
            await asyncio.wait_for(ws.recv(), T)
        assert ws.close_code == 1001


async def test_a_plain_get_of_the_websocket_path_gets_426(tmp_path):
    async with serving(tmp_path) as (front, _):
        status, headers, _ = await raw_request(front.port, get(front.port, "/ws"))
        assert status == 426 and headers["upgrade"] == "websocket"


# ---------------------------------------------------------------- bad requests (issue 33, item 5)


@pytest.mark.parametrize("target", [
    b"/\x00", b"/%00", b"/recordings/%00.mp4", b"/" + b"a" * 3000, b"/" + b"a" * 9000, b"/../etc/passwd",
    b"/static/./x", b"/%zz", b"/%4", b"/%ff%fe", b"/\xff\xfe", b"/caf\xc3\xa9", b"/a\x7fb", b"/a\x1bb", b"*",
    b"http://evil.example/", b"/index.html?x=%zz",
])
async def test_a_bad_request_target_gets_a_4xx_and_no_traceback_in_the_log(tmp_path, caplog, target):
    caplog.set_level(logging.DEBUG)
    async with serving(tmp_path) as (front, _):
        status, _, _ = await raw_request(front.port, b"GET " + target + b" HTTP/1.1\r\nHost: x\r\n\r\n")
        assert 400 <= status < 500, status
        status, _, body = await raw_request(front.port, get(front.port, "/"))  # and the server goes on
        assert status == 200 and body == b"<html>player</html>"
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR], caplog.text
    assert "Traceback" not in caplog.text


async def test_a_route_that_fails_is_a_500_with_nothing_of_the_failure_on_the_wire(tmp_path, caplog):
    def broken(request: HttpRequest) -> HttpReply:
        raise RuntimeError("secret detail")

    handlers = Handlers(route=broken, websocket=echo, client=lambda r: "x")
    async with serving(tmp_path, handlers=handlers) as (front, _):
        status, _, body = await raw_request(front.port, get(front.port, "/"))
    assert status == 500 and b"secret" not in body and b"Traceback" not in body
    assert "secret detail" in caplog.text  # the operator's log has it


# ---------------------------------------------------------------- request bodies


async def test_a_request_body_reaches_the_route_and_one_over_the_limit_gets_413(tmp_path):
    seen = []

    def route(request: HttpRequest) -> HttpReply:
        seen.append((request.method, request.body))
        return reply(http.HTTPStatus.OK, b"ok", "text/plain")

    handlers = Handlers(route=route, websocket=echo, client=lambda r: "x")
    async with serving(tmp_path, handlers=handlers, max_body_bytes=1000) as (front, _):
        post = b"POST /whip HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/sdp\r\n"
        status, _, _ = await raw_request(front.port, post + b"Content-Length: 5\r\n\r\nv=0\r\n")
        assert status == 200 and seen == [("POST", b"v=0\r\n")]
        status, _, _ = await raw_request(front.port, post + b"Content-Length: 1001\r\n\r\n" + b"x" * 1001)
        chunked = post + b"Transfer-Encoding: chunked\r\n\r\n" + b"".join(
            f"{400:x}\r\n".encode() + b"x" * 400 + b"\r\n" for _ in range(3)) + b"0\r\n\r\n"
        assert (status, (await raw_request(front.port, chunked))[0]) == (413, 413)
        assert len(seen) == 1


# ---------------------------------------------------------------- recordings: Range, bounded pieces, the cap


def pattern_file(path: Path, size: int) -> bytes:
    """A file whose every offset has its own byte pattern (a 251-byte cycle): a wrong offset shows."""
    data = (bytes(range(251)) * (size // 251 + 1))[:size]
    path.write_bytes(data)
    return data


@pytest.mark.parametrize("header, span", [
    ("bytes=0-99", (0, 99)), ("bytes=100-", (100, 999)), ("bytes=-100", (900, 999)), ("bytes=990-5000", (990, 999)),
    ("bytes=-5000", (0, 999)), ("Bytes=0-0", (0, 0)), ("bytes= 5-6 ", (5, 6)), ("bytes=5-6,", (5, 6)),
    (None, None), ("", None), ("items=0-5", None), ("bytes=5-1", None), ("bytes=abc", None), ("bytes=-", None),
    ("bytes=0-1,5-6", None), ("bytes=0-1, -5", None), ("bytes=1-2-3", None),
])
def test_byte_range(header, span):
    assert byte_range(header, 1000) == span


@pytest.mark.parametrize("header", ["bytes=1000-", "bytes=5000-6000", "bytes=-0", f"bytes={10**30}-"])
def test_a_range_past_the_end_is_not_satisfiable(header):
    with pytest.raises(RangeNotSatisfiable):
        byte_range(header, 1000)
    with pytest.raises(RangeNotSatisfiable):
        byte_range("bytes=0-", 0)  # an empty file has no byte to give


async def test_ranges_of_a_recording_single_suffix_open_ended_unsatisfiable_and_multi(tmp_path):
    data = pattern_file(tmp_path / NAME, 300_000)
    size = len(data)
    async with serving(tmp_path, files={NAME: tmp_path / NAME}) as (front, _):
        async def fetch(*headers):
            return await raw_request(front.port, get(front.port, "/recordings/" + NAME, *headers))

        status, headers, body = await fetch()
        assert (status, body, headers["accept-ranges"]) == (200, data, "bytes")
        for rng, start, end in (("bytes=0-99", 0, 99), ("bytes=-1000", size - 1000, size - 1),
                                ("bytes=299000-", 299_000, size - 1), ("bytes=262140-262150", 262_140, 262_150)):
            status, headers, body = await fetch(f"Range: {rng}")
            assert status == 206 and body == data[start:end + 1], rng
            assert headers["content-range"] == f"bytes {start}-{end}/{size}"
            assert headers["content-length"] == str(end + 1 - start)
        status, headers, body = await fetch(f"Range: bytes={size}-")
        assert status == 416 and headers["content-range"] == f"bytes */{size}" and b"Range" in body
        # several ranges: the whole file with 200 (RFC 9110 lets a server ignore Range; see routes.byte_range)
        status, headers, body = await fetch("Range: bytes=0-9,100-109")
        assert status == 200 and body == data and "content-range" not in headers


async def test_a_big_recording_is_streamed_in_pieces_and_a_slow_reader_holds_few_of_them(tmp_path, monkeypatch):
    size = 64 << 20
    data = pattern_file(tmp_path / NAME, size)
    reads = []

    def counted(fd, offset, n):
        reads.append(n)
        return os.pread(fd, n, offset)

    monkeypatch.setattr(F, "read_piece", counted)
    async with serving(tmp_path, files={NAME: tmp_path / NAME}) as (front, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
        writer.write(get(front.port, "/recordings/" + NAME))
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), T)
        assert head.startswith(b"HTTP/1.1 200") and f"Content-Length: {size}".encode() in head
        first = await asyncio.wait_for(reader.readexactly(1 << 20), T)
        await asyncio.sleep(0.5)  # the reader stops reading: the server stops reading the file
        read_while_paused = sum(reads)
        assert read_while_paused < 16 << 20, read_while_paused  # the socket's buffers and a piece, not 64 MiB
        assert first == data[:1 << 20]
        rest = await asyncio.wait_for(reader.readexactly(size - (1 << 20)), 60)
        assert first + rest == data
        writer.close()
    assert max(reads) <= F.PIECE_BYTES and sum(reads) == size


async def test_downloads_per_client_are_capped_and_the_next_gets_429_with_retry_after(tmp_path):
    pattern_file(tmp_path / NAME, 32 << 20)  # more than the sockets' buffers: a download not read stays open
    async with serving(tmp_path, files={NAME: tmp_path / NAME}, max_downloads_per_client=2) as (front, routes):
        async def start_download(source: str = "127.0.0.1"):
            reader, writer = await asyncio.open_connection("127.0.0.1", front.port, local_addr=(source, 0))
            writer.write(get(front.port, "/recordings/" + NAME))
            return reader, writer, await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), T)

        downloads = [await start_download() for _ in range(2)]
        assert all(head.startswith(b"HTTP/1.1 200") for _, _, head in downloads)
        status, headers, body = await raw_request(front.port, get(front.port, "/recordings/" + NAME))
        assert status == 429 and int(headers["retry-after"]) > 0 and b"--max-downloads-per-client" in body
        assert front.downloads.held("127.0.0.1") == 2
        other = await start_download("127.0.0.2")  # another address has its own
        assert other[2].startswith(b"HTTP/1.1 200")
        downloads[0][1].close()  # a download ends (its client went away): its slot comes free
        for _ in range(int(T / 0.05)):
            if front.downloads.held("127.0.0.1") < 2:
                break
            await asyncio.sleep(0.05)
        again = await start_download()
        assert again[2].startswith(b"HTTP/1.1 200")
        for _, writer, _ in (*downloads[1:], other, again):
            writer.close()
        status, _, _ = await raw_request(front.port, get(front.port, "/"))  # the player is not a download
        assert status == 200


def test_the_ports_flags_reach_the_server_config_and_a_bad_one_is_an_error(tmp_path):
    from streamsvc.cli import _front_config, build_parser

    def config(*argv):
        return _front_config(build_parser().parse_args(["serve", *argv]))

    assert config() == {"tls_cert": None, "tls_key": None, "metrics_port": None, "max_downloads_per_client": 4}
    assert config("--max-downloads-per-client", "2", "--metrics-port", "9100")["max_downloads_per_client"] == 2
    with pytest.raises(ValueError, match="--max-downloads-per-client 0"):
        config("--max-downloads-per-client", "0")
    with pytest.raises(ValueError, match="both --tls-cert and --tls-key"):
        config("--tls-cert", "cert.pem")
    (tmp_path / "junk.pem").write_text("not a certificate")
    with pytest.raises(OSError):  # ssl.SSLError is one: serve prints it and exits 2
        config("--tls-cert", str(tmp_path / "junk.pem"), "--tls-key", str(tmp_path / "junk.pem"))


# ---------------------------------------------------------------- /metrics


async def test_with_tokens_metrics_need_the_token_as_a_bearer_header(tmp_path):
    async with serving(tmp_path, access=AccessConfig(tokens={"tok": None})) as (front, routes):
        for headers, expected in (((), 401), (("Authorization: Bearer wrong",), 401),
                                  (("Authorization: Basic tok",), 401), (("Authorization: Bearer tok",), 200)):
            status, got, body = await raw_request(front.port, get(front.port, "/metrics", *headers))
            assert status == expected, headers
            if status == 401:
                assert got["www-authenticate"].startswith("Bearer") and b"token" in body
            else:
                assert b"streamsvc_refusals_total" in body
        status, _, _ = await raw_request(front.port, get(front.port, "/metrics?token=tok"))
        assert status == 401  # not in the address, where logs and proxies would keep it
    async with serving(tmp_path) as (front, routes):  # no tokens: open, as before
        assert (await raw_request(front.port, get(front.port, "/metrics")))[0] == 200


async def test_with_a_metrics_port_the_main_port_has_no_metrics(tmp_path):
    static = tmp_path / "static"
    static.mkdir()
    routes = Routes(AccessConfig(tokens={"tok": None}), str(static), Store({}), Metrics(), ready=lambda: True,
                    refresh_metrics=lambda: None, metrics_apart=True)
    main = HttpFront(FrontConfig(port=0), Handlers(route=routes.handle, websocket=echo, client=lambda r: "x"))
    apart = HttpFront(FrontConfig(port=0), Handlers(route=routes.metrics_only, websocket=echo, client=lambda r: "x"))
    await main.start()
    await apart.start()
    try:
        assert (await raw_request(main.port, get(main.port, "/metrics", "Authorization: Bearer tok")))[0] == 404
        status, _, body = await raw_request(apart.port, get(apart.port, "/metrics"))  # no token there
        assert status == 200 and b"streamsvc_refusals_total" in body
        assert (await raw_request(apart.port, get(apart.port, "/healthz")))[0] == 404
        assert (await raw_request(apart.port, get(apart.port, "/ws")))[0] == 404
    finally:
        await main.stop()
        await apart.stop()


# ---------------------------------------------------------------- the connection hook


async def test_a_connection_the_hook_refuses_is_dropped_and_an_admitted_ones_end_is_heard(tmp_path):
    events = []

    def admit(address: str) -> str | None:
        events.append(("open", address))
        return "over the cap" if address == "127.0.0.2" else None

    routes_box = {}
    handlers = Handlers(route=lambda r: routes_box["routes"].handle(r), websocket=echo, client=lambda r: "x",
                        admit_connection=admit, connection_closed=lambda a: events.append(("closed", a)))
    async with serving(tmp_path, handlers=handlers) as (front, routes):
        routes_box["routes"] = routes
        status, _, _ = await raw_request(front.port, get(front.port, "/"))
        assert status == 200
        reader, writer = await asyncio.open_connection("127.0.0.1", front.port, local_addr=("127.0.0.2", 0))
        writer.write(get(front.port, "/"))
        with contextlib.suppress(ConnectionError):  # dropped: no answer at all
            assert await asyncio.wait_for(reader.read(), T) == b""
        writer.close()
        for _ in range(int(T / 0.05)):
            if ("closed", "127.0.0.1") in events:
                break
            await asyncio.sleep(0.05)
    assert events[:2] == [("open", "127.0.0.1"), ("closed", "127.0.0.1")] and ("open", "127.0.0.2") in events
    assert ("closed", "127.0.0.2") not in events  # never admitted, never counted



async def test_a_connection_the_hold_hook_names_is_read_only_after_its_hold(tmp_path):
    routes_box = {}
    handlers = Handlers(route=lambda r: routes_box["routes"].handle(r), websocket=echo, client=lambda r: "x",
                        hold_connection=lambda address: 0.6 if address == "127.0.0.2" else 0.0)
    async with serving(tmp_path, handlers=handlers) as (front, routes):
        routes_box["routes"] = routes
        loop = asyncio.get_running_loop()
        began = loop.time()
        status, _, _ = await raw_request(front.port, get(front.port, "/"), source="127.0.0.1")
        assert status == 200 and loop.time() - began < 0.5
        began = loop.time()
        status, _, _ = await raw_request(front.port, get(front.port, "/"), source="127.0.0.2")
        # answered, but only once the hold is over
        assert status == 200 and 0.6 <= loop.time() - began < 0.6 + T
