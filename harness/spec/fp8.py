"""FP8 output of the quantizing norms (``rmsnorm_fp8``, ``add_rmsnorm_fp8``): the constants of the
contract and exact float8_e4m3fn arithmetic in fp64, for the reference and the checker.

    y          = x * rstd * weight, in fp32 (never rounded to x's dtype before it is quantized)
    scale[m,g] = max(amax(|y[m, g*group : (g+1)*group]|), AMAX_FLOOR) / E4M3_MAX      fp32, (M, N / group)
    q          = e4m3fn(y / scale): round to nearest even, saturating at +-E4M3_MAX

``group`` is N (one scale per row, "per token") or ``GROUP_BLOCK`` (one per 1 x 128 block, the
blockwise FP8 GEMMs' layout; N a multiple of it). ``AMAX_FLOOR`` keeps a row (or block) of zeros
finite: its scale is AMAX_FLOOR / 448 and its q zeros, never 0 / 0. The scale is not rounded to a
power of two; ``quantize(..., pow2_scale=True)`` gives the rounding some GEMMs want (UE8M0 scales:
2^ceil(log2(scale)), so |y / scale| stays <= 448), which no op record uses yet.

float8_e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities, one NaN pattern per sign
(S.1111.111); largest finite 448 = 1.75 * 2^8; smallest normal 2^-6; subnormals k * 2^-9, k = 1..7.
Between 2^e and 2^(e+1) the values are 2^(e-3) apart (an e4m3 *step*); below 2^-6, 2^-9 apart.
"""

from __future__ import annotations

import numbers

import torch

E4M3_MAX = 448.0
# the floor of a group's amax: a zero row gets scale AMAX_FLOOR / 448 (finite) and q = 0
AMAX_FLOOR = 1e-10
# the block of the blockwise layout (DeepSeek-V3-style FP8 GEMMs): one scale per 1 x 128 elements
GROUP_BLOCK = 128
E4M3_MIN_NORMAL = 2.0**-6
E4M3_SUBNORMAL_STEP = 2.0**-9
FP8_DTYPE = torch.float8_e4m3fn


def contract_functions(launch):
    """The two contract functions of a DSL's FP8 file from its one launcher ``launch(x, residual,
    weight, eps, group) -> (q, scale, residual_out or None, rstd)``, which serves both ops."""

    def rmsnorm_fp8_fwd(x, weight, eps, group):
        q, scale, _, rstd = launch(x, None, weight, eps, group)
        return q, scale, rstd

    def add_rmsnorm_fp8_fwd(x, residual, weight, eps, group):
        return launch(x, residual, weight, eps, group)

    return rmsnorm_fp8_fwd, add_rmsnorm_fp8_fwd


def check_group(group, n: int) -> int:
    """``group``: N (one scale per row) or GROUP_BLOCK with N a multiple of it; a clear error otherwise."""
    if isinstance(group, bool) or not isinstance(group, numbers.Integral):
        raise TypeError(
            f"group must be an int (N = {n} for one scale per row, or {GROUP_BLOCK}), got {type(group).__name__}"
        )
    group = int(group)
    if group == n:
        return group
    if group != GROUP_BLOCK:
        raise ValueError(
            f"group must be N = {n} (one scale per row) or {GROUP_BLOCK} (1 x {GROUP_BLOCK} blocks), got {group}"
        )
    if n % GROUP_BLOCK:
        raise ValueError(
            f"group = {GROUP_BLOCK} needs N a multiple of {GROUP_BLOCK}; N = {n} is not (group = N: one scale per row)"
        )
    return group


def e4m3_step(a: torch.Tensor) -> torch.Tensor:
    """The spacing of e4m3fn values at magnitude ``a`` (fp64): 2^(e-3) in [2^e, 2^(e+1)), 2^-9 below
    the normals. At an exact power of two, the spacing above it."""
    a = a.abs().to(torch.float64)
    _, exp = torch.frexp(a.clamp_min(E4M3_MIN_NORMAL))  # a = m * 2^exp, m in [0.5, 1)
    return torch.ldexp(torch.ones_like(a), exp - 1 - 3)


def e4m3_round(v: torch.Tensor) -> torch.Tensor:
    """The e4m3fn value nearest each fp64 ``v`` (ties to the even mantissa), saturated at
    +-E4M3_MAX, as fp64. Exact: v / step is a scaling by a power of two, and torch.round rounds
    half to even."""
    v = v.to(torch.float64)
    step = e4m3_step(v)
    return (torch.round(v / step) * step).clamp(-E4M3_MAX, E4M3_MAX)


def groups_of(t: torch.Tensor, group: int) -> torch.Tensor:
    """(..., N) -> (..., N / group, group), a view where one exists."""
    return t.unflatten(-1, (t.shape[-1] // group, group))


def quantize(
    y: torch.Tensor, group: int, floor: float = AMAX_FLOOR, pow2_scale: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale) of the contract, exactly, in fp64: scale per group from the amax of |y|, then each
    y / scale rounded to the nearest e4m3fn value (ties to even), saturating. ``pow2_scale``: the
    scale rounded up to a power of two (not part of any op record yet)."""
    y = y.to(torch.float64)
    scale = groups_of(y, group).abs().amax(-1).clamp_min(floor) / E4M3_MAX
    if pow2_scale:
        _, exp = torch.frexp(scale)
        # a power of two already is kept; anything else goes up to the next one
        up = torch.ldexp(torch.ones_like(scale), exp)
        scale = torch.where(up / 2 == scale, scale, up)
    v = groups_of(y, group) / scale.unsqueeze(-1)
    return e4m3_round(v).flatten(-2), scale
