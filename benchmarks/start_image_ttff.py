"""TTFF from a start image beside TTFF without: `streamsvc loadtest` runs, alternating with and without --start-image.

    python -m benchmarks.start_image_ttff                    # 3 rounds, --streams 4 --duration 20, a drawn 128x128 PNG
    python -m benchmarks.start_image_ttff --rounds 5 --image photo.jpg --server-arg=--kv-quant=int4

(from the repository root). Each round runs the load test twice on a fresh local server (the built-in model, CPU),
once without an image and once with every stream starting from it, the order alternating between rounds so that a
drift in the host's speed falls on both. The image defaults to one drawn here (a teal square on beige, 128x128, a
PNG of a few hundred bytes: inline in each start); a file over 45 KiB is uploaded once before the streams connect
(not in their TTFF). Prints one line per run and a table, then one JSON line: per run the TTFF p50 / p95 / max, the
stalls and the admitted streams, and the medians of the TTFF p50 over the rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np


def drawn_png() -> bytes:
    """A 128x128 PNG: a teal square on beige, off-centre (no palette colour of models/scenes.py)."""
    import fractions

    import av

    img = np.empty((128, 128, 3), np.uint8)
    img[:] = (235, 215, 175)
    img[66:94, 26:54] = (20, 170, 160)
    ctx = av.CodecContext.create("png", "w")
    ctx.width, ctx.height, ctx.pix_fmt, ctx.time_base = 128, 128, "rgb24", fractions.Fraction(1, 1)
    frame = av.VideoFrame.from_ndarray(img, format="rgb24")
    return b"".join(bytes(p) for p in [*ctx.encode(frame), *ctx.encode(None)])


def one_run(args, image: Path | None, out: Path) -> dict:
    cmd = [sys.executable, "-m", "streamsvc.cli", "loadtest", "--streams", str(args.streams), "--duration",
           str(args.duration), "--progress-every", "0", "--json", str(out),
           *(f"--server-arg={a}" for a in args.server_arg)]
    if image is not None:
        cmd += ["--start-image", str(image)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.duration + 300)
    if done.returncode != 0:
        raise SystemExit(f"the load test failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    r = json.loads(out.read_text())
    ttff = r["ttff_s"]
    return {"image": image is not None, "admitted": r["admitted"], "ttff_p50_s": ttff.get("p50"),
            "ttff_p95_s": ttff.get("p95"), "ttff_max_s": ttff.get("max"), "stalls": r["stalls"]["count"]}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3, help="runs with and without the image, each (default 3)")
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--duration", type=float, default=20.0)
    p.add_argument("--image", default=None, help="the start image (default: a 128x128 PNG drawn here)")
    p.add_argument("--server-arg", action="append", default=[], help="passed to the load test's local server")
    args = p.parse_args(argv)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        image = Path(args.image) if args.image else Path(tmp) / "start.png"
        if not args.image:
            image.write_bytes(drawn_png())
        for i in range(args.rounds):
            for with_image in ((False, True) if i % 2 == 0 else (True, False)):
                run = one_run(args, image if with_image else None, Path(tmp) / f"run{len(runs)}.json")
                runs.append({"round": i, **run})
                print(f"round {i} {'image   ' if with_image else 'no image'}: admitted {run['admitted']}, TTFF p50 "
                      f"{run['ttff_p50_s']} s, p95 {run['ttff_p95_s']} s, max {run['ttff_max_s']} s, stalls "
                      f"{run['stalls']}", flush=True)
    medians = {}
    for key, with_image in (("no_image", False), ("image", True)):
        p50s = [r["ttff_p50_s"] for r in runs if r["image"] is with_image and r["ttff_p50_s"] is not None]
        medians[key] = round(statistics.median(p50s), 3) if p50s else None
    print(f"\n| TTFF p50 (median of {args.rounds} runs) | without an image | with an image |\n|---|---|---|\n"
          f"| --streams {args.streams} --duration {args.duration:g} | {medians['no_image']} s | {medians['image']} s |")
    result = {"streams": args.streams, "duration_s": args.duration, "image": str(args.image or "drawn 128x128 PNG"),
              "ttff_p50_median_s": medians, "runs": runs}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
