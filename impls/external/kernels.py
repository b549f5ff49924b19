"""Contract wrappers around the external baselines (imported only when one is used).

Quack 0.6.5: ``quack.rmsnorm.rmsnorm_fwd/rmsnorm_bwd`` (its backward autotunes on first use: that
lands in compile_s, not in the timing), ``layernorm_fwd/layernorm_bwd`` which take fp32 weight and
bias, so those are upcast per call (N elements). Liger-Kernel 0.8.5: the functional forward and
backward behind ``LigerRMSNormFunction`` (its default "llama" casting mode, backward not in place)
and ``LigerLayerNormFunction``. Neither library is ours; every table marks them external.

add_rmsnorm: Quack's residual path (what ``quack.rmsnorm(x, w, residual=r, prenorm=True)`` runs:
``rmsnorm_fwd(..., residual=)`` returning residual_out, ``rmsnorm_bwd(..., dresidual_out)`` adding
it into dx) normalises the fp32 sum x + residual before rounding it, where the contract (and the
unfused model) normalises residual_out as stored: it is checked against the same reference, and
where the difference exceeds the tolerance (rstd at small N, in 16-bit x) it fails and is never
ranked. Liger's ``LigerFusedAddRMSNormFunction`` (functional forward and backward, "llama" casting,
``in_place=False``) rounds the sum first. Both take fp32 weights beside 16-bit x; Liger's backward
needs a dresidual_out tensor, so a None one is passed as zeros.
"""

import inspect
from types import SimpleNamespace

import torch


def _with_row_mode(fn, *args):
    """Liger's functional entry points gained a trailing ``row_mode`` argument in later releases."""
    if "row_mode" in inspect.signature(fn).parameters:
        return fn(*args, None)
    return fn(*args)


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
        return dx, dw.to(weight.dtype), db.to(weight.dtype)

    def add_rmsnorm_fwd(x, residual, weight, eps):
        return q.rmsnorm_fwd(x, weight, residual=residual, eps=eps, store_rstd=True)

    def add_rmsnorm_bwd(dy, dresidual_out, residual_out, weight, rstd):
        dh, dw, _, _ = q.rmsnorm_bwd(residual_out, weight, dy, rstd, dresidual_out, has_residual=True)
        return dh, dw

    return SimpleNamespace(rmsnorm_fwd=rmsnorm_fwd, rmsnorm_bwd=rmsnorm_bwd, layernorm_fwd=layernorm_fwd, layernorm_bwd=layernorm_bwd,
                           add_rmsnorm_fwd=add_rmsnorm_fwd, add_rmsnorm_bwd=add_rmsnorm_bwd)  # fmt: skip


def liger():
    from liger_kernel.ops import fused_add_rms_norm as fa
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

    def add_rmsnorm_fwd(x, residual, weight, eps):
        # its forward views the rows as (-1, N): a column slice arrives copied
        # returns (Y, S, RSTD, BLOCK_SIZE, num_warps, num_stages, casting_mode) in 0.8.5
        y, h, rstd, *_ = _with_row_mode(fa.fused_add_rms_norm_forward, x.contiguous(), residual.contiguous(), weight, eps, 0.0, "llama")
        return y, h, rstd

    def add_rmsnorm_bwd(dy, dresidual_out, residual_out, weight, rstd):
        block, warps = calculate_settings(residual_out.shape[-1])
        dres = torch.zeros_like(dy) if dresidual_out is None else dresidual_out.contiguous()
        # (dY, dS_out, S, W, RSTD, offset, casting_mode, BLOCK_SIZE, num_warps, num_stages, in_place):
        # num_stages 2, as its forward picks
        dh, _, dw = _with_row_mode(fa.fused_add_rms_norm_backward, dy.contiguous(), dres, residual_out.contiguous(), weight, rstd, 0.0,
                                   fa._str_to_casting_mode["llama"], block, warps, 2, False)  # fmt: skip
        return dh, dw

    return SimpleNamespace(rmsnorm_fwd=rmsnorm_fwd, rmsnorm_bwd=rmsnorm_bwd, layernorm_fwd=layernorm_fwd, layernorm_bwd=layernorm_bwd,
                           add_rmsnorm_fwd=add_rmsnorm_fwd, add_rmsnorm_bwd=add_rmsnorm_bwd)  # fmt: skip
