import pytest
import torch

from models.taehv import TAEHV_FILE, TAEHVDecoder
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
