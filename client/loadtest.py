"""`streamsvc loadtest`: N viewers at once against a server; TTFF, stalls, freezes, control latency.

With no ``--url`` it starts a local server process (``python -m streamsvc.cli serve``)
on a free loopback port, waits for ``GET /healthz`` to answer 200 (bounded), runs
the viewers, and stops the server at the end (also on errors and Ctrl-C). Every
viewer connects at the same moment (the hard case for TTFF and admission), opens
its own prompt, and sends a new prompt every ``--prompt-every`` seconds, each
viewer at its own phase so the prompt changes are spread out.

With ``--watchers-per-stream K`` each stream also gets K watchers (protocol.py
"Steerers and watchers"): they join over the same transport as soon as their
steerer's ``ready`` gave the stream's id and watch secret (its watch link), all
at once, never steer, and leave when their steerer does. Each is measured like
any viewer (its TTFF counts from its own connect, its join); the report gives
them in a ``watchers`` section of their own, and every top-level figure stays
the steerers'.

The prompts follow the server's model: before the viewers connect, one short
stream's ``ready`` tells its vocabulary (client/loadtest_prompts.py). A model with one
(the built-in model knows only its caption words, and draws noise for others)
gets scene captions made of those words; a model without (real weights, umT5)
gets free text. With ``--verify-pixels`` the prompts are scene captions (colour,
shape, motion; each a new colour) whatever the model, and every viewer also
times each prompt to the first played frame whose colour matches it
(client/verify.py), reported beside the control latency, which trusts the chunk
headers.

The report (a table on stdout, the same figures as JSON with ``--json``) follows
DESIGN.md "Measuring a stream"; ``summarize`` (client/loadtest_report.py) computes it from
the viewers' ``StreamResult`` s and is pure; client/loadtest_host.py says what the load test's own
machine did to the figures (its event loop's pauses, CPU steal). Transports plug in through ``TRANSPORTS``: a client
class built as ``cls(url, ClientConfig)`` whose ``await run(duration_s, prompts)``
returns a ``StreamResult``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from client.camera import FileSource
from client.loadtest_host import STEAL_WARN, LoopPauses, cpu_ticks, own_stalls, steal_fraction
from client.loadtest_metrics import bucket_key, metrics_url, scrape_metrics, server_figures  # noqa: F401 (used there)
from client.loadtest_prompts import probe_vocabulary, prompt_schedule, viewer_prompt
from client.loadtest_report import format_table, summarize, verdict
from client.start_image import check as check_image
from client.start_image import image_ref
from client.viewer import ClientConfig, DecodeMode, StreamResult, tls_context
from client.webrtc_client import WebRtcClient
from client.ws_client import StreamClient, stream_url
from streamsvc.wire.image import ImageError, is_data_url

TRANSPORTS: dict[str, type] = {"ws": StreamClient, "webrtc": WebRtcClient}
"""transport name -> client class (``cls(url, ClientConfig)``, ``await run(duration_s, prompts) -> StreamResult``)."""

class ServerStartError(RuntimeError):
    """The local server did not come up; the message says why and where its log is."""


# ---------------------------------------------------------------- arguments


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--streams", type=int, default=16, help="viewers, all connecting at once (default 16)")
    p.add_argument("--watchers-per-stream", type=int, default=0, metavar="K",
                   help="watchers of each stream, joining once its steerer is ready, over the same transport; reported "
                        "apart (default 0; a server admits --max-watchers a stream, 64 by default)")
    p.add_argument("--url", default=None,
                   help="server's WebSocket URL, e.g. ws://127.0.0.1:8000/ws (default: start a local server process)")
    p.add_argument("--duration", type=float, default=30.0, help="seconds each viewer watches, from connect (default 30)")
    p.add_argument("--prompt-every", type=float, default=5.0,
                   help="seconds between a viewer's prompt changes, phases staggered across viewers (default 5; 0 = never)")
    p.add_argument("--transport", default="ws", choices=sorted(TRANSPORTS), help="how viewers receive video (default ws)")
    p.add_argument("--fps", type=int, default=None, help="frame rate each viewer asks for (default: the server's, 16)")
    p.add_argument("--seed", type=int, default=0, help="viewer i's noise seed is SEED + i (default 0)")
    p.add_argument("--decode", default=DecodeMode.INLINE.value, choices=[m.value for m in DecodeMode],
                   help="where viewers decode H.264: inline on the event loop, in a thread, or none (default inline)")
    p.add_argument("--stats-every", type=float, default=0.5,
                   help="seconds between the viewers' stats messages to the server (default 0.5; 0 = none)")
    p.add_argument("--token", default=None,
                   help="access token the viewers send in start (a local server is started with --auth-token TOKEN)")
    p.add_argument("--ca-file", default=None, metavar="PEM",
                   help="a wss:// --url whose certificate no system CA signed: trust the CA (or the self-signed "
                        "certificate) in this file")
    p.add_argument("--insecure", action="store_true",
                   help="a wss:// --url: check no certificate at all (a self-signed one on a LAN; not on the internet)")
    p.add_argument("--json", default=None, metavar="FILE", help="write the report as JSON to FILE")
    p.add_argument("--progress-every", type=float, default=3.0, help="seconds between progress lines (default 3; 0 = quiet)")
    p.add_argument("--input", default=None, metavar="synthetic|FILE",
                   help="each viewer sends input video for its stream to restyle, paced in real time at the stream's "
                        "fps (over ws: H.264 on its WebSocket; over webrtc: a camera track on its peer connection): "
                        "'synthetic' (a scene of models/scenes.py rendered by the command line, one per viewer) or a "
                        "video FILE (looped); reports glass-to-glass latency")
    p.add_argument("--strength", type=float, default=None,
                   help="with --input: how far from the input each stream goes, 0..1 (1: text-to-video; default: the "
                        "server's, snapped to the model's schedule)")
    p.add_argument("--start-image", default=None, metavar="FILE",
                   help="every stream starts from this image (PNG, JPEG or WebP: inline in its start up to 45 KiB, "
                        "else uploaded once before the streams connect, POST /images, up to 4 MiB, and not counted "
                        "in TTFF), so that TTFF from an image can be compared with TTFF without (README: Start from "
                        "an image); not with --input")
    p.add_argument("--styles", default=None, metavar="NAME,NAME,...",
                   help="stream i starts in style i modulo the list, each one the server offers (serve --lora-dir; "
                        "'none': no style), and the report gives each style's admitted streams and stalls (README: "
                        "Styles per stream)")
    p.add_argument("--verify-pixels", action="store_true",
                   help="time each prompt from its send to the first played frame whose colour matches the prompt's "
                        "colour word (client/verify.py), reported beside the header-based control latency; the prompts "
                        "become the built-in model's scene captions (colour, shape, motion), each a new colour; needs "
                        "--decode inline or thread")
    add_server_arguments(p)


def add_server_arguments(p: argparse.ArgumentParser) -> None:
    """The local server's options (`local_serve_args` makes `streamsvc serve`'s): the load test's, the soak's."""
    g = p.add_argument_group("local server (ignored with --url)")
    g.add_argument("--preset", default="tiny", help="model preset of the local server (default tiny)")
    g.add_argument("--device", default="cpu", help="device of the local server (default cpu)")
    g.add_argument("--policy", default="slack",
                   help="scheduler policy of the local server: slack, least_slack, round_robin or fifo (default slack)")
    g.add_argument("--buffer-cap", type=float, default=None,
                   help="seconds generated ahead of each viewer at most, on the local server (default: the server's)")
    g.add_argument("--latency", default=None, choices=("default", "low"),
                   help="the local server's latency mode (default: the server's; see `streamsvc serve --help`)")
    g.add_argument("--chunk-latent-frames", type=int, default=None, choices=(1, 3),
                   help="latent frames a chunk on the local server (default: the server's, or its latency mode's)")
    g.add_argument("--kv-quant", default="none", choices=["none", "int4", "int2"],
                   help="KV cache storage of the local server (default none)")
    g.add_argument("--weights", default="auto", metavar="auto|builtin|random|FILE",
                   help="the local server's model (default auto: the tiny preset's shipped trained model; random = "
                        "random weights, the load test's figures before the built-in model; see `streamsvc serve --help`)")
    g.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for `streamsvc serve` (repeatable, e.g. --server-arg=--utilization=0.8)")
    g.add_argument("--server-timeout", type=float, default=90.0,
                   help="seconds to wait for the local server's /healthz (default 90)")


# ---------------------------------------------------------------- the local server


def local_serve_args(args) -> list[str]:
    """`streamsvc serve`'s arguments for the local server, from `add_server_arguments`' options (and --token; a
    webrtc --transport keeps ICE on loopback)."""
    serve = ["--preset", args.preset, "--device", args.device, "--policy", args.policy, "--kv-quant", args.kv_quant,
             "--weights", args.weights, *args.server_arg]
    for flag, value in (("--buffer-cap", args.buffer_cap), ("--latency", args.latency),
                        ("--chunk-latent-frames", args.chunk_latent_frames)):
        if value is not None:
            serve += [flag, str(value)]
    if getattr(args, "token", None) is not None:
        serve += ["--auth-token", args.token]
    if getattr(args, "transport", "ws") == "webrtc":  # the viewers gather on 127.0.0.1 for a local URL
        serve += ["--ice-address", "127.0.0.1"]
    return serve


class LocalServer:
    """``streamsvc serve`` in a child process on a free loopback port; a context manager."""

    def __init__(self, serve_args: Sequence[str], *, host: str = "127.0.0.1", start_timeout_s: float = 90.0) -> None:
        self.host = host
        self.serve_args = list(serve_args)
        self.start_timeout_s = start_timeout_s
        self.port: int | None = None
        self.proc: subprocess.Popen | None = None
        self._logdir = tempfile.TemporaryDirectory(prefix="streamsvc-loadtest-")
        self.log_path = Path(self._logdir.name) / "server.log"

    @property
    def ws_url(self) -> str:
        return stream_url(self.host, self.port)

    def __enter__(self) -> LocalServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        self.port = free_port(self.host)
        cmd = [sys.executable, "-m", "streamsvc.cli", "serve", "--host", self.host, "--port", str(self.port),
               *self.serve_args]
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT)
        health = f"http://{self.host}:{self.port}/healthz"
        deadline = time.monotonic() + self.start_timeout_s
        for _ in range(int(self.start_timeout_s / 0.1) + 10):
            code = self.proc.poll()
            if code is not None:
                raise ServerStartError(f"the local server exited with code {code} before it was healthy; "
                                       f"command: {' '.join(cmd)}\n{self.log_tail()}")
            if http_status(health, timeout_s=1.0) == 200:
                return
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
        self.stop()
        raise ServerStartError(f"the local server did not answer 200 on {health} within {self.start_timeout_s:g} s "
                               f"(raise --server-timeout?); command: {' '.join(cmd)}\n{self.log_tail()}")

    def stop(self, timeout_s: float = 15.0) -> int | None:
        """SIGTERM (the server closes its streams gracefully), then SIGKILL after ``timeout_s``. Idempotent."""
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        with contextlib.suppress(OSError):
            self._log.close()
        return proc.returncode

    def log_tail(self, lines: int = 20) -> str:
        if not self._log.closed:
            self._log.flush()
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no server log)"
        return "server log (last lines):\n  " + "\n  ".join(text[-lines:])

    def cpu_seconds(self) -> float | None:
        """User + system CPU time of the server process so far (Linux /proc; None elsewhere)."""
        return process_cpu_seconds(self.proc.pid) if self.proc is not None else None

    def cleanup(self) -> None:
        self._logdir.cleanup()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def http_status(url: str, timeout_s: float) -> int | None:
    """The HTTP status of GET url, or None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError, TimeoutError):
        return None


