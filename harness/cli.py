"""The `normbench` command line (also `python -m harness`).

Bad input of any kind ends in one line on stderr and exit status 2; failed checks in exit status 1.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys
from pathlib import Path

from .contract import DIRECTIONS, DTYPES, OPS
from .ops import WEIGHTS

IMPLS_START, IMPLS_END = "<!-- impls:start -->", "<!-- impls:end -->"


class UsageError(ValueError):
    pass


def _split(value: str | None, allowed, what: str) -> list[str]:
    if value is None:
        return list(allowed)
    items = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in items if v not in allowed]
    if bad or not items:
        raise UsageError(f"unknown {what} '{','.join(bad) or value}'; choose from {', '.join(allowed)}")
    return items


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _device(arg: str | None) -> str:
    dev = arg or _default_device()
    if dev not in ("cpu", "cuda"):
        raise UsageError(f"unknown device '{dev}'; choose cpu or cuda")
    if dev == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--device cuda, but no CUDA GPU is available here")
    return dev


def _require_cuda(command: str) -> None:
    import torch

    if not torch.cuda.is_available():
        raise UsageError(f"normbench {command} needs a CUDA GPU and none is available here")


def _console():
    from rich.console import Console

    return Console(stderr=False, highlight=False)


# ---------------------------------------------------------------- list
def implementation_rows(device: str | None = None) -> list[dict]:
    from .registry import all_implementations

    rows = []
    for impl in all_implementations().values():
        devices = [device] if device else list(impl.devices)
        why = {d: impl.unavailable(d) for d in devices}
        rows.append(
            {
                "name": impl.name,
                "dsl": impl.dsl,
                "ops": list(impl.ops),
                "dtypes": list(impl.dtypes),
                "devices": list(impl.devices),
                "external": impl.external,
                "available": {d: w is None for d, w in why.items()},
                "why_not": {d: w for d, w in why.items() if w},
                "description": impl.description,
                "sources": list(impl.sources),
                "prompt": impl.prompt,
            }
        )
    return sorted(rows, key=lambda r: (r["external"], r["dsl"], r["name"]))


def markdown_impl_table() -> str:
    from .registry import all_implementations

    lines = ["| name | DSL | ops | dtypes | runs on | what it is |", "|---|---|---|---|---|---|"]
    for impl in sorted(all_implementations().values(), key=lambda i: (i.external, i.dsl, i.name)):
        src = f" ([source]({impl.sources[0]}))" if impl.sources else ""
        prompt = f" (prompt: [{Path(impl.prompt).name}]({impl.prompt}))" if impl.prompt else ""
        runs = ", ".join(impl.devices) + (f" (CPU: {impl.interpreter}=1)" if impl.interpreter and "cpu" in impl.devices else "")
        lines.append(
            f"| `{impl.name}` | {impl.dsl} | {', '.join(impl.ops)} | {', '.join(impl.dtypes)} | {runs} | {impl.description}{src}{prompt} |"
        )
    return "\n".join(lines)


def cmd_list(a) -> int:
    if a.update_readme:
        readme = Path(a.readme)
        text = readme.read_text()
        if IMPLS_START not in text:
            raise UsageError(f"{readme} has no {IMPLS_START} ... {IMPLS_END} section")
        new = re.sub(
            re.escape(IMPLS_START) + r".*?" + re.escape(IMPLS_END),
            lambda _m: f"{IMPLS_START}\n{markdown_impl_table()}\n{IMPLS_END}",
            text,
            flags=re.S,
        )
        readme.write_text(new)
        print(f"updated the implementation table in {readme}")
        return 0
    if a.markdown:
        print(markdown_impl_table())
        return 0
    device = _default_device()
    rows = implementation_rows()
    if a.json:
        print(json.dumps(rows, indent=2))
        return 0
    from rich.table import Table

    from .registry import DISCOVERY_ERRORS

    t = Table(title=f"normbench implementations (this machine: {device})")
    for c in ("name", "DSL", "ops", "dtypes", "runs here?"):
        t.add_column(c)
    for r in rows:
        here = device if device in r["devices"] else r["devices"][0]
        ok = r["available"].get(here)
        status = f"[green]yes[/] ({here})" if ok else f"[red]no[/]: {r['why_not'].get(here) or r['why_not'].get(device)}"
        if not ok and device == "cuda" and "cpu" in r["available"] and r["available"]["cpu"]:
            status += " [dim](runs on cpu)[/]"
        name = r["name"] + (" [dim](external)[/]" if r["external"] else "")
        t.add_row(name, r["dsl"], ",".join(r["ops"]), ",".join(r["dtypes"]), status)
    con = _console()
    con.print(t)
    for mod, err in DISCOVERY_ERRORS.items():
        con.print(f"[red]{mod} failed to import[/]: {err}")
    return 0


# ---------------------------------------------------------------- check
def _shape_sets(value: str | None, device: str):
    from .shapes import SHAPE_SETS, parse_shape

    if value is None:
        names = ["smoke", "edge"] if device == "cpu" else ["smoke", "edge", "decode"]
    else:
        names = [v.strip() for v in value.split(",") if v.strip()]
    out = []
    for nm in names:
        if nm in SHAPE_SETS:
            out.append((nm, SHAPE_SETS[nm]))
        elif re.fullmatch(r"[0-9x]+(:[a-z-]+)?", nm):
            out.append(("custom", (parse_shape(nm),)))
        else:
            raise UsageError(f"unknown shape set '{nm}'; choose from {', '.join(SHAPE_SETS)} or give a shape like 4096x8192")
    return out


def cmd_check(a) -> int:
    device = _device(a.device)
    if device == "cpu":
        # before anything imports triton: its own language functions are decorated at import
        from .contract import INTERPRETERS

        os.environ.setdefault(INTERPRETERS["triton"], "1")
    from rich.progress import track
    from rich.table import Table

    from .checker import run_check
    from .registry import select

    ops = _split(a.op, OPS, "op")
    dirs = _split(a.direction, DIRECTIONS, "direction")
    dtypes = _split(a.dtype, tuple(DTYPES), "dtype")
    sets = _shape_sets(a.shapes, device)
    impls = select(a.impl)
    points = [
        (impl, op, d, dt, sname, s)
        for impl in impls
        for op in ops
        if op in impl.ops
        for d in dirs
        for dt in dtypes
        for sname, shapes in sets
        for s in shapes
    ]
    results = []
    skipped = {}
    for impl, op, d, dt, sname, s in track(points, description="check", disable=a.quiet or not sys.stdout.isatty()):
        if impl.name in skipped:
            continue
        r = run_check(impl, op, d, s, dt, device, seed=a.seed, weights=a.weights, overflow=a.overflow)
        if r.status == "skip" and impl.unavailable(device):
            skipped[impl.name] = r.error
            continue
        results.append((sname, r))
    con = _console()
    t = Table(title=f"normbench check ({device})")
    for c in ("implementation", "op", "direction", "dtype", "shape set", "passed", "failed", "errors", "worst ulp"):
        t.add_column(c, justify="right" if c in ("passed", "failed", "errors", "worst ulp") else "left")
    groups: dict = {}
    for sname, r in results:
        groups.setdefault((r.impl, r.op, r.direction, r.dtype, sname), []).append(r)
    for (name, op, d, dt, sname), rs in groups.items():
        ok = sum(r.status == "pass" for r in rs)
        fail = sum(r.status == "fail" for r in rs)
        err = sum(r.status == "error" for r in rs)
        worst = max((t.max_ulp for r in rs for t in r.tensors if t.max_ulp == t.max_ulp), default=float("nan"))
        style = "green" if not (fail or err) else "red"
        t.add_row(name, op, d, dt, sname, f"[{style}]{ok}[/]", str(fail), str(err), f"{worst:.3g}")
    con.print(t)
    for name, why in skipped.items():
        con.print(f"[yellow]skipped[/] {name}: {why}")
    bad = [(s, r) for s, r in results if r.status in ("fail", "error")]
    for _, r in bad[:50]:
        con.print(f"[red]{r.status.upper()}[/] {r.impl} {r.op} {r.direction} {r.dtype} {r.shape}: {r.summary()}")
    if len(bad) > 50:
        con.print(f"... and {len(bad) - 50} more")
    if a.json:
        from .bench import environment

        payload = {
            "command": "normbench " + " ".join(shlex.quote(x) for x in sys.argv[1:]),
            "environment": environment(device),
            "skipped": skipped,
            "results": [dict(r.to_json(), shape_set=s) for s, r in results],
        }
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(payload, indent=1))
    n_ok = sum(r.status == "pass" for _, r in results)
    con.print(f"{n_ok} passed, {len(bad)} failed, {len(skipped)} implementations skipped")
    return 1 if bad else 0


# ---------------------------------------------------------------- bench / rank / report
def cmd_bench(a) -> int:
    import torch

    from . import report
    from .bench import default_out_dir, run_bench
    from .registry import select
    from .roofline import DIRECTIONS_BENCH

    _require_cuda("bench")
    ops = _split(a.op, OPS, "op")
    dirs = _split(a.direction or "fwd,bwd", DIRECTIONS_BENCH, "direction")
    dtypes = _split(a.dtype or "bf16", tuple(DTYPES), "dtype")
    sets = _shape_sets(a.shapes or "sweep,decode", "cuda")
    impls = select(a.impl)
    profile_ns = _ints(a.profile_n, "--profile-n") if a.profile else None
    out = Path(a.out) if a.out else default_out_dir(torch.cuda.get_device_name(0))
    command = "normbench " + " ".join(shlex.quote(x) for x in sys.argv[1:])
    from .bench import CudaTimer

    if a.rep_ms <= 0 or a.warmup_ms < 0:
        raise UsageError("--rep-ms must be > 0 and --warmup-ms >= 0")
    timer = CudaTimer(warmup_ms=a.warmup_ms, rep_ms=a.rep_ms)
    weights = _split(a.weights or "same", WEIGHTS, "weights")
    rows = run_bench(impls, ops, dirs, sets, dtypes, out, resume=a.resume, command=command, timer=timer, weights=weights)
    written = report.write_report(out)
    _print_rank(rows)
    print(f"wrote {out}/results.jsonl, {written['report']}, {written['csv']} and {len(written['plots'])} plots")
    if a.profile:
        from .profile import profile

        profile(out, ns=profile_ns, ops=ops, directions=dirs)
        report.write_report(out)
    return 0


def _ints(value: str, what: str) -> list[int]:
    try:
        out = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"{what} takes comma-separated integers, got '{value}'") from None
    if not out or min(out) < 1:
        raise UsageError(f"{what} takes comma-separated positive integers, got '{value}'")
    return out


def cmd_merge(a) -> int:
    from . import report
    from .bench import merge_results

    rows = merge_results(Path(a.dest), [Path(p) for p in a.sources], commit=a.commit)
    written = report.write_report(Path(a.dest))
    print(f"merged {len(a.sources)} folder(s) into {a.dest}: {len(rows)} points; wrote {written['report']}")
    return 0


def cmd_overhead(a) -> int:
    from .overhead import markdown, run
    from .registry import select
    from .shapes import parse_shape

    device = _device(a.device)
    ops = _split(a.op, OPS, "op")
    if a.calls < 1 or a.trials < 1:
        raise UsageError("--calls and --trials must be >= 1")
    out = Path(a.out) if a.out else None
    rows = run(select(a.impl), ops, parse_shape(a.shape), a.dtype, device, out, a.calls, a.trials)
    print("\n".join(markdown(rows)))
    if out:
        print(f"wrote {out}")
    return 0


def cmd_profile(a) -> int:
    from . import report
    from .profile import DEFAULT_NS, profile
    from .roofline import DIRECTIONS_BENCH

    _require_cuda("profile")
    out = Path(a.dir) if a.dir else report.newest_report(Path(a.reports))
    ops = _split(a.op, OPS, "op") if a.op else None
    dirs = _split(a.direction, DIRECTIONS_BENCH, "direction") if a.direction else None
    ns = _ints(a.n, "--n") if a.n else list(DEFAULT_NS)
    if not a.timeout > 0:
        raise UsageError(f"--timeout must be > 0 seconds, got {a.timeout}")
    result = profile(out, ns=ns, impl=a.impl, ops=ops, directions=dirs, dtype=a.dtype, timeout_s=a.timeout)
    report.write_report(out)
    failed = [p for p in result["points"] if p.get("error")]
    print(f"wrote {out}/profile.json ({len(result['points'])} points, {len(failed)} without counters) and {out}/report.md")
    return 0


def _print_rank(rows) -> None:
    from rich.table import Table

    from . import rank

    con = _console()
    for op, d, sset, dt in rank.sections(rows):
        board = rank.leaderboard(rows, op, d, sset, dt)
        if not board:
            continue
        t = Table(title=f"{op} {d} — {sset}, {dt}")
        for c in ("#", "implementation", "DSL", "frac. of copy BW", "TB/s", "µs", "coverage", "vs eager"):
            t.add_column(c, justify="left" if c in ("implementation", "DSL") else "right")
        for i, r in enumerate(board, 1):
            name = r.impl + (" [dim](external)[/]" if r.external else "")
            t.add_row(
                str(i), name, r.dsl,
                f"{r.score * 100:.1f}%" if r.score else "–",
                f"{r.tbps:.2f}" if r.tbps else "–",
                f"{r.us:.1f}" if r.us else "–",
                r.coverage,
                f"{r.speedup:.2f}x" if r.speedup else "–",
            )  # fmt: skip
        con.print(t)
        win = rank.winners(rows, op, d, sset, dt)
        if win:
            con.print("  winners: " + ", ".join(f"{w['shape']}: {w['best']['impl']}" for w in win))


def cmd_rank(a) -> int:
    from . import report

    dirs = [Path(p) for p in a.results] or [report.newest_report(Path(a.reports))]
    rows = []
    for d in dirs:
        d = d.parent if d.is_file() else d
        _, r = report.load(d)
        rows += r
    _print_rank(rows)
    return 0


def cmd_report(a) -> int:
    from . import report

    d = Path(a.dir) if a.dir else report.newest_report(Path(a.reports))
    written = report.write_report(d)
    print(f"wrote {written['report']}, {written['csv']} and {len(written['plots'])} plots")
    if a.update_readme:
        report.update_readme(d, Path(a.readme))
        print(f"updated the leaderboard in {a.readme} from {d}")
    return 0


# ---------------------------------------------------------------- DSL hooks
def cmd_tune(a) -> int:
    from .registry import select

    impls = [i for i in select(a.impl) if i.hooks.get("tune")]
    if not impls:
        raise UsageError(f"no implementation matching '{a.impl}' has a tune hook")
    dev = _device("cuda")
    ops = _split(a.op, OPS, "op")
    sets = _shape_sets(a.shapes or "sweep", dev)
    shapes = [s for _, ss in sets for s in ss]
    dtype = _split(a.dtype or "bf16", tuple(DTYPES), "dtype")[0]
    log_dir = Path(a.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    for impl in impls:
        why = impl.unavailable(dev)
        if why:
            print(f"skipping {impl.name}: {why}")
            continue
        tune = impl.hook("tune")
        for op in ops:
            if op in impl.ops:
                tune(op=op, shapes=shapes, dtype=dtype, log_dir=log_dir)
    return 0


def cmd_codegen(a) -> int:
    from .registry import get

    impl = get(a.impl)
    fn = impl.hook("codegen")
    if fn is None:
        raise UsageError(f"implementation '{impl.name}' has no codegen hook")
    if a.op not in impl.ops:
        raise UsageError(f"implementation '{impl.name}' does not implement {a.op}")
    if a.n < 1:
        raise UsageError(f"--n must be >= 1, got {a.n}")
    src = fn(op=a.op, direction=a.direction, n=a.n, dtype=a.dtype)
    if a.out:
        Path(a.out).write_text(src)
        print(f"wrote {a.out}")
    else:
        print(src)
    return 0


def cmd_delegate(module: str):
    def run(a) -> int:
        import importlib

        try:
            mod = importlib.import_module(f"harness.{module}")
        except ModuleNotFoundError as e:
            raise UsageError(f"`normbench {module}` is not available in this checkout ({e})") from None
        return mod.main(a.rest)

    return run


# ---------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="normbench", description="RMSNorm / LayerNorm kernels across GPU DSLs: checked against fp64, ranked against the copy roofline.")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    s = sub.add_parser("list", help="every implementation, whether it runs here and why not")
    s.add_argument("--json", action="store_true")
    s.add_argument("--markdown", action="store_true", help="the README's implementation table")
    s.add_argument("--update-readme", action="store_true", help="regenerate the table in README.md")
    s.add_argument("--readme", default="README.md")
    s.set_defaults(fn=cmd_list)

    def common(s, directions=DIRECTIONS):
        s.add_argument("--impl", help="glob(s) over implementation names or DSLs, comma-separated (default: all)")
        s.add_argument("--op", help=f"{', '.join(OPS)} (comma-separated)")
        s.add_argument("--weights", help=f"the parameters: {', '.join(WEIGHTS)} (fp32 beside 16-bit x; Gemma's 1 + w) (comma-separated for bench)")
        s.add_argument("--direction", help=f"{', '.join(directions)} (comma-separated)")
        s.add_argument("--shapes", help="shape set(s): smoke, edge, sweep, decode, or MxN (comma-separated)")
        s.add_argument("--dtype", help="bf16, fp16, fp32 (comma-separated)")

    s = sub.add_parser("check", help="the correctness matrix against the fp64 reference")
    common(s)
    s.add_argument("--device", help="cpu or cuda (default: cuda if available)")
    s.add_argument("--json", metavar="FILE", help="write every result as JSON")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--overflow", action="store_true", help="inputs whose squares overflow fp32 (NaN accepted)")
    s.add_argument("--quiet", action="store_true")
    s.set_defaults(fn=cmd_check, weights="same")

    s = sub.add_parser("bench", help="check, then time against the copy roofline (GPU)")
    common(s, ("fwd", "bwd", "fwdbwd"))
    s.add_argument("--out", help="report folder (default: reports/<gpu>/<date>)")
    s.add_argument("--resume", action="store_true", help="skip points already in the folder's results.jsonl")
    s.add_argument("--profile", action="store_true", help="then `normbench profile` the folder (Nsight Compute counters)")
    s.add_argument("--profile-n", default="4096,16384,262144", help="row lengths N that --profile measures (default: 4096,16384,262144)")
    s.add_argument("--rep-ms", type=int, default=100, help="time budget of each trial's repetitions (do_bench rep)")
    s.add_argument("--warmup-ms", type=int, default=25, help="warm-up of each trial (do_bench warmup)")
    s.set_defaults(fn=cmd_bench)

    s = sub.add_parser("rank", help="leaderboards from benchmark results (default: the newest report)")
    s.add_argument("results", nargs="*", help="report folders or results.jsonl files")
    s.add_argument("--reports", default="reports")
    s.set_defaults(fn=cmd_rank)

    s = sub.add_parser("report", help="write report.md, results.csv and plots for a benchmark folder")
    s.add_argument("dir", nargs="?", help="report folder (default: the newest)")
    s.add_argument("--reports", default="reports")
    s.add_argument("--update-readme", action="store_true", help="regenerate the README's leaderboard section")
    s.add_argument("--readme", default="README.md")
    s.set_defaults(fn=cmd_report)

    s = sub.add_parser("merge", help="fold other benchmark folders of the same GPU into one (their points replace same-key points)")
    s.add_argument("dest", help="the benchmark folder to update")
    s.add_argument("sources", nargs="+", help="benchmark folders to fold in, oldest first")
    s.add_argument("--commit", help="the commit holding the code the sources measured, where their meta.json records none or a -dirty tree")
    s.set_defaults(fn=cmd_merge)

    s = sub.add_parser("overhead", help="host time per call (contract functions, autograd fwd+bwd) on a tiny shape")
    s.add_argument("--impl", help="glob(s) over implementation names or DSLs, comma-separated (default: all)")
    s.add_argument("--op", help="rmsnorm, layernorm or both (comma-separated)")
    s.add_argument("--shape", default="4x4096", help="a shape small enough that the GPU waits for the host (default: 4x4096)")
    s.add_argument("--dtype", default="bf16", choices=tuple(DTYPES))
    s.add_argument("--device", help="cpu or cuda (default: cuda if available)")
    s.add_argument("--calls", type=int, default=200)
    s.add_argument("--trials", type=int, default=5)
    s.add_argument("--out", help="write the rows as JSON here")
    s.set_defaults(fn=cmd_overhead)

    s = sub.add_parser("profile", help="Nsight Compute counters for benchmarked points: DRAM bytes vs the bytes model (GPU)")
    s.add_argument("dir", nargs="?", help="benchmark folder (default: the newest)")
    s.add_argument("--reports", default="reports")
    s.add_argument("--impl", help="glob(s) over implementation names or DSLs (default: the best of each DSL)")
    s.add_argument("--op", help="rmsnorm, layernorm or both (comma-separated)")
    s.add_argument("--direction", help="fwd, bwd, fwdbwd (comma-separated)")
    s.add_argument("--n", help="row lengths N of the sweep points to profile (default: 4096,16384,262144)")
    s.add_argument("--dtype", default="bf16", choices=tuple(DTYPES))
    s.add_argument("--timeout", type=float, default=300, help="seconds per point before ncu is stopped")
    s.set_defaults(fn=cmd_profile)

    s = sub.add_parser("tune", help="offline tuning for implementations that pin configs (GPU)")
    s.add_argument("--impl", required=True)
    s.add_argument("--op")
    s.add_argument("--shapes")
    s.add_argument("--dtype")
    s.add_argument("--log-dir", default="reports/tuning")
    s.set_defaults(fn=cmd_tune)

    s = sub.add_parser("codegen", help="print the code an implementation generates (e.g. Helion -> Triton)")
    s.add_argument("impl")
    s.add_argument("--op", default="rmsnorm", choices=OPS)
    s.add_argument("--direction", default="fwd", choices=DIRECTIONS)
    s.add_argument("--n", type=int, default=4096)
    s.add_argument("--dtype", default="bf16", choices=tuple(DTYPES))
    s.add_argument("--out")
    s.set_defaults(fn=cmd_codegen)

    for name, helptext in (("tritonbench", "run TritonBench with every implementation registered"), ("generate", "generate kernels with an LLM endpoint")):
        s = sub.add_parser(name, help=helptext, add_help=False)
        s.add_argument("rest", nargs=argparse.REMAINDER)
        s.set_defaults(fn=cmd_delegate(name))
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    if argv and argv[0] in ("tritonbench", "generate"):
        # argparse.REMAINDER refuses a first argument that starts with '--': pass the rest verbatim
        args = argparse.Namespace(fn=cmd_delegate(argv[0]), rest=argv[1:])
    else:
        args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except (ValueError, TypeError) as e:
        if os.environ.get("NORMBENCH_DEBUG"):
            raise
        print(f"normbench: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("normbench: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
