"""`normbench check`: the correctness matrix, implementation by implementation, with its progress,
its table and its JSON record. Each point is one ``harness.run.checker.run_check``; an
implementation that cannot run here is skipped once, with its reason, and never stops the others.

The edge set brings the overflow case along (``OVERFLOW_SET``): for the ops whose record says so,
in the dtypes the overflow inputs exist in, the shapes of ``harness.spec.inputs.OVERFLOW_SHAPES``
on rows whose squares overflow fp32, where NaN or the right answer passes and a finite wrong number
fails (what tests/test_implementations.py holds every implementation to). ``overflow=True``
(``--overflow``) instead runs every selected point on such inputs.

Ctrl-C stops the run where it is: what was checked is summarized (and written, marked
``interrupted``), and the command exits 130.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from harness.run.checker import OVERFLOW_DTYPES, CheckResult, run_check
from harness.spec.inputs import OVERFLOW_SHAPES
from harness.spec.ops import get_op

ULP_NOTE = (
    "max ulp: the largest error in units of the output dtype's last place at the reference value. A point "
    "passes when every element is within max(ulps * ulp, rtol * |ref|) + floor * rms(its terms) "
    "(harness/spec/tolerances.py): near-zero elements of a cancelling sum (dx, dweight) are held to the floor, "
    "not to 2 ulps, so a passing row can show a large max ulp. Its errors must also average out: the mean "
    "signed error over the tensor within its sampling noise and a small floor (a 0.5% scale is caught "
    "even where each element is within 2 ulps). FP8 ops: q in e4m3 steps from the exact rounding (1 only where y / scale "
    "sits at a rounding boundary), scale in ulps of fp32 (large for an implementation that declares it rounds y to "
    "x's dtype first: eager)."
)
WORD = {"pass": "passed", "fail": "failed", "error": "errors", "skip": "skipped"}
# the shape set name of the overflow points the edge set brings along
OVERFLOW_SET = "overflow"
# with output to a file, the longest a group may run with nothing printed
PROGRESS_EVERY_S = 30.0


@dataclass
class Outcome:
    """What a check run found: (shape set, result) per point run, and the implementations skipped
    whole (name -> why)."""

    device: str
    results: list[tuple[str, CheckResult]] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    interrupted: bool = False  # stopped by Ctrl-C: what is here is what was checked before it
    # harness.run.invariance results (as dicts), when they were asked for
    invariance: list[dict] | None = None

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


class _Heartbeat:
    """Progress lines for a log: one per finished group, and one at least every
    ``PROGRESS_EVERY_S`` seconds while a group runs (one point can take minutes: a compile, an
    interpreter on a wide row), from a thread, so that a long check never looks hung."""

    def __init__(self, n_groups: int, total: int):
        self.n_groups, self.total = n_groups, total
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.group = ""
        self.index = self.done = self.in_group = self.group_size = 0
        self.point = ""
        self.t_group = self.t_print = time.perf_counter()
        self.thread = threading.Thread(target=self._beat, daemon=True)
        self.thread.start()

    def print(self, line: str) -> None:
        with self.lock:
            print(line, flush=True)
            self.t_print = time.perf_counter()

    def _beat(self) -> None:
        while not self.stop.wait(min(1.0, PROGRESS_EVERY_S / 4)):
            now = time.perf_counter()
            if self.group and now - self.t_print >= PROGRESS_EVERY_S:
                self.print(f"check [{self.index}/{self.n_groups}] {self.group}: {self.in_group}/{self.group_size} points, "
                           f"on {self.point} ({now - self.t_group:.0f} s in this group; {self.done}/{self.total} points)")  # fmt: skip

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


def _label(pt) -> str:
    if len(pt) < 6:  # an invariance group: (impl, op)
        return "the invariance probes"
    _, _, d, dt, sname, s, *_ = pt
    return f"{d} {dt} {s.label}" + (f" ({sname})" if sname == OVERFLOW_SET else "")


def _progress(groups: list, quiet: bool):
    """One (implementation, op, points) group at a time: a bar naming the implementation on a
    terminal, one line per group otherwise (a log must show that a long check is moving), and one
    at least every ``PROGRESS_EVERY_S`` seconds within a group."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    total = sum(len(pts) for _, _, pts in groups)
    if quiet or not sys.stdout.isatty():
        beat = None if quiet else _Heartbeat(len(groups), total)
        try:
            for i, (name, op, pts) in enumerate(groups, 1):
                t0 = time.perf_counter()
                stats: dict = {}
                if beat:
                    beat.group, beat.index, beat.in_group, beat.group_size, beat.t_group = f"{name} {op}", i, 0, len(pts), t0
                for pt in pts:
                    if beat:
                        beat.point = _label(pt)
                    yield pt, stats
                    if beat:
                        beat.in_group += 1
                        beat.done += 1
                if beat:
                    counts = ", ".join(f"{v} {k}" for k, v in sorted(stats.items()))
                    beat.print(f"check [{i}/{len(groups)}] {name} {op}: {counts or 'nothing run'} "
                               f"({time.perf_counter() - t0:.1f} s; {beat.done}/{total} points)")  # fmt: skip
        finally:
            if beat:
                beat.close()
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


