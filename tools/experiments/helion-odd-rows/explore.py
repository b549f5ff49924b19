"""Helion's realigned kernels (``impls/helion/kernels.py``, ``*_odd``) for rows whose length is no
multiple of a 16-byte vector: each candidate config checked against the fp64 reference (512 rows:
every offset within a vector), then timed at N = 4001 (or ODD_N), M * N ~ 2^27, bf16, for the six
(op, direction) pairs (or PAIRS: "layernorm_bwd,..."), against the element-wise kernels the same
rows take without them. GRID="rows,warps,programs;..." replaces the candidates beside the default.

python tools/experiments/helion-odd-rows/explore.py OUT [BUDGET_S]
    -> OUT/results.json (every candidate: config, check, compile + first call s, ms, fraction of
       copy bandwidth), OUT/best.json (per pair the fastest passing realigned candidate, as a
       configs.json ``realigned`` entry), OUT/meta.json (GPU, versions, copy bandwidth)

Round 1 runs, per pair, the element-wise kernels ("before") and the realigned default; round 2
the other candidates while BUDGET_S (default 200) lasts, so that a slow compile loses candidates,
not pairs; round 3 times the fastest realigned candidate and "before" twice more, alternating.
Each Helion config is one compile (seconds each): the grid is kept small on purpose.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from gpu_timing import bench, finish_meta, fraction, start_meta

from harness.run.bench import callables
from harness.run.checker import run_check
from harness.registry import get
from harness.spec.contract import DTYPES
from harness.spec.inputs import make_case
from harness.spec.roofline import bytes_moved
from harness.spec.shapes import Shape
from impls.helion import configs, kernels

N = int(os.environ.get("ODD_N", "4001"))
M, DTYPE = 2**27 // N, "bf16"
PAIRS = [(op, d) for d in ("fwd", "bwd") for op in ("rmsnorm", "layernorm", "add_rmsnorm")
         if f"{op}_{d}" in os.environ.get("PAIRS", f"{op}_{d}").split(",")]  # fmt: skip
BUCKET = str(1 << (N - 1).bit_length())
# (rows a step, warps, programs per SM) beside the default; at N = 4001 (4096 lanes) 4 warps hold
# 32 elements a thread per row, 8 warps 16
GRID = {
    "fwd": [(1, 4, 2), (2, 8, 1), (1, 8, 2), (2, 4, 1)],
    "bwd": [(1, 4, 2), (1, 8, 1), (1, 4, 1), (2, 8, 1)],
}
if os.environ.get("GRID"):  # "rows,warps,programs;..." for both directions
    GRID = dict.fromkeys(GRID, [tuple(int(v) for v in c.split(",")) for c in os.environ["GRID"].split(";")])


def candidate(op: str, direction: str, rows: int, warps: int, programs_per_sm: int) -> configs.Pinned:
    kernel = configs.realigned_default(op, direction, N).kernel
    return configs.Pinned(kernel, {"block_sizes": [rows], "num_warps": warps}, "explore", programs_per_sm=programs_per_sm)


def candidates(op: str, direction: str) -> list:
    """(tag, Pinned or None): None is "before" (the element-wise kernels)."""
    default = configs.realigned_default(op, direction, N)
    out = [("before", None), ("default", default)]
    for rows, warps, pps in GRID[direction]:
        c = candidate(op, direction, rows, warps, pps)
        if (c.config, c.programs_per_sm) != (default.config, default.programs_per_sm):
            out.append(("grid", c))
    return out


def pin(choice):
    """The contract functions run ``choice`` on odd rows (None: the element-wise kernels)."""
    configs.REALIGNED_N = (0, 0) if choice is None else (1024, 8192)
    kernels.choose_realigned = lambda op, direction, x: choice


def describe(choice) -> dict:
    return {} if choice is None else {"kernel": choice.kernel, "config": choice.config, "programs_per_sm": choice.programs_per_sm}


def main(out_dir: str, budget_s: float = 200.0) -> None:
    t0 = time.time()
    os.makedirs(out_dir, exist_ok=True)
    impl = get("helion")
    import helion

    meta = start_meta(dtype=DTYPE, n=N, m=M, helion=getattr(helion, "__version__", None))
    copy_tbps = meta["copy_before"]["tbps"]
    shape = Shape((M, N))
    cases = {op: make_case(op, shape, DTYPES[DTYPE], "cuda") for op in ("rmsnorm", "layernorm", "add_rmsnorm")}
    results = []

    def measure(op, direction, tag, choice):
        rec = {"op": op, "direction": direction, "N": N, "M": M, "dtype": DTYPE, "tag": tag, **describe(choice)}
        rec["bytes"] = nbytes = bytes_moved(op, direction, M, N, DTYPES[DTYPE].itemsize).main
        pin(choice)
        try:
            t = time.time()
            chk = run_check(impl, op, direction, Shape((512, N)), DTYPE, "cuda", kernels=kernels)
            rec["compile_and_check_s"] = round(time.time() - t, 1)
            rec["check"] = chk.status
            if chk.status != "pass":
                rec["check_summary"] = chk.summary()[:400]
            fn = callables(kernels, op, direction, cases[op])
            rec["ms"] = [round(bench(fn), 5)]
            rec["frac"] = fraction(rec["ms"], nbytes, copy_tbps)
        except Exception as e:  # noqa: BLE001
            rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        print(op, direction, tag, json.dumps(describe(choice).get("config")), choice and choice.programs_per_sm,
              rec.get("check"), rec.get("ms"), rec.get("frac"), rec.get("error", ""), flush=True)  # fmt: skip
        results.append(rec)
        return rec

    todo = {pair: candidates(*pair) for pair in PAIRS}
    for (op, d), cands in todo.items():  # round 1: before and default, every pair
        for tag, choice in cands[:2]:
            measure(op, d, tag, choice)
    skipped = []
    for (op, d), cands in todo.items():  # round 2: the grid, while the budget lasts
        for tag, choice in cands[2:]:
            if time.time() - t0 > budget_s:
                skipped.append(describe(choice) | {"op": op, "direction": d})
                continue
            measure(op, d, tag, choice)
    best = {}
    for op, d in PAIRS:  # round 3: the fastest realigned and "before", twice more, alternating
        mine = [r for r in results if (r["op"], r["direction"]) == (op, d) and r.get("check") == "pass" and "ms" in r]
        fastest = min((r for r in mine if r["tag"] != "before"), key=lambda r: r["ms"][0], default=None)
        before = next((r for r in mine if r["tag"] == "before"), None)
        for _ in range(2):
            for r in (fastest, before):
                if r is None or time.time() - t0 > budget_s + 30:
                    continue
                choice = None if r["tag"] == "before" else configs.Pinned.from_entry(r, "explore")
                pin(choice)
                r["ms"].append(round(bench(callables(kernels, op, d, cases[op])), 5))
                r["frac"] = fraction(r["ms"], r["bytes"], copy_tbps)
        if fastest:
            best[f"{op}_{d}"] = {BUCKET: describe(configs.Pinned.from_entry(fastest, "explore")) | {"frac": fastest["frac"]}}
            print("best", op, d, fastest["config"], fastest["programs_per_sm"], fastest["frac"],
                  "before", before and before.get("frac"), flush=True)  # fmt: skip
    meta["skipped"] = skipped
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(out_dir, "best.json"), "w") as f:
        json.dump({torch.cuda.get_device_name(): best}, f, indent=1)
    finish_meta(out_dir, meta)


if __name__ == "__main__":
    main(sys.argv[1], *(float(a) for a in sys.argv[2:3]))
