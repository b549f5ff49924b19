"""``normbench tune --impl helion``: a bounded search for each Helion kernel's config, per N.

Not Helion's autotuner, which compiles hundreds of configs per shape (minutes each): for every N of
the given shapes and both directions, ``candidates()`` derives at most MAX_CANDIDATES configs from N,
M and the SM count. Each one is

1. checked by ``harness.run.checker.run_check`` on a few rows of the same N (fp64 reference, the
   project's tolerances), which also compiles it; a candidate that fails is logged and dropped;
2. timed on the full shape with ``triton.testing.do_bench`` (median), through the very
   ``launch()`` path the contract functions use, including the partial-row sums of the backward.

Compiling dominates, so each (entry point, N) job runs in its own worker process; timing is
serialized across workers by a lock so that no two measurements share the GPU. The fastest passing
candidate goes into configs.json under this GPU's name; the log (every candidate with its compile
and check time, result and median time, the winner, the wall time) is written to ``log_dir``.
"""

from __future__ import annotations

import datetime
import json
import multiprocessing as mp
import os
import time
from pathlib import Path

import torch

from . import configs
from .configs import Pinned

MAX_CANDIDATES = 13  # the fallback and up to 12 derived configs
SMALL_ROWS = 512  # rows up to this long: the small-row candidates (tens of rows per step)
ELEMENT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
TENSORS_MOVED = {"fwd": 2, "bwd": 3}  # fwd: x in, y out; bwd: x and dy in, dx out


def _pow2_floor(v: int) -> int:
    return 1 << max(0, int(v).bit_length() - 1)


