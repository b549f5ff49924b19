"""RMSNorm, LayerNorm and add + RMSNorm, forward and backward, hand-written in Gluon
(``triton.experimental.gluon``: Triton with explicit layouts).

Per row of N elements, all arithmetic in fp32 (x, dy, w, b are upcast right after loading):

    RMSNorm     rstd = 1 / sqrt(mean(x^2) + eps)                            xhat = x * rstd
    LayerNorm   mean = mean(x),  rstd = 1 / sqrt(mean((x - mean)^2) + eps)  xhat = (x - mean) * rstd
    add+RMSNorm h = round_x_dtype(x + residual)  (stored: residual_out),     xhat = h * rstd(h)
    forward     y = xhat * w (+ b)
    backward    g = dy * w,  c1 = mean(g * xhat),  c2 = mean(g) (LayerNorm; 0 for RMSNorm)
                dx = rstd * (g - xhat * c1 - c2)  (+ dresidual_out for add+RMSNorm: dh)
                dw = sum over rows of dy * xhat,   db = sum over rows of dy

One set of kernels serves the three ops through compile-time flags (``LAYERNORM``,
``HAS_RESIDUAL``, ``HAS_DRESIDUAL``): add + RMSNorm is RMSNorm whose row loader also reads the
residual and stores the sum, and whose backward adds dresidual_out before dx's one rounding.

Design decisions:

* Layouts are chosen by hand (``plan.py``): a ``BlockedLayout`` of 128-bit vectors per thread
  along N (narrower where N is not a multiple of 16 bytes, unless realigned: below), threads then
  warps along N for wide rows, spare warps along M for narrow ones, and for small rows (QK-norm's
  head_dim) a tile of tens of rows, several vectors per lane. Row reductions are ``gl.reduce`` sums over that layout
  (within a warp by shuffles, across warps once through shared memory); per-row values live in
  ``SliceLayout(1, layout)`` and per-column ones (weight) in ``SliceLayout(0, layout)``, so no
  layout conversion is needed anywhere.
* Per-head views in place: q and k of a fused QKV projection are (T, NH, N) views whose token
  stride spans all P heads, so no (M, N) view of their rows exists. The row tensors the kernels
  read (x, the residual, dy, dresidual_out) come as (M, N) or as such views (the implementation
  declares ``row_views``), and with ``HEADS`` row r is addressed at (r // NH) * stride(0) +
  (r % NH) * stride(1) (``_starts``): an integer division per row, not per element, and no copy.
  The outputs are (M, N); the statistics (M,).
* The sum of add + RMSNorm is rounded to x's dtype before the statistics: the unfused model
  stores h in x's dtype and normalises what it stored, so y must equal rmsnorm(residual_out) as
  stored, and the backward (which only sees the stored h) must match the forward's statistics.
* Weights and biases are loaded in their own dtype (x's, or fp32 for mixed precision) and
  upcast; dw and db are accumulated in fp32 and rounded once, to the weight's dtype.
* Statistics that overflow give NaN, never a finite wrong value: with |x| near 1e30 in bf16,
  x^2 overflows fp32 and the sum of squares is inf, so rsqrt gives 0 and y would silently become
  0 (RMSNorm) or the bias (LayerNorm). ``_rstd`` turns an infinite sum into a NaN rstd, which
  reaches y and, through the saved rstd, dx (torch's LayerNorm returns NaN there too).
* Forward: one pass with the whole row in registers up to ``FWD_ROW_BYTES`` of x; wider rows
  are walked in chunks twice, statistics then y, the second pass last chunk first so that it
  starts on what the first pass read last (still in L2). LayerNorm's chunked statistics merge
  per-chunk (mean, sum of squared deviations) pairs (Chan et al.), never E[x^2] - E[x]^2.
  add + RMSNorm's second pass reads the h it stored (from L2) instead of x and the residual.
* Forward of wide rows, where ``plan.FWD_EXCHANGE`` pins it per op, element size and row bucket
  (where it measured faster): the chunked forward reads each row twice, and with a row in flight
  per SM, rows of 256 KB and more no longer fit the L2 between the passes. ``_fwd_sliced_kernel``
  cuts the row into column slices, one program each, which read their slice once into registers
  and exchange partial statistics as the wide backward's slices exchange their row sums (the same
  ``_publish`` / ``_await_slots``): per row block each posts an fp32 value per statistic (int64 slot:
  the bits and a "posted" bit, one atomic exchange), RMSNorm its sum of squares, LayerNorm its sum
  and its sum of squared deviations from its own mean, and waits for its siblings' with the next
  block's slice already loading. The slots are added in slice order, so every sibling gets the same
  bits whatever the timing; LayerNorm's merge is Chan et al.'s (M2 = sum of the slices' M2 + sum of
  n_s (mean_s - mean)^2), never E[x^2] - E[x]^2. The wait is bounded (NaN statistics, not a hang,
  where a sibling never posts) and barrier-free (the [rows, slots] tile lies within one warp). All
  siblings must be resident: G row groups x S slices with G from ``exchange_groups`` over the SMs
  times the programs each may hold (no more than the binary allows); where the slices outnumber
  them, or no entry exists, the one-program-a-row forward runs. It reads what that forward reads:
  fp32 weights beside 16-bit x, no weight or bias, (T, NH, N) views.
* Backward: persistent, each program walking a contiguous range of row blocks (the next block's
  loads, its rows' statistics too, issued before this block's math) and accumulating dw / db over
  them in fp32 registers; LayerNorm moves two rows a program on 8-warp tiles (``plan.py``);
  each writes one partial row and ``_sum_partials_kernel`` adds them in a fixed order
  (deterministic, no atomics). The grid is as many programs as the SMs hold at once, counted from
  the compiled binary's registers and shared memory (``_resident``): a grid sized by threads alone
  oversubscribes the registers, and its last programs then run a second wave with a full share
  each. dw and db are accumulated per row of the tile ([ROWS, BLOCK_N], summed over the rows once
  at the end): summed per block, the sum over a tile's rows crosses warps through shared memory
  and a barrier every block, which for small rows costs more than the block's loads. Rows wider
  than ``BWD_ROW_MAX`` are cut into column slices, one per program of a row group. Their row
  reductions c1, c2 travel between the sibling programs: each posts its slice's sums of a row block
  to global memory and waits for the others' (``Plan.exchange``; no more programs than the SMs
  hold at once, ``Plan.per_sm`` each at most, so all are resident), so x and dy are read once;
  elsewhere they come from ``_bwd_row_sums_kernel``'s per-(row, slice) sums, x and dy read twice.
  On 16-bit rows up to 32768 columns (LayerNorm: 65536) the slices are narrow (2048-4096 columns
  on 2-8 warps) and an SM runs two to four programs: while one waits for its siblings' sums, the
  others' loads are in flight (``plan.SPREAD_SLICES``).
* Rows whose length is no multiple of a 16-byte vector (16-bit x, N = 4001) start anywhere within
  a vector, so the row kernels above move them element-wise: a 2-byte access per element keeps the
  load/store units, not DRAM, busy. Where the plan says so (``plan.REALIGNED``: whole rows, (M, N)
  rows of one stride and 16-byte aligned starts: ``realigned``), the realigned kernels
  (``_fwd_odd_kernel``, ``_bwd_odd_kernel``) read and write each row's body in whole vectors from
  its first aligned element, and its head and tail (under a vector each) as one short edge vector,
  element-wise. The body then sits in shifted columns, so the weight (and bias) and the dw / db
  accumulators must be shifted alike. A row r starts (r * stride) mod 8 elements into a vector, so
  a persistent program whose rows are p, p + G, ... with G a multiple of 8 keeps one shift: one
  shifted weight, loaded once, and one shifted dw / db, written to its partial row in column order
  at the end (``_sum_partials_kernel`` adds them as ever). The edge vector lies on the body tile's
  threads and warps, one element a lane, so that the per-row values of the two share one layout
  (``_row_sum``, ``_per_edge``: conversions that move nothing).
  The price is batch invariance at those widths: which columns are body and which edge depends on
  where the row starts, so its sums round differently at another place in the batch. Sums exact in
  any order were measured in Triton's realigned kernels (same design) and cost more than the
  realigned body gains (reports/experiments/triton-odd-rows/), so the sums are plain fp32.

Without a GPU: Gluon kernels do not run in Triton's interpreter. The tests compile them for sm_90a
(``compile_only``: every op, direction, row regime and dtype, through the host code below), and
run their code under the interpreter with the layouts erased (``interpret.py``) against fp64.
Works with triton 3.6 (the GPU machine's) to 3.9 (CI's): only Gluon operations both have are used.
"""

from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from harness.spec.contract import contract_functions
from harness.spec.jit_launch import launch_named
from harness.spec.occupancy import exchange_groups, held

from .plan import Plan, Realigned, Tile, fwd_exchange_plan, next_pow2, plan, programs_per_sm, realigned_plan, tile


# ========================================================================== device functions
@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _sum(x, axis: gl.constexpr):
    """``gl.sum``, with a Gluon combine function: ``gl.sum``'s own is a Triton function, which
    Triton's interpreter (TRITON_INTERPRET=1, on in CPU test runs) replaces at import time and
    Gluon's compiler then refuses."""
    return gl.reduce(x, axis, _add)


