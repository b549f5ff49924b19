"""RMSNorm, LayerNorm and add + RMSNorm, forward and backward, hand-written in cuTile Python
(``cuda.tile``: NVIDIA's tile-based kernels, compiled from Tile IR by ``tileiras``).

Per row of N elements, all arithmetic in fp32 (x, dy, w, b are upcast right after loading):

    RMSNorm     rstd = 1 / sqrt(mean(x^2) + eps)                            xhat = x * rstd
    LayerNorm   mean = mean(x),  rstd = 1 / sqrt(mean((x - mean)^2) + eps)  xhat = (x - mean) * rstd
    add+RMSNorm h = round_x_dtype(x + residual)  (stored: residual_out),     xhat = h * rstd(h)
    forward     y = xhat * w (+ b)
    backward    g = dy * w,  c1 = mean(g * xhat),  c2 = mean(g) (LayerNorm; 0 for RMSNorm)
                dx = rstd * (g - xhat * c1 - c2)  (+ dresidual_out for add+RMSNorm: dh)
                dw = sum over rows of dy * xhat,   db = sum over rows of dy

One set of kernels serves the three ops through compile-time flags (``ct.Constant`` parameters
``LAYERNORM``, ``HAS_RESIDUAL``, ``HAS_DRESIDUAL``): add + RMSNorm is RMSNorm whose row loader also
reads the residual and stores the sum, and whose backward adds dresidual_out before dx's rounding.

Design decisions:

* Tiles, not threads: a kernel loads ``[rows, width]`` tiles of the 2-D arrays by tile index
  (``ct.load(X, (block, chunk), shape)``) and the compiler spreads them over its threads. Arrays
  carry their shape and strides, so a column slice (row stride > N) is passed as the view it is
  and indexed through its stride: nothing is copied.
* Per-head views (the contract's ``row_views``): q and k cut from a fused QKV projection are
  (T, H, N) views with no (M, N) view of their rows. A tile of rows t * H + h is loaded as a
  [rows / h_r, h_r, N] tile of the 3-D array, h_r heads of one token (all H where a tile spans
  several tokens), and reshaped to [rows, N]: its row-major order is the contract's, so the
  statistics and outputs index rows as they do for (M, N) arrays (``_ld_rows``). Tiles are powers
  of two: where H is not one, a tile takes a power of two dividing H, and below 4 rows the view is
  copied (``head_rows``).
* Tile dimensions must be powers of two, N need not be: loads use ``PaddingMode.ZERO``, so the
  columns past N (and the rows past M in the last row block) read as 0 and add nothing to a sum,
  stores drop them, and where a padded 0 would not stay 0 (x - mean in LayerNorm) a column mask
  (``ct.arange`` < N) zeroes it. The tile shapes come from ``plan.py``.
* A persistent forward (the table's choice on the H100): a grid of a few programs per SM, each
  taking every k-th row block with the weight and bias loaded once: in the H100 search ahead of
  one program per block or level with it (RMSNorm N = 1024 92% against 78%, LayerNorm 8192 88%
  against 61%; best of each side over the other knobs).
* Rows wider than one tile (N up to 262144): the forward walks the row in chunks twice,
  statistics then y, the second pass last chunk first so that it starts on what the first pass
  read last (still in L2). LayerNorm's chunked statistics merge per-chunk (mean, sum of squared
  deviations) pairs (Chan et al.), never E[x^2] - E[x]^2. add + RMSNorm's second pass adds x and
  the residual again (the same rounding, the same h) instead of reading back the h its own program
  stored: no kernel here reads what it wrote. The backward cuts such rows into column slices, one
  program each, whose row reductions c1, c2 come from ``_bwd_row_sums_kernel``'s per-(row, slice)
  sums, added in slice order by every program that needs them (deterministic), or (``sync``) from
  the slices themselves: ``_bwd_sync_kernel``'s programs, one per SM so that all are resident,
  post their parts to global memory and wait for each other's, and x and dy are read once. The
  wait re-reads with atomics: a plain load in the loop was hoisted out of it by the compiler.
* Wide rows, forward, exchanging (``Tuning.fwd_sync``, ``_fwd_sync_kernel``): the chunked forward
  reads x twice, and with a row block per SM in flight rows of 49152 and more overflow the L2
  between the passes, so the second read comes from DRAM. Instead the row is cut into column
  slices, one program each, that exchange their partial statistics as the backward's do: each
  reads its slice once into registers, posts the slice's sum of squares (LayerNorm: its sum and
  its sum of squared deviations from the slice's own mean, two planes) through ``_post_sums``,
  loads its slice of the next block, waits through ``_await_parts`` (bounded: NaN rows where a
  sibling never posts, not a hang) and merges the parts in slice order, the same bits in every
  sibling. LayerNorm merges by Chan's formula (mean = sum of the sums / N, M2 = sum of the m2_s +
  sum of n_s (mean_s - mean)^2), never E[x^2] - E[x]^2. Its grid is the backward's, groups of
  slices one program per SM, every sibling resident; where a row has more slices than the GPU has
  SMs the launcher takes the chunked forward. Slice 0 stores mean and rstd.
* dweight / dbias without atomics: the backward is persistent, a grid of a few programs per SM
  (per column slice), each walking a contiguous range of row blocks and accumulating dw / db
  in fp32 tiles; each writes one partial row, and ``_sum_partials_kernel`` adds the partials in a
  fixed order and rounds once to the weight's dtype. The same inputs on the same GPU give the
  same bits.
* Weights and biases are loaded in their own dtype (x's, or fp32 for mixed precision) and
  upcast; dw and db are accumulated in fp32 and rounded once, to the weight's dtype.
* The sum of add + RMSNorm is rounded to x's dtype before the statistics: the unfused model
  stores h in x's dtype and normalises what it stored, so y must equal rmsnorm(residual_out) as
  stored, and the backward (which only sees the stored h) must match the forward's statistics.
* Statistics that overflow give NaN, never a finite wrong value: with |x| near 1e30 in bf16,
  x^2 overflows fp32 and the sum of squares is inf, so rsqrt gives 0 and y would silently become
  0 (RMSNorm) or the bias (LayerNorm). ``_rstd`` turns an infinite sum into a NaN rstd, which
  reaches y and, through the saved rstd, dx (torch's LayerNorm returns NaN there too).
* eps is a runtime fp32 argument (a Python float), M and N are read from the arrays' shapes
  inside the kernels: a kernel is compiled per dtype, flag set, tile shape and the alignment of
  its arrays (which cuTile's dispatcher specialises on), not per M, N or eps. cuTile indexes
  arrays with int32 shapes and strides: an x spanning 2^31 elements or more (rows x row
  stride) is refused with a ValueError rather than launched.

The host's choices (tile rows, a persistent forward grid, TMA, the compiler's occupancy and
worker-warp hints; ``plan.Tuning``) come from a table per GPU, op, direction and N bucket
(``configs.py``): on an H100 they took the same kernels from 20-66% of the copy bandwidth to
72-96% up to N = 8192. TMA wants row strides of whole 16-byte units, which N = 4001 in bf16 does not
have: the row kernels ran at 13-28% there (element-wise 2-byte accesses), and no host choice tried
moved them (TMA on or off for loads and stores, tile sizes, worker warps).

Realigned rows (16-bit rows whose length is no multiple of 8, contiguous, one tile wide; the
``_*_odd_kernel`` pair, chosen by ``takes_realigned``):

* Phases: row r starts r * N elements into the array, and 8 rows later 8N further, a whole number
  of vectors: rows r = i + 8k (phase i) all start at the same place within a vector. From its
  first whole vector on, a row's body (a multiple of 8 elements) is a row of the (rows, body) array
  of row stride 8N that ``_phase_body`` makes in the kernel (``Array.slice`` of the flat array at a
  multiple of 8, re-shaped with ``Array.from_foreign``): its start, strides and shape are
  multiples of 16 bytes, and cuTile's divisibility analysis sees it, so the bodies move as TMA
  boxes or 128-bit accesses, as aligned rows do. Nothing is copied.
* The head and tail (under 8 elements each) travel as one 16-lane edge tile, gathered and
  scattered element-wise through int32 offsets into the flat array; sums are body + edge.
* Program p takes phase p mod 8 (the grid is 8 programs per phase group), so its weight, bias and
  dweight / dbias columns are shifted by the phase's head, once: the weight's body is gathered,
  stored to the phase's row of an aligned fp32 scratch and loaded back as a tile. Gathered and used
  directly, its element-wise layout forced every x tile into it through shared memory (2-byte
  shared loads per element in every row block); loaded, it takes x's layout.
* Every program writes its partial dweight / dbias row in natural column order (element-wise,
  once), so ``_sum_partials_kernel`` adds them as it adds the row kernels'.
* Not batch invariant at these widths: which columns are body and which edge depends on a row's
  phase, so its sums round differently at another place in the batch.

Without a GPU: cuTile has no CPU interpreter, but ``tileiras`` compiles without one. The tests
compile every kernel for sm_90 (``compile_only``: the host code below builds the same launches and
``cuda.tile.compilation.export_kernel`` turns each into a cubin) on every row regime and dtype.

Measurements behind these choices: docs/kernels/cutile.md.
"""

