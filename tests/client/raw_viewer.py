"""A stream's viewer over a raw WebSocket, for the end-to-end tests that read what a running server sends as it is
sent: every message parsed, every chunk kept as (header, payload, its frames decoded by PyAV as float32 RGB 0..255),
and the order in which chunks and replies came. Every wait is bounded."""

import asyncio
import contextlib
import json

import numpy as np
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from client.decode import FrameDecoder
from streamsvc.engine.config import EngineConfig
from streamsvc.viewers.server import Server, ServerConfig
from streamsvc.wire import protocol as P

T = 30.0  # bound on anything that should take a few seconds on a loaded 2-core host


@contextlib.asynccontextmanager
async def serving(config: ServerConfig, **engine):
    """A running server (loopback, an ephemeral port) of the tiny model on CPU at full steps (no degradation: a
    stream's frames depend on its prompt, seed and conditioning only), with the EngineConfig fields `engine`."""
    server = Server(EngineConfig(preset="tiny", device="cpu", degrade=False, **engine), config)
    await asyncio.wait_for(server.start(), 120)
    try:
        yield server
    finally:
        await asyncio.wait_for(server.stop(), 30)


class RawViewer:
    """One stream's viewer (a steerer from `start`, a watcher from `watch`); a test module's subclass may ask for
    another prompt or seed."""

    prompt, seed = "a red ball moving right", 5

    def __init__(self, ws, first) -> None:
        self.ws, self.first = ws, first
        self.messages: list = []
        self.chunks: list[tuple[P.Chunk, bytes, np.ndarray]] = []
        self.order: list[tuple[str, object]] = []  # ("chunk", prompt_version) or ("reply", request), as they came
        self.decoder = FrameDecoder()
        self.task = asyncio.ensure_future(self._read()) if isinstance(first, P.Ready) else None

    @classmethod
    async def start(cls, server: Server, ws=None, **fields) -> "RawViewer":
        """`start` this class's prompt and seed with `fields` over `ws` (default: a new connection)."""
        ws = ws or await connect(f"ws://127.0.0.1:{server.port}/ws", max_size=P.MAX_CHUNK_BYTES)
        await ws.send(json.dumps({"type": "start", "prompt": cls.prompt, "seed": cls.seed, **fields}))
        return cls(ws, P.parse_server(await asyncio.wait_for(ws.recv(), T)))

    @classmethod
    async def watch(cls, server: Server, ready: P.Ready) -> "RawViewer":
        """Watch the stream `ready` opened, by its watch link."""
        ws = await connect(f"ws://127.0.0.1:{server.port}/ws", max_size=P.MAX_CHUNK_BYTES)
        await ws.send(json.dumps({"type": "watch", "stream_id": ready.stream_id, "secret": ready.watch_secret}))
        return cls(ws, P.parse_server(await asyncio.wait_for(ws.recv(), T)))

    @property
    def frames(self) -> np.ndarray:
        return np.concatenate([frames for *_, frames in self.chunks])

    async def _read(self) -> None:
        with contextlib.suppress(ConnectionClosed):
            async for data in self.ws:
                if isinstance(data, bytes):
                    header, units = P.unpack_chunk(data)
                    frames = [f.to_ndarray(format="rgb24") for au in units for f in self.decoder.decode(au)]
                    self.chunks.append((header, b"".join(units), np.stack(frames).astype(np.float32)))
                    self.order.append(("chunk", header.prompt_version))
                else:
                    self.messages.append(P.parse_server(data))
                    self.order.append(("reply", getattr(self.messages[-1], "request", None)))

    async def send(self, **msg) -> None:
        await self.ws.send(json.dumps(msg))

    async def wait_until(self, predicate, timeout_s: float = T) -> bool:
        for _ in range(int(timeout_s / 0.05)):
            if predicate():
                return True
            await asyncio.sleep(0.05)
        return predicate()

    def replies(self, request: str) -> list:
        return [m for m in self.messages if isinstance(m, (P.Ack, P.Error)) and m.request == request]

    async def close(self) -> None:
        await self.ws.close()
        if self.task is not None:
            await asyncio.wait_for(self.task, T)
