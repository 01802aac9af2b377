"""The service end to end: the real server and the real load-test viewers over WebSocket, N raised until stalls.

    python benchmarks/service.py --preset wan2.1-1.3b --device cuda --max-streams 6 --serve-arg=--compile
    python benchmarks/service.py --preset tiny --device cpu --max-streams 2 --duration 8     # a CPU smoke run
    python benchmarks/service.py --url ws://127.0.0.1:8000/ws --max-streams 4                # a running server
    python benchmarks/service.py --preset wan2.1-1.3b --fidelity exact,quantized,approximate --start 2 --max-streams 5
    python benchmarks/service.py --preset tiny --device cpu --input synthetic --start 6 --max-streams 16 --step 2

What it does, in one invocation:

1. Times the generator's chunk the way `benchmarks/generator.py` does (run as a child process with
   `--only-chunk`): 4 denoising forwards + the commit at a full cache (sink + window frames), recache and
   decode excluded, warm-up and capture kept out. Flags of the server that change that cost (`--compile`,
   `--kv-quant`, `--sink-frames`, `--window-frames`, and the weights: `--wan-dir`,
   `--checkpoint`, `--decoder`, `--taehv`) go to the benchmark too.
2. Starts `python -m streamsvc.cli serve --preset P --device D --port PORT [--serve-arg ...]` and waits
   (bounded by --server-timeout, a progress line every 10 s) for `GET /healthz` to answer 200; the start
   of a GPU server includes compile and CUDA-graph capture. With --url it uses that server instead.
3. For N = 1, 1 + step, ... up to --max-streams runs `python -m streamsvc.cli loadtest --url ... --streams N`
   (every viewer connects at once, a new prompt every --prompt-every seconds) and reads its JSON report.
   It stops raising N after the first run with stalls, refusals (the admitted count stops growing) or a
   failed load test, then stops the server (SIGINT, bounded wait, then SIGKILL).

With `--input synthetic` (or `--input FILE`) every viewer sends its camera (a rendered scene of models/scenes.py, or
the file, looped) as the stream's input video (issue 35, `loadtest --input`), at `--strength`; the rows then carry
glass-to-glass p50 / p95 (capture -> played) too.

For each N it reports admitted / refused (and the first refusal's reason), stalls and the stall ratio,
TTFF and control latency p50 / p95, delivered fps (mean per stream and the sum), chunk latency mean / max
and the chunks over 1 s, and the engine's cost per chunk while serving: device time (CUDA events; on CPU
the wall time) and wall time of `steps` denoising forwards + one commit, and the output stage (frames to
host, x264, packing) per chunk, beside the generator benchmark's chunk and the ratio of the two (device
time while serving / benchmark: above 1 is what serving adds to the same forwards). The engine's figures
are per forward; with batching (CPU default: up to 4 streams per forward) a forward serves several chunks.

With `--fidelity T1,T2,...` it does all that once per tier (`streamsvc serve --fidelity T`, the benchmark with
`--fidelity T`), a server each, and reports the streams at 0 stalls of each tier. With `--latency default,low` the
same once per latency mode (`streamsvc serve --latency M`; the benchmark at the mode's chunk size), and with both,
once per mode and tier: the streams per device that each chunk size costs.

Prints a table, then one JSON line with everything (`largest_stall_free_n`: the largest N at which every
viewer was admitted and none stalled; with several tiers, `by_fidelity` holds each tier's result and
`largest_stall_free_n` maps tier -> N). Logs of the children are kept in --log-dir (default: a temp dir).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from client.loadtest import free_port, http_status, metrics_url, scrape_metrics  # noqa: E402
from client.ws_client import stream_url  # noqa: E402

DEFAULT_STEPS = 4  # denoising forwards per chunk, when the generator benchmark does not say


def log(*parts) -> None:
    print(*parts, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- arguments


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny", help="model preset of the server and the benchmark (default tiny)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default auto: cuda if present)")
    p.add_argument("--max-streams", type=int, default=8, help="largest N of viewers tried (default 8)")
    p.add_argument("--step", type=int, default=1, help="N grows by this much per run (default 1)")
    p.add_argument("--duration", type=float, default=30.0, help="seconds each load test's viewers watch (default 30)")
    p.add_argument("--prompt-every", type=float, default=5.0, help="seconds between a viewer's prompts (default 5; 0 = never)")
    p.add_argument("--port", type=int, default=0, help="the server's port (default 0: a free one)")
    p.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for `streamsvc serve` (repeatable, e.g. --serve-arg=--compile)")
    p.add_argument("--url", default=None, help="use the server at this WebSocket URL instead of starting one")
    p.add_argument("--no-bench", action="store_true", help="skip the generator benchmark (no ratio column)")
    p.add_argument("--bench-iters", type=int, default=10, help="--iters of benchmarks/generator.py (default 10)")
    p.add_argument("--bench-timeout", type=float, default=900.0, help="seconds the generator benchmark may take (default 900)")
    p.add_argument("--server-timeout", type=float, default=600.0,
                   help="seconds to wait for the server's /healthz (default 600: compile and graph capture)")
    p.add_argument("--log-dir", default=None, help="where the children's logs and reports go (default: a temp dir)")
    p.add_argument("--fidelity", default=None, metavar="TIER[,TIER...]",
                   help="serve (and benchmark) under `--fidelity TIER`, one sweep per tier with a server of its own, "
                        "e.g. exact,quantized,approximate: streams at 0 stalls per tier (default: no --fidelity)")
    p.add_argument("--latency", default=None, metavar="MODE[,MODE...]",
                   help="serve under `--latency MODE`, one sweep per mode (and per --fidelity tier), e.g. default,low: "
                        "streams at 0 stalls per chunk size (default: no --latency)")
    p.add_argument("--speed-options", default=None, metavar="LIST",
                   help="`--speed-options LIST` for every tier's server and benchmark (default: each tier's own)")
    p.add_argument("--start", type=int, default=1, help="first N of viewers tried (default 1)")
    p.add_argument("--input", default=None, metavar="synthetic|FILE",
                   help="every viewer sends input video for its stream to restyle (loadtest --input): streams per "
                        "device at 0 stalls with input, and glass-to-glass latency")
    p.add_argument("--strength", type=float, default=None, help="with --input: the streams' strength (loadtest --strength)")
    args = p.parse_args(argv)
    if args.max_streams < 1 or args.step < 1 or args.duration <= 0 or not 1 <= args.start <= args.max_streams:
        p.error(f"--max-streams and --step must be >= 1, --start in [1, --max-streams] and --duration > 0; got "
                f"--max-streams {args.max_streams} --step {args.step} --start {args.start} --duration {args.duration}")
    args.tiers = [t.strip() for t in args.fidelity.split(",") if t.strip()] if args.fidelity else [None]
    for tier in args.tiers:
        if tier not in (None, "exact", "quantized", "approximate"):
            p.error(f"--fidelity {tier!r}: use exact, quantized or approximate (comma list)")
    args.latencies = [m.strip() for m in args.latency.split(",") if m.strip()] if args.latency else [None]
    for mode in args.latencies:
        if mode not in (None, "default", "low"):
            p.error(f"--latency {mode!r}: use default or low (comma list)")
    if args.url and len(args.tiers) * len(args.latencies) > 1:
        p.error("--url serves one configuration: give one --fidelity and one --latency (what that server runs) or none")
    return args


def tier_args(tier: str | None, speed_options: str | None) -> list[str]:
    """The serve (and generator benchmark) flags of one tier's sweep."""
    out = [] if tier is None else ["--fidelity", tier]
    return out + ([] if speed_options is None else ["--speed-options", speed_options])


