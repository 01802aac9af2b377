"""Soak: N streams for T minutes with churn; every minute what the server holds, how late its chunks are, and what the
pictures show; at the end, what grew and what drifted.

    python benchmarks/soak.py --streams 16 --minutes 60                   # a local server: tiny, CPU, shipped weights
    python benchmarks/soak.py --streams 4 --minutes 3                     # a short look
    python benchmarks/soak.py --url ws://127.0.0.1:8000/ws --streams 2 --minutes 8 --sample-every 8   # a running one
    python benchmarks/soak.py --preset wan2.1-1.3b --device cuda --streams 2 --minutes 8
    python benchmarks/soak.py --streams 2 --minutes 4 --minute-s 6 --session-s 120    # a test: minutes of 6 s

With no `--url` it starts `streamsvc serve` on a free loopback port as `streamsvc loadtest` does (client/loadtest.py
`LocalServer`, the same server options), and stops it at the end. The viewers are the load test's WebSocket clients
(client/ws_client.py) with its prompts (client/loadtest_prompts.py: scene captions for a model with a vocabulary, as
the built-in one, free text for others). Each of the N slots (benchmarks/soak_churn.py) keeps a stream open the
whole run with churn: a new prompt every 30 s and bursts of one every 5 s for 30 s every 5 minutes; a pause of 15 s
every 4 minutes; a watcher joining every 90 s for 45 s; and every 8 minutes (0.8-1.2 times, by slot) it closes its
stream and opens a new one (a viewer reconnecting). Every 4th slot (`--input-every`) sends input video (a rendered
scene, as `loadtest --input synthetic`) where the server takes it. `--minute-s` shortens the minute for tests, and
every period with it. Everything is bounded: the run's length, each slot's plan, each wait.

Every minute it records, and prints a progress line of:

- from /metrics: the server's RSS, open fds and threads (the process collector's, and the encoder processes' summed),
  the GPU's allocated and reserved memory (on CUDA), every `streamsvc_table_entries` series (where the server has
  them); chunk latency p50 / p95 over the minute (interpolated in the histogram's buckets, about 25 % apart) and its
  max (exact when the server's slowest-so-far rose in the minute, else the bound of the highest bucket reached),
  degraded chunks (fewer steps, or a cheaper encode);
- from the viewers: stalls (count, seconds, ratio) of the steerers, and apart of the watchers;
- from sampled frames (see benchmarks/soak_streams.py: the first `--sample-streams` slots without input decode, one
  chunk in `--sample-every` is read): mean brightness, saturation, sharpness (variance of the Laplacian) and the change
  from frame to frame; for the built-in model, the share of frames whose colour, shape and motion match the prompt
  (client/pixels.py), a prompt's first `--settle-chunks` chunks (2) left out, and apart by chunks since the switch.

At the end (benchmarks/soak_figures.py): RSS, fds, threads, encoder and GPU memory and every table from minute 5 to
the end (`growth`); latency p95 of the last 10 minutes against minutes 5-15 (both windows scaled to the run for a run
under an hour); the drift of every frame figure, the mean of the run's last 15 % less its first 15 % (HeliosBench's
delta-M), and of the pixel score and the frame figures with the prompts' mix taken out (`all_same_prompts`,
`sharpness_same_prompts`...: each prompt against itself over the run; the built-in model draws a ball far better
than a triangle and a dark prompt's frames are darker, so a window that asked for more of them would read as
drift); the must-show checks; what the host did (its load, CPU steal, the client loop's pauses). A PNG of each
curve goes to `--out` where matplotlib is installed (skipped with a line if not), and `overview.png` with the main
ones side by side (the README's picture). Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.soak_churn import ChurnConfig, slot_plan  # noqa: E402
from benchmarks.soak_figures import (  # noqa: E402
    bucket_delta, caption_triple, drift, growth, highest_bucket, histogram_quantile, mix_adjusted_drift, window_mean,
    window_quantile, windows)
from benchmarks.soak_streams import FRAME_STATS, POSITIONS, SWITCHES, Context, Samples, run_slot  # noqa: E402
from client import loadtest  # noqa: E402
from client.loadtest_host import LoopPauses, cpu_ticks, overlapping, steal_fraction  # noqa: E402
from client.loadtest_prompts import probe_vocabulary, viewer_prompt  # noqa: E402
from client.viewer import DecodeMode  # noqa: E402

LATENCY = "streamsvc_chunk_latency_seconds"
TABLES = "streamsvc_table_entries{"
SERVER = {  # record field -> /metrics key
    "rss_bytes": "process_resident_memory_bytes", "fds": "process_open_fds", "threads": "streamsvc_process_threads",
    "encoders": "streamsvc_encoder_processes", "encoder_rss_bytes": "streamsvc_encoder_rss_bytes",
    "encoder_fds": "streamsvc_encoder_open_fds", "encoder_threads": "streamsvc_encoder_threads",
    "gpu_allocated_bytes": "streamsvc_cuda_memory_allocated_bytes",
    "gpu_reserved_bytes": "streamsvc_cuda_memory_reserved_bytes",
}
MAX_MINUTES, MAX_STREAMS = 24 * 60, 256


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--streams", type=int, default=16, help="slots, each a stream open the whole run (default 16)")
    p.add_argument("--minutes", type=float, default=60.0, help="the run's length in minutes (default 60)")
    p.add_argument("--minute-s", type=float, default=60.0,
                   help="seconds a minute (default 60; a test shortens it, and every churn period with it)")
    p.add_argument("--url", default=None, help="a running server's WebSocket URL (default: start a local server)")
    p.add_argument("--token", default=None, help="access token for the viewers and /metrics")
    p.add_argument("--sample-streams", type=int, default=4,
                   help="slots whose frames are decoded and sampled (default 4)")
    p.add_argument("--sample-every", type=int, default=4, help="of those, one chunk in K is read (default 4)")
    p.add_argument("--decode", choices=("inline", "thread"), default="inline",
                   help="where the sampled slots decode and their frames are read: on the soak's event loop "
                        "(default; cheap at the built-in model's 128x128) or in worker threads (a GPU model's "
                        "832x480, whose decoding and reading would pause the loop that plays every viewer)")
    p.add_argument("--settle-chunks", type=int, default=2,
                   help="a prompt's first chunks left out of the pixel score (default 2; the switch's and the next)")
    p.add_argument("--input-every", type=int, default=4, help="every K-th slot sends input video (0: none; default 4)")
    p.add_argument("--seed", type=int, default=0, help="the input scenes' seed (default 0)")
    g = p.add_argument_group("churn (an hour-long run's seconds, scaled by --minute-s / 60)")
    for name, default, what in (("prompt-every-s", 30.0, "a new prompt this often"),
                                ("burst-every-s", 5.0, "within a burst, a prompt this often"),
                                ("burst-s", 30.0, "a burst's length"), ("burst-period-s", 300.0, "a burst this often"),
                                ("session-s", 480.0, "a steerer reconnects (a new stream) this often"),
                                ("pause-every-s", 240.0, "a pause this often"), ("pause-s", 15.0, "a pause's length"),
                                ("watch-every-s", 90.0, "a watcher joins this often"),
                                ("watch-s", 45.0, "and stays this long")):
        g.add_argument(f"--{name}", type=float, default=default, help=f"{what} (default {default:g})")
    g.add_argument("--watchers", type=int, default=1, help="watchers a stream at most at once (default 1)")
    p.add_argument("--out", default=None, help="folder for the PNGs and the JSON (default: a new temp folder)")
    loadtest.add_server_arguments(p)
    args = p.parse_args(argv)
    if not (1 <= args.streams <= MAX_STREAMS and 0 < args.minutes <= MAX_MINUTES and args.minute_s > 0):
        p.error(f"--streams 1..{MAX_STREAMS}, --minutes in (0, {MAX_MINUTES}], --minute-s > 0")
    if args.sample_every < 1 or min(args.sample_streams, args.input_every, args.settle_chunks) < 0:
        p.error("--sample-every >= 1; --sample-streams, --input-every and --settle-chunks >= 0")
    if args.url is not None and not args.url.startswith(("ws://", "wss://")):
        p.error(f"--url {args.url}: a WebSocket URL, e.g. ws://127.0.0.1:8000/ws")
    return args


def churn_config(args: argparse.Namespace) -> ChurnConfig:
    return ChurnConfig(run_s=args.minutes * args.minute_s, scale=args.minute_s / 60.0,
                       prompt_every_s=args.prompt_every_s, burst_every_s=args.burst_every_s, burst_s=args.burst_s,
                       burst_period_s=args.burst_period_s, session_s=args.session_s, pause_every_s=args.pause_every_s,
                       pause_s=args.pause_s, watchers=args.watchers, watch_every_s=args.watch_every_s,
                       watch_s=args.watch_s)


# ---------------------------------------------------------------- one minute's record


def buckets(m: dict | None) -> dict[float, float]:
    """The chunk latency histogram's cumulative buckets {le: count} of a scrape."""
    head = f"{LATENCY}_bucket{{le="
    return {float(k[len(head):-1]): v for k, v in (m or {}).items() if k.startswith(head)}


