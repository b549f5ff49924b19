"""Gluon's sliced backward for wide rows: the slices exchanging their row sums (``EXCHANGE``)
against the row-sums kernel (x and dy read twice), each checked against the fp64 reference, timed
alternately, and launched repeatedly for NaN rows and repeatability.

python tools/experiments/gluon-wide-sync/explore.py OUT [DTYPES]
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
WIDE_N = (10240, 12288, 16384, 24576, 32768, 49152, 65536, 131072, 262144)


def main(out_dir, dtypes):
    from harness.registry import get
    from harness.run.bench import callables
    from harness.run.checker import run_check
    from impls.gluon import kernels as K

    os.makedirs(out_dir, exist_ok=True)
    impl = get("gluon")
    kernels = impl.kernels("cuda")
    meta = start_meta()
    copy = meta["copy_before"]["tbps"]
    with open(os.path.join(out_dir, "results.jsonl"), "w") as f:
        for dt in dtypes:
            for n in WIDE_N:
                for op in OPS:
                    shape = Shape((ELEMS // n, n))
                    case = make_case(op, shape, DTYPES[dt], "cuda")
                    fn = callables(kernels, op, "bwd", case)
                    rec = {"op": op, "N": n, "M": shape.m, "dtype": dt}
                    K.EXCHANGE = True
                    chk = run_check(impl, op, "bwd", Shape((512, n)), dt, "cuda")
                    rec["check_exchange"] = chk.status
                    first, nan, differ = None, 0, 0
                    for _ in range(20):  # repeated launches: NaN rows (a wait that ran out), same bits
                        dx = fn()[0]
                        nan += bool(torch.isnan(dx).any().item())
                        if first is None:
                            first = dx.clone()
                        differ += not torch.equal(first, dx)
                    rec["launches"], rec["launches_with_nan"], rec["launches_differing"] = 20, nan, differ
                    ms = {"exchange": [], "row_sums": []}
                    for _ in range(3):
                        for mode in ("row_sums", "exchange"):
                            K.EXCHANGE = mode == "exchange"
                            ms[mode].append(round(bench(fn), 5))
                    K.EXCHANGE = True
                    nbytes = bytes_moved(op, "bwd", shape.m, shape.n, DTYPES[dt].itemsize).main
                    for mode, v in ms.items():
                        med = sorted(v)[1]
                        rec[f"ms_{mode}"] = v
                        rec[f"frac_{mode}"] = round(nbytes / (med * 1e-3) / 1e12 / copy, 4)
                    f.write(json.dumps(rec) + "\n")
                    f.flush()
                    print(json.dumps(rec), flush=True)
                    del fn, case, first, dx
                    torch.cuda.empty_cache()
    finish_meta(out_dir, meta)


if __name__ == "__main__":
    main(sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "bf16").split(","))
