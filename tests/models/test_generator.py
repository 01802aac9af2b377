"""The generation core on the tiny preset, CPU, random weights."""

import numpy as np
import pytest
import torch

from kvcache import StreamCache
from models import CacheAccess, WorkKind
from tests.conftest import reference_latents, solo_and_batched, tiny_generator


def run_chunks(gen, state, n, prompt_at=None):
    it = gen.stream(state, prompt_at)
    return [next(it) for _ in range(n)]


def test_cached_generation_equals_full_recompute():
    gen = tiny_generator(sink_frames=3, window_frames=9)
    state = gen.open_stream("s", "a red fox in snow", seed=7)
    chunks = run_chunks(gen, state, 4)  # 12 frames: fills sinks + window exactly, no eviction
    ref = reference_latents(gen, "a red fox in snow", 7, 4)
    for c, r in zip(chunks, ref):
        assert torch.allclose(c.latents, r, atol=1e-4, rtol=1e-4), (c.index, (c.latents - r).abs().max())


def test_in_place_reads_equal_copies_past_the_window():
    # staged, attention reads the cache in place: the cached values as stored, a chunk's own K/V in
    # the storage's staging, and the cached keys rotated once per chunk. A commit past the window
    # overwrites the oldest frames, which it must read first; each commit and advance makes the
    # rotated keys stale.
    runs = {}
    for stage in (True, False):
        gen = tiny_generator(sink_frames=3, window_frames=6, stage_kv=stage)
        rotated = []
        runner = gen.runner
        gen.runner = lambda x, t, text, access: rotated.append(access[0].keys_rotated) or runner(x, t, text, access)
        state = gen.open_stream("s", "a lighthouse", seed=4)
        assert (gen.workspace is not None) == stage and state.cache.spec.staging_frames == 0
        runs[stage] = (run_chunks(gen, state, 6), state.cache, rotated)  # 18 frames, past 3 + 6
    (staged, cache_s, rotated), (copied, cache_c, never) = runs[True], runs[False]
    assert rotated == [False, True, True, True, True] * 6 and not any(never)  # 4 steps + commit, rotated at the first
    for a, b in zip(staged, copied):
        assert torch.allclose(a.latents, b.latents, atol=1e-5), (a.index, (a.latents - b.latents).abs().max())
    for layer in range(2):
        for x, y in zip(cache_s.read(layer), cache_c.read(layer)):
            assert torch.allclose(x, y, atol=1e-5)


def test_past_window_sinks_hold_first_frames_window_latest_memory_constant():
    gen = tiny_generator(sink_frames=3, window_frames=6)
    state = gen.open_stream("s", "waves", seed=1)
    run_chunks(gen, state, 3)
    nbytes, ptr = state.cache.nbytes, state.cache.storage.k.data_ptr()
    chunks = run_chunks(gen, state, 5)  # 8 chunks = 24 frames, far past 3 + 6
    assert state.cache.nbytes == nbytes and state.cache.storage.k.data_ptr() == ptr
    ids = state.cache.frame_ids
    assert ids[:3] == [0, 1, 2]
    assert sorted(ids[3:]) == list(range(18, 24))
    # the positions read are [sinks | window in time order]
    order = sorted(range(3, 9), key=lambda s: state.cache.positions()[s])
    assert [ids[s] for s in order] == list(range(18, 24))
    # the window's K/V are those committed for its frames: recommit the last chunk's latents and compare
    assert chunks[-1].index == 7 and chunks[-1].frames.shape[0] == 12


def test_same_seed_same_frames_other_seed_differs():
    a = run_chunks(tiny_generator(), tiny_generator().open_stream("a", "city at night", 3), 3)
    gen = tiny_generator()
    b = run_chunks(gen, gen.open_stream("b", "city at night", 3), 3)
    c = run_chunks(gen, gen.open_stream("c", "city at night", 4), 3)
    assert all(np.array_equal(x.frames, y.frames) for x, y in zip(a, b))
    assert not np.array_equal(a[1].frames, c[1].frames)
    assert a[0].frames.shape == (9, 128, 128, 3) and a[1].frames.shape == (12, 128, 128, 3)
    assert a[0].frames.dtype == torch.uint8


