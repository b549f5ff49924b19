"""``normbench tune --impl triton``: every ``configs.candidates()`` config timed per op,
direction and N, the winners pinned in ``configs.json`` under this GPU's name.

Each (op, direction, N) is one job in a worker process. A job first runs each candidate through
``harness.run.checker.run_check`` on 64 rows of the same N (the fp64 reference and the project's
tolerances; M is not specialized, so this compiles exactly the binary the full shape runs) and
drops a candidate that fails; then, holding a lock that keeps every other job off the GPU, it times
the passing ones on the full shape with ``triton.testing.do_bench`` (median). Compiling dominates
and runs in parallel; the timings do not share the GPU. (The search used to be one process, one
compile after another: about 800 compiles for the three ops on the sweep.)

What is pinned: per N bucket (the register tile width), the winner at the bucket's own N (a power
of two), or at the widest sweep N of the bucket when no power of two is in it; and at another N of
the bucket, its own winner as an exact-N entry when that beat the bucket's config at this N by more
than ``EXACT_N_MARGIN`` (the noise of two do_bench medians). An op/direction's entries for this GPU
are replaced as a whole; other GPUs' and other ops' entries are kept. The log (every candidate with
its check and time, the winners) goes to ``log_dir``.
"""

from __future__ import annotations

import datetime
import json
import multiprocessing as mp
import os
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from . import configs as C

EXACT_N_MARGIN = 0.015
CHECK_ROWS = 64
ELEMENT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def pinned_kernels(impl, fwd_cfg: C.Config | None, bwd_cfg: C.Config | None):
    """The contract functions with explicit configs, behind the harness's own input handling
    (validation, reshaping, M = 0): what ``run_check(kernels=...)`` takes."""
    from harness.spec.loading import checked_functions

    from . import kernels as K

    return SimpleNamespace(**checked_functions(impl, K.contract(fwd_cfg, bwd_cfg)))


# ---------------------------------------------------------------- one job per (op, direction, N)
_GPU_LOCK = None


def _init_worker(lock) -> None:
    global _GPU_LOCK
    _GPU_LOCK = lock


def _run_job(job: dict) -> dict:
    try:
        return _tune_job(job)
    except Exception as e:  # one broken job must not lose the others' results
        return {**job, "error": f"{type(e).__name__}: {str(e)[:300]}", "tried": [], "best": None}


def _full_run(op: str, direction: str, m: int, n: int, dtype: str):
    """launch(config) on the full (M, N) shape, with the inputs the benchmark draws."""
    from harness.spec.contract import DTYPES
    from harness.spec.inputs import make_case
    from harness.spec.shapes import Shape

    from . import kernels as K

    values = make_case(op, Shape((m, n)), DTYPES[dtype], "cuda")
    layernorm = op == "layernorm"
    x, w, b, eps = values["x"], values["weight"], values["bias"], values["eps"]
    residual, dres = values.get("residual"), values.get("dresidual_out")  # the fused add's only
    if direction == "fwd":
        return lambda cfg: K.norm_fwd(x, w, b, eps, layernorm, cfg, residual=residual)
    _, mean, rstd, h = K.norm_fwd(x, w, b, eps, layernorm, residual=residual)
    saved = x if h is None else h  # what the backward differentiates at: x, or residual_out
    return lambda cfg: K.norm_bwd(values["dy"], saved, w, mean, rstd, layernorm, cfg, dresidual=dres)


def _tune_job(job: dict) -> dict:
    import triton.testing

    from harness.registry import get
    from harness.run.checker import run_check
    from harness.spec.shapes import Shape

    op, direction, m, n, dtype = job["op"], job["direction"], job["m"], job["n"], job["dtype"]
    impl = get("triton")
    tried = []
    for entry in job["candidates"]:
        cfg = C.Config(**entry)
        kernels = pinned_kernels(impl, cfg if direction == "fwd" else None, cfg if direction == "bwd" else None)
        t0 = time.perf_counter()
        check = run_check(impl, op, direction, Shape((CHECK_ROWS, n)), dtype, "cuda", kernels=kernels)
        tried.append({**entry, "compile_and_check_s": round(time.perf_counter() - t0, 2), "check": check.status,
                      "check_detail": check.summary()[:300]})  # fmt: skip
    nbytes = job["units"] * m * n * ELEMENT_BYTES[dtype]
    with _GPU_LOCK:
        launch = _full_run(op, direction, m, n, dtype)
        for rec in tried:
            if rec["check"] != "pass":
                continue
            cfg = _config(rec)
            try:
                launch(cfg)
                torch.cuda.synchronize()
                ms = triton.testing.do_bench(lambda: launch(cfg), warmup=25, rep=100, return_mode="median")
                rec["ms"], rec["tb_s"] = round(ms, 5), round(nbytes / ms / 1e9, 3)
            except Exception as e:  # e.g. out of resources at the full size: a result, not a crash
                rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
    timed = [r for r in tried if "ms" in r]
    best = min(timed, key=lambda r: r["ms"]) if timed else None
    return {**{k: v for k, v in job.items() if k != "candidates"}, "bytes": nbytes, "tried": tried, "best": best}


# ---------------------------------------------------------------- choosing what to pin
def _config(rec: dict) -> C.Config:
    """The Config of a log record (a config's fields beside its check and time)."""
    return C.Config(**{k: rec[k] for k in C.Config.__dataclass_fields__ if k in rec})


