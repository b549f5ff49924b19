"""The generated parts of the documents, written by one writer: a section between
``<!-- NAME:start -->`` and ``<!-- NAME:end -->`` is replaced, the rest of the file kept byte for byte.

* ``impls`` in README.md: the implementation table (``normbench list --update-readme``);
* ``summary`` in README.md: the best of each DSL per op and direction on each GPU;
* ``leaderboard`` in reports/LEADERBOARD.md: every GPU's ranked tables and plots
  (both by ``normbench report --update-leaderboard``, from the current report of each GPU).

Where a GPU's report folder holds ``checks/invariance.json`` (``normbench check --invariance --json``),
both also show that GPU's batch invariance and determinism per implementation; where it does not,
nothing is added.

Tests regenerate each one and compare it with the committed file, so none goes stale.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from harness.registry import all_implementations
from harness.results import rank
from harness.results.report import load, markdown
from harness.spec.ops import OPS

LEADERBOARD = Path("reports/LEADERBOARD.md")
README = Path("README.md")
# in a GPU's report folder: what `normbench check --invariance --json` wrote there
INVARIANCE = Path("checks/invariance.json")
PROPERTIES = (("batch_invariant_fwd", "batch-invariant fwd"), ("batch_invariant_bwd", "batch-invariant bwd"), ("deterministic", "deterministic"))


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:start -->", f"<!-- {name}:end -->"


def replace_section(text: str, name: str, body: str, where: str = "the file") -> str:
    """``text`` with its ``name`` section's body replaced by ``body``; a ValueError when the markers
    are missing."""
    start, end = markers(name)
    if start not in text or end not in text:
        raise ValueError(f"{where} has no {start} ... {end} section")
    return re.sub(re.escape(start) + r".*?" + re.escape(end), lambda _m: f"{start}\n{body.strip()}\n{end}", text, flags=re.S)


def section(text: str, name: str) -> str:
    """The body of ``text``'s ``name`` section (what ``replace_section`` wrote)."""
    start, end = markers(name)
    return text[text.index(start) + len(start) : text.index(end)].strip()


def write_section(path: Path, name: str, body: str) -> None:
    path = Path(path)
    path.write_text(replace_section(path.read_text(), name, body, str(path)))


