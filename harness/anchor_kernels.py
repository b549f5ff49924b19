"""Contract wrappers around the external baselines (imported only when one is used).

Quack 0.6.5: ``quack.rmsnorm.rmsnorm_fwd/rmsnorm_bwd`` (its backward autotunes on first use: that
lands in compile_s, not in the timing), ``layernorm_fwd/layernorm_bwd`` which take fp32 weight and
bias, so those are upcast per call (N elements). Liger-Kernel 0.8.5: the functional forward and
backward behind ``LigerRMSNormFunction`` (its default "llama" casting mode, backward not in place)
and ``LigerLayerNormFunction``. Neither library is ours; every table marks them external.
"""

from types import SimpleNamespace

import torch


def quack():
    import importlib

    # ``quack.rmsnorm`` is also a function re-exported by the package: import the module by name
    q = importlib.import_module("quack.rmsnorm")

    def rmsnorm_fwd(x, weight, eps):
        y, _, rstd = q.rmsnorm_fwd(x, weight, eps=eps, store_rstd=True)
        return y, rstd

    def rmsnorm_bwd(dy, x, weight, rstd):
        dx, dw, _, _ = q.rmsnorm_bwd(x, weight, dy, rstd)
        return dx, dw

    def layernorm_fwd(x, weight, bias, eps):
        b = bias.float() if bias is not None else None
        y, rstd, mean = q.layernorm_fwd(x, weight.float(), b, eps=eps, return_rstd=True, return_mean=True)
        return y, mean, rstd

    def layernorm_bwd(dy, x, weight, mean, rstd):
        dx, dw, db = q.layernorm_bwd(x, weight, dy, rstd, mean, has_bias=True)
        return dx, dw.to(x.dtype), db.to(x.dtype)

    return SimpleNamespace(rmsnorm_fwd=rmsnorm_fwd, rmsnorm_bwd=rmsnorm_bwd, layernorm_fwd=layernorm_fwd, layernorm_bwd=layernorm_bwd)


def liger():
    from liger_kernel.ops import layer_norm as ln
    from liger_kernel.ops import rms_norm as rn
    from liger_kernel.ops.utils import calculate_settings

    def rmsnorm_fwd(x, weight, eps):
        y, _, rstd, _, _, _ = rn.rms_norm_forward(x, weight, eps, 0.0, "llama", None)
        return y, rstd

    def rmsnorm_bwd(dy, x, weight, rstd):
        block, warps = calculate_settings(x.shape[-1])
        return rn.rms_norm_backward(dy, x, weight, rstd, 0.0, "llama", block, warps, False, None)

    def layernorm_fwd(x, weight, bias, eps):
        b = bias if bias is not None else torch.zeros_like(weight)
        y, _, mean, rstd, _, _ = ln.layer_norm_forward(x, weight, b, eps)
        return y, mean, rstd

    def layernorm_bwd(dy, x, weight, mean, rstd):
        # Liger reads only the bias's dtype here
        return ln.layer_norm_backward(dy, x, weight, weight, mean, rstd)

    return SimpleNamespace(rmsnorm_fwd=rmsnorm_fwd, rmsnorm_bwd=rmsnorm_bwd, layernorm_fwd=layernorm_fwd, layernorm_bwd=layernorm_bwd)
