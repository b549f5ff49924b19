"""RMSNorm, LayerNorm and the fused residual add + RMSNorm, forward and backward, in Triton.

Per row of N elements, all arithmetic in fp32 (x, dy, w, b are upcast right after loading):

    RMSNorm     rstd = 1 / sqrt(mean(x^2) + eps)                          xhat = x * rstd
    LayerNorm   mean = mean(x),  rstd = 1 / sqrt(mean((x - mean)^2) + eps)  xhat = (x - mean) * rstd
    forward     y = xhat * w (+ b)
    backward    g = dy * w,  c1 = mean(g * xhat),  c2 = mean(g) (LayerNorm; 0 for RMSNorm)
                dx = rstd * (g - xhat * c1 - c2)
                dw = sum over rows of dy * xhat,   db = sum over rows of dy
    add + RMSNorm   h = round_to_x_dtype(x + residual) (stored: residual_out), then RMSNorm of h;
                    backward dh = RMSNorm's dx (with h for x) + dresidual_out, rounded once

RMSNorm is LayerNorm without the centring, so every kernel takes ``LAYERNORM`` as a compile-time
flag; the fused add is RMSNorm's kernels with ``HAS_RESIDUAL`` (forward) and ``HAS_DRESIDUAL``
(backward) on, on every path below. Memory traffic is what matters: the forward reads x once and
writes y (fused: reads x and residual, writes y and residual_out); the backward reads x and dy once
and writes dx (fused: reads dy, residual_out and dresidual_out, writes dh), and its column
reductions (dw, db) ride along in the same pass.

Why the fused sum is rounded before the statistics: the unfused model stores x + residual in x's
dtype and normalises that; normalising the fp32 sum instead would give a y (and rstd) that differ
from the unfused pair's, and a backward (which only sees residual_out) inconsistent with its
forward. So h is rounded once, stored, and the statistics and y are computed from h as stored.

Weights and biases come in x's dtype or in fp32 (mixed precision): each is loaded through its own
pointer type and upcast, so an fp32 weight costs 4 bytes a column instead of 2; dw and db are
reduced in fp32 whatever their dtype and rounded once to the weight's. Configs are chosen by x's
dtype (the bytes of a row), except that the re-read backward takes one row per tile with an fp32
weight beside 16-bit rows (``configs.for_weight``: two rows spill there).

A row whose sum of squares overflows fp32 (|x| from ~1e19 up) would get rstd = rsqrt(inf) = 0 and
y = 0 (or the bias): finite and wrong. Its rstd is NaN instead, so y and dx are NaN there, as
torch's LayerNorm gives (its rms_norm returns 0 there, which is not copied).

Where a row is: row r of an (M, N) row tensor at r * stride; a (T, H, N) per-head view (q and k
cut from a fused QKV projection's output: token stride (heads + 2 kv_heads) * N, so no (M, N) view
of them exists) is read in place, row r = t * H + h at t * stride(0) + h * stride(1)
(``_row_offsets``; the contract hands such a tensor over as it is, ``row_views``). Each row tensor
has its own two strides (dy may be contiguous where x is a view); the outputs are written as
contiguous (M, N) rows. ``VIEWS`` is a compile-time flag, so (M, N) rows compile to the plain
row * stride; the views pay an int32 division per row, not per element, and keep 16-byte vectors
(the head stride is a whole row).

How a row is walked (``Config``, chosen per GPU and N bucket in ``configs``):

* whole row: a [ROWS, next_pow2(N)] tile in registers, one read of everything. Short rows
  (N <= 512: QK-norm's head_dim, M in the millions) take many rows to a tile (2048-8192 elements),
  so that every thread moves whole 16-byte vectors and enough bytes are in flight;
* whole row read twice (backward, ``reread``): the second read, for dx, comes from L1/L2, which
  leaves the registers to the dw/db accumulators (rows of ~8-16K elements);
* whole row without the prefetch (backward, ``prefetch`` off): the registers of the next row block
  and of the weight go to the row itself, as a first-shot LLM kernel of the fused backward does at
  N = 16384 (its sm_90a build still spills there);
* forward, chunked, for rows too wide for registers: pass 1 walks the row in column chunks for the
  statistics, pass 2 walks it again *backwards* to write y, so that it starts on the chunks pass 1
  read last, which are still in L2 (a forward walk would start on the ones evicted first); L2
  eviction hints keep the rows between their two reads (pass 1 evict_last, pass 2 and y
  evict_first). With one 512 KB row per SM in flight at N = 262144 (more than the L2 holds) they
  do not suffice: pass 2 then reads much of x from DRAM again. The fused add writes h in pass 1
  and pass 2 reads h back (one row from L2, not x and residual), after a barrier that orders the
  other threads' writes of h before the reads;
* forward, sliced, exchanging (``slice`` with ``sync``): each program owns a column slice of a
  group of rows and reads it once, into registers; the slices of a row exchange their partial
  statistics through global memory, as the sliced backward's do (below);
* backward, sliced, for rows too wide for registers: each program owns a column slice (``slice``)
  of a group of rows, so that its dw/db accumulators (slice-wide) stay in registers; the row
  reductions c1, c2 need the whole row. The siblings post their slices' sums of each row block to
  each other through global memory and wait for the rest (``sync``: x and dy read once; the wait
  overlaps the next blocks' loads; all siblings resident: one program per SM, or the config's
  ``programs_per_sm`` once the binary says an SM holds them), or they
  come from a first kernel that sums each (row, slice) (``row_sums``: x and dy are read twice
  from DRAM, 5 units of traffic instead of 3), or from the program itself streaming the other
  slices of its rows (read from L2 after a sibling's DRAM read: 3 units, but latency-bound).

The backward is persistent: a grid of a few programs per SM (``programs_per_sm``), each walking a
contiguous range of row blocks, loading the next block while it computes the current one, and
accumulating dw / db over its rows in fp32; it writes one partial row, and ``_sum_partials_kernel``
adds the partials in a fixed order (deterministic, no atomics). With many short rows to a tile the
accumulators are a whole [ROWS, N] tile (``acc_rows``), summed over the rows once at the end:
summed per block instead, the column sums cross the warps that hold the tile's rows, a round trip
through shared memory and a barrier on every block, which is what held short rows back. Why not one
program per wide row with its dw/db partial row in global memory, read-added-written per row block:
at N = 16384 the partial rows (one per SM) and the rows in flight outgrow the L2, so x and dy are
read from DRAM almost twice and the partials are written back, far more traffic than the problem's
own.

Why wide forward rows are sliced and exchange their statistics: the chunked forward reads each
row twice, hoping for L2 on the second read, and with a row per SM in flight the rows outgrow the
L2 from N ~ 49152 (bf16) on, so x comes from DRAM twice. A row cut into column slices, one program
each, is read once: each program keeps its slice in registers, sums its part of the statistics and
posts it for its siblings. RMSNorm (and the fused add, from h as stored) posts the slice's sum of
squares; LayerNorm posts the slice's sum and its sum of squared deviations from the slice's own
mean, and the siblings merge them with Chan et al.'s formula (mean = sum of the sums / N,
M2 = sum of the slices' M2 + sum of n_s (mean_s - mean)^2), not E[x^2] - E[x]^2, which cancels
badly. A post is the backward's: the fp32 value and a "posted" bit in one int64 slot, one atomic
exchange; the next block's loads go out before the wait, so the wait overlaps them; every sibling
adds the posts in slice order (the same bits in each, whatever the timing); the wait is bounded
(NaN, not a hang, if a sibling never posts). The siblings wait for each other, so all of them must
be resident: one program per SM (``harness.spec.occupancy.exchange_groups``), and where a row's
slices outnumber the SMs, or a block's slots do not fit one warp, the chunked forward runs
instead. The H100 table pins it (``Config.sync`` with ``slice``) where it measured faster than the
chunked forward: from 131072 columns (RMSNorm, the fused add; LayerNorm at 131072), on two rows a
block of 8192-column slices or on 16384-column slices, which move enough bytes per exchange for the
wait to hide behind them; one row of 8192 columns a block lost almost everywhere
(docs/kernels/triton.md).

Rows whose length is no multiple of a 16-byte vector (N = 4001) start anywhere within a vector,
so the row kernels' loads and stores are element-wise (a 2-byte access per element keeps the
load/store units, not DRAM, busy). The realigned kernels (``Config.realign``, pinned per bucket in
the ``*_odd`` tables) read each row's body in whole vectors from its first aligned element and its
head and tail (under a vector each) element-wise. The body then sits in shifted columns, so the
weight and the dw / db accumulators must be shifted alike; Triton's layouts are static, and
``tl.gather`` along the row lowers to a chain of warp shuffles (some 16K for a 4096-wide bf16 row,
which ptxas took minutes over). A row r starts (r * N) mod 8 elements into a vector, so a
persistent program whose rows are r0, r0 + G, ... with G a multiple of 8 keeps one shift: one
shifted weight, loaded once, and one shifted dw, written back in column order at the end.

The price is batch invariance at those widths: which columns are body and which are head or tail
depends on where the row starts, so its sums round differently at another place in the batch.
Two exact sums (the same bits in any order) were built and timed: each term truncated to a 64-bit
integer at a scale set by the row's largest, and each term split on three fixed fp32 grids whose
sums are exact. Both cost up to 38 points of copy bandwidth at N = 2047-7001 (LayerNorm's backward
at 4001: 73% with plain sums, 41% and 35% with exact ones), mostly more than the realigned body
gains, so the sums are plain fp32 (reports/experiments/triton-odd-rows/).

Rows too wide for one program's registers in the backward (above 16384): a 32768-wide row's dw
accumulator alone is 128 KB of fp32, half an SM's register file, so the program that owns a row
cannot also keep dw for it, and a row is cut into column slices, one program each. Their row sums
travel between the sibling programs through global memory (``sync``: 3 units of traffic); without
that, a first kernel sums every (row, slice) (``row_sums``: 5 units), or each program streams its
siblings' slices from L2 (3 units, but every round trip is waited on).

Interpreter notes (CI runs these under TRITON_INTERPRET=1): no arithmetic on bf16 values (it is
silently wrong there), no libdevice (``tl.rsqrt`` instead); its programs run one after another, so
programs that wait for each other fall back to kernels that do not (the tests run the exchanging
forward there twice on the same slots: the first launch posts every slice, the second finds them
all posted); its fp32 -> bf16 conversion truncates, so residual_out is rounded by hand there
(``_round_to``).

Measurements behind these choices: docs/kernels/triton.md.
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch
import triton
import triton.language as tl

from harness.spec.contract import contract_functions
from harness.spec.jit_launch import fast
from harness.spec.occupancy import exchange_groups, held

from .configs import Config, bucket, choose, for_weight, sm_count

# Running under the CPU interpreter (its fp32 -> bf16 conversion truncates: see ``_round_to``).
INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


# ==================================================================================== forward
@triton.jit
def _rstd(var, eps):
    """1 / sqrt(var + eps), and NaN where var overflowed fp32 (|x| ~ 1e19 and up: x^2 is inf):
    rsqrt(inf) = 0 would make y = 0, or the bias, a finite wrong number. torch's LayerNorm gives
    NaN there; its rms_norm gives 0, which we do not copy."""
    return tl.where(var == float("inf"), float("nan"), tl.rsqrt(var + eps))


@triton.jit
def _round_to(v, DTYPE: tl.constexpr):
    """fp32 -> DTYPE, rounded to nearest even. The GPU's conversion does this; the interpreter's
    fp32 -> bf16 truncates, which would make residual_out differ from the unfused model's by an ulp
    on the CPU, so there bf16 is rounded with integer arithmetic (NaN kept NaN)."""
    if INTERPRETED and DTYPE == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        out = tl.where(v == v, bits, 0x7FC0).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        out = v.to(DTYPE)
    return out


@triton.jit
def _load_input(x_ptrs, r_ptrs, h_ptrs, mask, HAS_RESIDUAL: tl.constexpr, LAST_USE: tl.constexpr, KEEP: tl.constexpr):
    """The forward's first read of a tile, in fp32: x, or for the fused add h = x + r, summed in
    fp32, rounded once to x's dtype and stored (residual_out), and returned *as stored*, so that the
    statistics and y are those of rmsnorm(residual_out). Eviction hints: KEEP for what is read again
    (x, or h as written), LAST_USE for x and r when h replaces them."""
    if HAS_RESIDUAL:
        x = tl.load(x_ptrs, mask=mask, other=0.0, eviction_policy=LAST_USE).to(tl.float32)
        r = tl.load(r_ptrs, mask=mask, other=0.0, eviction_policy=LAST_USE).to(tl.float32)
        v = _round_to(x + r, h_ptrs.dtype.element_ty)
        tl.store(h_ptrs, v, mask=mask, eviction_policy=KEEP)
    else:
        v = tl.load(x_ptrs, mask=mask, other=0.0, eviction_policy=KEEP)
    return v.to(tl.float32)


@triton.jit
def _affine(y, W, B, cols, col_mask, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """y * w (+ b), with w and b loaded in their own dtype (x's or fp32) and upcast."""
    if HAS_WEIGHT:
        y = y * tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        y = y + tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    return y


@triton.jit
def _row_offsets(rows, stride, stride_h, HEADS, VIEWS: tl.constexpr):
    """Element offset (int64) of each row of a row tensor: row * stride for (M, N) rows; with
    VIEWS, row r = t * HEADS + h of a (T, HEADS, N) view at t * stride + h * stride_h (per-head q or
    k of a fused QKV tensor, which no (M, N) view reaches). The division is done in int32 (rows <
    2^31), the products in int64 (offsets pass 2^31 elements)."""
    if VIEWS:
        return (rows // HEADS).to(tl.int64) * stride + (rows % HEADS).to(tl.int64) * stride_h
    return rows.to(tl.int64) * stride


@triton.jit(do_not_specialize=["M", "eps"])
def _norm_fwd_row_kernel(
    X, R, W, B, Y, H, MEAN, RSTD,
    M, N, stride_x, stride_r, stride_y, stride_h, eps,
    HEADS, stride_xh, stride_rh, stride_yh, stride_hh,
    LAYERNORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, VIEWS: tl.constexpr, EXACT_N: tl.constexpr,
):  # fmt: skip
    if EXACT_N:  # Config.exact_n: N known at compile time, the masks of whole vectors fold away
        N = EXACT_N
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < M
    mask = row_mask[:, None] & (cols < N)[None, :]
    y_rows = _row_offsets(rows, stride_y, stride_yh, HEADS, VIEWS)[:, None]
    x_at = _row_offsets(rows, stride_x, stride_xh, HEADS, VIEWS)
    r_at = _row_offsets(rows, stride_r, stride_rh, HEADS, VIEWS)
    h_at = _row_offsets(rows, stride_h, stride_hh, HEADS, VIEWS)

    x = _load_input(X + x_at[:, None] + cols[None, :], R + r_at[:, None] + cols[None, :],
                    H + h_at[:, None] + cols[None, :], mask, HAS_RESIDUAL, "", "")  # fmt: skip
    if LAYERNORM:
        mean = tl.sum(x, axis=1) / N
        # centre in registers before squaring (two-pass variance): E[x^2] - E[x]^2 cancels badly
        x = tl.where(mask, x - mean[:, None], 0.0)
        tl.store(MEAN + rows, mean, mask=row_mask)
    rstd = _rstd(tl.sum(x * x, axis=1) / N, eps)
    tl.store(RSTD + rows, rstd, mask=row_mask)

    y = _affine(x * rstd[:, None], W, B, cols, cols < N, HAS_WEIGHT, HAS_BIAS)
    tl.store(Y + y_rows + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M", "eps"])
def _norm_fwd_chunked_kernel(
    X, R, W, B, Y, H, MEAN, RSTD,
    M, N, stride_x, stride_r, stride_y, stride_h, eps,
    HEADS, stride_xh, stride_rh, stride_yh, stride_hh,
    LAYERNORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    ROWS: tl.constexpr, CHUNK: tl.constexpr, VIEWS: tl.constexpr,
):  # fmt: skip
    n_chunks = tl.cdiv(N, CHUNK)
    # One row block per program, or several with a persistent grid (``Config.persistent``).
    for block in range(tl.program_id(0), tl.cdiv(M, ROWS), tl.num_programs(0)):
        rows = block * ROWS + tl.arange(0, ROWS)
        row_mask = rows < M
        x_rows = X + _row_offsets(rows, stride_x, stride_xh, HEADS, VIEWS)[:, None]
        r_rows = R + _row_offsets(rows, stride_r, stride_rh, HEADS, VIEWS)[:, None]
        h_rows = H + _row_offsets(rows, stride_h, stride_hh, HEADS, VIEWS)[:, None]
        y_rows = Y + _row_offsets(rows, stride_y, stride_yh, HEADS, VIEWS)[:, None]

        # pass 1: the statistics. evict_last asks L2 to keep the row for pass 2, which reads it
        # evict_first (its last use) and writes y evict_first too, so that neither pushes out the
        # rows still waiting for their second read. With the fused add, the row kept is h as
        # written (one row instead of x and r).
        if LAYERNORM:
            # Chan et al.'s merge of per-chunk (mean, sum of squared deviations): no E[x^2] - E[x]^2
            mean = tl.zeros([ROWS], dtype=tl.float32)
            m2 = tl.zeros([ROWS], dtype=tl.float32)
            for c in range(0, n_chunks):
                cols = c * CHUNK + tl.arange(0, CHUNK)
                mask = row_mask[:, None] & (cols < N)[None, :]
                x = _load_input(x_rows + cols[None, :], r_rows + cols[None, :], h_rows + cols[None, :], mask,
                                HAS_RESIDUAL, "evict_first", "evict_last")  # fmt: skip
                seen = tl.cast(c * CHUNK, tl.float32)
                count = tl.cast(tl.minimum(N - c * CHUNK, CHUNK), tl.float32)
                chunk_mean = tl.sum(x, axis=1) / count
                dev = tl.where(mask, x - chunk_mean[:, None], 0.0)
                delta = chunk_mean - mean
                mean = mean + delta * (count / (seen + count))
                m2 = m2 + tl.sum(dev * dev, axis=1) + delta * delta * (seen * count / (seen + count))
            rstd = _rstd(m2 / N, eps)
            tl.store(MEAN + rows, mean, mask=row_mask)
        else:
            sum_sq = tl.zeros([ROWS, CHUNK], dtype=tl.float32)
            for c in range(0, n_chunks):
                cols = c * CHUNK + tl.arange(0, CHUNK)
                mask = row_mask[:, None] & (cols < N)[None, :]
                x = _load_input(x_rows + cols[None, :], r_rows + cols[None, :], h_rows + cols[None, :], mask,
                                HAS_RESIDUAL, "evict_first", "evict_last")  # fmt: skip
                sum_sq += x * x
            rstd = _rstd(tl.sum(sum_sq, axis=1) / N, eps)
        tl.store(RSTD + rows, rstd, mask=row_mask)
        if HAS_RESIDUAL:
            # pass 2 reads h where other threads of this program may have written it: the barrier
            # orders those global writes before the reads (CTA scope)
            tl.debug_barrier()
            x_rows = h_rows

        # pass 2, last chunk first (still in L2): y
        for i in range(0, n_chunks):
            cols = (n_chunks - 1 - i) * CHUNK + tl.arange(0, CHUNK)
            col_mask = cols < N
            mask = row_mask[:, None] & col_mask[None, :]
            x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
            if LAYERNORM:
                x = x - mean[:, None]
            y = _affine(x * rstd[:, None], W, B, cols, col_mask, HAS_WEIGHT, HAS_BIAS)
            tl.store(y_rows + cols[None, :], y.to(Y.dtype.element_ty), mask=mask, eviction_policy="evict_first")


# ========================================================== sibling programs exchanging row sums
# Re-reads of the posted row sums a sliced program makes before it gives up on a sibling (see
# ``_await_sums``): ~2^20 L2 round trips, about a second, far beyond any real wait.
SPIN_LIMIT = 1 << 20
# The most slots (rows x slices, padded to a power of two) a block may wait on: one warp's lanes.
SYNC_SLOTS_MAX = 32


@triton.jit
def _row_block_range(M, ROWS: tl.constexpr, worker, workers):
    """Worker ``worker``'s contiguous range of row blocks out of ``workers``: as even as possible
    (sizes differ by at most one), so no program idles while another finishes a double share."""
    n_blocks = tl.cdiv(M, ROWS)
    share = n_blocks // workers
    extra = n_blocks % workers
    first = worker * share + tl.minimum(worker, extra)
    return first, first + share + (worker < extra).to(tl.int32)


@triton.jit
def _publish(SLOTS, slot, value, row_mask):
    """Post one slice's row sums for its siblings: each fp32 sum in the low half of an int64 slot,
    bit 32 set as the "posted" flag, in one atomic exchange, so a reader that sees the flag sees
    the value with it (no fence between a value and its flag to get wrong)."""
    bits = value.to(tl.uint32, bitcast=True).to(tl.int64)  # zero-extended
    tl.atomic_xchg(SLOTS + slot, bits | (tl.full(value.shape, 1, tl.int64) << 32), mask=row_mask, sem="relaxed")


@triton.jit
def _posted(v):
    """The fp32 value in a slot's low half; NaN where the slot was never posted."""
    return tl.where((v >> 32) == 0, float("nan"), v.to(tl.int32).to(tl.float32, bitcast=True))


@triton.jit
def _await_slots(SLOTS, PLANE, rows64, SLICES, SLICES_P2: tl.constexpr, row_mask, spin, PLANES: tl.constexpr):
    """Every slice's posted value of each row, [rows, SLICES_P2] (padding lanes and masked rows 0),
    once all have posted: the slots of each row re-read (volatile: from L2, never a stale L1 line)
    until all carry the flag. With ``PLANES`` = 2 (LayerNorm's two statistics, the second plane
    ``PLANE`` slots on) both planes are re-read in every round and both values come back: one L2
    round trip a round, where waiting for one plane and then the other took two (the second plane
    is posted with the first, so its own wait was a round trip that found it there). With one
    plane, the second value is the first's. The wait is bounded (``spin`` re-reads; what is left of
    it comes back, 0 once it ran out, so that a program waits out one bound at most): a sibling
    that never posts (only if the grid outgrew the resident programs, which the launchers prevent)
    leaves its value NaN, so that the row's result is visibly wrong, not a hang.

    The slots must fit one warp (``SYNC_SLOTS_MAX``): then every warp holds its own copy of them
    and leaves the loop once its copy is complete, which is final, as a slot only ever goes from
    empty to posted. Spread over warps, the test that ends the loop is a reduction across warps,
    whose copies were read at different moments: warps then left the loop on different iterations
    and out of step with each other's barriers (2 rows x 32 slices gave NaN rows on an H100; the
    compiled loop held a ``bar.sync``, which ``harness.spec.ptx.spin_barriers`` counts)."""
    k = tl.arange(0, SLICES_P2)
    slots = SLOTS + rows64[:, None] * SLICES + k[None, :]
    mask = row_mask[:, None] & (k < SLICES)[None, :]
    posted = tl.full([1, SLICES_P2], 1, tl.int64) << 32  # what padding lanes and masked rows read as
    v = tl.load(slots, mask=mask, other=posted, volatile=True)
    u = v
    if PLANES == 2:
        u = tl.load(slots + PLANE, mask=mask, other=posted, volatile=True)
    tries = 0
    while (tl.min(tl.min((v & u) >> 32, axis=1), axis=0) == 0) & (tries < spin):
        v = tl.load(slots, mask=mask, other=posted, volatile=True)
        u = v
        if PLANES == 2:
            u = tl.load(slots + PLANE, mask=mask, other=posted, volatile=True)
        tries += 1
    all_posted = tl.min(tl.min((v & u) >> 32, axis=1), axis=0) != 0
    return _posted(v), _posted(u), tl.where(all_posted, spin, 0)


@triton.jit
def _await_sums(SLOTS, PLANE, rows64, SLICES, SLICES_P2: tl.constexpr, row_mask, spin, PLANES: tl.constexpr):
    """The whole rows' sums of each plane, once every slice has posted its part
    (``_await_slots``), added in slice order, so every sibling gets the same bits and the result is
    the same run to run."""
    a, b, spin = _await_slots(SLOTS, PLANE, rows64, SLICES, SLICES_P2, row_mask, spin, PLANES)
    return tl.sum(a, axis=1), tl.sum(b, axis=1), spin


@triton.jit
def _load_slice(X, R, rows, end, cols, col_mask, stride_x, stride_xh, stride_r, stride_rh, HEADS,
                VIEWS: tl.constexpr, HAS_RESIDUAL: tl.constexpr):  # fmt: skip
    """A row block's own slice of x (and of the residual), in its storage dtype: what waits in
    registers for the wait before it is used (16-bit rows take half the registers of fp32)."""
    mask = (rows < end)[:, None] & col_mask[None, :]
    x = tl.load(X + _row_offsets(rows, stride_x, stride_xh, HEADS, VIEWS)[:, None] + cols[None, :], mask=mask, other=0.0)
    r = x  # (no residual: a placeholder, never read)
    if HAS_RESIDUAL:
        r = tl.load(R + _row_offsets(rows, stride_r, stride_rh, HEADS, VIEWS)[:, None] + cols[None, :], mask=mask, other=0.0)
    return x, r


@triton.jit(do_not_specialize=["M", "eps", "SLICES"])
def _norm_fwd_sync_kernel(
    X, R, W, B, Y, H, MEAN, RSTD, STATS,
    M, N, stride_x, stride_r, stride_y, stride_h, eps,
    HEADS, stride_xh, stride_rh, stride_yh, stride_hh, SLICES, SPIN,
    LAYERNORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    ROWS: tl.constexpr, SLICE: tl.constexpr, SLICES_P2: tl.constexpr, VIEWS: tl.constexpr, AHEAD: tl.constexpr,
):  # fmt: skip
    """The forward of rows too wide for one program's registers, each row read once (``Config.sync``
    with ``slice``). Program p owns column slice p % SLICES of the row blocks of row group
    p // SLICES (a contiguous range, ``_row_block_range``), and its weight and bias slice, loaded
    once. Per row block it loads its slice (the fused add: h rounded once and stored, the
    statistics h's as stored), posts its slice's partial statistics to STATS (int64 slots, zeroed
    by the launcher: RMSNorm's sum of squares; LayerNorm's sum and sum of squared deviations from
    the slice's own mean, two planes), issues the next block's loads, then waits for its siblings'
    posts and merges them in slice order, the same bits in every sibling: RMSNorm adds them,
    LayerNorm merges them with Chan et al.'s formula (mean = sum of the sums / N, M2 = sum of the
    m2_s + sum of n_s (mean_s - mean)^2, n_s the slice's columns). Slice 0 stores mean and rstd;
    every slice normalises and stores its own columns of y. All siblings must be resident: the
    launcher keeps the grid to one program per SM (``exchange_grid``)."""
    me = tl.program_id(0) % SLICES
    group = tl.program_id(0) // SLICES
    first, last = _row_block_range(M, ROWS, group, tl.num_programs(0) // SLICES)
    end = tl.minimum(M, last * ROWS)
    stats_end = tl.where(me == 0, end, 0)  # one slice stores mean and rstd
    cols = me * SLICE + tl.arange(0, SLICE)
    col_mask = cols < N
    n_me = tl.minimum(N - me * SLICE, SLICE).to(tl.float32)  # this slice's columns (the last may be short)
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        b = tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    spin = SPIN

    rows = first * ROWS + tl.arange(0, ROWS)
    x_next, r_next = _load_slice(X, R, rows, end, cols, col_mask, stride_x, stride_xh, stride_r, stride_rh, HEADS,
                                 VIEWS, HAS_RESIDUAL)  # fmt: skip
    if AHEAD == 2:
        x_next2, r_next2 = _load_slice(X, R, rows + ROWS, end, cols, col_mask, stride_x, stride_xh, stride_r,
                                       stride_rh, HEADS, VIEWS, HAS_RESIDUAL)  # fmt: skip
    for block in range(first, last):
        row_mask = rows < end
        mask = row_mask[:, None] & col_mask[None, :]
        rows64 = rows.to(tl.int64)
        if HAS_RESIDUAL:  # h rounded once and stored (residual_out); the statistics are h's as stored
            h = _round_to(x_next.to(tl.float32) + r_next.to(tl.float32), H.dtype.element_ty)
            h_rows = _row_offsets(rows, stride_h, stride_hh, HEADS, VIEWS)
            tl.store(H + h_rows[:, None] + cols[None, :], h, mask=mask)
            x = h.to(tl.float32)
        else:
            x = x_next.to(tl.float32)
        # this slice's part of the statistics, posted before the next block's loads go out
        if LAYERNORM:
            part = tl.sum(x, axis=1)
            dev = tl.where(mask, x - (part / n_me)[:, None], 0.0)
            _publish(STATS, rows64 * SLICES + me, part, row_mask)
            _publish(STATS, (M + rows64) * SLICES + me, tl.sum(dev * dev, axis=1), row_mask)
        else:
            _publish(STATS, rows64 * SLICES + me, tl.sum(x * x, axis=1), row_mask)
        if AHEAD == 2:
            x_next, r_next = x_next2, r_next2
            x_next2, r_next2 = _load_slice(X, R, rows + 2 * ROWS, end, cols, col_mask, stride_x, stride_xh, stride_r,
                                           stride_rh, HEADS, VIEWS, HAS_RESIDUAL)  # fmt: skip
        else:
            x_next, r_next = _load_slice(X, R, rows + ROWS, end, cols, col_mask, stride_x, stride_xh, stride_r,
                                         stride_rh, HEADS, VIEWS, HAS_RESIDUAL)  # fmt: skip
        if LAYERNORM:
            sums, m2s, spin = _await_slots(STATS, M * SLICES, rows64, SLICES, SLICES_P2, row_mask, spin, 2)
            k = tl.arange(0, SLICES_P2)
            n_k = tl.minimum(tl.maximum(N - k * SLICE, 0), SLICE).to(tl.float32)[None, :]  # 0 past the last slice
            mean = tl.sum(sums, axis=1) / N
            d = sums / tl.maximum(n_k, 1.0) - mean[:, None]  # (padding lanes: 0 - mean, times n_k = 0)
            rstd = _rstd((tl.sum(m2s, axis=1) + tl.sum(n_k * d * d, axis=1)) / N, eps)
            x = x - mean[:, None]
            tl.store(MEAN + rows, mean, mask=rows < stats_end)
        else:
            sum_sq, _, spin = _await_sums(STATS, 0, rows64, SLICES, SLICES_P2, row_mask, spin, 1)
            rstd = _rstd(sum_sq / N, eps)
        tl.store(RSTD + rows, rstd, mask=rows < stats_end)
        y = x * rstd[:, None]
        if HAS_WEIGHT:
            y = y * w
        if HAS_BIAS:
            y = y + b
        y_rows = _row_offsets(rows, stride_y, stride_yh, HEADS, VIEWS)
        tl.store(Y + y_rows[:, None] + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
        rows += ROWS

@triton.jit
def _odd_split(first_row, stride, N, VEC: tl.constexpr):
    """(head, body) of the realigned kernels' rows: a row at element offset e starts ``head`` =
    (-e) mod VEC elements before its first whole 16-byte vector, whose ``body`` (a multiple of VEC)
    follows; what is left at the end (under VEC) is the tail. Every row of a program shares them
    (see the module docstring), so they come from its first row."""
    e = first_row.to(tl.int64) * stride
    head = ((VEC - e % VEC) % VEC).to(tl.int32)
    return head, tl.maximum(N - head, 0) // VEC * VEC


@triton.jit
def _odd_edges(head, body, N, VEC: tl.constexpr):
    """The columns of a row's head and tail, as one short vector (lanes past them masked)."""
    k = tl.arange(0, 2 * VEC)
    return k + tl.where(k >= head, body, 0), k < N - body


@triton.jit
def _odd_columns(me, stride, N, VEC: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program ``me``'s columns: (head, j, the body's lanes, the edge's columns, its lanes); the
    body's column j is head + j."""
    head, body = _odd_split(me, stride, N, VEC)
    j = tl.arange(0, BLOCK_N)
    edge_cols, in_edge = _odd_edges(head, body, N, VEC)
    return head, j, j < body, edge_cols, in_edge


@triton.jit
def _load_shifted(P, head, j, in_body, edge_cols, in_edge):
    """A per-column vector (weight, bias) in a realigned program's columns: (body, edge), fp32."""
    body = tl.load(P + head + j, mask=in_body, other=0.0).to(tl.float32)[None, :]
    edge = tl.load(P + edge_cols, mask=in_edge, other=0.0).to(tl.float32)[None, :]
    return body, edge


@triton.jit
def _store_shifted(P, head, j, in_body, edge_cols, in_edge, body, edge):
    """A partial row (dw, db) from a realigned program's columns, in natural column order."""
    tl.store(P + head + j, body, mask=in_body)
    tl.store(P + edge_cols, edge, mask=in_edge)


@triton.jit
def _load_split(P, body_at, edge_at, mask_b, mask_e):
    """A tile of realigned rows in its storage dtype: (body, edge)."""
    return tl.load(P + body_at, mask=mask_b, other=0.0), tl.load(P + edge_at, mask=mask_e, other=0.0)


@triton.jit
def _odd_tile(rows, M, stride, j, in_body, edge_cols, in_edge, VEC: tl.constexpr):
    """A tile of realigned rows: (row mask, body offsets, edge offsets, body mask, edge mask). The
    body starts at each row's offset rounded up to a multiple of VEC, computed as such so that the
    compiler sees the alignment and loads whole vectors."""
    row_mask = rows < M
    at = rows.to(tl.int64) * stride
    body_at = ((at + VEC - 1) // VEC * VEC)[:, None] + j[None, :]
    edge_at = at[:, None] + edge_cols[None, :]
    return row_mask, body_at, edge_at, row_mask[:, None] & in_body[None, :], row_mask[:, None] & in_edge[None, :]


@triton.jit
def _row_sum(body, edge):
    """Per row, the sum of a realigned row's body and edge terms. Its rounding depends on which
    columns are body and which edge, that is on where the row starts within a vector: the same row
    at another place in the batch can get other bits (not batch invariant; see the module
    docstring)."""
    return tl.sum(body, axis=1) + tl.sum(edge, axis=1)


@triton.jit(do_not_specialize=["M", "eps"])
def _norm_fwd_odd_kernel(
    X, R, W, B, Y, H, MEAN, RSTD,
    M, N, stride, eps,
    LAYERNORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, VEC: tl.constexpr,
):  # fmt: skip
    """The forward of rows whose length is no multiple of a 16-byte vector (``Config.realign``).
    Program p walks rows p, p + G, p + 2G, ... (G programs, a multiple of VEC), which all start at
    the same offset within a vector: their bodies are read and written in whole vectors from each
    row's first aligned element, their heads and tails element-wise, and the weight (and bias) is
    loaded once, shifted to match. The next tile's loads are issued before this tile's math (few
    programs per SM: their loads must keep enough bytes in flight)."""
    me = tl.program_id(0)
    programs = tl.num_programs(0)
    head, j, in_body, edge_cols, in_edge = _odd_columns(me, stride, N, VEC, BLOCK_N)
    if HAS_WEIGHT:
        w_body, w_edge = _load_shifted(W, head, j, in_body, edge_cols, in_edge)
    if HAS_BIAS:
        b_body, b_edge = _load_shifted(B, head, j, in_body, edge_cols, in_edge)

    rows = me + tl.arange(0, ROWS) * programs
    _, body_at, edge_at, mask_b, mask_e = _odd_tile(rows, M, stride, j, in_body, edge_cols, in_edge, VEC)
    xb_next, xe_next = _load_split(X, body_at, edge_at, mask_b, mask_e)
    if HAS_RESIDUAL:
        rb_next, re_next = _load_split(R, body_at, edge_at, mask_b, mask_e)
    for t in range(tl.cdiv(tl.cdiv(M - me, programs), ROWS)):
        here, here_b, here_e = rows, body_at, edge_at
        xb, xe = xb_next.to(tl.float32), xe_next.to(tl.float32)
        if HAS_RESIDUAL:
            rb, re = rb_next.to(tl.float32), re_next.to(tl.float32)

        rows += ROWS * programs
        _, body_at, edge_at, next_b, next_e = _odd_tile(rows, M, stride, j, in_body, edge_cols, in_edge, VEC)
        xb_next, xe_next = _load_split(X, body_at, edge_at, next_b, next_e)
        if HAS_RESIDUAL:
            rb_next, re_next = _load_split(R, body_at, edge_at, next_b, next_e)

        if HAS_RESIDUAL:  # h rounded once and stored (residual_out); the statistics are h's as stored
            hb = _round_to(xb + rb, H.dtype.element_ty)
            he = _round_to(xe + re, H.dtype.element_ty)
            tl.store(H + here_b, hb, mask=mask_b)
            tl.store(H + here_e, he, mask=mask_e)
            xb, xe = hb.to(tl.float32), he.to(tl.float32)
        here_mask = here < M
        if LAYERNORM:
            mean = _row_sum(xb, xe) / N
            xb = tl.where(mask_b, xb - mean[:, None], 0.0)
            xe = tl.where(mask_e, xe - mean[:, None], 0.0)
            tl.store(MEAN + here, mean, mask=here_mask)
        rstd = _rstd(_row_sum(xb * xb, xe * xe) / N, eps)
        tl.store(RSTD + here, rstd, mask=here_mask)
        yb = xb * rstd[:, None]
        ye = xe * rstd[:, None]
        if HAS_WEIGHT:
            yb, ye = yb * w_body, ye * w_edge
        if HAS_BIAS:
            yb, ye = yb + b_body, ye + b_edge
        tl.store(Y + here_b, yb.to(Y.dtype.element_ty), mask=mask_b)
        tl.store(Y + here_e, ye.to(Y.dtype.element_ty), mask=mask_e)
        mask_b, mask_e = next_b, next_e


def row_shape(x) -> tuple[int, int, int]:
    """(M, N, H): the rows of x, and H the heads of a (T, H, N) per-head view whose rows the kernels
    address themselves (0 for (M, N) rows)."""
    if x.dim() == 3:
        t, heads, n = x.shape
        return t * heads, n, heads
    m, n = x.shape
    return m, n, 0


def row_strides(t, heads: int) -> tuple[int, int]:
    """(stride, head stride) of a row tensor as ``_row_offsets`` takes them: an (M, N) tensor's row
    stride; with ``heads``, a (T, H, N) view's two strides, or (M, N) rows (the outputs) as such a
    view."""
    if not heads:
        return t.stride(0), 0
    return (t.stride(0), t.stride(1)) if t.dim() == 3 else (heads * t.stride(0), t.stride(0))


def realigned(cfg: Config, n: int, heads: int, tensors) -> tuple[int, int]:
    """(row stride, vector) where the realigned kernels take these row tensors, else (0, 0): rows
    whose length is no multiple of a 16-byte vector, whole rows to a program (no chunks, no
    slices), (M, N) rows (not per-head views), and one row stride and a 16-byte aligned start for
    every tensor, so that a row starts at the same offset within a vector in each of them."""
    if not cfg.realign or cfg.chunk or cfg.slice or heads:  # (the common case first: host time)
        return 0, 0
    vec = 16 // tensors[0].element_size()
    if n % vec == 0:
        return 0, 0
    stride = tensors[0].stride(0)
    if any(t.stride(0) != stride or t.data_ptr() % 16 for t in tensors):
        return 0, 0
    return stride, vec


def realigned_grid(cfg: Config, m: int, vec: int, device) -> int:
    """The realigned kernels' persistent grid: a multiple of the vector, so that a program's rows
    share their offset within it; ``programs_per_sm`` per SM rounded down (rounded up, the programs
    past what the SMs hold would run as a second wave), no more than the row tiles need, at
    least one vector's worth."""
    programs = min(cfg.programs_per_sm * sm_count(device) // vec, triton.cdiv(triton.cdiv(m, cfg.rows), vec))
    return max(programs, 1) * vec


def slots_fit(rows: int, slices: int) -> bool:
    """Whether a block's slots (rows x slices, padded to a power of two) fit one warp, as the
    exchanging kernels' wait needs (``_await_slots``), forward and backward."""
    return rows * triton.next_power_of_2(slices) <= SYNC_SLOTS_MAX


def exchange_grid(cfg: Config, m: int, n: int, sms: int) -> tuple[int, int]:
    """(row groups, slices) of the exchanging sliced forward (``_norm_fwd_sync_kernel``): a grid of
    groups x slices programs, one per SM, so that every sibling a program waits for is resident
    (``exchange_groups``). Groups 0 where it cannot run: a row's slices outnumber the SMs, or a
    block's slots (rows x slices, padded to a power of two) do not fit one warp (``_await_slots``)."""
    slices = triton.cdiv(n, cfg.slice)
    if not slots_fit(cfg.rows, slices):
        return 0, slices
    return exchange_groups(triton.cdiv(m, cfg.rows), slices, sms), slices


def launch_fwd_exchange(cfg: Config, x, weight, bias, eps, layernorm: bool, y, mean, rstd, residual, residual_out,
                        groups: int, stats, spin: int = SPIN_LIMIT):  # fmt: skip
    """Run the exchanging sliced forward on ``groups`` row groups, posting through ``stats``
    ((1 + layernorm, M, slices) int64, all zero); returns the compiled kernel."""
    M, N, heads = row_shape(x)
    slices = triton.cdiv(N, cfg.slice)
    fused = residual is not None
    r, h = (residual, residual_out) if fused else (x, y)
    (sx, sxh), (sr, srh), (sy, syh), (sh, shh) = (row_strides(t, heads) for t in (x, r, y, h))
    return fast(_norm_fwd_sync_kernel)[(groups * slices,)](  # x, y in place of absent tensors: never touched
        x, r, x if weight is None else weight, x if bias is None else bias, y, h, mean, rstd, stats,
        M, N, sx, sr, sy, sh, eps, max(heads, 1), sxh, srh, syh, shh, slices, spin,
        layernorm, fused, weight is not None, bias is not None,
        cfg.rows, cfg.slice, triton.next_power_of_2(slices), heads > 0, cfg.ahead, num_warps=cfg.warps,
    )  # fmt: skip


def launch_fwd(cfg: Config, x, weight, bias, eps, layernorm: bool, y, mean, rstd, residual=None, residual_out=None):
    """Run the forward with ``cfg`` into y / mean / rstd (and residual_out = x + residual when a
    residual is given); returns the compiled kernel (its ``n_regs`` and ``n_spills`` are the
    compiler's report). x (and residual) may be (T, H, N) per-head views (``row_shape``)."""
    M, N, heads = row_shape(x)
    if cfg.slice and cfg.sync:
        # The exchanging slices where every sibling can be resident (``exchange_grid``); elsewhere,
        # and on the interpreter (whose programs run one after another: a program would wait for a
        # sibling that has not started), the chunked forward in chunks of the slice's width.
        groups, slices = exchange_grid(cfg, M, N, sm_count(x.device)) if x.is_cuda else (0, 0)
        if groups:
            stats = torch.zeros((1 + int(layernorm), M, slices), dtype=torch.int64, device=x.device)
            return launch_fwd_exchange(cfg, x, weight, bias, eps, layernorm, y, mean, rstd, residual, residual_out,
                                       groups, stats)  # fmt: skip
        cfg = replace(cfg, chunk=cfg.chunk or cfg.slice, slice=0, sync=False)
    grid = triton.cdiv(M, cfg.rows)
    if cfg.chunk and cfg.persistent:
        grid = min(grid, cfg.programs_per_sm * sm_count(x.device))
    kernel, width = (_norm_fwd_chunked_kernel, cfg.chunk) if cfg.chunk else (_norm_fwd_row_kernel, bucket(N))
    fused = residual is not None
    r, h = (residual, residual_out) if fused else (x, y)
    stride, vec = realigned(cfg, N, heads, (x, r, y, h))
    if stride:
        return fast(_norm_fwd_odd_kernel)[(realigned_grid(cfg, M, vec, x.device),)](
            x, r, x if weight is None else weight, x if bias is None else bias, y, h, mean, rstd,
            M, N, stride, eps, layernorm, fused, weight is not None, bias is not None,
            cfg.rows, bucket(N), vec, num_warps=cfg.warps,
        )  # fmt: skip
    (sx, sxh), (sr, srh), (sy, syh), (sh, shh) = (row_strides(t, heads) for t in (x, r, y, h))
    exact = () if cfg.chunk else (N if cfg.exact_n else 0,)
    return fast(kernel)[(grid,)](  # x, y in place of absent tensors: never touched
        x, r, x if weight is None else weight, x if bias is None else bias, y, h, mean, rstd,
        M, N, sx, sr, sy, sh, eps, max(heads, 1), sxh, srh, syh, shh,
        layernorm, fused, weight is not None, bias is not None,
        cfg.rows, width, heads > 0, *exact, num_warps=cfg.warps,
    )  # fmt: skip


def op_name(layernorm: bool, fused_add: bool) -> str:
    """The op whose configs a launch uses (``configs.choose``)."""
    return "layernorm" if layernorm else "add_rmsnorm" if fused_add else "rmsnorm"


def norm_fwd(x, weight, bias, eps, layernorm: bool, config: Config | None = None, residual=None):
    """(y, mean or None, rstd, residual_out or None); with ``residual``, the norm of x + residual
    (residual_out, as stored). ``config`` overrides the pinned/heuristic choice."""
    M, N, _ = row_shape(x)
    y = x.new_empty((M, N))
    h = x.new_empty((M, N)) if residual is not None else None
    rstd = x.new_empty(M, dtype=torch.float32)
    mean = x.new_empty(M, dtype=torch.float32) if layernorm else rstd  # unused for RMSNorm

    def launch(cfg: Config):
        return launch_fwd(cfg, x, weight, bias, eps, layernorm, y, mean, rstd, residual, h)

    launch(config or choose(op_name(layernorm, h is not None), "fwd", N, x.device, launch, x.dtype))
    return y, (mean if layernorm else None), rstd, h


# =================================================================================== backward
# (config, N, dtypes, flags, device, strides, alignment) -> programs of the exchanging slice kernel's
# binary an SM holds (configs asking for more than one per SM)
_SYNC_HELD: dict = {}


@triton.jit(do_not_specialize=["M"])
def _norm_bwd_row_kernel(
    DY, X, W, MEAN, RSTD, DRES, DX, DW_PARTIAL, DB_PARTIAL,
    M, N, stride_dy, stride_x, stride_dres, stride_dx,
    HEADS, stride_dyh, stride_xh, stride_dresh, stride_dxh,
    LAYERNORM: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_DRESIDUAL: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, VIEWS: tl.constexpr, REREAD: tl.constexpr, EXACT_N: tl.constexpr,
    PREFETCH: tl.constexpr, ACC_ROWS: tl.constexpr,
):  # fmt: skip
    if EXACT_N:  # Config.exact_n (see the forward)
        N = EXACT_N
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    if REREAD or not PREFETCH:
        w_cols = W + cols  # re-read each row instead (L1-resident): its registers go to dw
    # ACC_ROWS (``Config.acc_rows``): dw / db accumulated per tile row and summed over the rows once
    # at the end. Summed per block instead, the sum over the tile's rows crosses warps (a round trip
    # through shared memory and a barrier per block), which short rows, many to a tile, pay on
    # every block; the price is a second row-tile of registers.
    if ACC_ROWS:
        dw = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
        db = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    else:
        dw = tl.zeros([BLOCK_N], dtype=tl.float32)
        db = tl.zeros([BLOCK_N], dtype=tl.float32)

    first, last = _row_block_range(M, ROWS, tl.program_id(0), tl.num_programs(0))
    end = tl.minimum(M, last * ROWS)  # rows from here on are the next program's
    # Software pipelining by hand (PREFETCH): the next block's loads are issued before this block's
    # math, so a program always has a block in flight while it computes. The prefetched values wait
    # in registers in their storage dtype (for bf16, half the registers of the fp32 math). Without
    # it, those registers go to a wider row (a whole 16384-wide row per program, as a first-shot
    # LLM kernel does) and the other programs of the SM hide the latency.
    rows = first * ROWS + tl.arange(0, ROWS)
    if PREFETCH:
        row_mask = rows < end
        mask = row_mask[:, None] & col_mask[None, :]
        x_next = tl.load(X + _row_offsets(rows, stride_x, stride_xh, HEADS, VIEWS)[:, None] + cols[None, :],
                         mask=mask, other=0.0)  # fmt: skip
        dy_next = tl.load(DY + _row_offsets(rows, stride_dy, stride_dyh, HEADS, VIEWS)[:, None] + cols[None, :],
                          mask=mask, other=0.0)  # fmt: skip
        rstd_next = tl.load(RSTD + rows, mask=row_mask, other=0.0)
        mean_next = tl.load(MEAN + rows, mask=row_mask, other=0.0) if LAYERNORM else rstd_next
    for block in range(first, last):
        if PREFETCH:
            x, dy, rstd, mean = x_next.to(tl.float32), dy_next.to(tl.float32), rstd_next, mean_next
        mask = (rows < end)[:, None] & col_mask[None, :]
        x_ptrs = X + _row_offsets(rows, stride_x, stride_xh, HEADS, VIEWS)[:, None] + cols[None, :]
        dy_ptrs = DY + _row_offsets(rows, stride_dy, stride_dyh, HEADS, VIEWS)[:, None] + cols[None, :]
        dres_ptrs = DRES + _row_offsets(rows, stride_dres, stride_dresh, HEADS, VIEWS)[:, None] + cols[None, :]
        dx_ptrs = DX + _row_offsets(rows, stride_dx, stride_dxh, HEADS, VIEWS)[:, None] + cols[None, :]
        if not PREFETCH:
            x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptrs, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(RSTD + rows, mask=rows < end, other=0.0)
            mean = tl.load(MEAN + rows, mask=rows < end, other=0.0) if LAYERNORM else rstd

        rows += ROWS
        if PREFETCH:
            row_mask = rows < end
            next_mask = row_mask[:, None] & col_mask[None, :]
            next_x = X + _row_offsets(rows, stride_x, stride_xh, HEADS, VIEWS)[:, None] + cols[None, :]
            next_dy = DY + _row_offsets(rows, stride_dy, stride_dyh, HEADS, VIEWS)[:, None] + cols[None, :]
            x_next = tl.load(next_x, mask=next_mask, other=0.0)
            dy_next = tl.load(next_dy, mask=next_mask, other=0.0)
            rstd_next = tl.load(RSTD + rows, mask=row_mask, other=0.0)
            mean_next = tl.load(MEAN + rows, mask=row_mask, other=0.0) if LAYERNORM else rstd_next

        if (REREAD or not PREFETCH) and HAS_WEIGHT:
            w = tl.load(w_cols, mask=col_mask, other=0.0).to(tl.float32)
        if LAYERNORM:
            x = x - mean[:, None]
        xhat = x * rstd[:, None]  # padding lanes hold junk here, but dy (hence g) is 0 there
        g = dy * w[None, :] if HAS_WEIGHT else dy
        c1 = tl.sum(g * xhat, axis=1) / N
        if LAYERNORM:
            c2 = tl.sum(g, axis=1) / N
        if REREAD:
            # Rows too wide to keep x, dy and the accumulators in registers together: read the row
            # again (it was read a moment ago: L1/L2 hits, no DRAM traffic) rather than spill.
            # evict_first marks the last use; it also keeps the compiler from reusing the first read.
            x = tl.load(x_ptrs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
            dy = tl.load(dy_ptrs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
            if LAYERNORM:
                x = x - mean[:, None]
            xhat = x * rstd[:, None]
            if HAS_WEIGHT:
                g = dy * tl.load(w_cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
            else:
                g = dy
        if LAYERNORM:
            dx = (g - xhat * c1[:, None] - c2[:, None]) * rstd[:, None]
            if ACC_ROWS:
                db += dy
            else:
                db += tl.sum(dy, axis=0)
        else:
            dx = (g - xhat * c1[:, None]) * rstd[:, None]
        if HAS_DRESIDUAL:
            # the fused add's dresidual_out, added before dx's single rounding. Loaded here, not
            # prefetched with x and dy: built for sm_90a (``sm90a_build``), a variant prefetching
            # it took N = 4096 (8 warps) from 99 to 150 registers, one program per SM where the
            # config launches two.
            dx += tl.load(dres_ptrs, mask=mask, other=0.0).to(tl.float32)
        if HAS_WEIGHT:
            if ACC_ROWS:
                dw += dy * xhat
            else:
                dw += tl.sum(dy * xhat, axis=0)
        tl.store(dx_ptrs, dx.to(DX.dtype.element_ty), mask=mask)

    if ACC_ROWS:
        dw = tl.sum(dw, axis=0)
        db = tl.sum(db, axis=0)
    partial = tl.program_id(0).to(tl.int64) * N + cols
    if HAS_WEIGHT:
        tl.store(DW_PARTIAL + partial, dw, mask=col_mask)
    if LAYERNORM:
        tl.store(DB_PARTIAL + partial, db, mask=col_mask)


@triton.jit(do_not_specialize=["M"])
def _norm_bwd_odd_kernel(
    DY, X, W, MEAN, RSTD, DRES, DX, DW_PARTIAL, DB_PARTIAL,
    M, N, stride,
    LAYERNORM: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_DRESIDUAL: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, VEC: tl.constexpr,
):  # fmt: skip
    """The backward of rows whose length is no multiple of a 16-byte vector (``Config.realign``):
    the row kernel's loop (the next tile's loads issued before this one's math), over rows
    p, p + G, ... as in ``_norm_fwd_odd_kernel``, so that the weight and the dw / db accumulators
    hold one shift for all of a program's rows: the body's columns start at ``head``, the head's
    and tail's are ``edge_cols``. The partial rows are written back in natural column order."""
    me = tl.program_id(0)
    programs = tl.num_programs(0)
    head, j, in_body, edge_cols, in_edge = _odd_columns(me, stride, N, VEC, BLOCK_N)
    if HAS_WEIGHT:
        w_body, w_edge = _load_shifted(W, head, j, in_body, edge_cols, in_edge)
    dw_body = tl.zeros([BLOCK_N], dtype=tl.float32)
    db_body = tl.zeros([BLOCK_N], dtype=tl.float32)
    dw_edge = tl.zeros([2 * VEC], dtype=tl.float32)
    db_edge = tl.zeros([2 * VEC], dtype=tl.float32)

    rows = me + tl.arange(0, ROWS) * programs
    row_mask, body_at, edge_at, mask_b, mask_e = _odd_tile(rows, M, stride, j, in_body, edge_cols, in_edge, VEC)
    xb_next, xe_next = _load_split(X, body_at, edge_at, mask_b, mask_e)
    dyb_next, dye_next = _load_split(DY, body_at, edge_at, mask_b, mask_e)
    rstd_next = tl.load(RSTD + rows, mask=row_mask, other=0.0)
    mean_next = tl.load(MEAN + rows, mask=row_mask, other=0.0) if LAYERNORM else rstd_next
    for t in range(tl.cdiv(tl.cdiv(M - me, programs), ROWS)):
        xb, dyb, xe, dye = xb_next.to(tl.float32), dyb_next.to(tl.float32), xe_next.to(tl.float32), dye_next.to(tl.float32)
        rstd, mean = rstd_next, mean_next
        here_b, here_e = body_at, edge_at

        rows += ROWS * programs
        row_mask, body_at, edge_at, next_b, next_e = _odd_tile(rows, M, stride, j, in_body, edge_cols, in_edge, VEC)
        xb_next, xe_next = _load_split(X, body_at, edge_at, next_b, next_e)
        dyb_next, dye_next = _load_split(DY, body_at, edge_at, next_b, next_e)
        rstd_next = tl.load(RSTD + rows, mask=row_mask, other=0.0)
        mean_next = tl.load(MEAN + rows, mask=row_mask, other=0.0) if LAYERNORM else rstd_next

        if LAYERNORM:
            xb, xe = xb - mean[:, None], xe - mean[:, None]
        xhat_b, xhat_e = xb * rstd[:, None], xe * rstd[:, None]  # padding lanes: dy (hence g) is 0
        gb, ge = (dyb * w_body, dye * w_edge) if HAS_WEIGHT else (dyb, dye)
        c1 = _row_sum(gb * xhat_b, ge * xhat_e) / N
        if LAYERNORM:
            c2 = _row_sum(gb, ge) / N
            dxb = (gb - xhat_b * c1[:, None] - c2[:, None]) * rstd[:, None]
            dxe = (ge - xhat_e * c1[:, None] - c2[:, None]) * rstd[:, None]
            db_body += tl.sum(dyb, axis=0)
            db_edge += tl.sum(dye, axis=0)
        else:
            dxb = (gb - xhat_b * c1[:, None]) * rstd[:, None]
            dxe = (ge - xhat_e * c1[:, None]) * rstd[:, None]
        if HAS_DRESIDUAL:  # (not prefetched: see the row kernel)
            dxb += tl.load(DRES + here_b, mask=mask_b, other=0.0).to(tl.float32)
            dxe += tl.load(DRES + here_e, mask=mask_e, other=0.0).to(tl.float32)
        if HAS_WEIGHT:
            dw_body += tl.sum(dyb * xhat_b, axis=0)
            dw_edge += tl.sum(dye * xhat_e, axis=0)
        tl.store(DX + here_b, dxb.to(DX.dtype.element_ty), mask=mask_b)
        tl.store(DX + here_e, dxe.to(DX.dtype.element_ty), mask=mask_e)
        mask_b, mask_e = next_b, next_e

    partial = me.to(tl.int64) * N
    if HAS_WEIGHT:
        _store_shifted(DW_PARTIAL + partial, head, j, in_body, edge_cols, in_edge, dw_body, dw_edge)
    if LAYERNORM:
        _store_shifted(DB_PARTIAL + partial, head, j, in_body, edge_cols, in_edge, db_body, db_edge)


@triton.jit
def _row_terms(X, DY, W, x_rows, dy_rows, row_mask, cols, col_mask, mean,
               LAYERNORM: tl.constexpr, HAS_WEIGHT: tl.constexpr):  # fmt: skip
    """The [rows, cols] tiles of g * (x - mean) and g, whose row sums times rstd / N and / N are c1
    and c2 (``x_rows``, ``dy_rows``: the rows' element offsets). Centring by the given mean keeps
    the sum of a long row from cancelling."""
    mask = row_mask[:, None] & col_mask[None, :]
    x = tl.load(X + x_rows[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + dy_rows[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if LAYERNORM:
        x = tl.where(mask, x - mean[:, None], 0.0)
    if HAS_WEIGHT:
        dy = dy * tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    return dy * x, dy


@triton.jit(do_not_specialize=["M"])
def _norm_bwd_row_sums_kernel(
    DY, X, W, MEAN, ROW_SUMS,
    M, N, stride_dy, stride_x, HEADS, stride_dyh, stride_xh,
    LAYERNORM: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    ROWS: tl.constexpr, SLICE: tl.constexpr, SLICES: tl.constexpr, VIEWS: tl.constexpr,
):  # fmt: skip
    """Pass 1 of the two-kernel backward: ROW_SUMS[k, row, slice] = the row sum over one column
    slice of ``_row_terms``' k-th tile (k = 0: g * (x - mean), k = 1: g), one tile per program."""
    me = tl.program_id(0) % SLICES
    rows = (tl.program_id(0) // SLICES) * ROWS + tl.arange(0, ROWS)
    row_mask = rows < M
    cols = me * SLICE + tl.arange(0, SLICE)
    mean = tl.load(MEAN + rows, mask=row_mask, other=0.0) if LAYERNORM else tl.zeros([ROWS], dtype=tl.float32)
    x_rows = _row_offsets(rows, stride_x, stride_xh, HEADS, VIEWS)
    dy_rows = _row_offsets(rows, stride_dy, stride_dyh, HEADS, VIEWS)
    gxc, g = _row_terms(X, DY, W, x_rows, dy_rows, row_mask, cols, cols < N, mean, LAYERNORM, HAS_WEIGHT)
    rows = rows.to(tl.int64)
    tl.store(ROW_SUMS + rows * SLICES + me, tl.sum(gxc, axis=1), mask=row_mask)
    if LAYERNORM:
        tl.store(ROW_SUMS + (M + rows) * SLICES + me, tl.sum(g, axis=1), mask=row_mask)


@triton.jit(do_not_specialize=["M"])
def _norm_bwd_slice_kernel(
    DY, X, W, MEAN, RSTD, ROW_SUMS, DRES, DX, DW_PARTIAL, DB_PARTIAL,
    M, N, stride_dy, stride_x, stride_dres, stride_dx,
    HEADS, stride_dyh, stride_xh, stride_dresh, stride_dxh,
    LAYERNORM: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_DRESIDUAL: tl.constexpr,
    ROWS: tl.constexpr, SLICE: tl.constexpr, SLICES: tl.constexpr, SLICES_P2: tl.constexpr,
    SUMS_GIVEN: tl.constexpr, STREAM: tl.constexpr, VIEWS: tl.constexpr, SYNC: tl.constexpr,
    SPIN, AHEAD: tl.constexpr,
):  # fmt: skip
    """The backward for rows too wide for one program's registers. Each program owns one column
    slice of the rows of its row group: dx, and dw / db for its slice, accumulated in registers
    over the group's rows like the row kernel's. The row reductions need the whole row; they come
    from ``_norm_bwd_row_sums_kernel``'s per-slice sums (``SUMS_GIVEN``), from the other slices,
    streamed here in tiles of STREAM columns, or (``SYNC``) from the siblings themselves: each
    program posts its slice's sums of a row block to ROW_SUMS (int64 slots, zeroed by the launcher)
    and waits for the others' before it computes dx. x and dy are then read once, from DRAM (3 units
    of traffic), and the wait overlaps the next block's loads, issued before it. The siblings must be
    resident together: the launcher keeps the grid to one program per SM, or to the config's
    ``programs_per_sm`` once the first launch's binary says an SM holds that many
    (``harness.spec.occupancy``).

    Streaming reads every row SLICES times, once from DRAM and then from L2: the SLICES siblings of
    a row group are adjacent program ids, resident together and walking the same rows in step:
    x and dy come from DRAM once, but each row waits for its L2 round trips, which made it slower
    than the two-kernel way where it was timed."""
    me = tl.program_id(0) % SLICES
    group = tl.program_id(0) // SLICES
    first, last = _row_block_range(M, ROWS, group, tl.num_programs(0) // SLICES)
    end = tl.minimum(M, last * ROWS)
    cols = me * SLICE + tl.arange(0, SLICE)
    col_mask = cols < N
    dw = tl.zeros([SLICE], dtype=tl.float32)
    db = tl.zeros([SLICE], dtype=tl.float32)
    spin = SPIN

    # the own slice of the next row block is loaded while this one is computed (see the row kernel)
    rows = first * ROWS + tl.arange(0, ROWS)
    mask = (rows < end)[:, None] & col_mask[None, :]
    x_rows = _row_offsets(rows, stride_x, stride_xh, HEADS, VIEWS)
    dy_rows = _row_offsets(rows, stride_dy, stride_dyh, HEADS, VIEWS)
    x_next = tl.load(X + x_rows[:, None] + cols[None, :], mask=mask, other=0.0)
    dy_next = tl.load(DY + dy_rows[:, None] + cols[None, :], mask=mask, other=0.0)
    if AHEAD == 2:  # and the block after it (in storage dtype: 16-bit rows take half the registers)
        mask = (rows + ROWS < end)[:, None] & col_mask[None, :]
        x_rows = _row_offsets(rows + ROWS, stride_x, stride_xh, HEADS, VIEWS)
        dy_rows = _row_offsets(rows + ROWS, stride_dy, stride_dyh, HEADS, VIEWS)
        x_next2 = tl.load(X + x_rows[:, None] + cols[None, :], mask=mask, other=0.0)
        dy_next2 = tl.load(DY + dy_rows[:, None] + cols[None, :], mask=mask, other=0.0)
    for block in range(first, last):
        row_mask = rows < end
        mask = row_mask[:, None] & col_mask[None, :]
        rows64 = rows.to(tl.int64)
        rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
        mean = tl.load(MEAN + rows, mask=row_mask, other=0.0) if LAYERNORM else tl.zeros([ROWS], dtype=tl.float32)
        if SUMS_GIVEN and not SYNC:
            # added in slice order, whichever program computed them: deterministic
            k = tl.arange(0, SLICES_P2)
            sums = ROW_SUMS + rows64[:, None] * SLICES + k[None, :]
            sums_mask = row_mask[:, None] & (k < SLICES)[None, :]
            sum_gxc = tl.sum(tl.load(sums, mask=sums_mask, other=0.0), axis=1)
            if LAYERNORM:
                sum_g = tl.sum(tl.load(sums + M * SLICES, mask=sums_mask, other=0.0), axis=1)
        elif not SYNC:
            # The other slices first, while this block's own slice still waits in its storage dtype
            # (half the registers of fp32), in tiles of STREAM columns summed lane-wise.
            acc_gxc = tl.zeros([ROWS, STREAM], dtype=tl.float32)
            acc_g = tl.zeros([ROWS, STREAM], dtype=tl.float32)
            for j in range(SLICE // STREAM, SLICES * SLICE // STREAM):  # from the next slice on, wrapping
                other = (me * SLICE + j * STREAM) % (SLICES * SLICE) + tl.arange(0, STREAM)
                gxc, g_other = _row_terms(X, DY, W, x_rows, dy_rows, row_mask, other, other < N, mean,
                                          LAYERNORM, HAS_WEIGHT)  # fmt: skip
                acc_gxc += gxc
                acc_g += g_other  # (dead code for RMSNorm, dropped by the compiler)
            sum_gxc = tl.sum(acc_gxc, axis=1)
            sum_g = tl.sum(acc_g, axis=1)

        x, dy = x_next.to(tl.float32), dy_next.to(tl.float32)
        if SYNC:  # this slice's part of the row sums, posted before the next block's loads go out
            gs = dy * tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :] if HAS_WEIGHT else dy
            xs = x - mean[:, None] if LAYERNORM else x
            _publish(ROW_SUMS, rows64 * SLICES + me, tl.sum(gs * xs, axis=1), row_mask)
            if LAYERNORM:
                _publish(ROW_SUMS, (M + rows64) * SLICES + me, tl.sum(gs, axis=1), row_mask)
        if AHEAD == 2:
            x_next, dy_next = x_next2, dy_next2
        next_mask = (rows + AHEAD * ROWS < end)[:, None] & col_mask[None, :]
        x_rows = _row_offsets(rows + AHEAD * ROWS, stride_x, stride_xh, HEADS, VIEWS)
        dy_rows = _row_offsets(rows + AHEAD * ROWS, stride_dy, stride_dyh, HEADS, VIEWS)
        if AHEAD == 2:
            x_next2 = tl.load(X + x_rows[:, None] + cols[None, :], mask=next_mask, other=0.0)
            dy_next2 = tl.load(DY + dy_rows[:, None] + cols[None, :], mask=next_mask, other=0.0)
        else:
            x_next = tl.load(X + x_rows[:, None] + cols[None, :], mask=next_mask, other=0.0)
            dy_next = tl.load(DY + dy_rows[:, None] + cols[None, :], mask=next_mask, other=0.0)
        if SYNC:
            # LayerNorm's two sums in one wait (``_await_slots``); RMSNorm's second is its first, unread
            sum_gxc, sum_g, spin = _await_sums(ROW_SUMS, M * SLICES, rows64, SLICES, SLICES_P2, row_mask, spin,
                                               1 + LAYERNORM)  # fmt: skip
        if LAYERNORM:
            x = x - mean[:, None]
        if HAS_WEIGHT:  # re-read per block (an L1 hit) rather than held: its registers go to dw / db
            g = dy * tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        else:
            g = dy
        if not SUMS_GIVEN and not SYNC:
            sum_gxc += tl.sum(g * x, axis=1)  # padding lanes: g is 0 there
            sum_g += tl.sum(g, axis=1)
        xhat = x * rstd[:, None]
        c1 = sum_gxc * rstd / N
        if LAYERNORM:
            dx = (g - xhat * c1[:, None] - (sum_g / N)[:, None]) * rstd[:, None]
            db += tl.sum(dy, axis=0)
        else:
            dx = (g - xhat * c1[:, None]) * rstd[:, None]
        if HAS_DRESIDUAL:  # (not prefetched: see the row kernel)
            dres_rows = _row_offsets(rows, stride_dres, stride_dresh, HEADS, VIEWS)
            dx += tl.load(DRES + dres_rows[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_WEIGHT:
            dw += tl.sum(dy * xhat, axis=0)
        dx_rows = _row_offsets(rows, stride_dx, stride_dxh, HEADS, VIEWS)
        tl.store(DX + dx_rows[:, None] + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        rows += ROWS

    partial = group.to(tl.int64) * N + cols
    if HAS_WEIGHT:
        tl.store(DW_PARTIAL + partial, dw, mask=col_mask)
    if LAYERNORM:
        tl.store(DB_PARTIAL + partial, db, mask=col_mask)


@triton.jit
def _sum_partials_kernel(PARTIALS, OUT, P, N, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """OUT[k, :] = sum over p of PARTIALS[k, p, :], in fp32, always in the same order."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.program_id(1).to(tl.int64)
    acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    for p0 in range(0, P, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        mask = (p < P)[:, None] & (cols < N)[None, :]
        acc += tl.load(PARTIALS + (k * P + p[:, None]) * N + cols[None, :], mask=mask, other=0.0)
    tl.store(OUT + k * N + cols, tl.sum(acc, axis=0).to(OUT.dtype.element_ty), mask=cols < N)


def launch_bwd(cfg: Config, dy, x, weight, mean, rstd, layernorm: bool, dx, sums, dresidual=None):
    """Run the backward with ``cfg`` into dx (plus ``dresidual`` when given) and ``sums`` (rows: dw
    if weight, then db if layernorm); returns the compiled main kernel (see ``launch_fwd``)."""
    M, N, heads = row_shape(x)
    dres = x if dresidual is None else dresidual  # x: a placeholder, never read
    (sdy, sdyh), (sx, sxh), (sdres, sdresh), (sdx, sdxh) = (row_strides(t, heads) for t in (dy, x, dres, dx))
    n_sums = sums.shape[0]
    w = x if weight is None else weight  # x, rstd: placeholders, never read
    mean = rstd if mean is None else mean
    slices = triton.cdiv(N, cfg.slice) if cfg.slice else 1
    # Siblings that wait for each other must all be resident: one program per SM, and a row's slices
    # no more than the SMs. A block's slots must fit one warp (``_await_sums``). Where either cannot
    # hold (or on the interpreter, whose programs run one after another), the row sums come from the
    # first kernel instead.
    sync = (bool(cfg.slice and cfg.sync) and x.is_cuda and slices <= sm_count(x.device)
            and slots_fit(cfg.rows, slices))  # fmt: skip
    # Several exchanging programs per SM (``cfg.programs_per_sm``) only once the binary has said that
    # an SM holds them: the first launch of each binary (keyed by what specializes it: the dtypes,
    # flags, strides and 16-byte alignments) runs one per SM
    held_key = None
    programs_per_sm = 1 if sync else cfg.programs_per_sm
    if sync and cfg.programs_per_sm > 1:
        held_key = (cfg, N, x.dtype, w.dtype, layernorm, dresidual is not None, heads > 0, x.get_device(),
                    sdy, sx, sdres, sdx, sdyh, sxh, sdresh,
                    (dy.data_ptr() | x.data_ptr() | w.data_ptr() | dres.data_ptr()) % 16 == 0)  # fmt: skip
        programs_per_sm = min(cfg.programs_per_sm, _SYNC_HELD.get(held_key, 1))
    # one partial row of dw / db per program, or per row group of the slice kernel
    stride, vec = realigned(cfg, N, heads, (dy, x, dres, dx))
    if stride:
        partial_rows = realigned_grid(cfg, M, vec, x.device)
    else:
        partial_rows = min(triton.cdiv(M, cfg.rows), max(1, programs_per_sm * sm_count(x.device) // slices))
    partials = torch.empty((max(n_sums, 1), partial_rows, N), dtype=torch.float32, device=x.device)
    if stride:
        compiled = fast(_norm_bwd_odd_kernel)[(partial_rows,)](
            dy, x, w, mean, rstd, dres, dx, partials[0], partials[n_sums - 1], M, N, stride,
            layernorm, weight is not None, dresidual is not None, cfg.rows, bucket(N), vec,
            num_warps=cfg.warps,
        )  # fmt: skip
    elif cfg.slice:
        row_sums = rstd  # never read unless the first kernel fills it
        if sync:
            row_sums = torch.zeros((1 + int(layernorm), M, slices), dtype=torch.int64, device=x.device)
        elif cfg.row_sums or cfg.sync:
            row_sums = x.new_empty((2, M, slices), dtype=torch.float32)
            grid = (slices * triton.cdiv(M, cfg.rows),)
            fast(_norm_bwd_row_sums_kernel)[grid](
                dy, x, w, mean, row_sums, M, N, sdy, sx, max(heads, 1), sdyh, sxh,
                layernorm, weight is not None, cfg.rows, cfg.slice, slices, heads > 0, num_warps=cfg.warps,
            )  # fmt: skip
        compiled = fast(_norm_bwd_slice_kernel)[(partial_rows * slices,)](
            dy, x, w, mean, rstd, row_sums, dres, dx, partials[0], partials[n_sums - 1],
            M, N, sdy, sx, sdres, sdx, max(heads, 1), sdyh, sxh, sdresh, sdxh,
            layernorm, weight is not None, dresidual is not None,
            cfg.rows, cfg.slice, slices, triton.next_power_of_2(slices), cfg.row_sums or cfg.sync,
            min(cfg.chunk or cfg.slice, cfg.slice), heads > 0, sync, SPIN_LIMIT, cfg.ahead, num_warps=cfg.warps,
        )  # fmt: skip
        if held_key is not None and held_key not in _SYNC_HELD:
            _SYNC_HELD[held_key] = held(compiled, cfg.warps)
    else:
        args = (
            dy, x, w, mean, rstd, dres, dx, partials[0], partials[n_sums - 1],
            M, N, sdy, sx, sdres, sdx, max(heads, 1), sdyh, sxh, sdresh, sdxh,
            layernorm, weight is not None, dresidual is not None, cfg.rows,
        )  # fmt: skip
        compiled = fast(_norm_bwd_row_kernel)[(partial_rows,)](
            *args, bucket(N), heads > 0, cfg.reread, N if cfg.exact_n else 0, cfg.prefetch, cfg.acc_rows,
            num_warps=cfg.warps,
        )  # fmt: skip
    if n_sums:
        if x.is_cuda:
            # narrow column strips, so that even N = 1024 spreads over dozens of SMs: a handful of
            # programs each walking all the partials would cost as much as the main kernel
            block_n = min(max(bucket(N) // 256, 16), 256)
            block_p = 4096 // block_n
        else:  # the interpreter pays per program and per operation, not per element
            block_n, block_p = min(bucket(N), 16384), 16
        grid = (triton.cdiv(N, block_n), n_sums)
        fast(_sum_partials_kernel)[grid](partials, sums, partial_rows, N, block_p, block_n, num_warps=4)
    return compiled


def norm_bwd(dy, x, weight, mean, rstd, layernorm: bool, config: Config | None = None, dresidual=None):
    """(dx, dw or None, db or None); dx + ``dresidual`` when given (the fused add's dh). dw and db
    come back in the weight's dtype (x's without a weight). ``config`` overrides the
    pinned/heuristic choice."""
    M, N, _ = row_shape(x)
    has_weight = weight is not None
    dx = x.new_empty((M, N))
    n_sums = int(has_weight) + int(layernorm)
    sums = x.new_empty((n_sums, N), dtype=weight.dtype if has_weight else x.dtype)

    def launch(cfg: Config):
        return launch_bwd(cfg, dy, x, weight, mean, rstd, layernorm, dx, sums, dresidual)

    if config is None:
        config = choose(op_name(layernorm, dresidual is not None), "bwd", N, x.device, launch, x.dtype)
        config = for_weight(config, "bwd", weight.dtype if has_weight else x.dtype, x.dtype)
    launch(config)
    dw = sums[0] if has_weight else None
    db = sums[n_sums - 1] if layernorm else None
    return dx, dw, db


# ============================================================================ the contract
def contract(fwd_config: Config | None = None, bwd_config: Config | None = None):
    """The six contract functions, on the pinned/heuristic configs or on the given ones (what
    ``normbench tune`` checks and times each candidate with)."""

    def fwd(x, residual, weight, bias, eps, layernorm):
        y, mean, rstd, residual_out = norm_fwd(x, weight, bias, eps, layernorm, fwd_config, residual)
        return y, residual_out, mean, rstd

    def bwd(dy, dresidual_out, x, weight, mean, rstd, layernorm):
        return norm_bwd(dy, x, weight, mean, rstd, layernorm, bwd_config, dresidual_out)

    return contract_functions(fwd, bwd)


(rmsnorm_fwd, rmsnorm_bwd, layernorm_fwd, layernorm_bwd, add_rmsnorm_fwd, add_rmsnorm_bwd) = contract()