@pytest.mark.parametrize("recache_sinks", [False, True])
def test_prompt_switch_recache_equals_fresh_computation(recache_sinks):
    gen = tiny_generator(sink_frames=3, window_frames=6, recache_sinks=recache_sinks)
    state = gen.open_stream("s", "a forest", seed=2)
    run_chunks(gen, state, 4)  # window has rolled once: frames 0-2 sinks, 6-11 window
    gen.set_prompt(state, "a desert")
    assert gen.next_work(state) is WorkKind.RECACHE
    sinks_before = [t.clone() for t in state.cache.read(0, 3)]
    gen.run(WorkKind.RECACHE, [state])
    assert state.prompt_version == 1 and state.prompt == "a desert"

    # reference: a fresh cache that commits the same clean latents chunk by chunk under the new prompt
    ref = StreamCache(state.cache.spec)
    text = gen.encode_prompt("a desert")
    old_text = gen.encode_prompt("a forest")
    frames = [state.clean[s] for s in range(9)]  # after recache, slots are in time order
    nf = 3
    for c in range(3):
        x = torch.stack(frames[c * nf : (c + 1) * nf], dim=1)[None]
        slots = ref.plan_commit(nf)
        use = old_text if (c == 0 and not recache_sinks) else text
        gen.model(x, torch.zeros(1, nf), use, [CacheAccess(ref, ref.num_frames, write_slots=slots)])
        ref.advance(slots)
    for layer in range(gen.model_cfg.num_layers):
        k, v = state.cache.read(layer)
        rk, rv = ref.read(layer)
        assert torch.allclose(k, rk, atol=1e-5) and torch.allclose(v, rv, atol=1e-5), layer
    if not recache_sinks:
        assert torch.equal(state.cache.read(0, 3)[0], sinks_before[0])
    # the next chunk is generated under the new version
    chunk = run_chunks(gen, state, 1)[0]
    assert chunk.prompt_version == 1