@gluon.jit
def _min(a, b):
    return gl.minimum(a, b)


@gluon.jit
def _offsets(rows, cols, stride):
    """[rows, cols] element offsets; rows in int64 (row * stride overflows int32 past 2^31)."""
    return gl.expand_dims(rows.to(gl.int64) * stride, 1) + gl.expand_dims(cols, 0)


@gluon.jit
def _starts(rows, stride, hstride, NH, HEADS: gl.constexpr):
    """Each row's first element, in int64: row r of an (M, N) matrix is at r * stride; with HEADS,
    row r of a (T, NH, N) view (a head of a fused QKV tensor) is at (r // NH) * stride + (r % NH)
    * hstride, so that such a view is read in place."""
    r = rows.to(gl.int64)
    if HEADS:
        at = (r // NH) * stride + (r % NH) * hstride
    else:
        at = r * stride
    return at


@gluon.jit
def _at(starts, cols):
    """[rows, cols] element offsets from the rows' first elements (``_starts``)."""
    return gl.expand_dims(starts, 1) + gl.expand_dims(cols, 0)


@gluon.jit
def _load_row(X, R, H, x_at, r_at, h_at, mask, HAS_RESIDUAL: gl.constexpr):
    """The row to normalise, as fp32: x, or h = x + residual rounded to x's dtype and stored."""
    x = gl.load(X + x_at, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = gl.load(R + r_at, mask=mask, other=0.0)
        x = (x.to(gl.float32) + r.to(gl.float32)).to(X.dtype.element_ty)
        gl.store(H + h_at, x, mask=mask)
    return x.to(gl.float32)


@gluon.jit
def _rstd(sum_sq, N, eps):
    """1 / sqrt(sum_sq / N + eps); NaN where the sum of squares overflowed (see the docstring)."""
    return gl.where(sum_sq == float("inf"), float("nan"), gl.rsqrt(sum_sq / N + eps))


@gluon.jit
def _affine(y, W, B, cols, col_mask, HAS_WEIGHT: gl.constexpr, HAS_BIAS: gl.constexpr):
    if HAS_WEIGHT:
        y = y * gl.expand_dims(gl.load(W + cols, mask=col_mask, other=0.0).to(gl.float32), 0)
    if HAS_BIAS:
        y = y + gl.expand_dims(gl.load(B + cols, mask=col_mask, other=0.0).to(gl.float32), 0)
    return y


# ==================================================================================== forward
@gluon.jit(do_not_specialize=["M", "eps"])
def _fwd_kernel(
    X, R, W, B, Y, H, MEAN, RSTD,
    M, N, NH, stride_x, hstride_x, stride_r, hstride_r, stride_y, stride_h, eps,
    LAYERNORM: gl.constexpr, HAS_WEIGHT: gl.constexpr, HAS_BIAS: gl.constexpr, HAS_RESIDUAL: gl.constexpr,
    ROWS: gl.constexpr, BLOCK_N: gl.constexpr, CHUNKED: gl.constexpr, HEADS: gl.constexpr, layout: gl.constexpr,
):  # fmt: skip
    """One block of ROWS rows per program: the whole row in registers (BLOCK_N >= N), or, with
    CHUNKED, walked twice in chunks of BLOCK_N columns. x and the residual may be (T, NH, N)
    views (HEADS); y and h are (M, N)."""
    rows = gl.program_id(0) * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    chunk = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
    row_mask = rows < M
    x_rows = _starts(rows, stride_x, hstride_x, NH, HEADS)
    r_rows = _starts(rows, stride_r, hstride_r, NH, HEADS)
    y_rows = rows.to(gl.int64) * stride_y
    h_rows = rows.to(gl.int64) * stride_h
    if not CHUNKED:
        col_mask = chunk < N
        mask = gl.expand_dims(row_mask, 1) & gl.expand_dims(col_mask, 0)
        x = _load_row(X, R, H, _at(x_rows, chunk), _at(r_rows, chunk), _at(h_rows, chunk), mask, HAS_RESIDUAL)
        if LAYERNORM:
            mean = _sum(x, axis=1) / N
            # centre in registers before squaring (two-pass variance): E[x^2] - E[x]^2 cancels badly
            x = gl.where(mask, x - gl.expand_dims(mean, 1), 0.0)
            gl.store(MEAN + rows, mean, mask=row_mask)
        rstd = _rstd(_sum(x * x, axis=1), N, eps)
        gl.store(RSTD + rows, rstd, mask=row_mask)
        y = _affine(x * gl.expand_dims(rstd, 1), W, B, chunk, col_mask, HAS_WEIGHT, HAS_BIAS)
        gl.store(Y + _at(y_rows, chunk), y.to(Y.dtype.element_ty), mask=mask)
    else:
        n_chunks = gl.cdiv(N, BLOCK_N)
        # pass 1: the statistics (and h, stored, for add + RMSNorm)
        mean = gl.zeros([ROWS], gl.float32, layout=gl.SliceLayout(1, layout))
        m2 = gl.zeros([ROWS], gl.float32, layout=gl.SliceLayout(1, layout))
        sum_sq = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=layout)
        for c in range(0, n_chunks):
            cols = c * BLOCK_N + chunk
            mask = gl.expand_dims(row_mask, 1) & gl.expand_dims(cols < N, 0)
            x = _load_row(X, R, H, _at(x_rows, cols), _at(r_rows, cols), _at(h_rows, cols), mask, HAS_RESIDUAL)
            if LAYERNORM:
                seen = gl.cast(c * BLOCK_N, gl.float32)
                count = gl.cast(gl.minimum(N - c * BLOCK_N, BLOCK_N), gl.float32)
                chunk_mean = _sum(x, axis=1) / count
                dev = gl.where(mask, x - gl.expand_dims(chunk_mean, 1), 0.0)
                delta = chunk_mean - mean
                mean = mean + delta * (count / (seen + count))
                m2 = m2 + _sum(dev * dev, axis=1) + delta * delta * (seen * count / (seen + count))
            else:
                sum_sq += x * x
        if LAYERNORM:
            rstd = _rstd(m2, N, eps)
            gl.store(MEAN + rows, mean, mask=row_mask)
        else:
            rstd = _rstd(_sum(sum_sq, axis=1), N, eps)
        gl.store(RSTD + rows, rstd, mask=row_mask)

        # pass 2, last chunk first (still in L2): y, from x or from the h pass 1 stored
        if HAS_RESIDUAL:
            SRC = H
            src_rows = h_rows
        else:
            SRC = X
            src_rows = x_rows
        for i in range(0, n_chunks):
            cols = (n_chunks - 1 - i) * BLOCK_N + chunk
            col_mask = cols < N
            mask = gl.expand_dims(row_mask, 1) & gl.expand_dims(col_mask, 0)
            x = gl.load(SRC + _at(src_rows, cols), mask=mask, other=0.0).to(gl.float32)
            if LAYERNORM:
                x = x - gl.expand_dims(mean, 1)
            y = _affine(x * gl.expand_dims(rstd, 1), W, B, cols, col_mask, HAS_WEIGHT, HAS_BIAS)
            gl.store(Y + _at(y_rows, cols), y.to(Y.dtype.element_ty), mask=mask)


# ================================================================ realigned rows (forward)
@gluon.jit
def _odd_split(first_row, stride, N, VEC: gl.constexpr):
    """(head, body) of a realigned program's rows: a row at element offset e starts ``head`` =
    (-e) mod VEC elements before its first whole 16-byte vector, whose ``body`` (a multiple of VEC,
    computed as such: the body's mask then holds whole vectors) follows; the rest, under VEC, is the
    tail. All of a program's rows share them (the module docstring), so its first row gives them."""
    e = first_row.to(gl.int64) * stride
    head = ((VEC - e % VEC) % VEC).to(gl.int32)
    return head, gl.maximum(N - head, 0) // VEC * VEC


@gluon.jit
def _odd_edges(head, body, N, VEC: gl.constexpr, edge_layout: gl.constexpr):
    """The columns of a row's head and tail as one short vector, and its lanes that hold one."""
    k = gl.arange(0, 2 * VEC, layout=gl.SliceLayout(0, edge_layout))
    return k + gl.where(k >= head, body, 0), k < N - body


@gluon.jit
def _odd_columns(me, stride, N, VEC: gl.constexpr, BLOCK_N: gl.constexpr, layout: gl.constexpr,
                 edge_layout: gl.constexpr):  # fmt: skip
    """Program ``me``'s columns: (head, j, the body's lanes, the edge's columns, its lanes); the
    body's column j is head + j."""
    head, body = _odd_split(me, stride, N, VEC)
    j = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
    edge_cols, in_edge = _odd_edges(head, body, N, VEC, edge_layout)
    return head, j, j < body, edge_cols, in_edge


@gluon.jit
def _load_shifted(P, head, j, in_body, edge_cols, in_edge):
    """A per-column vector (weight, bias) in a realigned program's columns: (body, edge), fp32."""
    body = gl.expand_dims(gl.load(P + head + j, mask=in_body, other=0.0).to(gl.float32), 0)
    edge = gl.expand_dims(gl.load(P + edge_cols, mask=in_edge, other=0.0).to(gl.float32), 0)
    return body, edge


@gluon.jit
def _store_shifted(P, head, j, in_body, edge_cols, in_edge, body, edge):
    """A partial row (dw, db) from a realigned program's columns, in natural column order."""
    gl.store(P + head + j, body, mask=in_body)
    gl.store(P + edge_cols, edge, mask=in_edge)


@gluon.jit
def _load_split(P, body_at, edge_at, mask_b, mask_e):
    """A tile of realigned rows in its storage dtype: (body, edge)."""
    return gl.load(P + body_at, mask=mask_b, other=0.0), gl.load(P + edge_at, mask=mask_e, other=0.0)


@gluon.jit
def _odd_rows(me, programs, ROWS: gl.constexpr, layout: gl.constexpr):
    """The first tile's rows of program ``me``: me, me + programs, ... (one offset within a vector)."""
    return me + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout)) * programs


