"""Discrete-event simulation of one device serving live streams, driving the real Scheduler.

The engine is replaced by its cost model (forwards with jitter, a dearer recache)
and its pipeline: it completes a plan as soon as it launches it (up to
`launch_depth` forwards queued on the device, costs learnt when each forward ends,
`observe_cost`), and a COMMIT's frames reach the viewer `hand_over_s` after the
forward ends (copy and encode on worker threads, `delivered`). The viewers are the
playback buffer of DESIGN.md "Measuring a stream".

Scenario `load` (the default): viewers arrive as a Poisson process, watch for a
random time, switch prompts at random and leave; load is the offered compute as a
fraction of the device's capacity. Each (policy, load, admission) cell runs several
seeds on the same workloads (common random numbers), pooled before the figures are
taken:

  stall ratio        total stall time / (play time + stall time)
  viewer time lost   (startup wait + stall time) / session time, summed over admitted viewers;
                     a viewer who leaves before its first frame lost its whole session
  TTFF p95           arrival -> first frame (a viewer who left first counts its session length)
  control p95        prompt sent -> first frame generated under it played

Calibration (the issue's reference case): 5 forwards of 50 ms per 0.75 s chunk, so
the device holds 3 streams; 2 s buffer cap.

Scenario `h200`: 1, 2, 3 streams requested together (50 ms apart; `--stagger`: each
2-12 s after the previous, joining a stream that plays) on an H200
(DENOISE 50 ms, COMMIT 55 ms, RECACHE 130 ms; a first chunk of 9 frames, then 12 at
16 fps), each watching for the whole run and sending a prompt every ~10 s; reports
admitted streams, stalls, TTFF p95, control latency p50/p95 and chunk latency p95
(due -> delivered, what the start rule's lead is made of), for the default start
rule and, as a baseline, without it (`start_margin_s=inf`: run ahead to the cap).

    PYTHONPATH=. python benchmarks/scheduler.py                          # full run, ~3 min on 2 cores
    PYTHONPATH=. python benchmarks/scheduler.py --quick                  # a smoke run
    PYTHONPATH=. python benchmarks/scheduler.py --stall-guard-chunks -1  # the policies without the guard
    PYTHONPATH=. python benchmarks/scheduler.py --scenario h200          # 1, 2, 3 streams on an H200
    PYTHONPATH=. python benchmarks/scheduler.py --scenario h200 --stagger --startup-slack-s 0.75

Ends with one JSON line; exits 1 when a must-show check fails (not with --quick).
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import itertools
import json
import math
import os
import random
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field

from models.work import WorkKind
from streamsvc.scheduling import POLICIES, Plan, Scheduler, SchedulerConfig, StreamRequest


@dataclass(frozen=True)
class SimConfig:
    forward_s: float = 0.05  # mean wall time of a DENOISE forward (batch 1)
    commit_s: float = 0.05  # mean wall time of a COMMIT forward (batch 1: the chunk's K/V and its decode)
    recache_s: float = 0.075  # mean wall time of a RECACHE forward (it runs over the whole window)
    hand_over_s: float = 0.02  # a COMMIT's end -> its frames at the viewer (copy to host, encode, send)
    launch_depth: int = 2  # forwards the engine keeps launched on the device (1: decide when the device idles)
    jitter: float = 0.1  # sigma of the lognormal factor (mean 1) on every forward's time
    batch_gain: float = 0.04  # a batch of b costs b x (1 - batch_gain) forwards for b > 1 (DESIGN: 3-5 %)
    denoise_steps: int = 4  # DENOISE forwards per chunk; one COMMIT follows
    degrade_steps: tuple[int, ...] = (3, 2)  # fewer steps a late chunk may run with (GeneratorConfig.degraded_steps)
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
    def chunk_cost_s(self) -> float:
        return self.denoise_steps * self.forward_s + self.commit_s

    @property
    def capacity_streams(self) -> float:
        """Streams the device can serve at 100 % busy (recaches aside)."""
        return self.chunk_s / self.chunk_cost_s


H200 = SimConfig(forward_s=0.050, commit_s=0.055, recache_s=0.130, duration_s=300.0)


@dataclass
class Viewer:
    stream_id: str  # its stream
    arrive: float  # connects (and asks for admission)
    leave: float  # disconnects, whatever happened
    prompt_times: list[float]  # when it sends a new prompt
    admitted: bool = False  # admission accepted it
    refusal: str | None = None  # admission's reason when it refused
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


def make_fixed_workload(sim: SimConfig, streams: int, seed: int, stagger: bool = False) -> list[Viewer]:
    """`streams` viewers asking 50 ms apart (`stagger`: each 2-12 s after the previous one, joining
    streams that play), all staying until `duration_s`, a prompt every ~prompt_every_s."""
    rng = random.Random(f"fixed:{seed}:{streams}:{stagger}")
    viewers, arrive = [], 0.0
    for i in range(streams):
        if i:
            arrive += rng.uniform(2.0, 12.0) if stagger else 0.05
        prompts, p = [], arrive
        while True:
            p += rng.expovariate(1 / sim.prompt_every_s)
            if p >= sim.duration_s:
                break
            prompts.append(p)
        viewers.append(Viewer(f"s{i}", arrive=arrive, leave=sim.duration_s, prompt_times=prompts))
    return viewers


def simulate(sim: SimConfig, sched_cfg: SchedulerConfig, viewers: list[Viewer], jitter_key: str) -> dict:
    """One run over `viewers` (forward times drawn from `jitter_key`); the summed raw figures of its viewers."""
    jitter = random.Random(f"jitter:{jitter_key}")
    sched = Scheduler(sched_cfg)
    mean_s = {WorkKind.DENOISE: sim.forward_s, WorkKind.COMMIT: sim.commit_s, WorkKind.RECACHE: sim.recache_s}
    for kind, cost in mean_s.items():  # the engine's warm-up measures every kind before serving
        sched.seed_cost(kind, 1, cost)
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
    launched = 0  # forwards launched on the device and not finished
    device_free_at = 0.0  # the last launched forward ends then
    wake_pending = math.inf  # earliest wake-up already queued
    busy_s = 0.0
    chunk_latency_s: list[float] = []
    chunks = degraded = 0  # chunks committed, and those with fewer denoising steps (instead of a stall)

    def forward_cost(plan: Plan) -> float:
        b = len(plan.stream_ids)
        factor = 1.0 if b == 1 else b * (1 - sim.batch_gain)
        return mean_s[plan.kind] * factor * jitter.lognormvariate(-sim.jitter**2 / 2, sim.jitter)

    def kick(now: float) -> None:
        """The engine's loop: decide and launch while the device queue has room."""
        nonlocal launched, device_free_at, wake_pending, busy_s, chunks, degraded
        while launched < sim.launch_depth:
            plan = sched.next(now)
            if plan is None:
                wake = sched.wake_at(now)
                if wake is not None and wake < wake_pending:
                    wake_pending = wake
                    push(wake, "wake", None)
                return
            cost = forward_cost(plan)
            device_free_at = max(now, device_free_at) + cost
            busy_s += cost
            launched += 1
            sched.complete(plan, now, None, deliver=False)
            if plan.kind is WorkKind.COMMIT:
                chunks += len(plan.steps)
                degraded += sum(1 for n in plan.steps if n < sched_cfg.denoise_steps)
            push(device_free_at, "done", (plan, cost))

    end = 0.0
    while events:
        now, _, what, payload = heapq.heappop(events)
        end = now
        if what == "arrive":
            v = payload
            req = StreamRequest(v.stream_id, sim.fps, sim.first_chunk_frames, sim.chunk_frames)
            admission = sched.admit(req, now)
            v.admitted, v.refusal = admission.accepted, admission.reason
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
        elif what == "done":
            plan, cost = payload
            launched -= 1
            sched.observe_cost(plan.kind, len(plan.stream_ids), cost)
            if plan.kind is WorkKind.COMMIT:
                for i, stream_id in enumerate(plan.stream_ids):
                    frames = sim.first_chunk_frames if plan.chunk_index[i] == 0 else sim.chunk_frames
                    push(now + sim.hand_over_s, "delivered", (stream_id, frames, plan.prompt_seqs[i]))
        else:
            stream_id, frames, version = payload
            latency = sched.delivered(stream_id, now)
            if latency is not None:  # None: the viewer left while its chunk was on its way
                chunk_latency_s.append(latency)
                by_id[stream_id].deliver(now, frames, version, sim.fps)
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
        "chunk_latency_s": chunk_latency_s,
        "refusals": [v.refusal for v in viewers if not v.admitted],
        "busy": busy_s / end if end > 0 else 0.0,
        "chunks": chunks,
        "degraded": degraded,
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
    runs = [simulate(sim, sched_cfg, make_workload(sim, load, seed), f"{seed}:{load}") for seed in seeds]
    keys = ("viewers", "admitted", "session_s", "startup_s", "stall_s", "stalls", "chunks", "degraded")
    total = {k: sum(r[k] for r in runs) for k in keys}
    ttff = [x for r in runs for x in r["ttff_s"]]
    control = [x for r in runs for x in r["control_s"]]
    play_s = total["session_s"] - total["startup_s"] - total["stall_s"]
    return {
        "policy": sched_cfg.policy,
        "admission": math.isfinite(sched_cfg.utilization_target),
        "degrade": bool(sched_cfg.degrade_steps),
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
        "chunks": total["chunks"],
        "degraded": total["degraded"],
        "time_lost_by_seed": [(r["startup_s"] + r["stall_s"]) / max(r["session_s"], 1e-9) for r in runs],
    }



