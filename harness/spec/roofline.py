"""The bytes model, in one place, and the copy-bandwidth roofline it is measured against.

Main bytes (what a perfect kernel must move; every TB/s figure counts these) are the op record's row
tensors (``harness.spec.ops``: ``rows_moved``), M * N elements of x's size each:
    rmsnorm, layernorm   fwd = x read + y written = 2 rows; bwd = x, dy read + dx written = 3 rows
    add_rmsnorm          fwd = x, residual read + y, residual_out written = 4 rows;
                         bwd = dy, dresidual_out, residual_out read + dh written = 4 rows
    fwdbwd               fwd + bwd
    rmsnorm_fp8_*        fwd only: x read (1 row) + q written at 1 byte an element + the fp32 scales
                         (M * N / group of them): bf16 x moves 3 bytes an element, plus 4 / group
    add_rmsnorm_fp8_*    fwd only: x, residual read + residual_out written (3 rows) + q and the scales
Extra bytes, reported separately: the parameters read (in their own dtype: fp32 weights count 4 bytes
each), the statistics (written by fwd, read by bwd), dweight/dbias writes. Partial buffers of a split
dweight reduction are implementation details and are not counted: they show up as a lower TB/s,
which is the point.
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.spec.ops import get_op

DIRECTIONS_BENCH = ("fwd", "bwd", "fwdbwd")


@dataclass(frozen=True)
class Bytes:
    main: int
    extra: int


def bytes_moved(op: str, direction: str, m: int, n: int, elem_size: int, affine: bool = True, param_size: int | None = None) -> Bytes:
    """``param_size``: bytes per parameter element (x's ``elem_size`` unless given: 4 for fp32
    parameters beside 16-bit x)."""
    if direction not in DIRECTIONS_BENCH:
        raise ValueError(f"unknown direction '{direction}'; expected one of {', '.join(DIRECTIONS_BENCH)}")
    rec = get_op(op)
    if not rec.offers(direction):
        raise ValueError(f"{op} has no {direction} (it has {', '.join(rec.directions)})")
    ps = elem_size if param_size is None else param_size
    n_stats = len(rec.stats)
    n_params = len(rec.params) if affine else 0
    # fwd reads the parameters and writes the statistics; bwd reads the weight and the statistics
    # and writes a gradient per parameter
    fwd = Bytes(rec.rows_of("fwd") * m * n * elem_size + rec.quantized_bytes(m, n), n_params * n * ps + n_stats * m * 4)
    if direction == "fwd":
        return fwd
    bwd = Bytes(rec.rows_of("bwd") * m * n * elem_size, (n * ps if affine else 0) + n_stats * m * 4 + n_params * n * ps)
    if direction == "bwd":
        return bwd
    return Bytes(fwd.main + bwd.main, fwd.extra + bwd.extra)


def tbps(nbytes: int, ms: float) -> float:
    """Terabytes per second for ``nbytes`` moved in ``ms`` milliseconds."""
    return nbytes / (ms * 1e-3) / 1e12
