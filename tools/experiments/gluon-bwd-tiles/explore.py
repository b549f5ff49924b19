"""Gluon's whole-row backward tile at mid widths (H100): the plan's tile beside two others, each
checked against fp64 on a few rows and timed at the sweep's 2^27 elements.

* ``base``: ``plan.tile`` as committed (two 16-byte vectors of the row per lane, warps along N).
* ``lane1``: one vector per lane, twice the warps along N (at most 16): half the registers of the
  row per thread.
* ``rows2``: the base tile's warps doubled along M: two rows per program.

    OUT=out python tools/experiments/gluon-bwd-tiles/explore.py [N,...] [op,...]

Writes ``$OUT/gluon_tiles.json``: per (variant, op, N) the check's status, ms (median of the trials'
medians), the trials' spread and the fraction of the copy bandwidth measured at the start.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

from harness.registry import get
from harness.run.bench import callables
from harness.run.checker import run_check
from harness.run.timer import CudaTimer, measure_copy_bandwidth, summarize
from harness.spec.contract import DTYPES
from harness.spec.inputs import make_case
from harness.spec.roofline import bytes_moved, tbps
from harness.spec.shapes import SWEEP_ELEMENTS, Shape

NS = [int(v) for v in (sys.argv[1] if len(sys.argv) > 1 else "2880,4096,5120,7168").split(",")]
OPS = (sys.argv[2] if len(sys.argv) > 2 else "layernorm,add_rmsnorm,rmsnorm").split(",")
TIMER = CudaTimer(warmup_ms=5, rep_ms=25, trials=3)


def variants():
    from impls.gluon import plan as P

    def lane1(t):
        threads_n = t.width // t.vec
        tpw_n = min(P.WARP, threads_n)
        warps_n = min(max(threads_n // P.WARP, 1), P.MAX_WARPS)
        warps = max(warps_n, P.MIN_WARPS)
        return P.Tile(t.width, t.vec, (P.WARP // tpw_n, tpw_n), (warps // warps_n, warps_n))

    def rows2(t):
        return P.Tile(t.width, t.vec, t.threads, (t.warps[0] * 2, t.warps[1]), t.reps)

    return {"base": None, "lane1": lane1, "rows2": rows2}


def main() -> None:
    from impls.gluon import plan as P

    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    copy = measure_copy_bandwidth()
    roof = copy["tbps"]
    impl = get("gluon")
    k = impl.kernels("cuda")
    committed = P._plan
    rows = []
    for name, change in variants().items():
        def planned(direction, n, elem_size, change=change):
            p = committed(direction, n, elem_size)
            if change is None or direction != "bwd" or p.wide:
                return p
            return P.Plan(change(p.tile), p.pieces)

        P._plan = planned
        P._PLANS.clear()
        for n in NS:
            for op in OPS:
                t = P.plan("bwd", n, 2).tile
                row = {"variant": name, "op": op, "n": n, "tile": {"warps": t.warps, "threads": t.threads, "rows": t.rows}}
                try:
                    r = run_check(impl, op, "bwd", Shape((96, n)), "bf16", "cuda", seed=1, kernels=k)
                    row["check"] = "pass" if r.passed else r.summary()[:200]
                    shape = Shape((SWEEP_ELEMENTS // n, n))
                    case = make_case(op, shape, DTYPES["bf16"], "cuda", 0)
                    fn = callables(k, op, "bwd", case)
                    fn()
                    torch.cuda.synchronize()
                    trials, _ = TIMER.time(fn)
                    s = summarize(trials)
                    b = bytes_moved(op, "bwd", shape.m, shape.n, 2)
                    row.update(ms=s["ms"], spread=round(s["spread"], 4), frac=round(tbps(b.main, s["ms"]) / roof, 4))
                except Exception as e:  # noqa: BLE001 -- one failing variant never stops the run
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                torch.cuda.empty_cache()
                print(json.dumps(row), flush=True)
                rows.append(row)
    P._plan = committed
    P._PLANS.clear()
    env = {"gpu": torch.cuda.get_device_name(), "copy_bandwidth": copy, "torch": torch.__version__,
           "commit": os.environ.get("NORMBENCH_COMMIT"), "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    (out / "gluon_tiles.json").write_text(json.dumps({**env, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
