"""Hours of a stream are its first minutes again: chunk 100,000 is computed exactly as chunk 100 is, given the same
cache contents, at chunks of 3 latent frames and of 1, in every storage of the cache (dense, int4, int2).

Nothing the model computes grows with a stream's age: the cache is a ring (sinks, then a window whose oldest slot the
next frame overwrites), and RoPE reads positions relative to its layout [sinks | window | chunk], integers from 0 to
the cache's capacity plus a chunk, whatever the frame's index in the stream; the angles come from those integers in
float64, so no position is accumulated or drifts. A stream's age lives in counters only (its chunks and frames, the
cache's frames seen and each slot's frame index, the decoder's frames out), which `aged` moves on as if the stream
had made 99,900 more chunks: the chunks that follow must be those of the young stream, bit for bit, through every
phase of the ring and a prompt switch (whose recache groups the window's frames into chunks by their frame index).
"""

import pytest
import torch

from models import ChunkGenerator, StreamState
from tests.conftest import tiny_generator

YOUNG = 100  # the chunk the young stream makes next
OLD = 100_000  # the chunk the aged stream makes next: about 21 hours of 16 fps video at chunks of 12 frames


def aged(gen: ChunkGenerator, state: StreamState, chunks: int) -> None:
    """Move `state` on by `chunks` chunks as if it had made them: its counters only (its cache's contents, its
    noise and its decoder's memory stay). The window's frames get the frame indices they would have (the sinks keep
    theirs: a stream's first frames); `chunks` must bring the ring's head back to where it is."""
    latents = chunks * gen.cfg.frames_per_chunk
    frames = chunks * gen.frames_in_chunk(1)
    cache = state.cache
    assert latents % cache.spec.window_frames == 0, "the ring's head would be elsewhere"
    state.chunks_done += chunks
    state.frames_done += frames
    state.decoder.frames_out += frames
    cache.frames_seen += latents
    sinks = cache.spec.sink_frames
    cache.frame_ids = [f if slot < sinks or f < 0 else f + latents for slot, f in enumerate(cache.frame_ids)]
    cache.touch()


def next_chunk(gen: ChunkGenerator, state: StreamState):
    """The stream's next chunk (its recache first when a prompt is pending)."""
    return next(gen.stream(state))


@pytest.mark.parametrize("frames_per_chunk,kv_quant", [(3, "none"), (1, "none"), (3, "int4"), (1, "int2")])
def test_chunk_100000_is_computed_exactly_as_chunk_100_given_the_same_cache(frames_per_chunk, kv_quant):
    gen = tiny_generator(frames_per_chunk=frames_per_chunk, kv_quant=kv_quant)
    young = gen.open_stream("young", "a red ball on grass", seed=7)
    old = gen.open_stream("old", "a red ball on grass", seed=7)
    for _ in range(YOUNG):  # the same chunks, so the same cache contents, noise and decoder memory
        for state in (young, old):
            next_chunk(gen, state)
    aged(gen, old, OLD - YOUNG)
    cache_young, cache_old = young.cache, old.cache
    assert cache_old.frames_seen - cache_young.frames_seen == (OLD - YOUNG) * frames_per_chunk
    assert cache_old.positions() == cache_young.positions()  # relative to the layout, not the frame index
    assert max(cache_old.positions()) + frames_per_chunk < gen.model.rope.time.shape[0]  # far inside the table

    ring = cache_young.spec.window_frames // frames_per_chunk  # chunks until the ring's head comes back
    heads = set()
    for i in range(ring + 3):
        if i == 1:  # a prompt switch: the window is recached, grouped into chunks by its frames' indices
            for state in (young, old):
                gen.set_prompt(state, "a blue cube in the snow")
        a, b = next_chunk(gen, young), next_chunk(gen, old)
        assert (a.index, b.index) == (YOUNG + i, OLD + i)
        assert b.first_frame - a.first_frame == (OLD - YOUNG) * gen.frames_in_chunk(1)
        assert torch.equal(a.latents, b.latents) and torch.equal(a.frames, b.frames), f"chunk {a.index} vs {b.index}"
        assert a.prompt_version == b.prompt_version and a.steps == b.steps
        assert cache_old.positions() == cache_young.positions() and cache_old.head == cache_young.head
        heads.add(cache_young.head)
    assert len(heads) == ring  # every phase of the ring came by
    assert young.prompt_version == old.prompt_version == 1
