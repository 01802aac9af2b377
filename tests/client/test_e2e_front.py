"""The port end to end (streamsvc/front.py behind the real server, tiny preset on CPU): bad request targets on the
server with its player."""

import asyncio
import contextlib
import logging
import urllib.error
import urllib.request
from pathlib import Path

from streamsvc.engine import EngineConfig
from streamsvc.server import Server, ServerConfig

T = 10.0  # generous bound for anything that should take well under a second
STATIC = Path(__file__).resolve().parents[2] / "client" / "static"

@contextlib.asynccontextmanager
async def running(**config):
    server = Server(EngineConfig(preset="tiny", device="cpu"), ServerConfig(port=0, **config))
    await asyncio.wait_for(server.start(), 60)
    try:
        yield server
    finally:
        await asyncio.wait_for(server.stop(), 30)

def status(url: str, headers: dict | None = None) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=T) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code

async def test_a_nul_in_the_target_is_a_400_on_the_server_with_its_player_and_no_traceback(caplog):
    caplog.set_level(logging.DEBUG)
    async with running(static_dir=str(STATIC)) as server:
        for target in (b"/\x00", b"/%00", b"/index.html%00.js", b"/recordings/%00", b"/" + b"%2e%2e/" * 5 + b"etc"):
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(b"GET " + target + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            answer = await asyncio.wait_for(reader.read(), T)
            writer.close()
            assert answer.split(b" ", 2)[1] in (b"400", b"404"), (target, answer[:80])
        assert await asyncio.to_thread(status, f"http://127.0.0.1:{server.port}/") == 200  # the player still
    assert "Traceback" not in caplog.text and not [r for r in caplog.records if r.exc_info]
