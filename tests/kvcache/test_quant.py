"""int4 / int2 KV storage: the torch reference, QuantStorage, and the Triton kernels against the reference."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvcache import CachePool, CacheSpec, StreamCache, make_storage
from kvcache.quant import (
    DENSE,
    QUANT,
    QuantLayout,
    QuantStorage,
    ReadScratch,
    ceil_bf16,
    dequantize_keys,
    dequantize_values,
    pack,
    quant_frame_bytes,
    quantize_keys,
    quantize_values,
    scratch_bytes,
    unpack,
)

HAS_CUDA = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # set by test_triton_interpreted_on_cpu's subprocess
KERNEL_DEVICE = None if not HAS_TRITON else "cuda" if HAS_CUDA else "cpu" if INTERPRET else None

WAN = dict(num_layers=30, num_heads=12, head_dim=128, tokens_per_frame=1560, sink_frames=3, window_frames=9)


def small_spec(quant: str = "int2", **kw) -> CacheSpec:
    base = dict(num_layers=2, num_heads=2, head_dim=16, tokens_per_frame=24, sink_frames=2, window_frames=4)
    base.update(kw)
    return CacheSpec(dtype=base.pop("dtype", "float32"), quant=quant, **{"group_size": 12, **base})


def kv_frames(n: int, spec: CacheSpec, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, T, H, D] keys with outlier channels (as real keys have) and values."""
    g = torch.Generator().manual_seed(seed)
    shape = (n, spec.tokens_per_frame, spec.num_heads, spec.head_dim)
    k = torch.randn(shape, generator=g) * (1 + 8 * (torch.rand(spec.head_dim, generator=g) > 0.9))
    v = torch.randn(shape, generator=g) * 2 + 0.5
    return k.to(spec.torch_dtype), v.to(spec.torch_dtype)


def deq_reference(spec: CacheSpec, k: torch.Tensor, v: torch.Tensor):
    """What a quantized frame reads back as, through the reference."""
    bits, d, dt = int(spec.quant[3:]), spec.head_dim, spec.torch_dtype
    kq = dequantize_keys(*quantize_keys(k, spec.group_size, bits), d, bits, dt)
    vq = dequantize_values(*quantize_values(v, bits), d, bits, dt)
    return kq, vq


