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

``*_fwd_sync``, the forward for wide rows with x (and residual) read once from DRAM: with one row
per SM in flight, rows of 512 KB (N = 262144 bf16) overflow the L2 and the looped form's second
pass reads x from DRAM again. Here a row is cut into column slices, one program per slice, each
holding its slice in registers; the slices of a row exchange their partial statistics through
global memory exactly as the exchanging backward (below) does: same grid of groups x slices
programs, each group walking a contiguous run of row blocks; same slots (fp32 bits | 1 << 32 in one
int64, one atomic exchange, zeroed by the launcher); the next block's loads issued before the
bounded wait; the slots added in slice order, so every sibling gets the same bits. RMSNorm (and
the fused add, whose h is rounded and stored as the row kernel does it, its square summed from the
rounded h) posts sum(h^2). LayerNorm posts two values per slice, its sum and m2 = the sum of squared
deviations from its own mean (over its n_s valid columns: the last slice may be partial), merged by
Chan's formula, mean = sum(sum_s) / N, M2 = sum(m2_s) + sum(n_s (mean_s - mean)^2): every term is
a sum of squares of deviations, so nothing cancels (E[x^2] - mean^2 would where |mean| >> std).
The slices' column counts come in as a small fp32 vector (one per slice). rstd (and mean) come out
as the row kernel's (NaN where the statistics overflow); the first slice's programs store them.
Weight and bias are loaded once per program (its slice never changes). As for the backward, the
launcher runs it only where every sibling is resident (groups x slices <= SMs), and the row kernel
where it cannot (the CPU, more slices than SMs); per-head (T, H, N) views keep the kernel over
tokens and heads.

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
* ``*_bwd_sync``, the split backward in one kernel, x and dy read once (3 units of traffic where
  the split one moves 5): a persistent grid of groups x slices programs, each owning one column
  slice (the split config's column tile) of a contiguous run of row blocks; per block it posts its
  slice's part of each row's sums (RMSNorm: sum(g * x); LayerNorm: sum(g * (x - mean)) and sum(g))
  to global memory, issues the next block's loads, and waits for its siblings' parts. The launcher
  keeps the grid to the SMs (groups * slices <= SM count, one program each): a program spins until
  every sibling has posted, so all must be resident at once; a grid the GPU cannot hold would wait
  for programs that start only when it ends. Each sum travels as one int64, its fp32 bits
  zero-extended with bit 32 set as the "posted" flag, in one atomic exchange: a reader that sees
  the flag sees the value (no fence between a value and its flag to get wrong). The wait re-reads
  the row block's slots with an atomic add of 0 (Helion has no volatile load; the atomic reads L2,
  never a stale L1 line) and adds them in one fixed order over the slices, the same in every
  program, so all siblings get the same bits and a run is deterministic. It is bounded: a slot still
  empty after 2^20 re-reads (about a second) makes that row's sums NaN, a visibly wrong dx rather
  than a hang, and the program waits no more on later blocks. On the CPU (eager mode runs the
  programs one after another) and where the conditions fail the choice runs the split kernels.

* ``*_bwd_heads``, the resident backward over (T, H, N) rows, tiled over tokens and heads, whose
  dw (and db) accumulate per row of the step ([tokens, heads, N] in fp32 registers) and are
  summed over the rows once per program. The small rows' configs pin it (an (M, N) matrix runs as
  (M, 1, N)): the resident kernel's sum over the step's rows every step is a reduction across
  warps through shared memory, which for rows of 64-512 elements costs more than the step's loads.

Either way the fp32 partial rows are summed after the kernel in fp32 and cast once, by a Helion
kernel of their own (``summed``: one launch where ATen's sum and a cast took two), a column strip a
program in a fixed order: deterministic, no atomics.

Per-head views (``row_views``): q and k of a fused QKV projection are (T, H, N) views whose token
stride spans all P heads, so no (M, N) view of their rows exists. The kernels ``*_fwd_heads`` and
``*_bwd_heads`` tile such a tensor over its two leading dims, each with its own stride (Helion
passes every stride), and read it in place; they run the config pinned for rows of N with its rows
per program and per step spread over tokens and heads (``configs.heads_config``). Their outputs are
(T, H, N), their statistics (T, H), returned as (M,). Rows too wide to stay resident in the
backward (the split kernels) are copied to (M, N) first.

Realigned rows (``*_odd``): a 16-bit row whose length is no multiple of a 16-byte vector (N = 4001)
starts anywhere within a vector, so the kernels above move it element-wise (a 2-byte access per
element keeps the load/store units, not DRAM, busy). The realigned kernels read and write each
row's body in whole vectors from its first aligned element, and its head and tail (under a vector
each) as one short element-wise edge vector. They index flat views of the row tensors with
computed offsets (``hl.load`` / ``hl.store`` with index tensors); the body's offset is written as
the row's offset rounded up to a multiple of the vector, ``(e + vec - 1) // vec * vec``, so that
Triton's alignment analysis sees the divisibility and emits 16-byte loads and stores (it cannot
see it through a per-row shift read from memory). The body then sits in shifted columns, so the
weight (and bias) and the dw (and db) accumulators are shifted alike. A row r starts (r * N) mod 8
elements into a vector, so a persistent program walking rows p, p + G, p + 2G, ... with G a
multiple of 8 keeps one shift: one shifted weight, loaded once, and one shifted partial row,
written back in column order at the end. G is ``programs_per_sm`` per SM rounded down to a
multiple of 8 (rounded up, the extra programs would run as a second wave). They take (M, N)
rows of 1024 < N <= 8192 (whole rows in registers), every row tensor contiguous from a 16-byte
aligned start, so that a row starts at the same offset in all of them; other rows, fp32 rows
(4 bytes an access already) and per-head views keep the kernels above.

The price is batch invariance at those widths: which columns are body and which edge depends on
where a row starts, so its sums can round differently at another place in the batch (the Triton
realigned kernels pay the same; exact sums cost more than the vectors gain there).

