"""KV cache storage: bytes, quantization error, rollout drift and step time, bf16 vs int4 / int2.

    python benchmarks/kvcache.py --preset wan2.1-1.3b --device cpu --only bytes
    python benchmarks/kvcache.py --preset wan2.1-1.3b --device cuda            # all parts (H200)
    python benchmarks/kvcache.py --preset tiny --device cpu --chunks 6         # a quick CPU check

Parts (--only picks some, comma separated):
  bytes  per latent frame and per stream, metadata included; computed from `bytes_for`, nothing allocated
  error  ||K - deq(K)|| / ||K|| and ||V - deq(V)|| / ||V|| on the model's own cached K/V (quantized
         frames only), and the relative error of each layer's self-attention output when the same
         queries attend to the dequantized cache instead of the bf16 one; Gaussian noise beside it
  drift  a --chunks rollout per mode from the same seed, relative latent error per chunk against bf16
         (and a second bf16 rollout: the run-to-run floor)
  speed  ms per denoising forward and per commit forward with a full cache (sink + window frames),
         the overhead against bf16, TFLOP/s, and the fused read alone in GB/s

Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvcache import CacheSpec, StreamCache  # noqa: E402
from kvcache.quant import QUANT, QuantLayout, QuantStorage, quant_frame_bytes, scratch_bytes  # noqa: E402

PROMPT = "a red fox running through fresh snow at dawn, cinematic"
PARTS = ("bytes", "error", "drift", "speed")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny", help="model preset (models.config.PRESETS)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--only", default=",".join(PARTS), help=f"comma separated subset of {','.join(PARTS)}")
    ap.add_argument("--kv-quant", default="int4,int2", help="quantized modes to compare with bf16 (int4, int2)")
    ap.add_argument("--sink-frames", type=int, default=3)
    ap.add_argument("--window-frames", type=int, default=9)
    ap.add_argument("--residual-frames", type=int, default=None, help="dense newest window frames (CacheSpec default)")
    ap.add_argument("--group-size", type=int, default=None, help="tokens per key group (CacheSpec default)")
    ap.add_argument("--chunks", type=int, default=20, help="chunks of the drift rollout")
    ap.add_argument("--iters", type=int, default=10, help="timed chunks (4 denoise + 1 commit forwards each) per mode")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compile", action="store_true", help="torch.compile the DiT's elementwise helpers")
    args = ap.parse_args(argv)

    parts = [p.strip() for p in args.only.split(",") if p.strip()]
    bad = [p for p in parts if p not in PARTS]
    modes = [m.strip() for m in args.kv_quant.split(",") if m.strip() and m.strip() != "none"]
    if bad or any(m not in ("int4", "int2") for m in modes):
        ap.error(f"--only takes {PARTS}, --kv-quant takes int4,int2; got --only {args.only} --kv-quant {args.kv_quant}")

    from models.config import ModelConfig

    mc = ModelConfig.from_name(args.preset)
    spec_kw = dict(
        num_layers=mc.num_layers,
        num_heads=mc.num_heads,
        head_dim=mc.head_dim,
        tokens_per_frame=mc.tokens_per_frame,
        sink_frames=args.sink_frames,
        window_frames=args.window_frames,
    )
    if args.residual_frames is not None:
        spec_kw["residual_frames"] = args.residual_frames
    if args.group_size is not None:
        spec_kw["group_size"] = args.group_size
    result: dict = {"bench": "kvcache", "preset": args.preset, "device": args.device, "modes": ["bf16", *modes]}
    result.update(bytes_part(spec_kw, modes))
    if "bytes" in parts:
        print_bytes(result)

    needs_model = [p for p in parts if p != "bytes"]
    if needs_model:
        gen = build(args)
        result["device_name"] = torch.cuda.get_device_name() if gen.device.type == "cuda" else "cpu"
        result["dtype"] = str(gen.model.dtype).removeprefix("torch.")
        storage_kw = {k: v for k, v in spec_kw.items() if k in ("sink_frames", "window_frames", "residual_frames", "group_size")}
        dense = dataclasses.replace(gen.cache_spec(), **storage_kw)
        specs = {"bf16": dense, **{m: dataclasses.replace(dense, quant=m) for m in modes}}
        if "error" in parts:
            result["error"] = error_part(gen, specs, args)
        if "drift" in parts:
            result["drift"] = drift_part(gen, specs, args)
        if "speed" in parts:
            result["speed"] = speed_part(gen, specs, args)
    result["summary"] = summarize(result, modes)
    print(json.dumps(result))
    return result


def summarize(r: dict, modes: list[str]) -> dict:
    """The headline figures of each mode, from whichever parts ran."""
    out = {}
    for m in modes:
        row = {"frame_ratio_vs_bf16": r["frame_ratio_vs_bf16"][m], "stream_ratio_vs_bf16": r["stream_ratio_vs_bf16"][m]}
        if "error" in r:
            row["attn_out_rel_err"] = r["error"][m]["attn_out_rel_err"]["mean"]
        if "drift" in r:
            row["drift_last_chunk"] = r["drift"][m]["last"]
        if "speed" in r:
            row["denoise_overhead_pct"] = r["speed"][m]["denoise_overhead_pct"]
            row["chunk_overhead_pct"] = r["speed"][m]["chunk_overhead_pct"]
        out[m] = row
    return out


# -- bytes -------------------------------------------------------------------------------------


def bytes_part(spec_kw: dict, modes: list[str]) -> dict:
    dense = CacheSpec(dtype="bfloat16", **spec_kw)
    per_frame = {"bf16": dense.dense_frame_bytes}
    per_stream = {"bf16": dense.stream_bytes()}
    variants, same_memory = {}, {}
    for m in ("int4", "int2"):
        spec = dataclasses.replace(dense, quant=m)
        per_frame[m] = quant_frame_bytes(spec)
        if m not in modes:
            continue
        per_stream[m] = spec.stream_bytes()
        variants[m] = {
            f"residual{spec.residual_frames}_dense_sinks": spec.stream_bytes(),
            "residual0_dense_sinks": dataclasses.replace(spec, residual_frames=0).stream_bytes(),
            "residual0_quantized_sinks": dataclasses.replace(spec, residual_frames=0, quantize_sinks=True).stream_bytes(),
        }
        # the longest window whose stream fits in the bf16 stream's memory (same sinks and residual)
        lay = QuantLayout.of(spec)
        fixed = QuantStorage.bytes_for(dataclasses.replace(spec, window_frames=lay.residual))
        w = lay.residual + (per_stream["bf16"] - fixed) // per_frame[m]
        while w > 0 and dataclasses.replace(spec, window_frames=w).stream_bytes() > per_stream["bf16"]:
            w -= 1
        same_memory[m] = w
    return {
        "shape": {k: spec_kw[k] for k in ("num_layers", "num_heads", "head_dim", "tokens_per_frame")},
        "cache": {
            "sink_frames": dense.sink_frames,
            "window_frames": dense.window_frames,
            "residual_frames": dataclasses.replace(dense, quant="int2").residual_frames,
            "group_size": dense.group_size,
        },
        "bytes_per_frame": per_frame,
        "frame_ratio_vs_bf16": {m: round(per_frame["bf16"] / b, 3) for m, b in per_frame.items()},
        "bytes_per_stream": per_stream,
        "stream_ratio_vs_bf16": {m: round(per_stream["bf16"] / b, 3) for m, b in per_stream.items()},
        "bytes_per_stream_variants": variants,
        "window_frames_in_bf16_stream_memory": same_memory,
        "scratch_bytes_per_device": scratch_bytes(dense),
    }


def print_bytes(r: dict) -> None:
    mib = 2**20
    c = r["cache"]
    print(f"{r['preset']}: {r['shape']}, sink {c['sink_frames']} + window {c['window_frames']}, "
          f"residual {c['residual_frames']}, key group {c['group_size']} tokens")  # fmt: skip
    for m, b in r["bytes_per_frame"].items():
        line = f"  {m:5s} {b / mib:9.2f} MiB/frame ({r['frame_ratio_vs_bf16'][m]:.2f}x smaller)"
        if m in r["bytes_per_stream"]:
            s = r["bytes_per_stream"][m]
            line += f"   {s / mib:9.1f} MiB/stream ({r['stream_ratio_vs_bf16'][m]:.2f}x)"
        if m in r["window_frames_in_bf16_stream_memory"]:
            line += f"   window of {r['window_frames_in_bf16_stream_memory'][m]} frames in the bf16 stream's memory"
        print(line)
    for m, v in r["bytes_per_stream_variants"].items():
        print(f"  {m} per stream: " + ", ".join(f"{k} {b / mib:.1f} MiB" for k, b in v.items()))
    print(f"  read scratch, once per device: {r['scratch_bytes_per_device'] / mib:.1f} MiB")


# -- the model ---------------------------------------------------------------------------------


def build(args):
    from models import GeneratorConfig, build_generator

    t0 = time.perf_counter()
    cfg = GeneratorConfig(sink_frames=args.sink_frames, window_frames=args.window_frames)
    gen = build_generator(args.preset, device=args.device, seed=args.seed, cfg=cfg)
    if getattr(args, "compile", False):
        from models.dit_ops import compile_helpers

        compile_helpers()
    print(f"built {args.preset} on {gen.device} ({gen.model.dtype}) in {time.perf_counter() - t0:.1f} s", flush=True)
    return gen


def run_chunks(gen, state, n: int) -> list[torch.Tensor]:
    """Generate n chunks; their clean latents."""
    out = []
    while len(out) < n:
        for chunk in gen.run(gen.next_work(state), [state]):
            if chunk is not None:
                out.append(chunk.latents)
    return out


def chunks_to_fill(spec: CacheSpec, frames_per_chunk: int) -> int:
    """Chunks after which the cache is full and its window has rolled once."""
    return -(-spec.capacity_frames // frames_per_chunk) + 1


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float32."""
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# -- error -------------------------------------------------------------------------------------


