"""Helion's backward for wide rows as one kernel whose column slices exchange their row sums
(``kernels.py``, ``*_bwd_sync``: x and dy read once) against the pinned choice (the split
backward's two kernels, x and dy read twice, or the resident kernel where that is pinned), for
rmsnorm, layernorm and add_rmsnorm. Candidates cross the slice width with the rows a step and the
warps. Each is checked against the fp64 reference on (512, N), then all are timed alternately,
three rounds, bf16, M * N = 2^27.

    python tools/experiments/helion-wide-sync/sync.py OUT

``WIDE_N`` (comma-separated) narrows the widths; no new (op, N) starts after ``BUDGET_S`` seconds
(default 420). Writes OUT/results.jsonl (one line per (op, N): each candidate's choice, grid,
check, compile + check seconds, errors, ms per round, fractions of the copy bandwidth) and
OUT/meta.json.
"""

from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from gpu_timing import bench, finish_meta, start_meta, write_result

ELEMS = 2**27
OPS = ("rmsnorm", "layernorm", "add_rmsnorm")
WIDTHS = tuple(
    int(n) for n in os.environ.get("WIDE_N", "10240,12288,16384,24576,32768,65536,131072,262144").split(",")
)
BUDGET_S = float(os.environ.get("BUDGET_S", "420"))
# (slice width, rows a step, warps): 16-32 elements of a row tensor per thread and step, the slice
# and step of the tuned split entries (2048 x 2 on 8 warps) among them; 1024-column slices only
# where a row's slices fit the SMs (else the split kernels run)
GRID = (
    (1024, 2, 4),
    (2048, 1, 4),
    (2048, 2, 8),
    (4096, 1, 8),
    (4096, 2, 8),
    (4096, 2, 16),
    (8192, 1, 8),
    (8192, 1, 16),
)


def name(c) -> str:
    return "pinned" if c is None else "s{} r{} w{}".format(*c)


def candidate(family: str, n: int, pinned, c):
    """The entry naming the exchanging kernel for grid point ``c``: the split config whose column
    tile and step it takes (``configs.sync_config``), with the pinned entry's row sums for the
    split fallback (the tuner's row walk where the pinned entry has none)."""
    from impls.helion.configs import Pinned

    width, rows, warps = c
    row_walk = {"block_sizes": [1], "reduction_loops": [None if n <= 16384 else 8192], "num_warps": 32}
    first = pinned.first_pass or row_walk
    return Pinned(f"{family}_bwd_sync", {"block_sizes": [128, width, rows], "num_warps": warps}, "candidate", first)


def main(out_dir: str) -> None:
    import helion

    from harness.registry import get
    from harness.run.bench import callables
    from harness.run.checker import run_check
    from harness.spec.contract import DTYPES
    from harness.spec.inputs import make_case
    from harness.spec.roofline import bytes_moved
    from harness.spec.shapes import Shape
    from impls.helion import configs
    from impls.helion.tune import pinned_kernels

    t0 = time.time()
    os.makedirs(out_dir, exist_ok=True)
    impl = get("helion")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    meta = start_meta(variants=[name(c) for c in (None, *GRID)], widths=WIDTHS, budget_s=BUDGET_S,
                      helion=getattr(helion, "__version__", None), sms=sms)  # fmt: skip
    copy = meta["copy_before"]["tbps"]
    skipped = []
    with open(os.path.join(out_dir, "results.jsonl"), "w") as f:
        for n in WIDTHS:
            for op in OPS:
                if time.time() - t0 > BUDGET_S:
                    print("budget spent: skip", op, n, flush=True)
                    skipped.append([op, n])
                    continue
                family = "layernorm" if op == "layernorm" else "rmsnorm"
                m = ELEMS // n
                shape = Shape((m, n))
                case = make_case(op, shape, DTYPES["bf16"], "cuda")
                rows = configs.FUSED_ADD_ROWS["bwd"] if op == "add_rmsnorm" else 1.0
                pinned = configs.choose(f"{family}_bwd", case["x"], rows=rows)
                nbytes = bytes_moved(op, "bwd", m, n, 2).main
                rec = {"op": op, "N": n, "M": m, "pinned": pinned.entry(), "choices": {}, "grid": {},
                       "checks": {}, "compile_and_check_s": {}, "errors": {}, "ms": {}}  # fmt: skip
                runs = {}
                for c in (None, *GRID):
                    key = name(c)
                    choices = {}
                    if c is not None:
                        choice = candidate(family, n, pinned, c)
                        choices = {f"{family}_bwd": choice}
                        rec["choices"][key] = choice.entry()
                        slices = -(-n // c[0])
                        rec["grid"][key] = (
                            {"slices": slices, "groups": max(1, min(-(-m // c[1]), sms // slices))}
                            if slices <= sms
                            else "split (more slices than SMs)"
                        )
                    kern = pinned_kernels(impl, choices)
                    t = time.time()
                    try:
                        check = run_check(impl, op, "bwd", Shape((512, n)), "bf16", "cuda", kernels=kern)
                        rec["checks"][key] = check.status
                        if check.status != "pass":
                            rec["errors"][key] = check.summary()[:300]
                        fn = callables(kern, op, "bwd", case)
                        fn()
                        torch.cuda.synchronize()
                        runs[key] = fn
                    except Exception as e:  # noqa: BLE001 -- a candidate that does not build is a result too
                        rec["errors"][key] = f"{type(e).__name__}: {str(e)[:300]}"
                    rec["compile_and_check_s"][key] = round(time.time() - t, 1)
                    print(op, n, key, rec["checks"].get(key), rec["compile_and_check_s"][key], "s",
                          rec["errors"].get(key, ""), flush=True)  # fmt: skip
                for _ in range(3):
                    for key, fn in runs.items():
                        rec["ms"].setdefault(key, []).append(round(bench(fn), 5))
                write_result(f, rec, nbytes, copy)
                del runs, case
                torch.cuda.empty_cache()
    meta["skipped"] = skipped
    finish_meta(out_dir, meta)


if __name__ == "__main__":
    main(sys.argv[1])
