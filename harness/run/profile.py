"""`normbench profile` (and `normbench bench --profile`): Nsight Compute counters behind the
roofline fractions of a benchmark folder.

The question a fraction of copy bandwidth leaves open is *why*: does the kernel move more bytes
than the bytes model (x read twice because a row did not fit on chip, a partial buffer, spills to
local memory), or the right bytes too slowly (occupancy, latency, a tail)? The counters answer it:

    dram_over_model = (DRAM bytes read + written, all kernels of one call) / bytes model (x + y, or x + dy + dx)
    dram_tbps       = those DRAM bytes / the kernels' summed duration

A point with ``dram_over_model`` near 1.0 reads each tensor once; 1.5 for a backward means x and dy
were read twice. Each point is measured once more in a child process under
``ncu --clock-control none`` (the clocks are left as found; ncu replays the kernel per metric group
with caches flushed), profiling only the region between cudaProfilerStart/Stop around one call.
Points are taken from the folder's ``results.jsonl`` (sweep, passed): by default the best
implementation of each DSL, externals included, at the sweep shapes with the given N. Results are
merged into ``profile.json`` (keyed by implementation, op, direction, shape, dtype) and shown by
``normbench report`` as a table.
"""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import subprocess
import sys
from fnmatch import fnmatch
from pathlib import Path

from harness.results import rank
from harness.results.counters import PROFILE_FILE, line
from harness.results.store import load_results

DEFAULT_NS = (4096, 16384, 262144)
# name in profile.json -> ncu metric. Units are asked for in base units (bytes, ns) so no scaling
# ("Mbyte", "usecond") has to be undone.
METRICS = {
    "time_ns": "gpu__time_duration.sum",
    "dram_read_bytes": "dram__bytes_read.sum",
    "dram_write_bytes": "dram__bytes_write.sum",
    "dram_pct_of_peak": "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "l2_hit_pct": "lts__t_sector_hit_rate.pct",
    "warps_active_pct": "sm__warps_active.avg.pct_of_peak_sustained_active",
    "registers_per_thread": "launch__registers_per_thread",
}


def run_one(impl_name: str, op: str, direction: str, shape_label: str, dtype: str) -> None:
    """Child process body: warm up (JIT, autotune caches, allocator), then one profiled call."""
    import torch

    from harness.registry import get
    from harness.run.bench import callables
    from harness.spec.contract import DTYPES
    from harness.spec.inputs import make_case
    from harness.spec.shapes import parse_shape

    k = get(impl_name).kernels("cuda")
    case = make_case(op, parse_shape(shape_label), DTYPES[dtype], "cuda")
    fn = callables(k, op, direction, case)
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def find_ncu() -> str | None:
    found = shutil.which("ncu")
    if found:
        return found
    installed = sorted(Path("/opt/nvidia").glob("nsight-compute/*/ncu")) + sorted(Path("/usr/local").glob("cuda*/bin/ncu"))
    return str(installed[-1]) if installed else None


def parse_ncu_csv(text: str) -> list[dict]:
    """One dict per profiled kernel launch from ``ncu --csv --print-units base`` output (its
    'details' page: one row per kernel x metric, other lines are ncu's and the program's chatter)."""
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    by_metric = {v: k for k, v in METRICS.items()}
    kernels: dict = {}
    for row in csv.DictReader(io.StringIO("\n".join(lines))):
        kid = (row.get("ID"), row.get("Kernel Name"))
        entry = kernels.setdefault(kid, {"kernel": (row.get("Kernel Name") or "")[:120], "grid": row.get("Grid Size"), "block": row.get("Block Size")})
        name = by_metric.get(row.get("Metric Name", ""))
        if name is None:
            continue
        try:
            entry[name] = float(row["Metric Value"].replace(",", ""))
        except (KeyError, ValueError):
            pass
    return list(kernels.values())


def summarize(kernels: list[dict], bytes_model: int) -> dict:
    """Per-point totals: DRAM bytes against the bytes model, duration-weighted percentages."""
    time_ns = sum(k.get("time_ns", 0.0) for k in kernels)
    dram = sum(k.get("dram_read_bytes", 0.0) + k.get("dram_write_bytes", 0.0) for k in kernels)
    out = {
        "kernels": len(kernels),
        "time_us": time_ns / 1e3 if time_ns else None,
        "dram_bytes": dram,
        "dram_over_model": dram / bytes_model if bytes_model else None,
        "dram_tbps": dram / time_ns / 1e3 if time_ns else None,
    }
    for name in ("dram_pct_of_peak", "l2_hit_pct", "warps_active_pct"):
        weighted = [(k[name], k.get("time_ns", 0.0)) for k in kernels if name in k]
        total = sum(t for _, t in weighted)
        out[name] = sum(v * t for v, t in weighted) / total if total else None
    regs = [k["registers_per_thread"] for k in kernels if "registers_per_thread" in k]
    out["max_registers_per_thread"] = max(regs) if regs else None
    return out


