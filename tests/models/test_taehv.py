import pytest
import torch

from models.taehv import TAEHV_FILE, MemBlock, TAEHVDecoder, TAEHVEncoder, TPool
from models.weights import CheckpointError

H, W = 3, 5  # latent size: video 24x40
N_F = (8, 6, 4, 4)


def taehv_layout_shapes(latent: int = 16, n_f=(256, 128, 64, 64), strides=(1, 2, 2)) -> dict[str, tuple[int, ...]]:
    """TAEHV's decoder keys and shapes, from the layout of its nn.Sequential (madebyollin/taehv)."""
    keys = {"decoder.1.weight": (n_f[0], latent, 3, 3), "decoder.1.bias": (n_f[0],)}
    i = 3
    for s in range(3):
        c = n_f[s]
        for _ in range(3):  # MemBlock: conv.0 (2c -> c), conv.2, conv.4; no skip since widths match
            for j, cin in ((0, 2 * c), (2, c), (4, c)):
                keys[f"decoder.{i}.conv.{j}.weight"] = (c, cin, 3, 3)
                keys[f"decoder.{i}.conv.{j}.bias"] = (c,)
            i += 1
        i += 1  # Upsample
        keys[f"decoder.{i}.conv.weight"] = (c * strides[s], c, 1, 1)  # TGrow
        keys[f"decoder.{i + 1}.weight"] = (n_f[s + 1], c, 3, 3)  # conv without bias
        i += 2
    keys[f"decoder.{i + 1}.weight"] = (3, n_f[3], 3, 3)  # after a ReLU
    keys[f"decoder.{i + 1}.bias"] = (3,)
    return keys


def random_file(path, seed: int = 0, **changes) -> dict:
    gen = torch.Generator().manual_seed(seed)
    sd = {k: torch.randn(shape, generator=gen) * 0.3 for k, shape in taehv_layout_shapes(n_f=N_F).items()}
    sd["encoder.0.weight"] = torch.zeros(4, 3, 3, 3)  # TAEHV's file also holds its encoder
    sd.update(changes)
    sd = {k: v for k, v in sd.items() if v is not None}
    torch.save(sd, path)
    return sd


def test_full_size_layout_matches_module():
    own = {k: tuple(v.shape) for k, v in TAEHVDecoder().state_dict().items()}
    assert own == taehv_layout_shapes()


def test_taehv_file_loads_strictly(tmp_path):
    sd = random_file(tmp_path / TAEHV_FILE)
    dec = TAEHVDecoder.from_path(tmp_path, device="cpu", dtype=torch.float32)
    got = dec.state_dict()
    assert set(got) == {k for k in sd if k.startswith("decoder.")}
    for k, v in got.items():
        assert torch.equal(v, sd[k]), k


