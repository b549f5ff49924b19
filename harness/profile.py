"""`normbench bench --profile`: Nsight Compute counters behind the roofline fractions.

For each op x direction, the best implementation of each DSL at one sweep shape is run once more in
a child process under ``ncu --clock-control none`` (the clocks are left as found), profiling only
the region between cudaProfilerStart/Stop. DRAM throughput (% of peak) and achieved occupancy are
recorded per kernel and, weighted by kernel duration, per point into ``profile.json``.
"""

from __future__ import annotations

import csv
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

from . import rank
from .bench import load_results

PROFILE_N = 4096
METRICS = (
    "gpu__time_duration.sum",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "sm__warps_active.avg.pct_of_peak_sustained_active",
)


def run_one(impl_name: str, op: str, direction: str, shape_label: str, dtype: str) -> None:
    """Child process body: warm up, then one profiled call."""
    import torch

    from . import autograd
    from .contract import DTYPES
    from .inputs import make_case
    from .registry import get
    from .shapes import parse_shape

    k = get(impl_name).kernels("cuda")
    case = make_case(op, parse_shape(shape_label), DTYPES[dtype], "cuda")
    fn = autograd.callables(k, op, direction, case)
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def _parse(csv_text: str) -> list[dict]:
    lines = [ln for ln in csv_text.splitlines() if ln.startswith('"')]
    kernels: dict = {}
    for row in csv.DictReader(io.StringIO("\n".join(lines))):
        kid = (row.get("ID"), row.get("Kernel Name"))
        entry = kernels.setdefault(kid, {"kernel": row.get("Kernel Name", "")[:120]})
        try:
            entry[row["Metric Name"]] = float(row["Metric Value"].replace(",", ""))
        except (KeyError, ValueError):
            pass
    return list(kernels.values())


def profile_best(report_dir: Path, n: int = PROFILE_N) -> dict:
    ncu = shutil.which("ncu") or next(iter(Path("/opt/nvidia").glob("nsight-compute/*/ncu")), None)
    out_path = Path(report_dir) / "profile.json"
    rows = load_results(Path(report_dir) / "results.jsonl")
    if ncu is None:
        result = {"error": "ncu (Nsight Compute) not found on this machine"}
        out_path.write_text(json.dumps(result, indent=2))
        print(result["error"])
        return result
    result = {"ncu": str(ncu), "points": []}
    for op, direction, sset, dtype in rank.sections(rows):
        if sset != "sweep":
            continue
        for dsl, best in rank.by_dsl(rows, op, direction, sset, dtype).items():
            pt = next((r for r in rows if r["impl"] == best.impl and r["op"] == op and r["direction"] == direction and r["N"] == n and r["status"] == "ok" and r["dtype"] == dtype), None)
            if pt is None:
                continue
            cmd = [str(ncu), "--clock-control", "none", "--profile-from-start", "off", "--csv", "--metrics", ",".join(METRICS),
                   sys.executable, "-c", f"from harness.profile import run_one; run_one({best.impl!r}, {op!r}, {direction!r}, {pt['shape']!r}, {dtype!r})"]  # fmt: skip
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
                kernels = _parse(proc.stdout)
                total = sum(k.get(METRICS[0], 0.0) for k in kernels) or 1.0
                entry = {"impl": best.impl, "dsl": dsl, "op": op, "direction": direction, "shape": pt["shape"], "tbps": pt["tbps"], "kernels": kernels}
                for m, name in ((METRICS[1], "dram_pct"), (METRICS[2], "occupancy_pct")):
                    entry[name] = sum(k.get(m, 0.0) * k.get(METRICS[0], 0.0) for k in kernels) / total if kernels else None
                if not kernels:
                    entry["error"] = (proc.stderr or proc.stdout)[-400:]
            except Exception as e:
                entry = {"impl": best.impl, "op": op, "direction": direction, "error": f"{type(e).__name__}: {e}"}
            result["points"].append(entry)
            print(f"profiled {best.impl} {op} {direction} {pt['shape']}: DRAM {entry.get('dram_pct')}% occupancy {entry.get('occupancy_pct')}%")
    out_path.write_text(json.dumps(result, indent=2))
    return result
