"""Triton's FP8-output norms launched as the norm forward's config walks the row ("table": the
RMSNorm / fused-add forward's pinned rows, warps and chunk, or slice as the chunk) against
``fp8.heuristic`` ("heuristic": rows of at least 4096 elements to a program, 512 elements a warp,
up to 16 warps; rows past 16384 chunked in 4096 columns on 8 warps), ``fp8.launch_shape`` patched
to each in turn. The better of the two per point, where it beat the heuristic by more than a
point, is what ``fp8_configs.json`` pins. Per op (rmsnorm_fp8,
add_rmsnorm_fp8), grouping (per token, 1 x 128) and N of the sweep, between and small sets
(M = 2^27 / N, bf16, bf16 weight): whether both variants' outputs agree bit for bit (another
number of warps may add a row's squares in another order, so a last bit of rstd may differ), then
timed alternately, three rounds, as the harness
times (CUDA-graph replays, L2 flushed before each call, ``harness.run.timer``). Bytes: the
harness's model of the op.

    python tools/experiments/triton-fp8-configs/fwd.py OUT [N,N,...]

Writes OUT/results.jsonl (per point: launch shapes, whether the outputs agree, ms per round,
fractions of the copy bandwidth, spreads) and OUT/meta.json; prints one line per point.
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
from harness.spec.shapes import BETWEEN_N, SMALL_N, SWEEP_N
from impls.triton import fp8
from impls.triton.configs import choose

ELEMS = 2**27


def borrowed(n: int, fused: bool, per_row: bool, device) -> tuple[int, int, int]:
    cfg = choose("add_rmsnorm" if fused else "rmsnorm", "fwd", n, device, None, torch.bfloat16)
    return cfg.rows, cfg.warps, cfg.chunk or cfg.slice


def heuristic(n: int, fused: bool, per_row: bool, device) -> tuple[int, int, int]:
    return fp8.heuristic(n)


def main(out: str, ns) -> None:
    os.makedirs(out, exist_ok=True)
    meta = start_meta(experiment="triton-fp8-configs")
    copy = meta["copy_before"]["tbps"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    table = fp8.launch_shape
    variants = {"table": borrowed, "heuristic": heuristic}
    with open(os.path.join(out, "results.jsonl"), "w") as f:
        for n in ns:
            m = ELEMS // n
            x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, generator=gen)
            res = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, generator=gen)
            w = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=gen)
            for op in ("rmsnorm_fp8", "add_rmsnorm_fp8"):
                for group in sorted({n, 128}, reverse=True):
                    if n % group:
                        continue
                    name = f"{op}_{'token' if group == n else 'g128'}"
                    residual = res if op == "add_rmsnorm_fp8" else None
                    rec = {"op": name, "N": n, "M": m, "shape": {}, "ms": {}}
                    outs = {}
                    for v, shape in variants.items():
                        fp8.launch_shape = shape
                        try:
                            rec["shape"][v] = shape(n, residual is not None, group == n, x.device)
                            outs[v] = fp8._launch(x, residual, w, 1e-6, group)
                        finally:
                            fp8.launch_shape = table
                    a, b = outs["table"], outs["heuristic"]
                    rec["same"] = all(torch.equal(p.view(torch.uint8) if p.dtype == torch.float8_e4m3fn else p,
                                                  q.view(torch.uint8) if q.dtype == torch.float8_e4m3fn else q)
                                      for p, q in zip(a, b) if p is not None)  # fmt: skip
                    del outs, a, b
                    rec["ms"] = alternate(functools.partial(fp8._launch, x, residual, w, 1e-6, group), fp8, "launch_shape", variants)
                    nbytes = bytes_moved(name, "fwd", m, n, 2).main
                    rec["frac"] = {v: fraction(t, nbytes, copy) for v, t in rec["ms"].items()}
                    rec["spread"] = spreads(rec["ms"])
                    f.write(json.dumps(rec) + "\n")
                    f.flush()
                    print(f"{name:22s} N={n:6d} same={rec['same']} " + "  ".join(
                        f"{v} {rec['shape'][v]} {rec['frac'][v] * 100:5.1f}% ({rec['spread'][v] * 100:.1f}%)"
                        for v in variants), flush=True)  # fmt: skip
            del x, res, w
    finish_meta(out, meta)


if __name__ == "__main__":
    default = sorted(set(SWEEP_N) | set(BETWEEN_N) | set(SMALL_N))
    main(sys.argv[1], [int(v) for v in sys.argv[2].split(",")] if len(sys.argv) > 2 else default)
