"""Watchers end to end over loopback: one stream, its steerer and its watchers (the server in-process, tiny preset).

Raw WebSocket connections, so that what is checked is the wire: the same bytes to every viewer, a late
watcher's first chunk a keyframe, steering refused to watchers, the token handed over, taken after the steerer
left, and the orphan timeout; a watch link and a take as capabilities (an id alone grants nothing). Every wait is
bounded.
"""

import asyncio
import base64
import contextlib
import json

import av
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from streamsvc.viewers.server import Server
from streamsvc.viewers.session import GOP_CHUNKS
from streamsvc.wire import protocol as P
from tests.client.servers import running

T = 10.0


class Peer:
    """One raw WebSocket viewer: what it sent and everything it received, chunk payloads and messages apart."""

    def __init__(self, ws) -> None:
        self.ws = ws
        self.payloads: list[bytes] = []  # binary chunk messages, as received
        self.messages: list = []  # parsed text messages
        self.ready: P.Ready | None = None
        self._reader = asyncio.create_task(self._read())

    @classmethod
    async def open(cls, server: Server, first: dict) -> "Peer":
        ws = await connect(f"ws://127.0.0.1:{server.port}/ws", max_size=P.MAX_CHUNK_BYTES)
        peer = cls(ws)
        await ws.send(json.dumps(first))
        await peer.until(lambda: peer.ready is not None or peer.errors, "ready")
        return peer

    async def _read(self) -> None:
        with contextlib.suppress(ConnectionClosed):
            async for raw in self.ws:
                if isinstance(raw, bytes):
                    self.payloads.append(raw)
                    continue
                msg = P.parse_server(raw)
                self.messages.append(msg)
                if isinstance(msg, P.Ready):
                    self.ready = msg

    def of(self, kind) -> list:
        return [m for m in self.messages if isinstance(m, kind)]

    @property
    def errors(self) -> list[P.Error]:
        return self.of(P.Error)

    @property
    def headers(self) -> list[P.Chunk]:
        return [P.unpack_chunk(p)[0] for p in self.payloads]

    async def send(self, msg: dict) -> None:
        await self.ws.send(json.dumps(msg))

    async def until(self, predicate, what: str, timeout_s: float = T) -> None:
        for _ in range(int(timeout_s / 0.02)):
            if predicate():
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"timed out waiting for {what}; messages: {self.messages[-5:]}")

    async def close(self) -> None:
        await self.ws.close()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._reader, 5)


def start(prompt: str = "a red ball moving right") -> dict:
    return {"type": "start", "prompt": prompt, "seed": 3}


def watch(ready: P.Ready) -> dict:
    """A watch of the stream its steerer's `ready` names, by its watch link: the id and the watch secret."""
    return {"type": "watch", "stream_id": ready.stream_id, "secret": ready.watch_secret}


def take(ready: P.Ready) -> dict:
    """A take of the steer token of the stream its first steerer's `ready` names, with its steer secret."""
    return {"type": "take", "secret": ready.steer_secret}


def decode(payloads: list[bytes]) -> int:
    """Frames a fresh H.264 decoder makes of these chunks (it needs an IDR with SPS/PPS first)."""
    codec = av.CodecContext.create("h264", "r")
    frames = 0
    for payload in payloads:
        for au in P.unpack_chunk(payload)[1]:
            frames += len(codec.decode(av.Packet(au)))
    return frames + len(codec.decode(None))


