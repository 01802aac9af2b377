"""Hostile clients against `streamsvc serve`, one function per case (issue 33's must-shows), each bounded in count
and time:

    python -m benchmarks.hostile                       # every case at full size
    python -m benchmarks.hostile --idle 1100 --nofile 1024 --start-timeout 10

(from the repository root, on Linux: it reads /proc for the server's open file descriptors).

Idle sockets (`idle_sockets`): a fresh server (tiny preset, CPU) runs under a file descriptor limit of --nofile,
soft and hard, as systemd gives a service by default. --idle WebSockets from 127.0.0.1 open at once, answer the
server's pings and never send `start`. Then a client from 127.0.0.2 starts a stream, timed from its connect to its
first chunk (the target is under 1 s), and asks /healthz. Then the idle sockets wait for the server to close them.
What must hold: the server keeps room for the second address (per-address and total connection caps under the fd
limit, each refused upgrade a 429 or 503 with Retry-After that holds nothing after), and closes every idle socket
by its deadline (--start-timeout), after which its file descriptors are back to where they started.

Prints each figure as it comes, then one JSON line with all of them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
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
from streamsvc import protocol as P

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


# ---------------------------------------------------------------- cases


async def _idle_sockets(server: Served, idle: int, start_timeout_s: float, concurrency: int,
                        client_timeout_s: float) -> dict:
    fds_before = server.fds()
    opened_at = time.monotonic()
    sockets, refused = await open_idle(server.url, idle, concurrency, client_timeout_s)
    held_s = time.monotonic() - opened_at
    fds_held = server.fds()
    print(f"idle sockets: {idle} from {HOST} in {held_s:.2f} s: {len(sockets)} open, refused {dict(refused)}; "
          f"server fds {fds_before} -> {fds_held}")
    ttfc, outcome = await first_chunk(server.url, GOOD, client_timeout_s)
    print(f"client from {GOOD}: {outcome}" + (f" after {ttfc:.3f} s" if ttfc is not None else ""))
    status, health_s = await asyncio.to_thread(healthz, server.port, GOOD, client_timeout_s)
    print(f"/healthz from {GOOD}: {status} in {health_s:.3f} s")
    closed = await closed_by_server(sockets, opened_at, start_timeout_s + 10.0)
    await asyncio.sleep(1.0)  # the server's side of the last closes
    fds_after = server.fds()
    print(f"idle sockets closed by the server: {closed['closed']} of {len(sockets)} (codes {closed['close_codes']}), "
          f"the last {closed['last_closed_s']} s after they opened (--start-timeout {start_timeout_s:g}); "
          f"server fds now {fds_after}")
    for ws in sockets:
        await ws.close()
    return {"idle": idle, "idle_open": len(sockets), "idle_refused": dict(refused), "open_s": round(held_s, 2),
            "good_first_chunk_s": None if ttfc is None else round(ttfc, 3), "good_outcome": outcome,
            "healthz_status": status, "healthz_s": round(health_s, 3), **{f"idle_{k}": v for k, v in closed.items()},
            "server_fds_before": fds_before, "server_fds_held": fds_held, "server_fds_after": fds_after}


def idle_sockets(idle: int = 1100, nofile: int = 1024, start_timeout_s: float = 10.0, serve_args: Sequence[str] = (),
                 concurrency: int = CONNECT_CONCURRENCY, client_timeout_s: float = T) -> dict:
    """The "idle sockets" must-show (module doc); its figures. `concurrency`: idle sockets opening at once;
    `client_timeout_s`: how long the good client and /healthz may take before they count as not served."""
    raise_own_fd_limit(idle + 256)
    args = ["--start-timeout", f"{start_timeout_s:g}", *serve_args]
    with limited_server(args, nofile) as server:
        figures = asyncio.run(_idle_sockets(server, idle, start_timeout_s, concurrency, client_timeout_s))
        figures["server_log_tail"] = server.log_tail(8) if figures["good_first_chunk_s"] is None else None
    return {"case": "idle_sockets", "nofile": nofile, "start_timeout_s": start_timeout_s, **figures}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--idle", type=int, default=1100, help="idle WebSockets from one address (default 1100)")
    p.add_argument("--nofile", type=int, default=1024, help="the server's fd limit, soft and hard (default 1024)")
    p.add_argument("--start-timeout", type=float, default=10.0, help="the server's --start-timeout (default 10)")
    p.add_argument("--server-arg", action="append", default=[], help="another flag for `streamsvc serve`")
    args = p.parse_args(argv)
    idle = idle_sockets(args.idle, args.nofile, args.start_timeout, args.server_arg)
    ok = (idle["good_first_chunk_s"] is not None and idle["good_first_chunk_s"] < 1.0
          and idle["healthz_status"] == 200 and idle["idle_still_open"] == 0)
    print(json.dumps({"idle_sockets": idle, "ok": ok}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
