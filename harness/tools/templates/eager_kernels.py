"""RMSNorm, LayerNorm and residual add + RMSNorm as plain PyTorch formulas, in fp32.

Per row of N elements, computed in fp32 and rounded once to x's dtype (statistics stay fp32)::

    RMSNorm        rstd = 1 / sqrt(mean(x^2) + eps)                     y = x * rstd * w
    LayerNorm      mean = mean(x), rstd = 1 / sqrt(mean((x - mean)^2) + eps)
                                                                        y = (x - mean) * rstd * w + b
    add + RMSNorm  h = x + residual (rounded to x's dtype: residual_out), y = RMSNorm(h)

Backward, with xhat = (x - mean) * rstd (mean = 0 for RMSNorm) and g = dy * w::

    dx = rstd * (g - xhat * mean(g * xhat) - mean(g))   (the mean(g) term: LayerNorm only)
    dweight = sum over rows of dy * xhat,  dbias = sum over rows of dy (in the weight's dtype)
    add + RMSNorm: dh = dx + dresidual_out

LayerNorm rows whose squares overflow fp32 (|x| ~ 1e19 and up) have var = inf, where
rsqrt(inf) = 0 would give y = bias, a finite wrong answer: rstd is NaN there instead.

The harness hands every function 2-D (M, N) rows with unit stride along N (harness.spec.contract).
"""

import torch


def _rstd(var, eps):
    return torch.rsqrt(var + eps).masked_fill(torch.isinf(var), float("nan"))


def rmsnorm_fwd(x, weight, eps):
    xf = x.float()
    rstd = torch.rsqrt(xf.square().mean(-1) + eps)
    y = xf * rstd[:, None]
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype), rstd


def _norm_bwd(dy, x, weight, mean, rstd):
    """dx (fp32), dweight and dbias of the formulas above; ``mean`` None for RMSNorm."""
    xhat = (x.float() if mean is None else x.float() - mean[:, None]) * rstd[:, None]
    dyf = dy.float()
    g = dyf * weight.float() if weight is not None else dyf
    dx = g - xhat * (g * xhat).mean(-1, keepdim=True)
    if mean is not None:
        dx = dx - g.mean(-1, keepdim=True)
    pdtype = weight.dtype if weight is not None else x.dtype
    dweight = (dyf * xhat).sum(0).to(pdtype) if weight is not None else None
    return dx * rstd[:, None], dweight, dyf.sum(0).to(pdtype)


def rmsnorm_bwd(dy, x, weight, rstd):
    dx, dweight, _ = _norm_bwd(dy, x, weight, None, rstd)
    return dx.to(x.dtype), dweight


def layernorm_fwd(x, weight, bias, eps):
    var, mean = torch.var_mean(x.float(), -1, correction=0)
    rstd = _rstd(var, eps)
    y = (x.float() - mean[:, None]) * rstd[:, None]
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype), mean, rstd


def layernorm_bwd(dy, x, weight, mean, rstd):
    dx, dweight, dbias = _norm_bwd(dy, x, weight, mean, rstd)
    return dx.to(x.dtype), dweight, dbias


def add_rmsnorm_fwd(x, residual, weight, eps):
    h = (x.float() + residual.float()).to(x.dtype)
    y, rstd = rmsnorm_fwd(h, weight, eps)
    return y, h, rstd


def add_rmsnorm_bwd(dy, dresidual_out, residual_out, weight, rstd):
    dx, dweight, _ = _norm_bwd(dy, residual_out, weight, None, rstd)
    if dresidual_out is not None:
        dx = dx + dresidual_out.float()
    return dx.to(residual_out.dtype), dweight