def run_all(fn, jobs: list, workers: int) -> list:
    """fn over jobs, in worker processes when `workers` > 1; results in order."""
    if workers > 1:
        with ProcessPoolExecutor(max_workers=workers) as pool:
            return list(pool.map(fn, jobs))
    return [fn(job) for job in jobs]

def run_fixed_cell(args: tuple[SimConfig, SchedulerConfig, int, list[int]]) -> dict:
    """All seeds of one (start rule, streams requested) cell of the fixed scenario, pooled."""
    sim, sched_cfg, streams, seeds, stagger = args
    runs = [
        simulate(sim, sched_cfg, make_fixed_workload(sim, streams, seed, stagger), f"{seed}:{streams}:{stagger}")
        for seed in seeds
    ]
    pooled = {k: [x for r in runs for x in r[k]] for k in ("ttff_s", "control_s", "chunk_latency_s", "refusals")}
    stall_s = sum(r["stall_s"] for r in runs)
    play_s = sum(r["session_s"] - r["startup_s"] - r["stall_s"] for r in runs)
    return {
        "start_rule": math.isfinite(sched_cfg.start_margin_s),
        "buffer_cap_s": sched_cfg.buffer_cap_s,
        "requested": streams,
        "admitted": sum(r["admitted"] for r in runs) / len(runs),
        "stalls": sum(r["stalls"] for r in runs),
        "stall_ratio": stall_s / (play_s + stall_s) if play_s + stall_s > 0 else 0.0,
        "ttff_p95_s": percentile(pooled["ttff_s"], 95),
        "control_p50_s": percentile(pooled["control_s"], 50),
        "control_p95_s": percentile(pooled["control_s"], 95),
        "control_n": len(pooled["control_s"]),
        "chunk_latency_p50_s": percentile(pooled["chunk_latency_s"], 50),
        "chunk_latency_p95_s": percentile(pooled["chunk_latency_s"], 95),
        "busy": sum(r["busy"] for r in runs) / len(runs),
        "refusal": pooled["refusals"][0] if pooled["refusals"] else None,
    }


