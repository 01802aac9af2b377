"""The Prometheus metrics of one server (`Metrics`: its own registry, no globals) and how they are read off the
engine and the open streams when /metrics is asked for (`Metrics.refresh`).

Counters and histograms move as things happen (a stream admitted, a chunk sent, a refusal); the gauges are set
from the engine's counters and the streams' states at each refresh. The cluster's gateway keeps one too, for what
it refuses at its own front.

What the process holds, which an hour-long stream must leave flat (benchmarks/soak.py reads it every minute): its own
RSS, open fds and CPU come from prometheus_client's `ProcessCollector`, on the server's registry; `ProcessGauges` adds
what that collector lacks, read off Linux's /proc (`read_process`):

- the server's thread count (`streamsvc_process_threads`: every OS thread, torch's and x264's included);
- the encoder child processes (streamsvc/engine/encode.py `EncoderProcess`: x264 out of the server's GIL), summed:
  `streamsvc_encoder_processes`, `..._rss_bytes`, `..._open_fds`, `..._threads`;
- on a CUDA device, torch's allocated and reserved memory (`streamsvc_cuda_memory_{allocated,reserved}_bytes`), made
  at the first refresh that has them, so a CPU server shows none.

Where there is no /proc the thread and child figures are skipped (logged once), as the collector skips its own.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest

from streamsvc.door.access import Refusal
from streamsvc.viewers.session import Session, SessionState

if TYPE_CHECKING:
    from streamsvc.engine.engine import Engine

# chunk latency buckets (s): about 25 % apart from 0.1 to 2 s, where chunks land, so that a percentile read off the
# buckets over a minute (benchmarks/soak.py) moves when the latency creeps by a tenth
CHUNK_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.125, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.75, 1, 1.25, 1.5,
                         2, 3, 5)
PROC = Path("/proc")

log = logging.getLogger(__name__)


class Metrics:
    """Prometheus metrics of one server (its own registry, no globals)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.process = ProcessGauges(r)  # RSS, fds, CPU, threads; the encoder processes'; CUDA memory (refresh)
        self.streams = Gauge("streamsvc_streams", "Open streams by state", ["state"], registry=r)
        self.admitted = Counter("streamsvc_streams_admitted", "Streams admitted", registry=r)
        self.refused = Counter("streamsvc_streams_refused", "Streams refused at admission", registry=r)
        self.stalls = Gauge("streamsvc_modelled_stalls", "Stalls of open streams in the scheduler's playback model", registry=r)
        self.client_stalls = Counter("streamsvc_client_stalls", "Stalls reported by clients (stats messages)", registry=r)
        self.client_late = Gauge("streamsvc_client_late", "Lateness of open streams that their own clients caused (a "
                                 "viewer's reports, input missing or late): charged to the stream, never read as "
                                 "overload", registry=r)
        self.track_stalls = Counter("streamsvc_webrtc_track_stalls",
                                    "WebRTC: times a track had no frame at its due time (stalls the server caused)",
                                    registry=r)
        self.ttff = Histogram("streamsvc_ttff_seconds", "Admission to first chunk sent", registry=r,
                              buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10))
        self.watcher_ttff = Histogram("streamsvc_watcher_ttff_seconds", "A watcher's join to its first chunk sent",
                                      registry=r, buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10))
        self.watchers = Gauge("streamsvc_watchers", "Viewers watching open streams (steerers not counted)", registry=r)
        self.watchers_admitted = Counter("streamsvc_watchers_admitted", "Watchers admitted", registry=r)
        self.orphans = Gauge("streamsvc_orphaned_streams", "Open streams whose steerer left (watchers remain)",
                             registry=r)
        self.recordings = Gauge("streamsvc_recordings", "Streams being recorded", registry=r)
        self.input = Gauge("streamsvc_input", "Input video of the open streams (issue 35): frames received, dropped, "
                           "repeated, decode errors, chunks taken with frames and missing", ["kind"], registry=r)
        self.recording_bytes = Gauge("streamsvc_recordings_bytes", "Disk the recordings use", registry=r)
        self.chunk_latency = Histogram("streamsvc_chunk_latency_seconds", "First denoising step to chunk ready",
                                       registry=r, buckets=CHUNK_LATENCY_BUCKETS)
        self.chunks = Counter("streamsvc_chunks", "Chunks sent", registry=r)
        self.degraded = Gauge("streamsvc_degraded_chunks", "Chunks degraded instead of a stall, by the stage that "
                              "was late (device: fewer denoising steps; encode: a cheaper x264 encode)", ["stage"],
                              registry=r)
        self.overloaded = Counter("streamsvc_streams_overloaded", "Streams ended as the last resort (error 'overloaded'): "
                                  "degradation could no longer keep every stream from stalling", registry=r)
        self.stage_load = Gauge("streamsvc_stage_load", "Predicted busy fraction of each stage a chunk passes "
                                "(what admission checks against its target)", ["stage"], registry=r)
        self.admission_closed = Gauge("streamsvc_admission_closed",
                                      "1 while a stream was late lately: no stream is admitted (the closed loop)", registry=r)
        self.pressure = Gauge("streamsvc_scheduler_pressure",
                              "1 while a chunk was degraded lately (no stream steers ahead of its lead)", registry=r)
        self.queue = Gauge("streamsvc_scheduler_queue", "Streams that want a forward now", registry=r)
        self.load = Gauge("streamsvc_scheduler_load", "Predicted busy fraction of the engine", registry=r)
        self.kv_bytes = Gauge("streamsvc_kv_bytes", "KV cache bytes held by open streams", registry=r)
        self.kv_budget = Gauge("streamsvc_kv_budget_bytes", "KV pool budget", registry=r)
        self.forwards = Gauge("streamsvc_forwards", "Forwards run, by kind", ["kind"], registry=r)
        self.forward_s = Gauge("streamsvc_forward_seconds", "Time spent in forwards, by kind", ["kind"], registry=r)
        self.forward_gpu_s = Gauge("streamsvc_forward_gpu_seconds",
                                   "Device time of forwards by CUDA events (CPU: wall time), by kind", ["kind"], registry=r)
        self.encode_s = Gauge("streamsvc_encode_seconds", "Output stage time: frames to host, x264 and packing",
                              registry=r)
        self.chunks_encoded = Gauge("streamsvc_chunks_encoded", "Chunks through the output stage", registry=r)
        self.chunk_latency_max = Gauge("streamsvc_chunk_latency_max_seconds",
                                       "Slowest chunk so far: its first forward's launch to its hand-over", registry=r)
        self.parked = Gauge("streamsvc_parked_streams", "Paused streams whose state is parked in host memory",
                            registry=r)
        self.parked_bytes = Gauge("streamsvc_parked_bytes", "Host memory the parked streams hold", registry=r)
        self.park_budget = Gauge("streamsvc_park_budget_bytes", "Host memory parked streams may hold", registry=r)
        self.parks = Gauge("streamsvc_parks", "Streams parked (pauses) and brought back (resumes)", ["op"],
                           registry=r)
        self.park_s = Gauge("streamsvc_park_seconds", "Time of the parks' and resumes' copies, in total", ["op"],
                            registry=r)
        self.streamless_s = Gauge("streamsvc_streamless_cpu_seconds",
                                  "Event-loop CPU spent on clients without a stream (HTTP requests, messages before "
                                  "start or watch), in total; left out of the cost estimates admission uses", registry=r)
        self.errors = Counter("streamsvc_protocol_errors", "Bad client messages answered with an error", registry=r)
        self.replies_dropped = Counter("streamsvc_error_replies_dropped", "Error replies not sent: past a "
                                       "connection's rate of them (streamsvc/viewers/outbox.py)", registry=r)
        self.connections = Gauge("streamsvc_connections", "Open connections: WebSockets (with a stream or not), "
                                 "WebRTC peer connections (viewers', WHEP's) and WHIP publishers", ["kind"], registry=r)
        self.tables = Gauge("streamsvc_table_entries", "Entries of the server's tables kept per stream, viewer, "
                            "connection or client address, by table (Server.table_sizes: flat over a long run)",
                            ["table"], registry=r)
        self.refusals = Counter("streamsvc_refusals", "Requests refused, by reason", ["reason"], registry=r)
        for reason in Refusal:
            self.refusals.labels(reason.value)  # every reason shows, at 0 until it happens

    def refresh(self, engine: Engine, sessions: Collection[Session], recording_bytes: int,
                streamless_s: float = 0.0, connections: Mapping[str, int] | None = None,
                tables: Mapping[str, int] | None = None) -> None:
        """Set the gauges from the engine's counters and its latest snapshot, the open streams (`sessions`), the
        disk the recordings use, the event loop's CPU on clients without a stream so far (`streamless_s`), the
        open connections by kind (`connections`) and the server's tables' entries by name (`tables`)."""
        m, st = self, engine.stats()
        snap = st.scheduler
        out = engine.output  # (None while the engine builds)
        m.process.refresh(out.encoder_pids() if out else (), out.device_memory() if out else None)
        m.streamless_s.set(streamless_s)
        for table, n in (tables or {}).items():
            m.tables.labels(table).set(n)
        for kind, n in (connections or {}).items():
            m.connections.labels(kind).set(n)
        for state in SessionState:
            m.streams.labels(state.value).set(sum(1 for s in sessions if s.state is state))
        m.kv_bytes.set(st.kv_used_bytes)
        m.watchers.set(sum(s.watchers for s in sessions))
        m.orphans.set(sum(1 for s in sessions if s.steerer is None))
        m.recordings.set(sum(1 for s in sessions if s.recorder is not None))
        inputs = [s.input.stats() for s in sessions if s.input is not None]
        for kind in ("received", "dropped", "repeated", "decode_errors", "chunks", "missing_chunks"):
            m.input.labels(kind).set(sum(i[kind] for i in inputs))
        m.recording_bytes.set(recording_bytes)
        m.kv_budget.set(st.kv_budget_bytes)
        for kind, n in st.forwards.items():
            m.forwards.labels(kind).set(n)
            m.forward_s.labels(kind).set(st.forward_seconds[kind])
            m.forward_gpu_s.labels(kind).set(st.gpu_seconds[kind])
        m.encode_s.set(st.encode_seconds)
        m.chunks_encoded.set(st.chunks_encoded)
        m.chunk_latency_max.set(st.chunk_latency_max_s)
        m.parked.set(st.parked_streams)
        m.parked_bytes.set(st.parked_bytes)
        m.park_budget.set(engine.config.park_budget_bytes)
        for op, n, seconds in (("park", st.parks, st.park_seconds),
                               ("restore", st.restores, st.restore_seconds)):
            m.parks.labels(op).set(n)
            m.park_s.labels(op).set(seconds)
        m.degraded.labels("device").set(st.degraded_chunks)
        m.degraded.labels("encode").set(st.fast_encodes)
        if snap is not None:
            for stage, load in snap.stage_load.items():
                m.stage_load.labels(stage.value).set(load)
            m.admission_closed.set(int(snap.late))
            m.pressure.set(int(snap.pressure))
            m.queue.set(snap.queue_length)
            m.load.set(snap.predicted_load)
            m.stalls.set(snap.stalls)
            m.client_late.set(snap.client_late)

    def exposition(self) -> bytes:
        """The registry in Prometheus' text format (the body of GET /metrics)."""
        return generate_latest(self.registry)


