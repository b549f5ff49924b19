"""A sleep between a waiting program's re-reads of its siblings' posts (``BACKOFF_NS``), in Gluon's
and Triton's exchanging wide-row backward: the exchange at every width (Gluon: past its plan's
limit too) with 0, 100 and 400 ns, against the row-sums kernel, checked, timed alternately.

python tools/experiments/gluon-wide-sync/backoff.py OUT
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
WIDE_N = (65536, 131072, 262144)
SLEEPS = (0, 100, 400)
TRITON_SYNC = {"rows": 1, "warps": 8, "slice": 8192, "sync": True, "ahead": 2}
TRITON_ROW_SUMS = {"rows": 1, "warps": 16, "slice": 8192, "row_sums": True}


def main(out_dir):

    from harness.registry import get
    from harness.run.bench import callables
    from harness.run.checker import run_check
    from impls.gluon import kernels as G
    from impls.gluon import plan as P
    from impls.triton import kernels as T
    from impls.triton.configs import Config
    from impls.triton.tune import pinned_kernels

    P.EXCHANGE_SLICES = {False: 64, True: 64}
    P.EXCHANGE_SLICES_FP32_LAYERNORM = 64
    os.makedirs(out_dir, exist_ok=True)
    gluon, triton_impl = get("gluon"), get("triton")
    variants = {"gluon": gluon.kernels("cuda")}
    tk = {"row_sums": pinned_kernels(triton_impl, None, Config(**TRITON_ROW_SUMS)),
          "sync": pinned_kernels(triton_impl, None, Config(**TRITON_SYNC))}  # fmt: skip
    meta = start_meta(triton_sync=TRITON_SYNC, triton_row_sums=TRITON_ROW_SUMS)
    copy = meta["copy_before"]["tbps"]
    with open(os.path.join(out_dir, "results.jsonl"), "w") as f:
        for n in WIDE_N:
            for op in OPS:
                shape = Shape((ELEMS // n, n))
                case = make_case(op, shape, DTYPES["bf16"], "cuda")
                nbytes = bytes_moved(op, "bwd", shape.m, shape.n, 2).main
                fns = {
                    "gluon": callables(variants["gluon"], op, "bwd", case),
                    "triton_sync": callables(tk["sync"], op, "bwd", case),
                    "triton_row_sums": callables(tk["row_sums"], op, "bwd", case),
                }
                # (name, fn, setup): the row-sums ways once, the exchanges at each sleep
                runs = [("gluon row_sums", "gluon", ("gluon", False, 0)), ("triton row_sums", "triton_row_sums", None)]
                runs += [(f"gluon exchange {s} ns", "gluon", ("gluon", True, s)) for s in SLEEPS]
                runs += [(f"triton sync {s} ns", "triton_sync", ("triton", True, s)) for s in SLEEPS]
                rec = {"op": op, "N": n, "M": shape.m, "checks": {}, "ms": {}}

                def setup(s):
                    if s is None:
                        return
                    dsl, on, ns = s
                    if dsl == "gluon":
                        G.EXCHANGE, G.BACKOFF_NS = on, ns
                    else:
                        T.BACKOFF_NS = ns

                for name, _, s in runs:
                    if s and s[1] and s[2] in (0, 400):  # the exchange checked at two sleeps
                        setup(s)
                        kern = gluon if s[0] == "gluon" else None
                        if kern is not None:
                            chk = run_check(gluon, op, "bwd", Shape((512, n)), "bf16", "cuda")
                        else:
                            chk = run_check(triton_impl, op, "bwd", Shape((512, n)), "bf16", "cuda", kernels=tk["sync"])
                        rec["checks"][name] = chk.status
                for _ in range(3):
                    for name, key, s in runs:
                        setup(s)
                        rec["ms"].setdefault(name, []).append(round(bench(fns[key]), 5))
                G.EXCHANGE, G.BACKOFF_NS, T.BACKOFF_NS = True, 0, 0
                rec["frac"] = {k: round(nbytes / (sorted(v)[1] * 1e-3) / 1e12 / copy, 4) for k, v in rec["ms"].items()}
                f.write(json.dumps(rec) + "\n")
                f.flush()
                print(op, n, rec["checks"], rec["frac"], flush=True)
                del fns, case
                torch.cuda.empty_cache()
    finish_meta(out_dir, meta)


if __name__ == "__main__":
    main(sys.argv[1])