def bench_flags(serve_args: list[str], device: str) -> list[str]:
    """The serve flags that change a chunk's cost, as flags of benchmarks/generator.py (`serve`
    compiles by default on CUDA, so the benchmark does too unless --no-compile is served)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--kv-quant")
    p.add_argument("--sink-frames")
    p.add_argument("--window-frames")
    p.add_argument("--fidelity")
    p.add_argument("--speed-options")
    p.add_argument("--latency")
    p.add_argument("--chunk-latent-frames")
    for flag in ("--wan-dir", "--checkpoint", "--decoder", "--taehv"):
        p.add_argument(flag)
    known, _ = p.parse_known_args(serve_args)
    compiled = known.compile if known.compile is not None else device.startswith("cuda")
    out = ["--compile"] if compiled else []
    chunk = known.chunk_latent_frames or ("1" if known.latency == "low" else None)  # (streamsvc/options.py)
    if chunk is not None:
        out += ["--chunk-latent-frames", chunk]
    for flag in ("kv_quant", "sink_frames", "window_frames", "wan_dir", "checkpoint", "decoder", "taehv", "fidelity",
                 "speed_options"):
        value = getattr(known, flag)
        if value is not None:
            out += [f"--{flag.replace('_', '-')}", value]
    return out


# ---------------------------------------------------------------- child processes


def run_child(cmd: list[str], log_path: Path, timeout_s: float, what: str) -> int | None:
    """Run `cmd` with its output in `log_path`; its exit code, or None when it ran past `timeout_s`
    (then it got SIGTERM and, 15 s later, SIGKILL)."""
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
        try:
            return proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log(f"{what} ran past {timeout_s:g} s; stopping it")
            stop_process(proc, signal.SIGTERM, 15.0)
            return None
        except BaseException:
            stop_process(proc, signal.SIGTERM, 15.0)
            raise


def stop_process(proc: subprocess.Popen, sig: int, timeout_s: float) -> int | None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.returncode


def tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return f"(no log at {path})"
    return f"{path} (last lines):\n  " + "\n  ".join(text[-lines:])


def last_json_line(path: Path) -> dict | None:
    """The last line of a file that parses as a JSON object."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        line = line.strip()
        if line.startswith("{"):
            with contextlib.suppress(json.JSONDecodeError):
                return json.loads(line)
    return None