def tables(m: dict | None) -> dict[str, float]:
    """Every `streamsvc_table_entries` series of a scrape, by its labels' values ("sessions", or "a,b")."""
    return {",".join(kv.partition("=")[2] for kv in k[len(TABLES):-1].split(",")): v
            for k, v in (m or {}).items() if k.startswith(TABLES)}


def minute_record(minute: int, t: float, m: dict | None, before: dict | None, prev: dict | None, ctx: Context,
                  t_prev: float) -> dict:
    """What minute `minute` (ending at `t`) showed: the scrape `m` against the one before (`before`), the viewers'
    totals against the previous record's (`prev`), the frames sampled since `t_prev`."""
    rec: dict = {"minute": minute, "t_s": round(t, 2), "scraped": m is not None,
                 "open": {"steerers": len(ctx.steerers.open), "watchers": len(ctx.watchers.open)}}
    for field, key in SERVER.items():
        rec[field] = None if m is None else m.get(key)
    rec["cpu_cores"] = None
    if m is not None and before is not None and "process_cpu_seconds_total" in m and t > t_prev:
        cpu_s = m["process_cpu_seconds_total"] - before.get("process_cpu_seconds_total", 0.0)
        rec["cpu_cores"] = round(cpu_s / (t - t_prev), 3)
    rec["tables"] = tables(m)
    hist = bucket_delta(buckets(before), buckets(m)) if m is not None else []
    top = m.get("streamsvc_chunk_latency_max_seconds") if m is not None else None
    rose = top is not None and before is not None and top > before.get("streamsvc_chunk_latency_max_seconds", 0)
    rec["latency"] = {"chunks": hist[-1][1] if hist else 0, "p50_s": _r(histogram_quantile(hist, 0.5)),
                      "p95_s": _r(histogram_quantile(hist, 0.95)),
                      "max_s": _r(top) if rose else highest_bucket(hist), "max_exact": rose}
    rec["degraded"] = {stage: (m or {}).get(f"streamsvc_degraded_chunks{{stage={stage}}}", 0)
                       - (before or {}).get(f"streamsvc_degraded_chunks{{stage={stage}}}", 0)
                       for stage in ("device", "encode")} if m is not None else None
    for who, viewing in (("stalls", ctx.steerers), ("watcher_stalls", ctx.watchers)):
        n, stall_s, play_s = viewing.totals()
        last = (prev or {}).get(f"_{who}", (0, 0.0, 0.0))
        dn, ds, dp = n - last[0], stall_s - last[1], play_s - last[2]
        rec[who] = {"count": dn, "seconds": round(ds, 3), "ratio": _r(ds / (ds + dp) if ds + dp > 0 else 0.0, 6)}
        rec[f"_{who}"] = (n, stall_s, play_s)  # (totals: dropped from the JSON)
    s = ctx.samples
    frames = {name: _r(window_mean(getattr(s, name), t_prev, t)) for name in FRAME_STATS}
    rec["frames"] = {**frames, "n": sum(1 for x, _ in s.brightness if t_prev <= x < t)}
    rec["pixels"] = None
    if ctx.score_pixels:
        n = sum(1 for x, _ in s.all if t_prev <= x < t)
        rec["pixels"] = {name: _r(window_mean(getattr(s, name), t_prev, t)) for name in ("colour", "shape", "motion",
                                                                                         "all")} | {"frames": n}
    rec["churn"] = {k: v for k, v in vars(ctx.tally).items() if k != "errors"}
    return rec


