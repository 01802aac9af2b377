"""Generator speed: ms per forward by cache fill, ms per chunk (denoise / commit / decode), batch scaling.

One stream's forward reads its cache in place and rotates the cached keys once per chunk (at the
first denoising step; models/dit.py AttentionKV): "ms" by fill is a later step's forward,
"ms_rotating" the first's. Batch scaling compares forwards that all rotate (a batch always does).

    python benchmarks/generator.py --preset wan2.1-1.3b --device cuda
    python benchmarks/generator.py --preset tiny --device cpu --iters 5
    python benchmarks/generator.py --preset wan2.1-1.3b --only-chunk   # the full-cache chunk only (benchmarks/service.py)
    python benchmarks/generator.py --preset wan2.1-1.3b --fidelity approximate   # with a tier's speed options
    python benchmarks/generator.py --preset wan2.1-14b --wan-dir /data/wan/Wan2.1-T2V-14B --only-chunk \
        --fidelity exact,quantized,approximate   # every tier in turn on the one loaded model

Warm-up (and compile, with --compile, and CUDA-graph capture) is kept out of the timings.
Forwards go through the generator's path: CUDA graphs on CUDA unless --no-cuda-graphs.
TFLOP/s and MFU are against a bf16 GEMM measured in the same run. Reports the load (seconds, device
memory of the DiT, the text encoder and the KV workspace, the host's peak RSS). Ends with one JSON
line; with several tiers its "runs" hold each tier's figures.
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models import PRESETS, CacheAccess, ChunkGenerator, GeneratorConfig, build_generator, fidelity  # noqa: E402
from models.build import DECODERS  # noqa: E402


class Timer:
    """Median wall time of a callable in ms; CUDA events on GPU, perf_counter on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __call__(self, fn, iters: int, warmup: int = 2) -> float:
        return self.split([fn], iters, warmup)[0]

    def split(self, fns, iters: int, warmup: int = 2) -> list[float]:
        """Median ms of each of `fns`, run in turn `iters` times (after `warmup` rounds)."""
        for _ in range(warmup):
            for fn in fns:
                fn()
        times = [[] for _ in fns]
        for _ in range(iters):
            for fn, ts in zip(fns, times):
                if self.cuda:
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    fn()
                    b.record()
                    torch.cuda.synchronize()
                    ts.append(a.elapsed_time(b))
                else:
                    t = time.perf_counter()
                    fn()
                    ts.append((time.perf_counter() - t) * 1e3)
        return [statistics.median(ts) for ts in times]


def gemm_tflops(device, dtype, timer: Timer) -> float:
    n = 8192 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    ms = timer(lambda: a @ b, iters=10 if device.type == "cuda" else 3)
    return 2 * n**3 / (ms / 1e3) / 1e12


def fill_cache(gen, state, frames: int) -> None:
    """Commit `frames` latent frames' worth of random K/V without running the model."""
    cache = state.cache
    cache.reset()
    spec = cache.spec
    nf = gen.cfg.frames_per_chunk
    g = torch.Generator(device=gen.device).manual_seed(0)
    while cache.num_frames < min(frames, spec.capacity_frames) or cache.frames_seen < frames:
        slots = cache.plan_commit(nf)
        shape = (nf, spec.tokens_per_frame, spec.num_heads, spec.head_dim)
        for layer in range(spec.num_layers):
            k = torch.randn(shape, generator=g, device=gen.device).to(spec.torch_dtype)
            cache.write(layer, slots, k, torch.randn(shape, generator=g, device=gen.device).to(spec.torch_dtype))
        cache.advance(slots)


def forward_ms(gen, states, timer, iters, rotate: bool = False) -> float:
    """ms of one denoising forward at the caches' current fill. One stream reads its cache in place
    and, as a chunk's later steps do, reuses the keys rotated by the forward before; `rotate`
    marks the caches changed before each forward, so that each rotates them (a chunk's first step)."""
    mc, nf = gen.model_cfg, gen.cfg.frames_per_chunk
    b = len(states)
    x = torch.randn(b, mc.in_channels, nf, mc.latent_height, mc.latent_width, device=gen.device)
    t = torch.full((b, nf), 937.5, device=gen.device)
    text = [(torch.cat([s.text[i][0] for s in states]), torch.cat([s.text[i][1] for s in states])) for i in range(mc.num_layers)]
    access = [CacheAccess(s.cache, s.cache.num_frames) for s in states]

    def run():
        if rotate:
            for s in states:
                s.cache.touch()
        gen.forward(x, t, text, access)

    return timer(run, iters)


