"""Pass/fail criterion, as data.

An element passes when   |out - ref| <= max(ulps * ulp(ref), rtol * |ref|) + floor * rms(ref row) + tiny
where ulp() is the spacing of the output dtype at the reference value and rms(ref row) is the RMS of
the reference over the element's row (over the whole vector for dweight, dbias and statistics).
For results that can cancel, the floor is relative to the size of their terms instead: the row RMS
of rstd * dy * w for dx, and the RMS of the column L2 norms of dy * x * rstd (dweight) and dy (dbias).

Why these numbers: a kernel that accumulates in fp32 and rounds once is within 0.5 ulp of the fp64
reference, plus a double rounding where it rounds x*rstd before multiplying by w (PyTorch eager does):
2 ulps covers both. The floor covers cancellation in dx = rstd * (g - xhat*c), where a result far
below its terms (N = 1 gives dx ~ eps) carries fp32 error of the terms' size. fp32 outputs (and the fp32 statistics)
are bounded by accumulation error over up to 2^18 elements, not by rounding: hence an rtol. A kernel
that accumulates dweight in bf16 is off by ~10% of the vector's RMS at M = 8192: rejected by far.

Bias: a tensor passes only if its errors average out. Every element within 2 ulps still lets a kernel
scale its output by 1.005 (a wrong constant, an eps added twice): each element moves by less than
its tolerance, all in the same direction. So the checker also takes the mean signed error over the
tensor, in units of each element's allowed error, once signed by the reference (positive: too large
in magnitude: a scale bias) and once plain (an offset), and holds both to
``BIAS_Z * standard error + Tol.bias``. Round-to-nearest gives zero-mean errors, so the bound is the
sampling noise of that mean (the standard error, from 8 rows on taken over rows as well: a row's
elements share one rstd, whose fp32 error moves the whole row; from 8 columns on over columns too,
whose elements share a weight and a bias; rows narrower than ``BIAS_MIN_COLUMNS`` are not held to
it, their few distinct values being no sample) plus a floor for the tiny biases an
honest kernel does have (an approximate rsqrt on a GPU: ~1e-7 relative, 0.002 of a bf16 ulp). The exception is
declared, not tolerated silently: Triton's CPU interpreter converts fp32 to bf16 by truncation
(toward zero), so its bf16 outputs carry up to half an ulp of bias toward zero that a GPU's
round-to-nearest does not (``TOWARD_ZERO_ULPS``), allowed in that direction only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tol:
    ulps: float
    rtol: float
    floor: float
    # the largest mean signed error, in units of the allowed error, beyond the sampling noise
    bias: float = 0.02


# keyed by the dtype of the tensor being checked (statistics are always fp32)
TOLERANCES: dict[torch.dtype, Tol] = {
    torch.bfloat16: Tol(ulps=2, rtol=0.0, floor=2**-9, bias=0.02),
    torch.float16: Tol(ulps=2, rtol=0.0, floor=2**-12, bias=0.02),
    torch.float32: Tol(ulps=0, rtol=1e-4, floor=2**-16, bias=0.02),
}
# standard errors a mean signed error may lie from zero by chance: checks run ~10^4 tensors, and at
# 6 a Gaussian mean strays that far once in 5e8
BIAS_Z = 6.0
# the fewest elements a mean signed error is held to: the spread of fewer is too noisy a standard
# error (the rstd of 2 rows of 2^17 elements summed in order: each off by ~1e-5, the same sign by chance)
BIAS_MIN_ELEMENTS = 16
# rows narrower than this are not held to the bias bound: their outputs take a few values set by the
# parameters (LayerNorm gives y = bias at N = 1 and +-weight + bias at N = 2 in every row; RMSNorm
# +-weight at N = 1), one rounding each, not a sample
BIAS_MIN_COLUMNS = 3
# bias toward zero of a conversion by truncation (Triton's CPU interpreter, fp32 -> bf16), in ulps
TOWARD_ZERO_ULPS = 0.5


def ulp(ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of ``dtype`` at each (fp64) reference value; subnormal spacing below the normals."""
    fi = torch.finfo(dtype)
    a = ref.abs().clamp_min(fi.tiny)
    return torch.exp2(torch.floor(torch.log2(a))) * fi.eps


def row_rms(ref: torch.Tensor) -> torch.Tensor:
    if ref.dim() <= 1:
        return ref.square().mean().sqrt().expand_as(ref) if ref.numel() else ref
    return ref.square().mean(-1, keepdim=True).sqrt().expand_as(ref)


def allowed_error(ref: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None = None) -> torch.Tensor:
    """``scale``: the magnitude of the terms the result is computed from, where that exceeds the
    result (dx's terms are rstd * dy * w); the floor is taken relative to its row RMS."""
    t = TOLERANCES[dtype]
    fi = torch.finfo(dtype)
    rel = torch.maximum(t.ulps * ulp(ref, dtype), t.rtol * ref.abs())
    return rel + t.floor * row_rms(ref if scale is None else scale) + fi.tiny


# FP8 ops (harness.spec.fp8): scale and q are held to what the implementation's own statistics give
# (rstd, and residual_out for add + RMSNorm, each checked above against fp64): y = residual_out * rstd
# * w in fp64, its exact group amax and scale, and y / scale rounded exactly. An fp32 rstd's
# accumulation error moves a whole row's y and scale together and cancels in y / scale, so it is not
# counted twice; what is left is fp32 rounding:
# * scale within SCALE_ULPS ulps of fp32 plus SCALE_REL relative: the roundings of the fp32 y whose
#   amax it is (x * rstd, * w), of 1/448 where a kernel multiplies by it, and of the scale itself;
# * q the exact e4m3fn value of y / scale (ties to even, saturating), except where y / scale lies
#   within Q_BAND_REL (relative) of a rounding boundary, where the neighbour on the other side passes
#   too (fp32's y / scale may fall either side): at most one e4m3 step, counted and reported;
# * the dequantized q * scale within half an e4m3 step (at the reference's scale) of the fp64 y, plus
#   the fp32 statistic's tolerance (rtol above) and Q_BAND_REL.
# An implementation that declares ``rounds_before_quantizing`` (the unfused passes: y stored in x's
# dtype, then its amax, the division and the cast) is allowed that one rounding on top, as the
# x dtype's tolerance above (2 ulps of bf16: 2^-6 relative), on scale, q's band and q * scale.
SCALE_ULPS = 1.0
SCALE_REL = 2.0**-22
Q_BAND_REL = 2.0**-20


def rounding_allowance(dtype: torch.dtype) -> float:
    """The relative error of a y rounded to ``dtype`` (``rounds_before_quantizing``): the dtype's
    tolerance at the bottom of a binade, its worst place."""
    t = TOLERANCES[dtype]
    return max(t.ulps * torch.finfo(dtype).eps, t.rtol)