def resolved_device(device: str) -> str:
    """What `--device auto` means here (as `streamsvc serve` resolves it)."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def generator_chunk(args, logdir: Path) -> dict | None:
    """benchmarks/generator.py --only-chunk in a child process: its result's `chunk`, or None on failure."""
    cmd = [sys.executable, str(REPO / "benchmarks" / "generator.py"), "--preset", args.preset,
           "--iters", str(args.bench_iters), "--only-chunk",
           *bench_flags(args.serve_arg, resolved_device(args.device))]
    if args.device != "auto":
        cmd += ["--device", args.device]
    log(f"timing the generator's chunk: {' '.join(cmd[1:])}")
    t0 = time.monotonic()
    code = run_child(cmd, logdir / "generator.log", args.bench_timeout, "the generator benchmark")
    result = last_json_line(logdir / "generator.log") if code == 0 else None
    if result is None:
        log(f"the generator benchmark failed (exit {code}); going on without it\n{tail(logdir / 'generator.log')}")
        return None
    chunk = result["chunk"]
    log(f"generator chunk: {chunk['dit_chunk_ms']} ms (denoise {chunk['denoise_ms']} + commit {chunk['commit_ms']}) "
        f"on {result['device']}, {time.monotonic() - t0:.0f} s")
    return {**chunk, "device": result["device"], "compile": result["compile"], "cuda_graphs": result["cuda_graphs"],
            "fidelity": result.get("fidelity"), "speed_options": result.get("speed_options"),
            "flash_attention": result["flash_attention"], "kv_quant": result["kv_quant"],
            "sink_frames": result["sink_frames"], "window_frames": result["window_frames"]}


@dataclass
class ServerProcess:
    """`streamsvc serve` as a child process, its output in `log_path`."""

    cmd: list[str]
    log_path: Path
    host: str
    port: int
    proc: subprocess.Popen | None = None

    @property
    def ws_url(self) -> str:
        return stream_url(self.host, self.port)

    def start(self, timeout_s: float) -> None:
        """Start it and wait for /healthz to answer 200; RuntimeError (with the log's tail) if it does not."""
        self._out = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.cmd, cwd=REPO, stdin=subprocess.DEVNULL, stdout=self._out,
                                     stderr=subprocess.STDOUT)
        health = f"http://{self.host}:{self.port}/healthz"
        t0 = time.monotonic()
        next_note = t0 + 10.0
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with code {self.proc.returncode} before it was healthy\n"
                                   f"{tail(self.log_path)}")
            if http_status(health, timeout_s=2.0) == 200:
                log(f"server up at {self.ws_url} after {time.monotonic() - t0:.1f} s")
                return
            if time.monotonic() >= next_note:
                log(f"waiting for {health}: {time.monotonic() - t0:.0f} s")
                next_note += 10.0
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"the server did not answer 200 on {health} within {timeout_s:g} s (raise --server-timeout?)"
                           f"\n{tail(self.log_path)}")

    def stop(self) -> int | None:
        """SIGINT (the server closes every stream), SIGKILL after 60 s. Idempotent."""
        if self.proc is None:
            return None
        code = stop_process(self.proc, signal.SIGINT, 60.0)
        with contextlib.suppress(OSError):
            self._out.close()
        return code


