"""RMSNorm (and the fused residual add + RMSNorm) with FP8 output, in Triton: one read of x, a
one-byte write of q.

Per row of N elements, in fp32 (x, residual and w upcast right after loading):

    rstd  = 1 / sqrt(mean(x^2) + eps)            y = x * rstd * w       (never rounded to x's dtype)
    scale = max(amax(|y| over the group), floor) / 448     one per row (group = N) or per 1 x 128 block
    q     = e4m3fn(y / scale): round to nearest even, saturating at +-448
    add + RMSNorm   h = round_to_x_dtype(x + residual), stored (residual_out); the above on h as stored

How a row is walked (rows a program, warps, chunk: ``resolve``, pinned per GPU, op and N in
``fp8_configs.json`` where a measured candidate beat the heuristic), in one of two kernels:

* whole row: a [ROWS, next_pow2(N)] tile in registers. The scales are the amax of y itself: per
  row a row reduction; per 1 x 128 block the tile is viewed as [ROWS, BLOCK_N / 128, 128] and
  reduced along its last axis (the blocks never cross a row: N is a multiple of 128), so
  q = y / scale broadcasts one scale over its block;
* chunked (wider rows): pass 1 walks the row in CHUNK columns for the sum of squares (storing h for
  the fused add) and, per row, the amax of |x * w|, whose product with rstd (> 0) is the amax of
  |y| up to fp32's rounding; pass 2 walks it again, last chunk first (still in L2), for y and q,
  and per 1 x 128 block takes each block's amax there (CHUNK is a multiple of 128). x is read twice,
  the second time mostly from L2, as the chunked norm forward reads it.

Per-head (T, H, N) views of x and the residual (q and k of a fused QKV projection, ``row_views``)
are read in place, each row where the norm kernels find it (``kernels._row_offsets``, a compile-time
``VIEWS`` flag); a reshape to rows would copy them, which cost two thirds of the time at QK-norm's
shapes. q, the scales, residual_out and rstd are written as (M, ...) rows.

448 appears as a literal in the kernels: harness.spec.fp8.E4M3_MAX, which a jit function cannot
read. The conversion: on a GPU ``.to(tl.float8e4nv)`` of fp32 is the hardware's (cvt.rn.satfinite on
sm_90: nearest even, saturating), after a clamp to +-448 that states the saturation whatever the
lowering. Triton's CPU interpreter converts otherwise: ties away from zero, subnormals truncated,
values past 448 to NaN or garbage (it keeps the exponent bits and clamps them). There the value is
rounded to the e4m3 grid by hand first (``_e4m3_rne``: the fp32 bits rounded to 3 mantissa bits, or
to a multiple of 2^-9 below the normals), and the interpreter's conversion of a value already on
the grid is exact. Its fp32 -> bf16 conversion truncates too: residual_out is rounded by hand there.
q is written one byte an element: a tile's stores are as wide as its x loads are (8 or 16 bytes a
thread). Scales are (M, N / group) fp32, row-major: the layout the blockwise GEMMs read (the
per-token case is (M, 1)).
"""

from __future__ import annotations

import functools
import json
import os

import torch
import triton
import triton.language as tl

from harness.spec.fp8 import AMAX_FLOOR, FP8_DTYPE, GROUP_BLOCK, contract_functions
from harness.spec.tuned import ENV as TUNED_ENV
from harness.spec.tuned import capability_of, table_for
from impls.triton.configs import device_name, pinned_table
from impls.triton.kernels import _row_offsets, row_shape, row_strides

INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")
# launch shapes measured per GPU (``resolve``)
CONFIG_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fp8_configs.json")
# the heuristic's launch shape: the widest row held in registers (elements; past it the chunked
# kernel in CHUNK columns a step), and ROW_ELEMENTS at least to a program (several narrow rows)
WHOLE_MAX = 16384
ROW_ELEMENTS = 4096
CHUNK = 4096


