"""Sequence parallel (Ulysses) prediction for one stream split across k devices, from one device (issue 34).

One rank's share of a k-way Ulysses forward is timed on ONE device, for k = 1, 2, 4, 8 (those dividing the
heads), built from the model's own modules at the preset's sizes (`--blocks` blocks with random weights, run
in a row and scaled to the layer count; on CUDA one CUDA graph per part, as the generator replays forwards, with
the elementwise helpers and FP8 quantizers compiled, as `streamsvc serve` runs them there):
- per-token work on the rank's N/k tokens with all heads: the q/k/v projections, the qk RMSNorm and the new
  tokens' RoPE (over all heads, so before the all-to-all), the send/receive layout copies of the two
  all-to-alls, the o projection, the cross-attention (text K/V replicated: no collective), the FFN and the
  residual / modulated norms (the fused kernels models/dit.py runs);
- the self-attention of the rank's H/k heads, all N queries against the N chunk keys plus the cache's keys at
  a full window (`--sink-frames` + `--window-frames`), with the backend the model uses (FlashAttention-4
  where installed, else SDPA with cuDNN first); once per chunk, the rotation of its heads' cached keys; a
  commit also writes its heads' K/V into the cache;
- the outer work: patch embedding and head on N/k tokens, the time embedding.
k = 1 is checked against a real full forward of the whole model (`ChunkGenerator.forward`, CUDA graphs).

Collectives (counted, not run: this needs one device): per block an all-to-all of q, k, v in (each rank
sends (k-1)/k of its N/k x dim values of each) and one of the attention output back, in bf16; per forward an
all-gather of the head's output (float32). The keys cross before RoPE and each rank rotates its heads' after
the all-to-all, as models/parallel.py does, so a cache write needs no more traffic (`--keys-rope-on-shard`
counts the extra all-to-all of the unrotated keys a write would need were the keys rotated on the token shard
before crossing; the RoPE's work is the same either way). An all-to-all's time is its bytes per rank / a bus
bandwidth (+ `--collective-latency-us` per call): until an all-to-all is measured on several devices the bus
bandwidth is the all-reduce's measured on these hosts (`--bus-gbps`, default the low end; source printed).
k must divide the heads and the tokens of a frame (each rank holds T/k tokens of every frame, as
models/parallel.py's `check_degree` says); other k are listed as skipped.

Prediction per k: a forward = shard compute + collectives; a chunk = the tier's forwards + the decode
(`--decoder`: the Wan VAE by default for wan2.1-*, a recorded figure; the built-in or TAEHV decoders are
timed here with random weights), run after the commit as the engine runs it today (models/parallel.py's
ShardedGenerator decodes on every rank; decoded on rank 0 alone, the others would wait for it at the next
chunk's first all-to-all: the same latency); `period_overlapped_ms` says what overlapping it with the next
chunk would give. Exact: 4 steps + commit. Approximate: `--fidelity approximate`'s default options on
the device (on CUDA fp8-linears, steps-3, commit-reuse), timed with FP8 linears where on. Then whether one
stream is live (chunk latency under its 0.75 s play time at 16 fps, 12 frames), at what margin, and how many
streams per group the scheduler's admission (streamsvc/scheduling: utilization target, start rule, buffer
cap) admits, the group counting as one device.

    python benchmarks/parallel.py --preset wan2.1-14b --weights random
    python benchmarks/parallel.py --preset tiny --device cpu --iters 2   # the CPU smoke (tests/)
Prints tables on stderr and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.generator import Timer, fill_cache, forward_ms  # noqa: E402
from models import PRESETS, ChunkGenerator, GeneratorConfig, fidelity  # noqa: E402
from models import flash, fp8, triton_ops  # noqa: E402
from models.config import ModelConfig  # noqa: E402
from models.dit import CausalWanModel, attention_backends, feed_forward, sinusoidal_embedding  # noqa: E402
from models.dit_ops import KERNELS, Rope  # noqa: E402
from models.work import WorkKind  # noqa: E402
from streamsvc.scheduling import (  # noqa: E402  (pure: no asyncio, no torch)
    AdmissionControl, CostEstimates, SchedulerConfig, Stage, StreamLoad, StreamRequest,
)

KS = (1, 2, 4, 8)
BYTES_BF16 = 2
BUS_GBPS_SOURCE = ("/work/.library/device/KINDS.md (the device tool): NCCL all-reduce of 1 GiB, bus bandwidth, "
                   "nvidia-h100-x2 329, -x4 355, -x8 361 GB/s (seen 2026-11-13); an all-to-all is not measured yet")
# decode per chunk (3 latent frames -> 12 frames at 480x832) where it is not timed here
DECODE_RECORDED = {
    "wan-vae": (273.2, "Wan2.1 VAE decoder, bf16, H200 (benchmarks/RESULTS.md, wan2.1-14b on one H200, issue 26)"),
    "taehv": (12.9, "TAEHV decoder, H200 (DESIGN.md)"),
    "none": (0.0, "no decode counted"),
}
ENCODE_RECORDED = (126.0, "x264 per chunk at 480x832 (RESULTS.md, issue 26 serve warm-up)")
FPS, CHUNK_FRAMES, FIRST_CHUNK_FRAMES = 16.0, 12, 9


# ---------------------------------------------------------------------------------------------------------------
# the model at the preset's sizes, random weights made on the device


def random_model(mc: ModelConfig, device: torch.device, dtype: torch.dtype, seed: int = 0) -> CausalWanModel:
    """The DiT with random weights (CausalWanModel.init_weights' distributions, drawn on the device: a 14B's
    would take minutes from the host's generator)."""
    with torch.device("meta"):
        model = CausalWanModel(mc).to(dtype)
    model = model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("modulation"):
                p.normal_(0.0, 1.0 / mc.dim**0.5, generator=gen)
            elif p.ndim == 1:
                p.fill_(1.0 if "norm" in name else 0.0)
            else:
                bound = math.sqrt(6.0 / (p.shape[0] + math.prod(p.shape[1:])))
                p.uniform_(-bound, bound, generator=gen)
    model.rope = Rope(mc)  # plain tensors, built on meta above
    return model.eval()


def graph_or_eager(fn, device: torch.device, pool, keep: list):
    """`fn` captured as a CUDA graph (after two eager runs: kernels compile, backends pick) and its replay;
    elsewhere `fn` itself."""
    if device.type != "cuda":
        return fn
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream(device).wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool):
        fn()
    keep.append(g)
    return g.replay


