"""Styles per stream on a server (`serve --lora-dir DIR`): the style LoRAs it offers, loaded into the generator's
adapters (models/adapters.py) once, shared by every stream that uses them, evicted least-recently-used under a budget.

- The offer: one style per LoRA file of the folder (models/adapters.py SUFFIXES, the layouts `AdapterSet.load` reads),
  named by the file's stem. Every file is loaded once at start, so that a bad one (unreadable, a layer the model does
  not have, a rank over the maximum) is logged with its reason then; it stays listed (GET /loras, with its error) but
  not offered (`ready`), and a stream that names it is refused with that reason. A file changed since is read again.
- Loading and CUDA graphs: at start the styles are kept loaded in name order while they fit the budget, before the
  engine captures its CUDA graphs, so that serving replays graphs for each set of Linears those styles adapt; a style
  loaded later whose Linears match such a set replays them too (its weights go through the same buffers,
  `AdapterBuffers`). One loaded later that adapts another set of Linears runs eagerly: models/graphs.py says so in
  one log line, at its first forward. On CPU nothing is captured.
- The budget (`budget_bytes`, serve --lora-budget-gib): the loaded adapters' bytes stay under it. Loading one more
  evicts the least recently used ones that no open or paused stream holds (its style, or a switch not yet applied);
  when that cannot make room, the stream or the switch is refused with the figures, and the stream goes on.
- Memory: each loaded adapter's bytes are held in the device's KV pool (`CachePool.reserve`) while it is loaded: a
  stream's KV cache is admitted only into what the caches and the styles leave, each style counted once.
- Cost: a forward with a style costs more than one without (per stream; `measure_cost` times it at start: chunks of a
  throwaway stream under the loaded style of the highest rank against the same without, the medians' ratio). A
  stream with a style is charged that share more on the device (scheduling's StreamRequest.style_cost), a style of a
  higher rank that share times the ranks' ratio: bounds both, as the overhead grows slower than the rank
  (benchmarks/lora_forward.py measured rank 16 at more than half the overhead of rank 64). With no style loaded at
  start, FALLBACK_COST. A live switch charges the dearest of the styles
  before and after it (both run until it is applied), from the switch to the stream's next one.
- The model's input adapter (models/generator.py `input_adapter`: the streams with an input of a kind it was trained
  for run under it when they have no style) costs the same way: `measure_cost` times it beside the style, and such a
  stream is charged the dearer of its share and its styles'.
- Streams: `take` (a new stream's style: the refusal, or None), `switch` (a steerer's, versioned as a prompt switch:
  the scheduler plans its recache, `apply` hands it to the generator with the plan that brings its version),
  `release` (the stream closed). A paused stream keeps its style. Everything here runs on the engine thread but
  `listing` and `offered`, which read what the engine thread published.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvcache import CachePool
from kvcache.units import format_bytes
from models.adapters import SUFFIXES, AdapterError, AdapterSet
from streamsvc.wire.protocol import MAX_LORA_NAME_CHARS

log = logging.getLogger("streamsvc.engine")

DEFAULT_BUDGET_BYTES = 2 * 2**30  # serve --lora-budget-gib's default
# a style's share of a forward when none could be measured at start: about the largest overhead
# benchmarks/lora_forward.py measured (the tiny model on CPU, rank 64: +46 %)
FALLBACK_COST = 0.5
NO_STYLES = "this server offers no styles: serve it with --lora-dir DIR (a folder of LoRA files) to offer some"
PARALLEL = ("styles do not run under --parallel: a forward split over a device group cannot add a stream's own "
            "adapter (models/dit.py); serve without --parallel to offer them")


class StyleBusy(AdapterError):
    """A style that cannot be loaded now (the budget or the device memory is held by styles in use): try later."""


@dataclass(frozen=True)
class StyleInfo:
    """One offered style as GET /loras lists it."""

    name: str
    rank: int | None  # the largest rank of its layers (None: its file could not be read)
    bytes: int  # device memory its adapter holds when loaded (0: unknown)
    loaded: bool  # on the device now
    error: str | None = None  # why its file cannot be used (None: it can)


@dataclass
class _File:
    path: Path
    rank: int | None = None
    nbytes: int = 0
    error: str | None = None
    stat: tuple[int, int] | None = None  # (mtime_ns, size) when `error` was found: a changed file is read again


@dataclass
class _Held:
    """A stream's style: the one it runs under, and switches given a version but not applied yet."""

    name: str | None
    scale: float
    input_kind: str | None = None  # its input ("video" | "image"; None: text alone): it may run the input adapter
    pending: dict[int, tuple[str | None, float]] = field(default_factory=dict)

    def names(self) -> set[str]:
        return {n for n in (self.name, *(p[0] for p in self.pending.values())) if n is not None}


