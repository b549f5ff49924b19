"""LayerNorm in Helion: tile-first kernels, one helion.Config pinned per GPU and row length.

Forward, per row x of length N (all arithmetic in fp32):

    mean = mean(x)
    rstd = 1 / sqrt(mean((x - mean)^2) + eps)      two passes over the row: no cancellation
    y    = (x - mean) * rstd * w + b               rounded once to x's dtype

Backward, with xhat = (x - mean) * rstd and g = dy * w:

    dx = rstd * (g - mean(g) - xhat * mean(g * xhat))     per row
    dw = sum over rows of dy * xhat,   db = sum over rows of dy

Same structure as rmsnorm.py (see its docstring): the forward reduces whole rows (looped over column
chunks when the config sets ``reduction_loops``); the backward either keeps whole rows in registers
(``layernorm_bwd_resident``) or, for wide rows, computes the two row means first
(``layernorm_bwd_row_sums``) and then dx, dw and db on [rows x columns] tiles
(``layernorm_bwd_split``); dw and db are fp32 partial rows per program, summed after the kernel in
fp32. Means are sums divided by n for the reason given there.

Weight and bias may be fp32 beside 16-bit x: loaded in their own dtype, converted in registers;
dweight and dbias are reduced in fp32 and returned in the weight's dtype (x's when there is none).

A row whose squared deviations overflow fp32 (values near 1e30 in bf16 or fp32; or a mean that
overflows, which makes them infinite too) gets rstd = NaN and so y = NaN, as torch's layer_norm
returns; rsqrt(inf) = 0 would have returned y = bias, a finite wrong number. The backward sees that
NaN rstd and returns NaN in dx.
"""

from __future__ import annotations

import helion.language as hl
import torch

from .configs import choose, launch
from .imports import RefMode, kernel

# See rmsnorm.py: always compiled, dynamic M, N specialized in the kernel.
COMPILED = {"static_shapes": False, "ref_mode": RefMode.OFF}


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
        rstd_rows = torch.where(var < float("inf"), torch.rsqrt(var + eps), float("nan"))  # see the docstring
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


def layernorm_fwd(x, weight, bias, eps):
    return launch(layernorm_fwd_kernel, choose("layernorm_fwd", x).config, x, weight, bias, eps)


def layernorm_bwd(dy, x, weight, mean, rstd):
    choice = choose("layernorm_bwd", x)
    if choice.kernel == layernorm_bwd_split.name:
        c_xhat, c_mean = launch(layernorm_bwd_row_sums, choice.first_pass, dy, x, weight, mean, rstd)
        dx, dw_partial, db_partial = launch(
            layernorm_bwd_split, choice.config, dy, x, weight, mean, rstd, c_xhat, c_mean
        )
    else:
        dx, dw_partial, db_partial = launch(layernorm_bwd_resident, choice.config, dy, x, weight, mean, rstd)
    param_dtype = weight.dtype if weight is not None else x.dtype
    dw = dw_partial.sum(0).to(param_dtype) if weight is not None else None
    return dx, dw, db_partial.sum(0).to(param_dtype)
