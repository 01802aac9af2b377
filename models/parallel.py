"""One forward of the causal DiT split across a process group: Ulysses sequence parallelism (xDiT's USP).

Each of k ranks (one process per device; `torch.distributed` with NCCL on GPUs, gloo on CPU) holds the
same T/k tokens of every frame of the chunk: rank r the tokens [r T/k, (r+1) T/k) of each frame, so
the per-frame modulation applies to a shard as it is. On its shard a rank runs the patch embedding,
the FFN, the modulation, the cross-attention (all heads, over the prompt's text K/V, which every rank
holds whole) and the head, with no collective. Self-attention, per block:

    q, k, v = projections of the shard's tokens              [B, F*T/k, H, D]
    q <- RoPE(RMSNorm(q)) at the shard's own positions       (the qk norm runs over all H*D: per token)
    k <- RMSNorm(k)                                          (cached before RoPE, so rotated after)
    all-to-all (q, k and v in one): tokens/k x H -> tokens x H/k       [B, F*T, H/k, D]
    k <- RoPE(k); attention of the rank's heads over the cache's keys for those heads and all new tokens;
    the new keys (before RoPE) and values written to the rank's cache (its heads only)
    all-to-all back: tokens x H/k -> tokens/k x H, then the output projection on the shard

Each head is computed whole on one rank, so the math is the one-process forward's (the exact tier).
At the end the head's output is all-gathered: every rank gets the whole flow v, so each rank's
generator (`ShardedGenerator`) keeps the same stream state (noise, latents, ring) when the ranks
make the same calls in the same order, as a group replaying rank 0's plans does.

The KV cache shards by head: a rank's `CacheSpec` has H/k heads (`shard_spec`), so its storage,
workspace and pool hold and count that rank's share, and nothing moves between ranks for it.

k must divide the heads and the tokens of a frame (`allowed_degrees`): there is no padding. Every
divisor of the presets' heads divides their tokens per frame (1560 at 480x832; 16 for tiny).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, MutableMapping, Sequence
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist

from kvcache import CacheSpec
from models.config import ModelConfig
from models.decoder import NoDecoder, StreamingDecoder
from models.encoder import StreamingEncoder
from models.dit import AttentionKV, CacheAccess, CausalWanModel, SelfAttention, TextKV
from models.dit_ops import KERNELS
from models.build import build_generator
from models.generator import ChunkGenerator
from models.stream import GeneratorConfig
from models.text import TextEncoder

# Set in every rank (and Ray worker) we start: NVLink multicast (NVLS) can take a shared host's GPUs down.
PARALLEL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def parallel_env(environ: MutableMapping[str, str] | None = None) -> MutableMapping[str, str]:
    """Write PARALLEL_ENV into `environ` (os.environ by default: what spawned ranks inherit); returns it."""
    environ = os.environ if environ is None else environ
    environ.update(PARALLEL_ENV)
    return environ


def allowed_degrees(cfg: ModelConfig) -> list[int]:
    """The group sizes a forward of `cfg` splits over: those dividing its heads and its tokens per frame."""
    return [k for k in range(1, cfg.num_heads + 1) if cfg.num_heads % k == 0 and cfg.tokens_per_frame % k == 0]


def check_degree(cfg: ModelConfig, k: int) -> None:
    """Raise ValueError, naming the allowed values, unless a forward of `cfg` splits over k ranks."""
    allowed = allowed_degrees(cfg)
    if k not in allowed:
        raise ValueError(
            f"a forward of {cfg.name} ({cfg.num_heads} heads, {cfg.tokens_per_frame} tokens per frame) cannot be "
            f"split over {k} ranks: k must divide both; use one of {', '.join(map(str, allowed))}"
        )


def shard_spec(spec: CacheSpec, k: int) -> CacheSpec:
    """One rank's share of a stream's cache: its `num_heads / k` heads, everything else the same."""
    if spec.num_heads % k:
        raise ValueError(f"a cache of {spec.num_heads} heads does not shard over {k} ranks: k must divide the heads")
    return replace(spec, num_heads=spec.num_heads // k)


class Ulysses:
    """This rank's side of the split (models/dit.py `SequenceSplit`): its token shard and the collectives."""

    def __init__(self, cfg: ModelConfig, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        check_degree(cfg, self.size)
        self.tokens = cfg.tokens_per_frame // self.size  # tokens of each frame this rank holds
        self.first = self.rank * self.tokens  # its first token within a frame

    def shard(self, p: torch.Tensor) -> torch.Tensor:
        # p: [B, F, T, X] -> [B, F, T/k, X], this rank's tokens of each frame (a view)
        return p[:, :, self.first : self.first + self.tokens]

    def gather(self, p: torch.Tensor) -> torch.Tensor:
        # p: [B, F, T/k, X] on every rank -> [B, F, T, X] on every rank
        parts = [torch.empty_like(p) for _ in range(self.size)]
        dist.all_gather(parts, p.contiguous(), group=self.group)
        return torch.stack(parts, dim=2).flatten(2, 3)  # token i*T/k + u of a frame: rank i's u-th

    def tokens_to_heads(self, t: torch.Tensor) -> torch.Tensor:
        # t: [G, B, F, T/k, H, D], this rank's tokens -> [G, B, F, T, H/k, D], all tokens of this rank's heads
        g, b, nf, tpl, nh, hd = t.shape
        send = t.unflatten(4, (self.size, nh // self.size)).permute(4, 0, 1, 2, 3, 5, 6).contiguous()  # [k, G, B, F, T/k, H/k, D]
        recv = torch.empty_like(send)  # [k, ...]: recv[i] is rank i's tokens of this rank's heads
        dist.all_to_all_single(recv, send, group=self.group)
        return recv.permute(1, 2, 3, 0, 4, 5, 6).reshape(g, b, nf, self.size * tpl, nh // self.size, hd)

    def heads_to_tokens(self, t: torch.Tensor) -> torch.Tensor:
        # t: [B, F, T, H/k, D], all tokens of this rank's heads -> [B, F, T/k, H, D], this rank's tokens
        b, nf, tpf, hl, hd = t.shape
        send = t.unflatten(2, (self.size, self.tokens)).permute(2, 0, 1, 3, 4, 5).contiguous()  # [k, B, F, T/k, H/k, D]
        recv = torch.empty_like(send)  # recv[i]: head group i of this rank's tokens
        dist.all_to_all_single(recv, send, group=self.group)
        return recv.permute(1, 2, 3, 0, 4, 5).reshape(b, nf, self.tokens, self.size * hl, hd)

    def _own_rows(self, table: torch.Tensor, nf: int) -> torch.Tensor:
        # table: [F*T, 1, D] cos or sin of every token -> [F*T/k, 1, D], this rank's tokens' (contiguous)
        return self.shard(table.view(1, nf, -1, *table.shape[1:]))[0].reshape(-1, *table.shape[1:])

    def self_attention(self, model: CausalWanModel, ops, layer: int, attn: SelfAttention, x: torch.Tensor,
                       kv: AttentionKV, rope, mask: torch.Tensor | None) -> torch.Tensor:
        # x: [B, n, dim], this rank's n = F*T/k tokens -> [B, n, dim]; kv: [B, Lk, H/k, D], this rank's heads
        b, n = x.shape[:2]
        nh, hd, eps, nf = attn.num_heads, attn.head_dim, model.cfg.eps, kv.n_frames
        q, k, v = model.project_qkv(attn, x)  # [B, n, H, D]
        if v is None:
            v = attn.v(x).view(b, n, nh, hd)
        send = torch.empty(3, b, n, nh, hd, dtype=q.dtype, device=q.device)  # q rotated, k normalized, v
        for j in range(b):
            (q_cos, q_sin), _ = rope[j]
            ops.norm_rope_into(q[j], attn.norm_q.weight, eps, self._own_rows(q_cos, nf), self._own_rows(q_sin, nf), send[0, j])
        send[1] = KERNELS.rms_norm(k.flatten(-2), attn.norm_k.weight, eps).view_as(k)
        send[2] = v
        qs, kn, vs = self.tokens_to_heads(send.view(3, b, nf, self.tokens, nh, hd)).flatten(2, 3)  # each [B, L, H/k, D]
        keys, values = kv.buffers(layer)  # [B, Lk, H/k, D], the cached part filled
        tpf, hl, n_all = model.cfg.tokens_per_frame, nh // self.size, kv.n_tokens
        writes = []  # (access, K normalized before RoPE, V), stored once attention has read the cache
        for j, acc in enumerate(kv.access):
            (q_cos, q_sin), _ = rope[j]
            r = kv.own_at[j]
            ops.rope_into(kn[j], q_cos, q_sin, keys[j, r : r + n_all])
            vj = values[j, r : r + n_all].copy_(vs[j])
            if acc.write_slots is not None:
                writes.append((acc, kn[j].view(-1, tpf, hl, hd), vj.view(-1, tpf, hl, hd)))
        out = model.attend(layer, qs, keys, values, mask, writes)  # [B, L, H/k, D]
        out = self.heads_to_tokens(out.reshape(b, nf, tpf, hl, hd))  # [B, F, T/k, H, D]
        return attn.o(out.reshape(b, n, nh * hd))


class ShardedModel:
    """Drop-in for `model(x, t, text, access)` on one rank of a group (what `ChunkGenerator.runner` calls).

    Every rank of the group calls it with the same x [B, C, F, h, w], t [B, F] and text (each rank's
    copy of the prompt's K/V, all heads), and access whose caches hold this rank's heads
    (`shard_spec`). It returns the whole v [B, C, F, h, w] float32 on every rank."""

    def __init__(self, model: CausalWanModel, group: dist.ProcessGroup | None = None) -> None:
        self.model = model
        self.split = Ulysses(model.cfg, group)

    @property
    def rank(self) -> int:
        return self.split.rank

    @property
    def size(self) -> int:
        return self.split.size

    def __call__(self, x: torch.Tensor, t: torch.Tensor, text: TextKV, access: Sequence[CacheAccess]) -> torch.Tensor:
        return self.forward(x, t, text, access)

    @torch.inference_mode()
    def forward(self, x: torch.Tensor, t: torch.Tensor, text: TextKV, access: Sequence[CacheAccess]) -> torch.Tensor:
        heads = self.model.cfg.num_heads // self.size
        for acc in access:
            if acc.cache is not None and acc.cache.spec.num_heads != heads:
                raise ValueError(
                    f"rank {self.rank} of {self.size} holds {heads} heads of each cache, got a cache of "
                    f"{acc.cache.spec.num_heads}: make the caches of shard_spec(spec, {self.size})"
                )
        return self.model.predict_flow(x, t, text, access, split=self.split)


def root_rank(group: dist.ProcessGroup | None) -> int:
    """The global rank of the group's rank 0: the one that encodes prompts and decodes chunks."""
    return 0 if group is None else dist.get_global_rank(group, 0)


class RootTextEncoder:
    """The text encoder on the group's rank 0: encodes (umT5 runs once, here) and broadcasts the embedding
    to the group's other ranks (`ReceivedTextEncoder`), which call `encode` at the same point: every rank
    calls `encode_prompt` in the same order with the same prompt cache, so they miss it together."""

    def __init__(self, inner, group: dist.ProcessGroup | None, device: torch.device) -> None:
        self.inner, self.group, self.device = inner, group, device

    def __getattr__(self, name: str):
        return getattr(self.inner, name)  # unknown_words, vocabulary, text_dim, ...

    def encode(self, prompts: list[str]) -> torch.Tensor:
        emb = self.inner.encode(prompts).to(self.device)  # [B, text_len, text_dim]
        meta = torch.tensor([*emb.shape, _DTYPES.index(emb.dtype)], dtype=torch.int64, device=self.device)
        dist.broadcast(meta, root_rank(self.group), group=self.group)
        dist.broadcast(emb.contiguous(), root_rank(self.group), group=self.group)
        return emb


class ReceivedTextEncoder:
    """The text encoder on the group's other ranks: receives what rank 0's `RootTextEncoder` encoded."""

    vocabulary = None

    def __init__(self, text_dim: int, text_len: int, group: dist.ProcessGroup | None, device: torch.device) -> None:
        self.text_dim, self.text_len, self.group, self.device = text_dim, text_len, group, device

    def unknown_words(self, prompt: str) -> list[str]:
        return []

    def encode(self, prompts: list[str]) -> torch.Tensor:
        meta = torch.empty(4, dtype=torch.int64, device=self.device)
        dist.broadcast(meta, root_rank(self.group), group=self.group)
        b, n, d, dtype = meta.tolist()
        emb = torch.empty(b, n, d, dtype=_DTYPES[dtype], device=self.device)
        dist.broadcast(emb, root_rank(self.group), group=self.group)
        return emb


_DTYPES = [torch.float32, torch.bfloat16, torch.float16]  # what a text encoder's output may be


class ShardedGenerator(ChunkGenerator):
    """A `ChunkGenerator` on one rank of a group: its forwards are split across the group (`ShardedModel`)
    and its streams' caches, workspace and pool hold this rank's heads (`cache_spec`).

    Every rank makes the same calls in the same order (open_stream with the same seed, run, set_prompt,
    ...): each forward is a collective. Each gets the whole output, so the ranks' stream states stay
    the same, and each encodes prompts and decodes chunks itself. Forwards run eagerly: no CUDA graphs
    (collectives inside graphs are a later piece of work)."""

    def __init__(self, model: CausalWanModel, cfg: GeneratorConfig = GeneratorConfig(), text_encoder: TextEncoder | None = None,
                 decoder: StreamingDecoder | None = None, group: dist.ProcessGroup | None = None,
                 encoder: StreamingEncoder | None = None) -> None:
        self.sharded = ShardedModel(model, group)  # first: the workspace's spec needs the group's size
        super().__init__(model, replace(cfg, cuda_graphs=False), text_encoder, decoder, encoder)
        self.runner = self.sharded

    @property
    def rank(self) -> int:
        return self.sharded.rank

    @property
    def world_size(self) -> int:
        return self.sharded.size

    def cache_spec(self) -> CacheSpec:
        """This rank's share of each stream's cache: H/k heads (what its pool allocates and counts)."""
        return shard_spec(super().cache_spec(), self.sharded.size)


def build_sharded_generator(preset: str = "tiny", *, group: dist.ProcessGroup | None = None,
                            cfg: GeneratorConfig = GeneratorConfig(), root_only: bool = False, **kw) -> ShardedGenerator:
    """`build_generator`'s generator (the same arguments) on this rank of `group` (None: the default
    group), the whole DiT on each rank. A group size that does not divide the loaded model's heads is
    a ValueError (`check_degree`). `root_only`: see `shard_generator`."""
    return shard_generator(build_base(preset, cfg=cfg, **kw), cfg, group, root_only)


def build_base(preset: str = "tiny", *, cfg: GeneratorConfig = GeneratorConfig(), **kw) -> ChunkGenerator:
    """The one-process generator a rank's `shard_generator` starts from (no full-head workspace, no graphs)."""
    return build_generator(preset, cfg=replace(cfg, stage_kv=False, cuda_graphs=False), **kw)


def shard_generator(base: ChunkGenerator, cfg: GeneratorConfig, group: dist.ProcessGroup | None = None,
                    root_only: bool = False) -> ShardedGenerator:
    """`base` (of `build_base`) on this rank of `group`. With `root_only`, the text encoder runs on the
    group's rank 0 only (its output broadcast) and so does the decoder (the other ranks get `NoDecoder`):
    every rank must then make the same calls, prompt encodings included."""
    text, decoder = base.text_encoder, base.decoder
    if root_only:
        mc, device = base.model_cfg, base.device
        if dist.get_rank() == root_rank(group):
            text = RootTextEncoder(text, group, device)
        else:  # a worker's base (`build_worker_generator`'s) loaded neither
            text, decoder = ReceivedTextEncoder(mc.text_dim, mc.text_len, group, device), NoDecoder(mc)
    # video-to-video input: each rank encodes its stream's frames itself (the same latents on every rank); with
    # root_only the workers load no encoder (nor decoder), so such a group takes no input (can_take_input False)
    encoder = None if root_only else base.encoder
    return ShardedGenerator(base.model, replace(base.cfg, stage_kv=cfg.stage_kv), text, decoder, group, encoder)


def build_worker_generator(preset: str = "tiny", *, group: dist.ProcessGroup | None = None,
                           cfg: GeneratorConfig = GeneratorConfig(), **kw) -> ShardedGenerator:
    """A rank other than the group's rank 0, with `root_only`: `build_generator`'s DiT alone (`dit_only`: the
    umT5 text encoder and the VAE or TAEHV decoder are never loaded; rank 0 encodes and decodes)."""
    base = build_generator(preset, cfg=replace(cfg, stage_kv=False, cuda_graphs=False), dit_only=True, **kw)
    return shard_generator(base, cfg, group, root_only=True)


def init_rank(rank: int, world_size: int, init_method: str, backend: str = "gloo", timeout_s: float = 60.0) -> None:
    """Join the default process group as `rank` of `world_size` (gloo on CPU, nccl on GPUs); a collective
    that waits longer than `timeout_s` fails instead of hanging (gloo's default is 30 minutes)."""
    parallel_env()
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))


def spawn_ranks(fn: Callable[..., None], world_size: int, args: tuple = (), timeout_s: float = 120.0) -> None:
    """Run fn(rank, world_size, *args) in `world_size` fresh (spawned) processes with PARALLEL_ENV set, and
    wait for all of them: at most `timeout_s`, then every one still running is killed and TimeoutError
    raised. A rank that raises or dies fails the whole (torch's ProcessRaisedException / ProcessExitedException)."""
    import torch.multiprocessing as mp

    parallel_env()  # inherited by the children
    ctx = mp.start_processes(fn, args=(world_size, *args), nprocs=world_size, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{world_size} ranks of {fn.__name__} did not finish within {timeout_s:g} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
            p.join()
