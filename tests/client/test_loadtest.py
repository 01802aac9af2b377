"""The load test's report (pure, exact values) and its local server process (a short real run)."""

import argparse
import asyncio
import json
import re
import time

import pytest

from client import loadtest, loadtest_host, loadtest_prompts, loadtest_report
from client.playback import PlaybackStats
from client.viewer import StreamResult


def playback(**kw) -> PlaybackStats:
    base = dict(ttff_s=0.25, stalls=0, stall_s=0.0, play_s=10.0, frames_played=160, frames_received=170,
                delivered_fps=16.0, freezes=0, freeze_s=0.0, control_latencies_s=(), prompts_pending=0,
                buffered_s=0.5, paused_s=0.0)
    base.update(kw)
    return PlaybackStats(**base)


def result(pb: PlaybackStats | None = None, refused: str | None = None, errors=(), **kw) -> StreamResult:
    admitted = refused is None and pb is not None
    base = dict(url="ws://x/ws", admitted=admitted, refused_reason=refused, stream_id="s0" if admitted else None,
                fps=16 if admitted else None, width=128, height=128, chunk_frames=12 if admitted else None,
                playback=pb, session_s=10.5, connected_at=100.0, chunks=14, degraded_chunks=0, frames_decoded=170, bad_frames=0,
                prompt_versions=(0,),
                acks=(), prompts_sent=0, min_headroom_s=0.25, stall_events=(), decode_s=0.05, decode_max_s=0.004,
                closed_reason="closed by client" if admitted else None, errors=tuple(errors))
    base.update(kw)
    return StreamResult(**base)


def test_percentile_interpolates_between_closest_ranks():
    assert loadtest_report.percentile([], 50) is None
    assert loadtest_report.percentile([3.0], 95) == 3.0
    assert loadtest_report.percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0
    assert loadtest_report.percentile([1.0, 2.0, 3.0, 4.0, 5.0], 75) == 4.0
    assert loadtest_report.percentile([0.0, 10.0], 95) == 9.5
    assert loadtest_report.percentile([5.0, 1.0, 3.0], 0) == 1.0


def test_summary_counts_admitted_refused_stalls_and_latencies():
    results = [
        result(playback(ttff_s=0.25, control_latencies_s=(0.5, 1.0))),
        result(playback(ttff_s=0.75, stalls=2, stall_s=0.5, play_s=9.5, delivered_fps=15.0, freezes=1, freeze_s=0.25,
                        control_latencies_s=(0.75,), prompts_pending=1), degraded_chunks=3),
        result(refused="compute: busy", errors=["refused: compute: busy"]),
        result(refused="compute: busy", errors=["refused: compute: busy"]),
        result(None, errors=["connect: OSError: refused"], admitted=False),
    ]
    r = loadtest_report.summarize(results, duration_s=10.0)
    assert r["streams"] == 5 and r["admitted"] == 2
    assert r["refused"] == {"count": 2, "reasons": {"compute: busy": 2}}
    assert r["chunk_s"] == 0.75 and r["fps"] == 16
    assert r["ttff_s"] == {"n": 2, "p50": 0.5, "p95": 0.725, "p99": 0.745, "max": 0.75}
    assert r["stalls"] == {"count": 2, "total_s": 0.5, "ratio": 0.025, "streams_with_stalls": 1}  # 0.5 / 20
    assert r["freezes"] == {"count": 1, "total_s": 0.25}
    assert (r["degraded_chunks"], r["chunks"]) == (3, 28)
    assert r["control_latency_s"]["n"] == 3 and r["control_latency_s"]["p50"] == 0.75
    assert r["control_latency_s"]["max"] == 1.0 and r["control_latency_s"]["pending"] == 1
    assert r["delivered_fps"] == {"mean": 15.5, "min": 15.0}
    assert r["viewer_time_lost"] == round((0.25 + 0.75 + 0.5) / 21.0, 6)
    assert r["errors"] == {"count": 1, "messages": {"connect: OSError: refused": 1}}  # refusals are not errors
    assert len(r["per_stream"]) == 2
    json.dumps(r)  # the report is plain JSON
    assert "16 admitted" not in loadtest_report.format_table(r) and "2 admitted" in loadtest_report.format_table(r)
    assert re.search(r"degraded chunks \(fewer steps, cheaper encode\) +3 of 28\n", loadtest_report.format_table(r))
    assert loadtest_report.verdict(r) == ("verdict: 2/5 admitted, 2 stalls (0.50 s), TTFF p95 0.72 s, control p95 "
                                          f"{r['control_latency_s']['p95']:.2f} s: 1 of 2 viewers stalled")