@pytest.mark.parametrize(
    "change, pattern",
    [
        ({"decoder.9.conv.2.bias": None}, r"missing.*decoder\.9\.conv\.2\.bias"),
        ({"decoder.99.weight": torch.zeros(1)}, r"unexpected.*decoder\.99\.weight"),
        ({"decoder.14.weight": torch.zeros(4, 5, 3, 3)}, r"mis-shaped.*decoder\.14\.weight"),
    ],
)
def test_strict(tmp_path, change, pattern):
    random_file(tmp_path / TAEHV_FILE, **change)
    with pytest.raises(CheckpointError, match=pattern):
        TAEHVDecoder.from_path(tmp_path / TAEHV_FILE, device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    path = tmp_path_factory.mktemp("taehv") / TAEHV_FILE
    random_file(path, seed=1)
    return TAEHVDecoder.from_path(path, device="cpu", dtype=torch.float32)


def latents(seed: int, frames: int) -> torch.Tensor:
    return torch.randn(16, frames, H, W, generator=torch.Generator().manual_seed(seed))  # [C, F, h, w]


def test_chunked_equals_whole_clip(decoder):
    z = latents(2, 9)
    state = decoder.init_state()
    chunks = [decoder.decode_float(z[:, i : i + 3], state) for i in (0, 3, 6)]
    assert [c.shape[0] for c in chunks] == [9, 12, 12]
    whole = decoder.decode_float(z, decoder.init_state())  # [33, 3, 24, 40]
    assert whole.shape == (33, 3, 8 * H, 8 * W)
    assert 0.05 < whole.std()  # not all clamped
    torch.testing.assert_close(torch.cat(chunks), whole, atol=1e-5, rtol=0)
    assert state.nbytes() == decoder.state_bytes(8 * H, 8 * W)


def test_uint8_and_isolated_streams(decoder):
    za, zb = latents(3, 6), latents(4, 6)
    sa, sb = decoder.init_state(), decoder.init_state()
    mixed = {"a": [], "b": []}
    for i in (0, 3):
        mixed["a"].append(decoder.decode(za[:, i : i + 3], sa))
        mixed["b"].append(decoder.decode(zb[:, i : i + 3], sb))
    assert mixed["a"][0].shape == (9, 8 * H, 8 * W, 3) and mixed["a"][0].dtype == torch.uint8
    assert sa.frames_out == 21
    for name, z in (("a", za), ("b", zb)):
        s = decoder.init_state()
        for x, chunk in zip(mixed[name], (z[:, :3], z[:, 3:])):
            assert torch.equal(x, decoder.decode(chunk, s)), name


def test_full_size_state_bytes():
    nbytes = TAEHVDecoder().state_bytes(480, 832, torch.float16)
    assert nbytes == 2 * (3 * 256 * 60 * 104 + 3 * 128 * 120 * 208 + 3 * 64 * 240 * 416)


# -- the encoder (video-to-video input, issue 35) ------------------------------------------------------

def taehv_encoder_layout_shapes(latent: int = 16, width: int = 64, strides=(2, 2, 1)) -> dict[str, tuple[int, ...]]:
    """TAEHV's encoder keys and shapes, from the layout of its nn.Sequential (madebyollin/taehv): conv, ReLU,
    then per stage TPool (1x1 conv of stride*w -> w, no bias), a stride-2 conv (no bias), 3 MemBlocks; a conv."""
    keys = {"encoder.0.weight": (width, 3, 3, 3), "encoder.0.bias": (width,)}
    i = 2
    for s in strides:
        keys[f"encoder.{i}.conv.weight"] = (width, width * s, 1, 1)
        keys[f"encoder.{i + 1}.weight"] = (width, width, 3, 3)
        for b in range(3):
            for j, cin in ((0, 2 * width), (2, width), (4, width)):
                keys[f"encoder.{i + 2 + b}.conv.{j}.weight"] = (width, cin, 3, 3)
                keys[f"encoder.{i + 2 + b}.conv.{j}.bias"] = (width,)
        i += 5
    keys[f"encoder.{i}.weight"] = (latent, width, 3, 3)
    keys[f"encoder.{i}.bias"] = (latent,)
    return keys


def test_full_size_encoder_layout_matches_taehvs():
    assert {k: tuple(v.shape) for k, v in TAEHVEncoder().state_dict().items()} == taehv_encoder_layout_shapes()


def encoder_file(path, seed: int = 0, with_encoder: bool = True) -> dict:
    gen = torch.Generator().manual_seed(seed)
    sd = {k: torch.randn(shape, generator=gen) * 0.3 for k, shape in taehv_layout_shapes(n_f=N_F).items()}
    if with_encoder:
        for k, shape in taehv_encoder_layout_shapes(width=6).items():  # biases small, weights by fan-in
            fan_in = shape[1] * shape[2] * shape[3] if len(shape) == 4 else 100
            sd[k] = torch.randn(shape, generator=gen) * (1.5 / fan_in) ** 0.5
    torch.save(sd, path)
    return sd


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    path = tmp_path_factory.mktemp("taehv-enc") / TAEHV_FILE
    sd = encoder_file(path, seed=5)
    enc = TAEHVEncoder.from_path(path, device="cpu", dtype=torch.float32)
    assert {k: v for k, v in enc.state_dict().items()}.keys() == {k for k in sd if k.startswith("encoder.")}
    assert all(torch.equal(v, sd[k]) for k, v in enc.state_dict().items())
    return enc


def test_a_file_without_the_encoder_says_so(tmp_path):
    encoder_file(tmp_path / TAEHV_FILE, with_encoder=False)
    with pytest.raises(CheckpointError, match="no TAEHV encoder"):
        TAEHVEncoder.from_path(tmp_path, device="cpu", dtype=torch.float32)
    TAEHVDecoder.from_path(tmp_path, device="cpu", dtype=torch.float32)  # its decoder still loads


def frames(seed: int, n: int) -> torch.Tensor:
    return torch.randint(0, 256, (n, 8 * H, 8 * W, 3), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


def sequential_reference(enc: TAEHVEncoder, video: torch.Tensor) -> torch.Tensor:
    """TAEHV's encoder one time step at a time (a TPool waits for `stride` steps, a MemBlock sees its previous
    input), written apart from the module's chunked path: video [T, H, W, 3] uint8 (T a multiple of 4)."""
    memory: dict[int, object] = {}
    out = []
    for x in video.permute(0, 3, 1, 2).float().div(255)[:, None]:  # [1, 3, H, W] each
        items = [x]
        for i, block in enumerate(enc.encoder):
            nxt = []
            for x in items:
                if isinstance(block, MemBlock):
                    past = memory.get(i, torch.zeros_like(x))
                    memory[i] = x
                    nxt.append(block(x, past))
                elif isinstance(block, TPool):
                    memory.setdefault(i, []).append(x)
                    if len(memory[i]) == block.stride:
                        nxt.append(block.conv(torch.cat(memory[i], 1)))
                        memory[i] = []
                else:
                    nxt.append(block(x))
            items = nxt
        out += items
    return torch.cat(out).transpose(0, 1)  # [C, F, h, w]


def test_encoder_chunk_by_chunk_equals_the_step_by_step_reference(encoder):
    video = frames(1, 33)  # a stream's first chunk (9 frames) and two more (12 each)
    state = encoder.init_state()
    with torch.no_grad():
        chunks = [encoder.encode(video[a:b], state) for a, b in ((0, 9), (9, 21), (21, 33))]
        # frame 0 stands for latent frame 0's four frames (Wan's convention): repeated three times first
        ref = sequential_reference(encoder, torch.cat([video[:1].expand(3, -1, -1, -1), video]))
    assert [c.shape for c in chunks] == [(16, 3, H, W)] * 3
    assert float(ref.std()) > 0.01
    torch.testing.assert_close(torch.cat(chunks, dim=1), ref, atol=1e-5, rtol=1e-5)
    assert state.frames_in == 33 and state.nbytes() == encoder.state_bytes(8 * H, 8 * W)


def test_encoder_streams_stay_apart(encoder):
    a, b = frames(2, 21), frames(3, 21)
    sa, sb = encoder.init_state(), encoder.init_state()
    za = [encoder.encode(a[:9], sa)]
    zb = [encoder.encode(b[:9], sb)]
    za.append(encoder.encode(a[9:], sa))
    zb.append(encoder.encode(b[9:], sb))
    s = encoder.init_state()
    assert torch.equal(za[1], [encoder.encode(a[:9], s), encoder.encode(a[9:], s)][1])
    assert not torch.equal(za[1], zb[1])


def test_full_size_encoder_state_bytes():
    # 3 MemBlocks of 64 channels at 1/2, 1/4 and 1/8 of 480x832, fp16
    assert TAEHVEncoder().state_bytes(480, 832, torch.float16) == 2 * 3 * 64 * (240 * 416 + 120 * 208 + 60 * 104)
