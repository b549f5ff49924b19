"""Helion's backward with its dw / db partial rows summed by one Helion kernel
(``kernels.summed``: "one launch") against ATen's sum over the rows and a cast to the parameter's
dtype ("sum + cast", the backward before), ``kernels.summed`` patched to the latter. Per op in
rmsnorm, layernorm, add_rmsnorm (bf16, bf16 weights) and shape: the per-head set's (T, H, 128)
shapes (contiguous and as head slices of a fused QKV tensor), the small set and the sweep up to
N = 8192 (M * N = 2^27). Each variant's dw (and db) against an fp64 reference (largest error over
the largest |value|); both timed alternately, three rounds, as the harness times short kernels
(CUDA-graph replays, L2 flushed before each call, ``harness.run.timer``). Bytes: the harness's
backward model.

    python tools/experiments/helion-sums/bwd.py OUT

Writes OUT/results.jsonl and OUT/meta.json; prints one line per point.
"""

from __future__ import annotations

import functools
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(HERE))

import torch
from gpu_timing import alternate, finish_meta, fraction, spreads, start_meta

from harness.spec.roofline import bytes_moved
from impls.helion import kernels as K

ELEMS = 2**27
PERHEAD = [(t, h, 128, p) for t, h, p in ((32768, 32, 48), (32768, 8, 48), (16384, 64, 80), (16384, 8, 80))]
FLAT = [(ELEMS // n, n) for n in (64, 128, 256, 512, 1024, 2048, 4096, 8192)]
OPS = ("rmsnorm", "layernorm", "add_rmsnorm")


def aten(partial, dtype):
    return partial.sum(0).to(dtype)


def inputs(shape, gen):
    if len(shape) == 4:
        t, h, n, p = shape
        x = torch.randn(t, p, n, device="cuda", dtype=torch.bfloat16, generator=gen)[:, :h]
        dy = torch.randn(t, h, n, device="cuda", dtype=torch.bfloat16, generator=gen)
    else:
        x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen)
        dy = torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    n = x.shape[-1]
    w = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=gen)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=gen)
    return x, dy, w, b


def error(got, want) -> float:
    return ((got.double() - want).abs().max() / want.abs().max()).item()


def main(out: str) -> None:
    os.makedirs(out, exist_ok=True)
    meta = start_meta(experiment="helion-sums")
    copy = meta["copy_before"]["tbps"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    one = K.summed
    variants = {"one launch": one, "sum + cast": aten}
    with open(os.path.join(out, "results.jsonl"), "w") as f:
        for op in OPS:
            for shape in PERHEAD + FLAT:
                x, dy, w, b = inputs(shape, gen)
                n = x.shape[-1]
                m = x.numel() // n
                if op == "layernorm":
                    _, mean, rstd = K.layernorm_fwd(x, w, b, 1e-6)
                    bwd = functools.partial(K.layernorm_bwd, dy, x, w, mean, rstd)
                else:
                    _, rstd = K.rmsnorm_fwd(x, w, 1e-6)
                    mean = None
                    bwd = functools.partial(K.add_rmsnorm_bwd, dy, dy if op == "add_rmsnorm" else None, x, w, rstd)
                xd, dyd = x.reshape(m, n).double(), dy.reshape(m, n).double()
                xc = xd - mean.reshape(m).double()[:, None] if mean is not None else xd
                want_dw = (dyd * xc * rstd.reshape(m).double()[:, None]).sum(0)
                rec = {"op": op, "shape": "x".join(map(str, shape[:3])) + (f":head-slice-{shape[3]}" if len(shape) == 4 else ""),
                       "M": m, "N": n, "err": {}, "ms": {}}  # fmt: skip
                for v, summing in variants.items():
                    K.summed = summing
                    try:
                        res = bwd()
                    finally:
                        K.summed = one
                    rec["err"][v] = {"dw": error(res[1], want_dw)}
                    if op == "layernorm":
                        rec["err"][v]["db"] = error(res[2], dyd.sum(0))
                rec["ms"] = alternate(bwd, K, "summed", variants)
                nbytes = bytes_moved(op, "bwd", m, n, 2).main
                rec["frac"] = {v: fraction(t, nbytes, copy) for v, t in rec["ms"].items()}
                rec["spread"] = spreads(rec["ms"])
                f.write(json.dumps(rec) + "\n")
                f.flush()
                print(f"{op:11s} {rec['shape']:28s} " + "  ".join(
                    f"{v} {rec['frac'][v] * 100:5.1f}% (spread {rec['spread'][v] * 100:.1f}%, dw err {rec['err'][v]['dw']:.1e})"
                    for v in variants), flush=True)  # fmt: skip
    finish_meta(out, meta)


if __name__ == "__main__":
    main(sys.argv[1])
