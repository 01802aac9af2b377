"""A prompt flood against the load test: N well-behaved viewers plus one that sends prompts as fast as it likes.

    python -m benchmarks.prompt_flood --streams 15 --duration 30 --prompt-every 5 --flood-rate 100
    python -m benchmarks.prompt_flood --url ws://127.0.0.1:8000/ws --token s3cret --streams 15 --flood-rate 100

(from the repository root). Exits 1 when a viewer stalled or the flooder got no rate-limit error.
Without --url it starts a local `streamsvc serve` (tiny preset, CPU; --server-arg adds flags). The N viewers
are `streamsvc loadtest`'s (every one connects at once and changes its prompt every --prompt-every seconds);
the flooder is one more viewer, opened once the others play, that sends --flood-rate prompts a second for the
rest of the run. What must hold: the N viewers do not stall, the flooder's prompts beyond its stream's
control rate are refused with `rate_limited` errors while its stream goes on playing, and its prompts cost
at most one recache per chunk (prompt coalescing).

Prints the load test's table, then one JSON line: the N viewers' stalls, TTFF and control latency, the
flooder's prompts sent / acked / rate-limited and the chunks it received, and the server's refusals by
reason, recaches and chunks over the run (from /metrics).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

from client import loadtest, loadtest_report
from client.viewer import ClientConfig
from client.ws_client import StreamClient
from streamsvc.wire import protocol as P


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    loadtest.add_arguments(p)
    p.add_argument("--flood-rate", type=float, default=100.0, help="the flooder's prompts a second (default 100)")
    p.set_defaults(streams=15, progress_every=0.0)
    return p.parse_args(argv)


async def flood(url: str, token: str | None, rate: float, duration_s: float) -> dict:
    """One viewer sending ``rate`` prompts a second for ``duration_s``; what it got back."""
    client = StreamClient(url, ClientConfig(prompt="the flooder's stream", seed=999, token=token))
    if not await client.open():
        await client.close()
        return {"admitted": False, "refused": client.refused_reason, "errors": client.errors[:5]}
    start = time.monotonic()
    sent = 0
    for k in range(int(rate * duration_s)):
        delay = start + k / rate - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        try:
            await client.set_prompt(f"flood prompt {k}")
        except RuntimeError:  # the stream ended (the report says how)
            break
        sent += 1
    await client.wait_until(lambda: len(client.acks) + len(client.server_errors) >= sent, 5.0)
    chunks_while_flooding = client.chunks
    await client.close()
    codes = [e.code.value for e in client.server_errors]
    playback = client.result().playback
    return {
        "admitted": True, "prompts_sent": sent, "acked": sum(a.request == "set_prompt" for a in client.acks),
        "rate_limited": codes.count(P.ErrorCode.RATE_LIMITED.value),
        "other_errors": [e for e in client.errors if not e.startswith(P.ErrorCode.RATE_LIMITED.value)][:5],
        "chunks": chunks_while_flooding, "stalls": playback.stalls, "closed_reason": client.closed_reason,
    }


async def run(args, url: str) -> dict:
    murl = loadtest.metrics_url(url)
    first = await asyncio.to_thread(loadtest.scrape_metrics, murl)
    settle_s = 3.0  # the viewers connect and play before the flood begins
    viewers = asyncio.create_task(loadtest.run_viewers(args, url, None))
    await asyncio.sleep(settle_s)
    flooder = await flood(url, args.token, args.flood_rate, max(1.0, args.duration - settle_s - 1.0))
    report = await viewers
    last = await asyncio.to_thread(loadtest.scrape_metrics, murl)

    def delta(key: str) -> float | None:
        return None if last is None else last.get(key, 0.0) - (first or {}).get(key, 0.0)

    refusals = {k.split("reason=")[1][:-1]: delta(k) for k in (last or {}) if k.startswith("streamsvc_refusals_total")}
    return {"report": report, "flooder": flooder, "refusals": refusals,
            "recaches": delta("streamsvc_forwards{kind=recache}"), "chunks": delta("streamsvc_chunks_total")}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    server = None
    if args.url is None:
        serve_args = ["--preset", args.preset, "--device", args.device, *args.server_arg]
        if args.token is not None:
            serve_args += ["--auth-token", args.token]
        server = loadtest.LocalServer(serve_args, start_timeout_s=args.server_timeout)
        server.start()
    try:
        out = asyncio.run(run(args, server.ws_url if server else args.url))
    finally:
        if server is not None:
            server.stop()
            server.cleanup()
    report, flooder = out["report"], out["flooder"]
    print(loadtest_report.format_table(report))
    result = {
        "streams": args.streams, "admitted": report["admitted"], "duration_s": args.duration,
        "prompt_every_s": args.prompt_every, "flood_rate": args.flood_rate,
        "stalls": report["stalls"]["count"], "stall_s": report["stalls"]["total_s"],
        "ttff_p95_s": report["ttff_s"]["p95"], "control_p95_s": report["control_latency_s"]["p95"],
        "flooder": flooder, "refusals": out["refusals"], "recaches": out["recaches"], "chunks": out["chunks"],
    }
    print(json.dumps(result))
    ok = report["stalls"]["count"] == 0 and flooder.get("rate_limited", 0) > 0 and flooder.get("closed_reason") == "closed by client"
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
