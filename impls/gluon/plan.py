"""Launch plans for the Gluon kernels: a heuristic from N and x's element size, no per-GPU table.

A plan is a tile of ``[rows, width]`` elements and the ``BlockedLayout`` that spreads it over the
threads of one program. The rules, and why they carry across GPUs (they depend on the 16-byte
vector width, the 32-thread warp and the register file of an SM, the same on every NVIDIA GPU
since Volta, not on SM counts or clocks):

* ``vec`` = 16 bytes / element size: each thread loads and stores 128-bit vectors (8 bf16/fp16
  or 4 fp32 elements), the widest global access there is.
* threads along N first: ``width / vec`` threads cover a row with one vector each; a warp spans
  up to 32 of them, and rows narrower than a warp share it (``threads_per_warp = [32 / t, t]``),
  so that a warp never idles on padding when N is small.
* warps along N for wide rows, one per 2 vectors of the row per lane (``threads_n / 64``), at
  most 16: every thread then holds 2-4 vectors of the row (16-64 fp32 registers) and the row
  reduction crosses at most 16 warps through shared memory once. Narrow rows get 4 warps, the
  spare ones along M (``warps_per_cta = [4 / warps_n, warps_n]``): a program moves several rows.
* the row stays in registers up to ``FWD_ROW_BYTES`` of x (forward: 32768 16-bit elements, 64
  fp32 registers per thread at 16 warps; ptxas for sm_90a fits them in its 128-register cap
  without spilling, where 32768 fp32 elements spill) and ``BWD_ROW_MAX`` elements (backward: x,
  dy, dw, db, 16 each, and the next block's x and dy prefetched: up to 128 registers; ptxas
  spills 4-52 bytes per thread in a few fp32 / wide LayerNorm cases, an L1-resident cost far below
  the row-sums pass a narrower limit would add): wider rows are walked in chunks
  (forward, two passes over the row, the second from L2) or cut into column slices (backward).
* the persistent backward grid fills each SM with up to 2048 threads of programs (the thread
  limit of an SM from Volta to Hopper), so the grid follows the GPU's SM count at run time.
"""

from __future__ import annotations

from dataclasses import dataclass

VECTOR_BYTES = 16
WARP = 32
MAX_WARPS = 16
MIN_WARPS = 4
FWD_ROW_BYTES = 65536  # bytes of x a forward program keeps in registers (see above)
BWD_ROW_MAX = 8192  # backward: x, dy and the dw/db accumulators, 16 per thread each at 16 warps
FWD_CHUNK = 8192  # column chunk of the forward's wide-row path
BWD_SLICE = 8192  # column slice of the backward's wide-row path
THREADS_PER_SM = 2048


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass(frozen=True)
class Tile:
    """A [rows, width] tile (width a power of two) and its BlockedLayout's parameters."""

    width: int
    vec: int
    threads: tuple[int, int]  # threads_per_warp, [M, N]
    warps: tuple[int, int]  # warps_per_cta, [M, N]

    @property
    def rows(self) -> int:
        return self.threads[0] * self.warps[0]

    @property
    def num_warps(self) -> int:
        return self.warps[0] * self.warps[1]

    def layout(self):
        from triton.experimental.gluon import language as gl

        return gl.BlockedLayout([1, self.vec], list(self.threads), list(self.warps), [1, 0])


def tile(width: int, elem_size: int) -> Tile:
    """The layout rules above, for a tile ``width`` (a power of two) columns wide."""
    if width & (width - 1):
        raise ValueError(f"tile width must be a power of two, got {width}")
    vec = min(VECTOR_BYTES // elem_size, width)
    threads_n = width // vec
    tpw_n = min(WARP, threads_n)
    warps_n = min(max(threads_n // (2 * WARP), 1), MAX_WARPS)
    warps = max(warps_n, MIN_WARPS)
    return Tile(width, vec, (WARP // tpw_n, tpw_n), (warps // warps_n, warps_n))


@dataclass(frozen=True)
class Plan:
    """How one (direction, N, dtype) runs: the tile, and how many of them cover a row."""

    tile: Tile
    pieces: int  # 1: the whole row in one tile; > 1: chunks (forward) or slices (backward)

    @property
    def wide(self) -> bool:
        return self.pieces > 1


def plan(direction: str, n: int, elem_size: int) -> Plan:
    """The launch plan for a row of ``n`` elements of ``elem_size`` bytes (x's dtype)."""
    if direction not in ("fwd", "bwd"):
        raise ValueError(f"direction must be 'fwd' or 'bwd', got {direction!r}")
    if n < 1:
        raise ValueError(f"N must be >= 1, got {n}")
    limit, piece = (FWD_ROW_BYTES // elem_size, FWD_CHUNK) if direction == "fwd" else (BWD_ROW_MAX, BWD_SLICE)
    width = next_pow2(n)
    if width <= limit:
        return Plan(tile(width, elem_size), 1)
    return Plan(tile(piece, elem_size), -(-n // piece))


def programs_per_sm(t: Tile) -> int:
    """Resident programs per SM for the persistent backward: as many as fill its threads."""
    return max(1, THREADS_PER_SM // (t.num_warps * WARP))