def test_watchers_are_summarized_apart_and_the_top_level_stays_the_steerers():
    steerers = [result(playback(ttff_s=0.25, control_latencies_s=(0.5,)), audience_max=2, prompts_sent=1),
                result(refused="compute: busy", errors=["refused: compute: busy"])]
    w = dict(role="watch", watched="s0", stream_id="s0", viewer_id="v1", prompts_sent=0)
    watchers = [
        result(playback(ttff_s=0.5), **w),
        result(playback(ttff_s=1.0, stalls=1, stall_s=0.5, play_s=9.5, freezes=2, freeze_s=0.75, delivered_fps=15.0),
               stall_events=((4.0, 0.5),), **w),
        result(refused="stream s0 has 2 watchers, its limit", errors=["refused: stream s0 has 2 watchers, its limit"]),
        result(None, admitted=False, errors=["connect: OSError: refused"]),
    ]
    r = loadtest_report.summarize(steerers, duration_s=10.0, watchers=watchers, watchers_per_stream=3,
                           watchers_not_started=3)
    assert (r["streams"], r["admitted"], r["ttff_s"]["n"], r["stalls"]["count"]) == (2, 1, 1, 0)  # the steerers'
    assert r["control_latency_s"]["sent"] == 1 and len(r["per_stream"]) == 1
    wt = r["watchers"]
    assert (wt["per_stream"], wt["count"], wt["admitted"], wt["not_started"], wt["failed"]) == (3, 7, 2, 3, 1)
    assert wt["refused"] == {"count": 1, "reasons": {"stream s0 has 2 watchers, its limit": 1}}
    assert wt["ttff_s"] == {"n": 2, "p50": 0.75, "p95": 0.975, "p99": 0.995, "max": 1.0}
    assert wt["stalls"] == {"count": 1, "total_s": 0.5, "ratio": 0.025, "streams_with_stalls": 1}  # 0.5 / 20
    assert wt["freezes"] == {"count": 2, "total_s": 0.75} and wt["delivered_fps"] == {"mean": 15.5, "min": 15.0}
    assert wt["viewer_time_lost"] == round((0.5 + 1.0 + 0.5) / 21.0, 6)
    assert wt["roles"] == {"watch": 2} and wt["audience_max"] == {"min": 2, "max": 2} and wt["chunks"] == 28
    assert wt["errors"] == {"count": 1, "messages": {"connect: OSError: refused": 1}}
    assert [(v["viewer_id"], v["stalls"], v["stall_events"]) for v in wt["per_viewer"]] == \
        [("v1", 0, []), ("v1", 1, [[4.0, 0.5]])]
    json.dumps(r)
    text = loadtest_report.format_table(r)
    assert "watchers  " in text and "7 (3 a stream: 2 admitted, 1 refused, 3 not started (stream refused), 1 failed)" in text
    assert re.search(r"watchers' TTFF from join p50 / p95 / max +0.750 / 0.975 / 1.000 s\n", text)
    assert re.search(r"watchers' stalls +1 \(0.500 s, ratio 0.02500, 1 watchers\)\n", text)
    assert "watcher error x1: connect: OSError: refused" in text
    assert "watchers" not in loadtest_report.summarize(steerers, duration_s=10.0)  # none asked for: no section


