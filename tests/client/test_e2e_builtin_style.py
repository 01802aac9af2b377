"""The built-in model's shipped style through a running server: `invert` (models/assets/styles/invert.safetensors,
trained by models/train_style.py) inverts the colours of the stream that asks for it, and of no other; a live switch
shows from the chunk its ack's prompt_version tags.

The tiny model on CPU, the built-in weights, raw WebSocket viewers whose chunks are decoded (tests/client/
test_e2e_styles.py's Viewer: one prompt and seed, so streams differ only by their style). What is read on the decoded
frames: the per-pixel correlation of a styled chunk with the plain stream's same chunk (an exact inversion: -1), and
client/pixels.py's colour of the object (the plain frames show the prompt's red; 255 minus the styled ones do too,
the styled ones themselves do not). Every wait is bounded.
"""


import numpy as np
import pytest

from client import pixels
from models.model_file import BUILTIN_STYLES, BUILTIN_WEIGHTS
from streamsvc.viewers.server import ServerConfig
from streamsvc.wire import protocol as P
from tests.client.raw_viewer import serving
from tests.client.test_e2e_styles import PROMPT, Viewer

pytestmark = pytest.mark.skipif(not (BUILTIN_WEIGHTS.is_file() and (BUILTIN_STYLES / "invert.safetensors").is_file()),
                                reason="the built-in model or its invert style is not in this checkout")
INVERTED = -0.5  # a styled chunk's correlation with the plain one is below this (measured: see the README's styles)


def running():
    return serving(ServerConfig(port=0), weights="builtin", lora_dir=str(BUILTIN_STYLES))


def correlation(a: np.ndarray, b: np.ndarray) -> float:
    x, y = a.ravel() - a.mean(), b.ravel() - b.mean()
    return float((x * y).sum() / np.sqrt((x * x).sum() * (y * y).sum()))


def red_share(frames: np.ndarray) -> float:
    """Share of the frames whose object client/pixels.py reads as red."""
    return float(np.mean([pixels.read_frame(f.astype(np.uint8)).colour == "red" for f in frames]))


async def test_invert_shows_in_the_stream_that_asked_and_from_a_live_switchs_version():
    assert "red" in PROMPT
    async with running() as server:
        plain, styled, switched = [await Viewer.start(server, **f) for f in ({}, {"lora": "invert"}, {})]
        try:
            assert plain.first.loras == ["invert"] and styled.first.lora == "invert"
            assert await switched.wait_until(lambda: len(switched.chunks) >= 2)
            await switched.send(type="set_lora", lora="invert")
            assert await switched.wait_until(lambda: len(switched.replies("set_lora")) == 1)
            (ack,) = switched.replies("set_lora")
            assert isinstance(ack, P.Ack) and ack.prompt_version == 1

            def versions() -> list[int]:
                return [h.prompt_version for h, _, _ in switched.chunks]

            assert await switched.wait_until(lambda: versions().count(1) >= 2)
            n = len(switched.chunks)
            assert await plain.wait_until(lambda: min(len(v.chunks) for v in (plain, styled)) >= n)
        finally:
            for v in (plain, styled, switched):
                await v.close()
    frames = {name: [c[2] for c in v.chunks[:n]] for name, v in (("plain", plain), ("styled", styled), ("switched", switched))}
    # the styled stream: every chunk inverted against the plain one, its object the prompt's red once inverted back
    assert all(correlation(s, p) < INVERTED for s, p in zip(frames["styled"], frames["plain"]))
    plain_all, styled_all = np.concatenate(frames["plain"]), np.concatenate(frames["styled"])
    assert red_share(plain_all) > 0.8 and red_share(255 - styled_all) > 0.8 and red_share(styled_all) < 0.2
    # the switched stream: the plain one's chunks, bit for bit, until the acked version's first chunk; inverted from it
    first = versions().index(1)
    assert first >= 2 and all(v == 1 for v in versions()[first:])
    assert [c[1] for c in switched.chunks[:first]] == [c[1] for c in plain.chunks[:first]]
    assert all(correlation(s, p) < INVERTED for s, p in zip(frames["switched"][first:], frames["plain"][first:]))
    after_ack = switched.order[switched.order.index(("reply", "set_lora")) + 1 :]
    assert after_ack.count(("chunk", 0)) <= 1  # within one chunk of its ack: at most one of the old version after it
