"""RMSNorm, LayerNorm and residual add + RMSNorm in Triton: one program per row, the whole row in
one block of registers.

Per row of N elements, in fp32, rounded once to x's dtype (statistics stay fp32)::

    RMSNorm        rstd = 1 / sqrt(mean(x^2) + eps)                     y = x * rstd * w
    LayerNorm      mean = mean(x), rstd = 1 / sqrt(mean((x - mean)^2) + eps)
                                                                        y = (x - mean) * rstd * w + b
    add + RMSNorm  h = x + residual (rounded to x's dtype: residual_out), y = RMSNorm(h)

Backward, with xhat = (x - mean) * rstd (mean = 0 for RMSNorm) and g = dy * w::

    dx = rstd * (g - xhat * mean(g * xhat) - mean(g))   (the mean(g) term: LayerNorm only)
    dweight = sum over rows of dy * xhat,  dbias = sum over rows of dy (in the weight's dtype)
    add + RMSNorm: dh = dx + dresidual_out

LayerNorm rows whose squares overflow fp32 have var = inf, where rsqrt(inf) = 0 would give
y = bias, a finite wrong answer: rstd is NaN there instead.

Where to go from here: each program writes its row of dy * xhat to an (M, N) fp32 buffer that torch
sums, and holds a whole row in registers (wide rows spill on a GPU); residual_out is added by torch
before the kernel. The fused and persistent versions of all three are in impls/triton/kernels.py.
Under Triton's CPU interpreter (TRITON_INTERPRET=1) do no arithmetic on bf16 values: load, convert
to fp32, compute, convert once when storing.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _fwd_kernel(X, W, B, Y, MEAN, RSTD, stride_x, N, eps,
                HAS_W: tl.constexpr, HAS_B: tl.constexpr, LAYERNORM: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if LAYERNORM:
        mean = tl.sum(x, axis=0) / N
        x = tl.where(mask, x - mean, 0.0)
        tl.store(MEAN + row, mean)
    var = tl.sum(x * x, axis=0) / N
    rstd = tl.rsqrt(var + eps)
    if LAYERNORM:
        rstd = tl.where(var == float("inf"), float("nan"), rstd)
    tl.store(RSTD + row, rstd)
    y = x * rstd
    if HAS_W:
        y = y * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_B:
        y = y + tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * N + cols, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _bwd_kernel(DY, X, W, MEAN, RSTD, DRES, DX, DW_ROWS, stride_dy, stride_x, stride_dres, N,
                HAS_W: tl.constexpr, HAS_DRES: tl.constexpr, LAYERNORM: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.load(RSTD + row)
    if LAYERNORM:
        x = tl.where(mask, x - tl.load(MEAN + row), 0.0)
    xhat = x * rstd
    g = dy
    if HAS_W:
        g = dy * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(DW_ROWS + row * N + cols, dy * xhat, mask=mask)
    dx = g - xhat * (tl.sum(g * xhat, axis=0) / N)
    if LAYERNORM:
        dx = dx - tl.sum(g, axis=0) / N
    dx = dx * rstd
    if HAS_DRES:
        dx = dx + tl.load(DRES + row * stride_dres + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(DX + row * N + cols, dx.to(DX.dtype.element_ty), mask=mask)


def _launch_args(n):
    block = triton.next_power_of_2(n)
    return block, min(16, max(4, block // 1024))


def _fwd(x, weight, bias, eps, layernorm):
    m, n = x.shape
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    mean = torch.empty(m, dtype=torch.float32, device=x.device) if layernorm else None
    rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    block, warps = _launch_args(n)
    _fwd_kernel[(m,)](
        x, x if weight is None else weight, x if bias is None else bias, y, rstd if mean is None else mean, rstd,
        x.stride(0), n, eps, HAS_W=weight is not None, HAS_B=bias is not None, LAYERNORM=layernorm,
        BLOCK=block, num_warps=warps,
    )  # fmt: skip
    return y, mean, rstd


def _bwd(dy, x, weight, mean, rstd, dresidual_out, layernorm):
    m, n = x.shape
    dx = torch.empty((m, n), dtype=x.dtype, device=x.device)
    dw_rows = torch.empty((m, n), dtype=torch.float32, device=x.device) if weight is not None else None
    block, warps = _launch_args(n)
    _bwd_kernel[(m,)](
        dy, x, x if weight is None else weight, rstd if mean is None else mean, rstd,
        dy if dresidual_out is None else dresidual_out, dx, dx if dw_rows is None else dw_rows,
        dy.stride(0), x.stride(0), 0 if dresidual_out is None else dresidual_out.stride(0), n,
        HAS_W=weight is not None, HAS_DRES=dresidual_out is not None, LAYERNORM=layernorm,
        BLOCK=block, num_warps=warps,
    )  # fmt: skip
    pdtype = weight.dtype if weight is not None else x.dtype
    dweight = dw_rows.sum(0).to(pdtype) if dw_rows is not None else None
    return dx, dweight, dy.float().sum(0).to(pdtype)


def rmsnorm_fwd(x, weight, eps):
    y, _, rstd = _fwd(x, weight, None, eps, layernorm=False)
    return y, rstd


def rmsnorm_bwd(dy, x, weight, rstd):
    dx, dweight, _ = _bwd(dy, x, weight, None, rstd, None, layernorm=False)
    return dx, dweight


def layernorm_fwd(x, weight, bias, eps):
    return _fwd(x, weight, bias, eps, layernorm=True)


def layernorm_bwd(dy, x, weight, mean, rstd):
    return _bwd(dy, x, weight, mean, rstd, None, layernorm=True)


def add_rmsnorm_fwd(x, residual, weight, eps):
    h = (x.float() + residual.float()).to(x.dtype)
    y, _, rstd = _fwd(h, weight, None, eps, layernorm=False)
    return y, h, rstd


def add_rmsnorm_bwd(dy, dresidual_out, residual_out, weight, rstd):
    dh, dweight, _ = _bwd(dy, residual_out, weight, None, rstd, dresidual_out, layernorm=False)
    return dh, dweight
