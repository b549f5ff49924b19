"""RMSNorm (and the fused residual add + RMSNorm) with FP8 output, in Gluon.

Per row, in fp32 (x, residual and w upcast right after loading):

    rstd  = 1 / sqrt(mean(x^2) + eps)            y = x * rstd * w       (never rounded to x's dtype)
    scale = max(amax(|y| over the group), floor) / 448     one per row (group = N) or per 1 x 128 block
    q     = e4m3fn(clamp(y * (1 / scale), -448, 448))
    add + RMSNorm   h = round_to_x_dtype(x + residual), stored (residual_out); the above on h as stored

The tiles and their BlockedLayouts are the norm forward's (``plan.py``: 128-bit vectors of x per
thread, threads then warps along N), so q's store is a vector of 8 (16-bit x) or 4 (fp32 x) bytes
per thread. Per 1 x 128 block the [ROWS, BLOCK_N] tile is reshaped to [ROWS, BLOCK_N / 128, 128]
(``gl.reshape``: the compiler infers that layout from the tile's, the blocks never straddle a row)
and reduced along its last axis; q comes back to the tile's layout for its store
(``gl.convert_layout``, a no-op where the inferred layout already is it), and the scales are stored
from a layout of their own, one lane per scale. Rows wider than the plan's register row are walked
twice in chunks: pass 1 the sum of squares (h stored) and, per row, the amax of |x * w| (rstd > 0
scales it to that of |y|, up to fp32's rounding); pass 2, last chunk first, y, q and each chunk's
block scales.

The scale is an IEEE division (``gl.div_rn``; a plain fp32 division is an approximation) and q is
y times its reciprocal. The cast is the hardware's (cvt.rn.satfinite on sm_90: nearest even,
saturating) after a clamp that states the saturation. Gluon does not run in Triton's interpreter:
without a GPU the tests compile these kernels for sm_90a (``compile_only``).

x and the residual may be per-head (T, NH, N) views of a fused QKV tensor (``row_views``), of whose
rows no (M, N) view exists: a reshape would copy them. They are read in place, as the norm kernels
read theirs (``kernels._starts``: with ``HEADS`` row r is at (r // NH) * stride(0) + (r % NH) *
stride(1), an integer division per row and only for views); q, the scales, h and rstd are (M, ...).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from harness.spec.fp8 import AMAX_FLOOR, FP8_DTYPE, GROUP_BLOCK, contract_functions

from .kernels import _row_shape, _starts, _stride_args, compile_kernel
from .plan import Plan, plan

_COMPILE_ONLY: list = []


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _max(a, b):
    return gl.maximum(a, b)


@gluon.jit
def _at(starts, cols):
    return gl.expand_dims(starts, 1) + gl.expand_dims(cols, 0)


@gluon.jit
def _load_row(X, R, H, x_at, r_at, h_at, mask, HAS_RESIDUAL: gl.constexpr):
    x = gl.load(X + x_at, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = gl.load(R + r_at, mask=mask, other=0.0)
        x = (x.to(gl.float32) + r.to(gl.float32)).to(X.dtype.element_ty)
        gl.store(H + h_at, x, mask=mask)
    return x.to(gl.float32)


@gluon.jit
def _e4m3(v):
    return gl.minimum(gl.maximum(v, -448.0), 448.0).to(gl.float8e4nv)


@gluon.jit
def _blocks(y, Q, S, q_at, rows, row_mask, mask, s_row, G0, N,
            ROWS: gl.constexpr, WIDTH: gl.constexpr, GROUP: gl.constexpr, FLOOR: gl.constexpr,
            layout: gl.constexpr, s_layout: gl.constexpr):  # fmt: skip
    """q and the scales of a [ROWS, WIDTH] tile of y (0 where masked) whose columns start at block G0."""
    BLOCKS: gl.constexpr = WIDTH // GROUP
    y3 = gl.reshape(y, [ROWS, BLOCKS, GROUP])
    amax = gl.maximum(gl.reduce(gl.abs(y3), 2, _max), FLOOR)
    scale = gl.div_rn(amax, gl.full(amax.shape, 448.0, gl.float32, amax.type.layout))
    inv = gl.div_rn(gl.full(scale.shape, 1.0, gl.float32, scale.type.layout), scale)
    q = gl.convert_layout(gl.reshape(y3 * gl.expand_dims(inv, 2), [ROWS, WIDTH]), layout)
    gl.store(Q + q_at, _e4m3(q), mask=mask)
    s = gl.convert_layout(scale, s_layout)
    s_rows = gl.program_id(0) * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
    blocks = G0 + gl.arange(0, BLOCKS, layout=gl.SliceLayout(0, s_layout))
    s_mask = gl.expand_dims(s_rows < s_row, 1) & gl.expand_dims(blocks * GROUP < N, 0)
    gl.store(S + _at(s_rows.to(gl.int64) * (N // GROUP), blocks), s, mask=s_mask)


@gluon.jit(do_not_specialize=["M", "eps"])
def _fp8_kernel(
    X, R, W, Q, S, H, RSTD,
    M, N, NH, stride_x, hstride_x, stride_r, hstride_r, stride_h, eps,
    HAS_RESIDUAL: gl.constexpr, HAS_WEIGHT: gl.constexpr, PER_ROW: gl.constexpr, ROWS: gl.constexpr,
    BLOCK_N: gl.constexpr, CHUNKED: gl.constexpr, GROUP: gl.constexpr, FLOOR: gl.constexpr, HEADS: gl.constexpr,
    layout: gl.constexpr, s_layout: gl.constexpr,
):  # fmt: skip
    rows = gl.program_id(0) * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    chunk = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
    row_mask = rows < M
    x_rows = _starts(rows, stride_x, hstride_x, NH, HEADS)
    r_rows = _starts(rows, stride_r, hstride_r, NH, HEADS)
    rows64 = rows.to(gl.int64)
    h_rows, q_rows = rows64 * stride_h, rows64 * N
    if not CHUNKED:
        col_mask = chunk < N
        mask = gl.expand_dims(row_mask, 1) & gl.expand_dims(col_mask, 0)
        x = _load_row(X, R, H, _at(x_rows, chunk), _at(r_rows, chunk), _at(h_rows, chunk), mask, HAS_RESIDUAL)
        rstd = gl.rsqrt(gl.reduce(x * x, 1, _add) / N + eps)
        gl.store(RSTD + rows, rstd, mask=row_mask)
        y = x * gl.expand_dims(rstd, 1)
        if HAS_WEIGHT:
            y = y * gl.expand_dims(gl.load(W + chunk, mask=col_mask, other=0.0).to(gl.float32), 0)
        if PER_ROW:
            amax = gl.maximum(gl.reduce(gl.abs(y), 1, _max), FLOOR)
            scale = gl.div_rn(amax, gl.full(amax.shape, 448.0, gl.float32, amax.type.layout))
            inv = gl.div_rn(gl.full(scale.shape, 1.0, gl.float32, scale.type.layout), scale)
            gl.store(Q + _at(q_rows, chunk), _e4m3(y * gl.expand_dims(inv, 1)), mask=mask)
            gl.store(S + rows, scale, mask=row_mask)
        else:
            _blocks(
                y,
                Q,
                S,
                _at(q_rows, chunk),
                rows,
                row_mask,
                mask,
                M,
                0,
                N,
                ROWS,
                BLOCK_N,
                GROUP,
                FLOOR,
                layout,
                s_layout,
            )
    else:
        n_chunks = gl.cdiv(N, BLOCK_N)
        # pass 1: the sum of squares (h stored), per row the amax of |x * w|
        sum_sq = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=layout)
        big = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=layout)
        for c in range(n_chunks):
            cols = c * BLOCK_N + chunk
            col_mask = cols < N
            mask = gl.expand_dims(row_mask, 1) & gl.expand_dims(col_mask, 0)
            x = _load_row(X, R, H, _at(x_rows, cols), _at(r_rows, cols), _at(h_rows, cols), mask, HAS_RESIDUAL)
            sum_sq += x * x
            if PER_ROW:
                xw = x
                if HAS_WEIGHT:
                    xw = x * gl.expand_dims(gl.load(W + cols, mask=col_mask, other=0.0).to(gl.float32), 0)
                big = gl.maximum(big, gl.abs(xw))
        rstd = gl.rsqrt(gl.reduce(sum_sq, 1, _add) / N + eps)
        gl.store(RSTD + rows, rstd, mask=row_mask)
        amax = gl.maximum(gl.reduce(big, 1, _max) * rstd, FLOOR)
        scale = gl.div_rn(amax, gl.full(amax.shape, 448.0, gl.float32, amax.type.layout))
        inv = gl.div_rn(gl.full(scale.shape, 1.0, gl.float32, scale.type.layout), scale)
        if PER_ROW:
            gl.store(S + rows, scale, mask=row_mask)
        if HAS_RESIDUAL:
            SRC = H
            src_rows = h_rows
        else:
            SRC = X
            src_rows = x_rows
        # pass 2, last chunk first (still in L2)
        for i in range(n_chunks):
            c = n_chunks - 1 - i
            cols = c * BLOCK_N + chunk
            col_mask = cols < N
            mask = gl.expand_dims(row_mask, 1) & gl.expand_dims(col_mask, 0)
            y = gl.load(SRC + _at(src_rows, cols), mask=mask, other=0.0).to(gl.float32) * gl.expand_dims(rstd, 1)
            if HAS_WEIGHT:
                y = y * gl.expand_dims(gl.load(W + cols, mask=col_mask, other=0.0).to(gl.float32), 0)
            if PER_ROW:
                gl.store(Q + _at(q_rows, cols), _e4m3(y * gl.expand_dims(inv, 1)), mask=mask)
            else:
                _blocks(y, Q, S, _at(q_rows, cols), rows, row_mask, mask, M, c * (BLOCK_N // GROUP), N,
                        ROWS, BLOCK_N, GROUP, FLOOR, layout, s_layout)  # fmt: skip


# ==================================================================================== host
class compile_only:
    """``with compile_only() as compiled:`` the FP8 functions compile their kernel for sm_90a
    instead of launching it (outputs unwritten); ``compiled`` lists what was compiled."""

    def __enter__(self):
        _COMPILE_ONLY.append([])
        return _COMPILE_ONLY[-1]

    def __exit__(self, *exc):
        _COMPILE_ONLY.pop()
        return False


def _run(x, residual, weight, eps, group):
    M, N, heads = _row_shape(x)
    p: Plan = plan("fwd", N, x.element_size())
    t = p.tile
    per_row = group == N
    if not per_row and t.width < GROUP_BLOCK:  # a block must fit the tile (N >= 128 here: a multiple)
        raise ValueError(f"the tile of N = {N} is narrower than a {GROUP_BLOCK}-column block")
    q = torch.empty((M, N), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((M, N // group), dtype=torch.float32, device=x.device)
    rstd = torch.empty(M, dtype=torch.float32, device=x.device)
    h = x.new_empty((M, N)) if residual is not None else None
    args = dict(
        X=x, R=x if residual is None else residual, W=x if weight is None else weight, Q=q, S=scale,
        H=x if h is None else h, RSTD=rstd, M=M, N=N, NH=max(heads, 1), **_stride_args("x", x, heads),
        **_stride_args("r", x if residual is None else residual, heads),
        stride_h=0 if h is None else h.stride(0), eps=eps,
    )  # fmt: skip
    constexprs = dict(
        HAS_RESIDUAL=residual is not None, HAS_WEIGHT=weight is not None, PER_ROW=per_row, ROWS=t.rows,
        BLOCK_N=t.width, CHUNKED=p.wide, GROUP=GROUP_BLOCK if per_row else group, FLOOR=AMAX_FLOOR, HEADS=heads > 0,
        layout=t.layout(), s_layout=gl.BlockedLayout([1, 1], [1, 32], [t.num_warps, 1], [1, 0]),
    )  # fmt: skip
    grid = (triton.cdiv(M, t.rows),)
    if _COMPILE_ONLY:
        _COMPILE_ONLY[-1].append(compile_kernel(_fp8_kernel, args, constexprs, t.num_warps))
    else:
        _fp8_kernel[grid](**args, **constexprs, num_warps=t.num_warps)
    return q, scale, h, rstd


rmsnorm_fp8_fwd, add_rmsnorm_fp8_fwd = contract_functions(_run)
