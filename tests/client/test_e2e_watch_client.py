"""Watchers through the client and the load test's code path (the server in-process, tiny preset, CPU).

tests/client/test_e2e_watch.py checks the wire with raw WebSockets; this checks what the client makes of it:
a watcher measured like any viewer, its role and audience kept, steering refused without ending it, and
`run_viewers` with watchers reporting them apart from the steerers. Every wait is bounded.
"""

import argparse
import asyncio

import pytest

from client import loadtest, loadtest_prompts, loadtest_report
from client.viewer import ClientConfig, ClientState
from client.ws_client import StreamClient
from streamsvc.wire import protocol as P
from tests.client.test_e2e_ws import running, url

T = 10.0


def watcher(server, ready: P.Ready, **kw) -> StreamClient:
    """A watcher of the stream its steerer's `ready` names, by its watch link (the id and the watch secret)."""
    return StreamClient(url(server), ClientConfig(watch=ready.stream_id, secret=ready.watch_secret, **kw))


async def test_a_watcher_plays_the_stream_keeps_its_audience_and_cannot_steer():
    async with running() as server:
        async with StreamClient(url(server), ClientConfig(prompt="a red ball moving right", seed=3)) as steerer:
            sid = steerer.ready.stream_id
            async with watcher(server, steerer.ready) as w:
                assert w.ready.stream_id == sid and w.role == "watch" and steerer.role == "steer"
                assert await w.wait_until(lambda: w.chunks >= 2 and w.audience is not None, T), w.errors
                assert w.headers[0].keyframe
                await w.set_prompt("a blue square falling")  # refused, recorded, not fatal
                assert await w.wait_until(lambda: w.not_steerer == 1, T)
                n = w.chunks
                assert await w.wait_until(lambda: w.chunks >= n + 2, T)  # the stream goes on
                assert w.state is ClientState.PLAYING and w.stats().prompts_pending == 0
                assert await steerer.wait_until(lambda: steerer.audience_max == 1, T)
            r = w.result()
            n = steerer.chunks  # the watcher's close ended its watching only
            assert await steerer.wait_until(lambda: steerer.chunks >= n + 1, T)
            assert steerer.closed_reason is None and steerer.state is ClientState.PLAYING
        assert r.admitted and r.role == "watch" and r.watched == sid and r.viewer_id == w.ready.viewer_id
        assert r.playback.ttff_s is not None and 0 < r.playback.ttff_s < T and r.frames_decoded > 0
        assert r.not_steerer == 1 and len(r.errors) == 1 and r.errors[0].startswith("not_steerer: ")
        assert r.closed_reason == "closed by client"


async def test_a_watcher_is_told_when_its_steerer_pauses_and_waits_without_a_stall():
    """The steerer pauses: its watchers get `audience` with paused, and their playback waits with the stream (no
    chunk comes, no stall is counted); it resumes: paused is false again and chunks come."""
    async with running() as server:
        async with StreamClient(url(server), ClientConfig(prompt="a red ball moving right", seed=3)) as steerer:
            async with watcher(server, steerer.ready) as w:
                assert await w.wait_until(lambda: w.chunks >= 2 and w.audience is not None, T), w.errors
                assert w.audience.paused is False
                await steerer.pause()
                assert await w.wait_until(lambda: w.audience.paused, T)
                assert await steerer.wait_until(lambda: [a.request for a in steerer.acks] == ["pause"], T)
                await asyncio.sleep(0.5)  # what was generated before the pause plays out
                stalled = w.stats().stall_s
                await asyncio.sleep(1.0)
                assert w.stats().stall_s == stalled and w.stats().paused_s >= 1.0
                n = w.chunks
                await steerer.resume()
                assert await w.wait_until(lambda: not w.audience.paused and w.chunks >= n + 2, T), w.errors
                assert w.audience.role == "watch" and w.audience.watchers == 1


async def test_a_watch_of_no_stream_is_a_refusal_and_the_steerers_close_ends_its_watchers():
    async with running() as server:
        nobody = StreamClient(url(server), ClientConfig(watch="s404", secret="x" * 22))
        assert not await nobody.open()
        assert nobody.state is ClientState.REFUSED and "s404" in nobody.refused_reason
        assert await nobody.wait_opened(0.01) is False
        assert nobody.server_errors[0].code == P.ErrorCode.NOT_FOUND

        steerer = StreamClient(url(server), ClientConfig(prompt="a green triangle rising", seed=1))
        run = asyncio.create_task(steerer.run(3.0))  # it closes after 3 s: the stream ends for its watchers
        assert await steerer.wait_opened(T)
        w = watcher(server, steerer.ready)
        r = await asyncio.wait_for(w.run(30.0), T)
        s = await asyncio.wait_for(run, T)
        assert r.closed_reason == s.closed_reason == "closed by client" and r.errors == () and r.session_s < 5.0
        assert r.chunks > 0 and r.playback.ttff_s is not None