def _points(impl, op, directions, dtypes, shape_sets, overflow: bool) -> list:
    """(impl, op, direction, dtype, set name, shape, overflow) of one group: the selected points, and
    the overflow case where the edge set is selected (see the module docstring)."""
    directions = [d for d in directions if get_op(op).offers(d)]  # the FP8 ops have no bwd
    pts = [(impl, op, d, dt, sname, s, overflow) for d in directions for dt in dtypes for sname, shapes in shape_sets for s in shapes]
    if not overflow and get_op(op).overflow and any(sname == "edge" for sname, _ in shape_sets):
        pts += [(impl, op, d, dt, OVERFLOW_SET, s, True) for d in directions for dt in dtypes if dt in OVERFLOW_DTYPES for s in OVERFLOW_SHAPES]
    return pts


def point_key(pt) -> tuple:
    """What names a point of ``plan`` (JSON-able: a fan-out's shard lists these)."""
    impl, op, d, dt, sname, s, over = pt
    return (impl.name, op, d, dt, sname, s.label, over)


def invariance_key(impl, op: str) -> tuple:
    """What names an implementation's and op's invariance probes (a unit of a fan-out's shard)."""
    return ("invariance", impl.name, op)


def plan(impls, ops, directions, dtypes, shape_sets, overflow: bool = False) -> list[tuple]:
    """Every point ``run`` checks, in its order: (impl, op, direction, dtype, set name, shape, overflow)."""
    return [pt for impl in impls for op in ops if op in impl.ops for pt in _points(impl, op, directions, dtypes, shape_sets, overflow)]


def run(impls, ops, directions, dtypes, shape_sets, device: str, seed: int = 0, weights: str = "same",
        overflow: bool = False, quiet: bool = False, invariance: dict | None = None, only: set | None = None,
        gpu_id: str | None = None, on_result=None) -> Outcome:  # fmt: skip
    """Check every point of the selection; ``shape_sets`` is [(set name, shapes)]. ``invariance``:
    also run ``harness.run.invariance`` on every implementation and op, with these keyword arguments
    (dtypes, ns, batches; {} for its defaults). Ctrl-C ends the run with what was checked, marked
    ``interrupted``.

    ``only``: the keys (``point_key``, ``invariance_key``) of the points and probes to run, the
    others left out (a fan-out's shard); ``gpu_id`` is recorded with every result;
    ``on_result(shape_set, result)`` is called as each point is checked (a shard streams them)."""
    groups = [(impl.name, op, _points(impl, op, directions, dtypes, shape_sets, overflow)) for impl in impls for op in ops if op in impl.ops]
    if only is not None:
        groups = [(name, op, kept) for name, op, pts in groups if (kept := [pt for pt in pts if point_key(pt) in only])]
    out = Outcome(device)
    progress = _progress(groups, quiet)
    try:
        for (impl, op, d, dt, sname, s, over), stats in progress:
            if impl.name in out.skipped:
                stats["skipped"] = stats.get("skipped", 0) + 1
                continue
            r = run_check(impl, op, d, s, dt, device, seed=seed, weights=weights, overflow=over)
            r.gpu_id = gpu_id
            stats[WORD[r.status]] = stats.get(WORD[r.status], 0) + 1
            if r.status == "skip" and impl.unavailable(device):
                out.skipped[impl.name] = r.error
                continue
            out.results.append((sname, r))
            if on_result:
                on_result(sname, r)
        if invariance is not None:
            out.invariance = []
            _invariance(out, impls, ops, device, seed, quiet, invariance, only)
    except KeyboardInterrupt:
        out.interrupted = True
    finally:
        progress.close()
    return out


