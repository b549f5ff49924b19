"""The fp64 reference: the math every implementation is checked against.

RMSNorm:   rstd = 1 / sqrt(mean(x^2) + eps)          y = x * rstd * w
LayerNorm: mean = mean(x), rstd = 1 / sqrt(var(x) + eps) (biased var)   y = (x - mean) * rstd * w + b

Backward, with xhat the normalized row and g = dy * w:
RMSNorm:   dx = rstd * (g - xhat * mean(g * xhat))                   dw = sum_rows(dy * xhat)
LayerNorm: dx = rstd * (g - xhat * mean(g * xhat) - mean(g))         dw = sum_rows(dy * xhat), db = sum_rows(dy)

Add + RMSNorm: h = round_to_x_dtype(x + residual) (what the unfused model stores), y = RMSNorm(h);
backward dh = RMSNorm's dx + dresidual_out (the gradient reaching h through the residual stream).

FP8 output (forward only): the RMSNorm (or add + RMSNorm) y above, never rounded to x's dtype, then
per group of ``group`` elements scale = max(amax|y|, floor) / 448 and q = e4m3fn(y / scale), round to
nearest even, saturating (``harness.spec.fp8``); q comes back as its exact fp64 value.

Inputs are the same low-precision tensors the kernels see, upcast to fp64; the backward reference
uses its own fp64 statistics, while kernels are given those statistics rounded to fp32.
"""

from __future__ import annotations

import torch

from harness.spec.fp8 import quantize


def _f64(t):
    return None if t is None else t.detach().to(torch.float64)


def rmsnorm_fwd(x, weight, eps):
    x = _f64(x)
    rstd = torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    y = x * rstd
    if weight is not None:
        y = y * _f64(weight)
    return y, rstd.squeeze(-1)


def layernorm_fwd(x, weight, bias, eps):
    x = _f64(x)
    mean = x.mean(-1, keepdim=True)
    rstd = torch.rsqrt((x - mean).square().mean(-1, keepdim=True) + eps)
    y = (x - mean) * rstd
    if weight is not None:
        y = y * _f64(weight)
    if bias is not None:
        y = y + _f64(bias)
    return y, mean.squeeze(-1), rstd.squeeze(-1)


def _column_sum(t):
    return t.reshape(-1, t.shape[-1]).sum(0)


def rmsnorm_bwd(dy, x, weight, rstd):
    dy, x, rstd = _f64(dy), _f64(x), _f64(rstd).unsqueeze(-1)
    xhat = x * rstd
    g = dy * _f64(weight) if weight is not None else dy
    dx = rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    dw = _column_sum(dy * xhat) if weight is not None else None
    return dx, dw


def layernorm_bwd(dy, x, weight, mean, rstd):
    dy, x = _f64(dy), _f64(x)
    mean, rstd = _f64(mean).unsqueeze(-1), _f64(rstd).unsqueeze(-1)
    xhat = (x - mean) * rstd
    g = dy * _f64(weight) if weight is not None else dy
    dx = rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True) - g.mean(-1, keepdim=True))
    dw = _column_sum(dy * xhat) if weight is not None else None
    return dx, dw, _column_sum(dy)


def add_rmsnorm_fwd(x, residual, weight, eps):
    # the sum is rounded once to x's dtype, as the unfused pair stores it; fp64 then sees that value
    h = (_f64(x) + _f64(residual)).to(x.dtype)
    y, rstd = rmsnorm_fwd(h, weight, eps)
    return y, _f64(h), rstd


def add_rmsnorm_bwd(dy, dresidual_out, residual_out, weight, rstd):
    dh, dw = rmsnorm_bwd(dy, residual_out, weight, rstd)
    if dresidual_out is not None:
        dh = dh + _f64(dresidual_out)
    return dh, dw


def rmsnorm_fp8_fwd(x, weight, eps, group):
    y, rstd = rmsnorm_fwd(x, weight, eps)
    q, scale = quantize(y, group)
    return q, scale, rstd


def add_rmsnorm_fp8_fwd(x, residual, weight, eps, group):
    y, h, rstd = add_rmsnorm_fwd(x, residual, weight, eps)
    q, scale = quantize(y, group)
    return q, scale, h, rstd
