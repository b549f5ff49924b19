"""Launch plans for the cuTile kernels: tile shapes and grids from N, M and a ``Tuning`` (the
host's other choices; per GPU, op, direction and N bucket in ``configs.json``, read by ``configs.py``).

cuTile programs are written per block of threads over whole tiles; the compiler (``tileiras``)
picks the threads, vectors and layouts itself. What the host chooses is the tile shape, whose
every dimension must be a power of two, the grid, and the hints the compiler takes:

* ``width``: the tile's columns, ``next_pow2(N)`` while the whole row fits in one tile
  (``fwd_row_max`` / ``bwd_row_max`` elements), else a fixed chunk (forward: the row walked in
  chunks) or slice (backward: the row cut into column slices, one program each) of that many;
  the exchanging forward's slices (``fwd_sync_plan``) are ``fwd_slice`` wide whatever the row max.
* ``rows``: rows per tile, so that a tile holds about ``*_tile_elements`` elements whatever N is
  (a program moves several narrow rows at once), and at most the largest power of two <= M, so
  that a tile of few rows is not mostly padding. There are ``cdiv(M, rows)`` row blocks: every
  tile starts inside the array (one wholly outside is undefined behaviour in cuTile), and the
  last may overhang its end, padded with zeros where loaded and clipped where stored.
* the grids: the backward is persistent (``programs_per_sm`` programs per SM, each walking a
  contiguous range of row blocks and keeping one fp32 partial row of dweight / dbias); the
  forward launches one program per row block, or a persistent grid (``fwd_programs_per_sm``).
* the hints: TMA or not for loads and stores, a DRAM latency hint, and the kernel's occupancy and
  worker warps. Measured, these moved the same kernels by tens of points, differently per op
  and width (docs/kernels/cutile.md), hence a table rather than constants.

The module's constants are the first version's plan, which ``Tuning()`` keeps as its defaults.
"""

from __future__ import annotations

from dataclasses import dataclass

FWD_ROW_MAX = 8192  # elements of a row held in one forward tile
BWD_ROW_MAX = 4096  # backward: x, dy, dw and db tiles of this width live together
FWD_CHUNK = 4096  # column chunk of the forward's wide-row path
BWD_SLICE = 4096  # column slice of the backward's wide-row path
FWD_SLICE = 8192  # column slice of the exchanging forward (``Tuning.fwd_sync``)
TILE_ELEMENTS = 4096  # a tile of narrow rows holds about this many elements
MAX_ROWS = 64
PROGRAMS_PER_SM = 4
VEC = 8  # 16-bit elements in a 16-byte vector
PHASES = VEC  # the realigned kernels' row classes: row r starts (r mod 8) * N elements into a vector
# Narrower rows keep the row kernels: the edges' element-wise share grows as 16 / N, and rows of
# several to a tile were checked on the GPU for LayerNorm's forward only (N = 1001), the rest from
# N = 2999 up (reports/experiments/cutile-odd-rows/).
ODD_MIN_N = 2048


@dataclass(frozen=True)
class Tuning:
    """What the host chooses beyond the tile: the compiler hints and the grids. ``fwd_programs_per_sm``
    0 launches one program per row block; k > 0 a persistent grid of k programs per SM, each walking
    every k-th block with the weight loaded once. ``latency``, ``occupancy``, ``worker_warps`` 0: the
    compiler's own. ``acc_rows``: the backward accumulates dweight / dbias per tile row (one column
    reduction at the end, not one per row block). ``realign``: 16-bit rows whose length is no
    multiple of 8 take the realigned kernels where they apply (``realigned``). ``sync``: the
    backward's column slices exchange their row sums among themselves (one program per SM) instead
    of reading them from a first kernel (``kernels._bwd_sync_kernel``). ``fwd_sync``: the forward
    cuts rows wider than ``fwd_slice`` (a power of two) into column slices of that many columns,
    one program each, that exchange their partial statistics (``kernels._fwd_sync_kernel``, one
    program per SM; ``fwd_sync_plan``), whatever ``fwd_row_max`` says; where a row has more slices
    than the GPU has SMs it takes the forward ``fwd_row_max`` and ``fwd_chunk`` give. Its tile
    rows come from ``fwd_tile_elements`` as the other tiles' do."""

    fwd_row_max: int = FWD_ROW_MAX
    bwd_row_max: int = BWD_ROW_MAX
    fwd_chunk: int = FWD_CHUNK
    bwd_slice: int = BWD_SLICE
    fwd_tile_elements: int = TILE_ELEMENTS
    bwd_tile_elements: int = TILE_ELEMENTS
    max_rows: int = MAX_ROWS
    programs_per_sm: int = PROGRAMS_PER_SM
    fwd_programs_per_sm: int = 0
    tma_load: bool = True
    tma_store: bool = True
    latency: int = 0
    occupancy: int = 0
    worker_warps: int = 0
    acc_rows: bool = False
    realign: bool = True
    sync: bool = False
    fwd_sync: bool = False
    fwd_slice: int = FWD_SLICE


# Experiments (tools/experiments/cutile-tuning) set a tuning for every call; None: each call takes
# its GPU's table entry (configs.py)
TUNING: Tuning | None = None


def set_tuning(**changes) -> Tuning | None:
    """Every call on ``Tuning(**changes)`` from now on (experiments); returns the previous override."""
    global TUNING
    old, TUNING = TUNING, Tuning(**changes)
    return old


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass(frozen=True)
class Plan:
    """How one (direction, M, N) runs: a [rows, width] tile, and how many tiles cover a row."""

    rows: int
    width: int
    pieces: int  # 1: the whole row in one tile; > 1: chunks (forward) or slices (backward)

    @property
    def wide(self) -> bool:
        return self.pieces > 1


