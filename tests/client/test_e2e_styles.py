"""Styles per stream through a running server (`serve --lora-dir`): the tiny model on CPU, raw WebSocket viewers.

The LoRA files are written here in two of the layouts served (tests/models/test_adapters.py's writers) over the tiny
model's Linears, plus one that is no LoRA file. Streams of one prompt and seed make the same frames unless a style
changes them: each forward runs one stream (max_batch 1) at full steps (no degradation), so a stream's frames depend
on nothing but its prompt, seed and style. Every wait is bounded.
"""

import asyncio
import json
import urllib.error
import urllib.request

import numpy as np

from streamsvc.viewers.server import Server, ServerConfig
from streamsvc.wire import protocol as P
from tests.client.raw_viewer import T, RawViewer, serving
from tests.conftest import tiny_generator
from tests.models.test_adapters import make_pairs, save_diffusers, save_peft

PROMPT, SEED = "a red ball moving right", 5


def running(lora_dir=None, tokens=(), **server_kw):
    access = {"access": _access(tokens)} if tokens else {}
    return serving(ServerConfig(port=0, **server_kw, **access), lora_dir=lora_dir)


def _access(tokens):
    from streamsvc.door.access import AccessConfig

    return AccessConfig(tokens={t: None for t in tokens})


class Viewer(RawViewer):
    prompt, seed = PROMPT, SEED


def difference(a: Viewer, b: Viewer, indices) -> float:
    """Mean absolute difference (0..255) of the two streams' frames over the chunks of `indices`."""
    return float(np.mean([np.abs(a.chunks[i][2] - b.chunks[i][2]).mean() for i in indices]))


def write_styles(folder):
    model = tiny_generator().model  # the server's shapes (the tiny preset)
    folder.mkdir()
    save_peft(folder / "ink.pt", make_pairs(model, 8, 1))
    save_diffusers(folder / "neon.safetensors", make_pairs(model, 4, 2), alpha=4)
    (folder / "broken.safetensors").write_bytes(b"no LoRA in here")
    return folder


def get_json(server: Server, path: str):
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}{path}", timeout=T) as r:
        return r.status, json.loads(r.read())


async def test_a_style_per_stream_its_live_switch_and_the_refusals(tmp_path):
    async with running(str(write_styles(tmp_path / "styles"))) as server:
        status, listing = await asyncio.to_thread(get_json, server, "/loras")
        assert status == 200 and [s["name"] for s in listing] == ["broken", "ink", "neon"]
        ink = listing[1]
        assert (ink["rank"], ink["loaded"], ink["error"]) == (8, True, None) and ink["bytes"] > 0
        assert "cannot be read" in listing[0]["error"]

        refused = {}
        for name, fields in {"unknown": {"lora": "nope"}, "scale": {"lora": "ink", "lora_scale": 3.0},
                             "broken": {"lora": "broken"}}.items():
            v = await Viewer.start(server, **fields)
            refused[name] = v.first
            await v.close()
        assert all(isinstance(e, P.Error) and e.code == P.ErrorCode.REFUSED for e in refused.values())
        assert "no style named 'nope' (offered: ink, neon)" in refused["unknown"].message
        assert "lora_scale must be a number in [0.0, 2.0], got 3.0" in refused["scale"].message
        assert "style 'broken' cannot be used" in refused["broken"].message
        assert "Traceback" not in "".join(e.message for e in refused.values())

        plain, styled, switched, off = [await Viewer.start(server, **f) for f in ({}, {"lora": "ink"}, {}, {})]
        try:
            assert plain.first.loras == ["ink", "neon"] and plain.first.lora is None
            assert (styled.first.lora, styled.first.lora_scale) == ("ink", 1.0)
            assert await switched.wait_until(lambda: len(switched.chunks) >= 2 and len(off.chunks) >= 2)
            await switched.send(type="set_lora", lora="neon", lora_scale=1.5)
            await off.send(type="set_lora", lora="neon", lora_scale=0.0)  # scale 0: no style, a recache alone
            await switched.send(type="set_lora", lora="nope")
            assert await switched.wait_until(lambda: len(switched.replies("set_lora")) == 2)
            ack, error = switched.replies("set_lora")
            assert isinstance(ack, P.Ack) and ack.prompt_version == 1
            assert error.code == P.ErrorCode.INVALID_FIELD and "no style named 'nope'" in error.message

            def after() -> list[int]:  # the indices of its chunks under the new style's version
                return [i for i, (h, _, _) in enumerate(switched.chunks) if h.prompt_version == 1]

            assert await switched.wait_until(lambda: len(after()) >= 2)  # it goes on, under the new style
            n = max(after()) + 1
            assert await plain.wait_until(lambda: min(len(v.chunks) for v in (plain, styled, off)) >= n)
            assert [type(m) for m in off.replies("set_lora")] == [P.Ack]
        finally:
            for v in (plain, styled, switched, off):
                await v.close()
        # the style shows in the stream that asked for it, and only there
        assert difference(styled, plain, range(n)) > 2.0
        before = [i for i in range(n) if switched.chunks[i][0].prompt_version == 0]
        assert before and all(switched.chunks[i][1] == plain.chunks[i][1] for i in before)  # bit for bit
        assert difference(switched, plain, after()) > 2.0
        assert difference(off, plain, range(n)) == 0.0  # so the switched stream's difference is its style's
        plain_payloads = [c[1] for c in plain.chunks[:3]]

    async with running() as server:  # no --lora-dir: the plain stream is the same, a style is refused
        status, listing = await asyncio.to_thread(get_json, server, "/loras")
        assert status == 200 and listing == []
        same = await Viewer.start(server)
        try:
            assert same.first.loras is None
            assert await same.wait_until(lambda: len(same.chunks) >= 3)
        finally:
            await same.close()
        assert [c[1] for c in same.chunks[:3]] == plain_payloads
        v = await Viewer.start(server, lora="ink")
        await v.close()
        assert v.first.code == P.ErrorCode.REFUSED and "offers no styles" in v.first.message


