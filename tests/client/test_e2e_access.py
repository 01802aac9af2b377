"""Access over loopback: tokens, origins, per-client limits, control rates and prompt coalescing, with the
server in-process (tiny preset, CPU) and real WebSocket clients. Rates run on an injected clock."""

import asyncio
import urllib.request

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from client.loadtest import scrape_metrics
from client.viewer import ClientConfig, ClientState
from client.ws_client import StreamClient
from streamsvc.door.access import AccessConfig, Rate
from streamsvc.viewers.server import Server
from streamsvc.wire import protocol as P
from tests.client.servers import running, url
from tests.clock import ManualClock as Clock

T = 10.0  # generous bound for anything that should take well under a second


def viewer(server: Server, token: str | None = None, prompt: str = "a red fox in the snow") -> StreamClient:
    return StreamClient(url(server), ClientConfig(prompt=prompt, seed=1, token=token, stats_every_s=0))


async def refusals(server: Server, token: str | None = None) -> dict[str, float]:
    """The refusals counted in /metrics (which, on a server with tokens, needs one)."""
    metrics = await asyncio.to_thread(scrape_metrics, f"http://127.0.0.1:{server.port}/metrics", T, token)
    return {k.split("reason=")[1][:-1]: v for k, v in metrics.items() if k.startswith("streamsvc_refusals_total")}


def metrics_text(port: int, token: str) -> str:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=T) as r:
        return r.read().decode()


async def raw_start(server: Server, start: P.Start, **connect_kw) -> tuple[P.Error | P.Ready, object]:
    """Open a socket, send start, return the answer and the socket."""
    ws = await asyncio.wait_for(connect(url(server), compression=None, max_size=P.MAX_CHUNK_BYTES, **connect_kw), T)
    await ws.send(P.encode(start))
    return P.parse_server(await asyncio.wait_for(ws.recv(), T)), ws


# ---------------------------------------------------------------- tokens


async def test_with_tokens_a_stream_starts_only_with_a_valid_one_in_start_or_in_the_header():
    async with running(AccessConfig(tokens={"s3cret": None, "other": None})) as server:
        async with viewer(server, token="s3cret") as c:  # the token in the start message
            assert c.state is ClientState.PLAYING
            assert await c.wait_until(lambda: c.chunks >= 1, T), c.errors

        answer, ws = await raw_start(server, P.Start(prompt="header"), additional_headers={"Authorization": "Bearer other"})
        assert isinstance(answer, P.Ready)
        await ws.close()

        for token, headers, says in ((None, {}, "needs an access token"), ("wrong", {}, "not valid"),
                                     (None, {"Authorization": "Bearer wrong"}, "not valid"),
                                     (None, {"Authorization": "Basic s3cret"}, "needs an access token")):
            answer, ws = await raw_start(server, P.Start(prompt="no", token=token), additional_headers=headers)
            assert isinstance(answer, P.Error) and answer.code is P.ErrorCode.UNAUTHORIZED, answer
            assert says in answer.message and "s3cret" not in answer.message and answer.request == "start"
            await asyncio.wait_for(ws.wait_closed(), T)  # the server closed the socket
            assert ws.close_code == 1008

        c = viewer(server, token="wrong")
        assert not await c.open()  # the Python client reports it as a refusal, with the reason
        assert c.state is ClientState.REFUSED and "not valid" in c.refused_reason
        await c.close()
        assert (await refusals(server, "s3cret"))["unauthorized"] == 5
        assert not server.sessions


async def test_without_tokens_any_start_is_served_and_a_token_sent_anyway_is_ignored():
    async with running() as server:
        for token in (None, "anything"):
            async with viewer(server, token=token) as c:
                assert c.state is ClientState.PLAYING


# ---------------------------------------------------------------- origins


async def test_browser_upgrades_must_come_from_the_servers_own_origin_or_an_allowed_one():
    async with running(AccessConfig(allowed_origins=("https://app.example.org",))) as server:
        own = f"http://127.0.0.1:{server.port}"
        for origin in (None, own, "https://app.example.org"):
            answer, ws = await raw_start(server, P.Start(prompt="ok"), **({"origin": origin} if origin else {}))
            assert isinstance(answer, P.Ready), origin
            await ws.close()
        for origin in ("http://evil.example", "null", f"http://127.0.0.1:{server.port + 1}"):
            with pytest.raises(InvalidStatus) as refused:
                await raw_start(server, P.Start(prompt="no"), origin=origin)
            assert refused.value.response.status_code == 403
            assert b"--allow-origin" in refused.value.response.body
        assert (await refusals(server))["origin"] == 3


# ---------------------------------------------------------------- per-client limits


async def test_streams_per_address_and_per_token_are_limited_and_freed_when_a_stream_ends():
    async with running(AccessConfig(tokens={"one": 1, "many": None}, max_streams_per_client=2)) as server:
        async with viewer(server, token="one") as first:
            assert first.state is ClientState.PLAYING
            answer, ws = await raw_start(server, P.Start(prompt="second on one", token="one"))
            assert answer.code is P.ErrorCode.TOO_MANY_STREAMS and "token" in answer.message
            await ws.close()
            async with viewer(server, token="many") as second:
                assert second.state is ClientState.PLAYING
                third = viewer(server, token="many")
                assert not await third.open()
                assert third.state is ClientState.REFUSED and "--max-streams-per-client" in third.refused_reason
                await third.close()
        async with viewer(server, token="one") as again:  # both streams ended: their slots came free
            assert again.state is ClientState.PLAYING
        counted = await refusals(server, "many")
        assert counted["token_streams"] == 1 and counted["client_streams"] == 1


