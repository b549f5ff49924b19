"""Reports: Markdown, CSV and PNG plots from a benchmark folder (results.jsonl + meta.json). The
leaderboard built from them is ``harness.results.generated``'s."""

from __future__ import annotations

import csv
from pathlib import Path

from harness.results import rank
from harness.results.counters import fmt
from harness.results.counters import markdown as counters
from harness.results.store import PROFILE_FILE, load_results, read_meta, read_profile
from harness.spec.errors import plain_text

CSV_FIELDS = (
    "impl", "dsl", "external", "op", "direction", "shape_set", "shape", "M", "N", "dtype", "weights", "status", "check",
    "reason", "compile_s", "ms", "ms_p95", "spread", "noisy", "graph", "timing", "bytes_main", "bytes_extra", "tbps", "frac_roofline", "config",
    "gpu_id",
)  # fmt: skip


def load(report_dir: Path) -> tuple[dict, list[dict]]:
    """meta.json (``{}`` when absent) and the points of a benchmark folder, its profile.json (when
    present) checked too; a one-line ValueError naming the file and line for anything else."""
    report_dir = Path(report_dir)
    if not report_dir.is_dir():
        raise ValueError(f"{report_dir}: no such benchmark folder" if not report_dir.exists() else f"{report_dir}: not a folder")
    res = report_dir / "results.jsonl"
    if not res.exists():
        raise ValueError(f"no results.jsonl in {report_dir}")
    meta_path = report_dir / "meta.json"
    meta = read_meta(meta_path) if meta_path.exists() else {}
    rows = load_results(res)
    _check_profile(report_dir)
    return meta, rows


def _check_profile(report_dir: Path) -> None:
    """The counters table reads profile.json as it is: it must be what `profile` writes."""
    if (Path(report_dir) / PROFILE_FILE).exists():
        read_profile(Path(report_dir) / PROFILE_FILE)


def _name(r: rank.Ranked) -> str:
    return f"{r.impl} (external)" if r.external else r.impl


def markdown(meta: dict, rows: list[dict], rel_plots: str | None = "") -> str:
    roof = meta.get("copy_bandwidth_tbps")
    v = meta.get("versions") or {}
    lines = [
        f"# normbench results — {meta.get('gpu', '?')}",
        "",
        _copy_line(meta, roof) + " Bytes model: fwd = x + y, bwd = x + dy + dx.",
        "",
        f"GPU {meta.get('gpu')} (driver {meta.get('driver')}, CUDA {meta.get('cuda')}), torch {meta.get('torch')}, "
        + ", ".join(f"{k} {val}" for k, val in v.items() if val)
        + ("; commits per run below." if any(r.get("git_commit") for r in meta.get("runs", [])) else f"; commit `{meta.get('git_commit')}`."),
        "",
        "Runs that wrote this folder (each point in `results.jsonl` names its run where recorded):",
        "",
        *_run_lines(meta),
        "",
    ]
    if meta.get("note"):
        lines += [f"Note: {meta['note']}", ""]
    for op, direction, shape_set, dtype in rank.sections(rows):
        board = rank.leaderboard(rows, op, direction, shape_set, dtype)
        if not board:
            continue
        lines += [f"## {op} {direction} — {shape_set}, {dtype}", ""]
        lines += ["| rank | implementation | DSL | geomean frac. of copy BW | geomean TB/s | geomean µs | coverage | speedup vs eager | noisy |", "|---:|---|---|---:|---:|---:|---:|---:|---:|"]
        for i, r in enumerate(board, 1):
            pct = fmt(r.score * 100 if r.score else None, "{:.1f}%")
            lines.append(f"| {i} | {_name(r)} | {r.dsl} | {pct} | {fmt(r.tbps)} | {fmt(r.us, '{:.1f}')} | {r.coverage} | {fmt(r.speedup, '{:.2f}x')} | {r.noisy} |")
        lines.append("")
        if any(r.partial for r in board):
            lines += [f"(partial: passed on fewer than the section's {board[0].shapes} shapes; ranked below every implementation that passed all of them.)", ""]
        lines += _shape_table(rows, op, direction, shape_set, dtype)
        if rel_plots is not None and shape_set in PLOTTED:
            lines += [f"![{op} {direction}]({rel_plots}plot-{op}-{direction}-{dtype}.png)", ""]
        failed = [r for r in rank.section_rows(rows, op, direction, shape_set, dtype) if r["status"] in ("failed", "error")]
        if failed:
            lines += ["Failed or crashed points (never ranked):", ""]
            lines += [f"- {r['impl']} {r['shape']}: {r['status']} — {plain_text(r.get('check') or r.get('reason') or '')[:200]}"
                      for r in failed]
            lines.append("")
    lines += _dsl_section(rows)
    lines += _llm_section(rows)
    lines += _config_section(rows)
    return "\n".join(lines) + "\n"


