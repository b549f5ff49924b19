"""RMSNorm, add + RMSNorm and LayerNorm, forward and backward, in Helion: tile-first kernels, one
helion.Config pinned per GPU and row length (``configs.py``).

Per row x of length N, all arithmetic in fp32, y and dx rounded once to x's dtype, rstd and mean
stored in fp32, one per row:

    RMSNorm    rstd = 1 / sqrt(mean(x^2) + eps)                           xhat = x * rstd
    LayerNorm  mean = mean(x),  rstd = 1 / sqrt(mean((x - mean)^2) + eps)   xhat = (x - mean) * rstd
    forward    y = xhat * w (+ b)
    backward   g = dy * w
               dx = rstd * (g - xhat * mean(g * xhat) - mean(g))      (mean(g): LayerNorm only)
               dw = sum over rows of dy * xhat,   db = sum over rows of dy
    add + RMSNorm  h = round(x + residual), stored as residual_out (x's dtype);  y = rmsnorm(h)
                   backward: dh = rmsnorm's dx (on h) + dresidual_out, added in fp32, rounded once

The fused add is the RMSNorm kernels with one more optional tensor each. The forward kernel takes
``residual`` and the buffer ``residual_out`` (both None for plain RMSNorm; Helion specializes on
None, so each variant is its own binary with no dead code), the backward kernels take
``dresidual`` (None: no add). The buffer is allocated by the caller rather than in the kernel so
that the kernel's host code has no branch on the arguments. The fused op runs rmsnorm's pinned
config for the same N (there is no table of its own): the kernels, block shapes and loops are
those of rmsnorm; only the number of rows read differs.

The sum is rounded to x's dtype before the statistics because the unfused pair (a residual add,
then RMSNorm) normalises the tensor it stored: computing rstd from the fp32 sum would give a y that
differs from the unfused model's by up to an ulp of the sum.

LayerNorm's variance is the mean of the centred squares, two passes over the row, never
E[x^2] - mean^2, which cancels in fp32 when |mean| >> std.

Weights and bias may be fp32 beside 16-bit x (mixed precision): they are loaded in their own dtype
and converted to fp32 in registers like everything else; Helion binds one more specialization per
weight dtype. dweight and dbias are reduced in fp32 and returned in the weight's dtype (x's when
there is none).

Statistics that overflow give NaN, never a finite wrong value. A row whose sum of squares (RMSNorm:
rms(x) above about 1.8e19 / sqrt(N), representable in bf16 and fp32) or squared deviations
(LayerNorm: values near 1e30, or a mean that overflows) overflows fp32 gets rstd = NaN, hence
y = NaN, and NaN flows into dx through rstd. The alternative, rsqrt(inf) = 0, would return y = 0
or the bias, a finite wrong number: torch's layer_norm returns NaN there, and LayerNorm here
matches it; torch.nn.functional.rms_norm returns 0, which RMSNorm here does not copy.

The forward tiles rows and reduces each full row; Helion turns the row into a loop over column
chunks when the config sets ``reduction_loops`` (rows that do not fit in registers). In that looped
form the normalising loop reads the row again (x, and for add_rmsnorm x and residual, recomputing h
rather than reading back residual_out, which other threads of the program wrote), as the plain
RMSNorm re-reads x: the same single-program-per-row structure, with the second read mostly from L2.

The backward comes in two shapes; the pinned config says which one a row length uses:

* ``*_bwd_resident``, for rows that fit in registers (N <= 16384): each program owns a block of
  rows and walks it a few rows at a time with whole rows in registers (x and dy are read once),
  accumulating dw (and db) over the block in fp32 registers; it writes one fp32 partial row each
  at the end.
* split, for wider rows, where a program cannot hold both a row and an N-wide dw accumulator:
  ``*_bwd_row_sums`` computes the row means (mean(g * xhat), and LayerNorm's mean(g)) for every
  row (a row reduction, like the forward), then ``*_bwd_split`` tiles the matrix in [rows x
  columns] blocks, each program walking its block's rows for dx and accumulating dw (and db) over
  them for its columns only. x and dy are read twice; the 2-D grid keeps the GPU busy however few
  the rows, and the partials stay small. dresidual is read by the second kernel only, where dx is
  formed.

* ``*_bwd_heads``, the resident backward over (T, H, N) rows, tiled over tokens and heads, whose
  dw (and db) accumulate per row of the step ([tokens, heads, N] in fp32 registers) and are
  summed over the rows once per program. The small rows' configs pin it (an (M, N) matrix runs as
  (M, 1, N)): the resident kernel's sum over the step's rows every step is a reduction across
  warps through shared memory, which for rows of 64-512 elements costs more than the step's loads.

Either way the fp32 partial rows are summed after the kernel in fp32 and cast once: deterministic,
no atomics.

Per-head views (``row_views``): q and k of a fused QKV projection are (T, H, N) views whose token
stride spans all P heads, so no (M, N) view of their rows exists. The kernels ``*_fwd_heads`` and
``*_bwd_heads`` tile such a tensor over its two leading dims, each with its own stride (Helion
passes every stride), and read it in place; they run the config pinned for rows of N with its rows
per program and per step spread over tokens and heads (``configs.heads_config``). Their outputs are
(T, H, N), their statistics (T, H), returned as (M,). Rows too wide to stay resident in the
backward (the split kernels) are copied to (M, N) first.

Row means are written ``torch.sum(...) / n``, not ``torch.mean``: in a kernel that also holds an
[n]-sized accumulator, Helion 1.4 and 1.5 divide a ``torch.mean`` by the row length padded to a
power of two (1024 for N = 1000).

Measurements behind these choices: docs/kernels/helion.md.
"""