def process_cpu_seconds(pid: int) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    except (OSError, ValueError, IndexError):
        return None


# ---------------------------------------------------------------- running


@dataclass
class _Run:
    clients: list  # the steerers, one a stream
    metrics_url: str
    started_at: float
    peak_metrics: dict | None = None  # the scrape with the most open streams
    first_metrics: dict | None = None
    watchers: list = field(default_factory=list)  # the watchers started so far
    scrape_options: dict = field(default_factory=dict)  # scrape_metrics' token and TLS context


async def _progress(run: _Run, every_s: float, duration_s: float, quiet: bool) -> None:
    """One line every few seconds: open streams, chunks, buffers, stalls, prompts; and a /metrics scrape."""
    prev, prev_t = run.first_metrics, run.started_at
    for _ in range(int((duration_s + 30) / max(every_s, 0.1)) + 2):
        await asyncio.sleep(every_s)
        now = time.monotonic()
        stats = [c.stats() for c in run.clients if c.ready is not None]
        stats = [s for s in stats if s is not None]
        m = await asyncio.to_thread(scrape_metrics, run.metrics_url, 1.0, **run.scrape_options)
        open_streams = sum(1 for c in run.clients if c.ready is not None and c.closed_reason is None)
        if m is not None:
            if run.peak_metrics is None or m.get("streamsvc_kv_bytes", 0) >= run.peak_metrics.get("streamsvc_kv_bytes", 0):
                run.peak_metrics = m
        busy = "-"
        if m is not None and prev is not None and now > prev_t:
            spent = sum(m.get(f"streamsvc_forward_gpu_seconds{{kind={k}}}", 0) - prev.get(f"streamsvc_forward_gpu_seconds{{kind={k}}}", 0)
                        for k in ("recache", "denoise", "commit"))
            busy = f"{spent / (now - prev_t):.2f}"
        if m is not None:
            prev, prev_t = m, now
        if not quiet:
            buffered = [s.buffered_s for s in stats]
            watching = ""
            if run.watchers:
                ws = [w.stats() for w in run.watchers if w.ready is not None]
                ws = [s for s in ws if s is not None]
                watching = (f"  watchers {sum(1 for w in run.watchers if w.ready is not None and w.closed_reason is None)}"
                            f" (stalls {sum(s.stalls for s in ws)})")
            print(f"[{now - run.started_at:5.1f} s] open {open_streams:3d}  "
                  f"chunks {sum(c.chunks for c in run.clients):5d}  "
                  f"buffer min {min(buffered, default=0):.2f} s  stalls {sum(s.stalls for s in stats)}  "
                  f"prompts settled {sum(len(s.control_latencies_s) for s in stats)}  engine busy {busy}{watching}",
                  flush=True)
        if all(c.state.value in ("closed", "refused") for c in [*run.clients, *run.watchers]):
            return


