"""Two benchmark folders of the same selection, point by point: a serial run (one GPU) against a
fanned-out one (``--gpus N``), with their wall times, the fractions of copy bandwidth compared
against the noise. tools/scale_out.sh calls it; docs/scale-out.md says what it is for.

    python tools/compare_runs.py SERIAL FANNED [--noise SERIAL2] [--wall S_SERIAL S_FANNED] [--json FILE]

The noise of a point: with ``--noise`` (a second serial run of the same selection), how far that
run's fraction is from the first's (run-to-run); without it, the larger spread of the two runs'
trial medians ((max - min) / min, within a run). A point agrees when its fractions differ by no
more than its noise (and 1%, a floor for points whose trials happened to agree closely).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from harness.results.store import load_results, point_key

FLOOR = 0.01


def _points(path: Path) -> dict:
    return {point_key(r): r for r in load_results(Path(path) / "results.jsonl")}


def _q(xs: list[float], q: float) -> float | None:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] if xs else None


def compare(serial: Path, fanned: Path, noise: Path | None = None, wall: tuple[float, float] | None = None) -> dict:
    a, b = _points(serial), _points(fanned)
    a2 = _points(noise) if noise else {}
    both = [k for k in a if k in b]
    timed = [k for k in both if a[k].get("frac_roofline") and b[k].get("frac_roofline")]
    diffs, noises, agree, worst = [], [], 0, []
    for k in timed:
        fa, fb = a[k]["frac_roofline"], b[k]["frac_roofline"]
        d = fb / fa - 1
        if k in a2 and a2[k].get("frac_roofline"):
            n = abs(a2[k]["frac_roofline"] / fa - 1)
        else:
            n = max(a[k].get("spread") or 0.0, b[k].get("spread") or 0.0)
        diffs.append(abs(d))
        noises.append(n)
        agree += abs(d) <= max(n, FLOOR)
        worst.append((abs(d), n, k, fa, fb))
    worst.sort(reverse=True)
    out = {
        "serial": str(serial), "fanned": str(fanned), "noise_from": str(noise) if noise else "trial spread within each run",
        "points": {"serial": len(a), "fanned": len(b), "both": len(both), "timed_in_both": len(timed),
                   "only_serial": len(set(a) - set(b)), "only_fanned": len(set(b) - set(a)),
                   "status_differs": sum(a[k]["status"] != b[k]["status"] for k in both)},
        "abs_rel_diff": {"median": statistics.median(diffs) if diffs else None, "p90": _q(diffs, 0.9), "max": max(diffs, default=None)},
        "noise": {"median": statistics.median(noises) if noises else None, "p90": _q(noises, 0.9)},
        "within_noise": agree,
        "worst": [{"point": list(k), "serial": fa, "fanned": fb, "abs_rel_diff": d, "noise": n} for d, n, k, fa, fb in worst[:10]],
    }  # fmt: skip
    if wall:
        out["wall_s"] = {"serial": wall[0], "fanned": wall[1], "ratio": wall[1] / wall[0] if wall[0] else None}
    return out


def markdown(c: dict) -> str:
    p, d, n = c["points"], c["abs_rel_diff"], c["noise"]

    def pct(x):
        return "–" if x is None else f"{100 * x:.2f}%"

    lines = [f"Serial `{c['serial']}` against fanned-out `{c['fanned']}`."]
    if "wall_s" in c:
        w = c["wall_s"]
        lines.append(f"Wall time: {w['serial']:.0f} s serial, {w['fanned']:.0f} s fanned out: **{w['ratio']:.3f}x**.")
    lines += [
        (f"Points: {p['both']} in both ({p['timed_in_both']} timed in both; {p['only_serial']} only serial, {p['only_fanned']} only fanned out; "
         f"{p['status_differs']} with another status)."),
        (f"Fraction of copy bandwidth, |fanned / serial - 1|: median {pct(d['median'])}, p90 {pct(d['p90'])}, max {pct(d['max'])}; "
         f"noise ({c['noise_from']}): median {pct(n['median'])}, p90 {pct(n['p90'])}; "
         f"**{c['within_noise']} of {p['timed_in_both']}** within their noise (floor {pct(FLOOR)})."),
    ]  # fmt: skip
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("serial")
    ap.add_argument("fanned")
    ap.add_argument("--noise", help="a second serial run of the same selection: the run-to-run noise")
    ap.add_argument("--wall", nargs=2, type=float, metavar=("SERIAL_S", "FANNED_S"), help="the two runs' wall seconds")
    ap.add_argument("--json", help="write the comparison here")
    a = ap.parse_args(argv)
    c = compare(Path(a.serial), Path(a.fanned), Path(a.noise) if a.noise else None, tuple(a.wall) if a.wall else None)
    if a.json:
        Path(a.json).write_text(json.dumps(c, indent=1))
    print(markdown(c))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