@triton.jit
def _round_to(v, DTYPE: tl.constexpr):
    """fp32 -> DTYPE, nearest even: the GPU's conversion; bf16 by hand in the interpreter, whose
    conversion truncates (NaN kept NaN: |v| <= inf is false only there)."""
    if INTERPRETED and DTYPE == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        out = tl.where(tl.abs(v) <= float("inf"), bits, 0x7FC0).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        out = v.to(DTYPE)
    return out


@triton.jit
def _e4m3_rne(v):
    """The e4m3fn value nearest v (ties to the even mantissa), saturated at +-448, as fp32: from
    2^-6 up the fp32 bits rounded to 3 mantissa bits (a carry moves the exponent, as it should);
    below, the subnormals' multiples of 2^-9, rounded to an integer by the 2^23 trick (exact:
    |v| * 512 < 8)."""
    a = tl.minimum(tl.abs(v), 448.0)
    bits = a.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)  # -1048576: ~0xFFFFF
    sub = ((a * 512.0 + 8388608.0) - 8388608.0) * 0.001953125
    r = tl.where(a < 0.015625, sub, normal)
    return tl.where(v < 0, -r, r)


@triton.jit
def _to_e4m3(v):
    v = tl.minimum(tl.maximum(v, -448.0), 448.0)
    if INTERPRETED:
        v = _e4m3_rne(v)
    return v.to(tl.float8e4nv)