def progress_line(rec: dict, minutes: float) -> str:
    mb = lambda b: "-" if b is None else f"{b / 2**20:.0f} MB"  # noqa: E731
    lat, st, fr, px = rec["latency"], rec["stalls"], rec["frames"], rec["pixels"]
    f = lambda x, spec: "-" if x is None else format(x, spec)  # noqa: E731
    gpu = (f"  gpu {mb(rec['gpu_allocated_bytes'])}/{mb(rec['gpu_reserved_bytes'])}"
           if rec["gpu_allocated_bytes"] is not None else "")
    tabs = f"  tables {sum(rec['tables'].values()):.0f}" if rec["tables"] else ""
    return (f"[min {rec['minute']}/{minutes:g}] open {rec['open']['steerers']}+{rec['open']['watchers']}w  "
            f"rss {mb(rec['rss_bytes'])} fds {f(rec['fds'], '.0f')} thr {f(rec['threads'], '.0f')}  "
            f"enc {f(rec['encoders'], '.0f')}x {mb(rec['encoder_rss_bytes'])}{gpu}{tabs}  "
            f"lat p50/p95/max {f(lat['p50_s'], '.3f')}/{f(lat['p95_s'], '.3f')}/{f(lat['max_s'], '.3f')} s  "
            f"stalls {st['count']} ({st['seconds']:.2f} s)  degraded {sum((rec['degraded'] or {}).values()):.0f}  "
            + (f"pixels {f(px['all'] and 100 * px['all'], '.1f')} %  " if px else "")
            + f"bright {f(fr['brightness'], '.1f')} sat {f(fr['saturation'], '.3f')} "
            f"sharp {f(fr['sharpness'], '.0f')} change {f(fr['change'], '.2f')}")


