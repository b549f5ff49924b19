"""Small rows, per-head views and an odd width for the Helion and Gluon kernels: the code before the
change (a copy of the committed kernels under ``.nbbase/nbbase``, given as ``--base``) beside the
working tree's, and the Helion small-row config search, in one GPU run.

* Gluon: every point of the small set, N = 4001, and two per-head pairs, before and after; the
  small-row tile's knobs (``plan.LANE_VECS``, ``plan.THREAD_VECS``) at N = 128 and 512; the
  persistent backward's grid by the threads' count instead of the binary's occupancy.
* Helion: ``impls.helion.tune``'s jobs for RMSNorm and LayerNorm at the small N, the config the
  committed table gives these N (its 1024 bucket) as the first candidate: the before. Compiles in
  worker processes while the main process times; every timing holds one lock. Before of the
  per-head pair and of add_rmsnorm at N = 128 and 512 from the committed copy.

Writes ``$OUT/gluon.json``, ``$OUT/helion_tune.json``, ``$OUT/helion_base.json``: per point ms (median
of the trials' medians), the trials' spread, TB/s of the bytes the harness counts and the fraction
of the copy bandwidth measured at the start.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

import torch

from harness.registry import get
from harness.run.bench import callables
from harness.run.timer import CudaTimer, measure_copy_bandwidth, summarize
from harness.spec.contract import DTYPES
from harness.spec.inputs import make_case
from harness.spec.roofline import bytes_moved, tbps
from harness.spec.shapes import SHAPE_SETS, SWEEP_ELEMENTS, Shape

OPS = ("rmsnorm", "layernorm", "add_rmsnorm")
SMALL = tuple(SHAPE_SETS["small"])
ODD = (Shape((SWEEP_ELEMENTS // 4001, 4001)),)
PERHEAD = tuple(SHAPE_SETS["perhead"][:4])  # (32768, 32 of 48) and (32768, 8 of 48), each beside contiguous
TIMER = CudaTimer(warmup_ms=10, rep_ms=40, trials=2)


def timed(k, op, direction, shape, dtype, lock, roof) -> dict:
    row = {"op": op, "direction": direction, "shape": shape.label, "n": shape.n, "dtype": dtype}
    try:
        case = make_case(op, shape, DTYPES[dtype], "cuda", 0)
        fn = callables(k, op, direction, case)
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        row["first_call_s"] = round(time.perf_counter() - t0, 2)
        with lock:
            trials, _ = TIMER.time(fn)
        s = summarize(trials)
        b = bytes_moved(op, direction, shape.m, shape.n, DTYPES[dtype].itemsize)
        row.update(ms=s["ms"], spread=round(s["spread"], 4), tbps=round(tbps(b.main, s["ms"]), 3))
        row["frac"] = round(row["tbps"] / roof, 4)
    except Exception as e:  # noqa: BLE001 -- one failing point never stops the run
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    finally:
        torch.cuda.empty_cache()
    print(json.dumps(row), flush=True)
    return row


def impl_like(name: str, entry: str | None = None, **changes):
    impl = get(name)
    if entry:
        changes.update(name=f"{name}-base", entry=entry, row_views=False)
    return dataclasses.replace(impl, **changes)


def gluon_runs(lock, roof) -> list[dict]:
    from impls.gluon import kernels, plan

    out = []
    base = impl_like("gluon", "nbbase.gluon.kernels").kernels("cuda")
    new = get("gluon").kernels("cuda")
    for label, k in (("base", base), ("new", new)):
        for shape in SMALL + ODD + PERHEAD:
            for op in OPS:
                for d in ("fwd", "bwd"):
                    out.append({"variant": label, **timed(k, op, d, shape, "bf16", lock, roof)})
    knobs = {
        "lanes1": (1, {"fwd": 4, "bwd": 2}),
        "lanes4-t8-4": (4, {"fwd": 8, "bwd": 4}),
        "t8-1": (2, {"fwd": 8, "bwd": 1}),
    }
    default = (plan.LANE_VECS, dict(plan.THREAD_VECS))
    two = tuple(s for s in SMALL if s.n in (128, 512))
    for label, (lanes, per_thread) in knobs.items():
        plan.LANE_VECS, plan.THREAD_VECS = lanes, per_thread
        for shape in two:
            for op in ("rmsnorm", "layernorm"):
                for d in ("fwd", "bwd"):
                    out.append({"variant": label, **timed(new, op, d, shape, "bf16", lock, roof)})
    plan.LANE_VECS, plan.THREAD_VECS = default
    resident = kernels._resident
    kernels._resident = lambda kernel, args, constexprs, t, *where: plan.programs_per_sm(t)
    for shape in two + ODD:
        for op in ("rmsnorm", "layernorm"):
            out.append({"variant": "threads-grid", **timed(new, op, "bwd", shape, "bf16", lock, roof)})
    kernels._resident = resident
    from harness.run.checker import run_check

    impl = get("gluon")
    for shape in (*two, *ODD, PERHEAD[0]):
        for op in OPS:
            for d in ("fwd", "bwd"):
                r = run_check(impl, op, d, shape, "bf16", "cuda", seed=1, kernels=new)
                out.append({"variant": "check", "op": op, "direction": d, "shape": shape.label, "status": r.status,
                            "detail": "" if r.passed else r.summary()[:300]})  # fmt: skip
                print("check", op, d, shape.label, r.status, flush=True)
    return out


def helion_base_runs(lock, roof) -> list[dict]:
    k = impl_like("helion", "nbbase.helion.kernels").kernels("cuda")
    out = []
    for shape in PERHEAD[:2]:
        for op in OPS:
            for d in ("fwd", "bwd"):
                out.append({"variant": "base", **timed(k, op, d, shape, "bf16", lock, roof)})
    for shape in (s for s in SMALL if s.n in (128, 512)):
        for d in ("fwd", "bwd"):
            out.append({"variant": "base", **timed(k, "add_rmsnorm", d, shape, "bf16", lock, roof)})
    return out


def helion_jobs(gpu: str, sms: int) -> list[dict]:
    from impls.helion import configs, tune

    jobs = []
    for direction in ("bwd", "fwd"):
        for op in ("rmsnorm", "layernorm"):
            for shape in SMALL:
                m, n, entry = shape.m, shape.n, f"{op}_{direction}"
                base = configs.pinned(entry, n, "bf16", gpu).entry()
                cands = ([base] + [c.entry() for c in tune.candidates(entry, m, n, sms) if c.entry() != base])[:10]
                jobs.append({"entry": entry, "m": m, "n": n, "dtype": "bf16", "candidates": cands})
    return jobs


def collected(pending, pool, roof: float, label: str, shown: tuple) -> list:
    """The tuning jobs' results once the pool is done, each candidate's fraction of the copy
    bandwidth added and one line printed per job: its first candidate (``label``) and the best."""
    results = pending.get()
    pool.close()
    pool.join()
    for r in results:
        for c in r["candidates"]:
            if "ms" in c:
                c["frac"] = round(c["tb_s"] / roof, 4)
        best = r["best"]
        shown_values = [best and best[k] for k in shown]
        print(r["entry"], r["n"], label, r["candidates"][0].get("frac"), "best", best and best.get("frac"), *shown_values, flush=True)
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default=".nbbase", help="folder holding the package nbbase (the committed kernels)")
    ap.add_argument("--workers", type=int, default=12)
    args = ap.parse_args()
    sys.path.insert(0, args.base)
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    from impls.helion import tune

    gpu = torch.cuda.get_device_name()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    copy = measure_copy_bandwidth()
    roof = copy["tbps"]
    print("gpu", gpu, "copy TB/s", round(roof, 3), flush=True)
    env = {"gpu": gpu, "copy_bandwidth": copy, "torch": torch.__version__}
    import triton

    env["triton"] = triton.__version__
    ctx = mp.get_context("spawn")
    lock = ctx.Lock()
    jobs = helion_jobs(gpu, sms)
    pool = ctx.Pool(args.workers, initializer=tune._init_worker, initargs=(lock,))
    pending = pool.map_async(tune._run_job, jobs, chunksize=1)
    try:
        import helion

        env["helion"] = getattr(helion, "__version__", "?")
    except ImportError:
        env["helion"] = None
    rows = gluon_runs(lock, roof)
    (out / "gluon.json").write_text(json.dumps({**env, "rows": rows}, indent=1) + "\n")
    print("gluon done", round(time.perf_counter() - started, 1), flush=True)
    rows = helion_base_runs(lock, roof)
    (out / "helion_base.json").write_text(json.dumps({**env, "rows": rows}, indent=1) + "\n")
    print("helion base done", round(time.perf_counter() - started, 1), flush=True)
    results = collected(pending, pool, roof, "base", ("kernel", "config"))
    (out / "helion_tune.json").write_text(json.dumps({**env, "jobs": results}, indent=1) + "\n")
    print("all done", round(time.perf_counter() - started, 1), flush=True)


if __name__ == "__main__":
    main()
