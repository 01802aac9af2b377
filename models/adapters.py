"""Style adapters: LoRAs applied per stream on top of shared base weights, never merged into them.

A stream may run under a style: an adapter (a LoRA) and a scale. The base weights stay shared by every
stream; each forward adds each stream's low-rank term to the outputs of the Linears its adapter names,
for that stream's rows only (S-LoRA's and Punica's multi-LoRA serving):

    y_i = base(x_i) + s_i * (alpha / r) * (x_i A^T) B^T        (stream i; A [r, in], B [out, r])

A stream without a style is not touched at all: its rows go through exactly the base computation, so it
is bit for bit what a model without adapters gives. `--lora` (models/weights.py `merge_lora`) is another
thing: one model LoRA merged into the weights at load.

- `AdapterSet`: the adapters a generator offers, each loaded once (in the model's dtype, on its device)
  and shared by every stream that uses it, bound to the model's Linears; their bytes are known (`nbytes`)
  so that admission can count them. It checks what a file holds (`AdapterError`, a ValueError, names
  the file, the layers and the fix) and what a stream asks for (`use`: a known name, a scale in range).
- `AdapterUse`: one stream's choice (an adapter and a scale), carried by its `CacheAccess` into a forward.
- `LoraBatch`: one forward's adapters; the DiT's Linear call sites hand it their input and output.

The files: the layouts `--lora` reads (PEFT keys `<module>.lora_A[.adapter].weight` / `lora_B`, or
`lora_down` / `lora_up`, in Wan's module names, maybe under `generator_lora` and `base_model.model.` /
`model.` prefixes: LongLive's `lora.pt`), plus
- diffusers' (`transformer.blocks.0.attn1.to_q.lora_A.weight`, WanTransformer3DModel's names, renamed by
  models/weights.py `diffusers_to_wan`), alpha in the safetensors metadata `lora_adapter_metadata`;
- the original Wan names as ComfyUI and diffusion-pipe save them (`diffusion_model.blocks.0.self_attn.q.
  lora_down.weight`, `.lora_up.weight`, `.alpha`);
- kohya's (musubi-tuner: `lora_unet_blocks_0_self_attn_q.lora_down.weight`, `.lora_up.weight`, `.alpha`),
  Wan's names with underscores for dots.
The scale of a layer is alpha / r: `alpha=` given to `load` wins, else the layer's `.alpha`, else the
metadata's `lora_alpha`, else r (scale 1, as `merge_lora` takes it). Full-weight differences (`.diff`,
`.diff_b`) and DoRA magnitudes are not low-rank terms: such a file is refused, as is one naming a layer
that is no Linear of the model (the patch embedding's convolution included).

CUDA graphs: a graph fixes the addresses it reads, so an adapter is meant to go in through fixed buffers
of `max_rank` per targeted Linear (zero-padded: exact, the padding adds exact zeros), as the KV workspace
does; until those are captured, a forward with an adapter runs eagerly (models/graphs.py `graph_key`).
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from models.fp8 import FP8Linear
from models.weights import CheckpointError, diffusers_to_wan

MAX_RANK = 64  # the largest rank an adapter may have unless the generator says otherwise (a buffer's size)
SCALE_RANGE = (0.0, 2.0)  # the scales a stream may ask for (0: the style is off)
SUFFIXES = (".safetensors", ".pt", ".pth", ".bin")  # the files `load_dir` offers

_PREFIXES = ("base_model.model.", "model.", "module.", "transformer.", "diffusion_model.")  # stripped, repeatedly
_INFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")  # wrapper names, dropped
_KOHYA = "lora_unet_"  # kohya / musubi-tuner: `lora_unet_<module with _ for .>.lora_down.weight`
_HALF = re.compile(r"^(?P<module>.+)\.(?P<half>lora_A|lora_B|lora_down|lora_up)(?:\.(?P<adapter>[^.]+))?\.weight$")
_HALVES = {"lora_A": "A", "lora_down": "A", "lora_B": "B", "lora_up": "B"}
_TEXT_LAYERS = re.compile(r"^(text_embedding\.\d+|blocks\.\d+\.cross_attn\.[kv])$")  # Linears that see the prompt only
_uids = itertools.count(1)


class AdapterError(ValueError):
    """An adapter file, name or scale that cannot be used: the message says which and why."""


@dataclass(frozen=True)
class LoraLayer:
    """One targeted Linear's low-rank pair, in the model's dtype on its device."""

    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]
    scale: float | torch.Tensor  # alpha / r; in `AdapterBuffers`, a 0-d device tensor (a graph reads it)

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True, eq=False)
class Adapter:
    """A loaded style: its layers by the model's module name, and the same by module (what a forward looks up)."""

    name: str
    path: str
    layers: dict[str, LoraLayer]  # module name -> its pair
    modules: dict[nn.Module, LoraLayer]  # the model's Linear -> its pair
    uid: int  # unique per load: text K/V computed under this adapter are cached under it

    @classmethod
    def of(cls, name: str, layers: dict[str, LoraLayer], linears: dict[str, nn.Module], path: str = "") -> Adapter:
        """An adapter of `layers` (module name -> pair) on the model's Linears (`linears`: name -> module), with a
        uid of its own. Training builds one over its parameters (models/train_style.py), so that its forward is
        the one serving runs."""
        return cls(name, path, layers, {linears[m]: layer for m, layer in layers.items()}, next(_uids))

    @property
    def rank(self) -> int:
        """The largest rank of its layers."""
        return max(layer.rank for layer in self.layers.values())

    @property
    def nbytes(self) -> int:
        """Device memory its pairs hold."""
        return sum(t.numel() * t.element_size() for layer in self.layers.values() for t in (layer.a, layer.b))

    @functools.cached_property
    def targets(self) -> tuple[str, ...]:
        """Its Linears' names, sorted: adapters with the same targets share CUDA graphs (`AdapterBuffers`)."""
        return tuple(sorted(self.layers))

    @property
    def touches_text(self) -> bool:
        """Whether it changes a prompt's cross-attention K/V (its text embedding or cross-attention k / v)."""
        return any(_TEXT_LAYERS.match(name) for name in self.layers)


