"""Video-to-video in the chunk generator (issue 35): input frames encoded, noised to the stream's strength
(snapped to the schedule's sigmas) and denoised from that step; tiny preset, CPU, random weights."""

import pytest
import torch

from kvcache import StreamCache
from models import WorkKind, build_generator
from models.encoder import BlockPCAEncoder, EncoderState, grouped, latent_frames
from models.scenes import Scene, Timeline
from tests.conftest import tiny_generator


def scene_frames(gen, first: int, n: int) -> torch.Tensor:
    """Video frames first .. first+n-1 of a red ball moving right, at the model's size."""
    mc = gen.model_cfg
    tl = Timeline(((0, Scene("red", "ball", motion="right"), "a red ball moving right"),), mc.height, mc.width)
    return tl.render(range(first, first + n))


def chunk(gen, state, frames=None, *, give=True):
    """One chunk of `state`, with `frames` as its input (None and give: set_input(None), a missing input)."""
    if give:
        gen.set_input(state, frames)
    while True:
        out = gen.run(gen.next_work(state), [state])[0]
        if out is not None:
            return out


def stream_chunks(gen, state, n, strength=None, inputs=True):
    """n chunks of the scene as input (inputs False: no set_input at all)."""
    if strength is not None:
        gen.set_strength(state, strength)
    out, first = [], 0
    for c in range(n):
        count = gen.frames_in_chunk(c)
        out.append(chunk(gen, state, scene_frames(gen, first, count), give=inputs))
        first += count
    return out


def test_strength_snaps_to_the_nearest_sigma_ties_to_the_noisier():
    gen = tiny_generator(timesteps=(1000.0, 750.0, 500.0, 250.0))
    sig = gen.input_strengths()
    assert sig == tuple(gen.sigmas) and sig[0] == 1.0 and list(sig) == sorted(sig, reverse=True)
    assert [gen.start_step(s) for s in (1.0, 0.97, 0.95, 0.9, 0.75, 0.7, 0.0)] == [0, 0, 1, 1, 2, 3, 3]
    tie = (sig[1] + sig[2]) / 2
    assert gen.start_step(tie) == 1  # halfway: the noisier step
    state = gen.open_stream("s", "a cat", seed=0)
    assert state.strength == 1.0
    assert gen.set_strength(state, 0.6) == state.strength == sig[3]
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="strength must be in"):
            gen.set_strength(state, bad)


def test_without_input_or_at_strength_one_the_frames_are_text_to_video_bit_for_bit():
    # the text-to-video path is untouched: a stream given no input, one whose input is missing every chunk,
    # and one whose input is at strength 1.0 (step 0: (1 - 1) z + 1 noise is the noise) make the same frames
    runs = []
    for mode in ("none", "missing", "strength 1"):
        gen = tiny_generator()
        state = gen.open_stream("s", "a blue ball", seed=3)
        if mode == "none":
            runs.append(stream_chunks(gen, state, 3, inputs=False))
        elif mode == "missing":
            runs.append([chunk(gen, state, None) for _ in range(3)])
        else:
            runs.append(stream_chunks(gen, state, 3, strength=1.0))
    assert [c.input for c in runs[0]] == ["none"] * 3 and [c.input for c in runs[1]] == ["missing"] * 3
    assert [c.input for c in runs[2]] == ["frames"] * 3 and all(c.start_step == 0 and c.steps == 4 for c in runs[2])
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a.latents, b.latents) and torch.equal(a.frames, b.frames)


