"""End to end over loopback: the server in-process (tiny preset, CPU), real WebSocket clients.

Every wait is bounded (StreamClient.wait_until, asyncio.wait_for); each test takes a few seconds.
These are the one place where client tests may import the server.
"""

import asyncio
import contextlib
import gc
import os
import weakref

import pytest
from websockets.asyncio.client import connect

from client.loadtest import free_port
from client.viewer import ClientConfig, ClientState
from client.ws_client import StreamClient
from kvcache.units import format_bytes
from models import GeneratorConfig, build_generator
from streamsvc.engine.config import EngineConfig
from streamsvc.viewers.server import Server, ServerConfig
from streamsvc.wire import protocol as P

T = 10.0  # generous bound for anything that should take well under a second


def engine_config(**kw) -> EngineConfig:
    return EngineConfig(preset="tiny", device="cpu", **kw)


@contextlib.asynccontextmanager
async def running(config: EngineConfig | None = None):
    server = Server(config or engine_config(), ServerConfig(port=0))
    await asyncio.wait_for(server.start(), 60)
    try:
        yield server
    finally:
        await asyncio.wait_for(server.stop(), 30)


@pytest.fixture
async def server():
    async with running() as s:
        yield s


def url(server: Server) -> str:
    return f"ws://127.0.0.1:{server.port}/ws"


def viewer(server: Server, prompt: str = "a red fox in the snow", **kw) -> StreamClient:
    return StreamClient(url(server), ClientConfig(prompt=prompt, seed=kw.pop("seed", 1), **kw))


async def wait_for_server(predicate, timeout_s: float = T) -> bool:
    """Poll server-side state (there is no event for it) until predicate() holds, at most timeout_s."""
    for _ in range(int(timeout_s / 0.02)):
        if predicate():
            return True
        await asyncio.sleep(0.02)
    return predicate()


async def test_three_clients_at_once_receive_chunks_that_decode_to_frames_of_the_right_size(server):
    clients = [viewer(server, f"prompt {i}", seed=i) for i in range(3)]
    assert await asyncio.wait_for(asyncio.gather(*(c.open() for c in clients)), T) == [True] * 3
    try:
        for c in clients:
            assert await c.wait_until(lambda c=c: c.chunks >= 3, T), c.errors
    finally:
        await asyncio.gather(*(c.close() for c in clients))
    gen = server.engine.gen
    width, height = gen.model_cfg.width, gen.model_cfg.height
    assert len({c.ready.stream_id for c in clients}) == 3
    for c in clients:
        r = c.result()
        assert (r.width, r.height) == (width, height)
        assert r.frames_decoded == sum(h.frames for h in c.headers) and r.bad_frames == 0
        assert [h.index for h in c.headers] == list(range(r.chunks))
        assert c.headers[0].keyframe and c.headers[0].frames == gen.frames_in_chunk(0)
        assert all(h.frames == gen.frames_in_chunk(1) for h in c.headers[1:])
        assert [h.pts for h in c.headers[1:]] == [h.pts + h.frames for h in c.headers[:-1]]
        assert r.playback.ttff_s is not None and 0 < r.playback.ttff_s < T
        assert r.closed_reason == "closed by client" and r.errors == ()


async def test_a_prompt_change_shows_in_the_ack_and_the_chunk_headers(server):
    async with viewer(server) as c:
        assert await c.wait_until(lambda: c.chunks >= 1, T)
        await c.set_prompt("a blue whale under the sea")
        assert await c.wait_until(lambda: any(a.request == "set_prompt" for a in c.acks), T)
        assert [(a.request, a.prompt_version) for a in c.acks] == [("set_prompt", 1)]
        assert await c.wait_until(lambda: any(h.prompt_version == 1 for h in c.headers), T)
        assert await c.wait_until(lambda: len(c.stats().control_latencies_s) == 1, T)
    versions = [h.prompt_version for h in c.headers]
    assert versions[0] == 0 and versions == sorted(versions) and set(versions) == {0, 1}
    r = c.result()
    assert r.prompt_versions == (0, 1) and r.prompts_sent == 1
    (latency,) = r.playback.control_latencies_s
    assert 0 < latency < T
    assert r.playback.prompts_pending == 0