async def test_a_style_survives_pause_and_resume_and_loras_needs_the_token(tmp_path):
    async with running(str(write_styles(tmp_path / "styles")), tokens=("sesame",)) as server:
        try:
            await asyncio.to_thread(get_json, server, "/loras")
            raise AssertionError("GET /loras without the token was served")
        except urllib.error.HTTPError as e:
            assert e.code == 401
        status, listing = await asyncio.to_thread(get_json, server, "/loras?token=sesame")
        assert status == 200 and len(listing) == 3
        paused, twin = [await Viewer.start(server, lora="neon", lora_scale=0.5, token="sesame") for _ in range(2)]
        plain = await Viewer.start(server, token="sesame")
        try:
            assert await paused.wait_until(lambda: len(paused.chunks) >= 2)
            await paused.send(type="pause")
            assert await paused.wait_until(lambda: len(paused.replies("pause")) == 1)
            await asyncio.sleep(1.0)
            await paused.send(type="resume")
            assert await paused.wait_until(lambda: len(paused.replies("resume")) == 1)
            assert [type(m) for m in paused.replies("pause") + paused.replies("resume")] == [P.Ack, P.Ack]
            resumed_at = len(paused.chunks)
            n = resumed_at + 2
            assert await paused.wait_until(lambda: min(len(v.chunks) for v in (paused, twin, plain)) >= n)
        finally:
            for v in (paused, twin, plain):
                await v.close()
        # the chunks after the resume are the twin's, under the same style, where it stopped; not the plain stream's
        assert difference(paused, twin, range(n)) == 0.0
        assert difference(paused, plain, range(resumed_at, n)) > 2.0


async def test_a_recordings_chapters_name_the_styles(tmp_path):
    async with running(str(write_styles(tmp_path / "styles")), recordings_dir=str(tmp_path / "rec")) as server:
        v = await Viewer.start(server, lora="ink", lora_scale=0.75)
        try:
            await v.send(type="record")
            assert await v.wait_until(lambda: any(isinstance(m, P.Recording) for m in v.messages))
            assert await v.wait_until(lambda: len(v.chunks) >= 2)
            await v.send(type="set_lora", lora="neon")
            assert await v.wait_until(lambda: sum(h.prompt_version == 1 for h, _, _ in v.chunks) >= 2)
            await v.send(type="close")
            assert await v.wait_until(lambda: any(isinstance(m, P.Closed) for m in v.messages))
        finally:
            await v.close()
        rec = next(m for m in v.messages if isinstance(m, P.Recording))
        url = f"http://127.0.0.1:{server.port}{rec.chapters}"
        vtt = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=T).read().decode())
        assert f"{PROMPT} [style ink x0.75]" in vtt and f"{PROMPT} [style neon x1]" in vtt
