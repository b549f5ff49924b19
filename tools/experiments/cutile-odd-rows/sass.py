"""The memory instructions tileiras emits for the cuTile kernels of one call, without a GPU: every
kernel the call launches compiled for sm_90 (``compile_only``) and disassembled; per kernel, its
global and shared memory instructions by kind and width, and the total instruction count.

    python tools/experiments/cutile-odd-rows/sass.py OP DIRECTION N [M] [DTYPE]
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.getcwd())

MEMORY = re.compile(r"\b(LDG|STG|LDS|STS|UTMALDG|UTMASTG|UBLKCP|LDGSTS|RED|ATOMG)(\.[A-Z0-9_.]+)?")


def disassembler() -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")


def sass_of(cubin: bytes) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([disassembler(), "-c", f.name], capture_output=True, text=True, check=True).stdout


def summary(sass: str) -> dict:
    """Instructions and memory instructions by kind, of the whole kernel and of its widest loop
    (the span of its longest backward branch: the row-block loop, unrolled or not)."""
    lines = [ln for ln in sass.splitlines() if re.search(r"/\*[0-9a-f]{4}\*/", ln)]
    kinds = collections.Counter(m.group(0) for ln in lines for m in [MEMORY.search(ln)] if m)
    out = {"instructions": len(lines), "memory": dict(sorted(kinds.items()))}
    loops = []
    pending, at = [], {}  # a label's address is its next instruction's
    for ln in sass.splitlines():
        m = re.match(r"\s*(\.L_x_\d+):", ln)
        if m:
            pending.append(m.group(1))
            continue
        a = re.search(r"/\*([0-9a-f]{4,})\*/", ln)
        if a:
            for lab in pending:
                at[lab] = int(a.group(1), 16)
            pending = []
            b = re.search(r"BRA\s+`?\(?(\.L_x_\d+)", ln)
            if b and b.group(1) in at and at[b.group(1)] < int(a.group(1), 16):
                loops.append((at[b.group(1)], int(a.group(1), 16)))
    if loops:
        lo, hi = max(loops, key=lambda l: l[1] - l[0])
        body = [ln for ln in lines if lo <= int(re.search(r"/\*([0-9a-f]{4,})\*/", ln).group(1), 16) <= hi]
        out["loop_instructions"] = len(body)
        out["loop_memory"] = dict(sorted(collections.Counter(
            m.group(0) for ln in body for m in [MEMORY.search(ln)] if m).items()))
        out["loop_barriers"] = sum("BAR.SYNC" in ln for ln in body)
    return out


def compiled(op: str, direction: str, n: int, m: int = 64, dtype=torch.bfloat16, param_dtype=None):
    """[(kernel name, cubin)] of one call at (m, n)."""
    from impls.cutile import kernels as k

    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, n, generator=g).to(dtype)
    dy = torch.randn(m, n, generator=g).to(dtype)
    w = torch.ones(n, dtype=param_dtype or dtype)
    s = torch.ones(m)
    calls = {
        ("rmsnorm", "fwd"): lambda: k.rmsnorm_fwd(x, w, 1e-5),
        ("rmsnorm", "bwd"): lambda: k.rmsnorm_bwd(dy, x, w, s),
        ("layernorm", "fwd"): lambda: k.layernorm_fwd(x, w, w.clone(), 1e-5),
        ("layernorm", "bwd"): lambda: k.layernorm_bwd(dy, x, w, s, s),
        ("add_rmsnorm", "fwd"): lambda: k.add_rmsnorm_fwd(x, dy, w, 1e-5),
        ("add_rmsnorm", "bwd"): lambda: k.add_rmsnorm_bwd(dy, dy.clone(), x, w, s),
    }
    with k.compile_only() as out:
        calls[(op, direction)]()
    return out


if __name__ == "__main__":
    op, direction, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    m = int(sys.argv[4]) if len(sys.argv) > 4 else 64
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    dtype = dtypes[sys.argv[5] if len(sys.argv) > 5 else "bf16"]
    for name, cubin in compiled(op, direction, n, m, dtype):
        print(name, summary(sass_of(cubin)))
        if os.environ.get("DUMP"):
            with open(os.path.join(os.environ["DUMP"], f"{op}_{direction}_{n}_{name}.sass"), "w") as f:
                f.write(sass_of(cubin))
