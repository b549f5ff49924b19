"""The counters table of a report: what ``normbench profile`` measured (``profile.json``), one line
per point and as Markdown."""

from __future__ import annotations

import json
from pathlib import Path

PROFILE_FILE = "profile.json"


def fmt(x, spec="{:.2f}"):
    """``x`` formatted, or an en dash where it is missing."""
    return "–" if x is None else spec.format(x)


def line(p: dict) -> str:
    head = f"{p['impl']} {p['op']} {p['direction']} {p['shape']}"
    if p.get("error"):
        return f"{head}: {p['error']}"
    return (f"{head}: {p['kernels']} kernel(s), DRAM {fmt(p['dram_over_model'], '{:.2f}')}x the bytes model at "
            f"{fmt(p['dram_tbps'], '{:.2f}')} TB/s, L2 hit {fmt(p['l2_hit_pct'], '{:.0f}')}%, "
            f"warps active {fmt(p['warps_active_pct'], '{:.0f}')}%, regs {fmt(p['max_registers_per_thread'], '{:.0f}')}")


def markdown(report_dir: Path) -> list[str]:
    """The report's counter table, or nothing when the folder has no profile.json."""
    path = Path(report_dir) / PROFILE_FILE
    if not path.exists():
        return []
    points = json.loads(path.read_text()).get("points", [])
    if not points:
        return []
    out = ["## Hardware counters (Nsight Compute, one call per point, `normbench profile`)", "",
           "DRAM / model = DRAM bytes read + written by all kernels of one call over the bytes model "
           "(fwd x + y, bwd x + dy + dx): 1.00 means every tensor moved once. Timed TB/s is the benchmark's.", "",
           "| op | dir | shape | implementation | kernels | timed TB/s | DRAM / model | DRAM TB/s | L2 hit | warps active | regs/thread |",
           "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for p in points:
        if p.get("error"):
            out.append(f"| {p['op']} | {p['direction']} | {p['shape']} | {p['impl']} | – | {fmt(p.get('tbps'), '{:.2f}')} | {p['error'][:80]} | | | | |")
            continue
        out.append(
            f"| {p['op']} | {p['direction']} | {p['shape']} | {p['impl']} | {p['kernels']} | {fmt(p.get('tbps'), '{:.2f}')} | "
            f"{fmt(p['dram_over_model'], '{:.2f}')} | {fmt(p['dram_tbps'], '{:.2f}')} | {fmt(p['l2_hit_pct'], '{:.0f}%')} | "
            f"{fmt(p['warps_active_pct'], '{:.0f}%')} | {fmt(p['max_registers_per_thread'], '{:.0f}')} |"
        )
    return out + [""]