def time_ms(timer: Timer, fn, iters: int, device: torch.device) -> float:
    """Median ms of one `fn`, several run back to back per timed sample when one is short."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    once = (time.perf_counter() - t0) * 1e3
    reps = max(1, min(50, math.ceil(5.0 / max(once, 1e-3)))) if device.type == "cuda" else 1
    return timer(lambda: [fn() for _ in range(reps)], iters, warmup=1) / reps


# ---------------------------------------------------------------------------------------------------------------
# one rank's share of a k-way forward


@dataclass(frozen=True)
class ShardShape:
    k: int
    tokens: int  # N: the chunk's tokens
    cached_tokens: int  # the cache's keys at the fill timed
    heads: int  # H
    dim: int
    layers: int

    @property
    def rank_tokens(self) -> int:  # N/k
        return self.tokens // self.k

    @property
    def rank_heads(self) -> int:  # H/k
        return self.heads // self.k

    @property
    def keys(self) -> int:
        return self.tokens + self.cached_tokens


class RankShard:
    """Buffers and work of one rank of a k-way Ulysses forward over `blocks` of `model` (all ranks do the same).

    Per block: `pre` (q/k/v projections on the rank's N/k tokens, qk-norm + RoPE over all heads, the send layout
    [N/k, k, H/k, D] -> [k, N/k, H/k, D] of q, k, v), `attend` (H/k heads: the received queries [N, H/k, D]
    against [the N received keys | the cached keys], staged as the workspace stages them), `post` (the output's
    receive layout [k, N/k, H/k, D] -> [N/k, H, D], o projection, residual norm, cross-attention, FFN, modulated
    norms). The all-to-alls themselves are left out (counted apart); what NCCL would write lands in buffers that
    hold random values. k = 1 is the model's own one-stream path: no layout copies, keys written in place."""

    def __init__(self, model: CausalWanModel, shape: ShardShape, frames: int, cached_frames: int, seed: int = 0) -> None:
        cfg = model.cfg
        self.model, self.s, self.cfg = model, shape, cfg
        self.blocks = list(model.blocks)
        dev, dt = model.device, model.dtype
        self.dt, self.eps = dt, cfg.eps
        self.ops = triton_ops if dev.type == "cuda" and triton_ops.AVAILABLE else KERNELS
        n, nn_, hk, d, dim = shape.rank_tokens, shape.tokens, shape.rank_heads, cfg.head_dim, cfg.dim
        g = torch.Generator(device=dev).manual_seed(seed)

        def rnd(*size, dtype=dt, scale=1.0):
            return (torch.randn(size, generator=g, device=dev) * scale).to(dtype)

        with torch.inference_mode():
            self.h = rnd(1, 1, n, dim, dtype=torch.float32)  # the residual of the rank's tokens
            self.y0 = rnd(1, 1, n, dim)  # a block's modulated input
            self.mods = [(blk.modulation.float().view(1, 1, 1, 6, dim)
                          + rnd(1, 1, 1, 6, dim, dtype=torch.float32, scale=0.1)).unbind(3) for blk in self.blocks]
            ctx = rnd(1, cfg.text_len, cfg.text_dim)
            self.text = model.text_kv(ctx)  # per block, replicated on every rank
            cos, sin = model.rope.table(list(range(cached_frames, cached_frames + frames)), dev)
            self.q_cos, self.q_sin = cos[:n].contiguous(), sin[:n].contiguous()  # the rank's own tokens
            self.k_cos = self.k_sin = None
            if cached_frames:
                self.k_cos, self.k_sin = model.rope.table(list(range(cached_frames)), dev)
            # per block: the staged keys/values of the rank's heads [1, N + cached, H/k, D], own first (AttentionKV),
            # the stored (unrotated) cached keys, the cache slots a commit writes, the received queries
            self.keys = [rnd(1, shape.keys, hk, d) for _ in self.blocks]
            self.values = [rnd(1, shape.keys, hk, d) for _ in self.blocks]
            self.stored = [rnd(shape.cached_tokens, hk, d) for _ in self.blocks] if cached_frames else []
            self.slots_k = [torch.empty(nn_, hk, d, device=dev, dtype=dt) for _ in self.blocks]
            self.slots_v = [torch.empty(nn_, hk, d, device=dev, dtype=dt) for _ in self.blocks]
            self.q_recv = rnd(nn_, hk, d) if shape.k > 1 else None
            self.attn_out = [rnd(1, nn_, hk, d) for _ in self.blocks]  # stands for the output's receive buffer
            # the rank's own tokens, all heads: q, k after norm + RoPE, v; the send buffers of the first all-to-all
            # and the receive layout of the second (k = 1: none, K and V go straight to the staged buffers)
            self.qs = torch.empty(n, cfg.num_heads, d, device=dev, dtype=dt)
            split = shape.k > 1
            self.ks = torch.empty_like(self.qs) if split else None
            self.vs = torch.empty(n, dim, device=dev, dtype=dt) if split else None
            self.send = torch.empty(3, shape.k, n, hk, d, device=dev, dtype=dt) if split else None
            self.o_in = torch.empty(n, shape.k, hk, d, device=dev, dtype=dt) if split else None
            # the outer work: the rank's patches of the (replicated) latent, per-frame timesteps
            pdim = cfg.in_channels * math.prod(cfg.patch)
            self.patches = rnd(1, n, pdim)
            self.t = torch.full((1, frames), 937.5, device=dev)

    # -- per block ---------------------------------------------------------------------------------------------

    def pre(self, i: int, y: torch.Tensor) -> None:
        attn, s, d = self.blocks[i].self_attn, self.s, self.cfg.head_dim
        n, nh, hk = s.rank_tokens, s.heads, s.rank_heads
        x = y.view(n, -1)
        own = s.k == 1  # one rank: the model's own path, K and V straight into the staged buffers
        k_out = self.keys[i][0, :n] if own else self.ks
        v_out = self.values[i][0, :n].view(n, -1) if own else self.vs
        if isinstance(attn.q, fp8.FP8Linear):  # x quantized once for the three FP8 GEMMs (models/dit.py)
            xq, xs = fp8.OPS.quantize_rows(x)
            q, k = (lin.gemm(xq, xs, x.dtype).view(n, nh, d) for lin in (attn.q, attn.k))
            v_out.copy_(attn.v.gemm(xq, xs, x.dtype).view_as(v_out))
        else:
            q, k = attn.q(x).view(n, nh, d), attn.k(x).view(n, nh, d)
            if x.is_cuda:
                torch.addmm(attn.v.bias, x, attn.v.weight.t(), out=v_out)
            else:
                v_out.copy_(attn.v(x))
        self.ops.norm_rope_into(q, attn.norm_q.weight, self.eps, self.q_cos, self.q_sin, self.qs)
        self.ops.norm_rope_into(k, attn.norm_k.weight, self.eps, self.q_cos, self.q_sin, k_out)
        if not own:  # the first all-to-all's send layout: each destination rank's heads contiguous
            for j, t in enumerate((self.qs, self.ks, self.vs)):
                self.send[j].copy_(t.view(n, s.k, hk, d).transpose(0, 1))

    def attend(self, i: int) -> torch.Tensor:
        q = (self.qs if self.s.k == 1 else self.q_recv)[None]  # [1, N, H/k, D]
        keys, values = self.keys[i], self.values[i]
        if flash.usable(q):
            return flash.attend(q, keys, values)
        return F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)).transpose(1, 2)

    def post(self, i: int, out: torch.Tensor) -> torch.Tensor:
        blk, s, ops, eps, dt = self.blocks[i], self.s, self.ops, self.eps, self.dt
        n = s.rank_tokens
        mod = self.mods[i]
        nxt = self.mods[(i + 1) % len(self.blocks)]
        if s.k == 1:
            a_in = out.reshape(1, n, -1)
        else:  # the second all-to-all's receive layout: [k sources, N/k, H/k, D] -> the rank's tokens, all heads
            self.o_in.copy_(out[0].reshape(s.k, n, s.rank_heads, -1).transpose(0, 1))
            a_in = self.o_in.view(1, n, -1)
        h = self.h
        a = blk.self_attn.o(a_in).view_as(h)
        h, y = ops.residual_norm(h, a, mod[2], blk.norm3.weight, blk.norm3.bias, eps, dt)
        a = blk.cross_attn(y.view(1, n, -1), *self.text[i]).view_as(h)
        h, y = ops.residual_adaln(h, a, None, mod[3], mod[4], eps, dt)
        a = feed_forward(blk.ffn, y)
        h, y = ops.residual_adaln(h, a, mod[5], nxt[0], nxt[1], eps, dt)
        return y

    def rotate(self, i: int) -> None:
        """A chunk's first step: its heads' cached keys rotated to their positions (the later steps reuse them)."""
        if self.stored:
            self.ops.rope_into(self.stored[i], self.k_cos, self.k_sin, self.keys[i][0, self.s.tokens:])

    def write(self, i: int) -> None:
        """A commit (or the last step under commit-reuse): its heads' K (before RoPE) and V into the cache slots."""
        n = self.s.tokens
        self.slots_k[i].copy_(self.keys[i][0, :n])
        self.slots_v[i].copy_(self.values[i][0, :n])

    # -- what is timed -----------------------------------------------------------------------------------------

    def stack(self) -> None:
        """A denoising step's blocks (no rotation: a chunk's later steps; the first adds `rotate`)."""
        y = self.y0
        for i in range(len(self.blocks)):
            self.pre(i, y)
            y = self.post(i, self.attend(i))

    def pre_all(self) -> None:
        for i in range(len(self.blocks)):
            self.pre(i, self.y0)

    def attend_all(self) -> None:
        for i in range(len(self.blocks)):
            self.attend(i)

    def post_all(self) -> None:
        for i in range(len(self.blocks)):
            self.post(i, self.attn_out[i])

    def rotate_all(self) -> None:
        for i in range(len(self.blocks)):
            self.rotate(i)

    def write_all(self) -> None:
        for i in range(len(self.blocks)):
            self.write(i)

    def outer(self) -> None:
        """Patch embedding and head on the rank's tokens, the time embedding and the modulation (per frame)."""
        m, cfg = self.model, self.cfg
        conv = m.patch_embedding
        hp = F.linear(self.patches, conv.weight.flatten(1), conv.bias).float()
        e = m.time_embedding(sinusoidal_embedding(cfg.freq_dim, self.t.flatten()).to(self.dt)).float()
        e0 = m.time_projection(e.to(self.dt)).float().view(1, -1, 1, 6, cfg.dim)
        mod = (torch.stack([blk.modulation for blk in m.blocks]).float().view(-1, 1, 1, 1, 6, cfg.dim) + e0).unbind(4)
        y = KERNELS.adaln(hp.view(1, 1, -1, cfg.dim), mod[0][0, :, :1], mod[1][0, :, :1], cfg.eps, self.dt)
        head = (m.head.modulation.float().view(1, 1, 1, 2, cfg.dim) + e.view(1, -1, 1, 1, cfg.dim)).unbind(3)
        y = KERNELS.adaln(y.float(), head[0][:, :1], head[1][:, :1], cfg.eps, self.dt)
        m.head.head(y.view(1, -1, cfg.dim)).float()


