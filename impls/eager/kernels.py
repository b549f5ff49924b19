"""PyTorch eager, the baseline every speedup is quoted against.

Forward: ATen's fused kernels (``_fused_rms_norm`` and ``native_layer_norm``, what F.rms_norm and
F.layer_norm dispatch to), which also return the fp32 statistics. Backward: the kernels autograd
runs for them (``_fused_rms_norm_backward``, ``native_layer_norm_backward``), called directly with the
saved statistics so no forward is recomputed. On the CPU, where ATen has no fused RMSNorm backward,
RMSNorm's backward runs its formula as fp32 ops; LayerNorm, whose CPU kernels keep the statistics
in the parameters' dtype, runs its forward with fp32 parameters (fp32 statistics, y in x's dtype)
and its backward as ATen's fp32 kernel on x and dy in fp32, each gradient rounded once (its
mixed-dtype backward rounds dweight and dbias on the way).

ATen's own kernels, whatever is installed beside torch: torch 2.13 and later route ATen's fused
RMSNorm (``_fused_rms_norm`` and its backward) to a vendored copy of Quack (CuTe DSL kernels,
``torch._native``) on sm_90/sm_100 when a CUDA build of torch finds an nvidia-cutlass-dsl version it
accepts, and silently do not with others. Where that override is on, the calls here bypass it: ATen's
own kernel is taken from the dispatcher once, with the override switched off for that moment, and
called directly (``_native``). What F.rms_norm itself runs in a process is in every report's
meta.json (``environment.aten_rms_norm``: ``harness.run.environment.aten_rms_norm``).

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

from harness.run.environment import rms_norm_overrides

aten = torch.ops.aten
# (ATen op, dispatch key) -> ATen's own kernel, captured where torch overrides the op
_NATIVE: dict = {}


def _native(op: str, x: torch.Tensor):
    """``aten.<op>`` as ATen's own kernel for x's device: the op itself, or, where torch routes it to
    a DSL kernel (its vendored Quack: harness.run.environment.rms_norm_overrides), ATen's kernel
    taken from the dispatcher with the override switched off for that moment and called directly,
    so the baseline is the same kernel with any nvidia-cutlass-dsl installed."""
    key = "CUDA" if x.is_cuda else "CPU"
    if op not in rms_norm_overrides(key):
        # torch's own binding where the op has one: the same dispatch as aten.<op>, without the
        # overload resolution that torch.ops' Python packet runs on every call
        # (or the overload itself: a packet resolves its overload in Python on every call)
        return getattr(torch, op, None) or getattr(aten, op).default
    kernel = _NATIVE.get((op, key))
    if kernel is None:
        from torch._native import registry

        registry.deregister_op_overrides(disable_op_symbols=[op])
        try:
            kernel = _NATIVE[(op, key)] = torch.library.get_kernel(f"aten::{op}", key)
        finally:
            registry.reenable_op_overrides(enable_op_symbols=[op])
    keys = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))
    return lambda *args: kernel.call_boxed(keys, *args)


def _mixed(x, weight) -> bool:
    # ATen's fused CUDA RMSNorm takes one dtype; F.rms_norm falls back to its composite ops then
    return weight is not None and weight.dtype != x.dtype and x.is_cuda


def rmsnorm_fwd(x, weight, eps):
    if _mixed(x, weight):  # F.rms_norm's composite formula, in fp32
        rstd = torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps)
        return (x.float() * rstd * weight.float()).to(x.dtype), rstd.reshape(-1)
    y, rstd = _native("_fused_rms_norm", x)(x, [x.shape[-1]], weight, eps)
    # (M, 1), fp32 as ATen computes it for every dtype here: .float() would be one more op call
    return y, rstd.view(-1) if rstd.dtype == torch.float32 else rstd.reshape(-1).float()


_FUSED_RMS_BWD: dict = {}  # device type -> whether ATen has a fused RMSNorm backward there


def _has_fused_rms_bwd(device: torch.device) -> bool:
    got = _FUSED_RMS_BWD.get(device.type)
    if got is None:
        key = "CUDA" if device.type == "cuda" else "CPU"
        got = _FUSED_RMS_BWD[device.type] = torch._C._dispatch_has_kernel_for_dispatch_key("aten::_fused_rms_norm_backward", key)
    return got


def rmsnorm_bwd(dy, x, weight, rstd):
    if _has_fused_rms_bwd(x.device) and not _mixed(x, weight):
        mask = [True, weight is not None]
        return _native("_fused_rms_norm_backward", x)(dy, x, [x.shape[-1]], rstd.view(-1, 1), weight, mask)
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
    if not x.is_cuda:
        # ATen's CPU kernel returns the statistics in its parameters' dtype (the contract wants
        # fp32): fp32 parameters beside 16-bit x (a weight of ones where there are none: y is the
        # same), its mixed-dtype kernel, y in x's dtype. Where a row's variance overflows it can
        # return rstd = 0 and y = bias where its narrow-row path returns NaN: NaN wherever rstd is 0
        # (only an infinite variance gives it)
        n = x.shape[-1]
        if x.dtype != torch.float32 and weight is None and bias is None:
            weight = torch.ones(n, dtype=torch.float32)
        y, mean, rstd = torch.native_layer_norm(x, [n], _f32(weight), _f32(bias), eps)
        mean, rstd = mean.view(-1), rstd.view(-1)
        if not rstd.all():
            overflow = rstd == 0
            y, rstd = y.masked_fill(overflow.unsqueeze(-1), float("nan")), rstd.masked_fill(overflow, float("nan"))
        return y, mean, rstd
    y, mean, rstd = torch.native_layer_norm(x, [x.shape[-1]], weight, bias, eps)  # aten's, bound directly
    return y, mean.reshape(-1), rstd.reshape(-1)


def _f32(t):
    return None if t is None else t.float()


def layernorm_bwd(dy, x, weight, mean, rstd):
    n = x.shape[-1]
    pdtype = weight.dtype if weight is not None else x.dtype
    if not x.is_cuda:
        # ATen's CPU backward takes the statistics in its parameters' dtype, and with fp32 ones
        # beside 16-bit x rounds dweight and dbias on the way: its fp32 kernel on fp32 copies
        # instead, the gradients rounded once to their dtypes
        dx, dw, db = aten.native_layer_norm_backward.default(
            dy.float(), x.float(), [n], mean.view(-1, 1), rstd.view(-1, 1), _f32(weight),
            torch.empty(n, dtype=torch.float32), [True, weight is not None, True],
        )  # fmt: skip
        return dx.to(x.dtype), (dw.to(pdtype) if dw is not None else None), db.to(pdtype)
    if _mixed(x, weight):
        # ATen's CUDA backward wants one dtype for x and the weight: the formula it implements, in
        # fp32, instead
        xhat = (x.float() - mean.view(-1, 1)) * rstd.view(-1, 1)
        g = dy.float() * weight.float() if weight is not None else dy.float()
        dx = rstd.view(-1, 1) * (g - xhat * (g * xhat).mean(-1, keepdim=True) - g.mean(-1, keepdim=True))
        dw = (dy.float() * xhat).sum(0).to(pdtype) if weight is not None else None
        return dx.to(x.dtype), dw, dy.float().sum(0).to(pdtype)
    # ATen only uses ``bias`` to know that dbias is wanted (and in which dtype): any (N,) tensor will do
    bias_marker = torch.empty(n, dtype=weight.dtype if weight is not None else x.dtype, device=x.device)
    return aten.native_layer_norm_backward(
        dy, x, [n], mean.view(-1, 1), rstd.view(-1, 1), weight, bias_marker, [True, weight is not None, True]
    )