async def test_every_viewer_gets_the_same_bytes_and_a_late_watcher_starts_at_a_keyframe():
    async with running() as server:
        steerer = await Peer.open(server, start())
        sid = steerer.ready.stream_id
        early = await Peer.open(server, watch(steerer.ready))
        assert early.ready.role == "watch" and early.ready.stream_id == sid and steerer.ready.role == "steer"
        assert early.ready.viewer_id != steerer.ready.viewer_id
        await steerer.until(lambda: len(steerer.payloads) >= 8, "8 chunks")
        sent = len(steerer.payloads)
        late = await Peer.open(server, watch(steerer.ready))
        await late.until(lambda: len(late.payloads) >= 3, "the late watcher's chunks")
        await early.until(lambda: len(early.payloads) >= len(steerer.payloads) - 1, "early watcher")
        # fan-out: one encode, the same bytes to each viewer, chunk by chunk
        by_index = {h.index: p for h, p in zip(steerer.headers, steerer.payloads)}
        for peer in (early, late):
            for header, payload in zip(peer.headers, peer.payloads):
                assert payload == by_index[header.index]
        assert [h.index for h in early.headers] == list(range(len(early.payloads)))
        first = late.headers[0]
        # it joined mid-stream: it starts at a keyframe chunk the stream kept (the encoder makes one every 2 s)
        assert sent - GOP_CHUNKS <= first.index <= sent and first.index > 0 and first.keyframe
        assert [h.index for h in late.headers] == list(range(first.index, first.index + len(late.headers)))
        assert decode(late.payloads) == sum(h.frames for h in late.headers)  # its first frame decodes, and all after
        await early.until(lambda: any(a.watchers == 2 for a in early.of(P.Audience)), "audience of 2 watchers")
        assert steerer.of(P.Audience)[-1] == P.Audience(role="steer", watchers=2, steered=True)
        assert server.metrics.registry.get_sample_value("streamsvc_watchers_admitted_total") == 2
        for peer in (late, early, steerer):
            await peer.close()


async def test_a_watcher_cannot_steer_until_the_token_is_handed_to_it():
    async with running() as server:
        steerer = await Peer.open(server, start())
        watcher = await Peer.open(server, watch(steerer.ready))
        await watcher.send({"type": "set_prompt", "prompt": "a blue square falling"})
        await watcher.until(lambda: watcher.errors, "not_steerer")
        error = watcher.errors[0]
        assert error.code == P.ErrorCode.NOT_STEERER and error.request == "set_prompt"
        assert steerer.ready.viewer_id in error.message  # who can hand the token over
        seen = len(watcher.payloads)
        await watcher.until(lambda: len(watcher.payloads) > seen + 1, "chunks after the refusal")  # it goes on

        await steerer.send({"type": "handover", "to": watcher.ready.viewer_id})
        await watcher.until(lambda: watcher.of(P.Audience) and watcher.of(P.Audience)[-1].role == "steer", "token")
        await watcher.send({"type": "set_prompt", "prompt": "a blue square falling"})
        await watcher.until(lambda: any(a.request == "set_prompt" for a in watcher.of(P.Ack)), "ack")
        version = [a for a in watcher.of(P.Ack) if a.request == "set_prompt"][0].prompt_version
        await steerer.until(lambda: any(h.prompt_version == version for h in steerer.headers), "the new prompt")
        await steerer.send({"type": "set_prompt", "prompt": "a green triangle"})  # it watches now
        await steerer.until(lambda: any(e.code == P.ErrorCode.NOT_STEERER for e in steerer.errors), "refused")
        await steerer.send({"type": "handover", "to": "v999"})  # not from a watcher: refused too
        await steerer.until(lambda: len(steerer.errors) == 2, "second refusal")
        await watcher.send({"type": "handover", "to": "v999"})
        await watcher.until(lambda: any(e.request == "handover" for e in watcher.errors), "unknown viewer")
        assert "no watcher 'v999'" in [e for e in watcher.errors if e.request == "handover"][0].message
        await watcher.close()
        await steerer.close()


