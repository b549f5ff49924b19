"""torch.compile of the FP8 ops' fp32 formula: what Inductor makes of norm, amax, divide and cast.

    rstd  = 1/sqrt(mean(x^2) + eps)          y = x * rstd * w      (fp32, never rounded to x's dtype)
    scale = max(amax(|y| per group), floor) / 448                  (M, N / group), fp32
    q     = e4m3fn(clamp(y / scale, -448, 448))

    Add + RMSNorm  h = x + residual (rounded to x's dtype: residual_out), then the above on h

One graph per function, as this folder's kernels.py compiles the norms (a private copy per shape,
strides, dtypes and group; eps a 0-d tensor input): Inductor sees the reduction, the group amax and
the cast together and may fuse them into one pass over x. The clamp is the contract's saturation
spelled out: the cast itself saturates in torch and in Triton's conversion on a GPU (cvt.rn.satfinite),
but a backend that does not would turn fp32's 448.00003 into NaN. The add's rounding to x's dtype is
part of the contract, so that graph asks Inductor to emulate precision casts (kernels.EXACT_CASTS).
"""

import torch

from harness.spec.fp8 import AMAX_FLOOR, E4M3_MAX, FP8_DTYPE
from impls.compile import kernels


def _quantize(y, group):
    yg = y.unflatten(-1, (y.shape[-1] // group, group))
    # times 1/448 (two roundings): a division by a constant may be an approximate one in generated code
    scale = yg.abs().amax(-1).clamp_min(AMAX_FLOOR) * (1.0 / E4M3_MAX)
    q = (yg / scale.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)
    return q.flatten(-2), scale


def _rms_fp8(x, w, eps, group):
    xf = x.float()
    rstd = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    y = xf * rstd
    if w is not None:
        y = y * w.float()
    q, scale = _quantize(y, group)
    return q, scale, rstd.squeeze(-1)


def _add_rms_fp8(x, residual, w, eps, group):
    h = (x.float() + residual.float()).to(x.dtype)
    q, scale, rstd = _rms_fp8(h, w, eps, group)
    return q, scale, h, rstd


FORMULAS = {"rmsnorm_fp8_fwd": _rms_fp8, "add_rmsnorm_fp8_fwd": _add_rms_fp8}
# the residual_out rounding must survive Inductor (see kernels.EXACT_CASTS)
EXACT_CASTS = ("add_rmsnorm_fp8_fwd",)


class _Compiled(kernels._Compiled):
    """The FP8 contract functions, compiled as kernels.py compiles the norms, one copy per group too."""

    FORMULAS = FORMULAS
    EXACT_CASTS = EXACT_CASTS

    def rmsnorm_fp8_fwd(self, x, weight, eps, group):
        return self._run("rmsnorm_fp8_fwd", x, weight, self._eps_tensor(eps, x.device), static=(group,))

    def add_rmsnorm_fp8_fwd(self, x, residual, weight, eps, group):
        return self._run("add_rmsnorm_fp8_fwd", x, residual, weight, self._eps_tensor(eps, x.device), static=(group,))


def make(mode: str = "default", backend: str = "inductor") -> _Compiled:
    return _Compiled(mode, backend)
