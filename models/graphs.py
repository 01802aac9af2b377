"""CUDA-graph replay of the DiT forward, one set of graphs for every stream.

A forward launches about 500 kernels; launched from Python one by one, the GPU idles between
them, and on a slow or busy host the launches fall behind the GPU altogether. A graph replays
the whole forward in one launch.

A graph fixes the addresses of everything it touches. What differs between streams and between
the chunks of one stream therefore goes in as values in fixed buffers, copied in before each
replay (gpt-fast's `input_pos`, vLLM's persistent inputs):
- the inputs x, t and the prompt's text K/V;
- the slots a commit writes (`CacheAccess.write_index`), which follow the ring's head;
- the cos/sin of the cached keys' RoPE positions (`CacheAccess.key_rope`), which do too;
- the K/V themselves: every stream's forward reads and writes the device's one workspace
  (kvcache/workspace.py), which the stream about to run is copied into;
- a stream's style: its adapter, zero-padded to the rank of the widest style loaded on its Linears
  at start-up (rounded up to 16: `AdapterSet.buffer_rank`), with its scales, in buffers shared by
  every graph of styles with the same targeted Linears (models/adapters.py `AdapterBuffers`),
  copied in when another adapter or scale runs; a wider style loaded later runs eagerly.
What is left in the key (`graph_key`) is the shape of the work: how many cached frames are
read, how many written, whether the cached keys must be rotated first, and the Linears a style
adapts (none without one). At sink 3 + window 9 that is 18 graphs, and as many again for each
set of targets the styles have, all captured at start-up (`capturing`, then `freeze()`); a key
first seen while serving runs eagerly, with a warning, and is never captured there.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from kvcache.storage import DenseStorage
from models.adapters import AdapterBuffers, AdapterSet
from models.dit import CacheAccess, CausalWanModel, TextKV, in_place

log = logging.getLogger(__name__)


@dataclass
class _Inputs:
    """The buffers a graph reads its inputs from, shared by every graph of the same shapes."""

    x: torch.Tensor  # [B, C, F, h, w]
    t: torch.Tensor  # [B, F]
    text: list[torch.Tensor]  # per layer k, v, flattened: [k0, v0, k1, v1, ...], each [B, text_len, H, D]
    index: torch.Tensor | None  # [frames written] int64: the slots a commit writes
    key_cos: torch.Tensor | None  # [read_slots * T, 1, D] float32: RoPE of the cached keys' positions
    key_sin: torch.Tensor | None


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: _Inputs
    out: torch.Tensor
    keep: object  # what the graph reads that nothing else may free: the queries' RoPE tables


_UNCAPTURABLE = object()  # a key whose capture failed


class GraphedForward:
    """Drop-in for `model(x, t, text, access)` that replays CUDA graphs where it safely can."""

    def __init__(self, model: CausalWanModel, adapters: AdapterSet | None = None) -> None:
        self.model = model
        self.adapters = adapters or AdapterSet(model)  # the styles: what ranks their buffers take
        self.adapter_buffers: dict[tuple[str, ...], AdapterBuffers] = {}  # by the Linears the styles adapt
        # while True (the warm-up), a forward of a new key runs eagerly (its kernels compile) and is
        # captured; after freeze() new keys run eagerly and nothing is captured
        self.capturing = True
        self._graphs: dict[tuple, object] = {}  # key -> _Graph or _UNCAPTURABLE
        self._inputs: dict[tuple, _Inputs] = {}
        self._indices: dict[tuple[int, ...], torch.Tensor] = {}  # write slots -> the same on the device
        self._pool = None
        self._warned: set[tuple] = set()
        self.stats = {"replays": 0, "captures": 0, "eager": 0}

    def freeze(self) -> None:
        """Serving starts: replay what was captured, run anything else eagerly, capture nothing."""
        self.capturing = False

    @property
    def keys(self) -> list[tuple]:
        """The keys captured so far."""
        return [k for k, g in self._graphs.items() if g is not _UNCAPTURABLE]

    @torch.inference_mode()  # as the model: static inputs made here are inference tensors, always updated here
    def __call__(self, x: torch.Tensor, t: torch.Tensor, text: TextKV, access: Sequence[CacheAccess]) -> torch.Tensor:
        key = None
        if x.is_cuda and not torch.cuda.is_current_stream_capturing():
            key = graph_key(x, t, text, access, self.model.cfg.patch[0])
        g = self._graphs.get(key) if key is not None else None
        if g is None and key is not None and self.capturing:
            out = self.model(x, t, text, access)  # first sight: Triton, FlashAttention and dynamo compile here
            self.stats["eager"] += 1
            self._graphs[key] = self._try_capture(x, t, text, access)
            return out
        if isinstance(g, _Graph) and access[0].lora is not None and not self._fits(access[0]):
            self.stats["eager"] += 1  # a style loaded after the capture, wider than its Linears' buffers
            return self.model(x, t, text, access)
        if not isinstance(g, _Graph):
            targets = None if key is None else key[5]  # a style's Linears (graph_key): one warning a set of them
            warn = key if targets is None else ("style", targets)
            if key is not None and g is None and warn not in self._warned:
                self._warned.add(warn)
                what = describe(key) if targets is None else f"forwards with a style on these {len(targets)} Linears"
                log.warning("no CUDA graph was captured at start-up for %s: running it eagerly", what)
            self.stats["eager"] += 1
            return self.model(x, t, text, access)
        self._load(g.inputs, x, t, text, access[0])
        g.graph.replay()
        self.stats["replays"] += 1
        return g.out.clone()

    # -- internals ----------------------------------------------------------------------------

    def _try_capture(self, x, t, text, access) -> object:
        try:
            g = self._capture(x, t, text, access)
        except RuntimeError as e:  # e.g. an op that cannot be captured: this key stays eager
            log.warning("CUDA graph capture failed, running eagerly: %s", str(e).splitlines()[0][:200])
            return _UNCAPTURABLE
        self.stats["captures"] += 1
        return g

    def _static_inputs(self, x, t, text, acc: CacheAccess) -> _Inputs:
        writes = None if acc.write_slots is None else len(acc.write_slots)
        key = (tuple(x.shape), x.dtype, tuple(t.shape), tuple(tuple(k.shape) for k, _ in text), acc.read_slots, writes)
        if key not in self._inputs:
            flat = [torch.empty_like(a) for a in itertools.chain.from_iterable(text)]
            index = None if writes is None else torch.empty(writes, dtype=torch.long, device=x.device)
            cos = sin = None
            if acc.read_slots:
                cos, sin = (torch.empty_like(a) for a in self.model.key_rope(acc))
            self._inputs[key] = _Inputs(torch.empty_like(x), torch.empty_like(t), flat, index, cos, sin)
        return self._inputs[key]

    def _index(self, slots: Sequence[int], device: torch.device) -> torch.Tensor:
        """The slots as a device tensor, made once per slot tuple (a ring has a few)."""
        key = tuple(slots)
        if key not in self._indices:
            self._indices[key] = torch.tensor(key, dtype=torch.long, device=device)
        return self._indices[key]

    def _load(self, inputs: _Inputs, x, t, text, acc: CacheAccess) -> None:
        """Copy this forward's values into the graph's buffers (device to device: nothing waits)."""
        inputs.x.copy_(x)
        inputs.t.copy_(t)
        torch._foreach_copy_(inputs.text, list(itertools.chain.from_iterable(text)))
        if inputs.index is not None:
            inputs.index.copy_(self._index(acc.write_slots, x.device))
        if inputs.key_cos is not None and not acc.keys_rotated:  # rotated keys are read as they are
            cos, sin = self.model.key_rope(acc)
            inputs.key_cos.copy_(cos)
            inputs.key_sin.copy_(sin)
        if acc.lora is not None:
            self._buffers(acc).load(acc.lora)

    def _buffers(self, acc: CacheAccess) -> AdapterBuffers:
        """The buffers that graphs of the style's targets read (made at its first capture, of the rank the
        styles loaded by then need)."""
        targets = acc.lora.adapter.targets
        if targets not in self.adapter_buffers:
            self.adapter_buffers[targets] = AdapterBuffers(acc.lora.adapter, self.adapters.buffer_rank(targets))
        return self.adapter_buffers[targets]

    def _fits(self, acc: CacheAccess) -> bool:
        """Whether the style fits its Linears' buffers (sized at start-up); logs once per style when not."""
        adapter, rank = acc.lora.adapter, self._buffers(acc).max_rank
        if adapter.rank <= rank:
            return True
        if ("rank", adapter.uid) not in self._warned:
            self._warned.add(("rank", adapter.uid))
            log.warning("style %r has rank %d, wider than its Linears' CUDA graph buffers (%d, sized at start-up): "
                        "its forwards run eagerly", adapter.name, adapter.rank, rank)
        return False

    def _capture(self, x, t, text, access) -> _Graph:
        acc = access[0]
        inputs = self._static_inputs(x, t, text, acc)
        self._load(inputs, x, t, text, acc)
        static_text = [(inputs.text[2 * i], inputs.text[2 * i + 1]) for i in range(len(text))]
        key_rope = None if inputs.key_cos is None else (inputs.key_cos, inputs.key_sin)
        lora = None if acc.lora is None else self._buffers(acc).use
        static_acc = replace(acc, write_index=inputs.index, key_rope=key_rope, lora=lora)
        keep = self.model.rope.table(acc.query_positions(x.shape[2] // self.model.cfg.patch[0]), x.device)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        # Capture only records (a commit's cache write included). `torch.cuda.graph` synchronizes and
        # empties the allocator's cache: fine at start-up, which is the only time anything is captured.
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            out = self.model(inputs.x, inputs.t, static_text, [static_acc])
        return _Graph(graph, inputs, out, keep)


def graph_key(x, t, text: TextKV, access: Sequence[CacheAccess], patch_t: int = 1) -> tuple | None:
    """What a graph of this forward fixes: the shapes, the storage it reads (the device's workspace),
    how many cached frames it reads and how many it writes, and whether it rotates the cached keys
    first, and the Linears its style adapts. Not the stream, the slots, the RoPE positions or the style's
    weights: those are copied in before each replay. None: the forward must run eagerly (several streams, a
    mask, storage read through a copy)."""
    if len(access) != 1 or access[0].cache is None or not in_place(access, x.shape[2] // patch_t):
        return None
    acc = access[0]
    storage = acc.cache.storage
    if type(storage) is not DenseStorage:
        return None
    writes = None if acc.write_slots is None else len(acc.write_slots)
    rotated = acc.keys_rotated or acc.read_slots == 0  # nothing cached: nothing to rotate
    shapes = tuple(tuple(k.shape) for k, _ in text[:1])
    targets = None if acc.lora is None else acc.lora.adapter.targets
    return (tuple(x.shape), x.dtype, tuple(t.shape), shapes, storage.uid, targets, acc.read_slots, writes, rotated)


def describe(key: tuple) -> str:
    """A graph key in words, for logs."""
    x_shape, *_, targets, read, writes, rotated = key
    what = "a forward" if writes is None else f"a forward writing {writes} frames"
    what += f" with a style on {len(targets)} Linears" if targets else ""
    return f"{what} of {x_shape[2]} frames over {read} cached frames ({'keys rotated' if rotated else 'rotating keys'})"


def capture_serving(gen) -> int:
    """Capture every graph that serving replays into `gen.runner` (a GraphedForward), then `freeze` it. `gen` is a
    ChunkGenerator (models/generator.py): with a throwaway stream, at each cache fill, a chunk's first denoising
    step (it rotates the cached keys), its later steps, its commit, and a commit that rotates (after a switch of
    streams, or in a recache); then a recache (with recache_chunks, also one of the whole window); all of it again
    under one style of each set of Linears the loaded styles adapt. Returns the number of graphs captured."""
    styles = {a.targets: name for name, a in gen.adapters.adapters.items()}  # one style of each set of targets
    for style in [None, *styles.values()]:
        _capture_stream(gen, style)
    gen.runner.freeze()
    return gen.runner.stats["captures"]


def _capture_stream(gen, style: str | None) -> None:
    mc, nf, device = gen.model_cfg, gen.cfg.frames_per_chunk, gen.device
    state = gen.open_stream("capture", "capture", seed=0, lora=style)
    cache, lora = state.cache, gen.lora_use(state)
    x = torch.randn(1, mc.in_channels, nf, mc.latent_height, mc.latent_width, generator=state.noise, device=device)
    t, t0 = torch.full((1, nf), 500.0, device=device), torch.zeros(1, nf, device=device)
    seen: set[int] = set()
    try:
        while cache.num_frames not in seen:  # fills 0, 3, ... up to a full cache
            n = cache.num_frames
            seen.add(n)
            slots = cache.plan_commit(nf)
            gen.forward(x, t0, state.text, [CacheAccess(cache, n, write_slots=slots, lora=lora)])  # a commit that rotates
            gen.forward(x, t, state.text, [CacheAccess(cache, n, lora=lora)])  # a chunk's first step: rotates
            gen.forward(x, t, state.text, [CacheAccess(cache, n, lora=lora)])  # its later steps
            gen.forward(x, t0, state.text, [CacheAccess(cache, n, write_slots=slots, lora=lora)])  # its commit
            cache.advance(slots)
            state.clean[torch.tensor(slots, device=device)] = x[0].transpose(0, 1)
        gen.set_prompt(state, "capture again")
        gen.recache(state)
        if gen.cfg.recache_chunks:  # the whole window too, as after commit reuse's chunk abandoned over it
            state.recache_all = True
            gen.set_prompt(state, "capture once more")
            gen.recache(state)
    finally:
        gen.close_stream(state)