def test_server_figures_are_the_deltas_over_the_run_and_the_peak_scrape_counts_streams_and_watchers():
    first = {"streamsvc_forwards{kind=denoise}": 10.0, "streamsvc_forward_seconds{kind=denoise}": 0.1,
             "streamsvc_chunks_total": 5.0, "streamsvc_chunks_encoded": 5.0, "streamsvc_encode_seconds": 0.1}
    last = {"streamsvc_forwards{kind=denoise}": 30.0, "streamsvc_forward_seconds{kind=denoise}": 0.5,
            "streamsvc_chunks_total": 105.0, "streamsvc_chunks_encoded": 9.0, "streamsvc_encode_seconds": 0.3}
    peak = {"streamsvc_streams{state=playing}": 3.0, "streamsvc_streams{state=paused}": 1.0,
            "streamsvc_streams{state=closed}": 7.0, "streamsvc_watchers": 96.0}
    figures = loadtest.server_figures(first, last, 10.0, peak)
    assert figures["forwards"]["denoise"] == 20 and figures["forward_ms"]["denoise"] == 20.0
    assert figures["chunks"] == 100 and figures["chunks_encoded"] == 4 and figures["encode_ms_per_chunk"] == 50.0
    assert figures["open_streams_peak"] == 4 and figures["watchers_peak"] == 96
    assert loadtest.server_figures(first, None, 10.0, peak) is None


def test_an_empty_run_summarizes_without_dividing_by_zero():
    r = loadtest_report.summarize([result(refused="full")], duration_s=5.0)
    assert r["admitted"] == 0 and r["ttff_s"]["p95"] is None and r["stalls"]["ratio"] == 0.0
    assert r["delivered_fps"] == {"mean": None, "min": None} and r["chunk_s"] is None
    loadtest_report.format_table(r)


def test_prompt_changes_are_spread_over_viewers_and_stop_before_the_end():
    a = loadtest_prompts.prompt_schedule(0, 4, 5.0, 30.0)
    b = loadtest_prompts.prompt_schedule(3, 4, 5.0, 30.0)
    assert [t for t, _ in a] == [5.0, 10.0, 15.0, 20.0, 25.0]
    assert [t for t, _ in b] == [8.75, 13.75, 18.75, 23.75]  # 28.75 is inside the 2 s quiet tail
    assert len({p for _, p in a}) == len(a) and a[0][1] != b[0][1]
    assert loadtest_prompts.prompt_schedule(0, 4, 0.0, 30.0) == []


def test_the_prompts_follow_the_servers_model():
    """A model with a vocabulary (the built-in one) gets captions in its words, every one of them; a model that reads
    any text gets free text (issue 33: the old defaults, such as "a red fox running through snow, in watercolour",
    drew noise on the built-in model)."""
    from models.scenes import vocabulary

    for words in (vocabulary(), ["a", "red", "blue", "ball", "rising", "falling"], ["red", "cube", "spinning"]):
        for i in range(16):
            prompts = [loadtest_prompts.viewer_prompt(i, 0, vocabulary=words)]
            prompts += [p for _, p in loadtest_prompts.prompt_schedule(i, 16, 5.0, 30.0, vocabulary=words)]
            assert len(prompts) >= 5 and all(set(p.split()) <= set(words) for p in prompts), (words, prompts)
    assert loadtest_prompts.viewer_prompt(0, 0, vocabulary=vocabulary()) == "a red ball moving right"
    assert loadtest_prompts.viewer_prompt(1, 1, vocabulary=["a", "red", "blue", "ball", "rising"]) == "a red ball rising"
    free = [loadtest_prompts.viewer_prompt(0, 0)] + [p for _, p in loadtest_prompts.prompt_schedule(0, 16, 5.0, 30.0)]
    assert free[0] == "a red fox running through snow (viewer 0)"
    assert free[2] == "a red fox running through snow, in watercolour (viewer 0, change 2)"


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    loadtest.add_arguments(p)
    return p.parse_args(list(argv))


def test_defaults_follow_the_issue():
    a = parse()
    assert (a.streams, a.url, a.duration, a.prompt_every, a.transport, a.preset) == (16, None, 30.0, 5.0, "ws", "tiny")
    assert a.weights == "auto"  # the local server runs the built-in trained model
    assert loadtest.TRANSPORTS["ws"].__name__ == "StreamClient"


