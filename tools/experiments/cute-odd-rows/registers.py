"""Registers of CuTe DSL's realigned backward against the kernel of aligned rows of about the same
width, without a GPU: each kernel compiled for sm_90a, its PTX assembled by ptxas as compiled (under
the launch's promise of CTAs per SM) and without that promise (what the kernel would take).

    CUTE_DSL_ARCH=sm_90a python tools/experiments/cute-odd-rows/registers.py ROOT OUT.json

ROOT: a checkout of the repository (a worktree of the commit to measure). MIN_REGISTERS: the
realigned launch's promise (``plan.REALIGNED_MIN_REGISTERS``; 0: the ring's own CTA count).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton

sys.path.insert(0, sys.argv[1])
from impls.cute import kernels as K  # noqa: E402
from impls.cute import plan as P  # noqa: E402

if "MIN_REGISTERS" in os.environ:
    P.REALIGNED_MIN_REGISTERS = int(os.environ["MIN_REGISTERS"])

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
POINTS = [(op, residual, n) for op, residual in (("rmsnorm", False), ("layernorm", False), ("rmsnorm", True))
          for n in (2999, 4001, 5003)]  # fmt: skip


def assemble(ptx: str) -> dict:
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        open(src, "w").write(ptx)
        out = subprocess.run([PTXAS, "-v", "-arch=sm_90a", src, "-o", os.path.join(d, "k.cubin")],
                             capture_output=True, text=True).stderr  # fmt: skip
    spill = re.search(r"(\d+) bytes spill stores", out)
    return {"registers": int(re.search(r"Used (\d+) registers", out).group(1)), "spill_stores": int(spill.group(1))}


def measure(op, residual, n, realign):
    K.compile_only(op, "bwd", torch.bfloat16, n, vec=8 if realign else None, residual=residual, realign=realign)
    key = list(K._COMPILED)[-1]
    fn, kernel = K._COMPILED[key]
    ptx = fn.__ptx__
    return {"op": "add_rmsnorm" if residual else op, "N": n, "realigned": realign, "ctas_per_sm": kernel.ring.ctas_per_sm,
            "threads": kernel.launch.num_threads, "as_launched": assemble(ptx),
            "uncapped": assemble(re.sub(r"\.minnctapersm \d+", "", ptx))}  # fmt: skip


def main(out):
    rows = []
    for op, residual, n in POINTS:
        for realign, width in ((True, n), (False, n // 8 * 8)):
            rows.append(measure(op, residual, width, realign))
            print(json.dumps(rows[-1]), flush=True)
    commit = subprocess.run(["git", "-C", sys.argv[1], "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    with open(out, "w") as f:
        json.dump({"commit": commit.stdout.strip(), "min_registers": getattr(P, "REALIGNED_MIN_REGISTERS", None),
                   "points": rows}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[2])
