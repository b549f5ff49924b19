"""cuTile's forward for wide rows: the column slices exchanging their partial row statistics
(``Tuning.fwd_sync``, ``kernels._fwd_sync_kernel``: x, and the residual, read once, one program per
SM) against the table's entry ("pinned": rows in one tile up to 32768 on the H100 table, walked twice
in chunks beyond). For each op and width, M = 2^27 // N rows: every candidate is compiled first in
parallel processes (cuTile's disk cache) and checked there against the fp64 reference through the
harness's checker on (2^23 // N, N) rows (the power of two at or below), then all are timed
alternately, three rounds (``gpu_timing.bench``: do_bench median of 40 ms after 10 ms, L2 flushed).
Bytes are the harness's model of the forward (``bytes_moved(...).main``: x (+ residual) read once,
y (+ residual_out) written once), as the bench counts them.

    python tools/experiments/cutile-wide-fwd/fwd.py OUT [DTYPE]      # on a GPU, DTYPE bf16 by default
    python tools/experiments/cutile-wide-fwd/fwd.py --dry [DTYPE]    # the candidates, no GPU needed

``WIDE_N`` (comma-separated, default 16384,...,262144) narrows the widths; ``BUDGET_S`` (default 150):
no (op, N) starts after that many seconds. Writes OUT/results.jsonl (one line per (op, N): checks,
errors, ms per round, fractions of the copy bandwidth, the tunings) and OUT/meta.json, and prints one
line per (op, N).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "cutile-tuning"))  # explore: tuned, run_once

ELEMS = 2**27
CHECK_ELEMS = 2**23
OPS = ("rmsnorm", "layernorm", "add_rmsnorm")
WIDTHS = tuple(int(n) for n in os.environ.get("WIDE_N", "16384,24576,32768,49152,65536,131072,262144").split(","))
SMS = 132  # --dry's grid (an H100's SMs); on a GPU the launcher reads its own
# The exchanging candidates: changes to the table entry besides fwd_sync. One program per SM holds
# its slice in registers (fp32 after the load) plus the next block's slice in flight (x's dtype, and
# the residual's): 8192 columns on 8 warps are 32 + 16 registers a thread for x (the backward's best
# slice); 16384 on 8 warps twice that, fewer slices and twice the bytes in flight per SM; 4096 on 4
# warps with two rows a tile, the same registers as the first with shorter rows' slices; 16384 on 16
# warps, the first's registers a thread with half the siblings to wait for.
GRID = (
    {"fwd_slice": 8192, "fwd_tile_elements": 8192, "worker_warps": 8, "occupancy": 1},
    {"fwd_slice": 16384, "fwd_tile_elements": 16384, "worker_warps": 8, "occupancy": 1},
    {"fwd_slice": 4096, "fwd_tile_elements": 8192, "worker_warps": 4, "occupancy": 1},
    {"fwd_slice": 16384, "fwd_tile_elements": 16384, "worker_warps": 16, "occupancy": 1},
)
SHORT = {"fwd_slice": "s", "fwd_tile_elements": "e", "worker_warps": "w", "occupancy": "o"}


def name(c) -> str:
    return "pinned" if c is None else "sync " + " ".join(f"{SHORT[k]}{int(v)}" for k, v in c.items())


def entry(op: str, n: int) -> dict:
    """The table's entry for (op, fwd, n) on this GPU (--dry without one: the first GPU's table)."""
    from dataclasses import asdict

    import torch

    from impls.cutile import configs
    from impls.cutile.plan import Tuning

    if torch.cuda.is_available():
        return asdict(configs.choose(op, "fwd", n, torch.device("cuda", torch.cuda.current_device())))
    return asdict(Tuning(**configs._nearest(configs._table()[configs.gpus()[0]][f"{op}_fwd"], n)))


def candidates(op: str, n: int) -> dict:
    """{name: tuning} at (op, n): the entry as it is, and each exchanging variant that cuts the row
    into 2 or more slices (a row of one slice has nothing to exchange)."""
    base = entry(op, n)
    out = {name(None): base}
    for c in GRID:
        if n > c["fwd_slice"]:
            out[name(c)] = {**base, "fwd_sync": True, **c}
    return out


def check_m(n: int) -> int:
    return 1 << ((CHECK_ELEMS // n).bit_length() - 1)


def warm_group(args):
    """One (op, N)'s candidates compiled, run once on the full case and checked (in a worker
    process): ({name: check status}, {name: error})."""
    op, n, dtype, cands = args
    import torch
    from explore import kernels, run_once, tuned

    from harness.registry import get
    from harness.run.checker import run_check
    from harness.spec.shapes import Shape

    impl = get("cutile")
    k = kernels()
    case = make_case(op, n, dtype)
    checks, errors = {}, {}
    for key, t in cands.items():
        try:
            with tuned(t):
                run_once(k, op, "fwd", case)
                checks[key] = run_check(impl, op, "fwd", Shape((check_m(n), n)), dtype, "cuda").status
        except Exception as e:  # noqa: BLE001 -- a candidate that does not build is a result too
            errors[key] = f"{type(e).__name__}: {str(e)[:300]}"
    torch.cuda.synchronize()
    return op, n, checks, errors


def make_case(op: str, n: int, dtype: str):
    import torch

    from harness.spec.contract import DTYPES
    from harness.spec.inputs import make_case as make
    from harness.spec.shapes import Shape

    return make(op, Shape((ELEMS // n, n)), DTYPES[dtype], "cuda") if torch.cuda.is_available() else None


def dry(dtype: str) -> None:
    from impls.cutile.plan import Tuning, fwd_sync_plan, plan, sync_groups

    total = 0
    for n in WIDTHS:
        for op in OPS:
            m = ELEMS // n
            for key, t in candidates(op, n).items():
                tu = Tuning(**t)
                p = fwd_sync_plan(m, n, tu)
                if p is not None and sync_groups(m, p, SMS):
                    how = f"slices {p.pieces} x {p.width}, rows {p.rows}, groups {sync_groups(m, p, SMS)} on {SMS} SMs"
                else:
                    q = plan("fwd", m, n, tu)
                    how = f"{'chunks' if q.wide else 'whole row'} {q.pieces} x {q.width}, rows {q.rows}"
                print(f"{op} N={n} M={m} {dtype} check M={check_m(n)}: {key}: {how}")
                total += 1
    print(total, "candidates")


def main(out_dir: str, dtype: str, budget_s: float) -> None:
    import torch
    from explore import kernels, run_once, tuned
    from gpu_timing import bench, finish_meta, start_meta, write_result

    from harness.spec.contract import DTYPES
    from harness.spec.roofline import bytes_moved

    t0 = time.time()
    os.makedirs(out_dir, exist_ok=True)
    os.environ.setdefault("CUDA_TILE_CACHE_DIR", "/tmp/cutile-cache")
    points = [(op, n) for n in WIDTHS for op in OPS]
    cands = {p: candidates(*p) for p in points}
    results = {}
    ctx = mp.get_context("spawn")
    jobs = [(op, n, dtype, cands[(op, n)]) for op, n in points]
    with ctx.Pool(min(12, os.cpu_count() or 1)) as pool:
        for op, n, checks, errors in pool.imap_unordered(warm_group, jobs):
            results[(op, n)] = (checks, errors)
    built = sum(len(c) for c in cands.values())
    print(f"compiled and checked {built} candidates in {time.time() - t0:.0f} s", flush=True)
    k = kernels()
    meta = start_meta(variants=[name(None)] + [name(c) for c in GRID], widths=WIDTHS, dtype=dtype,
                      check_rows={n: check_m(n) for n in WIDTHS})  # fmt: skip
    copy = meta["copy_before"]["tbps"]
    with open(os.path.join(out_dir, "results.jsonl"), "w") as f:
        for op, n in points:
            if time.time() - t0 > budget_s:
                print("budget spent: stop before", op, n, flush=True)
                meta.setdefault("skipped", []).append([op, n])
                continue
            checks, errors = results[(op, n)]
            b = bytes_moved(op, "fwd", ELEMS // n, n, DTYPES[dtype].itemsize)
            rec = {"op": op, "N": n, "M": ELEMS // n, "dtype": dtype, "bytes": b.main, "bytes_extra": b.extra,
                   "checks": checks, "errors": dict(errors), "ms": {}, "tunings": cands[(op, n)]}  # fmt: skip
            case = make_case(op, n, dtype)
            runs = {key: t for key, t in cands[(op, n)].items() if key not in errors}
            for _ in range(3):
                for key, t in list(runs.items()):
                    try:
                        with tuned(t):
                            fn = run_once(k, op, "fwd", case)
                            rec["ms"].setdefault(key, []).append(round(bench(fn), 5))
                    except Exception as e:  # noqa: BLE001
                        rec["errors"][key] = f"{type(e).__name__}: {str(e)[:300]}"
                        runs.pop(key)
            write_result(f, rec, b.main, copy)
            del case
            torch.cuda.empty_cache()
    finish_meta(out_dir, meta)


if __name__ == "__main__":
    args = sys.argv[1:]
    if not args or args[0] in ("-h", "--help"):
        print(__doc__)
    elif args[0] in ("--dry", "count"):
        dry(args[1] if len(args) > 1 else "bf16")
    else:
        main(args[0], args[1] if len(args) > 1 else "bf16", float(os.environ.get("BUDGET_S", "150")))