def _config_section(rows) -> list[str]:
    """Which points ran on configs tuned on this GPU, borrowed from another, or from a heuristic
    (implementations that pin launch configs per GPU record it; points written before they did
    say nothing)."""
    counts: dict[tuple[str, str], int] = {}
    for r in rows:
        if r.get("status") != "ok" or not r.get("config"):
            continue
        for part in str(r["config"]).split("; "):
            how = part.split(": ", 1)[-1]
            counts[(r["impl"], how)] = counts.get((r["impl"], how), 0) + 1
    if not counts:
        return []
    out = ["## Where the launch configs came from", "",
           "Implementations that pin launch configs per GPU record, per point and direction, whether the config was tuned on this GPU, borrowed from a tuned GPU of the same compute capability, or a heuristic's (`harness/tuned.py`).", "",
           "| implementation | configs | points × directions |", "|---|---|---:|"]  # fmt: skip
    out += [f"| {impl} | {how} | {n} |" for (impl, how), n in sorted(counts.items())]
    return out + [""]


def _llm_section(rows) -> list[str]:
    """LLM-generated kernels: the verbatim first shot next to the after-fix version, per sample."""
    from harness.registry import all_implementations

    names = sorted({r["impl"] for r in rows if str(r.get("dsl", "")).startswith("llm-")})
    if not names:
        return []
    reg = all_implementations()
    out = ["## LLM-generated kernels: first shot vs after fixes (sweep, bf16)", "",
           "| implementation | variant | fixes | prompt | fwd: passed, geomean frac. | bwd: passed, geomean frac. |",
           "|---|---|---:|---|---:|---:|"]  # fmt: skip
    for name in names:
        impl = reg.get(name)
        meta = impl.meta if impl else {}
        cells = []
        for d in ("fwd", "bwd"):
            sel = [r for r in rows if r["impl"] == name and r["direction"] == d and r["shape_set"] == "sweep" and rank.precision(r) == "bf16"]
            ok = [r for r in sel if r["status"] == "ok"]
            tried = [r for r in sel if r["status"] != "skip"]
            g = rank.geomean(r.get("frac_roofline") for r in ok)
            cells.append(f"{len(ok)}/{len(tried)}, {fmt(g * 100 if g else None, '{:.1f}%')}")
        prompt = f"`{impl.prompt}`" if impl and impl.prompt else "–"
        out.append(f"| {name} | {meta.get('variant', '?')} | {len(meta.get('fixes', []))} | {prompt} | {cells[0]} | {cells[1]} |")
    return out + ["", "A sample with no fixes is registered once, as its verbatim first shot.", ""]


def _run_lines(meta: dict) -> list[str]:
    out = []
    for i, r in enumerate(meta.get("runs", [])):
        copy = (r.get("copy_bandwidth") or {}).get("tbps")
        gpu = f"GPU {r['gpu_id']}" + (f", shard {r['shard']}" if r.get("shard") else "") if r.get("gpu_id") else None
        facts = [f"commit `{r['git_commit']}`" if r.get("git_commit") else None, f"copy {copy:.2f} TB/s" if copy else None, gpu, r.get("started")]
        out.append(f"{i}. `{r.get('command') or '?'}` ({', '.join(f for f in facts if f)})")
    return out


def _copy_line(meta: dict, roof) -> str:
    runs = [r["copy_bandwidth"]["tbps"] for r in meta.get("runs", []) if (r.get("copy_bandwidth") or {}).get("tbps")]
    if len(runs) > 1:
        each = ", ".join(f"{t:.2f}" for t in runs)
        return (f"Copy bandwidth (device-to-device copy, bytes read + written), measured at the start of each of the "
                f"{len(runs)} runs that wrote this report: **{each} TB/s**; every point's fraction is of its own run's.")
    return (f"Copy bandwidth measured in this run: **{fmt(roof)} TB/s** (device-to-device copy, bytes read + written); "
            "every fraction below is of that number.")


