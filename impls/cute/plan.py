"""Launch planning for the CuTe DSL kernels (``kernels.py``): how a row is spread over vectors,
threads, CTAs and clusters, how many backward CTAs share an SM and how deep their shared-memory
ring is, and the shared memory of each launch. Pure Python (torch only for strides and pointers),
so every launch shape is checked without a GPU or CUTLASS.

    chunk        = vec * threads_per_row * vecs_per_thread     columns one CTA covers
    cluster_n * chunk >= N                                      one cluster covers a row
    rows_per_cta = num_threads / threads_per_row                (1 in a cluster)
    smem         = the kernel's buffers in allocation order, 16-byte aligned, + mbarriers

Vectors: ``vec`` is 128 bits (8 bf16/fp16, 4 fp32) when N, the row strides and every pointer
allow it, narrower otherwise (``vector_width``): the widest global access there is.

Work split: a row is cut into ``cluster_n`` column chunks, one per CTA of a thread-block cluster;
inside a CTA, ``threads_per_row`` threads share a row and each holds ``vecs_per_thread`` vectors,
strided by ``vec * threads_per_row`` so that a warp's accesses are contiguous. Rows up to 32 KB
stay in one CTA (several rows per CTA when they are short); wider rows go to a cluster (up to 16
CTAs, 32 KB per CTA), so every row is read from DRAM exactly once at every N up to 262144, and
beyond until a CTA's share outgrows shared memory (the narrowest reach: the LayerNorm backward,
fp32 rows of about 295000 and 16-bit ones of about 430000; wider rows get a ValueError). The
backward of LayerNorm and of the fused add takes at most 8192 columns per CTA (16 KB of a 16-bit
row) in clusters of up to 8 (``_BWD_MAX_COLUMNS``), so that each CTA keeps its accumulators in
registers and a deeper ring.

Valid by construction: ``planned_launch`` computes each kernel's launch shape and its exact shared
memory (``shared_memory_bytes`` mirrors the kernels' allocation order; a test compares it with what
the compiler computed) and ``check_launch`` refuses, with a ValueError before anything is compiled,
a shape Hopper would reject at launch (threads per CTA, warps, cluster of at most 16 with one row,
the row covered, shared memory <= 227 KB): the driver only rejects those when launching.

Whole warps, not always a power of two: a cluster's thread count is whole warps, since a power of
two could leave the cluster's last CTA empty just past a power-of-two width, which used to halve
the cluster and double the shared memory (``launch_shape``). In the backward, whole warps likewise
keep the threads of a non-power-of-two row from idling on padding.

The backward's ring (``backward_ring``): the CTAs per SM are promised to ptxas (min blocks per SM),
which caps the registers so that many CTAs really are resident, and the stages take what shared
memory is left, at most 4. fp32 at N = 262144 fits one stage only (128 KB per CTA): correct, but
its loads do not overlap.

Measurements behind these choices: docs/kernels/cute.md.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import lru_cache

import torch

# Hopper's limits on one launch. Dynamic shared memory above SMEM_LIMIT is not a compile error: the
# driver rejects the launch (CUDA_ERROR_INVALID_VALUE, the DSL's CUDA_LAUNCH_INVALID_CONFIG), so
# every launch shape is checked against these before it is compiled (check_launch).
SMEM_LIMIT = 227 * 1024  # per CTA
MAX_THREADS = 1024  # per CTA
MAX_CLUSTER = 16  # CTAs per cluster: 8 portable, 16 with the non-portable attribute (the DSL sets it)
MAX_ROWS = 2**31 - 1  # M is a 32-bit kernel argument; the forward's grid x is ceil(M / rows per CTA)
# Shared memory budget of one CTA's backward ring (the rest is headroom for the reduction buffers).
_SMEM_BUDGET = 200 * 1024
# A CTA holds at most this many bytes of one row; wider rows are split across a cluster.
_MAX_CHUNK_BYTES = 32 * 1024
# The backward of LayerNorm and of the fused add takes at most this many columns per CTA, in a
# cluster of up to 8: its 512-thread CTA then carries 16 fp32 dweight accumulators per thread
# (LayerNorm's dbias beside them in registers, not shared memory) and, in 16-bit types, a ring of
# 4 stages instead of 2: more rows in flight for the two backwards that lacked them most. Not
# taken where it would need 16 CTAs, where it lost, nor for fp32 rows, which stay at 8192 columns
# per 32 KB (fewer columns lost). Plain RMSNorm keeps 32 KB: 16 KB lost on its wide rows. The
# halving only pays since the rstd/mean prefetch: before it, every row waited on its statistics
# and on the exchange between the CTAs in turn, and halving lost.
_BWD_MAX_COLUMNS = {"layernorm": 8192, "add_rmsnorm": 8192}
_BWD_MAX_HALVED_CLUSTER = 8
# Threads of persistent backward CTAs per SM (backward_ring): 512 at 128 registers each. More
# (768) lost on short rows.
_BWD_THREADS_PER_SM = 512
# ... except that a CTA count is rounded up (3 CTAs of 192 threads, not 2) where the registers still
# fit without spilling, 102 or more each: the extra CTA paid on LayerNorm's short rows. Not the
# fused add's: its three-tensor ring then loses a stage, which cost more than the CTA gave.
_BWD_ROUNDED_UP_THREADS_MAX = 640
# The LayerNorm backward carries two fp32 accumulators (dweight, dbias) per column: beyond 16 KB of
# row per 512-thread CTA both no longer fit in 128 registers (ptxas spilled), so dbias moves to
# shared memory there. Before the rstd/mean prefetch that beat halving the chunk (a cluster twice
# as large). Since, 16-bit rows halve instead up to a cluster of 8 (_BWD_MAX_COLUMNS), so shared
# memory takes dbias for fp32 chunks over 4096 columns and for 16-bit rows past that cap's reach
# (N > 65536).
_DBIAS_SMEM_ABOVE_BYTES = 16 * 1024
# Most ring stages of the backward. More stages keep more rows in flight, but measured they did not
# pay: 6 to 8 stages lost on RMSNorm and left the fused add and LayerNorm where they were.
_MAX_STAGES = 4
# The fused add's ring (x, dy and dresidual_out) at 4 CTAs per SM (16-bit N <= 2048): 3 stages ran
# clearly faster than 4 there. Not understood, and not general: RMSNorm's two-tensor ring there
# gained nothing from 3, LayerNorm's lost, so they keep 4.
_RESIDUAL_STAGES_AT_4_CTAS = 3
_REGISTERS_PER_SM = 65536
# The realigned backward (rows of an odd width) promises ptxas this many registers per thread:
# uncapped it takes 8-85 more than the kernel of aligned rows (the span's addresses, the row's
# elements among the span's), and under the ring's usual cap of 96 it spills its accumulators
# (LayerNorm at N = 2999 and 5003: 220 bytes a thread, 63-64% of copy bandwidth, 89 and 83% with
# 128; reports/experiments/cute-odd-rows/). 168 lost
# instead at 4001, where it left one CTA per SM (RMSNorm 94 -> 83%).
REALIGNED_MIN_REGISTERS = 128
# Target vectors per thread: 64 B of x in 16-bit types in the forward, enough loads in flight; half
# that in the backward, whose thread also carries fp32 dweight / dbias accumulators (registers).
_VECS_PER_THREAD = {"fwd": 4, "bwd": 2}
# Forward rows of at least this many bytes per CTA are staged in shared memory (Launch.stage_x).
# add_rmsnorm is RMSNorm with a residual row staged beside x.
_STAGE_X_BYTES = {"rmsnorm": 32 * 1024, "add_rmsnorm": 32 * 1024, "layernorm": 10 * 1024}
_STAGED_VECS_PER_THREAD = 8
# Staged 256-thread CTAs per SM promised to ptxas, which caps the registers to match: 4 x 64 for
# RMSNorm (its natural count; more headroom only made ptxas take 78), 3 x 80 for LayerNorm (83-89
# uncapped: 2 CTAs per SM; capped, ptxas spills 8-32 B per thread). 128-thread staged CTAs (rows of
# 10-16 KB) fit 5-7 per SM uncapped; a cap there only made ptxas spill. add_rmsnorm stages two rows
# (x and the residual: 64 KB per CTA), so shared memory allows 3 CTAs, enough once the add went one
# vector at a time (add_residual_staged).
_STAGED_CTAS_PER_SM = {"rmsnorm": 4, "add_rmsnorm": 3, "layernorm": 3}
# The LayerNorm forward over a cluster (Launch.one_exchange) takes 38-40 registers uncapped; 6 CTAs
# is what its 32 KB of shared memory per CTA allows, so this cap only keeps a later change from
# silently costing CTAs.
_ONE_EXCHANGE_CTAS_PER_SM = 6


# ============================================================================ launch shape
@dataclass(frozen=True)
class Launch:
    """How one row is spread over threads and CTAs (static: part of the compiled kernel)."""

    vec: int  # elements per vector access
    threads_per_row: int
    num_threads: int
    cluster_n: int  # CTAs per row (a cluster along grid y)
    vecs_per_thread: int
    # Forward only: x goes global -> shared memory by cp.async and is re-read from there for every
    # pass, so no register holds a row across a reduction; registers then no longer cap the CTAs
    # resident per SM (the bytes in flight), shared memory does.
    stage_x: bool = False
    late_weights: bool = False  # forward only: load weight / bias after the reductions
    # LayerNorm forward over a cluster only: one (count, mean, M2) exchange between the CTAs instead
    # of two sums, and y written one vector at a time (40 registers instead of 80: 6 CTAs per SM
    # instead of 3). On a row held by one CTA this lost: the weight and bias loads, one vector at a
    # time, wait on L2 one after another. On short register-resident rows the merges' divisions
    # cost more still.
    one_exchange: bool = False
    # Backward only: promise ptxas at least this many registers per thread (fewer CTAs per SM where
    # the ring would promise fewer; 0: the ring's count). The realigned backward needs more
    # registers than the kernel of aligned rows (``REALIGNED_MIN_REGISTERS``).
    min_registers: int = 0

    @property
    def rows_per_cta(self) -> int:
        return self.num_threads // self.threads_per_row

    @property
    def chunk(self) -> int:
        """Columns one CTA covers (its tile may run past N: those columns are predicated off)."""
        return self.vec * self.threads_per_row * self.vecs_per_thread

    @property
    def warps_per_row(self) -> int:
        return max(self.threads_per_row // 32, 1)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2_at_least(v: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, v))))


def _leaves_a_cta_empty(n_vecs: int, cluster_n: int, tpr: int, vpt: int) -> bool:
    return cluster_n > 1 and (cluster_n - 1) * tpr * vpt >= n_vecs


def launch_shape(n: int, elem_bytes: int, vec: int, direction: str = "fwd", op: str = "rmsnorm", few_rows: bool = False,
                 residual: bool = False, rows: int = 0) -> Launch:  # fmt: skip
    """``residual``: the fused add's backward (RMSNorm's, with dresidual_out in the ring).
    ``few_rows``: no more rows than SMs. Staging a row held by one CTA only pays by fitting more
    CTAs per SM; with a CTA per SM at most it is a shared-memory round trip for nothing.
    ``rows``: at most this many rows per CTA (0: no cap), for a per-head view whose heads the
    usual tile does not divide (``view_rows``).

    Cluster peers should each get a non-empty slice of the row. A power-of-two thread count can
    leave the last CTA empty just past a power-of-two width (bf16 N = 131080: 16 CTAs of 3 x 512
    vectors cover 15 x 12288 columns before the last). Halving the cluster there used to double the
    chunk, and its shared memory with it: the LayerNorm backward asked 296 KB per CTA at bf16
    N = 131080 and fp32 N = 81924, and the driver rejected the launch (CUDA_ERROR_INVALID_VALUE).
    Instead the row's threads become the fewest whole warps (up to 1024) that cover the chunk;
    where even that does not fit, the last CTA idles instead. The chunk never grows past what
    the per-CTA byte cap and the cluster give."""
    cluster_n = 1
    while n * elem_bytes > _MAX_CHUNK_BYTES * cluster_n and cluster_n < MAX_CLUSTER:
        cluster_n *= 2
    columns = _BWD_MAX_COLUMNS.get("add_rmsnorm" if residual else op) if direction == "bwd" else None
    while columns and n > columns * cluster_n and cluster_n < _BWD_MAX_HALVED_CLUSTER:
        cluster_n *= 2
    n_vecs = n // vec
    chunk_vecs = _cdiv(n_vecs, cluster_n)
    stage = direction == "fwd" and chunk_vecs * vec * elem_bytes >= _STAGE_X_BYTES[op]
    stage = stage and not (few_rows and cluster_n == 1)  # a cluster's LayerNorm path needs its staged row
    target = _STAGED_VECS_PER_THREAD if stage else _VECS_PER_THREAD[direction]
    max_tpr = 256 if stage else 512
    tpr = min(max_tpr, max(32 if stage else 1, _pow2_at_least(_cdiv(chunk_vecs, target))))
    vpt = _cdiv(chunk_vecs, tpr)
    if direction == "bwd" and tpr >= 64:
        # A power-of-two tile past a non-power-of-two row leaves threads without columns: at
        # N = 2304 256 threads of which 144 work. Whole warps cover the row instead, which paid on
        # such rows for LayerNorm, the fused add and RMSNorm. Plain RMSNorm's CTAs under 512
        # threads followed once backward_ring rounded their count up (3 of 192 threads at 2880, not
        # 2): a large gain on one GPU, a small loss at a few N on the other.
        tpr = min(tpr, 32 * _cdiv(_cdiv(chunk_vecs, vpt), 32))
    if _leaves_a_cta_empty(n_vecs, cluster_n, tpr, vpt):
        for v in range(vpt, 0, -1):  # fewer vectors per thread: a finer tile
            warps = _cdiv(_cdiv(chunk_vecs, v), 32)
            if 32 * warps > MAX_THREADS:
                break
            if not _leaves_a_cta_empty(n_vecs, cluster_n, 32 * warps, v):
                tpr, vpt = 32 * warps, v
                break
    # Failing that (no tile of at most max_tpr threads fits), the last CTA idles: every path predicates
    # the columns past N, and to the (count, mean, M2) merge a count of 0 is the identity.
    layer_fwd = op == "layernorm" and direction == "fwd"
    num_threads = tpr * min(max(1, 128 // tpr), rows or MAX_THREADS)
    return Launch(vec, tpr, num_threads, cluster_n, vpt, stage, stage and layer_fwd, layer_fwd and cluster_n > 1)


@dataclass(frozen=True)
class BackwardRing:
    """The backward's shared-memory plan for one launch shape (pure Python: no GPU needed)."""

    tensors: int  # row tensors in the ring: x and dy, and dresidual_out when given
    dbias_in_smem: bool
    acc_bytes: int  # shared memory of the dbias accumulator (0 when it lives in registers)
    ctas_per_sm: int  # promised to ptxas (min blocks per SM)
    stages: int
    fold_bytes: int = 0  # shared memory in which a CTA of several rows folds its accumulators (0: one row)