from __future__ import annotations

import functools
import io
import math

import cuda.tile as ct
import torch

from harness.spec.contract import contract_functions
from harness.spec.validation import has_no_row_view

from . import configs
from . import plan as _plan_module
from .plan import (PHASES, Plan, backward_groups, forward_programs, fwd_sync_plan, next_pow2, plan, realigned,
                   realigned_programs, sync_groups)

ConstBool = ct.Constant[bool]
ConstInt = ct.Constant[int]
ZERO = ct.PaddingMode.ZERO


# ========================================================================== device functions
def _ld(A, index, shape, TMA, LATENCY):
    """``ct.load`` zero-padded past the array, with the plan's memory hints: TMA or not, and a DRAM
    latency hint (0: the compiler's own)."""
    if LATENCY > 0:
        t = ct.load(A, index=index, shape=shape, padding_mode=ZERO, allow_tma=TMA, latency=LATENCY)
    else:
        t = ct.load(A, index=index, shape=shape, padding_mode=ZERO, allow_tma=TMA)
    return t


def _st(A, index, tile, TMA, LATENCY):
    if LATENCY > 0:
        ct.store(A, index=index, tile=tile, allow_tma=TMA, latency=LATENCY)
    else:
        ct.store(A, index=index, tile=tile, allow_tma=TMA)


