"""Fidelity tiers (models/fidelity.py) and the approximate tier's generator options: shorter schedules,
commit reuse (the cache keeps the last denoising step's K/V) and recache-last (a prompt switch recomputes the
window's newest chunk only), tiny preset, CPU."""

import pytest
import torch

from kvcache import StreamCache
from models import CacheAccess, GeneratorConfig, WorkKind, fidelity
from tests.conftest import solo_and_batched, tiny_generator


def test_every_option_has_a_tier_and_the_tiers_cap_them():
    assert fidelity.TIERS == ("exact", "quantized", "approximate")
    for o in fidelity.OPTIONS:
        assert o.tier in ("quantized", "approximate") and o.what
    assert fidelity.allowed("fp8-linears", "quantized") and not fidelity.allowed("fp8-linears", "exact")
    assert not fidelity.allowed("commit-reuse", "quantized") and fidelity.allowed("commit-reuse", "approximate")
    assert fidelity.allowed("commit-reuse", None)  # no cap given
    assert fidelity.defaults(None, "cuda") == [] and fidelity.defaults("exact", "cuda") == []
    assert fidelity.defaults("quantized", "cuda") == ["fp8-linears"]  # INT8 attention only when named
    assert fidelity.defaults("approximate", "cuda") == ["fp8-linears", "steps-3", "commit-reuse"]
    assert fidelity.defaults("approximate", "cpu") == ["steps-3", "commit-reuse"]  # FP8 and INT8 only pay on a GPU
    assert fidelity.degrade_allowed(None) and fidelity.degrade_allowed("quantized") and not fidelity.degrade_allowed("exact")


def test_configure_sets_the_generator_and_refuses_what_is_over_the_cap():
    base = GeneratorConfig()
    cfg = fidelity.configure(base, "approximate", None, "cuda")
    assert cfg.fp8_linears and cfg.attention_quant == "none" and cfg.commit_reuse
    assert cfg.timesteps == base.timesteps[:3] and cfg.shorter_steps == (2,)
    assert fidelity.active(cfg) == ["fp8-linears", "steps-3", "commit-reuse"]
    named = fidelity.configure(base, "quantized", fidelity.parse("int8-attention"), "cuda")
    assert named.attention_quant == "int8" and fidelity.active(named) == ["int8-attention"]
    assert fidelity.tier_of(fidelity.active(cfg)) == "approximate"
    assert "fidelity approximate" in fidelity.describe(cfg, degrade=True)
    assert fidelity.configure(base, "exact", None, "cuda") == base
    assert fidelity.describe(base, degrade=False).startswith("fidelity exact: speed options none")
    two = fidelity.configure(base, "approximate", fidelity.parse("steps-2"), "cpu")
    assert two.timesteps == (1000.0, 750.0) and not two.fp8_linears and two.shorter_steps == ()
    with pytest.raises(ValueError, match="commit-reuse is approximate, over --fidelity quantized"):
        fidelity.configure(base, "quantized", ["commit-reuse"], "cuda")
    with pytest.raises(ValueError, match="--kv-quant int2 is a quantized option, over --fidelity exact"):
        fidelity.configure(GeneratorConfig(kv_quant="int2"), "exact", None, "cuda")
    assert fidelity.configure(GeneratorConfig(kv_quant="int2"), None, None, "cuda").kv_quant == "int2"  # no cap
    assert fidelity.parse(None) is None and fidelity.parse("none") == []
    with pytest.raises(ValueError, match="unknown"):
        fidelity.parse("fp9-linears")
    with pytest.raises(ValueError, match="alternatives"):
        fidelity.parse("steps-3,steps-2")


def record_forwards(gen):
    seen = []
    runner = gen.runner

    def spy(x, t, text, access):
        seen.append((x.clone(), t.clone(), [a.write_slots for a in access]))
        return runner(x, t, text, access)

    gen.runner = spy
    return seen


def test_shorter_schedule_runs_its_steps_and_degrades_below_them():
    gen = tiny_generator(sink_frames=3, window_frames=6, timesteps=(1000.0, 750.0, 500.0))
    state = gen.open_stream("s", "a red ball", seed=1)
    it = gen.stream(state)
    chunks = [next(it) for _ in range(3)]
    assert state.forwards == {"recache": 0, "denoise": 9, "commit": 3} and {c.steps for c in chunks} == {3}
    assert gen.cfg.shorter_steps == (2,)


