"""Repeated launches of the exchanging backward (``sync``): rows that came back NaN (a wait that ran
out), whether the bits repeat launch to launch, and the largest difference from the two-kernel way.

python tools/experiments/triton-wide-sync/stress.py OUT [LAUNCHES]
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

sys.path.insert(0, os.getcwd())
from harness.run.bench import callables
from harness.spec.contract import DTYPES
from harness.spec.inputs import make_case
from harness.spec.shapes import Shape

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from explore import kernels_for

CASES = [  # (op, N, M, config): the pinned H100 entries' shapes, a few rows short of a group each
    *[(op, n, m, {"rows": 1, "warps": w, "slice": 8192, "sync": True, **a})
      for op in ("rmsnorm", "layernorm", "add_rmsnorm")
      for n, m in ((16384, 8192), (24576, 4096), (65536, 2048), (131072, 1024), (262144, 512), (262144, 37))
      for w, a in ((16, {}), (8, {"ahead": 2}))],
    *[(op, n, m, {"rows": 2, "warps": 8, "slice": 4096, "sync": True})
      for op in ("rmsnorm", "layernorm") for n, m in ((12288, 10923), (16384, 8192), (65536, 2048))],
]  # fmt: skip


def main(out_dir, launches):
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "stress.jsonl"), "w") as out:
        for op, n, m, cfg in CASES:
            case = make_case(op, Shape((m, n)), DTYPES["bf16"], "cuda")
            run = callables(kernels_for(cfg), op, "bwd", case)
            ref = callables(kernels_for({"rows": 1, "warps": 16, "slice": 8192, "row_sums": True}), op, "bwd", case)()
            ref = ref[0].float()
            first, nan_launches, differ, worst = None, 0, 0, 0.0
            t0 = time.time()
            for i in range(launches):
                dx = run()[0]
                bad = torch.isnan(dx).any(dim=1).sum().item()
                nan_launches += bad > 0
                if first is None:
                    first = dx.clone()
                elif not torch.equal(dx, first):
                    differ += 1
                if not bad:
                    worst = max(worst, (dx.float() - ref).abs().max().item())
            torch.cuda.synchronize()
            rec = {"op": op, "N": n, "M": m, "config": cfg, "launches": launches,
                   "launches_with_nan_rows": nan_launches, "launches_differing_from_first": differ,
                   "max_abs_diff_vs_row_sums": worst, "s": round(time.time() - t0, 2)}  # fmt: skip
            out.write(json.dumps(rec) + "\n")
            out.flush()
            print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 50)