async def test_server_messages_the_client_does_not_use_never_end_it():
    async with running() as server:
        async with StreamClient(url(server), ClientConfig(prompt="a red ball", seed=1)) as c:
            c._on_text('{"type": "hologram", "depth": 3}')  # a type newer than this client
            c._on_text(P.encode(P.Recording(url="/recordings/s0.mp4", chapters="/recordings/s0.vtt")))
            c._on_text(P.encode(P.Audience(role="watch", watchers=4, steered=False)))
            c._on_text(P.encode(P.Answer(sdp="v=0")))  # valid, but not on a ws stream
            assert c.role == "watch" and c.audience_max == 4 and c.recording.url == "/recordings/s0.mp4"
            n = c.chunks
            assert await c.wait_until(lambda: c.chunks >= n + 2, T)
        r = c.result()
        assert r.ignored_messages == 2 and r.errors == () and r.recording_url == "/recordings/s0.mp4"


def test_a_watcher_config_takes_a_stream_id_and_nothing_of_a_steerers():
    cfg = ClientConfig(watch="s3", secret="w4tch", token="t0k")
    assert cfg.first_message("webrtc") == P.Watch(stream_id="s3", secret="w4tch", transport="webrtc", token="t0k")
    assert ClientConfig(prompt="a cat").first_message() == P.Start(prompt="a cat")
    with pytest.raises(ValueError, match="give no prompt, seed or fps"):
        ClientConfig(watch="s3", secret="w4tch", prompt="a cat")
    with pytest.raises(ValueError, match="a watch needs the stream's watch secret"):  # an id alone grants nothing
        ClientConfig(watch="s3")
    with pytest.raises(ValueError, match="only a watch takes one"):
        ClientConfig(prompt="a cat", secret="w4tch")
    with pytest.raises(ValueError, match="give a prompt"):
        ClientConfig()
    with pytest.raises(ValueError, match="stream_id"):  # the protocol's own check
        ClientConfig(watch="not an id!", secret="w4tch")


def args(server, **kw) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    loadtest.add_arguments(p)
    a = p.parse_args(["--url", url(server), "--progress-every", "0"])
    for k, v in kw.items():
        setattr(a, k, v)
    return a


@pytest.mark.slow
async def test_run_viewers_with_watchers_reports_them_apart():
    async with running() as server:
        report = await asyncio.wait_for(loadtest.run_viewers(
            args(server, streams=2, watchers_per_stream=3, duration=4.0, prompt_every=1.5), url(server), None), 60)
    assert report["streams"] == 2 and report["admitted"] == 2 and report["ttff_s"]["n"] == 2  # the steerers'
    sent = sum(len(loadtest_prompts.prompt_schedule(i, 2, 1.5, 4.0)) for i in range(2))
    assert sent > 0 and report["control_latency_s"]["sent"] == sent  # the steerers' prompts only
    w = report["watchers"]
    assert (w["count"], w["per_stream"], w["admitted"], w["refused"]["count"], w["not_started"], w["failed"]) == \
        (6, 3, 6, 0, 0, 0)
    assert w["ttff_s"]["n"] == 6 and 0 < w["ttff_s"]["max"] < 4.0
    assert w["roles"] == {"watch": 6} and w["audience_max"] == {"min": 3, "max": 3}
    assert w["not_steerer"] == 0 and w["errors"]["count"] == 0 and "during_own_pauses" in w["stalls"]
    assert len(w["per_viewer"]) == 6 and all(v["chunks"] > 0 and v["ttff_s"] > 0 for v in w["per_viewer"])
    assert {v["stream_id"] for v in w["per_viewer"]} == {s["stream_id"] for s in report["per_stream"]}
    assert w["frames"]["played"] > 0 and w["delivered_fps"]["min"] > 0
    text = loadtest_report.format_table(report)
    assert "watchers' TTFF from join p50 / p95 / max" in text and "6 (3 a stream: 6 admitted" in text


@pytest.mark.slow
async def test_run_viewers_over_webrtc_with_watchers():
    async with running() as server:
        report = await asyncio.wait_for(loadtest.run_viewers(
            args(server, streams=1, watchers_per_stream=2, duration=4.0, prompt_every=0.0, transport="webrtc"),
            url(server), None), 60)
    w = report["watchers"]
    assert report["admitted"] == 1 and w["admitted"] == 2 and w["ttff_s"]["n"] == 2, (report["errors"], w["errors"])
    assert w["frames"]["played"] > 0 and w["errors"]["count"] == 0