@gluon.jit
def _odd_body(rows, M, stride, j, in_body, VEC: gl.constexpr):
    """[rows, body] offsets and mask: from each row's offset rounded up to a multiple of VEC,
    computed as such, so that the compiler sees 16-byte aligned runs and moves whole vectors."""
    at = rows.to(gl.int64) * stride
    mask = gl.expand_dims(rows < M, 1) & gl.expand_dims(in_body, 0)
    return gl.expand_dims((at + VEC - 1) // VEC * VEC, 1) + gl.expand_dims(j, 0), mask


@gluon.jit
def _odd_edge(rows, M, stride, edge_cols, in_edge):
    """[rows, head and tail] offsets and mask (element-wise accesses)."""
    return _offsets(rows, edge_cols, stride), gl.expand_dims(rows < M, 1) & gl.expand_dims(in_edge, 0)


@gluon.jit
def _row_sum(body, edge, layout: gl.constexpr):
    """Per row, the sum of a realigned row's body and edge terms, in the body's row layout (the
    edge's row layout holds the same elements in the same places: the conversion moves nothing).
    Its rounding depends on which columns are body and which edge, so on where the row starts
    within a vector: not batch invariant (see the module docstring)."""
    return _sum(body, axis=1) + gl.convert_layout(_sum(edge, axis=1), gl.SliceLayout(1, layout))


@gluon.jit
def _per_edge(v, edge_layout: gl.constexpr):
    """A per-row value as a column to broadcast over the edge tile."""
    return gl.expand_dims(gl.convert_layout(v, gl.SliceLayout(1, edge_layout)), 1)


@gluon.jit(do_not_specialize=["M", "eps"])
def _fwd_odd_kernel(
    X, R, W, B, Y, H, MEAN, RSTD, M, N, stride, eps,
    LAYERNORM: gl.constexpr, HAS_WEIGHT: gl.constexpr, HAS_BIAS: gl.constexpr, HAS_RESIDUAL: gl.constexpr,
    ROWS: gl.constexpr, BLOCK_N: gl.constexpr, VEC: gl.constexpr, layout: gl.constexpr, edge_layout: gl.constexpr,
):  # fmt: skip
    """The forward of (M, N) rows whose length is no multiple of a 16-byte vector, all row tensors
    of one ``stride`` with 16-byte aligned starts. Program p of G (a multiple of VEC) walks rows
    p, p + G, ..., which all start at the same offset within a vector: their bodies move in whole
    vectors, their heads and tails element-wise, and the weight (and bias) is loaded once, shifted
    to match. The next tile's loads go out before this tile's math (few programs per SM: their
    loads must keep enough bytes in flight)."""
    me = gl.program_id(0)
    programs = gl.num_programs(0)
    head, j, in_body, edge_cols, in_edge = _odd_columns(me, stride, N, VEC, BLOCK_N, layout, edge_layout)
    if HAS_WEIGHT:
        w_body, w_edge = _load_shifted(W, head, j, in_body, edge_cols, in_edge)
    if HAS_BIAS:
        b_body, b_edge = _load_shifted(B, head, j, in_body, edge_cols, in_edge)

    rows = _odd_rows(me, programs, ROWS, layout)
    rows_e = _odd_rows(me, programs, ROWS, edge_layout)
    body_at, mask_b = _odd_body(rows, M, stride, j, in_body, VEC)
    edge_at, mask_e = _odd_edge(rows_e, M, stride, edge_cols, in_edge)
    xb_next, xe_next = _load_split(X, body_at, edge_at, mask_b, mask_e)
    if HAS_RESIDUAL:
        rb_next, re_next = _load_split(R, body_at, edge_at, mask_b, mask_e)
    for t in range(gl.cdiv(gl.cdiv(M - me, programs), ROWS)):
        here, here_b, here_e, here_mb, here_me = rows, body_at, edge_at, mask_b, mask_e
        xb, xe = xb_next, xe_next
        if HAS_RESIDUAL:
            rb, r_e = rb_next, re_next

        rows += ROWS * programs
        rows_e += ROWS * programs
        body_at, mask_b = _odd_body(rows, M, stride, j, in_body, VEC)
        edge_at, mask_e = _odd_edge(rows_e, M, stride, edge_cols, in_edge)
        xb_next, xe_next = _load_split(X, body_at, edge_at, mask_b, mask_e)
        if HAS_RESIDUAL:
            rb_next, re_next = _load_split(R, body_at, edge_at, mask_b, mask_e)

        if HAS_RESIDUAL:  # h rounded once to x's dtype and stored, as ``_load_row`` does
            xb = (xb.to(gl.float32) + rb.to(gl.float32)).to(X.dtype.element_ty)
            xe = (xe.to(gl.float32) + r_e.to(gl.float32)).to(X.dtype.element_ty)
            gl.store(H + here_b, xb, mask=here_mb)
            gl.store(H + here_e, xe, mask=here_me)
        xb = xb.to(gl.float32)
        xe = xe.to(gl.float32)
        row_mask = here < M
        if LAYERNORM:
            mean = _row_sum(xb, xe, layout) / N
            xb = gl.where(here_mb, xb - gl.expand_dims(mean, 1), 0.0)
            xe = gl.where(here_me, xe - _per_edge(mean, edge_layout), 0.0)
            gl.store(MEAN + here, mean, mask=row_mask)
        rstd = _rstd(_row_sum(xb * xb, xe * xe, layout), N, eps)
        gl.store(RSTD + here, rstd, mask=row_mask)
        yb = xb * gl.expand_dims(rstd, 1)
        ye = xe * _per_edge(rstd, edge_layout)
        if HAS_WEIGHT:
            yb = yb * w_body
            ye = ye * w_edge
        if HAS_BIAS:
            yb = yb + b_body
            ye = ye + b_edge
        gl.store(Y + here_b, yb.to(Y.dtype.element_ty), mask=here_mb)
        gl.store(Y + here_e, ye.to(Y.dtype.element_ty), mask=here_me)


# =================================================================================== backward
@gluon.jit
def _row_block_range(M, ROWS: gl.constexpr, worker, workers):
    """Worker ``worker``'s contiguous range of row blocks out of ``workers``, sizes differing by
    at most one, so that no program idles while another finishes a double share."""
    n_blocks = gl.cdiv(M, ROWS)
    share = n_blocks // workers
    extra = n_blocks % workers
    first = worker * share + gl.minimum(worker, extra)
    return first, first + share + (worker < extra).to(gl.int32)


@gluon.jit
def _load_tiles(DY, X, dy_rows, x_rows, row_mask, cols, col_mask):
    """x and dy of a [rows, cols] tile (rows starting at ``x_rows``, ``dy_rows``) in their storage
    dtype; 0 outside the masks."""
    mask = gl.expand_dims(row_mask, 1) & gl.expand_dims(col_mask, 0)
    x = gl.load(X + _at(x_rows, cols), mask=mask, other=0.0)
    dy = gl.load(DY + _at(dy_rows, cols), mask=mask, other=0.0)
    return x, dy


@gluon.jit
def _row_stats(MEAN, RSTD, rows, row_mask, LAYERNORM: gl.constexpr):
    """(mean, rstd) of the rows (mean: rstd's values, unread, without LAYERNORM)."""
    rstd = gl.load(RSTD + rows, mask=row_mask, other=0.0)
    if LAYERNORM:
        mean = gl.load(MEAN + rows, mask=row_mask, other=0.0)
    else:
        mean = rstd
    return mean, rstd


@gluon.jit
def _bwd_terms(x, dy, W, mean, row_mask, cols, col_mask, LAYERNORM: gl.constexpr, HAS_WEIGHT: gl.constexpr):
    """(x - mean or x, dy, g = dy * w) in fp32 from ``_load_tiles``' tiles and the rows' means;
    padding lanes hold 0."""
    x = x.to(gl.float32)
    dy = dy.to(gl.float32)
    if LAYERNORM:
        mask = gl.expand_dims(row_mask, 1) & gl.expand_dims(col_mask, 0)
        x = gl.where(mask, x - gl.expand_dims(mean, 1), 0.0)
    g = dy
    if HAS_WEIGHT:
        g = dy * gl.expand_dims(gl.load(W + cols, mask=col_mask, other=0.0).to(gl.float32), 0)
    return x, dy, g


@gluon.jit(do_not_specialize=["M"])
def _bwd_row_sums_kernel(
    DY, X, W, MEAN, ROW_SUMS,
    M, N, NH, stride_dy, hstride_dy, stride_x, hstride_x,
    LAYERNORM: gl.constexpr, HAS_WEIGHT: gl.constexpr,
    ROWS: gl.constexpr, BLOCK_N: gl.constexpr, SLICES: gl.constexpr, HEADS: gl.constexpr, layout: gl.constexpr,
):  # fmt: skip
    """ROW_SUMS[0, row, s] = sum over slice s of g * (x - mean); ROW_SUMS[1, row, s] = of g."""
    me = gl.program_id(0) % SLICES
    rows = (gl.program_id(0) // SLICES) * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    cols = me * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
    row_mask = rows < M
    dy_rows = _starts(rows, stride_dy, hstride_dy, NH, HEADS)
    x_rows = _starts(rows, stride_x, hstride_x, NH, HEADS)
    x, dy = _load_tiles(DY, X, dy_rows, x_rows, row_mask, cols, cols < N)
    mean = gl.load(MEAN + rows, mask=row_mask, other=0.0) if LAYERNORM else gl.zeros_like(rows.to(gl.float32))
    xc, dy, g = _bwd_terms(x, dy, W, mean, row_mask, cols, cols < N, LAYERNORM, HAS_WEIGHT)
    at = rows.to(gl.int64) * SLICES + me
    gl.store(ROW_SUMS + at, _sum(g * xc, axis=1), mask=row_mask)
    if LAYERNORM:
        gl.store(ROW_SUMS + M * SLICES + at, _sum(g, axis=1), mask=row_mask)


@gluon.jit
def _publish(SLOT, value, row_mask):
    """Post a slice's row sums to its siblings: each fp32 sum in the low half of an int64 slot,
    bit 32 set as the "posted" flag, in one atomic exchange (a reader that sees the flag sees the
    value with it)."""
    bits = value.to(gl.uint32, bitcast=True).to(gl.int64)
    gl.atomic_xchg(SLOT, bits | 4294967296, mask=row_mask, sem="relaxed")


@gluon.jit
def _posted(v):
    """The fp32 value in a slot's low half; NaN where the slot was never posted."""
    return gl.where((v >> 32) == 0, float("nan"), v.to(gl.int32).to(gl.float32, bitcast=True))


@gluon.jit
def _await_slots(slots, plane, mask, spin, PLANES: gl.constexpr):
    """The posted values of ``slots`` ([rows, slices] pointers; 0 outside ``mask``), once all have
    posted: re-read (volatile: from L2) until every slot carries its flag. With ``PLANES`` = 2
    (LayerNorm's two statistics, the second plane ``plane`` slots on) both planes are re-read in
    every round and both values come back: one L2 round trip a round, where waiting for one plane
    and then the other took two (the second is posted with the first, so its own wait was a round
    trip that found it there); with one plane the second value is the first's. The slots lie
    within one warp in the sliced tiles' layout, so every warp waits on its own copy, which once
    complete is final (a slot only goes from empty to posted); spread over warps, the exit test
    would be a reduction across copies read at different moments. Bounded (``spin`` re-reads, 0
    once run out): a sibling that never posts gives NaN values, a visibly wrong result, not a hang."""
    v = gl.load(slots, mask=mask, other=4294967296, volatile=True)
    u = v
    if PLANES == 2:
        u = gl.load(slots + plane, mask=mask, other=4294967296, volatile=True)
    tries = 0
    while (gl.reduce(gl.reduce((v & u) >> 32, 1, _min), 0, _min) == 0) & (tries < spin):
        v = gl.load(slots, mask=mask, other=4294967296, volatile=True)
        u = v
        if PLANES == 2:
            u = gl.load(slots + plane, mask=mask, other=4294967296, volatile=True)
        tries += 1
    posted = gl.reduce(gl.reduce((v & u) >> 32, 1, _min), 0, _min) != 0
    return _posted(v), _posted(u), gl.where(posted, spin, 0)


@gluon.jit
def _await_sums(slots, plane, mask, spin, PLANES: gl.constexpr):
    """The rows' sums over every slice of each plane, once all have posted (``_await_slots``),
    added in slice order: the same bits in every sibling."""
    a, b, spin = _await_slots(slots, plane, mask, spin, PLANES)
    return _sum(a, axis=1), _sum(b, axis=1), spin


@gluon.jit(do_not_specialize=["M"])
def _bwd_kernel(
    DY, X, W, MEAN, RSTD, DRES, ROW_SUMS, DX, DW_PARTIAL, DB_PARTIAL,
    M, N, NH, stride_dy, hstride_dy, stride_x, hstride_x, stride_dres, hstride_dres, stride_dx,
    LAYERNORM: gl.constexpr, HAS_WEIGHT: gl.constexpr, HAS_DRESIDUAL: gl.constexpr,
    ROWS: gl.constexpr, BLOCK_N: gl.constexpr, SLICES: gl.constexpr, SLICES_P2: gl.constexpr,
    HEADS: gl.constexpr, layout: gl.constexpr, SYNC: gl.constexpr, PAIRED: gl.constexpr, SPIN,
):  # fmt: skip
    """Program (group, slice) owns columns [slice * BLOCK_N, +BLOCK_N) of its group's row blocks
    (SLICES = 1: the whole row, whose reductions it computes itself). dy, x and dresidual_out may
    be (T, NH, N) views (HEADS); dx is (M, N). With SYNC the siblings of a row group post their
    slices' row sums to ROW_SUMS (int64 slots, zeroed by the launcher) and wait for each other's,
    the next block's loads already in flight: x and dy are read once (without it, from
    ``_bwd_row_sums_kernel``'s sums: twice). The launcher keeps the grid resident (at most
    ``Plan.per_sm`` programs per SM, and no more than the binary lets an SM hold)."""
    row_layout: gl.constexpr = gl.SliceLayout(1, layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, layout)
    me = gl.program_id(0) % SLICES
    group = gl.program_id(0) // SLICES
    first, last = _row_block_range(M, ROWS, group, gl.num_programs(0) // SLICES)
    cols = me * BLOCK_N + gl.arange(0, BLOCK_N, layout=col_layout)
    col_mask = cols < N
    # dw and db per row of the tile, summed over the rows once at the end: a sum over the tile's
    # rows per block would cross warps through shared memory (a barrier) every block, which for
    # small rows costs more than the block's own loads
    dw = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=layout)
    db = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=layout)
    end = gl.minimum(M, last * ROWS)  # rows from here on are the next program's
    spin = SPIN
    # Software pipelining by hand: the next block's x and dy are loaded before this block's math,
    # so that a program always has a block in flight while it computes; they wait in registers
    # in their storage dtype (for 16-bit x, half the registers of the fp32 math). The rows' rstd
    # (and mean) come with them: loaded in their own iteration, each block would wait a DRAM
    # latency on them before its sums, LayerNorm's mean even before its first one.
    rows = first * ROWS + gl.arange(0, ROWS, layout=row_layout)
    x_next, dy_next = _load_tiles(
        DY, X, _starts(rows, stride_dy, hstride_dy, NH, HEADS), _starts(rows, stride_x, hstride_x, NH, HEADS),
        rows < end, cols, col_mask,
    )  # fmt: skip
    mean_next, rstd_next = _row_stats(MEAN, RSTD, rows, rows < end, LAYERNORM)
    for block in range(first, last):
        row_mask = rows < end
        mask = gl.expand_dims(row_mask, 1) & gl.expand_dims(col_mask, 0)
        x, dy, mean, rstd = x_next, dy_next, mean_next, rstd_next
        ahead = rows + ROWS
        x_next, dy_next = _load_tiles(
            DY, X, _starts(ahead, stride_dy, hstride_dy, NH, HEADS), _starts(ahead, stride_x, hstride_x, NH, HEADS),
            ahead < end, cols, col_mask,
        )  # fmt: skip
        mean_next, rstd_next = _row_stats(MEAN, RSTD, ahead, ahead < end, LAYERNORM)
        xc, dy, g = _bwd_terms(x, dy, W, mean, row_mask, cols, col_mask, LAYERNORM, HAS_WEIGHT)
        if SLICES == 1:
            sum_gxc = _sum(g * xc, axis=1)
            sum_g = _sum(g, axis=1)
        else:
            # the slices' sums, added in slice order whichever program computed them: deterministic
            k = gl.arange(0, SLICES_P2, layout=col_layout)
            at = gl.expand_dims(rows.to(gl.int64) * SLICES, 1) + gl.expand_dims(k, 0)
            sums_mask = gl.expand_dims(row_mask, 1) & gl.expand_dims(k < SLICES, 0)
            if SYNC:
                own = rows.to(gl.int64) * SLICES + me
                _publish(ROW_SUMS + own, _sum(g * xc, axis=1), row_mask)
                if LAYERNORM:
                    _publish(ROW_SUMS + M * SLICES + own, _sum(g, axis=1), row_mask)
                if PAIRED or not LAYERNORM:
                    # LayerNorm's two sums in one wait (``_await_slots``); RMSNorm's second is its first
                    sum_gxc, sum_g, spin = _await_sums(ROW_SUMS + at, M * SLICES, sums_mask, spin, 1 + LAYERNORM)
                else:  # one plane, then the other (``PAIRED_SLICES_MAX``)
                    sum_gxc, _, spin = _await_sums(ROW_SUMS + at, 0, sums_mask, spin, 1)
                    sum_g, _, spin = _await_sums(ROW_SUMS + M * SLICES + at, 0, sums_mask, spin, 1)
            else:
                sum_gxc = _sum(gl.load(ROW_SUMS + at, mask=sums_mask, other=0.0), axis=1)
                sum_g = _sum(gl.load(ROW_SUMS + M * SLICES + at, mask=sums_mask, other=0.0), axis=1)
        xhat = xc * gl.expand_dims(rstd, 1)
        dx = g - xhat * gl.expand_dims(sum_gxc * rstd / N, 1)
        if LAYERNORM:
            dx = dx - gl.expand_dims(sum_g / N, 1)
            db += dy
        dx = dx * gl.expand_dims(rstd, 1)
        if HAS_DRESIDUAL:
            dres_at = _at(_starts(rows, stride_dres, hstride_dres, NH, HEADS), cols)
            dx += gl.load(DRES + dres_at, mask=mask, other=0.0).to(gl.float32)
        if HAS_WEIGHT:
            dw += dy * xhat
        gl.store(DX + _offsets(rows, cols, stride_dx), dx.to(DX.dtype.element_ty), mask=mask)
        rows += ROWS

    partial = group.to(gl.int64) * N + cols
    if HAS_WEIGHT:
        gl.store(DW_PARTIAL + partial, _sum(dw, axis=0), mask=col_mask)
    if LAYERNORM:
        gl.store(DB_PARTIAL + partial, _sum(db, axis=0), mask=col_mask)


@gluon.jit(do_not_specialize=["M"])
def _bwd_odd_kernel(
    DY, X, W, MEAN, RSTD, DRES, DX, DW_PARTIAL, DB_PARTIAL, M, N, stride,
    LAYERNORM: gl.constexpr, HAS_WEIGHT: gl.constexpr, HAS_DRESIDUAL: gl.constexpr,
    ROWS: gl.constexpr, BLOCK_N: gl.constexpr, VEC: gl.constexpr, layout: gl.constexpr, edge_layout: gl.constexpr,
):  # fmt: skip
    """The backward of the rows ``_fwd_odd_kernel`` takes, over the same rows p, p + G, ... per
    program, so that the weight and the dw / db accumulators hold one shift for all of a program's
    rows: the body's columns start at ``head``, the head's and tail's are ``edge_cols``. The next
    tile's x, dy and statistics load before this tile's math (as ``_bwd_kernel``'s); the partial
    rows are written once, at the end, in natural column order."""
    me = gl.program_id(0)
    programs = gl.num_programs(0)
    head, j, in_body, edge_cols, in_edge = _odd_columns(me, stride, N, VEC, BLOCK_N, layout, edge_layout)
    if HAS_WEIGHT:
        w_body, w_edge = _load_shifted(W, head, j, in_body, edge_cols, in_edge)
    # summed over the tile's rows per tile: the rows repeat within each thread (``plan``), no warp
    # crossed
    dw_body = gl.zeros([BLOCK_N], gl.float32, layout=gl.SliceLayout(0, layout))
    db_body = gl.zeros([BLOCK_N], gl.float32, layout=gl.SliceLayout(0, layout))
    dw_edge = gl.zeros([2 * VEC], gl.float32, layout=gl.SliceLayout(0, edge_layout))
    db_edge = gl.zeros([2 * VEC], gl.float32, layout=gl.SliceLayout(0, edge_layout))

    rows = _odd_rows(me, programs, ROWS, layout)
    rows_e = _odd_rows(me, programs, ROWS, edge_layout)
    body_at, mask_b = _odd_body(rows, M, stride, j, in_body, VEC)
    edge_at, mask_e = _odd_edge(rows_e, M, stride, edge_cols, in_edge)
    xb_next, xe_next = _load_split(X, body_at, edge_at, mask_b, mask_e)
    dyb_next, dye_next = _load_split(DY, body_at, edge_at, mask_b, mask_e)
    mean_next, rstd_next = _row_stats(MEAN, RSTD, rows, rows < M, LAYERNORM)
    for t in range(gl.cdiv(gl.cdiv(M - me, programs), ROWS)):
        here_b, here_e, here_mb, here_me = body_at, edge_at, mask_b, mask_e
        xb, dyb = xb_next.to(gl.float32), dyb_next.to(gl.float32)
        xe, dye = xe_next.to(gl.float32), dye_next.to(gl.float32)
        mean, rstd = mean_next, rstd_next

        rows += ROWS * programs
        rows_e += ROWS * programs
        body_at, mask_b = _odd_body(rows, M, stride, j, in_body, VEC)
        edge_at, mask_e = _odd_edge(rows_e, M, stride, edge_cols, in_edge)
        xb_next, xe_next = _load_split(X, body_at, edge_at, mask_b, mask_e)
        dyb_next, dye_next = _load_split(DY, body_at, edge_at, mask_b, mask_e)
        mean_next, rstd_next = _row_stats(MEAN, RSTD, rows, rows < M, LAYERNORM)

        if LAYERNORM:
            xb = gl.where(here_mb, xb - gl.expand_dims(mean, 1), 0.0)
            xe = gl.where(here_me, xe - _per_edge(mean, edge_layout), 0.0)
        rstd_e = _per_edge(rstd, edge_layout)
        xhat_b = xb * gl.expand_dims(rstd, 1)
        xhat_e = xe * rstd_e
        gb = dyb
        ge = dye
        if HAS_WEIGHT:
            gb = dyb * w_body
            ge = dye * w_edge
        c1 = _row_sum(gb * xhat_b, ge * xhat_e, layout) / N
        dxb = gb - xhat_b * gl.expand_dims(c1, 1)
        dxe = ge - xhat_e * _per_edge(c1, edge_layout)
        if LAYERNORM:
            c2 = _row_sum(gb, ge, layout) / N
            dxb = dxb - gl.expand_dims(c2, 1)
            dxe = dxe - _per_edge(c2, edge_layout)
            db_body += _sum(dyb, axis=0)
            db_edge += _sum(dye, axis=0)
        dxb = dxb * gl.expand_dims(rstd, 1)
        dxe = dxe * rstd_e
        if HAS_DRESIDUAL:  # (not prefetched, as in ``_bwd_kernel``)
            dxb += gl.load(DRES + here_b, mask=here_mb, other=0.0).to(gl.float32)
            dxe += gl.load(DRES + here_e, mask=here_me, other=0.0).to(gl.float32)
        if HAS_WEIGHT:
            dw_body += _sum(dyb * xhat_b, axis=0)
            dw_edge += _sum(dye * xhat_e, axis=0)
        gl.store(DX + here_b, dxb.to(DX.dtype.element_ty), mask=here_mb)
        gl.store(DX + here_e, dxe.to(DX.dtype.element_ty), mask=here_me)

    partial = me.to(gl.int64) * N
    if HAS_WEIGHT:
        _store_shifted(DW_PARTIAL + partial, head, j, in_body, edge_cols, in_edge, dw_body, dw_edge)
    if LAYERNORM:
        _store_shifted(DB_PARTIAL + partial, head, j, in_body, edge_cols, in_edge, db_body, db_edge)


@gluon.jit
def _sum_partials_kernel(PARTIALS, OUT, P, P_STRIDE, N, BLOCK_P: gl.constexpr, BLOCK_N: gl.constexpr, layout: gl.constexpr):
    """OUT[k, :] = sum over p < P of PARTIALS[k, p, :] (PARTIALS: [K, P_STRIDE, N]) in fp32, always
    in the same order, rounded once to OUT's dtype (the weight's)."""
    cols = gl.program_id(0) * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
    k = gl.program_id(1).to(gl.int64)
    acc = gl.zeros([BLOCK_P, BLOCK_N], gl.float32, layout=layout)
    for p0 in range(0, P, BLOCK_P):
        p = p0 + gl.arange(0, BLOCK_P, layout=gl.SliceLayout(1, layout))
        mask = gl.expand_dims(p < P, 1) & gl.expand_dims(cols < N, 0)
        acc += gl.load(PARTIALS + _offsets(k * P_STRIDE + p, cols, N), mask=mask, other=0.0)
    gl.store(OUT + k * N + cols, _sum(acc, axis=0).to(OUT.dtype.element_ty), mask=cols < N)


# ======================================================= forward of wide rows: exchanging slices
@gluon.jit(do_not_specialize=["M", "eps", "SLICES", "SPIN"])
def _fwd_sliced_kernel(
    X, R, W, B, Y, H, MEAN, RSTD, SUMS, M2S,
    M, N, NH, stride_x, hstride_x, stride_r, hstride_r, stride_y, stride_h, eps, SLICES, SPIN,
    LAYERNORM: gl.constexpr, HAS_WEIGHT: gl.constexpr, HAS_BIAS: gl.constexpr, HAS_RESIDUAL: gl.constexpr,
    ROWS: gl.constexpr, BLOCK_N: gl.constexpr, SLOTS: gl.constexpr, HEADS: gl.constexpr, layout: gl.constexpr,
):  # fmt: skip
    """Program (group, slice) owns columns [slice * BLOCK_N, +BLOCK_N) of its group's contiguous
    range of row blocks and reads them once. Per block it posts its slice's partial statistics to
    SUMS (and M2S; (M, SLICES) int64 slots, zeroed by the launcher): RMSNorm the sum of squares,
    LayerNorm the sum and the sum of squared deviations from the slice's own mean; waits for its
    siblings' with the next block's loads in flight; merges them in slice order (LayerNorm: Chan et
    al.), the same bits in every sibling; and writes its slice of y (and of h). SLOTS: the slot
    tile's width, a power of two >= SLICES. x and the residual may be (T, NH, N) views (HEADS); y
    and h are (M, N). The launcher keeps every sibling resident."""
    row_layout: gl.constexpr = gl.SliceLayout(1, layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, layout)
    me = gl.program_id(0) % SLICES
    group = gl.program_id(0) // SLICES
    first, last = _row_block_range(M, ROWS, group, gl.num_programs(0) // SLICES)
    cols = me * BLOCK_N + gl.arange(0, BLOCK_N, layout=col_layout)
    col_mask = cols < N
    # the slice's weight and bias once per program, in their storage dtype (half the registers of
    # fp32 for 16-bit weights), upcast at each use
    if HAS_WEIGHT:
        w = gl.expand_dims(gl.load(W + cols, mask=col_mask, other=0.0), 0)
    if HAS_BIAS:
        b = gl.expand_dims(gl.load(B + cols, mask=col_mask, other=0.0), 0)
    # the slots' columns, and each slice's valid columns (the last slice may be partial; none past it)
    k = gl.arange(0, SLOTS, layout=col_layout)
    counts = gl.expand_dims(gl.minimum(gl.maximum(N - k * BLOCK_N, 0), BLOCK_N).to(gl.float32), 0)
    own_count = gl.minimum(N - me * BLOCK_N, BLOCK_N).to(gl.float32)
    end = gl.minimum(M, last * ROWS)  # rows from here on are the next group's
    # every sibling holds the same statistics: the first slice stores them
    stats_end = gl.where(me == 0, end, 0)
    spin = SPIN
    rows = first * ROWS + gl.arange(0, ROWS, layout=row_layout)
    mask = gl.expand_dims(rows < end, 1) & gl.expand_dims(col_mask, 0)
    x_next = gl.load(X + _at(_starts(rows, stride_x, hstride_x, NH, HEADS), cols), mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r_next = gl.load(R + _at(_starts(rows, stride_r, hstride_r, NH, HEADS), cols), mask=mask, other=0.0)
    for block in range(first, last):
        row_mask = rows < end
        mask = gl.expand_dims(row_mask, 1) & gl.expand_dims(col_mask, 0)
        x = x_next
        if HAS_RESIDUAL:
            r = r_next
        # the next block's slice goes out before this block's exchange: the wait overlaps its loads,
        # which wait in registers in their storage dtype
        ahead = rows + ROWS
        ahead_mask = gl.expand_dims(ahead < end, 1) & gl.expand_dims(col_mask, 0)
        x_next = gl.load(X + _at(_starts(ahead, stride_x, hstride_x, NH, HEADS), cols), mask=ahead_mask, other=0.0)
        if HAS_RESIDUAL:
            r_next = gl.load(R + _at(_starts(ahead, stride_r, hstride_r, NH, HEADS), cols), mask=ahead_mask, other=0.0)
        if HAS_RESIDUAL:  # h rounded once to x's dtype and stored, as ``_load_row`` does
            x = (x.to(gl.float32) + r.to(gl.float32)).to(X.dtype.element_ty)
            gl.store(H + _at(rows.to(gl.int64) * stride_h, cols), x, mask=mask)
        x = x.to(gl.float32)

        first_slot = rows.to(gl.int64) * SLICES
        slots = gl.expand_dims(first_slot, 1) + gl.expand_dims(k, 0)
        slots_mask = gl.expand_dims(row_mask, 1) & gl.expand_dims(k < SLICES, 0)
        if LAYERNORM:
            part = _sum(x, axis=1)
            dev = gl.where(mask, x - gl.expand_dims(part / own_count, 1), 0.0)
            _publish(SUMS + first_slot + me, part, row_mask)
            _publish(M2S + first_slot + me, _sum(dev * dev, axis=1), row_mask)
            sums, m2s, spin = _await_slots(SUMS + slots, M * SLICES, slots_mask, spin, 2)  # M2S is SUMS + M * SLICES
            mean = _sum(sums, axis=1) / N
            # Chan et al.: M2 = sum of the slices' M2 + sum of n_s (mean_s - mean)^2, never
            # E[x^2] - E[x]^2 (cancels badly); slots past the last slice count 0 columns
            spread = gl.where(counts > 0, sums / gl.maximum(counts, 1.0), 0.0) - gl.expand_dims(mean, 1)
            m2 = _sum(m2s, axis=1) + _sum(gl.where(counts > 0, counts * spread * spread, 0.0), axis=1)
            x = x - gl.expand_dims(mean, 1)
            rstd = _rstd(m2, N, eps)
        else:
            _publish(SUMS + first_slot + me, _sum(x * x, axis=1), row_mask)
            sum_sq, _, spin = _await_sums(SUMS + slots, 0, slots_mask, spin, 1)
            rstd = _rstd(sum_sq, N, eps)
        stats_mask = rows < stats_end
        if LAYERNORM:
            gl.store(MEAN + rows, mean, mask=stats_mask)
        gl.store(RSTD + rows, rstd, mask=stats_mask)
        y = x * gl.expand_dims(rstd, 1)
        if HAS_WEIGHT:
            y = y * w.to(gl.float32)
        if HAS_BIAS:
            y = y + b.to(gl.float32)
        gl.store(Y + _at(rows.to(gl.int64) * stride_y, cols), y.to(Y.dtype.element_ty), mask=mask)
        rows += ROWS


# ============================================================================ launching
# A launch is (kernel, grid, runtime args, compile-time args, warps). On a GPU it runs; in
# ``compile_only`` mode (no GPU: the tests) it is compiled for sm_90a from the same description,
# so the host code the GPU runs is the host code the tests exercise.
# The wide-row backward's slices exchange their row sums (``_await_sums``) where the plan says so
# (``Plan.exchange``); off, a first kernel sums every (row, slice) and x and dy are read twice
EXCHANGE = True
SYNC_SLOTS_MAX = 32  # slots (rows x slices, padded to a power of two) a block may wait on: one warp
SPIN_LIMIT = 1 << 20  # re-reads of the posted sums before a program gives up on a sibling (~1 s)
# LayerNorm's exchanging backward waits for both of its sums in one loop (both planes re-read each
# round) up to this many slices a row, and for one plane, then the other, past it: on an H100 (bf16)
# the single wait moved LayerNorm by 0.4-8.7 points at 10240-49152 (5-12 slices), by 0.5 at 65536
# and by -5 at 131072 (16 slices each: the early siblings re-read twice the slots while they wait)
PAIRED_SLICES_MAX = 12
FWD_SLOTS = 32  # the exchanging forward's slot tile: at least this wide (fewer binaries)
_COMPILE_ONLY: list = []  # a stack of lists collecting compiled kernels
_INTERPRETED: list = []  # a stack of {kernel name: interpreted copy} (interpret.layouts_erased)
# Without a GPU (compile_only, or the interpreter) grids are sized for one SM: the interpreter
# pays per program, and the persistent backward's programs then each walk several row blocks.
SM_COUNT_WITHOUT_GPU = 1


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return SM_COUNT_WITHOUT_GPU
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def _launch(kernel, grid, args: dict, constexprs: dict, num_warps: int):
    if _COMPILE_ONLY:
        _COMPILE_ONLY[-1].append(compile_kernel(kernel, args, constexprs, num_warps))
        return
    if _INTERPRETED:
        _INTERPRETED[-1][kernel.fn.__name__][grid](**args, **constexprs)
        return
    # a repeated launch goes straight to the kernel compiled for the first (harness.spec.jit_launch)
    launch_named(kernel, grid, {**args, **constexprs}, num_warps)


_SIG = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.float8_e4m3fn: "*fp8e4nv", torch.int64: "*i64"}


def compile_kernel(kernel, args: dict, constexprs: dict, num_warps: int, capability: int = 90):
    """Compile ``kernel`` for ``sm_<capability>`` without a GPU, specialised as a launch with
    these arguments would be (16-byte aligned pointers, strides divisible by 16 where they are)."""
    from triton.backends.compiler import GPUTarget

    try:
        from triton.experimental.gluon import GluonASTSource  # triton >= 3.7
    except ImportError:
        from triton.experimental.gluon._runtime import GluonASTSource  # triton 3.6

    signature, attrs = {}, {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        value = args[name]
        index = (kernel.arg_names.index(name),)
        if isinstance(value, torch.Tensor):
            signature[name] = _SIG[value.dtype]
            attrs[index] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if value % 16 == 0 and name not in kernel.do_not_specialize:
                attrs[index] = [["tt.divisibility", 16]]
    src = GluonASTSource(kernel, signature, constexprs, attrs)
    target = GPUTarget("cuda", capability, 32)
    return triton.compile(src, target=target, options={"num_warps": num_warps})


class compile_only:
    """``with compile_only() as compiled:`` the contract functions compile their kernels for
    sm_90a instead of launching them (their outputs stay unwritten); ``compiled`` lists them."""

    def __enter__(self):
        _COMPILE_ONLY.append([])
        return _COMPILE_ONLY[-1]

    def __exit__(self, *exc):
        _COMPILE_ONLY.pop()
        return False


def _grid_rows(m: int, t: Tile) -> int:
    return triton.cdiv(m, t.rows)


def _row_shape(x) -> tuple[int, int, int]:
    """(M, N, NH) of a row tensor: (M, N) rows, or a (T, NH, N) view of M = T * NH rows (NH = 0)."""
    if x.dim() == 3:
        return x.shape[0] * x.shape[1], x.shape[2], x.shape[1]
    return x.shape[0], x.shape[1], 0


def _stride_args(name: str, t, heads: int) -> dict:
    """``stride_<name>`` and ``hstride_<name>`` of a row tensor, for ``_starts``: (row stride, 0)
    of an (M, N) tensor, (token stride, head stride) of a (T, NH, N) view; an (M, N) tensor beside
    such views is addressed as its (T, NH, N) view."""
    if t.dim() == 3:
        stride, hstride = t.stride(0), t.stride(1)
    else:
        stride, hstride = (t.stride(0) * heads, t.stride(0)) if heads else (t.stride(0), 0)
    return {f"stride_{name}": stride, f"hstride_{name}": hstride}


# Programs per SM of a compiled persistent kernel, per the launch's key (see norm_bwd)
_RESIDENT: dict = {}


def _resident(kernel, args: dict, constexprs: dict, t: Tile, key: tuple, on_gpu: bool) -> int:
    """Programs of ``kernel`` one SM holds at once, read off its binary (registers, shared memory)
    once per ``key`` (what selects the binary: N, the dtypes, the flags, the strides, the 16-byte
    alignments); a persistent
    grid of more would run its last programs in a second wave, each with a full share. Without a
    GPU (compile-only, the interpreter), the thread limit's count."""
    if _COMPILE_ONLY or _INTERPRETED or not on_gpu:
        return programs_per_sm(t)
    got = _RESIDENT.get(key)
    if got is None:
        try:
            got = held(kernel.warmup(grid=(1,), **args, **constexprs, num_warps=t.num_warps), t.num_warps)
        except AttributeError:  # a Triton whose compiled kernel reports no registers: the threads' count
            got = programs_per_sm(t)
        _RESIDENT[key] = got
    return got


def _op(layernorm: bool, fused_add: bool) -> str:
    return "layernorm" if layernorm else "add_rmsnorm" if fused_add else "rmsnorm"


def realigned(direction: str, op: str, n: int, heads: int, tensors) -> tuple[Realigned | None, int]:
    """(the realigned kernels' launch, the row stride) where they take these row tensors, else
    (None, 0): 16-bit rows whose length is no multiple of a 16-byte vector that the plan realigns
    (``plan.realigned_plan``: whole rows, a ``REALIGNED`` entry), (M, N) rows (not per-head views),
    and one row stride and a 16-byte aligned start for every tensor, so that a row starts at the same
    offset within a vector in each of them."""
    if heads or n % 8 == 0:  # (the common case first: host time)
        return None, 0
    r = realigned_plan(direction, op, n, tensors[0].element_size())
    if r is None:
        return None, 0
    stride = tensors[0].stride(0)
    if any(t.dim() != 2 or t.stride(0) != stride or t.data_ptr() % 16 for t in tensors):
        return None, 0
    return r, stride


def _realigned_grid(kernel, args: dict, constexprs: dict, r: Realigned, m: int, x, flags: tuple) -> int:
    """The realigned kernels' persistent grid: a multiple of the vector, so that a program's rows
    share their offset within it; the plan's programs per SM (no more than the binary lets an SM
    hold: ``_resident``) rounded down, as programs past what the SMs hold would run as a second
    wave; no more than the row tiles need; at least one vector's worth. ``flags``: the compile-time
    flags, which with the tile and the dtypes select the binary."""
    t, vec = r.tile, r.tile.vec
    key = (kernel.fn.__name__, t, flags, x.dtype, args["W"].dtype, args["B"].dtype if "B" in args else None,
           x.get_device())  # fmt: skip
    per_sm = min(r.programs_per_sm, _resident(kernel, args, constexprs, t, key, x.is_cuda))
    programs = min(per_sm * sm_count(x.device) // vec, triton.cdiv(triton.cdiv(m, t.rows), vec))
    return max(programs, 1) * vec


# ============================================================================ forward (host)
def norm_fwd(x, residual, weight, bias, eps, layernorm: bool):
    """(y, h or None, mean or None, rstd); x and the residual (M, N) or (T, NH, N) views, y and h
    (M, N)."""
    M, N, heads = _row_shape(x)
    p: Plan = plan("fwd", N, x.element_size())
    t = p.tile
    y = x.new_empty((M, N))
    h = x.new_empty((M, N)) if residual is not None else None
    rstd = x.new_empty(M, dtype=torch.float32)
    mean = x.new_empty(M, dtype=torch.float32) if layernorm else None
    rows = (x, y) if residual is None else (x, residual, y, h)
    r, stride = realigned("fwd", _op(layernorm, residual is not None), N, heads, rows)
    if r is not None:
        args = dict(
            X=x, R=x if residual is None else residual, W=x if weight is None else weight,
            B=x if bias is None else bias, Y=y, H=y if h is None else h, MEAN=rstd if mean is None else mean,
            RSTD=rstd, M=M, N=N, stride=stride, eps=eps,
        )  # fmt: skip
        constexprs = dict(
            LAYERNORM=layernorm, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
            HAS_RESIDUAL=residual is not None, ROWS=r.tile.rows, BLOCK_N=r.tile.width, VEC=r.tile.vec,
            layout=r.tile.layout(), edge_layout=r.edge_layout(),
        )  # fmt: skip
        flags = (layernorm, weight is not None, bias is not None, residual is not None)
        grid = _realigned_grid(_fwd_odd_kernel, args, constexprs, r, M, x, flags)
        _launch(_fwd_odd_kernel, (grid,), args, constexprs, r.tile.num_warps)
        return y, h, mean, rstd
    if _fwd_exchange(x, residual, weight, bias, eps, layernorm, y, h, mean, rstd):
        return y, h, mean, rstd
    args = dict(
        X=x, R=x if residual is None else residual,  # x, rstd: placeholders, never read
        W=x if weight is None else weight, B=x if bias is None else bias,
        Y=y, H=y if h is None else h, MEAN=rstd if mean is None else mean, RSTD=rstd,
        M=M, N=N, NH=max(heads, 1), **_stride_args("x", x, heads), **_stride_args("r", x if residual is None else residual, heads),
        stride_y=y.stride(0), stride_h=(y if h is None else h).stride(0), eps=eps,
    )  # fmt: skip
    constexprs = dict(
        LAYERNORM=layernorm, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
        HAS_RESIDUAL=residual is not None, ROWS=t.rows, BLOCK_N=t.width, CHUNKED=p.wide, HEADS=heads > 0,
        layout=t.layout(),
    )  # fmt: skip
    _launch(_fwd_kernel, (_grid_rows(M, t),), args, constexprs, t.num_warps)
    return y, h, mean, rstd


def _fwd_exchange(x, residual, weight, bias, eps, layernorm: bool, y, h, mean, rstd) -> bool:
    """Launch the exchanging slices (``_fwd_sliced_kernel``) where the plan has an entry for this op
    and row (``plan.fwd_exchange_plan``) and every sibling can be resident: G row groups of S slices,
    G from ``exchange_groups`` over the SMs times the programs each may hold (the entry's, no more
    than the binary allows: ``_resident``). False, launching nothing, where the old forward must run:
    no entry, or more slices than those programs (G = 0)."""
    M, N, heads = _row_shape(x)
    p = fwd_exchange_plan(_op(layernorm, residual is not None), N, x.element_size())
    if p is None or not (x.is_cuda or _COMPILE_ONLY or _INTERPRETED):
        return False
    t, slices = p.tile, p.pieces
    # (M, S) int64 slots per statistic, zeroed: a slot goes from 0 to posted once a launch
    sums = torch.zeros((1 + int(layernorm), M, slices), dtype=torch.int64, device=x.device)
    res = x if residual is None else residual  # x, y, rstd: placeholders, never read
    args = dict(
        X=x, R=res, W=x if weight is None else weight, B=x if bias is None else bias,
        Y=y, H=y if h is None else h, MEAN=rstd if mean is None else mean, RSTD=rstd, SUMS=sums[0], M2S=sums[-1],
        M=M, N=N, NH=max(heads, 1), **_stride_args("x", x, heads), **_stride_args("r", res, heads),
        stride_y=y.stride(0), stride_h=(y if h is None else h).stride(0), eps=eps, SLICES=slices, SPIN=SPIN_LIMIT,
    )  # fmt: skip
    # the slot tile at least FWD_SLOTS wide, so that rows of a few slices more or less share a binary
    constexprs = dict(
        LAYERNORM=layernorm, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
        HAS_RESIDUAL=residual is not None, ROWS=t.rows, BLOCK_N=t.width,
        SLOTS=max(next_pow2(slices), FWD_SLOTS), HEADS=heads > 0, layout=t.layout(),
    )  # fmt: skip
    per_sm = p.per_sm
    if per_sm > 1:
        key = ("fwd", t, constexprs["SLOTS"], N, x.dtype, args["W"].dtype, args["B"].dtype, layernorm, weight is not None,
               bias is not None, residual is not None, heads > 0, x.get_device(), args["stride_x"], args["hstride_x"],
               args["stride_r"], args["hstride_r"], (x.data_ptr() | res.data_ptr() | args["W"].data_ptr()) % 16 == 0)  # fmt: skip
        per_sm = min(per_sm, _resident(_fwd_sliced_kernel, args, constexprs, t, key, x.is_cuda))
    groups = exchange_groups(triton.cdiv(M, t.rows), slices, per_sm * sm_count(x.device))
    if not groups:
        return False
    if _INTERPRETED:
        # the interpreter runs the programs one after another, so none finds a later sibling's
        # post: a first run posts every slot (its outputs NaN where a sibling came later), the
        # second finds them all and writes every output; no re-reads in either
        _launch(_fwd_sliced_kernel, (groups * slices,), {**args, "SPIN": 0}, constexprs, t.num_warps)
        args["SPIN"] = 0
    _launch(_fwd_sliced_kernel, (groups * slices,), args, constexprs, t.num_warps)
    return True


# =========================================================================== backward (host)
def norm_bwd(dy, dres, x, weight, mean, rstd, layernorm: bool):
    """(dx, dw or None, db or None); dw and db in the weight's dtype (x's when there is none). The
    row tensors (M, N) or (T, NH, N) views, dx (M, N)."""
    M, N, heads = _row_shape(x)
    p: Plan = plan("bwd", N, x.element_size(), layernorm)
    t = p.tile
    slices = p.pieces
    has_weight = weight is not None
    dx = x.new_empty((M, N))
    n_sums = int(has_weight) + int(layernorm)
    sums = x.new_empty((n_sums, N), dtype=weight.dtype if has_weight else x.dtype)
    rows = (dy, x, dx) if dres is None else (dy, x, dres, dx)
    r, stride = realigned("bwd", _op(layernorm, dres is not None), N, heads, rows)
    if r is not None:
        # one partial row per program, allocated once its grid is known: the grid is read off the
        # binary, which the partials' pointer (16-byte aligned either way) does not change
        args = dict(
            DY=dy, X=x, W=x if weight is None else weight, MEAN=rstd if mean is None else mean, RSTD=rstd,
            DRES=dy if dres is None else dres, DX=dx, DW_PARTIAL=rstd, DB_PARTIAL=rstd, M=M, N=N, stride=stride,
        )  # fmt: skip
        constexprs = dict(
            LAYERNORM=layernorm, HAS_WEIGHT=has_weight, HAS_DRESIDUAL=dres is not None, ROWS=r.tile.rows,
            BLOCK_N=r.tile.width, VEC=r.tile.vec, layout=r.tile.layout(), edge_layout=r.edge_layout(),
        )  # fmt: skip
        flags = (layernorm, has_weight, dres is not None)
        programs = _realigned_grid(_bwd_odd_kernel, args, constexprs, r, M, x, flags)
        partials = torch.empty((max(n_sums, 1), programs, N), dtype=torch.float32, device=x.device)
        args.update(DW_PARTIAL=partials[0], DB_PARTIAL=partials[n_sums - 1])
        _launch(_bwd_odd_kernel, (programs,), args, constexprs, r.tile.num_warps)
        _sum_partials(partials, sums, programs, n_sums, x)
        return dx, (sums[0] if has_weight else None), (sums[n_sums - 1] if layernorm else None)
    # one partial row of dw / db per row group, for at most as many groups as fill the SMs' threads
    # (the binary's registers may allow fewer: ``_resident``)
    most = min(_grid_rows(M, t), max(1, programs_per_sm(t) * sm_count(x.device) // slices))
    # the siblings exchange their row sums where they can all be resident (the plan's programs per
    # SM at most, then no more than the binary lets an SM hold: ``groups`` below) and
    # wait within a warp (``_await_sums``); the interpreter runs programs one after another: there,
    # and past those limits, the row-sums kernel
    sync = (p.exchange and EXCHANGE and (x.is_cuda or bool(_COMPILE_ONLY)) and not _INTERPRETED
            and t.rows * next_pow2(slices) <= SYNC_SLOTS_MAX and (slices <= sm_count(x.device) or bool(_COMPILE_ONLY)))  # fmt: skip
    if sync:
        most = min(most, max(1, p.per_sm * sm_count(x.device) // slices))
    partials = torch.empty((max(n_sums, 1), most, N), dtype=torch.float32, device=x.device)
    w = x if weight is None else weight  # x, rstd: placeholders, never read
    mean = rstd if mean is None else mean
    row_sums = rstd
    layout = t.layout()
    strides = {**_stride_args("dy", dy, heads), **_stride_args("x", x, heads)}
    if sync:
        row_sums = torch.zeros((1 + int(layernorm), M, slices), dtype=torch.int64, device=x.device)
    elif slices > 1:
        row_sums = x.new_empty((2, M, slices), dtype=torch.float32)
        _launch(
            _bwd_row_sums_kernel, (slices * _grid_rows(M, t),),
            dict(DY=dy, X=x, W=w, MEAN=mean, ROW_SUMS=row_sums, M=M, N=N, NH=max(heads, 1), **strides),
            dict(LAYERNORM=layernorm, HAS_WEIGHT=has_weight, ROWS=t.rows, BLOCK_N=t.width, SLICES=slices,
                 HEADS=heads > 0, layout=layout),
            t.num_warps,
        )  # fmt: skip
    args = dict(
        DY=dy, X=x, W=w, MEAN=mean, RSTD=rstd, DRES=dy if dres is None else dres, ROW_SUMS=row_sums,
        DX=dx, DW_PARTIAL=partials[0], DB_PARTIAL=partials[n_sums - 1],
        M=M, N=N, NH=max(heads, 1), **strides, **_stride_args("dres", dy if dres is None else dres, heads),
        stride_dx=dx.stride(0),
    )  # fmt: skip
    constexprs = dict(
        LAYERNORM=layernorm, HAS_WEIGHT=has_weight, HAS_DRESIDUAL=dres is not None,
        ROWS=t.rows, BLOCK_N=t.width, SLICES=slices, SLICES_P2=next_pow2(slices), HEADS=heads > 0, layout=layout,
        SYNC=sync, PAIRED=slices <= PAIRED_SLICES_MAX,
    )  # fmt: skip
    args["SPIN"] = SPIN_LIMIT
    # a cheap key (a call's host time counts at small M): the ints, dtypes and 16-byte alignments
    # that select the binary (another binary may need more registers: fewer programs per SM)
    key = (N, x.dtype, w.dtype, layernorm, has_weight, dres is not None, heads > 0, x.get_device(),
           args["stride_dy"], args["hstride_dy"], args["stride_x"], args["hstride_x"], args["stride_dres"], sync,
           constexprs["PAIRED"],
           (dy.data_ptr() | x.data_ptr() | w.data_ptr() | (0 if dres is None else dres.data_ptr())) % 16 == 0)  # fmt: skip
    groups = min(most, _resident(_bwd_kernel, args, constexprs, t, key, x.is_cuda) * sm_count(x.device) // slices) or 1
    _launch(_bwd_kernel, (groups * slices,), args, constexprs, t.num_warps)
    _sum_partials(partials, sums, groups, n_sums, x)
    dw = sums[0] if has_weight else None
    db = sums[n_sums - 1] if layernorm else None
    return dx, dw, db


def _sum_partials(partials, sums, groups: int, n_sums: int, x) -> None:
    """sums[k] = the sum of the first ``groups`` rows of partials[k] (``_sum_partials_kernel``)."""
    if not n_sums:
        return
    N = partials.shape[2]
    if x.is_cuda or _COMPILE_ONLY:
        # narrow column strips, so that even N = 1024 spreads over dozens of SMs
        block_n = min(max(next_pow2(N) // 256, 16), 256)
        block_p = 4096 // block_n
    else:  # the interpreter (interpret.py) pays per program and per operation, not per element
        block_n, block_p = min(next_pow2(N), 16384), 16
    strip = tile(block_n, 4)  # fp32 partials
    _launch(
        _sum_partials_kernel, (triton.cdiv(N, block_n), n_sums),
        dict(PARTIALS=partials, OUT=sums, P=groups, P_STRIDE=partials.shape[1], N=N),
        dict(BLOCK_P=block_p, BLOCK_N=block_n, layout=strip.layout()), strip.num_warps,
    )  # fmt: skip


# ============================================================================ the contract
(rmsnorm_fwd, rmsnorm_bwd, layernorm_fwd, layernorm_bwd, add_rmsnorm_fwd, add_rmsnorm_bwd) = contract_functions(
    norm_fwd, norm_bwd
)