# -- the reference -----------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("head_dim", [8, 16, 128])
def test_pack_unpack_is_exact(bits, head_dim):
    codes = torch.randint(0, 1 << bits, (3, 5, 2 * head_dim), dtype=torch.uint8)
    packed = pack(codes, head_dim, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 5, 2 * head_dim * bits // 8)
    assert torch.equal(unpack(packed, head_dim, bits), codes)
    # planar within a head: byte j of head 1 holds channels j + i * D/P of that head at bits [i*b, (i+1)*b)
    p, j = 8 // bits, 1
    byte = int(packed[0, 0, head_dim // p + j])
    for i in range(p):
        assert (byte >> (bits * i)) & ((1 << bits) - 1) == int(codes[0, 0, head_dim + i * (head_dim // p) + j])


def test_ceil_bf16_is_the_smallest_bf16_not_below():
    x = torch.rand(10000) * torch.logspace(-8, 8, 10000)
    r = ceil_bf16(x)
    assert r.dtype == torch.bfloat16 and bool((r.float() >= x).all())
    below = (r.view(torch.int16) - 1).view(torch.bfloat16).float()
    assert bool((below < x).all())
    exact = torch.tensor([0.0, 1.0, 0.375])
    assert torch.equal(ceil_bf16(exact).float(), exact)


@pytest.mark.parametrize("bits", [2, 4])
def test_dequantization_error_within_half_a_step(bits):
    spec = small_spec(f"int{bits}", tokens_per_frame=120, group_size=40, head_dim=32)
    k, v = kv_frames(3, spec, seed=1)
    k[0, :40, 0, :] = 3.25  # a constant group: scale 0, read back exactly
    d, g = spec.head_dim, spec.group_size
    kc, ks, kz = quantize_keys(k, g, bits)
    vc, vs, vz = quantize_values(v, bits)
    assert ks.dtype == vs.dtype == torch.bfloat16 and kz.dtype == vz.dtype == torch.float32
    kq = dequantize_keys(kc, ks, kz, d, bits, torch.float32)
    vq = dequantize_values(vc, vs, vz, d, bits, torch.float32)
    # keys: per channel, groups of g tokens
    f, t, h = k.shape[:3]
    kerr = (kq - k).abs().view(f, t // g, g, h * d)
    assert bool((kerr <= ks.float()[:, :, None] / 2 * (1 + 1e-6) + 1e-6).all())
    assert torch.equal(kq[0, :40, 0], k[0, :40, 0])
    # values: per token per head
    verr = (vq - v).abs()
    assert bool((verr <= vs.float()[..., None] / 2 * (1 + 1e-6) + 1e-6).all())
    # the grid covers each group: scale is range / levels rounded up (to bf16), never less
    levels = (1 << bits) - 1
    krange = k.view(f, t // g, g, h * d).amax(2) - k.view(f, t // g, g, h * d).amin(2)
    assert bool((ks.float() * levels >= krange).all())
    assert bool((ks.float() * levels <= krange * (1 + 2**-7) + 1e-30).all())
    # and the codes are used: the error is not trivially small
    assert float(kerr.mean()) > 0.02 * float(k.abs().mean())


def test_quantization_of_bf16_input():
    spec = small_spec("int4", dtype="bfloat16")
    k, v = kv_frames(2, spec, seed=2)
    kq, vq = deq_reference(spec, k, v)
    assert kq.dtype == torch.bfloat16
    assert float((kq.float() - k.float()).norm() / k.float().norm()) < 0.15
    assert float((vq.float() - v.float()).norm() / v.float().norm()) < 0.15


# -- the storage -------------------------------------------------------------------------------


def commit(cache: StreamCache, k: torch.Tensor, v: torch.Tensor) -> list[int]:
    slots = cache.plan_commit(k.shape[0])
    for layer in range(cache.spec.num_layers):
        cache.write(layer, slots, k + layer, v - layer)
    cache.advance(slots)
    return slots


@pytest.mark.parametrize("quant", ["int2", "int4"])
def test_ring_through_stream_cache(quant):
    """Sinks and the newest `residual_frames` window frames read back exactly; older ones as the reference."""
    spec = small_spec(quant, sink_frames=2, window_frames=5, residual_frames=2)
    cache = StreamCache(spec)
    assert isinstance(cache.storage, QuantStorage)
    nbytes = cache.nbytes
    frames = {}  # frame id -> (k, v)
    for chunk in range(6):  # 12 frames through 2 sinks + 5 window: wraps twice
        k, v = kv_frames(2, spec, seed=10 + chunk)
        first = cache.frames_seen
        commit(cache, k, v)
        for i in range(2):
            frames[first + i] = (k[i], v[i])
        window = cache.window_slots_in_order()
        newest = set(window[-spec.residual_frames :])
        for layer in range(spec.num_layers):
            kr, vr = cache.read(layer)
            assert kr.shape == (cache.num_frames, spec.tokens_per_frame, spec.num_heads, spec.head_dim)
            for slot in range(cache.num_frames):
                fk, fv = frames[cache.frame_ids[slot]]
                fk, fv = fk + layer, fv - layer
                if slot < spec.sink_frames or slot in newest:
                    assert cache.storage.maps[layer].loc[slot][0] == DENSE
                    assert torch.equal(kr[slot], fk) and torch.equal(vr[slot], fv)
                else:
                    assert cache.storage.maps[layer].loc[slot][0] == QUANT
                    qk, qv = deq_reference(spec, fk[None], fv[None])
                    assert torch.equal(kr[slot], qk[0]) and torch.equal(vr[slot], qv[0])
    assert cache.frame_ids[:2] == [0, 1] and sorted(cache.frame_ids[2:]) == list(range(7, 12))
    assert cache.nbytes == nbytes  # memory stays constant past the window


def test_relayout_and_quantized_sinks():
    """A recache rewrites the window in time order; quantize_sinks and residual 0 quantize everything."""
    spec = small_spec("int2", sink_frames=1, window_frames=3, residual_frames=0, quantize_sinks=True)
    assert QuantLayout.of(spec).dense_frames == 0
    cache = StreamCache(spec)
    for chunk in range(5):
        commit(cache, *kv_frames(1, spec, seed=chunk))
    slots = cache.relayout_window()
    assert slots == [1, 2, 3]
    k, v = kv_frames(len(slots), spec, seed=99)
    for layer in range(spec.num_layers):
        cache.write(layer, slots, k, v)
    kr, vr = cache.read(0)
    qk, qv = deq_reference(spec, k, v)
    assert torch.equal(kr[1:], qk) and torch.equal(vr[1:], qv)
    assert all(kind == QUANT for kind, _ in cache.storage.maps[0].loc)


def test_residual_larger_than_window_keeps_the_window_dense():
    spec = small_spec("int2", window_frames=2, residual_frames=3)
    lay = QuantLayout.of(spec)
    assert (lay.residual, lay.quant_frames) == (2, 0)
    cache = StreamCache(spec)
    ks = []
    for chunk in range(4):
        k, v = kv_frames(1, spec, seed=chunk)
        commit(cache, k, v)
        ks.append(k[0])
    kr, _ = cache.read(0)
    assert torch.equal(kr[2], ks[2]) and torch.equal(kr[3], ks[3])


def test_read_into_given_buffers_and_empty_slots_read_zero():
    spec = small_spec("int4")
    store = QuantStorage(spec, "cpu", scratch=ReadScratch())
    k, v = kv_frames(1, spec, seed=3)
    store.write(0, [0], k, v)
    out = (torch.full((3, 24, 2, 16), 7.0), torch.full((3, 24, 2, 16), 7.0))
    kr, vr = store.read(0, 3, out=out)
    assert kr is out[0] and torch.equal(kr[0], k[0]) and not bool(kr[1:].any()) and not bool(vr[1:].any())


def test_scratch_is_shared_per_device_and_not_per_stream():
    spec = small_spec("int2")
    scratch = ReadScratch()
    a, b = QuantStorage(spec, "cpu", scratch=scratch), QuantStorage(spec, "cpu", scratch=scratch)
    for store, seed in ((a, 1), (b, 2)):
        store.write(0, [0, 1], *kv_frames(2, spec, seed))
    ka, _ = a.read(0, 2)
    kb, _ = b.read(0, 2)
    assert ka.data_ptr() == kb.data_ptr()
    assert scratch.nbytes == scratch_bytes(spec)
    assert a.nbytes == QuantStorage.bytes_for(spec)  # the scratch is in neither stream's bytes


SPECS = [
    small_spec("int2"),
    small_spec("int4", dtype="bfloat16"),
    small_spec("int2", residual_frames=0, quantize_sinks=True),
    small_spec("int4", residual_frames=9),
    small_spec("int2", sink_frames=0, window_frames=6, residual_frames=1),
    CacheSpec(quant="int2", **WAN),
    CacheSpec(quant="int4", residual_frames=0, **WAN),
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.quant}-r{s.residual_frames}-qs{int(s.quantize_sinks)}-{s.dtype}")
def test_bytes_for_equals_the_tensors(spec):
    device = "meta" if spec.tokens_per_frame > 100 else "cpu"
    store = make_storage(spec, device)
    assert isinstance(store, QuantStorage)
    assert store.nbytes == QuantStorage.bytes_for(spec) == spec.stream_bytes()
    real = sum(t.untyped_storage().nbytes() for t in store.tensors()) if device == "cpu" else store.nbytes
    assert real == store.nbytes


def test_pool_admits_more_int2_streams_on_meta():
    dense = CacheSpec(**WAN)
    int2 = dataclasses.replace(dense, quant="int2")
    budget = 4 * dense.stream_bytes()
    pools = {q: CachePool(budget, device="meta") for q in ("none", "int2")}
    counts = {}
    for q, spec in (("none", dense), ("int2", int2)):
        n = 0
        while pools[q].allocate(f"s{n}", spec) is not None:
            n += 1
        counts[q] = n
    assert counts["none"] == 4 and counts["int2"] == budget // int2.stream_bytes() > 4
    assert pools["int2"].used_bytes == counts["int2"] * int2.stream_bytes()


def test_wan_bytes_per_frame():
    spec = CacheSpec(quant="int2", **WAN)
    bf16 = spec.dense_frame_bytes
    assert bf16 == 2 * 30 * 1560 * 1536 * 2 == 287_539_200
    int2 = quant_frame_bytes(spec, bits=2)
    int4 = quant_frame_bytes(spec, bits=4)
    assert spec.group_size == 120
    assert int2 == 30 * (2 * 1560 * 1536 // 4 + 13 * 1536 * 6 + 1560 * 12 * 6) == 42_906_240
    assert int4 == 30 * (2 * 1560 * 1536 // 2 + 13 * 1536 * 6 + 1560 * 12 * 6) == 78_848_640
    assert bf16 / int2 >= 6.0 and bf16 / int4 >= 3.5


def test_spec_validation():
    with pytest.raises(ValueError, match="must divide tokens_per_frame 1560"):
        CacheSpec(quant="int2", group_size=128, **WAN)
    with pytest.raises(ValueError, match="multiple of 4"):
        CacheSpec(1, 1, head_dim=6, tokens_per_frame=4, sink_frames=1, window_frames=1, quant="int2")
    assert CacheSpec(1, 1, head_dim=8, tokens_per_frame=64, sink_frames=1, window_frames=1).group_size == 64


# -- the Triton kernels ------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(KERNEL_DEVICE is None, reason="needs CUDA, or triton + TRITON_INTERPRET=1 (the next test)")
@pytest.mark.parametrize("bits", [2, 4])
def test_triton_matches_reference(bits):
    from kvcache import triton_quant

    dev = KERNEL_DEVICE
    big = dev == "cuda"
    dims = dict(num_heads=12, head_dim=128, tokens_per_frame=1560, group_size=120) if big else {}
    spec = small_spec(f"int{bits}", dtype="bfloat16" if big else "float32", residual_frames=1, **dims)
    k, v = kv_frames(5, spec, seed=bits)
    # quantize + pack: the same codes, scales and zeros as the reference
    kc, ks, kz = quantize_keys(k, spec.group_size, bits)
    vc, vs, vz = quantize_values(v, bits)
    for f in range(2):
        out = [torch.full_like(t[f], 0).to(dev) for t in (kc, ks, kz, vc, vs, vz)]
        triton_quant.quantize_frame(k[f].to(dev), v[f].to(dev), *out, group_size=spec.group_size, bits=bits)
        for got, want in zip(out, (kc, ks, kz, vc, vs, vz)):
            assert torch.equal(got.cpu(), want[f])
    # the fused read: dense sinks, dense residual, quantized frames and empty slots, against the torch backend
    tri = QuantStorage(spec, dev, backend="triton", scratch=ReadScratch())
    assert QuantStorage(spec, "meta" if dev == "cpu" else dev).backend == ("triton" if dev == "cuda" else "torch")
    ref = QuantStorage(spec, "cpu", backend="torch", scratch=ReadScratch())
    cache_t, cache_r = StreamCache(spec, storage=tri), StreamCache(spec, storage=ref)
    for chunk in range(3):
        k, v = kv_frames(1 if chunk < 2 else 3, spec, seed=20 + chunk)
        commit(cache_t, k.to(dev), v.to(dev))
        commit(cache_r, k, v)
        n = spec.capacity_frames  # includes empty slots until the cache is full
        for layer in range(spec.num_layers):
            kt, vt = tri.read(layer, n)
            kr, vr = ref.read(layer, n)
            assert tri.maps[layer].loc == ref.maps[layer].loc
            # one rounding apart at most (the kernel may fuse code * scale + zero)
            torch.testing.assert_close(kt.cpu().float(), kr.float(), rtol=1e-2 if big else 1e-6, atol=1e-5)
            torch.testing.assert_close(vt.cpu().float(), vr.float(), rtol=1e-2 if big else 1e-6, atol=1e-5)


@pytest.mark.skipif(HAS_CUDA or INTERPRET or not HAS_TRITON, reason="CUDA runs the kernels directly; needs triton")
def test_triton_interpreted_on_cpu():
    """Triton picks its interpreter per process at import, so the kernels run in a child with TRITON_INTERPRET=1."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", f"{__file__}::test_triton_matches_reference"]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "2 passed" in proc.stdout


# -- end to end --------------------------------------------------------------------------------


def test_a_stream_generates_with_int2_on_cpu():
    models = pytest.importorskip("models")
    cfg = models.GeneratorConfig(frames_per_chunk=1, timesteps=(1000.0, 500.0), sink_frames=1, window_frames=2)
    outs = {}
    for quant in ("none", "int2"):
        gen = models.build_generator("tiny", cfg=dataclasses.replace(cfg, kv_quant=quant), seed=0)
        spec = dataclasses.replace(gen.cache_spec(), residual_frames=1)
        state = gen.open_stream("s", "a red fox", seed=7, cache=StreamCache(spec))
        it = gen.stream(state, prompt_at={3: "a blue fox"})
        outs[quant] = torch.stack([next(it).latents for _ in range(5)])
        if quant == "int2":
            assert isinstance(state.cache.storage, QuantStorage)
            assert any(kind == QUANT for kind, _ in state.cache.storage.maps[0].loc)
    a, b = outs["none"], outs["int2"]
    assert bool(torch.isfinite(b).all())
    rel = float((a - b).norm() / a.norm())
    assert 0 < rel < 0.5, rel


def test_scratch_made_in_inference_mode_is_usable_outside():
    spec = small_spec("int2")
    scratch = ReadScratch()
    store = QuantStorage(spec, "cpu", scratch=scratch)
    store.write(0, [0], *kv_frames(1, spec, seed=5))
    with torch.inference_mode():
        store.read(0, 1)
    k, _ = store.read(0, 1)  # an in-place write into the scratch outside inference mode
    assert not k.is_inference()


def test_benchmark_bytes_part_at_the_wan_shape(capsys):
    """`benchmarks/kvcache.py --preset wan2.1-1.3b --device cpu --only bytes`: int2 >= 6x smaller per frame."""
    import importlib.util as iu

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "kvcache.py"
    spec = iu.spec_from_file_location("bench_kvcache", path)
    bench = iu.module_from_spec(spec)
    spec.loader.exec_module(bench)
    r = bench.main(["--preset", "wan2.1-1.3b", "--device", "cpu", "--only", "bytes"])
    bpf = r["bytes_per_frame"]
    assert bpf == {"bf16": 287_539_200, "int4": 78_848_640, "int2": 42_906_240}
    assert bpf["bf16"] / bpf["int2"] >= 6
    assert r["bytes_per_stream"]["int2"] == CacheSpec(quant="int2", **WAN).stream_bytes()
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("{") and '"bytes_per_frame"' in last
