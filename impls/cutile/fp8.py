"""RMSNorm (and the fused residual add + RMSNorm) with FP8 output, in cuTile Python: one read of x,
a one-byte write of q.

Per row of N elements, in fp32 (x, residual and w upcast right after loading):

    rstd  = 1 / sqrt(mean(x^2) + eps)            y = x * rstd * w       (never rounded to x's dtype)
    scale = max(amax(|y| over the group), floor) / 448     one per row (group = N) or per 1 x 128 block
    q     = e4m3fn(y / scale): round to nearest even, saturating at +-448
    add + RMSNorm   h = round_to_x_dtype(x + residual), stored (residual_out); the above on h as stored

Design decisions:

* The tiles are the norm forward's (``plan.py``, ``plan("fwd", M, N)``): a [ROWS, next_pow2(N)]
  tile while the row fits in one (several narrow rows to a program), else the row walked in
  chunks of ``FWD_CHUNK`` columns. Loads pad with zeros past N and past M, so a padded column
  adds nothing to the sum of squares and has y = 0, which never raises an amax; stores clip to the
  arrays' shapes, so nothing past N or M is written.
* Scales are (M, N / group) fp32, row-major: the layout the blockwise FP8 GEMMs read (per token:
  (M, 1)). They are stored as tiles like any other array: per row a [ROWS, 1] tile at (block, 0);
  per 1 x 128 block a [ROWS, WIDTH / 128] tile at (block, chunk), whose columns past N / 128 (the
  zero blocks of a padded row, their scale the floor's) the store drops.
* The 1 x 128 amax: the [ROWS, WIDTH] tile of y reshaped to [ROWS, WIDTH / 128, 128] and reduced
  along its last axis (WIDTH is a power of two >= 128 whenever N is a multiple of 128, and a
  block never straddles a row or a chunk: FWD_CHUNK is a multiple of 128); q = y * (1 / scale)
  broadcasts each block's reciprocal over its 128 columns, and the tile goes back to [ROWS, WIDTH]
  for its store. One ``ct.reshape`` each way; the compiler picks the layouts.
* The conversion: ``ct.astype(v, ct.float8_e4m3fn)`` is Tile IR's ``ftof`` with rounding to
  nearest even. The op has a rounding mode and no saturation attribute, so a clamp to +-448 before
  it states the saturation whatever the lowering does past the largest finite value. On sm_90
  ``tileiras`` lowers it to the hardware's saturating conversion (F2FP.SATFINITE.E4M3.F32 in the
  cubin), which the tests check where a disassembler is at hand. q is stored as the
  float8_e4m3fn array it is (a torch float8 tensor reaches the kernel through DLPack): one byte an
  element, no bit tricks. cuTile takes float8_e4m3fn from sm_90 on (below, it refuses the kernel
  with an error naming the dtype), although the record's other ops run from sm_80.
* The scale is an IEEE division (``ct.truediv`` with ``RoundingMode.RN``, stated though it is the
  default) and q is y times its reciprocal, also correctly rounded: within two roundings of
  y / scale, as the other FP8 kernels of this project compute it.
* NaN stays NaN: cuTile's maximum / minimum (elementwise and reductions) return the other operand
  of a NaN unless ``propagate_nan`` is set, which would turn a NaN y into a finite 448 and a NaN
  amax into the floor's scale. With it set, a row whose statistics overflow (rstd NaN, as the
  cuTile norms give: ``kernels._rstd``) gets NaN in q and its scales, never a finite wrong value.
* Wide rows: pass 1 accumulates the sum of squares (storing h for the fused add) and, per token,
  the amax of |x * w|, whose product with rstd (> 0) is the amax of |y| up to fp32's rounding;
  pass 2, last chunk first (still in L2), makes y, q and, per 1 x 128 block, each block's scale.
  As in the norm forward, pass 2 of add + RMSNorm adds x and the residual again (the same rounding
  gives the same h) instead of reading back the h its own program stored: cuTile exposes no block
  barrier that would order those stores before the loads.

What was easy in cuTile: float8_e4m3fn is a dtype like any other (cast, store, array argument);
the scales' partial tiles need no masks (stores clip); the block amax is a reshape and a
reduction. What was not: the conversion has no saturating form (hence the clamp), maximum and
minimum drop NaN unless told otherwise, and ``tileiras`` emits a cubin, no PTX: what the cast
lowers to is read from its SASS (``nvdisasm``, which cuda-tile does not ship), and the rounding
and saturation themselves are left to the GPU tests against the exact checker.

The launches go through ``kernels._launch``, so ``kernels.compile_only`` compiles these kernels too
(the tests, without a GPU).
"""