def _shape_table(rows, op, direction, shape_set, dtype) -> list[str]:
    sel = rank.section_rows(rows, op, direction, shape_set, dtype)
    impls = [r.impl for r in rank.leaderboard(rows, op, direction, shape_set, dtype)]
    shapes = sorted({(r["N"], r["M"], r["shape"]) for r in sel})
    # launch-bound decode shapes read better as time per call than as bandwidth
    latency = shape_set == "decode"
    head = "| shape (MxN) | " + " | ".join(impls) + " | winner |"
    what = "µs per call (CUDA-graph replay)" if latency else "TB/s"
    out = [f"{what} per shape (bold: fastest; ✗ failed check; ! error; – not run):", "", head, "|---|" + "---:|" * (len(impls) + 1)]
    win = {w["shape"]: w["best"]["impl"] for w in rank.winners(rows, op, direction, shape_set, dtype)}
    for _, _, label in shapes:
        cells = []
        for name in impls:
            pt = next((r for r in sel if r["impl"] == name and r["shape"] == label), None)
            if pt is None or pt["status"] == "skip":
                cells.append("–")
            elif pt["status"] == "failed":
                cells.append("✗")
            elif pt["status"] == "error":
                cells.append("!")
            else:
                txt = (f"{pt['ms'] * 1e3:.1f}" if latency else f"{pt['tbps']:.2f}") + ("~" if pt.get("noisy") else "")
                cells.append(f"**{txt}**" if win.get(label) == name else txt)
        out.append(f"| {label} | " + " | ".join(cells) + f" | {win.get(label, '–')} |")
    out += ["", "(~ marks a noisy point: its 3 trials disagree by more than 5%.)", ""]
    return out


def _dsl_section(rows) -> list[str]:
    combos = [(o, d) for o, d, s, t in rank.sections(rows) if s == "sweep" and t == "bf16"]
    if not combos:
        return []
    dsls = sorted({r.dsl for o, d in combos for r in rank.by_dsl(rows, o, d).values()})
    out = ["## Best of each DSL (sweep, bf16): geomean fraction of copy bandwidth", "", "| op / direction | " + " | ".join(dsls) + " |", "|---|" + "---:|" * len(dsls)]
    for o, d in combos:
        best, shapes = rank.by_dsl(rows, o, d), rank.shapes_in(rows, o, d)

        def cell(b):
            partial = f", {b.attempted} of {shapes} shapes" if b.attempted < shapes else ""
            return f"{b.score * 100:.1f}% ({b.impl}{partial})"

        cells = [cell(best[x]) if x in best else "–" for x in dsls]
        out.append(f"| {o} {d} | " + " | ".join(cells) + " |")
    return out + [""]


def write_csv(rows: list[dict], path: Path):
    with path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow(r)


# Shape sets drawn as bandwidth against N: the sweep as lines, and the points between its N and
# the small rows below it (the same bytes per point) as hollow markers on the same axes, so a kernel
# tuned to the sweep's eleven N shows where it falls off between and below them.
PLOTTED = ("sweep", "between", "small")
HOLLOW = {"between": "D", "small": "s"}

# Distinct colours (tab10, then the most distinct of matplotlib's other qualitative maps, none
# near white or black), one per implementation in the order of ``colours``.
PALETTE = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf",
    "#fdae6b", "#f0027f", "#393b79", "#6baed6", "#bcbddc", "#d6616b", "#7fc97f", "#1b9e77", "#c49c94", "#a6761d",
    "#66a61e", "#6a3d9a", "#8ca252", "#637939", "#e6ab02", "#d95f02", "#9e9ac8", "#fb9a99", "#a55194", "#fd8d3c",
)  # fmt: skip
FAILED_LABEL = "x: failed its check or raised (drawn at 0)"


def colours(names=()) -> dict[str, str]:
    """One colour per implementation, the same in every plot of every report: the registry's names
    in sorted order take the palette in turn, then any other name in ``names`` (rows of an
    implementation no longer registered) in sorted order; past the palette, evenly spaced hues."""
    import colorsys

    from harness.registry import all_implementations

    known = sorted(all_implementations())
    order = known + sorted(set(names) - set(known))

    def colour(i: int) -> str:
        if i < len(PALETTE):
            return PALETTE[i]
        k = i - len(PALETTE)
        r, g, b = colorsys.hsv_to_rgb((k * 0.618033988749895) % 1.0, 0.55 + 0.4 * (k % 2), 0.55 + 0.1 * (k % 3))
        return f"#{round(r * 255):02x}{round(g * 255):02x}{round(b * 255):02x}"

    return {name: colour(i) for i, name in enumerate(order)}


