"""Helion's forward for wide rows as one kernel whose column slices exchange their row statistics
(``kernels.py``, ``*_fwd_sync``: x, and the fused add's residual, read once) against the forward
the table picks today ("pinned": the row kernel, which walks a wide row twice in column chunks),
for rmsnorm, layernorm and add_rmsnorm, N in WIDE_N, M = 2^27 // N. Candidates: the pinned choice
and three exchanging ones, one row a step on 8 warps in 8192- and 4096-column slices and on 16 warps
in 16384-column slices (``CANDIDATES``: 32, 16 and 32 bf16 elements per thread and row tensor, in
registers once). Each is checked against the
fp64 reference with the harness's checker on (CHECK_M + M mod 16, N) rows (M's class for Triton's
integer specialization, so the check compiles the binary that is timed), then all are timed
alternately, three rounds (``gpu_timing.bench``: do_bench median, L2 flushed). Bytes: the
harness's forward model, ``bytes_moved(op, "fwd", ...)``: its main bytes (x (+ residual) read once,
y (+ residual_out) written once) make the fractions of the copy bandwidth, as in the harness's
TB/s; its extra bytes (the statistics and parameters) are recorded beside them.

    python tools/experiments/helion-wide-fwd/fwd.py OUT [DTYPE]     (GPU; DTYPE bf16 by default)
    python tools/experiments/helion-wide-fwd/fwd.py --dry [DTYPE]   (no GPU: lists the candidates)

Helion compiles are slow (seconds of tracing, then Triton's), so WORKERS processes (default 12)
share the (op, N) points: each compiles and checks its points' candidates and runs each once at
full size; once every process is done (or BUDGET_S, default 150 s from the start, has passed: no
new (op, N) starts after it), the points are timed one at a time under a lock, with nothing else
on the GPU. Environment: OPS (default rmsnorm,layernorm,add_rmsnorm), WIDE_N (default
16384,24576,32768,49152,65536,131072,262144), BUDGET_S,
CHECK_M (default 512), WORKERS. Writes OUT/results.jsonl (one line per (op, N): each candidate's
entry, grid, the kernel it ran, check, compile + check seconds, errors, ms per round, fractions of
the copy bandwidth) and OUT/meta.json, and prints one line per (op, N).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(HERE))

ELEMS = 2**27
OPS = tuple(os.environ.get("OPS", "rmsnorm,layernorm,add_rmsnorm").split(","))
WIDE_N = tuple(int(n) for n in os.environ.get("WIDE_N", "16384,24576,32768,49152,65536,131072,262144").split(","))
BUDGET_S = float(os.environ.get("BUDGET_S", "150"))
CHECK_M = int(os.environ.get("CHECK_M", "512"))
WORKERS = int(os.environ.get("WORKERS", "12"))
# (slice width, rows a step, warps) of the exchanging candidates
CANDIDATES = ((8192, 1, 8), (4096, 1, 8), (16384, 1, 16))
SMS = 132  # the H100's, for --dry


def name(c) -> str:
    return "pinned" if c is None else "s{} r{} w{}".format(*c)


def family(op: str) -> str:
    return "layernorm" if op == "layernorm" else "rmsnorm"


def candidate(op: str, pinned, c):
    """The entry naming the exchanging forward for ``c``: the pinned row kernel's config as its
    fallback, ``c`` as its own (``sync``) config."""
    from impls.helion.configs import Pinned

    width, rows, warps = c
    fallback = pinned.config if pinned.kernel.endswith("_fwd_kernel") else {"block_sizes": [1], "reduction_loops": [8192], "num_warps": 16}
    sync = {"block_sizes": [rows, width], "num_warps": warps}
    return Pinned(f"{family(op)}_fwd_sync", fallback, "candidate", sync=sync)


def grid(c, m: int, n: int, sms: int):
    from harness.spec.occupancy import exchange_groups

    width, rows, _ = c
    slices = -(-n // width)
    groups = exchange_groups(-(-m // rows), slices, sms)
    return {"slices": slices, "groups": groups} if groups else "row kernel (more slices than SMs)"


def points():
    return [(op, n) for n in WIDE_N for op in OPS]


def check_rows(m: int) -> int:
    return min(m, CHECK_M + m % 16)


def dry(dtype: str) -> None:
    for op, n in points():
        m = ELEMS // n
        print(op, n, f"M={m}", f"check M={check_rows(m)}", dtype, "pinned",
              *(f"{name(c)}: {grid(c, m, n, SMS)}" for c in CANDIDATES), sep=" | ")  # fmt: skip
    print(len(points()), "points,", len(points()) * (1 + len(CANDIDATES)), "candidates")


def worker(i: int, k: int, dtype: str, t0: float, out_dir: str, barrier, lock) -> None:
    """Compile, check and run once the candidates of points i, i + k, ...; after the barrier, time
    each point under the lock. Records go to OUT/part-<i>.jsonl."""
    import torch
    from gpu_timing import bench

    from harness.registry import get
    from impls.helion import kernels

    impl = get("helion")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ran = []
    launch = kernels.launch

    def logged(kernel, config, *args):
        ran.append(kernel.name)
        return launch(kernel, config, *args)

    kernels.launch = logged
    ready = []
    try:
        for op, n in points()[i::k]:
            if time.time() - t0 > BUDGET_S:
                ready.append({"op": op, "N": n, "skipped": "budget spent"})
                continue
            try:
                ready.append(prepare(op, n, dtype, impl, sms, ran))
            except Exception as e:  # noqa: BLE001 -- e.g. out of memory for the full case: a result
                ready.append({"op": op, "N": n, "skipped": f"{type(e).__name__}: {str(e)[:300]}"})
    finally:
        # the others wait here for this one: a failure above must not leave them waiting
        try:
            barrier.wait(timeout=900)
        except threading.BrokenBarrierError:
            print("worker", i, ": barrier broken, timing anyway", flush=True)
    with open(os.path.join(out_dir, f"part-{i}.jsonl"), "w") as f:
        for item in ready:
            if isinstance(item, dict):
                f.write(json.dumps(item) + "\n")
                continue
            rec, case, runs = item
            with lock:
                for _ in range(3):
                    for key, fn in runs.items():
                        rec["ms"].setdefault(key, []).append(round(bench(fn), 5))
            f.write(json.dumps(rec) + "\n")
            f.flush()
            del case, runs
            torch.cuda.empty_cache()


def prepare(op: str, n: int, dtype: str, impl, sms: int, ran: list):
    """(record, case, {candidate: callable}) of one point: each candidate checked on a few rows,
    then run once on the full case (the kernels it launched go to ``ran``)."""
    import torch

    from harness.run.bench import callables
    from harness.run.checker import run_check
    from harness.spec.contract import DTYPES
    from harness.spec.inputs import make_case
    from harness.spec.roofline import bytes_moved
    from harness.spec.shapes import Shape
    from impls.helion import configs
    from impls.helion.tune import pinned_kernels

    m = ELEMS // n
    b = bytes_moved(op, "fwd", m, n, DTYPES[dtype].itemsize)
    case = make_case(op, Shape((m, n)), DTYPES[dtype], "cuda")
    pinned = configs.choose(f"{family(op)}_fwd", case["x"])
    rec = {"op": op, "N": n, "M": m, "dtype": dtype, "bytes": b.main, "bytes_extra": b.extra,
           "pinned": pinned.entry(), "choices": {}, "grid": {}, "ran": {}, "checks": {},
           "compile_and_check_s": {}, "errors": {}, "ms": {}}  # fmt: skip
    runs = {}
    for c in (None, *CANDIDATES):
        key = name(c)
        choices = {}
        if c is not None:
            choice = candidate(op, pinned, c)
            choices = {f"{family(op)}_fwd": choice}
            rec["choices"][key] = choice.entry()
            rec["grid"][key] = grid(c, m, n, sms)
        kern = pinned_kernels(impl, choices)
        t = time.time()
        try:
            check = run_check(impl, op, "fwd", Shape((check_rows(m), n)), dtype, "cuda", kernels=kern)
            rec["checks"][key] = check.status
            if check.status != "pass":
                rec["errors"][key] = check.summary()[:300]
            fn = callables(kern, op, "fwd", case)
            del ran[:]
            fn()
            torch.cuda.synchronize()
            rec["ran"][key] = list(ran)
            runs[key] = fn
        except Exception as e:  # noqa: BLE001 -- a candidate that does not build is a result too
            rec["errors"][key] = f"{type(e).__name__}: {str(e)[:300]}"
        rec["compile_and_check_s"][key] = round(time.time() - t, 1)
        print(op, n, key, rec["checks"].get(key), rec["compile_and_check_s"][key], "s", rec["ran"].get(key),
              rec["errors"].get(key, ""), flush=True)  # fmt: skip
    return rec, case, runs


def run(out_dir: str, dtype: str = "bf16") -> None:
    import multiprocessing as mp

    import helion
    import torch
    from gpu_timing import finish_meta, fraction, start_meta

    t0 = time.time()
    os.makedirs(out_dir, exist_ok=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    meta = start_meta(dtype=dtype, variants=[name(c) for c in (None, *CANDIDATES)], widths=WIDE_N, budget_s=BUDGET_S,
                      check_m=CHECK_M, helion=getattr(helion, "__version__", None), sms=sms)  # fmt: skip
    copy = meta["copy_before"]["tbps"]
    k = max(1, min(WORKERS, len(points())))
    ctx = mp.get_context("spawn")
    barrier, lock = ctx.Barrier(k), ctx.Lock()
    procs = [ctx.Process(target=worker, args=(i, k, dtype, t0, out_dir, barrier, lock)) for i in range(k)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    meta["worker_exit_codes"] = [p.exitcode for p in procs]
    records = []
    for i in range(k):
        part = os.path.join(out_dir, f"part-{i}.jsonl")
        if os.path.exists(part):
            with open(part) as f:
                records += [json.loads(line) for line in f if line.strip()]
            os.remove(part)
    order = {p: j for j, p in enumerate(points())}
    records.sort(key=lambda r: order[(r["op"], r["N"])])
    meta["skipped"] = [[r["op"], r["N"], r["skipped"]] for r in records if "skipped" in r]
    with open(os.path.join(out_dir, "results.jsonl"), "w") as f:
        for rec in records:
            if "skipped" in rec:
                print("skip", rec["op"], rec["N"], rec["skipped"], flush=True)
                continue
            rec["frac"] = {key: fraction(ms, rec["bytes"], copy) for key, ms in rec["ms"].items()}
            f.write(json.dumps(rec) + "\n")
            bad = {key: s for key, s in rec["checks"].items() if s != "pass"}
            fracs = {key: round(v * 100, 1) for key, v in rec["frac"].items()}
            print(rec["op"], rec["N"], "not pass:", bad, rec["errors"], fracs, flush=True)
    finish_meta(out_dir, meta)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    if sys.argv[1] == "--dry":
        dry(*(sys.argv[2:3] or ["bf16"]))
    else:
        run(sys.argv[1], *(sys.argv[2:3] or ["bf16"]))
