"""`normbench check`: the correctness matrix, implementation by implementation, with its progress,
its table and its JSON record. Each point is one ``harness.run.checker.run_check``; an
implementation that cannot run here is skipped once, with its reason, and never stops the others."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from harness.run.checker import CheckResult, run_check

ULP_NOTE = (
    "max ulp: the largest error in units of the output dtype's last place at the reference value. A point "
    "passes when every element is within max(ulps * ulp, rtol * |ref|) + floor * rms(its terms) "
    "(harness/spec/tolerances.py): near-zero elements of a cancelling sum (dx, dweight) are held to the floor, "
    "not to 2 ulps, so a passing row can show a large max ulp."
)
WORD = {"pass": "passed", "fail": "failed", "error": "errors", "skip": "skipped"}


@dataclass
class Outcome:
    """What a check run found: (shape set, result) per point run, and the implementations skipped
    whole (name -> why)."""

    device: str
    results: list[tuple[str, CheckResult]] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    @property
    def bad(self) -> list[tuple[str, CheckResult]]:
        return [(s, r) for s, r in self.results if r.status in ("fail", "error")]

    @property
    def passed(self) -> int:
        return sum(r.status == "pass" for _, r in self.results)

    @property
    def nothing_checked(self) -> bool:
        return not self.passed and not self.bad

    def skip_reasons(self) -> list[str]:
        return sorted(set(self.skipped.values()) | {r.error for _, r in self.results if r.status == "skip"})


def _progress(groups: list, quiet: bool):
    """One (implementation, op, points) group at a time: a bar naming the implementation on a
    terminal, one line per group otherwise (a log must show that a long check is moving)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    total = sum(len(pts) for _, _, pts in groups)
    if quiet or not sys.stdout.isatty():
        done = 0
        for i, (name, op, pts) in enumerate(groups, 1):
            t0 = time.perf_counter()
            stats: dict = {}
            for pt in pts:
                yield pt, stats
            done += len(pts)
            if not quiet:
                counts = ", ".join(f"{v} {k}" for k, v in sorted(stats.items()))
                print(f"check [{i}/{len(groups)}] {name} {op}: {counts or 'nothing run'} "
                      f"({time.perf_counter() - t0:.1f} s; {done}/{total} points)", flush=True)  # fmt: skip
        return
    cols = (TextColumn("check [bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*cols, transient=True) as bar:
        task = bar.add_task("", total=total)
        for name, op, pts in groups:
            bar.update(task, description=f"{name} {op}")
            stats = {}
            for pt in pts:
                yield pt, stats
                bar.advance(task)


def run(impls, ops, directions, dtypes, shape_sets, device: str, seed: int = 0, weights: str = "same",
        overflow: bool = False, quiet: bool = False) -> Outcome:  # fmt: skip
    """Check every point of the selection; ``shape_sets`` is [(set name, shapes)]."""
    groups = [
        (impl.name, op, [(impl, op, d, dt, sname, s) for d in directions for dt in dtypes for sname, shapes in shape_sets for s in shapes])
        for impl in impls
        for op in ops
        if op in impl.ops
    ]
    out = Outcome(device)
    for (impl, op, d, dt, sname, s), stats in _progress(groups, quiet):
        if impl.name in out.skipped:
            stats["skipped"] = stats.get("skipped", 0) + 1
            continue
        r = run_check(impl, op, d, s, dt, device, seed=seed, weights=weights, overflow=overflow)
        stats[WORD[r.status]] = stats.get(WORD[r.status], 0) + 1
        if r.status == "skip" and impl.unavailable(device):
            out.skipped[impl.name] = r.error
            continue
        out.results.append((sname, r))
    return out


def table(outcome: Outcome, width: int = 100):
    """The results grouped per implementation, op, direction, dtype and shape set (a rich Table)."""
    from rich.table import Table

    t = Table(title=f"normbench check ({outcome.device})", padding=(0, 1), collapse_padding=True)
    # names whole where the width allows (the other columns take 64), folded, never cut, otherwise
    name_width = max(12, min(width - 64, max((len(r.impl) for _, r in outcome.results), default=14)))
    for c in ("implementation", "op", "dir", "dtype", "shapes", "pass", "fail", "error", "max ulp"):
        t.add_column(c, justify="right" if c in ("pass", "fail", "error", "max ulp") else "left", overflow="fold",
                     min_width=name_width if c == "implementation" else None)  # fmt: skip
    groups: dict = {}
    for sname, r in outcome.results:
        groups.setdefault((r.impl, r.op, r.direction, r.dtype, sname), []).append(r)
    for (name, op, d, dt, sname), rs in groups.items():
        ok = sum(r.status == "pass" for r in rs)
        fail = sum(r.status == "fail" for r in rs)
        err = sum(r.status == "error" for r in rs)
        worst = max((t.max_ulp for r in rs for t in r.tensors if t.max_ulp == t.max_ulp), default=float("nan"))
        style = "green" if not (fail or err) else "red"
        t.add_row(name, op, d, dt, sname, f"[{style}]{ok}[/]", str(fail), str(err), f"{worst:.3g}")
    return t


def print_summary(outcome: Outcome, con) -> None:
    con.print(table(outcome, con.width))
    con.print(f"[dim]{ULP_NOTE}[/]")
    for name, why in outcome.skipped.items():
        con.print(f"[yellow]skipped[/] {name}: {why}")
    bad = outcome.bad
    for _, r in bad[:50]:
        con.print(f"[red]{r.status.upper()}[/] {r.impl} {r.op} {r.direction} {r.dtype} {r.shape}: {r.summary()}")
    if len(bad) > 50:
        con.print(f"... and {len(bad) - 50} more")
    n_skip = sum(r.status == "skip" for _, r in outcome.results)
    con.print(f"{outcome.passed} passed, {len(bad)} failed, {n_skip} points skipped, {len(outcome.skipped)} implementations skipped")


def write_json(outcome: Outcome, path: Path, command: str) -> None:
    from harness.run.environment import environment

    payload = {
        "command": command,
        "environment": environment(outcome.device),
        "skipped": outcome.skipped,
        "results": [dict(r.to_json(), shape_set=s) for s, r in outcome.results],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1))
