"""Discrete-event simulation of one device serving live streams, driving the real Scheduler.

The engine is replaced by its cost model (forwards with jitter, a dearer recache,
the buffer cap) and the viewers by the playback buffer of DESIGN.md "Measuring a
stream". Viewers arrive as a Poisson process, watch for a random time, switch
prompts at random and leave; load is the offered compute as a fraction of the
device's capacity. Each (policy, load, admission) cell runs several seeds on the
same workloads (common random numbers), pooled before the figures are taken:

  stall ratio        total stall time / (play time + stall time)
  viewer time lost   (startup wait + stall time) / session time, summed over admitted viewers;
                     a viewer who leaves before its first frame lost its whole session
  TTFF p95           arrival -> first frame (a viewer who left first counts its session length)
  control p95        prompt sent -> first frame generated under it played

Calibration (the issue's reference case): 5 forwards of 50 ms per 0.75 s chunk, so
the device holds 3 streams; 2 s buffer cap.

    PYTHONPATH=. python benchmarks/scheduler.py                          # full run, ~1 min on 2 cores
    PYTHONPATH=. python benchmarks/scheduler.py --quick                  # a smoke run
    PYTHONPATH=. python benchmarks/scheduler.py --stall-guard-chunks -1  # the policies without the guard

Ends with one JSON line; exits 1 when a must-show check fails (not with --quick).
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import os
import random
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field

from streamsvc.scheduler import POLICIES, Plan, Scheduler, SchedulerConfig, StreamRequest, WorkKind


@dataclass(frozen=True)
class SimConfig:
    forward_s: float = 0.05  # mean wall time of a DENOISE or COMMIT forward (batch 1)
    recache_s: float = 0.075  # mean wall time of a RECACHE forward (it runs over the whole window)
    jitter: float = 0.1  # sigma of the lognormal factor (mean 1) on every forward's time
    batch_gain: float = 0.04  # a batch of b costs b x (1 - batch_gain) forwards for b > 1 (DESIGN: 3-5 %)
    denoise_steps: int = 4  # DENOISE forwards per chunk; one COMMIT follows
    fps: float = 16.0  # playback rate
    first_chunk_frames: int = 9  # frames of a stream's first chunk
    chunk_frames: int = 12  # frames of later chunks (0.75 s at 16 fps)
    buffer_cap_s: float = 2.0  # the scheduler's buffer cap
    session_mean_s: float = 30.0  # mean viewing time (exponential, at least session_min_s)
    session_min_s: float = 3.0  # shortest viewing time
    prompt_every_s: float = 10.0  # mean time between one viewer's prompt switches (Poisson)
    duration_s: float = 600.0  # arrivals happen in [0, duration_s); the run goes on until every viewer left

    @property
    def chunk_s(self) -> float:
        return self.chunk_frames / self.fps

    @property
    def capacity_streams(self) -> float:
        """Streams the device can serve at 100 % busy (recaches aside)."""
        return self.chunk_s / ((self.denoise_steps + 1) * self.forward_s)


@dataclass
class Viewer:
    stream_id: str  # its stream
    arrive: float  # connects (and asks for admission)
    leave: float  # disconnects, whatever happened
    prompt_times: list[float]  # when it sends a new prompt
    admitted: bool = False  # admission accepted it
    first_frame: float | None = None  # its first chunk arrived
    play_until: float = 0.0  # the buffered content lasts until then
    stall_s: float = 0.0  # total stall time
    stalls: int = 0  # number of stalls
    pending: list[tuple[int, float]] = field(default_factory=list)  # prompts (version, sent at) not yet seen
    control_s: list[float] = field(default_factory=list)  # prompt sent -> first frame under it played

    def deliver(self, t: float, frames: int, version: int, fps: float) -> None:
        if self.first_frame is None:
            self.first_frame = start = t
        elif t > self.play_until:
            self.stall_s += t - self.play_until
            self.stalls += 1
            start = t
        else:
            start = self.play_until
        self.play_until = start + frames / fps
        if start < self.leave:
            seen = [(v, sent) for v, sent in self.pending if v <= version]
            self.control_s.extend(start - sent for _, sent in seen)
            self.pending = [(v, sent) for v, sent in self.pending if v > version]

    def close(self) -> None:
        """At `leave`: a stall in progress counts up to the end of the session."""
        if self.first_frame is not None and self.play_until < self.leave:
            self.stall_s += self.leave - self.play_until
            self.stalls += 1

    @property
    def session_s(self) -> float:
        return self.leave - self.arrive

    @property
    def startup_s(self) -> float:
        end = self.leave if self.first_frame is None else self.first_frame
        return end - self.arrive


def make_workload(sim: SimConfig, load: float, seed: int) -> list[Viewer]:
    """Poisson arrivals at `load` x capacity, exponential sessions, Poisson prompt switches."""
    rng = random.Random(f"workload:{seed}:{load}")
    rate = load * sim.capacity_streams / sim.session_mean_s  # arrivals per second
    viewers, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= sim.duration_s:
            return viewers
        length = max(sim.session_min_s, rng.expovariate(1 / sim.session_mean_s))
        prompts, p = [], t
        while True:
            p += rng.expovariate(1 / sim.prompt_every_s)
            if p >= t + length:
                break
            prompts.append(p)
        viewers.append(Viewer(f"s{len(viewers)}", arrive=t, leave=t + length, prompt_times=prompts))


def simulate(sim: SimConfig, sched_cfg: SchedulerConfig, load: float, seed: int) -> dict:
    """One run; returns the summed raw figures of its viewers."""
    viewers = make_workload(sim, load, seed)
    jitter = random.Random(f"jitter:{seed}:{load}")
    sched = Scheduler(sched_cfg)
    events: list[tuple[float, int, str, object]] = []
    seq = 0

    def push(t: float, what: str, payload: object) -> None:
        nonlocal seq
        heapq.heappush(events, (t, seq, what, payload))
        seq += 1

    for v in viewers:
        push(v.arrive, "arrive", v)
        push(v.leave, "leave", v)
        for p in v.prompt_times:
            push(p, "prompt", v)
    by_id = {v.stream_id: v for v in viewers}
    busy = False  # a plan is running
    wake_pending = math.inf  # earliest wake-up already queued
    busy_s = 0.0

    def forward_cost(plan: Plan) -> float:
        base = sim.recache_s if plan.kind is WorkKind.RECACHE else sim.forward_s
        b = len(plan.stream_ids)
        factor = 1.0 if b == 1 else b * (1 - sim.batch_gain)
        return base * factor * jitter.lognormvariate(-sim.jitter**2 / 2, sim.jitter)

    def kick(now: float) -> None:
        nonlocal busy, wake_pending, busy_s
        if busy:
            return
        plan = sched.next(now)
        if plan is not None:
            cost = forward_cost(plan)
            busy, busy_s = True, busy_s + cost
            push(now + cost, "done", (plan, cost))
            return
        wake = sched.wake_at(now)
        if wake is not None and wake < wake_pending:
            wake_pending = wake
            push(wake, "wake", None)

    end = 0.0
    while events:
        now, _, what, payload = heapq.heappop(events)
        end = now
        if what == "arrive":
            v = payload
            req = StreamRequest(v.stream_id, sim.fps, sim.first_chunk_frames, sim.chunk_frames)
            v.admitted = sched.admit(req, now).accepted
        elif what == "leave":
            payload.close()
            sched.remove(payload.stream_id)
        elif what == "prompt":
            v = payload
            if v.stream_id in sched:
                v.pending.append((sched.set_prompt(v.stream_id, now), now))
        elif what == "wake":
            if now >= wake_pending:
                wake_pending = math.inf
        else:
            plan, cost = payload
            busy = False
            for stream_id in sched.complete(plan, now, cost):
                i = plan.stream_ids.index(stream_id)
                frames = sim.first_chunk_frames if plan.chunk_index[i] == 0 else sim.chunk_frames
                by_id[stream_id].deliver(now, frames, plan.prompt_seqs[i], sim.fps)
        kick(now)

    admitted = [v for v in viewers if v.admitted]
    return {
        "viewers": len(viewers),
        "admitted": len(admitted),
        "session_s": sum(v.session_s for v in admitted),
        "startup_s": sum(v.startup_s for v in admitted),
        "stall_s": sum(v.stall_s for v in admitted),
        "stalls": sum(v.stalls for v in admitted),
        "streams_with_stalls": sum(1 for v in admitted if v.stalls),
        "ttff_s": [v.startup_s for v in admitted],
        "control_s": [c for v in admitted for c in v.control_s],
        "busy": busy_s / end if end > 0 else 0.0,
    }


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (None for no values)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def run_cell(args: tuple[SimConfig, SchedulerConfig, float, list[int]]) -> dict:
    """All seeds of one (policy, load, admission) cell, pooled."""
    sim, sched_cfg, load, seeds = args
    runs = [simulate(sim, sched_cfg, load, seed) for seed in seeds]
    total = {k: sum(r[k] for r in runs) for k in ("viewers", "admitted", "session_s", "startup_s", "stall_s", "stalls")}
    ttff = [x for r in runs for x in r["ttff_s"]]
    control = [x for r in runs for x in r["control_s"]]
    play_s = total["session_s"] - total["startup_s"] - total["stall_s"]
    return {
        "policy": sched_cfg.policy,
        "admission": math.isfinite(sched_cfg.utilization_target),
        "load": load,
        "viewers": total["viewers"],
        "admitted": total["admitted"],
        "stalls": total["stalls"],
        "streams_with_stalls": sum(r["streams_with_stalls"] for r in runs),
        "stall_ratio": total["stall_s"] / (play_s + total["stall_s"]) if play_s + total["stall_s"] > 0 else 0.0,
        "time_lost": (total["startup_s"] + total["stall_s"]) / total["session_s"] if total["session_s"] else 0.0,
        "ttff_p50_s": percentile(ttff, 50),
        "ttff_p95_s": percentile(ttff, 95),
        "control_p50_s": percentile(control, 50),
        "control_p95_s": percentile(control, 95),
        "control_n": len(control),
        "busy": sum(r["busy"] for r in runs) / len(runs),
        "time_lost_by_seed": [(r["startup_s"] + r["stall_s"]) / max(r["session_s"], 1e-9) for r in runs],
    }


def paired_difference(a: list[float], b: list[float]) -> tuple[float, float]:
    """Mean and standard error of a[i] - b[i] over seeds (same workloads, so paired)."""
    diffs = [x - y for x, y in zip(a, b)]
    mean = sum(diffs) / len(diffs)
    if len(diffs) < 2:
        return mean, math.inf
    var = sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1)
    return mean, math.sqrt(var / len(diffs))


def checks(cells: list[dict]) -> dict:
    """The issue's must-show, computed from the cells."""

    def cell(policy: str, load: float, admission: bool) -> dict | None:
        for c in cells:
            if (c["policy"], c["load"], c["admission"]) == (policy, load, admission):
                return c
        return None

    result: dict = {}
    admitted_cells = [c for c in cells if c["admission"] and c["load"] <= 1.2 + 1e-9]
    if admitted_cells:
        result["admission_zero_stalls"] = all(c["stalls"] == 0 for c in admitted_cells)
    loads = sorted({c["load"] for c in cells})
    pairs = [(cell("slack", x, False), cell("round_robin", x, False)) for x in loads]
    pairs = [(s, r) for s, r in pairs if s and r]
    if pairs:
        # Strictly: pooled viewer time lost of slack <= round robin's at every load.
        result["slack_time_lost_le_rr"] = all(s["time_lost"] <= r["time_lost"] for s, r in pairs)
        # Within noise: the per-seed paired difference is not above 2 standard errors.
        diffs = {s["load"]: paired_difference(s["time_lost_by_seed"], r["time_lost_by_seed"]) for s, r in pairs}
        result["slack_time_lost_not_above_rr_2se"] = all(mean <= 2 * se for mean, se in diffs.values())
        result["slack_minus_rr_time_lost_pp"] = {
            f"{load:g}": f"{100 * mean:+.2f} +- {100 * se:.2f}" for load, (mean, se) in diffs.items()
        }
        high = [(s, r) for s, r in pairs if s["load"] >= 0.7 - 1e-9]
        result["slack_ttff_p95_lt_rr_at_load_ge_0.7"] = all(s["ttff_p95_s"] < r["ttff_p95_s"] for s, r in high)
    return result