async def test_ready_and_the_prompt_ack_name_the_words_the_built_in_model_does_not_know():
    """The built-in model knows only its caption words and draws noise for others: ready carries its vocabulary and
    the start prompt's unknown words, a set_prompt's ack those of the new prompt (issue 33)."""
    from models.scenes import vocabulary

    async with running(engine_config(weights="builtin")) as server:
        async with viewer(server, "a red fox running through snow, in watercolour") as c:
            assert c.ready.vocabulary == vocabulary()
            assert c.ready.unknown_words == ["fox", "running", "through", "snow", "watercolour"]
            for prompt in ("a blue ball moving left", "a green Koala"):
                await c.set_prompt(prompt)
            assert await c.wait_until(lambda: len(c.acks) == 2, T)
            assert [(a.prompt_version, a.unknown_words) for a in c.acks] == [(1, []), (2, ["koala"])]


async def test_a_model_that_reads_any_text_sends_no_vocabulary_and_no_unknown_words(server):
    async with viewer(server, "a red fox running through snow") as c:  # random weights: the hashing encoder
        assert c.ready.vocabulary is None and c.ready.unknown_words == []
        await c.set_prompt("a lighthouse in a storm")
        assert await c.wait_until(lambda: len(c.acks) == 1, T)
        assert c.acks[0].unknown_words == []


async def test_the_load_test_learns_the_servers_vocabulary_from_one_short_stream():
    """The load test's probe: the built-in model's caption words, None for random weights (free text), and a refused
    probe is no vocabulary; each probe stream is closed before the viewers come."""
    from client import loadtest_prompts
    from models.scenes import vocabulary

    async with running(engine_config(weights="builtin")) as server:
        assert (await asyncio.wait_for(loadtest_prompts.probe_vocabulary(url(server), None, T), 2 * T)
                == (True, vocabulary()))
        assert await wait_for_server(lambda: not server.sessions)
    full = Server(engine_config(), ServerConfig(port=0, max_streams=0))  # every stream refused
    await asyncio.wait_for(full.start(), 60)
    try:
        assert await asyncio.wait_for(loadtest_prompts.probe_vocabulary(url(full), None, T), 2 * T) == (False, None)
    finally:
        await asyncio.wait_for(full.stop(), 30)
    async with running() as server:
        assert await asyncio.wait_for(loadtest_prompts.probe_vocabulary(url(server), None, T), 2 * T) == (True, None)
        assert not server.sessions


async def test_protocol_errors_get_error_messages_and_the_stream_goes_on(server):
    async with viewer(server) as c:
        assert await c.wait_until(lambda: c.chunks >= 1, T)
        await c.send_raw("{not json")
        await c.send_raw('{"type": "teleport"}')
        await c.send_raw('{"type": "stats", "buffered_s": -1, "frames_played": 0}')  # out of range
        await c.send_raw('{"type": "set_prompt", "prompt": ""}')  # too short
        await c.send_raw(P.encode(P.Start(prompt="again")))
        assert await c.wait_until(lambda: len(c.server_errors) >= 5, T), c.errors
        codes = [e.code for e in c.server_errors]
        assert codes == [P.ErrorCode.BAD_JSON, P.ErrorCode.UNKNOWN_TYPE, P.ErrorCode.INVALID_FIELD,
                         P.ErrorCode.INVALID_FIELD, P.ErrorCode.ALREADY_STARTED]
        assert "buffered_s" in c.server_errors[2].message and "prompt" in c.server_errors[3].message
        n = c.chunks
        assert await c.wait_until(lambda: c.chunks >= n + 2, T)  # the stream goes on
        assert c.state is ClientState.PLAYING and c.closed_reason is None
    assert c.result().closed_reason == "closed by client"


async def test_a_client_dropped_mid_stream_leaves_the_kv_pool_at_its_baseline(server):
    baseline = server.engine.stats().kv_used_bytes
    async with viewer(server, "the one that stays") as stays:
        with_one = server.engine.stats().kv_used_bytes
        assert with_one > baseline
        ws = await asyncio.wait_for(connect(url(server), compression=None, max_size=P.MAX_CHUNK_BYTES), T)
        await ws.send(P.encode(P.Start(prompt="the one that drops", seed=2)))
        ready = P.parse_server(await asyncio.wait_for(ws.recv(), T))
        assert isinstance(ready, P.Ready)
        assert server.engine.stats().kv_used_bytes > with_one
        for _ in range(5):  # ready, then the first chunk
            msg = await asyncio.wait_for(ws.recv(), T)
            if isinstance(msg, bytes):
                break
        assert isinstance(msg, bytes) and P.unpack_chunk(msg)[0].index == 0
        ws.transport.abort()  # no close frame: the TCP connection just goes away

        assert await wait_for_server(lambda: ready.stream_id not in server.sessions)
        # the other one's cache stays
        assert await wait_for_server(lambda: server.engine.stats().kv_used_bytes == with_one)
        n = stays.chunks
        assert await stays.wait_until(lambda: stays.chunks >= n + 2, T)  # and still plays
    assert await wait_for_server(lambda: server.engine.stats().kv_used_bytes == baseline and not server.sessions)


