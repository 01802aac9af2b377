import torch

from models import ModelConfig
from models.dit import Rope, apply_rope, sinusoidal_embedding


def test_rope_matches_wan_complex_rotation():
    cfg = ModelConfig.from_name("wan2.1-1.3b")
    rope = Rope(cfg)
    positions = [0, 1, 2, 7, 3]
    cos, sin = rope.table(positions, torch.device("cpu"))
    x = torch.randn(len(positions) * cfg.tokens_per_frame, cfg.num_heads, cfg.head_dim, dtype=torch.float64)
    # Wan: view pairs as complex numbers and multiply by exp(i * angle), angles split 44/42/42 over t/h/w
    dt, dh, dw = cfg.rope_split
    h, w = cfg.grid
    def freqs(n, d):
        return torch.outer(torch.arange(n, dtype=torch.float64), 1.0 / 10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ft, fh, fw = freqs(1024, dt), freqs(h, dh), freqs(w, dw)
    ang = torch.cat([
        ft[positions][:, None, None].expand(-1, h, w, -1),
        fh[None, :, None].expand(len(positions), -1, w, -1),
        fw[None, None, :].expand(len(positions), h, -1, -1),
    ], dim=-1).reshape(-1, 1, cfg.head_dim // 2)
    ref = torch.view_as_real(torch.view_as_complex(x.unflatten(-1, (-1, 2)).contiguous()) * torch.polar(torch.ones_like(ang), ang)).flatten(-2)
    out = apply_rope(x.float(), cos, sin).double()
    assert torch.allclose(out, ref, atol=1e-5)


def test_sinusoidal_embedding_is_cos_then_sin():
    e = sinusoidal_embedding(8, torch.tensor([0.0, 1000.0]))
    assert e.shape == (2, 8)
    assert torch.allclose(e[0], torch.tensor([1.0] * 4 + [0.0] * 4, dtype=torch.float64))
    assert torch.isclose(e[1, 0], torch.cos(torch.tensor(1000.0, dtype=torch.float64)))