def _text(s) -> str:
    """A label as matplotlib draws it verbatim ('$' would start mathtext)."""
    return str(s).replace("$", r"\$")


def figure(meta: dict, rows: list[dict], op: str, direction: str, dtype: str, colors: dict | None = None):
    """The plot of one op, direction and dtype (a matplotlib Figure, or None when it has no point
    that was attempted): passed points as lines (sweep), hollow diamonds (between) and squares (small), failed and
    crashed ones as an x at 0 in their implementation's colour."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    roof = meta.get("copy_bandwidth_tbps")
    keys = {(op, direction, s, dtype) for s in PLOTTED}
    mine = [r for r in rows if rank.section_of(r) in keys and r["status"] != "skip"]
    if not mine:
        return None
    colors = colors or colours(r["impl"] for r in rows)
    fig, ax = plt.subplots(figsize=(12, 5.5))
    names = sorted({r["impl"] for r in mine})
    for name in names:
        pts = [r for r in mine if r["impl"] == name]
        ext = any(r.get("external") for r in pts)
        label = _text(f"{name}{' (external)' if ext else ''}")
        ok = sorted((r["N"], r["tbps"]) for r in pts if r["status"] == "ok" and r["shape_set"] == "sweep")
        if ok:
            ax.plot([p[0] for p in ok], [p[1] for p in ok], marker="o", ls="--" if ext else "-", color=colors[name], label=label)
            label = None  # one legend entry per implementation
        for shape_set, marker in HOLLOW.items():
            off = sorted((r["N"], r["tbps"]) for r in pts if r["status"] == "ok" and r["shape_set"] == shape_set)
            if off:
                ax.scatter([p[0] for p in off], [p[1] for p in off], marker=marker, facecolors="none", edgecolors=[colors[name]], label=label)
                label = None
        bad = sorted(r["N"] for r in pts if r["status"] in ("failed", "error"))
        if bad:
            # at the floor, unclipped: a point that failed would otherwise leave no mark at all
            ax.scatter(bad, [0] * len(bad), marker="x", color=colors[name], s=60, clip_on=False, zorder=3, label=label, gid=f"failed:{name}")
    if any(r["status"] in ("failed", "error") for r in mine):
        ax.plot([], [], ls="none", marker="x", color="k", label=FAILED_LABEL)
    if roof:
        ax.axhline(roof, color="k", lw=1.5, label=f"copy bandwidth {roof:.2f} TB/s")
        ax.axhline(0.9 * roof, color="k", lw=0.8, ls=":", label="90% of copy")
    ax.set_xscale("log", base=2)
    hollow = [what for shape_set, what in (("between", "diamonds: N between the sweep's"), ("small", "squares: small rows"))
              if any(r["shape_set"] == shape_set for r in mine)]  # fmt: skip
    ax.set_xlabel("N (hidden size); M x N = 2^27" + "".join(f"; hollow {w}" for w in hollow))
    ax.set_ylabel("TB/s (main bytes / time)")
    ax.set_title(_text(f"{op} {direction}, {dtype} — {meta.get('gpu') or ''}"))
    ax.set_ylim(bottom=0)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return fig


def plots(meta: dict, rows: list[dict], out_dir: Path) -> list[Path]:
    import matplotlib.pyplot as plt

    written = []
    colors = colours(r["impl"] for r in rows)
    figures = sorted({(op, direction, dtype) for op, direction, shape_set, dtype in rank.sections(rows) if shape_set in PLOTTED})
    for op, direction, dtype in figures:
        fig = figure(meta, rows, op, direction, dtype, colors)
        if fig is None:
            continue
        path = Path(out_dir) / f"plot-{op}-{direction}-{dtype}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def write_report(report_dir: Path, meta: dict | None = None, rows: list[dict] | None = None) -> dict:
    """report.md, results.csv and the plots of ``report_dir``, from ``meta`` and ``rows`` when the
    caller has them (a run just measured them), else read from the folder."""
    report_dir = Path(report_dir)
    if meta is None or rows is None:
        meta, rows = load(report_dir)
    else:
        _check_profile(report_dir)
    write_csv(rows, report_dir / "results.csv")
    pngs = plots(meta, rows, report_dir)

    (report_dir / "report.md").write_text(markdown(meta, rows) + "\n".join(counters(report_dir)))
    return {"report": report_dir / "report.md", "csv": report_dir / "results.csv", "plots": pngs}
