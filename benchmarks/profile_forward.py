"""Where one DiT forward's time goes (as the generator runs it: CUDA graphs, FlashAttention-4 where
installed): GPU time per forward by kernel, and SDPA's backends at our shape.

    python benchmarks/profile_forward.py --preset wan2.1-1.3b --cached-frames 9
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.generator import Timer, fill_cache, forward_ms  # noqa: E402
from models import CacheAccess, build_generator  # noqa: E402


def sdpa_backends(mc, cached: int, timer: Timer) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    lq, lk = 3 * mc.tokens_per_frame, (cached + 3) * mc.tokens_per_frame
    q = torch.randn(1, lq, mc.num_heads, mc.head_dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(1, lk, mc.num_heads, mc.head_dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    v = torch.randn_like(k)
    flops = 4 * lq * lk * mc.dim
    out = {}
    for name in ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION"):
        for layout in ("strided", "contiguous"):
            qq, kk, vv = (q, k, v) if layout == "strided" else (q.contiguous(), k.contiguous(), v.contiguous())
            try:
                with sdpa_kernel([getattr(SDPBackend, name)]):
                    ms = timer(lambda: torch.nn.functional.scaled_dot_product_attention(qq, kk, vv), 20)
                out[f"{name}/{layout}"] = {"ms": round(ms, 3), "tflops": round(flops / ms / 1e9, 1)}
            except RuntimeError as e:
                out[f"{name}/{layout}"] = {"error": str(e).splitlines()[0][:120]}
            print(name, layout, out[f"{name}/{layout}"], file=sys.stderr)
    return out


def kernel_times(gen, state, timer, forwards: int = 3) -> list[dict]:
    """GPU time per forward by kernel name, longest first, over `forwards` timed forwards (the
    profiler sees the kernels inside CUDA graph replays too)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        forward_ms(gen, [state], timer, forwards, rotate=True)
    total = collections.defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            total[e.name][0] += e.device_time
            total[e.name][1] += 1
    n = forwards + 2  # the timer's two warm-up forwards run under the profiler too
    rows = [{"name": k, "us_per_forward": round(t / n, 1), "calls_per_forward": round(c / n, 1)} for k, (t, c) in total.items()]
    return sorted(rows, key=lambda r: -r["us_per_forward"])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="wan2.1-1.3b")
    p.add_argument("--cached-frames", type=int, default=9)
    p.add_argument("--compile", action="store_true")
    args = p.parse_args()
    timer = Timer(torch.device("cuda"))
    gen = build_generator(args.preset, device="cuda", dtype=torch.bfloat16)
    state = gen.open_stream("p", "profile", seed=0)
    fill_cache(gen, state, args.cached_frames)
    mc = gen.model_cfg
    x = torch.randn(1, mc.in_channels, 3, mc.latent_height, mc.latent_width, device="cuda")
    t = torch.full((1, 3), 937.5, device="cuda")
    run = lambda: gen.model(x, t, state.text, [CacheAccess(state.cache, state.cache.num_frames)])  # noqa: E731
    rel = None
    if args.compile:  # before any graph is captured: graphs keep the kernels they were captured with
        from models.dit_ops import compile_helpers

        ref = run()
        compile_helpers()
        out = run()
        rel = ((out - ref).norm() / ref.norm()).item()
        print(f"compiled vs eager output: rel err {rel:.2e}", file=sys.stderr)
    eager_ms = timer(run, 5)
    print(f"forward, kernels launched one by one: {eager_ms:.2f} ms", file=sys.stderr)
    ms = forward_ms(gen, [state], timer, 5, rotate=True)
    print(f"forward (CUDA graphs; rotating the cached keys, as a chunk's first step): {ms:.2f} ms", file=sys.stderr)
    kernels = kernel_times(gen, state, timer)
    for k in kernels[:25]:
        print(f"{k['us_per_forward']:9.1f} us/forward {k['calls_per_forward']:6.1f}x  {k['name'][:140]}", file=sys.stderr)
    busy = sum(k["us_per_forward"] for k in kernels) / 1000
    print(f"GPU busy {busy:.2f} ms of a {ms:.2f} ms forward", file=sys.stderr)
    res = {"bench": "profile_forward", "eager_ms": round(eager_ms, 2), "forward_ms": round(ms, 2), "compile": args.compile,
           "compiled_rel_err": rel, "gpu_busy_ms": round(busy, 2), "top_kernels": kernels[:10]}
    res["sdpa"] = sdpa_backends(gen.model_cfg, args.cached_frames, timer)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