def test_commit_reuse_drops_the_commit_and_caches_the_last_steps_kv():
    chunks, forwards, caches = {}, {}, {}
    for reuse in (False, True):
        gen = tiny_generator(sink_frames=3, window_frames=6, commit_reuse=reuse)
        seen = record_forwards(gen)
        state = gen.open_stream("s", "a blue square", seed=2)
        it = gen.stream(state)
        chunks[reuse] = [next(it) for _ in range(5)]  # past the window: the ring turns
        forwards[reuse] = len(seen)
        caches[reuse] = (gen, state, seen)
    assert forwards[True] == forwards[False] - 5  # one forward fewer per chunk
    gen, state, seen = caches[True]
    assert state.forwards == {"recache": 0, "denoise": 20, "commit": 0}
    # each chunk's 4th step (t = 625) wrote the cache; the others did not
    writes = [w[0] for _, _, w in seen]
    assert [w is not None for w in writes] == [False, False, False, True] * 5
    assert all(t[0, 0].item() == pytest.approx(625.0) for (_, t, w) in seen if w[0] is not None)
    # the first chunk's cached K/V are those of a forward of its last step's input at that step's timestep
    x, t, _ = seen[3]
    fresh = StreamCache(gen.cache_spec())
    gen.model(x, t, state.text, [CacheAccess(fresh, 0, write_slots=[0, 1, 2])])
    for layer in range(gen.model_cfg.num_layers):
        k, v = state.cache.read(layer, 3)  # the sinks: the first chunk's frames, never overwritten
        k2, v2 = fresh.read(layer, 3)
        torch.testing.assert_close(k, k2, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v, v2, rtol=1e-5, atol=1e-5)
    lat = {r: torch.stack([c.latents for c in chunks[r]]) for r in chunks}
    assert torch.isfinite(lat[True]).all()
    torch.testing.assert_close(lat[True][0], lat[False][0])  # the first chunk reads no cache: identical
    err = ((lat[True] - lat[False]).norm() / lat[False].norm()).item()
    assert 0 < err < 0.2


def test_commit_reuse_with_a_chunk_cut_short_commits_with_a_forward():
    gen = tiny_generator(sink_frames=3, window_frames=6, commit_reuse=True)
    seen = record_forwards(gen)
    state = gen.open_stream("s", "a green ball", seed=3)
    gen.denoise([state])
    gen.denoise([state])
    gen.set_steps(state, 2)  # degraded after its 2nd step: that step did not write the cache
    assert gen.next_work(state) is WorkKind.COMMIT
    gen.commit([state])
    assert state.forwards["commit"] == 1 and seen[-1][1].abs().sum() == 0  # a real commit at t = 0
    gen.set_steps(state, 4)
    gen.denoise([state])
    gen.set_steps(state, 3)  # degraded before its 3rd step: that one is the last and writes
    gen.denoise([state])
    gen.denoise([state])
    assert seen[-1][2] == [[3, 4, 5]]
    gen.commit([state])
    assert state.forwards["commit"] == 1 and state.cache.num_frames == 6


def test_commit_reuse_abandoned_over_live_slots_recaches_them():
    gen = tiny_generator(sink_frames=3, window_frames=3, commit_reuse=True)
    state = gen.open_stream("s", "a red kite", seed=4)
    it = gen.stream(state)
    for _ in range(2):
        next(it)  # sinks and window full: the next chunk overwrites the oldest window frames
    for _ in range(4):
        gen.denoise([state])
    assert state.reused_slots == [3, 4, 5]
    version = state.prompt_version
    gen.abandon_chunk(state)
    assert gen.next_work(state) is WorkKind.RECACHE and state.pending_prompt == "a red kite"
    gen.run(WorkKind.RECACHE, [state])
    assert state.prompt_version == version and state.forwards["recache"] == 1


def test_commit_reuse_batched_streams_equal_one_by_one():
    """Streams at different fills and steps in one forward: each one whose step is its last writes its own
    slots; a batched commit runs a forward only for a chunk cut short (here: none, then one)."""
    gen = tiny_generator(sink_frames=3, window_frames=6, commit_reuse=True)
    solo, batch, solo_out, batch_out = solo_and_batched(gen, ["alpha", "beta", "gamma"])
    for s_chunks, b_chunks in zip(solo_out, batch_out):
        for x, y in zip(s_chunks, b_chunks):
            torch.testing.assert_close(x.latents, y.latents, atol=1e-4, rtol=1e-4)
    for s, b in zip(solo, batch):
        assert b.forwards["commit"] == 0 and b.cache.num_frames == s.cache.num_frames
        for layer in range(gen.model_cfg.num_layers):
            torch.testing.assert_close(s.cache.read(layer)[0], b.cache.read(layer)[0], atol=1e-4, rtol=1e-4)
    # one of the batch cut short after its 2nd step commits with a forward, the others without
    for _ in range(2):
        gen.run(WorkKind.DENOISE, batch)
    gen.set_steps(batch[1], 2)
    for _ in range(2):
        gen.run(WorkKind.DENOISE, [batch[0], batch[2]])
    gen.run(WorkKind.COMMIT, batch)
    assert [b.forwards["commit"] for b in batch] == [0, 1, 0]


