import pytest
import torch
from torch import nn

pytest.importorskip("diffusers")
from diffusers import AutoencoderKLWan  # noqa: E402

from models.weights import CheckpointError  # noqa: E402
from models.wan_vae import (  # noqa: E402
    WAN_VAE_FILE,
    WanVAEDecoder,
    WanVAEEncoder,
    diffusers_key_to_wan,
    wan21_vae_config,
    wan_key_to_diffusers,
    wan_vae_state_bytes,
)

H, W = 4, 6  # latent size of the tiny tests: video 32x48


def wan_layout_shapes(base: int = 96, z: int = 16, dim_mult=(1, 2, 4, 4), nrb: int = 2, tdown=(False, True, True)):
    """Wan's own VAE key names and shapes, enumerated from the structure of wan/modules/vae.py."""
    keys: dict[str, tuple[int, ...]] = {}

    def conv(prefix, cin, cout, k):
        keys[f"{prefix}.weight"] = (cout, cin, *k)
        keys[f"{prefix}.bias"] = (cout,)

    def resblock(prefix, cin, cout):
        keys[f"{prefix}.residual.0.gamma"] = (cin, 1, 1, 1)
        conv(f"{prefix}.residual.2", cin, cout, (3, 3, 3))
        keys[f"{prefix}.residual.3.gamma"] = (cout, 1, 1, 1)
        conv(f"{prefix}.residual.6", cout, cout, (3, 3, 3))
        if cin != cout:
            conv(f"{prefix}.shortcut", cin, cout, (1, 1, 1))

    def middle(prefix, d):
        resblock(f"{prefix}.middle.0", d, d)
        keys[f"{prefix}.middle.1.norm.gamma"] = (d, 1, 1)
        conv(f"{prefix}.middle.1.to_qkv", d, 3 * d, (1, 1))
        conv(f"{prefix}.middle.1.proj", d, d, (1, 1))
        resblock(f"{prefix}.middle.2", d, d)

    last = len(dim_mult) - 1
    dims = [base * u for u in (1, *dim_mult)]  # encoder
    conv("encoder.conv1", 3, dims[0], (3, 3, 3))
    n = 0
    for i, (cin, cout) in enumerate(zip(dims[:-1], dims[1:])):
        for _ in range(nrb):
            resblock(f"encoder.downsamples.{n}", cin, cout)
            cin, n = cout, n + 1
        if i != last:
            conv(f"encoder.downsamples.{n}.resample.1", cout, cout, (3, 3))
            if tdown[i]:
                conv(f"encoder.downsamples.{n}.time_conv", cout, cout, (3, 1, 1))
            n += 1
    middle("encoder", dims[-1])
    keys["encoder.head.0.gamma"] = (dims[-1], 1, 1, 1)
    conv("encoder.head.2", dims[-1], 2 * z, (3, 3, 3))
    conv("conv1", 2 * z, 2 * z, (1, 1, 1))
    conv("conv2", z, z, (1, 1, 1))
    dims = [base * u for u in (dim_mult[-1], *dim_mult[::-1])]  # decoder
    conv("decoder.conv1", z, dims[0], (3, 3, 3))
    middle("decoder", dims[0])
    n, tup = 0, tdown[::-1]
    for i, (cin, cout) in enumerate(zip(dims[:-1], dims[1:])):
        if i > 0:
            cin //= 2  # Wan2.1: the previous stage's upsample halved the channels
        for _ in range(nrb + 1):
            resblock(f"decoder.upsamples.{n}", cin, cout)
            cin, n = cout, n + 1
        if i != last:
            conv(f"decoder.upsamples.{n}.resample.1", cout, cout // 2, (3, 3))
            if tup[i]:
                conv(f"decoder.upsamples.{n}.time_conv", cout, 2 * cout, (3, 1, 1))
            n += 1
    keys["decoder.head.0.gamma"] = (dims[-1], 1, 1, 1)
    conv("decoder.head.2", dims[-1], 3, (3, 3, 3))
    return keys


def test_full_size_wan_keys_map_onto_diffusers():
    wan = wan_layout_shapes()
    assert len(wan) == 194
    with torch.device("meta"):
        model_sd = AutoencoderKLWan(**wan21_vae_config()).state_dict()
    renamed = {wan_key_to_diffusers(k): shape for k, shape in wan.items()}
    assert len(renamed) == 194
    assert set(renamed) == set(model_sd)
    for k, shape in renamed.items():
        assert tuple(model_sd[k].shape) == shape, k
    for k in wan:
        assert diffusers_key_to_wan(wan_key_to_diffusers(k)) == k


def test_full_size_state_bytes():
    nbytes = wan_vae_state_bytes(480, 832, torch.bfloat16)
    assert 1.85e9 < nbytes < 1.95e9, nbytes
    assert wan_vae_state_bytes(480, 832, torch.float32) == 2 * nbytes


@pytest.fixture(scope="module")
def tiny_vae():
    torch.manual_seed(0)
    vae = AutoencoderKLWan(**wan21_vae_config(base_dim=8)).eval()
    with torch.no_grad():  # spread the RMS-norm gains so every layer matters
        for name, p in vae.named_parameters():
            if name.endswith("gamma"):
                p.uniform_(0.5, 1.5)
    return vae


def wan_state_dict(vae) -> dict[str, torch.Tensor]:
    return {diffusers_key_to_wan(k): v.clone() for k, v in vae.state_dict().items()}


@pytest.fixture(scope="module")
def layouts(tiny_vae, tmp_path_factory):
    root = tmp_path_factory.mktemp("vae")
    (root / "wan").mkdir()
    torch.save(wan_state_dict(tiny_vae), root / "wan" / WAN_VAE_FILE)
    tiny_vae.save_pretrained(root / "diffusers" / "vae")
    return root


def test_tiny_wan_file_has_wan_layout(tiny_vae):
    wan = wan_state_dict(tiny_vae)
    expected = wan_layout_shapes(base=8)
    assert {k: tuple(v.shape) for k, v in wan.items()} == expected


@pytest.mark.parametrize("where", ["wan/" + WAN_VAE_FILE, "wan", "diffusers", "diffusers/vae"])
def test_both_layouts_load_the_same_decoder(tiny_vae, layouts, where):
    dec = WanVAEDecoder.from_path(layouts / where, device="cpu", dtype=torch.float32)
    got = dec.vae.state_dict()
    for k, v in tiny_vae.state_dict().items():
        assert torch.equal(got[k], v), k
    assert dec.vae.config.base_dim == 8 and dec.dtype == torch.float32


def _write(tmp_path, sd):
    torch.save(sd, tmp_path / WAN_VAE_FILE)
    return tmp_path / WAN_VAE_FILE


def test_strict_missing_extra_misshaped(tiny_vae, tmp_path):
    sd = wan_state_dict(tiny_vae)
    missing = dict(sd)
    del missing["decoder.upsamples.7.time_conv.weight"]
    with pytest.raises(CheckpointError, match=r"missing.*decoder\.up_blocks\.1\.upsamplers\.0\.time_conv\.weight"):
        WanVAEDecoder.from_path(_write(tmp_path, missing), device="cpu", dtype=torch.float32)
    extra = dict(sd, **{"decoder.extra.weight": torch.zeros(2)})
    with pytest.raises(CheckpointError, match=r"unexpected.*decoder\.extra\.weight"):
        WanVAEDecoder.from_path(_write(tmp_path, extra), device="cpu", dtype=torch.float32)
    bad = dict(sd, **{"decoder.head.0.gamma": torch.ones(8, 1, 1)})
    with pytest.raises(CheckpointError, match=r"mis-shaped.*decoder\.norm_out\.gamma"):
        WanVAEDecoder.from_path(_write(tmp_path, bad), device="cpu", dtype=torch.float32)


def test_strict_diffusers_folder(tiny_vae, tmp_path):
    from safetensors.torch import save_file

    tiny_vae.save_pretrained(tmp_path / "vae")
    sd = {k: v.contiguous() for k, v in tiny_vae.state_dict().items() if k != "decoder.conv_out.bias"}
    save_file(sd, str(tmp_path / "vae" / "diffusion_pytorch_model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing.*decoder\.conv_out\.bias"):
        WanVAEDecoder.from_path(tmp_path, device="cpu", dtype=torch.float32)


def latents(seed: int, frames: int = 9) -> torch.Tensor:
    return torch.randn(16, frames, H, W, generator=torch.Generator().manual_seed(seed))  # [C, F, h, w]


def test_chunked_decode_equals_whole_clip(tiny_vae):
    dec = WanVAEDecoder(tiny_vae)
    z = latents(1)
    state = dec.init_state()
    chunks = [dec.decode_float(z[:, i : i + 3], state) for i in (0, 3, 6)]  # [3, N, H, W] each
    assert [c.shape[1] for c in chunks] == [9, 12, 12]
    raw = z * dec.std + dec.mean  # the DiT's latents are normalized
    with torch.no_grad():
        whole = tiny_vae.decode(raw[None]).sample[0]  # [3, 33, 32, 48]
    got = torch.cat(chunks, dim=1)
    assert got.shape == whole.shape == (3, 33, 8 * H, 8 * W)
    assert whole.std() > 0.05  # not all clamped
    torch.testing.assert_close(got, whole, atol=1e-5, rtol=0)


def test_uint8_frames_and_counts(tiny_vae):
    dec = WanVAEDecoder(tiny_vae)
    z = latents(2, 6)
    state = dec.init_state()
    a = dec.decode(z[:, :3], state)
    b = dec.decode(z[:, 3:], state)
    assert a.shape == (9, 8 * H, 8 * W, 3) and b.shape == (12, 8 * H, 8 * W, 3)
    assert a.dtype == torch.uint8 and state.frames_out == 21
    ref = dec.decode_float(z, dec.init_state())  # [3, 21, H, W]
    expect = ((ref.permute(1, 2, 3, 0) + 1) * 127.5).round().clamp(0, 255).to(torch.uint8)
    assert torch.equal(torch.cat([a, b]), expect)


def test_interleaved_streams_stay_isolated(tiny_vae):
    dec = WanVAEDecoder(tiny_vae)
    za, zb = latents(3, 6), latents(4, 6)
    sa, sb = dec.init_state(), dec.init_state()
    mixed = {"a": [], "b": []}
    for i in (0, 3):
        mixed["a"].append(dec.decode(za[:, i : i + 3], sa))
        mixed["b"].append(dec.decode(zb[:, i : i + 3], sb))
    for name, z in (("a", za), ("b", zb)):
        s = dec.init_state()
        alone = [dec.decode(z[:, i : i + 3], s) for i in (0, 3)]
        for x, y in zip(mixed[name], alone):
            assert torch.equal(x, y), name


def test_state_bytes_match_a_real_stream(tiny_vae):
    dec = WanVAEDecoder(tiny_vae)
    state = dec.init_state()
    z = latents(5, 6)
    dec.decode(z[:, :3], state)
    first = state.nbytes()
    dec.decode(z[:, 3:], state)
    assert state.nbytes() == first  # steady after the first chunk: two frames per causal conv
    assert state.nbytes() == wan_vae_state_bytes(8 * H, 8 * W, torch.float32, config=tiny_vae.config)


# -- the streaming encoder (video-to-video input, issue 35) -----------------------------------------


def video(seed: int, n: int) -> torch.Tensor:
    return torch.randint(0, 256, (n, 8 * H, 8 * W, 3), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


def test_streaming_encode_equals_the_whole_video_encode(tiny_vae):
    enc = WanVAEEncoder(tiny_vae)
    frames = video(1, 33)  # a stream's first chunk (9 frames) and two more (12 each)
    state = enc.init_state()
    chunks = [enc.encode(frames[a:b], state) for a, b in ((0, 9), (9, 21), (21, 33))]
    assert [tuple(c.shape) for c in chunks] == [(16, 3, H, W)] * 3
    x = frames.permute(3, 0, 1, 2).float().div(127.5).sub(1)[None]  # [1, 3, 33, H, W] in [-1, 1]
    with torch.no_grad():
        mu = tiny_vae.encode(x).latent_dist.mean[0]  # diffusers' own whole-clip encode: [16, 9, h, w]
    whole = (mu - enc.mean) / enc.std
    assert whole.shape == (16, 9, H, W) and whole.std() > 0.05
    torch.testing.assert_close(torch.cat(chunks, dim=1), whole, atol=1e-4, rtol=1e-4)
    assert state.frames_in == 33 and state.nbytes() == enc.state_bytes(8 * H, 8 * W)


def test_a_restarted_run_starts_from_the_chunks_fourth_frame(tiny_vae):
    enc = WanVAEEncoder(tiny_vae)
    frames = video(2, 12)
    got = enc.encode(frames, enc.init_state())  # a fresh state mid-stream: 12 frames
    assert torch.equal(got, enc.encode(frames[3:], enc.init_state()))
    with pytest.raises(ValueError, match="takes 1 \\+ 4k frames"):
        state = enc.init_state()
        enc.encode(frames[:9], state)
        enc.encode(frames[:9], state)


def test_encoder_streams_stay_isolated(tiny_vae):
    enc = WanVAEEncoder(tiny_vae)
    a, b = video(3, 21), video(4, 21)
    sa, sb = enc.init_state(), enc.init_state()
    za = [enc.encode(a[:9], sa)]
    zb = [enc.encode(b[:9], sb)]
    za.append(enc.encode(a[9:], sa))
    zb.append(enc.encode(b[9:], sb))
    s = enc.init_state()
    alone = [enc.encode(a[:9], s), enc.encode(a[9:], s)]
    assert all(torch.equal(x, y) for x, y in zip(za, alone)) and not torch.equal(za[1], zb[1])


def test_full_size_encoder_state_bytes():
    enc = WanVAEEncoder(nn.Module.to(AutoencoderKLWan(**wan21_vae_config(base_dim=8)), torch.bfloat16))
    small = enc.state_bytes(8 * H, 8 * W)
    assert 0 < small < enc.state_bytes(16 * H, 16 * W)


def test_a_stream_starts_from_an_image_through_the_vae(tiny_vae):
    """`ChunkGenerator.start_from_image` with the Wan VAE as encoder and decoder (the Wan presets'), on a small DiT:
    the image is encoded as a causal run's lone first frame, decoded as the stream's first frame, and the decoder's
    causal state goes on from it (the frames equal the latents decoded in one run)."""
    from models import ChunkGenerator, GeneratorConfig
    from models.config import ModelConfig
    from models.dit import CausalWanModel

    mc = ModelConfig.from_name("tiny", latent_height=8, latent_width=8)  # the tiny preset's patch: 64x64 video
    enc, dec = WanVAEEncoder(tiny_vae), WanVAEDecoder(tiny_vae)
    gen = ChunkGenerator(CausalWanModel(mc).init_weights(0), GeneratorConfig(), decoder=dec, encoder=enc)
    image = torch.randint(0, 256, (64, 64, 3), generator=torch.Generator().manual_seed(6), dtype=torch.uint8)
    state = gen.open_stream("s", "a ball", seed=0)
    first = gen.start_from_image(state, image)
    assert torch.equal(first.latents, enc.encode(image[None], enc.init_state())) and first.latents.shape == (16, 1, 8, 8)
    assert first.frames.shape == (1, 64, 64, 3)
    chunk = next(gen.stream(state))
    assert (chunk.index, chunk.first_frame, chunk.frames.shape[0]) == (1, 1, 12)
    whole = dec.decode(torch.cat([first.latents, chunk.latents], dim=1), dec.init_state())
    assert (torch.cat([first.frames, chunk.frames]).int() - whole.int()).abs().max() <= 1
