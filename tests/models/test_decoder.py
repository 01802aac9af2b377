"""The built-in causal decoder: each latent pixel becomes an 8x8 patch of 4 video frames."""

import torch
import torch.nn.functional as F

from models import ModelConfig, TinyStreamingDecoder


def test_each_latent_pixel_becomes_its_patch_of_colour_detail_and_linear_path():
    """forward sums the patch at latent resolution and permutes once: pixel (y*8+dy, x*8+dx, c) of frame
    f*4+t is the colour c at (y, x), plus detail channel (c, dy, dx), plus the linear path's channel
    (t, dy, dx, c), as an explicit per-pixel reference says."""
    mc = ModelConfig.from_name("tiny")
    dec = TinyStreamingDecoder(mc).init_weights(0)
    torch.manual_seed(0)
    with torch.no_grad():
        dec.inverse.weight.normal_(0, 0.1)
        dec.inverse.bias.normal_(0, 0.1)
    b, nf, h, w = 2, 2, 3, 4
    z = torch.randn(b, nf, mc.in_channels, h, w)
    with torch.no_grad():
        rgb, _ = dec(z)
        # the features forward computes before the patch, recomputed
        feats = F.silu(dec.conv_in(z.flatten(0, 1))).unflatten(0, (b, nf))
        mem, mixed = None, []
        for f in range(nf):
            prev = torch.zeros_like(feats[:, f]) if mem is None else mem
            mem = feats[:, f] + F.silu(dec.memory(torch.cat([feats[:, f], prev], dim=1)))
            mixed.append(mem)
        x = dec.temporal(torch.stack(mixed, 1).flatten(0, 1))
        x = F.silu(dec.frame(x.view(b * nf * dec.tu, -1, h, w)))  # [N, ch, h, w]
        colour, detail = dec.color(x), dec.detail(x)  # [N, 3, h, w], [N, 3*8*8, h, w]
        linear = dec.inverse(z.flatten(0, 1))  # [B*F, (t, dy, dx, c), h, w]
    su, tu = dec.su, dec.tu
    assert rgb.shape == (b, nf * tu, h * su, w * su, 3)
    for bi, fi, yy, xx, c in [(0, 0, 0, 0, 0), (1, 3, 17, 30, 2), (0, 7, 23, 9, 1), (1, 4, 8, 31, 0), (1, 6, 15, 16, 1)]:
        y, dy, x_, dx = yy // su, yy % su, xx // su, xx % su
        n, lat, t = bi * nf * tu + fi, bi * nf + fi // tu, fi % tu  # video frame in the batch, its latent frame
        want = colour[n, c, y, x_] + detail[n, (c * su + dy) * su + dx, y, x_] + linear[lat, ((t * su + dy) * su + dx) * 3 + c, y, x_]
        torch.testing.assert_close(rgb[bi, fi, yy, xx, c], want, rtol=1e-5, atol=1e-5)


def test_decode_gives_the_forwards_frames_as_uint8_a_chunk_at_a_time():
    """decode (the serving path: straight to [0, 255] and uint8 before its one permute) equals forward's
    frames mapped from [-1, 1] to uint8, chunk after chunk with the memory carried, the stream's first latent
    frame giving one video frame."""
    mc = ModelConfig.from_name("tiny")
    dec = TinyStreamingDecoder(mc).init_weights(1)
    with torch.no_grad():
        dec.inverse.weight.normal_(0, 0.2)
    z = torch.randn(1, 6, mc.in_channels, mc.latent_height, mc.latent_width)
    with torch.no_grad():
        rgb, _ = dec(z)
    want = rgb[0].clamp(-1, 1).add(1).mul(127.5).round().to(torch.uint8)[dec.tu - 1 :]
    state = dec.init_state()
    got = torch.cat([dec.decode(z[0, i : i + 3].transpose(0, 1), state) for i in (0, 3)])
    assert got.dtype == torch.uint8 and got.shape == want.shape == (6 * dec.tu - dec.tu + 1, mc.height, mc.width, 3)
    diff = (got.int() - want.int()).abs()
    assert diff.max() <= 1 and (diff == 0).float().mean() > 0.99  # the same up to rounding at .5
    assert state.frames_out == got.shape[0]
