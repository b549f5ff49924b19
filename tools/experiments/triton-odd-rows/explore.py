"""Triton's realigned kernels for rows whose length is no multiple of a 16-byte vector (N = 4001):
each candidate launch config checked against the fp64 reference (512 rows: every offset within a
vector), then timed at M * N = 2^27, against the element-wise row kernels they replace (the
pinned config with ``realign`` off). Earlier rounds of this script (the commits that add the data
in reports/experiments/triton-odd-rows/) also timed the realigned kernels with exact row sums.

python tools/experiments/triton-odd-rows/explore.py warm I K     -> compile jobs I::K on 64-row inputs (DTYPE)
python tools/experiments/triton-odd-rows/explore.py run OUT BUDGET_S [DTYPE]
    -> OUT/results.jsonl: per (op, direction, N) every candidate's check and time; the fastest, the
       pinned config realigned and the pinned element-wise timed twice more, in alternating rounds
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, replace

import torch

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from gpu_timing import bench, cli, finish_meta, fraction, start_meta

from harness.spec.contract import DTYPES
from harness.spec.inputs import make_case
from harness.spec.roofline import bytes_moved
from harness.spec.shapes import Shape
from impls.triton import configs as C

ELEMS = 2**27
OPS = ("rmsnorm", "layernorm", "add_rmsnorm")
ODD_N = tuple(int(n) for n in os.environ.get("ODD_N", "2047,4001,7001").split(","))
DIRECTIONS = tuple(os.environ.get("DIRECTIONS", "fwd,bwd").split(","))
GPU = "NVIDIA H100 80GB HBM3"  # whose pinned table gives the "pinned" candidates


def candidates(op, direction, n):
    """(tag, config): the pinned config element-wise ("before"), the pinned realigned config (the
    ``*_odd`` table's, "pinned") and a grid of realigned ones; ``CANDIDATES`` keeps some tags."""
    before = C.lookup(GPU, op, direction, n)
    pinned = C.lookup(GPU, op, direction, n, odd=True)
    out = [("before", replace(before, realign=False)), ("pinned", replace(pinned, realign=True))]
    b = C.bucket(n)
    if direction == "fwd":
        grid = [(r, w, p) for r in (1, 2) for w in (4, 8, 16) for p in (1, 2, 4) if 4 <= r * b // (32 * w) <= 64]
    else:
        grid = [(1, 8, 1), (1, 16, 1), (1, 32, 1), (2, 16, 1), (1, 8, 2), (1, 4, 2), (2, 8, 1), (1, 4, 4)]
        grid = [g for g in grid if 2 <= g[0] * b // (32 * g[1]) <= 64]
    for r, w, p in grid:
        cfg = C.Config(rows=r, warps=w, programs_per_sm=p, realign=True)
        if cfg != out[1][1]:
            out.append(("grid", cfg))
    keep = os.environ.get("CANDIDATES")
    return [c for c in out if keep is None or c[0] in keep.split(",")]


def jobs(dtype="bf16"):
    return [(op, d, n, dtype, tag, cfg) for n in ODD_N for d in DIRECTIONS for op in OPS
            for tag, cfg in candidates(op, d, n)]  # fmt: skip


_IMPL = {}


def kernels_for(direction, cfg):
    from harness.registry import get
    from impls.triton.tune import pinned_kernels

    if "triton" not in _IMPL:
        _IMPL["triton"] = get("triton")
    return pinned_kernels(_IMPL["triton"], cfg if direction == "fwd" else None, cfg if direction == "bwd" else None)


def build(op, direction, shape, dtype):
    from harness.run.bench import callables

    case = make_case(op, shape, DTYPES[dtype], "cuda")
    return lambda cfg: callables(kernels_for(direction, cfg), op, direction, case)


def warm(i, k):
    for op, d, n, dtype, tag, cfg in jobs(os.environ.get("DTYPE", "bf16"))[i::k]:
        try:
            build(op, d, Shape((64, n)), dtype)(cfg)()
        except Exception as e:  # noqa: BLE001
            print("warm fail", op, d, n, cfg, type(e).__name__, str(e)[:300], flush=True)
    torch.cuda.synchronize()


def run(out_dir, budget_s, dtype="bf16"):
    from harness.run.checker import run_check

    t0 = time.time()
    os.makedirs(out_dir, exist_ok=True)
    meta = start_meta(dtype=dtype, odd_n=ODD_N)
    copy_tbps = meta["copy_before"]["tbps"]
    points = {}
    for op, d, n, dt, tag, cfg in jobs(dtype):
        points.setdefault((op, d, n, dt), []).append((tag, cfg))
    size = DTYPES[dtype].itemsize
    with open(os.path.join(out_dir, "results.jsonl"), "w") as f:
        for (op, d, n, dt), cfgs in points.items():
            if time.time() - t0 > budget_s:
                meta.setdefault("skipped", []).append([op, d, n])
                continue
            shape = Shape((ELEMS // n, n))
            launch = build(op, d, shape, dt)
            nbytes = bytes_moved(op, d, shape.m, shape.n, size).main
            recs = []
            for tag, cfg in cfgs:
                rec = {"op": op, "direction": d, "N": n, "M": shape.m, "dtype": dt, "tag": tag,
                       "config": asdict(cfg), "bytes": nbytes}  # fmt: skip
                kernels = kernels_for(d, cfg)
                chk = run_check(_IMPL["triton"], op, d, Shape((512, n)), dt, "cuda", kernels=kernels)
                rec["check"] = chk.status
                if chk.status != "pass":
                    rec["check_summary"] = chk.summary()[:400]
                try:
                    rec["ms"] = [round(bench(launch(cfg)), 5)]
                except Exception as e:  # noqa: BLE001
                    rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                recs.append((cfg, rec))
            ok = [(c, r) for c, r in recs if "ms" in r and r["check"] == "pass"]
            if ok:  # the fastest, the pinned and the element-wise, twice more, alternating
                again = [min((cr for cr in ok if cr[1]["tag"] in tags), key=lambda cr: cr[1]["ms"][0], default=None)
                         for tags in (("grid", "pinned"), ("pinned",), ("before",))]  # fmt: skip
                for _ in range(2):
                    for cfg, r in {id(cr): cr for cr in again if cr}.values():
                        r["ms"].append(round(bench(launch(cfg)), 5))
            for cfg, r in recs:
                if "ms" in r:
                    r["frac"] = fraction(r["ms"], nbytes, copy_tbps)
                f.write(json.dumps(r) + "\n")
                print(op, d, n, r["tag"], cfg.rows, cfg.warps, cfg.programs_per_sm, r["check"], r.get("ms"),
                      r.get("frac"), flush=True)  # fmt: skip
            f.flush()
            del launch
            torch.cuda.empty_cache()
    finish_meta(out_dir, meta)


if __name__ == "__main__":
    cli(warm, jobs, run)