async def _stream(run: _Run, steerer, schedule: list[tuple[float, str]], duration_s: float, watchers: int,
                  make_watcher) -> tuple[StreamResult, list[StreamResult], int]:
    """One stream: its steerer's session, and ``watchers`` watchers (``make_watcher(ready)``: the steerer's ready names
    the stream and its watch secret) that join at once when its ready came and watch until the steerer's session is
    due to end. Returns the steerer's result, the watchers' results, and how many watchers never started (the stream
    was refused or failed, or ended first)."""
    session = asyncio.create_task(steerer.run(duration_s, schedule))
    results: list[StreamResult] = []
    not_started = 0
    try:
        if watchers > 0:
            # open() sets the event whatever happens, within its own timeout; the margin is for a busy loop
            if await steerer.wait_opened(steerer.config.open_timeout_s + 10.0):
                left = steerer.connected_at + duration_s - time.monotonic()
            else:
                left = 0.0
            if left > 0 and not session.done():
                clients = [make_watcher(steerer.ready) for _ in range(watchers)]
                run.watchers.extend(clients)
                results = list(await asyncio.gather(*(w.run(left) for w in clients)))
            else:
                not_started = watchers
        return await session, results, not_started
    finally:
        if not session.done():  # (only when this was cancelled or a watcher raised)
            session.cancel()
            await asyncio.wait([session], timeout=steerer.config.close_timeout_s + 1.0)