Row means are written ``torch.sum(...) / n``, not ``torch.mean``: in a kernel that also holds an
[n]-sized accumulator, Helion 1.4 and 1.5 divide a ``torch.mean`` by the row length padded to a
power of two (1024 for N = 1000).

Measurements behind these choices: docs/kernels/helion.md.
"""

from __future__ import annotations

import helion.language as hl
import torch
import triton
from triton.runtime.errors import OutOfResources

from harness.spec.occupancy import exchange_groups

from .configs import (
    FUSED_ADD_ROWS,
    choose,
    choose_realigned,
    fwd_sync_config,
    heads_config,
    is_odd,
    launch,
    realigned_programs,
    sm_count,
    sync_config,
)
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
def rmsnorm_bwd_sync(
    dy: torch.Tensor,
    dresidual: torch.Tensor | None,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    rstd: torch.Tensor,
    slots: torch.Tensor,
    groups: int,
    share: int,
    extra: int,
    spin: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The split backward in one pass: ``groups`` x slices programs, each owning one column slice of
    a group's rows, posting its slice's part of each row's sum(g * x) to ``slots`` ((M, slices)
    int64, zeroed by the caller) and waiting for its siblings' (see the module docstring). Group g
    walks row blocks [g * share + min(g, extra), (g + 1) * share + min(g + 1, extra)), ``spin``
    bounds each wait."""
    m, n = x.size()
    n = hl.specialize(n)
    hl.specialize(slots.size(1))
    rows_per_step = hl.register_block_size(m)
    slice_width = hl.register_block_size(n)
    dx = torch.empty([m, n], dtype=x.dtype, device=x.device)
    dw_partial = torch.empty([groups, n], dtype=torch.float32, device=x.device)
    for group, cols in hl.tile([groups, n], block_size=[1, slice_width]):
        # a run of row blocks, as many as every other group's or one more (``min`` here, not in a
        # helper: Helion traces a helper's Python ``min`` on symbols by their example values)
        begin = (group.begin * share + min(group.begin, extra)) * rows_per_step
        end = min(m, ((group.begin + 1) * share + min(group.begin + 1, extra)) * rows_per_step)
        dw_acc = hl.zeros([cols], dtype=torch.float32)
        budget = hl.full([], spin, dtype=torch.int32)
        x_next, dy_next = _rows_ahead(x, dy, begin, end, rows_per_step, cols)
        for rows in hl.tile(begin, end, block_size=rows_per_step):
            xf = x_next.to(torch.float32)
            dyf = dy_next.to(torch.float32)
            g = dyf
            if weight is not None:
                g = dyf * weight[cols].to(torch.float32)[None, :]
            hl.atomic_xchg(slots, [rows, cols.id], _posted(torch.sum(g * xf, dim=-1)))
            # the next block's loads go out before the wait, which they overlap
            x_next, dy_next = _rows_ahead(x, dy, rows.begin + rows_per_step, end, rows_per_step, cols)
            sums = hl.atomic_add(slots, [rows, slice(None)], 0)
            tries = hl.zeros([], dtype=torch.int32)
            while _unposted(sums) & (tries < budget):
                sums = hl.atomic_add(slots, [rows, slice(None)], 0)
                tries = tries + 1
            budget = torch.where(_unposted(sums), 0, budget)
            rstd_rows = rstd[rows][:, None]
            c = torch.sum(_values(sums), dim=-1)[:, None] * rstd_rows / n
            xhat = xf * rstd_rows
            dxf = (g - xhat * c) * rstd_rows
            if dresidual is not None:
                dxf = dxf + dresidual[rows, cols].to(torch.float32)
            dx[rows, cols] = dxf.to(x.dtype)
            dw_acc = dw_acc + torch.sum(dyf * xhat, dim=0)
        dw_partial[group.begin, cols] = dw_acc
    return dx, dw_partial


def _rows_ahead(x, dy, first, end, rows_per_step, cols):
    """x and dy (storage dtype) of the block of rows from ``first`` in an exchanging program's slice;
    rows from ``end`` on read 0; dy None (the forward's residual where there is none) stays None.
    (``unsqueeze``: see _odd_tile.)"""
    rows = first + hl.arange(rows_per_step)
    mask = (rows < end).unsqueeze(1)
    return hl.load(x, [rows, cols], extra_mask=mask), None if dy is None else hl.load(dy, [rows, cols], extra_mask=mask)