@triton.jit
def _load_row(X, R, H, x_at, r_at, h_at, cols, mask, HAS_RESIDUAL: tl.constexpr):
    """x in fp32, or h = x + residual rounded once to x's dtype, stored (residual_out) and returned
    as stored."""
    x = tl.load(X + x_at[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(R + r_at[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        h = _round_to(x + r, H.dtype.element_ty)
        tl.store(H + h_at[:, None] + cols[None, :], h, mask=mask)
        x = h.to(tl.float32)
    return x


@triton.jit
def _scale(amax, FLOOR: tl.constexpr):
    """(scale, 1 / scale): the scale rounded once (IEEE division: Triton's plain fp32 division is
    an approximation of up to 2 ulps), q = y * (1 / scale) within two roundings of y / scale."""
    scale = tl.div_rn(tl.maximum(amax, FLOOR), 448.0)
    return scale, tl.div_rn(1.0, scale)


@triton.jit
def _quantize_blocks(y, Q, S, q_at, s_at, cols, mask, row_mask, G0, N,
                     ROWS: tl.constexpr, WIDTH: tl.constexpr, GROUP: tl.constexpr, FLOOR: tl.constexpr):  # fmt: skip
    """q and the scales of a [ROWS, WIDTH] tile of y whose columns start at block G0 of GROUP each
    (y 0 where masked: padded blocks get the floor, and are not stored)."""
    BLOCKS: tl.constexpr = WIDTH // GROUP
    y3 = tl.reshape(y, (ROWS, BLOCKS, GROUP))
    scale, inv = _scale(tl.max(tl.abs(y3), axis=2), FLOOR)
    q = tl.reshape(y3 * inv[:, :, None], (ROWS, WIDTH))
    tl.store(Q + q_at[:, None] + cols[None, :], _to_e4m3(q), mask=mask)
    blocks = G0 + tl.arange(0, BLOCKS)
    tl.store(S + s_at[:, None] + blocks[None, :], scale, mask=row_mask[:, None] & (blocks * GROUP < N)[None, :])


@triton.jit(do_not_specialize=["M", "eps"])
def _fp8_row_kernel(
    X, R, W, Q, S, H, RSTD,
    M, N, stride_x, stride_r, stride_h, stride_s, eps, HEADS, stride_xh, stride_rh,
    HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, PER_ROW: tl.constexpr, VIEWS: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr, FLOOR: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    mask = row_mask[:, None] & col_mask[None, :]
    rows64 = rows.to(tl.int64)
    x_at = _row_offsets(rows, stride_x, stride_xh, HEADS, VIEWS)
    r_at = _row_offsets(rows, stride_r, stride_rh, HEADS, VIEWS)
    x = _load_row(X, R, H, x_at, r_at, rows64 * stride_h, cols, mask, HAS_RESIDUAL)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / N + eps)
    tl.store(RSTD + rows, rstd, mask=row_mask)
    y = x * rstd[:, None]
    if HAS_WEIGHT:
        y = y * tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    q_at = rows64 * N
    s_at = rows64 * stride_s
    if PER_ROW:
        scale, inv = _scale(tl.max(tl.abs(y), axis=1), FLOOR)
        tl.store(Q + q_at[:, None] + cols[None, :], _to_e4m3(y * inv[:, None]), mask=mask)
        tl.store(S + s_at, scale, mask=row_mask)
    else:
        _quantize_blocks(y, Q, S, q_at, s_at, cols, mask, row_mask, 0, N, ROWS, BLOCK_N, GROUP, FLOOR)


@triton.jit(do_not_specialize=["M", "eps"])
def _fp8_chunked_kernel(
    X, R, W, Q, S, H, RSTD,
    M, N, stride_x, stride_r, stride_h, stride_s, eps, HEADS, stride_xh, stride_rh,
    HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, PER_ROW: tl.constexpr, VIEWS: tl.constexpr,
    ROWS: tl.constexpr, CHUNK: tl.constexpr, GROUP: tl.constexpr, FLOOR: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_mask = rows < M
    rows64 = rows.to(tl.int64)
    x_at = _row_offsets(rows, stride_x, stride_xh, HEADS, VIEWS)
    r_at = _row_offsets(rows, stride_r, stride_rh, HEADS, VIEWS)
    h_at = rows64 * stride_h
    n_chunks = tl.cdiv(N, CHUNK)
    # pass 1: sum of squares, and per row the amax of |x * w| (rstd > 0 scales it to that of |y|)
    sum_sq = tl.zeros([ROWS, CHUNK], dtype=tl.float32)
    amax = tl.zeros([ROWS, CHUNK], dtype=tl.float32)
    for c in range(n_chunks):
        cols = c * CHUNK + tl.arange(0, CHUNK)
        col_mask = cols < N
        mask = row_mask[:, None] & col_mask[None, :]
        x = _load_row(X, R, H, x_at, r_at, h_at, cols, mask, HAS_RESIDUAL)
        sum_sq += x * x
        if PER_ROW:
            xw = x
            if HAS_WEIGHT:
                xw = x * tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
            amax = tl.maximum(amax, tl.abs(xw))
    rstd = tl.rsqrt(tl.sum(sum_sq, axis=1) / N + eps)
    tl.store(RSTD + rows, rstd, mask=row_mask)
    scale, inv = _scale(tl.max(amax, axis=1) * rstd, FLOOR)
    if PER_ROW:
        tl.store(S + rows64 * stride_s, scale, mask=row_mask)
    if HAS_RESIDUAL:
        # pass 2 reads h where other threads of this program wrote it: the barrier orders those
        # writes before the reads (CTA scope)
        tl.debug_barrier()
        X = H
        x_at = h_at
    # pass 2, last chunk first (still in L2): y, q and the blocks' scales
    for i in range(n_chunks):
        c = n_chunks - 1 - i
        cols = c * CHUNK + tl.arange(0, CHUNK)
        col_mask = cols < N
        mask = row_mask[:, None] & col_mask[None, :]
        y = tl.load(X + x_at[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32) * rstd[:, None]
        if HAS_WEIGHT:
            y = y * tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        if PER_ROW:
            tl.store(Q + (rows64 * N)[:, None] + cols[None, :], _to_e4m3(y * inv[:, None]), mask=mask)
        else:
            _quantize_blocks(y, Q, S, rows64 * N, rows64 * stride_s, cols, mask, row_mask, c * (CHUNK // GROUP), N,
                             ROWS, CHUNK, GROUP, FLOOR)  # fmt: skip


def _launch(x, residual, weight, eps, group):
    M, N, heads = row_shape(x)
    (sx, sxh), (sr, srh) = row_strides(x, heads), row_strides(residual if residual is not None else x, heads)
    per_row = group == N
    q = torch.empty((M, N), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((M, N // group), dtype=torch.float32, device=x.device)
    rstd = torch.empty(M, dtype=torch.float32, device=x.device)
    h = torch.empty((M, N), dtype=x.dtype, device=x.device) if residual is not None else None
    rows, warps, chunk = launch_shape(N, residual is not None, per_row, x.device)
    common = {"HAS_RESIDUAL": residual is not None, "HAS_WEIGHT": weight is not None, "PER_ROW": per_row,
              "GROUP": group if not per_row else GROUP_BLOCK, "FLOOR": AMAX_FLOOR, "VIEWS": heads > 0}  # fmt: skip
    args = (x, residual if residual is not None else x, weight if weight is not None else x, q, scale,
            h if h is not None else x, rstd, M, N, sx, sr, N, scale.stride(0), eps, max(heads, 1), sxh, srh)  # fmt: skip
    if chunk:
        _fp8_chunked_kernel[(triton.cdiv(M, rows),)](*args, ROWS=rows, CHUNK=chunk, num_warps=warps, **common)
    else:
        block_n = triton.next_power_of_2(N)
        _fp8_row_kernel[(triton.cdiv(M, rows),)](*args, ROWS=rows, BLOCK_N=block_n, num_warps=warps, **common)
    return q, scale, h, rstd


def op_name(fused: bool, per_row: bool) -> str:
    return f"{'add_' if fused else ''}rmsnorm_fp8_{'token' if per_row else 'g128'}"


@functools.cache
def _tables() -> dict:
    with open(CONFIG_FILE) as f:
        return {k: v for k, v in json.load(f).items() if not k.startswith("_")}


# (op, N, device, the NORMBENCH_CONFIGS override) -> what ``resolve`` found: asked once, not on every
# launch (a call's host time counts at small M)
_RESOLVED: dict = {}


def resolve(op: str, n: int, device: torch.device) -> tuple[tuple[int, int, int], str]:
    """((rows a program, warps, chunk: 0 for the whole row in registers), where it comes from):
    the entry of ``CONFIG_FILE`` for this GPU (or one of its compute capability), op and exactly N,
    else N's power-of-two bucket; else ``heuristic``."""
    if device.type != "cuda":
        return heuristic(n), "interpreter"
    key = (op, n, device, os.environ.get(TUNED_ENV))
    hit = _RESOLVED.get(key)
    if hit is None:
        hit = _RESOLVED[key] = _lookup(op, n, device)
    return hit


def _lookup(op: str, n: int, device: torch.device) -> tuple[tuple[int, int, int], str]:
    # a NORMBENCH_CONFIGS override may name a GPU with norm tables but no FP8 entries: its FP8
    # shapes are then the heuristic's; one naming no tuned GPU at all is refused, as for the norms
    override = os.environ.get(TUNED_ENV, "").strip()
    tuned = {override: {}, **_tables()} if override in pinned_table() else _tables()
    gpu, how = table_for(device_name(device), tuned, capability_of(device))
    by_n = tuned[gpu].get(op, {}) if gpu else {}
    entry = by_n.get(str(n)) or by_n.get(str(triton.next_power_of_2(n)))
    if entry is not None:
        return (entry["rows"], entry["warps"], entry["chunk"]), how
    return heuristic(n), how if gpu is None else f"heuristic (no entry for N={n} in the table of {gpu})"


def heuristic(n: int) -> tuple[int, int, int]:
    """Rows of at least ROW_ELEMENTS to a program, 512 elements a warp, up to 16 warps; rows past
    WHOLE_MAX in CHUNK columns on 8 warps."""
    block_n = triton.next_power_of_2(n)
    if block_n > WHOLE_MAX:
        return 1, 8, CHUNK
    rows = max(1, min(64, ROW_ELEMENTS // block_n))
    return rows, max(1, min(16, rows * block_n // 512)), 0


def launch_shape(n: int, fused: bool, per_row: bool, device: torch.device) -> tuple[int, int, int]:
    return resolve(op_name(fused, per_row), n, device)[0]


def source(op: str, n: int, device) -> str:
    """Where one launch's shape comes from (the benchmark records it per point)."""
    return resolve(op, n, device)[1]


rmsnorm_fp8_fwd, add_rmsnorm_fp8_fwd = contract_functions(_launch)