@torch.inference_mode()
def error_part(gen, specs: dict, args) -> dict:
    from models.dit_ops import apply_rope, norm_rope

    model, dev = gen.model, gen.device
    dense = specs["bf16"]
    state = gen.open_stream("error", PROMPT, seed=args.seed, cache=StreamCache(dense, dev))
    run_chunks(gen, state, chunks_to_fill(dense, gen.cfg.frames_per_chunk))
    cache = state.cache
    n, nf = cache.num_frames, gen.cfg.frames_per_chunk

    # the next denoising forward's own queries and keys/values, per layer (hooks on the self-attention)
    captured: dict[tuple[int, str], torch.Tensor] = {}
    hooks = []
    for i, blk in enumerate(model.blocks):
        for name in ("q", "k", "v"):
            mod = getattr(blk.self_attn, name)
            hook = lambda _m, _args, out, i=i, name=name: captured.__setitem__((i, name), out[0])  # noqa: E731
            hooks.append(mod.register_forward_hook(hook))
    try:
        gen.denoise([state])
    finally:
        for h in hooks:
            h.remove()

    h, d = dense.num_heads, dense.head_dim
    q_cos, q_sin = model.rope.table(list(range(n, n + nf)), dev)
    k_cos, k_sin = model.rope.table(cache.positions(n), dev)
    time_order = list(range(cache.sinks_filled)) + cache.window_slots_in_order()
    out: dict = {}
    for m in [k for k in specs if k != "bf16"]:
        store = QuantStorage(specs[m], dev)
        kerr, verr, attn = [], [], []
        for layer in range(dense.num_layers):
            kc, vc = cache.read(layer)  # dense [n, T, H, D]
            for slot in time_order:  # commit order: the newest frames stay dense
                store.write(layer, [slot], kc[slot : slot + 1], vc[slot : slot + 1])
            kq, vq = store.read(layer, n)
            qslots = [s for s in range(n) if store.maps[layer].loc[s][0] == QUANT]
            kerr.append(rel(kq[qslots], kc[qslots]))
            verr.append(rel(vq[qslots], vc[qslots]))
            sa = model.blocks[layer].self_attn
            q = norm_rope(captured[(layer, "q")].view(-1, h, d), sa.norm_q.weight, model.cfg.eps, q_cos, q_sin)
            k_new = norm_rope(captured[(layer, "k")].view(-1, h, d), sa.norm_k.weight, model.cfg.eps, q_cos, q_sin)
            v_new = captured[(layer, "v")].view(-1, h, d)

            def attend(kk, vv):
                keys = torch.cat([apply_rope(kk.reshape(-1, h, d), k_cos, k_sin), k_new])
                vals = torch.cat([vv.reshape(-1, h, d), v_new])
                return torch.nn.functional.scaled_dot_product_attention(
                    q.transpose(0, 1)[None], keys.transpose(0, 1)[None], vals.transpose(0, 1)[None]
                )

            ref = attend(kc, vc)
            attn.append(rel(attend(kq, vq), ref))
        # the same quantizer on Gaussian noise of one frame's shape, for comparison
        g = torch.Generator(device=dev).manual_seed(args.seed)
        noise = torch.randn(1, dense.tokens_per_frame, h, d, generator=g, device=dev).to(dense.torch_dtype)
        gstore = QuantStorage(dataclasses.replace(specs[m], sink_frames=0, window_frames=1, residual_frames=0), dev)
        gstore.write(0, [0], noise, noise)
        gk, gv = gstore.read(0, 1)
        out[m] = {
            "key_rel_err": summary(kerr),
            "value_rel_err": summary(verr),
            "attn_out_rel_err": summary(attn),
            "attn_out_rel_err_per_layer": [round(x, 5) for x in attn],
            "gaussian_key_rel_err": round(rel(gk, noise), 5),
            "gaussian_value_rel_err": round(rel(gv, noise), 5),
            "quantized_slots": len(qslots),
            "read_slots": n,
        }
        del store, gstore
        print(f"error {m}: keys {out[m]['key_rel_err']['mean']:.4f}, values {out[m]['value_rel_err']['mean']:.4f}, "
              f"attention out {out[m]['attn_out_rel_err']['mean']:.4f} (max {out[m]['attn_out_rel_err']['max']:.4f}); "
              f"Gaussian keys {out[m]['gaussian_key_rel_err']:.4f}", flush=True)  # fmt: skip
    return out


