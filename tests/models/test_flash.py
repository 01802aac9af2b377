"""The optional FlashAttention-4 path (models/flash.py): when it is taken, and that it equals SDPA."""

import pytest
import torch
import torch.nn.functional as F

from models import flash


def test_not_used_on_cpu_or_when_disabled_and_says_why(monkeypatch):
    q = torch.zeros(1, 8, 2, 64, dtype=torch.bfloat16)
    assert not flash.usable(q)
    assert flash.status(torch.device("cpu")) == "not a CUDA device"
    flash._load.cache_clear()
    monkeypatch.setenv("STREAMSVC_FLASH", "0")
    try:
        assert flash._kernel() is None and "STREAMSVC_FLASH=0" in flash._load()[1]
    finally:
        flash._load.cache_clear()


def test_a_missing_package_names_the_install(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_flash(name, *args, **kwargs):
        if name.startswith("flash_attn"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    flash._load.cache_clear()
    monkeypatch.setattr(builtins, "__import__", no_flash)
    try:
        kernel, why = flash._load()
        assert kernel is None and "does not import" in why and "pip install" in why
    finally:
        flash._load.cache_clear()


def test_splits_keys_where_that_fills_the_waves(monkeypatch):
    monkeypatch.setattr(flash, "_num_sms", lambda device: 132)  # the H200's
    monkeypatch.setattr(flash.triton_ops, "AVAILABLE", True)
    flash._plan.cache_clear()
    qkv = lambda b, lq, lk, d=128: (torch.empty(b, lq, 12, d), torch.empty(b, lk, 12, d), torch.empty(b, lk, 12, d))  # noqa: E731
    parts = flash.kv_parts(*qkv(1, 4680, 18720))  # 444 tiles: 4 waves whole, the last a third full
    assert len(parts) == 2 and sum(parts) == 18720 and parts[0] % flash.TILE_N == 0
    assert parts[0] > parts[1]  # the long part's tiles go first, the short ones fill the tail
    tiles, blocks = 444, 147
    split = flash._finish(tiles, (parts[0] // 128, blocks - parts[0] // 128), 132)
    assert split < flash._finish(tiles, (74, 73), 132) < flash._finish(tiles, (blocks,), 132)  # beats equal halves and whole
    assert flash.kv_parts(*qkv(1, 33 * 128, 33 * 128 * 4)) == (33 * 128 * 4,)  # 396 tiles: exactly 3 full waves
    assert flash.kv_parts(*qkv(2, 4680, 18720)) == (18720,)  # batches: not split
    assert flash.kv_parts(*qkv(1, 4680, 1560)) == (1560,)  # too few keys
    assert flash.kv_parts(*qkv(1, 4680, 18720, d=64)) == (18720,)  # another tile shape: not modelled
    q, k, v = qkv(1, 4680, 18720)
    assert flash.kv_parts(q, k[:, ::2], v[:, ::2]) == (9360,)  # the parts must be rows of one buffer


@pytest.mark.parametrize("tiles,blocks,sms,want", [(4, 3, 2, 2 * (3 + 2)), (5, 3, 2, 3 * (3 + 2)), (132, 10, 132, 12)])
def test_finish_time_of_a_grid(tiles, blocks, sms, want):
    assert flash._finish(tiles, (blocks,), sms) == want


CUDA_Q = torch.empty(1, 1, 1, 128, dtype=torch.bfloat16, device="cuda") if torch.cuda.is_available() else None


@pytest.mark.gpu
@pytest.mark.skipif(CUDA_Q is None or not flash.usable(CUDA_Q), reason="needs flash-attn-4 on an SM90/SM100 GPU")
@pytest.mark.parametrize("lq,lk", [(4680, 18720), (4680, 4680), (4680, 23400), (300, 77)])  # Wan's chunk vs 12, 3, 15 frames (split); ragged
def test_matches_sdpa(lq, lk):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, n, 12, 128, generator=g, device="cuda").to(torch.bfloat16) for n in (lq, lk, lk))
    ref = F.scaled_dot_product_attention(q.transpose(1, 2).float(), k.transpose(1, 2).float(), v.transpose(1, 2).float())
    out = flash.attend(q, k, v)
    assert out.shape == q.shape and out.dtype == q.dtype
    err = (out.float() - ref.transpose(1, 2)).abs().max().item()
    assert err < 2e-2, err


@pytest.mark.gpu
@pytest.mark.skipif(CUDA_Q is None or not flash.usable(CUDA_Q), reason="needs flash-attn-4 on an SM90/SM100 GPU")
def test_in_place_reads_match_copies():
    """bf16 at head dim 128, so FA4 runs (split keys from 2,048 keys on), through CUDA graphs and a
    ring that rolls: forwards that read the cache in place (values as stored, keys rotated once per
    chunk) equal forwards over copies, rotated every time."""
    from models import CacheAccess, GeneratorConfig
    from models.config import ModelConfig
    from models.dit import CausalWanModel
    from models.generator import ChunkGenerator

    mc = ModelConfig.from_name("tiny", dim=256, num_heads=2, latent_height=64, latent_width=64)  # 256 tokens a frame
    model = CausalWanModel(mc).init_weights(3).to("cuda", torch.bfloat16).eval()
    xs = torch.randn(8, 1, mc.in_channels, 3, 64, 64, generator=torch.Generator().manual_seed(0)).cuda()
    outs, stats = [], []
    for stage in (True, False):
        gen = ChunkGenerator(model, GeneratorConfig(sink_frames=3, window_frames=6, stage_kv=stage))
        s = gen.open_stream("a", "a red kite", seed=1)
        assert (gen.workspace is not None) == stage
        got = []
        for c in range(8):  # 24 frames through 3 sinks + 6 window slots: the later commits overwrite
            for step in (900.0, 500.0):  # two denoising steps: the second reuses the rotated keys
                got.append(gen.forward(xs[c], torch.full((1, 3), step, device="cuda"), s.text, [CacheAccess(s.cache, s.cache.num_frames)]))
            slots = s.cache.plan_commit(3)
            got.append(gen.forward(xs[c], torch.zeros(1, 3, device="cuda"), s.text, [CacheAccess(s.cache, s.cache.num_frames, write_slots=slots)]))
            s.cache.advance(slots)
        outs.append(torch.stack(got).float())
        stats.append(gen.runner.stats)
    err = ((outs[0] - outs[1]).norm() / outs[1].norm()).item()
    assert err < 1e-2, err
    assert stats[0]["replays"] > 5, stats
