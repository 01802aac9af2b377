"""Streams that start from an image, through a running server (the tiny model on CPU, raw WebSocket viewers).

The images are drawn here (a shape on a flat background in colours of no palette of models/scenes.py) and encoded as
PNG by PyAV. A viewer's frames are the H.264 it receives, decoded by PyAV. Each forward runs one stream at full
steps (no degradation), so a stream's frames depend on nothing but its prompt, seed and image. Every wait is bounded.
"""

import asyncio
import base64
import json
import urllib.error
import urllib.request

import numpy as np
import pytest
from websockets.asyncio.client import connect

from client import pixels
from streamsvc.engine.images import StartImages
from streamsvc.viewers.server import Server, ServerConfig
from streamsvc.wire import image as I
from streamsvc.wire import protocol as P
from tests.client.raw_viewer import T, RawViewer, serving
from tests.streamsvc.test_start_image import drawn, encode, png_claiming, psnr

PROMPT, SEED = "a green square moving right", 5
SIZE = 128  # the tiny model's frame


def running(weights=None, **server_kw):
    return serving(ServerConfig(port=0, **server_kw), weights=weights)


class Viewer(RawViewer):
    prompt, seed = PROMPT, SEED


def upload(server: Server, body: bytes, ctype: str = "image/png", method: str = "POST") -> tuple[int, bytes]:
    request = urllib.request.Request(f"http://127.0.0.1:{server.port}{I.UPLOAD_PATH}", data=body, method=method,
                                     headers={"Content-Type": ctype})
    try:
        with urllib.request.urlopen(request, timeout=T) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


async def test_the_first_frame_a_viewer_gets_is_the_drawn_image_and_the_prompts_motion_follows():
    """The built-in model (--weights auto): the first frame decoded from the wire is at least 25 dB against the drawn
    image, and the frames after it move the way the prompt says (client/pixels.py, 12-frame windows)."""
    image = drawn()
    async with running(weights="auto") as server:
        v = await Viewer.start(server, image=I.data_url(encode(image)))
        plain = await Viewer.start(server)  # the same prompt and seed from noise
        try:
            assert isinstance(v.first, P.Ready), v.first
            assert (v.first.image, v.first.first_chunk_frames, plain.first.image) == (True, 1, None)
            assert await v.wait_until(lambda: len(v.chunks) >= 3 and len(plain.chunks) >= 1, 60)
        finally:
            await v.close()
            await plain.close()
    head = v.chunks[0][0]
    assert (head.index, head.pts, head.frames, head.input, head.keyframe, head.steps) == (0, 0, 1, "image", True, 4)
    assert [(h.index, h.pts, h.input) for h, *_ in v.chunks[1:3]] == [(1, 1, "none"), (2, 13, "none")]
    first = v.chunks[0][2][0]
    got = psnr(first, image)
    assert got >= 25.0, f"first frame {got:.1f} dB against the drawn image"
    assert psnr(plain.chunks[0][2][0], image) < 15.0  # (the same stream from noise is nothing like it)
    readings = [pixels.read_frame(f) for f in v.frames[1:25].astype(np.uint8)]
    moves = [pixels.motion(pixels.velocity(readings[w : w + 12], SIZE, SIZE)) for w in (0, 12)]
    assert moves == ["right", "right"], moves
    start = pixels.read_frame(image).centre
    assert abs(readings[0].centre[0] - start[0]) < 12 and abs(readings[0].centre[1] - start[1]) < 12


