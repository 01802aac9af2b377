"""Starting a stream from an image (causal image-to-video, `ChunkGenerator.start_from_image`) on the tiny preset."""

import numpy as np
import pytest
import torch

from models import CacheAccess, WorkKind, build_generator
from models.model_file import BUILTIN_WEIGHTS
from tests.conftest import reference_latents, tiny_generator


def square_image(size=128, centre=(40, 80), half=14, fg=(20, 170, 160), bg=(235, 215, 175)) -> torch.Tensor:
    """[H, W, 3] uint8: a teal square on a beige background, colours of no palette of ours, drawn here."""
    img = np.empty((size, size, 3), np.uint8)
    img[:] = bg
    x, y = centre
    img[y - half : y + half, x - half : x + half] = fg
    return torch.from_numpy(img)


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = (a.double() - b.double()).pow(2).mean().item()
    return float("inf") if mse == 0 else 10 * np.log10(255**2 / mse)


@pytest.mark.parametrize("nf", [3, 1])
def test_chunks_after_the_image_equal_a_full_recompute_with_the_image_as_block_zero(nf):
    gen = tiny_generator(frames_per_chunk=nf, sink_frames=3, window_frames=9)
    image = square_image()
    state = gen.open_stream("s", "a ball moving right", seed=5)
    first = gen.start_from_image(state, image)
    z = gen.encoder.encode(image[None], gen.encoder.init_state())
    torch.testing.assert_close(first.latents, z)  # latent frame 0 is the image's encoding
    assert state.cache.num_frames == 1 and state.cache.frame_ids[0] == 0 and state.start_frames == 1
    torch.testing.assert_close(state.clean[0], z[:, 0])
    n = 9 // nf  # the image and n chunks fit the sinks and the window: no eviction
    it = gen.stream(state)
    chunks = [next(it) for _ in range(n)]
    for c, r in zip(chunks, reference_latents(gen, "a ball moving right", 5, n, image=z)):
        assert torch.allclose(c.latents, r, atol=1e-4, rtol=1e-4), (c.index, (c.latents - r).abs().max())
    assert state.cache.frame_ids[: state.cache.num_frames] == list(range(1 + n * nf))


@pytest.mark.parametrize("nf", [3, 1])
def test_chunk_indices_and_video_frames_count_the_image_as_chunk_zero(nf):
    gen = tiny_generator(frames_per_chunk=nf)
    state = gen.open_stream("s", "a ball", seed=0)
    first = gen.start_from_image(state, square_image())
    assert (first.index, first.first_frame, first.frames.shape, first.steps) == (0, 0, (1, 128, 128, 3), 0)
    assert first.latents.shape[1] == 1 and state.forwards == {"recache": 0, "denoise": 0, "commit": 1}
    it = gen.stream(state)
    chunks = [next(it) for _ in range(4)]
    assert [c.index for c in chunks] == [1, 2, 3, 4]
    assert [c.frames.shape[0] for c in chunks] == [4 * nf] * 4 == [gen.frames_in_chunk(c.index) for c in chunks]
    assert [c.first_frame for c in chunks] == [1 + 4 * nf * i for i in range(4)]
    assert state.frames_done == 1 + 16 * nf and state.decoder.frames_out == state.frames_done
    ids, total = state.cache.frame_ids[: state.cache.num_frames], 1 + 4 * nf
    assert ids[:3] == [0, 1, 2] and sorted(ids[3:]) == list(range(total - len(ids) + 3, total))  # sinks: the image first


def test_the_decoder_goes_on_from_the_image_as_from_a_first_chunk():
    """The frames after the image are what the decoder gives the stream's latents decoded in one run: its causal
    state after the image's frame is the image's."""
    gen = tiny_generator()
    state = gen.open_stream("s", "a ball", seed=1)
    first = gen.start_from_image(state, square_image())
    chunk = next(gen.stream(state))
    whole = gen.decoder.decode(torch.cat([first.latents, chunk.latents], dim=1), gen.decoder.init_state())
    torch.testing.assert_close(torch.cat([first.frames, chunk.frames]), whole, rtol=0, atol=1)


