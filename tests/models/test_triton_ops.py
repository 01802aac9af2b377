"""The fused Triton kernels (models/triton_ops.py) against the torch references in models/dit_ops.py.

On CUDA they run compiled; on CPU a child process runs them in Triton's interpreter."""

import importlib.util
import os

import pytest
import torch

from models import dit_ops
from tests.conftest import run_interpreted

HAS_CUDA = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # set by test_interpreted_on_cpu's child
DEVICE = None if not HAS_TRITON else "cuda" if HAS_CUDA else "cpu" if INTERPRET else None
needs_kernels = pytest.mark.skipif(DEVICE is None, reason="needs CUDA, or triton + TRITON_INTERPRET=1 (test_interpreted_on_cpu)")


def shapes():
    # (batch, frames, tokens per frame, heads, head dim): Wan's on CUDA, small ones in the interpreter
    return (1, 3, 1560, 12, 128) if DEVICE == "cuda" else (2, 2, 5, 3, 8)


def tables(rows, d, g):
    """RoPE tables as Rope.table builds them: [rows, 1, D], each pair's angle repeated, sin signed (-, +)."""
    ang = torch.rand(rows, 1, d // 2, generator=g, dtype=torch.float64) * 50
    cos = ang.cos().repeat_interleave(2, dim=-1)
    sin = (ang.sin()[..., None] * torch.tensor([-1.0, 1.0], dtype=torch.float64)).flatten(-2)
    return cos.float().to(DEVICE), sin.float().to(DEVICE)


def skip_interpreted_bf16(dtype):
    if dtype == torch.bfloat16 and DEVICE != "cuda":
        pytest.skip("Triton's interpreter truncates float32 -> bfloat16 casts (the GPU rounds to nearest)")


def close(got, want, dtype):
    got, want = got.float().cpu(), want.float().cpu()
    if dtype == torch.bfloat16:  # the same roundings: nearly all equal, the rest about one bf16 step apart
        torch.testing.assert_close(got, want, rtol=2e-2, atol=4e-2)
        assert (got != want).float().mean() < 0.05
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["affine", "modulated", "modulated_ungated"])
def test_residual_norm_matches_reference(kind, dtype):
    from models import triton_ops

    skip_interpreted_bf16(dtype)
    b, f, t, nh, d = shapes()
    dim = nh * d
    g = torch.Generator().manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=g).to(DEVICE)  # noqa: E731
    h, y = rnd(b, f, t, dim), rnd(b, f, t, dim).to(dtype)
    mod = rnd(b, f, 1, 6, dim).unbind(3)  # strided views, as the model passes them
    gate = None if kind == "modulated_ungated" else mod[2]
    if kind == "affine":
        w, bias = rnd(dim).to(dtype), rnd(dim).to(dtype)
        want_h, want = dit_ops.residual_norm(h.clone(), y, gate, w, bias, 1e-6, dtype)
        got_h, got = triton_ops.residual_norm(h.clone(), y, gate, w, bias, 1e-6, dtype)
    else:
        want_h, want = dit_ops.residual_adaln(h.clone(), y, gate, mod[0], mod[1], 1e-6, dtype)
        got_h, got = triton_ops.residual_adaln(h.clone(), y, gate, mod[0], mod[1], 1e-6, dtype)
    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got_h.cpu(), want_h.cpu(), rtol=1e-6, atol=1e-6)
    close(got, want, dtype)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_rope_and_key_buffer_matches_reference(dtype):
    from models import triton_ops

    skip_interpreted_bf16(dtype)
    _, f, t, nh, d = shapes()
    g = torch.Generator().manual_seed(1)
    rnd = lambda *s: torch.randn(*s, generator=g).to(DEVICE)  # noqa: E731
    qkv = rnd(f * t, 3, nh, d).to(dtype)  # rows strided like a fused projection's output
    q, k = qkv[:, 0], qkv[:, 1]
    w = (1 + 0.1 * rnd(nh * d)).to(dtype)
    rows = f * t
    q_cos, q_sin = tables(rows, d, g)
    c_cos, c_sin = tables(2 * rows, d, g)
    kc = rnd(2 * rows, nh, d).to(dtype)
    # the key buffer [cached | this forward's] as AttentionKV fills it, and the queries
    got, want = (torch.full((3 * rows, nh, d), float("nan"), dtype=dtype, device=DEVICE) for _ in range(2))
    got_n, want_n, got_q, want_q = (torch.empty(rows, nh, d, dtype=dtype, device=DEVICE) for _ in range(4))
    for ops, buf, normed, qbuf in ((triton_ops, got, got_n, got_q), (dit_ops.KERNELS, want, want_n, want_q)):
        ops.rope_into(kc, c_cos, c_sin, buf[: 2 * rows])
        ops.norm_rope_into(k, w, 1e-6, q_cos, q_sin, buf[2 * rows :], normed)
        ops.norm_rope_into(q, w, 1e-6, q_cos, q_sin, qbuf)
    assert not got.isnan().any()
    close(got, want, dtype)
    close(got_n, want_n, dtype)
    close(got_q, want_q, dtype)
    close(want_q, dit_ops.norm_rope(q, w, 1e-6, q_cos, q_sin), dtype)  # the into-form is the pure reference


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_parts_matches_reference(dtype):
    """Attention over two unequal parts of the keys, merged by log-sum-exp, equals attention over all."""
    from models import triton_ops

    skip_interpreted_bf16(dtype)
    lq, lk, nh, d = (4680, 18720, 12, 128) if DEVICE == "cuda" else (37, 50, 3, 16)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(n, nh, d, generator=g).to(DEVICE) for n in (lq, lk, lk))
    scale = d**-0.5

    def attend(keys, values):  # -> out [Lq, H, D], lse [H, Lq]
        s = torch.einsum("qhd,khd->hqk", q, keys) * scale
        return torch.einsum("hqk,khd->qhd", s.softmax(-1), values), s.logsumexp(-1)

    cut = lk * 4 // 5
    parts = [attend(k[:cut], v[:cut]), attend(k[cut:], v[cut:])]
    o = torch.stack([p[0] for p in parts]).to(dtype)
    lse = torch.stack([p[1] for p in parts]).float().contiguous()
    got, want = triton_ops.merge_parts(o, lse).float().cpu(), attend(k, v)[0].float().cpu()
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the parts' outputs are rounded before merging
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs CUDA")
def test_cuda_forward_with_kernels_tracks_reference_ops():
    """The model on CUDA (Triton kernels) against the same weights on CPU (torch references)."""
    from models import CacheAccess, build_generator

    gpu = build_generator("tiny", device="cuda", dtype=torch.float32, seed=3)
    cpu = build_generator("tiny", device="cpu", dtype=torch.float32, seed=3)
    outs = []
    for gen in (gpu, cpu):
        state = gen.open_stream("s", "a red kite", seed=5)
        mc = gen.model_cfg
        x = torch.randn(1, mc.in_channels, 3, mc.latent_height, mc.latent_width, generator=torch.Generator().manual_seed(0))
        t = torch.full((1, 3), 500.0)
        outs.append(gen.model(x.to(gen.device), t.to(gen.device), state.text, [CacheAccess(None, 0)]).cpu())
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_cuda_forwards_through_a_rolling_cache_track_cpu():
    """Commits through a ring that rolls, then batched reads of unequal fills: the CUDA path
    (the key / value buffers, kernels) gives the CPU reference's outputs."""
    from models import CacheAccess, GeneratorConfig, build_generator

    cfg = GeneratorConfig(sink_frames=3, window_frames=6)
    g = torch.Generator().manual_seed(0)
    outs = {}
    for dev in ("cuda", "cpu"):
        gen = build_generator("tiny", device=dev, dtype=torch.float32, seed=3, cfg=cfg)
        mc = gen.model_cfg
        a, b = gen.open_stream("a", "a red kite", seed=1), gen.open_stream("b", "a blue kite", seed=2)
        xs = torch.randn(6, 1, mc.in_channels, 3, mc.latent_height, mc.latent_width, generator=g.manual_seed(0))
        got = []
        for c in range(5):  # stream a commits 5 chunks (15 frames through 3 sinks + 6 window slots), b 2
            for s in (a, b) if c < 2 else (a,):
                slots = s.cache.plan_commit(3)
                acc = CacheAccess(s.cache, s.cache.num_frames, write_slots=slots)
                got.append(gen.model(xs[c].to(dev), torch.zeros(1, 3, device=dev), s.text, [acc]).cpu())
                s.cache.advance(slots)
        text = [(torch.cat([ka, kb]), torch.cat([va, vb])) for (ka, va), (kb, vb) in zip(a.text, b.text)]
        access = [CacheAccess(s.cache, s.cache.num_frames) for s in (a, b)]
        got.append(gen.model(torch.cat([xs[5], xs[4]]).to(dev), torch.full((2, 3), 750.0, device=dev), text, access).cpu())
        outs[dev] = torch.cat(got)
    torch.testing.assert_close(outs["cuda"], outs["cpu"], rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(HAS_CUDA or INTERPRET or not HAS_TRITON, reason="CUDA runs the kernels directly; needs triton")
def test_interpreted_on_cpu():
    """Triton picks its interpreter per process at import, so the kernel tests run in a child with TRITON_INTERPRET=1."""
    proc = run_interpreted(__file__, "matches_reference")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "5 passed" in proc.stdout  # float32; bfloat16 runs on CUDA


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_cuda_graph_replay_equals_eager():
    """Chunks of two streams taking turns through a rolling ring and a prompt switch: the generator
    with CUDA graphs (models/graphs.py) gives the same latents as without, and does replay."""
    from models import GeneratorConfig, build_generator

    lat, gens = [], []
    for graphs in (True, False):
        cfg = GeneratorConfig(sink_frames=3, window_frames=6, cuda_graphs=graphs)
        gen = build_generator("tiny", device="cuda", dtype=torch.float32, seed=3, cfg=cfg)
        a, b = gen.open_stream("a", "a red kite", seed=1), gen.open_stream("b", "a blue kite", seed=2)
        out = []
        for c in range(6):
            if c == 3:
                gen.set_prompt(a, "a green kite")
            for s in (a, b):
                if gen.next_work(s).value == "recache":
                    gen.run(gen.next_work(s), [s])
            for s in (a, b):  # one chunk each, in turn: each switches the workspace
                while True:
                    work = gen.next_work(s)
                    chunks = gen.run(work, [s])
                    if work.value == "commit":
                        out += [ch.latents for ch in chunks]
                        break
        lat.append(torch.stack(out))
        gens.append(gen)
    torch.testing.assert_close(lat[0], lat[1], rtol=1e-5, atol=1e-5)
    assert gens[0].runner.stats["replays"] > 10
