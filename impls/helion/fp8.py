"""RMSNorm (and the fused residual add + RMSNorm) with FP8 output, in Helion.

Per row, in fp32 (x, residual and w converted right after loading):

    rstd  = 1 / sqrt(mean(x^2) + eps)            y = x * rstd * w       (never rounded to x's dtype)
    scale = max(amax(|y| over the group), floor) / 448     one per row (group = N) or per 1 x 128 block
    q     = e4m3fn(clamp(y / scale, -448, 448))
    add + RMSNorm   h = round_to_x_dtype(x + residual), stored (residual_out); the above on h as stored

Two kernels, one per grouping, each tiling rows (and a twin of each over per-head views, below):

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

The kernels share their arithmetic: ``_loaded`` (x in fp32, or h stored and taken as stored),
``_normalized`` (rstd and x * rstd over a row's one or two dims) and ``_quantized`` (each group's
scale and q) are plain functions that Helion traces into each kernel (their constants, 1/448 among
them, become fp32 literals). The weight is applied in each kernel's body: inside such a function
Helion takes ``weight[None, :]`` (no tile in the index) for a view, which it cannot lower.

Per-head views (``row_views``): q and k of a fused QKV projection are (T, H, N) views whose token
stride spans all the projection's heads, so no (M, N) view of their rows exists, and flattening one
copies it (with the copy, these ops ran at 28-33% of the copy bandwidth on an H100, against
90-98% on the same shapes contiguous).
``rmsnorm_fp8_row_heads`` and ``rmsnorm_fp8_block_heads`` are the two kernels over such rows, as
kernels.py's ``*_fwd_heads`` are RMSNorm's: they tile tokens and heads and read x and residual in
place, every tensor through its own strides (residual may be a view too, or contiguous); the block
kernel takes (T, H, N / 128, 128) views, the same split of the last dim. q and residual_out come
back (T, H, N), contiguous; the scales and rstd as (M, ...) rows. Rows too wide for registers need
no copy either: there is no separate wide-row kernel, only ``reduction_loops``, which the kernels
over heads take as the row kernels do (the norms copy per-head views only for their split
backward).

Configs: one per N bucket for all four kernels, the entry ``configs.FP8_ENTRY`` (``configs.choose``:
configs.json where a GPU has entries for it, else ``configs.fp8_default_config``, not tuned), in
the per-token kernel's terms; ``kernel_config`` gives the others theirs: the block kernels count
the column chunk in blocks (``in_blocks``), the kernels over heads spread the rows per program over
tokens and heads by the RMSNorm forward's rule (``configs.heads_config``).
"""

from __future__ import annotations

import helion.language as hl
import torch

from harness.spec.fp8 import AMAX_FLOOR, E4M3_MAX, FP8_DTYPE, GROUP_BLOCK, contract_functions

from .configs import FP8_ENTRY, Pinned, choose, heads_config, launch
from .imports import kernel
from .kernels import COMPILED


def _loaded(x, residual, residual_out, index):
    """x's rows at ``index`` in fp32; with a residual, h = x + residual rounded to x's dtype, stored
    in residual_out and returned in fp32 (the statistics are those of h as stored)."""
    xf = x[index].to(torch.float32)
    if residual is not None:
        h = (xf + residual[index].to(torch.float32)).to(x.dtype)
        residual_out[index] = h
        xf = h.to(torch.float32)
    return xf


def _normalized(xf, eps: float, n: int, lead: int):
    """(y before the weight, rstd) of the fp32 rows ``xf``: its first ``lead`` dims index rows, the
    others hold a row of ``n`` elements (the true length: ``xf``'s may be padded to a power of two).
    Broadcasts are spelled ``unsqueeze``: Helion cannot lower a ``[:, None]`` outside a kernel's body."""
    row = xf.dim() - lead
    sq = xf * xf
    for _ in range(row):
        sq = torch.sum(sq, dim=-1)
    rstd = torch.rsqrt(sq / n + eps)
    spread = rstd
    for _ in range(row):
        spread = spread.unsqueeze(-1)
    return xf * spread, rstd


def _quantized(yf):
    """(q, scale) of fp32 y whose last dim is one group."""
    amax = torch.amax(torch.abs(yf), dim=-1)
    s = torch.where(amax < AMAX_FLOOR, AMAX_FLOOR, amax) * (1.0 / E4M3_MAX)
    v = yf * torch.reciprocal(s).unsqueeze(-1)
    return torch.where(v > E4M3_MAX, E4M3_MAX, torch.where(v < -E4M3_MAX, -E4M3_MAX, v)).to(FP8_DTYPE), s


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
        xf = _loaded(x, residual, residual_out, (rows, slice(None)))
        yf, rstd_rows = _normalized(xf, eps, n, 1)
        if weight is not None:
            yf = yf * weight[None, :].to(torch.float32)
        q_rows, s = _quantized(yf)
        q[rows, :] = q_rows
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
        xf = _loaded(x, residual, residual_out, (rows, slice(None), slice(None)))
        yf, rstd_rows = _normalized(xf, eps, g * b, 1)
        if weight is not None:
            yf = yf * weight[None, :, :].to(torch.float32)
        q_rows, s = _quantized(yf)
        q[rows, :, :] = q_rows
        scale[rows, :] = s
        rstd[rows] = rstd_rows
    return q, scale, rstd