@pytest.mark.slow
def test_a_short_run_against_a_local_server_writes_the_report(tmp_path, capsys):
    out = tmp_path / "lt.json"
    code = loadtest.run(parse("--streams", "2", "--duration", "4", "--prompt-every", "1", "--json", str(out),
                              "--progress-every", "1"))
    assert code == 0
    r = json.loads(out.read_text())
    assert r["streams"] == 2 and r["admitted"] == 2 and r["errors"]["count"] == 0
    assert r["ttff_s"]["n"] == 2 and r["control_latency_s"]["sent"] == 3  # at 1 and 2 s, and at 1.5 s
    assert r["control_latency_s"]["n"] + r["control_latency_s"]["pending"] == 3
    assert r["server"]["chunks"] > 0 and r["server"]["forward_ms"]["commit"] > 0
    # the local server runs the built-in model: its ready's vocabulary made the prompts captions in its words
    from models.scenes import vocabulary
    assert r["prompts"]["captions"] and r["prompts"]["vocabulary_words"] == len(vocabulary())
    assert all(set(p.split()) <= set(vocabulary()) for p in r["prompts"]["opening"]), r["prompts"]
    text = capsys.readouterr().out
    assert "TTFF p50" in text and "server up at ws://127.0.0.1:" in text
    assert re.search(r"\nverdict: 2/2 admitted, \d+ stalls .*TTFF p95 [0-9.]+ s, control p95", text)
    assert f"wrote the report as JSON to {out}" in text
    assert "prompts: captions in the words of the server model's vocabulary" in text


def test_a_server_that_cannot_start_is_a_clear_error(capsys):
    code = loadtest.run(parse("--streams", "1", "--duration", "1", "--policy", "no_such_policy"))
    assert code == 3
    err = capsys.readouterr().err
    assert "the local server exited with code 2 before it was healthy" in err and "no_such_policy" in err


def test_steal_is_the_share_of_cpu_time_the_hypervisor_took():
    before = [100, 0, 50, 800, 0, 0, 0, 50, 0, 0]
    after = [200, 0, 100, 900, 0, 0, 0, 150, 7, 0]  # +100 user, +50 system, +100 idle, +100 steal
    assert loadtest_host.steal_fraction(before, after) == 100 / 350
    assert loadtest_host.steal_fraction(None, after) is None and loadtest_host.steal_fraction(before, before) is None
    ticks = loadtest_host.cpu_ticks()
    assert ticks is None or (len(ticks) >= 8 and all(t >= 0 for t in ticks))


def test_stalls_that_overlap_a_pause_of_the_viewers_own_loop_are_counted_apart():
    # connected at 100 s: a stall ending 5 s in after 0.2 s (104.8-105.0), one ending 9 s in after 0.1 s
    r = result(playback(stalls=2, stall_s=0.3), stall_events=((5.0, 0.2), (9.0, 0.1)))
    assert loadtest_host.own_stalls([r], [(104.9, 0.3)]) == 1  # the loop paused 104.9-105.2
    assert loadtest_host.own_stalls([r], [(105.0, 0.3), (108.0, 0.5)]) == 0  # touching or before is not overlapping
    assert loadtest_host.own_stalls([r], [(104.0, 5.0)]) == 2
    assert loadtest_host.own_stalls([result(None, admitted=False, connected_at=None)], [(0.0, 1e9)]) == 0


async def test_loop_pauses_records_a_blocked_loop():
    pauses = loadtest_host.LoopPauses(period_s=0.01, min_pause_s=0.05)
    task = asyncio.create_task(pauses.run(time.monotonic() + 2.0))
    await asyncio.sleep(0.05)
    time.sleep(0.2)  # block the loop
    await asyncio.sleep(0.05)
    task.cancel()
    assert len(pauses.pauses) == 1 and 0.15 <= pauses.pauses[0][1] < 1.0 and pauses.max_s >= 0.15
    assert pauses.busy == [0.0] or pauses.busy[0] < 0.1  # time.sleep blocks without working: not the loop's own
    spin = loadtest_host.LoopPauses(period_s=0.01, min_pause_s=0.05)
    task = asyncio.create_task(spin.run(time.monotonic() + 2.0))
    await asyncio.sleep(0.05)
    t, cpu = time.monotonic(), time.thread_time()
    while time.thread_time() - cpu < 0.2 and time.monotonic() - t < 5.0:  # the loop busy with work of its own (its
        pass  # CPU time, not the wall's: a busy host gives this thread less than the wall)
    await asyncio.sleep(0.05)
    task.cancel()
    assert len(spin.busy) == 1 and spin.busy[0] >= 0.1
    assert spin.figures()["pauses_over_50ms"] == 1 and spin.figures()["busy_in_pauses_s"] >= 0.1


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["ws", "webrtc"])
def test_verify_pixels_times_every_prompt_on_the_played_frames(tmp_path, capsys, transport):
    """Whatever the weights draw, every prompt sent is timed, missed or superseded, on frames read while it waited
    (whether the colours match is the built-in model's test: tests/test_builtin_model.py)."""
    out = tmp_path / "lt.json"
    code = loadtest.run(parse("--streams", "2", "--duration", "5", "--prompt-every", "1.5", "--json", str(out),
                              "--progress-every", "0", "--verify-pixels", "--transport", transport))
    assert code == 0
    r = json.loads(out.read_text())
    px, cl = r["pixel_latency_s"], r["control_latency_s"]
    assert r["admitted"] == 2 and r["errors"]["count"] == 0 and r["config"]["verify_pixels"]
    assert cl["sent"] == 3 and px["n"] + px["unmatched"] + px["superseded"] == cl["sent"] and px["no_colour"] == 0
    assert px["frames_read"] > 0 and px["read_ms_per_frame"] > 0
    assert "pixel-verified latency p50 / p95 / max" in capsys.readouterr().out
    assert loadtest.run(parse("--streams", "1", "--verify-pixels", "--decode", "none")) == 2


