"""RMSNorm, LayerNorm and add + RMSNorm, forward and backward, in CuTe DSL (Hopper, sm_90).

Math, per row x of length N (fp32 throughout, y / dx rounded once to x's dtype):

    RMSNorm    rstd = 1 / sqrt(mean(x^2) + eps)             xhat = x * rstd
    LayerNorm  mean = sum(x) / N                             xhat = (x - mean) * rstd
               rstd = 1 / sqrt(M2 / N + eps),  M2 = sum((x - mean)^2)
               M2 is never E[x^2] - mean^2, which cancels in fp32 when |mean| >> std. A row in one
               CTA: the sum, then the centred sum of squares (two passes). A row over a cluster:
               every thread takes (count, mean, M2) of its own vectors, centred, and these merge
               pairwise up the reduction tree (Chan et al.), one exchange between the CTAs:
                   n = na + nb,  mean = (na ma + nb mb) / n,  M2 = M2a + M2b + (mb - ma)^2 na nb / n
    forward    y = xhat * w (+ b)

    backward   g = dy * w,   c1 = sum(xhat * g) / N,   c2 = sum(g) / N  (LayerNorm only)
               dx = rstd * (g - xhat * c1 - c2)
               dw = sum over rows of dy * xhat,   db = sum over rows of dy

    add_rmsnorm  h = round_to_x_dtype(x + residual)   (the sum in fp32, rounded once)
                 forward: residual_out = h, then RMSNorm of h;  backward: dh = dx(h) + dresidual_out

add_rmsnorm is the RMSNorm kernels with a residual switch (NormForward / NormBackward ``residual``),
so it takes every path RMSNorm takes (registers, staged, cluster) in one pass over the rows. The sum
is rounded to x's dtype before the statistics because residual_out is stored in x's dtype and the
unfused model normalises what it stored: y is then bit for bit rmsnorm(residual_out), and the
backward, which sees only residual_out, differentiates the same function. Staged, the residual row
is staged beside x and h overwrites x's staged vectors (each thread its own). In the backward,
dresidual_out rides the cp.async ring beside x and dy and is added to dx in fp32, so dh is rounded
once.

Weights and biases come in their own dtype: x's, or fp32 beside 16-bit x (mixed precision). They
are loaded in that dtype, one vector of x's width per vector (an fp32 vector of 8 is two 128-bit
loads; vector_width aligns its pointer to match) and converted to fp32 in registers like x.
dweight / dbias are reduced in fp32 and rounded once to the weight's dtype.

Statistics that overflow: x^2 of |x| > 1.8e19 is inf in fp32, and rsqrt(inf) = 0 would make the row
a finite y = b (LayerNorm) or 0 (RMSNorm). rstd is NaN where the variance (mean square) is inf, so
y and dx are NaN there, as torch's LayerNorm gives; torch's RMSNorm returns the finite 0s, a wrong
number this does not copy.

Work split and launch shapes (``plan.py``): a row is cut into ``cluster_n`` column chunks, one per
CTA of a thread-block cluster, so that every row is read from DRAM exactly once at every N up to
262144; inside a CTA, threads share a row in 128-bit vectors where N, the strides and the pointers
allow. Every launch shape, with its exact shared memory, is checked against Hopper's limits before
anything is compiled, so a shape the driver would reject is a ValueError, not a failed launch.

Per-head views (the contract's ``row_views``): q and k cut from a fused QKV projection are
(T, H, N) views with no (M, N) view of their rows. The kernels read them in place as rows whose
row mode is (H, T):(head stride, token stride) (``as_rows``): CuTe's colexicographic index
h + H * t is the contract's row t * H + h, so tiles, partitions and the row coordinates that index
the flat statistics are those of (M, N) rows, and the layout algebra does the addressing with no
division per row. H is static (in the compile key), T and the strides symbolic. CuTe divides that
mode into tiles of R rows where R divides H or H divides R (any T: the outermost mode extends, so
a last tile past T is one past M, predicated off as ever); elsewhere a CTA takes gcd(H, R) rows
while that is still a warp, and past that the view is copied (``view_rows``). A 3-D tensor with
an (M, N) view (dy, contiguous) goes as (M, N) rows; the outputs are (M, N).

Forward: one-shot, one row tile per CTA. Short rows are loaded straight into registers. From 32 KB
(RMSNorm) / 10 KB (LayerNorm) of row per CTA, x is staged in shared memory instead (cp.async) and
re-read from there for each pass, 8 vectors per thread: a register-resident 32 KB chunk cost
63 (RMSNorm) / 110 (LayerNorm) registers x 512 threads, so only 2 / 1 CTAs fit per SM and an SM
had 32-64 KB of loads in flight, nothing while it reduced; staged, the CTA count per SM is set by
shared memory and registers together (RMSNorm 64 registers: 4 CTAs of 256 threads). LayerNorm
loads weight and bias after its reductions (late_weights), so they hold no registers then. Over a
cluster (``one_exchange``) it also reduces once per row (the (count, mean, M2) merge above) and
writes y one vector at a time, that vector's weight and bias loaded just before: 40 registers
instead of 80, so shared memory alone sets its CTAs per SM (6 of 256 threads, not 3).

Row reductions: warp shuffles over the lanes of a row, then one value (RMSNorm, backward) or one
(count, mean, M2) triple (LayerNorm forward over a cluster) per warp through shared memory; in a
cluster, every warp pushes its partial into every peer CTA's shared memory with ``st.async``
(distributed shared memory) and each CTA waits on its own mbarrier for the bytes of all peers. No
cluster-wide barrier sits on the critical path.

Backward: persistent. As many CTAs (or clusters) as the driver's occupancy calculator says fit at
once (``max_resident``: clusters must fit inside a GPC, so this is not SMs / cluster_n) loop over
row tiles, with a cp.async ring of up to 4 shared-memory stages so the next rows' x and dy are in
flight while the current row reduces. Each row is reduced from shared memory, then re-read from it
for dx, so only the fp32 dweight / dbias accumulators stay in registers across the reduction (for
LayerNorm chunks over 16 KB per CTA, dbias accumulates in shared memory). A row's rstd (and
mean) is loaded one iteration ahead, like the ring: loaded at the top of its own iteration, every
row waited a DRAM latency on it before its first sum, and with one or two CTAs per SM nothing hid
that wait. The accumulators are written once per CTA to an fp32 partial buffer (slots, N)
(a CTA of several short rows first adds its rows' accumulators in shared memory, in row order),
summed over the slots by one SlotSum launch (dweight and dbias together) and rounded once: no
atomics, bit-identical run to run. torch's ``sum(0)`` and cast there had cost a large
share of the backward's time.

Rows of an odd width (N no multiple of a 16-byte vector, 16-bit rows, ``realigned_launch``): a row
of 4001 bf16 elements starts anywhere within a vector, so vector_width gives 2-byte accesses and the
load/store units, not DRAM, set the pace (the backward at 43-68% of copy bandwidth on the H100).
The backward reads such rows realigned instead: row r starts s = (r N) mod 8 elements into the
vector at (r N) - s, and its span of whole vectors from there is copied by cp.async like any row,
the neighbouring rows' elements in its first and last vector included. Once the row has landed,
the threads holding those two vectors set the neighbours' elements to 0 in the staged copy, before
any arithmetic (an inf beside the row cannot reach it), and dx is stored in whole vectors except in
those two, element by element. A persistent CTA takes rows b, b + G, ... with G a multiple of 8
(``_backward``), so that every row it takes starts at the same s: its weight is loaded once,
shifted by s, its dweight / dbias accumulate in the span's columns and go to its partial row
shifted back, and which of a thread's elements are the row's is one bitmask register. The last
row's last vector may run past the tensor: that vector alone is read element by element. The
kernel takes 8-85 registers more than the one of aligned rows, so the launch promises ptxas 128
(``plan.REALIGNED_MIN_REGISTERS``). Forward rows stay element-wise (74-88% at N = 4001, H100).

Compilation: one kernel per (op, direction, dtype, N, vec, weight / bias dtypes, residual, the
per-head views' H and which tensors are views, realigned rows, launch) key, compiled on first use with M (the row
count, or T) symbolic, so a new M never recompiles (SlotSum shapes its CTA by the slot count, 8 to
64 threads per column, so a backward's width may compile it up to four times); ``COMPILE_SECONDS``
records the compile time per key. Calls go through TVM-FFI (torch tensors passed straight in, the
current stream taken from the environment) to keep the launch overhead small for decode shapes.

Measurements behind these choices, and the known limits: docs/kernels/cute.md.
"""

from __future__ import annotations

import math
import operator
import tempfile
import time
from functools import lru_cache
from importlib.util import find_spec

import torch

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import cpasync

from harness.spec.validation import has_no_row_view

from .plan import (
    _ONE_EXCHANGE_CTAS_PER_SM,
    _STAGED_CTAS_PER_SM,
    MAX_ROWS,
    Launch,
    _cdiv,
    _reduction_slots,
    backward_ring,
    planned_launch,
    realigned_launch,
    shared_memory_bytes,
    slot_threads,
    vector_width,
    view_rows,
)

_TORCH2CUTE = {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16, torch.float32: cutlass.Float32}
_HAS_TVM_FFI = find_spec("tvm_ffi") is not None