async def test_x_forwarded_for_counts_only_with_trust_proxy():
    for trust, admitted in ((True, True), (False, False)):
        async with running(AccessConfig(max_streams_per_client=1, trust_proxy=trust)) as server:
            a, ws_a = await raw_start(server, P.Start(prompt="a"), additional_headers={"X-Forwarded-For": "203.0.113.1"})
            b, ws_b = await raw_start(server, P.Start(prompt="b"), additional_headers={"X-Forwarded-For": "203.0.113.2"})
            assert isinstance(a, P.Ready) and isinstance(b, P.Ready) is admitted, (trust, b)
            await ws_a.close()
            await ws_b.close()


# ---------------------------------------------------------------- control rates


async def test_control_messages_over_the_rate_are_refused_and_the_stream_goes_on():
    clock = Clock()
    access = AccessConfig(control_rate=Rate(2.0, 3), stats_rate=Rate(1.0, 1))
    async with running(access, clock) as server:
        async with viewer(server) as c:
            assert await c.wait_until(lambda: c.chunks >= 1, T)
            for _ in range(5):
                await c.send_raw(P.encode(P.Resume()))
            assert await c.wait_until(lambda: len(c.acks) + len(c.server_errors) >= 5, T)
            assert [a.request for a in c.acks] == ["resume"] * 3  # the burst
            assert [(e.code, e.request) for e in c.server_errors] == [(P.ErrorCode.RATE_LIMITED, "resume")] * 2
            assert "2 control messages a second" in c.server_errors[0].message

            stats = P.encode(P.Stats(buffered_s=1.0, frames_played=10))
            for _ in range(3):  # stats have their own cap: they do not eat the steering budget
                await c.send_raw(stats)
            assert await c.wait_until(lambda: len(c.server_errors) >= 4, T)
            assert [e.request for e in c.server_errors[2:]] == ["stats", "stats"]

            clock.now += 1.0  # two control messages refilled
            await c.set_prompt("a blue whale under the sea")
            assert await c.wait_until(lambda: any(a.request == "set_prompt" for a in c.acks), T), c.errors
            n = c.chunks
            assert await c.wait_until(lambda: c.chunks >= n + 2, T)  # and the stream plays on
            assert c.state is ClientState.PLAYING and c.closed_reason is None
            assert await c.wait_until(lambda: c.stats().prompts_pending == 0, T)  # the prompt got its reply
        counted = await refusals(server)
        assert counted["rate_limited"] == 2 and counted["stats_rate_limited"] == 2


async def test_a_prompt_flood_is_rate_limited_answered_in_order_and_the_stream_goes_on():
    clock = Clock()
    async with running(AccessConfig(control_rate=Rate(5.0, 10)), clock) as server:
        async with viewer(server) as c:
            assert await c.wait_until(lambda: c.chunks >= 1, T)
            for i in range(40):
                await c.set_prompt(f"flood {i}")
            assert await c.wait_until(lambda: len(c.acks) + len(c.server_errors) >= 40, T), c.errors
            assert len(c.acks) == 10 and len(c.server_errors) == 30
            assert all(e.code is P.ErrorCode.RATE_LIMITED and e.request == "set_prompt" for e in c.server_errors)
            versions = [a.prompt_version for a in c.acks]
            assert versions == list(range(1, 11))  # each accepted prompt its version, in order (the scheduler
            # coalesces them: the newest shows, tests/streamsvc/scheduling/test_planner.py)
            assert await c.wait_until(lambda: c.headers[-1].prompt_version == versions[-1], T)
            assert await c.wait_until(lambda: c.stats().prompts_pending == 0, T)  # every reply paired up
            n = c.chunks
            assert await c.wait_until(lambda: c.chunks >= n + 2, T)
        assert (await refusals(server))["rate_limited"] == 30


# ---------------------------------------------------------------- coalescing


async def test_fifty_prompts_in_one_second_cost_at_most_one_recache_per_chunk():
    async with running(AccessConfig(control_rate=Rate(1000.0, 1000))) as server:
        engine = server.engine
        async with viewer(server) as c:
            assert await c.wait_until(lambda: c.chunks >= 1, T)
            recaches0, chunks0 = engine.stats().forwards["recache"], c.chunks
            for i in range(50):
                await c.set_prompt(f"prompt {i}")
                await asyncio.sleep(0.02)
            assert await c.wait_until(lambda: len(c.acks) >= 50, T), c.errors
            last = c.acks[-1].prompt_version
            assert last == 50  # "prompt 49": each prompt its version
            assert await c.wait_until(lambda: c.headers[-1].prompt_version == last, T)  # the newest is generated
            recaches, chunks = engine.stats().forwards["recache"] - recaches0, c.chunks - chunks0
            assert await c.wait_until(lambda: c.stats().prompts_pending == 0, T)  # every prompt settled on screen
        assert 1 <= recaches <= chunks + 1, (recaches, chunks)
        assert [a.prompt_version for a in c.acks] == sorted(a.prompt_version for a in c.acks)
        assert c.server_errors == []


# ---------------------------------------------------------------- metrics


async def test_metrics_count_refusals_by_reason_and_carry_no_prompt_text_or_client_address():
    async with running(AccessConfig(tokens={"t": None})) as server:
        async with viewer(server, token="t", prompt="a very secret prompt about zebras") as c:
            await c.set_prompt("another secret prompt about giraffes")
            assert await c.wait_until(lambda: len(c.acks) >= 1, T)
            text = await asyncio.to_thread(metrics_text, server.port, "t")
        assert "zebras" not in text and "giraffes" not in text and "127.0.0.1" not in text
        for reason in ("origin", "unauthorized", "token_streams", "client_streams", "server_cap", "admission",
                       "rate_limited", "stats_rate_limited"):
            assert f'streamsvc_refusals_total{{reason="{reason}"}}' in text
