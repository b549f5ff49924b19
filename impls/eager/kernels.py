"""PyTorch eager, the baseline every speedup is quoted against.

Forward: ATen's fused kernels (``_fused_rms_norm`` and ``native_layer_norm``, what F.rms_norm and
F.layer_norm dispatch to), which also return the fp32 statistics. Backward: the kernels autograd
runs for them (``_fused_rms_norm_backward``, ``native_layer_norm_backward``), called directly with the
saved statistics so no forward is recomputed. On the CPU, where ATen has no fused RMSNorm backward
and its LayerNorm backward takes the statistics in x's dtype, the same formulas run as fp32 ops.
"""

import torch

aten = torch.ops.aten


def rmsnorm_fwd(x, weight, eps):
    y, rstd = aten._fused_rms_norm(x, [x.shape[-1]], weight, eps)
    return y, rstd.reshape(-1).float()


def _has_fused_rms_bwd(device: torch.device) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(
        "aten::_fused_rms_norm_backward", "CUDA" if device.type == "cuda" else "CPU"
    )


def rmsnorm_bwd(dy, x, weight, rstd):
    if _has_fused_rms_bwd(x.device):
        mask = [True, weight is not None]
        return aten._fused_rms_norm_backward(dy, x, [x.shape[-1]], rstd.view(-1, 1), weight, mask)
    # ATen's composite formula, in fp32 (what autograd of F.rms_norm computes on such a backend)
    xhat = x.float() * rstd.view(-1, 1)
    g = dy.float() * weight.float() if weight is not None else dy.float()
    dx = rstd.view(-1, 1) * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    dw = (dy.float() * xhat).sum(0).to(weight.dtype) if weight is not None else None
    return dx.to(x.dtype), dw


def layernorm_fwd(x, weight, bias, eps):
    y, mean, rstd = aten.native_layer_norm(x, [x.shape[-1]], weight, bias, eps)
    if mean.dtype != torch.float32:
        # ATen's CPU kernel returns the statistics in x's dtype; the contract wants them in fp32
        var, mean = torch.var_mean(x.float(), -1, correction=0)
        return y, mean, torch.rsqrt(var + eps)
    return y, mean.reshape(-1), rstd.reshape(-1)


def layernorm_bwd(dy, x, weight, mean, rstd):
    n = x.shape[-1]
    if not x.is_cuda:
        # ATen's CPU backward wants the statistics in x's dtype (losing their precision): use the
        # formula it implements, in fp32, instead
        xhat = (x.float() - mean.view(-1, 1)) * rstd.view(-1, 1)
        g = dy.float() * weight.float() if weight is not None else dy.float()
        dx = rstd.view(-1, 1) * (g - xhat * (g * xhat).mean(-1, keepdim=True) - g.mean(-1, keepdim=True))
        dw = (dy.float() * xhat).sum(0).to(x.dtype) if weight is not None else None
        return dx.to(x.dtype), dw, dy.float().sum(0).to(x.dtype)
    # ATen only uses ``bias`` to know that dbias is wanted: any (N,) tensor will do
    bias_marker = torch.empty(n, dtype=x.dtype, device=x.device)
    return aten.native_layer_norm_backward(
        dy, x, [n], mean.view(-1, 1), rstd.view(-1, 1), weight, bias_marker, [True, weight is not None, True]
    )