def test_commit_reuse_survives_switching_streams_between_last_step_and_commit():
    """The last step's K/V are written in the device's workspace; another stream taking the workspace before
    the commit copies them home first (including slots past the cache's fill)."""
    alone = {}
    for name, seed in (("a", 1), ("b", 2)):
        gen = tiny_generator(sink_frames=3, window_frames=3, commit_reuse=True)
        s = gen.open_stream(name, f"prompt {name}", seed=seed)
        it = gen.stream(s)
        alone[name] = torch.stack([next(it).latents for _ in range(4)])
    gen = tiny_generator(sink_frames=3, window_frames=3, commit_reuse=True)
    a, b = gen.open_stream("a", "prompt a", seed=1), gen.open_stream("b", "prompt b", seed=2)
    out = {"a": [], "b": []}
    for _ in range(4):
        for _ in range(4):
            gen.denoise([a])
        for _ in range(4):
            gen.denoise([b])  # b takes the workspace: a's last-step K/V go home
        out["a"] += gen.commit([a])
        out["b"] += gen.commit([b])
    assert gen.workspace.switches > 4
    for name in ("a", "b"):
        torch.testing.assert_close(torch.stack([c.latents for c in out[name]]), alone[name], rtol=1e-5, atol=1e-5)


def test_recache_last_is_an_approximate_option_off_by_default():
    base = GeneratorConfig()
    assert fidelity.BY_NAME["recache-last"].tier == "approximate" and "recache-last" in fidelity.STEADY
    assert "recache-last" not in fidelity.defaults("approximate", "cuda") + fidelity.defaults("approximate", "cpu")
    assert fidelity.parse("recache-last,commit-reuse") == ["recache-last", "commit-reuse"]
    cfg = fidelity.configure(base, "approximate", fidelity.parse("recache-last"), "cpu")
    assert cfg.recache_chunks == 1 and not cfg.commit_reuse and cfg.timesteps == base.timesteps
    assert fidelity.active(cfg) == ["recache-last"] and fidelity.tier_of(["recache-last"]) == "approximate"
    assert fidelity.configure(base, None, ["recache-last"], "cuda").recache_chunks == 1  # no cap given
    assert fidelity.configure(cfg, "approximate", None, "cpu").recache_chunks == 0  # the tier's defaults only
    assert "recache-last" in fidelity.describe(cfg, degrade=False) and "recache-last (approximate)" in fidelity.help_text()
    with pytest.raises(ValueError, match="recache-last is approximate, over --fidelity quantized"):
        fidelity.configure(base, "quantized", ["recache-last"], "cuda")
    with pytest.raises(ValueError, match="recache_chunks must be >= 0"):
        GeneratorConfig(recache_chunks=-1)


def kv_by_frame(gen, state) -> dict:
    """(layer, frame id) -> that frame's cached (K, V)."""
    kv = {}
    for layer in range(gen.model_cfg.num_layers):
        k, v = state.cache.read(layer)
        for slot, frame in enumerate(state.cache.frame_ids):
            kv[layer, frame] = (k[slot].clone(), v[slot].clone())
    return kv


def six_chunks(stage_kv=True, **cfg):
    """A stream of 6 chunks under "a forest", sink 3 + window 9: the ring's head is at 6, so the window's slots
    are out of time order (a recache's relayout moves every frame). Returns (generator, state, iterator, forwards seen)."""
    gen = tiny_generator(sink_frames=3, window_frames=9, stage_kv=stage_kv, **cfg)
    seen = record_forwards(gen)
    state = gen.open_stream("s", "a forest", seed=2)
    it = gen.stream(state)
    for _ in range(6):
        next(it)
    assert state.cache.head == 6
    return gen, state, it, seen