# ---------------------------------------------------------------- the run's figures


def summarize(records: list[dict], scrapes: list[tuple[float, dict | None]], samples: Samples, run_s: float,
              minute_s: float, score_pixels: bool, own: tuple[int, float] = (0, 0.0)) -> dict:
    """Growth, latency windows, stalls, drift and the must-show checks, from the minutes' records, the scrapes (t, m)
    and the frame samples. `own`: (count, seconds) of the steerers' stalls that overlap the soak's own loop pauses
    (client/loadtest_host.py `LoopPauses`: the load test held them up, not the server), counted apart as the load
    test does."""
    w = windows(run_s, minute_s)
    series = lambda field: [(r["t_s"], r[field]) for r in records if r.get(field) is not None]  # noqa: E731
    grown = {field: growth(series(field), w.growth_from_s) for field in SERVER}
    names = sorted({name for r in records for name in r["tables"]})
    grown["tables"] = {n: growth([(r["t_s"], r["tables"][n]) for r in records if n in r["tables"]], w.growth_from_s)
                       for n in names}
    hists = [(t, buckets(m)) for t, m in scrapes if m is not None]
    early, late = window_quantile(hists, *w.early, 0.95), window_quantile(hists, *w.late, 0.95)
    last = records[-1] if records else {}
    n, stall_s, play_s = last.get("_stalls", (0, 0.0, 0.0))
    ratio = stall_s / (stall_s + play_s) if stall_s + play_s > 0 else 0.0
    server_ratio = max(0.0, stall_s - own[1]) / (stall_s + play_s) if stall_s + play_s > 0 else 0.0
    drifts = {name: drift(getattr(samples, name), run_s) for name in Samples.SERIES
              if score_pixels or name in FRAME_STATS}
    if score_pixels:
        drifts["all_same_prompts"] = mix_adjusted_drift(samples.scored, run_s)
        # and at the same number of prompts before: a stream follows its opening prompt best (78 % against 50-69 %
        # after a switch, in the hour's run), and the run's first minutes hold more opening prompts (every slot's
        # first session starts at 0) than its last, whose sessions' phases have spread out
        drifts["all_same_prompts_and_history"] = mix_adjusted_drift(samples.scored_with_history, run_s)
    for name, chunks in samples.by_prompt.items():  # frame statistics, each prompt against itself
        drifts[f"{name}_same_prompts"] = mix_adjusted_drift(chunks, run_s)
    rss, px, same = grown["rss_bytes"], drifts.get("all"), drifts.get("all_same_prompts")
    history = drifts.get("all_same_prompts_and_history")
    checks = {
        "stall_ratio_at_most_1e-4": ratio <= 1e-4,
        "stall_ratio_outside_own_pauses_at_most_1e-4": server_ratio <= 1e-4,
        "rss_growth_under_5pct": None if not rss or rss["relative"] is None else rss["relative"] < 0.05,
        "latency_p95_within_10pct": None if not early or late is None else abs(late / early - 1) <= 0.10,
        "pixels_within_2_points": None if not px or px["delta"] is None else abs(px["delta"]) <= 0.02,
        "pixels_same_prompts_within_2_points": None if not same or same["delta"] is None else abs(same["delta"]) <= 0.02,
        "pixels_same_prompts_and_history_within_2_points":
            None if not history or history["delta"] is None else abs(history["delta"]) <= 0.02,
    }
    return {
        "windows": {"growth_from_s": w.growth_from_s, "early_s": w.early, "late_s": w.late, "scale": round(w.scale, 4)},
        "growth": grown,
        "latency_p95": {"early_s": _r(early), "late_s": _r(late),
                        "change": _r(late / early - 1) if early and late is not None else None},
        "stalls": {"count": n, "seconds": round(stall_s, 3), "ratio": _r(ratio, 7),
                   "per_stream_hour_s": _r(3600 * ratio, 3), "during_own_pauses": own[0],
                   "during_own_pauses_s": round(own[1], 3), "ratio_outside_own_pauses": _r(server_ratio, 7)},
        "watcher_stalls": dict(zip(("count", "seconds", "playing_s"), last.get("_watcher_stalls", (0, 0.0, 0.0)))),
        "drift": drifts,
        "checks": checks,
    }


