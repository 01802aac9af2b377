"""Speed and drift of each speed option and fidelity tier against the exact (bf16 reference) run.

For each variant (a set of speed options, models/fidelity.py) one stream runs `--chunks` chunks from the same
seed and prompts as the exact run: `--prompt`, switched to `--prompt2` before chunk `--switch-at` (a recache, the
same in every variant); then, at a full cache, `--timed-chunks` more are timed, and `--timed-recaches` prompt
switches. Reported per variant:
- drift: the relative latent error of the last of the `--chunks` chunks (||x - x_exact|| / ||x_exact||), its
  mean over all of them and over those from the switch on (what a recache option changes), and the PSNR (dB) of
  the decoded frames against the exact run's, over all chunks and for the last one. Each chunk's noise is
  seeded from (seed, chunk index), so that a variant with fewer steps (which draws fewer re-noising samples)
  starts each chunk from the same noise as the exact run. Random weights make this a proxy (their flow is not a
  trained one); `--weights builtin` (tiny preset) measures it on the trained built-in model;
- speed: ms of a denoising forward (median, full cache; a later step, which reads the keys rotated by the
  first), ms of the commit forward (0 with commit reuse), DiT ms per chunk (its forwards) and ms per chunk
  with the decode, each the median over the timed chunks, and forwards per chunk; ms of a recache at a full cache
  (the whole call, its forwards and any K/V it moves) and its forwards, the median over the timed recaches.

    python benchmarks/fidelity.py --preset tiny --device cpu                      # CPU smoke, random weights
    python benchmarks/fidelity.py --preset tiny --device cpu --weights builtin    # the trained tiny model
    python benchmarks/fidelity.py --preset wan2.1-1.3b --device cuda --compile    # the H200 table

Forwards run through the generator's path (CUDA graphs on CUDA, captured on first sight during the drift run,
so warm-up and capture stay out of the timed chunks). Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models import ChunkGenerator, GeneratorConfig, WorkKind, build_generator, fidelity  # noqa: E402

# name -> speed options (None: the tier's defaults on the device)
VARIANTS: dict[str, list[str] | None] = {
    "exact": [],
    "fp8-linears": ["fp8-linears"],
    "int8-attention": ["int8-attention"],
    "quantized": ["fp8-linears", "int8-attention"],
    "steps-3": ["steps-3"],
    "steps-2": ["steps-2"],
    "commit-reuse": ["commit-reuse"],
    "recache-last": ["recache-last"],
    "approximate": ["fp8-linears", "int8-attention", "steps-3", "commit-reuse"],
    "approximate-2": ["fp8-linears", "int8-attention", "steps-2", "commit-reuse"],
}


def log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


def elapsed_ms(fn, cuda: bool) -> float:
    """ms that fn() takes: on CUDA between events around it (the device's time, after a synchronize)."""
    if not cuda:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b)


class ForwardTimer:
    """Wraps a generator's runner: the time of each forward, by kind (denoise, commit, recache)."""

    def __init__(self, gen: ChunkGenerator) -> None:
        self.gen, self.inner = gen, gen.runner
        self.cuda = gen.device.type == "cuda"
        self.on = False
        self.marks: list[tuple[str, object, object]] = []
        self.kind = "recache"
        gen.runner = self
        for kind in ("denoise", "commit"):  # what the forwards that follow are, without reading t on the device
            setattr(gen, kind, self._marking(kind, getattr(gen, kind)))

    def _marking(self, kind, fn):
        def run(*a, **kw):
            self.kind = kind
            try:
                return fn(*a, **kw)
            finally:
                self.kind = "recache"

        return run

    def __call__(self, x, t, text, access):
        if not self.on:
            return self.inner(x, t, text, access)
        kind = self.kind
        if self.cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            out = self.inner(x, t, text, access)
            b.record()
        else:
            a = time.perf_counter()
            out = self.inner(x, t, text, access)
            b = time.perf_counter()
        self.marks.append((kind, a, b))
        return out

    def take(self) -> dict[str, list[float]]:
        """ms of the forwards since the last take, by kind."""
        if self.cuda:
            torch.cuda.synchronize()
        out: dict[str, list[float]] = {"denoise": [], "commit": [], "recache": []}
        for kind, a, b in self.marks:
            out[kind].append(a.elapsed_time(b) if self.cuda else (b - a) * 1e3)
        self.marks = []
        return out