from __future__ import annotations

import cuda.tile as ct
import torch

from harness.spec.fp8 import AMAX_FLOOR, E4M3_MAX, FP8_DTYPE, GROUP_BLOCK, contract_functions

from .kernels import (
    ConstBool,
    ConstInt,
    _as_rows,
    _check_index_range,
    _grid_rows,
    _launch,
    _ld_rows,
    _load_row,
    _param,
    _placeholder,
    _rstd,
    compile_only,  # noqa: F401  (the tests compile these kernels through it)
)
from .plan import plan

RN = ct.RoundingMode.RN


# ========================================================================== device functions
def _weighted(y, W, chunk, BLOCK_N, HAS_WEIGHT):
    if HAS_WEIGHT:
        y = y * _param(W, chunk, BLOCK_N)
    return y


def _amax(a, axis):
    return ct.max(ct.abs(a), axis=axis, keepdims=True, propagate_nan=True)


def _scale(amax):
    """(scale, 1 / scale), each rounded once."""
    scale = ct.truediv(ct.maximum(amax, AMAX_FLOOR, propagate_nan=True), E4M3_MAX, rounding_mode=RN)
    return scale, ct.truediv(1.0, scale, rounding_mode=RN)


def _to_e4m3(v):
    v = ct.minimum(ct.maximum(v, -E4M3_MAX, propagate_nan=True), E4M3_MAX, propagate_nan=True)
    return ct.astype(v, ct.float8_e4m3fn)


def _quantize_blocks(y, Q, S, block, chunk, ROWS, WIDTH, GROUP):
    """q and the scales of a [ROWS, WIDTH] tile of y: column tile ``chunk`` of row block ``block``."""
    blocks = WIDTH // GROUP
    y3 = ct.reshape(y, (ROWS, blocks, GROUP))
    scale, inv = _scale(_amax(y3, 2))
    ct.store(Q, index=(block, chunk), tile=_to_e4m3(ct.reshape(y3 * inv, (ROWS, WIDTH))))
    ct.store(S, index=(block, chunk), tile=ct.reshape(scale, (ROWS, blocks)))


def _row_again(X, R, block, chunk, ROWS, BLOCK_N, HEAD_ROWS, HAS_RESIDUAL):
    """Pass 2's x, or h from x and the residual again (the same rounding as pass 1's)."""
    x = _ld_rows(X, block, chunk, ROWS, BLOCK_N, HEAD_ROWS, True, 0)
    if HAS_RESIDUAL:
        r = _ld_rows(R, block, chunk, ROWS, BLOCK_N, HEAD_ROWS, True, 0)
        x = ct.astype(ct.astype(x, ct.float32) + ct.astype(r, ct.float32), X.dtype)
    return ct.astype(x, ct.float32)


