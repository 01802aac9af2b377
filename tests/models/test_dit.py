import pytest
import torch

from models import ModelConfig
from models.dit import sinusoidal_embedding
from models.dit_ops import Rope, apply_rope


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


def test_a_sample_model_returns_the_flow_that_leads_to_its_head_output():
    """prediction="sample": the head gives x0 and the model returns (x - x0) / sigma, so the sampler's
    x - sigma * v is the head's output. A flow model with the same weights returns that output as it is."""
    from dataclasses import replace

    from models import CausalWanModel
    from models.dit import CacheAccess

    cfg = ModelConfig.from_name("tiny")
    flow = CausalWanModel(cfg).init_weights(0).eval()
    sample = CausalWanModel(replace(cfg, prediction="sample")).eval()
    sample.load_state_dict(flow.state_dict())
    x = torch.randn(2, cfg.in_channels, 3, cfg.latent_height, cfg.latent_width, generator=torch.Generator().manual_seed(1))
    t = torch.tensor([[1000.0] * 3, [625.0] * 3])
    text = flow.project_text(torch.randn(2, cfg.text_len, cfg.text_dim))
    access = [CacheAccess(None, 0)] * 2
    with torch.no_grad():
        head = flow.predict_flow(x, t, text, access)
        v = sample.predict_flow(x, t, text, access)
        v0 = sample.predict_flow(x, torch.zeros_like(t), text, access)  # a commit's timestep: finite
    torch.testing.assert_close(x - (t / 1000).view(2, 1, 3, 1, 1) * v, head, rtol=0, atol=1e-5)
    assert not torch.allclose(v, head)
    assert torch.isfinite(v0).all()
    with pytest.raises(ValueError, match="prediction"):
        replace(cfg, prediction="noise")
