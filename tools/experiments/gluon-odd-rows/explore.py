"""Gluon's realigned kernels for rows whose length is no multiple of a 16-byte vector (N = 4001):
each candidate launch config (rows a program, warps, programs per SM: an entry of
``impls.gluon.plan.REALIGNED``) checked against the fp64 reference (512 rows: every offset within a
vector), then timed at M * N = 2^27, against the element-wise kernels they replace (the plan without
the entry, "before"), and the plan's own entry ("pinned").

python tools/experiments/gluon-odd-rows/explore.py count                -> the number of jobs
python tools/experiments/gluon-odd-rows/explore.py warm I K             -> compile jobs I::K on 64-row inputs (DTYPE)
python tools/experiments/gluon-odd-rows/explore.py run OUT BUDGET_S [DTYPE]
    -> OUT/results.jsonl: per (op, direction, N) every candidate's check, time and launch (the main
       kernel's grid and warps); the fastest, the pinned and the element-wise timed twice more, in
       alternating rounds. OUT/meta.json: GPU, versions, the copy bandwidth before and after.

Environment: ODD_N (default 2047,4001,7001), DIRECTIONS (fwd,bwd), OPS (rmsnorm,layernorm,
add_rmsnorm), CANDIDATES (tags to keep: before,pinned,grid), DTYPE (warm's; default bf16).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from gpu_timing import bench, cli, finish_meta, fraction, start_meta

from harness.spec.contract import DTYPES
from harness.spec.inputs import make_case
from harness.spec.roofline import bytes_moved
from harness.spec.shapes import Shape
from impls.gluon import plan as P

ELEMS = 2**27
OPS = tuple(os.environ.get("OPS", "rmsnorm,layernorm,add_rmsnorm").split(","))
ODD_N = tuple(int(n) for n in os.environ.get("ODD_N", "2047,4001,7001").split(","))
DIRECTIONS = tuple(os.environ.get("DIRECTIONS", "fwd,bwd").split(","))
PINNED = dict(P.REALIGNED)  # the plan's entries as committed


def candidates(op, direction, n):
    """(tag, entry): the element-wise kernels ("before", no entry), the plan's entry ("pinned") and
    a grid of (rows, warps, programs per SM) whose warps all lie along N (as the plan's tiles);
    ``CANDIDATES`` keeps some tags."""
    b = P.next_pow2(n)
    pinned = PINNED.get((direction, op, b))
    out = [("before", None)] + ([("pinned", pinned)] if pinned else [])
    most_warps = min(b // (P.WARP * 8), P.MAX_WARPS)  # 16-byte vectors of 16-bit x, one lane each
    if direction == "fwd":
        grid = [(r, w, p) for r in (1, 2) for w in (4, 8, 16) for p in (1, 2, 4) if 4 <= r * b // (32 * w) <= 64]
    else:
        grid = [(1, 8, 1), (1, 16, 1), (2, 16, 1), (1, 8, 2), (1, 4, 2), (2, 8, 1), (1, 4, 4), (2, 4, 2)]
        grid = [g for g in grid if 2 <= g[0] * b // (32 * g[1]) <= 64]
    out += [("grid", g) for g in grid if g[1] <= most_warps and g != pinned]
    keep = os.environ.get("CANDIDATES")
    return [c for c in out if keep is None or c[0] in keep.split(",")]


def jobs(dtype="bf16"):
    return [(op, d, n, dtype, tag, entry) for n in ODD_N for d in DIRECTIONS for op in OPS
            for tag, entry in candidates(op, d, n)]  # fmt: skip


@contextlib.contextmanager
def entry_in_plan(op, direction, n, entry):
    """The plan with ``entry`` for this point (None: without one, the element-wise kernels)."""
    key = (direction, op, P.next_pow2(n))
    saved = dict(P.REALIGNED)
    P.REALIGNED.pop(key, None)
    if entry is not None:
        P.REALIGNED[key] = tuple(entry)
    try:
        yield
    finally:
        P.REALIGNED.clear()
        P.REALIGNED.update(saved)


_IMPL = {}


def impl_and_kernels():
    from harness.registry import get

    if "gluon" not in _IMPL:
        impl = get("gluon")
        _IMPL["gluon"] = (impl, impl.kernels("cuda"))
    return _IMPL["gluon"]


def build(op, direction, shape, dtype):
    from harness.run.bench import callables

    case = make_case(op, shape, DTYPES[dtype], "cuda")
    return callables(impl_and_kernels()[1], op, direction, case)


@contextlib.contextmanager
def launches():
    """(kernel name, grid, warps) of every Gluon launch inside."""
    from impls.gluon import kernels as K

    seen, launch = [], K._launch

    def spy(kernel, grid, args, constexprs, num_warps):
        seen.append((kernel.fn.__name__, list(grid), num_warps))
        return launch(kernel, grid, args, constexprs, num_warps)

    K._launch = spy
    try:
        yield seen
    finally:
        K._launch = launch


def warm(i, k):
    for op, d, n, dtype, tag, entry in jobs(os.environ.get("DTYPE", "bf16"))[i::k]:
        try:
            with entry_in_plan(op, d, n, entry):
                build(op, d, Shape((64, n)), dtype)()
        except Exception as e:  # noqa: BLE001
            print("warm fail", op, d, n, tag, entry, type(e).__name__, str(e)[:300], flush=True)
    torch.cuda.synchronize()


def run(out_dir, budget_s, dtype="bf16"):
    from harness.run.checker import run_check

    t0 = time.time()
    os.makedirs(out_dir, exist_ok=True)
    pinned = {f"{d} {op} {b}": v for (d, op, b), v in PINNED.items()}
    meta = start_meta(dtype=dtype, odd_n=ODD_N, impl="gluon", pinned=pinned)
    copy_tbps = meta["copy_before"]["tbps"]
    impl, kernels = impl_and_kernels()
    points = {}
    for op, d, n, dt, tag, entry in jobs(dtype):
        points.setdefault((op, d, n, dt), []).append((tag, entry))
    size = DTYPES[dtype].itemsize
    with open(os.path.join(out_dir, "results.jsonl"), "w") as f:
        for (op, d, n, dt), entries in points.items():
            if time.time() - t0 > budget_s:
                meta.setdefault("skipped", []).append([op, d, n])
                continue
            shape = Shape((ELEMS // n, n))
            fn = build(op, d, shape, dt)
            nbytes = bytes_moved(op, d, shape.m, shape.n, size).main
            recs = []
            for tag, entry in entries:
                rec = {"op": op, "direction": d, "N": n, "M": shape.m, "dtype": dt, "tag": tag,
                       "entry": list(entry) if entry else None, "bytes": nbytes}  # fmt: skip
                with entry_in_plan(op, d, n, entry):
                    with launches() as seen:
                        chk = run_check(impl, op, d, Shape((512, n)), dt, "cuda", kernels=kernels)
                    rec["check"] = chk.status
                    if chk.status != "pass":
                        rec["check_summary"] = chk.summary()[:400]
                    try:
                        with launches() as seen:
                            fn()
                        rec["launch"] = seen[0] if seen else None  # (the main kernel's, at the timed M)
                        rec["ms"] = [round(bench(fn), 5)]
                    except Exception as e:  # noqa: BLE001
                        rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                recs.append((entry, rec))
            ok = [(e, r) for e, r in recs if "ms" in r and r["check"] == "pass"]
            if ok:  # the fastest, the pinned and the element-wise, twice more, alternating
                again = [min((er for er in ok if er[1]["tag"] in tags), key=lambda er: er[1]["ms"][0], default=None)
                         for tags in (("grid", "pinned"), ("pinned",), ("before",))]  # fmt: skip
                for _ in range(2):
                    for entry, r in {id(er): er for er in again if er}.values():
                        with entry_in_plan(op, d, n, entry):
                            r["ms"].append(round(bench(fn), 5))
            for entry, r in recs:
                if "ms" in r:
                    r["frac"] = fraction(r["ms"], nbytes, copy_tbps)
                f.write(json.dumps(r) + "\n")
                print(op, d, n, r["tag"], entry, r.get("launch"), r["check"], r.get("ms"), r.get("frac"), flush=True)
            f.flush()
            del fn
            torch.cuda.empty_cache()
    finish_meta(out_dir, meta)


if __name__ == "__main__":
    cli(warm, jobs, run)
