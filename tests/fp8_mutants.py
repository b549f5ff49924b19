"""FP8 ops implemented with one defect each (never registered in impls/): the checker must reject
every one of them, and pass the same code without the defect. They are the fused fp32 formula in
PyTorch (y = x * rstd * w in fp32, per-group amax, y / scale, cast), with:

    none                the formula as the contract states it (must pass)
    rounded_scale       the scale from the amax of y rounded to x's dtype (q still from the fp32 y)
    truncate            y / scale rounded toward zero onto the e4m3 grid, not to nearest even
    no_saturation       a conversion without saturation that checks the range before rounding: a
                        y / scale past 448 by fp32's rounding (448.00003) becomes NaN
    group_off_by_one    each block's amax over columns [128 g + 1, 128 (g + 1) + 1) (the last wraps)
    row_amax            every block's scale from the amax of the whole row (1 x 128 blocks)
"""

from types import SimpleNamespace

import torch

from harness.spec.fp8 import AMAX_FLOOR, E4M3_MAX, FP8_DTYPE, e4m3_step


def _norm(x, residual, weight, eps):
    h = x if residual is None else (x.float() + residual.float()).to(x.dtype)
    hf = h.float()
    rstd = torch.rsqrt(hf.square().mean(-1, keepdim=True) + eps)
    y = hf * rstd
    if weight is not None:
        y = y * weight.float()
    return y, h, rstd.squeeze(-1)


def _cast(v, defect):
    if defect == "truncate":
        v64 = v.double()
        step = e4m3_step(v64)
        return (torch.trunc(v64 / step) * step).clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)
    if defect == "no_saturation":
        return torch.where(v.abs() > E4M3_MAX, float("nan"), v).to(FP8_DTYPE)
    return v.to(FP8_DTYPE)


def _quantize(y, x_dtype, group, defect):
    n = y.shape[-1]
    yg = y.unflatten(-1, (n // group, group))
    if defect == "rounded_scale":
        amax = yg.to(x_dtype).abs().amax(-1).float()
    elif defect == "group_off_by_one":
        amax = torch.roll(y, -1, dims=-1).unflatten(-1, (n // group, group)).abs().amax(-1)
    elif defect == "row_amax":
        amax = y.abs().amax(-1, keepdim=True).expand(*y.shape[:-1], n // group)
    else:
        amax = yg.abs().amax(-1)
    scale = amax.clamp_min(AMAX_FLOOR) / E4M3_MAX
    q = _cast(yg / scale.unsqueeze(-1), defect)
    return q.flatten(-2), scale


def fp8(defect: str = "none"):
    def rmsnorm_fp8_fwd(x, weight, eps, group):
        y, _, rstd = _norm(x, None, weight, eps)
        q, scale = _quantize(y, x.dtype, group, defect)
        return q, scale, rstd

    def add_rmsnorm_fp8_fwd(x, residual, weight, eps, group):
        y, h, rstd = _norm(x, residual, weight, eps)
        q, scale = _quantize(y, x.dtype, group, defect)
        return q, scale, h, rstd

    return SimpleNamespace(rmsnorm_fp8_fwd=rmsnorm_fp8_fwd, add_rmsnorm_fp8_fwd=add_rmsnorm_fp8_fwd)
