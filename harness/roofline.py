"""The bytes model, in one place, and the copy-bandwidth roofline it is measured against.

Main bytes (what a perfect kernel must move; every TB/s figure counts these):
    fwd    = x read + y written                     = 2 * M * N * s
    bwd    = x read + dy read + dx written          = 3 * M * N * s
    fwdbwd = fwd + bwd                              = 5 * M * N * s
Extra bytes, reported separately: weight and bias reads, the statistics (written by fwd, read by
bwd), dweight/dbias writes. Partial buffers of a split dweight reduction are implementation details
and are not counted: they show up as a lower TB/s, which is the point.
"""

from __future__ import annotations

from dataclasses import dataclass

DIRECTIONS_BENCH = ("fwd", "bwd", "fwdbwd")


@dataclass(frozen=True)
class Bytes:
    main: int
    extra: int


def bytes_moved(op: str, direction: str, m: int, n: int, elem_size: int, affine: bool = True) -> Bytes:
    if direction not in DIRECTIONS_BENCH:
        raise ValueError(f"unknown direction '{direction}'; expected one of {', '.join(DIRECTIONS_BENCH)}")
    if op not in ("rmsnorm", "layernorm"):
        raise ValueError(f"unknown op '{op}'")
    n_stats = 2 if op == "layernorm" else 1
    n_vec_fwd = (2 if op == "layernorm" else 1) if affine else (1 if op == "layernorm" else 0)
    fwd = Bytes(2 * m * n * elem_size, n_vec_fwd * n * elem_size + n_stats * m * 4)
    # bwd reads weight, the statistics; writes dweight (and dbias)
    n_grads = (2 if op == "layernorm" else 1) if affine else (1 if op == "layernorm" else 0)
    bwd = Bytes(3 * m * n * elem_size, (n * elem_size if affine else 0) + n_stats * m * 4 + n_grads * n * elem_size)
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