def summary(xs: list[float]) -> dict:
    return {"mean": round(statistics.fmean(xs), 5), "max": round(max(xs), 5), "min": round(min(xs), 5)}


# -- drift -------------------------------------------------------------------------------------


@torch.inference_mode()
def drift_part(gen, specs: dict, args) -> dict:
    dev = gen.device
    runs = {}
    plan = [("bf16", specs["bf16"]), ("bf16_rerun", specs["bf16"])] + [(m, s) for m, s in specs.items() if m != "bf16"]
    for name, spec in plan:
        t0 = time.perf_counter()
        state = gen.open_stream(f"drift-{name}", PROMPT, seed=args.seed, cache=StreamCache(spec, dev))
        runs[name] = [x.float() for x in run_chunks(gen, state, args.chunks)]
        del state
        print(f"drift {name}: {args.chunks} chunks in {time.perf_counter() - t0:.1f} s", flush=True)
    ref = runs["bf16"]
    out = {}
    for name, lat in runs.items():
        if name == "bf16":
            continue
        per_chunk = [round(rel(a, b), 5) for a, b in zip(lat, ref)]
        out[name] = {"rel_latent_err_per_chunk": per_chunk, "last": per_chunk[-1], "max": max(per_chunk)}
        print(f"drift {name}: per chunk {per_chunk}", flush=True)
    return out


