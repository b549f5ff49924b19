"""Triton's exchanging slices with several programs per SM (``Config.programs_per_sm`` with
``sync``; the launcher caps it at what the binary lets an SM hold), against the pinned configs, at
N = 10240-32768: the shape that lifted Gluon's backward there (reports/experiments/gluon-wide-sync/,
round 2). Each candidate is checked against the fp64 reference on (512, N), then all are timed
alternately, three rounds, bf16, M * N = 2^27.

python tools/experiments/triton-wide-sync/spread.py OUT
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from gpu_timing import bench, finish_meta, start_meta, write_result

from harness.spec.contract import DTYPES
from harness.spec.inputs import make_case
from harness.spec.roofline import bytes_moved
from harness.spec.shapes import Shape
from impls.triton.configs import Config

ELEMS = 2**27
OPS = ("rmsnorm", "layernorm", "add_rmsnorm")
WIDTHS = tuple(int(n) for n in os.environ.get("WIDE_N", "10240,12288,16384,24576,32768").split(","))
# (slice, warps, programs per SM, blocks ahead)
GRID = ((2048, 4, 4, 1), (2048, 4, 2, 1), (4096, 8, 2, 1), (4096, 4, 2, 1), (4096, 8, 2, 2))


def name(c) -> str:
    return "pinned" if c is None else "s{} w{} p{} a{}".format(*c)


def main(out_dir: str) -> None:
    from harness.registry import get
    from harness.run.bench import callables
    from harness.run.checker import run_check
    from impls.triton import kernels as K
    from impls.triton.tune import pinned_kernels

    impl = get("triton")
    os.makedirs(out_dir, exist_ok=True)
    meta = start_meta(variants=[name(c) for c in (None, *GRID)])
    copy = meta["copy_before"]["tbps"]
    with open(os.path.join(out_dir, "results.jsonl"), "w") as f:
        for n in WIDTHS:
            for op in OPS:
                shape = Shape((ELEMS // n, n))
                case = make_case(op, shape, DTYPES["bf16"], "cuda")
                nbytes = bytes_moved(op, "bwd", shape.m, shape.n, 2).main
                rec = {"op": op, "N": n, "checks": {}, "errors": {}, "ms": {}}
                runs = {}
                for c in (None, *GRID):
                    cfg = (
                        None
                        if c is None
                        else Config(rows=1, warps=c[1], slice=c[0], sync=True, programs_per_sm=c[2], ahead=c[3])
                    )
                    kern = pinned_kernels(impl, None, cfg)
                    try:
                        rec["checks"][name(c)] = run_check(
                            impl, op, "bwd", Shape((512, n)), "bf16", "cuda", kernels=kern
                        ).status
                        fn = callables(kern, op, "bwd", case)
                        fn()
                        fn()  # the second launch runs the programs per SM the binary allows
                        torch.cuda.synchronize()
                        runs[name(c)] = fn
                    except Exception as e:  # noqa: BLE001 -- a candidate that does not build is a result too
                        rec["errors"][name(c)] = f"{type(e).__name__}: {str(e)[:300]}"
                rec["held"] = {str(k[0]): v for k, v in K._SYNC_HELD.items() if k[1] == n}
                for _ in range(3):
                    for k, fn in runs.items():
                        rec["ms"].setdefault(k, []).append(round(bench(fn), 5))
                write_result(f, rec, nbytes, copy)
                del runs, case
                torch.cuda.empty_cache()
    finish_meta(out_dir, meta)


if __name__ == "__main__":
    main(sys.argv[1])
