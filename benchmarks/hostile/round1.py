"""Round one (issue 33): idle sockets, poisoned admission, slow readers.
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

Poisoned admission (`poisoned_admission`): a fresh server (tiny preset, CPU, the defaults); a client with no
stream, from 127.0.0.2, floods it with junk WebSocket frames and GET /metrics for --flood-seconds (40); 6 s in,
--viewers (16) viewers from 127.0.0.1 connect at once and play 30 s while the flood still runs; once they have left,
one more stream starts. What must hold: every viewer admitted, 0 stalls, the last stream admitted.

    python -m benchmarks.hostile --case poisoned_admission

Slow readers (`slow_readers`): a fresh server serves a 64 MiB recording (a file with a recording's name, made here)
to three slow readers, one from each of 127.0.0.1-3, reading 256 KiB/s for 10 s. What must hold: the server's RSS
grows by under 50 MiB (each request read the whole file into memory before issue 33), and /healthz answers.

Prints each figure as it comes, then one JSON line with all of them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import multiprocessing
import os
import resource
import secrets
import socket
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from client import loadtest
from client.viewer import ClientConfig
from client.ws_client import StreamClient

from .common import (
    CONNECT_CONCURRENCY,
    GOOD,
    HOST,
    Served,
    T,
    closed_by_server,
    first_chunk,
    healthz,
    limited_server,
    open_idle,
    raise_own_fd_limit,
    rss_bytes,
)

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


# ---------------------------------------------------------------- poisoned admission


FLOODER = "127.0.0.2"  # the poisoned-admission case's attacker (its viewers come from HOST)
JUNK = (b"{not json", b"\x00\x01junk", b'{"type": "set_prompt"}', b'{"type": "no such message"}')
UPGRADE = ("GET /ws HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
           "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n")


def _masked_frames(count: int) -> bytes:
    """`count` junk client frames (text and binary, masked with a zero key as RFC 6455 allows), back to back."""
    frames = []
    for i in range(count):
        payload = JUNK[i % len(JUNK)]
        opcode = 0x2 if payload.startswith(b"\x00") else 0x1
        frames.append(bytes([0x80 | opcode, 0x80 | len(payload)]) + b"\x00\x00\x00\x00" + payload)
    return b"".join(frames)


def _junk_frames(port: int, stop_at: float, max_frames: int, counts: Counter, duration_s: float) -> None:
    """WebSockets from FLOODER that never send `start`, each sending junk frames as fast as the server takes them
    until it closes (then another), until `stop_at` or `max_frames`."""
    batch = _masked_frames(64)
    while time.monotonic() < stop_at and counts["frames"] < max_frames:
        try:
            sock = socket.create_connection((HOST, port), timeout=5, source_address=(FLOODER, 0))
        except OSError as e:
            counts[f"connect error: {type(e).__name__}"] += 1
            time.sleep(0.05)
            continue
        with sock:
            try:
                sock.sendall(UPGRADE.format(host=HOST, port=port).encode())
                head = b""
                while b"\r\n\r\n" not in head and len(head) < 65536:
                    data = sock.recv(4096)
                    if not data:
                        break
                    head += data
                status = head.split(b" ", 2)[1].decode() if head.count(b" ") >= 2 else "none"
                if status != "101":
                    counts[f"upgrade {status}"] += 1
                    time.sleep(0.05)
                    continue
                counts["connections"] += 1
                drain = threading.Thread(target=_drain_socket, args=(sock,), daemon=True)
                drain.start()
                while time.monotonic() < stop_at and counts["frames"] < max_frames:
                    sock.sendall(batch)
                    counts["frames"] += 64
            except OSError:
                counts["closed by the server"] += 1
    counts["junk_s"] = round(duration_s - (stop_at - time.monotonic()), 1)  # how long the junk flood lasted


def _drain_socket(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while sock.recv(1 << 16):
            pass


def _metrics_requests(port: int, stop_at: float, max_requests: int, counts: Counter) -> None:
    """GET /metrics from FLOODER on a kept-alive connection (another when it closes), until `stop_at` or
    `max_requests`; each status counted."""
    conn = None
    while time.monotonic() < stop_at and counts["metrics requests"] < max_requests:
        try:
            if conn is None:
                conn = http.client.HTTPConnection(HOST, port, timeout=5, source_address=(FLOODER, 0))
            conn.request("GET", "/metrics")
            response = conn.getresponse()
            response.read()
            counts["metrics requests"] += 1
            counts[f"metrics {response.status}"] += 1
            if response.will_close:
                conn.close()
                conn = None
        except (OSError, http.client.HTTPException) as e:
            counts[f"metrics error: {type(e).__name__}"] += 1
            if conn is not None:
                conn.close()
            conn = None
            time.sleep(0.01)


def _flood(port: int, duration_s: float, max_frames: int, max_requests: int, out) -> None:
    """The flooding client (its own process): junk frames and /metrics at once for `duration_s`; its counts to `out`."""
    stop_at = time.monotonic() + duration_s
    counts: Counter = Counter()
    threads = [threading.Thread(target=_junk_frames, args=(port, stop_at, max_frames, counts, duration_s)),
               threading.Thread(target=_metrics_requests, args=(port, stop_at, max_requests, counts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    counts["flooder_cpu_s"] = round(usage.ru_utime + usage.ru_stime, 2)  # what the attack took of this host's CPU
    counts["frames_per_s"] = round(counts["frames"] / duration_s)
    counts["metrics_per_s"] = round(counts["metrics requests"] / duration_s, 1)
    out.put(dict(counts))


async def _after_empty(url: str) -> dict:
    """One stream started once every viewer has left (the lock-out of issue 33 refused it, 0 streams open)."""
    client = StreamClient(url, ClientConfig(prompt="a red ball moving right", seed=1, stats_every_s=0))
    async with client:
        got = await client.wait_until(lambda: client.chunks >= 1, T) if client.ready is not None else False
    return {"admitted": client.ready is not None, "first_chunk": bool(got), "refused": client.refused_reason}


def poisoned_admission(viewers: int = 16, duration_s: float = 30.0, flood_s: float = 40.0, lead_s: float = 6.0,
                       max_frames: int = 100_000_000, max_requests: int = 500_000,
                       serve_args: Sequence[str] = ()) -> dict:
    """The "poisoned admission" must-show: a fresh `streamsvc serve` (tiny preset, CPU, the defaults); a client with
    no stream, from FLOODER, floods it with junk WebSocket frames and GET /metrics for `flood_s` (bounded by
    `max_frames` and `max_requests` too); `lead_s` into the flood, `viewers` viewers from HOST connect at once (the
    load test's) and play `duration_s` while the flood still runs. Then, every viewer gone, one more stream starts.
    What must hold: every viewer admitted, 0 stalls, and the last stream admitted (before issue 33's fix: the
    second viewer on was refused by the send's estimate, and so was every stream once the server emptied)."""
    server = loadtest.LocalServer(["--preset", "tiny", "--device", "cpu", *serve_args])
    server.start()
    try:
        ctx = multiprocessing.get_context("fork")
        out = ctx.Queue()
        flooder = ctx.Process(target=_flood, args=(server.port, flood_s, max_frames, max_requests, out), daemon=True)
        flooder.start()
        time.sleep(lead_s)
        p = argparse.ArgumentParser()
        loadtest.add_arguments(p)
        args = p.parse_args(["--url", server.ws_url, "--streams", str(viewers), "--duration", f"{duration_s:g}",
                             "--progress-every", "0"])
        report = asyncio.run(loadtest.run_viewers(args, server.ws_url, None))
        flood_left_s = flood_s - lead_s - duration_s
        flooder.join(max(0.0, flood_left_s) + T)
        flood = out.get(timeout=T) if not flooder.is_alive() else {"error": "the flooder did not end"}
        after = asyncio.run(_after_empty(server.ws_url))
        metrics = loadtest.scrape_metrics(loadtest.metrics_url(server.ws_url), T) or {}
        cpu_s = server.cpu_seconds()
    finally:
        server.stop()
        log_tail = server.log_tail(8)
        server.cleanup()
    refused = report["refused"]
    stalls = report["stalls"]
    print(f"poisoned admission: flood from {FLOODER} for {flood_s:g} s: {flood}")
    print(f"  {viewers} viewers from {HOST}, {lead_s:g} s into the flood: {report['admitted']} admitted, refused "
          f"{refused['reasons']}; stalls {stalls['count']} ({stalls['total_s']} s)")
    print(f"  once they left, one more stream: {after}")
    return {"case": "poisoned_admission", "viewers": viewers, "duration_s": duration_s, "flood_s": flood_s,
            "lead_s": lead_s, "admitted": report["admitted"], "refused": refused["reasons"],
            "stalls": stalls["count"], "stall_s": stalls["total_s"], "ttff_p95_s": report["ttff_s"]["p95"],
            "flood": flood, "after_empty": after, "server_cpu_s": cpu_s,
            "streamless_cpu_s": metrics.get("streamsvc_streamless_cpu_seconds"),
            "refusals": {k.split("reason=")[1][:-1]: v for k, v in metrics.items()
                         if k.startswith("streamsvc_refusals_total") and v},
            "server_log_tail": log_tail if report["admitted"] < viewers or not after["admitted"] else None}


# ---------------------------------------------------------------- slow readers


SLOW_READERS = ("127.0.0.1", "127.0.0.2", "127.0.0.3")  # one reader from each address (the download cap is per address)


def _slow_reader(port: int, source: str, path: str, seconds: float, rate_bps: int, got: dict) -> None:
    """GET `path` from `source` on a socket with a small receive buffer, reading `rate_bps` bytes a second for
    `seconds`, then hang up (a viewer on a slow link, or an attacker holding responses open)."""
    piece, period = 16 << 10, (16 << 10) / rate_bps
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32 << 10)
        sock.settimeout(T)
        sock.bind((source, 0))
        sock.connect((HOST, port))
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {HOST}:{port}\r\n\r\n".encode())
        head = sock.recv(4096)
        got[source] = {"status": head.split(b" ", 2)[1].decode() if head.count(b" ") >= 2 else "none", "bytes": 0}
        stop_at = time.monotonic() + seconds
        while time.monotonic() < stop_at:
            data = sock.recv(piece)
            if not data:
                break
            got[source]["bytes"] += len(data)
            time.sleep(period)


def slow_readers(size_mib: int = 64, seconds: float = 10.0, rate_kib_s: int = 256,
                 serve_args: Sequence[str] = ()) -> dict:
    """The "slow readers" must-show: a recording of `size_mib` MiB (a file with a recording's name, made here: no
    stream needs to run for minutes) served by a fresh server; one slow reader from each of SLOW_READERS reads it
    at `rate_kib_s` KiB/s for `seconds`. The server's RSS is sampled before and during (the target: under 50 MiB
    added for the three), and /healthz is timed while they read. Before issue 33, each request read the whole
    file into memory on the event loop."""
    with tempfile.TemporaryDirectory(prefix="streamsvc-slow-") as directory:
        name = f"s0-20261206T000000-{secrets.token_hex(16)}.mp4"
        with open(Path(directory) / name, "wb") as f:
            chunk = os.urandom(1 << 20)
            for _ in range(size_mib):
                f.write(chunk)
        with limited_server(["--recordings-dir", directory, *serve_args], 4096) as server:
            time.sleep(1.0)  # past the start's transients
            before = rss_bytes(server.proc.pid)
            got: dict = {}
            readers = [threading.Thread(target=_slow_reader, args=(server.port, source, f"/recordings/{name}",
                                                                 seconds, rate_kib_s << 10, got), daemon=True)
                       for source in SLOW_READERS]
            for t in readers:
                t.start()
            peak, health = before or 0, []
            stop_at = time.monotonic() + seconds
            while time.monotonic() < stop_at:
                peak = max(peak, rss_bytes(server.proc.pid) or 0)
                health.append(healthz(server.port, GOOD, 5.0)[1])
                time.sleep(0.2)
            for t in readers:
                t.join(T)
            added_mib = (peak - before) / (1 << 20) if before else None
    print(f"slow readers: {len(SLOW_READERS)} readers of a {size_mib} MiB recording at {rate_kib_s} KiB/s for "
          f"{seconds:g} s: RSS {before / (1 << 20):.1f} MiB before, +{added_mib:.1f} MiB at the peak; /healthz max "
          f"{max(health) * 1e3:.1f} ms; {got}")
    return {"case": "slow_readers", "size_mib": size_mib, "readers": got, "rss_before_mib": round(before / (1 << 20), 1),
            "rss_added_mib": round(added_mib, 1), "healthz_max_ms": round(max(health) * 1e3, 1)}
