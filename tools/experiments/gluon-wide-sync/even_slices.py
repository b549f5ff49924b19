"""Gluon's backward between one program's row and the wide rows (N = 10240-32768): slices that cut
the row evenly, against the plan's 8192-column slices (at 10240 and 12288 one full slice and a part,
so the programs of the part idle while their siblings finish; LayerNorm there even reads x and dy
twice, through the row-sums kernel). Each variant exchanges its row sums (one program per SM; with
``per_sm`` 2, two, where the binary lets an SM hold both), is checked against the fp64 reference on
(512, N), then timed alternately with the others, three rounds.

A variant is (slice columns, warps along N, rows a block, programs per SM); "plan" is the plan's
own launch; "whole" is one program per row, the row in one power-of-two tile (16 warps), which the
plan leaves above 8192 columns because its dw and db spill.

ROUND=1|2 python tools/experiments/gluon-wide-sync/even_slices.py OUT [N,...]
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

ELEMS = 2**27
OPS = ("rmsnorm", "layernorm", "add_rmsnorm")
# (slice, warps along N, rows a block, programs per SM); "plan": the plan's own; "whole": one tile.
# The first round (``ROUND=1``) crossed slices and warps at one program per SM with a few of more;
# the second (the default) took its winners' shape to more programs per SM and more widths.
ROUNDS = {
    "1": ((10240, 12288, 16384, 24576), (
        "plan", "whole",
        (2048, 4, 1, 1), (2048, 4, 1, 4), (2048, 8, 1, 2),
        (4096, 8, 1, 1), (4096, 8, 2, 1), (4096, 16, 1, 1), (4096, 8, 1, 2),
    )),
    "2": ((10240, 12288, 16384, 20480, 24576, 32768, 49152, 65536), (
        "plan",
        (2048, 4, 1, 3), (2048, 4, 1, 4), (2048, 2, 1, 4), (1024, 4, 1, 4),
        (4096, 8, 1, 2), (4096, 8, 2, 1), (4096, 4, 1, 2),
    )),
}  # fmt: skip
WIDTHS, VARIANTS = ROUNDS[os.environ.get("ROUND", "2")]


def name(v) -> str:
    return v if isinstance(v, str) else "s{} w{} r{} p{}".format(*v)


def main(out_dir: str, widths) -> None:
    from harness.registry import get
    from harness.run.bench import callables
    from harness.run.checker import run_check
    from impls.gluon import kernels as G
    from impls.gluon import plan as P

    own_plan, own_sm = G.plan, G.sm_count
    os.makedirs(out_dir, exist_ok=True)
    impl = get("gluon")
    kernels = impl.kernels("cuda")
    meta = start_meta(round=os.environ.get("ROUND", "2"), variants=[name(v) for v in VARIANTS])
    copy = meta["copy_before"]["tbps"]
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def use(v, n, fn):
        G._RESIDENT.clear()  # its key holds no tile: a variant's residency is its own
        G.sm_count = own_sm
        if v == "plan":
            G.plan = own_plan
            return
        if v == "whole":
            custom = P.Plan(P.tile(P.next_pow2(n), 2), 1)
        else:
            width, warps, rows, _ = v
            # 16-byte vectors, a warp's lanes along N, ``rows`` rows a thread (the layout repeated)
            custom = P.Plan(P.Tile(width, 8, (1, 32), (1, warps), rows), -(-n // width), True)

        def patched(direction, n_, elem_size, layernorm=False):
            if direction == "bwd" and n_ == n and elem_size == 2:
                return custom
            return own_plan(direction, n_, elem_size, layernorm)

        G.plan = patched
        if v != "whole" and v[3] > 1:
            # the launcher sizes an exchanging grid at one program per SM; count each SM per_sm
            # times, but only where the binary lets an SM hold them all (siblings must be resident)
            fn()
            torch.cuda.synchronize()
            held = min(G._RESIDENT.values())
            if held < v[3]:
                raise RuntimeError(f"an SM holds {held} program(s) of this binary, not {v[3]}")
            G.sm_count = lambda device: own_sm(device) * v[3]

    with open(os.path.join(out_dir, "results.jsonl"), "w") as f:
        for n in widths:
            for op in OPS:
                shape = Shape((ELEMS // n, n))
                case = make_case(op, shape, DTYPES["bf16"], "cuda")
                fn = callables(kernels, op, "bwd", case)
                nbytes = bytes_moved(op, "bwd", shape.m, shape.n, 2).main
                rec = {"op": op, "N": n, "M": shape.m, "sms": sms, "checks": {}, "ms": {}, "errors": {}}
                live = []
                for v in VARIANTS:
                    if v == "whole" and n > 16384:
                        continue
                    try:
                        use(v, n, fn)
                        rec["checks"][name(v)] = run_check(impl, op, "bwd", Shape((512, n)), "bf16", "cuda").status
                        fn()
                        torch.cuda.synchronize()
                        live.append(v)
                    except Exception as e:  # noqa: BLE001 -- a variant that does not build or launch is a result too
                        rec["errors"][name(v)] = f"{type(e).__name__}: {str(e)[:300]}"
                for _ in range(3):
                    for v in live:
                        use(v, n, fn)
                        rec["ms"].setdefault(name(v), []).append(round(bench(fn), 5))
                use("plan", n, fn)
                write_result(f, rec, nbytes, copy)
                del fn, case
                torch.cuda.empty_cache()
    finish_meta(out_dir, meta)


if __name__ == "__main__":
    main(sys.argv[1], tuple(int(n) for n in sys.argv[2].split(",")) if len(sys.argv) > 2 else WIDTHS)
