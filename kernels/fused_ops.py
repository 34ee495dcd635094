"""Fused elementwise work of a decoder layer (Triton on a GPU, torch elsewhere): RMSNorm with the residual
add folded in, and SiLU(gate) · up.

In a decode step these are the small kernels between the matmuls and attention.  Written out in torch an
RMSNorm is seven launches (upcast, square, mean, +eps, rsqrt, scale, downcast, weight), and with the two
residual adds and the activation they took about 2 ms of a Llama-3-8B decode step at batch 64 on an H100
(2026-11-24, torch profiler) — as much as the KV of a 1k context.  Here each is one launch.

Numerics follow the torch code they replace (``rms_norm_torch``, ``silu_mul_torch``): the residual sum
rounded to the activation dtype, the norm in float32, rounded to the activation dtype before the weight
multiplies it (Hugging Face's LlamaRMSNorm order), SiLU rounded before the product.  Only the float32
sum of squares is accumulated in another order, so a bf16 output can differ from torch's in its last
place now and then; ``tests/test_fused_ops.py`` bounds that.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import triton
import triton.language as tl

from kvbench.kernels._triton_utils import cast_rne, interpreting, next_pow2, pdl, pdl_enter, pdl_launch

__all__ = ["rms_norm", "rms_norm_torch", "silu_mul", "silu_mul_torch", "use_triton"]


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   residual: Optional[torch.Tensor] = None) -> Union[torch.Tensor, tuple]:
    """The reference: ``residual`` given → (norm(x + residual), x + residual)."""
    s = x if residual is None else x + residual
    xf = s.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * xf.to(s.dtype)
    return out if residual is None else (out, s)


def silu_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    """``gate_up`` ``[..., 2·I]`` (gate, then up) → SiLU(gate) · up ``[..., I]``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def use_triton(x: torch.Tensor, want: Optional[bool] = None) -> bool:
    """Whether the Triton kernel runs: on CUDA tensors by default; ``want=True`` also on CPU tensors under
    Triton's interpreter (the CPU tests), ``False`` never."""
    if want is None:
        return x.is_cuda
    return bool(want) and (x.is_cuda or interpreting())


@triton.jit
def _rms_norm_kernel(X, R, W, OUT, RES_OUT, s_x0, s_x1, s_r0, s_r1, s_o0, s_o1, s_ro0, s_ro1, N, eps,
                     BLOCK: tl.constexpr, HAS_RES: tl.constexpr, EXACT: tl.constexpr, PDL: tl.constexpr = False):
    """Row (i, j) of ``N`` elements at ``i · s0 + j · s1`` (2-D and 3-D inputs alike).  ``EXACT``: the CPU
    interpreter's casts to bf16 truncate, so they round through ``cast_rne``.  ``PDL``: a programmatic
    dependent launch (``_triton_utils.pdl_enter``)."""
    pdl_enter(PDL)
    i = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1).to(tl.int64)
    c = tl.arange(0, BLOCK)
    m = c < N
    x = tl.load(X + i * s_x0 + j * s_x1 + c, mask=m, other=0.0)
    if HAS_RES:
        r = tl.load(R + i * s_r0 + j * s_r1 + c, mask=m, other=0.0)
        x = cast_rne(x.to(tl.float32) + r.to(tl.float32), X.dtype.element_ty, EXACT)  # the sum as torch rounds it
        tl.store(RES_OUT + i * s_ro0 + j * s_ro1 + c, x, mask=m)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / N
    y = cast_rne(xf * tl.math.rsqrt(var + eps), X.dtype.element_ty, EXACT)
    w = tl.load(W + c, mask=m, other=0.0)
    tl.store(OUT + i * s_o0 + j * s_o1 + c, cast_rne(w.to(tl.float32) * y.to(tl.float32), OUT.dtype.element_ty, EXACT),
             mask=m)


def _rows(t: torch.Tensor) -> tuple:
    """(grid, strides) of the rows of a 2-D ``[R, N]`` or 3-D ``[T, H, N]`` tensor."""
    if t.dim() == 2:
        return (t.shape[0], 1), (t.stride(0), 0)
    return (t.shape[0], t.shape[1]), (t.stride(0), t.stride(1))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: Optional[torch.Tensor] = None,
             triton_kernel: Optional[bool] = None) -> Union[torch.Tensor, tuple]:
    """RMSNorm over the last dim of a 2-D or 3-D ``x`` (last dim contiguous), times ``weight``; with
    ``residual``: one launch computes ``s = x + residual`` and returns ``(norm(s), s)``.  Off the GPU (or
    for other shapes) the torch reference; ``triton_kernel`` as in ``use_triton``."""
    if (not use_triton(x, triton_kernel) or x.dim() not in (2, 3) or x.stride(-1) != 1 or x.numel() == 0
            or (residual is not None and (residual.shape != x.shape or residual.stride(-1) != 1))):
        return rms_norm_torch(x, weight, eps, residual)
    n = x.shape[-1]
    out = torch.empty(x.shape, dtype=torch.result_type(weight, x), device=x.device)
    res_out = torch.empty_like(x) if residual is not None else out
    r = residual if residual is not None else x
    grid, sx = _rows(x)
    _, sr = _rows(r)
    _, so = _rows(out)
    _, sro = _rows(res_out)
    block, on = next_pow2(n), pdl()
    _rms_norm_kernel[grid](x, r, weight, out, res_out, *sx, *sr, *so, *sro, n, float(eps),
                           BLOCK=block, HAS_RES=residual is not None, EXACT=interpreting(), PDL=on,
                           num_warps=min(16, max(1, block // 512)), **pdl_launch(on))
    return out if residual is None else (out, res_out)


@triton.jit
def _silu_mul_kernel(GU, OUT, s_g, s_o, I, BLOCK: tl.constexpr, EXACT: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)  # as in ``_rms_norm_kernel``
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < I
    g = tl.load(GU + row * s_g + c, mask=m, other=0.0).to(tl.float32)
    u = tl.load(GU + row * s_g + I + c, mask=m, other=0.0)
    a = cast_rne(g / (1.0 + tl.exp(-g)), u.dtype, EXACT)  # SiLU, rounded as torch's activation output is
    tl.store(OUT + row * s_o + c, cast_rne(a.to(tl.float32) * u.to(tl.float32), OUT.dtype.element_ty, EXACT), mask=m)


def silu_mul(gate_up: torch.Tensor, triton_kernel: Optional[bool] = None) -> torch.Tensor:
    """SiLU(gate) · up of a 2-D ``[T, 2·I]`` (gate columns first) in one launch; otherwise the reference."""
    if not use_triton(gate_up, triton_kernel) or gate_up.dim() != 2 or gate_up.stride(-1) != 1 or gate_up.shape[-1] % 2:
        return silu_mul_torch(gate_up)
    t, i2 = gate_up.shape
    i = i2 // 2
    out = torch.empty(t, i, dtype=gate_up.dtype, device=gate_up.device)
    if t == 0:
        return out
    block, on = min(1024, next_pow2(i)), pdl()
    _silu_mul_kernel[(t, triton.cdiv(i, block))](gate_up, out, gate_up.stride(0), out.stride(0), i, BLOCK=block,
                                                 EXACT=interpreting(), PDL=on, num_warps=4, **pdl_launch(on))
    return out