def switched(stage_kv=True, **cfg):
    """`six_chunks`, then a switch to "a desert" and its recache. Returns the generator, the state, the recache's
    forwards, the K/V by frame right after it, the clean latents of the newest chunk ([C, 3, h, w]) and the 2
    chunks that follow."""
    gen, state, it, seen = six_chunks(stage_kv, **cfg)
    before = len(seen)
    gen.set_prompt(state, "a desert")
    gen.run(WorkKind.RECACHE, [state])
    forwards = len(seen) - before
    kv = kv_by_frame(gen, state)
    newest = state.clean[[state.cache.frame_ids.index(f) for f in (15, 16, 17)]].transpose(0, 1).clone()
    return gen, state, forwards, kv, newest, [next(it) for _ in range(2)]


def assert_kv(a, b, equal=True):
    same = torch.allclose(a[0], b[0], rtol=1e-5, atol=1e-6) and torch.allclose(a[1], b[1], rtol=1e-5, atol=1e-6)
    assert same == equal


@pytest.mark.parametrize("stage_kv", [True, False])  # through the device's workspace, and the stream's own storage
def test_recache_last_recomputes_the_newest_chunk_and_keeps_the_older_ones(stage_kv):
    _, full_state, full_forwards, full, _, full_after = switched(stage_kv)
    gen, state, forwards, last, x, last_after = switched(stage_kv, recache_chunks=1)
    old = kv_by_frame(*six_chunks(stage_kv)[:2])  # no switch: the old prompt's K/V
    assert (full_forwards, forwards) == (3, 1)  # forwards over 3, 6 and 9 cached frames; one over 9
    assert state.forwards["recache"] == 1 and state.prompt_version == 1 and state.cache.frame_ids == full_state.cache.frame_ids
    newest, older, sinks = (15, 16, 17), (9, 10, 11, 12, 13, 14), (0, 1, 2)
    for layer in range(gen.model_cfg.num_layers):
        for f in newest:  # the newest chunk as a full recache computes it. That holds in layers 0 and 1, so in
            # every layer of the tiny preset's 2: the newest chunk's K/V of layer l depend on the older frames' K/V
            # of the layers below l, and those of layer 0 (before any attention) do not depend on the prompt
            assert_kv(last[layer, f], full[layer, f])
            assert_kv(last[layer, f], old[layer, f], equal=layer == 0)
        for f in older + sinks:  # moved from their ring slots to the relaid-out ones, K/V as under the old prompt
            assert_kv(last[layer, f], old[layer, f])
    for f in older:
        assert_kv(last[1, f], full[1, f], equal=False)  # a full recache recomputed them under the new prompt
    # at any depth: one forward at t = 0 over the newest chunk under the new prompt, reading the sinks and the
    # older frames with the old prompt's K/V, in time order
    ref = StreamCache(state.cache.spec)
    for layer in range(gen.model_cfg.num_layers):
        kept = [old[layer, f] for f in sinks + older]
        ref.write(layer, range(9), torch.stack([k for k, _ in kept]), torch.stack([v for _, v in kept]))
    gen.model(x[None], torch.zeros(1, 3), gen.encode_prompt("a desert"), [CacheAccess(ref, 9, write_slots=[9, 10, 11])])
    for layer in range(gen.model_cfg.num_layers):
        k, v = ref.read(layer, 12)
        for slot, f in zip((9, 10, 11), newest):
            assert_kv(last[layer, f], (k[slot], v[slot]))
    # the chunks after the switch read the older chunks' old K/V: close to a full recache's, not equal
    for a, b in zip(last_after, full_after):
        assert a.prompt_version == b.prompt_version == 1
        err = ((a.latents - b.latents).norm() / b.latents.norm()).item()
        assert 0 < err < 0.5, err


def test_recache_last_equals_a_full_recache_when_the_window_holds_one_chunk():
    out = {}
    for chunks in (0, 1):
        gen = tiny_generator(sink_frames=3, window_frames=3, recache_chunks=chunks)
        seen = record_forwards(gen)
        state = gen.open_stream("s", "a forest", seed=5)
        it = gen.stream(state, {4: "a desert"})
        out[chunks] = (torch.stack([next(it).latents for _ in range(6)]), len(seen))
    torch.testing.assert_close(out[1][0], out[0][0], rtol=0, atol=0)
    assert out[1][1] == out[0][1] == 6 * 5 + 1  # 5 forwards a chunk and one recache forward


def test_recache_last_changes_nothing_without_a_switch():
    lat = {}
    for chunks in (0, 1):
        gen = tiny_generator(sink_frames=3, window_frames=9, recache_chunks=chunks)
        state = gen.open_stream("s", "a forest", seed=3)
        it = gen.stream(state)
        lat[chunks] = torch.stack([next(it).latents for _ in range(7)])  # past the window: the ring turns
        assert state.forwards == {"recache": 0, "denoise": 28, "commit": 7}
    assert torch.equal(lat[1], lat[0])