def _invariance(out: Outcome, impls, ops, device: str, seed: int, quiet: bool, kwargs: dict, only: set | None = None) -> None:
    from harness.run.invariance import check_invariance

    groups = [(impl.name, op, [(impl, op)]) for impl in impls for op in ops if op in impl.ops and impl.name not in out.skipped
              and (only is None or invariance_key(impl, op) in only)]  # fmt: skip
    progress = _progress([(f"{name} invariance", op, pts) for name, op, pts in groups], quiet)
    try:
        for (impl, op), stats in progress:
            r = check_invariance(impl, op, device, seed=seed, **kwargs)
            stats[{"done": "done", "error": "errors", "skip": "skipped"}[r.status]] = 1
            out.invariance.append(r.to_json())
    finally:
        progress.close()


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


def _yes_no(value) -> str:
    return {True: "[green]yes[/]", False: "[red]no[/]", None: "–"}[value]


def invariance_table(rows: list[dict], width: int = 100):
    """Batch invariance and determinism per implementation and op (a rich Table)."""
    from rich.table import Table

    from harness.run.invariance import InvarianceResult

    batches = ", ".join(map(str, rows[0].get("batches", ()))) if rows else ""
    t = Table(title="batch invariance and determinism", padding=(0, 1), collapse_padding=True,
              caption=f"fwd, bwd: a row's outputs bitwise the same in batches of {batches} rows, first, middle or last; "
                      "determ.: every output bitwise the same in 3 runs (harness/run/invariance.py)")  # fmt: skip
    # names whole where the width allows (the other columns take 62), folded, never cut, otherwise
    whole = max((len(r["impl"]) for r in rows), default=0) <= width - 62
    t.add_column("implementation", no_wrap=whole, overflow="fold")
    t.add_column("op", no_wrap=True)
    for c in ("fwd", "bwd", "determ."):
        t.add_column(c, no_wrap=True)
    t.add_column("first mismatch", overflow="fold", ratio=1)

    for r in rows:
        res = InvarianceResult(**r)
        note = res.error if res.status != "done" else res.first_mismatch()
        t.add_row(res.impl, res.op, *(_yes_no(getattr(res, p)) for p in ("batch_invariant_fwd", "batch_invariant_bwd", "deterministic")), note)
    return t


def print_summary(outcome: Outcome, con) -> None:
    con.print(table(outcome, con.width))
    con.print(f"[dim]{ULP_NOTE}[/]")
    if outcome.invariance:
        con.print(invariance_table(outcome.invariance, con.width))
    for name, why in outcome.skipped.items():
        con.print(f"[yellow]skipped[/] {name}: {why}")
    bad = outcome.bad
    for _, r in bad[:50]:
        over = " (overflow inputs)" if r.overflow else ""
        con.print(f"[red]{r.status.upper()}[/] {r.impl} {r.op} {r.direction} {r.dtype} {r.shape}{over}: {r.summary()}")
    if len(bad) > 50:
        con.print(f"... and {len(bad) - 50} more")
    n_skip = sum(r.status == "skip" for _, r in outcome.results)
    con.print(f"{outcome.passed} passed, {len(bad)} failed, {n_skip} points skipped, {len(outcome.skipped)} implementations skipped")
    if outcome.interrupted:
        con.print("[yellow]interrupted[/]: the points above are those checked before Ctrl-C")


def write_json(outcome: Outcome, path: Path, command: str, env: dict | None = None) -> None:
    """The run's JSON record; ``env``: where it ran (default: this process's environment)."""
    from harness.run.environment import environment

    payload = {
        "command": command,
        "environment": env if env is not None else environment(outcome.device),
        "interrupted": outcome.interrupted,
        "skipped": outcome.skipped,
        "results": [dict(r.to_json(), shape_set=s) for s, r in outcome.results],
    }
    if outcome.invariance is not None:
        payload["invariance"] = outcome.invariance
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1))
