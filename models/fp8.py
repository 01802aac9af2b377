"""FP8 linears (the `quantized` tier's `fp8-linears`): weights quantized once at load, activations per token.

- Weights: float8_e4m3fn with one float32 scale per output channel (row of W): s_w = amax(|W_row|) / 448.
- Activations: dynamic, one scale per token (row of x): s_x = amax(|x_row|) / 448, computed in the forward
  on the device (no host sync, so CUDA graphs capture it).
- y = (x_q @ W_q^T) * s_x * s_w^T + b: on CUDA one `torch._scaled_mm` with row-wise scales (cuBLASLt's
  FP8 GEMM on sm89+; on the H200 about 1040 TFLOP/s on the FFN's GEMM against 740 in bf16). Elsewhere
  `reference`: the same quantized operands dequantized and multiplied in float32, which the tests take
  as ground truth for both.

`quantize_linears(model)` swaps the DiT's big linears (self-attention q/k/v/o, cross-attention q/o, the
FFN) for `FP8Linear`; norms, embeddings, the text projections and the head stay in the model dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
_TINY = 1e-12  # floor of an amax: an all-zero row gets scale ~0 and quantizes to zeros


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, K] -> (x_q [M, K] float8_e4m3fn, scale [M, 1] float32) with x ~= x_q * scale, per row."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp(min=_TINY) / FP8_MAX
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def gelu_quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """tanh-GELU of x, quantized per row (the FFN's hidden activation between its two FP8 GEMMs)."""
    return quantize_rows(F.gelu(x.float(), approximate="tanh"))


class _Ops:
    """The elementwise quantizers; `compile()` (from models.dit_ops.compile_helpers) fuses each into one kernel."""

    quantize_rows = staticmethod(quantize_rows)
    gelu_quantize_rows = staticmethod(gelu_quantize_rows)

    def compile(self) -> None:
        for name in ("quantize_rows", "gelu_quantize_rows"):
            setattr(self, name, torch.compile(globals()[name], dynamic=False, fullgraph=True))


OPS = _Ops()


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 values of quantized rows: q [M, K] float8, scale [M, 1] (or [M])."""
    return q.float() * scale.reshape(-1, 1).float()


def reference(xq, xs, wq, ws, bias, out_dtype: torch.dtype) -> torch.Tensor:
    """The FP8 GEMM's math in float32: (xq * xs) @ (wq * ws)^T + bias. xq [M, K], xs [M, 1], wq [N, K], ws [N]."""
    y = dequantize(xq, xs) @ dequantize(wq, ws).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


_BIAS_IN_GEMM = [True]  # False once a build of torch refused the bias in the row-wise GEMM: added after it


def scaled_mm(xq, xs, wq, ws, bias, out_dtype: torch.dtype) -> torch.Tensor:
    """`reference` through torch._scaled_mm (row-wise scales; bf16/fp16/fp32 out). wq is [N, K] row-major,
    which is the column-major [K, N] operand cuBLASLt wants; K and N must be multiples of 16."""
    b = None if bias is None else bias.to(out_dtype)
    if b is not None and _BIAS_IN_GEMM[0]:
        try:
            return torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.view(1, -1), bias=b, out_dtype=out_dtype)
        except RuntimeError:  # first seen on an eager forward (graphs capture only after one)
            _BIAS_IN_GEMM[0] = False
    out = torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.view(1, -1), out_dtype=out_dtype)
    return out if b is None else out + b


def use_scaled_mm(x: torch.Tensor, in_features: int, out_features: int) -> bool:
    """Whether the GEMM runs as torch._scaled_mm: CUDA of compute capability 8.9 or more, dims % 16."""
    if not x.is_cuda or in_features % 16 or out_features % 16:
        return False
    return torch.cuda.get_device_capability(x.device) >= (8, 9)


class FP8Linear(nn.Module):
    """nn.Linear's forward from FP8 weights (per output channel) and FP8 activations (per token)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        wq, ws = quantize_rows(weight.detach())
        self.register_buffer("weight_fp8", wq)  # [N, K] float8_e4m3fn
        self.register_buffer("weight_scale", ws.view(-1))  # [N] float32
        self.register_buffer("bias", None if bias is None else bias.detach().clone())  # [N], the model dtype

    def _apply(self, fn, recurse=True):
        # module.to(dtype) casts every floating buffer, float8 included: the quantized weights and their float32
        # scales keep their dtypes (and follow a move to another device); the bias follows the model's dtype
        keep = {"weight_fp8": self.weight_fp8, "weight_scale": self.weight_scale}
        super()._apply(fn, recurse)
        for name, old in keep.items():
            new = getattr(self, name)
            if new.dtype != old.dtype:
                setattr(self, name, old.to(new.device))
        return self

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> FP8Linear:
        return cls(linear.weight, linear.bias)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.weight_fp8, self.weight_scale).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xq, xs = OPS.quantize_rows(x.reshape(-1, self.in_features))
        return self.gemm(xq, xs, x.dtype).view(*x.shape[:-1], self.out_features)

    def gemm(self, xq: torch.Tensor, xs: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """Already quantized rows (xq [M, K], xs [M, 1]) -> [M, N] in `out_dtype`."""
        if out_dtype == torch.bfloat16 and use_scaled_mm(xq, self.in_features, self.out_features):  # row-wise: bf16 out
            return scaled_mm(xq, xs, self.weight_fp8, self.weight_scale, self.bias, out_dtype)
        return reference(xq, xs, self.weight_fp8, self.weight_scale, self.bias, out_dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, float8_e4m3fn per-channel"


# the linears of each block that run in FP8 (Wan's names); cross-attention k/v see only the text, once per prompt
BLOCK_LINEARS = ("self_attn.q", "self_attn.k", "self_attn.v", "self_attn.o", "cross_attn.q", "cross_attn.o", "ffn.0", "ffn.2")


def quantize_linears(model: nn.Module, names: tuple[str, ...] = BLOCK_LINEARS) -> int:
    """Swap each block's `names` linears for FP8Linear in place (the bf16 weights are dropped); returns how many."""
    n = 0
    for blk in model.blocks:
        for name in names:
            parent_name, _, attr = name.rpartition(".")
            parent = blk.get_submodule(parent_name)
            lin = getattr(parent, attr) if not attr.isdigit() else parent[int(attr)]
            if isinstance(lin, FP8Linear):
                continue
            new = FP8Linear.from_linear(lin)
            if attr.isdigit():
                parent[int(attr)] = new
            else:
                setattr(parent, attr, new)
            n += 1
    return n


def is_fp8(module: nn.Module) -> bool:
    return isinstance(module, FP8Linear)
