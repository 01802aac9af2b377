"""Round two, admission (issue 41, items 1 and 2): a quiet camera and a viewer's lying reports.

    python -m benchmarks.hostile --case quiet_camera --case lying_reports

Quiet camera (`quiet_camera`): a fresh server (tiny preset, CPU, the defaults). One stream starts with input over
the WebSocket (`"input": true`) and its camera sends nothing at first: its chunks run without input once the
server's wait for a camera's first frame is over. From 8 s on its camera turns on and off every 5 s: synthetic
frames (H.264, paced at the stream's fps) for 5 s, nothing for 5 s. Once 3 chunks of it came, --viewers (16)
viewers connect at once (the load test's) and play 30 s; meanwhile one more stream starts every 5 s and closes once
its first chunk came (a new start at every phase of the camera). What must hold: every viewer admitted, 0 stalls,
and no start refused for the quiet stream's lateness. (A later start may be refused by the closed loop for the
server's own lateness: an honest 16-viewer run on a 2-core host degrades a few chunks too.) Before issue 41 each
chunk of the quiet stream was let go as text-to-video too late for its viewer, came late or was encoded cheaper,
and closed admission for everyone ("closed loop: stream s0 was late ...").

Lying reports (`lying_reports`): a fresh server; one viewer sends `stats` with `buffered_s: 0` four times a second
(the server's stats rate) and no honest ones; meanwhile --viewers viewers start and play 30 s, and one more stream
starts every 5 s. What must hold: every viewer admitted, 0 stalls, no start refused for the liar's lateness. Before
issue 41 each report marked its stream late and closed admission for everyone.

Every loop is bounded in count and time; everything runs on loopback. Prints each figure as it comes; the JSON line
is `python -m benchmarks.hostile`'s.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence

import numpy as np

from client import loadtest
from client.viewer import ClientConfig, DecodeMode
from client.ws_client import StreamClient
from streamsvc.wire import protocol as P

from .common import T


def camera(w: int = 160, h: int = 96) -> Callable[[int], np.ndarray]:
    """A synthetic camera: a bar moving across grey, another size and aspect than the model's."""
    def frame(i: int) -> np.ndarray:
        img = np.full((h, w, 3), 90, np.uint8)
        x = (4 * i) % (w - 16)
        img[:, x : x + 16] = (230, 40, 40)
        return img
    return frame


async def _later_starts(url: str, count: int, every_s: float) -> list[dict]:
    """`count` streams started one after another, every `every_s` s, each closed once its first chunk came: were
    they admitted (a new start while the attacker runs), and how fast."""
    starts = []
    for i in range(count):
        await asyncio.sleep(every_s)
        t0 = time.monotonic()
        c = StreamClient(url, ClientConfig(prompt="a green cube", seed=1000 + i, decode=DecodeMode.NONE,
                                           stats_every_s=0))
        async with c:
            got = await c.wait_until(lambda: c.chunks >= 1, T) if c.ready is not None else False
        starts.append({"admitted": c.ready is not None, "first_chunk_s": round(time.monotonic() - t0, 3) if got
                       else None, "refused": c.refused_reason})
    return starts


async def _viewers_and_starts(url: str, viewers: int, duration_s: float, every_s: float) -> tuple[dict, list[dict]]:
    """The load test's `viewers` viewers for `duration_s`, and a later start every `every_s` s meanwhile."""
    p = argparse.ArgumentParser()
    loadtest.add_arguments(p)
    args = p.parse_args(["--url", url, "--streams", str(viewers), "--duration", f"{duration_s:g}",
                         "--progress-every", "0"])
    starts = asyncio.create_task(_later_starts(url, max(0, int(duration_s / every_s) - 1), every_s))
    try:
        report = await loadtest.run_viewers(args, url, None)
    finally:
        later = await asyncio.wait_for(starts, duration_s + 2 * T)
    return report, later


async def _beside(attack: asyncio.Task, url: str, viewers: int, duration_s: float,
                  every_s: float) -> tuple[dict, list[dict], dict]:
    """The viewers and later starts (`_viewers_and_starts`) while `attack` runs, then the server's /metrics; `attack`
    is cancelled at the end, whatever happened."""
    try:
        report, later = await _viewers_and_starts(url, viewers, duration_s, every_s)
        metrics = await asyncio.to_thread(loadtest.scrape_metrics, loadtest.metrics_url(url), T) or {}
    finally:
        attack.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await attack
    return report, later, metrics