def time_shard(model: CausalWanModel, shape: ShardShape, frames: int, cached_frames: int, timer: Timer, iters: int,
               device: torch.device) -> dict:
    """ms of one rank's parts over the layer count (the blocks timed scaled to it)."""
    shard = RankShard(model, shape, frames, cached_frames)
    keep: list = []
    pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
    scale = shape.layers / len(shard.blocks)
    out = {}
    with torch.inference_mode(), attention_backends():
        for name, fn in (("blocks", shard.stack), ("pre", shard.pre_all), ("attention", shard.attend_all),
                         ("post", shard.post_all), ("rotate", shard.rotate_all), ("write", shard.write_all),
                         ("outer", shard.outer)):
            run = graph_or_eager(fn, device, pool, keep)
            ms = time_ms(timer, run, iters, device)
            out[name] = ms if name == "outer" else ms * scale
    del keep, shard
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    out["forward"] = out["blocks"] + out["outer"]  # a denoising step (not a chunk's first: see rotate)
    out["linears"] = out["pre"] + out["post"]
    return {k: round(v, 3) for k, v in out.items()}


# ---------------------------------------------------------------------------------------------------------------
# collectives


def collective_bytes(mc: ModelConfig, tokens: int, k: int) -> dict:
    """Bytes each rank sends per collective, per block and per forward (bf16 activations; the head's output in
    float32). An all-to-all sends (k-1)/k of the rank's N/k tokens x dim of each tensor."""
    n = tokens // k
    one = n * mc.dim * BYTES_BF16 * (k - 1) // k  # one [N/k, dim] tensor's share for the other ranks
    qkv, out = 3 * one, one
    gather = n * mc.out_channels * math.prod(mc.patch) * 4 * (k - 1)  # all-gather of the flow (float32)
    return {
        "a2a_qkv": qkv,
        "a2a_out": out,
        "a2a_keys_unrotated": one,  # a cache write's extra all-to-all per block, were keys rotated before crossing
        "per_block": qkv + out,
        "per_forward": mc.num_layers * (qkv + out) + gather,
        "gather": gather,
        "collectives_per_forward": 2 * mc.num_layers + 1 if k > 1 else 0,
    }