class StyleLibrary:
    """The styles of one engine (module docstring). `adapters`: its generator's (None: styles refused, `refusal`
    says why); `files`: style name -> LoRA file; `pool`: the device's KV pool, where loaded adapters are held;
    `parallel`: the engine serves under --parallel, where no forward adds an adapter."""

    def __init__(self, adapters: AdapterSet | None, files: dict[str, Path], budget_bytes: int = DEFAULT_BUDGET_BYTES,
                 pool: CachePool | None = None, parallel: bool = False) -> None:
        if budget_bytes < 0:
            raise ValueError(f"the style budget must be >= 0 bytes, got {budget_bytes}")
        self.adapters, self.budget_bytes, self.pool = adapters, budget_bytes, pool
        # why no style can be used
        self.refusal = (PARALLEL if parallel else NO_STYLES) if adapters is None or not files else None
        self.parallel = parallel  # nothing to time at start either (`measure_cost`)
        self.files = {name: _File(Path(p)) for name, p in sorted(files.items())}
        self.streams: dict[str, _Held] = {}
        self.recent: list[str] = []  # the loaded styles, least recently used first
        self.cost, self.cost_rank = FALLBACK_COST, 0  # a styled forward's extra share, measured at that rank
        self.input_cost, self.input_kinds = 0.0, ()  # the input adapter's share, and the inputs that run it (`ready`)
        self.listing: tuple[StyleInfo, ...] = ()  # what GET /loras shows (published by the engine thread)
        self.offered: tuple[str, ...] = ()  # the names `ready` lists: styles whose files can be used
        self._publish()

    @classmethod
    def from_folder(cls, adapters: AdapterSet | None, folder: str | Path | None,
                    budget_bytes: int = DEFAULT_BUDGET_BYTES, pool: CachePool | None = None,
                    parallel: bool = False) -> StyleLibrary:
        """The styles of `folder` (None: none offered), each file named by its stem. A folder that is not one, or
        two files of one stem, is a ValueError (the server does not start); a file name too long for the wire is
        left out, with a warning."""
        if folder is None:
            return cls(None, {}, budget_bytes, pool, parallel)
        folder = Path(folder)
        if not folder.is_dir():
            raise ValueError(f"--lora-dir {folder}: not a directory")
        files = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in SUFFIXES)
        stems = [p.stem for p in files]
        twice = sorted({s for s in stems if stems.count(s) > 1})
        if twice:
            raise ValueError(f"--lora-dir {folder}: several files for the style(s) {', '.join(twice)}; keep one each")
        for p in [p for p in files if len(p.stem) > MAX_LORA_NAME_CHARS]:
            log.warning("style file %s left out: its name is over %d characters", p, MAX_LORA_NAME_CHARS)
        files = {p.stem: p for p in files if len(p.stem) <= MAX_LORA_NAME_CHARS}
        if not files:
            log.warning("--lora-dir %s holds no LoRA files (%s): no styles offered", folder, ", ".join(SUFFIXES))
        return cls(None if parallel else adapters, files, budget_bytes, pool, parallel)

    # -- start-up (before the CUDA graphs are captured) ------------------------------------------------------------

    def load_at_start(self) -> None:
        """Read and check every file (a bad one logged), keeping the styles loaded in name order while they fit."""
        if self.refusal is not None:
            if self.files:
                log.warning("%d style LoRA(s) not offered: %s", len(self.files), self.refusal)
            return
        for name in self.files:
            try:
                self._load(name)
            except AdapterError:
                log.warning("style %r is not offered: %s", name, self.files[name].error)
                continue
            f = self.files[name]
            if self.loaded_bytes > self.budget_bytes or not self._reserve(name, f.nbytes):
                self._evict(name)  # checked; loaded again when a stream asks for it
        loaded = list(self.recent)
        log.info("styles: %d offered (%s), %d loaded at start (%s of the %s budget)", len(self.offered),
                 ", ".join(self.offered) or "none", len(loaded), format_bytes(self.loaded_bytes),
                 format_bytes(self.budget_bytes))
        self._publish()

    def ready(self, gen) -> None:
        """The engine's CUDA graphs are captured (if any): time a style's cost, and the input adapter's, as serving
        will run them."""
        self.measure_cost(gen)

    def measure_cost(self, gen, chunks: int = 3, min_s: float = 2.0, rounds: tuple[int, int] = (3, 15),
                     clock: Callable[[], float] = time.perf_counter) -> None:
        """Time the extra share of a forward (module docstring) that the loaded style of the highest rank costs, and
        the model's input adapter: rounds of `chunks` chunks of a throwaway stream without either, then of one under
        each (one stream at a time: the warm-up's memory), after one round untimed, until `min_s` have passed (within
        `rounds`); the median of the rounds' ratios (a round's streams ran close together: drifts in the host's speed
        cancel)."""
        runs: dict[str, dict] = {}  # what is timed against the base: open_stream's arguments
        if self.recent:
            name = max(self.recent, key=lambda n: self.files[n].rank or 0)
            runs["style"] = {"lora": name}
        if not self.parallel and getattr(gen, "input_adapter", None) is not None and gen.input_kinds:
            self.input_kinds = tuple(gen.input_kinds)
            runs["input"] = {"input_kind": self.input_kinds[0]}
        if not runs:
            return
        ratios: dict[str, list[float]] = {k: [] for k in runs}
        t_start = clock()
        for i in range(rounds[1] + 1):
            base = self._time_chunks(gen, {}, chunks, clock)
            took = {k: self._time_chunks(gen, kwargs, chunks, clock) for k, kwargs in runs.items()}
            if i:
                for k, t in took.items():
                    ratios[k].append(t / base)
            if i >= rounds[0] and clock() - t_start >= min_s:
                break
        share = {k: max(0.0, statistics.median(r) - 1) for k, r in ratios.items()}
        if "style" in runs:
            self.cost, self.cost_rank = share["style"], self.files[name].rank or 0
            log.info("styles: a chunk under %r (rank %d) costs %+.0f %% of one without (median of %d rounds of %d "
                     "chunks): each stream with a style is charged that on the device", name, self.cost_rank,
                     100 * self.cost, len(ratios["style"]), chunks)
        if "input" in runs:
            self.input_cost = share["input"]
            log.info("the input adapter: a chunk under it costs %+.0f %% of one without (median of %d rounds of %d "
                     "chunks): each stream with an input it runs (%s) is charged that on the device",
                     100 * self.input_cost, len(ratios["input"]), chunks, ", ".join(self.input_kinds))

    @staticmethod
    def _time_chunks(gen, kwargs: dict, chunks: int, clock: Callable[[], float]) -> float:
        """Seconds `chunks` chunks of a new throwaway stream opened with `kwargs` (a style, an input kind) take."""
        state = gen.open_stream("style-cost", "style cost", seed=0, **kwargs)
        try:
            t0 = clock()
            for _ in range(chunks):
                while gen.run(gen.next_work(state), [state])[0] is None:
                    pass
            if gen.device.type == "cuda":
                torch.cuda.synchronize(gen.device)
            return clock() - t0
        finally:
            gen.close_stream(state)

    # -- streams (the engine thread) -------------------------------------------------------------------------------

    def table_sizes(self) -> dict[str, int]:
        """Entries of its per-stream table: the streams it holds styles for (a server counts it with its others)."""
        return {"styles.streams": len(self.streams)}

    @property
    def loaded_bytes(self) -> int:
        return sum(self.files[n].nbytes for n in self.recent)

    def take(self, stream_id: str, name: str | None, scale: float = 1.0, input_kind: str | None = None) -> str | None:
        """A new stream's style (None: none): why it is refused, or None with the style held for the stream (and its
        kind of input, for `cost_of`)."""
        if name is not None:
            try:
                self._acquire(name, scale)
            except AdapterError as e:
                return str(e)
        self.streams[stream_id] = _Held(name, scale, input_kind)
        self._publish()
        return None

    def cost_of(self, stream_id: str, also: str | None = None) -> float:
        """The extra share of a forward the stream's adapters cost (0 without one): the dearest of its style, the
        switches it waits for, `also`, and the input adapter if its input runs it."""
        held = self.streams.get(stream_id)
        names = (held.names() if held is not None else set()) | ({also} if also is not None else set())
        runs_input = held is not None and held.input_kind in self.input_kinds
        input_share = self.input_cost if runs_input else 0.0
        if not names:
            return input_share
        rank = max(self.files[n].rank or 0 for n in names)
        return max(input_share, self.cost * max(1.0, rank / self.cost_rank) if self.cost_rank else self.cost)

    def switch(self, stream_id: str, name: str | None, scale: float, version: Callable[[float], int]) -> int:
        """A steerer's switch to style `name` at `scale` (None: none): loaded if need be, then given a version by
        `version(cost)` (a prompt switch to the stream's newest prompt, the stream charged `cost_of` it from then on);
        returns it. An AdapterError (StyleBusy: try later) and nothing changed when the stream cannot have it."""
        held = self.streams[stream_id]
        if name is not None:
            self._acquire(name, scale)
        elif self.adapters is not None:
            self.adapters.check_scale(scale)
        seq = version(self.cost_of(stream_id, name))
        held.pending[seq] = (name, scale)
        self._publish()
        return seq

    def apply(self, gen, state, seq: int) -> None:
        """The stream's plan brings prompt version `seq`: the newest switch up to it goes to the generator with it."""
        held = self.streams.get(state.stream_id)
        due = [v for v in held.pending if v <= seq] if held is not None else []
        if not due:
            return
        held.name, held.scale = held.pending[max(due)]
        for v in due:
            del held.pending[v]
        gen.set_lora(state, held.name, held.scale, version=seq)

    def release(self, stream_id: str) -> None:
        """The stream closed: its styles may be evicted."""
        if self.streams.pop(stream_id, None) is not None:
            self._publish()

    # -- internals -------------------------------------------------------------------------------------------------

    def _acquire(self, name: str, scale: float) -> None:
        """Check `name` and `scale`, and load the style (evicting unused ones) unless it is: an AdapterError if not."""
        if self.refusal is not None:
            raise AdapterError(self.refusal)
        self.adapters.check_scale(scale)
        if name not in self.files:
            raise AdapterError(f"no style named {name!r} (offered: {', '.join(self.offered) or 'none'})")
        if name in self.recent:
            self.recent.remove(name)
            self.recent.append(name)
            return
        f = self.files[name]
        if f.error is not None and f.stat == _stat(f.path):
            raise AdapterError(f"style {name!r} cannot be used: {f.error}")
        while self.loaded_bytes + f.nbytes > self.budget_bytes and self._evict_one():
            pass
        if self.loaded_bytes + f.nbytes > self.budget_bytes:
            raise self._busy(name)
        self._load(name)  # (a file never read has no size yet: checked once loaded)
        if self.loaded_bytes > self.budget_bytes or not self._reserve(name, f.nbytes):
            self._evict(name)
            raise self._busy(name)

    def _busy(self, name: str) -> StyleBusy:
        pool = "" if self.pool is None else f", the KV pool {format_bytes(self.pool.free_bytes)} free"
        return StyleBusy(f"style {name!r} needs {format_bytes(self.files[name].nbytes)}, and the styles in use hold "
                         f"{format_bytes(self.loaded_bytes)} of the {format_bytes(self.budget_bytes)} style budget "
                         f"(--lora-budget-gib){pool}: try again when fewer styles or streams are in use")

    def _load(self, name: str) -> None:
        f = self.files[name]
        try:
            adapter = self.adapters.load(name, f.path)
        except AdapterError as e:
            f.error, f.stat = str(e), _stat(f.path)
            self._publish()
            raise AdapterError(f"style {name!r} cannot be used: {e}") from e
        f.rank, f.nbytes, f.error, f.stat = adapter.rank, adapter.nbytes, None, None
        self.recent.append(name)
        self._publish()

    def _reserve(self, name: str, nbytes: int) -> bool:
        return self.pool is None or self.pool.reserve(f"style {name}", nbytes)

    def _evict_one(self) -> bool:
        """Evict the least recently used style no stream holds; False when every loaded one is held."""
        held = set().union(*(h.names() for h in self.streams.values()))
        victim = next((n for n in self.recent if n not in held), None)
        if victim is None:
            return False
        self._evict(victim)
        log.info("style %r evicted (least recently used, no stream holds it)", victim)
        return True

    def _evict(self, name: str) -> None:
        self.adapters.remove(name)
        self.recent.remove(name)
        if self.pool is not None:
            self.pool.unreserve(f"style {name}")
        self._publish()

    def _publish(self) -> None:
        loaded = set(self.recent)
        self.listing = tuple(StyleInfo(n, f.rank, f.nbytes, n in loaded, f.error) for n, f in self.files.items())
        self.offered = () if self.refusal is not None else tuple(n for n, f in self.files.items() if f.error is None)


def _stat(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size