def test_a_lower_strength_starts_later_runs_fewer_forwards_and_stays_nearer_the_input():
    far = {}
    for strength in (1.0, 0.94, 0.83, 0.625):
        gen = tiny_generator()
        state = gen.open_stream("s", "a blue ball", seed=3)
        chunks = stream_chunks(gen, state, 2, strength=strength)
        k = gen.start_step(strength)
        assert [(c.start_step, c.steps) for c in chunks] == [(k, 4)] * 2
        assert state.forwards["denoise"] == 2 * (4 - k) and state.forwards["commit"] == 2
        z = BlockPCAEncoder.random(gen.model_cfg).encode(scene_frames(gen, 9, 12), EncoderState(frames_in=9))
        far[k] = float((chunks[1].latents - z).pow(2).mean())
    # random weights denoise towards nothing in particular: the less noise the input got, the nearer it stays
    assert far[3] < far[2] < far[0] and far[1] < far[0]


def test_degrading_drops_steps_after_the_start_step_and_one_step_always_runs():
    gen = tiny_generator(degraded_steps=(3, 2))
    state = gen.open_stream("s", "a cat", seed=1)
    gen.set_strength(state, 0.6)  # start step 3 of 4: one step
    gen.set_input(state, scene_frames(gen, 0, 9))
    gen.set_steps(state, 2)  # between chunks: a degraded chunk of 2 steps, whose start step is already past it
    gen.run(WorkKind.DENOISE, [state])
    assert (state.start, state.step, state.steps) == (3, 4, 4) and gen.next_work(state) is WorkKind.COMMIT
    gen.set_steps(state, 2)  # cutting it short in progress: it keeps its one step
    out = gen.run(WorkKind.COMMIT, [state])[0]
    assert (out.start_step, out.steps, state.forwards["denoise"]) == (3, 4, 1)
    gen.set_strength(state, 0.94)  # start step 1: a 2-step degraded chunk runs steps 1 .. 1, one step
    gen.set_input(state, scene_frames(gen, 9, 12))
    gen.set_steps(state, 2)
    gen.run(WorkKind.DENOISE, [state])
    assert (state.start, state.step, state.steps) == (1, 2, 2)
    out = gen.run(gen.next_work(state), [state])[0]
    assert (out.start_step, out.steps, state.forwards["denoise"]) == (1, 2, 2)


def test_input_survives_an_abandoned_chunk_and_a_recache():
    ref_gen = tiny_generator()
    ref = ref_gen.open_stream("s", "a cat", seed=2)
    want = stream_chunks(ref_gen, ref, 2, strength=0.6)
    gen = tiny_generator()
    state = gen.open_stream("s", "a cat", seed=2)
    got = stream_chunks(gen, state, 1, strength=0.6)
    gen.set_input(state, scene_frames(gen, 9, 12))
    noise = state.noise.get_state()
    gen.run(WorkKind.DENOISE, [state])
    gen.abandon_chunk(state)  # restarted: the same input, drawn from the noise where it was
    state.noise.set_state(noise)
    assert state.input == "frames" and state.step == 0
    got.append(chunk(gen, state, give=False))
    assert torch.equal(want[1].latents, got[1].latents) and got[1].input == "frames"