def collective_ms(nbytes: int, calls: int, bus_gbps: float, latency_us: float) -> float:
    return nbytes / (bus_gbps * 1e9) * 1e3 + calls * latency_us / 1e3 if nbytes else 0.0


# ---------------------------------------------------------------------------------------------------------------
# the prediction


def chunk_ms(fwd: float, rotate: float, write: float, comm: float, comm_write: float, steps: int,
             commit_reuse: bool) -> float:
    """A chunk's DiT time: `steps` denoising forwards (the first rotates the cached keys), then the commit forward
    (writes the cache), or, under commit-reuse, the last step writes it and the commit runs no forward."""
    t = steps * (fwd + comm) + rotate
    if commit_reuse:
        return t + write + comm_write
    return t + fwd + comm + write + comm_write


def admitted(chunk_s: float, steps: int, commit_s: float, encode_s: float, cfg: SchedulerConfig,
             limit: int = 64) -> tuple[int, str | None]:
    """How many 16 fps streams the scheduler's admission lets onto the group (one device to it), with the costs
    seeded as the warm-up seeds them, and the reason it refuses the next one."""
    cfg = replace(cfg, denoise_steps=steps)
    costs = CostEstimates(cfg)
    denoise_s = (chunk_s - commit_s) / steps
    costs.forward.seed(WorkKind.DENOISE, 1, denoise_s)
    costs.forward.seed(WorkKind.COMMIT, 1, commit_s)
    costs.stage.seed(Stage.OUTPUT, 1, encode_s)
    costs.stage.seed(Stage.SEND, 1, 0.0005)
    control = AdmissionControl(cfg, costs)
    loads: list[StreamLoad] = []
    for i in range(limit):
        req = StreamRequest(f"s{i}", FPS, FIRST_CHUNK_FRAMES, CHUNK_FRAMES)
        a = control.admit(req, loads, now=100.0)
        if not a.accepted:
            return i, a.reason
        loads.append(StreamLoad(req, chunks_delivered=cfg.confirm_chunks))
    return limit, None


