"""RMSNorm (and the fused residual add + RMSNorm) with FP8 output, in CuTe DSL (Hopper, sm_90): one
read of x (and the residual), a one-byte write per element of q.

Per row of N elements, in fp32 (x, residual and w upcast right after loading):

    rstd  = 1 / sqrt(mean(x^2) + eps)            y = x * rstd * w       (never rounded to x's dtype)
    scale = max(amax(|y| over the group), floor) / 448     one per row (group = N) or per 1 x 128 block
    q     = e4m3fn(clamp(y * (1 / scale), -448, 448))      nearest even, saturating
    add + RMSNorm   h = round_to_x_dtype(x + residual), stored (residual_out); the above on h as stored

The norm's forward (``kernels.py``), quantized. Its launch shapes (``plan.py``: 128-bit vectors,
threads along the row, several rows per CTA for short rows, a cluster per row for wide ones, x
staged in shared memory from 32 KB of row per CTA) and its pieces (the sum-of-squares reduction in
its order, the residual add, the weight loads, the predicates) are imported, so every row width the
norm takes, this takes, with the norm's rstd to the bit. rstd is NaN where the mean square
overflows, as the norm's is, and every max here keeps a NaN: such a row's scales and q are NaN,
never the floor's scale or a saturated 448.

Per row (group = N): a second row reduction after rstd, the max of |y|, through the norm's
exchange: warp shuffles, then one value per warp through shared memory, or into every cluster
peer's shared memory (st.async) on a second mbarrier, so that a peer already done with the sum
never pushes its amax into the first exchange. The scale is that of y itself, not |x * w| * rstd.

Per 1 x 128 block, no exchange: a thread's vector k holds columns k * vec * threads + t * vec (a
warp's accesses contiguous), so a block is 128 / vec neighbouring lanes at one k (16 lanes of 16-bit
x, 32 of fp32: one butterfly over that lane group), or, where a row has fewer than 128 columns per
k, every lane of the row over 128 / (vec * threads) neighbouring k (``block_lanes``). That needs
vectors of 4 or more elements; rows whose stride or pointer allows only 1 or 2 (a view, which no
harness shape is) are copied first (``_launch``). A cluster CTA's chunk is then a multiple of 128
columns: no block crosses CTAs.

Staged rows are quantized one vector at a time from shared memory, so no fp32 row is live across a
reduction (the staged CTAs keep the norm's 64-80 registers, 3-4 per SM). Per row that is two passes
over the staged vectors, the amax and then q (y recomputed, the same bits); the second takes its
weight vectors from L2, since a weight held for both passes was converted to fp32 once for both and
spilled. A weight of more than 32 registers a thread (fp32 beside 16-bit x) comes from L2 a vector
at a time in every pass, as the norm's does.

The scale is an IEEE division and q is y times its IEEE reciprocal (``/`` on Float32 is div.rn.f32
and rcp.rn.f32 here, no ``div_rn`` needed): within two roundings of y / scale.

The conversion and the stores, in CuTe DSL. ``TensorSSA.to(cutlass.Float8E4M3FN)`` on fp32 lowers
to the hardware conversion, cvt.rn.satfinite.e4m3x2.f32, one instruction per pair of elements,
packed two bytes a register in order. The clamp before it (``cute.math.clamp`` with
``propagate_nan``: a compare and select that keeps a NaN) states the saturation whatever the
lowering. The bytes are bit-cast to Uint8 (``TensorSSA.bitcast``) and the kernel writes a uint8 view
of the float8_e4m3fn tensor, so nothing at the TVM-FFI boundary depends on FP8 support in DLPack.
q's register tile is partitioned by a tiled copy of the same thread and value layout as x's, so a
thread's vector of q is one copy of vec bytes (8 for 16-bit x, 4 for fp32). Easy: the conversion,
its pairing and packing came from the DSL's own cast with no inline PTX; the scales' IEEE
arithmetic is the default; the NaN-keeping max is a flag; a block's amax is one
``warp_reduction(threads_in_group=...)``; the row's max is the norm's exchange with another
operator. Hard: which lanes share a block is nowhere in the layout algebra: the kernel derives it
from the tile and has to establish that it is a lane group inside a warp, where Triton and Gluon
reshape the tile to [rows, N / 128, 128] and reduce an axis. The stores are only as wide as the
partition makes them: the DSL does not check a copy atom against a register tile's first mode, and
a (1, vec) tile copied with a vec-byte atom compiles into vec overlapping per-element copies.
Nothing here runs without a GPU, and the DSL has no interpreter: the tests compile the variants
for sm_90a and read the PTX (the conversion, the clamp, div.rn, the store widths).

Per-head (T, H, N) views of x and the residual are read in place, as the norm's forward reads them
(``kernels.py``, "Per-head views"); q, the scales, residual_out and rstd are written as rows.

Compilation: one kernel per (op, dtype, N, vec, weight dtype, grouping, per-head views, launch) key,
M symbolic, as the norms are (``COMPILE_SECONDS``); called through TVM-FFI.
"""