def _config_of(rec: dict) -> dict:
    return _config(rec).to_json()


def winners(results: list[dict]) -> dict:
    """{"<op>_<direction>": {bucket or exact N (str): config dict}} from the jobs' results (see the
    module docstring for which N a bucket's entry comes from)."""
    out: dict = {}
    by_entry: dict = {}
    for r in results:
        if r.get("best"):
            by_entry.setdefault(f"{r['op']}_{r['direction']}", []).append(r)
    for entry, rs in by_entry.items():
        table = out.setdefault(entry, {})
        buckets: dict = {}
        for r in rs:
            buckets.setdefault(C.bucket(r["n"]), []).append(r)
        for b, members in sorted(buckets.items()):
            lead = next((r for r in members if r["n"] == b), max(members, key=lambda r: r["n"]))
            chosen = _config_of(lead["best"])
            table[str(b)] = chosen
            for r in members:
                if r is lead:
                    continue
                at_n = {json.dumps(_config_of(t)): t["ms"] for t in r["tried"] if "ms" in t}
                bucket_ms = at_n.get(json.dumps(chosen), float("inf"))
                if bucket_ms > r["best"]["ms"] * (1 + EXACT_N_MARGIN):
                    table[str(r["n"])] = _config_of(r["best"])
    return out


def pin(gpu: str, tables: dict) -> None:
    """Merge ``tables`` into configs.json under ``gpu`` (one line per entry)."""
    with open(C.CONFIG_FILE) as f:
        data = json.load(f)
    data.setdefault(gpu, {}).update(tables)
    lines = ["{"]
    items = list(data.items())
    for i, (key, value) in enumerate(items):
        end = "," if i < len(items) - 1 else ""
        if key.startswith("_"):
            lines.append(f"  {json.dumps(key)}: {json.dumps(value)}{end}")
            continue
        lines.append(f"  {json.dumps(key)}: {{")
        entries = list(value.items())
        for j, (entry, by_n) in enumerate(entries):
            lines.append(f"    {json.dumps(entry)}: {{")
            rows = sorted(by_n.items(), key=lambda kv: int(kv[0]))
            for k, (n, cfg) in enumerate(rows):
                lines.append(f"      {json.dumps(n)}: {json.dumps(cfg)}" + ("," if k < len(rows) - 1 else ""))
            lines.append("    }" + ("," if j < len(entries) - 1 else ""))
        lines.append("  }" + end)
    text = "\n".join(lines + ["}"]) + "\n"
    assert json.loads(text) == data
    with open(C.CONFIG_FILE, "w") as f:
        f.write(text)
    C._PINNED = None  # re-read on the next lookup


# ---------------------------------------------------------------- the hook
def tune(op: str, shapes, dtype: str, log_dir=None, workers: int | None = None) -> dict:
    """Tune ``op`` on every N of ``shapes`` (their M is the M timed) in ``dtype`` on this GPU; pin
    the winners in configs.json; write the log to ``log_dir``."""
    from harness.spec.ops import get_op

    if not torch.cuda.is_available():
        raise RuntimeError("triton tuning needs a CUDA GPU")
    started = time.perf_counter()
    gpu = torch.cuda.get_device_name()
    rec = get_op(op)
    points = sorted({(s.m, s.n) for s in shapes}, key=lambda p: p[1])
    jobs = [
        {"op": op, "direction": d, "m": m, "n": n, "dtype": dtype, "units": rec.rows_of(d),
         "candidates": [c.to_json() for c in C.candidates(d, n)]}  # fmt: skip
        for d in ("bwd", "fwd")  # the backward has more candidates: start it first
        for m, n in points
    ]
    workers = workers or max(1, min(len(jobs), (os.cpu_count() or 4) - 2, 12))
    print(f"triton tune {op} {dtype} on {gpu}: {len(jobs)} jobs, "
          f"{sum(len(j['candidates']) for j in jobs)} candidates, {workers} worker processes", flush=True)  # fmt: skip
    ctx = mp.get_context("spawn")
    lock = ctx.Lock()
    results = []
    with ctx.Pool(workers, initializer=_init_worker, initargs=(lock,)) as pool:
        for r in pool.imap_unordered(_run_job, jobs):
            best = r.get("best")
            print(f"  {op} {r['direction']} N={r['n']}: "
                  + (f"{best['tb_s']} TB/s with {_config_of(best)}" if best else f"nothing timed {r.get('error', '')}"),
                  flush=True)  # fmt: skip
            results.append(r)
    tables = winners(results)
    pin(gpu, tables)
    import triton

    log = {"gpu": gpu, "op": op, "dtype": dtype, "workers": workers, "wall_s": round(time.perf_counter() - started, 1),
           "triton": triton.__version__, "torch": torch.__version__, "date": datetime.date.today().isoformat(),
           "pinned": tables, "jobs": sorted(results, key=lambda r: (r["direction"], r["n"]))}  # fmt: skip
    if log_dir:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        path = Path(log_dir) / f"triton-tune-{op}-{dtype}-{gpu.replace(' ', '_')}.json"
        path.write_text(json.dumps(log, indent=1) + "\n")
        print(f"log: {path}")
    return log
