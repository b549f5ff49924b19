"""The bytes model, in one place, and the copy-bandwidth roofline it is measured against.

Main bytes (what a perfect kernel must move; every TB/s figure counts these) are the op record's row
tensors (``harness.ops``: ``rows_moved``), M * N elements of x's size each:
    rmsnorm, layernorm   fwd = x read + y written = 2 rows; bwd = x, dy read + dx written = 3 rows
    add_rmsnorm          fwd = x, residual read + y, residual_out written = 4 rows;
                         bwd = dy, dresidual_out, residual_out read + dh written = 4 rows
    fwdbwd               fwd + bwd
Extra bytes, reported separately: the parameters read (in their own dtype: fp32 weights count 4 bytes
each), the statistics (written by fwd, read by bwd), dweight/dbias writes. Partial buffers of a split
dweight reduction are implementation details and are not counted: they show up as a lower TB/s,
which is the point.
"""

from __future__ import annotations

from dataclasses import dataclass

from .ops import get_op

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
    ps = elem_size if param_size is None else param_size
    n_stats = len(rec.stats)
    n_params = len(rec.params) if affine else 0
    # fwd reads the parameters and writes the statistics; bwd reads the weight and the statistics
    # and writes a gradient per parameter
    fwd = Bytes(rec.rows_of("fwd") * m * n * elem_size, n_params * n * ps + n_stats * m * 4)
    bwd = Bytes(rec.rows_of("bwd") * m * n * elem_size, (n * ps if affine else 0) + n_stats * m * 4 + n_params * n * ps)
    if direction == "fwd":
        return fwd
    if direction == "bwd":
        return bwd
    return Bytes(fwd.main + bwd.main, fwd.extra + bwd.extra)


def tbps(nbytes: int, ms: float) -> float:
    """Terabytes per second for ``nbytes`` moved in ``ms`` milliseconds."""
    return nbytes / (ms * 1e-3) / 1e12


def measure_copy_bandwidth(gib: float = 1.0, trials: int = 3) -> dict:
    """Device-to-device copy of a ``gib`` GiB buffer, timed like every benchmark point (CUDA events,
    L2 flushed, median). Bytes counted: read + written. Returns TB/s per trial and their median."""
    import functools
    import statistics

    import torch
    import triton.testing

    n = int(gib * 2**30)
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy = functools.partial(dst.copy_, src)
    per_trial = []
    for _ in range(trials):
        ms = triton.testing.do_bench(copy, warmup=25, rep=200, return_mode="median")
        per_trial.append(tbps(2 * n, ms))
    del src, dst, copy  # give the 2 GiB back before the benchmark allocates
    torch.cuda.empty_cache()
    return {"tbps": statistics.median(per_trial), "trials_tbps": per_trial, "bytes": 2 * n, "method": "copy_ of a uint8 buffer, do_bench median"}