@pytest.mark.parametrize("nf", [3, 1])
def test_a_prompt_switch_recaches_as_if_the_image_and_chunks_were_committed_under_the_new_prompt(nf):
    """With recache_sinks every cached frame is recomputed under the new prompt, the image as a block of its own
    and each chunk as its own block: the cache then holds what a stream started from the same image under the
    new prompt holds after committing the same latents. The stream goes on under the new prompt."""
    gen = tiny_generator(frames_per_chunk=nf, sink_frames=3, window_frames=9, recache_sinks=True)
    image = square_image()
    state = gen.open_stream("a", "a ball moving right", seed=2)
    gen.start_from_image(state, image)
    it = gen.stream(state)
    latents = [next(it).latents for _ in range(6 // nf)]
    gen.set_prompt(state, "a square falling")
    assert gen.next_work(state) is WorkKind.RECACHE
    gen.run(WorkKind.RECACHE, [state])

    ref = gen.open_stream("b", "a square falling", seed=2)
    gen.start_from_image(ref, image)
    for z in latents:
        slots = ref.cache.plan_commit(nf)
        gen.forward(z[None], torch.zeros(1, nf), ref.text, [CacheAccess(ref.cache, ref.cache.num_frames, write_slots=slots)])
        ref.cache.advance(slots)
    for layer in range(gen.model_cfg.num_layers):
        for got, want in zip(state.cache.read(layer), ref.cache.read(layer)):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    chunk = next(it)
    assert (chunk.index, chunk.prompt_version, state.prompt) == (1 + 6 // nf, 1, "a square falling")


@pytest.mark.parametrize(
    ("cfg", "groups"),
    [
        ({}, [[3], [4, 5, 6]]),  # the window starts mid-block: chunk 1's last frame alone, reading its sink frames
        ({"recache_sinks": True}, [[0], [1, 2, 3], [4, 5, 6]]),  # the image, then each chunk
        ({"recache_chunks": 1}, [[4, 5, 6]]),  # recache-last: the newest chunk only
    ],
)
def test_a_recache_after_an_image_start_recomputes_a_block_at_a_time(cfg, groups):
    """Image, chunk 1 (frames 1-3), chunk 2 (4-6) at sink 3: the sinks hold the image and chunk 1's first two frames."""
    gen = tiny_generator(sink_frames=3, window_frames=9, **cfg)
    state = gen.open_stream("s", "a ball", seed=0)
    gen.start_from_image(state, square_image())
    it = gen.stream(state)
    next(it), next(it)
    seen = []
    forward = gen.forward
    gen.forward = lambda x, t, text, access: seen.append((access[0].read_slots, list(access[0].write_slots))) or forward(x, t, text, access)
    gen.set_prompt(state, "a square")
    gen.run(WorkKind.RECACHE, [state])
    assert [w for _, w in seen] == groups and [r for r, _ in seen] == [g[0] for g in groups]


def test_refusals():
    gen = tiny_generator()
    state = gen.open_stream("s", "a ball", seed=0)
    with pytest.raises(ValueError, match=r"\[N, 128, 128, 3\] uint8"):
        gen.start_from_image(state, square_image(size=64))
    with pytest.raises(ValueError, match=r"uint8"):
        gen.start_from_image(state, square_image().float())
    next(gen.stream(state))
    with pytest.raises(ValueError, match="before the stream's first chunk"):
        gen.start_from_image(state, square_image())
    gen.encoder = None
    with pytest.raises(ValueError, match="no encoder"):
        gen.start_from_image(gen.open_stream("t", "a ball", seed=0), square_image())


@pytest.mark.skipif(not BUILTIN_WEIGHTS.is_file(), reason="the built-in model file is not in this checkout")
def test_the_builtin_models_first_frame_is_the_image():
    """The shipped encoder and decoder give the image back as the stream's first frame: at least 25 dB PSNR for a
    shape and background in colours the model was never trained on."""
    gen = build_generator("tiny", weights="builtin")
    image = square_image()
    state = gen.open_stream("s", "a green square moving right", seed=0)
    first = gen.start_from_image(state, image)
    assert psnr(first.frames[0], image) >= 25.0
