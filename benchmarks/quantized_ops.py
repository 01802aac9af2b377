"""The quantized tier's kernels one by one against bf16: each GEMM of a DiT block in FP8 (models/fp8.py) and the
self-attention with INT8 scores (models/sage.py) against FlashAttention-4 / SDPA, at one chunk's shapes.

    python benchmarks/quantized_ops.py --preset wan2.1-1.3b --device cuda --compile
    python benchmarks/quantized_ops.py --preset tiny --device cpu --iters 3      # a smoke run (torch references)

GEMMs (M = a chunk's tokens): bf16 (`F.linear`; the FFN's first with its GELU in the epilogue, as the model runs
it), the FP8 GEMM alone (`torch._scaled_mm` on operands quantized beforehand) and its input's per-token
quantization as the model runs it (once per block per input; `--compile` fuses it as serve does), with TFLOP/s;
then the sums over a block's GEMMs times the layers: the GEMM ms of a forward in bf16 and in FP8. Attention: a chunk's queries
over cache fills 0 .. sink + window frames, bf16 (FA4 where usable, else SDPA) against INT8 (quantization of Q
and K included), its kernel alone, and the same Triton kernel on bf16 Q and K (what INT8 gains inside the
kernel, apart from how the kernel compares with FA4), with TFLOP/s, and the relative error of INT8 against bf16. Medians of
CUDA events (perf_counter on CPU) after a warm-up. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.generator import Timer  # noqa: E402
from models import ModelConfig, flash, fp8, sage  # noqa: E402


def log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


def block_gemms(mc: ModelConfig) -> list[tuple[str, int, int, int]]:
    """(name, in, out, per block) of the linears models/fp8.py quantizes."""
    d, f = mc.dim, mc.ffn_dim
    return [("self_attn.q/k/v", d, d, 3), ("self_attn.o", d, d, 1), ("cross_attn.q", d, d, 1), ("cross_attn.o", d, d, 1),
            ("ffn.0 (+gelu)", d, f, 1), ("ffn.2", f, d, 1)]


def time_gemms(mc, m, device, dtype, timer, iters) -> list[dict]:
    """Per GEMM of a block: bf16 (as the model runs it), the FP8 GEMM alone, and the quantization of its input as
    the model runs it, once per block: the attention's input once for q, k and v; the FFN's hidden activation
    quantized with its GELU (which the bf16 FFN fuses into its first GEMM) before the second GEMM."""
    g = torch.Generator(device=device).manual_seed(0)
    rows = []
    for name, k, n, count in block_gemms(mc):
        x = torch.randn(m, k, device=device, generator=g).to(dtype)
        lin = torch.nn.Linear(k, n, device=device, dtype=dtype)
        q = fp8.FP8Linear.from_linear(lin)
        if name.startswith("ffn.0") and device.type == "cuda":
            bf16 = lambda: torch._addmm_activation(lin.bias, x, lin.weight.t(), use_gelu=True)  # noqa: E731
        elif name.startswith("ffn.0"):
            bf16 = lambda: F.gelu(lin(x), approximate="tanh")  # noqa: E731
        else:
            bf16 = lambda: lin(x)  # noqa: E731
        xq, xs = fp8.quantize_rows(x)
        gemm = lambda: q.gemm(xq, xs, dtype)  # noqa: E731
        quant = (lambda: fp8.OPS.gelu_quantize_rows(x)) if name.startswith("ffn.2") else (lambda: fp8.OPS.quantize_rows(x))
        fns = [bf16, gemm, quant]
        if fp8.use_scaled_mm(x, k, n):  # cuBLASLt's fast accumulation (less precise): worth it?
            b16 = None if q.bias is None else q.bias.to(dtype)
            fns.append(lambda: torch._scaled_mm(xq, q.weight_fp8.t(), scale_a=xs, scale_b=q.weight_scale.view(1, -1),
                                                bias=b16, out_dtype=dtype, use_fast_accum=True))
        with torch.inference_mode():
            t_bf16, t_gemm, t_quant, *t_fast = timer.split(fns, iters)
            want = lin(x).float()
            err = ((q(x).float() - want).norm() / want.norm()).item()
        flops = 2 * m * k * n
        fp8_block = count * t_gemm + t_quant
        rows.append({
            "gemm": name, "m": m, "k": k, "n": n, "per_block": count, "scaled_mm": fp8.use_scaled_mm(x, k, n),
            "bf16_ms": round(t_bf16, 4), "fp8_gemm_ms": round(t_gemm, 4), "quant_ms": round(t_quant, 4),
            "fp8_gemm_fast_accum_ms": round(t_fast[0], 4) if t_fast else None,
            "bf16_tflops": round(flops / t_bf16 / 1e9, 1), "fp8_gemm_tflops": round(flops / t_gemm / 1e9, 1),
            "speedup_gemm": round(t_bf16 / t_gemm, 3), "speedup_with_quant": round(count * t_bf16 / fp8_block, 3),
            "rel_err_vs_bf16": round(err, 4),
        })
        r = rows[-1]
        log(f"{name:16s} {m}x{k}x{n}: bf16 {r['bf16_ms']:.3f} ms ({r['bf16_tflops']} TFLOP/s), FP8 GEMM {r['fp8_gemm_ms']:.3f} "
            f"({r['fp8_gemm_tflops']}, x{r['speedup_gemm']}), its input's quantization {r['quant_ms']:.3f} x1 per {count} "
            f"GEMM(s): x{r['speedup_with_quant']} with it; rel err {r['rel_err_vs_bf16']}; fast accumulation "
            f"{r['fp8_gemm_fast_accum_ms']} ms")
    return rows


def time_attention(mc, frames, fills, device, dtype, timer, iters) -> list[dict]:
    g = torch.Generator(device=device).manual_seed(1)
    tpf, nh, hd = mc.tokens_per_frame, mc.num_heads, mc.head_dim
    lq = frames * tpf
    rows = []
    for fill in fills:
        lk = (fill + frames) * tpf
        q = torch.randn(1, lq, nh, hd, device=device, generator=g).to(dtype)
        k = (torch.randn(1, lk, nh, hd, device=device, generator=g) + torch.randn(1, 1, nh, hd, device=device, generator=g)).to(dtype)
        v = torch.randn(1, lk, nh, hd, device=device, generator=g).to(dtype)
        use_fa4 = flash.usable(q)

        def bf16():
            if use_fa4:
                return flash.attend(q, k, v)
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)

        fns = [bf16, lambda: sage.attend(q, k, v)]
        kernel_only = None
        if sage.usable(q):
            operands = sage.quantize_qk(q, k)
            out = torch.empty_like(q)

            def kernel_only():
                sage.attend_quantized(*operands, v, out)

            # the same Triton kernel with bf16 Q and K (unit scales): what INT8 gains within the kernel, apart from
            # how the kernel itself compares with FA4
            qb = (q.float() * hd**-0.5 * sage.LOG2E).to(dtype).permute(0, 2, 1, 3).contiguous()
            kb = k.permute(0, 2, 1, 3).contiguous()
            one_q = torch.ones_like(operands[1])
            one_k = torch.ones_like(operands[3])
            fns += [kernel_only, lambda: sage.attend_quantized(qb, one_q, kb, one_k, v, out)]
        with torch.inference_mode():
            times = timer.split(fns, iters)
            err = ((sage.attend(q, k, v).float() - bf16().float()).norm() / bf16().float().norm()).item()
        flops = 4 * lq * lk * hd * nh
        row = {"cached_frames": fill, "queries": lq, "keys": lk, "bf16_kernel": "fa4" if use_fa4 else "sdpa",
               "int8_kernel": "triton" if sage.usable(q) else "torch reference",
               "bf16_ms": round(times[0], 4), "int8_ms": round(times[1], 4),
               "int8_kernel_ms": round(times[2], 4) if kernel_only else None,
               "triton_bf16_kernel_ms": round(times[3], 4) if kernel_only else None,
               "bf16_tflops": round(flops / times[0] / 1e9, 1), "int8_tflops": round(flops / times[1] / 1e9, 1),
               "speedup": round(times[0] / times[1], 3), "rel_err": round(err, 4)}
        rows.append(row)
        log(f"attention, {fill:2d} cached frames ({lk} keys): bf16 ({row['bf16_kernel']}) {row['bf16_ms']:.3f} ms "
            f"({row['bf16_tflops']} TFLOP/s), INT8 {row['int8_ms']:.3f} ({row['int8_tflops']}; kernel alone "
            f"{row['int8_kernel_ms']}; the same kernel in bf16 {row['triton_bf16_kernel_ms']}), x{row['speedup']}, "
            f"rel err {row['rel_err']}")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--frames", type=int, default=3, help="latent frames of a chunk (default 3)")
    p.add_argument("--fills", default="0,3,6,9,12", help="cached frames the attention is timed at (default 0,3,6,9,12)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--compile", action="store_true", help="torch.compile the FP8 activation quantizers (as serve does on CUDA)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    mc = ModelConfig.from_name(args.preset)
    timer = Timer(device)
    if args.compile:
        fp8.OPS.compile()
    m = args.frames * mc.tokens_per_frame
    gemms = time_gemms(mc, m, device, dtype, timer, args.iters)
    per_forward = {
        "bf16_ms": round(mc.num_layers * sum(r["bf16_ms"] * r["per_block"] for r in gemms), 3),
        "fp8_gemm_ms": round(mc.num_layers * sum(r["fp8_gemm_ms"] * r["per_block"] for r in gemms), 3),
        "fp8_quant_ms": round(mc.num_layers * sum(r["quant_ms"] for r in gemms), 3),
    }
    per_forward["fp8_ms"] = round(per_forward["fp8_gemm_ms"] + per_forward["fp8_quant_ms"], 3)
    log(f"GEMMs of a forward ({mc.num_layers} layers): bf16 {per_forward['bf16_ms']} ms, FP8 {per_forward['fp8_ms']} ms "
        f"(GEMMs {per_forward['fp8_gemm_ms']} + activation quantization {per_forward['fp8_quant_ms']})")
    fills = [int(f) for f in args.fills.split(",") if f.strip()]
    try:
        attn = time_attention(mc, args.frames, fills, device, dtype, timer, args.iters)
        attn_error = None
    except Exception as e:  # noqa: BLE001 - the GEMMs' figures still come out
        attn, attn_error = [], f"{type(e).__name__}: {str(e)[:300]}"
        log(f"attention failed: {attn_error}")
    result = {
        "bench": "quantized_ops",
        "preset": args.preset,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(dtype).replace("torch.", ""),
        "compile": args.compile,
        "gemms": gemms,
        "gemm_ms_per_forward": per_forward,
        "attention": attn,
        "attention_error": attn_error,
        "attention_ms_per_forward_at_full": None if not attn else {
            "bf16": round(attn[-1]["bf16_ms"] * mc.num_layers, 2), "int8": round(attn[-1]["int8_ms"] * mc.num_layers, 2)},
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
