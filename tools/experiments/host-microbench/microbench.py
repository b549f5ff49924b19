"""Host-side micro-timings behind docs/method.md's host-time notes, on the CPU (one thread):

* a failed ``import`` of a module torch does not have (what eager paid per call on torch 2.11);
* the Triton launch key over 28 arguments (8 tensors, ints, a float, compile-time flags) as
  ``harness.spec.jit_launch`` builds it now and as the copy at ``--old`` built it;
* ATen's CPU LayerNorm forward on bf16 4 x 4096 rows and the ``var_mean`` of the same rows in fp32
  (what eager's CPU path used to add for fp32 statistics).

    git show 4d66936:harness/spec/jit_launch.py > /tmp/jit_launch_old.py
    python tools/experiments/host-microbench/microbench.py --old /tmp/jit_launch_old.py --out reports/cpu/overhead/microbench.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import timeit
from pathlib import Path

import torch

from harness.run.environment import environment
from harness.spec import jit_launch


def per_call_us(fn, number: int, repeat: int = 5) -> float:
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


def failed_import():
    try:
        from torch._no_such_module import registry  # noqa: F401
    except ImportError:
        return None


class _Param:
    def __init__(self, num: int, constexpr: bool):
        self.num, self.is_constexpr = num, constexpr


class _Kernel:
    params = [_Param(i, i >= 20) for i in range(28)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True, help="an earlier harness/spec/jit_launch.py to compare")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    spec = importlib.util.spec_from_file_location("jit_launch_old", a.old)
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    x = torch.zeros(64)
    args = tuple([x] * 8 + [4, 4096, 4096, 4096, 4096, 4096, 1e-5, 1, 0, 0, 0, 0] + [False, False, True, False, 1, 4096, False, 4096])
    k = _Kernel()
    rows = torch.randn(4, 4096).bfloat16()
    w, b = torch.randn(4096).bfloat16(), torch.randn(4096).bfloat16()
    out = {
        "environment": environment("cpu"),
        "threads": 1,
        "statistic": "min of 5 repeats, µs per call",
        "failed_import_us": per_call_us(failed_import, 2000),
        "launch_key_28_args_us": {
            "now": per_call_us(lambda: jit_launch._key(k, (4, 1, 1), args, 4, 0), 20000),
            "old": per_call_us(lambda: old._key(k, (4, 1, 1), args, 4, 0), 20000),
            "old_file": a.old,
        },
        "layernorm_bf16_4x4096_us": per_call_us(lambda: torch.nn.functional.layer_norm(rows, (4096,), w, b, 1e-5), 2000),
        "var_mean_fp32_4x4096_us": per_call_us(lambda: torch.var_mean(rows.float(), -1, correction=0), 2000),
    }
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: v for k, v in out.items() if k != "environment"}, indent=1))


if __name__ == "__main__":
    main()
