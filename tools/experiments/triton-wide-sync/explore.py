"""Triton's sliced backward for wide rows: row sums exchanged between sibling programs (``sync``)
against the pinned two-kernel way (``row_sums``), checked against the fp64 reference, then timed.

python tools/experiments/triton-wide-sync/explore.py warm I K     -> compile jobs I::K on 64-row inputs
python tools/experiments/triton-wide-sync/explore.py run OUT BUDGET_S [DTYPE]
    -> check every candidate (fp64 reference, 512 rows), time it at M * N = 2^27, write OUT/results.jsonl
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
from impls.triton.configs import Config

ELEMS = 2**27
OPS = ("rmsnorm", "layernorm", "add_rmsnorm")
WIDE_N = tuple(
    int(n) for n in os.environ.get("WIDE_N", "10240,12288,16384,24576,32768,49152,65536,131072,262144").split(",")
)


ROUND = os.environ.get("ROUND", "2")
# round 1: slice width x warps, one block loaded ahead; round 2: two blocks ahead, two rows a block
GRID = {
    "1": [(1, 8192, 16, 1), (1, 4096, 8, 1), (1, 4096, 16, 1), (1, 8192, 8, 1), (1, 2048, 8, 1)],
    "2": [
        (1, 8192, 16, 1),
        (1, 8192, 8, 1),
        (1, 8192, 16, 2),
        (1, 8192, 8, 2),
        (1, 4096, 8, 2),
        (2, 4096, 8, 1),
        (2, 4096, 8, 2),
        (2, 8192, 16, 1),
    ],
}


def candidates(n):
    out = []
    for rows, sl, warps, ahead in GRID[ROUND]:
        slices = -(-n // sl)
        if 2 <= slices <= 32 and sl * (slices - 1) < n:
            out.append(
                {"rows": rows, "warps": warps, "slice": sl, "sync": True, **({"ahead": 2} if ahead == 2 else {})}
            )
    return out


def jobs(dtype="bf16"):
    out = []
    for n in WIDE_N:
        for op in OPS:
            out.append((op, n, dtype, None))
            out += [(op, n, dtype, c) for c in candidates(n)]
    return out


_IMPL = {}


def kernels_for(cfg):
    from harness.registry import get
    from impls.triton.tune import pinned_kernels

    if "triton" not in _IMPL:
        _IMPL["triton"] = get("triton")
    return pinned_kernels(_IMPL["triton"], None, None if cfg is None else Config(**cfg))


def build(op, shape, dtype):
    from harness.run.bench import callables

    case = make_case(op, shape, DTYPES[dtype], "cuda")
    return lambda cfg: callables(kernels_for(cfg), op, "bwd", case)


def warm(i, k):
    for op, n, dtype, cfg in jobs()[i::k]:
        try:
            build(op, Shape((64, n)), dtype)(cfg)()
        except Exception as e:  # noqa: BLE001
            print("warm fail", op, n, cfg, type(e).__name__, str(e)[:300], flush=True)
    torch.cuda.synchronize()


def run(out_dir, budget_s, dtype="bf16"):

    from harness.run.checker import run_check

    t0 = time.time()
    os.makedirs(out_dir, exist_ok=True)
    meta = start_meta(dtype=dtype)
    copy_tbps = meta["copy_before"]["tbps"]
    kernels_for(None)
    points = {}
    for j in jobs(dtype):
        points.setdefault(j[:3], []).append(j[3])
    size = DTYPES[dtype].itemsize
    with open(os.path.join(out_dir, "results.jsonl"), "w") as f:
        for (op, n, dt), cfgs in points.items():
            if time.time() - t0 > budget_s:
                meta.setdefault("skipped", []).append([op, n])
                continue
            shape = Shape((ELEMS // n, n))
            launch = build(op, shape, dt)
            nbytes = bytes_moved(op, "bwd", shape.m, shape.n, size).main
            recs = []
            for cfg in cfgs:
                rec = {"op": op, "direction": "bwd", "N": n, "M": shape.m, "dtype": dt, "config": cfg, "bytes": nbytes}
                chk = run_check(_IMPL["triton"], op, "bwd", Shape((512, n)), dt, "cuda", kernels=kernels_for(cfg))
                rec["check"] = chk.status
                if chk.status != "pass":
                    rec["check_summary"] = chk.summary()[:400]
                try:
                    rec["ms"] = [round(bench(launch(cfg)), 5)]
                except Exception as e:  # noqa: BLE001
                    rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                recs.append(rec)
            ok = [r for r in recs if "ms" in r and r["check"] == "pass"]
            if ok:  # the best and the pinned, twice more, alternating
                best = min(ok, key=lambda r: r["ms"][0])
                ref = [r for r in ok if r["config"] is None and r is not best][:1]
                for _ in range(2):
                    for r in [best, *ref]:
                        r["ms"].append(round(bench(launch(r["config"])), 5))
            for r in recs:
                if "ms" in r:
                    r["frac"] = fraction(r["ms"], nbytes, copy_tbps)
                f.write(json.dumps(r) + "\n")
                print(op, n, r.get("config"), r["check"], r.get("ms"), r.get("frac"), flush=True)
            f.flush()
            del launch
            torch.cuda.empty_cache()
    finish_meta(out_dir, meta)


if __name__ == "__main__":
    cli(warm, jobs, run)