def test_recache_last_kept_kv_go_home_when_another_stream_takes_the_workspace():
    """The kept frames' K/V are moved in the workspace (the stream, copied in afresh, has written nothing
    there yet); another stream taking it right after the recache copies them back to the stream's own storage."""
    def run(other: bool):
        gen = tiny_generator(sink_frames=3, window_frames=9, recache_chunks=1)
        a = gen.open_stream("a", "a forest", seed=2)
        b = gen.open_stream("b", "a city", seed=9)
        it, it_b = gen.stream(a), gen.stream(b)
        for _ in range(6):
            next(it)
        if other:
            next(it_b)  # b takes the workspace: a goes home
        gen.set_prompt(a, "a desert")
        gen.run(WorkKind.RECACHE, [a])  # a is copied in again, its kept K/V moved there
        if other:
            next(it_b)  # and a goes home again
            assert gen.workspace.owner is b.cache
        return torch.stack([next(it).latents for _ in range(2)])

    torch.testing.assert_close(run(True), run(False), rtol=0, atol=0)


def test_recache_last_recaches_the_whole_window_after_commit_reuse_abandoned_over_it():
    gen = tiny_generator(sink_frames=3, window_frames=9, commit_reuse=True, recache_chunks=1)
    seen = record_forwards(gen)
    state = gen.open_stream("s", "a red kite", seed=4)
    it = gen.stream(state)
    for _ in range(4):
        next(it)  # sinks and window full: the next chunk's last step overwrites the oldest window frames
    for _ in range(4):
        gen.denoise([state])
    assert state.reused_slots == [3, 4, 5]
    gen.abandon_chunk(state)
    before = len(seen)
    gen.run(WorkKind.RECACHE, [state])
    assert len(seen) - before == 3 and not state.recache_all  # every window chunk, the overwritten one included
    gen.set_prompt(state, "a blue kite")
    before = len(seen)
    gen.run(WorkKind.RECACHE, [state])
    assert len(seen) - before == 1  # then the newest chunk only again


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_commit_reuse_replays_the_captured_graphs_and_equals_eager():
    """A chunk's last step writing the cache replays a commit's graph (t is an input): every forward after the
    start-up capture is a replay of a captured key, through a ring that turns and a prompt switch."""
    from models import build_generator

    lat = {}
    for graphs in (True, False):
        cfg = GeneratorConfig(sink_frames=3, window_frames=6, commit_reuse=True, cuda_graphs=graphs)
        gen = build_generator("tiny", device="cuda", dtype=torch.float32, seed=3, cfg=cfg)
        gen.capture_graphs()
        state = gen.open_stream("a", "a red kite", seed=1)
        it = gen.stream(state, {3: "a green kite"})
        lat[graphs] = torch.stack([next(it).latents for _ in range(6)])
        if graphs:
            assert gen.runner.stats["replays"] > 0 and not gen.runner._warned  # nothing ran uncaptured
    assert (lat[True] != 0).any()
    torch.testing.assert_close(lat[True], lat[False], rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_recache_last_replays_the_captured_graphs_and_equals_eager():
    """A recache of the newest chunk is a commit-shaped forward that rotates the keys, over every older frame:
    after the start-up capture every forward is a replay, through switches with the window partly filled and
    with the ring's head at 0, 6 and 3 (the kept frames' K/V moved before it), and equals eager."""
    from models import build_generator

    lat = {}
    for graphs in (True, False):
        cfg = GeneratorConfig(sink_frames=3, window_frames=9, recache_chunks=1, cuda_graphs=graphs)
        gen = build_generator("tiny", device="cuda", dtype=torch.float32, seed=3, cfg=cfg)
        gen.capture_graphs()
        state = gen.open_stream("a", "a red kite", seed=1)
        it = gen.stream(state, {2: "a green kite", 4: "a blue kite", 6: "a red kite", 7: "a white kite"})
        lat[graphs] = torch.stack([next(it).latents for _ in range(9)])
        assert state.forwards["recache"] == 4
        if graphs:
            assert gen.runner.stats["replays"] > 0 and not gen.runner._warned  # nothing ran uncaptured
    assert (lat[True] != 0).any()
    torch.testing.assert_close(lat[True], lat[False], rtol=1e-4, atol=1e-4)