def _ld_rows(A, block, chunk, ROWS, BLOCK_N, HEAD_ROWS, TMA, LATENCY):
    """Rows [block * ROWS, +ROWS) x column tile ``chunk`` of the contract's rows, as a [ROWS,
    BLOCK_N] tile: of an (M, N) array (HEAD_ROWS 0), or of a (T, H, N) per-head view, loaded as a
    [ROWS / HEAD_ROWS, HEAD_ROWS, BLOCK_N] tile (HEAD_ROWS divides H, and is H where the tile spans
    several tokens) whose row-major order is the rows' order t * H + h."""
    if HEAD_ROWS == 0:
        t = _ld(A, (block, chunk), (ROWS, BLOCK_N), TMA, LATENCY)
    else:
        per_token = A.shape[1] // HEAD_ROWS
        t = _ld(A, (block // per_token, block % per_token, chunk), (ROWS // HEAD_ROWS, HEAD_ROWS, BLOCK_N), TMA, LATENCY)
        t = ct.reshape(t, (ROWS, BLOCK_N))
    return t


def _load_row_hinted(X, R, H, block, chunk, ROWS, BLOCK_N, HEAD_ROWS, HAS_RESIDUAL, TMA_LOAD, TMA_STORE, LATENCY):
    """The [ROWS, BLOCK_N] tile to normalise, as fp32: x, or h = x + residual rounded to x's
    dtype and stored (H: (M, N) rows, whatever x's layout)."""
    x = _ld_rows(X, block, chunk, ROWS, BLOCK_N, HEAD_ROWS, TMA_LOAD, LATENCY)
    if HAS_RESIDUAL:
        r = _ld_rows(R, block, chunk, ROWS, BLOCK_N, HEAD_ROWS, TMA_LOAD, LATENCY)
        x = ct.astype(ct.astype(x, ct.float32) + ct.astype(r, ct.float32), X.dtype)
        _st(H, (block, chunk), x, TMA_STORE, LATENCY)
    return ct.astype(x, ct.float32)


def _rstd(sum_sq, n, eps):
    """1 / sqrt(sum_sq / n + eps); NaN where the sum of squares overflowed (see the docstring)."""
    return ct.where(sum_sq == math.inf, math.nan, ct.rsqrt(sum_sq / n + eps))


def _param(P, chunk, BLOCK_N):
    """Columns [chunk * BLOCK_N, +BLOCK_N) of a (N,) parameter, fp32, 0 past N."""
    return ct.astype(ct.load(P, index=(chunk,), shape=(BLOCK_N,), padding_mode=ZERO), ct.float32)


def _affine(y, W, B, chunk, BLOCK_N, HAS_WEIGHT, HAS_BIAS):
    if HAS_WEIGHT:
        y = y * _param(W, chunk, BLOCK_N)
    if HAS_BIAS:
        y = y + _param(B, chunk, BLOCK_N)
    return y


def _column_mask(chunk, BLOCK_N, n):
    return chunk * BLOCK_N + ct.arange(BLOCK_N, dtype=ct.int32) < n


def _row_stat(S, block, ROWS):
    """A (M,) fp32 statistic for the block's rows, as a [ROWS, 1] column (0 past M)."""
    return ct.reshape(ct.load(S, index=(block,), shape=(ROWS,), padding_mode=ZERO), (ROWS, 1))


# ==================================================================================== forward
def _fwd_kernel(
    X, R, W, B, Y, H, MEAN, RSTD, eps,
    LAYERNORM: ConstBool, HAS_WEIGHT: ConstBool, HAS_BIAS: ConstBool, HAS_RESIDUAL: ConstBool,
    ROWS: ConstInt, BLOCK_N: ConstInt, CHUNKED: ConstBool, TMA_LOAD: ConstBool, TMA_STORE: ConstBool,
    LATENCY: ConstInt, HEAD_ROWS: ConstInt,
):  # fmt: skip
    """Row blocks of ROWS rows, program p taking blocks p, p + programs, ...: the whole row in one
    tile (BLOCK_N >= N), or, with CHUNKED, walked twice in chunks of BLOCK_N columns. With as many
    programs as blocks, each takes one. X and R: (M, N) rows or per-head views (``_ld_rows``); Y
    and H are (M, N). (A kernel through ``_kernel``, which adds the plan's occupancy.)"""
    n = Y.shape[1]
    n_blocks = ct.cdiv(Y.shape[0], ROWS)
    if not CHUNKED:
        # weight and bias loaded once per program, not once per row block
        w = ct.full((BLOCK_N,), 1.0, dtype=ct.float32)
        b = ct.full((BLOCK_N,), 0.0, dtype=ct.float32)
        if HAS_WEIGHT:
            w = _param(W, 0, BLOCK_N)
        if HAS_BIAS:
            b = _param(B, 0, BLOCK_N)
        for block in range(ct.bid(0), n_blocks, ct.num_blocks(0)):
            x = _load_row_hinted(X, R, H, block, 0, ROWS, BLOCK_N, HEAD_ROWS, HAS_RESIDUAL, TMA_LOAD, TMA_STORE, LATENCY)
            if LAYERNORM:
                mean = ct.sum(x, axis=1, keepdims=True) / n
                # centre in registers before squaring (two-pass variance): E[x^2] - E[x]^2 cancels badly
                x = ct.where(_column_mask(0, BLOCK_N, n), x - mean, 0.0)
                ct.store(MEAN, index=(block,), tile=ct.reshape(mean, (ROWS,)))
            rstd = _rstd(ct.sum(x * x, axis=1, keepdims=True), n, eps)
            ct.store(RSTD, index=(block,), tile=ct.reshape(rstd, (ROWS,)))
            y = x * rstd
            if HAS_WEIGHT:
                y = y * w
            if HAS_BIAS:
                y = y + b
            _st(Y, (block, 0), ct.astype(y, Y.dtype), TMA_STORE, LATENCY)
    else:
        for block in range(ct.bid(0), n_blocks, ct.num_blocks(0)):
            n_chunks = ct.cdiv(n, BLOCK_N)
            # pass 1: the statistics (and h, stored, for add + RMSNorm)
            mean = ct.zeros((ROWS, 1), dtype=ct.float32)
            m2 = ct.zeros((ROWS, 1), dtype=ct.float32)
            sum_sq = ct.zeros((ROWS, BLOCK_N), dtype=ct.float32)
            for c in range(n_chunks):
                x = _load_row_hinted(X, R, H, block, c, ROWS, BLOCK_N, HEAD_ROWS, HAS_RESIDUAL, TMA_LOAD, TMA_STORE, LATENCY)
                if LAYERNORM:
                    seen = ct.astype(c * BLOCK_N, ct.float32)
                    count = ct.astype(ct.minimum(n - c * BLOCK_N, BLOCK_N), ct.float32)
                    chunk_mean = ct.sum(x, axis=1, keepdims=True) / count
                    dev = ct.where(_column_mask(c, BLOCK_N, n), x - chunk_mean, 0.0)
                    delta = chunk_mean - mean
                    total = seen + count
                    mean = mean + delta * (count / total)
                    m2 = m2 + ct.sum(dev * dev, axis=1, keepdims=True) + delta * delta * (seen * count / total)
                else:
                    sum_sq = sum_sq + x * x
            if LAYERNORM:
                rstd = _rstd(m2, n, eps)
                ct.store(MEAN, index=(block,), tile=ct.reshape(mean, (ROWS,)))
            else:
                rstd = _rstd(ct.sum(sum_sq, axis=1, keepdims=True), n, eps)
            ct.store(RSTD, index=(block,), tile=ct.reshape(rstd, (ROWS,)))

            # pass 2, last chunk first (still in L2): y, from x (and h again from x and the residual)
            for i in range(n_chunks):
                c = n_chunks - 1 - i
                x = ct.astype(_ld_rows(X, block, c, ROWS, BLOCK_N, HEAD_ROWS, TMA_LOAD, LATENCY), ct.float32)
                if HAS_RESIDUAL:
                    r = _ld_rows(R, block, c, ROWS, BLOCK_N, HEAD_ROWS, TMA_LOAD, LATENCY)
                    x = ct.astype(ct.astype(x + ct.astype(r, ct.float32), X.dtype), ct.float32)
                if LAYERNORM:
                    x = x - mean
                y = _affine(x * rstd, W, B, c, BLOCK_N, HAS_WEIGHT, HAS_BIAS)
                _st(Y, (block, c), ct.astype(y, Y.dtype), TMA_STORE, LATENCY)


# =================================================================================== backward
def _bwd_terms(DY, X, w, MEAN, block, me, n, ROWS, BLOCK_N, HEAD_ROWS, LAYERNORM, HAS_WEIGHT, TMA_LOAD, LATENCY):
    """(x - mean or x, dy, g = dy * w) in fp32 for the block's rows and slice ``me``; 0 past M
    and past N. ``w``: the slice's weight, fp32, loaded once per program."""
    x = ct.astype(_ld_rows(X, block, me, ROWS, BLOCK_N, HEAD_ROWS, TMA_LOAD, LATENCY), ct.float32)
    dy = ct.astype(_ld_rows(DY, block, me, ROWS, BLOCK_N, HEAD_ROWS, TMA_LOAD, LATENCY), ct.float32)
    if LAYERNORM:
        x = ct.where(_column_mask(me, BLOCK_N, n), x - _row_stat(MEAN, block, ROWS), 0.0)
    g = dy
    if HAS_WEIGHT:
        g = dy * w
    return x, dy, g


@ct.kernel
def _bwd_row_sums_kernel(
    DY, X, W, MEAN, ROW_SUMS,
    LAYERNORM: ConstBool, HAS_WEIGHT: ConstBool, ROWS: ConstInt, BLOCK_N: ConstInt, TMA_LOAD: ConstBool,
    LATENCY: ConstInt, HEAD_ROWS: ConstInt,
):  # fmt: skip
    """ROW_SUMS[0, row, s] = sum over slice s of g * (x - mean); ROW_SUMS[1, row, s] = of g."""
    block = ct.bid(0)
    me = ct.bid(1)
    w = _param(W, me, BLOCK_N)
    n = X.shape[1]
    if HEAD_ROWS > 0:
        n = X.shape[2]
    xc, dy, g = _bwd_terms(DY, X, w, MEAN, block, me, n, ROWS, BLOCK_N, HEAD_ROWS, LAYERNORM, HAS_WEIGHT, TMA_LOAD,
                           LATENCY)  # fmt: skip
    ct.store(ROW_SUMS, index=(0, block, me), tile=ct.reshape(ct.sum(g * xc, axis=1), (1, ROWS, 1)))
    if LAYERNORM:
        ct.store(ROW_SUMS, index=(1, block, me), tile=ct.reshape(ct.sum(g, axis=1), (1, ROWS, 1)))


def _slice_sums(ROW_SUMS, k, block, ROWS, SLICES_P2):
    """The slices' sums of one row quantity, added in slice order: [ROWS, 1]."""
    sums = ct.load(ROW_SUMS, index=(k, block, 0), shape=(1, ROWS, SLICES_P2), padding_mode=ZERO)
    return ct.sum(ct.reshape(sums, (ROWS, SLICES_P2)), axis=1, keepdims=True)


def _group_blocks(m, ROWS):
    """(first, count, all) row blocks of ROWS rows of m for this program's group (``ct.bid(0)`` of
    ``ct.num_blocks(0)``): a contiguous range, the groups' sizes differing by at most one, so that
    no program idles while another finishes a double share."""
    group = ct.bid(0)
    groups = ct.num_blocks(0)
    n_blocks = ct.cdiv(m, ROWS)
    share = n_blocks // groups
    extra = n_blocks % groups
    return group * share + ct.minimum(group, extra), share + ct.astype(group < extra, ct.int32), n_blocks


def _bwd_kernel(
    DY, X, W, MEAN, RSTD, DRES, ROW_SUMS, DX, DW_PARTIAL, DB_PARTIAL,
    LAYERNORM: ConstBool, HAS_WEIGHT: ConstBool, HAS_DRESIDUAL: ConstBool,
    ROWS: ConstInt, BLOCK_N: ConstInt, SLICES: ConstInt, SLICES_P2: ConstInt, TMA_LOAD: ConstBool,
    TMA_STORE: ConstBool, LATENCY: ConstInt, ACC_ROWS: ConstBool, HEAD_ROWS: ConstInt,
):  # fmt: skip
    """Program (group, slice) owns columns [slice * BLOCK_N, +BLOCK_N) of its group's row blocks
    (SLICES = 1: the whole row, whose reductions it computes itself). ACC_ROWS: dweight / dbias
    accumulate per row of the tile and are summed over the rows once, at the end, instead of a
    column reduction per row block."""
    group = ct.bid(0)
    me = ct.bid(1)
    n = DX.shape[1]
    first, count, _ = _group_blocks(DX.shape[0], ROWS)
    dw = ct.zeros((1, BLOCK_N), dtype=ct.float32)
    db = ct.zeros((1, BLOCK_N), dtype=ct.float32)
    dw_rows = ct.zeros((ROWS, BLOCK_N), dtype=ct.float32)
    db_rows = ct.zeros((ROWS, BLOCK_N), dtype=ct.float32)
    w = _param(W, me, BLOCK_N)
    for i in range(count):
        block = first + i
        xc, dy, g = _bwd_terms(DY, X, w, MEAN, block, me, n, ROWS, BLOCK_N, HEAD_ROWS, LAYERNORM, HAS_WEIGHT, TMA_LOAD,
                               LATENCY)  # fmt: skip
        rstd = _row_stat(RSTD, block, ROWS)
        if SLICES == 1:
            sum_gxc = ct.sum(g * xc, axis=1, keepdims=True)
        else:
            sum_gxc = _slice_sums(ROW_SUMS, 0, block, ROWS, SLICES_P2)
        xhat = xc * rstd
        dx = g - xhat * (sum_gxc * rstd / n)
        if LAYERNORM:
            if SLICES == 1:
                sum_g = ct.sum(g, axis=1, keepdims=True)
            else:
                sum_g = _slice_sums(ROW_SUMS, 1, block, ROWS, SLICES_P2)
            dx = dx - sum_g / n
            if ACC_ROWS:
                db_rows = db_rows + dy
            else:
                db = db + ct.sum(dy, axis=0, keepdims=True)
        dx = dx * rstd
        if HAS_DRESIDUAL:
            dres = _ld_rows(DRES, block, me, ROWS, BLOCK_N, HEAD_ROWS, TMA_LOAD, LATENCY)
            dx = dx + ct.astype(dres, ct.float32)
        if HAS_WEIGHT:
            if ACC_ROWS:
                dw_rows = dw_rows + dy * xhat
            else:
                dw = dw + ct.sum(dy * xhat, axis=0, keepdims=True)
        _st(DX, (block, me), ct.astype(dx, DX.dtype), TMA_STORE, LATENCY)
    if ACC_ROWS:
        dw = ct.sum(dw_rows, axis=0, keepdims=True)
        db = ct.sum(db_rows, axis=0, keepdims=True)
    if HAS_WEIGHT:
        ct.store(DW_PARTIAL, index=(group, me), tile=dw)
    if LAYERNORM:
        ct.store(DB_PARTIAL, index=(group, me), tile=db)


# Re-reads of a row's posted sums before a program gives up on a sibling (``_await_sums``): about
# 2^20 L2 round trips, a second or so, far beyond any real wait.
SPIN_LIMIT = 1 << 20
FLAG = 1 << 32  # a slot's "posted" bit, above the fp32 value in its low half


def _post_sums(SLOTS, block, me, value, ROWS):
    """Post one slice's sums of the block's rows ([ROWS] fp32) to SLOTS[row, me] for the siblings:
    the value's bits in the low half of an int64 slot and ``FLAG`` above them, in one atomic
    exchange, so that a reader who sees the flag sees the value with it. Rows past M fall outside
    the array and are not written. Acquire-release, unlike the reads in ``_await_sums``: no later
    operation (the wait) may move before it."""
    bits = ct.astype(ct.bitcast(value, ct.uint32), ct.int64)  # zero-extended
    rows = block * ROWS + ct.arange(ROWS, dtype=ct.int32)
    ct.atomic_xchg(SLOTS, (rows, me), ct.bitwise_or(bits, FLAG))


def _await_sums(SLOTS, block, ROWS, SLICES, SUMS, SLICES_P2, spin):
    """The block's rows' sums over all slices, once every slice has posted its part, for each of
    the SUMS row quantities: ``_await_parts``, added in slice order, so that every sibling gets the
    same bits and the result is the same run to run. Returns ([ROWS, SUMS, 1] sums, spin left)."""
    value, left = _await_parts(SLOTS, block, ROWS, SLICES, SUMS, SLICES_P2, spin)
    return ct.sum(value, axis=2, keepdims=True), left


def _await_parts(SLOTS, block, ROWS, SLICES, SUMS, SLICES_P2, spin):
    """The block's rows' parts from every slice, once every slice has posted its part, for each of
    the SUMS row quantities (SLOTS[row, k * SLICES + slice]): the row's slots re-read until every
    one carries the flag. They are re-read by atomic ORs of 0 at L2: a plain load
    re-read in the loop was taken for loop-invariant (rows whose siblings posted late kept waiting
    until the bound), and an atomic is done every time; relaxed, since the value is all there is
    to read (an acquire's fence would also wait for the next block's loads, in flight by then).
    LayerNorm's two sums share one wait. A slot still empty after ``spin`` re-reads (a sibling
    that never ran: only if the grid outgrew what the GPU holds at once, which the launcher
    prevents) makes its row's sum NaN, a visibly wrong dx, not a hang; what is left of ``spin``
    comes back, so that a program waits out one bound at most. Returns ([ROWS, SUMS, SLICES_P2]
    parts, 0 past the slices and past M; spin left)."""
    rows = ct.reshape(block * ROWS + ct.arange(ROWS, dtype=ct.int32), (ROWS, 1, 1))
    k = ct.reshape(ct.arange(SUMS, dtype=ct.int32), (1, SUMS, 1))
    lanes = ct.reshape(ct.arange(SLICES_P2, dtype=ct.int32), (1, 1, SLICES_P2))
    valid = (rows < SLOTS.shape[0]) & (lanes < SLICES)  # past M or past the slices: nothing to wait for
    zero = ct.zeros((1, 1, 1), dtype=ct.int64)
    relaxed = ct.MemoryOrder.RELAXED
    v = ct.atomic_or(SLOTS, (rows, k * SLICES + lanes), zero, memory_order=relaxed)
    missing = ct.sum(ct.astype(valid & (v < FLAG), ct.int32))
    tries = 0
    while (missing > 0) & (tries < spin):
        v = ct.atomic_or(SLOTS, (rows, k * SLICES + lanes), zero, memory_order=relaxed)
        missing = ct.sum(ct.astype(valid & (v < FLAG), ct.int32))
        tries += 1
    value = ct.bitcast(ct.astype(ct.bitwise_and(v, FLAG - 1), ct.uint32), ct.float32)
    value = ct.where(valid & (v < FLAG), math.nan, ct.where(valid, value, 0.0))
    left = ct.where(missing > 0, 0, spin - tries)
    return value, left


def _bwd_sync_kernel(
    DY, X, W, MEAN, RSTD, DRES, SLOTS, DX, DW_PARTIAL, DB_PARTIAL,
    LAYERNORM: ConstBool, HAS_WEIGHT: ConstBool, HAS_DRESIDUAL: ConstBool,
    ROWS: ConstInt, BLOCK_N: ConstInt, SLICES: ConstInt, SLICES_P2: ConstInt, TMA_LOAD: ConstBool,
    TMA_STORE: ConstBool, LATENCY: ConstInt, HEAD_ROWS: ConstInt, SPIN: ConstInt,
):  # fmt: skip
    """``_bwd_kernel``'s sliced rows with the row sums exchanged between the slices of a row group
    (program (group, slice)) instead of read from the first kernel's: each program posts its
    slice's sums of a row block (``_post_sums``), loads its slice of the next block, then waits for
    the other slices' sums (``_await_sums``) and computes dx, so x and dy are read once and the
    wait overlaps the next block's loads. Every program of the grid must be resident at once (the
    launcher keeps it to one per SM)."""
    group = ct.bid(0)
    me = ct.bid(1)
    n = DX.shape[1]
    first, count, n_blocks = _group_blocks(DX.shape[0], ROWS)
    dw = ct.zeros((ROWS, BLOCK_N), dtype=ct.float32)
    db = ct.zeros((ROWS, BLOCK_N), dtype=ct.float32)
    w = _param(W, me, BLOCK_N)
    spin = SPIN
    x_next = _ld_rows(X, first, me, ROWS, BLOCK_N, HEAD_ROWS, TMA_LOAD, LATENCY)
    dy_next = _ld_rows(DY, first, me, ROWS, BLOCK_N, HEAD_ROWS, TMA_LOAD, LATENCY)
    for i in range(count):
        block = first + i
        x = ct.astype(x_next, ct.float32)
        dy = ct.astype(dy_next, ct.float32)
        if LAYERNORM:
            x = ct.where(_column_mask(me, BLOCK_N, n), x - _row_stat(MEAN, block, ROWS), 0.0)
        g = dy
        if HAS_WEIGHT:
            g = dy * w
        _post_sums(SLOTS, block, me, ct.sum(g * x, axis=1), ROWS)
        if LAYERNORM:
            _post_sums(SLOTS, block, SLICES + me, ct.sum(g, axis=1), ROWS)
        # the next block's slice; past the range, a block that is read and never used (within the
        # array: a tile wholly outside it is undefined behaviour in cuTile)
        ahead = ct.minimum(block + 1, n_blocks - 1)
        x_next = _ld_rows(X, ahead, me, ROWS, BLOCK_N, HEAD_ROWS, TMA_LOAD, LATENCY)
        dy_next = _ld_rows(DY, ahead, me, ROWS, BLOCK_N, HEAD_ROWS, TMA_LOAD, LATENCY)
        rstd = _row_stat(RSTD, block, ROWS)
        sums, spin = _await_sums(SLOTS, block, ROWS, SLICES, 1 + int(LAYERNORM), SLICES_P2, spin)
        xhat = x * rstd
        dx = g - xhat * (ct.reshape(ct.extract(sums, (0, 0, 0), (ROWS, 1, 1)), (ROWS, 1)) * rstd / n)
        if LAYERNORM:
            dx = dx - ct.reshape(ct.extract(sums, (0, 1, 0), (ROWS, 1, 1)), (ROWS, 1)) / n
            db = db + dy
        dx = dx * rstd
        if HAS_DRESIDUAL:
            dx = dx + ct.astype(_ld_rows(DRES, block, me, ROWS, BLOCK_N, HEAD_ROWS, TMA_LOAD, LATENCY), ct.float32)
        if HAS_WEIGHT:
            dw = dw + dy * xhat
        _st(DX, (block, me), ct.astype(dx, DX.dtype), TMA_STORE, LATENCY)
    if HAS_WEIGHT:
        ct.store(DW_PARTIAL, index=(group, me), tile=ct.sum(dw, axis=0, keepdims=True))
    if LAYERNORM:
        ct.store(DB_PARTIAL, index=(group, me), tile=ct.sum(db, axis=0, keepdims=True))


def _fwd_sync_kernel(
    X, R, W, B, Y, H, MEAN, RSTD, SLOTS, eps,
    LAYERNORM: ConstBool, HAS_WEIGHT: ConstBool, HAS_BIAS: ConstBool, HAS_RESIDUAL: ConstBool,
    ROWS: ConstInt, BLOCK_N: ConstInt, SLICES: ConstInt, SLICES_P2: ConstInt, TMA_LOAD: ConstBool,
    TMA_STORE: ConstBool, LATENCY: ConstInt, HEAD_ROWS: ConstInt, SPIN: ConstInt,
):  # fmt: skip
    """The forward of rows cut into column slices, program (group, slice) owning columns
    [slice * BLOCK_N, +BLOCK_N) of its group's contiguous range of row blocks (``_group_blocks``):
    each program reads its slice of a block once, posts the slice's partial statistics
    (``_post_sums``: the sum of squares; LayerNorm's sum and sum of squared deviations from the
    slice's own mean, two planes), loads its slice of the next block, waits for the siblings'
    parts (``_await_parts``), merges them in slice order and writes y from the registers. Every
    program of the grid must be resident at once (the launcher keeps it to one per SM)."""
    me = ct.bid(1)
    n = Y.shape[1]
    first, count, n_blocks = _group_blocks(Y.shape[0], ROWS)
    # the slice's weight and bias, loaded once per program
    w = ct.full((BLOCK_N,), 1.0, dtype=ct.float32)
    b = ct.full((BLOCK_N,), 0.0, dtype=ct.float32)
    if HAS_WEIGHT:
        w = _param(W, me, BLOCK_N)
    if HAS_BIAS:
        b = _param(B, me, BLOCK_N)
    # each slice's valid columns (the last may be partial; 0 past the slices), for Chan's merge
    lanes = ct.reshape(ct.arange(SLICES_P2, dtype=ct.int32), (1, 1, SLICES_P2))
    widths = ct.astype(ct.maximum(ct.minimum(n - lanes * BLOCK_N, BLOCK_N), 0), ct.float32)
    mine = ct.astype(ct.minimum(n - me * BLOCK_N, BLOCK_N), ct.float32)
    spin = SPIN
    x_next = _ld_rows(X, first, me, ROWS, BLOCK_N, HEAD_ROWS, TMA_LOAD, LATENCY)
    r_next = x_next
    if HAS_RESIDUAL:
        r_next = _ld_rows(R, first, me, ROWS, BLOCK_N, HEAD_ROWS, TMA_LOAD, LATENCY)
    for i in range(count):
        block = first + i
        x = x_next
        if HAS_RESIDUAL:
            x = ct.astype(ct.astype(x, ct.float32) + ct.astype(r_next, ct.float32), X.dtype)
            _st(H, (block, me), x, TMA_STORE, LATENCY)
        x = ct.astype(x, ct.float32)
        if LAYERNORM:
            part_sum = ct.sum(x, axis=1, keepdims=True)
            dev = ct.where(_column_mask(me, BLOCK_N, n), x - part_sum / mine, 0.0)
            _post_sums(SLOTS, block, me, ct.reshape(part_sum, (ROWS,)), ROWS)
            _post_sums(SLOTS, block, SLICES + me, ct.sum(dev * dev, axis=1), ROWS)
        else:
            _post_sums(SLOTS, block, me, ct.sum(x * x, axis=1), ROWS)
        # the next block's slice, in flight during the wait; past the range, a block that is read
        # and never used (within the array: a tile wholly outside it is undefined behaviour)
        ahead = ct.minimum(block + 1, n_blocks - 1)
        x_next = _ld_rows(X, ahead, me, ROWS, BLOCK_N, HEAD_ROWS, TMA_LOAD, LATENCY)
        if HAS_RESIDUAL:
            r_next = _ld_rows(R, ahead, me, ROWS, BLOCK_N, HEAD_ROWS, TMA_LOAD, LATENCY)
        parts, spin = _await_parts(SLOTS, block, ROWS, SLICES, 1 + int(LAYERNORM), SLICES_P2, spin)
        if LAYERNORM:
            sums = ct.extract(parts, (0, 0, 0), (ROWS, 1, SLICES_P2))
            m2s = ct.extract(parts, (0, 1, 0), (ROWS, 1, SLICES_P2))
            mean = ct.sum(sums, axis=2, keepdims=True) / n
            # Chan et al.: the slices' squared deviations plus each slice's mean's from the row's
            part_mean = ct.where(widths > 0, sums / ct.maximum(widths, 1.0), 0.0)
            spread = widths * (part_mean - mean) * (part_mean - mean)
            m2 = ct.sum(m2s, axis=2, keepdims=True) + ct.sum(spread, axis=2, keepdims=True)
            mean = ct.reshape(mean, (ROWS, 1))
            rstd = _rstd(ct.reshape(m2, (ROWS, 1)), n, eps)
            x = x - mean
        else:
            rstd = _rstd(ct.reshape(ct.sum(parts, axis=2, keepdims=True), (ROWS, 1)), n, eps)
        if me == 0:
            if LAYERNORM:
                ct.store(MEAN, index=(block,), tile=ct.reshape(mean, (ROWS,)))
            ct.store(RSTD, index=(block,), tile=ct.reshape(rstd, (ROWS,)))
        y = x * rstd
        if HAS_WEIGHT:
            y = y * w
        if HAS_BIAS:
            y = y + b
        _st(Y, (block, me), ct.astype(y, Y.dtype), TMA_STORE, LATENCY)


@ct.kernel
def _sum_partials_kernel(PARTIALS, OUT, BLOCK_P: ConstInt, BLOCK_N: ConstInt):
    """OUT[k, :] = sum over p of PARTIALS[k, p, :] in fp32, always in the same order, rounded
    once to OUT's dtype (the weight's)."""
    chunk = ct.bid(0)
    k = ct.bid(1)
    acc = ct.zeros((BLOCK_P, BLOCK_N), dtype=ct.float32)
    for p in range(ct.cdiv(PARTIALS.shape[1], BLOCK_P)):
        part = ct.load(PARTIALS, index=(k, p, chunk), shape=(1, BLOCK_P, BLOCK_N), padding_mode=ZERO)
        acc = acc + ct.reshape(part, (BLOCK_P, BLOCK_N))
    total = ct.sum(acc, axis=0, keepdims=True)
    ct.store(OUT, index=(k, chunk), tile=ct.astype(total, OUT.dtype))


# ============================================================================ realigned rows
def _odd_split(phase, n):
    """(start, head, body) of phase ``phase``'s rows (rows r = phase + 8k; 16-bit elements): row
    r starts r * n = phase * n + 8kn elements into the array, so every row of a phase starts at
    the same place within a 16-byte vector. Its first whole vector is at ``start`` (a multiple of 8
    computed as such, so that the compiler sees it) plus 8kn, ``head`` = start - phase * n elements
    into the row; the ``body`` that follows is a multiple of 8 elements, and what is left (under
    8) is the tail."""
    start = ct.cdiv(phase * n, 8) * 8
    head = start - phase * n
    return start, head, (n - head) // 8 * 8


def _phase_body(A, start, rows, body):
    """The bodies of one phase's rows of a contiguous (M, N) array as a (rows, body) array of
    row stride 8N, starting at element ``start``: 16-byte aligned, strides of whole vectors, its
    shape a multiple of 8 columns, so loads and stores move whole vectors (or TMA boxes). A view
    of A's memory, nothing copied."""
    m = A.shape[0]
    n = A.shape[1]
    flat = ct.Array.from_foreign(A.foreign_pointer, (m * n,), (1,))
    return ct.Array.from_foreign(flat.slice(0, start, m * n).foreign_pointer, (rows, body), (8 * n, 1))


def _phase_stat(S, phase, rows):
    """One phase's entries of a (M,) per-row statistic, as a (rows,) array of stride 8."""
    return ct.Array.from_foreign(S.slice(0, phase, S.shape[0]).foreign_pointer, (rows,), (8,))


def _odd_edges(head, body, n):
    """A row's head and tail (under 8 elements each) as one 16-wide tile: edge lane k is column
    k of the row below ``head``, else column body + k; (columns, lanes in use)."""
    k = ct.arange(2 * 8, dtype=ct.int32)
    return k + ct.where(k >= head, body, 0), k < n - body


def _odd_rows(phase, block, ROWS):
    """The rows of a phase's row block, as a [ROWS, 1] column of row indices."""
    return ct.reshape(phase + 8 * (block * ROWS + ct.arange(ROWS, dtype=ct.int32)), (ROWS, 1))


def _odd_phase(A, phase, BLOCK_N):
    """Phase ``phase`` of the (M, N) rows of A, as both kernels take it: (n, start, head, body, rows,
    cols, lanes, in_body, in_edge), ``rows`` rows (phase + 8k) split by ``_odd_split`` and
    ``_odd_edges``; in_body and in_edge keep a [1, BLOCK_N] body tile and a [1, 16] edge tile to the
    columns in use (LayerNorm's x - mean is not 0 past them). The kernel computes the phase, ahead
    of its grid arithmetic: tileiras's code depends on the order of these operations, not only on
    what they compute."""
    m = A.shape[0]
    n = A.shape[1]
    start, head, body = _odd_split(phase, n)
    rows = ct.cdiv(m - phase, 8)
    cols, lanes = _odd_edges(head, body, n)
    in_body = ct.reshape(ct.arange(BLOCK_N, dtype=ct.int32) < body, (1, BLOCK_N))
    in_edge = ct.reshape(lanes, (1, 16))
    return n, start, head, body, rows, cols, lanes, in_body, in_edge


def _edge_at(A, rows, cols, lanes):
    """(flat array, element offsets, mask) of the edge lanes of these rows ([ROWS, 1]) of a contiguous
    (M, N) array: int32 offsets into one flat array (M * N < 2^31, see INDEX_LIMIT) and a mask that
    keeps them within it, so the accesses need no bounds checks of their own."""
    m = A.shape[0]
    n = A.shape[1]
    flat = ct.Array.from_foreign(A.foreign_pointer, (m * n,), (1,))
    at = rows * n + ct.reshape(cols, (1, 16))
    return flat, at, (rows < m) & ct.reshape(lanes, (1, 16))


def _ld_edges(A, rows, cols, lanes):
    """The edge lanes of these rows of an (M, N) array, element-wise, 0 past M and past the edges."""
    flat, at, mask = _edge_at(A, rows, cols, lanes)
    return ct.gather(flat, at, mask=mask, check_bounds=False)


def _st_edges(A, rows, cols, lanes, tile):
    flat, at, mask = _edge_at(A, rows, cols, lanes)
    ct.scatter(flat, at, tile, mask=mask, check_bounds=False)


def _shifted_param(P, SHIFTED, k, phase, head, body, cols, lanes, BLOCK_N):
    """A per-column vector (weight, bias) in a phase's columns, fp32: (body, edge) tiles, [1, BLOCK_N]
    and [1, 16]; 0 past them. Once per program: the body gathered (element-wise: it starts
    mid-vector), stored to the phase's row of the aligned fp32 scratch SHIFTED[k] and loaded back
    as a tile, so that it takes a load's layout (see the module docstring)."""
    j = ct.arange(BLOCK_N, dtype=ct.int32)
    pb = ct.astype(ct.gather(P, head + j, mask=j < body), ct.float32)
    ct.store(SHIFTED, index=(k, phase, 0), tile=ct.reshape(pb, (1, 1, BLOCK_N)))
    pb = ct.load(SHIFTED, index=(k, phase, 0), shape=(1, 1, BLOCK_N))
    pe = ct.astype(ct.gather(P, cols, mask=lanes), ct.float32)
    return ct.reshape(pb, (1, BLOCK_N)), ct.reshape(pe, (1, 16))


def _fwd_odd_kernel(
    X, R, W, B, Y, H, MEAN, RSTD, eps, SHIFTED,
    LAYERNORM: ConstBool, HAS_WEIGHT: ConstBool, HAS_BIAS: ConstBool, HAS_RESIDUAL: ConstBool,
    ROWS: ConstInt, BLOCK_N: ConstInt, TMA_LOAD: ConstBool, TMA_STORE: ConstBool, LATENCY: ConstInt,
):  # fmt: skip
    """The forward of realigned rows: program p takes phase p mod 8 and that phase's row blocks
    p // 8, p // 8 + G, ... (G = programs / 8), ROWS rows 8 apart to a block; bodies loaded and
    stored as [ROWS, BLOCK_N] tiles of the phase's aligned array, heads and tails element-wise."""
    phase = ct.bid(0) % 8
    groups = ct.num_blocks(0) // 8
    n, start, head, body, rows, cols, lanes, in_body, in_edge = _odd_phase(Y, phase, BLOCK_N)
    xs = _phase_body(X, start, rows, body)
    ys = _phase_body(Y, start, rows, body)
    # weight and bias gathered once per program, shifted to the phase's columns
    wb = ct.full((1, BLOCK_N), 1.0, dtype=ct.float32)
    we = ct.full((1, 16), 1.0, dtype=ct.float32)
    bb = ct.full((1, BLOCK_N), 0.0, dtype=ct.float32)
    be = ct.full((1, 16), 0.0, dtype=ct.float32)
    if HAS_WEIGHT:
        wb, we = _shifted_param(W, SHIFTED, 0, phase, head, body, cols, lanes, BLOCK_N)
    if HAS_BIAS:
        bb, be = _shifted_param(B, SHIFTED, 1, phase, head, body, cols, lanes, BLOCK_N)
    for block in range(ct.bid(0) // 8, ct.cdiv(rows, ROWS), groups):
        r = _odd_rows(phase, block, ROWS)
        xb = _ld(xs, (block, 0), (ROWS, BLOCK_N), TMA_LOAD, LATENCY)
        xe = _ld_edges(X, r, cols, lanes)
        if HAS_RESIDUAL:
            rb = _ld(_phase_body(R, start, rows, body), (block, 0), (ROWS, BLOCK_N), TMA_LOAD, LATENCY)
            re = _ld_edges(R, r, cols, lanes)
            xb = ct.astype(ct.astype(xb, ct.float32) + ct.astype(rb, ct.float32), X.dtype)
            xe = ct.astype(ct.astype(xe, ct.float32) + ct.astype(re, ct.float32), X.dtype)
            _st(_phase_body(H, start, rows, body), (block, 0), xb, TMA_STORE, LATENCY)
            _st_edges(H, r, cols, lanes, xe)
        xb = ct.astype(xb, ct.float32)
        xe = ct.astype(xe, ct.float32)
        if LAYERNORM:
            mean = (ct.sum(xb, axis=1, keepdims=True) + ct.sum(xe, axis=1, keepdims=True)) / n
            xb = ct.where(in_body, xb - mean, 0.0)
            xe = ct.where(in_edge, xe - mean, 0.0)
            ct.store(_phase_stat(MEAN, phase, rows), index=(block,), tile=ct.reshape(mean, (ROWS,)))
        rstd = _rstd(ct.sum(xb * xb, axis=1, keepdims=True) + ct.sum(xe * xe, axis=1, keepdims=True), n, eps)
        ct.store(_phase_stat(RSTD, phase, rows), index=(block,), tile=ct.reshape(rstd, (ROWS,)))
        yb = xb * rstd
        ye = xe * rstd
        if HAS_WEIGHT:
            yb = yb * wb
            ye = ye * we
        if HAS_BIAS:
            yb = yb + bb
            ye = ye + be
        _st(ys, (block, 0), ct.astype(yb, Y.dtype), TMA_STORE, LATENCY)
        _st_edges(Y, r, cols, lanes, ct.astype(ye, Y.dtype))


def _bwd_odd_kernel(
    DY, X, W, MEAN, RSTD, DRES, DX, DW_PARTIAL, DB_PARTIAL, SHIFTED,
    LAYERNORM: ConstBool, HAS_WEIGHT: ConstBool, HAS_DRESIDUAL: ConstBool,
    ROWS: ConstInt, BLOCK_N: ConstInt, TMA_LOAD: ConstBool, TMA_STORE: ConstBool, LATENCY: ConstInt,
    ACC_ROWS: ConstBool,
):  # fmt: skip
    """The backward of realigned rows: program p takes phase p mod 8 and a contiguous range of that
    phase's row blocks (``_bwd_kernel``'s split, per phase); its dweight / dbias accumulate in
    the phase's columns and go to partial row p in natural column order."""
    phase = ct.bid(0) % 8
    group = ct.bid(0) // 8
    groups = ct.num_blocks(0) // 8
    n, start, head, body, rows, cols, lanes, in_body, in_edge = _odd_phase(DX, phase, BLOCK_N)
    n_blocks = ct.cdiv(rows, ROWS)
    share = n_blocks // groups
    extra = n_blocks % groups
    first = group * share + ct.minimum(group, extra)
    count = share + ct.astype(group < extra, ct.int32)
    xs = _phase_body(X, start, rows, body)
    dys = _phase_body(DY, start, rows, body)
    dxs = _phase_body(DX, start, rows, body)
    wb = ct.full((1, BLOCK_N), 1.0, dtype=ct.float32)
    we = ct.full((1, 16), 1.0, dtype=ct.float32)
    if HAS_WEIGHT:
        wb, we = _shifted_param(W, SHIFTED, 0, phase, head, body, cols, lanes, BLOCK_N)
    dwb = ct.zeros((1, BLOCK_N), dtype=ct.float32)
    dbb = ct.zeros((1, BLOCK_N), dtype=ct.float32)
    dwb_rows = ct.zeros((ROWS, BLOCK_N), dtype=ct.float32)
    dbb_rows = ct.zeros((ROWS, BLOCK_N), dtype=ct.float32)
    dwe = ct.zeros((ROWS, 16), dtype=ct.float32)
    dbe = ct.zeros((ROWS, 16), dtype=ct.float32)
    for i in range(count):
        block = first + i
        r = _odd_rows(phase, block, ROWS)
        xb = ct.astype(_ld(xs, (block, 0), (ROWS, BLOCK_N), TMA_LOAD, LATENCY), ct.float32)
        xe = ct.astype(_ld_edges(X, r, cols, lanes), ct.float32)
        dyb = ct.astype(_ld(dys, (block, 0), (ROWS, BLOCK_N), TMA_LOAD, LATENCY), ct.float32)
        dye = ct.astype(_ld_edges(DY, r, cols, lanes), ct.float32)
        if LAYERNORM:
            mean = _row_stat(_phase_stat(MEAN, phase, rows), block, ROWS)
            xb = ct.where(in_body, xb - mean, 0.0)
            xe = ct.where(in_edge, xe - mean, 0.0)
        rstd = _row_stat(_phase_stat(RSTD, phase, rows), block, ROWS)
        gb = dyb
        ge = dye
        if HAS_WEIGHT:
            gb = dyb * wb
            ge = dye * we
        sum_gxc = ct.sum(gb * xb, axis=1, keepdims=True) + ct.sum(ge * xe, axis=1, keepdims=True)
        xhb = xb * rstd
        xhe = xe * rstd
        c1 = sum_gxc * rstd / n
        dxb = gb - xhb * c1
        dxe = ge - xhe * c1
        if LAYERNORM:
            c2 = (ct.sum(gb, axis=1, keepdims=True) + ct.sum(ge, axis=1, keepdims=True)) / n
            dxb = dxb - c2
            dxe = dxe - c2
            if ACC_ROWS:
                dbb_rows = dbb_rows + dyb
            else:
                dbb = dbb + ct.sum(dyb, axis=0, keepdims=True)
            dbe = dbe + dye
        dxb = dxb * rstd
        dxe = dxe * rstd
        if HAS_DRESIDUAL:
            dres = _ld(_phase_body(DRES, start, rows, body), (block, 0), (ROWS, BLOCK_N), TMA_LOAD, LATENCY)
            dxb = dxb + ct.astype(dres, ct.float32)
            dxe = dxe + ct.astype(_ld_edges(DRES, r, cols, lanes), ct.float32)
        if HAS_WEIGHT:
            if ACC_ROWS:
                dwb_rows = dwb_rows + dyb * xhb
            else:
                dwb = dwb + ct.sum(dyb * xhb, axis=0, keepdims=True)
            dwe = dwe + dye * xhe
        _st(dxs, (block, 0), ct.astype(dxb, DX.dtype), TMA_STORE, LATENCY)
        _st_edges(DX, r, cols, lanes, ct.astype(dxe, DX.dtype))
    if ACC_ROWS:
        dwb = ct.sum(dwb_rows, axis=0, keepdims=True)
        dbb = ct.sum(dbb_rows, axis=0, keepdims=True)
    me = ct.bid(0)
    if HAS_WEIGHT:
        _st_partial(DW_PARTIAL, me, head, body, cols, lanes, dwb, ct.sum(dwe, axis=0, keepdims=True), BLOCK_N)
    if LAYERNORM:
        _st_partial(DB_PARTIAL, me, head, body, cols, lanes, dbb, ct.sum(dbe, axis=0, keepdims=True), BLOCK_N)


def _st_partial(P, me, head, body, cols, lanes, pb, pe, BLOCK_N):
    """A program's partial row (dweight or dbias), from the phase's columns to row ``me`` of the
    (programs, N) partials in natural column order."""
    j = ct.arange(BLOCK_N, dtype=ct.int32)
    ct.scatter(P, (me, head + j), ct.reshape(pb, (BLOCK_N,)), mask=j < body)
    ct.scatter(P, (me, cols), ct.reshape(pe, (16,)), mask=lanes)


# ============================================================================ launching
# A launch is (kernel, grid, args). On a GPU it runs on the current torch stream; in
# ``compile_only`` mode (no GPU: the tests) it is compiled for sm_90 from the same description,
# so the host code the GPU runs is the host code the tests exercise.
_COMPILE_ONLY: list = []  # a stack of lists collecting (kernel name, cubin bytes)
# Without a GPU the persistent backward's grid is sized for one SM.
SM_COUNT_WITHOUT_GPU = 1
# cuTile's default array indexing is int32 (shapes, strides and offsets)
INDEX_LIMIT = 2**31
# a per-head view whose heads take no tile of this many rows (or the plan's, if fewer) is copied
MIN_VIEW_ROWS = 4

# float8_e4m3fn: the FP8-output ops' q (impls/cutile/fp8.py)
_CT_DTYPES = {torch.bfloat16: ct.bfloat16, torch.float16: ct.float16, torch.float32: ct.float32,
              torch.float8_e4m3fn: ct.float8_e4m3fn, torch.int64: ct.int64}  # fmt: skip


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return SM_COUNT_WITHOUT_GPU
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


_PLACEHOLDERS: dict = {}


def _placeholder(like: torch.Tensor, dtype: torch.dtype, ndim: int, role: str) -> torch.Tensor:
    """A tiny array for a parameter the kernel's flags leave unread (weight=None, no residual):
    cuTile takes arrays only, and the array arguments of a launch must not overlap, so each role
    has its own (made once per device and dtype)."""
    key = (like.device, dtype, ndim, role)
    if key not in _PLACEHOLDERS:
        _PLACEHOLDERS[key] = torch.zeros((1,) * ndim, dtype=dtype, device=like.device)
    return _PLACEHOLDERS[key]


_VARIANTS: dict = {}


def _kernel(fn, t):
    """The cuTile kernel of ``fn`` with the tuning's occupancy and worker-warp hints (0: the
    compiler's own), made once per pair."""
    key = (fn, t.occupancy, t.worker_warps)
    if key not in _VARIANTS:
        options = {"occupancy": t.occupancy} if t.occupancy > 0 else {}
        if t.worker_warps > 0:
            options["num_worker_warps"] = t.worker_warps
        _VARIANTS[key] = ct.kernel(**options)(fn)
    return _VARIANTS[key]


def _tuning(direction: str, n: int, layernorm: bool, fused: bool, device):
    """The experiments' override (``plan.TUNING``), else the table's entry for this op and width."""
    op = "layernorm" if layernorm else ("add_rmsnorm" if fused else "rmsnorm")
    return _plan_module.TUNING or configs.choose(op, direction, n, device)


def _launch(kernel, grid: tuple, args: tuple):
    if _COMPILE_ONLY:
        _COMPILE_ONLY[-1].append((_name(kernel), compile_kernel(kernel, args)))
        return
    device = next(a.device for a in args if isinstance(a, torch.Tensor))
    ct.launch(torch.cuda.current_stream(device), grid, kernel, args)


def _name(kernel) -> str:
    return kernel._annotated_function.pyfunc.__name__


def _pow2_divisor(value: int, cap: int = 16) -> int:
    """The largest power of two <= cap dividing ``value`` (0 counts as divisible by all)."""
    d = 1
    while d < cap and value % (2 * d) == 0:
        d *= 2
    return d


def _signature(args: tuple):
    """A kernel signature for a launch with these arguments: arrays with their dtype, rank, unit
    strides as constants and the alignment of their base, strides and shapes (the kinds of
    assumption cuTile's dispatcher derives from a launch's arguments); floats as fp32 runtime
    scalars (as the dispatcher passes a Python float); ints and bools as compile-time constants."""
    from cuda.tile.compilation import ArrayConstraint, CallingConvention, KernelSignature, ScalarConstraint

    params = []
    for a in args:
        if isinstance(a, torch.Tensor):
            elem = a.element_size()
            params.append(
                ArrayConstraint(
                    _CT_DTYPES[a.dtype], a.dim(), index_dtype=ct.int32, stride_lower_bound_incl=0,
                    alias_groups=(), may_alias_internally=False,
                    stride_constant=tuple(1 if s == 1 else None for s in a.stride()),
                    stride_divisible_by=tuple(_pow2_divisor(s, 16 // elem) for s in a.stride()),
                    shape_divisible_by=tuple(_pow2_divisor(s, 16 // elem) for s in a.shape),
                    base_addr_divisible_by=_pow2_divisor(a.data_ptr()),
                )
            )  # fmt: skip
        elif isinstance(a, float):
            params.append(ScalarConstraint(ct.float32))
        else:
            params.append(a)
    return KernelSignature(params, CallingConvention.cutile_python_v2())


def compile_kernel(kernel, args: tuple, gpu_code: str = "sm_90") -> bytes:
    """Compile ``kernel`` for ``gpu_code`` without a GPU, specialised as a launch with these
    arguments would be; returns the cubin."""
    from cuda.tile.compilation import export_kernel

    out = io.BytesIO()
    export_kernel(kernel, [_signature(args)], out, gpu_code=gpu_code, output_format="cubin")
    return out.getvalue()


class compile_only:
    """``with compile_only() as compiled:`` the contract functions compile their kernels for
    sm_90 instead of launching them (their outputs stay unwritten); ``compiled`` lists
    (kernel name, cubin) pairs."""

    def __enter__(self):
        _COMPILE_ONLY.append([])
        return _COMPILE_ONLY[-1]

    def __exit__(self, *exc):
        _COMPILE_ONLY.pop()
        return False


def _check_index_range(*tensors):
    for t in tensors:
        if t is not None and sum((d - 1) * s for d, s in zip(t.shape, t.stride())) + 1 >= INDEX_LIMIT:
            raise ValueError(
                f"cuTile kernels index arrays with int32: a {tuple(t.shape)} tensor with strides "
                f"{tuple(t.stride())} spans 2^31 elements or more"
            )


def head_rows(heads: int, rows: int) -> int:
    """Rows a tile of a (T, H, N) per-head view takes from one token, for a plan of ``rows`` rows
    (both powers of two in cuTile's tiles): all H heads where the tile spans whole tokens (H a power
    of two dividing ``rows``), else a power of two dividing H (the tile then has that many rows,
    within one token). 0: no such tile of at least ``MIN_VIEW_ROWS`` rows (H = 3 or 5, say), so the
    view is copied to (M, N) rows."""
    if heads & (heads - 1) == 0:
        return min(rows, heads)
    fit = min(rows, heads & -heads)
    return fit if fit >= min(rows, MIN_VIEW_ROWS) else 0


def _as_rows(rows: tuple, n: int, p: Plan) -> tuple[tuple, Plan, int]:
    """(row tensors as launched, the plan, HEAD_ROWS) for a call's row tensors (None where absent):
    (M, N) rows where every tensor has them (a 3-D tensor with an (M, N) view goes as that view);
    else every tensor as a (T, H, N) view, read in place with tiles of ``head_rows`` rows from a
    token (the plan's rows cut to those where the tile stays within one token), or, where no tile
    fits, copied to (M, N) rows."""
    rows = tuple(t if t is None or t.dim() == 2 or has_no_row_view(t) else t.reshape(-1, n) for t in rows)
    view = next((t for t in rows if t is not None and t.dim() == 3), None)
    if view is None:
        return rows, p, 0
    tokens, heads = view.shape[:2]
    hr = head_rows(heads, p.rows)
    if hr == 0:
        return tuple(t if t is None else t.reshape(-1, n) for t in rows), p, 0
    if hr < p.rows and hr < heads:
        p = Plan(hr, p.width, p.pieces)
    return tuple(t if t is None or t.dim() == 3 else t.view(tokens, heads, n) for t in rows), p, hr


def takes_realigned(rows: tuple, m: int, n: int, p: Plan, t) -> bool:
    """Whether a call's row tensors (None where absent; as ``_as_rows`` hands them over) take the
    realigned kernels: the shape's conditions (``plan.realigned``), and every row tensor (M, N)
    contiguous rows starting on a 16-byte boundary, so that every tensor's row r starts at the same
    place within a vector, (r * N) mod 8 elements in."""
    if not realigned(m, n, rows[0].element_size(), p, t):
        return False
    return all(r is None or (r.dim() == 2 and r.stride() == (n, 1) and r.data_ptr() % 16 == 0) for r in rows)


def _shifted_scratch(like: torch.Tensor, params: int, width: int) -> torch.Tensor:
    """The realigned kernels' (params, 8, width) fp32 scratch for the weight (and bias) shifted to
    each phase's columns; the programs of a phase all write the same values to its row."""
    return torch.empty((params, PHASES, width), dtype=torch.float32, device=like.device)


def _grid_rows(m: int, p: Plan) -> int:
    return -(-m // p.rows)


# ============================================================================ forward (host)
def norm_fwd(x, residual, weight, bias, eps, layernorm: bool):
    """(y, h or None, mean or None, rstd); x and the residual (M, N) rows or (T, H, N) views."""
    N = x.shape[-1]
    M = x.numel() // N
    _check_index_range(x, residual)
    t = _tuning("fwd", N, layernorm, residual is not None, x.device)
    sms = sm_count(x.device)
    # the exchanging slices where the tuning asks for them and their grid fits the SMs, else the
    # forward of rows in one tile or walked in chunks
    p = fwd_sync_plan(M, N, t)
    sync = p is not None and sync_groups(M, p, sms) > 0
    (x, residual), p, hr = _as_rows((x, residual), N, p if sync else plan("fwd", M, N, t))
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    h = torch.empty((M, N), dtype=x.dtype, device=x.device) if residual is not None else None
    rstd = torch.empty(M, dtype=torch.float32, device=x.device)
    mean = torch.empty(M, dtype=torch.float32, device=x.device) if layernorm else None
    args = (
        x, residual if residual is not None else _placeholder(x, x.dtype, 2, "residual"),
        weight if weight is not None else _placeholder(x, x.dtype, 1, "weight"),
        bias if bias is not None else _placeholder(x, x.dtype, 1, "bias"),
        y, h if h is not None else _placeholder(x, x.dtype, 2, "h"),
        mean if mean is not None else _placeholder(x, torch.float32, 1, "mean"), rstd, float(eps),
        layernorm, weight is not None, bias is not None, residual is not None, p.rows, p.width,
    )  # fmt: skip
    if sync:
        slots = torch.zeros((M, (1 + int(layernorm)) * p.pieces), dtype=torch.int64, device=x.device)
        args = args[:8] + (slots,) + args[8:] + (
            p.pieces, next_pow2(p.pieces), t.tma_load, t.tma_store, t.latency, hr, SPIN_LIMIT,
        )  # fmt: skip
        _launch(_kernel(_fwd_sync_kernel, t), (sync_groups(M, p, sms), p.pieces, 1), args)
        return y, h, mean, rstd
    if hr == 0 and takes_realigned((x, residual), M, N, p, t):
        programs = PHASES * realigned_programs("fwd", M, p, sms, t)
        shifted = _shifted_scratch(x, 1 + int(bias is not None), p.width)
        args = args[:9] + (shifted,) + args[9:] + (t.tma_load, t.tma_store, t.latency)
        _launch(_kernel(_fwd_odd_kernel, t), (programs, 1, 1), args)
        return y, h, mean, rstd
    args += (p.wide, t.tma_load, t.tma_store, t.latency, hr)
    _launch(_kernel(_fwd_kernel, t), (forward_programs(M, p, sms, t), 1, 1), args)
    return y, h, mean, rstd


# =========================================================================== backward (host)
def _pad16(n: int, itemsize: int) -> int:
    """n rounded up to a whole number of 16-byte vectors of ``itemsize``-byte elements."""
    per = max(1, 16 // itemsize)
    return -(-n // per) * per



def norm_bwd(dy, dres, x, weight, mean, rstd, layernorm: bool):
    """(dx, dw or None, db or None); dw and db in the weight's dtype (x's when there is none); dy,
    dres and x (M, N) rows or (T, H, N) views."""
    N = x.shape[-1]
    M = x.numel() // N
    _check_index_range(x, dy, dres)
    t = _tuning("bwd", N, layernorm, dres is not None, x.device)
    (dy, x, dres), p, hr = _as_rows((dy, x, dres), N, plan("bwd", M, N, t))
    slices = p.pieces
    has_weight = weight is not None
    dx = torch.empty((M, N), dtype=x.dtype, device=x.device)
    n_sums = int(has_weight) + int(layernorm)
    odd = hr == 0 and takes_realigned((dy, x, dres), M, N, p, t)
    # the exchanging slices' row groups (``_bwd_sync_kernel``, one program per SM); 0: not exchanging
    sync = sync_groups(M, p, sm_count(x.device)) if t.sync and slices > 1 else 0
    # the realigned kernel's programs each write a partial row, as the persistent groups do
    if odd:
        groups = PHASES * realigned_programs("bwd", M, p, sm_count(x.device), t)
    elif sync:
        groups = sync
    else:
        groups = backward_groups(M, p, sm_count(x.device), t)
    # Rows of the partials (and of the sums) padded to 16 bytes: the second of them (dbias) is a
    # view at an offset, and at N = 7 (28-byte rows) its stores were lost on an H100 (dbias 0).
    partials = torch.empty((max(n_sums, 1), groups, _pad16(N, 4)), dtype=torch.float32, device=x.device)[..., :N]
    w = weight if has_weight else _placeholder(x, x.dtype, 1, "weight")
    mean = mean if mean is not None else _placeholder(x, torch.float32, 1, "mean")
    dw_partial = partials[0] if has_weight else _placeholder(x, torch.float32, 2, "dw_partial")
    db_partial = partials[n_sums - 1] if layernorm else _placeholder(x, torch.float32, 2, "db_partial")
    dres_arg = dres if dres is not None else _placeholder(x, x.dtype, 2, "dres")
    if odd:
        args = (
            dy, x, w, mean, rstd, dres_arg, dx, dw_partial, db_partial, _shifted_scratch(x, 1, p.width), layernorm,
            has_weight, dres is not None,
            p.rows, p.width, t.tma_load, t.tma_store, t.latency, t.acc_rows,
        )  # fmt: skip
        _launch(_kernel(_bwd_odd_kernel, t), (groups, 1, 1), args)
        return _sum_partials(partials, weight, x, N, n_sums, groups, layernorm, dx)
    if sync:
        slots = torch.zeros((M, (1 + int(layernorm)) * slices), dtype=torch.int64, device=x.device)
        args = (
            dy, x, w, mean, rstd, dres_arg, slots, dx, dw_partial, db_partial, layernorm, has_weight,
            dres is not None, p.rows, p.width, slices, next_pow2(slices), t.tma_load, t.tma_store, t.latency, hr, SPIN_LIMIT,
        )  # fmt: skip
        _launch(_kernel(_bwd_sync_kernel, t), (groups, slices, 1), args)
        return _sum_partials(partials, weight, x, N, n_sums, groups, layernorm, dx)
    row_sums = _placeholder(x, torch.float32, 3, "row_sums")
    if slices > 1:
        row_sums = torch.empty((2, M, slices), dtype=torch.float32, device=x.device)
        _launch(
            _bwd_row_sums_kernel, (_grid_rows(M, p), slices, 1),
            (dy, x, w, mean, row_sums, layernorm, has_weight, p.rows, p.width, t.tma_load, t.latency, hr),
        )  # fmt: skip
    args = (
        dy, x, w, mean, rstd, dres_arg, row_sums, dx, dw_partial, db_partial, layernorm, has_weight,
        dres is not None, p.rows, p.width, slices, next_pow2(slices), t.tma_load, t.tma_store, t.latency,
        t.acc_rows, hr,
    )  # fmt: skip
    _launch(_kernel(_bwd_kernel, t), (groups, slices, 1), args)
    return _sum_partials(partials, weight, x, N, n_sums, groups, layernorm, dx)


def _sum_partials(partials, weight, x, N: int, n_sums: int, groups: int, layernorm: bool, dx):
    """(dx, dw or None, db or None): the programs' partial rows of dweight / dbias added in a fixed
    order and rounded once to the weight's dtype (x's when there is none)."""
    has_weight = weight is not None
    if not n_sums:
        return dx, None, None
    sum_dtype = weight.dtype if has_weight else x.dtype
    sums = torch.empty((n_sums, _pad16(N, sum_dtype.itemsize)), dtype=sum_dtype, device=x.device)[:, :N]
    # narrow column strips, so that even N = 1024 spreads over dozens of SMs
    block_n = min(max(next_pow2(N) // 256, 16), 256)
    block_p = min(4096 // block_n, next_pow2(groups))
    _launch(_sum_partials_kernel, (-(-N // block_n), n_sums, 1), (partials, sums, block_p, block_n))
    dw = sums[0] if has_weight else None
    db = sums[n_sums - 1] if layernorm else None
    return dx, dw, db


# ============================================================================ the contract
(rmsnorm_fwd, rmsnorm_bwd, layernorm_fwd, layernorm_bwd, add_rmsnorm_fwd, add_rmsnorm_bwd) = contract_functions(
    norm_fwd, norm_bwd
)