def print_table(cells: list[dict]) -> None:
    header = (
        f"{'adm':>3} {'load':>4} {'policy':<12} {'admit':>9} {'stalls':>6} {'stall%':>6} {'lost%':>6} "
        f"{'ttff50':>6} {'ttff95':>6} {'ctl50':>6} {'ctl95':>6} {'busy%':>5}"
    )
    print(header)
    print("-" * len(header))
    last = None
    for c in cells:
        if last is not None and (c["admission"], c["load"]) != last:
            print()
        last = (c["admission"], c["load"])
        fmt = lambda x: "   -  " if x is None else f"{x:6.2f}"  # noqa: E731
        print(
            f"{'on' if c['admission'] else 'off':>3} {c['load']:4.2f} {c['policy']:<12} "
            f"{c['admitted']:>4}/{c['viewers']:<4} {c['stalls']:>6} {100 * c['stall_ratio']:6.2f} "
            f"{100 * c['time_lost']:6.2f} {fmt(c['ttff_p50_s'])} {fmt(c['ttff_p95_s'])} "
            f"{fmt(c['control_p50_s'])} {fmt(c['control_p95_s'])} {100 * c['busy']:5.1f}"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=8, help="seeds per cell (default 8)")
    ap.add_argument("--first-seed", type=int, default=0, help="seeds are first-seed .. first-seed+seeds-1")
    ap.add_argument("--duration", type=float, default=900.0, help="seconds of arrivals per run (default 900)")
    ap.add_argument("--loads", default="0.5,0.6,0.7,0.8,0.9,1.0,1.1,1.2", help="offered loads, comma separated")
    ap.add_argument("--policies", default=",".join(POLICIES), help="policies, comma separated")
    ap.add_argument("--admission", choices=("both", "on", "off"), default="both")
    ap.add_argument(
        "--quick", action="store_true", help="3 seeds x 300 s at loads 0.5, 0.9, 1.2 (a smoke run, too few to decide)"
    )
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="processes (default: all cores)")
    ap.add_argument("--utilization-target", type=float, default=SchedulerConfig.utilization_target)
    ap.add_argument("--startup-slack-s", type=float, default=SchedulerConfig.startup_slack_s)
    ap.add_argument("--restart-margin-chunks", type=float, default=SchedulerConfig.restart_margin_chunks)
    ap.add_argument(
        "--stall-guard-chunks", type=float, default=SchedulerConfig.stall_guard_chunks, help="negative: guard off"
    )
    ap.add_argument("--no-restart", action="store_true", help="restart_on_prompt=False")
    ap.add_argument("--max-batch", type=int, default=1)
    args = ap.parse_args(argv)
    if args.quick:
        args.seeds, args.duration, args.loads = 3, 300.0, "0.5,0.9,1.2"
    loads = [float(x) for x in args.loads.split(",")]
    policies = args.policies.split(",")
    admissions = {"both": (True, False), "on": (True,), "off": (False,)}[args.admission]
    sim = SimConfig(duration_s=args.duration)
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))

    jobs = []
    for admission in admissions:
        for load in loads:
            for policy in policies:
                cfg = SchedulerConfig(
                    policy=policy,
                    denoise_steps=sim.denoise_steps,
                    buffer_cap_s=sim.buffer_cap_s,
                    max_batch=args.max_batch,
                    utilization_target=args.utilization_target if admission else math.inf,
                    initial_forward_s=sim.forward_s,
                    restart_on_prompt=not args.no_restart,
                    restart_margin_chunks=args.restart_margin_chunks,
                    startup_slack_s=args.startup_slack_s,
                    stall_guard_chunks=None if args.stall_guard_chunks < 0 else args.stall_guard_chunks,
                )
                jobs.append((sim, cfg, load, seeds))
    t0 = time.perf_counter()
    if args.workers > 1:
        with ProcessPoolExecutor(max_workers=args.workers) as pool:
            cells = list(pool.map(run_cell, jobs))
    else:
        cells = [run_cell(job) for job in jobs]
    wall_s = time.perf_counter() - t0

    print(
        f"scheduler simulation: capacity {sim.capacity_streams:g} streams ({sim.denoise_steps + 1} forwards of "
        f"{sim.forward_s * 1e3:g} ms, jitter {sim.jitter:g}, recache {sim.recache_s * 1e3:g} ms, per "
        f"{sim.chunk_s:g} s chunk), buffer cap {sim.buffer_cap_s:g} s, sessions ~{sim.session_mean_s:g} s, "
        f"a prompt every ~{sim.prompt_every_s:g} s; {len(seeds)} seeds x {sim.duration_s:g} s per cell"
    )
    print("stall% = stall / (play + stall); lost% = (startup + stall) / session; times in s\n")
    print_table(cells)
    verdict = checks(cells)
    print(f"\nchecks (wall {wall_s:.1f} s):")
    for key, value in verdict.items():
        print(f"  {key}: {value}")
    summary = {
        "bench": "scheduler",
        "sim": asdict(sim),
        "seeds": len(seeds),
        "utilization_target": args.utilization_target,
        "startup_slack_s": args.startup_slack_s,
        "restart_margin_chunks": args.restart_margin_chunks,
        "restart_on_prompt": not args.no_restart,
        "stall_guard_chunks": args.stall_guard_chunks,
        "max_batch": args.max_batch,
        "checks": verdict,
        "wall_s": round(wall_s, 2),
        "cells": [
            {k: (round(v, 4) if isinstance(v, float) else v) for k, v in c.items() if k != "time_lost_by_seed"}
            for c in cells
        ],
    }
    print(json.dumps(summary))
    decisive = ("admission_zero_stalls", "slack_time_lost_not_above_rr_2se", "slack_ttff_p95_lt_rr_at_load_ge_0.7")
    return 0 if args.quick or all(verdict.get(k, True) for k in decisive) else 1


if __name__ == "__main__":
    sys.exit(main())
