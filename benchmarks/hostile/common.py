"""What every hostile case shares: a server process under limits, a first chunk timed, /healthz, RSS."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import InvalidStatus, WebSocketException

from client.loadtest import free_port, http_status
from streamsvc.wire import protocol as P

HOST = "127.0.0.1"  # where the server listens, and the attacker's address
GOOD = "127.0.0.2"  # the well-behaved client's address (loopback: 127.0.0.0/8 all reaches this machine)
CONNECT_CONCURRENCY = 100  # idle connections opening at once (more overflow the listen backlog: 1 s SYN retries)
T = 30.0  # bound on any one step that should take well under a second


@dataclass
class Served:
    """A server process started by `limited_server`."""

    proc: subprocess.Popen
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"ws://{HOST}:{self.port}/ws"

    def fds(self) -> int | None:
        """The server's open file descriptors now (Linux /proc; None elsewhere)."""
        try:
            return len(os.listdir(f"/proc/{self.proc.pid}/fd"))
        except OSError:
            return None

    def log_tail(self, lines: int = 20) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])


@contextlib.contextmanager
def limited_server(serve_args: Sequence[str], nofile: int, start_timeout_s: float = 120.0) -> Iterator[Served]:
    """`streamsvc serve --preset tiny --device cpu` in a child process whose RLIMIT_NOFILE is `nofile`, soft and
    hard (what `ulimit -n` sets), on a free loopback port, once /healthz answers 200; stopped (SIGTERM, then
    SIGKILL) at the end."""
    port = free_port(HOST)
    cmd = [sys.executable, "-m", "streamsvc.cli", "serve", "--preset", "tiny", "--device", "cpu", "--host", HOST,
           "--port", str(port), *serve_args]
    with tempfile.TemporaryDirectory(prefix="streamsvc-hostile-") as logdir:
        log_path = Path(logdir) / "server.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile)))
            served = Served(proc, port, log_path)
            try:
                deadline = time.monotonic() + start_timeout_s
                while http_status(f"http://{HOST}:{port}/healthz", timeout_s=1.0) != 200:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"the server did not start ({' '.join(cmd)}):\n{served.log_tail()}")
                    time.sleep(0.2)
                yield served
            finally:
                proc.terminate()
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)


def raise_own_fd_limit(need: int) -> None:
    """This process opens `need` sockets at once: raise its soft fd limit toward the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


# ---------------------------------------------------------------- clients


async def open_idle(url: str, count: int, concurrency: int = CONNECT_CONCURRENCY,
                    timeout_s: float = T) -> tuple[list[ClientConnection], Counter]:
    """`count` WebSockets from HOST, `concurrency` opening at a time (each within `timeout_s`), that answer pings
    and send nothing; the open ones, and how the others ended ({"429": n, "503": n, "no Retry-After": n,
    "error: ...": n})."""
    gate = asyncio.Semaphore(concurrency)
    outcomes: Counter = Counter()

    async def one() -> ClientConnection | None:
        async with gate:
            try:
                return await connect(url, open_timeout=timeout_s, compression=None, ping_interval=None,
                                     close_timeout=2)
            except InvalidStatus as e:
                outcomes[str(e.response.status_code)] += 1
                if "Retry-After" not in e.response.headers:
                    outcomes["no Retry-After"] += 1
            except (OSError, asyncio.TimeoutError, WebSocketException) as e:
                outcomes[f"error: {type(e).__name__}"] += 1
            return None

    sockets = [ws for ws in await asyncio.gather(*(one() for _ in range(count))) if ws is not None]
    return sockets, outcomes


async def first_chunk(url: str, local: str, timeout_s: float = T) -> tuple[float | None, str]:
    """A stream started from address `local`: seconds from its connect to its first chunk (None: none came
    within `timeout_s`), and what happened."""
    start = time.monotonic()
    try:
        async with connect(url, open_timeout=timeout_s, compression=None, max_size=P.MAX_CHUNK_BYTES,
                           local_addr=(local, 0)) as ws:
            await ws.send(P.encode(P.Start(prompt="a red ball moving right")))
            deadline = start + timeout_s
            while time.monotonic() < deadline:
                raw = await asyncio.wait_for(ws.recv(), deadline - time.monotonic())
                if isinstance(raw, bytes):
                    return time.monotonic() - start, "first chunk"
                msg = P.parse_server(raw)
                if isinstance(msg, P.Error):
                    return None, f"error {msg.code.value}: {msg.message}"
            return None, "no chunk in time"
    except InvalidStatus as e:
        return None, f"HTTP {e.response.status_code}"
    except (OSError, asyncio.TimeoutError, WebSocketException) as e:
        return None, f"{type(e).__name__}: {e}"


def healthz(port: int, local: str, timeout_s: float = T) -> tuple[int | None, float]:
    """GET /healthz from address `local`: its status (None: no answer within `timeout_s`) and the seconds it
    took."""
    start = time.monotonic()
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout_s, source_address=(local, 0))
    try:
        conn.request("GET", "/healthz")
        return conn.getresponse().status, time.monotonic() - start
    except OSError:
        return None, time.monotonic() - start
    finally:
        conn.close()


async def closed_by_server(sockets: list[ClientConnection], opened_at: float, bound_s: float) -> dict:
    """Wait (at most `bound_s`) for the server to close `sockets`: how many it closed, with which codes, and when
    the last one went (seconds after `opened_at`)."""
    async def one(ws: ClientConnection) -> tuple[float | None, int | None]:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(ws.wait_closed(), max(0.0, opened_at + bound_s - time.monotonic()))
            return time.monotonic() - opened_at, ws.close_code
        return None, None

    ends = await asyncio.gather(*(one(ws) for ws in sockets))
    times = [t for t, _ in ends if t is not None]
    return {"closed": len(times), "still_open": len(sockets) - len(times),
            "close_codes": dict(Counter(str(code) for t, code in ends if t is not None)),
            "last_closed_s": round(max(times), 2) if times else None,
            "first_closed_s": round(min(times), 2) if times else None}


def rss_bytes(pid: int) -> int | None:
    """A process's resident memory now (Linux /proc; None elsewhere)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