async def test_bad_images_are_refused_with_the_reason_and_the_connection_and_other_streams_go_on():
    png = encode(drawn())
    b64 = base64.b64encode(png).decode()
    bad = {
        "wrong type": ("data:image/png;base64," + base64.b64encode(b"GIF89a" + bytes(64)).decode(),
                       "says image/png but its bytes are no PNG, JPEG or WebP"),
        "not an image type": (f"data:text/plain;base64,{b64}", "media type is 'text/plain'"),
        "not base64": (f"data:image/png,{b64}", "not base64"),
        "bad base64": ("data:image/png;base64,iVBORw0K!!", "base64 does not decode"),
        "over the inline cap": ("data:image/png;base64," + base64.b64encode(png + bytes(I.MAX_INLINE_IMAGE_BYTES))
                                .decode(), "over 46080 bytes, the most a start carries inline: upload it"),
        "corrupt": (I.data_url(png[:40] + bytes(len(png) - 40)), "PNG image does not decode"),
        "a decompression bomb": (I.data_url(png_claiming(50000, 50000)), "declares 50000x50000 pixels"),
        "no such upload": ("A" * 22, "no upload AAAAAA... here"),
        "neither": ("cat.png", "not a data: URL"),
    }
    async with running() as server:
        other = await Viewer.start(server)
        ws = await connect(f"ws://127.0.0.1:{server.port}/ws", max_size=P.MAX_CHUNK_BYTES)
        try:
            assert await other.wait_until(lambda: len(other.chunks) >= 1)
            before = len(other.chunks)
            for name, (image, why) in bad.items():
                got = (await Viewer.start(server, ws=ws, image=image)).first
                assert isinstance(got, P.Error), name
                assert (got.code, got.request) == (P.ErrorCode.BAD_IMAGE, "start"), (name, got)
                assert why in got.message and "no stream was opened" in got.message, (name, got.message)
                assert "Traceback" not in got.message
            got = (await Viewer.start(server, ws=ws, image=I.data_url(png), input=True)).first
            assert got.code == P.ErrorCode.INVALID_FIELD and "not both" in got.message
            ok = await Viewer.start(server, ws=ws, image=I.data_url(png))  # the same connection: a stream now
            assert isinstance(ok.first, P.Ready) and ok.first.image
            assert await ok.wait_until(lambda: len(ok.chunks) >= 2 and len(other.chunks) >= before + 2)
            assert not [m for m in other.messages if isinstance(m, P.Error)]
            server.engine.images = StartImages(None)  # what an engine whose model has no encoder says
            refused = await Viewer.start(server, image=I.data_url(png))
            assert refused.first.code == P.ErrorCode.REFUSED and "this model has no encoder" in refused.first.message
            await refused.close()
        finally:
            await other.close()
            await ok.close()
        assert ok.chunks[0][0].input == "image" and [h.index for h, *_ in ok.chunks[:2]] == [0, 1]


async def test_an_upload_starts_streams_over_the_websocket_and_its_refusals_are_http_statuses():
    image = drawn(256, 200, centre=(100, 90), half=30)  # another size: fitted to the frame
    async with running(weights="auto") as server:
        status, body = await asyncio.to_thread(upload, server, encode(image, "mjpeg", "yuvj420p"), "image/jpeg")
        assert status == 201, body
        image_id = json.loads(body)["image"]
        a, b = [await Viewer.start(server, image=image_id) for _ in range(2)]  # an upload is not used up
        try:
            assert a.first.image and b.first.image
            assert await a.wait_until(lambda: len(a.chunks) >= 2 and len(b.chunks) >= 2)
        finally:
            await a.close()
            await b.close()
        assert psnr(a.chunks[0][2][0], b.chunks[0][2][0]) == float("inf")  # one image, one seed: one stream
        from streamsvc.inputs.image import decode_image
        fitted = decode_image(encode(image, "mjpeg", "yuvj420p"), SIZE, SIZE)
        assert psnr(a.chunks[0][2][0], fitted) >= 25.0
        for body, ctype, status, text in [
            (png_claiming(50000, 50000), "image/png", 400, b"declares 50000x50000 pixels"),
            (b"hello", "text/plain", 415, b"an upload is an image file"),
            (bytes(I.MAX_IMAGE_BYTES + 1), "image/png", 413, b"a request body here is at most 4194304 bytes"),
        ]:
            got = await asyncio.to_thread(upload, server, body, ctype)
            assert got[0] == status and text in got[1], got
        assert (await asyncio.to_thread(upload, server, b"", "image/png", "GET"))[0] == 405
        assert server.table_sizes()["images.uploads"] == 1


