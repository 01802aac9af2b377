"""The fused Triton kernels (models/triton_ops.py) against the torch references in models/dit.py.

On CUDA they run compiled; on CPU a child process runs them in Triton's interpreter."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from models import dit

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
        want_h, want = dit.residual_norm(h.clone(), y, gate, w, bias, 1e-6, dtype)
        got_h, got = triton_ops.residual_norm(h.clone(), y, gate, w, bias, 1e-6, dtype)
    else:
        want_h, want = dit.residual_adaln(h.clone(), y, gate, mod[0], mod[1], 1e-6, dtype)
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
    close(triton_ops.norm_rope(q, w, 1e-6, q_cos, q_sin), dit.norm_rope(q, w, 1e-6, q_cos, q_sin), dtype)
    kc = rnd(2 * rows, nh, d).to(dtype)
    got_all, got_n = triton_ops.norm_rope_cat(kc, k, w, 1e-6, c_cos, c_sin, q_cos, q_sin)
    want_all, want_n = dit.norm_rope_cat(kc, k, w, 1e-6, c_cos, c_sin, q_cos, q_sin)
    assert got_all.shape == (3 * rows, nh, d)
    close(got_all, want_all, dtype)
    close(got_n, want_n, dtype)


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


@pytest.mark.skipif(HAS_CUDA or INTERPRET or not HAS_TRITON, reason="CUDA runs the kernels directly; needs triton")
def test_interpreted_on_cpu():
    """Triton picks its interpreter per process at import, so the kernel tests run in a child with TRITON_INTERPRET=1."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__, "-k", "matches_reference"]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "4 passed" in proc.stdout  # float32; bfloat16 runs on CUDA
