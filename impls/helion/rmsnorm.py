"""RMSNorm in Helion: tile-first kernels, one helion.Config pinned per GPU and row length.

Forward, per row x of length N (all arithmetic in fp32):

    rstd = 1 / sqrt(mean(x^2) + eps)        stored in fp32, one per row
    y    = x * rstd * w                     rounded once to x's dtype

Backward, with xhat = x * rstd and g = dy * w:

    dx = rstd * (g - xhat * c),   c = mean(g * xhat)      per row
    dw = sum over rows of dy * xhat                        a column sum over all M rows

The forward tiles rows and reduces each full row; Helion turns the row into a loop over column
chunks when the config sets ``reduction_loops`` (rows that do not fit in registers).

The backward comes in two shapes; the pinned config says which one a row length uses:

* ``rmsnorm_bwd_resident``, for rows that fit in registers (N <= 16384): each program owns a block
  of rows and walks it a few rows at a time with whole rows in registers (x and dy are read once),
  accumulating dw over the block in fp32 registers; it writes one fp32 partial row at the end.
* split, for wider rows, where a program cannot hold both a row and an N-wide dw accumulator:
  ``rmsnorm_bwd_row_sums`` computes c for every row (a row reduction, like the forward), then
  ``rmsnorm_bwd_split`` tiles the matrix in [rows x columns] blocks, each program walking its
  block's rows for dx and accumulating dw over them for its columns only. x and dy are read twice;
  the 2-D grid keeps the GPU busy however few the rows, and the partials stay small.

Either way the fp32 partial rows are summed after the kernel in fp32 and cast once: deterministic,
no atomics.

Row means are written ``torch.sum(...) / n``, not ``torch.mean``: in a kernel that also holds an
[n]-sized accumulator, Helion 1.4 and 1.5 divide a ``torch.mean`` by the row length padded to a
power of two (1024 for N = 1000).
"""

from __future__ import annotations

import helion
import helion.language as hl
import torch

from .configs import choose, launch

# Every kernel is compiled (never Helion's eager reference mode, whatever HELION_INTERPRET says at
# import time); ``launch`` runs CPU tensors through an eager twin instead. Shapes stay dynamic so a
# new M does not recompile; N is specialized inside each kernel because it sizes the tiles.
COMPILED = {"static_shapes": False, "ref_mode": helion.RefMode.OFF}


@helion.kernel(**COMPILED)
def rmsnorm_fwd_kernel(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    m, n = x.size()
    n = hl.specialize(n)
    y = torch.empty([m, n], dtype=x.dtype, device=x.device)
    rstd = torch.empty([m], dtype=torch.float32, device=x.device)
    for rows in hl.tile(m):
        xf = x[rows, :].to(torch.float32)
        rstd_rows = torch.rsqrt(torch.sum(xf * xf, dim=-1) / n + eps)
        yf = xf * rstd_rows[:, None]
        if weight is not None:
            yf = yf * weight[None, :].to(torch.float32)
        y[rows, :] = yf.to(x.dtype)
        rstd[rows] = rstd_rows
    return y, rstd


@helion.kernel(**COMPILED)
def rmsnorm_bwd_resident(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, rstd: torch.Tensor
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
            dx[rows, :] = ((g - xhat * c[:, None]) * rstd_rows).to(x.dtype)
            dw_acc = dw_acc + torch.sum(dyf * xhat, dim=0)
        dw_partial[block.id, :] = dw_acc
    return dx, dw_partial


@helion.kernel(**COMPILED)
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


@helion.kernel(**COMPILED)
def rmsnorm_bwd_split(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, rstd: torch.Tensor, c: torch.Tensor
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
            dx[rows, cols] = ((g - xhat * c[rows][:, None]) * rstd_rows).to(x.dtype)
            dw_acc = dw_acc + torch.sum(dyf * xhat, dim=0)
        dw_partial[block.id, cols] = dw_acc
    return dx, dw_partial


def rmsnorm_fwd(x, weight, eps):
    return launch(rmsnorm_fwd_kernel, choose("rmsnorm_fwd", x).config, x, weight, eps)


def rmsnorm_bwd(dy, x, weight, rstd):
    choice = choose("rmsnorm_bwd", x)
    if choice.kernel == rmsnorm_bwd_split.name:
        c = launch(rmsnorm_bwd_row_sums, choice.first_pass, dy, x, weight, rstd)
        dx, dw_partial = launch(rmsnorm_bwd_split, choice.config, dy, x, weight, rstd, c)
    else:
        dx, dw_partial = launch(rmsnorm_bwd_resident, choice.config, dy, x, weight, rstd)
    # Without a weight the kernels still fill dw_partial (one row per program): unused.
    dw = dw_partial.sum(0).to(x.dtype) if weight is not None else None
    return dx, dw
