"""RMSNorm (and the fused residual add + RMSNorm) with FP8 output, in Helion.

Per row, in fp32 (x, residual and w converted right after loading):

    rstd  = 1 / sqrt(mean(x^2) + eps)            y = x * rstd * w       (never rounded to x's dtype)
    scale = max(amax(|y| over the group), floor) / 448     one per row (group = N) or per 1 x 128 block
    q     = e4m3fn(clamp(y / scale, -448, 448))
    add + RMSNorm   h = round_to_x_dtype(x + residual), stored (residual_out); the above on h as stored

Two kernels, one per grouping, each tiling rows:

* ``rmsnorm_fp8_row_kernel`` (group = N) reduces each whole row twice, for the sum of squares and
  for the amax of y, and writes q and one scale per row: the structure of this folder's RMSNorm
  forward, with Helion turning the row into column loops where the config sets
  ``reduction_loops`` (rows too wide for registers; then x is read again per loop, mostly from L2);
* ``rmsnorm_fp8_block_kernel`` (group = 128) reduces the whole row for rstd, then walks it in
  ``hl.tile(n, block_size=128)`` column tiles, one per block: the block's amax, scale (stored at
  the tile's index) and q. The blocks re-read x (and recompute h from x and residual: reading back
  residual_out, which other threads of the program wrote, would need a barrier Helion does not
  place), the second read mostly from L2.

The cast is ``.to(torch.float8_e4m3fn)``: Triton's fp32 -> e4m3 conversion on a GPU (cvt.rn.satfinite
on sm_90), PyTorch's on the CPU (Helion's eager mode runs the body as PyTorch ops), both nearest
even and saturating; the clamp spells the saturation out. The scale is the amax times 1/448 (two
roundings): Triton's plain fp32 division, what ``/`` generates, is an approximation of up to 2 ulps. Configs: the RMSNorm forward's fallback
rule (rows per tile from N; a reduction loop past 32768 columns), not tuned.
"""

from __future__ import annotations

import helion.language as hl
import torch

from harness.spec.fp8 import AMAX_FLOOR, E4M3_MAX, FP8_DTYPE

from .configs import launch
from .imports import kernel
from .kernels import COMPILED


@kernel(**COMPILED)
def rmsnorm_fp8_row_kernel(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    residual_out: torch.Tensor | None,
    weight: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    m, n = x.size()
    n = hl.specialize(n)
    q = torch.empty([m, n], dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty([m, 1], dtype=torch.float32, device=x.device)
    rstd = torch.empty([m], dtype=torch.float32, device=x.device)
    for rows in hl.tile(m):
        xf = x[rows, :].to(torch.float32)
        if residual is not None:
            h = (xf + residual[rows, :].to(torch.float32)).to(x.dtype)
            residual_out[rows, :] = h
            xf = h.to(torch.float32)  # the statistics of h as stored
        rstd_rows = torch.rsqrt(torch.sum(xf * xf, dim=-1) / n + eps)
        yf = xf * rstd_rows[:, None]
        if weight is not None:
            yf = yf * weight[None, :].to(torch.float32)
        s = torch.clamp_min(torch.amax(torch.abs(yf), dim=-1), AMAX_FLOOR) * (1.0 / E4M3_MAX)
        q[rows, :] = torch.clamp(yf * (1.0 / s)[:, None], -E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)
        scale[rows, 0] = s
        rstd[rows] = rstd_rows
    return q, scale, rstd


@kernel(**COMPILED)
def rmsnorm_fp8_block_kernel(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    residual_out: torch.Tensor | None,
    weight: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    m, n = x.size()
    n = hl.specialize(n)
    q = torch.empty([m, n], dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty([m, n // 128], dtype=torch.float32, device=x.device)
    rstd = torch.empty([m], dtype=torch.float32, device=x.device)
    for rows in hl.tile(m):
        xf = x[rows, :].to(torch.float32)
        if residual is not None:
            h = (xf + residual[rows, :].to(torch.float32)).to(x.dtype)
            residual_out[rows, :] = h
            xf = h.to(torch.float32)
        rstd_rows = torch.rsqrt(torch.sum(xf * xf, dim=-1) / n + eps)
        for cols in hl.tile(n, block_size=128):
            yb = x[rows, cols].to(torch.float32)
            if residual is not None:
                yb = (yb + residual[rows, cols].to(torch.float32)).to(x.dtype).to(torch.float32)
            yb = yb * rstd_rows[:, None]
            if weight is not None:
                yb = yb * weight[None, cols].to(torch.float32)
            s = torch.clamp_min(torch.amax(torch.abs(yb), dim=-1), AMAX_FLOOR) * (1.0 / E4M3_MAX)
            q[rows, cols] = torch.clamp(yb * (1.0 / s)[:, None], -E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)
            scale[rows, cols.id] = s
        rstd[rows] = rstd_rows
    return q, scale, rstd


def config(n: int) -> dict:
    """The RMSNorm forward's fallback rule (configs.default_config): whole rows in registers up to
    32768 columns, several rows a tile for short ones; past that one row a tile, in 8192-column loops."""
    width = 1 << max(0, n - 1).bit_length()
    if width <= 32768:
        rows = min(64, max(1, 4096 // width))
        return {"block_sizes": [rows], "reduction_loops": [None], "num_warps": min(16, max(4, rows * width // 512))}
    return {"block_sizes": [1], "reduction_loops": [8192], "num_warps": 16}


def _rows(t):
    """(M, N) rows (a per-head (T, H, N) view is copied where no such view exists)."""
    return t if t is None or t.dim() == 2 else t.reshape(-1, t.shape[-1])


def _run(x, residual, weight, eps, group):
    x, residual = _rows(x), _rows(residual)
    residual_out = torch.empty_like(x) if residual is not None else None
    kern = rmsnorm_fp8_row_kernel if group == x.shape[-1] else rmsnorm_fp8_block_kernel
    q, scale, rstd = launch(kern, config(x.shape[-1]), x, residual, residual_out, weight, eps)
    return q, scale, residual_out, rstd


def rmsnorm_fp8_fwd(x, weight, eps, group):
    q, scale, _, rstd = _run(x, None, weight, eps, group)
    return q, scale, rstd


def add_rmsnorm_fp8_fwd(x, residual, weight, eps, group):
    return _run(x, residual, weight, eps, group)