def decoder_ms(name: str, mc: ModelConfig, device: torch.device, timer: Timer, iters: int, override: float | None):
    """(ms per chunk, source) of the decode: `override`, a recorded figure, or timed here with random weights."""
    if override is not None:
        return override, "--decode-ms"
    if name in DECODE_RECORDED and not (name == "taehv" and device.type == "cuda"):
        return DECODE_RECORDED[name]
    if name == "taehv":
        from models.taehv import TAEHVDecoder

        dec = TAEHVDecoder().to(device, torch.float16).eval()
        what = "TAEHV decoder (random weights, fp16), timed here"
    else:
        from models.decoder import TinyStreamingDecoder

        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        dec = TinyStreamingDecoder(mc).init_weights(seed=0).to(device, dtype).eval()
        what = "the built-in streaming decoder (random weights), timed here"
    x0 = torch.randn(mc.in_channels, 3, mc.latent_height, mc.latent_width, device=device)
    state = dec.init_state()
    with torch.inference_mode():
        dec.decode(x0, state)  # past the first chunk: 12 frames
        ms = timer(lambda: dec.decode(x0, state), iters)
    del dec
    return ms, what


def validate(mc: ModelConfig, gcfg: GeneratorConfig, device: torch.device, dtype: torch.dtype, timer: Timer,
             iters: int) -> dict:
    """A real full forward of the whole model (one stream, its cache full) as the generator runs it."""
    t0 = time.time()
    model = random_model(mc, device, dtype)
    gen = ChunkGenerator(model, gcfg)
    state = gen.open_stream("v", "validate", seed=0)
    fill_cache(gen, state, gen.cache_spec().capacity_frames)
    ms = forward_ms(gen, [state], timer, iters)
    rot = forward_ms(gen, [state], timer, iters, rotate=True)
    gen.close_stream(state)
    del gen, state, model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"forward_ms": round(ms, 3), "forward_rotating_ms": round(rot, 3), "build_and_time_s": round(time.time() - t0, 1)}


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                              cwd=Path(__file__).resolve().parents[1]).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="wan2.1-14b", choices=list(PRESETS))
    p.add_argument("--weights", default="random", choices=["random"],
                   help="random weights from a seed (the only choice: timings do not depend on the values)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--ks", default=",".join(map(str, KS)), help="group sizes to predict (those dividing the heads run)")
    p.add_argument("--sink-frames", type=int, default=3)
    p.add_argument("--window-frames", type=int, default=9)
    p.add_argument("--blocks", type=int, default=4, help="blocks built and timed in a row, scaled to the layer count")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--bus-gbps", type=float, default=329.0,
                   help="bus bandwidth of an all-to-all, GB/s (default: the low end of the all-reduce measured on "
                        "these H100 hosts)")
    p.add_argument("--collective-latency-us", type=float, default=20.0,
                   help="fixed cost per collective call (assumed, not measured here)")
    p.add_argument("--decoder", default=None, choices=["wan-vae", "taehv", "tiny", "none"],
                   help="decode counted per chunk (default: wan-vae for wan2.1-*, as serving with --wan-dir; tiny "
                        "for the tiny preset)")
    p.add_argument("--decode-ms", type=float, default=None, help="the decode's ms per chunk instead")
    p.add_argument("--encode-ms", type=float, default=None,
                   help="x264 per chunk on the output stage, for admission (default: the 480x832 figure recorded; "
                        "tiny: 1 ms)")
    p.add_argument("--approx-options", default=None,
                   help="the approximate tier's speed options (default: --fidelity approximate's on the device)")
    p.add_argument("--keys-rope-on-shard", action="store_true",
                   help="count an all-to-all of the unrotated keys per block for each cache write (keys rotated on the "
                        "token shard before crossing; models/parallel.py sends them before RoPE: none)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile the DiT's elementwise helpers and FP8 quantizers before any capture (default: "
                        "on with CUDA, off on CPU, as `streamsvc serve`)")
    p.add_argument("--no-validate", action="store_true", help="skip the real full forward (k = 1 check)")
    p.add_argument("--commit", default=None, help="the commit to report (default: git's HEAD, if readable)")
    args = p.parse_args(argv)

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    timer = Timer(device)
    log = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731
    mc = ModelConfig.from_name(args.preset)
    gcfg = GeneratorConfig(sink_frames=args.sink_frames, window_frames=args.window_frames)
    nf = gcfg.frames_per_chunk
    cached = args.sink_frames + args.window_frames
    tokens = nf * mc.tokens_per_frame
    try:
        acfg = fidelity.configure(gcfg, "approximate", fidelity.parse(args.approx_options), device.type)
    except ValueError as e:
        p.error(str(e))
    approx_opts = fidelity.active(acfg)
    ks = [int(x) for x in args.ks.split(",") if x.strip()]
    skipped = {k: f"{k} does not divide the {mc.num_heads} heads" if mc.num_heads % k else
               f"{k} does not divide the {mc.tokens_per_frame} tokens of a frame" for k in ks
               if mc.num_heads % k or mc.tokens_per_frame % k}
    ks = [k for k in ks if k not in skipped]
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    compiled = args.compile if args.compile is not None else device.type == "cuda"
    if compiled:  # before any graph is captured: graphs keep the kernels they were captured with
        from models.dit_ops import compile_helpers

        compile_helpers()
    commit = args.commit or git_commit()
    decoder = args.decoder or ("tiny" if args.preset == "tiny" else "wan-vae")
    log(f"{args.preset} on {dev_name} ({dtype}), {tokens} tokens a chunk against {cached} cached frames "
        f"({cached * mc.tokens_per_frame} keys + {tokens}), {mc.num_heads} heads, {mc.num_layers} layers; k = "
        f"{', '.join(map(str, ks))}"
        + (f" (not {', '.join(map(str, skipped))}: {'; '.join(skipped.values())})" if skipped else ""))
    log(f"attention backend: {'FlashAttention-4' if flash.status(device) is None else 'SDPA (cuDNN first)'}"
        f"{'' if flash.status(device) is None else ' - FA4: ' + str(flash.status(device))}")

    # -- shard timings -----------------------------------------------------------------------------------------
    t0 = time.time()
    blocks = max(1, min(args.blocks, mc.num_layers))
    model = random_model(replace(mc, num_layers=blocks), device, dtype)
    shards = {}
    for k in ks:
        shape = ShardShape(k, tokens, cached * mc.tokens_per_frame, mc.num_heads, mc.dim, mc.num_layers)
        shards[k] = {"bf16": time_shard(model, shape, nf, cached, timer, args.iters, device)}
        log(f"k={k}: {shards[k]['bf16']}")
    if acfg.fp8_linears:
        fp8.quantize_linears(model)
        for k in ks:
            shape = ShardShape(k, tokens, cached * mc.tokens_per_frame, mc.num_heads, mc.dim, mc.num_layers)
            shards[k]["fp8"] = time_shard(model, shape, nf, cached, timer, args.iters, device)
            log(f"k={k} fp8-linears: {shards[k]['fp8']}")
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    shard_s = time.time() - t0

    # -- the k = 1 check against a real full forward ----------------------------------------------------------
    validation = None
    if not args.no_validate and 1 in shards:
        try:
            validation = validate(mc, gcfg, device, dtype, timer, max(3, args.iters // 2))
            s1 = shards[1]["bf16"]
            validation["shard_k1_forward_ms"] = s1["forward"]
            validation["shard_k1_rotating_ms"] = round(s1["forward"] + s1["rotate"], 3)
            validation["ratio"] = round(s1["forward"] / validation["forward_ms"], 3)
            validation["ratio_rotating"] = round((s1["forward"] + s1["rotate"]) / validation["forward_rotating_ms"], 3)
        except torch.OutOfMemoryError as e:  # a 14B's weights, workspace and cache on a small card
            validation = {"error": f"out of memory: {str(e).splitlines()[0][:160]}"}
            gc.collect()
            torch.cuda.empty_cache()
        log(f"k=1 check, a real full forward (ChunkGenerator.forward, one stream, cache full): {validation}")

    # -- prediction --------------------------------------------------------------------------------------------
    dec_ms, dec_src = decoder_ms(decoder, mc, device, timer, max(3, args.iters // 2), args.decode_ms)
    if args.encode_ms is not None:
        enc_ms, enc_src = args.encode_ms, "--encode-ms"
    else:
        enc_ms, enc_src = (1.0, "assumed for the tiny preset") if args.preset == "tiny" else ENCODE_RECORDED
    sched = SchedulerConfig()
    play_ms = CHUNK_FRAMES / FPS * 1e3
    rows = []
    for k in ks:
        b = collective_bytes(mc, tokens, k)
        calls = b["collectives_per_forward"]
        comm = collective_ms(b["per_forward"], calls, args.bus_gbps, args.collective_latency_us)
        comm_write = collective_ms(mc.num_layers * b["a2a_keys_unrotated"], mc.num_layers if k > 1 else 0,
                                   args.bus_gbps, args.collective_latency_us) if args.keys_rope_on_shard else 0.0
        tiers = {}
        for tier, prec, steps, reuse in (("exact", "bf16", len(gcfg.timesteps), False),
                                         ("approximate", "fp8" if acfg.fp8_linears else "bf16", len(acfg.timesteps),
                                          acfg.commit_reuse)):
            sh = shards[k][prec]
            dit = chunk_ms(sh["forward"], sh["rotate"], sh["write"], comm, comm_write, steps, reuse)
            commit_fwd = 0.0 if reuse else sh["forward"] + comm + sh["write"] + comm_write
            latency = dit + dec_ms
            n, why = admitted(latency / 1e3, steps, (commit_fwd + dec_ms) / 1e3, enc_ms / 1e3, sched)
            tiers[tier] = {
                "forward_ms": round(sh["forward"] + comm, 2),
                "dit_chunk_ms": round(dit, 1),
                "chunk_ms": round(latency, 1),
                "period_overlapped_ms": round(max(dit, dec_ms), 1),
                "live": latency < play_ms,
                "margin_ms": round(play_ms - latency, 1),
                "load": round(latency / play_ms, 3),
                "streams": n,
                "refused_next": why,
            }
        rows.append({"k": k, "tokens_per_rank": tokens // k, "heads_per_rank": mc.num_heads // k,
                     "shard_ms": shards[k], "bytes": b, "comm_ms": round(comm, 3), "comm_write_ms": round(comm_write, 3),
                     **tiers})

    # -- tables ------------------------------------------------------------------------------------------------
    log("")
    log(f"One rank's share of a k-way forward, ms ({dev_name}; {blocks} blocks timed, x {mc.num_layers / blocks:g} "
        f"to {mc.num_layers} layers; CUDA graphs: {device.type == 'cuda'}; compiled helpers: {compiled}):")
    log(f"{'k':>2} {'tok/rank':>8} {'heads':>5} {'linears':>8} {'attn':>8} {'outer':>6} {'forward':>8} {'vs k=1':>6} "
        f"{'rotate':>7} {'write':>6} {'fp8 fwd':>8}")
    base = rows[0]["shard_ms"]["bf16"]["forward"] if rows and rows[0]["k"] == 1 else None
    for r in rows:
        s = r["shard_ms"]["bf16"]
        f8 = r["shard_ms"].get("fp8", {}).get("forward")
        log(f"{r['k']:>2} {r['tokens_per_rank']:>8} {r['heads_per_rank']:>5} {s['linears']:>8.2f} {s['attention']:>8.2f} "
            f"{s['outer']:>6.2f} {s['forward']:>8.2f} {(base / s['forward'] if base else float('nan')):>5.2f}x "
            f"{s['rotate']:>7.2f} {s['write']:>6.2f} {(f'{f8:.2f}' if f8 else '-'):>8}")
    if validation and "ratio" in validation:
        log(f"k=1 against the real full forward: {validation['shard_k1_forward_ms']:.2f} vs {validation['forward_ms']:.2f} ms "
            f"(x{validation['ratio']}); first step (rotating): {validation['shard_k1_rotating_ms']:.2f} vs "
            f"{validation['forward_rotating_ms']:.2f} ms (x{validation['ratio_rotating']})")
    log("")
    log(f"Collectives per rank (bf16; bus {args.bus_gbps:g} GB/s + {args.collective_latency_us:g} us a call): "
        f"source: {BUS_GBPS_SOURCE if args.bus_gbps == 329.0 else '--bus-gbps'}")
    log(f"{'k':>2} {'a2a qkv MB':>10} {'a2a out MB':>10} {'MB/block':>9} {'MB/forward':>10} {'calls':>5} {'ms/forward':>10} "
        f"{'+ms write':>9}")
    for r in rows:
        b = r["bytes"]
        log(f"{r['k']:>2} {b['a2a_qkv'] / 1e6:>10.2f} {b['a2a_out'] / 1e6:>10.2f} {b['per_block'] / 1e6:>9.2f} "
            f"{b['per_forward'] / 1e6:>10.1f} {b['collectives_per_forward']:>5} {r['comm_ms']:>10.2f} {r['comm_write_ms']:>9.2f}")
    log("")
    log(f"Predicted chunk latency (decode: {decoder} {dec_ms:.1f} ms, {dec_src}; run after the commit, not overlapped; "
        f"keys cross {'after' if args.keys_rope_on_shard else 'before'} RoPE; play time {play_ms:.0f} ms; admission: "
        f"utilization target {sched.utilization_target:g}, start margin {sched.start_margin_s:g} s, buffer cap "
        f"{sched.buffer_cap_s:g} s, encode {enc_ms:g} ms/chunk: {enc_src})")
    log(f"approximate = {', '.join(approx_opts)}")
    log(f"{'k':>2} {'tier':>11} {'ms/fwd':>7} {'DiT/chunk':>9} {'chunk':>7} {'overlap':>7} {'live':>4} {'margin':>7} "
        f"{'load':>5} {'streams':>7} {'GPUs/stream':>11}")
    for r in rows:
        for tier in ("exact", "approximate"):
            t = r[tier]
            log(f"{r['k']:>2} {tier:>11} {t['forward_ms']:>7.1f} {t['dit_chunk_ms']:>9.1f} {t['chunk_ms']:>7.1f} "
                f"{t['period_overlapped_ms']:>7.1f} {'yes' if t['live'] else 'no':>4} {t['margin_ms']:>7.1f} "
                f"{t['load']:>5.2f} {t['streams']:>7} {r['k'] * t['load']:>11.2f}")
    live_exact = next((r for r in rows if r["exact"]["streams"] >= 1), None)
    live_approx = next((r for r in rows if r["approximate"]["streams"] >= 1), None)
    for tier, r in (("exact", live_exact), ("approximate", live_approx)):
        if r is None:
            worst = rows[-1][tier] if rows else None
            log(f"{tier}: no k here admits one stream" + (f" (k={rows[-1]['k']}: {worst['refused_next']})" if worst else ""))
        else:
            t = r[tier]
            log(f"{tier}: one stream is admitted from k={r['k']}: chunk {t['chunk_ms']:.0f} ms against {play_ms:.0f} ms of "
                f"play, margin {t['margin_ms']:.0f} ms ({t['margin_ms'] / play_ms:.0%}), {t['streams']} stream(s) a group; "
                f"the next refused: {t['refused_next']}")
    result = {
        "bench": "parallel",
        "preset": args.preset,
        "weights": args.weights,
        "device": dev_name,
        "commit": commit,
        "dtype": str(dtype).replace("torch.", ""),
        "tokens": tokens,
        "cached_frames": cached,
        "heads": mc.num_heads,
        "layers": mc.num_layers,
        "blocks_timed": blocks,
        "attention": "fa4" if flash.status(device) is None else "sdpa",
        "cuda_graphs": device.type == "cuda",
        "compile": compiled,
        "ks": ks,
        "skipped": {str(k): v for k, v in skipped.items()},
        "bus_gbps": args.bus_gbps,
        "bus_source": BUS_GBPS_SOURCE if args.bus_gbps == 329.0 else "--bus-gbps",
        "collective_latency_us": args.collective_latency_us,
        "decoder": decoder,
        "decode_ms": round(dec_ms, 2),
        "decode_source": dec_src,
        "decode_overlap": False,
        "keys_rope_on_shard": args.keys_rope_on_shard,
        "encode_ms": enc_ms,
        "approx_options": approx_opts,
        "play_ms": play_ms,
        "scheduler": {"utilization_target": sched.utilization_target, "start_margin_s": sched.start_margin_s,
                      "buffer_cap_s": sched.buffer_cap_s},
        "validation": validation,
        "shard_s": round(shard_s, 1),
        "rows": rows,
        "live_exact_k": live_exact["k"] if live_exact else None,
        "live_approx_k": live_approx["k"] if live_approx else None,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