@dataclass(frozen=True)
class AdapterUse:
    """One stream's style in a forward."""

    adapter: Adapter
    scale: float  # the stream's scale, times each layer's alpha / r


class LoraBatch:
    """The adapters of one forward's streams. The DiT's Linear call sites pass it each Linear's input and output,
    the forward's streams along dim 0; it adds each stream's term to that stream's rows, in place, and touches
    no other row. A forward whose streams all carry one and the same `AdapterUse` object (training's batch of
    clips, models/train_style.py) gets it over all rows in one product; so does each run of neighbouring streams
    under the same adapter at the same scale (the streams with an input, under the model's input adapter), as the
    base Linear's one product over all rows."""

    def __init__(self, uses: Sequence[AdapterUse | None]) -> None:
        self.size = len(uses)  # the forward's streams
        self.streams = [(j, use) for j, use in enumerate(uses) if use is not None]
        first = uses[0] if uses else None
        self.shared = first if first is not None and all(use is first for use in uses) else None
        # runs of neighbouring streams under the same adapter and scale: one product each, over their rows (the
        # streams with an input share the model's input adapter; the base Linear is one product over all rows too)
        self.runs: list[tuple[int, int, AdapterUse]] = []  # (first stream, last stream + 1, use)
        for j, use in self.streams:
            last = self.runs[-1] if self.runs else None
            if last is not None and last[1] == j and (last[2].adapter.uid, last[2].scale) == (use.adapter.uid, use.scale):
                self.runs[-1] = (last[0], j + 1, last[2])
            else:
                self.runs.append((j, j + 1, use))

    @classmethod
    def of(cls, uses: Sequence[AdapterUse | None]) -> LoraBatch | None:
        """The batch of these streams' uses (one per stream, None: no style); None when none has one."""
        return cls(uses) if any(use is not None for use in uses) else None

    def add(self, module: nn.Module, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out[j] += stream j's term of `module` at x[j], for each stream j with one. x: [B, ..., in] and
        out: [B, ..., out] (contiguous), B the forward's streams, or [B * R, ...]: R rows of each stream in turn
        (training's cross-attention runs a prompt per frame). Returns out."""
        if self.shared is not None:
            layer = self.shared.adapter.modules.get(module)
            if layer is not None:
                add_term(layer, self.shared.scale, x, out)
            return out
        per = out.shape[0] // self.size
        for first, end, use in self.runs:
            layer = use.adapter.modules.get(module)
            if layer is not None:
                rows = slice(first * per, end * per)
                add_term(layer, use.scale, x[rows], out[rows])
        return out

    def add_stream(self, j: int, module: nn.Module, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`add` for stream j alone: x [..., in], out [..., out] its rows (a view written in place)."""
        for i, use in self.streams:
            layer = use.adapter.modules.get(module) if i == j else None
            if layer is not None:
                add_term(layer, use.scale, x, out)
        return out


def add_term(layer: LoraLayer, scale: float, x: torch.Tensor, out: torch.Tensor) -> None:
    """out += scale * layer.scale * (x A^T) B^T, in place. x: [..., in]; out: [..., out] with rows viewable flat."""
    h = x.reshape(-1, x.shape[-1]) @ layer.a.t()  # [n, r]
    if isinstance(layer.scale, torch.Tensor):  # a graph's buffers: the scale is a value on the device
        out.view(-1, out.shape[-1]).addmm_(h.mul_(layer.scale), layer.b.t(), alpha=scale)
    else:
        out.view(-1, out.shape[-1]).addmm_(h, layer.b.t(), alpha=scale * layer.scale)


class AdapterBuffers:
    """Fixed device buffers that hold one adapter at a time, for CUDA graphs (models/graphs.py): per targeted
    Linear A [max_rank, in] and B [out, max_rank], zero-padded past the adapter's rank (exact: the padding
    adds exact zeros), and each layer's scale times the stream's as a device value. A graph captured reading
    `use` serves every adapter with these targets; `load` copies one in before a replay (nothing when it is
    there already: a stream's forwards in a row copy it once)."""

    def __init__(self, adapter: Adapter, max_rank: int) -> None:
        self.targets, self.max_rank = adapter.targets, max_rank
        layers = [adapter.layers[m] for m in self.targets]
        dev, dt = layers[0].a.device, layers[0].a.dtype
        self.a = [torch.zeros(max_rank, layer.a.shape[1], device=dev, dtype=dt) for layer in layers]  # [R, in] each
        self.b = [torch.zeros(layer.b.shape[0], max_rank, device=dev, dtype=dt) for layer in layers]  # [out, R] each
        self.scales = torch.zeros(len(layers), device=dev)  # [targets] float32: layer scale x stream scale
        self.ranks = [0] * len(layers)  # rows of each A the resident adapter wrote
        self.resident: tuple[int, float] | None = None  # (uid, scale) of the adapter held
        bufs = {m: LoraLayer(a, b, self.scales[i]) for i, (m, a, b) in enumerate(zip(self.targets, self.a, self.b))}
        linear_of = {id(layer): lin for lin, layer in adapter.modules.items()}  # the model's Linear of each pair
        static = Adapter("(graph buffers)", "", bufs, {linear_of[id(adapter.layers[m])]: bufs[m] for m in bufs}, 0)
        self.use = AdapterUse(static, 1.0)  # what a graph is captured with

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.a + self.b)

    def load(self, use: AdapterUse) -> None:
        """Hold `use`'s adapter (of the same targets) and scale: copied in, device to device, unless held already."""
        if use.adapter.targets != self.targets:
            raise ValueError(f"style {use.adapter.name!r} adapts other layers than these buffers hold")
        if self.resident == (use.adapter.uid, use.scale):
            return
        if use.adapter.rank > self.max_rank:
            raise ValueError(f"style {use.adapter.name!r} has rank {use.adapter.rank}, over these buffers' {self.max_rank}")
        dst, src, stale = [], [], []
        for i, m in enumerate(self.targets):
            layer = use.adapter.layers[m]
            r = layer.rank
            dst += [self.a[i][:r], self.b[i][:, :r]]
            src += [layer.a, layer.b]
            if self.ranks[i] > r:  # rows a larger rank left: zeros again (B's columns past them then meet zeros)
                stale.append(self.a[i][r : self.ranks[i]])
            self.ranks[i] = r
        torch._foreach_copy_(dst, src)
        if stale:
            torch._foreach_zero_(stale)
        scales = torch.tensor([use.adapter.layers[m].scale * use.scale for m in self.targets], dtype=torch.float32)
        self.scales.copy_(scales.to(self.scales.device))
        self.resident = (use.adapter.uid, use.scale)


class AdapterSet:
    """The styles a generator offers, by name: loaded once, shared by every stream that uses them."""

    def __init__(self, model: nn.Module, max_rank: int = MAX_RANK, scale_range: tuple[float, float] = SCALE_RANGE) -> None:
        if max_rank < 1:
            raise ValueError(f"max_rank must be >= 1, got {max_rank}")
        self.max_rank, self.scale_range = max_rank, scale_range
        self.dtype, self.device = model.dtype, model.device  # what the adapters are stored in
        # the Linears an adapter may name (as the model has them now: FP8 ones included), and kohya's spelling
        self.linears = {n: m for n, m in model.named_modules() if isinstance(m, (nn.Linear, FP8Linear))}
        self.kohya = {n.replace(".", "_"): n for n in self.linears}
        self.adapters: dict[str, Adapter] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.adapters

    @property
    def names(self) -> list[str]:
        return sorted(self.adapters)

    def buffer_rank(self, targets: tuple[str, ...]) -> int:
        """The rank of the CUDA graphs' buffers for styles on `targets` (`AdapterBuffers`): the largest such style
        loaded, rounded up to a multiple of 16 and at most `max_rank`, so a library of rank-16 styles pays for 16."""
        rank = max((a.rank for a in self.adapters.values() if a.targets == targets), default=self.max_rank)
        return min(self.max_rank, -(-rank // 16) * 16)

    @property
    def nbytes(self) -> int:
        """Device memory every loaded adapter holds."""
        return sum(a.nbytes for a in self.adapters.values())

    def load(self, name: str, path: str | Path, alpha: float | None = None) -> Adapter:
        """Load the LoRA file `path` as the style `name` (a new name; `remove` an old one first). `alpha`: the
        layers' alpha (default: the file's, else the rank)."""
        if not name or not isinstance(name, str):
            raise AdapterError(f"a style needs a name, got {name!r}")
        if name in self.adapters:
            raise AdapterError(f"style {name!r} is loaded already (from {self.adapters[name].path}): remove it first")
        if alpha is not None and not (math.isfinite(alpha) and alpha > 0):
            raise AdapterError(f"LoRA {path}: alpha must be a positive number, got {alpha}")
        adapter = self.adapter_of(name, read_pairs(path), path, alpha)
        self.adapters[name] = adapter
        return adapter

    def adapter_of(self, name: str, pairs: dict[str, tuple], path: str | Path = "", alpha: float | None = None) -> Adapter:
        """An adapter of `pairs` ({module name: (A, B, alpha or None)}, as `read_pairs` gives them) on the model's
        Linears, checked (the names, the shapes, the rank), without offering it as a style: `load` offers it, the
        generator keeps its model file's input adapter apart (models/generator.py `input_adapter`)."""
        layers = {}
        for module, (a, b, file_alpha) in self._bind(path, pairs).items():
            r = a.shape[0]
            if r > self.max_rank:
                raise AdapterError(f"LoRA {path}: {module} has rank {r}, over the maximum {self.max_rank} "
                                   "(serve it with a larger maximum rank, or merge it with --lora)")
            scale = (alpha if alpha is not None else file_alpha if file_alpha is not None else r) / r
            layers[module] = LoraLayer(a.to(self.device, self.dtype).contiguous(), b.to(self.device, self.dtype).contiguous(), scale)
        return Adapter.of(name, layers, self.linears, str(path))

    def load_dir(self, folder: str | Path) -> list[str]:
        """Load every LoRA file of `folder` (its SUFFIXES), each as the style named by its file's stem. Returns
        the names loaded, sorted. All or nothing: a bad file is an error naming it, and none stays loaded."""
        folder = Path(folder)
        if not folder.is_dir():
            raise AdapterError(f"LoRA folder {folder} is not a directory")
        files = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in SUFFIXES)
        stems = [p.stem for p in files]
        if len(set(stems)) != len(stems):
            twice = sorted({s for s in stems if stems.count(s) > 1})
            raise AdapterError(f"LoRA folder {folder}: several files for the style(s) {', '.join(twice)}")
        loaded = []
        try:
            for p in files:
                loaded.append(self.load(p.stem, p).name)
        except ValueError:
            for name in loaded:
                self.remove(name)
            raise
        return loaded

    def remove(self, name: str) -> None:
        """Forget the style `name` (streams still holding its adapter keep it until they switch)."""
        self.get(name)
        del self.adapters[name]

    def get(self, name: str) -> Adapter:
        if name not in self.adapters:
            offered = ", ".join(self.names) or "none"
            raise AdapterError(f"no style named {name!r} (offered: {offered})")
        return self.adapters[name]

    def check_scale(self, scale: float) -> float:
        lo, hi = self.scale_range
        if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not lo <= scale <= hi:  # NaN too
            raise AdapterError(f"lora_scale must be a number in [{lo}, {hi}], got {scale!r}")
        return float(scale)

    def use(self, name: str | None, scale: float = 1.0) -> AdapterUse | None:
        """A stream's style: None for no name or scale 0 (the stream runs as without adapters, bit for bit).
        An unknown name or an out-of-range scale is an AdapterError."""
        scale = self.check_scale(scale)
        if name is None:
            return None
        adapter = self.get(name)
        return None if scale == 0 else AdapterUse(adapter, scale)

    def _bind(self, path, pairs: dict[str, tuple]) -> dict[str, tuple]:
        """The file's pairs by the model's Linear names, checked against their shapes."""
        bound, unknown = {}, []
        for raw, pair in pairs.items():
            module = self._resolve(raw)
            if module is None:
                unknown.append(raw)
                continue
            if module in bound:
                raise AdapterError(f"LoRA {path}: {module} is named twice (as {raw} too)")
            a, b, _ = pair
            lin = self.linears[module]
            if a.ndim != 2 or a.shape[1] != lin.in_features or b.shape[0] != lin.out_features:
                raise AdapterError(f"LoRA {path}: {module} has A {tuple(a.shape)} and B {tuple(b.shape)}, for a Linear "
                                   f"of {lin.in_features} -> {lin.out_features} (a LoRA of another model?)")
            bound[module] = pair
        if unknown:
            shown = ", ".join(sorted(unknown)[:8]) + (f", ... ({len(unknown) - 8} more)" if len(unknown) > 8 else "")
            raise AdapterError(f"LoRA {path}: {len(unknown)} layer(s) match no Linear of the model: {shown}")
        return bound

    def _resolve(self, raw: str) -> str | None:
        """The model's Linear that a file's module name means (Wan's, diffusers' or kohya's spelling), or None."""
        if raw in self.linears:
            return raw
        if raw in self.kohya:
            return self.kohya[raw]
        try:
            renamed = next(iter(diffusers_to_wan({f"{raw}.weight": None})))
        except CheckpointError:
            return None
        module = renamed.removesuffix(".weight")
        return module if module in self.linears else None


def read_pairs(path: str | Path) -> dict[str, tuple[torch.Tensor, torch.Tensor, float | None]]:
    """{module name as the file spells it (prefixes off): (A [r, in], B [out, r], alpha or None)} of a LoRA
    file in any of the layouts above (`pairs_of`)."""
    return read_lora(path)[0]


def read_lora(path: str | Path) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor, float | None]], dict[str, str]]:
    """A LoRA file's pairs (`read_pairs`) and its metadata ({} for a .pt file), from one read of the file."""
    tensors, meta = _read(Path(path))
    return pairs_of(path, tensors, _metadata_alpha(path, meta.get("lora_adapter_metadata"))), meta