def plan(direction: str, m: int, n: int, tuning: Tuning | None = None) -> Plan:
    """The tile for ``m`` rows of ``n`` elements (``m >= 1``, ``n >= 1``) under ``tuning`` (the
    defaults above when None)."""
    if direction not in ("fwd", "bwd"):
        raise ValueError(f"direction must be 'fwd' or 'bwd', got {direction!r}")
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise ValueError(f"M must be an integer >= 1, got {m!r}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"N must be an integer >= 1, got {n!r}")
    t = tuning or Tuning()
    if direction == "fwd":
        limit, piece, elements = t.fwd_row_max, t.fwd_chunk, t.fwd_tile_elements
    else:
        limit, piece, elements = t.bwd_row_max, t.bwd_slice, t.bwd_tile_elements
    width = next_pow2(n)
    pieces = 1
    if width > limit:
        width, pieces = piece, -(-n // piece)
    rows = min(max(elements // width, 1), t.max_rows, 1 << (m.bit_length() - 1))
    return Plan(rows, width, pieces)


def backward_groups(m: int, p: Plan, sm_count: int, tuning: Tuning | None = None) -> int:
    """Programs of the persistent backward per column slice: enough to fill the GPU, at most one
    per row block (so that every program owns at least one)."""
    blocks = -(-m // p.rows)
    return max(1, min(blocks, (tuning or Tuning()).programs_per_sm * sm_count // p.pieces))


def sync_groups(m: int, p: Plan, sm_count: int) -> int:
    """Row groups of the exchanging backward (``Tuning.sync``) and forward (``Tuning.fwd_sync``):
    their slices wait for each other, so the whole grid must be resident at once, one program per
    SM; 0 where a row has more slices than the GPU has SMs (the backward then takes the first
    kernel's sums, the forward the chunked rows)."""
    from harness.spec.occupancy import exchange_groups

    return exchange_groups(-(-m // p.rows), p.pieces, sm_count)


def fwd_sync_plan(m: int, n: int, tuning: Tuning | None = None) -> Plan | None:
    """The exchanging forward's tile (``Tuning.fwd_sync``): slices of ``fwd_slice`` columns, rows
    from ``fwd_tile_elements``; None where the tuning does not ask for it or the row fits one
    slice. Whether its grid fits the GPU is ``sync_groups``'s question."""
    t = tuning or Tuning()
    if not t.fwd_sync or n <= t.fwd_slice:
        return None
    if t.fwd_slice < 1 or t.fwd_slice & (t.fwd_slice - 1):
        raise ValueError(f"fwd_slice must be a power of two, got {t.fwd_slice!r}")
    rows = min(max(t.fwd_tile_elements // t.fwd_slice, 1), t.max_rows, 1 << (m.bit_length() - 1))
    return Plan(rows, t.fwd_slice, -(-n // t.fwd_slice))


def forward_programs(m: int, p: Plan, sm_count: int, tuning: Tuning | None = None) -> int:
    """Programs of the forward: one per row block, or a persistent grid (``fwd_programs_per_sm``)."""
    blocks = -(-m // p.rows)
    k = (tuning or Tuning()).fwd_programs_per_sm
    return blocks if k <= 0 else max(1, min(blocks, k * sm_count))


def realigned(m: int, n: int, itemsize: int, p: Plan, tuning: Tuning | None = None) -> bool:
    """Whether rows of this shape take the realigned kernels (the tensors' own conditions, (M, N)
    rows with one row stride and 16-byte aligned starts, are the launcher's): 16-bit rows whose
    length is no multiple of a 16-byte vector, the whole row in one tile (no chunks, no slices),
    ``ODD_MIN_N`` elements or more, and at least one row of each of the 8 phases."""
    t = tuning or Tuning()
    return t.realign and itemsize == 2 and n % VEC != 0 and not p.wide and n >= ODD_MIN_N and m >= PHASES


def realigned_programs(direction: str, m: int, p: Plan, sm_count: int, tuning: Tuning | None = None) -> int:
    """Programs per phase of the realigned kernels (the grid is 8 times this): persistent in both
    directions, since a program gathers its shifted weight once (forward: ``fwd_programs_per_sm``,
    or ``PROGRAMS_PER_SM`` where the table launches one program per block; backward:
    ``programs_per_sm``), at most one per row block of the phase with the fewest rows."""
    t = tuning or Tuning()
    per_sm = (t.fwd_programs_per_sm or PROGRAMS_PER_SM) if direction == "fwd" else t.programs_per_sm
    blocks = -(-(m // PHASES) // p.rows)
    return max(1, min(blocks, per_sm * sm_count // PHASES))


def phase_split(phase: int, n: int) -> tuple[int, int, int]:
    """(start, head, body) of the realigned kernels' phase ``phase`` at width n, as their
    ``_odd_split`` computes it: rows phase + 8k start phase * n + 8kn elements into the array; their
    first whole 16-byte vector is ``start`` + 8kn (a multiple of 8), ``head`` elements into the
    row; the ``body`` from there is a multiple of 8 elements, and the tail (under 8) follows."""
    start = -(-phase * n // VEC) * VEC
    head = start - phase * n
    return start, head, (n - head) // VEC * VEC


def edge_columns(head: int, body: int, n: int) -> list[int]:
    """The row columns of a phase's 16 edge lanes that are in use, in lane order (``_odd_edges``):
    the head's columns, then the tail's."""
    return [k + (body if k >= head else 0) for k in range(2 * VEC) if k < n - body]
