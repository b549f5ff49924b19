"""Triton's backward with its dw / db sums taken by the row kernel's last programs
(``kernels._sum_when_all_posted``: "fused") against the same kernel followed by
``_sum_partials_kernel`` ("launched", the backward before): ``kernels.summing`` patched to give no
summers. Per op in rmsnorm, layernorm, add_rmsnorm (bf16, bf16 weights) and shape: the per-head
set's (T, H, 128) shapes (contiguous and as head slices of a fused QKV tensor), the small set and
the sweep up to N = 8192 (M * N = 2^27). Each variant's dw (and db) is compared with an fp64
reference (largest error over the largest |value|); then both are timed alternately, three rounds,
as the harness times short kernels (CUDA-graph replays with the L2 flushed before each call,
``harness.run.timer``). Bytes: the harness's backward model.

    python tools/experiments/triton-fused-sums/bwd.py OUT

Writes OUT/results.jsonl (per op and shape: errors, ms per round, fractions of the copy bandwidth)
and OUT/meta.json; prints one line per point.
"""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402
from gpu_timing import finish_meta, start_meta  # noqa: E402

from harness.run.timer import CudaTimer  # noqa: E402
from harness.spec.roofline import bytes_moved  # noqa: E402
from impls.triton import kernels as K  # noqa: E402

ELEMS = 2**27
PERHEAD = [(t, h, 128, p) for t, h, p in ((32768, 32, 48), (32768, 8, 48), (16384, 64, 80), (16384, 8, 80))]
FLAT = [(ELEMS // n, n) for n in (64, 128, 256, 512, 1024, 2048, 4096, 8192)]
OPS = ("rmsnorm", "layernorm", "add_rmsnorm")
LAUNCHED = lambda n, programs, sms: (0, 1, 1)  # noqa: E731


def inputs(shape, gen):
    """x (a head slice of a (T, P, N) tensor where P is given), dy, weight, bias."""
    if len(shape) == 4:
        t, h, n, p = shape
        x = torch.randn(t, p, n, device="cuda", dtype=torch.bfloat16, generator=gen)[:, :h]
        dy = torch.randn(t, h, n, device="cuda", dtype=torch.bfloat16, generator=gen)
    else:
        x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen)
        dy = torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    n = shape[2] if len(shape) == 4 else shape[1]
    w = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=gen)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=gen)
    return x, dy, w, b


def error(got, want) -> float:
    return ((got.double() - want).abs().max() / want.abs().max()).item()


def main(out: str) -> None:
    os.makedirs(out, exist_ok=True)
    meta = start_meta(experiment="triton-fused-sums")
    copy = meta["copy_before"]["tbps"]
    timer = CudaTimer(warmup_ms=5, rep_ms=25, trials=1)
    gen = torch.Generator(device="cuda").manual_seed(0)
    real = K.summing
    with open(os.path.join(out, "results.jsonl"), "w") as f:
        for op in OPS:
            for shape in PERHEAD + FLAT:
                x, dy, w, b = inputs(shape, gen)
                n = x.shape[-1]
                m = x.numel() // n
                layernorm = op == "layernorm"
                dres = dy if op == "add_rmsnorm" else None
                y, mean, rstd, _ = K.norm_fwd(x, w, b if layernorm else None, 1e-6, layernorm)
                xd = x.reshape(m, n).double()
                dyd = dy.reshape(m, n).double()
                xc = xd - mean.double()[:, None] if layernorm else xd
                want_dw = (dyd * xc * rstd.double()[:, None]).sum(0)
                rec = {"op": op, "shape": "x".join(map(str, shape[:3])) + (f":head-slice-{shape[3]}" if len(shape) == 4 else ""),
                       "M": m, "N": n, "err": {}, "ms": {}}  # fmt: skip
                fns = {}
                for variant, summing in (("fused", real), ("launched", LAUNCHED)):
                    K.summing = summing
                    try:
                        dx, dw, db = K.norm_bwd(dy, x, w, mean, rstd, layernorm, dresidual=dres)
                        rec["err"][variant] = {"dw": error(dw, want_dw)}
                        if layernorm:
                            rec["err"][variant]["db"] = error(db, dyd.sum(0))
                    finally:
                        K.summing = real

                    def fn(summing=summing):
                        K.summing = summing
                        try:
                            K.norm_bwd(dy, x, w, mean, rstd, layernorm, dresidual=dres)
                        finally:
                            K.summing = real

                    fns[variant] = fn
                for _ in range(3):
                    for variant, fn in fns.items():
                        trials, _ = timer.time(fn, graph="flushed")
                        rec["ms"].setdefault(variant, []).append(sorted(trials[0])[len(trials[0]) // 2])
                nbytes = bytes_moved(op, "bwd", m, n, 2).main
                rec["frac"] = {v: round(nbytes / (sorted(t)[1] * 1e-3) / 1e12 / copy, 4) for v, t in rec["ms"].items()}
                spread = {v: round(max(t) / min(t) - 1, 4) for v, t in rec["ms"].items()}
                rec["spread"] = spread
                f.write(json.dumps(rec) + "\n")
                f.flush()
                print(f"{op:11s} {rec['shape']:28s} " + "  ".join(
                    f"{v} {rec['frac'][v] * 100:5.1f}% (spread {spread[v] * 100:.1f}%, dw err {rec['err'][v]['dw']:.1e})"
                    for v in fns), flush=True)  # fmt: skip
                del x, dy, y, mean, rstd, xd, dyd, xc
    finish_meta(out, meta)


if __name__ == "__main__":
    main(sys.argv[1])