def test_watchers_are_reported_apart_and_the_top_level_stays_the_steerers():
    # 3 streams with 2 watchers each asked for: s1 refused, so its 2 watchers never started; s0's watchers joined,
    # s2 got one (its second was refused by the server's --max-watchers)
    steerers = [
        result(playback(ttff_s=0.25), stream_id="s0", audience_max=2),
        result(refused="compute: busy", errors=["refused: compute: busy"]),
        result(playback(ttff_s=0.75), stream_id="s2", audience_max=1),
    ]
    watchers = [
        result(playback(ttff_s=0.5, stalls=1, stall_s=0.2, play_s=9.8, delivered_fps=15.0, freezes=1, freeze_s=0.3),
               stream_id="s0", role="watch", watched="s0", viewer_id="v1", chunks=12),
        result(playback(ttff_s=1.5), stream_id="s0", role="watch", watched="s0", viewer_id="v2", chunks=11),
        result(playback(ttff_s=1.0), stream_id="s2", role="watch", watched="s2", viewer_id="v4", chunks=12),
        result(refused="stream s2 has 1 watchers, its limit (--max-watchers)", watched="s2",
               errors=["refused: stream s2 has 1 watchers, its limit (--max-watchers)"]),
    ]
    r = loadtest_report.summarize(steerers, duration_s=10.0, watchers=watchers, watchers_per_stream=2,
                           watchers_not_started=2)
    # the top level is the steerers' alone, as without watchers
    alone = loadtest_report.summarize(steerers, duration_s=10.0)
    assert {k: v for k, v in r.items() if k != "watchers"} == alone and "watchers" not in alone
    w = r["watchers"]
    assert (w["per_stream"], w["count"], w["admitted"], w["not_started"], w["failed"]) == (2, 6, 3, 2, 0)
    assert w["refused"] == {"count": 1, "reasons": {"stream s2 has 1 watchers, its limit (--max-watchers)": 1}}
    assert w["ttff_s"] == {"n": 3, "p50": 1.0, "p95": 1.45, "p99": 1.49, "max": 1.5}  # from each watcher's join
    assert w["stalls"] == {"count": 1, "total_s": 0.2, "ratio": round(0.2 / 30.0, 6), "streams_with_stalls": 1}
    assert w["freezes"] == {"count": 1, "total_s": 0.3}
    assert w["delivered_fps"] == {"mean": round(47.0 / 3, 3), "min": 15.0}
    assert w["chunks"] == 35 and w["roles"] == {"watch": 3} and w["audience_max"] == {"min": 1, "max": 2}
    assert w["errors"] == {"count": 0, "messages": {}}  # a refusal is not an error
    assert [v["viewer_id"] for v in w["per_viewer"]] == ["v1", "v2", "v4"]
    assert [v["stream_id"] for v in w["per_viewer"]] == ["s0", "s0", "s2"]
    json.dumps(r)
    table = loadtest_report.format_table(r)
    assert "6 (2 a stream: 3 admitted, 1 refused, 2 not started (stream refused), 0 failed)" in table
    assert re.search(r"watchers' TTFF from join p50 / p95 / max +1\.000 / 1\.450 / 1\.500 s\n", table)
    assert re.search(r"watchers' stalls +1 \(0\.200 s, ratio 0\.00667, 1 watchers\)\n", table)
    assert "watcher refused x1: stream s2 has 1 watchers" in table