def pairs_of(path, tensors: dict[str, torch.Tensor], alpha: float | None) -> dict[str, tuple[torch.Tensor, torch.Tensor, float | None]]:
    """The pairs of a LoRA's tensors, as `read_pairs` gives them: every key must belong to a pair (or be its alpha);
    a pair without an alpha of its own has `alpha` (the file's: None where it names none). `path` names the source
    in errors."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        module, half = _split_key(path, _strip(key))
        got = halves.setdefault(module, {})
        if half in got:
            raise AdapterError(f"LoRA {path}: {module} has two {half} entries (several adapters in one file?)")
        got[half] = t
    if not halves:
        raise AdapterError(f"LoRA {path} holds no LoRA pairs")
    pairs = {}
    for module, got in sorted(halves.items()):
        if "A" not in got or "B" not in got:
            raise AdapterError(f"LoRA {path}: {module} has no {'lora_B (up)' if 'A' in got else 'lora_A (down)'} weight")
        a, b = got["A"], got["B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise AdapterError(f"LoRA {path}: {module} has A {tuple(a.shape)} and B {tuple(b.shape)}: not [r, in] and "
                               "[out, r] (a convolution's LoRA is not served per stream)")
        if not (a.is_floating_point() and b.is_floating_point() and torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise AdapterError(f"LoRA {path}: {module} has weights that are not finite floating-point numbers")
        own = got.get("alpha")
        if own is not None:
            if own.numel() != 1 or not math.isfinite(float(own)) or float(own) <= 0:
                raise AdapterError(f"LoRA {path}: {module}.alpha must be one positive number, got {own.tolist()}")
            own = float(own)
        pairs[module] = (a, b, own if own is not None else alpha)
    return pairs


def _read(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The file's tensors (unwrapped from LongLive's `generator_lora`) and metadata ({} for a .pt file)."""
    if not path.is_file():
        raise AdapterError(f"LoRA file {path} does not exist")
    if path.suffix not in SUFFIXES:
        raise AdapterError(f"LoRA file {path}: expected one of {', '.join(SUFFIXES)}, got {path.suffix!r}")
    meta: dict[str, str] = {}
    try:
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), "pt") as f:
                meta = dict(f.metadata() or {})
                sd = {k: f.get_tensor(k) for k in f.keys()}
        else:
            sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a corrupt or foreign file: safetensors, pickle and zip raise many kinds
        raise AdapterError(f"LoRA file {path} cannot be read: {type(e).__name__}: {str(e)[:200]}") from e
    if not isinstance(sd, dict):
        raise AdapterError(f"LoRA file {path} holds a {type(sd).__name__}, not a state dict")
    if isinstance(sd.get("generator_lora"), dict):  # LongLive's: its critic_lora and step are not the generator's
        sd = sd["generator_lora"]
    bad = sorted(str(k) for k, v in sd.items() if not isinstance(v, torch.Tensor))
    if bad:
        raise AdapterError(f"LoRA file {path}: entries {', '.join(bad[:8])} are not tensors")
    return sd, meta


