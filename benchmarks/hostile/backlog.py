"""Round two, the client that never reads (issue 41, item 4).

    python -m benchmarks.hostile --case never_reads

Never reads (`never_reads`): a fresh server (tiny preset, CPU, the defaults). --viewers (4 here by default: the
case's `viewers`) viewers from 127.0.0.1 start and play 20 s (the load test's). 4 s in, an attacker from 127.0.0.2
(a process of its own, on a raw socket with a small receive buffer) starts a stream with input (`"input": true`),
reads its `ready`, and from then on reads nothing: it sends 8-byte binary messages that are not input, as fast as
the socket takes them, until the server drops it (a send fails) or 15 s pass. The server's RSS is sampled from the
attack's start to the viewers' end. What must hold: the server's RSS grows by under 32 MiB, the attacker is
disconnected within 10 s, and the viewers see 0 stalls. Before issue 41 each message was answered with a `bad_chunk`
error queued on an unbounded outbox (1.4 million in 9 s grew the server by 195-451 MiB) and none counted as a
protocol error; now they do (--max-protocol-errors closes it), error replies have a rate of their own, and an outbox
past its bound closes its connection. Once disconnected, the attacker reads what the socket still holds, to report
the close frame's code (the server's close reaches it only if it came before the server dropped the socket).

Every loop is bounded in count and time; everything runs on loopback. Prints each figure as it comes; the JSON line
is `python -m benchmarks.hostile`'s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import socket
import struct
import threading
import time
from collections.abc import Sequence

from client import loadtest
from streamsvc.wire import protocol as P

from .common import HOST, T, limited_server, rss_bytes

ATTACKER = "127.0.0.2"  # the attacker's address (the viewers come from HOST)
BATCH = 1024  # garbage messages per write
UPGRADE = ("GET /ws HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
           "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n")


def _client_frame(opcode: int, payload: bytes) -> bytes:
    """A masked client frame (a zero key, which RFC 6455 allows: the payload goes as it is)."""
    n = len(payload)
    head = bytes([0x80 | opcode]) + (bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + struct.pack("!H", n))
    return head + b"\x00\x00\x00\x00" + payload


def _server_frames(data: bytes) -> list[tuple[int, bytes]]:
    """The whole server frames (unmasked) at the start of `data`: (opcode, payload) each."""
    frames, i = [], 0
    for _ in range(len(data)):
        if len(data) - i < 2:
            break
        opcode, n = data[i] & 0x0F, data[i + 1] & 0x7F
        start = i + 2
        if n == 126:
            n, start = struct.unpack("!H", data[start:start + 2])[0], start + 2
        elif n == 127:
            n, start = struct.unpack("!Q", data[start:start + 8])[0], start + 8
        if len(data) < start + n:
            break
        frames.append((opcode, data[start:start + n]))
        i = start + n
    return frames


def _attack(port: int, max_s: float, out) -> None:
    """The attacker (its own process): a stream with input, then garbage input as fast as the socket takes it, never
    reading, until a send fails or `max_s`; its figures to `out`."""
    figures: dict = {"sent": 0, "ended": f"still open after {max_s:g} s", "disconnected_s": None}
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: the server's sends back up soon
    sock.bind((ATTACKER, 0))
    sock.settimeout(T)
    try:
        sock.connect((HOST, port))
        sock.sendall(UPGRADE.format(host=HOST, port=port).encode())
        sock.sendall(_client_frame(0x1, P.encode(P.Start(prompt="a red ball moving right", input=True)).encode()))
        data = b""
        for _ in range(1000):  # to its `ready` (or a refusal): the last thing it reads
            if b"\r\n\r\n" in data and _server_frames(data.split(b"\r\n\r\n", 1)[1]):
                break
            data += sock.recv(4096)
        _, rest = data.split(b"\r\n\r\n", 1)
        first = _server_frames(rest)[0][1].decode()
        figures["ready"] = json.loads(first).get("type") == "ready"
        if not figures["ready"]:
            figures["ended"] = f"not admitted: {first[:200]}"
            out.put(figures)
            return
        batch = _client_frame(0x2, b"garbage!") * BATCH
        sock.settimeout(1.0)
        t0 = time.monotonic()
        while time.monotonic() - t0 < max_s:
            try:
                sock.sendall(batch)
                figures["sent"] += BATCH
            except TimeoutError:
                continue  # the server reads nothing for a second (it may have stopped reading): still connected
            except OSError as e:
                figures["disconnected_s"] = round(time.monotonic() - t0, 3)
                figures["ended"] = f"{type(e).__name__}: {e}"
                break
        figures["close"] = _close_frame(sock)
    except OSError as e:
        figures["ended"] = f"{type(e).__name__} before the attack: {e}"
    finally:
        sock.close()
    out.put(figures)


def _close_frame(sock: socket.socket) -> str | None:
    """What the socket still holds after the disconnect: the server's close frame ("CODE reason"), if it got there."""
    sock.settimeout(1.0)
    data = b""
    try:
        for _ in range(4096):
            piece = sock.recv(1 << 16)
            if not piece:
                break
            data += piece
    except OSError:
        pass
    for opcode, payload in _server_frames(data):
        if opcode == 0x8 and len(payload) >= 2:
            return f"{struct.unpack('!H', payload[:2])[0]} {payload[2:].decode(errors='replace')}"
    return None