def chunk_split(gen, state, timer, iters) -> dict:
    """ms of the denoise steps, the commit and the decode of one chunk at the cache's current fill."""
    steps = len(gen.sigmas)
    nf = gen.cfg.frames_per_chunk

    def denoise_all():
        state.reused_slots = None  # commit reuse wrote the ring's next slots: fine here, the fill stays put
        gen.abandon_chunk(state)
        for _ in range(steps):
            gen.denoise([state])

    def commit_only():  # the commit forward right after the steps, without advancing the ring: the fill stays put
        if gen.cfg.commit_reuse:  # no commit forward: the last step wrote the cache
            return
        slots = state.cache.plan_commit(nf)
        gen.forward(state.x0[None], torch.zeros(1, nf, device=gen.device), state.text,
                    [CacheAccess(state.cache, state.cache.num_frames, write_slots=slots)])

    denoise, commit = timer.split([denoise_all, commit_only], iters)
    x0 = state.x0.clone()
    dec_state = gen.decoder.init_state()
    gen.decoder.decode(x0, dec_state)  # past the first chunk: 12 frames
    decode = timer(lambda: gen.decoder.decode(x0, dec_state), iters)
    frames = gen.frames_in_chunk(1)
    total = denoise + commit + decode
    flops = gen.model_cfg.flops_per_forward(nf, state.cache.num_frames + nf)  # one denoising step's
    return {
        "steps": steps,
        "denoise_ms": round(denoise, 2),
        "denoise_step_ms": round(denoise / steps, 2),
        "denoise_step_tflops": round(flops / (denoise / steps / 1e3) / 1e12, 1),
        "commit_ms": round(commit, 2),
        "decode_ms": round(decode, 2),
        "chunk_ms": round(total, 2),
        "dit_chunk_ms": round(denoise + commit, 2),
        "fps": round(frames / (total / 1e3), 1),
        "dit_fps": round(frames / ((denoise + commit) / 1e3), 1),
    }


def flash_used(gen) -> bool:
    from models import flash

    mc = gen.model_cfg
    return flash.usable(torch.empty(1, 1, mc.num_heads, mc.head_dim, device=gen.device, dtype=gen.model.dtype))


def tiers_of(text: str | None) -> list[str | None]:
    """--fidelity: one tier, a comma list run in turn (ordered exact, quantized, approximate: FP8 linears,
    once swapped in, stay), or none (None)."""
    if text is None:
        return [None]
    tiers = [t.strip() for t in text.split(",") if t.strip()]
    for t in tiers:
        fidelity.rank(t)  # ValueError naming the tiers
    return sorted(set(tiers), key=fidelity.rank)


def load_figures(gen, device: torch.device, seconds: float) -> dict:
    """What loading cost: seconds, device memory of its parts (GiB) and the host's peak RSS."""
    gib = lambda n: round(n / 2**30, 2)  # noqa: E731
    dit = sum(t.numel() * t.element_size() for t in gen.model.state_dict().values())
    text = getattr(gen.text_encoder, "model", None)
    out = {
        "load_s": round(seconds, 2),
        "dit_gib": gib(dit),
        "dit_params_b": round(sum(p.numel() for p in gen.model.parameters()) / 1e9, 3),
        "text_encoder_gib": gib(sum(p.numel() * p.element_size() for p in text.parameters())) if text is not None else 0.0,
        "workspace_gib": gib(gen.workspace.nbytes) if gen.workspace is not None else 0.0,
        "kv_stream_gib": gib(gen.cache_spec().stream_bytes()),
        "decoder_state_gib": gib(gen.decoder_state_bytes()),
        "host_peak_rss_gib": gib(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024),
    }
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        out |= {"allocated_gib": gib(torch.cuda.memory_allocated(device)), "free_gib": gib(free), "total_gib": gib(total)}
    return out