# ============================================================================ reductions
@cute.jit
def publish_warp_values(
    values: tuple,
    launch: cutlass.Constexpr,
    sbuf: cute.Tensor,  # fp32 (rows_per_cta, warps_per_row * cluster_n, slots)
    slot: Int32,
    mbar: cute.Pointer,  # this stage's mbarrier (cluster only, else None)
    phase: Int32,
):
    """Every warp's ``values`` (the same in all its lanes) -> sbuf[row, warp of the row, slot + j], in
    this CTA and, in a cluster, in every peer CTA; returns once all of the row's entries are there."""
    wpr = const_expr(launch.warps_per_row)
    cn = const_expr(launch.cluster_n)
    lane, warp = cute.arch.lane_idx(), cute.arch.warp_idx()
    row, col = warp // wpr, warp % wpr
    if const_expr(cn == 1):
        if lane == 0:
            for j in cutlass.range_constexpr(len(values)):
                sbuf[row, col, slot + j] = values[j]
        cute.arch.barrier()
    else:
        # One mbarrier per stage counts the bytes of every peer's every warp; lane l of each
        # warp pushes that warp's values to CTA l of the cluster (itself included).
        rank = cute.arch.block_idx_in_cluster()
        if warp == 0:
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(mbar, len(values) * wpr * cn * 4)
        if lane < cn:
            for j in cutlass.range_constexpr(len(values)):
                dst = sbuf.iterator + cute.crd2idx((row, rank * wpr + col, slot + j), sbuf.layout)
                cute.arch.store_async_dsmem(dst, values[j].bitcast(Int32), mbar, lane)
        cute.arch.mbarrier_wait(mbar, phase)


