"""`python -m benchmarks.hostile`: run the hostile cases (see the package's docstring), one JSON line at the end."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass

from . import admission, backlog, capabilities, decoders, round1


@dataclass(frozen=True)
class Case:
    """One hostile case: how to run it from the parsed flags, and whether its figures hold."""

    run: Callable[[argparse.Namespace], dict]  # the case, at the flags' sizes: its figures
    holds: Callable[[argparse.Namespace, dict], bool]  # what must hold, on those figures


CASES: dict[str, Case] = {
    "idle_sockets": Case(
        lambda a: round1.idle_sockets(a.idle, a.nofile, a.start_timeout, a.server_arg),
        lambda a, f: (f["good_first_chunk_s"] is not None and f["good_first_chunk_s"] < 1.0
                      and f["healthz_status"] == 200 and f["idle_still_open"] == 0)),
    "poisoned_admission": Case(
        lambda a: round1.poisoned_admission(a.viewers, flood_s=a.flood_seconds, serve_args=a.server_arg),
        lambda a, f: f["admitted"] == a.viewers and f["stalls"] == 0 and f["after_empty"]["admitted"]),
    "slow_readers": Case(
        lambda a: round1.slow_readers(serve_args=a.server_arg),
        lambda a, f: f["rss_added_mib"] < 50 and all(r["status"] == "200" for r in f["readers"].values())),
    "quiet_camera": Case(
        lambda a: admission.quiet_camera(a.viewers, serve_args=a.server_arg),
        lambda a, f: admission.holds(a.viewers, f)),
    "lying_reports": Case(
        lambda a: admission.lying_reports(a.viewers, serve_args=a.server_arg),
        lambda a, f: admission.holds(a.viewers, f)),
    "old_steerer": Case(
        lambda a: capabilities.old_steerer(serve_args=a.server_arg),
        lambda a, f: capabilities.old_steerer_holds(f)),
    "log_flood": Case(
        lambda a: capabilities.log_flood(serve_args=a.server_arg),
        lambda a, f: not f["over"] and not f["ours_over"]),  # the libraries' lines, and our own
    "never_reads": Case(  # 4 viewers beside the attacker, whatever --viewers says (the case's own size)
        lambda a: backlog.never_reads(4, serve_args=a.server_arg),
        lambda a, f: backlog.never_reads_holds(4, f)),
    "resolution_bomb": Case(
        lambda a: decoders.resolution_bomb(serve_args=a.server_arg),
        lambda a, f: decoders.holds(f)),
}


def main(argv: list[str] | None = None) -> int:
    from . import __doc__ as doc

    p = argparse.ArgumentParser(prog="python -m benchmarks.hostile", description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", action="append", choices=tuple(CASES), help="run only this case (repeatable; default: all)")
    p.add_argument("--list", action="store_true", help="name the cases and exit")
    p.add_argument("--server-arg", action="append", default=[], help="another flag for `streamsvc serve`")
    p.add_argument("--idle", type=int, default=1100, help="idle sockets: WebSockets from one address (default 1100)")
    p.add_argument("--nofile", type=int, default=1024, help="idle sockets: the server's fd limit (default 1024)")
    p.add_argument("--start-timeout", type=float, default=10.0, help="idle sockets: the server's --start-timeout")
    p.add_argument("--viewers", type=int, default=16, help="viewers beside the attacker, where a case has them (16)")
    p.add_argument("--flood-seconds", type=float, default=40.0, help="poisoned admission: the flood's length (40)")
    args = p.parse_args(argv)
    if args.list:
        print("\n".join(CASES))
        return 0
    figures, ok = {}, True
    for name in args.case or CASES:
        case = CASES[name]
        figures[name] = case.run(args)
        held = bool(case.holds(args, figures[name]))
        figures[name]["holds"] = held
        print(f"{name}: {'holds' if held else 'DOES NOT HOLD'}", flush=True)
        ok &= held
    print(json.dumps({**figures, "ok": ok}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