def wait_streams_closed(url: str, timeout_s: float = 30.0) -> None:
    """Until the server holds no open stream (the last viewers' caches freed), at most `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        m = scrape_metrics(metrics_url(url))
        if m is None:
            return
        held = sum(v for k, v in m.items() if k.startswith("streamsvc_streams{") and "state=closed" not in k)
        if held == 0:
            return
        time.sleep(0.5)
    log(f"the server still holds streams {timeout_s:g} s after the load test; going on")


def loadtest(args, url: str, n: int, logdir: Path) -> dict | None:
    """One `streamsvc loadtest` with N viewers; its JSON report, or None when it wrote none."""
    report_path = logdir / f"loadtest-{n}.json"
    cmd = [sys.executable, "-m", "streamsvc.cli", "loadtest", "--url", url, "--streams", str(n),
           "--duration", str(args.duration), "--prompt-every", str(args.prompt_every), "--json", str(report_path)]
    if getattr(args, "input", None):
        cmd += ["--input", args.input] + ([] if args.strength is None else ["--strength", str(args.strength)])
    timeout_s = args.duration * 1.5 + 90.0 + 0.5 * n  # viewers' open timeouts and the report on top of the watching
    code = run_child(cmd, logdir / f"loadtest-{n}.log", timeout_s, f"the load test with {n} viewers")
    try:
        report = json.loads(report_path.read_text())
    except (OSError, json.JSONDecodeError):
        log(f"the load test with {n} viewers wrote no report (exit {code})\n{tail(logdir / f'loadtest-{n}.log')}")
        return None
    report["exit_code"] = code
    return report


# ---------------------------------------------------------------- figures (pure)


def _per_chunk(ms: dict | None, steps: int) -> float | None:
    """`steps` denoising forwards + one commit, from per-forward ms by kind; None when not measured (0: an
    engine that does not time its forwards that way)."""
    if not ms or not ms.get("denoise") or not ms.get("commit"):
        return None
    return round(steps * ms["denoise"] + ms["commit"], 2)


def planned_steps(serve_args: list[str], device: str) -> int:
    """Denoising steps per chunk that the served flags ask for (--fidelity / --speed-options), for a sweep
    without the generator benchmark (which says)."""
    from models import GeneratorConfig, fidelity

    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--fidelity")
    p.add_argument("--speed-options")
    known, _ = p.parse_known_args(serve_args)
    cfg = fidelity.configure(GeneratorConfig(), known.fidelity, fidelity.parse(known.speed_options), device.split(":")[0])
    return len(cfg.timesteps)


def row(n: int, report: dict, bench: dict | None, steps: int = DEFAULT_STEPS) -> dict:
    """One table row from a load test's report (and the generator benchmark's chunk, whose steps win)."""
    srv = report.get("server") or {}
    steps = (bench or {}).get("steps", steps)
    forwards = srv.get("forwards") or {}
    if report.get("glass_to_glass_s") and forwards.get("commit"):  # input video: chunks start at the strength's step
        steps = forwards.get("denoise", 0) / forwards["commit"]  # the denoise forwards a chunk took, measured
    gpu_ms = _per_chunk(srv.get("gpu_ms"), steps)
    bench_ms = (bench or {}).get("dit_chunk_ms")
    reasons = report["refused"]["reasons"]
    return {
        "n": n,
        "admitted": report["admitted"],
        "refused": report["refused"]["count"],
        "refused_reason": next(iter(reasons), None),
        "stalls": report["stalls"]["count"],
        "stall_ratio": report["stalls"]["ratio"],
        "ttff_p50_s": report["ttff_s"]["p50"],
        "ttff_p95_s": report["ttff_s"]["p95"],
        "control_p50_s": report["control_latency_s"]["p50"],
        "control_p95_s": report["control_latency_s"]["p95"],
        "fps_mean": report["delivered_fps"]["mean"],
        "fps_total": round(sum(s["delivered_fps"] or 0.0 for s in report.get("per_stream", [])), 2),
        "chunk_latency_mean_s": srv.get("chunk_latency_mean_s"),
        "chunk_latency_max_s": srv.get("chunk_latency_max_s"),
        "chunks_over_1s": srv.get("chunks_over_1s"),
        "engine_gpu_ms_per_chunk": gpu_ms,
        "engine_wall_ms_per_chunk": _per_chunk(srv.get("forward_ms"), steps),
        "encode_ms_per_chunk": srv.get("encode_ms_per_chunk"),
        "bench_chunk_ms": bench_ms,
        "gpu_vs_bench": round(gpu_ms / bench_ms, 3) if gpu_ms and bench_ms else None,
        "engine_busy": srv.get("engine_busy"),
        "errors": report["errors"]["count"],
        "g2g_p50_s": (report.get("glass_to_glass_s") or {}).get("p50"),  # with --input: capture -> played
        "g2g_p95_s": (report.get("glass_to_glass_s") or {}).get("p95"),
    }


def stop_reason(rows: list[dict]) -> str | None:
    """Why N should not grow past the last run, or None to go on."""
    last = rows[-1]
    if last["stalls"]:
        return f"{last['stalls']} stalls at N={last['n']}"
    if last["refused"]:
        return f"{last['refused']} refused at N={last['n']}: {last['refused_reason']}"
    if len(rows) > 1 and last["admitted"] <= rows[-2]["admitted"]:
        return f"admitted stopped growing at N={last['n']} ({last['admitted']})"
    return None


def largest_stall_free_n(rows: list[dict]) -> int | None:
    """The largest N at which every viewer was admitted and none stalled."""
    ok = [r["n"] for r in rows if r["admitted"] == r["n"] and not r["stalls"]]
    return max(ok, default=None)


COLUMNS = (  # header, row key, format
    ("N", "n", "{:d}"), ("adm", "admitted", "{:d}"), ("ref", "refused", "{:d}"), ("stalls", "stalls", "{:d}"),
    ("ratio", "stall_ratio", "{:.4f}"), ("ttff50", "ttff_p50_s", "{:.2f}"), ("ttff95", "ttff_p95_s", "{:.2f}"),
    ("ctl50", "control_p50_s", "{:.2f}"), ("ctl95", "control_p95_s", "{:.2f}"), ("fps", "fps_mean", "{:.1f}"),
    ("fps_sum", "fps_total", "{:.1f}"), ("lat_mean", "chunk_latency_mean_s", "{:.3f}"),
    ("lat_max", "chunk_latency_max_s", "{:.3f}"), (">1s", "chunks_over_1s", "{:.0f}"),
    ("gpu_ms", "engine_gpu_ms_per_chunk", "{:.1f}"), ("wall_ms", "engine_wall_ms_per_chunk", "{:.1f}"),
    ("enc_ms", "encode_ms_per_chunk", "{:.1f}"), ("bench_ms", "bench_chunk_ms", "{:.1f}"),
    ("gpu/bench", "gpu_vs_bench", "{:.2f}"), ("g2g50", "g2g_p50_s", "{:.3f}"), ("g2g95", "g2g_p95_s", "{:.3f}"),
)


def format_table(rows: list[dict]) -> str:
    """Seconds for TTFF / control / chunk latency; ms per chunk of `steps` denoising forwards + a commit."""
    cells = [[h for h, _, _ in COLUMNS]]
    for r in rows:
        cells.append(["-" if r[k] is None else fmt.format(r[k]) for _, k, fmt in COLUMNS])
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in cells]
    for r in rows:
        if r["refused_reason"]:
            lines.append(f"N={r['n']}: first refusal: {r['refused_reason']}")
    return "\n".join(lines)


# ---------------------------------------------------------------- main


def serve_command(args, port: int) -> list[str]:
    return [sys.executable, "-m", "streamsvc.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
            "--preset", args.preset, "--device", args.device, *args.serve_arg]


def sweep(args, url: str, bench: dict | None, logdir: Path) -> tuple[list[dict], list[dict], str]:
    """Load tests at growing N; (rows, reports, why the sweep stopped)."""
    rows, reports = [], []
    steps = planned_steps(args.serve_arg, resolved_device(args.device))
    for n in range(args.start, args.max_streams + 1, args.step):
        log(f"N={n}: {n} viewers for {args.duration:g} s, prompt every {args.prompt_every:g} s")
        report = loadtest(args, url, n, logdir)
        if report is None:
            return rows, reports, f"the load test failed at N={n}"
        rows.append(row(n, report, bench, steps))
        reports.append({k: v for k, v in report.items() if k != "per_stream"})
        r = rows[-1]
        log(f"N={n}: admitted {r['admitted']}, refused {r['refused']}, stalls {r['stalls']}, "
            f"TTFF p95 {r['ttff_p95_s']} s, engine {r['engine_gpu_ms_per_chunk']} ms per chunk")
        why = stop_reason(rows)
        if why is not None:
            return rows, reports, why
        wait_streams_closed(url)
    return rows, reports, f"reached --max-streams {args.max_streams}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    serve_arg = list(args.serve_arg)
    results = []
    with contextlib.ExitStack() as stack:
        if args.log_dir:
            root = Path(args.log_dir)
            root.mkdir(parents=True, exist_ok=True)
        else:
            root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="streamsvc-service-")))
        configs = [(mode, tier) for mode in args.latencies for tier in args.tiers]
        for mode, tier in configs:
            args.serve_arg = serve_arg + tier_args(tier, args.speed_options) + (["--latency", mode] if mode else [])
            name = "-".join(x for x in (mode, tier) if x)
            logdir = root if len(configs) == 1 else root / name
            logdir.mkdir(parents=True, exist_ok=True)
            if name:
                log(f"--- {' '.join(x for x in (mode and f'latency {mode}', tier and f'fidelity {tier}') if x)}")
            result = run_one(args, logdir)
            if result is None:
                return 3
            results.append({"latency": mode, "fidelity": tier, **result})

    for result in results:
        bench = result["generator_chunk"]
        tier = (f", latency {result['latency']}" if result["latency"] else "") + (
            f", fidelity {result['fidelity']}" if result["fidelity"] else "")
        print(f"service at {args.preset} on {args.device}{tier}: {args.duration:g} s per run, prompt every "
              f"{args.prompt_every:g} s; ms per chunk = {(bench or {}).get('steps', result['steps'])} denoise + 1 commit "
              "forwards (a commit without a forward under commit-reuse; with --input, the denoise forwards a chunk "
              "took while serving: chunks of input start at the strength's step)")
        print(format_table(result["rows"]))
    if len(results) > 1 and len(args.latencies) == 1:
        print("streams at 0 stalls by fidelity: " + ", ".join(f"{r['fidelity']} {r['largest_stall_free_n']}" for r in results))
        out = {"bench": "service", "preset": args.preset, "by_fidelity": results,
               "largest_stall_free_n": {r["fidelity"]: r["largest_stall_free_n"] for r in results}}
    elif len(results) > 1:
        names = ["/".join(x for x in (r["latency"], r["fidelity"]) if x) for r in results]
        print("streams at 0 stalls by configuration: " + ", ".join(
            f"{name} {r['largest_stall_free_n']}" for name, r in zip(names, results)))
        out = {"bench": "service", "preset": args.preset, "by_configuration": results,
               "largest_stall_free_n": {name: r["largest_stall_free_n"] for name, r in zip(names, results)}}
    else:
        out = results[0]
    print(json.dumps(out))
    return 0 if all(r["rows"] for r in results) else 1


def run_one(args, logdir: Path) -> dict | None:
    """The generator benchmark, a server (unless --url) and the sweep, with `args.serve_arg`; None when the server failed."""
    with contextlib.ExitStack() as stack:
        bench = None if args.no_bench else generator_chunk(args, logdir)
        server = None
        if args.url is None:
            port = args.port or free_port()
            server = ServerProcess(serve_command(args, port), logdir / "server.log", "127.0.0.1", port)
            log(f"starting: {' '.join(server.cmd[1:])}")
            stack.callback(lambda: log(f"server stopped (exit {server.stop()})"))
            try:
                server.start(args.server_timeout)
            except RuntimeError as e:
                log(f"benchmarks/service.py: {e}")
                return None
        url = args.url or server.ws_url
        rows, reports, why = sweep(args, url, bench, logdir)
        log(f"stopped: {why}")
        if server is not None and rows:
            log(tail(server.log_path, 3))
    return {
        "bench": "service",
        "preset": args.preset,
        "device": (bench or {}).get("device", args.device),
        "url": args.url,
        "serve_args": args.serve_arg,
        "duration_s": args.duration,
        "prompt_every_s": args.prompt_every,
        "generator_chunk": bench,
        "steps": planned_steps(args.serve_arg, resolved_device(args.device)),
        "rows": rows,
        "largest_stall_free_n": largest_stall_free_n(rows),
        "max_admitted": max((r["admitted"] for r in rows), default=0),
        "stopped": why,
        "reports": reports,
    }


if __name__ == "__main__":
    sys.exit(main())