def _sample_rss(pid: int, stop: threading.Event, samples: list[int]) -> None:
    for _ in range(100_000):
        if stop.is_set():
            return
        rss = rss_bytes(pid)
        if rss is not None:
            samples.append(rss)
        time.sleep(0.1)


def never_reads(viewers: int = 4, duration_s: float = 20.0, lead_s: float = 4.0, attack_s: float = 15.0,
                serve_args: Sequence[str] = ()) -> dict:
    """The "client that never reads" must-show (module doc): its figures."""
    with limited_server(serve_args, 4096) as server:
        p = argparse.ArgumentParser()
        loadtest.add_arguments(p)
        args = p.parse_args(["--url", server.url, "--streams", str(viewers), "--duration", f"{duration_s:g}",
                             "--progress-every", "0"])
        ctx = multiprocessing.get_context("fork")
        out = ctx.Queue()
        attacker = ctx.Process(target=_attack, args=(server.port, attack_s, out), daemon=True)
        stop, samples = threading.Event(), []
        sampler = threading.Thread(target=_sample_rss, args=(server.proc.pid, stop, samples), daemon=True)

        def attack_later() -> None:
            time.sleep(lead_s)  # the viewers play by then
            samples.append(rss_bytes(server.proc.pid) or 0)
            sampler.start()
            attacker.start()

        starter = threading.Thread(target=attack_later, daemon=True)
        starter.start()
        cpu_before = loadtest.process_cpu_seconds(server.proc.pid)
        report = asyncio.run(loadtest.run_viewers(args, server.url, None))
        starter.join(T)
        attacker.join(attack_s + T)
        attack = out.get(timeout=T) if not attacker.is_alive() else {"ended": "the attacker did not end"}
        stop.set()
        sampler.join(T)
        cpu_s = loadtest.process_cpu_seconds(server.proc.pid) - cpu_before
        metrics = loadtest.scrape_metrics(loadtest.metrics_url(server.url), T) or {}
        log_tail = server.log_tail(8)
    before, peak = samples[0], max(samples)
    added_mib = (peak - before) / (1 << 20)
    stalls = report["stalls"]
    refusals = {k.split("reason=")[1][:-1]: v for k, v in metrics.items()
                if k.startswith("streamsvc_refusals_total") and v}
    print(f"never reads: attacker from {ATTACKER}: {attack}")
    print(f"  server RSS {before / (1 << 20):.1f} MiB at the attack's start, +{added_mib:.1f} MiB at the peak; "
          f"{cpu_s:.1f} CPU-s over the run; refusals {refusals}; error replies dropped "
          f"{metrics.get('streamsvc_error_replies_dropped_total')}")
    print(f"  {viewers} viewers from {HOST} for {duration_s:g} s: {report['admitted']} admitted, stalls "
          f"{stalls['count']} ({stalls['total_s']} s)")
    return {"case": "never_reads", "viewers": viewers, "duration_s": duration_s, "lead_s": lead_s,
            "attack": attack, "rss_before_mib": round(before / (1 << 20), 1), "rss_added_mib": round(added_mib, 1),
            "admitted": report["admitted"], "stalls": stalls["count"], "stall_s": stalls["total_s"],
            "server_cpu_s": round(cpu_s, 1), "refusals": refusals,
            "error_replies_dropped": metrics.get("streamsvc_error_replies_dropped_total"),
            "server_log_tail": log_tail if attack.get("disconnected_s") is None else None}


def never_reads_holds(viewers: int, f: dict) -> bool:
    """RSS growth under 32 MiB, the attacker disconnected within 10 s, every viewer admitted and 0 stalls."""
    gone = f["attack"].get("disconnected_s")
    return f["rss_added_mib"] < 32 and gone is not None and gone < 10 and f["admitted"] == viewers and f["stalls"] == 0
