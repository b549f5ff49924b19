"""Gluon's slice programs for wide rows: 16 or 8 warps (``plan.BWD_SLICE_WARPS``), each exchanging
row sums at every width (the plan's slice limits lifted), against the row-sums kernel on 16 warps;
checked, then timed alternately. (Run at 40104df, it also crossed one or two row blocks loaded
ahead; two gained nothing and that path was removed.)

python tools/experiments/gluon-wide-sync/slices.py OUT
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from gpu_timing import bench, finish_meta, start_meta

from harness.spec.contract import DTYPES
from harness.spec.inputs import make_case
from harness.spec.roofline import bytes_moved
from harness.spec.shapes import Shape

ELEMS = 2**27
OPS = ("rmsnorm", "layernorm", "add_rmsnorm")
WIDE_N = tuple(int(n) for n in os.environ.get("WIDE_N", "16384,32768,65536,131072,262144").split(","))
VARIANTS = [("row_sums", None, False), ("exchange w16 a1", None, True), ("exchange w8 a1", 8, True)]


def main(out_dir):
    from harness.registry import get
    from harness.run.bench import callables
    from harness.run.checker import run_check
    from impls.gluon import kernels as G
    from impls.gluon import plan as P

    P.EXCHANGE_SLICES = 64
    P.EXCHANGE_SLICES_FP32_LAYERNORM = 64
    os.makedirs(out_dir, exist_ok=True)
    impl = get("gluon")
    kernels = impl.kernels("cuda")
    meta = start_meta()
    copy = meta["copy_before"]["tbps"]

    def use(variant):
        _, warps, exchange = variant
        P.BWD_SLICE_WARPS, P.EXCHANGE_WIDE, G.EXCHANGE = warps, 1, exchange

    with open(os.path.join(out_dir, "results.jsonl"), "w") as f:
        for n in WIDE_N:
            for op in OPS:
                shape = Shape((ELEMS // n, n))
                case = make_case(op, shape, DTYPES["bf16"], "cuda")
                fn = callables(kernels, op, "bwd", case)
                nbytes = bytes_moved(op, "bwd", shape.m, shape.n, 2).main
                rec = {"op": op, "N": n, "M": shape.m, "checks": {}, "ms": {}}
                for v in VARIANTS:
                    use(v)
                    rec["checks"][v[0]] = run_check(impl, op, "bwd", Shape((512, n)), "bf16", "cuda").status
                for _ in range(3):
                    for v in VARIANTS:
                        use(v)
                        rec["ms"].setdefault(v[0], []).append(round(bench(fn), 5))
                use(VARIANTS[1])
                rec["frac"] = {k: round(nbytes / (sorted(t)[1] * 1e-3) / 1e12 / copy, 4) for k, t in rec["ms"].items()}
                f.write(json.dumps(rec) + "\n")
                f.flush()
                print(op, n, rec["checks"], {k: round(v * 100, 1) for k, v in rec["frac"].items()}, flush=True)
                del fn, case
                torch.cuda.empty_cache()
    finish_meta(out_dir, meta)


if __name__ == "__main__":
    main(sys.argv[1])
