"""A test-only implementation of every op (add_rmsnorm included), in plain fp32 torch formulas, that
counts its calls: the tests register it with the autograd layer to prove which kernels a module, a
compiled model or a CUDA graph actually runs. Not in ``impls/``: the registry never sees it."""

from collections import Counter

from harness.spec.contract import Implementation
from impls.compile.kernels import _ln_bwd, _ln_fwd, _rms_bwd, _rms_fwd

CALLS: Counter = Counter()

RECORD = Implementation(
    name="test-counting",
    dsl="eager",
    entry="tests.counting_impl",
    description="test-only: fp32 torch formulas that count their calls",
    ops=("rmsnorm", "layernorm", "add_rmsnorm"),
    devices=("cpu", "cuda"),
)


def _param_dtype(out, weight):
    # dweight / dbias in the weight's dtype, as the contract asks (the formulas give x's)
    return tuple(t.to(weight.dtype) if weight is not None and t is not None and t.dim() == 1 else t for t in out)


def rmsnorm_fwd(x, weight, eps):
    CALLS["rmsnorm_fwd"] += 1
    return _rms_fwd(x, weight, eps)


def rmsnorm_bwd(dy, x, weight, rstd):
    CALLS["rmsnorm_bwd"] += 1
    return _param_dtype(_rms_bwd(dy, x, weight, rstd), weight)


def layernorm_fwd(x, weight, bias, eps):
    CALLS["layernorm_fwd"] += 1
    return _ln_fwd(x, weight, bias, eps)


def layernorm_bwd(dy, x, weight, mean, rstd):
    CALLS["layernorm_bwd"] += 1
    return _param_dtype(_ln_bwd(dy, x, weight, mean, rstd), weight)


def add_rmsnorm_fwd(x, residual, weight, eps):
    CALLS["add_rmsnorm_fwd"] += 1
    h = (x.float() + residual.float()).to(x.dtype)
    y, rstd = _rms_fwd(h, weight, eps)
    return y, h, rstd


def add_rmsnorm_bwd(dy, dresidual_out, residual_out, weight, rstd):
    CALLS["add_rmsnorm_bwd"] += 1
    # in fp32 throughout, rounded once: dh = dx + dresidual_out
    dh, dw = _param_dtype(_rms_bwd(dy.float(), residual_out.float(), weight, rstd), weight)
    if dresidual_out is not None:
        dh = dh + dresidual_out.float()
    return dh.to(residual_out.dtype), dw
