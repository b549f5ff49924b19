"""cuTile's backward for rows wider than one tile (N > 8192): the column slices exchanging their row
sums among themselves (``Tuning.sync``, ``kernels._bwd_sync_kernel``: x and dy read once) against
the table's entry (the first kernel's per-slice sums, then the sliced kernel: x and dy read twice).
Candidates change the slice width, the rows per tile and the compiler's hints of the table
entry (round two crossed slices of 2048-8192 columns with 1-4 rows and the hints; round three
searches around its best). Each candidate is compiled in parallel processes first (cuTile's disk cache),
checked against the fp64 reference on (512, N), then all are timed alternately, three rounds, bf16,
M * N = 2^27.

    python tools/experiments/cutile-wide-sync/sync.py OUT [BUDGET_S]

``WIDE_N`` (comma-separated) narrows the widths. Writes OUT/results.jsonl (one line per (op, N):
checks, errors, ms per round, fractions of the copy bandwidth) and OUT/meta.json.
"""

from __future__ import annotations

import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "cutile-tuning"))
from explore import ELEMS, OPS, case_of, kernels, run_once, tuned, warm  # noqa: E402
from gpu_timing import bench, finish_meta, start_meta, write_result  # noqa: E402

WIDTHS = tuple(int(n) for n in os.environ.get("WIDE_N", "10240,12288,16384,24576,32768,49152,65536,131072,262144").split(","))
# Round three: around round two's best (8192-wide slices, one row, 8 worker warps, occupancy 1),
# with LayerNorm's two sums awaited together. Each: the changes to the table entry besides sync.
GRID = (
    dict(bwd_slice=8192, bwd_tile_elements=8192, worker_warps=8, occupancy=1),
    dict(bwd_slice=8192, bwd_tile_elements=8192, worker_warps=8, occupancy=2),
    dict(bwd_slice=8192, bwd_tile_elements=8192, worker_warps=4, occupancy=1),
    dict(bwd_slice=8192, bwd_tile_elements=8192, worker_warps=8, occupancy=1, tma_store=False),
    dict(bwd_slice=8192, bwd_tile_elements=8192, worker_warps=8, occupancy=1, latency=4),
    dict(bwd_slice=8192, bwd_tile_elements=16384, worker_warps=8, occupancy=1),
    dict(bwd_slice=16384, bwd_tile_elements=16384, bwd_row_max=8192, worker_warps=8, occupancy=1),
    dict(bwd_slice=4096, bwd_tile_elements=4096, worker_warps=8, occupancy=1),
)
SHORT = {"bwd_slice": "s", "bwd_tile_elements": "e", "worker_warps": "w", "occupancy": "o", "tma_store": "ts",
         "latency": "l", "bwd_row_max": "max"}  # fmt: skip


def name(c) -> str:
    return "table" if c is None else " ".join(f"{SHORT[k]}{int(v)}" for k, v in c.items())


def tuning_of(op: str, n: int, c) -> dict:
    """The table entry's fields for (op, bwd, n), with sync and the candidate's changes (None: the
    entry as it is; round two timed ``Tuning()``'s defaults under that name instead, the first
    version's plan, not the entry)."""
    from dataclasses import asdict

    from impls.cutile import configs

    t = asdict(configs.choose(op, "bwd", n, torch.device("cuda", torch.cuda.current_device())))
    return t if c is None else {**t, "sync": True, **c}


def main(out_dir: str, budget_s: float) -> None:
    from harness.registry import get
    from harness.run.checker import run_check
    from harness.spec.roofline import bytes_moved
    from harness.spec.shapes import Shape

    t0 = time.time()
    os.makedirs(out_dir, exist_ok=True)
    os.environ.setdefault("CUDA_TILE_CACHE_DIR", "/tmp/cutile-cache")
    cands = (None, *GRID)
    points = [(op, n) for n in WIDTHS for op in OPS]
    warm([(op, "bwd", n, [tuning_of(op, n, c) for c in cands]) for op, n in points], min(12, os.cpu_count() or 1))
    impl = get("cutile")
    k = kernels()
    meta = start_meta(variants=[name(c) for c in cands], widths=WIDTHS)
    copy = meta["copy_before"]["tbps"]
    with open(os.path.join(out_dir, "results.jsonl"), "w") as f:
        for op, n in points:
            if time.time() - t0 > budget_s:
                print("budget spent: stop before", op, n, flush=True)
                break
            case = case_of(op, "bwd", n)
            nbytes = bytes_moved(op, "bwd", ELEMS // n, n, 2).main
            rec = {"op": op, "N": n, "checks": {}, "errors": {}, "ms": {}, "tunings": {}}
            runs = {}
            for c in cands:
                t = tuning_of(op, n, c)
                rec["tunings"][name(c)] = t
                try:
                    with tuned(t):
                        rec["checks"][name(c)] = run_check(impl, op, "bwd", Shape((512, n)), "bf16", "cuda").status
                        run_once(k, op, "bwd", case)
                    runs[name(c)] = t
                except Exception as e:  # noqa: BLE001 -- a candidate that does not build is a result too
                    rec["errors"][name(c)] = f"{type(e).__name__}: {str(e)[:300]}"
            for _ in range(3):
                for key, t in runs.items():
                    with tuned(t):
                        fn = run_once(k, op, "bwd", case)
                        rec["ms"].setdefault(key, []).append(round(bench(fn), 5))
            write_result(f, rec, nbytes, copy)
            del case
            torch.cuda.empty_cache()
    finish_meta(out_dir, meta)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 420)