async def test_a_viewer_gone_while_its_stream_opens_leaves_nothing_behind(server):
    baseline = server.engine.stats().kv_used_bytes
    for _ in range(5):  # the TCP connection goes away right after the start, before or after the ready
        ws = await connect(url(server))
        await ws.send(P.encode(P.Start(prompt="gone at once")))
        ws.transport.abort()
    assert await wait_for_server(lambda: not server.sessions and server.engine.stats().kv_used_bytes == baseline)
    assert await wait_for_server(lambda: not server.entry.limits.held())
    async with viewer(server) as c:  # and the server goes on serving
        assert await c.wait_until(lambda: c.chunks >= 2, T)


async def test_refusal_with_the_kv_pools_reason_when_the_server_is_full():
    stream_bytes = build_generator("tiny", device="cpu", cfg=GeneratorConfig()).cache_spec().stream_bytes()
    async with running(engine_config(kv_budget_bytes=stream_bytes * 3 // 2)) as server:
        async with viewer(server, "first") as first:
            assert first.ready is not None
            second = viewer(server, "second")
            assert await asyncio.wait_for(second.open(), T) is False
            await second.close()
            r = second.result()
            assert not r.admitted and r.playback is None and second.state is ClientState.REFUSED
            assert r.refused_reason.startswith("kv cache: KV cache needs ")  # sizes in the unit they call for:
            assert f"free of {format_bytes(stream_bytes * 3 // 2)} (1 streams open)" in r.refused_reason  # not 0.3 MiB
            assert [e.code for e in second.server_errors] == [P.ErrorCode.REFUSED]
            assert first.state is ClientState.PLAYING
        assert await wait_for_server(lambda: server.engine.stats().kv_used_bytes == 0)


async def test_a_burst_of_connects_is_refused_without_model_work_while_the_admitted_play_on():
    # 2 streams' KV fits: of 30 viewers connecting at once, 2 play and 28 get the pool's reason; a refused
    # start never reaches the model (its prompt is not even encoded) and the admitted ones go on
    stream_bytes = build_generator("tiny", device="cpu", cfg=GeneratorConfig()).cache_spec().stream_bytes()
    async with running(engine_config(kv_budget_bytes=stream_bytes * 5 // 2)) as server:
        clients = [viewer(server, f"burst prompt {i}", seed=i) for i in range(30)]
        opened = await asyncio.wait_for(asyncio.gather(*(c.open() for c in clients)), T)
        try:
            playing = [c for c, ok in zip(clients, opened) if ok]
            refused = [c for c, ok in zip(clients, opened) if not ok]
            assert len(playing) == 2 and len(refused) == 28
            assert all(c.refused_reason.startswith("kv cache:") for c in refused)
            encoded = set(server.engine.gen.prompts.entries)  # (no styles: keyed by the prompt alone)
            assert not encoded & {c.config.prompt for c in refused}
            assert {c.config.prompt for c in playing} <= encoded
            n = [c.chunks for c in playing]
            for c, before in zip(playing, n):
                assert await c.wait_until(lambda c=c, before=before: c.chunks >= before + 3, T), c.errors
        finally:
            await asyncio.gather(*(c.close() for c in clients))


async def test_every_chunk_header_says_its_denoising_steps(server):
    async with viewer(server) as c:
        assert await c.wait_until(lambda: c.chunks >= 3, T)
    assert c.ready.steps == len(server.engine.gen.sigmas) == 4
    assert all(1 <= h.steps <= c.ready.steps for h in c.headers)
    assert c.result().degraded_chunks == sum(1 for h in c.headers if h.steps < c.ready.steps)


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="the encoder processes are read off /proc")
async def test_metrics_show_the_process_and_its_encoder_processes(server):
    async with viewer(server) as c:
        assert await c.wait_until(lambda: c.chunks >= 2, T)
        server.refresh_metrics()
        value = server.metrics.registry.get_sample_value
        workers = len(server.engine.output.encoder_pids())
        assert workers >= 1  # on the CPU, x264 runs in child processes, one an output worker
        assert value("streamsvc_encoder_processes") == workers
        assert value("streamsvc_encoder_rss_bytes") > workers * 5e6  # Python, av and numpy in each
        assert value("streamsvc_encoder_threads") >= workers and value("streamsvc_encoder_open_fds") >= 3 * workers
        assert value("process_resident_memory_bytes") > value("streamsvc_encoder_rss_bytes") / workers
        assert value("process_open_fds") > 0 and value("streamsvc_process_threads") >= 3  # loop, engine, output
        assert value("streamsvc_cuda_memory_allocated_bytes") is None  # a CPU server shows no device memory


async def test_pause_and_resume_are_acknowledged_and_generation_waits_while_paused(server):
    def metric(name: str, **labels) -> float:
        server.refresh_metrics()
        return server.metrics.registry.get_sample_value(name, labels)

    async with viewer(server) as c:
        assert await c.wait_until(lambda: c.chunks >= 2, T)
        await c.resume()  # not paused: acknowledged, nothing happens
        assert await c.wait_until(lambda: [a.request for a in c.acks] == ["resume"], T)
        assert metric("streamsvc_parks", op="restore") == 0
        await c.pause()
        await c.pause()  # a repeat is acknowledged too
        assert await c.wait_until(lambda: [a.request for a in c.acks] == ["resume", "pause", "pause"], T)
        assert metric("streamsvc_parked_streams") == 1 and metric("streamsvc_parks", op="park") == 1
        assert metric("streamsvc_parked_bytes") > 0
        await asyncio.sleep(0.5)  # the buffer reaches the cap, then nothing more comes
        n = c.chunks
        await asyncio.sleep(1.0)
        assert c.chunks <= n + 1
        await c.resume()
        assert await c.wait_until(lambda: [a.request for a in c.acks][3:] == ["resume"], T)
        assert await c.wait_until(lambda: c.chunks >= n + 3, T)
        assert c.stats().paused_s >= 1.4
        assert metric("streamsvc_parked_streams") == 0 and metric("streamsvc_parked_bytes") == 0
        assert metric("streamsvc_parks", op="restore") == 1 and metric("streamsvc_park_seconds", op="restore") > 0
    assert c.result().errors == ()


async def test_a_pause_without_park_budget_is_unavailable_with_the_reason_and_the_stream_goes_on():
    async with running(engine_config(park_budget_bytes=0)) as server:
        async with viewer(server) as c:
            assert await c.wait_until(lambda: c.chunks >= 1, T)
            await c.pause()
            assert await c.wait_until(lambda: c.server_errors, T)
            error = c.server_errors[0]
            assert error.code == P.ErrorCode.UNAVAILABLE and error.request == "pause" and "budget" in error.message
            n = c.chunks
            assert await c.wait_until(lambda: c.chunks >= n + 2, T)  # it was never paused
            assert c.acks == [] and server.engine.stats().parked_streams == 0


async def test_a_resume_refused_for_room_leaves_the_stream_and_its_playback_paused_until_one_is_taken():
    """Room for one stream: A pauses (its cache goes to host memory), B takes the room, A's resume is refused
    (`unavailable`): A stays paused and so does its playback, its wait not counted as a stall. B leaves, and A's
    next resume is taken."""
    stream_bytes = build_generator("tiny", device="cpu", cfg=GeneratorConfig()).cache_spec().stream_bytes()
    async with running(engine_config(kv_budget_bytes=stream_bytes * 3 // 2)) as server:
        async with viewer(server, "first") as a:
            assert await a.wait_until(lambda: a.chunks >= 1, T)
            await a.pause()
            assert await a.wait_until(lambda: [x.request for x in a.acks] == ["pause"], T)
            assert await wait_for_server(lambda: server.engine.stats().parked_streams == 1)
            async with viewer(server, "second") as b:
                assert await b.wait_until(lambda: b.chunks >= 1, T), b.errors
                await a.resume()
                assert await a.wait_until(lambda: a.resumes_refused == 1, T)
                error = a.server_errors[-1]
                assert error.code == P.ErrorCode.UNAVAILABLE and error.request == "resume" and "kv" in error.message.lower()
                stalled = a.stats().stall_s
                await asyncio.sleep(1.0)
                assert a.stats().stall_s == stalled and a.stats().paused_s >= 1.0  # paused, not stalled
                assert a.state is ClientState.PLAYING and server.engine.stats().parked_streams == 1
            assert await wait_for_server(lambda: server.engine.stats().kv_used_bytes == 0)
            n = a.chunks
            await a.resume()
            assert await a.wait_until(lambda: [x.request for x in a.acks] == ["pause", "resume"], T), a.errors
            assert await a.wait_until(lambda: a.chunks >= n + 2, T)
            assert a.resumes_refused == 1


async def test_graceful_stop_sends_closed_to_every_connected_client():
    async with running() as server:
        clients = [viewer(server, f"p{i}", seed=i) for i in range(2)]
        assert await asyncio.wait_for(asyncio.gather(*(c.open() for c in clients)), T) == [True, True]
        for c in clients:
            assert await c.wait_until(lambda c=c: c.chunks >= 1, T)
        await asyncio.wait_for(server.stop(), T)
        for c in clients:
            assert await c.wait_until(lambda c=c: c.closed_reason is not None, T)
    for c in clients:
        await c.close()
        r = c.result()
        assert r.closed_reason == "server shutting down" and r.errors == ()
        assert r.playback is not None and r.playback.frames_received > 0


async def test_a_whole_session_with_run_reports_playback_and_control_latency(server):
    c = viewer(server, stats_every_s=0.25)
    r = await asyncio.wait_for(c.run(3.0, [(1.0, "a lighthouse in a storm")]), 3.0 + T)
    assert r.admitted and r.closed_reason == "closed by client" and r.errors == ()
    assert 2.9 < r.session_s < 3.0 + T
    assert r.prompt_versions == (0, 1) and len(r.playback.control_latencies_s) == 1
    assert r.playback.frames_played > 0 and r.playback.delivered_fps > 0
    assert r.chunks >= 3 and r.acks == (("set_prompt", 1),)


async def test_no_server_is_an_error_in_the_result_not_an_exception():
    c = StreamClient(f"ws://127.0.0.1:{free_port()}/ws", ClientConfig(prompt="anyone there?", open_timeout_s=2))
    r = await asyncio.wait_for(c.run(1.0), T)
    assert not r.admitted and r.refused_reason is None and r.playback is None
    assert len(r.errors) == 1 and r.errors[0].startswith("connect:")
    assert c.state is ClientState.CLOSED


async def test_latency_low_serves_chunks_of_4_frames_whose_lone_first_frame_comes_with_the_second():
    """`serve --latency low`'s engine (streamsvc/options.py): its ready says so and gives chunks of 4 frames after a
    first of 1, which reaches the viewer together with the second (alone, it would play and stall); the session plays
    without a stall and steers, the new prompt's first chunk cutting to it."""
    from streamsvc import cli, options

    config = options.engine_config(cli.build_parser().parse_args(["serve", "--device", "cpu", "--latency", "low"]))
    server = Server(config, ServerConfig(port=0))
    await asyncio.wait_for(server.start(), 60)
    try:
        c = viewer(server, stats_every_s=0.25)
        r = await asyncio.wait_for(c.run(3.0, [(1.0, "a blue square moving left")]), 3.0 + T)
        assert r.admitted and r.errors == () and (c.ready.latency, c.ready.chunk_frames) == ("low", 4)
        assert c.ready.first_chunk_frames == 1 and [h.frames for h in c.headers[:3]] == [1, 4, 4]
        assert r.playback.stalls == 0 and r.prompt_versions == (0, 1)
        assert len(r.playback.control_latencies_s) == 1
        # the new prompt's first chunk cuts, from a keyframe; no other chunk does
        cuts = [(h.prompt_version, h.keyframe) for h in c.headers if h.cut]
        assert cuts == [(1, True)] and next(h for h in c.headers if h.prompt_version == 1).cut
    finally:
        await asyncio.wait_for(server.stop(), 30)


async def test_a_closed_streams_session_is_freed_soon_without_the_automatic_collector(server):
    """A closed stream's session, viewers and driver refer to one another, so only a collection frees them: the
    server runs one soon after the close (before, only the rare automatic full one did, and a soak's RSS crept up)."""
    gc.collect()
    gc.disable()  # the automatic collector could free it too, at a moment of its own
    try:
        async with viewer(server, "a red ball moving right") as c:
            assert await c.wait_until(lambda: c.chunks >= 1, T)
            session = weakref.ref(server.sessions[c.ready.stream_id])
        assert await wait_for_server(lambda: session() is None, T)
    finally:
        gc.enable()