async def run_viewers(args, url: str, server: LocalServer | None) -> dict:
    """Run every viewer at once (and each stream's watchers once its steerer is ready); the report (without the
    CPU figures of the caller)."""
    cls = TRANSPORTS[args.transport]
    per_stream = getattr(args, "watchers_per_stream", 0)
    everyone = args.streams * (1 + per_stream)
    tls = {"ca_file": getattr(args, "ca_file", None), "insecure": getattr(args, "insecure", False)}  # wss://
    probed, vocabulary = await probe_vocabulary(url, args.token, max(10.0, 0.25 * args.streams), tls)
    captions = args.verify_pixels or bool(vocabulary) or not probed  # (captions read as plain English to any model)
    prompts = {"captions": captions, "vocabulary_words": None if vocabulary is None else len(vocabulary),
               "probe_admitted": probed, "opening": [viewer_prompt(i, 0, captions, vocabulary) for i in range(3)]}
    if vocabulary:
        print(f"prompts: captions in the words of the server model's vocabulary ({len(vocabulary)} words)", flush=True)
    elif not probed:
        print("prompts: captions (the probe stream was refused, so the server's model is unknown)", flush=True)
    elif not captions:
        print("prompts: free text (the server's model reads any text)", flush=True)
    sources = getattr(args, "input_sources", None)  # input video: one frame source a viewer (--input)
    if sources is None and getattr(args, "input", None) not in (None, "synthetic"):
        sources = [FileSource(args.input, max_frames=128, width=480)]  # (at most 480 wide: 50 MB held, looped)
    image = await start_image(args, url, tls)
    clients = []
    for i in range(args.streams):
        prompt = viewer_prompt(i, 0, captions, vocabulary)
        camera = {"input": sources[i % len(sources)], "strength": args.strength} if sources else {}
        cfg = ClientConfig(prompt=prompt, seed=args.seed + i, fps=args.fps, token=args.token, image=image,
                           lora=stream_style(args, i),
                           stats_every_s=args.stats_every, decode=DecodeMode(args.decode),
                           open_timeout_s=max(10.0, 0.25 * args.streams), verify_pixels=args.verify_pixels,
                           **camera, **tls)
        clients.append(cls(url, cfg))

    def make_watcher(ready):  # a watcher of the stream its steerer's ready names, by its watch link (id and secret)
        return cls(url, ClientConfig(watch=ready.stream_id, secret=ready.watch_secret, token=args.token,
                                     stats_every_s=args.stats_every, decode=DecodeMode(args.decode),
                                     open_timeout_s=max(10.0, 0.25 * everyone), **tls))

    murl = metrics_url(url)
    scrape = {"token": args.token, "ssl_context": tls_context(tls["ca_file"], tls["insecure"])}
    first = await asyncio.to_thread(scrape_metrics, murl, 2.0, **scrape)
    run = _Run(clients, murl, time.monotonic(), first_metrics=first, scrape_options=scrape)
    progress = asyncio.create_task(_progress(run, args.progress_every or 1.0, args.duration, quiet=args.progress_every <= 0))
    pauses = LoopPauses()
    watch = asyncio.create_task(pauses.run(time.monotonic() + args.duration + 30.0))
    try:
        streams = await asyncio.gather(*(
            _stream(run, c, prompt_schedule(i, args.streams, args.prompt_every, args.duration, captions, vocabulary),
                    args.duration, per_stream, make_watcher)
            for i, c in enumerate(clients)
        ))
    finally:
        progress.cancel()
        watch.cancel()
        await asyncio.wait([progress, watch], timeout=2)
    results = [r for r, _, _ in streams]
    wall = time.monotonic() - run.started_at
    last = await asyncio.to_thread(scrape_metrics, murl, 2.0, **scrape)
    if per_stream > 0:
        watchers = [w for _, ws, _ in streams for w in ws]
        report = summarize(results, duration_s=args.duration, watchers=watchers, watchers_per_stream=per_stream,
                           watchers_not_started=sum(n for _, _, n in streams))
        report["watchers"]["stalls"]["during_own_pauses"] = own_stalls(watchers, pauses.pauses)
    else:
        report = summarize(results, duration_s=args.duration)
    report["stalls"]["during_own_pauses"] = own_stalls(results, pauses.pauses)
    report["client_loop"] = pauses.figures()
    report["prompts"] = prompts
    if getattr(args, "styles", None):
        report["styles"] = style_figures(results, [stream_style(args, i) for i in range(args.streams)])
    report["server"] = server_figures(first, last, wall, run.peak_metrics)
    return report