def _figures(report: dict, later: list[dict], metrics: dict, attacker: str) -> dict:
    """The viewers' and the later starts' figures, the refusals the attacker's stream (`attacker`, its id) caused
    ("closed loop: stream ID was late"), and the server's own counts of whose lateness it was."""
    reasons = [r for r, n in report["refused"]["reasons"].items() for _ in range(n)]
    reasons += [s["refused"] for s in later if not s["admitted"]]
    return {"admitted": report["admitted"], "refused": report["refused"]["reasons"], "stalls": report["stalls"]["count"],
            "stall_s": report["stalls"]["total_s"], "ttff_p95_s": report["ttff_s"]["p95"],
            "later_starts": len(later), "later_admitted": sum(s["admitted"] for s in later),
            "later_refused": [s["refused"] for s in later if not s["admitted"]],
            "refused_for_the_attacker": sum(f"stream {attacker} was late" in (r or "") for r in reasons),
            "client_late": metrics.get("streamsvc_client_late"),
            "degraded": {k.split("stage=")[1][:-1]: v for k, v in metrics.items()
                         if k.startswith("streamsvc_degraded_chunks{")},
            "refusals": {k.split("reason=")[1][:-1]: v for k, v in metrics.items()
                         if k.startswith("streamsvc_refusals_total") and v}}


def holds(viewers: int, figures: dict) -> bool:
    """What must hold in either case: every viewer admitted, 0 stalls, and no start (a viewer's or a later one)
    refused for the attacker's lateness. (A later start may still be refused by the closed loop for the server's
    own lateness: an honest 16-viewer run on a 2-core host degrades a few chunks too.)"""
    return figures.get("admitted") == viewers and figures.get("stalls") == 0 \
        and figures.get("refused_for_the_attacker") == 0


def _serve(serve_args: Sequence[str]) -> loadtest.LocalServer:
    server = loadtest.LocalServer(["--preset", "tiny", "--device", "cpu", *serve_args])
    server.start()
    return server


# ---------------------------------------------------------------- the quiet camera


async def _toggle_camera(client: StreamClient, quiet_s: float, period_s: float, until: float,
                         switched: list[float]) -> None:
    """The camera: off for `quiet_s` from now, then on and off every `period_s` until `until` (this clock); the times
    (from now) it switched go to `switched`."""
    t0 = time.monotonic()
    client.input_paused = True
    at = t0 + quiet_s
    for _ in range(int((until - t0) / period_s) + 2):  # bounded
        if at >= until:
            break
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        client.input_paused = not client.input_paused
        switched.append(round(time.monotonic() - t0, 2))
        at += period_s


async def _quiet_camera(url: str, viewers: int, duration_s: float, quiet_s: float, period_s: float,
                        every_s: float) -> dict:
    quiet = StreamClient(url, ClientConfig(prompt="a blue ball", seed=7, input=camera(), decode=DecodeMode.NONE))
    quiet.input_paused = True  # before it starts: nothing is sent at first
    async with quiet:
        if quiet.ready is None:
            return {"quiet_admitted": False, "quiet_refused": quiet.refused_reason}
        t0 = time.monotonic()
        switched: list[float] = []
        toggles = asyncio.create_task(_toggle_camera(quiet, quiet_s, period_s, t0 + quiet_s + duration_s + 2 * T,
                                                     switched))
        # its first chunks, without input, after the server's wait for a camera's first frame
        first = await quiet.wait_until(lambda: quiet.chunks >= 3, T)
        started = time.monotonic() - t0
        report, later, metrics = await _beside(toggles, url, viewers, duration_s, every_s)
    result = quiet.result()
    figures = _figures(report, later, metrics, quiet.ready.stream_id)
    figures.update(quiet_admitted=True, quiet_first_chunk=first, quiet_chunks=result.chunks,
                   quiet_missing_chunks=result.input_missing, quiet_frames_sent=result.input_sent,
                   quiet_stalls=result.playback.stalls if result.playback else None,
                   viewers_started_s=round(started, 2), camera_switched_s=switched)
    return figures


