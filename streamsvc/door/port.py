"""A server's port, and --metrics-port's: the front (streamsvc/door/front.py) with the guard's hooks on every
connection and request (streamsvc/door/guard.py), their CPU metered as work of no stream (streamsvc/door/cpumeter.py).
`streamsvc serve`'s server (streamsvc/viewers/server.py) and the cluster's gateway (streamsvc/cluster/gateway.py)
each open one; `serve_until_signalled` runs either until SIGINT or SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
from collections.abc import Awaitable, Callable

from streamsvc.door.access import Refusal, exposure_warning
from streamsvc.door.cpumeter import CpuMeter
from streamsvc.door.front import FRONT_TABLES, Connection, FrontConfig, Handlers, HttpFront, tls_context
from streamsvc.door.guard import Guard, raise_fd_limit
from streamsvc.door.routes import HttpReply, HttpRequest
from streamsvc.metrics import Metrics
from streamsvc.wire import protocol as P

log = logging.getLogger("streamsvc.server")

Route = Callable[[HttpRequest], HttpReply | None | Awaitable[HttpReply]]


class Port:
    """The port of `config` (a ServerConfig: host, port, TLS, handshake timeout, downloads per client, metrics port),
    each WebSocket served by `websocket`."""

    def __init__(self, config, guard: Guard, streamless: CpuMeter, metrics: Metrics,
                 websocket: Callable[[Connection], Awaitable[None]], body_limits: dict[str, int] | None = None) -> None:
        self.config = config
        self.body_limits = body_limits or {}  # paths whose request bodies may pass the front's limit (an image upload)
        self.guard = guard
        self.streamless = streamless
        self.metrics = metrics
        self.websocket = websocket
        self._fronts: list[HttpFront] = []  # the port's, then --metrics-port's

    async def open(self, route: Route, metrics_route: Route) -> str:
        """Listen: requests answered by `route` (and --metrics-port's by `metrics_route`); the port's base URL. The
        guard's connection caps follow the file descriptors this process may hold; a port open to other hosts without
        a token is warned of."""
        cfg = self.config
        self.guard.listen(raise_fd_limit())
        front = FrontConfig(host=cfg.host, port=cfg.port, max_message_bytes=P.MAX_MESSAGE_BYTES,
                            tls=tls_context(cfg.tls_cert, cfg.tls_key) if cfg.tls_cert else None,
                            handshake_timeout_s=cfg.handshake_timeout_s,
                            max_downloads_per_client=cfg.max_downloads_per_client, body_limits=self.body_limits)
        fronts = [(front, route)]
        if cfg.metrics_port is not None:
            fronts.append((dataclasses.replace(front, port=cfg.metrics_port, body_limits={}), metrics_route))
        for config, handler in fronts:
            self._fronts.append(HttpFront(config, self._handlers(handler)))
            await self._fronts[-1].start()
        warning = exposure_warning(cfg.host, cfg.access)
        if warning:
            log.warning(warning)
        return f"{self._fronts[0].scheme}://{cfg.host}:{self.port}"

    @property
    def port(self) -> int:
        return self._fronts[0].port

    @property
    def socket(self):
        """The port's listening socket."""
        return self._fronts[0].socket

    def table_sizes(self) -> dict[str, int]:
        """Its fronts' tables' entries, summed (the port's and --metrics-port's; see Server.table_sizes)."""
        sizes = dict.fromkeys(FRONT_TABLES, 0)
        for front in self._fronts:
            for name, n in front.table_sizes().items():
                sizes[name] += n
        return sizes

    async def close(self) -> None:
        for front in self._fronts:
            await front.stop()

    def _handlers(self, route: Route) -> Handlers:
        guard = self.guard  # the front's admission hooks: connection caps and request rates
        # each is stream-less work, and a connection or a request a stream-less event
        hook, meter = self.streamless.hook, lambda fn: self.streamless.hook(fn, event=False)
        return Handlers(route=route, websocket=self.websocket, client=guard.client,
                        admit_connection=hook(guard.admit_connection), connection_closed=meter(guard.connection_closed),
                        hold_connection=meter(guard.hold_connection),
                        admit_request=hook(guard.admit_request), admit_upgrade=meter(guard.admit_upgrade),
                        upgrade_ended=meter(guard.upgrade_ended),
                        download_refused=lambda _: self.metrics.refusals.labels(Refusal.DOWNLOADS.value).inc())


async def serve_until_signalled(start: Callable[[], Awaitable[None]], stop: Callable[[], Awaitable[None]]) -> None:
    """`start()`, then wait for SIGINT or SIGTERM, then `stop()`."""
    await start()
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stopping.set)
    await stopping.wait()
    log.info("shutting down")
    await stop()