from __future__ import annotations

import math
import tempfile
import time
from functools import lru_cache

import torch

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int64, Uint8, const_expr

from harness.spec.fp8 import AMAX_FLOOR, E4M3_MAX, FP8_DTYPE, GROUP_BLOCK, contract_functions

from .kernels import (
    _HAS_TVM_FFI,
    _TORCH2CUTE,
    _broadcast_rows,
    _check_call,
    _copy_atom,
    _dtype,
    _fake,
    _fake_rows,
    _num_sms,
    _planned,
    _reduction_buffer_layout,
    _tiled_copy,
    add_residual,
    add_residual_staged,
    as_rows,
    column_predicate,
    load_weight,
    publish_warp_values,
    read_staged,
    row_allreduce,
    rstd_or_nan,
    sum_of_squares_by_vector,
)
from .plan import _STAGED_CTAS_PER_SM, Launch, _cdiv, check_launch, planned_launch, vector_width

COMPILE_SECONDS: dict[tuple, float] = {}  # key -> seconds spent compiling it
_COMPILED: dict[tuple, tuple] = {}


# ============================================================================ pieces
def _fmax(a, b):
    """max that keeps a NaN (max.NaN.f32): a row whose y is NaN gets a NaN scale, never a finite one."""
    return cute.arch.fmax(a, b, nan=True)


@cute.jit
def scale_of(amax: Float32):
    """(scale, 1 / scale), both IEEE-rounded (div.rn, rcp.rn)."""
    scale = _fmax(amax, Float32(AMAX_FLOOR)) / Float32(E4M3_MAX)
    return scale, Float32(1.0) / scale


@cute.jit
def to_e4m3(y: cute.TensorSSA, inv: Float32) -> cute.TensorSSA:
    """The bytes of e4m3fn(y * inv): clamped to +-448 (NaN kept), then the hardware's conversion
    (cvt.rn.satfinite.e4m3x2.f32, a pair an instruction), bit-cast to Uint8 (flat, in order)."""
    v = y * inv
    v = cute.math.clamp(v, cute.full_like(v, -E4M3_MAX), cute.full_like(v, E4M3_MAX), propagate_nan=True)
    return v.to(cutlass.Float8E4M3FN).bitcast(Uint8)


@cute.jit
def vector_amax(y: cute.TensorSSA) -> Float32:
    return abs(y).reduce(cute.ReductionOp.MAX, Float32(0.0), 0)