def quiet_camera(viewers: int = 16, duration_s: float = 30.0, quiet_s: float = 8.0, period_s: float = 5.0,
                 every_s: float = 5.0, serve_args: Sequence[str] = ()) -> dict:
    """The "quiet camera" must-show (module doc); its figures."""
    server = _serve(serve_args)
    try:
        figures = asyncio.run(_quiet_camera(server.ws_url, viewers, duration_s, quiet_s, period_s, every_s))
        cpu_s = server.cpu_seconds()
    finally:
        server.stop()
        log_tail = server.log_tail(8)
        server.cleanup()
    print(f"quiet camera: a stream with input, its camera off for {quiet_s:g} s, then on and off every "
          f"{period_s:g} s ({figures.get('quiet_chunks')} chunks, {figures.get('quiet_missing_chunks')} without "
          f"input, {figures.get('quiet_frames_sent')} frames sent; its own stalls {figures.get('quiet_stalls')}, "
          f"lateness charged to it {figures.get('client_late')})")
    print(f"  {viewers} viewers: {figures.get('admitted')} admitted, refused {figures.get('refused')}; stalls "
          f"{figures.get('stalls')} ({figures.get('stall_s')} s); later starts {figures.get('later_admitted')} of "
          f"{figures.get('later_starts')} admitted {figures.get('later_refused') or ''}; starts refused for the attacker's "
          f"lateness: {figures.get('refused_for_the_attacker')}")
    held = holds(viewers, figures)
    return {"case": "quiet_camera", "viewers": viewers, "duration_s": duration_s, "quiet_s": quiet_s,
            "camera_period_s": period_s, **figures, "server_cpu_s": cpu_s,
            "server_log_tail": None if held else log_tail}


# ---------------------------------------------------------------- lying reports


async def _lie(client: StreamClient, every_s: float, until: float, counts: dict) -> None:
    """`stats` with `buffered_s: 0` (and more frames played than were ever sent) every `every_s` s until `until`,
    counted in `counts["sent"]`."""
    for _ in range(int((until - time.monotonic()) / every_s) + 1):  # bounded
        if time.monotonic() >= until:
            break
        await client.send_raw(P.encode(P.Stats(buffered_s=0.0, frames_played=int(P.MAX_STAT))))
        counts["sent"] += 1
        await asyncio.sleep(every_s)


async def _lying_reports(url: str, viewers: int, duration_s: float, every_s: float, report_every_s: float) -> dict:
    liar = StreamClient(url, ClientConfig(prompt="a yellow star", seed=5, decode=DecodeMode.NONE, stats_every_s=0))
    async with liar:
        if liar.ready is None:
            return {"liar_admitted": False, "liar_refused": liar.refused_reason}
        await liar.wait_until(lambda: liar.chunks >= 1, T)
        counts = {"sent": 0}
        lies = asyncio.create_task(_lie(liar, report_every_s, time.monotonic() + duration_s + 2 * T, counts))
        await asyncio.sleep(2.0)  # its reports already going when the viewers come
        report, later, metrics = await _beside(lies, url, viewers, duration_s, every_s)
    result = liar.result()
    figures = _figures(report, later, metrics, liar.ready.stream_id)
    rate_limited = sum(1 for e in result.errors if e.startswith("rate_limited"))
    figures.update(liar_admitted=True, liar_chunks=result.chunks, liar_reports=counts["sent"],
                   liar_reports_rate_limited=rate_limited, liar_seconds=round(result.session_s, 1))
    return figures


def lying_reports(viewers: int = 16, duration_s: float = 30.0, every_s: float = 5.0, report_every_s: float = 0.25,
                  serve_args: Sequence[str] = ()) -> dict:
    """The "lying reports" must-show (module doc); its figures."""
    server = _serve(serve_args)
    try:
        figures = asyncio.run(_lying_reports(server.ws_url, viewers, duration_s, every_s, report_every_s))
        cpu_s = server.cpu_seconds()
    finally:
        server.stop()
        log_tail = server.log_tail(8)
        server.cleanup()
    print(f"lying reports: a viewer reporting buffered_s 0 every {report_every_s:g} s ({figures.get('liar_reports')} "
          f"reports, {figures.get('liar_chunks')} "
          f"chunks made for it in {figures.get('liar_seconds')} s, {figures.get('liar_reports_rate_limited')} reports "
          f"rate-limited; lateness charged to it {figures.get('client_late')})")
    print(f"  {viewers} viewers: {figures.get('admitted')} admitted, refused {figures.get('refused')}; stalls "
          f"{figures.get('stalls')} ({figures.get('stall_s')} s); later starts {figures.get('later_admitted')} of "
          f"{figures.get('later_starts')} admitted {figures.get('later_refused') or ''}; starts refused for the attacker's "
          f"lateness: {figures.get('refused_for_the_attacker')}")
    held = holds(viewers, figures)
    return {"case": "lying_reports", "viewers": viewers, "duration_s": duration_s, "report_every_s": report_every_s,
            **figures, "server_cpu_s": cpu_s, "server_log_tail": None if held else log_tail}
