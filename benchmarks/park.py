"""Pause and resume: how long parking a stream's whole state in host memory takes, and what it frees.

    python benchmarks/park.py                                  # CUDA: wan2.1-1.3b, random weights, sink 3 + window 9
    python benchmarks/park.py --device cpu                     # the tiny preset on CPU (a quick check)
    python benchmarks/park.py --preset wan2.1-1.3b --kv-quant int4

A stream's cache is filled to its full window by running chunks (eager forwards, no graphs), then it is
parked (ChunkGenerator.park: the KV cache, text K/V, decoder state and latents copied to pinned host memory on
a side stream; the pool's reservation released) and restored into a fresh cache from the pool, --reps times
after one warm-up round (the first pinned allocation is reported apart as "cold"). Each round synchronizes
before and after. Times: "copy" is the copies on the copy stream (CUDA events), "wall" the host's time from
the call to the copies' end (pinned allocation included). Reported: bytes moved, median and p95 of each,
GB/s of the copies, the device memory freed (torch.cuda.memory_allocated before and after the park) and the
pool's bytes given back, and whether the restored cache equals what was parked. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvcache import CachePool  # noqa: E402
from models import GeneratorConfig, build_generator  # noqa: E402

PROMPT = "a red fox running through fresh snow at dawn, cinematic"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _allocated(device: torch.device) -> int | None:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


def _p(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--preset", default=None, help="model preset (default: wan2.1-1.3b on CUDA, tiny on CPU)")
    ap.add_argument("--sink-frames", type=int, default=3)
    ap.add_argument("--window-frames", type=int, default=9)
    ap.add_argument("--kv-quant", default="none", choices=("none", "int4", "int2"))
    ap.add_argument("--reps", type=int, default=10, help="timed park + restore rounds (after one warm-up round)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    preset = args.preset or ("wan2.1-1.3b" if device.type == "cuda" else "tiny")

    t0 = time.perf_counter()
    cfg = GeneratorConfig(sink_frames=args.sink_frames, window_frames=args.window_frames, kv_quant=args.kv_quant,
                          cuda_graphs=False)
    gen = build_generator(preset, device=device, seed=args.seed, cfg=cfg)
    spec = gen.cache_spec()
    pool = CachePool(spec.stream_bytes() + gen.decoder_state_bytes() + 1, device)
    cache = pool.allocate_or_raise("s", spec, gen.decoder_state_bytes())
    state = gen.open_stream("s", PROMPT, seed=args.seed, cache=cache)
    it = gen.stream(state)
    chunks = 0
    while state.cache.num_frames < spec.capacity_frames:  # fill the window
        next(it)
        chunks += 1
    _sync(device)
    print(f"{preset} on {device}: {chunks} chunks filled the cache ({spec.capacity_frames} frames, "
          f"{spec.stream_bytes() / 2**20:.1f} MiB of KV) in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    del cache

    rounds = []
    for rep in range(args.reps + 1):
        _sync(device)
        before, pool_before = _allocated(device), pool.used_bytes
        t = time.perf_counter()
        parked = gen.park(state)
        while not parked.done():
            time.sleep(1e-4)
        _sync(device)
        park_wall = time.perf_counter() - t
        park_copy = parked.seconds
        released = pool.release("s")  # the pool's accounting: its reservation goes back
        _sync(device)
        after = _allocated(device)
        t = time.perf_counter()
        cache = pool.allocate_or_raise("s", spec, gen.decoder_state_bytes())  # taken again
        gen.restore(parked, cache)
        while not parked.done():
            time.sleep(1e-4)
        _sync(device)
        restore_wall = time.perf_counter() - t
        rounds.append(dict(
            park_wall=park_wall, park_copy=park_copy, restore_wall=restore_wall, restore_copy=parked.seconds,
            nbytes=parked.nbytes, kv_bytes=parked.cache.nbytes, freed=None if before is None else before - after,
            pool_released=released, pool_before=pool_before, pool_after_park=pool_before - released,
            pool_after_restore=pool.used_bytes,
        ))
        if rep == args.reps:  # the last restore: what came back equals what was parked
            host = parked.cache.moved.tensors + parked.moved.tensors
            back = state.cache.storage.tensors() + [t for t in _device_fields(state)]
            exact = len(host) == len(back) and all(torch.equal(h, b.cpu()) for h, b in zip(host, back))
        del parked, cache

    cold, timed = rounds[0], rounds[1:]
    nbytes = timed[0]["nbytes"]
    med = {k: _p([r[k] for r in timed], 0.5) for k in ("park_wall", "park_copy", "restore_wall", "restore_copy")}
    p95 = {k: _p([r[k] for r in timed], 0.95) for k in med}
    result = {
        "benchmark": "park",
        "preset": preset,
        "device": str(device) if device.type != "cuda" else torch.cuda.get_device_name(device),
        "sink_frames": args.sink_frames,
        "window_frames": args.window_frames,
        "kv_quant": args.kv_quant,
        "decoder": type(gen.decoder).__name__,
        "reps": args.reps,
        "bytes_moved": nbytes,
        "kv_bytes": timed[0]["kv_bytes"],
        "other_bytes": nbytes - timed[0]["kv_bytes"],  # text K/V, decoder state, clean latents
        **{f"{k}_median_ms": round(1e3 * v, 3) for k, v in med.items()},
        **{f"{k}_p95_ms": round(1e3 * v, 3) for k, v in p95.items()},
        "park_gbps": round(nbytes / med["park_copy"] / 1e9, 2) if med["park_copy"] > 0 else None,
        "restore_gbps": round(nbytes / med["restore_copy"] / 1e9, 2) if med["restore_copy"] > 0 else None,
        "cold_park_wall_ms": round(1e3 * cold["park_wall"], 3),
        "device_bytes_freed": timed[0]["freed"],  # torch.cuda.memory_allocated before - after the park (None on CPU)
        "pool_bytes_released": timed[0]["pool_released"],  # the pool's reservation, decoder state included
        "pool_used_before_after_park_after_restore": [timed[0]["pool_before"], timed[0]["pool_after_park"],
                                                      timed[0]["pool_after_restore"]],
        "exact": exact,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    print(f"parked {nbytes / 2**20:.1f} MiB ({result['kv_bytes'] / 2**20:.1f} MiB of KV): park {med['park_copy'] * 1e3:.1f} ms "
          f"copy / {med['park_wall'] * 1e3:.1f} ms wall (p95 {p95['park_wall'] * 1e3:.1f}), restore "
          f"{med['restore_copy'] * 1e3:.1f} / {med['restore_wall'] * 1e3:.1f} ms (p95 {p95['restore_wall'] * 1e3:.1f}); "
          f"device memory freed {result['device_bytes_freed']}, pool released {result['pool_bytes_released']}; "
          f"exact {exact}", file=sys.stderr)
    print(json.dumps(result))
    return result


def _device_fields(state) -> list[torch.Tensor]:
    """The restored state's tensors besides its cache, in the order parking copied them."""
    from models.generator import _tensors
    from models.stream import PARKED_FIELDS

    return _tensors({name: getattr(state, name) for name in PARKED_FIELDS})


if __name__ == "__main__":
    main()
