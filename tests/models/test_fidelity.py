"""Fidelity tiers (models/fidelity.py) and the approximate tier's generator options: shorter schedules
and commit reuse (the cache keeps the last denoising step's K/V), tiny preset, CPU."""

import pytest
import torch

from kvcache import StreamCache
from models import CacheAccess, GeneratorConfig, Work, fidelity
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
    assert gen.next_work(state) is Work.COMMIT
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
    assert gen.next_work(state) is Work.RECACHE and state.pending_prompt == "a red kite"
    gen.run(Work.RECACHE, [state])
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
        gen.run(Work.DENOISE, batch)
    gen.set_steps(batch[1], 2)
    for _ in range(2):
        gen.run(Work.DENOISE, [batch[0], batch[2]])
    gen.run(Work.COMMIT, batch)
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