async def test_the_stream_outlives_its_steerer_while_watchers_remain_and_a_watcher_takes_the_token():
    async with running(orphan_timeout_s=30) as server:
        steerer = await Peer.open(server, start())
        sid = steerer.ready.stream_id
        a, b = await Peer.open(server, watch(steerer.ready)), await Peer.open(server, watch(steerer.ready))
        await b.send(take(steerer.ready))  # refused while the steerer holds it
        await b.until(lambda: b.errors, "take refused")
        assert b.errors[0].code == P.ErrorCode.NOT_STEERER
        await steerer.close()  # it vanishes: the stream goes on for its watchers
        await a.until(lambda: a.of(P.Audience) and not a.of(P.Audience)[-1].steered, "orphaned")
        seen = len(a.payloads)
        await a.until(lambda: len(a.payloads) >= seen + 2, "chunks without a steerer")
        server.refresh_metrics()  # what GET /metrics runs
        assert sid in server.sessions and server.metrics.registry.get_sample_value("streamsvc_orphaned_streams") == 1
        assert server.metrics.registry.get_sample_value("streamsvc_watchers") == 2
        await b.send(take(steerer.ready))
        await b.until(lambda: b.of(P.Ack) and b.of(P.Ack)[-1].request == "take", "take")
        await a.until(lambda: a.of(P.Audience)[-1].steered, "steered again")
        await b.send({"type": "set_prompt", "prompt": "a blue square falling"})
        await b.until(lambda: any(x.request == "set_prompt" for x in b.of(P.Ack)), "the new steerer's ack")
        await a.send({"type": "close"})  # a watcher's close ends its watching only
        await a.until(lambda: a.of(P.Closed), "closed")
        seen = len(b.payloads)
        await b.until(lambda: len(b.payloads) >= seen + 2, "the stream goes on")
        await b.send({"type": "close"})  # the steerer's close ends the stream
        await b.until(lambda: b.of(P.Closed), "closed")
        for _ in range(100):
            if not server.sessions and server.engine.stats().kv_used_bytes == 0:
                break
            await asyncio.sleep(0.05)
        assert not server.sessions and server.engine.stats().kv_used_bytes == 0
        await a.close()
        await b.close()


async def test_an_orphaned_stream_ends_after_the_orphan_timeout():
    async with running(orphan_timeout_s=0.5) as server:
        steerer = await Peer.open(server, start())
        watcher = await Peer.open(server, watch(steerer.ready))
        await steerer.close()
        await watcher.until(lambda: watcher.of(P.Closed), "closed by the orphan timeout", timeout_s=5)
        assert "nobody took the steer token within 0.5 s" in watcher.of(P.Closed)[0].reason
        assert not server.sessions
        await watcher.close()


async def test_watch_refusals_say_why():
    async with running(max_watchers=1) as server:
        nobody = await Peer.open(server, {"type": "watch", "stream_id": "s404", "secret": "x" * 22})
        assert nobody.errors[0].code == P.ErrorCode.NOT_FOUND and nobody.errors[0].request == "watch"
        steerer = await Peer.open(server, start())
        first = await Peer.open(server, watch(steerer.ready))
        second = await Peer.open(server, watch(steerer.ready))
        assert first.ready is not None and second.ready is None
        assert second.errors[0].code == P.ErrorCode.REFUSED and "--max-watchers" in second.errors[0].message
        await first.send(start())
        await first.until(lambda: first.errors, "already watching")
        assert first.errors[0].code == P.ErrorCode.ALREADY_STARTED
        assert server.metrics.registry.get_sample_value("streamsvc_refusals_total", {"reason": "watchers"}) == 1
        # a link of no stream counts as a wrong secret would: the metrics tell no prober which it was
        assert server.metrics.registry.get_sample_value("streamsvc_refusals_total", {"reason": "secret"}) == 1
        for peer in (nobody, second, first, steerer):
            await peer.close()


async def test_the_steerers_close_ends_the_stream_for_every_watcher():
    async with running() as server:
        steerer = await Peer.open(server, start())
        watchers = [await Peer.open(server, watch(steerer.ready)) for _ in range(3)]
        await watchers[-1].until(lambda: watchers[-1].payloads, "a chunk")
        await steerer.send({"type": "close"})
        for w in watchers:
            await w.until(lambda w=w: w.of(P.Closed), "closed")
            assert w.of(P.Closed)[0].reason == "closed by client"
        for peer in watchers + [steerer]:
            await peer.close()
        assert not server.sessions