def plot(records: list[dict], out: Path) -> list[str]:
    """A PNG of each curve over the run's minutes in `out`; none (with a line) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNGs (pip install matplotlib)", flush=True)
        return []
    curves = {f: lambda r, f=f: r[f] for f in SERVER} | {
        f"latency_{q}": (lambda r, q=q: r["latency"][q]) for q in ("p50_s", "p95_s", "max_s")} | {
        "stall_seconds": lambda r: r["stalls"]["seconds"],
        "degraded": lambda r: sum((r["degraded"] or {}).values())} | {
        f"frame_{q}": (lambda r, q=q: r["frames"][q]) for q in ("brightness", "saturation", "sharpness", "change")} | {
        f"pixels_{q}": (lambda r, q=q: (r["pixels"] or {}).get(q)) for q in ("colour", "shape", "motion", "all")} | {
        f"table_{n}": (lambda r, n=n: r["tables"].get(n)) for n in sorted({n for r in records for n in r["tables"]})}
    paths = [overview(records, out, plt)]
    for name, get in curves.items():
        points = [(r["minute"], get(r)) for r in records if get(r) is not None]
        if not points:
            continue
        fig, ax = plt.subplots(figsize=(6, 3))
        draw_curve(ax, name, points)
        fig.tight_layout()
        path = out / f"{name}.png"
        fig.savefig(path, dpi=80)
        plt.close(fig)
        paths.append(str(path))
    return paths


OVERVIEW = (  # the README's picture: what would grow, how late chunks are, what the frames show
    ("server RSS (MB)", lambda r: r["rss_bytes"] / 2**20),
    ("encoder process RSS (MB)", lambda r: r["encoder_rss_bytes"] / 2**20 if r["encoder_rss_bytes"] else None),
    ("GPU memory allocated (MB)", lambda r: r["gpu_allocated_bytes"] / 2**20 if r["gpu_allocated_bytes"] else None),
    ("server threads", lambda r: r["threads"]),
    ("chunk latency p95 (s)", lambda r: r["latency"]["p95_s"]),
    ("frames: colour, shape and motion right (%)", lambda r: 100 * r["pixels"]["all"] if r["pixels"] else None),
    ("frames: sharpness", lambda r: r["frames"]["sharpness"]),
)


def draw_curve(ax, title: str, points: list[tuple], top: float | None = None, fontsize: float | None = None) -> None:
    """One curve over the run's minutes, its y axis from 0 (a flat curve reads flat) up to `top` (None: matplotlib's)."""
    ax.plot(*zip(*points), marker=".")
    ax.set_ylim(bottom=min(0.0, min(v for _, v in points)), top=top)
    ax.ticklabel_format(axis="y", useOffset=False)
    ax.set_title(title, fontsize=fontsize)
    ax.set_xlabel("minute", fontsize=fontsize and fontsize - 1)


def overview(records: list[dict], out: Path, plt) -> str:
    """One PNG of the run's main curves side by side (those with points), each from 0: `overview.png`."""
    panels = [(title, [(r["minute"], v) for r in records if (v := get(r)) is not None]) for title, get in OVERVIEW]
    panels = [(title, points) for title, points in panels if points][:6]
    fig, axes = plt.subplots(2, 3, figsize=(12, 5), squeeze=False)
    for ax, (title, points) in zip(axes.flat, panels):
        draw_curve(ax, title, points, top=1.15 * max(v for _, v in points) or 1.0, fontsize=10)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    path = out / "overview.png"
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return str(path)


