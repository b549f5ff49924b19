"""Gluon's forward of wide rows: the current choice ("pinned": one program a row, the whole row in
registers up to 32768 16-bit columns, else walked twice in chunks) against column slices that read
the row once and exchange their partial statistics through global memory (``_fwd_sliced_kernel``,
forced through ``plan.FWD_EXCHANGE``). Per op and N (M = 2^27 // N, M·N = 2^27), each candidate is
checked against the fp64 reference on (512, N) (the harness's checker), launched 5 times for NaN
and repeatability, then all are timed alternately, three rounds (``do_bench`` medians, L2 flushed);
the fraction is of the copy bandwidth over the harness's forward bytes (x (+ residual) read, y
(+ residual_out) written once). A candidate is (slice columns, warps, rows a block, programs per
SM); "path" records the kernel each one launched (a candidate whose slices outnumber the resident
programs runs the old forward). Results: OUT/results.jsonl, OUT/meta.json, one line per (op, N).

    python tools/experiments/gluon-wide-fwd/fwd.py OUT [DTYPE]      # on a GPU; DTYPE bf16 (default), fp16, fp32
    python tools/experiments/gluon-wide-fwd/fwd.py --dry [DTYPE]    # no GPU: the jobs and candidates

Env: WIDE_N (default 16384,24576,32768,49152,65536,131072,262144); BUDGET_S (default 150): no new
(op, N) starts after that many seconds.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ELEMS = 2**27
OPS = ("rmsnorm", "layernorm", "add_rmsnorm")
WIDE_N = tuple(int(n) for n in os.environ.get("WIDE_N", "16384,24576,32768,49152,65536,131072,262144").split(","))
# (slice columns, warps along N, rows a block, programs per SM), 32 16-bit elements a thread each:
# 8192 columns on 8 warps, one program per SM (16 KB of x a block, the next block's in flight while
# it waits); 16384 on 16 warps, one per SM (half the siblings to wait for); two rows a block on 16
# warps, in 8192- and 16384-column slices (twice the bytes per exchange; 64 elements a thread for
# the second); 32768 on 32 warps (a quarter of the siblings). 4096 on 4 warps, two per SM, lost
# everywhere in the first round (reports/experiments/gluon-wide-fwd/, commit bcbddcf) and is gone.
CANDIDATES = ((8192, 8, 1, 1), (16384, 16, 1, 1), (8192, 16, 2, 1), (16384, 16, 2, 1), (32768, 32, 1, 1))
LAUNCHES = 5


def name(v) -> str:
    return v if isinstance(v, str) else "s{} w{} r{} p{}".format(*v)


def jobs():
    return [(op, n) for n in WIDE_N for op in OPS]


def dry(dtype: str) -> None:
    from impls.gluon import plan as P

    elem = {"bf16": 2, "fp16": 2, "fp32": 4}[dtype]
    for op, n in jobs():
        pinned = P.fwd_exchange_plan(op, n, elem)
        cur = "exchange" if pinned else ("chunked" if P.plan("fwd", n, elem).wide else "whole row")
        cands = []
        for c in CANDIDATES:
            P.FWD_EXCHANGE = {(op, elem, P.next_pow2(n)): c}
            p = P.fwd_exchange_plan(op, n, elem)
            cands.append(f"{name(c)}: {p.pieces if p else 'no'} slices")
        P.FWD_EXCHANGE = {}
        print(op, n, ELEMS // n, f"pinned ({cur});", "; ".join(cands))
    print(len(jobs()), "jobs,", 1 + len(CANDIDATES), "candidates each")


def main(out_dir: str, dtype: str) -> None:
    import torch
    from gpu_timing import bench, finish_meta, start_meta, write_result

    from harness.registry import get
    from harness.run.bench import callables
    from harness.run.checker import run_check
    from harness.spec.contract import DTYPES
    from harness.spec.inputs import make_case
    from harness.spec.roofline import bytes_moved
    from harness.spec.shapes import Shape
    from impls.gluon import kernels as G
    from impls.gluon import plan as P

    budget = float(os.environ.get("BUDGET_S", "150"))
    started = time.time()
    os.makedirs(out_dir, exist_ok=True)
    impl = get("gluon")
    kernels = impl.kernels("cuda")
    pinned = dict(P.FWD_EXCHANGE)
    elem = DTYPES[dtype].itemsize
    meta = start_meta(dtype=dtype, widths=list(WIDE_N), candidates=[name(c) for c in CANDIDATES], budget_s=budget)
    copy = meta["copy_before"]["tbps"]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    own_launch, paths = G._launch, []

    def spy(kernel, *args):
        paths.append(kernel.fn.__name__)
        return own_launch(kernel, *args)

    G._launch = spy

    def use(v, op, n):
        P.FWD_EXCHANGE = dict(pinned) if v == "pinned" else {**pinned, (op, elem, P.next_pow2(n)): v}

    skipped = []
    with open(os.path.join(out_dir, "results.jsonl"), "w") as f:
        for op, n in jobs():
            if time.time() - started > budget:
                skipped.append([op, n])
                continue
            shape = Shape((ELEMS // n, n))
            case = make_case(op, shape, DTYPES[dtype], "cuda")
            fn = callables(kernels, op, "fwd", case)
            nbytes = bytes_moved(op, "fwd", shape.m, shape.n, elem).main
            rec = {"op": op, "N": n, "M": shape.m, "dtype": dtype, "sms": sms, "checks": {}, "path": {}, "ms": {},
                   "errors": {}, "launches_with_nan": {}, "launches_differing": {}}  # fmt: skip
            live = []
            for v in ("pinned", *CANDIDATES):
                try:
                    use(v, op, n)
                    rec["checks"][name(v)] = run_check(impl, op, "fwd", Shape((512, n)), dtype, "cuda").status
                    paths.clear()
                    first, nan, differ = None, 0, 0
                    for _ in range(LAUNCHES):  # a wait that ran out gives NaN; the merge is in slice order
                        y = fn()[0]
                        nan += bool(torch.isnan(y).any().item())
                        first = y.clone() if first is None else first
                        differ += not torch.equal(first, y)
                    torch.cuda.synchronize()
                    rec["path"][name(v)] = paths[0] if paths else None
                    rec["launches_with_nan"][name(v)], rec["launches_differing"][name(v)] = nan, differ
                    live.append(v)
                    del first, y
                except Exception as e:  # noqa: BLE001 -- a candidate that does not build or launch is a result too
                    rec["errors"][name(v)] = f"{type(e).__name__}: {str(e)[:300]}"
            for _ in range(3):
                for v in live:
                    use(v, op, n)
                    rec["ms"].setdefault(name(v), []).append(round(bench(fn), 5))
            use("pinned", op, n)
            write_result(f, rec, nbytes, copy)
            del fn, case
            torch.cuda.empty_cache()
    G._launch = own_launch
    P.FWD_EXCHANGE = pinned
    meta["skipped_after_budget"] = skipped
    finish_meta(out_dir, meta)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    if sys.argv[1] in ("--dry", "count"):
        dry(sys.argv[2] if len(sys.argv) > 2 else "bf16")
    else:
        main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "bf16")