def backward_ring(launch: Launch, elem_bytes: int, op: str, residual: bool = False) -> BackwardRing:
    """The CTA count is promised to ptxas (min blocks per SM), which caps the registers so that many
    CTAs really are resident: the persistent grid is sized by it. A chunk of more than 16 KB leaves
    the LayerNorm backward more fp32 dweight + dbias accumulators than 128 registers hold: dbias
    then accumulates in shared memory (each thread its own columns, so no barrier). A CTA of several
    short rows folds its rows' accumulators into one partial row through shared memory at its end
    (``fold_bytes``), so that SlotSum sums one slot per CTA, not one per row slot."""
    tensors = 3 if residual else 2
    dbias = op == "layernorm" and launch.chunk * elem_bytes > _DBIAS_SMEM_ABOVE_BYTES
    acc = launch.rows_per_cta * launch.chunk * 4 if dbias else 0
    fold = launch.rows_per_cta * launch.chunk * 4 if launch.rows_per_cta > 1 else 0
    fixed = acc + fold  # per CTA, beside the ring
    stage_bytes = tensors * launch.rows_per_cta * launch.chunk * elem_bytes

    def stages(ctas: int) -> int:
        # fp32 at N = 262144 fits a single stage (128 KB per CTA): correct, but loads do not overlap
        return max(1, min(_MAX_STAGES, (_SMEM_BUDGET - fixed * ctas) // (stage_bytes * ctas)))

    ctas = max(1, _BWD_THREADS_PER_SM // launch.num_threads)
    while ctas > 1 and (2 * stage_bytes + fixed) * ctas > _SMEM_BUDGET:
        ctas //= 2
    up = _cdiv(_BWD_THREADS_PER_SM, launch.num_threads)
    if not residual and up > ctas and up * launch.num_threads <= _BWD_ROUNDED_UP_THREADS_MAX and stages(up) == _MAX_STAGES:
        ctas = up
    if launch.min_registers:
        ctas = max(1, min(ctas, _REGISTERS_PER_SM // (launch.num_threads * launch.min_registers)))
    depth = stages(ctas)
    if residual and ctas >= 4:
        depth = min(depth, _RESIDUAL_STAGES_AT_4_CTAS)
    return BackwardRing(tensors, dbias, acc, ctas, depth, fold)


def _reduction_slots(op: str, direction: str, launch: Launch) -> int:
    """fp32 values per (row, warp) in the reduction buffer. Forward: RMSNorm's sum of squares;
    LayerNorm's sum and centred sum of squares, or its (count, mean, M2) triple (one_exchange).
    Backward: two row-iteration parities of one (RMSNorm) or two (LayerNorm) sums."""
    if direction == "bwd":
        return 2 * (2 if op == "layernorm" else 1)
    return 3 if launch.one_exchange else (2 if op == "layernorm" else 1)


def shared_memory_bytes(launch: Launch, elem_bytes: int, op: str, direction: str, residual: bool = False) -> int:
    """Dynamic shared memory of one CTA, laid out as the kernels allocate it (in this order, each
    buffer aligned to 16 bytes, the mbarriers to 8)."""
    L = launch
    row_bytes = L.rows_per_cta * L.chunk * elem_bytes
    sbuf = L.rows_per_cta * L.warps_per_row * L.cluster_n * _reduction_slots(op, direction, L) * 4
    if direction == "fwd":
        staged = (2 if residual else 1) if L.stage_x else 0
        buffers, mbarriers = [row_bytes] * staged + [sbuf], 1
    else:
        ring = backward_ring(L, elem_bytes, op, residual)
        buffers = ([row_bytes * ring.stages] * ring.tensors + [sbuf] + [ring.acc_bytes] * ring.dbias_in_smem
                   + [ring.fold_bytes] * (ring.fold_bytes > 0))
        mbarriers = 2
    offset = 0
    for size in buffers:
        offset = _cdiv(offset, 16) * 16 + size
    if L.cluster_n > 1:
        offset = _cdiv(offset, 8) * 8 + 8 * mbarriers
    return offset


def check_launch(launch: Launch, n: int, smem: int, what: str = "") -> None:
    """Raise ValueError unless this launch shape is one Hopper accepts and that covers a row of n
    columns exactly once: the grid is (row tiles or persistent CTAs, cluster_n, 1), the cluster
    (1, cluster_n, 1), the block (num_threads, 1, 1)."""
    L = launch
    fail = []
    if not (32 <= L.num_threads <= MAX_THREADS and L.num_threads % 32 == 0):
        fail.append(f"{L.num_threads} threads per CTA (needs a multiple of 32, at most {MAX_THREADS})")
    tpr = L.threads_per_row
    if L.num_threads % tpr or (tpr % 32 if tpr >= 32 else 32 % tpr):
        fail.append(f"{L.threads_per_row} threads per row (a power of two below a warp, whole warps above)")
    if L.cluster_n not in (1, 2, 4, 8, 16) or L.cluster_n > MAX_CLUSTER:
        fail.append(f"a cluster of {L.cluster_n} CTAs (a power of two, at most {MAX_CLUSTER})")
    if L.cluster_n > 1 and L.rows_per_cta != 1:
        fail.append(f"{L.rows_per_cta} rows per CTA in a cluster (one row per cluster)")
    if L.vec < 1 or n % L.vec or L.vecs_per_thread < 1:
        fail.append(f"vectors of {L.vec} elements x {L.vecs_per_thread} per thread for N = {n}")
    if L.cluster_n * L.chunk < n:
        fail.append(f"{L.cluster_n} CTAs of {L.chunk} columns for N = {n} (the row not covered)")
    if smem > SMEM_LIMIT:
        fail.append(f"{smem} B of shared memory per CTA (Hopper allows {SMEM_LIMIT} B)")
    if fail:
        raise ValueError(f"impls.cute: no valid launch for {what or f'N = {n}'}: " + "; ".join(fail))


@lru_cache(maxsize=None)
def planned_launch(n: int, elem_bytes: int, vec: int, direction: str, op: str, few_rows: bool = False,
                   residual: bool = False, rows: int = 0) -> tuple[Launch, int]:  # fmt: skip
    """(launch shape, dynamic shared memory bytes), valid by construction: ValueError otherwise."""
    launch = launch_shape(n, elem_bytes, vec, direction, op, few_rows, residual, rows)
    smem = shared_memory_bytes(launch, elem_bytes, op, direction, residual)
    what = f"{op} {direction} at N = {n} with {elem_bytes}-byte elements" + (" and a residual row" if residual else "")
    check_launch(launch, n, smem, what)
    return launch, smem


def realigned_span(n: int, vec: int) -> int:
    """Columns of a realigned row's span: the whole vectors that hold a row of n elements starting
    anywhere within a vector (``realigned_launch``)."""
    return vec * _cdiv(n + vec - 1, vec)


@lru_cache(maxsize=None)
def realigned_launch(n: int, elem_bytes: int, op: str, residual: bool = False) -> Launch | None:
    """The backward's launch for rows of n 16-bit elements, n no multiple of a 16-byte vector, read
    realigned (``kernels.py``, "Rows of an odd width"), or None where they stay element-wise:
    16-bit rows whose span is one row per CTA, no cluster (from N = 1018 up to the widest
    row one CTA holds). Shorter rows share a CTA, and its rows would start at different offsets
    within a vector; fp32 rows were left element-wise."""
    vec = 16 // elem_bytes
    if elem_bytes != 2 or n % vec == 0:
        return None
    launch, _ = planned_launch(realigned_span(n, vec), elem_bytes, vec, "bwd", op, False, residual)
    if launch.cluster_n > 1 or launch.rows_per_cta > 1:
        return None
    return dataclasses.replace(launch, min_registers=REALIGNED_MIN_REGISTERS)


def vector_width(n: int, dtype: torch.dtype, *tensors: torch.Tensor) -> int:
    """Widest vector of x's dtype (<= 128 bits) that N, every leading stride (a row's; a per-head
    view's token and head strides) and every base pointer allow. Every tensor's pointer must be
    aligned to one vector of its own elements: an fp32 weight beside 16-bit x is read 8 elements
    (32 bytes, two 128-bit loads) per vector of x."""
    vec = 16 // dtype.itemsize
    for v in (n, *(t.stride(d) for t in tensors for d in range(t.dim() - 1) if t.shape[d] > 1)):
        vec = math.gcd(vec, v)
    while vec > 1 and any(t.data_ptr() % (vec * t.element_size()) for t in tensors):
        vec //= 2
    return vec


def view_rows(launch: Launch, heads: int) -> int:
    """Rows per CTA with which a (T, H, N) per-head view is read in place (``kernels.py``, "Per-head
    views"), or 0: the view is copied to (M, N) rows. A CTA's tile is R consecutive rows
    r = t * H + h, which the view's layout divides into as one tile where R divides H (the tile
    inside one token) or H divides R (whole tokens). Elsewhere the CTA takes gcd(H, R) rows, which
    divides H, where that is still a warp of threads."""
    r = launch.rows_per_cta
    if heads % r == 0 or r % heads == 0:
        return r
    fewer = math.gcd(heads, r)
    return fewer if fewer * launch.threads_per_row >= 32 else 0


def slot_threads(slots: int) -> int:
    """Threads per column of SlotSum: few slots (wide rows, decode) leave the CTA's threads to the
    columns instead."""
    return min(64, max(8, _pow2_at_least(_cdiv(slots, 4))))