# ---------------------------------------------------------------- running


async def soak(args: argparse.Namespace, url: str) -> tuple[list[dict], list, Context, tuple[int, float], dict]:
    """Run the slots and record every minute; the records, the scrapes, the context, the steerers' stalls that
    overlap the soak's own loop pauses (count, seconds), and what the host did."""
    churn = churn_config(args)
    probed, vocabulary = await probe_vocabulary(url, args.token, max(10.0, 0.25 * args.streams))
    captions = bool(vocabulary) or not probed
    score = bool(vocabulary) and caption_triple(viewer_prompt(0, 0, captions, vocabulary)) is not None
    inputs = [i for i in range(args.streams) if args.input_every and i % args.input_every == args.input_every - 1]
    sources = {}
    if inputs:
        from streamsvc.inputs.synthetic import scene_sources  # (renders models/scenes.py: the command line's part)

        sources = dict(zip(inputs, scene_sources(len(inputs), seed=args.seed)))
    sampled = {i for i in range(args.streams) if i not in sources}
    sampled = set(sorted(sampled)[: args.sample_streams])
    reader = ThreadPoolExecutor(1, thread_name_prefix="soak-read") if args.decode == "thread" else None
    ctx = Context(url, churn, time.monotonic(), captions, vocabulary, args.streams, sampled, args.sample_every, score,
                  token=args.token, sources=sources, settle=args.settle_chunks, decode=DecodeMode(args.decode),
                  reader=reader)
    print(f"{args.streams} streams for {args.minutes:g} min (minutes of {args.minute_s:g} s) at {url}; prompts: "
          f"{'captions' if captions else 'free text'}; frames sampled from slots {sorted(sampled)}, one chunk in "
          f"{args.sample_every}{'; pixels scored (the built-in model)' if score else ''}; input video from slots "
          f"{inputs or 'none'}", flush=True)
    murl = loadtest.metrics_url(url)
    scrape = lambda: asyncio.to_thread(loadtest.scrape_metrics, murl, 5.0, args.token)  # noqa: E731
    pauses, ticks0, t0_wall = LoopPauses(), cpu_ticks(), time.monotonic()
    watch = asyncio.create_task(pauses.run(t0_wall + churn.run_s + 120))
    scrapes = [(0.0, await scrape())]
    records: list[dict] = []
    slots = [asyncio.create_task(run_slot(ctx, i, slot_plan(i, args.streams, churn))) for i in range(args.streams)]
    minutes = math.ceil(args.minutes)
    try:
        for k in range(1, minutes + 1):
            t_end = min(k * args.minute_s, churn.run_s - min(1.0, 0.02 * args.minute_s))  # the last before closes
            await asyncio.sleep(max(0.0, t_end - ctx.since()))
            t = ctx.since()
            m = await scrape()
            scrapes.append((t, m))
            prev = next((s for _, s in reversed(scrapes[:-1]) if s is not None), None)
            records.append(minute_record(k, t, m, prev, records[-1] if records else None, ctx, scrapes[-2][0]))
            print(progress_line(records[-1], args.minutes), flush=True)
        for failed in await asyncio.wait_for(asyncio.gather(*slots, return_exceptions=True), 60.0):
            if isinstance(failed, BaseException):  # a slot's bug: said, not hidden in the figures
                print(f"a slot failed: {type(failed).__name__}: {failed}", file=sys.stderr, flush=True)
                ctx.tally.error(f"slot failed: {type(failed).__name__}: {failed}")
        if ctx.tasks:
            await asyncio.wait(list(ctx.tasks), timeout=30.0)
    finally:
        for task in [*slots, *ctx.tasks, watch]:
            task.cancel()
        await asyncio.wait([*slots, *ctx.tasks, watch], timeout=10.0)
        if reader is not None:  # the sampled chunks still queued are read before the figures
            await asyncio.to_thread(reader.shutdown, wait=True)
    await asyncio.sleep(2.0)  # every stream closed: what is left
    after = await scrape()
    host = {"client_loop": pauses.figures(), "steal": _r(steal_fraction(ticks0, cpu_ticks()), 4)}
    own = {who: overlapping(viewing.stall_events(), pauses.pauses)  # the soak's own loop held them up, not the server
           for who, viewing in (("stalls", ctx.steerers), ("watcher_stalls", ctx.watchers))}
    host["stalls_during_own_pauses"] = {who: {"count": n, "seconds": round(s, 3)} for who, (n, s) in own.items()}
    closed = {f: None if after is None else after.get(k) for f, k in SERVER.items()} | {"tables": tables(after)}
    return records, scrapes, ctx, own["stalls"], {"host": host, "after_close": closed}


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="soak-"))
    out.mkdir(parents=True, exist_ok=True)
    server, load0, wall0 = None, os.getloadavg(), time.monotonic()
    old_term = signal.signal(signal.SIGTERM, _interrupt)  # a SIGTERM stops the local server as Ctrl-C does
    try:
        if args.url is None:
            server = loadtest.LocalServer(loadtest.local_serve_args(args), start_timeout_s=args.server_timeout)
            shown = ["***" if a == "--auth-token" else b for a, b in zip(["", *server.serve_args], server.serve_args)]
            print(f"starting a local server: streamsvc serve {' '.join(shown)}", flush=True)
            server.start()
            print(f"server up at {server.ws_url} after {time.monotonic() - wall0:.1f} s", flush=True)
        cpu0 = server.cpu_seconds() if server else None
        t0 = time.monotonic()
        records, scrapes, ctx, own, extra = asyncio.run(soak(args, args.url or server.ws_url))
        wall = time.monotonic() - t0
        cpu1 = server.cpu_seconds() if server else None
    finally:
        signal.signal(signal.SIGTERM, old_term)
        if server is not None:
            server.stop()
            server.cleanup()
    report = {"benchmark": "soak",
              "config": {k: v for k, v in vars(args).items() if k not in ("token",)} | {"run_s": ctx.churn.run_s},
              **summarize(records, scrapes, ctx.samples, ctx.churn.run_s, args.minute_s, ctx.score_pixels, own),
              "churn": vars(ctx.tally),
              "sampling": {"streams": sorted(ctx.sample_streams), "every": args.sample_every,
                           "chunks_read": ctx.samples.chunks_read, "frames_read": len(ctx.samples.brightness),
                           "pixel_frames": len(ctx.samples.all), "read_s": round(ctx.samples.read_s, 2),
                           "settle_chunks": args.settle_chunks,
                           "pixels_by_chunks_since_switch": _by(ctx.samples.by_position, POSITIONS),
                           "pixels_by_prompts_before": _by(ctx.samples.by_switches, SWITCHES)},
              **extra,
              "minutes": [{k: v for k, v in r.items() if not k.startswith("_")} for r in records]}
    report["host"] |= {"cores": os.cpu_count(), "loadavg_start": [round(x, 2) for x in load0],
                       "loadavg_end": [round(x, 2) for x in os.getloadavg()], "wall_s": round(wall, 1),
                       "server_cores": None if cpu0 is None or cpu1 is None else round((cpu1 - cpu0) / wall, 3)}
    report["pngs"] = plot(report["minutes"], out)
    (out / "soak.json").write_text(json.dumps(report, indent=1) + "\n")
    c = report["checks"]
    st = report["stalls"]
    print(f"stalls {st['count']} (ratio {st['ratio']}; {st['during_own_pauses']} during the soak's own loop pauses, "
          f"ratio {st['ratio_outside_own_pauses']} without them); rss growth "
          f"{_pct((report['growth']['rss_bytes'] or {}).get('relative'))}; latency p95 "
          f"{report['latency_p95']['early_s']} -> {report['latency_p95']['late_s']} s; checks {c}; "
          f"report and PNGs in {out}", flush=True)
    print(json.dumps(report))
    return report


def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(x, nd)


def _by(tallies: dict[int, list[int]], top: int) -> dict[str, float | None]:
    """{key: [right, n]} -> {"key": right / n}, the top key written "top+" (it holds the rest)."""
    return {f"{k}+" if k == top else str(k): _r(right / n) if n else None for k, (right, n) in sorted(tallies.items())}


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.1f} %"


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("soak: interrupted", file=sys.stderr)
        sys.exit(130)