def _warps(elements: int, per_thread: int) -> int:
    return min(32, max(4, elements // (32 * per_thread)))


def candidates(entry: str, m: int, n: int, sms: int) -> list[Pinned]:
    """The configs tried for ``entry`` at (M, N): the fallback ``default_config``, then a spread
    around whole rows in registers with
    8-64 fp32 values per thread and a few programs per SM (plus software pipelining or unrolling of
    the backward's row loop); for wide rows, column chunks of 4K-32K elements (forward) or the split
    backward with 64-256 rows x 512-2048 columns per program. Small rows (N <= ``SMALL_ROWS``):
    forward tiles of 4K-16K elements; the backward over (M, 1, N) rows (``*_bwd_heads``) with steps
    of 2K-8K elements, before the resident ones."""
    op, direction = entry.split("_")
    width = 1 << max(0, n - 1).bit_length()
    # The fallback is always a candidate, first (never cut by MAX_CANDIDATES): a tuned entry must
    # beat what a GPU without a table runs. Without it a tuned table once lost to the fallback (its
    # 64 rows x 16 warps was not a candidate).
    fallback = configs.default_config(entry, n)
    out: list[Pinned] = [Pinned(fallback.kernel, fallback.config, "candidate", fallback.first_pass)]

    def add(kernel: str, first_pass: dict | None = None, **config):
        p = Pinned(f"{op}_{kernel}", config, "candidate", first_pass)
        if p.entry() not in [q.entry() for q in out]:
            out.append(p)

    if direction == "fwd":
        if width <= SMALL_ROWS:
            for elements in (4096, 8192, 16384):
                for warps in (4, 8):
                    add("fwd_kernel", block_sizes=[elements // width], reduction_loops=[None], num_warps=warps)
        elif width <= 16384:
            for elements in (max(width, 4096), 2 * max(width, 4096)):
                for per_thread in (8, 16, 32, 64):
                    warps = elements // (32 * per_thread)
                    if 4 <= warps <= 32:
                        add("fwd_kernel", block_sizes=[elements // width], reduction_loops=[None], num_warps=warps)
        else:
            if width <= 65536:
                add("fwd_kernel", block_sizes=[1], reduction_loops=[None], num_warps=32)
            for chunk in (4096, 8192, 16384, 32768):
                for per_thread in (8, 16):
                    add("fwd_kernel", block_sizes=[1], reduction_loops=[chunk], num_warps=_warps(chunk, per_thread))
        return out[:MAX_CANDIDATES]

    if width <= SMALL_ROWS:
        # Small rows (QK-norm's head_dim): the kernel over (M, 1, N) rows, whose dw accumulates per
        # row of the step (no sum across warps per step); 2K-8K elements a step, a few hundred
        # rows per program.
        for step_elements in (2048, 4096, 8192):
            step = step_elements // width
            few = max(step, _pow2_floor(m // (4 * sms)))
            for warps in (4, 8):
                add("bwd_heads", block_sizes=[few, step, 1], num_warps=warps)
        step = 4096 // width
        add("bwd_heads", block_sizes=[max(step, _pow2_floor(m // (16 * sms))), step, 1], num_warps=4)
        add("bwd_heads", block_sizes=[max(step, _pow2_floor(m // (4 * sms))), step, 1], num_warps=4, range_num_stages=[0, 2, 0])
    if width <= 16384:
        # Whole rows in registers; a few programs per SM, each walking its rows a step at a time.
        step = max(1, 2048 // width)
        few = max(step, _pow2_floor(m // ((2 if width >= 8192 else 4) * sms)))
        warps = _warps(step * width, 16)
        # range_num_stages pipelines the row loop: the next rows' loads in flight during this
        # step's reductions, the prefetch the hand-written Triton backward does by hand.
        add("bwd_resident", block_sizes=[few, step], num_warps=warps)
        add("bwd_resident", block_sizes=[2 * few, step], num_warps=warps)
        add("bwd_resident", block_sizes=[few, step], num_warps=warps, range_num_stages=[0, 2])
        add("bwd_resident", block_sizes=[few, step], num_warps=warps, range_num_stages=[0, 3])
        add("bwd_resident", block_sizes=[few, step], num_warps=warps, range_unroll_factors=[0, 2])
        add("bwd_resident", block_sizes=[2 * few, step], num_warps=warps, range_num_stages=[0, 3])
        if width < 16384:
            add("bwd_resident", block_sizes=[few, step], num_warps=_warps(step * width, 8))
            add("bwd_resident", block_sizes=[few, step], num_warps=_warps(step * width, 8), range_num_stages=[0, 3])
            add("bwd_resident", block_sizes=[few, 2 * step], num_warps=_warps(2 * step * width, 16))
            add("bwd_resident", block_sizes=[2 * few, 2 * step], num_warps=_warps(2 * step * width, 16))
            add("bwd_resident", block_sizes=[few, step], num_warps=_warps(step * width, 32))
            wide_step_warps = _warps(2 * step * width, 16)
            add("bwd_resident", block_sizes=[few, 2 * step], num_warps=wide_step_warps, range_num_stages=[0, 3])
    if width >= 16384:
        # Split: per-row sums (a row walk like the forward's), then [rows x columns] tiles.
        row_walk = {"block_sizes": [1], "reduction_loops": [None if width <= 16384 else 8192], "num_warps": 32}
        row_walk_small = {"block_sizes": [1], "reduction_loops": [4096], "num_warps": 16}
        for rows, cols, step, warps in ((128, 1024, 4, 8), (128, 2048, 2, 8), (64, 1024, 4, 8), (256, 1024, 4, 8)):
            add("bwd_split", row_walk, block_sizes=[rows, cols, step], num_warps=warps)
        if width > 16384:
            add("bwd_split", row_walk, block_sizes=[128, 1024, 8], num_warps=16)
            add("bwd_split", row_walk, block_sizes=[128, 512, 8], num_warps=8)
            add("bwd_split", row_walk_small, block_sizes=[128, 1024, 4], num_warps=8)
    return out[:MAX_CANDIDATES]


def pinned_kernels(impl, choices: dict[str, Pinned]):
    """The contract functions running ``choices`` (entry point -> Pinned, e.g. {"rmsnorm_bwd": ...},
    which add_rmsnorm's backward runs too) for the length of each call (``configs.force``), behind
    the harness's own input handling (validation, reshaping, M = 0): what ``run_check(kernels=...)``
    and ``harness.run.bench.callables`` take. ``{}``: the pinned configs."""
    from types import SimpleNamespace

    from harness.spec.loading import checked_functions

    from . import kernels

    def forcing(fn):
        def call(*args):
            before = {entry: configs.force(entry, choice) for entry, choice in choices.items()}
            try:
                return fn(*args)
            finally:
                for entry, choice in before.items():
                    configs.force(entry, choice)

        return call

    raw = SimpleNamespace(**{name: forcing(getattr(kernels, name)) for name in kernels.__all__})
    return SimpleNamespace(**checked_functions(impl, raw))


# ---------------------------------------------------------------- one job per (entry point, N)
_GPU_LOCK = None


def _init_worker(lock) -> None:
    global _GPU_LOCK
    _GPU_LOCK = lock


def _small_rows(m: int) -> int:
    """Rows for the correctness check: Triton specializes integer arguments on divisibility by 16,
    so keep M's class and the check compiles exactly the binary that the full shape runs."""
    return 64 if m % 16 == 0 else 16 + max(2, m % 16)


def _full_inputs(op: str, direction: str, m: int, n: int, dtype: str):
    from harness.spec.contract import DTYPES
    from harness.spec.inputs import make_case
    from harness.spec.shapes import Shape

    case = make_case(op, Shape((m, n)), DTYPES[dtype], "cuda")
    x, w, b, eps = case["x"], case["weight"], case["bias"], case["eps"]
    if direction == "fwd":
        return (x, w, b, eps) if op == "layernorm" else (x, w, eps)
    xf = x.float()
    if op == "rmsnorm":
        rstd = torch.rsqrt(xf.square().mean(-1) + eps)
        return (case["dy"], x, w, rstd)
    var, mean = torch.var_mean(xf, -1, correction=0)
    return (case["dy"], x, w, mean, torch.rsqrt(var + eps))


def _run_job(job: dict) -> dict:
    try:
        return _tune_job(job)
    except Exception as e:  # one broken job must not lose the others' results
        return {**job, "error": f"{type(e).__name__}: {str(e)[:300]}", "candidates": [], "best": None}


def _tune_job(job: dict) -> dict:
    import triton

    from harness import get
    from harness.run.checker import run_check
    from harness.spec.shapes import Shape

    from . import kernels

    entry, m, n, dtype = job["entry"], job["m"], job["n"], job["dtype"]
    op, direction = entry.split("_")
    configs.FEW_ROWS_RULE = False  # check on a few rows the very binary that is timed on all M
    gpu = torch.cuda.get_device_name()
    impl = get("helion")
    fn = getattr(kernels, entry)
    nbytes = TENSORS_MOVED[direction] * m * n * ELEMENT_BYTES[dtype]
    tried = []
    for cand in job["candidates"]:
        configs.use(entry, n, dtype, gpu, Pinned.from_entry(cand, "candidate"))
        t0 = time.perf_counter()
        check = run_check(impl, op, direction, Shape((_small_rows(m), n)), dtype, "cuda")
        tried.append(
            {
                **cand,
                "compile_and_check_s": round(time.perf_counter() - t0, 2),
                "check": check.status,
                "check_detail": check.summary()[:300],
            }
        )
    args = _full_inputs(op, direction, m, n, dtype)
    with _GPU_LOCK:
        for rec in tried:
            if rec["check"] != "pass":
                continue
            configs.use(entry, n, dtype, gpu, Pinned.from_entry(rec, "candidate"))
            try:
                fn(*args)
                torch.cuda.synchronize()
                ms = triton.testing.do_bench(lambda: fn(*args), warmup=25, rep=100, return_mode="median")
                rec["ms"] = round(ms, 5)
                rec["tb_s"] = round(nbytes / ms / 1e9, 3)
            except Exception as e:  # e.g. out of resources at the full size: a result, not a crash
                rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
    timed = [r for r in tried if "ms" in r]
    best = min(timed, key=lambda r: r["ms"]) if timed else None
    return {"entry": entry, "m": m, "n": n, "dtype": dtype, "bytes": nbytes, "candidates": tried, "best": best}


# ---------------------------------------------------------------- the hook
def tune(
    op: str, shapes, dtype: str, log_dir: Path, workers: int | None = None, directions=("bwd", "fwd")
) -> dict:
    """Tune ``op`` for every N in ``shapes`` (harness.spec.shapes.Shape, their M is the M timed) in
    ``dtype`` on this GPU; update configs.json; write the log to ``log_dir``. add_rmsnorm has
    nothing of its own to tune: it runs rmsnorm's kernels with rmsnorm's configs (see kernels.py)."""
    if op not in ("rmsnorm", "layernorm"):
        print(f"helion: {op} runs the configs of rmsnorm at the same N; tune rmsnorm for it")
        return {"op": op, "dtype": dtype, "jobs": []}
    if not torch.cuda.is_available():
        raise RuntimeError("helion tuning needs a CUDA GPU")
    started = time.perf_counter()
    gpu = torch.cuda.get_device_name()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    points = sorted({(s.m, s.n) for s in shapes}, key=lambda p: p[1])
    jobs = [
        {
            "entry": f"{op}_{direction}",
            "m": m,
            "n": n,
            "dtype": dtype,
            "candidates": [c.entry() for c in candidates(f"{op}_{direction}", m, n, sms)],
        }
        for direction in directions  # the backward compiles longer: start it first
        for m, n in points
    ]
    workers = workers or max(1, min(len(jobs), (os.cpu_count() or 4) - 2, 12))
    ctx = mp.get_context("spawn")
    lock = ctx.Lock()
    with ctx.Pool(workers, initializer=_init_worker, initargs=(lock,)) as pool:
        results = pool.map(_run_job, jobs, chunksize=1)
    versions = {pkg: _version(pkg) for pkg in ("helion", "triton", "torch")}
    run = {"workers": workers, "wall_s": round(time.perf_counter() - started, 1), **versions}
    return record(op, dtype, gpu, results, Path(log_dir), run)


def record(op: str, dtype: str, gpu: str, results: list[dict], log_dir: Path, run: dict) -> dict:
    """Write the winners into configs.json (merged with what is there) and the log into log_dir."""
    results = sorted(results, key=lambda r: (r["entry"], r["n"]))
    data = json.loads(configs.CONFIG_FILE.read_text()) if configs.CONFIG_FILE.exists() else {}
    data["about"] = data.get("about") or "Pinned helion.Config per GPU, entry point, dtype and N bucket: see configs.py"
    by_gpu = data.setdefault("gpus", {}).setdefault(gpu, {})
    today = datetime.date.today().isoformat()
    for r in results:
        if r["best"] is not None:
            by_gpu.setdefault(r["entry"], {}).setdefault(dtype, {})[str(r["n"])] = {
                **Pinned.from_entry(r["best"], "tuned").entry(),
                "ms": r["best"]["ms"],
                "tb_s": r["best"]["tb_s"],
                "tuned": today,
            }
    configs.CONFIG_FILE.write_text(_dump(data))
    configs.reload()

    log = {"gpu": gpu, "op": op, "dtype": dtype, **run, "jobs": results}
    log_dir.mkdir(parents=True, exist_ok=True)
    stem = f"helion-tune-{op}-{dtype}-{gpu.replace(' ', '_')}"
    (log_dir / f"{stem}.json").write_text(json.dumps(log, indent=1) + "\n")
    (log_dir / f"{stem}.md").write_text(_summary(log))
    return log


def _version(pkg: str) -> str:
    from importlib.metadata import version

    try:
        return version(pkg)
    except Exception:
        return "?"


def _dump(data: dict) -> str:
    """JSON with one config per line: readable diffs when a GPU is re-tuned."""
    lines = ["{", f'  "about": {json.dumps(data["about"])},', '  "gpus": {']
    gpus = list(data["gpus"].items())
    for gi, (gpu, entries) in enumerate(gpus):
        lines.append(f"    {json.dumps(gpu)}: {{")
        for ei, (entry, dtypes) in enumerate(sorted(entries.items())):
            lines.append(f"      {json.dumps(entry)}: {{")
            for di, (dt, buckets) in enumerate(sorted(dtypes.items())):
                lines.append(f"        {json.dumps(dt)}: {{")
                items = sorted(buckets.items(), key=lambda kv: int(kv[0]))
                for bi, (n, hit) in enumerate(items):
                    comma = "," if bi < len(items) - 1 else ""
                    lines.append(f"          {json.dumps(n)}: {json.dumps(hit)}{comma}")
                lines.append("        }" + ("," if di < len(dtypes) - 1 else ""))
            lines.append("      }" + ("," if ei < len(entries) - 1 else ""))
        lines.append("    }" + ("," if gi < len(gpus) - 1 else ""))
    lines.append("  }," if "realigned" in data else "  }")
    if "realigned" in data:  # the realigned kernels' table (configs.py): GPU -> op_direction -> bucket
        lines.append('  "realigned": {')
        gpus = list(data["realigned"].items())
        for gi, (gpu, entries) in enumerate(gpus):
            lines.append(f"    {json.dumps(gpu)}: {{")
            for ei, (entry, buckets) in enumerate(sorted(entries.items())):
                lines.append(f"      {json.dumps(entry)}: {{")
                items = sorted(buckets.items(), key=lambda kv: int(kv[0]))
                for bi, (n, hit) in enumerate(items):
                    lines.append(f"        {json.dumps(n)}: {json.dumps(hit)}" + ("," if bi < len(items) - 1 else ""))
                lines.append("      }" + ("," if ei < len(entries) - 1 else ""))
            lines.append("    }" + ("," if gi < len(gpus) - 1 else ""))
        lines.append("  }")
    lines += ["}", ""]
    text = "\n".join(lines)
    assert json.loads(text) == data
    return text


def _summary(log: dict) -> str:
    out = [
        f"# Helion tuning: {log['op']} {log['dtype']} on {log['gpu']}",
        "",
        f"helion {log.get('helion')}, triton {log.get('triton')}, torch {log.get('torch')}; "
        f"{log.get('workers')} worker processes; wall time {log.get('wall_s')} s. "
        "Times are medians of triton.testing.do_bench on the "
        "full shape; TB/s counts x and y (fwd) or x, dy and dx (bwd).",
        "",
        "| entry | M x N | candidate | check | compile+check s | ms | TB/s | best |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for job in log["jobs"]:
        for c in job["candidates"]:
            ms = c.get("ms", "")
            tb = c.get("tb_s", c.get("error", ""))
            star = "**yes**" if c == job["best"] else ""
            cfg = ", ".join(f"{k}={v}" for k, v in c["config"].items())
            if c.get("first_pass"):
                cfg += "; row sums: " + ", ".join(f"{k}={v}" for k, v in c["first_pass"].items())
            out.append(
                f"| {job['entry']} | {job['m']}x{job['n']} | {c['kernel']}: {cfg} | {c['check']} | "
                f"{c['compile_and_check_s']} | {ms} | {tb} | {star} |"
            )
    return "\n".join(out) + "\n"
