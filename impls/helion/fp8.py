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
* ``rmsnorm_fp8_block_kernel`` (group = 128) takes the rows as (M, N / 128, 128) views (a view of
  any (M, N) rows: only the last dim is split), so a 1 x 128 block is a row of the tile's last two
  dims and its amax a reduction over the last one, never crossing blocks. Whole rows in registers,
  each row is read once: rstd from the sum over both dims, then every block's amax, scale and q
  from the same tile. Where the config sets ``reduction_loops``, Helion walks the blocks in chunks
  twice: pass 1 the sum of squares (storing residual_out), pass 2 y, each block's amax and q from
  one load of the chunk, mostly from L2 (h recomputed from x and residual: reading back
  residual_out, which other threads of the program wrote, would need a barrier Helion does not
  place).

  Not a loop of ``hl.tile(n, block_size=128)`` steps after the row's sum: one [rows, 128] tile a
  step leaves a few elements per thread and a reduction across warps per block, one block after
  another, and latency rather than bandwidth sets the time (3-16% of the copy bandwidth past
  N = 2048 on an H100).

The cast is ``.to(torch.float8_e4m3fn)``: Triton's fp32 -> e4m3 conversion on a GPU (cvt.rn.satfinite
on sm_90), PyTorch's on the CPU (Helion's eager mode runs the body as PyTorch ops), both nearest
even and saturating; the clamp spells the saturation out. The clamps are written as ``torch.where``:
the same values, NaN included (a comparison with NaN is false, so NaN passes through as clamp
passes it), in a compare and a select per element, where ``torch.clamp`` lowers to Inductor's
NaN-propagating maximum and minimum, two more operations each. The scale is the amax times 1/448
(two roundings): Triton's plain fp32 division, what ``/`` generates, is an approximation of up to
2 ulps.

Configs: one per N bucket for both kernels, the entry ``configs.FP8_ENTRY`` (``configs.choose``:
configs.json where a GPU has entries for it, else ``configs.fp8_default_config``, not tuned), in
the per-token kernel's terms; the block kernel runs it with its column chunk counted in blocks
(``in_blocks``).
"""

from __future__ import annotations

import helion.language as hl
import torch

from harness.spec.fp8 import AMAX_FLOOR, E4M3_MAX, FP8_DTYPE, GROUP_BLOCK, contract_functions

from .configs import FP8_ENTRY, choose, launch
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
        amax = torch.amax(torch.abs(yf), dim=-1)
        s = torch.where(amax < AMAX_FLOOR, AMAX_FLOOR, amax) * (1.0 / E4M3_MAX)
        v = yf * (1.0 / s)[:, None]
        q[rows, :] = torch.where(v > E4M3_MAX, E4M3_MAX, torch.where(v < -E4M3_MAX, -E4M3_MAX, v)).to(FP8_DTYPE)
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
    """Rows as (M, N / 128, 128) views (x, residual, residual_out; weight (N / 128, 128)); q comes
    back in the same shape, the scales (M, N / 128)."""
    m, g, b = x.size()
    g = hl.specialize(g)
    b = hl.specialize(b)
    q = torch.empty([m, g, b], dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty([m, g], dtype=torch.float32, device=x.device)
    rstd = torch.empty([m], dtype=torch.float32, device=x.device)
    for rows in hl.tile(m):
        xf = x[rows, :, :].to(torch.float32)
        if residual is not None:
            h = (xf + residual[rows, :, :].to(torch.float32)).to(x.dtype)
            residual_out[rows, :, :] = h
            xf = h.to(torch.float32)
        rstd_rows = torch.rsqrt(torch.sum(torch.sum(xf * xf, dim=-1), dim=-1) / (g * b) + eps)
        yf = xf * rstd_rows[:, None, None]
        if weight is not None:
            yf = yf * weight[None, :, :].to(torch.float32)
        amax = torch.amax(torch.abs(yf), dim=-1)
        s = torch.where(amax < AMAX_FLOOR, AMAX_FLOOR, amax) * (1.0 / E4M3_MAX)
        v = yf * (1.0 / s)[:, :, None]
        q[rows, :, :] = torch.where(v > E4M3_MAX, E4M3_MAX, torch.where(v < -E4M3_MAX, -E4M3_MAX, v)).to(FP8_DTYPE)
        scale[rows, :] = s
        rstd[rows] = rstd_rows
    return q, scale, rstd


def config(x: torch.Tensor) -> dict:
    """The config of the FP8 entry for rows like ``x`` (configs.choose: this GPU's table bucket for
    N, else the FP8 rule), in the per-token kernel's terms."""
    return choose(FP8_ENTRY, x).config


# id of a per-token config -> (the config, its block kernel form): the pinned configs are the same
# dicts call after call, so each is translated once
_IN_BLOCKS: dict[int, tuple[dict, dict]] = {}


def in_blocks(config: dict) -> dict:
    """A per-token config for the block kernel: the same rows per program and warps, its column
    chunk (``reduction_loops``) counted in 128-column blocks, the unit of that kernel's loop."""
    hit = _IN_BLOCKS.get(id(config))
    if hit is None or hit[0] is not config:
        loops = config.get("reduction_loops")
        blocks = dict(config)
        if loops:
            blocks["reduction_loops"] = [None if c is None else max(1, c // GROUP_BLOCK) for c in loops]
        if len(_IN_BLOCKS) >= 64:  # configs made per call would pile up
            _IN_BLOCKS.clear()
        hit = _IN_BLOCKS[id(config)] = (config, blocks)
    return hit[1]


def _rows(t):
    """(M, N) rows (a per-head (T, H, N) view is copied where no such view exists)."""
    return t if t is None or t.dim() == 2 else t.reshape(-1, t.shape[-1])


def _blocks(t, n):
    """(..., N) -> (..., N / 128, 128): a view, whatever the strides."""
    return None if t is None else t.unflatten(-1, (n // GROUP_BLOCK, GROUP_BLOCK))


def _run(x, residual, weight, eps, group):
    x, residual = _rows(x), _rows(residual)
    residual_out = torch.empty_like(x) if residual is not None else None
    n = x.shape[-1]
    cfg = config(x)
    if group == n:
        q, scale, rstd = launch(rmsnorm_fp8_row_kernel, cfg, x, residual, residual_out, weight, eps)
        return q, scale, residual_out, rstd
    q, scale, rstd = launch(
        rmsnorm_fp8_block_kernel, in_blocks(cfg), *(_blocks(t, n) for t in (x, residual, residual_out, weight)), eps
    )
    return q.flatten(-2), scale, residual_out, rstd


rmsnorm_fp8_fwd, add_rmsnorm_fp8_fwd = contract_functions(_run)
