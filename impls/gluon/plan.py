"""Launch plans for the Gluon kernels: a heuristic from N and x's element size, no per-GPU table.

A plan is a tile of ``[rows, width]`` elements and the ``BlockedLayout`` that spreads it over the
threads of one program. The rules, and why they carry across GPUs (they depend on the 16-byte
vector width, the 32-thread warp and the register file of an SM, the same on every NVIDIA GPU
since Volta, not on SM counts or clocks):

* ``vec`` = 16 bytes / element size: each thread loads and stores 128-bit vectors (8 bf16/fp16
  or 4 fp32 elements), the widest global access there is, where N allows: a row whose bytes are
  not a multiple of 16 (N = 4001) cannot start every row on a 16-byte boundary, so its vector is
  the widest power of two dividing N (one element for an odd N), and the lanes of a warp then
  cover consecutive elements: each load instruction of the warp reads one contiguous run of the
  row. A 16-byte layout over such a row would issue one narrow access per element, 8 per lane,
  each spread over 512 bytes.
* threads along N first: ``width / vec`` threads cover a row with one vector each; a warp spans
  up to 32 of them, and rows narrower than a warp share it (``threads_per_warp = [32 / t, t]``),
  so that a warp never idles on padding when N is small.
* warps along N for wide rows, one per 2 vectors of the row per lane (``threads_n / 64``), at
  most 16: every thread then holds 2-4 vectors of the row (16-64 fp32 registers) and the row
  reduction crosses at most 16 warps through shared memory once. A narrower vector takes as
  many warps as give each lane one 16-byte vector's worth of elements: each element is then its
  own access with its own 64-bit address, and more per lane spill or starve the backward's
  occupancy. Narrow rows get 4 warps, the spare ones along M (``warps_per_cta = [4 / warps_n,
  warps_n]``): a program moves several rows.
* small rows (at most ``SMALL_ROW_VECS`` vectors, 1 KB of 16-bit x: QK-norm's head_dim, small
  models): a lane holds ``LANE_VECS`` vectors of its row, so fewer lanes share a row and its
  reduction takes fewer shuffles, and the tile repeats the layout along M (``reps``) until each
  thread holds ``THREAD_VECS`` vectors of x: one program moves tens of rows, enough bytes in
  flight per thread without a grid of a million tiny programs.
* the row stays in registers up to ``FWD_ROW_BYTES`` of x (forward: 32768 16-bit elements, 64
  fp32 registers per thread at 16 warps; ptxas for sm_90a fits them in its 128-register cap
  without spilling, where 32768 fp32 elements spill) and ``BWD_ROW_MAX`` elements (backward: x,
  dy, dw, db, 16 each, and the next block's x and dy prefetched: up to 128 registers; ptxas
  spills 4-52 bytes per thread in a few fp32 / wide LayerNorm cases, an L1-resident cost far below
  the row-sums pass a narrower limit would add): wider rows are walked in chunks
  (forward, two passes over the row, the second from L2) or cut into column slices (backward).
* LayerNorm's backward on a whole-row tile of 8 warps along N (16-bit rows of 2049-4096 elements
  in 16-byte vectors) moves two rows a program (``LAYERNORM_BWD_ROWS``): at about 120 registers a
  thread, two programs of one row each are all an SM holds, and two rows a program measured
  faster there; not the fused add's (slower), nor at 16 warps (two rows of 32 warps spill).
* the wide backward's slices exchange their row sums through global memory (``kernels``) where
  that measured faster than the row-sums kernel on an H100 (reports/experiments/gluon-wide-sync/):
  up to ``EXCHANGE_SLICES`` slices (at 32 it lost whatever the warps: 28-41% against 54-61%), on
  8 warps from 7 slices (16 warps lost from 8: 53% at 131072 against 67% on 8), LayerNorm only from
  two whole slices and up to four slices of fp32 rows (fp32 at 8 warps not measured).
* the exchanging slices of 16-bit rows in 16-byte vectors up to ``SPREAD_SLICES``' bounds (32768
  columns, LayerNorm's 65536) are narrow and several to an SM: 2048 columns on 4 warps, four a
  program per SM, up to 16384 (LayerNorm: on 2 warps up to 20480), then 4096 columns on 8 warps
  (LayerNorm: 4), two per SM. A program waiting for its siblings' sums leaves the SM to the others'
  loads, where one program per SM (8192-column slices) idled at every wait; and a row of 10240 or
  12288 columns no longer makes one full 8192-column slice and a part whose programs idle half the
  time. Measured on an H100 against those (reports/experiments/gluon-wide-sync/, round 2): RMSNorm
  54-76 -> 81-83% at 10240-24576, LayerNorm 52-65 -> 72-78% at 10240-32768 (49152-65536: 66-70 ->
  71-72), the fused add 70-78 -> 82-84% at 10240-12288 and 20480; from 49152 (RMSNorm, the fused
  add) the 8192-column slices stayed ahead. The launcher still caps the programs per SM at what the
  binary lets an SM hold, so the siblings are always resident.
* rows of 16-bit x whose length is no multiple of a 16-byte vector (N = 4001), whole rows: the
  realigned kernels (``kernels``: each row's body in 16-byte vectors from its first aligned
  element, its head and tail element-wise) where ``REALIGNED`` has an entry for the direction, op
  and row bucket: rows a program, warps and programs per SM. A program keeps its shifted weight (and
  bias, or dw and db) in registers for its whole life and loads its next tile ahead, so few programs
  per SM of one or two rows each, and the grid a fixed count (a multiple of 8, rounded down so that
  no program waits for a second wave). The tile's warps go along N first and its rows repeat within
  each thread, so that the backward's per-block sums of dw and db over the rows never cross warps;
  the head-and-tail vector lies on the same threads and warps at one element a lane, so that the
  per-row values of the two tiles share one layout and the conversion between them moves nothing.
  The entries are the winners of a search on an H100 at N = 2047, 4001 and 7001, started from
  Triton's (reports/experiments/gluon-odd-rows/). Without an entry the element-wise kernels run:
  the 1024 bucket (Triton's realigned kernels lost at N = 1001), the forward's wider buckets (not
  measured), fp32 rows (element-wise accesses move 4 bytes each; realigned, Triton's lost as often
  as they won).
* the wide forward's column slices that exchange their row statistics (``kernels``: each slice read
  once into registers, where the chunked forward reads the row twice, its second pass from an L2
  that rows of 256 KB and more no longer fit) where ``FWD_EXCHANGE`` has an entry for the op, x's
  element size and the row bucket: slice columns, warps, rows a block, programs per SM. Entries
  where it measured faster on an H100 (reports/experiments/gluon-wide-fwd/, bf16 and fp16):
  RMSNorm and the fused add in 16-bit at 49152-131072 columns, on 16384-column slices of 16 warps,
  one per SM (RMSNorm 69-72 -> 86% at 49152-65536 and 65 -> 74% at 131072, the fused add 80-87 ->
  85-90%); LayerNorm's exchange lost at every width (the merge of two statistics a slice), and at
  262144 the 16-slice rows lost to the chunked forward too, so the one-program-a-row forward runs
  there. The slice tile is a warp's lanes along N in 16-byte
  vectors, its warps along N, its rows repeated within each thread (the posted slots' [rows, slots]
  tile then lies within one warp: a barrier-free wait, as the backward's), so rows whose length is
  no multiple of a vector keep the old forward.
* the persistent backward grid is as many programs as the SMs hold at once: kernels.py reads the
  compiled binary's registers and shared memory and counts the programs an SM keeps resident
  (``harness.spec.occupancy``), so that no program waits for a second wave; without a binary to read
  (compile-only), up to 2048 threads of programs per SM (the thread limit from Volta to Hopper).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from harness.spec.occupancy import THREADS_PER_SM

VECTOR_BYTES = 16
WARP = 32
MAX_WARPS = 16
MIN_WARPS = 4
FWD_ROW_BYTES = 65536  # bytes of x a forward program keeps in registers (see above)
BWD_ROW_MAX = 8192  # backward: x, dy and the dw/db accumulators, 16 per thread each at 16 warps
FWD_CHUNK = 8192  # column chunk of the forward's wide-row path
BWD_SLICE = 8192  # column slice of the backward's wide-row path
# the wide backward's exchange of row sums: most slices (LayerNorm of fp32 rows: fewer)
EXCHANGE_SLICES = 16
EXCHANGE_SLICES_FP32_LAYERNORM = 4
# slice programs that exchange take this many warps from ``EXCHANGE_WIDE`` slices on (None: the
# layout rules' 16)
BWD_SLICE_WARPS = 8
EXCHANGE_WIDE = 7
# 16-bit rows in 16-byte vectors from BWD_ROW_MAX up to the bound: narrower slices on fewer warps,
# several exchanging programs per SM (see above). layernorm -> ((up to N, slice columns, warps,
# programs per SM), ...); wider rows take the 8192-column slices
SPREAD_SLICES = {
    False: ((16384, 2048, 4, 4), (32768, 4096, 8, 2)),
    True: ((20480, 2048, 2, 4), (65536, 4096, 4, 2)),
}
SMALL_ROW_VECS = 64  # rows of at most this many vectors (1 KB of 16-bit x) take the small-row tile
LANE_VECS = 2  # small rows: vectors of a row per lane
THREAD_VECS = {"fwd": 4, "bwd": 2}  # small rows: vectors of x per thread per tile
# LayerNorm's backward: rows a program on a whole-row tile of this many warps along N, 16-bit x
LAYERNORM_BWD_ROWS = {8: 2}
# Narrower vectors: elements of a row per lane (None: one 16-byte vector's worth). Fewer warps per
# row (more elements per lane) were faster at N = 4001 on an H100 but are not checked on a GPU
# yet: docs/kernels/gluon.md.
NARROW_ELEMENTS = None
# The realigned kernels (see above): (direction, op, row bucket) -> (rows a program, warps,
# programs per SM). Experiments change the entries; a missing one means the element-wise kernels.
REALIGNED = {
    ("fwd", "rmsnorm", 2048): (2, 8, 4), ("fwd", "layernorm", 2048): (1, 4, 4), ("fwd", "add_rmsnorm", 2048): (1, 4, 4),
    ("fwd", "rmsnorm", 4096): (2, 4, 2), ("fwd", "layernorm", 4096): (2, 4, 2), ("fwd", "add_rmsnorm", 4096): (1, 4, 2),
    ("fwd", "rmsnorm", 8192): (1, 8, 2), ("fwd", "layernorm", 8192): (2, 16, 2), ("fwd", "add_rmsnorm", 8192): (1, 4, 2),
    ("bwd", "rmsnorm", 2048): (2, 4, 2), ("bwd", "layernorm", 2048): (1, 4, 4), ("bwd", "add_rmsnorm", 2048): (2, 4, 2),
    ("bwd", "rmsnorm", 4096): (1, 4, 2), ("bwd", "layernorm", 4096): (1, 4, 4), ("bwd", "add_rmsnorm", 4096): (2, 8, 1),
    ("bwd", "rmsnorm", 8192): (1, 8, 1), ("bwd", "layernorm", 8192): (1, 8, 1), ("bwd", "add_rmsnorm", 8192): (1, 8, 1),
}  # fmt: skip
# The wide forward's exchanging slices (see above): (op, x's element size, row bucket =
# next_pow2(N)) -> (slice columns, warps along N, rows a block, programs per SM). A missing entry
# keeps the one-program-a-row forward; experiments set entries to force a candidate.
FWD_EXCHANGE: dict = {
    ("rmsnorm", 2, 65536): (16384, 16, 1, 1), ("rmsnorm", 2, 131072): (16384, 16, 1, 1),
    ("add_rmsnorm", 2, 65536): (16384, 16, 1, 1), ("add_rmsnorm", 2, 131072): (16384, 16, 1, 1),
}  # fmt: skip


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass(frozen=True)
class Tile:
    """A [rows, width] tile (width a power of two) and its BlockedLayout's parameters."""

    width: int
    vec: int
    threads: tuple[int, int]  # threads_per_warp, [M, N]
    warps: tuple[int, int]  # warps_per_cta, [M, N]
    reps: int = 1  # the layout repeated along M: rows per thread

    @property
    def rows(self) -> int:
        return self.threads[0] * self.warps[0] * self.reps

    @property
    def num_warps(self) -> int:
        return self.warps[0] * self.warps[1]

    def layout(self):
        return _layout(self.vec, self.threads, self.warps)


