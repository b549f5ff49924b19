"""Each launch of an exchanging backward timed on its own (CUDA events around one call, the L2
flushed before it as do_bench does): the median, the mean, the tail, and how many launches took more
than 1.3x the median. A row group waits for all its slices, so a sibling that runs late (not yet
resident, or starved on an SM it shares with spinning programs) stalls the group: a heavy tail shows
it, where the median that the benchmark reports does not, and a training step pays the mean.

Gluon: the plan with and without ``SPREAD_SLICES`` (several programs per SM) and alternatives to its
entries; Triton: the pinned LayerNorm config against 2048-column slices at four programs per SM.
Variants alternate per shape.

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

OPS = ("rmsnorm", "layernorm", "add_rmsnorm")
WIDTHS = (10240, 12288, 16384, 24576)
# Gluon: name -> SPREAD_SLICES (None: the plan as committed)
GLUON = {
    "one per SM": {},
    "plan": None,
    "p3 to 16384": {False: ((16384, 2048, 4, 3), (32768, 4096, 8, 2)), True: ((20480, 2048, 2, 3), (65536, 4096, 4, 2))},
    "4096 x 2": {False: ((32768, 4096, 8, 2),), True: ((65536, 4096, 4, 2),)},
}  # fmt: skip
TRITON_LN = {"pinned": None, "s2048 w4 p4": {"rows": 1, "warps": 4, "slice": 2048, "sync": True, "programs_per_sm": 4}}


def times(run, cache, launches: int) -> dict:
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
    q, med = sorted(ms), statistics.median(ms)
    return {"median_ms": med, "mean_ms": statistics.fmean(ms), "p90_ms": q[int(0.9 * (len(q) - 1))],
            "p99_ms": q[int(0.99 * (len(q) - 1))], "max_ms": q[-1], "slow": sum(t > 1.3 * med for t in ms)}  # fmt: skip


def main(out_dir: str, launches: int) -> None:
    from harness.registry import get
    from harness.run.bench import callables
    from impls.gluon import kernels as G
    from impls.gluon import plan as P
    from impls.triton.configs import Config
    from impls.triton.tune import pinned_kernels

    os.makedirs(out_dir, exist_ok=True)
    gluon, triton = get("gluon").kernels("cuda"), get("triton")
    own = P.SPREAD_SLICES
    cache = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    with open(os.path.join(out_dir, "launch_times.jsonl"), "w") as out:
        for n in WIDTHS:
            for op in OPS:
                case = make_case(op, Shape((2**27 // n, n)), DTYPES["bf16"], "cuda")
                runs = {}
                for name, spread in GLUON.items():
                    runs[("gluon", name)] = (spread, callables(gluon, op, "bwd", case))
                if op == "layernorm" and n <= 16384:
                    for name, cfg in TRITON_LN.items():
                        kern = pinned_kernels(triton, None, None if cfg is None else Config(**cfg))
                        runs[("triton", name)] = (None, callables(kern, op, "bwd", case))
                for (impl, name), (spread, run) in runs.items():
                    if impl == "gluon":
                        P.SPREAD_SLICES = own if spread is None else spread
                        G._RESIDENT.clear()
                    p = P.plan("bwd", n, 2, op == "layernorm")
                    rec = {
                        "impl": impl,
                        "variant": name,
                        "op": op,
                        "N": n,
                        "launches": launches,
                        **times(run, cache, launches),
                    }
                    if impl == "gluon":
                        rec.update(slice=p.tile.width, warps=p.tile.num_warps, per_sm=p.per_sm)
                    out.write(json.dumps(rec) + "\n")
                    print(
                        impl,
                        name,
                        op,
                        n,
                        {k: round(v, 3) for k, v in rec.items() if k.endswith("_ms")},
                        "slow",
                        rec["slow"],
                        flush=True,
                    )
                P.SPREAD_SLICES = own
                del runs, case
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 300)