# ---------------------------------------------------------------- implementations
def impl_table() -> str:
    """Markdown: every registered implementation, its DSL, ops, dtypes, devices and source."""
    lines = ["| name | DSL | ops | dtypes | runs on | what it is |", "|---|---|---|---|---|---|"]
    for impl in sorted(all_implementations().values(), key=lambda i: (i.external, i.dsl, i.name)):
        src = f" ([source]({impl.sources[0]}))" if impl.sources else ""
        prompt = f" (prompt: [{Path(impl.prompt).name}]({impl.prompt}))" if impl.prompt else ""
        runs = ", ".join(impl.devices) + (f" (CPU: {impl.interpreter}=1)" if impl.interpreter and "cpu" in impl.devices else "")
        lines.append(
            f"| `{impl.name}` | {impl.dsl} | {', '.join(impl.ops)} | {', '.join(impl.dtypes)} | {runs} | {impl.description}{src}{prompt} |"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------- reports
def current_reports(root: Path = Path("reports")) -> list[Path]:
    """The current report of each GPU: ``root/<gpu>/`` folders holding results.jsonl and meta.json."""
    return sorted(p.parent for p in Path(root).glob("*/results.jsonl") if (p.parent / "meta.json").exists())


def _rel(target: Path, start: Path) -> str:
    return Path(os.path.relpath(target, start)).as_posix()


# ---------------------------------------------------------------- batch invariance
def invariance_rows(report_dir: Path) -> list[dict] | None:
    """The invariance results of a GPU's report folder (one dict per implementation and op), or None
    when it has no ``checks/invariance.json``; a ValueError naming the file when it is not what
    ``normbench check --invariance --json`` writes."""
    path = Path(report_dir) / INVARIANCE
    if not path.is_file():
        return None
    try:
        rows = json.loads(path.read_text()).get("invariance")
    except (json.JSONDecodeError, AttributeError) as e:
        raise ValueError(f"{path}: not a JSON object ({e})") from None
    keys = {"impl", "op", *(p for p, _ in PROPERTIES)}
    if not isinstance(rows, list) or not all(isinstance(r, dict) and keys <= r.keys() for r in rows):
        raise ValueError(f"{path}: no 'invariance' list of results (write it with normbench check --invariance --json)")
    for i, r in enumerate(rows):
        bad = [p for p, _ in PROPERTIES if r[p] not in (True, False, None)]
        if bad or not isinstance(r.get("mismatches", {}), dict):
            raise ValueError(f"{path}: invariance result {i} ({r['impl']} {r['op']}): {', '.join(bad) or 'mismatches'} is not what check writes")
    return rows


def _cell(text: str) -> str:
    """``text`` fit for one Markdown table cell."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _impl_order(name: str) -> tuple:
    impl = all_implementations().get(name)
    return (impl.external, impl.dsl, name) if impl else (True, "~", name)


def _mark(value) -> str:
    return {True: "yes", False: "**no**", None: "–"}[value]


def invariance_detail(rows: list[dict]) -> list[str]:
    """Markdown for the leaderboard: per implementation, each op's three properties, and the first
    mismatch of each that does not hold."""
    ops = [o for o in OPS if any(r["op"] == o for r in rows)]
    by = {(r["impl"], r["op"]): r for r in rows}
    batches = " or ".join(map(str, rows[0].get("batches", ()))) or "several"
    out = [f"Batch-invariant: a row's outputs bitwise the same in a batch of {batches} rows, first, middle or last "
           "(forward: y, statistics, residual_out; backward: dx / dh). Deterministic: every output, dweight and dbias "
           "included, bitwise the same in three runs. Each cell: fwd / bwd / deterministic.", "",
           "| implementation | " + " | ".join(ops) + " | first mismatch |", "|---|" + "---|" * (len(ops) + 1)]  # fmt: skip
    for name in sorted({r["impl"] for r in rows}, key=_impl_order):
        cells, notes = [], []
        for o in ops:
            r = by.get((name, o))
            if r is None:
                cells.append("")
                continue
            cells.append(" / ".join(_mark(r[p]) for p, _ in PROPERTIES) if r.get("status", "done") != "skip" else "skipped")
            for p, label in PROPERTIES:
                m = r.get("mismatches", {}).get(p)
                if m:
                    params = "" if m.get("weights", "same") == "same" else f"+{m['weights']}"
                    where = f"run {m['run'] + 1}" if m.get("run") is not None else f"row {m.get('row')} of {m.get('batch')}"
                    notes.append(f"{o} {label}: {m['tensor']} ({m['dtype']}{params}, N={m['n']}, {where}, max diff {m['max_abs']:.2g})")
            if r.get("status") == "error":
                notes.append(f"{o}: error: {r.get('error', '')[:120]}")
        out.append(f"| `{name}` | " + " | ".join(cells) + f" | {_cell('; '.join(notes))} |")
    return out


def invariance_summary(rows: list[dict]) -> list[str]:
    """Markdown for the README: per implementation, whether each property holds for every op it
    provides (the ops where it does not, otherwise)."""
    out = ["| implementation | " + " | ".join(label for _, label in PROPERTIES) + " |", "|---|" + "---|" * len(PROPERTIES)]
    for name in sorted({r["impl"] for r in rows}, key=_impl_order):
        mine = [r for r in rows if r["impl"] == name and r.get("status", "done") != "skip"]
        cells = []
        for p, _ in PROPERTIES:
            no = [r["op"] for r in mine if r[p] is False]
            unknown = [r["op"] for r in mine if r[p] is None]
            cells.append(f"no ({', '.join(no)})" if no else "–" if not mine or len(unknown) == len(mine) else
                         "yes" if not unknown else f"yes ({', '.join(unknown)}: –)")  # fmt: skip
        out.append(f"| `{name}` | " + " | ".join(cells) + " |")
    return out


# ---------------------------------------------------------------- leaderboard and summary
def leaderboard(report_dirs: list[Path], where: Path = LEADERBOARD) -> str:
    """Each GPU's ranked tables and plots (the per-shape tables stay in its report.md)."""
    body = ["Generated by `normbench report --update-leaderboard` from the current report of each GPU. Do not edit by hand.", ""]
    for d in report_dirs:
        meta, rows = load(d)
        rel = _rel(d, where.parent) + "/"
        body += [f"## {meta.get('gpu', d.name)}", "", f"From [`{rel}`]({rel}report.md).", ""]
        skip = False
        for line in markdown(meta, rows, rel_plots=rel).splitlines()[1:]:
            if " per shape (bold" in line:
                skip = True
            if skip and (line.startswith("![") or line.startswith("## ")):
                skip = False
            if not skip:
                body.append(line.replace("## ", "### ", 1) if line.startswith("## ") else line)
        body.append("")
        inv = invariance_rows(d)
        if inv:
            body += ["### Batch invariance and determinism", "", f"From [`{rel}{INVARIANCE.as_posix()}`]({rel}{INVARIANCE.as_posix()}).", ""]
            body += invariance_detail(inv) + [""]
    return "\n".join(body)


def summary(report_dirs: list[Path], where: Path = README, leaderboard_path: Path = LEADERBOARD) -> str:
    """Per GPU: the best implementation of each DSL per op and direction, geomean fraction of the
    copy bandwidth over the bf16 sweep."""
    out = [f"Generated by `normbench report --update-leaderboard`; every table, shape and dtype in "
           f"[{leaderboard_path.name}]({_rel(leaderboard_path, where.parent)}). Geomean fraction of the copy bandwidth "
           "measured in the same run, bf16 sweep (N = 1024 to 262144 at M·N = 2^27), best implementation of each DSL (LLM samples per target DSL, external baselines by name).", ""]  # fmt: skip
    for d in report_dirs:
        meta, rows = load(d)
        combos = [(o, dr) for o, dr, s, t in rank.sections(rows) if s == "sweep" and t == "bf16"]
        if not combos:
            continue
        best = {c: _best_per_column(rows, *c) for c in combos}
        found = {x for b in best.values() for x in b}
        # the hand-written DSLs, then the LLM samples per DSL, then each external baseline by name
        cols = sorted(found, key=lambda x: (x.startswith("llm-") + 2 * (x in _externals(rows)), x))
        out += [f"**{meta.get('gpu', d.name)}** ([report]({_rel(d, where.parent)}/report.md))", "",
                "| op / direction | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]  # fmt: skip
        for o, dr in combos:
            cells = [f"{best[(o, dr)][x].score * 100:.0f}%" if x in best[(o, dr)] else "–" for x in cols]
            out.append(f"| {o} {dr} | " + " | ".join(cells) + " |")
        out.append("")
        per_regime = regimes(rows)
        if per_regime:
            out += [f"Per regime on the {meta.get('gpu', d.name)}: geomean over the three norm ops of each DSL's best "
                    "implementation measured on every point of the set (bf16); below target: the hand-written kernel's "
                    "bf16 points of these sets under [its target](docs/method.md#targets), failures included.", ""]  # fmt: skip
            out += per_regime + [""]
        inv = invariance_rows(d)
        if inv:
            out += [f"Batch invariance and determinism on the {meta.get('gpu', d.name)} (every op of an implementation; "
                    f"per op and the first mismatch in [{leaderboard_path.name}]({_rel(leaderboard_path, where.parent)})):", ""]  # fmt: skip
            out += invariance_summary(inv) + [""]
    return "\n".join(out)


def regimes(rows: list[dict]) -> list[str]:
    """Per DSL (its best implementation per op, LLM samples left out) and external baseline: the
    geomean over the ops of the fraction reached on each regime's bf16 points, forward and backward,
    and the hand-written kernels' points below their targets (``harness.results.targets``)."""
    from harness.results.rank import geomean
    from harness.results.targets import REGIMES, below, norm_ops

    ops = norm_ops()
    present = {(s, d) for o, d, s, t in rank.sections(rows) if o in ops and s in REGIMES and t == "bf16" and d in ("fwd", "bwd")}
    cols = [(s, d) for s in REGIMES for d in ("fwd", "bwd") if (s, d) in present]
    if not cols:
        return []
    cells: dict = {}
    for s, d in cols:
        per_op: dict = {}
        for o in ops:
            for r in rank.leaderboard(rows, o, d, s):
                col = r.impl if r.external else r.dsl
                if r.score is None or col.startswith("llm-") or r.passed < r.shapes:
                    continue
                per_op.setdefault(col, {})
                per_op[col][o] = max(per_op[col].get(o, 0.0), r.score)
        for col, scores in per_op.items():
            if len(scores) == len({o for o, dd, ss, t in rank.sections(rows) if o in ops and ss == s and dd == d and t == "bf16"}):
                cells[(col, s, d)] = geomean(scores.values())
    names = sorted({c for c, _, _ in cells}, key=lambda x: (x in _externals(rows), x))
    counts = below(rows)
    out = ["| DSL | " + " | ".join(f"{s} {d}" for s, d in cols) + " | below target |", "|---|" + "---:|" * (len(cols) + 1)]
    for name in names:
        row = [f"{cells[(name, s, d)] * 100:.0f}%" if (name, s, d) in cells else "–" for s, d in cols]
        miss = f"{counts[name][0]} of {counts[name][1]}" if name in counts else "–"
        out.append(f"| {name} | " + " | ".join(row) + f" | {miss} |")
    return out


def _externals(rows) -> set[str]:
    return {r["impl"] for r in rows if r.get("external")}


def _best_per_column(rows, op, direction) -> dict:
    """The best implementation of each DSL, and each external baseline on its own (``rank.by_dsl``'s
    rule: one measured on every shape of the section beats one measured on some)."""
    shapes = rank.shapes_in(rows, op, direction)
    best: dict = {}
    for r in rank.leaderboard(rows, op, direction):
        if r.score is None:
            continue
        col = r.impl if r.external else r.dsl
        cur = best.get(col)
        if cur is None or (r.attempted == shapes, r.score) > (cur.attempted == shapes, cur.score):
            best[col] = r
    return best


def update_leaderboard(report_dirs: list[Path], leaderboard_path: Path = LEADERBOARD, readme: Path = README) -> None:
    """Rewrite the leaderboard file and the README's summary from ``report_dirs``."""
    if not report_dirs:
        raise ValueError("no report to build the leaderboard from")
    write_section(leaderboard_path, "leaderboard", leaderboard(report_dirs, leaderboard_path))
    write_section(readme, "summary", summary(report_dirs, readme, leaderboard_path))