def attention_check(gen: ChunkGenerator, state) -> dict:
    """INT8 against exact attention on the model's own self-attention inputs: one denoising forward of the
    stream at its current (full) cache, every layer's queries, keys and values; relative error per layer."""
    import torch.nn.functional as F

    from models import sage

    errs = []
    real = sage.attend

    def spy(q, k, v):
        out = real(q, k, v)
        want = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
        errs.append(((out.float() - want.float()).norm() / want.float().norm()).item())
        return out

    runner, gen.runner = gen.runner, gen.model  # eager: a graph replay would not call the spy
    sage.attend = spy
    try:
        gen.abandon_chunk(state)
        gen.denoise([state])
    finally:
        sage.attend = real
        gen.runner = runner
        gen.abandon_chunk(state)
    return {"layers": len(errs), "rel_err_mean": round(statistics.mean(errs), 5), "rel_err_max": round(max(errs), 5)}


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = (a.float() - b.float()).pow(2).mean().item()
    return float("inf") if mse == 0 else 10 * math.log10(255.0**2 / mse)


def run_variant(name, options, base_gen, base_cfg, models, args, ref) -> dict:
    """One stream of `args.chunks` chunks (drift against `ref`, or become the reference), then timed chunks."""
    device = base_gen.device
    cfg = fidelity.configure(base_cfg, None, options, device.type)
    if cfg.fp8_linears and "fp8" not in models:
        models["fp8"] = copy.deepcopy(models["exact"])  # quantized once, shared by the FP8 variants
    model = models["fp8" if cfg.fp8_linears else "exact"]
    gen = ChunkGenerator(model, cfg, base_gen.text_encoder, base_gen.decoder)
    timer = ForwardTimer(gen)
    start = gen.start_chunk

    def start_aligned(st):  # chunk k starts from the same noise in every variant, whatever the steps before drew
        st.noise.manual_seed(args.seed * 100_003 + st.chunks_done)
        start(st)

    gen.start_chunk = start_aligned
    state = gen.open_stream("fidelity", args.prompt, seed=args.seed)
    switched = 0 < args.switch_at < args.chunks  # chunks [switch_at, chunks) are the new prompt's
    it = gen.stream(state, {args.switch_at: args.prompt2} if switched else None)
    lat, frames = [], []
    t0 = time.perf_counter()
    for _ in range(args.chunks):
        c = next(it)
        lat.append(c.latents.float().clone())
        frames.append(c.frames.clone())
    drift_s = time.perf_counter() - t0
    check = attention_check(gen, state) if cfg.attention_quant == "int8" else None
    # timed chunks at a full cache (the drift run filled it and captured every graph it replays)
    chunk_ms, dit_ms, den, com = [], [], [], []
    cuda = device.type == "cuda"
    for _ in range(args.timed_chunks):
        timer.on = True
        chunk_ms.append(elapsed_ms(lambda: next(it), cuda))
        f = timer.take()
        timer.on = False
        dit_ms.append(sum(f["denoise"]) + sum(f["commit"]))
        den += f["denoise"][1:]  # later steps: the first rotates the cached keys
        com += f["commit"]
    # timed prompt switches at a full cache, each followed by a chunk (untimed) so that the ring turns between
    # them; the first is a warm-up (on CUDA it may capture a graph the drift run did not)
    recache_ms, recache_fwd_ms, recache_fwd = [], [], []
    for i in range(args.timed_recaches + 1 if args.timed_recaches > 0 else 0):
        gen.set_prompt(state, (args.prompt, args.prompt2)[i % 2])
        timer.on = True
        ms = elapsed_ms(lambda: gen.run(WorkKind.RECACHE, [state]), cuda)
        f = timer.take()
        timer.on = False
        if i > 0:
            recache_ms.append(ms)
            recache_fwd_ms.append(sum(f["recache"]))
            recache_fwd.append(len(f["recache"]))
        next(it)
    steps = len(gen.sigmas)
    row = {
        "variant": name,
        "options": fidelity.active(cfg),
        "tier": fidelity.tier_of(fidelity.active(cfg)),
        "steps": steps,
        "forwards_per_chunk": steps + (0 if cfg.commit_reuse else 1),
        "denoise_ms": round(statistics.median(den), 3) if den else None,
        "commit_ms": round(statistics.median(com), 3) if com else 0.0,
        "dit_chunk_ms": round(statistics.median(dit_ms), 2),
        "chunk_ms": round(statistics.median(chunk_ms), 2),
        "recache_ms": round(statistics.median(recache_ms), 2) if recache_ms else None,  # the whole call
        "recache_fwd_ms": round(statistics.median(recache_fwd_ms), 2) if recache_fwd_ms else None,  # its forwards
        "recache_forwards": recache_fwd[0] if recache_fwd else None,
        "drift_run_s": round(drift_s, 1),
        "int8_attention_vs_exact": check,  # on the model's own activations, per layer (int8-attention only)
    }
    if ref is None:
        row.update(rel_err_last=0.0, rel_err_mean=0.0, rel_err_switched=0.0 if switched else None, psnr_db=None,
                   psnr_last_db=None)
        ref = (lat, frames)
    else:
        errs = [((x - r).norm() / r.norm()).item() for x, r in zip(lat, ref[0])]
        row.update(
            rel_err_last=round(errs[-1], 5),
            rel_err_mean=round(statistics.mean(errs), 5),
            rel_err_switched=round(statistics.mean(errs[args.switch_at:]), 5) if switched else None,
            psnr_db=round(psnr(torch.cat(frames), torch.cat(ref[1])), 2),
            psnr_last_db=round(psnr(frames[-1], ref[1][-1]), 2),
        )
    gen.close_stream(state)
    del gen, state, it
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return row, ref


