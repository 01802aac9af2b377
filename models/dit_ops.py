"""The DiT's elementwise steps, in torch: 3D RoPE (its tables, `Rope`, and the rotation, `apply_rope`),
qk-RMSNorm, the modulated LayerNorm (AdaLN) and the residual adds fused with the next norm.

A block calls them through `KERNELS`, which `compile_helpers()` fills with torch.compile'd versions; the
fused Triton kernels (models/triton_ops.py) take the same signatures and are checked against these.
Shapes as in models/dit.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from models import fp8
from models.config import ModelConfig


class Rope:
    """3D RoPE tables (Wan's interleaved pairs), looked up by temporal position at read time."""

    def __init__(self, cfg: ModelConfig, max_positions: int = 1024, theta: float = 10000.0) -> None:
        self.grid = cfg.grid
        self.tokens_per_frame = cfg.tokens_per_frame

        def angles(n: int, d: int) -> torch.Tensor:  # [n, d/2] in float64
            return torch.outer(torch.arange(n, dtype=torch.float64), 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))

        dt, dh, dw = cfg.rope_split
        h, w = self.grid
        self.time = angles(max_positions, dt)  # [P, dt/2]
        hw = torch.cat(  # [h*w, (dh + dw)/2], h-major as Wan flattens frames
            [angles(h, dh)[:, None].expand(h, w, -1), angles(w, dw)[None, :].expand(h, w, -1)], dim=-1
        ).reshape(h * w, -1)
        self.space = hw
        self._tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def table(self, positions: Sequence[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for the tokens of frames at `positions`: each [len(positions) * T, 1, D] float32,
        every pair's angle repeated and sin signed (-, +), as `apply_rope` wants."""
        key = (tuple(positions), device)
        if key not in self._tables:
            if max(positions, default=0) >= self.time.shape[0]:
                raise ValueError(f"RoPE position {max(positions)} is past the table of {self.time.shape[0]}")
            t = self.time[list(positions)]  # [F, dt/2]
            ang = torch.cat(
                [t[:, None].expand(-1, self.tokens_per_frame, -1), self.space[None].expand(len(positions), -1, -1)], dim=-1
            ).reshape(len(positions) * self.tokens_per_frame, 1, -1)
            if len(self._tables) > 64:
                self._tables.clear()
            with torch.inference_mode(False):  # normal tensors: a table made while serving may serve training
                sign = torch.tensor([-1.0, 1.0], dtype=torch.float64)
                cos = ang.cos().repeat_interleave(2, dim=-1)
                sin = (ang.sin()[..., None] * sign).flatten(-2)
                self._tables[key] = (cos.float().to(device), sin.float().to(device))
        return self._tables[key]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [..., L, H, D]; cos, sin: [L, 1, D] (each pair's angle repeated, sin signed -,+) -> x rotated pairwise:
    # (x[2i], x[2i+1]) -> (x[2i] cos - x[2i+1] sin, x[2i] sin + x[2i+1] cos), same dtype as x
    xf = x.float()
    swapped = xf.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)  # (x[2i+1], x[2i])
    return (xf * cos + swapped * sin).type_as(x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x) * weight


def norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [L, H, D] projected queries or keys -> qk-RMSNorm over H*D, then RoPE: [L, H, D]
    n = rms_norm(x.flatten(-2), weight, eps).view_as(x)
    return apply_rope(n, cos, sin)


def adaln(h: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
    # h: [B, F, T, dim] float32 residual; shift, scale: [B, F, 1, dim] -> modulated LayerNorm in `dtype`
    return (F.layer_norm(h, h.shape[-1:], eps=eps) * (1 + scale) + shift).to(dtype)


def residual_norm(h, y, gate, weight, bias, eps: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    # h: [B, F, T, dim] float32; y: same shape, model dtype; gate: [B, F, 1, dim]
    # -> (h + y * gate, its affine LayerNorm in `dtype`): one pass instead of two
    h = h + y.float() * gate
    return h, F.layer_norm(h, h.shape[-1:], weight.float(), bias.float(), eps).to(dtype)


def residual_adaln(h, y, gate, shift, scale, eps: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    # -> (h + y * gate (gate None: h + y), the next modulated LayerNorm of it in `dtype`)
    h = h + (y.float() if gate is None else y.float() * gate)
    return h, adaln(h, shift, scale, eps, dtype)


class _Kernels:
    """The elementwise pieces of a block; `compile_helpers()` swaps in torch.compile'd versions.
    The `*_into` forms write into slices of the attention's key / query buffers, as the Triton
    kernels (models/triton_ops.py) do; here they copy a pure function's result."""

    rms_norm = staticmethod(rms_norm)
    rope = staticmethod(apply_rope)
    norm_rope = staticmethod(norm_rope)
    adaln = staticmethod(adaln)
    residual_norm = staticmethod(residual_norm)
    residual_adaln = staticmethod(residual_adaln)

    def norm_rope_into(self, x, weight, eps: float, cos, sin, out, normed=None) -> None:
        """out <- RoPE(RMSNorm(x)); normed (if given) <- RMSNorm(x). x: [L, H, D]; cos, sin: [L, 1, D]."""
        if normed is None:
            out.copy_(self.norm_rope(x, weight, eps, cos, sin))
            return
        normed.copy_(self.rms_norm(x.flatten(-2), weight, eps).view_as(x))
        out.copy_(self.rope(normed, cos, sin))

    def rope_into(self, x, cos, sin, out) -> None:
        """out <- RoPE(x): cached keys, stored normalized, rotated to their cache positions."""
        out.copy_(self.rope(x, cos, sin))


KERNELS = _Kernels()


def compile_helpers() -> None:
    """Fuse RoPE, the norms and the residuals with torch.compile (one kernel each instead of several)."""
    import torch._dynamo

    # one specialization per batch size, cache fill and gate/no gate: more than dynamo's default of 8
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    for name in ("rms_norm", "rope", "norm_rope", "adaln", "residual_norm", "residual_adaln"):
        setattr(KERNELS, name, torch.compile(getattr(_Kernels, name), dynamic=False, fullgraph=True))
    fp8.OPS.compile()  # the FP8 linears' activation quantizers (used only when fp8-linears is on)