def test_recache_chunk_by_chunk_equals_one_masked_forward_over_the_window():
    # a recache runs one forward per chunk of the window (no mask, a commit's shapes); the reference is
    # one forward over the whole window, block-causal through a mask, as recaches were computed before
    gen = tiny_generator(sink_frames=3, window_frames=9)
    state = gen.open_stream("s", "a forest", seed=2)
    run_chunks(gen, state, 6)  # the window has rolled: its slots are out of time order
    ref = StreamCache(state.cache.spec)
    gen.set_prompt(state, "a desert")
    gen.run(WorkKind.RECACHE, [state])
    assert state.forwards["recache"] == 1
    for layer in range(gen.model_cfg.num_layers):  # the sinks as they were, the window in time order
        k, v = state.cache.read(layer)
        ref.write(layer, range(12), k, v)
    ref.sinks_filled, ref.window_filled = 3, 9
    x = state.clean[3:12].transpose(0, 1)[None]  # [1, C, 9, h, w], oldest first
    blocks = [state.cache.frame_ids[s] // 3 for s in range(3, 12)]
    assert blocks == [3, 3, 3, 4, 4, 4, 5, 5, 5]
    gen.model(x, torch.zeros(1, 9), gen.encode_prompt("a desert"), [CacheAccess(ref, 3, write_slots=list(range(3, 12)), block_ids=blocks)])
    for layer in range(gen.model_cfg.num_layers):
        for got, want in zip(state.cache.read(layer), ref.read(layer)):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_streams_switching_through_the_workspace_equal_each_alone():
    # one stream's forwards run in the device's workspace; two streams interleaved forward by forward
    # (each switch copies one in and the other's new frames back) give what each gives alone
    alone = []
    for seed in (1, 2):
        gen = tiny_generator(sink_frames=3, window_frames=6)
        alone.append(run_chunks(gen, gen.open_stream("s", f"prompt {seed}", seed), 5))
    gen = tiny_generator(sink_frames=3, window_frames=6)
    states = [gen.open_stream(f"s{seed}", f"prompt {seed}", seed) for seed in (1, 2)]
    together = [[], []]
    for c in range(5):
        for _ in range(len(gen.sigmas)):
            for s in states:
                gen.run(WorkKind.DENOISE, [s])
        if c == 3:
            gen.set_prompt(states[0], "prompt 1")  # the same prompt again: a recache that changes nothing
            gen.run(WorkKind.RECACHE, [states[0]])
        for j, s in enumerate(states):
            together[j] += gen.run(WorkKind.COMMIT, [s])
    assert gen.workspace.switches > 2 * 5 * len(gen.sigmas)
    for a, b in zip(alone, together):
        for x, y in zip(a, b):
            torch.testing.assert_close(x.latents, y.latents, atol=1e-5, rtol=1e-5)
    gen.close_stream(states[1])  # the attached one goes away: nothing is copied back
    assert gen.workspace.owner is None and states[1].cache.storage is not gen.workspace.storage


def test_first_prompt_switch_without_cache_needs_no_recache():
    gen = tiny_generator()
    state = gen.open_stream("s", "one", seed=0)
    gen.set_prompt(state, "two")
    assert gen.next_work(state) is WorkKind.DENOISE
    chunk = run_chunks(gen, state, 1)[0]
    assert chunk.prompt_version == 1 and state.forwards["recache"] == 0


def test_prompt_changes_the_video():
    gen = tiny_generator()
    a = run_chunks(gen, gen.open_stream("a", "a cat", 5), 2)
    b = run_chunks(gen, gen.open_stream("b", "a spaceship", 5), 2)
    assert not np.array_equal(a[1].frames, b[1].frames)


def test_batched_streams_equal_one_by_one():
    gen = tiny_generator(sink_frames=3, window_frames=6)
    solo, batch, solo_out, batch_out = solo_and_batched(gen, ["alpha", "beta", "gamma"])
    for s_chunks, b_chunks in zip(solo_out, batch_out):
        for x, y in zip(s_chunks, b_chunks):
            assert torch.allclose(x.latents, y.latents, atol=1e-4), (x.latents - y.latents).abs().max()
    for s, b in zip(solo, batch):
        for layer in range(gen.model_cfg.num_layers):
            assert torch.allclose(s.cache.read(layer)[0], b.cache.read(layer)[0], atol=1e-4)


def test_commit_before_denoised_is_an_error():
    gen = tiny_generator()
    state = gen.open_stream("s", "x", seed=0)
    with pytest.raises(ValueError, match="not denoised"):
        gen.commit([state])


def test_degraded_chunk_is_the_full_schedules_early_exit():
    # a chunk run with 3 of the 4 steps is the full schedule's prediction after its 3rd step (same
    # noise draws up to there), tagged with its steps; the next chunk runs the full schedule again
    gen = tiny_generator()
    full = gen.open_stream("full", "a kite", seed=3)
    gen.run(WorkKind.DENOISE, [full])
    gen.run(WorkKind.DENOISE, [full])
    gen.run(WorkKind.DENOISE, [full])
    exit_at_3 = full.x0.clone()
    short = gen.open_stream("short", "a kite", seed=3)
    gen.set_steps(short, 3)
    for _ in range(3):
        assert gen.next_work(short) is WorkKind.DENOISE
        gen.run(WorkKind.DENOISE, [short])
    assert gen.next_work(short) is WorkKind.COMMIT
    chunk = gen.run(WorkKind.COMMIT, [short])[0]
    assert chunk.steps == 3 and torch.equal(chunk.latents, exit_at_3)
    assert short.steps == len(gen.sigmas) and run_chunks(gen, short, 1)[0].steps == len(gen.sigmas)


def test_a_chunk_in_progress_can_only_be_cut_short():
    gen = tiny_generator()
    state = gen.open_stream("s", "a kite", seed=0)
    with pytest.raises(ValueError, match="use 4 or one of"):
        gen.set_steps(state, 1)
    gen.run(WorkKind.DENOISE, [state])
    gen.run(WorkKind.DENOISE, [state])
    gen.set_steps(state, 2)  # cut at the step it has reached: the commit is next
    assert gen.next_work(state) is WorkKind.COMMIT
    with pytest.raises(ValueError, match="only be cut short"):
        gen.set_steps(state, 3)
    assert gen.run(WorkKind.COMMIT, [state])[0].steps == 2


def test_bf16_generation_runs_and_tracks_fp32():
    from models import build_generator

    gen16 = build_generator("tiny", device="cpu", dtype=torch.bfloat16, seed=0)
    gen32 = tiny_generator()
    a = run_chunks(gen16, gen16.open_stream("a", "a boat", 1), 2)
    b = run_chunks(gen32, gen32.open_stream("a", "a boat", 1), 2)
    assert a[1].frames.shape == (12, 128, 128, 3)
    rel = (a[0].latents - b[0].latents).norm() / b[0].latents.norm()
    assert rel < 0.1, rel


def test_the_prompt_cache_keeps_the_most_recent_prompts_within_its_bytes(monkeypatch):
    from models import prompts as G

    gen = tiny_generator()
    kv = gen.encode_prompt("a")
    size = sum(t.numel() * t.element_size() for pair in kv for t in pair)
    assert gen.encode_prompt("a") is kv  # computed once
    monkeypatch.setattr(G, "PROMPT_CACHE_BYTES", 2 * size)  # room for two (a 14B prompt is 420 MB)
    gen.encode_prompt("b")
    assert gen.encode_prompt("a") is kv  # "a" is now the newest
    gen.encode_prompt("c")
    assert list(gen.prompts.entries) == ["a", "c"]  # "b", the least recent, went
    state = gen.open_stream("s", "d", seed=0)
    gen.encode_prompt("e")
    gen.encode_prompt("f")
    assert list(gen.prompts.entries) == ["e", "f"]
    held = state.text  # the stream keeps its own prompt's K/V; asked again, the same values
    assert all(torch.equal(a, b) for pa, pb in zip(held, gen.encode_prompt("d")) for a, b in zip(pa, pb))
    monkeypatch.setattr(G, "PROMPT_CACHE_BYTES", 0)
    gen.encode_prompt("g")
    assert list(gen.prompts.entries) == ["g"]  # the newest always stays


@pytest.mark.parametrize("at_step, quant, parked_after",
                         [(0, "none", 3), (2, "none", 3), (0, "int4", 3), (0, "none", 4), (0, "int4", 4)])
def test_parked_and_restored_stream_continues_exactly(at_step, quant, parked_after):
    # the stream's whole state goes to host memory and back into a fresh cache, between chunks or in the
    # middle of one (x, x0 and the step travel too), quantized storage with its slot maps: the chunks after
    # it equal an uninterrupted run's. Parked after 4 chunks, the ring has turned (head 3 of the window's 6
    # slots), and the prompt switch at chunk 4 recaches from the restored clean latents and ring
    prompts = {2: "a red boat", 4: "a blue train"}
    gen = tiny_generator(sink_frames=3, window_frames=6, kv_quant=quant)
    want = run_chunks(gen, gen.open_stream("ref", "a cat", seed=7), 8, dict(prompts))
    gen = tiny_generator(sink_frames=3, window_frames=6, kv_quant=quant)
    other = gen.open_stream("other", "a dog", seed=3)  # takes the workspace while the stream is parked
    state = gen.open_stream("s", "a cat", seed=7)
    it = gen.stream(state, dict(prompts))
    got = [next(it) for _ in range(parked_after)]
    for _ in range(at_step):
        gen.run(WorkKind.DENOISE, [state])
    head = state.cache.head
    parked = _parked_and_back_after(gen, state, lambda: run_chunks(gen, other, 2))
    assert state.cache.head == head == (3 if parked_after == 4 else 0)
    assert parked.nbytes >= gen.cache_spec().stream_bytes() + state.clean.numel() * 4
    got += [next(it) for _ in range(8 - parked_after)]
    assert [c.index for c in got] == list(range(8))
    for a, b in zip(want, got):
        assert a.prompt_version == b.prompt_version
        assert torch.equal(a.latents, b.latents) and torch.equal(a.frames, b.frames)


def _parked_and_back_after(gen, state, meanwhile):
    """Park `state`, run `meanwhile`, restore it into a new cache."""
    parked = gen.park(state)
    assert parked.done() and state.cache is None and state.clean is None and state.text is None
    meanwhile()
    cache = StreamCache(gen.cache_spec(), gen.device)
    assert gen.restore(parked, cache) is state and state.cache is cache and parked.done()
    return parked


def test_park_moves_every_device_tensor_of_the_stream_to_the_host():
    gen = tiny_generator(sink_frames=1, window_frames=3)
    state = gen.open_stream("s", "a cat", seed=1)
    run_chunks(gen, state, 2)
    need = gen.park_bytes(state)
    cache = state.cache
    assert gen.workspace.owner is cache
    parked = gen.park(state)
    assert gen.workspace.owner is None  # the stream's frames went home before the copy
    assert parked.nbytes == need and parked.cache.nbytes == cache.spec.stream_bytes() == cache.storage.nbytes
    home = cache.storage.tensors()
    assert [t.shape for t in parked.cache.moved.tensors] == [t.shape for t in home]
    assert all(torch.equal(t, h) and t.data_ptr() != h.data_ptr() for t, h in zip(parked.cache.moved.tensors, home))
    assert parked.cache.ring["frames_seen"] == 6 and parked.fields["decoder"].memory is not None
    assert parked.seconds >= 0
