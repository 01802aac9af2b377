"""The load test's report, pure: every viewer's ``StreamResult`` in, the figures out (``summarize``), and the table
printed from them (``format_table``).

It follows DESIGN.md "Measuring a stream": TTFF, stalls, freezes, delivered fps, viewer time lost, control
latency, errors and decode cost of the steerers, the same of their watchers in a section of their own
(``summarize_watchers``), glass-to-glass of input video, and the pixel checks of ``--verify-pixels``
(``pixel_summary``). client/loadtest.py runs the viewers and adds the server's, the loop's and the CPU's figures.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

from client.verify import PixelStats
from client.viewer import StreamResult


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between closest ranks (numpy's default); None when empty."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(x, nd)


def _viewing(admitted: Sequence[StreamResult]) -> dict:
    """What admitted viewers saw, whatever their role: TTFF, stalls, freezes, delivered fps, time lost, headroom,
    frames and decode cost (DESIGN.md "Measuring a stream")."""
    pbs = [r.playback for r in admitted]
    ttffs = [p.ttff_s for p in pbs if p.ttff_s is not None]
    stall_s = sum(p.stall_s for p in pbs)
    watched = sum(p.play_s + p.stall_s for p in pbs)
    # viewer time lost: (startup wait + stall time) / session time, summed over admitted streams
    startup = sum(p.ttff_s if p.ttff_s is not None else r.session_s for r, p in zip(admitted, pbs))
    session = sum(r.session_s for r in admitted)
    frames = sum(r.frames_decoded for r in admitted)
    decode_s = sum(r.decode_s for r in admitted)
    headroom = [r.min_headroom_s for r in admitted if r.min_headroom_s is not None]
    return {
        "ttff_s": {"n": len(ttffs), "p50": _r(percentile(ttffs, 50)), "p95": _r(percentile(ttffs, 95)),
                   "p99": _r(percentile(ttffs, 99)), "max": _r(max(ttffs, default=None))},
        "stalls": {"count": sum(p.stalls for p in pbs), "total_s": _r(stall_s),
                   "ratio": _r(stall_s / watched if watched > 0 else 0.0, 6),
                   "streams_with_stalls": sum(1 for p in pbs if p.stalls > 0)},
        "freezes": {"count": sum(p.freezes for p in pbs), "total_s": _r(sum(p.freeze_s for p in pbs))},
        "delivered_fps": {"mean": _r(sum(p.delivered_fps for p in pbs) / len(pbs) if pbs else None, 3),
                          "min": _r(min((p.delivered_fps for p in pbs), default=None), 3)},
        "viewer_time_lost": _r((startup + stall_s) / session if session > 0 else None, 6),
        "min_headroom_s": {"min": _r(min(headroom, default=None)), "p5": _r(percentile(headroom, 5))},
        "frames": {"received": sum(p.frames_received for p in pbs), "played": sum(p.frames_played for p in pbs),
                   "decoded": frames, "bad_size": sum(r.bad_frames for r in admitted)},
        "decode": {"total_s": _r(decode_s), "per_frame_ms": _r(1e3 * decode_s / frames if frames else None, 4),
                   "max_chunk_ms": _r(1e3 * max((r.decode_max_s for r in admitted), default=0.0), 3)},
    }


def _errors(results: Sequence[StreamResult]) -> Counter:
    """Every viewer's error texts but its own refusal's."""
    return Counter(e for r in results for e in r.errors if r.refused_reason is None or not e.startswith("refused"))


def summarize(results: Sequence[StreamResult], *, duration_s: float, watchers: Sequence[StreamResult] | None = None,
              watchers_per_stream: int = 0, watchers_not_started: int = 0) -> dict:
    """The load test's report from every viewer's result. ``results`` are the streams' steerers (every top-level
    figure is theirs); with ``watchers`` (their watchers' results, ``watchers_not_started`` more never joined
    because their stream was refused) the report has a ``watchers`` section (``summarize_watchers``)."""
    admitted = [r for r in results if r.admitted and r.playback is not None]
    refused = [r for r in results if r.refused_reason is not None]
    pbs = [r.playback for r in admitted]
    lat = [x for p in pbs for x in p.control_latencies_s]
    seen = _viewing(admitted)
    ready = admitted[0] if admitted else None
    errors = _errors(results)
    report = {
        "streams": len(results),
        "admitted": len(admitted),
        "refused": {"count": len(refused), "reasons": dict(Counter(r.refused_reason for r in refused).most_common())},
        "duration_s": duration_s,
        "fps": ready.fps if ready else None,
        "frame_size": [ready.width, ready.height] if ready else None,
        "chunk_s": ready.chunk_frames / ready.fps if ready else None,
        "ttff_s": seen["ttff_s"],
        "stalls": seen["stalls"],
        # a cluster's worker died under some viewers: they reconnected (moved); the others' stalls counted apart
        "worker_lost": {"count": sum(r.worker_lost for r in results), "reconnects": sum(r.reconnects for r in results),
                        "streams": sum(1 for r in results if r.worker_lost),
                        "stalls_of_the_others": sum(p.stalls for r, p in zip(admitted, pbs) if r.worker_lost == 0)},
        "freezes": seen["freezes"],
        "degraded_chunks": sum(r.degraded_chunks for r in admitted),
        "chunks": sum(r.chunks for r in admitted),
        "control_latency_s": {"n": len(lat), "p50": _r(percentile(lat, 50)), "p95": _r(percentile(lat, 95)),
                              "max": _r(max(lat, default=None)), "sent": sum(r.prompts_sent for r in admitted),
                              "pending": sum(p.prompts_pending for p in pbs)},
        "delivered_fps": seen["delivered_fps"],
        "viewer_time_lost": seen["viewer_time_lost"],
        "min_headroom_s": seen["min_headroom_s"],
        "frames": seen["frames"],
        "decode": seen["decode"],
        "errors": {"count": sum(errors.values()), "messages": dict(errors.most_common(20))},
        "pixel_latency_s": pixel_summary([r.pixels for r in admitted if r.pixels is not None]),
        "glass_to_glass_s": glass_to_glass([r for r in admitted]),
        "per_stream": [
            {"stream_id": r.stream_id, "ttff_s": _r(r.playback.ttff_s), "stalls": r.playback.stalls,
             "stall_s": _r(r.playback.stall_s), "delivered_fps": _r(r.playback.delivered_fps, 3),
             "chunks": r.chunks, "degraded_chunks": r.degraded_chunks, "prompt_versions": len(r.prompt_versions),
             "control_p50_s": _r(percentile(r.playback.control_latencies_s, 50)),
             "min_headroom_s": _r(r.min_headroom_s), "errors": len(r.errors),
             "worker_lost": r.worker_lost, "reconnects": r.reconnects,
             "stall_events": [[_r(t, 3), _r(d, 4)] for t, d in r.stall_events]}
            for r in admitted
        ],
    }
    if watchers is not None:
        report["watchers"] = summarize_watchers(watchers, per_stream=watchers_per_stream,
                                                not_started=watchers_not_started, steerers=results)
    return report


def glass_to_glass(admitted: Sequence[StreamResult]) -> dict | None:
    """Input video: capture -> played of every played frame with an echoed capture time, all viewers together; None
    when no viewer sent input."""
    g2g = [x for r in admitted for x in r.glass_to_glass]
    sent = sum(r.input_sent for r in admitted)
    if not sent and not g2g:
        return None
    return {"n": len(g2g), "p50": _r(percentile(g2g, 50)), "p95": _r(percentile(g2g, 95)),
            "max": _r(max(g2g, default=None)), "input_frames_sent": sent,
            "missing_chunks": sum(r.input_missing for r in admitted)}


def summarize_watchers(watchers: Sequence[StreamResult], *, per_stream: int, not_started: int,
                       steerers: Sequence[StreamResult] = ()) -> dict:
    """The ``watchers`` section: what the watchers saw, measured as any viewer (TTFF from each one's join), and
    how many joined. ``not_started``: watchers that never connected because their stream was refused or failed;
    ``steerers``: their streams' steerers, whose audience messages say how many watchers the server counted."""
    admitted = [r for r in watchers if r.admitted and r.playback is not None]
    refused = [r for r in watchers if r.refused_reason is not None]
    errors = _errors(watchers)
    seen = _viewing(admitted)
    counted = [r.audience_max for r in steerers if r.admitted]
    return {
        "per_stream": per_stream,  # watchers asked for each stream
        "count": len(watchers) + not_started,  # every watcher asked for
        "admitted": len(admitted),
        "refused": {"count": len(refused), "reasons": dict(Counter(r.refused_reason for r in refused).most_common())},
        "not_started": not_started,  # their stream was refused (or failed): nothing to watch
        "failed": len(watchers) - len(admitted) - len(refused),  # started, neither admitted nor refused (errors say why)
        **seen,  # ttff_s (from the watcher's connect), stalls, freezes, delivered_fps, viewer_time_lost, ...
        "chunks": sum(r.chunks for r in admitted),
        "roles": dict(Counter(r.role for r in admitted).most_common()),  # "watch" unless the token came to one
        "audience_max": {"min": min(counted, default=None), "max": max(counted, default=None)},  # as steerers saw it
        "not_steerer": sum(r.not_steerer for r in watchers),
        "ignored_messages": sum(r.ignored_messages for r in watchers),
        "closed_reasons": dict(Counter(r.closed_reason for r in admitted).most_common(5)),
        "errors": {"count": sum(errors.values()), "messages": dict(errors.most_common(20))},
        "per_viewer": [
            {"stream_id": r.stream_id, "viewer_id": r.viewer_id, "ttff_s": _r(r.playback.ttff_s),
             "stalls": r.playback.stalls, "stall_s": _r(r.playback.stall_s), "freezes": r.playback.freezes,
             "delivered_fps": _r(r.playback.delivered_fps, 3), "chunks": r.chunks, "session_s": _r(r.session_s, 3),
             "errors": len(r.errors), "stall_events": [[_r(t, 3), _r(d, 4)] for t, d in r.stall_events]}
            for r in admitted
        ],
    }


def pixel_summary(stats: Sequence[PixelStats]) -> dict | None:
    """The pixel-verified prompt latency over every viewer (None without --verify-pixels)."""
    if not stats:
        return None
    lat = [x for s in stats for x in s.latencies_s]
    read = sum(s.frames_read for s in stats)
    return {"n": len(lat), "p50": _r(percentile(lat, 50)), "p95": _r(percentile(lat, 95)),
            "max": _r(max(lat, default=None)), "unmatched": sum(s.unmatched for s in stats),
            "superseded": sum(s.superseded for s in stats), "no_colour": sum(s.no_colour for s in stats),
            "frames_read": read, "read_ms_per_frame": _r(1e3 * sum(s.read_s for s in stats) / read if read else None)}


def format_table(report: dict) -> str:
    def f(x, nd=3, unit=""):
        return "-" if x is None else f"{x:.{nd}f}{unit}"

    t, st, cl, fz, fps = (report[k] for k in ("ttff_s", "stalls", "control_latency_s", "freezes", "delivered_fps"))
    rows = [
        ("streams", f"{report['streams']} ({report['admitted']} admitted, {report['refused']['count']} refused)"),
        ("chunk", f(report["chunk_s"], 4, " s")),
        ("TTFF p50 / p95 / p99 / max", " / ".join(f(t[k], 3) for k in ("p50", "p95", "p99", "max")) + " s"),
        ("stalls", f"{st['count']} ({f(st['total_s'], 3)} s, ratio {f(st['ratio'], 5)}, "
                   f"{st['streams_with_stalls']} streams)"),
        ("freezes (W3C)", f"{fz['count']} ({f(fz['total_s'], 3)} s)"),
        *([("stalls during the viewers' own pauses", f"{st['during_own_pauses']} (the load test's event loop paused "
            f"{report['client_loop']['pauses_over_50ms']} times over 50 ms, longest "
            f"{f(report['client_loop']['pause_max_s'], 3)} s; {f(report['client_loop']['paused_s'], 2)} s paused, "
            f"{f(report['client_loop'].get('busy_in_pauses_s'), 2)} s of it the loop's own work)")]
          if "client_loop" in report else []),
        ("degraded chunks (fewer steps, cheaper encode)", f"{report['degraded_chunks']} of {report['chunks']}"),
        ("control latency p50 / p95 / max", " / ".join(f(cl[k], 3) for k in ("p50", "p95", "max"))
         + f" s (n={cl['n']}, pending {cl['pending']})"),
        *([("pixel-verified latency p50 / p95 / max", " / ".join(f(px[k], 3) for k in ("p50", "p95", "max"))
            + f" s (n={px['n']}, never matched {px['unmatched']}, superseded {px['superseded']}, "
            f"{px['frames_read']} frames read at {f(px['read_ms_per_frame'], 3)} ms)")]
          if (px := report.get("pixel_latency_s")) else []),
        *([("glass-to-glass p50 / p95 / max", " / ".join(f(g[k], 3) for k in ("p50", "p95", "max"))
            + f" s (n={g['n']} frames; {g['input_frames_sent']} input frames sent, {g['missing_chunks']} chunks "
            "with the input missing)")] if (g := report.get("glass_to_glass_s")) else []),
        ("delivered fps mean / min", f"{f(fps['mean'], 2)} / {f(fps['min'], 2)}"),
        ("min headroom at arrival", f(report["min_headroom_s"]["min"], 3, " s")),
        ("decode per frame", f(report["decode"]["per_frame_ms"], 3, " ms")),
        ("errors", str(report["errors"]["count"])),
        *([("worker lost / reconnected (cluster)", f"{report['worker_lost']['count']} / "
            f"{report['worker_lost']['reconnects']} ({report['worker_lost']['streams']} streams moved; stalls of the "
            f"others {report['worker_lost']['stalls_of_the_others']})")] if report.get("worker_lost", {}).get("count") else []),
    ]
    srv = report.get("server")
    if srv:
        fm = srv["forward_ms"]
        rows.append(("server forward ms (recache/denoise/commit)", " / ".join(f(fm[k], 2) for k in fm)))
        gm = srv.get("gpu_ms") or {}
        rows.append(("server device ms (recache/denoise/commit)", " / ".join(f(gm[k], 2) for k in gm)))
        rows.append(("server encode per chunk", f(srv.get("encode_ms_per_chunk"), 2, " ms")))
        rows.append(("server chunk latency mean / max", f"{f(srv['chunk_latency_mean_s'], 3)} / "
                     f"{f(srv.get('chunk_latency_max_s'), 3)} s ({f(srv.get('chunks_over_1s'), 0)} chunks over 1 s)"))
        rows.append(("server engine busy", f(srv["engine_busy"], 3)))
        dg = srv.get("degraded_chunks") or {}
        rows.append(("server degraded device / encode, ended overloaded",
                     f"{f(dg.get('device'), 0)} / {f(dg.get('encode'), 0)}, {f(srv.get('overloaded'), 0)}"))
        if report.get("config", {}).get("transport") == "webrtc":
            rows.append(("server-side track stalls (WebRTC)", f(srv.get("webrtc_track_stalls"), 0)))
    cpu = report.get("cpu")
    if cpu:
        rows.append(("CPU cores used client / server", f"{f(cpu['client_cores'], 2)} / {f(cpu['server_cores'], 2)}"
                     f" of {cpu['cores']} (load avg at start {cpu['loadavg_start']})"))
        if cpu.get("steal") is not None:
            rows.append(("CPU time stolen by the hypervisor", f"{100 * cpu['steal']:.1f} %"))
    for name, row in (report.get("styles") or {}).items():  # --styles: a line a style
        refused = sum(row["refused"].values())
        rows.append((f"style {name}", f"{row['streams']} streams: {row['admitted']} admitted, {refused} refused; "
                                      f"{row['stalls']} stalls ({f(row['stall_s'], 3)} s)"))
    wt = report.get("watchers")
    if wt:
        rows += watcher_rows(wt, f)
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    for reason, n in list(report["refused"]["reasons"].items())[:3]:
        lines.append(f"refused x{n}: {reason}")
    for msg, n in list(report["errors"]["messages"].items())[:5]:
        lines.append(f"error x{n}: {msg}")
    if wt:
        for reason, n in list(wt["refused"]["reasons"].items())[:3]:
            lines.append(f"watcher refused x{n}: {reason}")
        for msg, n in list(wt["errors"]["messages"].items())[:5]:
            lines.append(f"watcher error x{n}: {msg}")
    return "\n".join(lines)


def watcher_rows(wt: dict, f) -> list[tuple[str, str]]:
    """The table's lines of the ``watchers`` section."""
    t, st, fz, fps = (wt[k] for k in ("ttff_s", "stalls", "freezes", "delivered_fps"))
    own = f"; {st['during_own_pauses']} during the load test's own pauses" if "during_own_pauses" in st else ""
    return [
        ("watchers", f"{wt['count']} ({wt['per_stream']} a stream: {wt['admitted']} admitted, "
                     f"{wt['refused']['count']} refused, {wt['not_started']} not started (stream refused), "
                     f"{wt['failed']} failed)"),
        ("watchers' TTFF from join p50 / p95 / max", " / ".join(f(t[k], 3) for k in ("p50", "p95", "max")) + " s"),
        ("watchers' stalls", f"{st['count']} ({f(st['total_s'], 3)} s, ratio {f(st['ratio'], 5)}, "
                             f"{st['streams_with_stalls']} watchers{own})"),
        ("watchers' freezes (W3C)", f"{fz['count']} ({f(fz['total_s'], 3)} s)"),
        ("watchers' delivered fps mean / min", f"{f(fps['mean'], 2)} / {f(fps['min'], 2)}"),
        ("watchers' decode per frame / errors", f"{f(wt['decode']['per_frame_ms'], 3, ' ms')} / {wt['errors']['count']}"),
    ]


def verdict(report: dict) -> str:
    """The run in one line: admitted, stalls, and the p95s a viewer feels (TTFF, control latency, glass-to-glass
    where the streams had input), then what it comes to: "no stalls", or how many viewers stalled."""
    def p95(key: str) -> str | None:
        value = (report.get(key) or {}).get("p95")
        return None if value is None else f"{value:.2f} s"

    st = report["stalls"]
    parts = [f"{report['admitted']}/{report['streams']} admitted", f"{st['count']} stalls ({st['total_s']:.2f} s)"]
    parts += [f"{name} p95 {value}" for name, value in (("TTFF", p95("ttff_s")), ("control", p95("control_latency_s")),
                                                        ("glass-to-glass", p95("glass_to_glass_s"))) if value]
    if report["admitted"] == 0:
        outcome = "no viewer got a stream"
    elif st["count"] == 0:
        outcome = "no stalls"
    else:
        outcome = f"{st['streams_with_stalls']} of {report['admitted']} viewers stalled"
    return f"verdict: {', '.join(parts)}: {outcome}"

