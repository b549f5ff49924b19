"""Each launch of Gluon's exchanging backward timed on its own (CUDA events around one call, the L2
flushed before it as do_bench does), as the plan runs it, for the spread slices (several programs per
SM) and the 8192-column slices (one per SM): the median, the tail, and how many launches took more
than 1.3x the median. A sibling that is not resident when its row group waits stalls the group: a
heavy tail would show it, where the median that the benchmark reports would not.

python tools/experiments/gluon-wide-sync/launch_times.py OUT [LAUNCHES]
"""

from __future__ import annotations

import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.getcwd())
from harness.spec.contract import DTYPES
from harness.spec.inputs import make_case
from harness.spec.shapes import Shape

WIDTHS = (10240, 12288, 16384, 24576, 65536)
OPS = ("rmsnorm", "layernorm", "add_rmsnorm")


def main(out_dir: str, launches: int) -> None:
    from harness.registry import get
    from harness.run.bench import callables
    from impls.gluon.plan import plan

    os.makedirs(out_dir, exist_ok=True)
    kernels = get("gluon").kernels("cuda")
    cache = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    with open(os.path.join(out_dir, "launch_times.jsonl"), "w") as out:
        for n in WIDTHS:
            for op in OPS:
                run = callables(kernels, op, "bwd", make_case(op, Shape((2**27 // n, n)), DTYPES["bf16"], "cuda"))
                for _ in range(5):
                    run()
                ms = []
                for _ in range(launches):
                    cache.zero_()
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    run()
                    b.record()
                    b.synchronize()
                    ms.append(a.elapsed_time(b))
                med = statistics.median(ms)
                q = sorted(ms)
                p = plan("bwd", n, 2, op == "layernorm")
                rec = {"op": op, "N": n, "slice": p.tile.width, "warps": p.tile.num_warps, "per_sm": p.per_sm,
                       "launches": launches, "median_ms": med, "p90_ms": q[int(0.9 * (len(q) - 1))],
                       "p99_ms": q[int(0.99 * (len(q) - 1))], "max_ms": q[-1], "slow": sum(t > 1.3 * med for t in ms)}  # fmt: skip
                out.write(json.dumps(rec) + "\n")
                print(json.dumps(rec), flush=True)
                del run
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 300)
