"""CUDA-graph replay of the DiT forward.

A forward launches about 500 kernels; launched from Python one by one, the GPU idles between
them, and on a slow or busy host the launches fall behind the GPU altogether. A graph replays
the whole forward in one launch.

A graph fixes everything it touches except its inputs: the caches it reads and writes, which
slots, the RoPE positions (they follow the ring's head), the shapes. `GraphedForward` keys its
graphs on exactly those, so a stream in steady state cycles through a few (one per ring
phase, denoise and commit apart). The inputs x, t and the prompt's text K/V are copied into
static buffers shared by all graphs of a batch size; graphs share one memory pool and run one
at a time, and each output is cloned at once, before another graph can reuse its memory.

A key seen for the first time runs eagerly (that is the warm-up: Triton and FlashAttention
compile there, and the RoPE tables get made); the second time it is captured. Anything that
cannot be captured safely (CPU, quantized storage whose reads keep scratch state, slots that
need an index tensor) runs eagerly.
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvcache.storage import DenseStorage
from models.dit import CacheAccess, CausalWanModel, TextKV, needs_mask

log = logging.getLogger(__name__)


@dataclass
class _Inputs:
    x: torch.Tensor
    t: torch.Tensor
    text: list[torch.Tensor]  # per layer k, v, flattened: [k0, v0, k1, v1, ...]


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: _Inputs
    out: torch.Tensor
    keep: object  # what the graph reads that nothing else may free: the RoPE tables


_UNCAPTURABLE = object()  # a key whose capture failed


class GraphedForward:
    """Drop-in for `model(x, t, text, access)` that replays CUDA graphs where it safely can."""

    def __init__(self, model: CausalWanModel, max_graphs: int = 128) -> None:
        self.model = model
        self.max_graphs = max_graphs
        self._graphs: OrderedDict[tuple, object] = OrderedDict()  # a _Graph; None: seen once; _UNCAPTURABLE
        self._inputs: dict[tuple, _Inputs] = {}
        self._pool = None
        self.stats = {"replays": 0, "captures": 0, "eager": 0}

    @torch.inference_mode()  # as the model: static inputs made here are inference tensors, always updated here
    def __call__(self, x: torch.Tensor, t: torch.Tensor, text: TextKV, access: Sequence[CacheAccess]) -> torch.Tensor:
        key = self._key(x, t, text, access)
        g = self._graph(key, x, t, text, access) if key is not None else None
        if g is None:
            self.stats["eager"] += 1
            return self.model(x, t, text, access)
        self._load(g.inputs, x, t, text)
        g.graph.replay()
        self.stats["replays"] += 1
        return g.out.clone()

    def _graph(self, key, x, t, text, access) -> _Graph | None:
        """The graph for `key`, captured on its second sight; None: run this forward eagerly."""
        if key not in self._graphs:  # first sight: eager (the warm-up), capture next time
            self._remember(key, None)
            return None
        g = self._graphs[key]
        if g is None:
            try:
                g = self._capture(x, t, text, access)
                self.stats["captures"] += 1
            except RuntimeError as e:  # e.g. an op that cannot be captured: stay eager for this key
                log.warning("CUDA graph capture failed, running eagerly: %s", str(e).splitlines()[0][:200])
                g = _UNCAPTURABLE
        self._remember(key, g)
        return g if g is not _UNCAPTURABLE else None

    # -- internals ----------------------------------------------------------------------------

    def _key(self, x, t, text, access) -> tuple | None:
        if not x.is_cuda or torch.cuda.is_current_stream_capturing():
            return None
        return graph_key(x, t, text, access)

    def _remember(self, key, g) -> None:
        self._graphs[key] = g
        self._graphs.move_to_end(key)
        while len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)

    def _static_inputs(self, x, t, text) -> _Inputs:
        key = (tuple(x.shape), x.dtype, tuple(t.shape), tuple(tuple(k.shape) for k, _ in text))
        if key not in self._inputs:
            flat = [torch.empty_like(a) for a in itertools.chain.from_iterable(text)]
            self._inputs[key] = _Inputs(torch.empty_like(x), torch.empty_like(t), flat)
        return self._inputs[key]

    @staticmethod
    def _load(inputs: _Inputs, x, t, text) -> None:
        inputs.x.copy_(x)
        inputs.t.copy_(t)
        torch._foreach_copy_(inputs.text, list(itertools.chain.from_iterable(text)))

    def _capture(self, x, t, text, access) -> _Graph:
        inputs = self._static_inputs(x, t, text)
        self._load(inputs, x, t, text)
        static_text = [(inputs.text[2 * i], inputs.text[2 * i + 1]) for i in range(len(text))]
        keep = self.model._rope_tables(access, x.shape[2])  # made now, outside the capture
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        # Capture only records (a commit's cache write included); the replay right after runs it.
        # `torch.cuda.graph` also synchronizes and empties the allocator's cache on each capture, which
        # a new stream's first chunks pay while serving (capturing by hand would avoid it).
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            out = self.model(inputs.x, inputs.t, static_text, access)
        return _Graph(graph, inputs, out, keep)


def graph_key(x, t, text: TextKV, access: Sequence[CacheAccess]) -> tuple | None:
    """What a graph of this forward fixes: shapes, and per stream its cache, the prefix read, the
    RoPE positions (the ring's phase), the slots written, whether it rotates the cached keys.
    None: the forward must run eagerly."""
    if needs_mask(access):
        return None  # a mask is built on the host
    parts = []
    for acc in access:
        cache = acc.cache
        if cache is None:
            parts.append((None, acc.read_slots, None, _tuple(acc.block_ids)))
            continue
        if type(cache.storage) is not DenseStorage:
            return None
        slots = _tuple(acc.write_slots)
        if slots and slots != tuple(range(slots[0], slots[0] + len(slots))):
            return None  # a wrapping write indexes with a tensor made on the host
        parts.append((cache.uid, acc.read_slots, tuple(acc.key_positions()), slots, _tuple(acc.block_ids), acc.keys_rotated))
    shapes = tuple(tuple(k.shape) for k, _ in text[:1])
    return (tuple(x.shape), x.dtype, tuple(t.shape), shapes, tuple(parts))


def _tuple(xs) -> tuple | None:
    return None if xs is None else tuple(xs)
