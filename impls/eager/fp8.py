"""PyTorch eager FP8 output: the unfused passes a model runs without a fused kernel, the baseline of
the FP8 ops' speedups.

    y      = rmsnorm(x) in x's dtype           ATen's fused RMSNorm (this folder's rmsnorm_fwd): x read, y written
    amax   = max |y| per group                 y read
    scale  = max(amax, floor) / 448            (M, N / group), fp32
    q      = e4m3fn(y / scale)                 y read, q written (the division and the cast fuse in
                                               one elementwise kernel only under torch.compile)

Add + RMSNorm adds first (``h = x + residual``, one elementwise kernel, as add_rmsnorm_fwd does).
y is stored in x's dtype between the passes, as the unfused model stores it: its amax is that of the
rounded y, the rounding a fused kernel saves; the record declares it (``rounds_before_quantizing``),
the only implementation the checker allows it. The cast is torch's: round to nearest even, and,
since |y / scale| <= 448 up to fp32's rounding of the division, never past 448 (torch saturates
there too); no clamp pass is needed.
"""

from harness.spec.fp8 import AMAX_FLOOR, E4M3_MAX, FP8_DTYPE, groups_of
from impls.eager.kernels import add_rmsnorm_fwd, rmsnorm_fwd


def _quantize(y, group):
    yg = groups_of(y, group)
    scale = yg.abs().amax(-1).float().clamp_min(AMAX_FLOOR) / E4M3_MAX
    q = (yg.float() / scale.unsqueeze(-1)).to(FP8_DTYPE)
    return q.flatten(-2), scale


def rmsnorm_fp8_fwd(x, weight, eps, group):
    y, rstd = rmsnorm_fwd(x, weight, eps)
    q, scale = _quantize(y, group)
    return q, scale, rstd


def add_rmsnorm_fp8_fwd(x, residual, weight, eps, group):
    y, h, rstd = add_rmsnorm_fwd(x, residual, weight, eps)
    q, scale = _quantize(y, group)
    return q, scale, h, rstd