def print_fixed_table(cells: list[dict]) -> None:
    header = (
        f"{'rule':>5} {'cap':>4} {'asked':>5} {'admit':>5} {'stalls':>6} {'stall%':>6} {'ttff95':>6} "
        f"{'ctl50':>6} {'ctl95':>6} {'lat50':>6} {'lat95':>6} {'busy%':>5}"
    )
    print(header)
    print("-" * len(header))
    fmt = lambda x: "   -  " if x is None else f"{x:6.3f}"  # noqa: E731
    for c in cells:
        print(
            f"{'lead' if c['start_rule'] else 'cap':>5} {c['buffer_cap_s']:4.1f} {c['requested']:>5} "
            f"{c['admitted']:5.2f} {c['stalls']:>6} {100 * c['stall_ratio']:6.2f} {fmt(c['ttff_p95_s'])} "
            f"{fmt(c['control_p50_s'])} {fmt(c['control_p95_s'])} {fmt(c['chunk_latency_p50_s'])} "
            f"{fmt(c['chunk_latency_p95_s'])} {100 * c['busy']:5.1f}"
        )
    for c in cells:
        if c["refusal"]:
            print(f"\nrefused ({'lead' if c['start_rule'] else 'cap'}, {c['requested']} asked): {c['refusal']}")
            break


