"""PyTorch eager, the baseline every speedup is quoted against.

Forward: ATen's fused kernels (``_fused_rms_norm`` and ``native_layer_norm``, what F.rms_norm and
F.layer_norm dispatch to), which also return the fp32 statistics. Backward: the kernels autograd
runs for them (``_fused_rms_norm_backward``, ``native_layer_norm_backward``), called directly with the
saved statistics so no forward is recomputed. On the CPU, where ATen has no fused RMSNorm backward
and its LayerNorm backward takes the statistics in x's dtype, the same formulas run as fp32 ops.

Add + RMSNorm is the unfused pair a model runs without a fused kernel: ``h = x + residual`` (one
elementwise kernel, fp32 math rounded to x's dtype), then the RMSNorm above on h; backward: the
RMSNorm backward, then ``dh = dx + dresidual_out`` as autograd accumulates it. Two extra passes
over the rows: the baseline a fused kernel is measured against.

Parameters may be fp32 beside 16-bit x: ATen's CPU kernels take mixed dtypes; its CUDA kernels (torch
2.11) do not, and there the same formulas run as fp32 ops, as F.rms_norm's composite fallback does;
gradients come back in the parameters' dtype. Overflow (rows whose squares overflow fp32): ATen's LayerNorm returns NaN (on
the CPU only for rows of one block); the CPU path recomputes the statistics and keeps NaN for every
row width rather than rstd = rsqrt(inf) = 0, which gives y = bias and a backward of zeros.
"""

import torch

aten = torch.ops.aten


def _mixed(x, weight) -> bool:
    # ATen's fused CUDA RMSNorm takes one dtype; F.rms_norm falls back to its composite ops then
    return weight is not None and weight.dtype != x.dtype and x.is_cuda


def rmsnorm_fwd(x, weight, eps):
    if _mixed(x, weight):  # F.rms_norm's composite formula, in fp32
        rstd = torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps)
        return (x.float() * rstd * weight.float()).to(x.dtype), rstd.reshape(-1)
    y, rstd = aten._fused_rms_norm(x, [x.shape[-1]], weight, eps)
    return y, rstd.reshape(-1).float()


def _has_fused_rms_bwd(device: torch.device) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(
        "aten::_fused_rms_norm_backward", "CUDA" if device.type == "cuda" else "CPU"
    )


def rmsnorm_bwd(dy, x, weight, rstd):
    if _has_fused_rms_bwd(x.device) and not _mixed(x, weight):
        mask = [True, weight is not None]
        return aten._fused_rms_norm_backward(dy, x, [x.shape[-1]], rstd.view(-1, 1), weight, mask)
    # ATen's composite formula, in fp32 (what autograd of F.rms_norm computes on such a backend)
    xhat = x.float() * rstd.view(-1, 1)
    g = dy.float() * weight.float() if weight is not None else dy.float()
    dx = rstd.view(-1, 1) * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    dw = (dy.float() * xhat).sum(0).to(weight.dtype) if weight is not None else None
    return dx.to(x.dtype), dw


def add_rmsnorm_fwd(x, residual, weight, eps):
    h = x + residual
    y, rstd = rmsnorm_fwd(h, weight, eps)
    return y, h, rstd


def add_rmsnorm_bwd(dy, dresidual_out, residual_out, weight, rstd):
    dx, dw = rmsnorm_bwd(dy, residual_out, weight, rstd)
    return (dx if dresidual_out is None else dx + dresidual_out), dw


def layernorm_fwd(x, weight, bias, eps):
    if bias is not None and weight is not None and bias.dtype != weight.dtype:
        bias = bias.to(weight.dtype)  # ATen's mixed-dtype kernels want both parameters fp32 (N elements)
    if _mixed(x, weight):  # ATen's CUDA LayerNorm wants x's dtype too: F.layer_norm's formula in fp32
        var, mean = torch.var_mean(x.float(), -1, correction=0, keepdim=True)
        rstd = torch.rsqrt(var + eps)
        y = (x.float() - mean) * rstd * weight.float()
        y = y + bias.float() if bias is not None else y
        return y.to(x.dtype), mean.reshape(-1), rstd.reshape(-1)
    y, mean, rstd = aten.native_layer_norm(x, [x.shape[-1]], weight, bias, eps)
    if not x.is_cuda:
        # ATen's CPU kernel returns the statistics in x's dtype (the contract wants fp32), and on
        # wide rows whose variance overflows it returns rstd = 0 and y = bias where its narrow-row
        # path returns NaN: statistics in fp32, NaN wherever the variance overflowed
        var, mean = torch.var_mean(x.float(), -1, correction=0)
        overflow = torch.isinf(var)
        return y.masked_fill(overflow.unsqueeze(-1), float("nan")), mean, torch.rsqrt(var + eps).masked_fill(overflow, float("nan"))
    return y, mean.reshape(-1), rstd.reshape(-1)


def layernorm_bwd(dy, x, weight, mean, rstd):
    n = x.shape[-1]
    if not x.is_cuda or _mixed(x, weight):
        # ATen's CPU backward wants the statistics in x's dtype (losing their precision), its CUDA
        # backward one dtype for x and the weight: the formula it implements, in fp32, instead
        xhat = (x.float() - mean.view(-1, 1)) * rstd.view(-1, 1)
        g = dy.float() * weight.float() if weight is not None else dy.float()
        dx = rstd.view(-1, 1) * (g - xhat * (g * xhat).mean(-1, keepdim=True) - g.mean(-1, keepdim=True))
        pdtype = weight.dtype if weight is not None else x.dtype
        dw = (dy.float() * xhat).sum(0).to(pdtype) if weight is not None else None
        return dx.to(x.dtype), dw, dy.float().sum(0).to(pdtype)
    # ATen only uses ``bias`` to know that dbias is wanted (and in which dtype): any (N,) tensor will do
    bias_marker = torch.empty(n, dtype=weight.dtype if weight is not None else x.dtype, device=x.device)
    return aten.native_layer_norm_backward(
        dy, x, [n], mean.view(-1, 1), rstd.view(-1, 1), weight, bias_marker, [True, weight is not None, True]
    )
