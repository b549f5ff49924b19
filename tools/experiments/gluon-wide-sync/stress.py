"""Repeated launches of Gluon's exchanging wide-row backward as the plan runs it: launches with a NaN
row (a wait that ran out), launches whose dx differs from the first, bf16, M * N = 2^27.

python tools/experiments/gluon-wide-sync/stress.py OUT [LAUNCHES]
    STRESS_N: the widths (comma-separated); STRESS_IMPL: gluon (default) or triton; STRESS_OPS
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
from harness.spec.contract import DTYPES
from harness.spec.inputs import make_case
from harness.spec.shapes import Shape

WIDTHS = tuple(int(n) for n in os.environ.get("STRESS_N", "16384,24576,49152,65536,131072").split(","))
IMPL = os.environ.get("STRESS_IMPL", "gluon")
OPS = tuple(os.environ.get("STRESS_OPS", "rmsnorm,layernorm,add_rmsnorm").split(","))
CASES = [(op, n) for op in OPS for n in WIDTHS]


def main(out_dir, launches):
    from harness.registry import get
    from harness.run.bench import callables
    from impls.gluon.plan import plan

    os.makedirs(out_dir, exist_ok=True)
    kernels = get(IMPL).kernels("cuda")
    with open(os.path.join(out_dir, "stress.jsonl"), "w") as out:
        for op, n in CASES:
            for m in (2**27 // n, 37):
                run = callables(kernels, op, "bwd", make_case(op, Shape((m, n)), DTYPES["bf16"], "cuda"))
                first, nan, differ = None, 0, 0
                for _ in range(launches):
                    dx = run()[0]
                    nan += bool(torch.isnan(dx).any().item())
                    if first is None:
                        first = dx.clone()
                    differ += not torch.equal(first, dx)
                rec = {"impl": IMPL, "op": op, "N": n, "M": m, "launches": launches, "launches_with_nan": nan,
                       "launches_differing": differ}  # fmt: skip
                if IMPL == "gluon":
                    p = plan("bwd", n, 2, op == "layernorm")
                    rec.update(exchange=p.exchange, warps=p.tile.num_warps, slice=p.tile.width, per_sm=p.per_sm)
                out.write(json.dumps(rec) + "\n")
                print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 50)