def fixed_checks(cells: list[dict]) -> dict:
    """The issue's targets for 2 streams on an H200 under the start rule, and a third refused."""
    rule = [c for c in cells if c["start_rule"]]
    two = [c for c in rule if c["requested"] == 2]
    three = [c for c in rule if c["requested"] == 3]
    result: dict = {}
    if two:
        c = two[0]
        result["two_admitted_zero_stalls"] = c["admitted"] == 2 and c["stalls"] == 0
        result["two_ttff_p95_le_1s"] = c["ttff_p95_s"] is not None and c["ttff_p95_s"] <= 1.0
        result["two_control_p95_le_1.5s"] = c["control_p95_s"] is not None and c["control_p95_s"] <= 1.5
    if three:
        result["third_refused_with_reason"] = three[0]["admitted"] == 2 and three[0]["refusal"] is not None
    return result


def with_overrides(sim: SimConfig, overrides: list[str]) -> SimConfig:
    """`sim` with `FIELD=VALUE` overrides (floats) from the command line."""
    fields = {f.name for f in dataclasses.fields(SimConfig)}
    changes = {}
    for item in overrides:
        name, _, value = item.partition("=")
        if name not in fields:
            raise SystemExit(f"--sim {item!r}: no field {name!r}; fields: {', '.join(sorted(fields))}")
        kind = type(getattr(sim, name))
        if kind not in (int, float):
            raise SystemExit(f"--sim {item!r}: {name} is not a number")
        changes[name] = kind(float(value))
    return dataclasses.replace(sim, **changes)


def main_fixed(args: argparse.Namespace, seeds: list[int]) -> int:
    sim = dataclasses.replace(H200, duration_s=args.duration if args.duration_set else H200.duration_s)
    sim = with_overrides(sim, args.sim)
    if args.buffer_cap is not None:
        sim = dataclasses.replace(sim, buffer_cap_s=args.buffer_cap)
    margins = [args.start_margin_s, math.inf] if math.isfinite(args.start_margin_s) else [math.inf]
    jobs = []
    for margin in margins:
        for streams in (1, 2, 3):
            cfg = SchedulerConfig(
                denoise_steps=sim.denoise_steps,
                buffer_cap_s=sim.buffer_cap_s,
                max_batch=args.max_batch,
                utilization_target=args.utilization_target,
                initial_forward_s=sim.forward_s,
                start_margin_s=margin,
                startup_slack_s=args.startup_slack_s,
                degrade_steps=sim.degrade_steps if args.degrade != "off" else (),
            )
            jobs.append((sim, cfg, streams, seeds, args.stagger))
    t0 = time.perf_counter()
    cells = run_all(run_fixed_cell, jobs, args.workers)
    wall_s = time.perf_counter() - t0
    print(
        f"scheduler simulation, H200: DENOISE {sim.forward_s * 1e3:g} ms x {sim.denoise_steps} + COMMIT "
        f"{sim.commit_s * 1e3:g} ms = {sim.chunk_cost_s * 1e3:g} ms per {sim.chunk_s:g} s chunk "
        f"({sim.capacity_streams:.2f} streams at 100 %), RECACHE {sim.recache_s * 1e3:g} ms, jitter {sim.jitter:g}, "
        f"hand-over {sim.hand_over_s * 1e3:g} ms, {sim.launch_depth} forwards launched ahead; buffer cap "
        f"{sim.buffer_cap_s:g} s, start margin {args.start_margin_s:g} s, startup slack {args.startup_slack_s:g} s; "
        f"viewers join {'2-12 s apart' if args.stagger else 'together'}, a prompt every ~{sim.prompt_every_s:g} s; "
        f"{len(seeds)} seeds x {sim.duration_s:g} s"
    )
    print("rule: lead = the start rule, cap = run ahead to the cap (start_margin_s=inf); admit: mean per seed;")
    print("ctl = prompt sent -> first frame under it played; lat = chunk latency, due -> delivered (every chunk,")
    print("those running ahead to a new prompt included); times in s\n")
    print_fixed_table(cells)
    verdict = fixed_checks(cells)
    print_checks_and_summary(verdict, wall_s, cells, {
        "bench": "scheduler",
        "scenario": "h200",
        "sim": asdict(sim),
        "seeds": len(seeds),
        "start_margin_s": args.start_margin_s if math.isfinite(args.start_margin_s) else None,  # None: no rule
        "startup_slack_s": args.startup_slack_s,
        "stagger": args.stagger,
        "utilization_target": args.utilization_target,
        "max_batch": args.max_batch,
    })
    return 0 if args.quick or all(verdict.values()) else 1