@kernel(**COMPILED)
def rmsnorm_fp8_row_heads(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    residual_out: torch.Tensor | None,
    weight: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """rmsnorm_fp8_row_kernel over (T, H, N) rows, tiled over tokens and heads; q and residual_out
    come back (T, H, N), the scales (T, H, 1), rstd (T, H)."""
    t, h, n = x.size()
    n = hl.specialize(n)
    q = torch.empty([t, h, n], dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty([t, h, 1], dtype=torch.float32, device=x.device)
    rstd = torch.empty([t, h], dtype=torch.float32, device=x.device)
    for tokens, heads in hl.tile([t, h]):
        xf = _loaded(x, residual, residual_out, (tokens, heads, slice(None)))
        yf, rstd_rows = _normalized(xf, eps, n, 2)
        if weight is not None:
            yf = yf * weight[None, None, :].to(torch.float32)
        q_rows, s = _quantized(yf)
        q[tokens, heads, :] = q_rows
        scale[tokens, heads, 0] = s
        rstd[tokens, heads] = rstd_rows
    return q, scale, rstd


@kernel(**COMPILED)
def rmsnorm_fp8_block_heads(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    residual_out: torch.Tensor | None,
    weight: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """rmsnorm_fp8_block_kernel over (T, H, N / 128, 128) views of (T, H, N) rows, tiled over tokens
    and heads; q comes back in the same shape, the scales (T, H, N / 128), rstd (T, H)."""
    t, h, g, b = x.size()
    g = hl.specialize(g)
    b = hl.specialize(b)
    q = torch.empty([t, h, g, b], dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty([t, h, g], dtype=torch.float32, device=x.device)
    rstd = torch.empty([t, h], dtype=torch.float32, device=x.device)
    for tokens, heads in hl.tile([t, h]):
        xf = _loaded(x, residual, residual_out, (tokens, heads, slice(None), slice(None)))
        yf, rstd_rows = _normalized(xf, eps, g * b, 2)
        if weight is not None:
            yf = yf * weight[None, None, :, :].to(torch.float32)
        q_rows, s = _quantized(yf)
        q[tokens, heads, :, :] = q_rows
        scale[tokens, heads, :] = s
        rstd[tokens, heads] = rstd_rows
    return q, scale, rstd


# (per-head view, 1 x 128 blocks) -> the kernel
KERNELS = {
    (False, False): rmsnorm_fp8_row_kernel,
    (False, True): rmsnorm_fp8_block_kernel,
    (True, False): rmsnorm_fp8_row_heads,
    (True, True): rmsnorm_fp8_block_heads,
}


def config(x: torch.Tensor) -> dict:
    """The config of the FP8 entry for rows like ``x`` (configs.choose: this GPU's table bucket for
    N, else the FP8 rule), in the per-token kernel's terms."""
    return choose(FP8_ENTRY, x).config


def in_blocks(config: dict) -> dict:
    """A per-token config for the block kernels: the same rows per program and warps, its column
    chunk (``reduction_loops``) counted in 128-column blocks, the unit of those kernels' loop."""
    loops = config.get("reduction_loops")
    blocks = dict(config)
    if loops:
        blocks["reduction_loops"] = [None if c is None else max(1, c // GROUP_BLOCK) for c in loops]
    return blocks


# (id of a per-token config, H or None, blocks) -> (the config, the form the kernel runs): the
# pinned configs are the same dicts call after call, so each is translated once per kernel
_FORMS: dict[tuple, tuple[dict, dict]] = {}


def kernel_config(config: dict, heads: int | None, blocks: bool) -> dict:
    """A per-token config in the terms of the kernel that runs: over tokens and heads (``heads``: H;
    None: (M, N) rows), its rows per program spread over them by the RMSNorm forward's rule
    (``configs.heads_config``); for the block kernels, ``in_blocks``."""
    key = (id(config), heads, blocks)
    hit = _FORMS.get(key)
    if hit is None or hit[0] is not config:
        form = config if heads is None else heads_config(Pinned("rmsnorm_fwd_kernel", config), heads)
        if len(_FORMS) >= 64:  # configs made per call would pile up
            _FORMS.clear()
        hit = _FORMS[key] = (config, in_blocks(form) if blocks else form)
    return hit[1]


def _blocks(t, n):
    """(..., N) -> (..., N / 128, 128): a view, whatever the strides."""
    return None if t is None else t.unflatten(-1, (n // GROUP_BLOCK, GROUP_BLOCK))


def _run(x, residual, weight, eps, group):
    n = x.shape[-1]
    heads = x.shape[1] if x.dim() == 3 else None  # a per-head (T, H, N) view, read in place
    blocks = group != n
    residual_out = None if residual is None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    args = (x, residual, residual_out, weight)
    if blocks:
        args = tuple(_blocks(t, n) for t in args)
    q, scale, rstd = launch(KERNELS[heads is not None, blocks], kernel_config(config(x), heads, blocks), *args, eps)
    if blocks:
        q = q.flatten(-2)
    if heads is not None:  # the scales and rstd as (M, ...) rows
        scale, rstd = scale.flatten(0, 1), rstd.flatten()
    return q, scale, residual_out, rstd


rmsnorm_fp8_fwd, add_rmsnorm_fp8_fwd = contract_functions(_run)