@cute.jit
def row_allmax(value: Float32, launch: cutlass.Constexpr, sbuf: cute.Tensor, slot: cutlass.Constexpr, mbar,
               phase: cutlass.Constexpr) -> Float32:  # fmt: skip
    """The max of every thread's ``value`` over the whole row (NaN-propagating); every thread gets
    it. row_allreduce's exchange, with max in place of the sum."""
    tpr = const_expr(launch.threads_per_row)
    wpr = const_expr(launch.warps_per_row)
    cn = const_expr(launch.cluster_n)
    m = cute.arch.warp_reduction(value, _fmax, threads_in_group=min(tpr, 32))
    if const_expr(wpr > 1 or cn > 1):
        publish_warp_values((m,), launch, sbuf, slot, mbar, phase)
        lane, row = cute.arch.lane_idx(), cute.arch.warp_idx() // wpr
        entries = const_expr(wpr * cn)
        acc = Float32(0.0)
        for i in cutlass.range_constexpr(-(-entries // 32)):
            idx = lane + i * 32
            if idx < entries:
                acc = _fmax(acc, sbuf[row, idx, slot])
        m = cute.arch.warp_reduction(acc, _fmax)
    return m


def block_lanes(launch: Launch) -> tuple[int, int]:
    """(lanes, vectors) of one 1 x 128 block: the lane group (neighbouring lanes of a row) and the
    run of a thread's neighbouring vectors that together hold its 128 columns."""
    stride = launch.vec * launch.threads_per_row  # columns between a thread's vectors
    if stride >= GROUP_BLOCK:
        return GROUP_BLOCK // launch.vec, 1
    return launch.threads_per_row, GROUP_BLOCK // stride


def blocks_fit(launch: Launch) -> bool:
    """Whether every 1 x 128 block is a lane group of one warp at a run of vectors (block_lanes):
    128 a multiple of the columns per k, or those columns a multiple of 128 with 128 / vec <= 32."""
    stride = launch.vec * launch.threads_per_row
    if stride >= GROUP_BLOCK:
        return stride % GROUP_BLOCK == 0 and GROUP_BLOCK // launch.vec <= 32
    return GROUP_BLOCK % stride == 0 and launch.threads_per_row <= 32


def _weight_from_l2(launch: Launch, mW) -> bool:
    """A staged row's weight that would take more than 32 registers a thread (an fp32 weight beside
    16-bit x; fp32 beside fp32 x at 16 vectors a thread, N = 262144): loaded a vector at a time from
    L2 instead. Held whole, ptxas spilled 64 B a thread at 64 registers (fp32, N = 262144), as the
    norm's staged forward did with fp32 weights beside 16-bit x."""
    return launch.stage_x and mW is not None and launch.vecs_per_thread * launch.vec * mW.element_type.width > 32 * 32


# ============================================================================ the kernel
class Fp8Forward:
    """``residual``: add_rmsnorm, h = x + residual rounded to x's dtype, stored as residual_out and
    normalised as stored. ``per_row``: one scale per row (group = N), else per 1 x 128 block. The
    weight arrives in its own dtype (x's or fp32), or None."""

    def __init__(self, dtype, n: int, launch: Launch, residual: bool, per_row: bool):
        self.dtype, self.n, self.launch, self.residual, self.per_row = dtype, n, launch, residual, per_row
        self.op = "add_rmsnorm" if residual else "rmsnorm"
        self.blocks = 1 if per_row else n // GROUP_BLOCK  # scales per row

    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,
        mR: cute.Tensor,  # residual, or None
        mW: cute.Tensor,  # or None
        mQ: cute.Tensor,  # uint8 (M, N): the bytes of q
        mS: cute.Tensor,  # fp32 (M * blocks,): the scales, row-major
        mH: cute.Tensor,  # residual_out, or None
        mRstd: cute.Tensor,
        eps: Float32,
        stream: cuda.CUstream,
    ):
        L = self.launch
        mX, mR = as_rows(mX), as_rows(mR)
        self.kernel(mX, mR, mW, mQ, mS, mH, mRstd, eps, _tiled_copy(self.dtype, L), _tiled_copy(Uint8, L)).launch(
            grid=[cute.ceil_div(cute.size(mX, mode=[0]), L.rows_per_cta), L.cluster_n, 1],
            block=[L.num_threads, 1, 1],
            cluster=[1, L.cluster_n, 1] if const_expr(L.cluster_n > 1) else None,
            min_blocks_per_mp=_STAGED_CTAS_PER_SM[self.op] if const_expr(L.stage_x and L.num_threads == 256) else 0,
            preferred_smem_carveout=100 if const_expr(L.stage_x) else None,
            stream=stream,
        )

    @cute.kernel
    def kernel(self, mX, mR, mW, mQ, mS, mH, mRstd, eps: Float32, tiled: cute.TiledCopy, tiled_q: cute.TiledCopy):
        L = const_expr(self.launch)
        n = const_expr(self.n)
        tiler = (L.rows_per_cta, L.chunk)
        tidx, _, _ = cute.arch.thread_idx()
        bidx, rank, _ = cute.arch.block_idx()
        if const_expr(L.cluster_n == 1):
            rank = 0

        # allocation order: shared_memory_bytes() mirrors it
        smem = cutlass.utils.SmemAllocator()
        sX, sR = None, None
        if const_expr(L.stage_x):
            sX = smem.allocate_tensor(self.dtype, cute.make_ordered_layout(tiler, order=(1, 0)), byte_alignment=16)
            if const_expr(self.residual):
                sR = smem.allocate_tensor(self.dtype, cute.make_ordered_layout(tiler, order=(1, 0)), byte_alignment=16)
        exchanges = const_expr(2 if self.per_row else 1)  # the sum of squares, and the row's amax
        sbuf = smem.allocate_tensor(Float32, _reduction_buffer_layout(L, exchanges), byte_alignment=16)
        mbar = None
        if const_expr(L.cluster_n > 1):
            # one mbarrier per exchange: a peer that is done with the first may push its amax while
            # this CTA still waits for another peer's sum
            mbar = smem.allocate_array(Int64, num_elems=exchanges)
            if tidx < exchanges:
                cute.arch.mbarrier_init(mbar + tidx, 1)
            cute.arch.mbarrier_init_fence()
            cute.arch.cluster_arrive_relaxed()

        M = cute.size(mX, mode=[0])
        thr = tiled.get_slice(tidx)
        tXgX = thr.partition_S(cute.local_tile(mX, tiler, (bidx, rank)))
        tXgQ = tiled_q.get_slice(tidx).partition_D(cute.local_tile(mQ, tiler, (bidx, rank)))
        tXcX = thr.partition_S(cute.local_tile(cute.make_identity_tensor((M, n)), tiler, (bidx, rank)))
        tXgR, tXgH = None, None
        if const_expr(self.residual):
            tXgR = thr.partition_S(cute.local_tile(mR, tiler, (bidx, rank)))
            tXgH = thr.partition_D(cute.local_tile(mH, tiler, (bidx, rank)))
        whole_row = const_expr(L.cluster_n * L.chunk == n)
        in_row = None if const_expr(whole_row) else column_predicate(tXcX, n)
        row = tXcX[0][0]
        atom = _copy_atom(self.dtype, L.vec)
        atom_q = _copy_atom(Uint8, L.vec)

        # x (and the residual) in: registers, or staged in shared memory by cp.async
        rX = cute.make_rmem_tensor_like(tXgX)
        rR = cute.make_rmem_tensor_like(tXgX) if const_expr(self.residual) else None
        tXsX, tXsR = None, None
        if const_expr(L.stage_x):
            # each thread later reads back only the vectors its own cp.asyncs wrote: no CTA barrier
            tXsX = thr.partition_D(sX)
            async_atom = _copy_atom(self.dtype, L.vec, async_copy=True)
            if const_expr(self.residual):
                tXsR = thr.partition_D(sR)
            if row < M:
                cute.copy(async_atom, tXgX, tXsX, pred=in_row)
                if const_expr(self.residual):
                    cute.copy(async_atom, tXgR, tXsR, pred=in_row)
            cute.arch.cp_async_commit_group()
        else:
            rX.fill(0.0)  # columns past N read as 0: out of the sums and the amax
            if const_expr(self.residual):
                rR.fill(0.0)
            if row < M:
                cute.copy(atom, tXgX, rX, pred=in_row)
                if const_expr(self.residual):
                    cute.copy(atom, tXgR, rR, pred=in_row)
        rW, tXgW = None, None
        if const_expr(L.stage_x and mW is not None):
            tXgW = thr.partition_S(cute.local_tile(_broadcast_rows(mW, L.rows_per_cta), tiler, (0, rank)))
        if const_expr(not _weight_from_l2(L, mW)):
            rW = load_weight(mW, L, thr, tiler, rank, tXgX, in_row)
        if const_expr(L.cluster_n > 1):
            cute.arch.cluster_wait()

        # rstd: the norm's sum of squares, in its order
        if const_expr(L.stage_x):
            cute.arch.cp_async_wait_group(0)
            if const_expr(self.residual):
                ssq_thread = add_residual_staged(tXsX, tXsR, tXgH, atom, in_row, row < M, L.vecs_per_thread)
            else:
                read_staged(tXsX, rX, atom, in_row)
                ssq_thread = sum_of_squares_by_vector(rX, L.vecs_per_thread)
        else:
            if const_expr(self.residual):
                add_residual(rX, rR, tXgH, atom, in_row, row < M)
            x = rX.load().to(Float32)
            ssq_thread = (x * x).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
        (ssq,) = row_allreduce((ssq_thread,), L, sbuf, 0, mbar, 0)
        rstd = rstd_or_nan(ssq * const_expr(1.0 / n), eps)

        valid = row < M
        if const_expr(L.stage_x):
            self.quantize_staged(tXsX, rW, tXgW, tXgQ, tXcX, in_row, mS, rstd, valid, row, atom_q, sbuf, mbar)
        else:
            y = rX.load().to(Float32) * rstd
            if const_expr(mW is not None):
                y = y * rW.load().to(Float32)
            rQ = cute.make_rmem_tensor_like(tXgQ)
            if const_expr(self.per_row):
                amax = row_allmax(vector_amax(y), L, sbuf, 1, mbar + 1 if const_expr(mbar is not None) else None, 0)
                scale, inv = scale_of(amax)
                rQ.store(to_e4m3(y, inv))
                if valid and tXcX[0][1] == 0:
                    mS[row] = scale
            else:
                rY = cute.make_rmem_tensor_like(rX, Float32)
                rY.store(y)
                self.quantize_blocks(rY, rQ, tXcX, mS, valid, row)
            if valid:
                cute.copy(atom_q, rQ, tXgQ, pred=in_row)
        if valid and tXcX[0][1] == 0:  # the thread holding column 0 (in CTA 0 of the cluster)
            mRstd[row] = rstd

    @cute.jit
    def quantize_blocks(self, rY: cute.Tensor, rQ: cute.Tensor, tXcX: cute.Tensor, mS: cute.Tensor, valid, row):
        """q and the scales of a register row, block by block: each block's amax over its run of
        vectors in this thread, then over its lane group (one butterfly; the group's lanes all end
        with the block's amax); the group's first lane stores the scale. Vectors past N hold zeros,
        and their blocks are past N whole (N is a multiple of 128): no scale stored for them."""
        L = const_expr(self.launch)
        lanes, run = block_lanes(L)
        tidx, _, _ = cute.arch.thread_idx()
        for g in cutlass.range_constexpr(-(-L.vecs_per_thread // run)):
            first, last = const_expr(g * run), const_expr(min((g + 1) * run, L.vecs_per_thread))
            amax = Float32(0.0)
            for k in cutlass.range_constexpr(first, last):
                amax = _fmax(amax, vector_amax(rY[None, None, k].load()))
            amax = cute.arch.warp_reduction(amax, _fmax, threads_in_group=lanes)
            scale, inv = scale_of(amax)
            for k in cutlass.range_constexpr(first, last):
                rQ[None, None, k].store(to_e4m3(rY[None, None, k].load(), inv))
            col = tXcX[(0, 0), 0, first][1]
            if valid and tidx % lanes == 0 and col < self.n:
                mS[row * self.blocks + col // GROUP_BLOCK] = scale

    @cute.jit
    def vector_y(self, tXsX: cute.Tensor, rW, tXgW, k: cutlass.Constexpr, rstd: Float32, in_row_k):
        """y of this thread's staged vector k: x from shared memory, the weight from registers (rW)
        or else from L2 (tXgW: loaded only inside the row; 0 past it)."""
        rXk = cute.make_rmem_tensor_like(tXsX[None, None, k])
        cute.autovec_copy(tXsX[None, None, k], rXk)
        y = rXk.load().to(Float32) * rstd
        if const_expr(rW is not None):
            y = y * rW[None, None, k].load().to(Float32)
        elif const_expr(tXgW is not None):
            rWk = cute.make_rmem_tensor_like(tXgW[None, None, k])
            rWk.fill(0.0)
            if in_row_k:
                cute.copy(_copy_atom(tXgW.element_type, self.launch.vec), tXgW[None, None, k], rWk)
            y = y * rWk.load().to(Float32)
        return y

    @cute.jit
    def quantize_staged(self, tXsX, rW, tXgW, tXgQ, tXcX, in_row, mS, rstd, valid, row, atom_q, sbuf, mbar):
        """q and the scales of a staged row, one vector at a time from shared memory. Per row: an
        amax pass, the exchange, then a quantizing pass (y recomputed, the same bits) whose weight
        vectors come from L2: the weight in registers for both passes was converted to fp32 once
        for both (64 values a thread at bf16 N = 16384), and ptxas spilled at the 64 registers of 4
        CTAs per SM. Per block: one pass (a staged row has at least 128 columns per k: one vector
        per block). Vectors past N were never staged: kept out of the amax, and nothing of them
        stored."""
        L = const_expr(self.launch)
        tidx, _, _ = cute.arch.thread_idx()
        inv = Float32(0.0)
        wB = rW  # the quantizing pass's weight
        if const_expr(self.per_row):
            wB = None
            amax = Float32(0.0)
            for k in cutlass.range_constexpr(L.vecs_per_thread):
                if const_expr(in_row is None):
                    amax = _fmax(amax, vector_amax(self.vector_y(tXsX, rW, tXgW, k, rstd, True)))
                else:
                    a = vector_amax(self.vector_y(tXsX, rW, tXgW, k, rstd, in_row[0, 0, k]))
                    amax = _fmax(amax, cutlass.select_(in_row[0, 0, k], a, Float32(0.0)))
            amax = row_allmax(amax, L, sbuf, 1, mbar + 1 if const_expr(mbar is not None) else None, 0)
            scale, inv = scale_of(amax)
            if valid and tXcX[0][1] == 0:
                mS[row] = scale
        lanes, _ = block_lanes(L)
        for k in cutlass.range_constexpr(L.vecs_per_thread):
            in_row_k = True if const_expr(in_row is None) else in_row[0, 0, k]
            y = self.vector_y(tXsX, wB, tXgW, k, rstd, in_row_k)
            if const_expr(not self.per_row):
                # every lane shuffles (its group's lanes are all in the row or all past it)
                amax = cute.arch.warp_reduction(vector_amax(y), _fmax, threads_in_group=lanes)
                scale, inv = scale_of(amax)
                if valid and in_row_k and tidx % lanes == 0:
                    mS[row * self.blocks + tXcX[(0, 0), 0, k][1] // GROUP_BLOCK] = scale
            if valid and in_row_k:
                rQk = cute.make_rmem_tensor_like(tXgQ[None, None, k])
                rQk.store(to_e4m3(y, inv))
                cute.copy(atom_q, rQk, tXgQ[None, None, k])


# ============================================================================ launch and compile
def shared_memory_bytes(launch: Launch, elem_bytes: int, residual: bool, per_row: bool) -> int:
    """Dynamic shared memory of one CTA, as the kernel allocates it: the staged rows, the reduction
    buffer (one slot per exchange), 16-byte aligned, and in a cluster one mbarrier per exchange."""
    L = launch
    exchanges = 2 if per_row else 1
    row_bytes = L.rows_per_cta * L.chunk * elem_bytes
    staged = (2 if residual else 1) if L.stage_x else 0
    offset = 0
    for size in [row_bytes] * staged + [L.rows_per_cta * L.warps_per_row * L.cluster_n * exchanges * 4]:
        offset = _cdiv(offset, 16) * 16 + size
    if L.cluster_n > 1:
        offset = _cdiv(offset, 8) * 8 + 8 * exchanges
    return offset


@lru_cache(maxsize=None)
def kernel_key(op: str, dtype: torch.dtype, n: int, vec: int, wdtype: torch.dtype | None, per_row: bool,
               few_rows: bool = False, heads: int = 0, views: tuple[bool, ...] = (),
               rows: int = 0) -> tuple:  # fmt: skip
    """The compile cache's key (``op``: rmsnorm_fp8 or add_rmsnorm_fp8). The launch is the norm
    forward's (add_rmsnorm's for the fused add), checked here with this kernel's shared memory
    (ValueError) before anything is compiled or launched. ``heads``, ``views`` (x, residual) and
    ``rows``: per-head views, as the norm's kernel_key takes them."""
    residual = op == "add_rmsnorm_fp8"
    norm = "add_rmsnorm" if residual else "rmsnorm"
    launch, _ = planned_launch(n, dtype.itemsize, vec, "fwd", norm, few_rows, residual, rows)
    what = f"{op} at N = {n} with {dtype.itemsize}-byte elements"
    check_launch(launch, n, shared_memory_bytes(launch, dtype.itemsize, residual, per_row), what)
    return (op, dtype, n, vec, wdtype, per_row, heads, views if heads else (), launch)


def compile_kernel(key: tuple, keep_ptx: bool = False):
    """The compiled kernel for this key, compiled once (M symbolic). ``keep_ptx``: keep its PTX
    (``__ptx__``), for the tests, which read the conversion and the stores there."""
    cached = _COMPILED.get(key)
    if cached is not None and (not keep_ptx or cached[0].__ptx__):
        return cached
    t0 = time.perf_counter()
    op, dtype, n, vec, wdtype, per_row, heads, views, launch = key
    residual = op == "add_rmsnorm_fp8"
    cdt = _TORCH2CUTE[dtype]
    m, tokens = cute.sym_int(), cute.sym_int()
    x = _fake_rows(cdt, m, n, vec, heads if heads and views[0] else 0, tokens)
    res = _fake_rows(cdt, m, n, vec, heads if heads and views[1] else 0, tokens) if residual else None
    h = _fake(cdt, (m, n), vec) if residual else None
    w = _fake(_TORCH2CUTE[wdtype], (n,), vec) if wdtype is not None else None
    q = _fake(Uint8, (m, n), vec)
    scales = _fake(Float32, (cute.sym_int(),), 1)
    rstd = _fake(Float32, (m,), 1)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=_HAS_TVM_FFI)
    kernel = Fp8Forward(cdt, n, launch, residual, per_row)
    options = "--enable-tvm-ffi" if _HAS_TVM_FFI else ""
    args = (x, res, w, q, scales, h, rstd, Float32(0.0), stream)
    if keep_ptx:  # read into memory before the dump folder goes
        with tempfile.TemporaryDirectory() as dump:
            fn = cute.compile(kernel, *args, options=f"{options} --keep-ptx --dump-dir={dump}")
    else:
        fn = cute.compile(kernel, *args, options=options)
    COMPILE_SECONDS[key] = time.perf_counter() - t0
    _COMPILED[key] = (fn, kernel)
    return _COMPILED[key]


def _key_of(op, dtype, n, group, vec, wdtype, few_rows, heads=0, rows=0):
    vec = vec or math.gcd(n, 16 // dtype.itemsize)
    wdtype = dtype if wdtype == "x" else wdtype
    views = (True, op == "add_rmsnorm_fp8") if heads else ()
    return kernel_key(op, dtype, n, vec, wdtype, group == n, few_rows, heads, views, rows)


def compile_only(op: str, dtype: torch.dtype, n: int, group: int, vec: int | None = None,
                 wdtype: torch.dtype | None | str = "x", few_rows: bool = False, heads: int = 0,
                 rows: int = 0) -> float:  # fmt: skip
    """Compile one variant without a GPU (set CUTE_DSL_ARCH=sm_90a); returns compile seconds.
    ``group``: N or 128; ``wdtype``: the weight's dtype, "x" for x's own, None for no weight;
    ``heads``: x (and the residual) as (T, H, N) per-head views; ``rows``: a cap on rows per CTA."""
    key = _key_of(op, dtype, n, group, vec, wdtype, few_rows, heads, rows)
    compile_kernel(key)
    return COMPILE_SECONDS[key]


def compiled_ptx(op: str, dtype: torch.dtype, n: int, group: int, vec: int | None = None,
                 wdtype: torch.dtype | None | str = "x", few_rows: bool = False) -> str:  # fmt: skip
    """The PTX of one variant, compiled without a GPU as compile_only does."""
    return compile_kernel(_key_of(op, dtype, n, group, vec, wdtype, few_rows), keep_ptx=True)[0].__ptx__


# ============================================================================ the contract
def _fresh(t):
    """A contiguous copy in new (aligned) memory: rows of 128-bit vectors for the block path."""
    return None if t is None else torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)


def _launch(x, residual, weight, eps, group):
    n = x.shape[-1]
    m = x.numel() // n
    _check_call(m)
    per_row = group == n
    op = "add_rmsnorm_fp8" if residual is not None else "rmsnorm_fp8"
    few_rows = m <= _num_sms(x.device.index or 0)
    dtype, wdtype = x.dtype, _dtype(weight)

    def key_of(rows, heads, views, cap):
        vec = vector_width(n, dtype, *(t for t in (*rows, weight) if t is not None))
        return kernel_key(op, dtype, n, vec, wdtype, per_row, few_rows, heads, views, cap)

    # (M, N) rows, or (T, H, N) per-head views read in place as the norm's forward reads them
    key, (x, residual) = _planned(key_of, (x, residual), n)
    if not per_row and not blocks_fit(key[-1]):
        # vectors under 4 elements (a misaligned view): a block would span more than a warp
        x, residual, weight = _fresh(x), _fresh(residual), _fresh(weight)
        key, (x, residual) = _planned(key_of, (x, residual), n)
    q = torch.empty((m, n), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((m, n // group), dtype=torch.float32, device=x.device)
    rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    h = torch.empty((m, n), dtype=x.dtype, device=x.device) if residual is not None else None
    fn, _ = compile_kernel(key)
    fn(x, residual, weight, q.view(torch.uint8), scale.view(-1), h, rstd, eps)
    return q, scale, h, rstd


rmsnorm_fp8_fwd, add_rmsnorm_fp8_fwd = contract_functions(_launch)