async def test_pause_resume_recording_and_a_watcher_of_a_stream_started_from_an_image(tmp_path):
    """The paused stream resumes where it stopped (its chunks equal its twin's, and no second image chunk: the image
    is not applied again); a watcher gets the image's frame too; the recording starts with it."""
    url = I.data_url(encode(drawn()))
    async with running(recordings_dir=str(tmp_path), record_all=True) as server:
        paused, twin = [await Viewer.start(server, image=url) for _ in range(2)]
        watcher = await Viewer.watch(server, paused.first)
        try:
            assert isinstance(watcher.first, P.Ready) and watcher.first.role == "watch"
            assert await paused.wait_until(lambda: len(paused.chunks) >= 2)
            await paused.send(type="pause")
            assert await paused.wait_until(lambda: len(paused.replies("pause")) == 1)
            await asyncio.sleep(1.0)
            await paused.send(type="resume")
            assert await paused.wait_until(lambda: len(paused.replies("resume")) == 1)
            assert [type(m) for m in paused.replies("pause") + paused.replies("resume")] == [P.Ack, P.Ack]
            n = len(paused.chunks) + 2
            assert await paused.wait_until(lambda: min(len(v.chunks) for v in (paused, twin, watcher)) >= n)
            await paused.send(type="close")
            assert await paused.wait_until(lambda: any(isinstance(m, P.Closed) for m in paused.messages))
            rec = next(m for m in paused.messages if isinstance(m, P.Recording))
        finally:
            for v in (paused, twin, watcher):
                await v.close()
        mp4 = await asyncio.to_thread(lambda: urllib.request.urlopen(
            f"http://127.0.0.1:{server.port}{rec.url}", timeout=T).read())
    assert [h.input for h, *_ in paused.chunks].count("image") == 1 and paused.chunks[0][0].input == "image"
    assert [h.pts for h, *_ in paused.chunks[:n]] == [h.pts for h, *_ in twin.chunks[:n]]
    assert np.array_equal(paused.frames[: 1 + 12 * (n - 1)], twin.frames[: 1 + 12 * (n - 1)])
    assert watcher.chunks[0][0].index == 0 and np.array_equal(watcher.chunks[0][2], paused.chunks[0][2])
    import av
    with av.open(__import__("io").BytesIO(mp4)) as container:
        recorded = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    assert len(recorded) >= 1 + 12 and np.array_equal(recorded[0], paused.chunks[0][2][0])


async def test_the_python_client_starts_from_an_image_inline_or_uploaded():
    """client/start_image.py: a small file goes inline, a large one is uploaded once and named by two clients; the
    client's TTFF counts from its connect to the image's frame."""
    from client.start_image import image_ref
    from client.viewer import ClientConfig
    from client.ws_client import StreamClient

    small = encode(drawn())
    noise = np.random.default_rng(0).integers(0, 256, (400, 400, 3), dtype=np.uint8)  # incompressible: ~480 KB
    large = encode(noise)
    assert len(small) <= I.MAX_INLINE_IMAGE_BYTES < len(large) <= I.MAX_IMAGE_BYTES
    async with running() as server:
        url = f"ws://127.0.0.1:{server.port}/ws"
        inline, uploaded = [await asyncio.to_thread(image_ref, data, url) for data in (small, large)]
        assert I.is_data_url(inline) and I.UPLOAD_ID.match(uploaded)
        clients = [StreamClient(url, ClientConfig(prompt=PROMPT, seed=SEED, image=image))
                   for image in (inline, uploaded, uploaded, None)]
        results = await asyncio.gather(*(c.run(3.0) for c in clients))
    for c, r in zip(clients, results):
        assert c.ready is not None and r.playback is not None and r.playback.ttff_s is not None, r
    assert [c.ready.image for c in clients] == [True, True, True, None]
    assert [c.headers[0].input for c in clients] == ["image", "image", "image", "none"]
    assert [c.headers[0].frames for c in clients[:3]] == [1, 1, 1] and clients[3].headers[0].frames == 9
    with pytest.raises(ValueError, match="a watcher sends no input, image nor style"):
        ClientConfig(watch="s0", secret="x", image=inline)