@functools.cache
def _layout(vec: int, threads: tuple, warps: tuple):
    # one object per tile: built per launch it cost more host time than the rest of the forward
    from triton.experimental.gluon import language as gl

    return gl.BlockedLayout([1, vec], list(threads), list(warps), [1, 0])


def vector(n: int, elem_size: int) -> int:
    """Elements per vector access for rows of n elements: 16 bytes, or the widest power of two
    that divides n (every row then starts on a vector boundary)."""
    return min(VECTOR_BYTES // elem_size, n & -n)


def tile(width: int, elem_size: int, vec: int | None = None, direction: str | None = None) -> Tile:
    """The layout rules above, for a tile ``width`` (a power of two) columns wide, of ``vec``
    elements per access (16 bytes when not given); the small-row tile only for a norm's
    ``direction`` ("fwd" or "bwd")."""
    if width & (width - 1):
        raise ValueError(f"tile width must be a power of two, got {width}")
    full = min(VECTOR_BYTES // elem_size, width)
    vec = min(vec or full, width)
    threads_n = width // vec
    if direction is not None and threads_n <= SMALL_ROW_VECS and vec == full:
        lanes = min(WARP, max(1, threads_n // LANE_VECS))
        reps = max(1, THREAD_VECS[direction] * lanes // threads_n)
        return Tile(width, vec, (WARP // lanes, lanes), (MIN_WARPS, 1), reps)
    tpw_n = min(WARP, threads_n)
    # 16-byte vectors: two per lane; narrower ones: a lane holds one 16-byte vector's elements
    # (each a separate access, with its own 64-bit address: more would spill or starve occupancy)
    per_lane = 2 if vec == full else (NARROW_ELEMENTS or full) // vec
    warps_n = min(max(threads_n // (per_lane * WARP), 1), MAX_WARPS)
    warps = max(warps_n, MIN_WARPS)
    return Tile(width, vec, (WARP // tpw_n, tpw_n), (warps // warps_n, warps_n))


@dataclass(frozen=True)
class Plan:
    """How one (direction, N, dtype) runs: the tile, and how many of them cover a row."""

    tile: Tile
    pieces: int  # 1: the whole row in one tile; > 1: chunks (forward) or slices (backward)
    exchange: bool = False  # backward slices: exchange their row sums (else the row-sums kernel)
    per_sm: int = 1  # exchanging slices: programs an SM may run at once (all must be resident)

    @property
    def wide(self) -> bool:
        return self.pieces > 1


_PLANS: dict = {}


def plan(direction: str, n: int, elem_size: int, layernorm: bool = False) -> Plan:
    """The launch plan for a row of ``n`` elements of ``elem_size`` bytes (x's dtype), of LayerNorm
    or of the RMSNorm kernels (the fused add's too), computed once per arguments and rules (the
    constants above, which experiments and tests change)."""
    key = (direction, n, elem_size, layernorm, VECTOR_BYTES, WARP, MAX_WARPS, MIN_WARPS, FWD_ROW_BYTES, BWD_ROW_MAX,
           FWD_CHUNK, BWD_SLICE, SMALL_ROW_VECS, LANE_VECS, NARROW_ELEMENTS, tuple(LAYERNORM_BWD_ROWS.items()),
           EXCHANGE_SLICES, EXCHANGE_SLICES_FP32_LAYERNORM, BWD_SLICE_WARPS, EXCHANGE_WIDE,
           tuple((k, v) for k, v in SPREAD_SLICES.items()))  # fmt: skip
    got = _PLANS.get(key)
    if got is None:
        got = _PLANS[key] = _plan(direction, n, elem_size, layernorm)
    return got


def _plan(direction: str, n: int, elem_size: int, layernorm: bool = False) -> Plan:
    if direction not in ("fwd", "bwd"):
        raise ValueError(f"direction must be 'fwd' or 'bwd', got {direction!r}")
    if n < 1:
        raise ValueError(f"N must be >= 1, got {n}")
    limit, piece = (FWD_ROW_BYTES // elem_size, FWD_CHUNK) if direction == "fwd" else (BWD_ROW_MAX, BWD_SLICE)
    width = next_pow2(n)
    vec = vector(n, elem_size)
    if width > limit:
        spread = direction == "bwd" and vec == VECTOR_BYTES // elem_size == 8
        for most_n, columns, warps, per_sm in SPREAD_SLICES.get(layernorm, ()) if spread else ():
            if n <= most_n:
                t = Tile(columns, vec, (WARP // min(WARP, columns // vec), min(WARP, columns // vec)), (1, warps))
                return Plan(t, -(-n // columns), True, per_sm)
        pieces = -(-n // piece)
        most = EXCHANGE_SLICES_FP32_LAYERNORM if layernorm and elem_size == 4 else EXCHANGE_SLICES
        # LayerNorm on one whole slice and a part lost (10240, 12288)
        exchange = direction == "bwd" and pieces <= most and not (layernorm and n < 2 * piece)
        t = tile(piece, elem_size, vec, direction)
        if exchange and BWD_SLICE_WARPS and pieces >= EXCHANGE_WIDE:
            t = Tile(t.width, t.vec, t.threads, (1, BWD_SLICE_WARPS))
        return Plan(t, pieces, exchange)
    t = tile(width, elem_size, vec, direction)
    rows = LAYERNORM_BWD_ROWS.get(t.warps[1], 1) if layernorm and direction == "bwd" and elem_size == 2 else 1
    if rows > 1 and t.rows == 1:
        t = Tile(t.width, t.vec, t.threads, (t.warps[0] * rows, t.warps[1]), t.reps)
    return Plan(t, 1)


_FWD_EXCHANGE_PLANS: dict = {}


def fwd_exchange_plan(op: str, n: int, elem_size: int) -> Plan | None:
    """The exchanging forward's launch for rows of ``n`` elements of ``elem_size`` bytes of ``op``
    ("rmsnorm", "layernorm", "add_rmsnorm"): the slice tile, the slices (``pieces``) and the programs
    per SM, or None where the one-program-a-row forward runs: no ``FWD_EXCHANGE`` entry, rows that
    are no multiple of a 16-byte vector, or more slices than a warp's lanes hold slots (one vector
    of them a lane). A malformed entry raises."""
    if not FWD_EXCHANGE:  # (the common case first: host time)
        return None
    entry = FWD_EXCHANGE.get((op, elem_size, next_pow2(n)))
    vec = VECTOR_BYTES // elem_size
    if entry is None or n % vec:
        return None
    key = (n, vec, entry, WARP)
    got = _FWD_EXCHANGE_PLANS.get(key)
    if got is None:
        columns, warps, rows, per_sm = entry
        if columns & (columns - 1) or columns < vec * WARP * warps or min(warps, rows, per_sm) < 1:
            raise ValueError(
                f"FWD_EXCHANGE entry {entry}: slice columns must be a power of two of at least one "
                f"{vec}-element vector per lane of its {warps} warp(s), and warps, rows, programs per SM >= 1"
            )
        slices = -(-n // columns)
        if slices > vec * WARP:
            got = _FWD_EXCHANGE_PLANS[key] = False
        else:
            got = _FWD_EXCHANGE_PLANS[key] = Plan(Tile(columns, vec, (1, WARP), (1, warps), rows), slices, True, per_sm)
    return got or None


@dataclass(frozen=True)
class Realigned:
    """The realigned kernels' launch: the body's tile (16-byte vectors) and programs per SM."""

    tile: Tile
    programs_per_sm: int

    def edge_layout(self):
        """The head-and-tail vector's layout: one element a lane, on the body tile's threads and
        warps (its per-row values then lie as the body's do)."""
        return _layout(1, self.tile.threads, self.tile.warps)


_REALIGNED_PLANS: dict = {}


def realigned_plan(direction: str, op: str, n: int, elem_size: int) -> Realigned | None:
    """The realigned kernels' launch for rows of ``n`` elements of ``elem_size`` bytes, or None
    where the element-wise kernels run: rows that fill whole vectors, other than 16-bit, too wide
    for one program (chunks, slices), or whose (direction, op, bucket) has no ``REALIGNED`` entry."""
    vec = VECTOR_BYTES // elem_size
    if elem_size != 2 or n % vec == 0:
        return None
    width = next_pow2(n)
    entry = REALIGNED.get((direction, op, width))
    if entry is None or width > (FWD_ROW_BYTES // elem_size if direction == "fwd" else BWD_ROW_MAX):
        return None
    key = (width, elem_size, entry, VECTOR_BYTES, WARP)
    got = _REALIGNED_PLANS.get(key)
    if got is None:
        rows, warps, per_sm = entry
        threads_n = max(width // vec, 1)
        tpw_n = min(WARP, threads_n)
        warps_n = min(warps, max(threads_n // tpw_n, 1))
        warps_m = warps // warps_n
        along_m = (WARP // tpw_n) * warps_m  # rows the threads and warps span (a floor on the tile's rows)
        t = Tile(width, vec, (WARP // tpw_n, tpw_n), (warps_m, warps_n), max(1, rows // along_m))
        got = _REALIGNED_PLANS[key] = Realigned(t, per_sm)
    return got


def programs_per_sm(t: Tile) -> int:
    """Resident programs per SM for the persistent backward without a binary to read: as many as
    fill its threads."""
    return max(1, THREADS_PER_SM // (t.num_warps * WARP))
