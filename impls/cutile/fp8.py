"""RMSNorm (and the fused residual add + RMSNorm) with FP8 output, in cuTile Python: one read of x,
a one-byte write of q.

Per row of N elements, in fp32 (x, residual and w upcast right after loading):

    rstd  = 1 / sqrt(mean(x^2) + eps)            y = x * rstd * w       (never rounded to x's dtype)
    scale = max(amax(|y| over the group), floor) / 448     one per row (group = N) or per 1 x 128 block
    q     = e4m3fn(y / scale): round to nearest even, saturating at +-448
    add + RMSNorm   h = round_to_x_dtype(x + residual), stored (residual_out); the above on h as stored

Design decisions:

* The tiles, the grid and the compiler hints are the norm forward's, from its table (RMSNorm's
  entry, or add + RMSNorm's, at this width: ``configs.py``): a persistent grid of a few programs
  per SM, each with a [ROWS, next_pow2(N)] tile while the row fits in one (several narrow rows to a
  program), else the row walked in chunks. The quantization adds arithmetic and a narrower store
  to the same loads; on the first version's plan (one program per tile, the compiler's own hints)
  these kernels ran at 7-16% of the copy bandwidth on an H100. Loads pad with zeros past N and past M, so a padded column
  adds nothing to the sum of squares and has y = 0, which never raises an amax; stores clip to the
  arrays' shapes, so nothing past N or M is written.
* Scales are (M, N / group) fp32, row-major: the layout the blockwise FP8 GEMMs read (per token:
  (M, 1)). They are stored as tiles like any other array: per row a [ROWS, 1] tile at (block, 0);
  per 1 x 128 block a [ROWS, WIDTH / 128] tile at (block, chunk), whose columns past N / 128 (the
  zero blocks of a padded row, their scale the floor's) the store drops.
* The 1 x 128 amax: the [ROWS, WIDTH] tile of y reshaped to [ROWS, WIDTH / 128, 128] and reduced
  along its last axis (WIDTH is a power of two >= 128 whenever N is a multiple of 128, and a
  block never straddles a row or a chunk: every chunk width is a power of two >= 4096);
  q = y * (1 / scale) broadcasts each block's reciprocal over its 128 columns, and the tile goes
  back to [ROWS, WIDTH] for its store. One ``ct.reshape`` each way; the compiler picks the layouts.
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

from dataclasses import replace

import cuda.tile as ct
import torch

from harness.spec.fp8 import AMAX_FLOOR, E4M3_MAX, FP8_DTYPE, GROUP_BLOCK, contract_functions

from . import plan as _plan_module
from .kernels import (
    ConstBool,
    ConstInt,
    _as_rows,
    _check_index_range,
    _kernel,
    _launch,
    _ld_rows,
    _load_row_hinted,
    _param,
    _placeholder,
    _rstd,
    _st,
    _tuning,
    compile_only,  # noqa: F401  (the tests compile these kernels through it)
    sm_count,
)
from .plan import Plan, Tuning, forward_programs, plan

RN = ct.RoundingMode.RN
# Rows walked in chunks take this rather than the norm forward's entry: searched on an H100 over chunk
# x programs per SM x worker warps at N = 49152-262144 (docs/kernels/cutile.md), the one rule within
# 8% of each point's best (the norm's entries fell to 23% for RMSNorm's 1 x 128 scales at 65536).
CHUNKED_TUNING = {"fwd_chunk": 4096, "fwd_tile_elements": 4096, "fwd_programs_per_sm": 4, "worker_warps": 8,
                  "occupancy": 0, "latency": 0, "tma_load": True, "tma_store": False}  # fmt: skip


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


def _quantize_blocks(y, Q, S, block, chunk, ROWS, WIDTH, GROUP, TMA_STORE, LATENCY):
    """q and the scales of a [ROWS, WIDTH] tile of y: column tile ``chunk`` of row block ``block``."""
    blocks = WIDTH // GROUP
    y3 = ct.reshape(y, (ROWS, blocks, GROUP))
    scale, inv = _scale(_amax(y3, 2))
    _st(Q, (block, chunk), _to_e4m3(ct.reshape(y3 * inv, (ROWS, WIDTH))), TMA_STORE, LATENCY)
    ct.store(S, index=(block, chunk), tile=ct.reshape(scale, (ROWS, blocks)))


def _row_again(X, R, block, chunk, ROWS, BLOCK_N, HEAD_ROWS, HAS_RESIDUAL, TMA_LOAD, LATENCY):
    """Pass 2's x, or h from x and the residual again (the same rounding as pass 1's)."""
    x = _ld_rows(X, block, chunk, ROWS, BLOCK_N, HEAD_ROWS, TMA_LOAD, LATENCY)
    if HAS_RESIDUAL:
        r = _ld_rows(R, block, chunk, ROWS, BLOCK_N, HEAD_ROWS, TMA_LOAD, LATENCY)
        x = ct.astype(ct.astype(x, ct.float32) + ct.astype(r, ct.float32), X.dtype)
    return ct.astype(x, ct.float32)


# ==================================================================================== kernel
def _fp8_kernel(
    X, R, W, Q, S, H, RSTD, eps,
    HAS_RESIDUAL: ConstBool, HAS_WEIGHT: ConstBool, PER_ROW: ConstBool,
    ROWS: ConstInt, BLOCK_N: ConstInt, CHUNKED: ConstBool, GROUP: ConstInt, HEAD_ROWS: ConstInt,
    TMA_LOAD: ConstBool, TMA_STORE: ConstBool, LATENCY: ConstInt,
):  # fmt: skip
    """Row blocks of ROWS rows, program p taking blocks p, p + programs, ... (the norm forward's
    persistent grid and hints, from its table): the whole row in one tile (BLOCK_N >= N), or, with
    CHUNKED, walked twice in chunks of BLOCK_N columns. GROUP: the block of the 1 x 128 scales
    (read only without PER_ROW). X and R: (M, N) rows or per-head views (``kernels._ld_rows``).
    (A kernel through ``kernels._kernel``, which adds the plan's occupancy.)"""
    n = Q.shape[1]
    n_blocks = ct.cdiv(Q.shape[0], ROWS)
    if not CHUNKED:
        w = ct.full((BLOCK_N,), 1.0, dtype=ct.float32)
        if HAS_WEIGHT:
            w = _param(W, 0, BLOCK_N)  # once per program, not once per row block
        for block in range(ct.bid(0), n_blocks, ct.num_blocks(0)):
            x = _load_row_hinted(X, R, H, block, 0, ROWS, BLOCK_N, HEAD_ROWS, HAS_RESIDUAL, TMA_LOAD, TMA_STORE, LATENCY)
            rstd = _rstd(ct.sum(x * x, axis=1, keepdims=True), n, eps)
            ct.store(RSTD, index=(block,), tile=ct.reshape(rstd, (ROWS,)))
            y = x * rstd * w
            if PER_ROW:
                scale, inv = _scale(_amax(y, 1))
                _st(Q, (block, 0), _to_e4m3(y * inv), TMA_STORE, LATENCY)
                ct.store(S, index=(block, 0), tile=scale)
            else:
                _quantize_blocks(y, Q, S, block, 0, ROWS, BLOCK_N, GROUP, TMA_STORE, LATENCY)
    else:
        for block in range(ct.bid(0), n_blocks, ct.num_blocks(0)):
            n_chunks = ct.cdiv(n, BLOCK_N)
            sum_sq = ct.zeros((ROWS, BLOCK_N), dtype=ct.float32)
            # reduced per chunk: a [ROWS, BLOCK_N] running max beside sum_sq spilled at 8192-wide chunks
            amax = ct.zeros((ROWS, 1), dtype=ct.float32)  # read only with PER_ROW
            for c in range(n_chunks):
                x = _load_row_hinted(X, R, H, block, c, ROWS, BLOCK_N, HEAD_ROWS, HAS_RESIDUAL, TMA_LOAD, TMA_STORE,
                                     LATENCY)  # fmt: skip
                sum_sq = sum_sq + x * x
                if PER_ROW:
                    amax = ct.maximum(amax, _amax(_weighted(x, W, c, BLOCK_N, HAS_WEIGHT), 1), propagate_nan=True)
            rstd = _rstd(ct.sum(sum_sq, axis=1, keepdims=True), n, eps)
            ct.store(RSTD, index=(block,), tile=ct.reshape(rstd, (ROWS,)))
            scale, inv = _scale(amax * rstd)
            if PER_ROW:
                ct.store(S, index=(block, 0), tile=scale)
            for i in range(n_chunks):
                c = n_chunks - 1 - i
                x = _row_again(X, R, block, c, ROWS, BLOCK_N, HEAD_ROWS, HAS_RESIDUAL, TMA_LOAD, LATENCY)
                y = _weighted(x * rstd, W, c, BLOCK_N, HAS_WEIGHT)
                if PER_ROW:
                    _st(Q, (block, c), _to_e4m3(y * inv), TMA_STORE, LATENCY)
                else:
                    _quantize_blocks(y, Q, S, block, c, ROWS, BLOCK_N, GROUP, TMA_STORE, LATENCY)


def fp8_tuning(m: int, n: int, fused: bool, device) -> tuple[Tuning, Plan]:
    """(tuning, plan) of an FP8 call on m rows of n: the norm forward's table entry at this width
    (RMSNorm's, or add + RMSNorm's), ``CHUNKED_TUNING``'s fields where the rows are walked in
    chunks; an experiment's override (``plan.TUNING``) as it is."""
    t = _tuning("fwd", n, False, fused, device)
    p = plan("fwd", m, n, t)
    if p.wide and _plan_module.TUNING is None:
        t = replace(t, **CHUNKED_TUNING)
        p = plan("fwd", m, n, t)
    return t, p


def _fp8_fwd(x, residual, weight, eps, group):
    """(q, scale, h or None, rstd); x and the residual (M, N) rows or (T, H, N) views."""
    N = x.shape[-1]
    M = x.numel() // N
    _check_index_range(x, residual)
    t, p = fp8_tuning(M, N, residual is not None, x.device)
    (x, residual), p, hr = _as_rows((x, residual), N, p)
    q = torch.empty((M, N), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((M, N // group), dtype=torch.float32, device=x.device)
    rstd = torch.empty(M, dtype=torch.float32, device=x.device)
    h = torch.empty((M, N), dtype=x.dtype, device=x.device) if residual is not None else None
    args = (
        x, residual if residual is not None else _placeholder(x, x.dtype, 2, "residual"),
        weight if weight is not None else _placeholder(x, x.dtype, 1, "weight"), q, scale,
        h if h is not None else _placeholder(x, x.dtype, 2, "h"), rstd, float(eps),
        residual is not None, weight is not None, group == N, p.rows, p.width, p.wide, GROUP_BLOCK, hr,
        t.tma_load, t.tma_store, t.latency,
    )  # fmt: skip
    _launch(_kernel(_fp8_kernel, t), (forward_programs(M, p, sm_count(x.device), t), 1, 1), args)
    return q, scale, h, rstd


rmsnorm_fp8_fwd, add_rmsnorm_fp8_fwd = contract_functions(_fp8_fwd)