def secret_bits(secret: str) -> int:
    """Random bits of a secret the server made (URL-safe base64 of random bytes)."""
    return 8 * len(base64.urlsafe_b64decode(secret + "=" * (-len(secret) % 4)))


async def test_an_id_alone_grants_nothing_a_watch_needs_the_streams_watch_secret():
    async with running() as server:
        steerer = await Peer.open(server, start())
        other = await Peer.open(server, start("a blue square falling"))
        ready, sid = steerer.ready, steerer.ready.stream_id
        secrets = [ready.watch_secret, ready.steer_secret, other.ready.watch_secret, other.ready.steer_secret]
        assert all(secret_bits(s) >= 128 for s in secrets) and len(set(secrets)) == 4, secrets
        # a stranger who counts ids, or holds a wrong secret (another stream's, or this one's steer secret), gets the
        # answer an id of no stream gets: word for word, so that ids cannot be probed
        strangers = [await Peer.open(server, first) for first in (
            {"type": "watch", "stream_id": sid},
            {"type": "watch", "stream_id": sid, "secret": other.ready.watch_secret},
            {"type": "watch", "stream_id": sid, "secret": ready.steer_secret},
            {"type": "watch", "stream_id": sid, "secret": ready.watch_secret[:-1]},
            {"type": "watch", "stream_id": "s404", "secret": ready.watch_secret},
        )]
        answers = {(p.errors[0].code, p.errors[0].message.replace("'s404'", repr(sid)), p.errors[0].request)
                   for p in strangers}  # (each names the id it asked for)
        assert all(p.ready is None and len(p.errors) == 1 for p in strangers)
        assert len(answers) == 1 and answers.pop()[:1] == (P.ErrorCode.NOT_FOUND,), answers
        assert server.metrics.registry.get_sample_value("streamsvc_refusals_total", {"reason": "secret"}) == 5
        assert server.sessions[sid].watchers == 0
        # the watch link plays; a watcher's ready carries neither secret (nothing in it grants steering)
        watcher = await Peer.open(server, watch(ready))
        assert watcher.ready.role == "watch" and watcher.ready.stream_id == sid
        assert watcher.ready.watch_secret is None and watcher.ready.steer_secret is None
        await watcher.until(lambda: len(watcher.payloads) >= 2, "the watcher's chunks")
        for peer in (*strangers, watcher, other, steerer):
            await peer.close()


async def test_a_take_needs_the_steer_secret_which_a_watch_link_does_not_carry():
    async with running(orphan_timeout_s=30) as server:
        steerer = await Peer.open(server, start())
        watcher = await Peer.open(server, watch(steerer.ready))
        await steerer.close()  # the stream is orphaned: its token is free, to whoever has its steer secret
        await watcher.until(lambda: watcher.of(P.Audience) and not watcher.of(P.Audience)[-1].steered, "orphaned")
        for secret in (None, steerer.ready.watch_secret, "x" * 22):
            await watcher.send({"type": "take", **({"secret": secret} if secret else {})})
        await watcher.until(lambda: len(watcher.errors) == 3, "three refusals")
        assert all(e.code == P.ErrorCode.NOT_STEERER and e.request == "take" and "steer secret" in e.message
                   for e in watcher.errors), watcher.errors
        assert server.sessions[steerer.ready.stream_id].steerer is None and not watcher.of(P.Ack)
        assert server.metrics.registry.get_sample_value("streamsvc_refusals_total", {"reason": "secret"}) == 3
        seen = len(watcher.payloads)
        await watcher.until(lambda: len(watcher.payloads) >= seen + 2, "the stream goes on")
        await watcher.send(take(steerer.ready))
        await watcher.until(lambda: watcher.of(P.Ack), "take")
        assert watcher.of(P.Ack)[-1].request == "take"
        await watcher.until(lambda: watcher.of(P.Audience)[-1].role == "steer", "steering")
        await watcher.send({"type": "set_prompt", "prompt": "a blue square falling"})
        await watcher.until(lambda: any(a.request == "set_prompt" for a in watcher.of(P.Ack)), "its prompt's ack")
        await watcher.close()