COLUMNS = (("variant", "variant", "{}"), ("tier", "tier", "{}"), ("steps", "steps", "{}"), ("fwd", "forwards_per_chunk", "{}"),
           ("denoise_ms", "denoise_ms", "{:.2f}"), ("commit_ms", "commit_ms", "{:.2f}"), ("dit_chunk_ms", "dit_chunk_ms", "{:.1f}"),
           ("chunk_ms", "chunk_ms", "{:.1f}"), ("recache_ms", "recache_ms", "{:.2f}"), ("rc_fwd", "recache_forwards", "{}"),
           ("rel_err@N", "rel_err_last", "{:.4f}"), ("rel_err_mean", "rel_err_mean", "{:.4f}"),
           ("rel_err_sw", "rel_err_switched", "{:.4f}"), ("psnr_dB", "psnr_db", "{:.1f}"), ("psnr@N_dB", "psnr_last_db", "{:.1f}"))


def format_table(rows: list[dict]) -> str:
    ok = [r for r in rows if "error" not in r]
    cells = [[h for h, _, _ in COLUMNS]] + [["-" if r[k] is None else f.format(r[k]) for _, k, f in COLUMNS] for r in ok]
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in cells]
    return "\n".join(lines + [f"{r['variant']}: failed: {r['error']}" for r in rows if "error" in r])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--weights", default="random", help="random (default), builtin (the trained tiny model) or a model file")
    p.add_argument("--checkpoint", default=None, help="DiT weights (file or Wan folder) instead of random ones")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma list of {', '.join(VARIANTS)} (exact always runs first: the reference)")
    p.add_argument("--chunks", type=int, default=20, help="chunks per variant before the drift is read (default 20)")
    p.add_argument("--timed-chunks", type=int, default=5, help="chunks timed after them, at a full cache (default 5)")
    p.add_argument("--timed-recaches", type=int, default=5,
                   help="prompt switches timed after those, at a full cache, a chunk after each (default 5)")
    p.add_argument("--sink-frames", type=int, default=3)
    p.add_argument("--window-frames", type=int, default=9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt", default="a red ball moving right")
    p.add_argument("--prompt2", default="a blue ball moving left", help="the prompt switched to at --switch-at")
    p.add_argument("--switch-at", type=int, default=10,
                   help="the chunk from which --prompt2 holds (a recache before it); 0 or >= --chunks: no switch (default 10)")
    p.add_argument("--compile", action="store_true", help="torch.compile the elementwise helpers (CUDA; as serve does)")
    p.add_argument("--no-cuda-graphs", action="store_true")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    for n in names:
        if n not in VARIANTS:
            p.error(f"variant {n!r} is unknown; use {', '.join(VARIANTS)}")
    names = ["exact"] + [n for n in names if n != "exact"]

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    base_cfg = GeneratorConfig(sink_frames=args.sink_frames, window_frames=args.window_frames,
                               cuda_graphs=not args.no_cuda_graphs)
    t0 = time.time()
    base = build_generator(args.preset, device=device, dtype=dtype, cfg=base_cfg, checkpoint=args.checkpoint,
                           weights=None if args.checkpoint else args.weights)
    if args.compile:
        from models.dit_ops import compile_helpers

        compile_helpers()
    log(f"model built in {time.time() - t0:.1f} s")
    models = {"exact": base.model}
    rows, ref = [], None
    for name in names:
        t0 = time.time()
        try:
            row, ref = run_variant(name, VARIANTS[name], base, base_cfg, models, args, ref)
        except Exception as e:  # noqa: BLE001 - one variant's failure (e.g. a kernel that does not build) is reported, the rest run
            if ref is None:
                raise
            log(f"{name}: failed: {type(e).__name__}: {e}")
            rows.append({"variant": name, "error": f"{type(e).__name__}: {str(e)[:300]}"})
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        rows.append(row)
        log(f"{name}: {row['dit_chunk_ms']} ms DiT per chunk, rel err {row['rel_err_last']}, PSNR {row['psnr_db']} dB "
            f"({time.time() - t0:.0f} s)")
        if row.get("int8_attention_vs_exact"):
            log(f"{name}: INT8 attention on the model's own activations vs exact: {row['int8_attention_vs_exact']}")
    switch = (f"prompt switched at chunk {args.switch_at}, rel_err_sw: the mean from it"
              if 0 < args.switch_at < args.chunks else "no prompt switch")
    print(f"fidelity at {args.preset} on {args.device} ({dtype}, weights {args.checkpoint or args.weights}), "
          f"sink {args.sink_frames} + window {args.window_frames}: drift after {args.chunks} chunks against exact "
          f"({switch}), ms medians of {args.timed_chunks} chunks and {args.timed_recaches} recaches at a full cache")
    print(format_table(rows))
    for r in rows:
        if r.get("int8_attention_vs_exact"):
            c = r["int8_attention_vs_exact"]
            print(f"{r['variant']}: INT8 self-attention against exact on the model's own inputs (one forward at a full "
                  f"cache, {c['layers']} layers): relative error mean {c['rel_err_mean']}, max {c['rel_err_max']}")
    result = {
        "bench": "fidelity",
        "preset": args.preset,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(dtype).replace("torch.", ""),
        "weights": args.checkpoint or args.weights,
        "chunks": args.chunks,
        "timed_chunks": args.timed_chunks,
        "timed_recaches": args.timed_recaches,
        "prompt": args.prompt,
        "prompt2": args.prompt2,
        "switch_at": args.switch_at,
        "sink_frames": args.sink_frames,
        "window_frames": args.window_frames,
        "compile": args.compile,
        "cuda_graphs": device.type == "cuda" and not args.no_cuda_graphs,
        "rows": rows,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
