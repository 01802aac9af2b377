"""Cost estimation: what one forward, one chunk and one stream cost on each stage.

Costs (`CostModel`): the warm-up's median of each forward kind until `cost_min_samples`
are measured while serving, then the `cost_percentile` of the last `cost_window`.

Each stage's cost per chunk (`Stage`: the device's forwards, the output stage's frames
to the host, x264 and packing on `output_capacity` workers, the transports' send on the
event loop) is seeded by the warm-up (`seed_stage`) and then follows the
`cost_percentile` of what serving measures (`observe_stage`). The device's load counts
the streams' prompt switches as measured: the recaches of the last RECACHE_WINDOW_S, at
a recache's cost.

`CostEstimates` holds the figures and adds them up (a chunk's forwards at a batch size,
one stream's share, what a chunk may wait for); admission and the planner read them.

What clients without a stream cost the server is theirs, not a stage's (issue 33: a flood of
junk frames or `GET /metrics` on a fresh server once made every start refused, for good).
The server meters the event loop's CPU spent on them (HTTP requests, messages before
`start`), and a sample that shares its time with that work is corrected by it
(`without_streamless`): the event loop's CPU per chunk sent less the stream-less CPU
(`SendSampler`), and on a CPU device a forward's wall time less the stream-less CPU that ran
meanwhile (it held the GIL and a core). Where that work was more than `streamless_max_share`
of the sample, or came in more stream-less events (connections, requests) than the sample
has units (chunks, a forward), the sample is dropped instead: the meter sees our handlers, not
the library's work around them (a flood of /metrics refused with 429 cost the loop some
0.3 ms a request in accepting, parsing and replying, and our handlers a fifth of that), so a
sample mostly made of such work would keep a share of it unseen, and a dropped sample moves
the estimate neither way. And an estimate is re-measured rather than believed forever:
when the server empties no sample can come to bring a wrong one down, so the first admission
into an empty server starts from the warm-up's figures again (`CostEstimates.restart`).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Collection, Hashable

from models.work import WorkKind

from .config import SchedulerConfig
from .types import Stage, StreamRequest

RECACHE_WINDOW_S = 10.0  # admission counts the recaches of this many past seconds as the streams' steering load


def percentile(samples: Collection[float], q: float) -> float | None:
    """Nearest-rank `q` percentile (q in (0, 1]; None for no samples)."""
    if not samples:
        return None
    ordered = sorted(samples)
    return ordered[math.ceil(q * len(ordered)) - 1]


class CostModel:
    """The cost of one forward per (kind, batch size): a high percentile of what serving measures.

    A prior (the warm-up's median through `seed`, else the first measurement) stands until `min_samples`
    forwards of that kind and size are measured; from then on the estimate is the `percentile` of the
    last `window` of them. So it follows what forwards cost under load (a throttled device, a noisy
    neighbour, an encoder competing for the CPU) and comes back down when that passes, and a run of
    fast samples cannot talk it down the way it could a moving average.
    """

    def __init__(self, initial_forward_s: float, percentile: float = 0.9, window: int = 64,
                 min_samples: int = 8) -> None:
        self.initial_forward_s = initial_forward_s
        self.percentile, self.min_samples = percentile, min_samples
        self._samples: dict[tuple[Hashable, int], deque[float]] = {}
        self._window = window
        self._estimate: dict[tuple[Hashable, int], float] = {}  # kept current by seed and observe
        self._seeds: dict[tuple[Hashable, int], float] = {}  # the priors given by `seed`, which `reset` goes back to

    def estimate(self, kind: Hashable, batch: int = 1) -> float:
        """The (kind, batch) cost. A batch size not measured yet, between two that are, costs the straight line
        between them (a forward's cost grows about linearly with its batch: on the tiny preset's CPU forward of
        one latent frame, 1.75 / 5.71 / 7.33 / 9.39 ms at 1 / 8 / 12 / 16, 7.35 ms on the line from 1 to 16 at
        12); one above every measured size costs what its streams cost one by one (batch x the batch-1 cost, else
        the initial guess): no gain is counted before it is seen."""
        if (kind, batch) in self._estimate:
            return self._estimate[(kind, batch)]
        one_by_one = batch * self._estimate.get((kind, 1), self.initial_forward_s)
        sizes = self.sizes(kind)
        below = [b for b in sizes if b < batch]
        above = [b for b in sizes if b > batch]
        if not below or not above:
            return one_by_one
        lo, hi = below[-1], above[0]
        cost_lo, cost_hi = self._estimate[(kind, lo)], self._estimate[(kind, hi)]
        return min(one_by_one, cost_lo + (cost_hi - cost_lo) * (batch - lo) / (hi - lo))

    def sizes(self, kind: Hashable) -> list[int]:
        """The batch sizes of `kind` seeded or measured, ascending."""
        return sorted(b for k, b in self._estimate if k == kind)

    def seed(self, kind: Hashable, batch: int, seconds: float) -> None:
        """A prior for (kind, batch), e.g. the warm-up's median; measurements replace it once there are enough."""
        key = (kind, batch)
        self._samples.pop(key, None)
        self._estimate[key] = self._seeds[key] = seconds

    def reset(self) -> None:
        """Forget every measurement: each seeded (kind, batch) costs its seed again, the others the initial guess."""
        self._samples.clear()
        self._estimate = dict(self._seeds)

    def observe(self, kind: Hashable, batch: int, elapsed_s: float) -> None:
        """One measured (kind, batch) cost."""
        key = (kind, batch)
        samples = self._samples.setdefault(key, deque(maxlen=self._window))
        samples.append(elapsed_s)
        if len(samples) >= self.min_samples:
            self._estimate[key] = percentile(samples, self.percentile)
        else:
            self._estimate.setdefault(key, elapsed_s)


class CostEstimates:
    """The scheduler's cost figures and their sums.

    `forward`: one forward's cost by (WorkKind, batch). `stage`: one chunk's cost on the output
    stage and the send, by (Stage, 1). And the recaches of the last RECACHE_WINDOW_S, which
    the device's load counts as the streams' steering.
    """

    def __init__(self, config: SchedulerConfig) -> None:
        cfg = self.config = config
        self.forward = CostModel(cfg.initial_forward_s, cfg.cost_percentile, cfg.cost_window, cfg.cost_min_samples)
        # cost of one chunk on the output stage and the send (per stream; the device's is `forward`)
        self.stage = CostModel(0.001, cfg.cost_percentile, cfg.cost_window, cfg.cost_min_samples)
        self._recaches: deque[float] = deque()  # times of recaches (one per stream) within RECACHE_WINDOW_S

    def restart(self) -> None:
        """Back to the warm-up's figures: measured forward and stage costs and the recaches counted lately are
        forgotten. For an empty server: no sample can come to bring a wrong estimate down (nothing is sent, nothing
        runs), so one that refused everyone would be believed forever; the warm-up's own figures still refuse what
        they should (a model too slow for its device)."""
        self.forward.reset()
        self.stage.reset()
        self._recaches.clear()

    def recache_s(self) -> float:
        """Estimated time of one stream's RECACHE forward."""
        return self.forward.estimate(WorkKind.RECACHE)

    def chunk_s(self, batch: int = 1, steps: int | None = None) -> float:
        """Estimated time of one chunk's forwards at `batch` streams (no recache): `steps` denoising
        forwards (default: all of them) and the commit."""
        steps = self.config.denoise_steps if steps is None else steps
        return steps * self.forward.estimate(WorkKind.DENOISE, batch) + self.forward.estimate(WorkKind.COMMIT, batch)

    def stream_chunk_s(self, streams: int, req: StreamRequest | None = None) -> float:
        """One stream's share of a chunk's forwards when `streams` streams batch up to max_batch together. A
        stream with input (`req`) is charged the larger of its chunks' costs with input (from its start step on)
        and without (all the steps: a chunk whose input is missing runs as text-to-video, and any stream's camera
        may go off; issue 41): the full count. A stream with a style is charged its `style_cost` share more."""
        batch = max(1, min(streams, self.config.max_batch))
        steps = self.config.denoise_steps
        if req is not None:
            steps = max(steps, input_steps(req, steps))
        return self.chunk_s(batch, steps=steps) / batch * (1.0 + (req.style_cost if req is not None else 0.0))

    def queue_work_s(self, streams: int) -> float:
        """One chunk of each of `streams` streams, in batches of up to max_batch: what a chunk may wait for."""
        batch = max(1, min(streams, self.config.max_batch))
        return math.ceil(streams / batch) * self.chunk_s(batch)

    def stream_load(self, req: StreamRequest, streams: int = 1) -> float:
        """Busy fraction of the device one stream needs in steady state among `streams` streams (chunks/s x
        its share of a chunk's forwards at the batch size that many streams run at)."""
        return req.fps / req.chunk_frames * self.stream_chunk_s(streams, req)

    def stage_chunk_s(self, stage: Stage, streams: int) -> float:
        """One stream's chunk on `stage`, as a share of the stage's time (the device's batched at `streams`)."""
        if stage is Stage.DEVICE:
            return self.stream_chunk_s(streams)
        capacity = self.config.output_capacity if stage is Stage.OUTPUT else 1.0
        return self.stage.estimate(stage) / capacity

    def recached(self, now: float) -> None:
        """A stream's RECACHE ran at `now`: it counts toward the device's load for RECACHE_WINDOW_S."""
        self._recaches.append(now)

    def recache_load(self, now: float | None = None) -> float:
        """Busy fraction of the device the streams' recaches took lately (measured, not predicted); with `now`,
        recaches older than RECACHE_WINDOW_S are forgotten first."""
        if now is not None:
            while self._recaches and self._recaches[0] < now - RECACHE_WINDOW_S:
                self._recaches.popleft()
        return len(self._recaches) / RECACHE_WINDOW_S * self.recache_s()


def input_steps(req: StreamRequest, denoise_steps: int) -> int:
    """Denoising forwards of `req`'s chunks with input frames at full quality: all of them, or with input from its
    start step on (at least one). (A chunk whose input went missing runs all of them: admission charges those, see
    `CostEstimates.stream_chunk_s`.)"""
    k = req.input_start_step
    return denoise_steps if k is None else max(denoise_steps, k + 1) - k


def without_streamless(total_s: float, streamless_s: float, max_share: float, events: int = 0,
                       units: int = 1) -> float | None:
    """A sample of a stage's work over `units` units of it (`total_s`: the event loop's CPU over `units` chunks, or
    a CPU forward's wall time, 1 unit) less `streamless_s`, the event loop's CPU on clients without a stream over
    the same time; None (drop the sample) when that was over `max_share` of `total_s`, or when more stream-less
    events (connections and requests) than units came meanwhile. The meter sees our handlers, not the library's
    work around them (accepting a connection, parsing a request or a frame, writing a reply: a fraction of a
    millisecond each, about what a chunk's send costs): a sample mostly theirs would keep a share of it unseen,
    and a dropped sample moves the estimate neither way."""
    streamless_s = max(0.0, streamless_s)
    if streamless_s > max_share * total_s or events > units:
        return None
    return total_s - streamless_s


class SendSampler:
    """The SEND stage's samples: the event loop's own CPU per chunk sent, from cumulative readings taken every period.

    `read(cpu_s, streamless_s, chunks, events)` takes the loop thread's CPU so far, the part of it the server
    metered as stream-less work, the chunks sent so far and the stream-less events counted so far. Over a window
    of at least `min_chunks` chunks it gives one sample: the window's CPU less its stream-less CPU, per chunk,
    unless `without_streamless` drops it; else None. A period in which no chunk was sent closes the window
    unsampled: its CPU belonged to no chunk (an idle server, a flood before any stream) and must not be charged to
    the next ones.
    """

    def __init__(self, min_chunks: int, max_share: float) -> None:
        if min_chunks < 1:
            raise ValueError(f"min_chunks={min_chunks}: a sample needs at least 1 chunk")
        self.min_chunks, self.max_share = min_chunks, max_share
        self._start: tuple[float, float, int, int] | None = None  # the readings where the window opened
        self._last_chunks: int | None = None  # chunks sent at the previous reading

    def read(self, cpu_s: float, streamless_s: float, chunks: int, events: int = 0) -> float | None:
        """The readings at the end of a period; returns the window's CPU per chunk when it closes with a sample."""
        reading = (cpu_s, streamless_s, chunks, events)
        last, self._last_chunks = self._last_chunks, chunks
        if self._start is None or chunks == last:  # the first reading, or a period without a chunk
            self._start = reading
            return None
        cpu0, streamless0, chunks0, events0 = self._start
        sent = chunks - chunks0
        if sent < self.min_chunks:
            return None
        self._start = reading
        own_s = without_streamless(cpu_s - cpu0, streamless_s - streamless0, self.max_share, events - events0, sent)
        return None if own_s is None else own_s / sent