def test_set_input_refuses_what_does_not_fit():
    gen = tiny_generator()
    state = gen.open_stream("s", "a cat", seed=0)
    with pytest.raises(ValueError, match="takes 9 input frames, got 12"):
        gen.set_input(state, scene_frames(gen, 0, 12))
    with pytest.raises(ValueError, match=r"must be \[N, 128, 128, 3\] uint8"):
        gen.set_input(state, torch.zeros(9, 64, 64, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="must be"):
        gen.set_input(state, torch.zeros(9, 128, 128, 3))
    gen.set_input(state, scene_frames(gen, 0, 9))
    with pytest.raises(ValueError, match="has its input already"):
        gen.set_input(state, scene_frames(gen, 0, 9))
    gen.run(WorkKind.DENOISE, [state])
    gen.abandon_chunk(state)
    gen.run(WorkKind.DENOISE, [state])
    with pytest.raises(ValueError, match="between chunks"):
        gen.set_input(state, None)


def test_a_model_without_an_encoder_takes_no_input():
    base = tiny_generator()
    gen = type(base)(base.model, base.cfg, base.text_encoder, base.decoder)  # a decoder given, no encoder
    assert not gen.can_take_input and gen.encoder is None and gen.encoder_state_bytes() == 0
    state = gen.open_stream("s", "a cat", seed=0)
    assert state.encoder is None
    with pytest.raises(ValueError, match="no encoder"):
        gen.set_input(state, scene_frames(gen, 0, 9))
    assert base.can_take_input


def test_parking_between_set_input_and_the_chunk_carries_the_input():
    want_gen = tiny_generator()
    want = stream_chunks(want_gen, want_gen.open_stream("s", "a cat", seed=5), 2, strength=0.6)
    gen = tiny_generator()
    state = gen.open_stream("s", "a cat", seed=5)
    got = stream_chunks(gen, state, 1, strength=0.6)
    gen.set_input(state, scene_frames(gen, 9, 12))
    parked = gen.park(state)
    assert state.input_latents is None and parked.fields["input_latents"] is not None
    gen.restore(parked, StreamCache(gen.cache_spec(), gen.device))
    got.append(chunk(gen, state, give=False))
    assert torch.equal(want[1].latents, got[1].latents)


def test_frame_counts_and_the_first_latent_frame():
    assert latent_frames(9, 4, first=True) == 3 and latent_frames(12, 4, first=False) == 3
    for n, first in ((12, True), (9, False), (0, False)):
        with pytest.raises(ValueError, match="whole latent frames"):
            latent_frames(n, 4, first)
    frames = torch.arange(9, dtype=torch.uint8).view(9, 1, 1, 1).expand(9, 2, 2, 3)
    g = grouped(frames, 4, first=True)  # frame 0 four times, then 1..4, 5..8 (models/latent.py video_frames)
    assert g[:, :, 0, 0, 0].tolist() == [[0, 0, 0, 0], [1, 2, 3, 4], [5, 6, 7, 8]]


def test_the_builtin_model_file_brings_its_pca_encoder():
    gen = build_generator("tiny", weights="builtin")
    assert gen.can_take_input and isinstance(gen.encoder, BlockPCAEncoder)
    z = gen.encoder.encode(scene_frames(gen, 0, 9), gen.encoder.init_state())
    # the PCA is whitened on rendered scenes: their latents have about unit spread
    assert z.shape == (16, 3, 16, 16) and 0.3 < float(z.std()) < 3


def taehv_generator():
    """The tiny preset with a causal encoder (TAEHV's layout, 6 channels, random weights) in place of the PCA."""
    from models.taehv import TAEHVEncoder

    base = tiny_generator()
    torch.manual_seed(0)
    enc = TAEHVEncoder(width=6).eval()
    return type(base)(base.model, base.cfg, base.text_encoder, base.decoder, enc)


def test_parking_between_chunks_carries_a_causal_encoders_memory():
    want_gen = taehv_generator()
    want = stream_chunks(want_gen, want_gen.open_stream("s", "a cat", seed=5), 3, strength=0.6)
    gen = taehv_generator()
    state = gen.open_stream("s", "a cat", seed=5)
    got = stream_chunks(gen, state, 1, strength=0.6)
    memory = dict(state.encoder.memory)
    assert len(memory) == 9 and state.encoder.frames_in == 9  # the 9 MemBlocks' last inputs
    parked = gen.park(state)
    assert state.encoder is None and parked.nbytes >= sum(t.numel() * 4 for t in memory.values())
    assert all(torch.equal(parked.fields["encoder"].memory[i], m) for i, m in memory.items())
    gen.restore(parked, StreamCache(gen.cache_spec(), gen.device))
    first = 9
    for c in (1, 2):
        got.append(chunk(gen, state, scene_frames(gen, first, 12)))
        first += 12
    for a, b in zip(want, got):
        assert torch.equal(a.latents, b.latents)
    # a missing chunk resets the causal run: the next input starts a new one (an empty memory)
    chunk(gen, state, None)
    assert state.encoder.frames_in == 0 and state.encoder.memory == {}