def _metadata_alpha(path: Path, meta: str | None) -> float | None:
    """diffusers' `lora_adapter_metadata` (PEFT's LoraConfig as JSON, maybe with `transformer.` keys): its
    lora_alpha. Per-layer patterns are refused rather than read wrong."""
    if not meta:
        return None
    try:
        cfg = json.loads(meta)
    except ValueError as e:
        raise AdapterError(f"LoRA file {path}: its lora_adapter_metadata is not JSON ({e})") from e
    cfg = {k.removeprefix("transformer."): v for k, v in cfg.items()} if isinstance(cfg, dict) else {}
    if cfg.get("alpha_pattern") or cfg.get("rank_pattern"):
        raise AdapterError(f"LoRA file {path}: per-layer alpha_pattern / rank_pattern are not supported; "
                           "give the layers' alpha as <module>.alpha tensors")
    alpha = cfg.get("lora_alpha")
    return float(alpha) if isinstance(alpha, (int, float)) and alpha > 0 else None


def _strip(key: str) -> str:
    for infix in _INFIXES:
        key = key.replace(infix, "")
    while (p := next((p for p in _PREFIXES if key.startswith(p)), None)) is not None:
        key = key[len(p):]
    return key


def _split_key(path, key: str) -> tuple[str, str]:
    """(module, "A" | "B" | "alpha") of a key with its prefixes off; anything else is an AdapterError."""
    if key.startswith(_KOHYA):
        module, _, rest = key[len(_KOHYA):].partition(".")
        kinds = {"lora_down.weight": "A", "lora_up.weight": "B", "alpha": "alpha"}
        if rest in kinds:
            return module, kinds[rest]
    elif key.endswith(".alpha"):
        return key.removesuffix(".alpha"), "alpha"
    elif (m := _HALF.match(key)) is not None:
        return m.group("module"), _HALVES[m.group("half")]
    why = ("a full-weight difference, not a low-rank pair" if key.endswith((".diff", ".diff_b"))
           else "a DoRA magnitude, not served" if "dora_scale" in key else "not a lora_A / lora_B (down / up) weight or alpha")
    raise AdapterError(f"LoRA {path}: key {key!r} is {why}")
