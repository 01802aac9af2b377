"""INT8 attention (models/sage.py): the torch reference against exact attention (random tensors with the
channel outliers keys carry, and the tiny model's own activations), the Triton kernel against the
reference (Triton's interpreter on CPU, in a child process; compiled on CUDA)."""

import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F

from models import GeneratorConfig, build_generator, sage
from tests.conftest import run_interpreted

HAS_CUDA = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # set by test_interpreted_on_cpu's child
DEVICE = None if not HAS_TRITON else "cuda" if HAS_CUDA else "cpu" if INTERPRET else None
needs_kernel = pytest.mark.skipif(DEVICE is None, reason="needs CUDA, or triton + TRITON_INTERPRET=1 (test_interpreted_on_cpu)")


def exact(q, k, v):
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def qkv(b, lq, lk, h, d, seed=0, device="cpu", dtype=torch.float32, outlier=4.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, lq, h, d, generator=g)
    k = torch.randn(b, lk, h, d, generator=g) + outlier * torch.randn(b, 1, h, d, generator=g)  # a per-channel offset
    v = torch.randn(b, lk, h, d, generator=g)
    return (t.to(device, dtype) for t in (q, k, v))


def test_reference_tracks_exact_attention_and_smoothing_is_what_keeps_it_there():
    q, k, v = qkv(2, 70, 200, 3, 64, outlier=20.0)
    want = exact(q, k, v)
    got = sage.reference(q, k, v)
    assert got.shape == want.shape and rel(got, want) < 0.03
    # without the smoothing the keys' offset takes the INT8 range: the same blocks are much worse
    d = q.shape[-1]
    qi, qs = sage.quantize_blocks(q, sage.BLOCK_M, d**-0.5 * sage.LOG2E)
    ki, ks = sage.quantize_blocks(k, sage.BLOCK_N)
    s = (qi.float() @ ki.float().transpose(-1, -2)) * qs.repeat_interleave(sage.BLOCK_M, 2)[:, :, :70, None] \
        * ks.repeat_interleave(sage.BLOCK_N, 2)[:, :, None, :200]
    unsmoothed = (torch.softmax(s * 0.6931471805599453, dim=-1) @ v.transpose(1, 2)).transpose(1, 2)
    assert rel(unsmoothed, want) > 3 * rel(got, want)


def test_quantize_blocks_bounds():
    x = torch.randn(1, 100, 2, 16) * 3
    q, s = sage.quantize_blocks(x, 32)
    assert q.dtype == torch.int8 and q.shape == (1, 2, 100, 16) and s.shape == (1, 2, 4)
    back = q.float() * s.repeat_interleave(32, dim=2)[:, :, :100, None]
    assert ((back - x.permute(0, 2, 1, 3)).abs() <= s.repeat_interleave(32, dim=2)[:, :, :100, None] / 2 + 1e-6).all()


def test_on_the_tiny_models_own_activations():
    """The self-attention inputs of a real forward (a chunk over a filled cache): INT8 scores track exact
    attention on them, and the generator with int8-attention tracks the exact one."""
    seen = []
    real = sage.attend

    def spy(q, k, v):
        seen.append((q.clone(), k.clone(), v.clone()))
        return real(q, k, v)

    lat = {}
    for quant in ("none", "int8"):
        gen = build_generator("tiny", device="cpu", dtype=torch.float32, seed=0,
                              cfg=GeneratorConfig(sink_frames=3, window_frames=6, attention_quant=quant))
        state = gen.open_stream("s", "a green triangle", seed=5)
        it = gen.stream(state)
        sage.attend = spy
        try:
            lat[quant] = torch.stack([next(it).latents for _ in range(4)])
        finally:
            sage.attend = real
    assert len(seen) == 2 * 4 * 5  # 2 layers, 4 chunks of 4 steps and a commit
    for q, k, v in seen[-10:]:  # over the fullest cache
        assert rel(sage.reference(q, k, v), exact(q, k, v)) < 0.03
    assert torch.isfinite(lat["int8"]).all() and rel(lat["int8"], lat["none"]) < 0.05


SHAPES = [(1, 48, 112, 2, 32), (2, 37, 150, 3, 64)] if DEVICE != "cuda" else [(1, 1000, 3000, 4, 128), (2, 300, 700, 2, 64)]


@needs_kernel
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_matches_reference(shape):
    b, lq, lk, h, d = shape
    dtype = torch.float32 if DEVICE != "cuda" else torch.bfloat16
    q, k, v = qkv(b, lq, lk, h, d, device=DEVICE, dtype=dtype)
    v = v.transpose(1, 2).contiguous().transpose(1, 2)  # strided values, as a cache view may be
    bm, bn = sage._tiles(d, lq)
    got = sage.attend(q, k, v)
    want = sage.reference(q, k, v, bm, bn)
    assert got.dtype == q.dtype and got.shape == q.shape
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    assert rel(got, exact(q, k, v)) < 0.03
    if DEVICE == "cpu":  # tiles larger than the quantization blocks (the GPU's tuned tiles may be): the same result
        qi, qs, ki, ks = sage.quantize_qk(q, k)
        out = torch.empty_like(q)
        sage._attn_kernel[(sage._blocks(lq, 32), b * h)](
            qi, qs, ki, ks, v, out, lq, lk, h, qs.shape[-1], ks.shape[-1], v.stride(0), v.stride(1), v.stride(2),
            out.stride(0), out.stride(1), out.stride(2), D=d, QM=bm, QN=bn, BM=32, BN=64, num_warps=4, num_stages=1)
        torch.testing.assert_close(out, got, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(HAS_CUDA or INTERPRET or not HAS_TRITON, reason="CUDA runs the kernel directly; needs triton")
def test_interpreted_on_cpu():
    """Triton picks its interpreter per process at import, so the kernel tests run in a child with TRITON_INTERPRET=1."""
    proc = run_interpreted(__file__, "matches_reference")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "2 passed" in proc.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs CUDA and triton")
def test_cuda_kernel_tracks_bf16_attention_at_wans_shape():
    q, k, v = qkv(1, 4680, 18720, 12, 128, device="cuda", dtype=torch.bfloat16, outlier=2.0)
    assert sage.usable(q)
    assert rel(sage.attend(q, k, v), exact(q, k, v)) < 0.03