@kernel(**COMPILED)
def rmsnorm_fwd_sync(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    residual_out: torch.Tensor | None,
    weight: torch.Tensor | None,
    eps: float,
    slots: torch.Tensor,
    groups: int,
    share: int,
    extra: int,
    spin: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """rmsnorm_fwd_kernel for wide rows, x (and residual) read once: ``groups`` x slices programs,
    each owning one column slice of a group's rows (as in rmsnorm_bwd_sync), posting its slice's
    sum(h^2) of each row to ``slots`` ((M, slices) int64, zeroed by the caller) and waiting for its
    siblings' (see the module docstring). The first slice's programs store rstd."""
    m, n = x.size()
    n = hl.specialize(n)
    hl.specialize(slots.size(1))
    rows_per_step = hl.register_block_size(m)
    slice_width = hl.register_block_size(n)
    y = torch.empty([m, n], dtype=x.dtype, device=x.device)
    rstd = torch.empty([m], dtype=torch.float32, device=x.device)
    for group, cols in hl.tile([groups, n], block_size=[1, slice_width]):
        begin = (group.begin * share + min(group.begin, extra)) * rows_per_step
        end = min(m, ((group.begin + 1) * share + min(group.begin + 1, extra)) * rows_per_step)
        if weight is not None:
            w = weight[cols].to(torch.float32)[None, :]  # once per program: its slice never changes
        budget = hl.full([], spin, dtype=torch.int32)
        x_next, r_next = _rows_ahead(x, residual, begin, end, rows_per_step, cols)
        for rows in hl.tile(begin, end, block_size=rows_per_step):
            xf = x_next.to(torch.float32)
            if residual is not None:
                h = (xf + r_next.to(torch.float32)).to(x.dtype)
                residual_out[rows, cols] = h
                xf = h.to(torch.float32)  # the statistics of h as stored, as rmsnorm_fwd_kernel
            hl.atomic_xchg(slots, [rows, cols.id], _posted(torch.sum(xf * xf, dim=-1)))
            x_next, r_next = _rows_ahead(x, residual, rows.begin + rows_per_step, end, rows_per_step, cols)
            sums = hl.atomic_add(slots, [rows, slice(None)], 0)
            tries = hl.zeros([], dtype=torch.int32)
            while _unposted(sums) & (tries < budget):
                sums = hl.atomic_add(slots, [rows, slice(None)], 0)
                tries = tries + 1
            budget = torch.where(_unposted(sums), 0, budget)
            ms = torch.sum(_values(sums), dim=-1) / n
            rstd_rows = torch.where(ms < float("inf"), torch.rsqrt(ms + eps), float("nan"))
            yf = xf * rstd_rows[:, None]
            if weight is not None:
                yf = yf * w
            y[rows, cols] = yf.to(x.dtype)
            if cols.id == 0:
                rstd[rows] = rstd_rows
    return y, rstd


def _posted(value):
    """A slot's int64 for fp32 ``value``: its bits zero-extended, bit 32 the "posted" flag."""
    return (value.view(torch.int32).to(torch.int64) & 0xFFFFFFFF) | (1 << 32)


def _unposted(sums):
    """Whether any slot of ``sums`` (the slots of a block's rows) is still empty."""
    flags = sums >> 32
    for dim in reversed(range(flags.dim())):
        flags = torch.amin(flags, dim=dim)
    return flags == 0


def _values(sums):
    """The fp32 values of ``sums``: NaN where a slot is still empty."""
    return torch.where((sums >> 32) == 0, float("nan"), (sums & 0xFFFFFFFF).to(torch.int32).view(torch.float32))


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
    odd = _realigned("add_rmsnorm", "fwd", x, residual, residual_out)
    if odd:
        y, rstd = _launch_realigned(odd, rmsnorm_fwd_odd, x, residual, residual_out, weight, eps)
        return y, residual_out, rstd
    if x.dim() == 3:
        y, rstd = _fwd_heads(rmsnorm_fwd_heads, "rmsnorm_fwd", x, residual, residual_out, weight, eps)
        return y, residual_out, rstd
    y, rstd = _rms_fwd(x, residual, residual_out, weight, eps)
    return y, residual_out, rstd


def rmsnorm_fwd(x, weight, eps):
    odd = _realigned("rmsnorm", "fwd", x)
    if odd:
        return _launch_realigned(odd, rmsnorm_fwd_odd, x, None, None, weight, eps)
    if x.dim() == 3:
        return _fwd_heads(rmsnorm_fwd_heads, "rmsnorm_fwd", x, None, None, weight, eps)
    return _rms_fwd(x, None, None, weight, eps)


def _rms_fwd(x, residual, residual_out, weight, eps):
    """The (M, N) RMSNorm forward (with the fused add where residual is given): the exchanging
    kernel where the choice names it and ``_fwd_exchange`` lets it run, else the row kernel. The
    fused add reads its own entry point, which falls back to rmsnorm's (``configs.FALLBACK_ENTRY``):
    reading x and residual once pays off for it at widths where it does not for RMSNorm."""
    choice = choose("rmsnorm_fwd" if residual is None else "add_rmsnorm_fwd", x)
    exchange = _fwd_exchange(choice, x, 1)
    if exchange is not None:
        return launch(rmsnorm_fwd_sync, exchange[0], x, residual, residual_out, weight, eps, *exchange[1:])
    return launch(rmsnorm_fwd_kernel, choice.config, x, residual, residual_out, weight, eps)


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
    dw = summed(dw_partial, weight.dtype) if weight is not None else None
    return (dx.view(t, n) if flat else dx), dw


# (N, dtype, device, with dresidual_out) -> the row factor whose config fits (see add_rmsnorm_bwd)
_FITS: dict = {}


def add_rmsnorm_bwd(dy, dresidual_out, residual_out, weight, rstd):
    """A config tuned for RMSNorm's two row tensors can ask more shared memory than the fused
    backward's three get (fp32 rows, for one): then the config of rows twice as long is taken, down
    to the column-split kernel, and remembered per N and dtype."""
    odd = _realigned("rmsnorm" if dresidual_out is None else "add_rmsnorm", "bwd", residual_out, dy, dresidual_out)
    if odd:
        dx, dw_partial = _launch_realigned(odd, rmsnorm_bwd_odd, dy, dresidual_out, residual_out, weight, rstd)
        return dx, summed(dw_partial, weight.dtype) if weight is not None else None
    if residual_out.dim() == 3:  # (T, H, N) rows: read in place, unless too wide to stay resident
        choice = choose("rmsnorm_bwd", residual_out)
        if choice.kernel not in (rmsnorm_bwd_split.name, rmsnorm_bwd_sync.name):
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
            if choice.kernel in (rmsnorm_bwd_split.name, rmsnorm_bwd_sync.name) or choice == failed:  # nothing smaller
                raise
            failed, rows = choice, rows * 2
            continue
        _FITS[key] = rows
        return out


def _bwd(choice, dy, dresidual_out, x, weight, rstd):
    if choice.kernel == rmsnorm_bwd_heads.name:
        return _rms_bwd_heads(choice, dy, dresidual_out, x, weight, rstd)
    exchange = _exchange(choice, x, 1)
    if exchange is not None:
        dx, dw_partial = launch(rmsnorm_bwd_sync, exchange[0], dy, dresidual_out, x, weight, rstd, *exchange[1:])
    elif choice.kernel in (rmsnorm_bwd_split.name, rmsnorm_bwd_sync.name):
        c = launch(rmsnorm_bwd_row_sums, choice.first_pass, dy, x, weight, rstd)
        dx, dw_partial = launch(rmsnorm_bwd_split, choice.config, dy, dresidual_out, x, weight, rstd, c)
    else:
        dx, dw_partial = launch(rmsnorm_bwd_resident, choice.config, dy, dresidual_out, x, weight, rstd)
    # Without a weight the kernels still fill dw_partial (one row per program): unused.
    dw = summed(dw_partial, weight.dtype) if weight is not None else None
    return dx, dw


def rmsnorm_bwd(dy, x, weight, rstd):
    return add_rmsnorm_bwd(dy, None, x, weight, rstd)


@kernel(**COMPILED)
def sum_partials_kernel(partial: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = the sum of the fp32 partial rows (P, N) over P, cast to out's dtype once: a column
    strip a program, its rows added in a fixed order (deterministic, no atomics)."""
    p, n = partial.size()
    for tile_n in hl.tile(n):
        acc = hl.zeros([tile_n], dtype=torch.float32)
        for tile_p in hl.tile(p):
            acc = acc + torch.sum(partial[tile_p, tile_n], dim=0)
        out[tile_n] = acc.to(out.dtype)
    return out


def summed(partial: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The backward's dw (or db) from its partial rows in one launch, where ATen's sum and the cast
    to the parameter's dtype took two (4 and 1.2 us on an H100 at (131072, 128), of a 44 us
    backward): 1 to 8.5 points of the copy bandwidth from N = 128 on (H100, bf16,
    reports/experiments/helion-sums/). Narrow column strips, so that even N = 128 spreads over
    several programs. Rows of 64 keep ATen's two launches: there the kernel's four strips each walk
    all the partial rows (one per row block of a short-row config, thousands), which ATen's
    reduction splits over many programs (5 points ahead)."""
    n = partial.shape[1]
    if n < 128:
        return partial.sum(0).to(dtype)
    block_n = min(max(triton.next_power_of_2(n) // 256, 16), 256)
    config = {"block_sizes": [block_n, 4096 // block_n], "num_warps": 4}
    return launch(sum_partials_kernel, config, partial, partial.new_empty(n, dtype=dtype))


# Re-reads of a row block's slots before an exchanging program gives up on a sibling (see the
# module docstring): ~2^20 L2 round trips, about a second, far beyond any real wait.
SPIN_LIMIT = 1 << 20


def _exchange(choice, x, planes: int):
    """The exchanging backward's (config, slots, groups, share, extra, spin) for (M, N) rows x under
    ``choice``, or None where it does not run: the choice names the split kernel, x is on the CPU
    (eager mode runs programs one after another: a wait would never end) or has no rows, or
    ``_exchange_grid`` says no."""
    if not choice.kernel.endswith("_bwd_sync") or not x.is_cuda or not x.shape[0]:
        return None
    return _exchange_grid(sync_config(choice.config), x, planes, sm_count(x.device))


def _fwd_exchange(choice, x, planes: int):
    """``_exchange`` for the forward: the exchanging forward's (config, slots, groups, share, extra,
    spin) for (M, N) rows x, or None where the row kernel runs instead: the choice names the row
    kernel, x is on the CPU or has no rows, or a row's slices outnumber the SMs."""
    if not choice.kernel.endswith("_fwd_sync") or not x.is_cuda or not x.shape[0]:
        return None
    return _exchange_grid(fwd_sync_config(choice), x, planes, sm_count(x.device))


# (N, slice width, device) -> each slice's columns, fp32 (LayerNorm's exchanging forward)
_COUNTS: dict = {}


def _slice_counts(n: int, width: int, device):
    """The columns of each ``width``-column slice of a row of n, fp32: all ``width`` but the last."""
    key = (n, width, device)
    if key not in _COUNTS:
        _COUNTS[key] = torch.tensor([min(width, n - s) for s in range(0, n, width)], dtype=torch.float32, device=device)
    return _COUNTS[key]


def _exchange_grid(config: dict, x, planes: int, sms: int):
    """``_exchange``'s launch arguments on a GPU of ``sms`` SMs, None where a row's slices outnumber
    them. The grid is ``groups`` x slices, no more programs than SMs, so that all siblings are
    resident together; the row blocks go to the groups as evenly as they can (``share`` each, one
    more to the first ``extra``). ``slots``: one int64 per (row, slice, row sum), zeroed on every
    call."""
    rows, width = config["block_sizes"]
    m, n = x.shape
    slices = -(-n // width)
    blocks = -(-m // rows)
    groups = exchange_groups(blocks, slices, sms)
    if not groups:
        return None
    slots = torch.zeros((m, slices) if planes == 1 else (m, slices, planes), dtype=torch.int64, device=x.device)
    return (config, slots, groups, *divmod(blocks, groups), SPIN_LIMIT)


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
def layernorm_bwd_sync(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    slots: torch.Tensor,
    groups: int,
    share: int,
    extra: int,
    spin: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """rmsnorm_bwd_sync for LayerNorm: each slice posts sum(g * (x - mean)) and sum(g) of its rows,
    ``slots`` (M, slices, 2)."""
    m, n = x.size()
    n = hl.specialize(n)
    hl.specialize(slots.size(1))
    hl.specialize(slots.size(2))
    rows_per_step = hl.register_block_size(m)
    slice_width = hl.register_block_size(n)
    dx = torch.empty([m, n], dtype=x.dtype, device=x.device)
    dw_partial = torch.empty([groups, n], dtype=torch.float32, device=x.device)
    db_partial = torch.empty([groups, n], dtype=torch.float32, device=x.device)
    for group, cols in hl.tile([groups, n], block_size=[1, slice_width]):
        # a run of row blocks, as many as every other group's or one more (``min`` here, not in a
        # helper: Helion traces a helper's Python ``min`` on symbols by their example values)
        begin = (group.begin * share + min(group.begin, extra)) * rows_per_step
        end = min(m, ((group.begin + 1) * share + min(group.begin + 1, extra)) * rows_per_step)
        dw_acc = hl.zeros([cols], dtype=torch.float32)
        db_acc = hl.zeros([cols], dtype=torch.float32)
        budget = hl.full([], spin, dtype=torch.int32)
        x_next, dy_next = _rows_ahead(x, dy, begin, end, rows_per_step, cols)
        for rows in hl.tile(begin, end, block_size=rows_per_step):
            xc = x_next.to(torch.float32) - mean[rows][:, None]
            dyf = dy_next.to(torch.float32)
            g = dyf
            if weight is not None:
                g = dyf * weight[cols].to(torch.float32)[None, :]
            hl.atomic_xchg(slots, [rows, cols.id, 0], _posted(torch.sum(g * xc, dim=-1)))
            hl.atomic_xchg(slots, [rows, cols.id, 1], _posted(torch.sum(g, dim=-1)))
            x_next, dy_next = _rows_ahead(x, dy, rows.begin + rows_per_step, end, rows_per_step, cols)
            sums = hl.atomic_add(slots, [rows, slice(None), slice(None)], 0)
            tries = hl.zeros([], dtype=torch.int32)
            while _unposted(sums) & (tries < budget):
                sums = hl.atomic_add(slots, [rows, slice(None), slice(None)], 0)
                tries = tries + 1
            budget = torch.where(_unposted(sums), 0, budget)
            sum_gxc, sum_g = hl.split(torch.sum(_values(sums), dim=1))
            rstd_rows = rstd[rows][:, None]
            xhat = xc * rstd_rows
            c_xhat = sum_gxc[:, None] * rstd_rows / n
            dx[rows, cols] = ((g - sum_g[:, None] / n - xhat * c_xhat) * rstd_rows).to(x.dtype)
            dw_acc = dw_acc + torch.sum(dyf * xhat, dim=0)
            db_acc = db_acc + torch.sum(dyf, dim=0)
        dw_partial[group.begin, cols] = dw_acc
        db_partial[group.begin, cols] = db_acc
    return dx, dw_partial, db_partial


@kernel(**COMPILED)
def layernorm_fwd_sync(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    counts: torch.Tensor,
    slots: torch.Tensor,
    groups: int,
    share: int,
    extra: int,
    spin: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """rmsnorm_fwd_sync for LayerNorm: each slice posts its rows' sum and the squared deviations from
    its own mean, ``slots`` (M, slices, 2), merged by Chan's formula with the slices' column
    counts ``counts`` ((slices,) fp32; see the module docstring). The first slice's programs store
    mean and rstd."""
    m, n = x.size()
    n = hl.specialize(n)
    hl.specialize(slots.size(1))
    hl.specialize(slots.size(2))
    hl.specialize(counts.size(0))
    rows_per_step = hl.register_block_size(m)
    slice_width = hl.register_block_size(n)
    y = torch.empty([m, n], dtype=x.dtype, device=x.device)
    mean = torch.empty([m], dtype=torch.float32, device=x.device)
    rstd = torch.empty([m], dtype=torch.float32, device=x.device)
    for group, cols in hl.tile([groups, n], block_size=[1, slice_width]):
        begin = (group.begin * share + min(group.begin, extra)) * rows_per_step
        end = min(m, ((group.begin + 1) * share + min(group.begin + 1, extra)) * rows_per_step)
        if weight is not None:
            w = weight[cols].to(torch.float32)[None, :]
        if bias is not None:
            b = bias[cols].to(torch.float32)[None, :]
        # the last slice may be partial: its lanes past the row must not add (0 - mean)^2
        in_row = (cols.index < n)[None, :]
        mine = counts[cols.id]
        columns = counts[None, :]  # every slice's, for the merge
        budget = hl.full([], spin, dtype=torch.int32)
        x_next, _ = _rows_ahead(x, None, begin, end, rows_per_step, cols)
        for rows in hl.tile(begin, end, block_size=rows_per_step):
            xf = x_next.to(torch.float32)
            part = torch.sum(xf, dim=-1)
            xc_part = torch.where(in_row, xf - (part / mine)[:, None], 0.0)
            hl.atomic_xchg(slots, [rows, cols.id, 0], _posted(part))
            hl.atomic_xchg(slots, [rows, cols.id, 1], _posted(torch.sum(xc_part * xc_part, dim=-1)))
            x_next, _ = _rows_ahead(x, None, rows.begin + rows_per_step, end, rows_per_step, cols)
            sums = hl.atomic_add(slots, [rows, slice(None), slice(None)], 0)
            tries = hl.zeros([], dtype=torch.int32)
            while _unposted(sums) & (tries < budget):
                sums = hl.atomic_add(slots, [rows, slice(None), slice(None)], 0)
                tries = tries + 1
            budget = torch.where(_unposted(sums), 0, budget)
            sum_s, m2_s = hl.split(_values(sums))
            mean_rows = torch.sum(sum_s, dim=-1) / n
            # Chan: the slices' own squared deviations plus each slice's mean's, weighted by its columns
            apart = sum_s / columns - mean_rows[:, None]
            var = (torch.sum(m2_s, dim=-1) + torch.sum(columns * apart * apart, dim=-1)) / n
            rstd_rows = torch.where(var < float("inf"), torch.rsqrt(var + eps), float("nan"))
            yf = (xf - mean_rows[:, None]) * rstd_rows[:, None]
            if weight is not None:
                yf = yf * w
            if bias is not None:
                yf = yf + b
            y[rows, cols] = yf.to(x.dtype)
            if cols.id == 0:
                mean[rows] = mean_rows
                rstd[rows] = rstd_rows
    return y, mean, rstd


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
    odd = _realigned("layernorm", "fwd", x)
    if odd:
        return _launch_realigned(odd, layernorm_fwd_odd, x, weight, bias, eps)
    if x.dim() == 3:
        return _fwd_heads(layernorm_fwd_heads, "layernorm_fwd", x, weight, bias, eps)
    choice = choose("layernorm_fwd", x)
    exchange = _fwd_exchange(choice, x, 2)
    if exchange is not None:
        config, *grid = exchange
        counts = _slice_counts(x.shape[1], config["block_sizes"][1], x.device)
        return launch(layernorm_fwd_sync, config, x, weight, bias, eps, counts, *grid)
    return launch(layernorm_fwd_kernel, choice.config, x, weight, bias, eps)


def layernorm_bwd(dy, x, weight, mean, rstd):
    odd = _realigned("layernorm", "bwd", x, dy)
    choice = odd or choose("layernorm_bwd", x)
    if odd:
        dx, dw_partial, db_partial = _launch_realigned(odd, layernorm_bwd_odd, dy, x, weight, mean, rstd)
    elif choice.kernel == layernorm_bwd_heads.name or (
        x.dim() == 3 and choice.kernel not in (layernorm_bwd_split.name, layernorm_bwd_sync.name)
    ):
        flat = x.dim() == 2
        if flat:
            dy, x = _as_heads(dy, x)
        t, h, n = x.shape
        dx, dw_partial, db_partial = launch(
            layernorm_bwd_heads, heads_config(choice, h), dy, x, weight, mean.view(t, h), rstd.view(t, h)
        )
        dx = dx.view(t, n) if flat else dx
    elif choice.kernel in (layernorm_bwd_split.name, layernorm_bwd_sync.name):
        if x.dim() == 3:  # too wide to stay resident: the (M, N) kernels, on a copy
            dy, x = dy.reshape(-1, x.shape[-1]), x.reshape(-1, x.shape[-1])
        exchange = _exchange(choice, x, 2)
        if exchange is not None:
            dx, dw_partial, db_partial = launch(
                layernorm_bwd_sync, exchange[0], dy, x, weight, mean, rstd, *exchange[1:]
            )
        else:
            c_xhat, c_mean = launch(layernorm_bwd_row_sums, choice.first_pass, dy, x, weight, mean, rstd)
            dx, dw_partial, db_partial = launch(
                layernorm_bwd_split, choice.config, dy, x, weight, mean, rstd, c_xhat, c_mean
            )
    else:
        dx, dw_partial, db_partial = launch(layernorm_bwd_resident, choice.config, dy, x, weight, mean, rstd)
    param_dtype = weight.dtype if weight is not None else x.dtype
    dw = summed(dw_partial, param_dtype) if weight is not None else None
    return dx, dw, summed(db_partial, param_dtype)


# ================================================================================ realigned rows
def _odd_columns(program, n: int, vec: int):
    """A realigned program's columns (see the module docstring): (head, j, the body's lanes, the
    edge's columns, its lanes). Its rows start ``head`` elements before their first whole vector,
    the body (a multiple of ``vec`` columns, column head + j at lane j) follows, and the head and
    tail (under ``vec`` each) form one short edge vector."""
    head = (vec - program * n % vec) % vec
    body = (n - head) // vec * vec
    j = hl.arange(1 << (n - 1).bit_length())
    k = hl.arange(2 * vec)
    return head, j, j < body, k + torch.where(k >= head, body, 0), k < n - body


def _odd_tile(rows, m, n: int, vec: int, j, in_body, edge_cols, in_edge):
    """Flat offsets of a tile of realigned rows: (row lanes, body offsets, edge offsets, body mask,
    edge mask). The body starts at the row's offset rounded up to a multiple of ``vec``, written as
    such so that the Triton compiler sees the alignment and moves whole 16-byte vectors. (Outside
    the kernel body Helion traces ``[:, None]`` as a slice it cannot lower: hence ``unsqueeze``.)"""
    in_rows = rows < m
    at = rows * n
    body_at = ((at + vec - 1) // vec * vec).unsqueeze(1) + j.unsqueeze(0)
    edge_at = at.unsqueeze(1) + edge_cols.unsqueeze(0)
    return in_rows, body_at, edge_at, in_rows.unsqueeze(1) & in_body.unsqueeze(0), in_rows.unsqueeze(1) & in_edge.unsqueeze(0)


def _load_shifted(p, head, j, in_body, edge_cols, in_edge):
    """A per-column vector (weight, bias) in a realigned program's columns: (body, edge), fp32."""
    body = hl.load(p, [head + j], extra_mask=in_body).to(torch.float32)
    return body.unsqueeze(0), hl.load(p, [edge_cols], extra_mask=in_edge).to(torch.float32).unsqueeze(0)


def _load_split(flat, body_at, edge_at, mask_b, mask_e):
    """A tile of realigned rows, fp32: (body, edge); lanes outside the rows read 0."""
    body = hl.load(flat, [body_at], extra_mask=mask_b).to(torch.float32)
    return body, hl.load(flat, [edge_at], extra_mask=mask_e).to(torch.float32)


def _store_split(flat, body_at, edge_at, mask_b, mask_e, body, edge):
    hl.store(flat, [body_at], body.to(flat.dtype), extra_mask=mask_b)
    hl.store(flat, [edge_at], edge.to(flat.dtype), extra_mask=mask_e)


def _row_sum(body, edge):
    """Per row, the sum of a realigned row's body and edge terms. Which columns are which depends
    on where the row starts within a vector, so the same row elsewhere in the batch can round
    differently (see the module docstring)."""
    return torch.sum(body, dim=-1) + torch.sum(edge, dim=-1)


def _flat(t):
    return None if t is None else t.view(-1)


@kernel(**COMPILED)
def rmsnorm_fwd_odd(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    residual_out: torch.Tensor | None,
    weight: torch.Tensor | None,
    eps: float,
    programs: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """rmsnorm_fwd_kernel on realigned rows: program p of ``programs`` (a multiple of the vector)
    takes rows p, p + programs, ..., a tile of them at a time (see the module docstring)."""
    m, n = x.size()
    n = hl.specialize(n)
    vec = 16 // x.itemsize
    y = torch.empty([m, n], dtype=x.dtype, device=x.device)
    rstd = torch.empty([m], dtype=torch.float32, device=x.device)
    x_flat, y_flat, r_flat, h_flat = _flat(x), _flat(y), _flat(residual), _flat(residual_out)
    slots = (m + programs - 1) // programs
    for p in hl.grid(programs):
        head, j, in_body, edge_cols, in_edge = _odd_columns(p, n, vec)
        if weight is not None:
            w_body, w_edge = _load_shifted(weight, head, j, in_body, edge_cols, in_edge)
        for slot in hl.tile(slots):
            rows = p + slot.index * programs
            in_rows, body_at, edge_at, mask_b, mask_e = _odd_tile(rows, m, n, vec, j, in_body, edge_cols, in_edge)
            xb, xe = _load_split(x_flat, body_at, edge_at, mask_b, mask_e)
            if residual is not None:
                rb, re = _load_split(r_flat, body_at, edge_at, mask_b, mask_e)
                hb, he = (xb + rb).to(x.dtype), (xe + re).to(x.dtype)
                _store_split(h_flat, body_at, edge_at, mask_b, mask_e, hb, he)
                xb, xe = hb.to(torch.float32), he.to(torch.float32)
            ms = _row_sum(xb * xb, xe * xe) / n
            rstd_rows = torch.where(ms < float("inf"), torch.rsqrt(ms + eps), float("nan"))
            yb, ye = xb * rstd_rows[:, None], xe * rstd_rows[:, None]
            if weight is not None:
                yb, ye = yb * w_body, ye * w_edge
            _store_split(y_flat, body_at, edge_at, mask_b, mask_e, yb, ye)
            hl.store(rstd, [rows], rstd_rows, extra_mask=in_rows)
    return y, rstd


@kernel(**COMPILED)
def rmsnorm_bwd_odd(
    dy: torch.Tensor,
    dresidual: torch.Tensor | None,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    rstd: torch.Tensor,
    programs: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """rmsnorm_bwd_resident on realigned rows (rows as in rmsnorm_fwd_odd): dw accumulates in the
    program's shifted columns and is written to its partial row in column order."""
    m, n = x.size()
    n = hl.specialize(n)
    vec = 16 // x.itemsize
    dx = torch.empty([m, n], dtype=x.dtype, device=x.device)
    dw_partial = torch.empty([programs, n], dtype=torch.float32, device=x.device)
    dy_flat, x_flat, dres_flat, dx_flat = _flat(dy), _flat(x), _flat(dresidual), _flat(dx)
    slots = (m + programs - 1) // programs
    for p in hl.grid(programs):
        head, j, in_body, edge_cols, in_edge = _odd_columns(p, n, vec)
        if weight is not None:
            w_body, w_edge = _load_shifted(weight, head, j, in_body, edge_cols, in_edge)
        dw_body = hl.zeros([j.size(0)], dtype=torch.float32)
        dw_edge = hl.zeros([2 * vec], dtype=torch.float32)
        for slot in hl.tile(slots):
            rows = p + slot.index * programs
            in_rows, body_at, edge_at, mask_b, mask_e = _odd_tile(rows, m, n, vec, j, in_body, edge_cols, in_edge)
            rstd_rows = hl.load(rstd, [rows], extra_mask=in_rows)[:, None]
            xb, xe = _load_split(x_flat, body_at, edge_at, mask_b, mask_e)
            dyb, dye = _load_split(dy_flat, body_at, edge_at, mask_b, mask_e)
            xhat_b, xhat_e = xb * rstd_rows, xe * rstd_rows
            gb, ge = dyb, dye
            if weight is not None:
                gb, ge = dyb * w_body, dye * w_edge
            c = _row_sum(gb * xhat_b, ge * xhat_e) / n
            dxb, dxe = (gb - xhat_b * c[:, None]) * rstd_rows, (ge - xhat_e * c[:, None]) * rstd_rows
            if dresidual is not None:
                dres_b, dres_e = _load_split(dres_flat, body_at, edge_at, mask_b, mask_e)
                dxb, dxe = dxb + dres_b, dxe + dres_e
            _store_split(dx_flat, body_at, edge_at, mask_b, mask_e, dxb, dxe)
            if weight is not None:
                dw_body = dw_body + torch.sum(dyb * xhat_b, dim=0)
                dw_edge = dw_edge + torch.sum(dye * xhat_e, dim=0)
        hl.store(dw_partial, [p, head + j], dw_body, extra_mask=in_body)
        hl.store(dw_partial, [p, edge_cols], dw_edge, extra_mask=in_edge)
    return dx, dw_partial


@kernel(**COMPILED)
def layernorm_fwd_odd(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float, programs: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """layernorm_fwd_kernel on realigned rows (rows as in rmsnorm_fwd_odd)."""
    m, n = x.size()
    n = hl.specialize(n)
    vec = 16 // x.itemsize
    y = torch.empty([m, n], dtype=x.dtype, device=x.device)
    mean = torch.empty([m], dtype=torch.float32, device=x.device)
    rstd = torch.empty([m], dtype=torch.float32, device=x.device)
    x_flat, y_flat = _flat(x), _flat(y)
    slots = (m + programs - 1) // programs
    for p in hl.grid(programs):
        head, j, in_body, edge_cols, in_edge = _odd_columns(p, n, vec)
        if weight is not None:
            w_body, w_edge = _load_shifted(weight, head, j, in_body, edge_cols, in_edge)
        if bias is not None:
            b_body, b_edge = _load_shifted(bias, head, j, in_body, edge_cols, in_edge)
        for slot in hl.tile(slots):
            rows = p + slot.index * programs
            in_rows, body_at, edge_at, mask_b, mask_e = _odd_tile(rows, m, n, vec, j, in_body, edge_cols, in_edge)
            xb, xe = _load_split(x_flat, body_at, edge_at, mask_b, mask_e)
            mean_rows = _row_sum(xb, xe) / n
            # centred lanes outside the row would be -mean: zero them before the squares
            xcb = torch.where(mask_b, xb - mean_rows[:, None], 0.0)
            xce = torch.where(mask_e, xe - mean_rows[:, None], 0.0)
            var = _row_sum(xcb * xcb, xce * xce) / n
            rstd_rows = torch.where(var < float("inf"), torch.rsqrt(var + eps), float("nan"))
            yb, ye = xcb * rstd_rows[:, None], xce * rstd_rows[:, None]
            if weight is not None:
                yb, ye = yb * w_body, ye * w_edge
            if bias is not None:
                yb, ye = yb + b_body, ye + b_edge
            _store_split(y_flat, body_at, edge_at, mask_b, mask_e, yb, ye)
            hl.store(mean, [rows], mean_rows, extra_mask=in_rows)
            hl.store(rstd, [rows], rstd_rows, extra_mask=in_rows)
    return y, mean, rstd


@kernel(**COMPILED)
def layernorm_bwd_odd(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    programs: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """layernorm_bwd_resident on realigned rows (rows as in rmsnorm_fwd_odd), dw and db accumulated
    in the program's shifted columns and written to its partial rows in column order."""
    m, n = x.size()
    n = hl.specialize(n)
    vec = 16 // x.itemsize
    dx = torch.empty([m, n], dtype=x.dtype, device=x.device)
    dw_partial = torch.empty([programs, n], dtype=torch.float32, device=x.device)
    db_partial = torch.empty([programs, n], dtype=torch.float32, device=x.device)
    dy_flat, x_flat, dx_flat = _flat(dy), _flat(x), _flat(dx)
    slots = (m + programs - 1) // programs
    for p in hl.grid(programs):
        head, j, in_body, edge_cols, in_edge = _odd_columns(p, n, vec)
        if weight is not None:
            w_body, w_edge = _load_shifted(weight, head, j, in_body, edge_cols, in_edge)
        dw_body = hl.zeros([j.size(0)], dtype=torch.float32)
        dw_edge = hl.zeros([2 * vec], dtype=torch.float32)
        db_body = hl.zeros([j.size(0)], dtype=torch.float32)
        db_edge = hl.zeros([2 * vec], dtype=torch.float32)
        for slot in hl.tile(slots):
            rows = p + slot.index * programs
            in_rows, body_at, edge_at, mask_b, mask_e = _odd_tile(rows, m, n, vec, j, in_body, edge_cols, in_edge)
            mean_rows = hl.load(mean, [rows], extra_mask=in_rows)[:, None]
            rstd_rows = hl.load(rstd, [rows], extra_mask=in_rows)[:, None]
            xb, xe = _load_split(x_flat, body_at, edge_at, mask_b, mask_e)
            dyb, dye = _load_split(dy_flat, body_at, edge_at, mask_b, mask_e)
            # lanes outside the row: x = 0 gives xhat = -mean * rstd there, but dy (hence g) is 0
            xhat_b, xhat_e = (xb - mean_rows) * rstd_rows, (xe - mean_rows) * rstd_rows
            gb, ge = dyb, dye
            if weight is not None:
                gb, ge = dyb * w_body, dye * w_edge
            c_xhat = _row_sum(gb * xhat_b, ge * xhat_e) / n
            c_mean = _row_sum(gb, ge) / n
            dxb = (gb - c_mean[:, None] - xhat_b * c_xhat[:, None]) * rstd_rows
            dxe = (ge - c_mean[:, None] - xhat_e * c_xhat[:, None]) * rstd_rows
            _store_split(dx_flat, body_at, edge_at, mask_b, mask_e, dxb, dxe)
            if weight is not None:
                dw_body = dw_body + torch.sum(dyb * xhat_b, dim=0)
                dw_edge = dw_edge + torch.sum(dye * xhat_e, dim=0)
            db_body = db_body + torch.sum(dyb, dim=0)
            db_edge = db_edge + torch.sum(dye, dim=0)
        hl.store(dw_partial, [p, head + j], dw_body, extra_mask=in_body)
        hl.store(dw_partial, [p, edge_cols], dw_edge, extra_mask=in_edge)
        hl.store(db_partial, [p, head + j], db_body, extra_mask=in_body)
        hl.store(db_partial, [p, edge_cols], db_edge, extra_mask=in_edge)
    return dx, dw_partial, db_partial


def _realigned(op: str, direction: str, x, *rows):
    """The realigned kernels' choice where they take these row tensors, else None: 16-bit rows of
    a length that fills no whole 16-byte vectors (``configs.is_odd``), (M, N) rows rather than
    per-head views, and every row tensor contiguous with a 16-byte aligned start, so that a row
    starts at the same offset within a vector in all of them. Their flat offsets are 32-bit: rows
    of 2^31 elements or more keep the row kernels."""
    if x.dim() != 2 or not x.shape[0] or not is_odd(x.shape[1], x.dtype) or x.numel() >= 2**31:
        return None
    if any(t is not None and (not t.is_contiguous() or t.data_ptr() % 16) for t in (x, *rows)):
        return None
    return choose_realigned(op, direction, x)


def _launch_realigned(choice, kernel, *args):
    """``kernel`` (a ``*_odd`` one) on its persistent grid (``configs.realigned_programs``); the
    first argument is the row tensor whose rows it walks."""
    x = args[0]
    return launch(kernel, choice.config, *args, realigned_programs(choice, x.shape[0], 16 // x.element_size(), x.device))