def test_watchers_that_saw_nothing_summarize_without_dividing_by_zero():
    r = loadtest_report.summarize([result(refused="full")], duration_s=5.0, watchers=[], watchers_per_stream=4,
                           watchers_not_started=4)
    w = r["watchers"]
    assert (w["count"], w["admitted"], w["not_started"]) == (4, 0, 4)
    assert w["ttff_s"]["p50"] is None and w["stalls"]["ratio"] == 0.0 and w["delivered_fps"]["mean"] is None
    assert w["audience_max"] == {"min": None, "max": None}
    assert re.search(r"watchers' TTFF from join p50 / p95 / max +- / - / - s\n", loadtest_report.format_table(r))


def test_watchers_per_stream_is_an_option_and_negative_is_refused(capsys):
    assert parse().watchers_per_stream == 0
    assert parse("--watchers-per-stream", "24").watchers_per_stream == 24
    assert loadtest.run(parse("--streams", "1", "--watchers-per-stream", "-1")) == 2
    assert "--watchers-per-stream >= 0" in capsys.readouterr().err


def test_start_image_is_checked_before_any_server_starts(tmp_path, capsys):
    from tests.streamsvc.test_start_image import drawn, encode

    png, gif = tmp_path / "a.png", tmp_path / "a.gif"
    png.write_bytes(encode(drawn()))
    gif.write_bytes(b"GIF89a" + bytes(32))
    for argv, why in [((str(tmp_path / "none.png"),), "cannot be read (No such file or directory)"),
                      ((str(gif),), "not a PNG, JPEG or WebP image"),
                      ((str(png), "--input", str(png)), "not with --input")]:
        assert loadtest.run(parse("--streams", "1", "--start-image", *argv)) == 2
        assert why in capsys.readouterr().err


@pytest.mark.slow
def test_a_short_run_whose_streams_start_from_an_image(tmp_path, capsys):
    from tests.streamsvc.test_start_image import drawn, encode

    image, out = tmp_path / "start.png", tmp_path / "lt.json"
    image.write_bytes(encode(drawn()))
    code = loadtest.run(parse("--streams", "2", "--duration", "4", "--start-image", str(image), "--json", str(out),
                              "--progress-every", "0"))
    assert code == 0
    r = json.loads(out.read_text())
    assert r["admitted"] == 2 and r["errors"]["count"] == 0 and r["ttff_s"]["n"] == 2
    assert r["config"]["start_image"] == str(image)
    assert f"start image {image}: {image.stat().st_size} bytes, inline in each start" in capsys.readouterr().out


def test_a_short_run_whose_streams_start_in_styles_reports_each_style(tmp_path, capsys):
    # the local server offers the built-in model's shipped style (models/assets/styles/invert.safetensors)
    out = tmp_path / "lt.json"
    loadtest.run(parse("--streams", "3", "--duration", "4", "--styles", "invert,none,nosuch", "--json", str(out),
                       "--progress-every", "0"))
    styles = json.loads(out.read_text())["styles"]
    assert styles["invert"]["admitted"] == 1 and styles["none"]["admitted"] == 1, styles
    assert styles["nosuch"]["admitted"] == 0 and sum(styles["nosuch"]["refused"].values()) == 1, styles
    table = capsys.readouterr().out  # the figures are in the printed table too, a line a style
    assert re.search(r"style invert +1 streams: 1 admitted, 0 refused; \d+ stalls", table), table
    assert re.search(r"style nosuch +1 streams: 0 admitted, 1 refused; 0 stalls", table), table


def test_styles_go_round_robin_over_the_streams():
    args = parse("--styles", "a, none ,b")
    assert [loadtest.stream_style(args, i) for i in range(4)] == ["a", None, "b", "a"]
    assert loadtest.stream_style(parse(), 3) is None