def stream_style(args, i: int) -> str | None:
    """The style stream i starts in (--styles, round robin; 'none' or no --styles: none)."""
    names = (getattr(args, "styles", None) or "none").split(",")
    name = names[i % len(names)].strip()
    return None if name in ("", "none") else name


def style_figures(results: Sequence[StreamResult], styles: Sequence[str | None]) -> dict:
    """Each style's streams (--styles): admitted, refused (with the reasons) and the admitted ones' stalls."""
    out: dict[str, dict] = {}
    for result, style in zip(results, styles):
        row = out.setdefault(style or "none", {"streams": 0, "admitted": 0, "refused": Counter(), "stalls": 0,
                                               "stall_s": 0.0})
        row["streams"] += 1
        if result.admitted and result.playback is not None:
            row["admitted"] += 1
            row["stalls"] += result.playback.stalls
            row["stall_s"] = round(row["stall_s"] + result.playback.stall_s, 3)
        elif result.refused_reason is not None:
            row["refused"][result.refused_reason] += 1
    return {name: row | {"refused": dict(row["refused"])} for name, row in out.items()}


def start_image_error(args) -> str | None:
    """What is wrong with --start-image before any server is asked (None: nothing, or no --start-image)."""
    if getattr(args, "start_image", None) is None:
        return None
    if getattr(args, "input", None) is not None:
        return "not with --input: a stream starts from an image or restyles input video, not both"
    try:
        check_image(Path(args.start_image).read_bytes())
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    except ImageError as e:
        return str(e)
    return None