def measure(gen, cfg: GeneratorConfig, args, timer: Timer, peak: float, log) -> dict:
    """One configuration's figures: ms per forward by fill, the chunk's split, the peer window, batches."""
    mc, nf = gen.model_cfg, gen.cfg.frames_per_chunk
    cap = gen.cache_spec().capacity_frames
    if gen.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(gen.device)

    # ms per forward by cache fill
    state = gen.open_stream("bench", "a timelapse of clouds over mountains", seed=0)
    by_fill = []
    for fill in [] if args.only_chunk else sorted({0, 3, 6, 9, cap} & set(range(cap + 1))):
        fill_cache(gen, state, fill)
        ms = forward_ms(gen, [state], timer, args.iters)
        rot = forward_ms(gen, [state], timer, args.iters, rotate=True)
        flops = mc.flops_per_forward(nf, fill + nf)
        row = {
            "cached_frames": fill,
            "keys": (fill + nf) * mc.tokens_per_frame,
            "ms": round(ms, 2),
            "ms_rotating": round(rot, 2),
            "tflops": round(flops / (ms / 1e3) / 1e12, 1),
            "mfu": round(flops / (ms / 1e3) / 1e12 / peak, 3),
        }
        by_fill.append(row)
        log(f"forward, {fill:2d} cached frames ({row['keys']} keys): {ms:7.2f} ms  {row['tflops']:6.1f} TFLOP/s  MFU {row['mfu']:.2f}"
            f"  (rotating the cached keys: {rot:.2f} ms)")

    # ms per chunk at a full cache, split into denoise / commit / decode
    fill_cache(gen, state, cap)
    chunk = chunk_split(gen, state, timer, max(2, args.iters // 2))
    chunk["denoise_step_mfu"] = round(chunk["denoise_step_tflops"] / peak, 3)
    log(f"chunk at sink {args.sink_frames} + window {args.window_frames}: {chunk}")
    peer = None
    if args.peer_window and args.peer_window != args.window_frames and not args.only_chunk:
        pgen_cfg = replace(cfg, window_frames=args.peer_window)
        pgen = type(gen)(gen.model, pgen_cfg, decoder=gen.decoder)
        pstate = pgen.open_stream("peer", "a timelapse of clouds over mountains", seed=0)
        fill_cache(pgen, pstate, pgen.cache_spec().capacity_frames)
        peer = chunk_split(pgen, pstate, timer, max(2, args.iters // 2))
        log(f"chunk at sink {args.sink_frames} + window {args.peer_window}: {peer}")
        del pstate, pgen

    # batch scaling at a full cache
    batches = []
    states = [state]
    for b in [] if args.only_chunk else [int(x) for x in args.batches.split(",")]:
        while len(states) < b:
            s = gen.open_stream(f"b{len(states)}", f"prompt {len(states)}", seed=len(states))
            fill_cache(gen, s, cap)
            states.append(s)
        ms = forward_ms(gen, states[:b], timer, args.iters, rotate=True)  # a batch copies and rotates every forward
        batches.append({"batch": b, "ms": round(ms, 2), "ms_per_stream": round(ms / b, 2)})
    base = batches[0]["ms_per_stream"] if batches else None
    for row in batches:
        row["throughput_vs_b1"] = round(base / row["ms_per_stream"], 3)
        log(f"batch {row['batch']}: {row['ms']:.2f} ms per forward, {row['ms_per_stream']:.2f} ms per stream, x{row['throughput_vs_b1']}")
    for s in states:
        gen.close_stream(s)
    return {
        "fidelity": fidelity.tier_of(fidelity.active(cfg)),
        "speed_options": fidelity.active(cfg),
        "flash_attention": flash_used(gen),
        "forward_by_fill": by_fill,
        "chunk": chunk,
        "peer_chunk": peer and {"window_frames": args.peer_window, **peer},
        "batch": batches,
        "peak_mem_gib": round(torch.cuda.max_memory_allocated(gen.device) / 2**30, 2) if gen.device.type == "cuda" else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny", choices=list(PRESETS))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--sink-frames", type=int, default=3)
    p.add_argument("--window-frames", type=int, default=9)
    p.add_argument("--chunk-latent-frames", type=int, default=3, choices=(1, 3), help="latent frames a chunk (as serve's)")
    p.add_argument("--peer-window", type=int, default=12, help="also time a chunk at sink + this window (Self-Forcing's)")
    p.add_argument("--kv-quant", default="none", choices=["none", "int4", "int2"])
    p.add_argument("--batches", default="1,2,4")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--compile", action="store_true", help="torch.compile the elementwise helpers (compile time excluded)")
    p.add_argument("--no-cuda-graphs", action="store_true", help="launch each forward's kernels from Python (no graph replay)")
    p.add_argument("--wan-dir", default=None, help="Wan2.1 folder: umT5, the VAE, the base DiT and its config.json (as `streamsvc serve`)")
    p.add_argument("--checkpoint", default=None, help="DiT weights (file or Wan folder; default random)")
    p.add_argument("--decoder", default="auto", choices=DECODERS, help="the decoder timed per chunk (as `streamsvc serve`)")
    p.add_argument("--taehv", default=None, help="TAEHV's taew2_1.pth for --decoder taehv")
    p.add_argument("--fidelity", default=None, metavar="TIER[,TIER...]",
                   help="turn on this tier's speed options that pay on the device (as `streamsvc serve --fidelity`); a "
                        f"comma list ({','.join(fidelity.TIERS)}) times each tier in turn on the one loaded model")
    p.add_argument("--speed-options", default=None, help="exactly these speed options (comma list or none; models/fidelity.py)")
    p.add_argument("--only-chunk", action="store_true",
                   help="time only the chunk at a full cache (no fill sweep, peer window or batch scaling)")
    args = p.parse_args(argv)
    try:
        tiers = tiers_of(args.fidelity)
    except ValueError as e:
        p.error(str(e))
    if len(tiers) > 1 and args.speed_options is not None:
        p.error("--speed-options names one configuration: give one --fidelity tier with it")

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    timer = Timer(device)
    log = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731

    peak = gemm_tflops(device, dtype, timer)
    log(f"GEMM ceiling: {peak:.0f} TFLOP/s ({dtype})")
    graphs = not args.no_cuda_graphs
    base_cfg = GeneratorConfig(sink_frames=args.sink_frames, window_frames=args.window_frames, kv_quant=args.kv_quant,
                               cuda_graphs=graphs, frames_per_chunk=args.chunk_latent_frames)
    cfgs = [fidelity.configure(base_cfg, t, fidelity.parse(args.speed_options), device.type) for t in tiers]
    if any(a.fp8_linears and not b.fp8_linears for a, b in zip(cfgs, cfgs[1:])):
        p.error("a tier without FP8 linears after one with them: FP8 weights, once swapped in, stay")
    t0 = time.time()
    gen = build_generator(args.preset, device=device, dtype=dtype, cfg=cfgs[0], checkpoint=args.checkpoint,
                          wan_dir=args.wan_dir, decoder=args.decoder, taehv=args.taehv)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    loaded = load_figures(gen, device, time.time() - t0)
    log(f"model built in {loaded['load_s']:.1f} s: {loaded}")
    if args.compile:
        from models.dit_ops import compile_helpers

        compile_helpers()
    runs = []
    for i, cfg in enumerate(cfgs):
        if i:  # the next tier on the same weights: a new generator (its own workspace and graphs) after the last is gone
            model, text_encoder, decoder = gen.model, gen.text_encoder, gen.decoder
            del gen
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            gen = ChunkGenerator(model, cfg, text_encoder, decoder)
        log(fidelity.describe(cfg, degrade=False))
        runs.append(measure(gen, cfg, args, timer, peak, log))

    mc = gen.model_cfg
    result = {
        "bench": "generator",
        "preset": args.preset,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(dtype).replace("torch.", ""),
        "model": {"dim": mc.dim, "ffn_dim": mc.ffn_dim, "num_heads": mc.num_heads, "num_layers": mc.num_layers,
                  "tokens_per_frame": mc.tokens_per_frame},
        "chunk_latent_frames": args.chunk_latent_frames, "sink_frames": args.sink_frames,
        "window_frames": args.window_frames,
        "kv_quant": args.kv_quant,
        "decoder": type(gen.decoder).__name__,
        "decoder_state_mb": round(gen.decoder_state_bytes() / 2**20, 1),
        "compile": args.compile,
        "cuda_graphs": graphs and device.type == "cuda",
        "gemm_tflops": round(peak, 1),
        "load": loaded,
        **(runs[0] if len(runs) == 1 else {"runs": runs}),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