@dataclass(frozen=True)
class ProcessFigures:
    """One process's holdings, from /proc/<pid>."""

    rss_bytes: int  # resident memory (VmRSS)
    open_fds: int  # entries of /proc/<pid>/fd
    threads: int  # OS threads (Threads)


def read_process(pid: int, proc: Path = PROC) -> ProcessFigures | None:
    """The figures of process `pid` from `proc` (/proc), or None when it cannot be read (gone, no /proc, not ours)."""
    try:
        fields = {}
        for line in (proc / str(pid) / "status").read_text().splitlines():
            key, _, value = line.partition(":")
            fields[key] = value.split()
        fds = sum(1 for _ in (proc / str(pid) / "fd").iterdir())
        return ProcessFigures(rss_bytes=int(fields["VmRSS"][0]) * 1024, open_fds=fds, threads=int(fields["Threads"][0]))
    except (OSError, KeyError, IndexError, ValueError):
        return None


class ProcessGauges:
    """The process collector and the gauges above, on a server's registry; `refresh` sets the gauges."""

    def __init__(self, registry: CollectorRegistry, proc: Path = PROC) -> None:
        self.registry = registry
        self.proc = proc
        self.has_proc = (proc / "self" / "status").exists()
        self._skip_logged = False
        ProcessCollector(registry=registry)  # process_resident_memory_bytes, process_open_fds, process_cpu_seconds...
        r = registry
        self.threads = Gauge("streamsvc_process_threads", "OS threads of the server process", registry=r)
        self.encoders = Gauge("streamsvc_encoder_processes", "Encoder child processes (x264 out of the server's GIL) "
                              "that could be read", registry=r)
        self.encoder_rss = Gauge("streamsvc_encoder_rss_bytes", "Resident memory of the encoder child processes, "
                                 "summed", registry=r)
        self.encoder_fds = Gauge("streamsvc_encoder_open_fds", "Open fds of the encoder child processes, summed",
                                 registry=r)
        self.encoder_threads = Gauge("streamsvc_encoder_threads", "OS threads of the encoder child processes, summed",
                                     registry=r)
        self.cuda_allocated: Gauge | None = None  # made at the first refresh with device memory (a CUDA server)
        self.cuda_reserved: Gauge | None = None

    def refresh(self, encoder_pids: Iterable[int] = (), device_memory: tuple[int, int] | None = None) -> None:
        """Read the server's threads and the encoder children `encoder_pids`; `device_memory`: (allocated, reserved)
        bytes of torch's CUDA allocator, None off CUDA."""
        if device_memory is not None:
            if self.cuda_allocated is None:
                r = self.registry
                self.cuda_allocated = Gauge("streamsvc_cuda_memory_allocated_bytes", "Device memory torch's CUDA "
                                            "allocator has handed out (torch.cuda.memory_allocated)", registry=r)
                self.cuda_reserved = Gauge("streamsvc_cuda_memory_reserved_bytes", "Device memory torch's CUDA "
                                           "allocator holds (torch.cuda.memory_reserved)", registry=r)
            self.cuda_allocated.set(device_memory[0])
            self.cuda_reserved.set(device_memory[1])
        if not self.has_proc:
            self.threads.set(threading.active_count())  # Python's threads only: better than none
            if not self._skip_logged:
                log.info("no %s on this platform: the encoder processes' memory, fds and threads are not measured",
                         self.proc)
                self._skip_logged = True
            return
        own = read_process(os.getpid(), self.proc)
        if own is not None:
            self.threads.set(own.threads)
        children = [f for f in (read_process(pid, self.proc) for pid in encoder_pids) if f is not None]
        self.encoders.set(len(children))
        self.encoder_rss.set(sum(f.rss_bytes for f in children))
        self.encoder_fds.set(sum(f.open_fds for f in children))
        self.encoder_threads.set(sum(f.threads for f in children))