def print_checks_and_summary(verdict: dict, wall_s: float, cells: list[dict], summary: dict) -> None:
    """The checks, then the one JSON line: `summary` with the checks, the wall time and the cells (floats
    rounded, the per-seed lists left out)."""
    print(f"\nchecks (wall {wall_s:.1f} s):")
    for key, value in verdict.items():
        print(f"  {key}: {value}")
    rounded = [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in c.items() if k != "time_lost_by_seed"}
               for c in cells]
    print(json.dumps({**summary, "checks": verdict, "wall_s": round(wall_s, 2), "cells": rounded}))


def paired_difference(a: list[float], b: list[float]) -> tuple[float, float]:
    """Mean and standard error of a[i] - b[i] over seeds (same workloads, so paired)."""
    diffs = [x - y for x, y in zip(a, b)]
    mean = sum(diffs) / len(diffs)
    if len(diffs) < 2:
        return mean, math.inf
    var = sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1)
    return mean, math.sqrt(var / len(diffs))


def checks(cells: list[dict]) -> dict:
    """The issue's must-show, computed from the cells (those of the first degrade setting run)."""
    cells = [c for c in cells if c["degrade"] == cells[0]["degrade"]] if cells else cells

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
        f"{'adm':>3} {'deg':>3} {'load':>4} {'policy':<12} {'admit':>9} {'stalls':>6} {'stall%':>6} {'lost%':>6} "
        f"{'ttff50':>6} {'ttff95':>6} {'ctl50':>6} {'ctl95':>6} {'busy%':>5} {'degraded':>13}"
    )
    print(header)
    print("-" * len(header))
    last = None
    for c in cells:
        if last is not None and (c["admission"], c["load"]) != last:
            print()
        last = (c["admission"], c["load"])
        deg = f"{c['degraded']}/{c['chunks']}"
        fmt = lambda x: "   -  " if x is None else f"{x:6.2f}"  # noqa: E731
        print(
            f"{'on' if c['admission'] else 'off':>3} {'on' if c['degrade'] else 'off':>3} {c['load']:4.2f} {c['policy']:<12} "
            f"{c['admitted']:>4}/{c['viewers']:<4} {c['stalls']:>6} {100 * c['stall_ratio']:6.2f} "
            f"{100 * c['time_lost']:6.2f} {fmt(c['ttff_p50_s'])} {fmt(c['ttff_p95_s'])} "
            f"{fmt(c['control_p50_s'])} {fmt(c['control_p95_s'])} {100 * c['busy']:5.1f} {deg:>13}"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", choices=("load", "h200"), default="load", help="see the module docstring")
    ap.add_argument("--seeds", type=int, default=8, help="seeds per cell (default 8)")
    ap.add_argument("--first-seed", type=int, default=0, help="seeds are first-seed .. first-seed+seeds-1")
    ap.add_argument(
        "--duration", type=float, default=None, help="seconds of arrivals per run (default 900; h200: 300 of viewing)"
    )
    ap.add_argument(
        "--start-margin-s", type=float, default=SchedulerConfig.start_margin_s, help="inf: no start rule (to the cap)"
    )
    ap.add_argument("--buffer-cap", type=float, default=None, help="buffer_cap_s (default 2.0)")
    ap.add_argument("--stagger", action="store_true", help="h200: viewers join 2-12 s apart, not together")
    ap.add_argument("--loads", default="0.5,0.6,0.7,0.8,0.9,1.0,1.1,1.2", help="offered loads, comma separated")
    ap.add_argument("--policies", default=",".join(POLICIES), help="policies, comma separated")
    ap.add_argument("--admission", choices=("both", "on", "off"), default="both")
    ap.add_argument("--degrade", choices=("on", "off", "both"), default="on",
                    help="chunks may run fewer denoising steps instead of a stall (the server's default: on)")
    ap.add_argument("--degrade-margin-s", type=float, default=SchedulerConfig.degrade_margin_s)
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
    ap.add_argument("--sim", action="append", default=[], metavar="FIELD=VALUE",
                    help="override a cost-model field (repeatable), e.g. --sim forward_s=0.062 --sim hand_over_s=0.055")
    args = ap.parse_args(argv)
    args.duration_set = args.duration is not None
    if args.duration is None:
        args.duration = 900.0
    if args.quick:
        args.seeds, args.duration, args.loads = 3, 300.0, "0.5,0.9,1.2"
        args.duration_set = True
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    if args.scenario == "h200":
        return main_fixed(args, seeds)
    loads = [float(x) for x in args.loads.split(",")]
    policies = args.policies.split(",")
    admissions = {"both": (True, False), "on": (True,), "off": (False,)}[args.admission]
    degrades = {"both": (True, False), "on": (True,), "off": (False,)}[args.degrade]
    sim = with_overrides(SimConfig(duration_s=args.duration), args.sim)
    if args.buffer_cap is not None:
        sim = dataclasses.replace(sim, buffer_cap_s=args.buffer_cap)

    jobs = []
    for admission, load, degrade, policy in itertools.product(admissions, loads, degrades, policies):
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
            start_margin_s=args.start_margin_s,
            degrade_steps=sim.degrade_steps if degrade else (),
            degrade_margin_s=args.degrade_margin_s,
        )
        jobs.append((sim, cfg, load, seeds))
    t0 = time.perf_counter()
    cells = run_all(run_cell, jobs, args.workers)
    wall_s = time.perf_counter() - t0

    print(
        f"scheduler simulation: capacity {sim.capacity_streams:g} streams ({sim.denoise_steps + 1} forwards of "
        f"{sim.forward_s * 1e3:g} ms, jitter {sim.jitter:g}, recache {sim.recache_s * 1e3:g} ms, per "
        f"{sim.chunk_s:g} s chunk), buffer cap {sim.buffer_cap_s:g} s, start margin {args.start_margin_s:g} s, "
        f"hand-over {sim.hand_over_s * 1e3:g} ms, {sim.launch_depth} forwards launched ahead, "
        f"sessions ~{sim.session_mean_s:g} s, "
        f"a prompt every ~{sim.prompt_every_s:g} s; {len(seeds)} seeds x {sim.duration_s:g} s per cell"
    )
    print("stall% = stall / (play + stall); lost% = (startup + stall) / session; times in s\n")
    print_table(cells)
    verdict = checks(cells)
    print_checks_and_summary(verdict, wall_s, cells, {
        "bench": "scheduler",
        "sim": asdict(sim),
        "seeds": len(seeds),
        "utilization_target": args.utilization_target,
        "startup_slack_s": args.startup_slack_s,
        "restart_margin_chunks": args.restart_margin_chunks,
        "restart_on_prompt": not args.no_restart,
        "stall_guard_chunks": args.stall_guard_chunks,
        "start_margin_s": args.start_margin_s if math.isfinite(args.start_margin_s) else None,  # None: no rule
        "max_batch": args.max_batch,
    })
    decisive = ("admission_zero_stalls", "slack_time_lost_not_above_rr_2se", "slack_ttff_p95_lt_rr_at_load_ge_0.7")
    return 0 if args.quick or all(verdict.get(k, True) for k in decisive) else 1


if __name__ == "__main__":
    sys.exit(main())