async def start_image(args, url: str, tls: dict) -> str | None:
    """--start-image FILE as every stream's start names it (client/start_image.py: inline, or uploaded once now)."""
    if getattr(args, "start_image", None) is None:
        return None
    data = Path(args.start_image).read_bytes()
    context = tls_context(tls["ca_file"], tls["insecure"])
    image = await asyncio.to_thread(image_ref, data, url, args.token, context)
    print(f"start image {args.start_image}: {len(data)} bytes, "
          f"{'inline in each start' if is_data_url(image) else 'uploaded once'}", flush=True)
    return image


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run(args, input_sources: list | None = None) -> int:
    """The load test; `input_sources`: with --input synthetic, one frame source per viewer (the command line renders
    them: the client imports no models)."""
    args.input_sources = input_sources
    if getattr(args, "input", None) == "synthetic" and not input_sources:
        print("streamsvc loadtest: --input synthetic needs the command line's rendered scenes (run `streamsvc "
              "loadtest`); or give --input FILE", file=sys.stderr)
        return 2
    if args.streams < 1 or args.duration <= 0 or args.watchers_per_stream < 0:
        print("streamsvc loadtest: --streams must be >= 1, --duration > 0 and --watchers-per-stream >= 0",
              file=sys.stderr)
        return 2
    image_error = start_image_error(args)
    if image_error is not None:
        print(f"streamsvc loadtest: --start-image {args.start_image}: {image_error}", file=sys.stderr)
        return 2
    if args.verify_pixels and args.decode == DecodeMode.NONE.value:
        print("streamsvc loadtest: --verify-pixels reads the frames: use --decode inline or thread", file=sys.stderr)
        return 2
    if args.url is not None and not args.url.startswith(("ws://", "wss://")):
        print(f"streamsvc loadtest: --url {args.url}: the server's WebSocket URL starts with ws:// or wss:// (e.g. "
              "ws://127.0.0.1:8000/ws)", file=sys.stderr)
        return 2
    server, started = None, False
    wall0, load0 = time.monotonic(), os.getloadavg()
    old_term = signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM cleans up like Ctrl-C (no orphaned server)
    try:
        if args.url is None:
            serve_args = local_serve_args(args)
            server = LocalServer(serve_args, start_timeout_s=args.server_timeout)
            shown = ["***" if prev == "--auth-token" else arg for prev, arg in zip(["", *serve_args], serve_args)]
            print(f"starting a local server: streamsvc serve {' '.join(shown)}", flush=True)  # the token not shown
            server.start()
            started = True
            print(f"server up at {server.ws_url} after {time.monotonic() - wall0:.1f} s", flush=True)
            url = server.ws_url
        else:
            url = args.url
        watching = f" and {args.watchers_per_stream} watchers a stream" if args.watchers_per_stream else ""
        print(f"{args.streams} viewers{watching} for {args.duration:g} s over {args.transport}, "
              f"prompt every {args.prompt_every:g} s", flush=True)
        srv_cpu0, t0, cpu1 = server.cpu_seconds() if server else None, time.monotonic(), time.process_time()
        ticks0 = cpu_ticks()
        report = asyncio.run(run_viewers(args, url, server))
        wall = time.monotonic() - t0
        srv_cpu1 = server.cpu_seconds() if server else None
        steal = steal_fraction(ticks0, cpu_ticks())
    except ServerStartError as e:
        print(f"streamsvc loadtest: {e}", file=sys.stderr)
        return 3
    except ImageError as e:
        print(f"streamsvc loadtest: --start-image {args.start_image}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("streamsvc loadtest: interrupted", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, old_term)
        if server is not None:
            code = server.stop()  # idempotent; SIGTERM -> the server closes its streams gracefully
            if started and code not in (0, None, -signal.SIGTERM):  # (a failed start was reported above)
                print(f"streamsvc loadtest: the local server exited with code {code}\n{server.log_tail()}",
                      file=sys.stderr)
            server.cleanup()
    report["cpu"] = {
        "cores": os.cpu_count(),
        "client_cores": round((time.process_time() - cpu1) / wall, 3),
        "server_cores": round((srv_cpu1 - srv_cpu0) / wall, 3) if srv_cpu0 is not None and srv_cpu1 is not None else None,
        "loadavg_start": [round(x, 2) for x in load0],
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        "steal": None if steal is None else round(steal, 3),
    }
    if steal is not None and steal > STEAL_WARN:
        print(f"note: the hypervisor took {steal:.0%} of this machine's CPU time during the run (steal); "
              "stalls on a CPU server are then a measure of the host, not of streamsvc", flush=True)
    report["config"] = {"url": args.url, "transport": args.transport, "local_server": args.url is None,
                        "preset": args.preset, "weights": args.weights, "device": args.device, "policy": args.policy,
                        "buffer_cap_s": args.buffer_cap, "latency": args.latency,
                        "chunk_latent_frames": args.chunk_latent_frames, "prompt_every_s": args.prompt_every,
                        "decode": args.decode, "stats_every_s": args.stats_every, "server_args": args.server_arg,
                        "verify_pixels": args.verify_pixels, "watchers_per_stream": args.watchers_per_stream,
                        "input": getattr(args, "input", None), "strength": getattr(args, "strength", None),
                        "start_image": getattr(args, "start_image", None)}
    print(format_table(report))
    print(verdict(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote the report as JSON to {args.json}")
    else:
        print("(--json FILE writes the report as JSON)")
    if report["admitted"] == 0 and report["refused"]["count"] == 0:
        print("streamsvc loadtest: no viewer got a stream (see errors above)", file=sys.stderr)
        return 1
    return 0
