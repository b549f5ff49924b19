"""CuTe DSL's realigned backward for rows whose length is no multiple of a 16-byte vector: each
(op, N, dtype) checked against the fp64 reference with the realigned kernel (registers promised
per thread: ``plan.REALIGNED_MIN_REGISTERS``, 0 for the ring's own CTA count) and with the
element-wise one it replaces (``kernels.REALIGN_BACKWARD``), on 37 rows (every offset within a
vector), M = 5 (fewer rows than CTAs) and the timed shape (the committed setting's), then all timed
at M * N = 2^27 in three alternating rounds.

python tools/experiments/cute-odd-rows/explore.py run OUT BUDGET_S [DTYPE]
    -> OUT/results.jsonl (per point and path: the checks, the times, the fraction of the copy
       bandwidth), OUT/meta.json (GPU, versions, the copy bandwidth before and after).

Environment: ODD_N (default 2999,3001,4001,5003,6007,8191), OPS (rmsnorm,layernorm,add_rmsnorm).
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from gpu_timing import bench, cli, finish_meta, fraction, start_meta

from harness.spec.contract import DTYPES
from harness.spec.inputs import make_case
from harness.spec.roofline import bytes_moved
from harness.spec.shapes import Shape
from impls.cute import kernels as K
from impls.cute import plan as P
from impls.cute.plan import realigned_launch

ELEMS = 2**27
OPS = tuple(os.environ.get("OPS", "rmsnorm,layernorm,add_rmsnorm").split(","))
ODD_N = tuple(int(n) for n in os.environ.get("ODD_N", "2999,3001,4001,5003,6007,8191").split(","))
COMMITTED = P.REALIGNED_MIN_REGISTERS
PATHS = {"element-wise": (False, COMMITTED), **{f"realigned-{r}": (True, r) for r in (0, 128, 168)}}


def use(path):
    on, registers = PATHS[path]
    K.REALIGN_BACKWARD = on
    if registers != P.REALIGNED_MIN_REGISTERS:
        P.REALIGNED_MIN_REGISTERS = registers
        P.realigned_launch.cache_clear()
        K.kernel_key.cache_clear()


def jobs(dtype="bf16"):
    size = DTYPES[dtype].itemsize
    return [(op, n) for n in ODD_N for op in OPS
            if realigned_launch(n, size, "layernorm" if op == "layernorm" else "rmsnorm", op == "add_rmsnorm")]  # fmt: skip


def impl_and_kernels():
    from harness.registry import get

    impl = get("cute")
    return impl, impl.kernels("cuda")


def warm(i, k):
    pass


def run(out_dir, budget_s, dtype="bf16"):
    from harness.run.bench import callables
    from harness.run.checker import run_check

    t0 = time.time()
    os.makedirs(out_dir, exist_ok=True)
    meta = start_meta(dtype=dtype, odd_n=ODD_N, impl="cute")
    copy_tbps = meta["copy_before"]["tbps"]
    impl, kernels = impl_and_kernels()
    with open(os.path.join(out_dir, "results.jsonl"), "w") as f:
        for op, n in jobs(dtype):
            if time.time() - t0 > budget_s:
                meta.setdefault("skipped", []).append([op, n])
                continue
            shape = Shape((ELEMS // n, n))
            nbytes = bytes_moved(op, "bwd", shape.m, shape.n, DTYPES[dtype].itemsize).main
            fn = callables(kernels, op, "bwd", make_case(op, shape, DTYPES[dtype], "cuda"))
            recs = {}
            for tag in PATHS:
                use(tag)
                rec = recs[tag] = {"op": op, "direction": "bwd", "N": n, "M": shape.m, "dtype": dtype, "path": tag,
                                   "bytes": nbytes, "checks": {}, "ms": []}  # fmt: skip
                committed = tag in ("element-wise", f"realigned-{COMMITTED}")
                for m in (37, 5, shape.m) if committed else (37, 5):
                    chk = run_check(impl, op, "bwd", Shape((m, n)), dtype, "cuda", kernels=kernels)
                    rec["checks"][m] = chk.status if chk.status == "pass" else chk.summary()[:300]
                fn()
                key = [k for k in K._COMPILED if k[1] == "bwd"][-1]
                kernel = K._COMPILED[key][1]
                rec["launch"], rec["ring"], rec["resident"] = str(kernel.launch), str(kernel.ring), K._RESIDENT.get(key)
            for _ in range(3):
                for tag in PATHS:
                    use(tag)
                    recs[tag]["ms"].append(round(bench(fn), 5))
            for rec in recs.values():
                rec["frac"] = fraction(rec["ms"], nbytes, copy_tbps)
                f.write(json.dumps(rec) + "\n")
                print(op, n, rec["path"], rec["checks"], rec["ms"], rec["frac"], flush=True)
            f.flush()
            use(f"realigned-{COMMITTED}")
            del fn
            torch.cuda.empty_cache()
    finish_meta(out_dir, meta)


if __name__ == "__main__":
    cli(warm, jobs, run)