@cute.jit
def row_allreduce(
    partials: tuple,
    launch: cutlass.Constexpr,
    sbuf: cute.Tensor,  # fp32 (rows_per_cta, warps_per_row * cluster_n, slots)
    slot: Int32,
    mbar: cute.Pointer,  # this stage's mbarrier (cluster only, else None)
    phase: Int32,
):
    """Sum each thread-partial in ``partials`` over the whole row; every thread gets the sums."""
    tpr = const_expr(launch.threads_per_row)
    wpr = const_expr(launch.warps_per_row)
    cn = const_expr(launch.cluster_n)
    sums = [cute.arch.warp_reduction(p, operator.add, threads_in_group=min(tpr, 32)) for p in partials]
    if const_expr(wpr > 1 or cn > 1):
        publish_warp_values(sums, launch, sbuf, slot, mbar, phase)
        lane, row = cute.arch.lane_idx(), cute.arch.warp_idx() // wpr
        entries = const_expr(wpr * cn)
        for j in cutlass.range_constexpr(len(sums)):
            acc = Float32(0.0)
            for i in cutlass.range_constexpr(-(-entries // 32)):
                idx = lane + i * 32
                if idx < entries:
                    acc += sbuf[row, idx, slot + j]
            sums[j] = cute.arch.warp_reduction(acc, operator.add)
    return sums


def merge_moments(na, ma, qa, nb, mb, qb):
    """Chan et al.'s pairwise merge of (count, mean, M2 = sum of squared deviations from the mean):

        n = na + nb,   mean = (na ma + nb mb) / n,   M2 = M2a + M2b + (mb - ma)^2 na nb / n

    Every term is centred, so nothing cancels the way E[x^2] - mean^2 does in fp32 when
    |mean| >> std. Written symmetrically in a and b, so both lanes of a butterfly compute the same
    bits and every thread of a row ends with identical statistics. A count of 0 is the identity."""
    n = na + nb
    inv_n = Float32(1.0) / cute.arch.fmax(n, Float32(1.0))
    delta = mb - ma
    return n, (na * ma + nb * mb) * inv_n, qa + qb + delta * delta * (na * nb * inv_n)


@cute.jit
def thread_moments(rX: cute.Tensor, in_row, launch: cutlass.Constexpr):
    """(count, mean, M2) of this thread's vectors inside the row: each vector's own (vec, mean, M2),
    merged one by one, so only one vector is ever held in fp32 (registers: see the launch caps)."""
    vec = const_expr(launch.vec)
    n, m, q = Float32(0.0), Float32(0.0), Float32(0.0)
    for k in cutlass.range_constexpr(launch.vecs_per_thread):
        xk = rX[None, None, k].load().to(Float32)
        mk = xk.reduce(cute.ReductionOp.ADD, Float32(0.0), 0) * (1.0 / vec)
        dk = xk - mk
        qk = (dk * dk).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
        # (two branches, not one `or`: the first is decided at compile time, the second at run time)
        if const_expr(in_row is None):  # noqa: SIM114
            n, m, q = merge_moments(n, m, q, Float32(vec), mk, qk)
        elif in_row[0, 0, k]:
            n, m, q = merge_moments(n, m, q, Float32(vec), mk, qk)
    return n, m, q


@cute.jit
def row_moments(
    moments: tuple,  # this thread's (count, mean, M2)
    launch: cutlass.Constexpr,
    sbuf: cute.Tensor,  # fp32 (rows_per_cta, warps_per_row * cluster_n, >= slot + 3)
    slot: Int32,
    mbar: cute.Pointer,
    phase: Int32,
):
    """(count, mean, M2) of the whole row from every thread's, merged pairwise (merge_moments):
    one exchange between warps / cluster peers, where mean-then-variance needs two."""
    tpr = const_expr(launch.threads_per_row)
    wpr = const_expr(launch.warps_per_row)
    cn = const_expr(launch.cluster_n)
    n, m, q = moments
    offset = const_expr(min(tpr, 32) // 2)
    while const_expr(offset > 0):
        n, m, q = merge_moments(n, m, q, cute.arch.shuffle_sync_bfly(n, offset=offset),
                                cute.arch.shuffle_sync_bfly(m, offset=offset),
                                cute.arch.shuffle_sync_bfly(q, offset=offset))
        offset = const_expr(offset // 2)
    if const_expr(wpr > 1 or cn > 1):
        publish_warp_values((n, m, q), launch, sbuf, slot, mbar, phase)
        lane, row = cute.arch.lane_idx(), cute.arch.warp_idx() // wpr
        entries = const_expr(wpr * cn)
        n, m, q = Float32(0.0), Float32(0.0), Float32(0.0)
        for i in cutlass.range_constexpr(-(-entries // 32)):
            idx = lane + i * 32
            if idx < entries:
                n, m, q = merge_moments(n, m, q, sbuf[row, idx, slot], sbuf[row, idx, slot + 1],
                                        sbuf[row, idx, slot + 2])
        for b in cutlass.range_constexpr(5):
            offset = const_expr(16 >> b)
            n, m, q = merge_moments(n, m, q, cute.arch.shuffle_sync_bfly(n, offset=offset),
                                    cute.arch.shuffle_sync_bfly(m, offset=offset),
                                    cute.arch.shuffle_sync_bfly(q, offset=offset))
    return n, m, q


def _reduction_buffer_layout(launch: Launch, slots: int):
    return cute.make_ordered_layout(
        (launch.rows_per_cta, launch.warps_per_row * launch.cluster_n, slots), order=(1, 0, 2)
    )


def _copy_atom(dtype, vec: int, async_copy: bool = False):
    """One vector per copy; cp.async (global -> shared, bypassing registers) moves 4..16 bytes."""
    bits = vec * dtype.width
    op = cpasync.CopyG2SOp() if async_copy and bits >= 32 else cute.nvgpu.CopyUniversalOp()
    return cute.make_copy_atom(op, dtype, num_bits_per_copy=bits)


def _tiled_copy(dtype, launch: Launch, async_copy: bool = False):
    atom = _copy_atom(dtype, launch.vec, async_copy)
    thr_layout = cute.make_ordered_layout((launch.rows_per_cta, launch.threads_per_row), order=(1, 0))
    return cute.make_tiled_copy_tv(atom, thr_layout, cute.make_layout((1, launch.vec)))


def column_predicate(tXcX: cute.Tensor, n: int) -> cute.Tensor:
    """One flag per vector: is it inside the row? (N is a multiple of vec: all in or all out.)
    Not called ``pred``: inside a dynamic ``if`` the DSL's generated region code shadows that name."""
    vpt = cute.size(tXcX, mode=[2])
    in_row = cute.make_rmem_tensor(cute.make_layout((1, 1, vpt), stride=(vpt, 0, 1)), Boolean)
    for k in range(vpt):
        in_row[0, 0, k] = cute.elem_less(tXcX[(0, 0), 0, k][1], n)
    return in_row


def _broadcast_rows(mV: cute.Tensor, rows: int) -> cute.Tensor:
    """(N,) -> (rows, N) with row stride 0, so a weight vector tiles like a row of x."""
    return cute.make_tensor(mV.iterator, cute.make_layout((rows, mV.shape[0]), stride=(0, 1)))


def as_rows(mT: cute.Tensor) -> cute.Tensor:
    """A row tensor as (M, N) rows: (M, N) as it is; a (T, H, N) per-head view as the same memory
    with the row mode (H, T):(stride H, stride T), whose colexicographic index h + H * t is the
    contract's row t * H + h. Tiles, partitions and row coordinates then work as on (M, N)."""
    if const_expr(mT is None or cute.rank(mT) == 2):
        return mT
    T, H, N = mT.shape
    sT, sH, sN = mT.stride
    return cute.make_tensor(mT.iterator, cute.make_layout(((H, T), N), stride=((sH, sT), sN)))


# ============================================================================ forward
class NormForward:
    """``residual``: add_rmsnorm, h = x + residual rounded to x's dtype, stored as residual_out and
    normalised as stored. ``weight`` / ``bias`` arrive in their own dtype (x's or fp32)."""

    def __init__(self, dtype, n: int, launch: Launch, layernorm: bool, residual: bool = False):
        self.dtype, self.n, self.launch, self.layernorm, self.residual = dtype, n, launch, layernorm, residual
        self.op = "layernorm" if layernorm else ("add_rmsnorm" if residual else "rmsnorm")

    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,
        mR: cute.Tensor,  # residual, or None
        mW: cute.Tensor,  # or None
        mB: cute.Tensor,  # or None
        mY: cute.Tensor,
        mH: cute.Tensor,  # residual_out, or None
        mRstd: cute.Tensor,
        mMean: cute.Tensor,  # or None
        eps: Float32,
        stream: cuda.CUstream,
    ):
        L = self.launch
        tiled = _tiled_copy(self.dtype, L)
        mX, mR = as_rows(mX), as_rows(mR)
        self.kernel(mX, mR, mW, mB, mY, mH, mRstd, mMean, eps, tiled).launch(
            grid=[cute.ceil_div(cute.size(mX, mode=[0]), L.rows_per_cta), L.cluster_n, 1],
            block=[L.num_threads, 1, 1],
            cluster=[1, L.cluster_n, 1] if const_expr(L.cluster_n > 1) else None,
            min_blocks_per_mp=(
                _ONE_EXCHANGE_CTAS_PER_SM if const_expr(L.one_exchange) else _STAGED_CTAS_PER_SM[self.op]
            ) if const_expr(L.stage_x and L.num_threads == 256) else 0,
            preferred_smem_carveout=100 if const_expr(L.stage_x) else None,
            stream=stream,
        )

    @cute.kernel
    def kernel(self, mX, mR, mW, mB, mY, mH, mRstd, mMean, eps: Float32, tiled: cute.TiledCopy):
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
        slots = const_expr(_reduction_slots(self.op, "fwd", L))
        sbuf = smem.allocate_tensor(Float32, _reduction_buffer_layout(L, slots), byte_alignment=16)
        mbar = None
        if const_expr(L.cluster_n > 1):
            mbar = smem.allocate_array(Int64, num_elems=1)
            if tidx == 0:
                cute.arch.mbarrier_init(mbar, 1)
            cute.arch.mbarrier_init_fence()
            cute.arch.cluster_arrive_relaxed()  # peers may push into us once the barrier exists

        M = cute.size(mX, mode=[0])
        thr = tiled.get_slice(tidx)
        tXgX = thr.partition_S(cute.local_tile(mX, tiler, (bidx, rank)))
        tXgY = thr.partition_D(cute.local_tile(mY, tiler, (bidx, rank)))
        tXcX = thr.partition_S(cute.local_tile(cute.make_identity_tensor((M, n)), tiler, (bidx, rank)))
        tXgR, tXgH = None, None
        if const_expr(self.residual):
            tXgR = thr.partition_S(cute.local_tile(mR, tiler, (bidx, rank)))
            tXgH = thr.partition_D(cute.local_tile(mH, tiler, (bidx, rank)))
        # When the cluster's tiles cover the row exactly, every vector is in the row: no predicate.
        whole_row = const_expr(L.cluster_n * L.chunk == n)
        in_row = None if const_expr(whole_row) else column_predicate(tXcX, n)
        row = tXcX[0][0]
        atom = _copy_atom(self.dtype, L.vec)

        rX = cute.make_rmem_tensor_like(tXgX)
        rR = cute.make_rmem_tensor_like(tXgX) if const_expr(self.residual) else None
        tXsX, tXsR = None, None
        if const_expr(L.stage_x):
            # Each thread later reads back only the vectors its own cp.asyncs wrote: no CTA barrier.
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
            rX.fill(0.0)  # columns past N read as 0 and drop out of the sums
            if const_expr(self.residual):
                rR.fill(0.0)
            if row < M:
                cute.copy(atom, tXgX, rX, pred=in_row)
                if const_expr(self.residual):
                    cute.copy(atom, tXgR, rR, pred=in_row)
        rW, rB = None, None
        if const_expr(not L.late_weights and not _y_per_vector(L, mW, self.dtype)):
            rW = load_weight(mW, L, thr, tiler, rank, tXgX, in_row)
            rB = load_weight(mB, L, thr, tiler, rank, tXgX, in_row)
        if const_expr(L.cluster_n > 1):
            cute.arch.cluster_wait()
        ssq_thread = None  # this thread's sum of squares, when the fused add already took it
        if const_expr(L.stage_x):
            cute.arch.cp_async_wait_group(0)
            if const_expr(self.residual):
                ssq_thread = add_residual_staged(tXsX, tXsR, tXgH, atom, in_row, row < M, L.vecs_per_thread)
            else:
                read_staged(tXsX, rX, atom, in_row)
        elif const_expr(self.residual):
            add_residual(rX, rR, tXgH, atom, in_row, row < M)
        inv_n = const_expr(1.0 / n)
        mean = Float32(0.0)
        if const_expr(L.one_exchange):
            _, mean, m2 = row_moments(thread_moments(rX, in_row, L), L, sbuf, 0, mbar, 0)
            rstd = rstd_or_nan(m2 * inv_n, eps)
        elif const_expr(self.layernorm):
            # one CTA per row (cluster_n == 1): two barrier-separated CTA reductions
            (total,) = row_allreduce((rX.load().to(Float32).reduce(cute.ReductionOp.ADD, Float32(0.0), 0),),
                                     L, sbuf, 0, None, 0)
            mean = total * inv_n
            if const_expr(L.stage_x):
                read_staged(tXsX, rX, atom, in_row)
            rXc = cute.make_rmem_tensor_like(rX, Float32)
            rXc.store(rX.load().to(Float32) - mean)
            if const_expr(not whole_row):
                # the zero-filled columns past N are -mean now: take them out of the variance
                for k in cutlass.range_constexpr(L.vecs_per_thread):
                    if not in_row[0, 0, k]:
                        for v in cutlass.range_constexpr(L.vec):
                            rXc[(v, 0), 0, k] = Float32(0.0)
            xc = rXc.load()
            (ssq,) = row_allreduce(((xc * xc).reduce(cute.ReductionOp.ADD, Float32(0.0), 0),), L, sbuf, 1, None, 0)
            rstd = rstd_or_nan(ssq * inv_n, eps)
        else:
            if const_expr(ssq_thread is None and L.stage_x):
                ssq_thread = sum_of_squares_by_vector(rX, L.vecs_per_thread)
            elif const_expr(ssq_thread is None):
                x = rX.load().to(Float32)
                ssq_thread = (x * x).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            (ssq,) = row_allreduce((ssq_thread,), L, sbuf, 0, mbar, 0)
            rstd = rstd_or_nan(ssq * inv_n, eps)
        if const_expr(_y_per_vector(L, mW, self.dtype)):
            # y one vector at a time: x from shared memory, weight and bias from L2, so only one
            # vector of each is live (all of them at once cost 80 registers, 3 CTAs per SM).
            tXgW = None if const_expr(mW is None) else thr.partition_S(
                cute.local_tile(_broadcast_rows(mW, L.rows_per_cta), tiler, (0, rank)))
            tXgB = None if const_expr(mB is None) else thr.partition_S(
                cute.local_tile(_broadcast_rows(mB, L.rows_per_cta), tiler, (0, rank)))
            for k in cutlass.range_constexpr(L.vecs_per_thread):
                if const_expr(whole_row):
                    normalize_vector(tXsX, tXgW, tXgB, tXgY, k, mean, rstd, atom, L.vec, row < M)
                else:
                    normalize_vector(tXsX, tXgW, tXgB, tXgY, k, mean, rstd, atom, L.vec, row < M and in_row[0, 0, k])
        else:
            if const_expr(L.late_weights):
                rW = load_weight(mW, L, thr, tiler, rank, tXgX, in_row)
                rB = load_weight(mB, L, thr, tiler, rank, tXgX, in_row)
            if const_expr(L.stage_x):
                read_staged(tXsX, rX, atom, in_row)
            y = rX.load().to(Float32) * rstd
            if const_expr(self.layernorm):
                y = (rX.load().to(Float32) - mean) * rstd
            if const_expr(mW is not None):
                y = y * rW.load().to(Float32)
            if const_expr(mB is not None):
                y = y + rB.load().to(Float32)
            rY = cute.make_rmem_tensor_like(tXgY)
            rY.store(y.to(self.dtype))
            if row < M:
                cute.copy(atom, rY, tXgY, pred=in_row)
        if row < M:  # noqa: SIM102 (as one `and` it compiles differently; this form was measured)
            if tXcX[0][1] == 0:  # the thread holding column 0 (in CTA 0 of the cluster)
                mRstd[row] = rstd
                if const_expr(mMean is not None):
                    mMean[row] = mean


def _y_per_vector(launch: Launch, mW, dtype) -> bool:
    """Write y one staged vector at a time, each with its weight (and bias) vector loaded just before:
    the LayerNorm forward over a cluster (Launch.one_exchange), and a staged row whose weight is
    wider than x (fp32 beside 16-bit x). That weight row whole in registers is 64 fp32 values per
    thread beside x's vectors: ptxas spilled 150-250 B per thread at bf16 N = 16384 and 32768
    (RMSNorm capped at 64 registers, add_rmsnorm at 80)."""
    if launch.one_exchange:
        return True
    return launch.stage_x and mW is not None and mW.element_type.width > dtype.width


@cute.jit
def rstd_or_nan(var: Float32, eps: Float32) -> Float32:
    """1 / sqrt(var + eps), NaN where var is +inf: x^2 overflowed fp32 (|x| > 1.8e19), and
    rsqrt(inf) = 0 would turn the row into a finite y = b (or 0). torch's LayerNorm gives NaN there;
    its RMSNorm gives 0, a finite wrong number, which this does not copy."""
    return Float32(cutlass.select_(var == Float32(math.inf), Float32(math.nan), cute.math.rsqrt(var + eps)))


@cute.jit
def add_residual(rX: cute.Tensor, rR: cute.Tensor, tXgH: cute.Tensor, atom, in_row, valid: Boolean):
    """rX <- h = x + residual, summed in fp32 and rounded once to x's dtype: the value the unfused
    model stores, so the statistics and y below see exactly what rmsnorm(residual_out) would.
    h is written out as residual_out."""
    rX.store((rX.load().to(Float32) + rR.load().to(Float32)).to(rX.element_type))
    if valid:
        cute.copy(atom, rX, tXgH, pred=in_row)


@cute.jit
def add_residual_staged(tXsX: cute.Tensor, tXsR: cute.Tensor, tXgH: cute.Tensor, atom, in_row, valid: Boolean,
                        vecs: cutlass.Constexpr) -> Float32:  # fmt: skip
    """The fused add on staged rows, one vector at a time: h = x + residual (fp32 sum, rounded once),
    written out as residual_out and over x's staged vector (this thread's own: no barrier), which
    the later pass re-reads. Returns this thread's sum of h^2. Both rows whole in registers (the
    add_residual form) held 2 x 8 vectors at once: ptxas, capped at 80 registers (3 CTAs per SM),
    spilled, and the staged fused add ran far below RMSNorm."""
    ssq = Float32(0.0)
    for k in cutlass.range_constexpr(vecs):
        rH = cute.make_rmem_tensor_like(tXsX[None, None, k])
        rR = cute.make_rmem_tensor_like(tXsR[None, None, k])
        cute.autovec_copy(tXsX[None, None, k], rH)
        cute.autovec_copy(tXsR[None, None, k], rR)
        rH.store((rH.load().to(Float32) + rR.load().to(Float32)).to(rH.element_type))
        cute.autovec_copy(rH, tXsX[None, None, k])
        part = vector_sum_of_squares(rH)
        if const_expr(in_row is None):
            ssq = ssq + part
            if valid:
                cute.copy(atom, rH, tXgH[None, None, k])
        else:
            # a vector past N was never staged: what shared memory holds there must not reach the sum
            ssq = ssq + cutlass.select_(in_row[0, 0, k], part, Float32(0.0))
            if valid and in_row[0, 0, k]:
                cute.copy(atom, rH, tXgH[None, None, k])
    return ssq


@cute.jit
def vector_sum_of_squares(rV: cute.Tensor) -> Float32:
    """The sum of x^2 over one vector, the one summation both staged RMSNorm paths use."""
    v = rV.load().to(Float32)
    return (v * v).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)


@cute.jit
def sum_of_squares_by_vector(rX: cute.Tensor, vecs: cutlass.Constexpr) -> Float32:
    """This thread's sum of x^2 in add_residual_staged's order (vector by vector), so that a staged
    RMSNorm row gives the fused add's rstd to the bit: y = rmsnorm(residual_out) as stored. Summed
    over all vectors at once, the order differed and so did y, by an ulp (fp16 / fp32 rows of
    131080 and 262144 over a cluster, on the H100)."""
    ssq = Float32(0.0)
    for k in cutlass.range_constexpr(vecs):
        ssq = ssq + vector_sum_of_squares(rX[None, None, k])
    return ssq


@cute.jit
def normalize_vector(tXsX, tXgW, tXgB, tXgY, k: cutlass.Constexpr, mean, rstd, atom, vec: cutlass.Constexpr,
                     valid: Boolean):  # fmt: skip
    """y = (x - mean) * rstd * w + b for this thread's k-th vector (LayerNorm, x staged)."""
    if valid:
        rX = cute.make_rmem_tensor_like(tXgY[None, None, k])
        cute.autovec_copy(tXsX[None, None, k], rX)
        y = (rX.load().to(Float32) - mean) * rstd
        for tXgV, is_bias in ((tXgW, False), (tXgB, True)):
            if const_expr(tXgV is not None):
                rV = cute.make_rmem_tensor_like(tXgV[None, None, k])
                cute.copy(_copy_atom(tXgV.element_type, vec), tXgV[None, None, k], rV)
                y = y + rV.load().to(Float32) if const_expr(is_bias) else y * rV.load().to(Float32)
        rX.store(y.to(rX.element_type))
        cute.copy(atom, rX, tXgY[None, None, k])


def load_weight(mV, launch: Launch, thr, tiler, rank, like: cute.Tensor, in_row):
    """This thread's vectors of a weight / bias row, in the row's own dtype (None stays None). An
    fp32 row beside 16-bit x takes two 128-bit loads per vector of x."""
    if const_expr(mV is None):
        return None
    rV = cute.make_rmem_tensor_like(like, mV.element_type)
    rV.fill(0.0)
    src = thr.partition_S(cute.local_tile(_broadcast_rows(mV, launch.rows_per_cta), tiler, (0, rank)))
    cute.copy(_copy_atom(mV.element_type, launch.vec), src, rV, pred=in_row)
    return rV


def read_staged(tXsX: cute.Tensor, rX: cute.Tensor, atom, in_row):
    """Registers <- this thread's staged vectors; vectors past N (never written) read as 0."""
    if const_expr(in_row is not None):
        rX.fill(0.0)
    cute.copy(atom, tXsX, rX, pred=in_row)


# ============================================================================ backward
@cute.jit
def load_tile(atom, srcs: tuple, dsts: tuple, zero: cute.Tensor, in_row: cute.Tensor, valid: Boolean):
    """One ring stage of the row tensors (x and dy, and dresidual_out: this thread's vectors). Rows
    past M are zero-filled instead: dy = 0 makes them contribute nothing to the sums or to dweight /
    dbias."""
    if valid:
        for src, dst in zip(srcs, dsts):
            cute.copy(atom, src, dst, pred=in_row)
    else:
        for dst in dsts:
            cute.autovec_copy(zero, dst)
    cute.arch.cp_async_commit_group()


@cute.jit
def load_row_stats(mRstd: cute.Tensor, mMean: cute.Tensor, row: Int32, M: Int32):
    """(rstd, mean) of one row (mean 0 without mMean; both 0 past M)."""
    rstd, mean = Float32(0.0), Float32(0.0)
    if row < M:
        rstd = mRstd[row]
        if const_expr(mMean is not None):
            mean = mMean[row]
    return rstd, mean


def max_resident(compiled, kernel, num_sms: int) -> int:
    """How many CTAs (clusters when cluster_n > 1) of this compiled kernel fit on the GPU at once,
    from the driver's occupancy calculator. With clusters this is not SMs / cluster_n: a cluster
    must fit inside one GPC and H100/H200 GPCs hold different SM counts. A persistent grid larger
    than this runs a second, mostly idle wave."""
    from cuda.bindings import driver

    L = kernel.launch
    fallback = max(1, num_sms * kernel.ring.ctas_per_sm // L.cluster_n)
    try:
        err, lib = driver.cuLibraryLoadData(compiled.artifacts.CUBIN, None, None, 0, None, None, 0)
        err, kernels = driver.cuLibraryEnumerateKernels(1, lib)
        err, func = driver.cuKernelGetFunction(kernels[0])
        smem = kernel.smem
        attr = driver.CUfunction_attribute
        driver.cuFuncSetAttribute(func, attr.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem)
        if L.cluster_n == 1:
            err, per_sm = driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(func, L.num_threads, smem)
            return per_sm * num_sms if err == driver.CUresult.CUDA_SUCCESS and per_sm > 0 else fallback
        driver.cuFuncSetAttribute(func, attr.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)
        cfg = driver.CUlaunchConfig()
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = L.cluster_n, 1, 1
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = L.num_threads, 1, 1
        cfg.sharedMemBytes = smem
        cluster = driver.CUlaunchAttribute()
        cluster.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        cluster.value.clusterDim.x, cluster.value.clusterDim.y, cluster.value.clusterDim.z = L.cluster_n, 1, 1
        cfg.numAttrs, cfg.attrs = 1, [cluster]
        err, clusters = driver.cuOccupancyMaxActiveClusters(func, cfg)
        return clusters if err == driver.CUresult.CUDA_SUCCESS and clusters > 0 else fallback
    except Exception:
        return fallback


def realigned_row(mT: cute.Tensor, row, n: int, chunk: int):
    """(span, s, base): the chunk of whole vectors from the aligned element ``base`` at or before flat
    row ``row`` of n elements in the 1-D tensor mT, and the row's offset s within it. The start
    is rounded down as ``// 8 * 8`` and asserted a multiple of 8, so that the pointer's alignment
    (16 bytes) is known to the compiler and cp.async moves whole vectors."""
    start = Int64(row) * n
    base = cute.assume(start // 8 * 8, divby=8)
    span = cute.make_tensor(mT.iterator + base, cute.make_layout((1, chunk), stride=(chunk, 1)))
    return span, Int32(start - base), base


@cute.jit
def load_realigned(atom, srcs: tuple, flats: tuple, dsts: tuple, zero: cute.Tensor, tXcS: cute.Tensor,
                   base: Int64, s: Int32, n: cutlass.Constexpr, valid: Boolean):  # fmt: skip
    """load_tile for a realigned row: this thread's vectors of its span that hold some of the row,
    by cp.async; a vector past the tensor's end (the last row's last one) element by element."""
    if valid:
        vpt = cute.size(tXcS, mode=[2])
        per = cute.size(tXcS, mode=[0])
        end = flats[0].shape[0]
        for k in cutlass.range_constexpr(vpt):
            c = tXcS[0, 0, k][1]
            if c >= s + n:  # past the row: 0s (the stage may hold an earlier row there)
                for dst in dsts:
                    cute.autovec_copy(zero[None, None, k], dst[None, None, k])
            elif base + c + per <= end:
                for src, dst in zip(srcs, dsts):
                    cute.copy(atom, src[None, None, k], dst[None, None, k])
            else:
                for flat, dst in zip(flats, dsts):
                    for e in cutlass.range_constexpr(per):
                        at = base + tXcS[e, 0, k][1]
                        dst[e, 0, k] = dst.element_type(0.0)
                        if at < end:
                            dst[e, 0, k] = flat[at]
    else:
        for dst in dsts:
            cute.autovec_copy(zero, dst)
    cute.arch.cp_async_commit_group()


class NormBackward:
    """``residual``: add_rmsnorm's dresidual_out is given; it rides the ring beside x and dy and is
    added to dx in fp32, before dh's single rounding. The weight arrives in its own dtype."""

    def __init__(self, dtype, n: int, launch: Launch, layernorm: bool, residual: bool = False, realign: bool = False):
        self.dtype, self.n, self.launch, self.layernorm, self.residual = dtype, n, launch, layernorm, residual
        self.realign = realign  # row tensors (dy, x, dresidual_out, dx) as flat 1-D tensors of M rows of n
        self.op = "layernorm" if layernorm else "rmsnorm"
        elem = dtype.width // 8
        self.ring = backward_ring(launch, elem, self.op, residual)
        self.smem = shared_memory_bytes(launch, elem, self.op, "bwd", residual)

    @cute.jit
    def __call__(
        self,
        mDY: cute.Tensor,
        mX: cute.Tensor,
        mW: cute.Tensor,  # or None
        mRstd: cute.Tensor,
        mMean: cute.Tensor,  # or None
        mDR: cute.Tensor,  # dresidual_out, or None
        mDX: cute.Tensor,
        mDWp: cute.Tensor,  # fp32 (groups, N) partials of dweight, or None
        mDBp: cute.Tensor,  # same for dbias, or None
        groups: Int32,  # persistent CTAs (clusters) along grid x
        stream: cuda.CUstream,
    ):
        L = self.launch
        if const_expr(not self.realign):
            mDY, mX, mDR = as_rows(mDY), as_rows(mX), as_rows(mDR)
        self.kernel(mDY, mX, mW, mRstd, mMean, mDR, mDX, mDWp, mDBp,
                    _tiled_copy(self.dtype, L, async_copy=True), _tiled_copy(self.dtype, L)).launch(
            grid=[groups, L.cluster_n, 1],
            block=[L.num_threads, 1, 1],
            cluster=[1, L.cluster_n, 1] if const_expr(L.cluster_n > 1) else None,
            min_blocks_per_mp=self.ring.ctas_per_sm,
            preferred_smem_carveout=100,
            stream=stream,
        )

    @cute.kernel
    def kernel(self, mDY, mX, mW, mRstd, mMean, mDR, mDX, mDWp, mDBp,
               tiled_load: cute.TiledCopy, tiled_store: cute.TiledCopy):
        L = const_expr(self.launch)
        n = const_expr(self.n)
        S = const_expr(self.ring.stages)
        nvals = const_expr(2 if self.layernorm else 1)
        tiler = (L.rows_per_cta, L.chunk)
        tidx, _, _ = cute.arch.thread_idx()
        bidx, rank, _ = cute.arch.block_idx()
        groups, _, _ = cute.arch.grid_dim()
        if const_expr(L.cluster_n == 1):
            rank = 0

        # allocation order: shared_memory_bytes() mirrors it
        smem = cutlass.utils.SmemAllocator()
        ring = cute.make_ordered_layout((L.rows_per_cta, L.chunk, S), order=(1, 0, 2))
        sX = smem.allocate_tensor(self.dtype, ring, byte_alignment=16)
        sDY = smem.allocate_tensor(self.dtype, ring, byte_alignment=16)
        sDR = None
        if const_expr(self.residual):
            sDR = smem.allocate_tensor(self.dtype, ring, byte_alignment=16)
        # two reduction stages (row-iteration parity), nvals values each
        sbuf = smem.allocate_tensor(Float32, _reduction_buffer_layout(L, 2 * nvals), byte_alignment=16)
        sDB = None
        if const_expr(self.ring.dbias_in_smem):
            sDB = smem.allocate_tensor(Float32, cute.make_ordered_layout(tiler, order=(1, 0)), byte_alignment=16)
        sFold = None
        if const_expr(self.ring.fold_bytes > 0):
            sFold = smem.allocate_tensor(Float32, cute.make_ordered_layout(tiler, order=(1, 0)), byte_alignment=16)
        mbar = None
        if const_expr(L.cluster_n > 1):
            mbar = smem.allocate_array(Int64, num_elems=2)
            if tidx < 2:
                cute.arch.mbarrier_init(mbar + tidx, 1)
            cute.arch.mbarrier_init_fence()
            cute.arch.cluster_arrive_relaxed()

        M = cute.size(mRstd, mode=[0])
        num_tiles = cute.ceil_div(M, L.rows_per_cta)
        ld = tiled_load.get_slice(tidx)
        st = tiled_store.get_slice(tidx)
        tXsX = ld.partition_D(sX)  # (..., stage)
        tXsDY = ld.partition_D(sDY)
        sRing = (tXsX, tXsDY)
        if const_expr(self.residual):
            sRing = (tXsX, tXsDY, ld.partition_D(sDR))
        atom_load = _copy_atom(self.dtype, L.vec, async_copy=True)
        atom = _copy_atom(self.dtype, L.vec)
        if const_expr(self.realign):
            # flat rows: a row tile is a row (rows_per_cta == 1, no cluster); its span is cut where
            # it is used (realigned_row). tXcS: this thread's span columns; shift: where the row
            # starts in them, the same for every row this CTA takes (see "Rows of an odd width").
            flats = (mX, mDY, mDR) if const_expr(self.residual) else (mX, mDY)
            tXcS = ld.partition_S(cute.make_identity_tensor((1, L.chunk)))
            _, shift, _ = realigned_row(mX, bidx, n, L.chunk)
            in_row = None
            # Bit i: this thread's span element i is the row's: one register across the row loop,
            # not a flag (or a column) per element.
            keep = Int32(0)
            for i in cutlass.range_constexpr(cute.size(tXcS)):
                col = tXcS[i][1] - shift
                if col >= 0 and col < n:
                    keep = keep | (1 << i)
        else:
            tXgX = ld.partition_S(cute.local_tile(mX, tiler, (None, rank)))  # (..., tile)
            tXgDY = ld.partition_S(cute.local_tile(mDY, tiler, (None, rank)))
            tXgDX = st.partition_D(cute.local_tile(mDX, tiler, (None, rank)))
            tXcX = ld.partition_S(cute.local_tile(cute.make_identity_tensor((M, n)), tiler, (None, rank)))
            gRing = (tXgX, tXgDY)
            if const_expr(self.residual):
                gRing = (tXgX, tXgDY, ld.partition_S(cute.local_tile(mDR, tiler, (None, rank))))
            in_row = column_predicate(tXcX[None, None, None, 0], n)

        # Each thread reads back only the smem vectors its own cp.asyncs wrote, so the ring needs
        # no CTA barrier. Vectors past N are never written: zero them once, for every stage.
        zero = cute.make_rmem_tensor_like(tXsX[None, None, None, 0])
        zero.fill(0.0)
        for s in cutlass.range_constexpr(S):
            for tXs in sRing:
                cute.autovec_copy(zero, tXs[None, None, None, s])

        for s in cutlass.range_constexpr(S - 1):
            early = bidx + s * groups
            if const_expr(self.realign):
                self.load_row(atom_load, flats, tuple(t[None, None, None, s] for t in sRing), zero, tXcS, ld, early,
                              early < num_tiles)
            else:
                load_tile(atom_load, tuple(g[None, None, None, early] for g in gRing),
                          tuple(t[None, None, None, s] for t in sRing), zero, in_row,
                          early < num_tiles and tXcX[0, 0, 0, early][0] < M)

        rW = cute.make_rmem_tensor_like(zero, Float32)
        rW.fill(1.0)
        if const_expr(self.realign):
            if const_expr(mW is not None):
                rW = cute.make_rmem_tensor_like(zero, mW.element_type)
                rW.fill(0.0)  # the weight shifted into the span's columns (0 outside the row)
                for i in cutlass.range_constexpr(cute.size(tXcS)):
                    col = tXcS[i][1] - shift
                    if col >= 0 and col < n:
                        rW[i] = mW[col]
        elif const_expr(mW is not None):
            rW = load_weight(mW, L, st, tiler, rank, zero, in_row)
        rDW = cute.make_rmem_tensor_like(zero, Float32)
        rDW.fill(0.0)
        rDB = cute.make_rmem_tensor_like(zero, Float32)
        rDB.fill(0.0)
        tXsDB = None
        if const_expr(self.ring.dbias_in_smem):
            tXsDB = st.partition_D(sDB)
            cute.autovec_copy(rDB, tXsDB)
        rX = cute.make_rmem_tensor_like(zero)
        rDY = cute.make_rmem_tensor_like(zero)
        rDR = cute.make_rmem_tensor_like(zero) if const_expr(self.residual) else None
        rDX = cute.make_rmem_tensor_like(zero)
        if const_expr(L.cluster_n > 1):
            cute.arch.cluster_wait()

        inv_n = const_expr(1.0 / n)
        it = Int32(0)
        # A row's rstd (and mean) is loaded one iteration before its use: see "Backward" above.
        first = bidx if const_expr(self.realign) else tXcX[0, 0, 0, bidx][0]
        rstd_next, mean_next = load_row_stats(mRstd, mMean, first, M)
        for tile in cutlass.range(bidx, num_tiles, groups, unroll=1):
            ahead, ahead_stage = tile + (S - 1) * groups, (it + S - 1) % S
            if const_expr(self.realign):
                self.load_row(atom_load, flats, tuple(t[None, None, None, ahead_stage] for t in sRing), zero, tXcS, ld,
                              ahead, ahead < num_tiles)
                row = tile
                rstd, mean = rstd_next, mean_next
                rstd_next, mean_next = load_row_stats(mRstd, mMean, tile + groups, M)
            else:
                load_tile(atom_load, tuple(g[None, None, None, ahead] for g in gRing),
                          tuple(t[None, None, None, ahead_stage] for t in sRing), zero, in_row,
                          ahead < num_tiles and tXcX[0, 0, 0, ahead][0] < M)
                row = tXcX[0, 0, 0, tile][0]
                rstd, mean = rstd_next, mean_next
                rstd_next, mean_next = load_row_stats(mRstd, mMean, tXcX[0, 0, 0, tile + groups][0], M)
            cute.arch.cp_async_wait_group(S - 1)
            stage = it % S
            if const_expr(self.realign):
                self.clear_neighbours(tuple(t[None, None, None, stage] for t in sRing), tXcS, keep)
            # Pass 1: the row sums. x and dy are read from shared memory again in pass 2 rather
            # than kept live across the reduction: that keeps the fp32 accumulators in registers.
            cute.autovec_copy(tXsX[None, None, None, stage], rX)
            cute.autovec_copy(tXsDY[None, None, None, stage], rDY)
            x, dy = rX.load().to(Float32), rDY.load().to(Float32)
            xhat = (x - mean) * rstd if const_expr(self.layernorm) else x * rstd
            g = dy * rW.load().to(Float32)
            partials = ((xhat * g).reduce(cute.ReductionOp.ADD, Float32(0.0), 0),)
            if const_expr(self.layernorm):
                partials = (partials[0], g.reduce(cute.ReductionOp.ADD, Float32(0.0), 0))
            parity = it % 2
            sums = row_allreduce(partials, L, sbuf, parity * nvals,
                                 mbar + parity if const_expr(mbar is not None) else None, (it // 2) % 2)
            c1 = sums[0] * inv_n
            c2 = sums[1] * inv_n if const_expr(self.layernorm) else Float32(0.0)
            # Pass 2: dx, and this row's share of dweight / dbias.
            cute.autovec_copy(tXsX[None, None, None, stage], rX)
            cute.autovec_copy(tXsDY[None, None, None, stage], rDY)
            x, dy = rX.load().to(Float32), rDY.load().to(Float32)
            xhat = (x - mean) * rstd if const_expr(self.layernorm) else x * rstd
            g = dy * rW.load().to(Float32)
            if const_expr(self.layernorm):
                dx = (g - xhat * c1 - c2) * rstd
            else:
                dx = (g - xhat * c1) * rstd
            if const_expr(self.residual):
                cute.autovec_copy(sRing[2][None, None, None, stage], rDR)
                dx = dx + rDR.load().to(Float32)
            rDX.store(dx.to(self.dtype))
            if row < M:
                if const_expr(self.realign):
                    self.store_row(atom, rDX, mDX, st, tXcS, row, keep)
                else:
                    cute.copy(atom, rDX, tXgDX[None, None, None, tile], pred=in_row)
            if const_expr(mDWp is not None):
                rDW.store(rDW.load() + dy * xhat)
            if const_expr(mDBp is not None):
                if const_expr(self.ring.dbias_in_smem):
                    cute.autovec_copy(tXsDB, rDB)
                rDB.store(rDB.load() + dy)
                if const_expr(self.ring.dbias_in_smem):
                    cute.autovec_copy(rDB, tXsDB)
            it += 1

        # One partial row per CTA (its share of the row in a cluster): every column < N is written.
        if const_expr(self.ring.dbias_in_smem):
            cute.autovec_copy(tXsDB, rDB)
        for acc, mP in ((rDW, mDWp), (rDB, mDBp)):
            if const_expr(mP is not None):
                if const_expr(self.realign):
                    for i in cutlass.range_constexpr(cute.size(tXcS)):
                        col = tXcS[i][1] - shift
                        if col >= 0 and col < n:
                            mP[bidx, col] = acc[i]
                elif const_expr(sFold is not None):
                    # Several short rows per CTA: their accumulators are added in shared memory, in
                    # row order (deterministic), one column per thread. With a slot per row, SlotSum,
                    # whose CTAs are few on a short row (4 at N = 128), read 4-32x more partials
                    # than there are CTAs, latency bound (docs/kernels/cute.md).
                    cute.autovec_copy(acc, st.partition_D(sFold))
                    cute.arch.barrier()
                    for c in cutlass.range(tidx, L.chunk, L.num_threads, unroll=1):
                        total = Float32(0.0)
                        for r in cutlass.range_constexpr(L.rows_per_cta):
                            total += sFold[r, c]
                        if c < n:
                            mP[bidx, c] = total
                    cute.arch.barrier()
                else:
                    tPgP = st.partition_D(cute.local_tile(mP, (1, L.chunk), (bidx, rank)))
                    for k in cutlass.range_constexpr(L.vecs_per_thread):
                        if in_row[0, 0, k]:
                            cute.autovec_copy(acc[None, None, k], tPgP[None, None, k])


    @cute.jit
    def load_row(self, atom, flats: tuple, dsts: tuple, zero: cute.Tensor, tXcS: cute.Tensor, ld, row: Int32,
                 valid: Boolean):  # fmt: skip
        """One ring stage of a realigned row (load_realigned), row < M or zero-filled."""
        srcs, base = [], Int64(0)
        for flat in flats:
            span, _, base = realigned_row(flat, row, self.n, self.launch.chunk)
            srcs.append(ld.partition_S(span))
        load_realigned(atom, tuple(srcs), flats, dsts, zero, tXcS, base, Int32(Int64(row) * self.n - base),
                       self.n, valid)  # fmt: skip

    @cute.jit
    def clear_neighbours(self, stage: tuple, tXcS: cute.Tensor, keep: Int32):
        """A realigned row's first and last vector also hold its neighbours' elements: 0 in the
        staged copy, once the row has landed, so that no arithmetic sees them (an inf beside the
        row cannot reach it) and dx, dweight and dbias get nothing from them. Only the threads
        holding those two vectors do anything; each clears its own vectors, so no barrier."""
        per = cute.size(tXcS, mode=[0])
        full = (1 << per) - 1
        for k in cutlass.range_constexpr(cute.size(tXcS, mode=[2])):
            if (keep >> (per * k)) & full != full:
                for e in cutlass.range_constexpr(per):
                    if (keep >> (per * k + e)) & 1 == 0:
                        for t in stage:
                            t[e, 0, k] = t.element_type(0.0)

    @cute.jit
    def store_row(self, atom, rDX: cute.Tensor, mDX: cute.Tensor, st, tXcS: cute.Tensor, row: Int32,
                  keep: Int32):  # fmt: skip
        """dx of a realigned row: whole vectors inside the row at once, its first and last vector
        element by element (their other elements belong to the neighbouring rows)."""
        span, _, _ = realigned_row(mDX, row, self.n, self.launch.chunk)
        tXgDX = st.partition_D(span)
        per = cute.size(tXcS, mode=[0])
        full = (1 << per) - 1
        for k in cutlass.range_constexpr(cute.size(tXcS, mode=[2])):
            bits = (keep >> (per * k)) & full
            if bits == full:
                cute.copy(atom, rDX[None, None, k], tXgDX[None, None, k])
            elif bits != 0:
                for e in cutlass.range_constexpr(per):
                    if (bits >> e) & 1 != 0:
                        tXgDX[e, 0, k] = rDX[e, 0, k]


# ============================================================================ dweight / dbias
class SlotSum:
    """out[c] = sum over slots s of P[s, c], in fp32, rounded once to out's dtype: the backward's
    partial rows of dweight (and dbias, the same launch along grid y) summed over its CTAs.

    torch's ``P.sum(0).to(dtype)`` took a large share of the backward's time: two kernels per
    parameter, each slow on these short, wide matrices. Here one launch sums both: a CTA holds
    ``lanes`` columns of vectors and spreads the slots over ``slot_threads`` threads (each adds its
    slots in order, four loads in flight), then adds the threads' sums in a fixed order through
    shared memory: deterministic, like the rest."""

    THREADS = 512

    def __init__(self, n: int, vec: int, slot_threads: int):
        self.n, self.vec, self.slot_threads = n, vec, slot_threads
        self.lanes = self.THREADS // slot_threads
        self.cols = self.lanes * vec  # columns per CTA

    @cute.jit
    def __call__(self, mP0: cute.Tensor, mO0: cute.Tensor, mP1: cute.Tensor, mO1: cute.Tensor, stream: cuda.CUstream):
        self.kernel(mP0, mO0, mP1, mO1).launch(
            grid=[cute.ceil_div(self.n, self.cols), 1 if const_expr(mP1 is None) else 2, 1],
            block=[self.THREADS, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(self, mP0, mO0, mP1, mO1):
        _, which, _ = cute.arch.block_idx()
        smem = cutlass.utils.SmemAllocator()
        sAcc = smem.allocate_tensor(Float32, cute.make_ordered_layout((self.slot_threads, self.cols), order=(1, 0)),
                                    byte_alignment=16)
        if const_expr(mP1 is None):
            self.column_sum(mP0, mO0, sAcc)
        elif which == 0:
            self.column_sum(mP0, mO0, sAcc)
        else:
            self.column_sum(mP1, mO1, sAcc)

    @cute.jit
    def column_sum(self, mP: cute.Tensor, mO: cute.Tensor, sAcc: cute.Tensor):
        vec, lanes = const_expr(self.vec), const_expr(self.lanes)
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane, r = tidx % lanes, tidx // lanes
        col_vec = bidx * lanes + lane
        acc = cute.make_rmem_tensor(cute.make_layout((1, vec)), Float32)
        acc.fill(0.0)
        part = cute.make_rmem_tensor(cute.make_layout((1, vec)), Float32)
        atom = _copy_atom(Float32, vec)
        if col_vec * vec < self.n:
            for s in cutlass.range(r, mP.shape[0], self.slot_threads, unroll=4):
                cute.copy(atom, cute.local_tile(mP, (1, vec), (s, col_vec)), part)
                acc.store(acc.load() + part.load())
        for j in cutlass.range_constexpr(vec):
            sAcc[r, lane * vec + j] = acc[0, j]
        cute.arch.barrier()
        if tidx < self.cols:
            col = bidx * self.cols + tidx
            total = Float32(0.0)
            for i in cutlass.range(self.slot_threads, unroll_full=True):
                total += sAcc[i, tidx]
            if col < self.n:
                mO[col] = total.to(mO.element_type)


# ============================================================================ compile cache
COMPILE_SECONDS: dict[tuple, float] = {}  # key -> seconds spent compiling it
_COMPILED: dict[tuple, object] = {}
_RESIDENT: dict[tuple, int] = {}  # backward key -> CTAs (clusters) resident at once: the grid


def _fake(dtype, shape, vec: int):
    """A symbolic tensor: rows of a symbolic stride that is a multiple of vec, the base pointer
    aligned to one vector (vector_width checks both)."""
    stride = (cute.sym_int64(divisibility=vec), 1) if len(shape) == 2 else (1,)
    return cute.runtime.make_fake_tensor(dtype, shape, stride=stride, assumed_align=vec * dtype.width // 8)


def _fake_rows(dtype, m, n: int, vec: int, heads: int = 0, tokens=None):
    """A symbolic row tensor: (M, N) rows, or with ``heads`` a (T, H, N) per-head view, H static
    (the tile's fit to the heads is decided when compiling), T and both strides symbolic, the
    strides multiples of vec."""
    if not heads:
        return _fake(dtype, (m, n), vec)
    stride = (cute.sym_int64(divisibility=vec), cute.sym_int64(divisibility=vec), 1)
    return cute.runtime.make_fake_tensor(dtype, (tokens, heads, n), stride=stride, assumed_align=vec * dtype.width // 8)


@lru_cache(maxsize=None)
def kernel_key(op: str, direction: str, dtype: torch.dtype, n: int, vec: int, wdtype: torch.dtype | None,
               bdtype: torch.dtype | None = None, residual: bool = False, few_rows: bool = False, heads: int = 0,
               views: tuple[bool, ...] = (), rows: int = 0, realign: bool = False) -> tuple:  # fmt: skip
    """The compile cache's key. ``wdtype`` / ``bdtype``: the weight's / bias's dtype (None: absent).
    ``residual``: add_rmsnorm's dresidual_out is given (backward; the forward always has its
    residual). ``heads``: H of the (T, H, N) per-head views among the row tensors (0: none), and
    ``views`` which row tensors are such views, in the kernel's order (forward: x, residual;
    backward: dy, x, dresidual_out); ``rows``: a cap on rows per CTA (``view_rows``); ``realign``: a
    backward of realigned rows (``realigned_launch``: its launch covers the span, vec is 8). The launch
    shape stands for ``few_rows`` and ``rows``, so that a call whose launch is the usual one shares
    its kernel. The launch is checked here (ValueError), before any compile or launch. Cached: the
    contract calls it on every call."""
    if op == "add_rmsnorm":  # the forward always reads a residual; the backward is RMSNorm's (+ dresidual_out)
        op, residual = ("add_rmsnorm", True) if direction == "fwd" else ("rmsnorm", residual)
    if realign:
        launch = realigned_launch(n, dtype.itemsize, op, residual)
        if launch is None or direction != "bwd" or heads:
            raise ValueError(f"impls.cute: rows of {n} {dtype} are not read realigned ({op} {direction})")
        return (op, direction, dtype, n, launch.vec, wdtype, bdtype, residual, 0, (), True, launch)
    launch, _ = planned_launch(n, dtype.itemsize, vec, direction, op, few_rows, residual, rows)
    return (op, direction, dtype, n, vec, wdtype, bdtype, residual, heads, views if heads else (), False, launch)


def compile_kernel(key: tuple):
    """The compiled kernel for this key (compiled once; a new M reuses it, except that a forward
    whose launch shape differs for few rows has a second variant for them)."""
    if key in _COMPILED:
        return _COMPILED[key]
    t0 = time.perf_counter()
    op, direction, dtype, n, vec, wdtype, bdtype, residual, heads, views, realign, launch = key
    cdt = _TORCH2CUTE[dtype]
    layer = op == "layernorm"
    m, tokens, flat = cute.sym_int(), cute.sym_int(), cute.sym_int64()

    def rows(i: int):  # the i-th row tensor the kernel reads (views' order); realigned: flat, 16-byte aligned
        if realign:
            return cute.runtime.make_fake_tensor(cdt, (flat,), stride=(1,), assumed_align=16)
        return _fake_rows(cdt, m, n, vec, heads if heads and views[i] else 0, tokens)

    w = _fake(_TORCH2CUTE[wdtype], (n,), 1 if realign else vec) if wdtype is not None else None
    rstd = _fake(Float32, (m,), 1)
    mean = _fake(Float32, (m,), 1) if layer else None
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=_HAS_TVM_FFI)
    options = "--enable-tvm-ffi" if _HAS_TVM_FFI else ""
    if direction == "fwd":
        b = _fake(_TORCH2CUTE[bdtype], (n,), vec) if bdtype is not None else None
        res = rows(1) if residual else None
        h = _fake(cdt, (m, n), vec) if residual else None
        kernel = NormForward(cdt, n, launch, layer, residual)
        fn = cute.compile(kernel, rows(0), res, w, b, _fake(cdt, (m, n), vec), h, rstd, mean, Float32(0.0), stream,
                          options=options)
    else:
        slots = cute.sym_int()
        pdiv = math.gcd(n, 4)
        dwp = _fake(Float32, (slots, n), pdiv) if wdtype is not None else None
        dbp = _fake(Float32, (slots, n), pdiv) if layer else None
        dres = rows(2) if residual else None
        kernel = NormBackward(cdt, n, launch, layer, residual, realign)
        dx = rows(0) if realign else _fake(cdt, (m, n), vec)
        # keep the cubin (max_resident() asks the driver about it) and the PTX (the tests read its vectors)
        with tempfile.TemporaryDirectory() as dump:
            fn = cute.compile(kernel, rows(0), rows(1), w, rstd, mean, dres, dx,
                              dwp, dbp, Int32(1), stream, options=f"{options} --keep-cubin --keep-ptx --dump-dir={dump}")
    COMPILE_SECONDS[key] = time.perf_counter() - t0
    _COMPILED[key] = (fn, kernel)
    return _COMPILED[key]


@lru_cache(maxsize=None)
def compile_slot_sum(n: int, pdtype: torch.dtype, with_bias: bool, threads_per_column: int):
    """SlotSum for (slots, n) fp32 partials -> (n,) of the parameter's dtype; slots symbolic."""
    t0 = time.perf_counter()
    vec = math.gcd(n, 4)
    slots = cute.sym_int()
    p = _fake(Float32, (slots, n), vec)
    o = cute.runtime.make_fake_tensor(_TORCH2CUTE[pdtype], (n,), stride=(1,))
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=_HAS_TVM_FFI)
    kernel = SlotSum(n, vec, threads_per_column)
    fn = cute.compile(kernel, p, o, p if with_bias else None, o if with_bias else None, stream,
                      options="--enable-tvm-ffi" if _HAS_TVM_FFI else "")
    COMPILE_SECONDS[("slot_sum", n, pdtype, with_bias, threads_per_column)] = time.perf_counter() - t0
    return fn


def compile_only(op: str, direction: str, dtype: torch.dtype, n: int, vec: int | None = None,
                 wdtype: torch.dtype | None | str = "x", residual: bool = False, few_rows: bool = False,
                 heads: int = 0, views: tuple[bool, ...] | None = None, rows: int = 0,
                 realign: bool = False) -> float:  # fmt: skip
    """Compile one variant without a GPU (set CUTE_DSL_ARCH=sm_90a); returns compile seconds.
    ``wdtype``: the weight's dtype, "x" for x's own, None for no affine (the LayerNorm forward's
    bias takes the weight's). ``heads``: row tensors as (T, H, N) per-head views, by default those
    a per-head call passes as such (x and the residual; in the backward x, dy coming contiguous);
    ``rows``: a cap on rows per CTA (``view_rows``); ``realign``: the backward of realigned rows."""
    vec = vec or math.gcd(n, 16 // dtype.itemsize)
    wdtype = dtype if wdtype == "x" else wdtype
    bdtype = wdtype if op == "layernorm" and direction == "fwd" else None
    if views is None:
        views = (True, op == "add_rmsnorm") if direction == "fwd" else (False, True, False)
    key = kernel_key(op, direction, dtype, n, vec, wdtype, bdtype, residual, few_rows, heads, views, rows, realign)
    compile_kernel(key)
    return COMPILE_SECONDS[key]


# ============================================================================ the contract
@lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _check_call(m: int):
    if not _HAS_TVM_FFI:
        raise RuntimeError("impls.cute calls its kernels through TVM-FFI: pip install apache-tvm-ffi")
    if m > MAX_ROWS:
        raise ValueError(f"impls.cute: {m} rows; the kernels take M as a 32-bit integer (at most {MAX_ROWS})")


def _dtype(t):
    return None if t is None else t.dtype


def _flat(t, n: int):
    """(M, N) rows where a view of them exists (the contract's ``has_no_row_view`` is false: T or H
    of 1, or a token stride of H head strides), else the tensor as it is."""
    if t is None or t.dim() == 2 or has_no_row_view(t):
        return t
    return t.view(-1, n)


def _planned(key_of, rows: tuple, n: int) -> tuple:
    """(compile key, row tensors as launched) of a call's row tensors (None where absent): (M, N)
    rows as they are, (T, H, N) per-head views in place with the rows per CTA ``view_rows`` gives,
    copied to (M, N) rows where it gives none. ``key_of(rows, heads, views, cap)`` is the call's
    kernel_key."""
    rows = tuple(_flat(t, n) for t in rows)
    views = tuple(t is not None and t.dim() == 3 for t in rows)
    if not any(views):
        return key_of(rows, 0, (), 0), rows
    heads = next(t.shape[1] for t in rows if t is not None and t.dim() == 3)
    key = key_of(rows, heads, views, 0)
    cap = view_rows(key[-1], heads)
    if cap == key[-1].rows_per_cta:
        return key, rows
    if cap:
        return key_of(rows, heads, views, cap), rows
    rows = tuple(t if t is None or t.dim() == 2 else t.reshape(-1, n) for t in rows)
    return key_of(rows, 0, (), 0), rows


# False: odd-width rows take the element-wise backward as before (the comparison behind
# docs/kernels/cute.md, tools/experiments/cute-odd-rows/).
REALIGN_BACKWARD = True


def _realigned(rows: tuple, n: int, op: str) -> tuple:
    """The backward's row tensors (dy, x, dresidual_out, dx) as flat 1-D views where the realigned
    kernel takes them (``realigned_launch``: 16-bit rows of an odd width, one row per CTA), else ():
    every one (M, N) rows of stride N, or a (T, H, N) view of such rows, from a 16-byte aligned
    start."""
    first = rows[1]
    if n % 8 == 0 or first.element_size() != 2 or not first.numel() or not REALIGN_BACKWARD:  # (common case first)
        return ()
    flat = []
    for t in rows:
        if t is None:
            flat.append(None)
            continue
        if not t.is_contiguous() or t.data_ptr() % 16:
            return ()
        flat.append(t.view(-1))
    if realigned_launch(n, 2, op, rows[2] is not None) is None:
        return ()
    return tuple(flat)


def _forward(op, x, residual, weight, bias, eps):
    n = x.shape[-1]
    m = x.numel() // n
    _check_call(m)
    y = x.new_empty((m, n))
    h = x.new_empty((m, n)) if residual is not None else None
    rstd = x.new_empty(m, dtype=torch.float32)
    mean = x.new_empty(m, dtype=torch.float32) if op == "layernorm" else None
    others = tuple(t for t in (y, h, weight, bias) if t is not None)
    few_rows = m <= _num_sms(x.device.index or 0)
    dtype, wdtype, bdtype, fused = x.dtype, _dtype(weight), _dtype(bias), residual is not None

    def key_of(rows, heads, views, cap):
        vec = vector_width(n, dtype, *(t for t in rows if t is not None), *others)
        return kernel_key(op, "fwd", dtype, n, vec, wdtype, bdtype, fused, few_rows, heads, views, cap)

    key, (x, residual) = _planned(key_of, (x, residual), n)
    fn, _ = compile_kernel(key)
    fn(x, residual, weight, bias, y, h, rstd, mean, eps)
    return y, h, mean, rstd


def _backward(op, dy, x, weight, rstd, mean, dresidual=None):
    n = x.shape[-1]
    m = x.numel() // n
    _check_call(m)
    dx = x.new_empty((m, n))
    others = tuple(t for t in (dx, weight) if t is not None)
    dtype, wdtype, fused = x.dtype, _dtype(weight), dresidual is not None

    def key_of(rows, heads, views, cap):
        vec = vector_width(n, dtype, *(t for t in rows if t is not None), *others)
        return kernel_key(op, "bwd", dtype, n, vec, wdtype, None, fused, False, heads, views, cap)

    rows = _realigned((dy, x, dresidual, dx), n, op)
    if rows:
        key = kernel_key(op, "bwd", dtype, n, 0, wdtype, None, fused, realign=True)
        dy, x, dresidual = rows[:3]
    else:
        key, (dy, x, dresidual) = _planned(key_of, (dy, x, dresidual), n)
    fn, kernel = compile_kernel(key)
    launch = kernel.launch
    if key not in _RESIDENT:
        _RESIDENT[key] = max_resident(fn, kernel, _num_sms(x.device.index or 0))
    groups = max(1, min(_cdiv(m, launch.rows_per_cta), _RESIDENT[key]))
    if rows and groups < m:  # every row of a CTA at the same offset within a vector
        groups = max(8, groups // 8 * 8)
    slots = groups  # one partial row per CTA (cluster): a CTA of several rows folds them
    dwp = x.new_empty((slots, n), dtype=torch.float32) if weight is not None else None
    dbp = x.new_empty((slots, n), dtype=torch.float32) if op == "layernorm" else None
    fn(dy, x, weight, rstd, mean, dresidual, rows[3] if rows else dx, dwp, dbp, groups)
    # reduced in fp32 over the slots, then rounded once to the parameter's dtype (x's or fp32)
    pdtype = x.dtype if weight is None else weight.dtype
    dw = x.new_empty(n, dtype=pdtype) if dwp is not None else None
    db = x.new_empty(n, dtype=pdtype) if dbp is not None else None
    pairs = [(p, out) for p, out in ((dwp, dw), (dbp, db)) if p is not None]
    if pairs:  # one launch for both: (partials, result) once or twice
        (p0, out0), (p1, out1) = pairs[0], (pairs[1] if len(pairs) == 2 else (None, None))
        compile_slot_sum(n, pdtype, p1 is not None, slot_threads(slots))(p0, out0, p1, out1)
    return dx, dw, db


def rmsnorm_fwd(x, weight, eps):
    y, _, _, rstd = _forward("rmsnorm", x, None, weight, None, eps)
    return y, rstd


def rmsnorm_bwd(dy, x, weight, rstd):
    dx, dw, _ = _backward("rmsnorm", dy, x, weight, rstd, None)
    return dx, dw


def layernorm_fwd(x, weight, bias, eps):
    y, _, mean, rstd = _forward("layernorm", x, None, weight, bias, eps)
    return y, mean, rstd


def layernorm_bwd(dy, x, weight, mean, rstd):
    return _backward("layernorm", dy, x, weight, rstd, mean)


def add_rmsnorm_fwd(x, residual, weight, eps):
    y, h, _, rstd = _forward("add_rmsnorm", x, residual, weight, None, eps)
    return y, h, rstd


def add_rmsnorm_bwd(dy, dresidual_out, residual_out, weight, rstd):
    """The RMSNorm backward kernel on residual_out, dresidual_out added before dh is rounded."""
    dh, dw, _ = _backward("rmsnorm", dy, residual_out, weight, rstd, None, dresidual_out)
    return dh, dw