def select_points(rows: list[dict], ns, impl: str | None = None, ops=None, directions=None, dtype: str = "bf16") -> list[dict]:
    """The benchmark rows to profile: passed sweep points at the given N, of the implementations
    matching ``impl`` (comma-separated globs over names or DSLs), or else of the best
    implementation of each DSL for that op and direction."""
    ok = [r for r in rows if r["shape_set"] == "sweep" and r["status"] == "ok" and r["dtype"] == dtype and r["N"] in ns]
    chosen = []
    for op, direction, sset, dt in rank.sections(rows):
        if sset != "sweep" or dt != dtype or (ops and op not in ops) or (directions and direction not in directions):
            continue
        if impl:
            globs = [g.strip() for g in impl.split(",") if g.strip()]
            names = {r["impl"] for r in ok if any(fnmatch(r["impl"], g) or fnmatch(str(r.get("dsl", "")), g) for g in globs)}
        else:
            names = {b.impl for b in rank.by_dsl(rows, op, direction, sset, dtype).values()}
        chosen += sorted((r for r in ok if r["op"] == op and r["direction"] == direction and r["impl"] in names), key=lambda r: (r["N"], r["impl"]))
    return chosen


def _key(p: dict) -> tuple:
    return (p["impl"], p["op"], p["direction"], p["shape"], p["dtype"])


def profile_point(ncu: str, row: dict, timeout_s: float = 300) -> dict:
    entry = {k: row[k] for k in ("impl", "dsl", "op", "direction", "shape", "N", "dtype", "tbps", "frac_roofline", "bytes_main", "bytes_extra")}
    child = f"from harness.run.profile import run_one; run_one({row['impl']!r}, {row['op']!r}, {row['direction']!r}, {row['shape']!r}, {row['dtype']!r})"
    cmd = [ncu, "--clock-control", "none", "--profile-from-start", "off", "--csv", "--print-units", "base",
           "--metrics", ",".join(METRICS.values()), sys.executable, "-c", child]  # fmt: skip
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    except subprocess.TimeoutExpired:
        return {**entry, "error": f"ncu did not finish in {timeout_s:.0f} s"}
    except OSError as e:
        return {**entry, "error": f"could not start ncu: {e}"}
    kernels = parse_ncu_csv(proc.stdout)
    if not kernels:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {**entry, "error": f"no kernel profiled (exit {proc.returncode}): " + " | ".join(tail)[-300:]}
    return {**entry, **summarize(kernels, row["bytes_main"]), "per_kernel": kernels}


def profile(report_dir: Path, ns=DEFAULT_NS, impl: str | None = None, ops=None, directions=None, dtype: str = "bf16",
            timeout_s: float = 300, rows: list[dict] | None = None) -> dict:  # fmt: skip
    """Profile the selected points of ``report_dir`` (its ``rows`` when the caller has them) and
    merge them into its profile.json."""
    from rich.progress import Progress

    report_dir = Path(report_dir)
    out_path = report_dir / PROFILE_FILE
    rows = load_results(report_dir / "results.jsonl") if rows is None else rows
    if not rows:
        raise ValueError(f"{report_dir} has no results.jsonl to profile (run `normbench bench` first)")
    points = select_points(rows, set(ns), impl, ops, directions, dtype)
    if not points:
        raise ValueError(f"no passed sweep point in {report_dir} matches N in {sorted(ns)}" + (f" and --impl {impl}" if impl else ""))
    ncu = find_ncu()
    if ncu is None:
        raise ValueError("ncu (Nsight Compute) not found on this machine: install it or put it on PATH")
    old = json.loads(out_path.read_text()) if out_path.exists() else {}
    merged = {_key(p): p for p in old.get("points", [])}
    def save() -> dict:  # after every point, so a run stopped half-way keeps what it measured
        result = {"ncu": ncu, "metrics": METRICS, "points": sorted(merged.values(), key=lambda p: (p["op"], p["direction"], p["N"], p["impl"]))}
        out_path.write_text(json.dumps(result, indent=1) + "\n")
        return result

    with Progress(transient=True) as bar:
        task = bar.add_task("ncu", total=len(points))
        for row in points:
            bar.update(task, description=f"ncu {row['impl']} {row['op']} {row['direction']} {row['shape']}")
            entry = profile_point(ncu, row, timeout_s)
            merged[_key(entry)] = entry
            result = save()
            bar.advance(task)
            bar.console.print(line(entry))
    return result
