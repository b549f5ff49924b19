"""Gluon's slice programs for wide rows: 16 or 8 warps (``plan.BWD_SLICE_WARPS``), one or two row
blocks loaded ahead (``plan.BWD_SLICE_AHEAD``), each exchanging row sums at every width (the plan's
slice limits lifted), against the row-sums kernel on 16 warps; checked, then timed alternately.

python tools/experiments/gluon-wide-sync/slices.py OUT
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

sys.path.insert(0, os.getcwd())
from harness.spec.contract import DTYPES  # noqa: E402
from harness.spec.inputs import make_case  # noqa: E402
from harness.spec.roofline import bytes_moved  # noqa: E402
from harness.spec.shapes import Shape  # noqa: E402

ELEMS = 2**27
OPS = ("rmsnorm", "layernorm", "add_rmsnorm")
WIDE_N = tuple(int(n) for n in os.environ.get("WIDE_N", "16384,32768,65536,131072,262144").split(","))
VARIANTS = [("row_sums", None, 1, False), ("exchange w16 a1", None, 1, True), ("exchange w16 a2", None, 2, True),
            ("exchange w8 a1", 8, 1, True), ("exchange w8 a2", 8, 2, True)]  # fmt: skip


def bench(fn):
    import triton.testing

    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


def main(out_dir):
    import triton

    from harness.registry import get
    from harness.run.bench import callables
    from harness.run.checker import run_check
    from harness.run.timer import measure_copy_bandwidth
    from impls.gluon import kernels as G
    from impls.gluon import plan as P

    P.EXCHANGE_SLICES = {False: 64, True: 64}
    P.EXCHANGE_SLICES_FP32_LAYERNORM = 64
    os.makedirs(out_dir, exist_ok=True)
    impl = get("gluon")
    kernels = impl.kernels("cuda")
    meta = {"gpu": torch.cuda.get_device_name(), "triton": triton.__version__, "commit": os.environ.get("NORMBENCH_COMMIT"),
            "copy_before": measure_copy_bandwidth(trials=2)}  # fmt: skip
    copy = meta["copy_before"]["tbps"]
    t0 = time.time()

    def use(variant):
        _, warps, ahead, exchange = variant
        P.BWD_SLICE_WARPS, P.BWD_SLICE_AHEAD, G.EXCHANGE = warps, ahead, exchange

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
    meta["copy_after"] = measure_copy_bandwidth(trials=2)
    meta["time_s"] = round(time.time() - t0, 1)
    with open(os.path.join(out_dir, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