from __future__ import annotations

import helion.language as hl
import torch
from triton.runtime.errors import OutOfResources

from .configs import FUSED_ADD_ROWS, choose, heads_config, launch
from .imports import RefMode, kernel

__all__ = ["rmsnorm_fwd", "rmsnorm_bwd", "layernorm_fwd", "layernorm_bwd", "add_rmsnorm_fwd", "add_rmsnorm_bwd"]

# Every kernel is compiled (never Helion's eager reference mode, whatever HELION_INTERPRET says at
# import time); ``launch`` runs CPU tensors through an eager twin instead. Shapes stay dynamic so a
# new M does not recompile; N is specialized inside each kernel because it sizes the tiles.
COMPILED = {"static_shapes": False, "ref_mode": RefMode.OFF}


# ==================================================================== RMSNorm and add + RMSNorm
@kernel(**COMPILED)
def rmsnorm_fwd_kernel(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    residual_out: torch.Tensor | None,
    weight: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    m, n = x.size()
    n = hl.specialize(n)
    y = torch.empty([m, n], dtype=x.dtype, device=x.device)
    rstd = torch.empty([m], dtype=torch.float32, device=x.device)
    for rows in hl.tile(m):
        xf = x[rows, :].to(torch.float32)
        if residual is not None:
            h = (xf + residual[rows, :].to(torch.float32)).to(x.dtype)
            residual_out[rows, :] = h
            xf = h.to(torch.float32)  # the statistics of h as stored (see the module docstring)
        ms = torch.sum(xf * xf, dim=-1) / n
        # an overflowed sum of squares gives NaN, not rsqrt(inf) = 0 (see the module docstring)
        rstd_rows = torch.where(ms < float("inf"), torch.rsqrt(ms + eps), float("nan"))
        yf = xf * rstd_rows[:, None]
        if weight is not None:
            yf = yf * weight[None, :].to(torch.float32)
        y[rows, :] = yf.to(x.dtype)
        rstd[rows] = rstd_rows
    return y, rstd


@kernel(**COMPILED)
def rmsnorm_bwd_resident(
    dy: torch.Tensor, dresidual: torch.Tensor | None, x: torch.Tensor, weight: torch.Tensor | None, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    m, n = x.size()
    n = hl.specialize(n)
    rows_per_program = hl.register_block_size(m)
    dx = torch.empty([m, n], dtype=x.dtype, device=x.device)
    dw_partial = torch.empty(
        [(m + rows_per_program - 1) // rows_per_program, n], dtype=torch.float32, device=x.device
    )
    for block in hl.tile(m, block_size=rows_per_program):
        dw_acc = hl.zeros([n], dtype=torch.float32)
        for rows in hl.tile(block.begin, block.end):
            rstd_rows = rstd[rows][:, None]
            xhat = x[rows, :].to(torch.float32) * rstd_rows
            dyf = dy[rows, :].to(torch.float32)
            g = dyf
            if weight is not None:
                g = dyf * weight[None, :].to(torch.float32)
            c = torch.sum(g * xhat, dim=-1) / n
            dxf = (g - xhat * c[:, None]) * rstd_rows
            if dresidual is not None:
                dxf = dxf + dresidual[rows, :].to(torch.float32)
            dx[rows, :] = dxf.to(x.dtype)
            dw_acc = dw_acc + torch.sum(dyf * xhat, dim=0)
        dw_partial[block.id, :] = dw_acc
    return dx, dw_partial


@kernel(**COMPILED)
def rmsnorm_bwd_row_sums(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, rstd: torch.Tensor
) -> torch.Tensor:
    m, n = x.size()
    n = hl.specialize(n)
    c = torch.empty([m], dtype=torch.float32, device=x.device)
    for rows in hl.tile(m):
        g = dy[rows, :].to(torch.float32)
        if weight is not None:
            g = g * weight[None, :].to(torch.float32)
        # mean(g * xhat) = rstd * mean(g * x): no need to form xhat here
        c[rows] = torch.sum(g * x[rows, :].to(torch.float32), dim=-1) * rstd[rows] / n
    return c


@kernel(**COMPILED)
def rmsnorm_bwd_split(
    dy: torch.Tensor,
    dresidual: torch.Tensor | None,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    rstd: torch.Tensor,
    c: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    m, n = x.size()
    n = hl.specialize(n)
    rows_per_program = hl.register_block_size(m)
    dx = torch.empty([m, n], dtype=x.dtype, device=x.device)
    dw_partial = torch.empty(
        [(m + rows_per_program - 1) // rows_per_program, n], dtype=torch.float32, device=x.device
    )
    for block, cols in hl.tile([m, n], block_size=[rows_per_program, None]):
        dw_acc = hl.zeros([cols], dtype=torch.float32)
        for rows in hl.tile(block.begin, block.end):
            rstd_rows = rstd[rows][:, None]
            xhat = x[rows, cols].to(torch.float32) * rstd_rows
            dyf = dy[rows, cols].to(torch.float32)
            g = dyf
            if weight is not None:
                g = dyf * weight[cols].to(torch.float32)[None, :]
            dxf = (g - xhat * c[rows][:, None]) * rstd_rows
            if dresidual is not None:
                dxf = dxf + dresidual[rows, cols].to(torch.float32)
            dx[rows, cols] = dxf.to(x.dtype)
            dw_acc = dw_acc + torch.sum(dyf * xhat, dim=0)
        dw_partial[block.id, cols] = dw_acc
    return dx, dw_partial


@kernel(**COMPILED)
def rmsnorm_fwd_heads(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    residual_out: torch.Tensor | None,
    weight: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """rmsnorm_fwd_kernel over (T, H, N) rows, tiled over tokens and heads (see the module docstring)."""
    t, h, n = x.size()
    n = hl.specialize(n)
    y = torch.empty([t, h, n], dtype=x.dtype, device=x.device)
    rstd = torch.empty([t, h], dtype=torch.float32, device=x.device)
    for tokens, heads in hl.tile([t, h]):
        xf = x[tokens, heads, :].to(torch.float32)
        if residual is not None:
            hs = (xf + residual[tokens, heads, :].to(torch.float32)).to(x.dtype)
            residual_out[tokens, heads, :] = hs
            xf = hs.to(torch.float32)
        ms = torch.sum(xf * xf, dim=-1) / n
        rstd_rows = torch.where(ms < float("inf"), torch.rsqrt(ms + eps), float("nan"))
        yf = xf * rstd_rows[:, :, None]
        if weight is not None:
            yf = yf * weight[None, None, :].to(torch.float32)
        y[tokens, heads, :] = yf.to(x.dtype)
        rstd[tokens, heads] = rstd_rows
    return y, rstd


@kernel(**COMPILED)
def rmsnorm_bwd_heads(
    dy: torch.Tensor, dresidual: torch.Tensor | None, x: torch.Tensor, weight: torch.Tensor | None, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The resident backward over (T, H, N) rows (rstd: (T, H)), its dw accumulated per row of the
    step and summed over them once per program (see the module docstring)."""
    t, h, n = x.size()
    n = hl.specialize(n)
    tokens_per_program = hl.register_block_size(t)
    tokens_per_step = hl.register_block_size(t)
    heads_per_step = hl.register_block_size(h)
    dx = torch.empty([t, h, n], dtype=x.dtype, device=x.device)
    dw_partial = torch.empty(
        [(t + tokens_per_program - 1) // tokens_per_program, n], dtype=torch.float32, device=x.device
    )
    for block in hl.tile(t, block_size=tokens_per_program):
        dw_acc = hl.zeros([tokens_per_step, heads_per_step, n], dtype=torch.float32)
        for tokens, heads in hl.tile([block.begin, 0], [block.end, h], block_size=[tokens_per_step, heads_per_step]):
            rstd_rows = rstd[tokens, heads][:, :, None]
            xhat = x[tokens, heads, :].to(torch.float32) * rstd_rows
            dyf = dy[tokens, heads, :].to(torch.float32)
            g = dyf
            if weight is not None:
                g = dyf * weight[None, None, :].to(torch.float32)
            c = torch.sum(g * xhat, dim=-1) / n
            dxf = (g - xhat * c[:, :, None]) * rstd_rows
            if dresidual is not None:
                dxf = dxf + dresidual[tokens, heads, :].to(torch.float32)
            dx[tokens, heads, :] = dxf.to(x.dtype)
            dw_acc = dw_acc + dyf * xhat
        dw_partial[block.id, :] = torch.sum(torch.sum(dw_acc, dim=0), dim=0)
    return dx, dw_partial


def add_rmsnorm_fwd(x, residual, weight, eps):
    residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.dim() == 3:
        y, rstd = _fwd_heads(rmsnorm_fwd_heads, "rmsnorm_fwd", x, residual, residual_out, weight, eps)
        return y, residual_out, rstd
    y, rstd = launch(rmsnorm_fwd_kernel, choose("rmsnorm_fwd", x).config, x, residual, residual_out, weight, eps)
    return y, residual_out, rstd


def rmsnorm_fwd(x, weight, eps):
    if x.dim() == 3:
        return _fwd_heads(rmsnorm_fwd_heads, "rmsnorm_fwd", x, None, None, weight, eps)
    return launch(rmsnorm_fwd_kernel, choose("rmsnorm_fwd", x).config, x, None, None, weight, eps)


def _fwd_heads(kernel, entry, x, *args):
    """A forward over (T, H, N) rows: the config pinned for rows of N, its rows per program spread
    over tokens and heads; the statistics returned as (T * H,)."""
    y, *stats = launch(kernel, heads_config(choose(entry, x), x.shape[1]), x, *args)
    return (y, *(s.view(-1) for s in stats))


def _as_heads(*rows):
    """(M, N) row tensors as (M, 1, N) views, for the kernels over (T, H, N) rows; None stays."""
    return tuple(None if r is None else r[:, None] for r in rows)


def _rms_bwd_heads(choice, dy, dresidual_out, x, weight, rstd):
    """rmsnorm_bwd_heads on (T, H, N) rows, or on (M, N) rows as (M, 1, N) (dx then (M, N))."""
    flat = x.dim() == 2
    if flat:
        dy, dresidual_out, x = _as_heads(dy, dresidual_out, x)
    t, h, n = x.shape
    dx, dw_partial = launch(
        rmsnorm_bwd_heads, heads_config(choice, h), dy, dresidual_out, x, weight, rstd.view(t, h)
    )
    dw = dw_partial.sum(0).to(weight.dtype) if weight is not None else None
    return (dx.view(t, n) if flat else dx), dw


# (N, dtype, device, with dresidual_out) -> the row factor whose config fits (see add_rmsnorm_bwd)
_FITS: dict = {}


def add_rmsnorm_bwd(dy, dresidual_out, residual_out, weight, rstd):
    """A config tuned for RMSNorm's two row tensors can ask more shared memory than the fused
    backward's three get (fp32 rows, for one): then the config of rows twice as long is taken, down
    to the column-split kernel, and remembered per N and dtype."""
    if residual_out.dim() == 3:  # (T, H, N) rows: read in place, unless too wide to stay resident
        choice = choose("rmsnorm_bwd", residual_out)
        if choice.kernel != rmsnorm_bwd_split.name:
            return _rms_bwd_heads(choice, dy, dresidual_out, residual_out, weight, rstd)
        n = residual_out.shape[-1]
        dy, residual_out = dy.reshape(-1, n), residual_out.reshape(-1, n)
        dresidual_out = None if dresidual_out is None else dresidual_out.reshape(-1, n)
    key = (residual_out.shape[-1], residual_out.dtype, residual_out.device, dresidual_out is not None)
    rows = _FITS.get(key, FUSED_ADD_ROWS["bwd"] if dresidual_out is not None else 1.0)
    failed = None
    while True:
        choice = choose("rmsnorm_bwd", residual_out, rows=rows)
        try:
            out = _bwd(choice, dy, dresidual_out, residual_out, weight, rstd)
        except OutOfResources:
            if choice.kernel == rmsnorm_bwd_split.name or choice == failed:  # nothing smaller to take
                raise
            failed, rows = choice, rows * 2
            continue
        _FITS[key] = rows
        return out


def _bwd(choice, dy, dresidual_out, x, weight, rstd):
    if choice.kernel == rmsnorm_bwd_heads.name:
        return _rms_bwd_heads(choice, dy, dresidual_out, x, weight, rstd)
    if choice.kernel == rmsnorm_bwd_split.name:
        c = launch(rmsnorm_bwd_row_sums, choice.first_pass, dy, x, weight, rstd)
        dx, dw_partial = launch(rmsnorm_bwd_split, choice.config, dy, dresidual_out, x, weight, rstd, c)
    else:
        dx, dw_partial = launch(rmsnorm_bwd_resident, choice.config, dy, dresidual_out, x, weight, rstd)
    # Without a weight the kernels still fill dw_partial (one row per program): unused.
    dw = dw_partial.sum(0).to(weight.dtype) if weight is not None else None
    return dx, dw


def rmsnorm_bwd(dy, x, weight, rstd):
    return add_rmsnorm_bwd(dy, None, x, weight, rstd)


# ==================================================================================== LayerNorm
@kernel(**COMPILED)
def layernorm_fwd_kernel(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    m, n = x.size()
    n = hl.specialize(n)
    y = torch.empty([m, n], dtype=x.dtype, device=x.device)
    mean = torch.empty([m], dtype=torch.float32, device=x.device)
    rstd = torch.empty([m], dtype=torch.float32, device=x.device)
    for rows in hl.tile(m):
        xf = x[rows, :].to(torch.float32)
        mean_rows = torch.sum(xf, dim=-1) / n
        xc = xf - mean_rows[:, None]
        var = torch.sum(xc * xc, dim=-1) / n
        rstd_rows = torch.where(var < float("inf"), torch.rsqrt(var + eps), float("nan"))  # see the module docstring
        yf = xc * rstd_rows[:, None]
        if weight is not None:
            yf = yf * weight[None, :].to(torch.float32)
        if bias is not None:
            yf = yf + bias[None, :].to(torch.float32)
        y[rows, :] = yf.to(x.dtype)
        mean[rows] = mean_rows
        rstd[rows] = rstd_rows
    return y, mean, rstd


@kernel(**COMPILED)
def layernorm_bwd_resident(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, mean: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    m, n = x.size()
    n = hl.specialize(n)
    rows_per_program = hl.register_block_size(m)
    dx = torch.empty([m, n], dtype=x.dtype, device=x.device)
    programs = (m + rows_per_program - 1) // rows_per_program
    dw_partial = torch.empty([programs, n], dtype=torch.float32, device=x.device)
    db_partial = torch.empty([programs, n], dtype=torch.float32, device=x.device)
    for block in hl.tile(m, block_size=rows_per_program):
        dw_acc = hl.zeros([n], dtype=torch.float32)
        db_acc = hl.zeros([n], dtype=torch.float32)
        for rows in hl.tile(block.begin, block.end):
            rstd_rows = rstd[rows][:, None]
            xhat = (x[rows, :].to(torch.float32) - mean[rows][:, None]) * rstd_rows
            dyf = dy[rows, :].to(torch.float32)
            g = dyf
            if weight is not None:
                g = dyf * weight[None, :].to(torch.float32)
            c_xhat = torch.sum(g * xhat, dim=-1) / n
            c_mean = torch.sum(g, dim=-1) / n
            dx[rows, :] = ((g - c_mean[:, None] - xhat * c_xhat[:, None]) * rstd_rows).to(x.dtype)
            dw_acc = dw_acc + torch.sum(dyf * xhat, dim=0)
            db_acc = db_acc + torch.sum(dyf, dim=0)
        dw_partial[block.id, :] = dw_acc
        db_partial[block.id, :] = db_acc
    return dx, dw_partial, db_partial


@kernel(**COMPILED)
def layernorm_bwd_row_sums(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, mean: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    m, n = x.size()
    n = hl.specialize(n)
    c_xhat = torch.empty([m], dtype=torch.float32, device=x.device)
    c_mean = torch.empty([m], dtype=torch.float32, device=x.device)
    for rows in hl.tile(m):
        xhat = (x[rows, :].to(torch.float32) - mean[rows][:, None]) * rstd[rows][:, None]
        g = dy[rows, :].to(torch.float32)
        if weight is not None:
            g = g * weight[None, :].to(torch.float32)
        c_xhat[rows] = torch.sum(g * xhat, dim=-1) / n
        c_mean[rows] = torch.sum(g, dim=-1) / n
    return c_xhat, c_mean


@kernel(**COMPILED)
def layernorm_bwd_split(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    c_xhat: torch.Tensor,
    c_mean: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    m, n = x.size()
    n = hl.specialize(n)
    rows_per_program = hl.register_block_size(m)
    dx = torch.empty([m, n], dtype=x.dtype, device=x.device)
    programs = (m + rows_per_program - 1) // rows_per_program
    dw_partial = torch.empty([programs, n], dtype=torch.float32, device=x.device)
    db_partial = torch.empty([programs, n], dtype=torch.float32, device=x.device)
    for block, cols in hl.tile([m, n], block_size=[rows_per_program, None]):
        dw_acc = hl.zeros([cols], dtype=torch.float32)
        db_acc = hl.zeros([cols], dtype=torch.float32)
        for rows in hl.tile(block.begin, block.end):
            rstd_rows = rstd[rows][:, None]
            xhat = (x[rows, cols].to(torch.float32) - mean[rows][:, None]) * rstd_rows
            dyf = dy[rows, cols].to(torch.float32)
            g = dyf
            if weight is not None:
                g = dyf * weight[cols].to(torch.float32)[None, :]
            dx[rows, cols] = ((g - c_mean[rows][:, None] - xhat * c_xhat[rows][:, None]) * rstd_rows).to(x.dtype)
            dw_acc = dw_acc + torch.sum(dyf * xhat, dim=0)
            db_acc = db_acc + torch.sum(dyf, dim=0)
        dw_partial[block.id, cols] = dw_acc
        db_partial[block.id, cols] = db_acc
    return dx, dw_partial, db_partial


@kernel(**COMPILED)
def layernorm_fwd_heads(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """layernorm_fwd_kernel over (T, H, N) rows, tiled over tokens and heads."""
    t, h, n = x.size()
    n = hl.specialize(n)
    y = torch.empty([t, h, n], dtype=x.dtype, device=x.device)
    mean = torch.empty([t, h], dtype=torch.float32, device=x.device)
    rstd = torch.empty([t, h], dtype=torch.float32, device=x.device)
    for tokens, heads in hl.tile([t, h]):
        xf = x[tokens, heads, :].to(torch.float32)
        mean_rows = torch.sum(xf, dim=-1) / n
        xc = xf - mean_rows[:, :, None]
        var = torch.sum(xc * xc, dim=-1) / n
        rstd_rows = torch.where(var < float("inf"), torch.rsqrt(var + eps), float("nan"))
        yf = xc * rstd_rows[:, :, None]
        if weight is not None:
            yf = yf * weight[None, None, :].to(torch.float32)
        if bias is not None:
            yf = yf + bias[None, None, :].to(torch.float32)
        y[tokens, heads, :] = yf.to(x.dtype)
        mean[tokens, heads] = mean_rows
        rstd[tokens, heads] = rstd_rows
    return y, mean, rstd


@kernel(**COMPILED)
def layernorm_bwd_heads(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, mean: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """layernorm_bwd_resident over (T, H, N) rows (mean, rstd: (T, H)), dw and db accumulated per
    row of the step and summed over them once per program."""
    t, h, n = x.size()
    n = hl.specialize(n)
    tokens_per_program = hl.register_block_size(t)
    tokens_per_step = hl.register_block_size(t)
    heads_per_step = hl.register_block_size(h)
    dx = torch.empty([t, h, n], dtype=x.dtype, device=x.device)
    programs = (t + tokens_per_program - 1) // tokens_per_program
    dw_partial = torch.empty([programs, n], dtype=torch.float32, device=x.device)
    db_partial = torch.empty([programs, n], dtype=torch.float32, device=x.device)
    for block in hl.tile(t, block_size=tokens_per_program):
        dw_acc = hl.zeros([tokens_per_step, heads_per_step, n], dtype=torch.float32)
        db_acc = hl.zeros([tokens_per_step, heads_per_step, n], dtype=torch.float32)
        for tokens, heads in hl.tile([block.begin, 0], [block.end, h], block_size=[tokens_per_step, heads_per_step]):
            rstd_rows = rstd[tokens, heads][:, :, None]
            xhat = (x[tokens, heads, :].to(torch.float32) - mean[tokens, heads][:, :, None]) * rstd_rows
            dyf = dy[tokens, heads, :].to(torch.float32)
            g = dyf
            if weight is not None:
                g = dyf * weight[None, None, :].to(torch.float32)
            c_xhat = torch.sum(g * xhat, dim=-1) / n
            c_mean = torch.sum(g, dim=-1) / n
            dxf = (g - c_mean[:, :, None] - xhat * c_xhat[:, :, None]) * rstd_rows
            dx[tokens, heads, :] = dxf.to(x.dtype)
            dw_acc = dw_acc + dyf * xhat
            db_acc = db_acc + dyf
        dw_partial[block.id, :] = torch.sum(torch.sum(dw_acc, dim=0), dim=0)
        db_partial[block.id, :] = torch.sum(torch.sum(db_acc, dim=0), dim=0)
    return dx, dw_partial, db_partial


def layernorm_fwd(x, weight, bias, eps):
    if x.dim() == 3:
        return _fwd_heads(layernorm_fwd_heads, "layernorm_fwd", x, weight, bias, eps)
    return launch(layernorm_fwd_kernel, choose("layernorm_fwd", x).config, x, weight, bias, eps)


def layernorm_bwd(dy, x, weight, mean, rstd):
    choice = choose("layernorm_bwd", x)
    if choice.kernel == layernorm_bwd_heads.name or (x.dim() == 3 and choice.kernel != layernorm_bwd_split.name):
        flat = x.dim() == 2
        if flat:
            dy, x = _as_heads(dy, x)
        t, h, n = x.shape
        dx, dw_partial, db_partial = launch(
            layernorm_bwd_heads, heads_config(choice, h), dy, x, weight, mean.view(t, h), rstd.view(t, h)
        )
        dx = dx.view(t, n) if flat else dx
    elif choice.kernel == layernorm_bwd_split.name:
        if x.dim() == 3:  # too wide to stay resident: the (M, N) kernels, on a copy
            dy, x = dy.reshape(-1, x.shape[-1]), x.reshape(-1, x.shape[-1])
        c_xhat, c_mean = launch(layernorm_bwd_row_sums, choice.first_pass, dy, x, weight, mean, rstd)
        dx, dw_partial, db_partial = launch(
            layernorm_bwd_split, choice.config, dy, x, weight, mean, rstd, c_xhat, c_mean
        )
    else:
        dx, dw_partial, db_partial = launch(layernorm_bwd_resident, choice.config, dy, x, weight, mean, rstd)
    param_dtype = weight.dtype if weight is not None else x.dtype
    dw = dw_partial.sum(0).to(param_dtype) if weight is not None else None
    return dx, dw, db_partial.sum(0).to(param_dtype)
