"""cuTile's realigned kernels for 16-bit rows whose length is no multiple of 8 (impls/cutile/kernels.py,
"Realigned rows"): each variant checked against the fp64 reference through the repository's checker
(512 x N: every phase, several row blocks; and 37 x 1001), then timed at M * N = 2^27 (N = 4001: M =
33546), bf16, against the row kernels they replace (``realign`` off, the table's entry otherwise).

    python tools/experiments/cutile-odd-rows/explore.py OUT [BUDGET_S]

Variants: "rows" (the row kernels, realign off), "realigned" (the table's entry), and the realigned
kernels under the hints that could matter for them: TMA off for loads or stores, worker warps 8,
two tile rows, and (forward) 2 programs per SM. Every variant is compiled first in parallel
processes (cuTile's disk cache), then checked and timed one at a time in this process; "rows" and
"realigned" are timed twice more, alternating. Writes OUT/results.jsonl and OUT/meta.json.

Environment: ODD_N (default 4001,2999,5003), OPS, DIRECTIONS, WARM=0 (no parallel compile first).
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import sys
import time
from dataclasses import asdict

import torch

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from gpu_timing import bench, finish_meta, fraction, start_meta

ELEMS = 2**27
OPS = tuple(os.environ.get("OPS", "rmsnorm,layernorm,add_rmsnorm").split(","))
DIRECTIONS = tuple(os.environ.get("DIRECTIONS", "fwd,bwd").split(","))
# WARM=0: no parallel compile first (each variant compiles when first checked)
WARM = os.environ.get("WARM", "1") != "0"
WIDTHS = tuple(int(n) for n in os.environ.get("ODD_N", "4001,2999,5003").split(","))


def variants(op: str, direction: str, n: int) -> list[tuple[str, dict]]:
    """(tag, tuning) at this point: the table's entry with realign off and on, and hints around it."""
    from impls.cutile import configs

    table = asdict(configs.choose(op, direction, n, torch.device("cuda")))
    out = [("rows", dict(table, realign=False)), ("realigned", dict(table, realign=True))]
    out += [("tma_load_off", dict(table, tma_load=False)), ("tma_store_" + ("off" if table["tma_store"] else "on"),
            dict(table, tma_store=not table["tma_store"])), ("worker_warps_8", dict(table, worker_warps=8))]  # fmt: skip
    if direction == "fwd":
        out += [("rows2", dict(table, fwd_tile_elements=8192, max_rows=64)), ("programs2", dict(table, fwd_programs_per_sm=2))]
    else:
        out += [("rows2", dict(table, bwd_tile_elements=8192, max_rows=64)), ("acc_rows_" + str(not table["acc_rows"]),
                dict(table, acc_rows=not table["acc_rows"]))]  # fmt: skip
    seen, keep = set(), []
    for tag, t in out:  # a hint the entry already has gives the entry again
        key = json.dumps(t, sort_keys=True)
        if key not in seen:
            seen.add(key)
            keep.append((tag, t))
    return keep


@contextlib.contextmanager
def tuned(tuning: dict):
    from impls.cutile import plan as P

    old = P.set_tuning(**tuning)
    try:
        yield
    finally:
        P.TUNING = old


def kernels():
    from harness.registry import get

    return get("cutile").kernels("cuda")


def call_of(k, op, direction, m, n):
    from harness.run.bench import callables
    from harness.spec.inputs import make_case
    from harness.spec.shapes import Shape

    case = make_case(op, Shape((m, n)), torch.bfloat16, "cuda")
    return callables(k, op, direction, case)


def warm_one(job):
    """One point's variants compiled (and run once) in a worker process."""
    op, direction, n = job
    k = kernels()
    errors = []
    for tag, t in variants(op, direction, n):
        try:
            with tuned(t):
                call_of(k, op, direction, 512, n)()
        except Exception as e:  # noqa: BLE001
            errors.append((tag, f"{type(e).__name__}: {str(e)[:300]}"))
    torch.cuda.synchronize()
    return op, direction, n, errors


def check(op, direction, n, tuning) -> dict:
    from harness.registry import get
    from harness.run.checker import run_check
    from harness.spec.shapes import Shape

    out = {}
    with tuned(tuning):
        for shape in (Shape((512, n)), Shape((37, 1001))):
            r = run_check(get("cutile"), op, direction, shape, "bf16", "cuda", kernels=kernels())
            out[shape.label] = r.status if r.passed else f"{r.status}: {r.summary()[:300]}"
    return out


def main(out_dir: str, budget_s: float):
    from harness.spec.roofline import bytes_moved
    from impls.cutile.plan import Tuning, plan, realigned

    t0 = time.time()
    os.makedirs(out_dir, exist_ok=True)
    os.environ.setdefault("CUDA_TILE_CACHE_DIR", "/tmp/cutile-cache")
    meta = start_meta(widths=list(WIDTHS))
    copy = meta["copy_before"]["tbps"]
    jobs = [(op, d, n) for n in WIDTHS for d in DIRECTIONS for op in OPS]
    with mp.get_context("spawn").Pool(min(14, len(jobs))) if WARM else contextlib.nullcontext() as pool:
        for op, d, n, errors in pool.imap_unordered(warm_one, jobs) if WARM else ():
            for tag, e in errors:
                print("warm error", op, d, n, tag, e, flush=True)
    print(f"warm {time.time() - t0:.0f} s", flush=True)
    k = kernels()
    with open(os.path.join(out_dir, "results.jsonl"), "w") as f:
        for op, d, n in jobs:
            if time.time() - t0 > budget_s:
                meta.setdefault("skipped", []).append([op, d, n])
                continue
            m = ELEMS // n
            nbytes = bytes_moved(op, d, m, n, 2).main
            fns, recs = {}, []
            for tag, t in variants(op, d, n):
                tt = Tuning(**t)
                rec = {"op": op, "direction": d, "N": n, "M": m, "variant": tag, "tuning": t,
                       "path": "realigned" if realigned(m, n, 2, plan(d, m, n, tt), tt) else "rows"}  # fmt: skip
                try:
                    rec["check"] = check(op, d, n, t)
                    with tuned(t):
                        fn = call_of(k, op, d, m, n)
                        rec["ms"] = [round(bench(fn), 5)]
                    fns[tag] = (fn, t)
                    rec["frac"] = fraction(rec["ms"], nbytes, copy)
                except Exception as e:  # noqa: BLE001
                    rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                recs.append(rec)
                print(op, d, n, tag, rec.get("check"), rec.get("frac"), rec.get("error", ""), flush=True)
            for _ in range(2):  # the row kernels and the realigned entry, alternating
                for rec in recs:
                    if rec["variant"] in ("rows", "realigned") and rec["variant"] in fns:
                        fn, t = fns[rec["variant"]]
                        with tuned(t):
                            rec["ms"].append(round(bench(fn), 5))
                        rec["frac"] = fraction(rec["ms"], nbytes, copy)
            f.writelines(json.dumps(r) + "\n" for r in recs)
            f.flush()
            del fns
            torch.cuda.empty_cache()
    finish_meta(out_dir, meta)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 200)