# ==================================================================================== kernel
@ct.kernel
def _fp8_kernel(
    X, R, W, Q, S, H, RSTD, eps,
    HAS_RESIDUAL: ConstBool, HAS_WEIGHT: ConstBool, PER_ROW: ConstBool,
    ROWS: ConstInt, BLOCK_N: ConstInt, CHUNKED: ConstBool, GROUP: ConstInt, HEAD_ROWS: ConstInt,
):  # fmt: skip
    """One block of ROWS rows per program: the whole row in one tile (BLOCK_N >= N), or, with
    CHUNKED, walked twice in chunks of BLOCK_N columns. GROUP: the block of the 1 x 128 scales
    (read only without PER_ROW). X and R: (M, N) rows or per-head views (``kernels._ld_rows``)."""
    block = ct.bid(0)
    n = Q.shape[1]
    if not CHUNKED:
        x = _load_row(X, R, H, block, 0, ROWS, BLOCK_N, HEAD_ROWS, HAS_RESIDUAL)
        rstd = _rstd(ct.sum(x * x, axis=1, keepdims=True), n, eps)
        ct.store(RSTD, index=(block,), tile=ct.reshape(rstd, (ROWS,)))
        y = _weighted(x * rstd, W, 0, BLOCK_N, HAS_WEIGHT)
        if PER_ROW:
            scale, inv = _scale(_amax(y, 1))
            ct.store(Q, index=(block, 0), tile=_to_e4m3(y * inv))
            ct.store(S, index=(block, 0), tile=scale)
        else:
            _quantize_blocks(y, Q, S, block, 0, ROWS, BLOCK_N, GROUP)
    else:
        n_chunks = ct.cdiv(n, BLOCK_N)
        # pass 1: the sum of squares (h stored), and per row the amax of |x * w|
        sum_sq = ct.zeros((ROWS, BLOCK_N), dtype=ct.float32)
        amax = ct.zeros((ROWS, BLOCK_N), dtype=ct.float32)  # read only with PER_ROW
        for c in range(n_chunks):
            x = _load_row(X, R, H, block, c, ROWS, BLOCK_N, HEAD_ROWS, HAS_RESIDUAL)
            sum_sq = sum_sq + x * x
            if PER_ROW:
                amax = ct.maximum(amax, ct.abs(_weighted(x, W, c, BLOCK_N, HAS_WEIGHT)), propagate_nan=True)
        rstd = _rstd(ct.sum(sum_sq, axis=1, keepdims=True), n, eps)
        ct.store(RSTD, index=(block,), tile=ct.reshape(rstd, (ROWS,)))
        if PER_ROW:
            # rstd > 0 scales the amax of |x * w| to that of |y|
            scale, inv = _scale(ct.max(amax, axis=1, keepdims=True, propagate_nan=True) * rstd)
            ct.store(S, index=(block, 0), tile=scale)
        # pass 2, last chunk first (still in L2): y, q and the blocks' scales
        for i in range(n_chunks):
            c = n_chunks - 1 - i
            y = _weighted(_row_again(X, R, block, c, ROWS, BLOCK_N, HEAD_ROWS, HAS_RESIDUAL) * rstd, W, c, BLOCK_N, HAS_WEIGHT)
            if PER_ROW:
                ct.store(Q, index=(block, c), tile=_to_e4m3(y * inv))
            else:
                _quantize_blocks(y, Q, S, block, c, ROWS, BLOCK_N, GROUP)


# ============================================================================== host
def _fp8_fwd(x, residual, weight, eps, group):
    """(q, scale, h or None, rstd); x and the residual (M, N) rows or (T, H, N) views."""
    N = x.shape[-1]
    M = x.numel() // N
    _check_index_range(x, residual)
    (x, residual), p, hr = _as_rows((x, residual), N, plan("fwd", M, N))
    q = torch.empty((M, N), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((M, N // group), dtype=torch.float32, device=x.device)
    rstd = torch.empty(M, dtype=torch.float32, device=x.device)
    h = torch.empty((M, N), dtype=x.dtype, device=x.device) if residual is not None else None
    args = (
        x, residual if residual is not None else _placeholder(x, x.dtype, 2, "residual"),
        weight if weight is not None else _placeholder(x, x.dtype, 1, "weight"), q, scale,
        h if h is not None else _placeholder(x, x.dtype, 2, "h"), rstd, float(eps),
        residual is not None, weight is not None, group == N, p.rows, p.width, p.wide, GROUP_BLOCK, hr,
    )  # fmt: skip
    _launch(_fp8_kernel, (_grid_rows(M, p), 1, 1), args)
    return q, scale, h, rstd


rmsnorm_fp8_fwd, add_rmsnorm_fp8_fwd = contract_functions(_fp8_fwd)
