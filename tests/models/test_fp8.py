"""FP8 linears (models/fp8.py): quantization error bounds, the GEMM against its float32 reference, the
module swap on the tiny preset, and on CUDA the _scaled_mm path against bf16 (skipped without CUDA)."""

import pytest
import torch
import torch.nn.functional as F

from models import GeneratorConfig, build_generator, fp8
from models.dit import CacheAccess

HAS_FP8_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_quantize_rows_error_is_within_e4m3_rounding():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=g) * torch.logspace(-3, 3, 64)[:, None]  # rows of very different sizes
    q, s = fp8.quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (64, 1) and s.dtype == torch.float32
    back = fp8.dequantize(q, s)
    # 3 mantissa bits: half a step is 2^-4 of the value; below 2^-6 (subnormals) steps are 2^-9 of the scale
    bound = x.abs() * 2**-4 + s * 2**-10 + 1e-12
    assert ((back - x).abs() <= bound).all()
    assert (q.float().abs().amax(dim=1) == fp8.FP8_MAX).all()  # each row uses the whole range
    zeros, zs = fp8.quantize_rows(torch.zeros(2, 16))
    assert (fp8.dequantize(zeros, zs) == 0).all()


def test_linear_tracks_float_and_scaled_mm_equals_reference():
    g = torch.Generator().manual_seed(1)
    lin = torch.nn.Linear(128, 96)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(96, 128, generator=g) / 11)
        lin.bias.copy_(torch.randn(96, generator=g))
    x = torch.randn(4, 10, 128, generator=g)
    q = fp8.FP8Linear.from_linear(lin)
    got = q(x)
    assert got.shape == (4, 10, 96) and got.dtype == x.dtype
    assert rel(got, lin(x)) < 0.05  # two e4m3 roundings per product
    assert rel(q.dequantized_weight(), lin.weight) < 0.04
    moved = fp8.FP8Linear.from_linear(lin).to(torch.bfloat16)  # a model-wide cast keeps the quantized storage
    assert moved.weight_fp8.dtype == torch.float8_e4m3fn and moved.weight_scale.dtype == torch.float32
    assert moved.bias.dtype == torch.bfloat16 and torch.equal(moved.weight_scale, q.weight_scale)
    # the _scaled_mm call (scales, transposes, bias) computes the reference's math (CPU runs it too)
    xq, xs = fp8.quantize_rows(x.reshape(-1, 128))
    want = fp8.reference(xq, xs, q.weight_fp8, q.weight_scale, q.bias, torch.float32)
    try:
        mm = fp8.scaled_mm(xq, xs, q.weight_fp8, q.weight_scale, q.bias, torch.float32)
    except (RuntimeError, NotImplementedError) as e:  # a torch without the CPU kernel
        pytest.skip(f"torch._scaled_mm does not run on CPU here: {e}")
    torch.testing.assert_close(mm, want, rtol=1e-5, atol=1e-5)


def test_swap_covers_the_big_linears_only_and_keeps_the_forward_close():
    gen = build_generator("tiny", device="cpu", dtype=torch.float32, seed=0)
    model = gen.model
    mc = gen.model_cfg
    x = torch.randn(1, mc.in_channels, 3, mc.latent_height, mc.latent_width, generator=torch.Generator().manual_seed(2))
    t = torch.full((1, 3), 937.5)
    text = gen.encode_prompt("a red ball")
    want = model(x, t, text, [CacheAccess(None, 0)])
    n = fp8.quantize_linears(model)
    assert n == 8 * mc.num_layers
    blk = model.blocks[0]
    for m in (blk.self_attn.q, blk.self_attn.k, blk.self_attn.v, blk.self_attn.o, blk.cross_attn.q, blk.cross_attn.o,
              blk.ffn[0], blk.ffn[2]):
        assert isinstance(m, fp8.FP8Linear)
    for m in (blk.cross_attn.k, blk.cross_attn.v, model.head.head, model.text_embedding[0], model.time_projection[1]):
        assert type(m) is torch.nn.Linear
    assert fp8.quantize_linears(model) == 0  # idempotent
    got = model(x, t, text, [CacheAccess(None, 0)])  # text K/V from before: cross k/v stay in the model dtype
    assert torch.isfinite(got).all() and rel(got, want) < 0.05


def test_generator_with_fp8_linears_tracks_the_reference():
    out = {}
    for on in (False, True):
        gen = build_generator("tiny", device="cpu", dtype=torch.float32, seed=0,
                              cfg=GeneratorConfig(sink_frames=3, window_frames=6, fp8_linears=on))
        state = gen.open_stream("s", "a blue square", seed=3)
        it = gen.stream(state)
        out[on] = torch.stack([next(it).latents for _ in range(4)])
    assert torch.isfinite(out[True]).all()
    assert 0 < rel(out[True], out[False]) < 0.1


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_FP8_GPU, reason="needs a CUDA GPU with FP8 (sm89+)")
def test_cuda_scaled_mm_tracks_bf16_and_reference():
    g = torch.Generator(device="cuda").manual_seed(0)
    for m, k, n in ((4680, 1536, 1536), (4680, 1536, 8960), (4680, 8960, 1536)):
        lin = torch.nn.Linear(k, n, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(n, k, device="cuda", generator=g) / k**0.5)
        x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
        q = fp8.FP8Linear.from_linear(lin)
        assert fp8.use_scaled_mm(x, k, n)
        got = q(x)
        xq, xs = fp8.quantize_rows(x)
        want = fp8.reference(xq, xs, q.weight_fp8, q.weight_scale, q.bias, torch.float32)
        assert rel(got, want) < 5e-3  # bf16 output rounding and accumulation order
        assert rel(got, lin(x)) < 0.05


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_FP8_GPU, reason="needs a CUDA GPU with FP8 (sm89+)")
def test_cuda_quantized_generator_graphs_equal_eager_and_track_bf16():
    """FP8 linears and INT8 attention replayed as CUDA graphs give what they give eagerly, close to bf16."""
    lat = {}
    for name, cfg in (("bf16", {}), ("q-graphs", {"fp8_linears": True, "attention_quant": "int8"}),
                      ("q-eager", {"fp8_linears": True, "attention_quant": "int8", "cuda_graphs": False})):
        gen = build_generator("tiny", device="cuda", dtype=torch.bfloat16, seed=0,
                              cfg=GeneratorConfig(sink_frames=3, window_frames=6, **cfg))
        gen.capture_graphs()
        state = gen.open_stream("s", "a red kite", seed=1)
        it = gen.stream(state)
        lat[name] = torch.stack([next(it).latents for _ in range(5)]).float()
        if name == "q-graphs":
            assert gen.runner.stats["replays"] > 0
    torch.testing.assert_close(lat["q-graphs"], lat["q-eager"], rtol=1e-2, atol=1e-2)
    assert rel(lat["q-graphs"], lat["bf16"]) < 0.15
