"""The in-process server the end-to-end tests play against: the built-in model on the CPU, on a free port."""

import asyncio
import contextlib

from streamsvc.door.access import AccessConfig
from streamsvc.engine.config import EngineConfig
from streamsvc.viewers.server import Server, ServerConfig


@contextlib.asynccontextmanager
async def running(access: AccessConfig = AccessConfig(), clock=None, **config):
    """A started server with `access` and the other ServerConfig fields in `config` (`clock`: the rates' time);
    stopped at the end."""
    server = Server(EngineConfig(preset="tiny", device="cpu"), ServerConfig(port=0, access=access, **config),
                    **({"clock": clock} if clock else {}))
    await asyncio.wait_for(server.start(), 60)
    try:
        yield server
    finally:
        await asyncio.wait_for(server.stop(), 30)


def url(server: Server) -> str:
    return f"ws://127.0.0.1:{server.port}/ws"