# -- speed -------------------------------------------------------------------------------------


class Timer:
    """Wall time of a region, with CUDA events on the GPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __enter__(self):
        if self.cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            self.end.record()
        else:
            self.t1 = time.perf_counter()

    @property
    def ms(self) -> float:
        if self.cuda:
            self.end.synchronize()
            return self.start.elapsed_time(self.end)
        return (self.t1 - self.t0) * 1e3


@torch.inference_mode()
def speed_part(gen, specs: dict, args) -> dict:
    from models.dit import CacheAccess

    model, dev, mc = gen.model, gen.device, gen.model_cfg
    nf, steps = gen.cfg.frames_per_chunk, len(gen.sigmas)
    out: dict = {}
    for m, spec in specs.items():
        cache = StreamCache(spec, dev)
        state = gen.open_stream(f"speed-{m}", PROMPT, seed=args.seed, cache=cache)
        run_chunks(gen, state, chunks_to_fill(spec, nf))  # full, rolling
        n = cache.num_frames
        g = torch.Generator(device=dev).manual_seed(args.seed)
        x = torch.randn(1, mc.in_channels, nf, mc.latent_height, mc.latent_width, generator=g, device=dev)
        t_noisy = torch.full((1, nf), 937.5, device=dev)
        t_clean = torch.zeros(1, nf, device=dev)

        def chunk(record: bool):
            times = []
            for _ in range(steps):  # denoising forwards: read the full cache
                with Timer(dev) as tm:
                    model(x, t_noisy, state.text, [CacheAccess(cache, n)])
                times.append(("denoise", tm))
            slots = cache.plan_commit(nf)  # commit forward: read, then write (and quantize) the chunk
            with Timer(dev) as tm:
                model(x, t_clean, state.text, [CacheAccess(cache, n, write_slots=slots)])
            cache.advance(slots)
            times.append(("commit", tm))
            return times if record else []

        for _ in range(2):  # warm-up: compile kernels, fill allocator caches
            chunk(False)
        sync(dev)
        recs = [r for _ in range(args.iters) for r in chunk(True)]
        den = [tm.ms for kind, tm in recs if kind == "denoise"]
        com = [tm.ms for kind, tm in recs if kind == "commit"]
        flops = mc.flops_per_forward(nf, n + nf)
        # the storage read alone: every layer, as one forward reads them
        reads = []
        for _ in range(3):
            with Timer(dev) as tm:
                for layer in range(spec.num_layers):
                    cache.read(layer, n)
            reads.append(tm.ms)
        read_ms = statistics.median(reads) / spec.num_layers
        moved = read_bytes_moved(spec, cache)
        out[m] = {
            "read_frames": n,
            "denoise_ms": round(statistics.median(den), 3),
            "commit_ms": round(statistics.median(com), 3),
            "chunk_forwards_ms": round(statistics.median(den) * steps + statistics.median(com), 3),
            "denoise_tflops": round(flops / statistics.median(den) / 1e9, 1),
            "read_ms_per_layer": round(read_ms, 4),
            "read_gbps": round(moved / read_ms / 1e6, 1) if m != "bf16" else None,
            "read_bytes_moved_per_layer": moved if m != "bf16" else 0,
        }
        print(f"speed {m}: denoise {out[m]['denoise_ms']:.2f} ms ({out[m]['denoise_tflops']} TFLOP/s), "
              f"commit {out[m]['commit_ms']:.2f} ms, read {read_ms * 1e3:.1f} us/layer", flush=True)  # fmt: skip
        del cache, state
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    base = out["bf16"]
    for m in out:
        if m != "bf16":
            out[m]["denoise_overhead_pct"] = round(100 * (out[m]["denoise_ms"] / base["denoise_ms"] - 1), 2)
            out[m]["commit_overhead_pct"] = round(100 * (out[m]["commit_ms"] / base["commit_ms"] - 1), 2)
            out[m]["chunk_overhead_pct"] = round(100 * (out[m]["chunk_forwards_ms"] / base["chunk_forwards_ms"] - 1), 2)
    return out


def read_bytes_moved(spec: CacheSpec, cache: StreamCache) -> int:
    """HBM bytes one layer read of a quantized cache moves: packed frames + dense frames read, the output written."""
    store = cache.storage
    if not isinstance(store, QuantStorage):
        return 0
    elem = torch.empty((), dtype=spec.torch_dtype).element_size()
    frame = spec.tokens_per_frame * spec.num_heads * spec.head_dim * elem * 2  # K + V of one layer
    kinds = [kind for kind, _ in store.maps[0].loc[: cache.num_frames]]
    q = sum(k == QUANT for k in kinds)
    return (len(kinds) - q) * frame + q * quant_frame_bytes(spec) // spec.num_layers + len(kinds) * frame


if __name__ == "__main__":
    main()
