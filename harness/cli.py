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

from harness.spec.contract import DIRECTIONS, DTYPES, OPS
from harness.spec.errors import OneLineParser, UsageError
from harness.spec.ops import WEIGHTS
from harness.spec.shapes import SHAPE_SETS

IMPL_HELP = (
    "glob(s) over implementation names or DSLs, comma-separated; a plain name that is an implementation's "
    "selects that one only; '!GLOB' excludes (default: all)"
)
OP_HELP = f"{', '.join(OPS)}, or rmsnorm_fp8 / add_rmsnorm_fp8 for both of their groupings (comma-separated; default: all)"
REPORTS_HELP = "where the current report of each GPU is (reports/<gpu>/) when no folder is given (default: reports)"


def _shown(text: str, limit: int = 60) -> str:
    """Text from the command line as one line of an error (a newline in it would start another)."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text[:limit])


def _split(value: str | None, allowed, what: str) -> list[str]:
    if value is None:
        return list(allowed)
    items = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in items if v not in allowed]
    if bad or not items:
        raise UsageError(f"unknown {what} '{_shown(','.join(bad) or value)}'; choose from {', '.join(allowed)}")
    return items


def _ops(value: str | None) -> list[str]:
    """--op: op names, or a contract stem for all of its records (rmsnorm_fp8: per token and 1 x 128)."""
    from harness.spec.ops import expand_ops, op_stems

    return expand_ops(_split(value, (*OPS, *op_stems()), "op")) if value is not None else list(OPS)


def _impl_globs(value: str) -> str:
    """--impl: at least one glob (an empty one would select every implementation, as no --impl does)."""
    globs = [p.strip() for p in value.split(",") if p.strip()]
    if not globs:
        raise argparse.ArgumentTypeError(f"'{_shown(value)}' names no implementation; give globs over names or DSLs, or leave --impl out for all")
    if any(not c.isprintable() or c.isspace() for g in globs for c in g):  # no name holds one
        raise argparse.ArgumentTypeError(f"'{_shown(value)}': a glob holds a space or a control character")
    return ",".join(globs)


SEED_LIMIT = 2**63  # torch's generators take seeds below 2**64 and fold negative ones onto them


def _seed(value: str) -> int:
    try:
        seed = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got '{_shown(value)}'") from None
    if not 0 <= seed < SEED_LIMIT:
        raise argparse.ArgumentTypeError(f"must be an integer from 0 to 2**63 - 1, got {_shown(value.strip())}")
    return seed


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _device(arg: str | None, fanned: bool = False) -> str:
    """--device, checked; a fan-out's parent (``fanned``) runs nothing itself: cuda unless told, on
    the GPUs --gpus names (a SLURM login node has none)."""
    dev = arg or ("cuda" if fanned else _default_device())
    if dev not in ("cpu", "cuda"):
        raise UsageError(f"unknown device '{dev}'; choose cpu or cuda")
    if dev == "cuda" and not fanned:
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--device cuda, but no CUDA GPU is available here")
    return dev


def _require_cuda(command: str) -> None:
    import torch

    if not torch.cuda.is_available():
        raise UsageError(f"normbench {command} needs a CUDA GPU and none is available here")


def _writable_where(path: Path, flag: str) -> None:
    """The nearest existing folder above ``path`` must be a folder we can write in."""
    up = path.parent
    while not up.exists() and up != up.parent:
        up = up.parent
    if not up.is_dir():
        raise UsageError(f"{flag} {path}: {up} is not a folder")
    import tempfile

    try:  # os.access says yes to root on read-only or virtual file systems: try it
        with tempfile.TemporaryFile(dir=up):
            pass
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot write in {up} ({e.strerror})") from None


def _output_file(value: str | None, flag: str) -> Path | None:
    """A file the command will write, checked before any work is done."""
    if value is None:
        return None
    path = Path(value)
    if path.is_dir():
        raise UsageError(f"{flag} {path}: is a folder, not a file")
    if path.exists() and not os.access(path, os.W_OK):
        raise UsageError(f"{flag} {path}: cannot write it")
    _writable_where(path, flag)
    return path


def _output_dir(value: str | Path | None, flag: str) -> Path | None:
    """A folder the command will write into (created if missing), checked before any work is done."""
    if value is None:
        return None
    path = Path(value)
    if path.exists() and not path.is_dir():
        raise UsageError(f"{flag} {path}: exists and is not a folder")
    _writable_where(path / "x", flag)
    return path


def _readme(value: str) -> Path:
    """A README whose generated section the command rewrites: an existing file we can write."""
    path = Path(value)
    if not path.is_file():
        raise UsageError(f"--readme {path}: " + ("is a folder, not a file" if path.is_dir() else "no such file"))
    if not os.access(path, os.R_OK | os.W_OK):
        raise UsageError(f"--readme {path}: cannot read and write it")
    return path


def _console():
    from rich.console import Console

    return Console(stderr=False, highlight=False)


# ---------------------------------------------------------------- list
NO_GPU = "needs a CUDA device and none is available here"


def _why_not(impl, device: str) -> str | None:
    """Why ``impl`` cannot run on ``device`` on this machine (None: it can)."""
    import torch

    why = impl.unavailable(device)
    if why is None and device == "cuda" and not torch.cuda.is_available():
        return NO_GPU
    return why


def implementation_rows(device: str | None = None) -> list[dict]:
    from harness.registry import all_implementations

    here = device or _default_device()
    rows = []
    for impl in all_implementations().values():
        devices = [device] if device else list(impl.devices)
        why = {d: _why_not(impl, d) for d in devices}
        why_here = _why_not(impl, here)
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
                "here": {"device": here, "runs": why_here is None, "why_not": why_here},
                "description": impl.description,
                "sources": list(impl.sources),
                "prompt": impl.prompt,
            }
        )
    return sorted(rows, key=lambda r: (r["external"], r["dsl"], r["name"]))


def cmd_list(a) -> int:
    from harness.results import generated

    if a.update_readme:
        readme = _readme(a.readme)
        generated.write_section(readme, "impls", generated.impl_table())
        print(f"updated the implementation table in {readme}")
        return 0
    if a.markdown:
        print(generated.impl_table())
        return 0
    device = _default_device()
    rows = implementation_rows()
    if a.json:
        print(json.dumps(rows, indent=2))
        return 0
    from rich.table import Table

    from harness.registry import DISCOVERY_ERRORS

    t = Table(title=f"normbench implementations (this machine: {device})")
    for c in ("name", "DSL", "ops", "dtypes", "runs here?"):
        t.add_column(c, overflow="fold")
    for r in rows:
        ok = r["here"]["runs"]
        status = f"[green]yes[/] ({device})" if ok else f"[red]no[/]: {r['here']['why_not']}"
        if not ok and device == "cuda" and r["available"].get("cpu"):
            status += " [dim](runs on cpu)[/]"
        name = r["name"] + (" [dim](external)[/]" if r["external"] else "")
        t.add_row(name, r["dsl"], ",".join(r["ops"]), ",".join(r["dtypes"]), status)
    con = _console()
    con.print(t)
    for mod, err in DISCOVERY_ERRORS.items():
        con.print(f"[red]{mod} failed to import[/]: {err}")
    return 0


# ---------------------------------------------------------------- check
def _shape(text: str):
    """One shape from the command line: parse_shape's checks, and a row length N >= 1."""
    from harness.spec.shapes import parse_shape

    shape = parse_shape(text)
    if shape.n < 1:
        raise UsageError(f"bad shape '{text}': the last dimension (N, the normalized length) must be >= 1")
    return shape


def _shape_sets(value: str | None, device: str):

    if value is None:
        names = ["smoke", "edge"] if device == "cpu" else ["smoke", "edge", "decode"]
    else:
        names = [v.strip() for v in value.split(",") if v.strip()]
        if not names:  # as an empty --op: refused, not a run of nothing
            raise UsageError(f"--shapes '{_shown(value)}' names no shape set; choose from {', '.join(SHAPE_SETS)} or a shape like 4096x8192")
    out = []
    for nm in names:
        # 'sweep@5120-' keeps the set's name (and so its place in reports and --resume) for the
        # points with 5120 <= N: a long per-shape search (compile-max-autotune) can be split over runs.
        ranged = re.fullmatch(r"([a-z]+)@([0-9]*)-([0-9]*)", nm)
        if ranged and ranged[1] in SHAPE_SETS:
            lo, hi = int(ranged[2] or 0), int(ranged[3] or 2**62)
            picked = tuple(s for s in SHAPE_SETS[ranged[1]] if lo <= s.n <= hi)
            if not picked:
                raise UsageError(f"shape set '{ranged[1]}' has no N in {lo}..{ranged[3] or 'inf'}")
            out.append((ranged[1], picked))
        elif nm in SHAPE_SETS:
            out.append((nm, SHAPE_SETS[nm]))
        elif re.fullmatch(r"[0-9x]+(:[a-z0-9-]+)?", nm):
            out.append(("custom", (_shape(nm),)))
        else:
            raise UsageError(
                f"unknown shape set '{_shown(nm)}'; choose from {', '.join(SHAPE_SETS)}, a range of one ('sweep@5120-', "
                "'sweep@-4096') or a shape like 4096x8192"
            )
    return out


# ---------------------------------------------------------------- fan-out (harness.run.fanout)
def _gpus(value: str):
    """--gpus: a number of GPUs >= 1, or 'all'."""
    v = value.strip().lower()
    if v == "all":
        return "all"
    try:
        n = int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of GPUs or 'all', got '{_shown(value)}'") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a number of GPUs >= 1 or 'all', got {n}")
    return n


def _scale(a):
    """The fan-out a command was asked for (None: a serial run, or one of a fan-out's workers)."""
    from harness.run import fanout

    if a.shard_spec:
        return None
    slurm = {key: getattr(a, flag[2:].replace("-", "_")) for key, flag in fanout.SLURM_FLAGS.items()}
    return fanout.scale(a.gpus, a.executor, a.no_wait, slurm)


def _command(a) -> str:
    return "normbench " + " ".join(shlex.quote(x) for x in a.argv)


def _fanned(fin) -> None:
    """Say what a fan-out merged (or submitted), and each shard that did not finish, on stderr."""
    from harness.run import fanout

    print(fanout.summary(fin))
    for problem in fin.problems:
        print(f"normbench: {fin.kind}: {problem}", file=sys.stderr)
    if fin.problems and fin.kind == "bench":
        print("normbench: bench: the points measured were merged; run the same command with --resume to measure the rest", file=sys.stderr)


def cmd_check(a) -> int:
    sc = _scale(a)
    device = _device(a.device, fanned=sc is not None)
    if device == "cpu":
        # before anything imports triton: its own language functions are decorated at import
        from harness.spec.interpreters import INTERPRETERS

        os.environ.setdefault(INTERPRETERS["triton"], "1")
    from harness.registry import select
    from harness.run import check

    ops = _ops(a.op)
    dirs = _split(a.direction, DIRECTIONS, "direction")
    dtypes = _split(a.dtype, tuple(DTYPES), "dtype")
    sets = _shape_sets(a.shapes, device)
    json_path = _output_file(a.json, "--json")
    command = "normbench " + " ".join(shlex.quote(x) for x in sys.argv[1:])
    # the invariance probes' dtypes: those asked for, else their own (bf16 and fp32)
    invariance = ({"dtypes": dtypes} if a.dtype else {}) if a.invariance else None
    fin = None
    if a.shard_spec:  # one of a fan-out's workers: its shard's points, streamed into its folder
        from harness.run import fanout

        return fanout.check_worker(fanout.load_shard(a.shard_spec, a.shard_index, device), select(a.impl), ops, dirs, dtypes, sets, device,
                                   invariance, seed=a.seed, weights=a.weights, overflow=a.overflow, quiet=a.quiet)  # fmt: skip
    if sc:
        from harness.run import fanout

        fin = fanout.check(sc, select(a.impl), ops, dirs, dtypes, sets, device, json_path, a.argv, _command(a), invariance, a.overflow)
        if fin.submitted or fin.outcome is None:
            _fanned(fin)
            return fin.exit_status
        outcome = fin.outcome
    else:
        outcome = check.run(select(a.impl), ops, dirs, dtypes, sets, device, seed=a.seed, weights=a.weights,
                            overflow=a.overflow, quiet=a.quiet, invariance=invariance)  # fmt: skip
    check.print_summary(outcome, _console())
    if fin:
        _fanned(fin)
        if fin.exit_status:
            return fin.exit_status
    elif json_path:
        check.write_json(outcome, json_path, command)
    if outcome.interrupted:
        return 130
    if outcome.nothing_checked:
        print(f"normbench: check: nothing was checked on {device}: every selected point was skipped ({'; '.join(outcome.skip_reasons())})", file=sys.stderr)
        return 1
    return 1 if outcome.bad else 0


# ---------------------------------------------------------------- bench / rank / report
def _refuse_to_overwrite(out: Path, a) -> None:
    results = out / "results.jsonl"
    if results.is_file() and not (a.resume or a.overwrite):
        raise UsageError(
            f"{out} already holds benchmark results ({results}): --resume adds to them, --overwrite starts the folder over"
        )


def _bench_selection(a):
    """The points `bench` and `warm` plan from their shared flags: implementations, ops,
    directions, shape sets, dtypes and weight variants (bench's defaults)."""
    from harness.registry import select
    from harness.spec.roofline import DIRECTIONS_BENCH

    ops = _ops(a.op)
    dirs = _split(a.direction or "fwd,bwd", DIRECTIONS_BENCH, "direction")
    dtypes = _split(a.dtype or "bf16", tuple(DTYPES), "dtype")
    sets = _shape_sets(a.shapes or "sweep,decode", "cuda")
    impls = select(a.impl)
    weights = _split(a.weights or "same", WEIGHTS, "weights")
    return impls, ops, dirs, sets, dtypes, weights


def _timer(a):
    from harness.run.timer import CudaTimer

    if a.rep_ms <= 0 or a.warmup_ms < 0:
        raise UsageError("--rep-ms must be > 0 and --warmup-ms >= 0")
    return CudaTimer(warmup_ms=a.warmup_ms, rep_ms=a.rep_ms)


def cmd_bench(a) -> int:
    import torch

    from harness.results import report
    from harness.run import fanout
    from harness.run.bench import default_out_dir, run_bench

    sc = _scale(a)
    if a.retry_noisy and not a.resume:
        raise UsageError("--retry-noisy measures again the noisy points of a folder: it goes with --resume")
    if a.shard_spec:  # one of a fan-out's workers: its shard's points into its shard's folder
        _require_cuda("bench")
        shard = fanout.load_shard(a.shard_spec, a.shard_index)
        return fanout.bench_worker(shard, *_bench_selection(a), timer=_timer(a))
    if a.out:  # before anything else: a folder of results is never wiped by accident
        _refuse_to_overwrite(Path(a.out), a)
    if sc:
        if sc.executor == "slurm" and (not a.out or a.profile):
            raise UsageError("bench --executor slurm needs --out (a folder the nodes share)" if not a.out else
                             "--profile runs on this machine's GPU after the merge: not with --executor slurm (profile the folder on a GPU node)")  # fmt: skip
        gpu = fanout.gpu_model(sc)
    else:
        _require_cuda("bench")
        gpu = None
    impls, ops, dirs, sets, dtypes, weights = _bench_selection(a)
    profile_ns = _ints(a.profile_n, "--profile-n") if a.profile else None
    out = _output_dir(a.out or default_out_dir(gpu or torch.cuda.get_device_name(0)), "--out")
    if not a.out:  # the default folder (named by the GPU) is known only now
        _refuse_to_overwrite(out, a)
    command = "normbench " + " ".join(shlex.quote(x) for x in sys.argv[1:])
    timer = _timer(a)
    if sc:
        fin = fanout.bench(sc, impls, ops, dirs, sets, dtypes, weights, out, a.resume, a.argv, _command(a), a.retry_noisy)
        if fin.submitted or not fin.rows:  # submitted (--no-wait), or nothing measured
            if fin.submitted or fin.problems:
                _fanned(fin)
            else:
                print(f"bench: nothing left to measure in {out}")
            return fin.exit_status
        meta, rows = fin.meta, fin.rows
    else:
        meta, rows = run_bench(impls, ops, dirs, sets, dtypes, out, resume=a.resume, command=command, timer=timer, weights=weights,
                               retry_noisy=a.retry_noisy)  # fmt: skip
    written = report.write_report(out, meta, rows)
    _print_rank(rows)
    print(f"wrote {out}/results.jsonl, {written['report']}, {written['csv']} and {len(written['plots'])} plots")
    if a.profile:
        from harness.run.profile import profile

        profile(out, ns=profile_ns, ops=ops, directions=dirs, rows=rows)
        report.write_report(out, meta, rows)
    if sc:
        _fanned(fin)
        return fin.exit_status
    return 0


def cmd_warm(a) -> int:
    from harness.run import fanout
    from harness.run.warm import run_warm

    sc = _scale(a)
    jobs = a.jobs if a.jobs is not None else fanout.default_jobs(sc, a.shard_spec, a.shard_index)
    if jobs < 1:
        raise UsageError("--jobs must be >= 1")
    if a.shard_spec:  # one of a fan-out's workers: its shard's searches on its GPU
        _require_cuda("warm")
        return fanout.warm_worker(fanout.load_shard(a.shard_spec, a.shard_index), *_bench_selection(a), jobs=jobs)
    if sc:
        fanout.gpu_model(sc)
    else:
        _require_cuda("warm")
    impls, ops, dirs, sets, dtypes, weights = _bench_selection(a)
    out = _output_dir(a.out, "--out")
    if sc:
        fin = fanout.warm(sc, impls, ops, dirs, sets, dtypes, weights, out, a.argv, _command(a))
        rows = fin.rows or []
    else:
        rows = run_warm(impls, ops, dirs, sets, dtypes, out, jobs=jobs, weights=weights)
    bad = [r for r in rows if r["status"] != "ok"]
    total = sum(r["search_s"] for r in rows)
    where = f"{fin.shards} GPUs x {jobs}" if sc else min(jobs, len(rows))  # run_warm starts no more workers than points
    if not (sc and fin.submitted):
        print(f"warmed {len(rows) - len(bad)} of {len(rows)} points ({total:.0f} s of searches over {where} processes); wrote {out}/warm.jsonl")
    for r in bad:
        print(f"  {r['impl']} {r['op']} {r['direction']} {r['shape']} {r['dtype']}: {r['reason']}")
    if sc:
        _fanned(fin)
        return fin.exit_status
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
    from harness.results import report
    from harness.results.store import merge_results
    from harness.run import fanout

    if any(fanout.is_fanout(Path(p)) for p in a.sources):  # a fan-out's work folder: its shards
        if len(a.sources) != 1:
            raise UsageError("merge: a fan-out's work folder is merged alone: normbench merge DEST WORKFOLDER")
        fin = fanout.merge(Path(a.dest), Path(a.sources[0]))
        _fanned(fin)
        return 1 if fin.problems else 0

    rows = merge_results(Path(a.dest), [Path(p) for p in a.sources], commit=a.commit)
    written = report.write_report(Path(a.dest))
    print(f"merged {len(a.sources)} folder(s) into {a.dest}: {len(rows)} points; wrote {written['report']}")
    return 0


def cmd_overhead(a) -> int:
    from harness.registry import select
    from harness.run.overhead import markdown, run

    device = _device(a.device)
    ops = _ops(a.op)
    if a.calls < 1 or a.trials < 1:
        raise UsageError("--calls and --trials must be >= 1")
    out = _output_file(a.out, "--out")
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
    command = "normbench " + " ".join(shlex.quote(x) for x in sys.argv[1:])
    pyprof = Path(a.python_profile) if a.python_profile else None
    if pyprof is not None and pyprof.exists() and not pyprof.is_dir():
        raise UsageError(f"--python-profile {a.python_profile}: exists and is not a folder")
    rows = run(select(a.impl), ops, _shape(a.shape), a.dtype, device, out, a.calls, a.trials, command=command,
               python_profile=pyprof)  # fmt: skip
    print("\n".join(markdown(rows)))
    if out:
        print(f"wrote {out}")
    return 0


def cmd_profile(a) -> int:
    from harness.results import report
    from harness.run.profile import DEFAULT_NS, profile
    from harness.spec.roofline import DIRECTIONS_BENCH

    _require_cuda("profile")
    if a.dir:
        out = Path(a.dir)
    else:
        import torch

        from harness.run.environment import slug

        out = Path(a.reports) / slug(torch.cuda.get_device_name(0))
        if not (out / "results.jsonl").exists():
            raise UsageError(f"no benchmark report of this GPU in {out} (name a folder)")
    ops = _ops(a.op) if a.op else None
    dirs = _split(a.direction, DIRECTIONS_BENCH, "direction") if a.direction else None
    ns = _ints(a.n, "--n") if a.n else list(DEFAULT_NS)
    if not a.timeout > 0:
        raise UsageError(f"--timeout must be > 0 seconds, got {a.timeout}")
    result = profile(out, ns=ns, impl=a.impl, ops=ops, directions=dirs, dtype=a.dtype, timeout_s=a.timeout)
    report.write_report(out)
    failed = [p for p in result["points"] if p.get("error")]
    print(f"wrote {out}/profile.json ({len(result['points'])} points, {len(failed)} without counters) and {out}/report.md")
    return 0


def _print_rank(rows) -> int:
    """Print the leaderboards; returns how many were printed."""
    from rich.table import Table

    from harness.results import rank

    con = _console()
    printed = 0
    for op, d, sset, dt in rank.sections(rows):
        board = rank.leaderboard(rows, op, d, sset, dt)
        if not board:
            continue
        printed += 1
        t = Table(title=f"{op} {d} — {sset}, {dt}")
        for c in ("#", "implementation", "DSL", "of copy BW", "TB/s", "µs", "passed", "vs eager"):
            t.add_column(c, justify="left" if c in ("implementation", "DSL") else "right", overflow="fold")
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
    return printed


def cmd_rank(a) -> int:
    from harness.results import generated, report
    from harness.results.store import load_results

    if a.results:
        groups = [(", ".join(a.results), [r for p in map(Path, a.results) for r in (load_results(p) if p.is_file() else report.load(p)[1])])]
    else:
        dirs = generated.current_reports(Path(a.reports))
        if not dirs:
            raise UsageError(f"no benchmark report under {a.reports}/ (run `normbench bench` first, or name a folder)")
        groups = []
        for d in dirs:
            meta, rows = report.load(d)
            groups.append((f"{d} ({meta.get('gpu', '?')})", rows))
    printed = 0
    for where, rows in groups:
        if not rows:
            raise UsageError(f"no benchmark points in {where}")
        _console().rule(f"[bold]{where}")
        printed += _print_rank(rows)
    if not printed:
        raise UsageError(f"nothing to rank in {', '.join(w for w, _ in groups)}: every point was skipped (not run here)")
    return 0


def _report_dirs(a) -> list[Path]:
    """The folders a command works on: those given, else the current report of every GPU."""
    from harness.results import generated

    dirs = [Path(d) for d in a.dirs] if a.dirs else generated.current_reports(Path(a.reports))
    if not dirs:
        raise UsageError(f"no benchmark report under {a.reports}/ (run `normbench bench` first, or name a folder)")
    return dirs


def cmd_report(a) -> int:
    from harness.results import generated, report

    if a.update_leaderboard:
        leaderboard, readme = _readme(a.leaderboard), _readme(a.readme)
    dirs = _report_dirs(a)
    loaded = [(d, *report.load(d)) for d in dirs]  # every folder read before anything is written
    for d, meta, rows in loaded:
        written = report.write_report(d, meta, rows)
        print(f"wrote {written['report']}, {written['csv']} and {len(written['plots'])} plots")
    if a.update_leaderboard:
        generated.update_leaderboard(dirs, leaderboard, readme)
        print(f"updated {leaderboard} and the summary in {readme} from {', '.join(map(str, dirs))}")
    return 0


# ---------------------------------------------------------------- DSL hooks
def cmd_tune(a) -> int:
    from harness.registry import select

    impls = [i for i in select(a.impl) if i.hooks.get("tune")]
    if not impls:
        raise UsageError(f"no implementation matching '{a.impl}' has a tune hook")
    _require_cuda("tune")
    dev = "cuda"
    ops = _ops(a.op)
    sets = _shape_sets(a.shapes or "sweep", dev)
    shapes = [s for _, ss in sets for s in ss]
    dtype = _split(a.dtype or "bf16", tuple(DTYPES), "dtype")[0]
    log_dir = _output_dir(a.log_dir, "--log-dir")
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
    from harness.registry import get

    impl = get(a.impl)
    fn = impl.hook("codegen")
    if fn is None:
        raise UsageError(f"implementation '{impl.name}' has no codegen hook")
    if a.op not in impl.ops:
        raise UsageError(f"implementation '{impl.name}' does not implement {a.op}")
    if a.n < 1:
        raise UsageError(f"--n must be >= 1, got {a.n}")
    out = _output_file(a.out, "--out")
    src = fn(op=a.op, direction=a.direction, n=a.n, dtype=a.dtype)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(src)
        print(f"wrote {a.out}")
    else:
        print(src)
    return 0


def cmd_model(a) -> int:
    sc = _scale(a)
    device = _device(a.device, fanned=sc is not None)
    if device == "cpu":  # before transformers imports triton (see cmd_check)
        from harness.spec.interpreters import INTERPRETERS

        os.environ.setdefault(INTERPRETERS["triton"], "1")
    from harness.registry import select
    from harness.run import models

    why = models.transformers_missing()
    if why:
        raise UsageError(why)
    archs = _split(a.arch, tuple(models.ARCHS), "arch")
    out = Path(a.out) if a.out else None
    train_only = {"--compile": a.compile or None, "--steps": a.steps, "--steps-per-trial": a.steps_per_trial, "--group": a.group}
    decode_only = {"--batch": a.batch, "--prompt": a.prompt, "--new-tokens": a.new_tokens, "--paths": a.paths}
    wrong = [opt for opt, value in (train_only if a.mode == "decode" else decode_only).items() if value is not None]
    if wrong:
        other = "train" if a.mode == "decode" else "decode"
        raise UsageError(f"model: {wrong[0]} is an option of --mode {other}, not --mode {a.mode}")
    shard = None
    if sc or a.shard_spec:  # the architectures over the GPUs, one worker each (harness.run.fanout)
        from harness.run import fanout
        from harness.run.bench import default_out_dir

        if a.mode == "decode":
            raise UsageError("model --gpus: --mode decode is not spread over GPUs; run it without --gpus")
        if sc:
            if sc.executor == "slurm" and not a.out:
                raise UsageError("model --executor slurm needs --out (a folder the nodes share)")
            out = out or default_out_dir(fanout.gpu_model(sc) if device == "cuda" else "cpu") / "models"
            fin = fanout.model(sc, archs, out, a.argv, _command(a))
            _fanned(fin)
            return fin.exit_status
        shard = fanout.load_shard(a.shard_spec, a.shard_index, device)
        archs, out = fanout.model_shard(shard, archs), shard.folder
    if a.mode == "decode":
        from harness.run import decode

        paths = _split(a.paths, decode.PATHS, "path") if a.paths is not None else None
        return decode.run(archs, a.size, select(a.impl), device=device, dtype=a.dtype, batches=a.batch, prompt=a.prompt,
                          new_tokens=a.new_tokens, paths=paths, trials=a.trials, out=out, seed=a.seed, tag=a.tag)  # fmt: skip
    status = models.run(archs, a.size, select(a.impl), device=device, steps=10 if a.steps is None else a.steps,
                        compile=a.compile, trials=a.trials, out=out, dtype=a.dtype, seed=a.seed,
                        steps_per_trial=a.steps_per_trial, group=a.group, tag=a.tag,
                        command=shard.command if shard else None)  # fmt: skip
    return shard.done(status) if shard else status


def _counts(value: str) -> list[int]:
    """--batch: comma-separated whole numbers (their range is checked where they are used)."""
    items = [v.strip() for v in value.split(",") if v.strip()]
    try:
        counts = [int(v) for v in items]
    except ValueError:
        counts = []
    if not counts:
        raise argparse.ArgumentTypeError(f"expected whole numbers separated by commas, got '{_shown(value)}'")
    return counts


# Commands whose code is not the harness's: TritonBench's adapter, and the LLM generator, which lives
# with its samples in impls/llm (the harness never imports an implementation package by name, so it
# is found by module path, as implementations are).
_DELEGATES = {"tritonbench": "harness.tools.tritonbench", "generate": "impls.llm.generate"}


def cmd_new(a) -> int:
    from harness.tools import new

    return new.main(a.name, a.dsl)


def cmd_delegate(module: str):
    def run(a) -> int:
        import importlib

        try:
            mod = importlib.import_module(_DELEGATES[module])
        except ModuleNotFoundError as e:
            raise UsageError(f"`normbench {module}` is not available in this checkout ({e})") from None
        return mod.main(a.rest)

    return run


# ---------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="normbench", description="RMSNorm / LayerNorm kernels across GPU DSLs: checked against fp64, ranked against the copy roofline.")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    s = sub.add_parser("list", help="every implementation, whether it runs here and why not")
    out = s.add_mutually_exclusive_group()  # each is a different output: two would print one and drop the other
    out.add_argument("--json", action="store_true", help="print the records as JSON")
    out.add_argument("--markdown", action="store_true", help="the README's implementation table")
    out.add_argument("--update-readme", action="store_true", help="regenerate the table in README.md")
    s.add_argument("--readme", default="README.md", help="the README --update-readme rewrites (default: README.md)")
    s.set_defaults(fn=cmd_list)

    def common(s, directions=DIRECTIONS):
        s.add_argument("--impl", type=_impl_globs, help=IMPL_HELP)
        s.add_argument("--op", help=OP_HELP)
        s.add_argument("--weights", help=f"the parameters: {', '.join(WEIGHTS)} (fp32 beside 16-bit x; Gemma's 1 + w) (comma-separated for bench)")
        s.add_argument("--direction", help=f"{', '.join(directions)} (comma-separated)")
        s.add_argument("--shapes", help=f"shape set(s): {', '.join(SHAPE_SETS)}, SET@LO-HI (the set's N in LO..HI, either side open), or MxN (comma-separated)")
        s.add_argument("--dtype", help=f"{', '.join(DTYPES)} (comma-separated)")

    def fan_out(s):
        from harness.run.fanout import EXECUTORS

        s.add_argument("--gpus", type=_gpus, metavar="N|all",
                       help="spread the points over N GPUs (one worker process each), merged into what a serial run writes; docs/scale-out.md")
        s.add_argument("--executor", choices=EXECUTORS,
                       help="how --gpus starts its workers: processes (default: this host), local (submitit's local executor), slurm (a SLURM job array)")
        s.add_argument("--no-wait", action="store_true", help="--executor slurm: submit and return; the array merges its shards when its last task ends")
        g = s.add_argument_group("SLURM, with --executor slurm (through submitit)")
        g.add_argument("--slurm-partition", help="the partition of GPU nodes (required)")
        g.add_argument("--slurm-gpus-per-node", type=int, help="GPUs of each array task, on one node, one shard each (default: 1; --gpus is a multiple)")
        g.add_argument("--slurm-time", type=int, metavar="MIN", help="time limit of each array task, in minutes (default: 240)")
        g.add_argument("--slurm-cpus-per-gpu", type=int, help="CPU cores per GPU (default: 8)")
        g.add_argument("--slurm-mem-gb", type=float, help="memory of each task in GB (default: the partition's)")
        g.add_argument("--slurm-account", help="the account to charge")
        g.add_argument("--slurm-qos", help="the quality of service")
        g.add_argument("--slurm-constraint", help="node features, e.g. the GPU model (a report is of one GPU model)")
        g.add_argument("--slurm-parallelism", type=int, help="at most this many tasks at once (default: all)")
        g.add_argument("--slurm-setup", action="append", metavar="LINE", help="a shell line each task runs first (module load, source .venv/bin/activate); repeatable")
        s.add_argument("--shard-spec", help=argparse.SUPPRESS)  # a fan-out's worker: its spec.json
        s.add_argument("--shard-index", type=int, default=0, help=argparse.SUPPRESS)  # and its shard

    s = sub.add_parser("check", help="the correctness matrix against the fp64 reference")
    common(s)
    fan_out(s)
    s.add_argument("--device", help="cpu or cuda (default: cuda if available)")
    s.add_argument("--json", metavar="FILE", help="write every result as JSON")
    s.add_argument("--seed", type=_seed, default=0, help="seed of the drawn inputs, 0 to 2**63 - 1 (default: 0)")
    s.add_argument("--quiet", action="store_true", help="no progress bar or progress lines")
    s.add_argument("--overflow", action="store_true",
                   help="every selected point on inputs whose squares overflow fp32 (NaN accepted); without it the edge set brings the overflow shapes along")
    s.add_argument("--invariance", action="store_true",
                   help="also probe batch invariance (fwd, bwd) and determinism of every implementation and op: a table, and the key 'invariance' of --json")
    s.set_defaults(fn=cmd_check, weights="same")

    s = sub.add_parser("bench", help="check, then time against the copy roofline (GPU)")
    common(s, ("fwd", "bwd", "fwdbwd"))
    s.add_argument("--out", help="report folder (default: runs/<gpu>/<date>; merge it into reports/<gpu> with `normbench merge`)")
    again = s.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true", help="skip points already in the folder's results.jsonl (same GPU only)")
    again.add_argument("--overwrite", action="store_true", help="start over in a folder that holds results (they are deleted, with the report, plots and counters)")
    s.add_argument("--retry-noisy", action="store_true",
                   help="with --resume: also measure again the selected points the folder holds whose trials disagree by more than 5%% (noisy)")
    s.add_argument("--profile", action="store_true", help="then `normbench profile` the folder (Nsight Compute counters)")
    s.add_argument("--profile-n", default="4096,16384,262144", help="row lengths N that --profile measures (default: 4096,16384,262144)")
    s.add_argument("--rep-ms", type=int, default=100, help="time budget of each trial's repetitions (do_bench rep)")
    s.add_argument("--warmup-ms", type=int, default=25, help="warm-up of each trial (do_bench warmup)")
    fan_out(s)
    s.set_defaults(fn=cmd_bench)

    s = sub.add_parser("warm", help="compile and autotune points in parallel processes, for a later bench to find in the caches (GPU)")
    common(s, ("fwd", "bwd", "fwdbwd"))
    s.add_argument("--out", required=True, help="folder for warm.jsonl (each point's search seconds): the bench's report folder")
    s.add_argument("--jobs", type=int, help="worker processes (per GPU with --gpus; default: half the CPUs, over the GPUs, at most 8)")
    fan_out(s)
    s.set_defaults(fn=cmd_warm)

    s = sub.add_parser("rank", help="leaderboards from benchmark results (default: the current report of each GPU)")
    s.add_argument("results", nargs="*", help="report folders or results.jsonl files")
    s.add_argument("--reports", default="reports", help=REPORTS_HELP)
    s.set_defaults(fn=cmd_rank)

    s = sub.add_parser("report", help="write report.md, results.csv and plots for benchmark folders; regenerate the leaderboard")
    s.add_argument("dirs", nargs="*", help="report folders (default: the current report of each GPU, reports/<gpu>/)")
    s.add_argument("--reports", default="reports", help=REPORTS_HELP)
    s.add_argument("--update-leaderboard", action="store_true", help="regenerate reports/LEADERBOARD.md and the README's summary from these folders")
    s.add_argument("--leaderboard", default="reports/LEADERBOARD.md", help="the leaderboard file (default: reports/LEADERBOARD.md)")
    s.add_argument("--readme", default="README.md", help="the README whose summary is rewritten (default: README.md)")
    s.set_defaults(fn=cmd_report)

    s = sub.add_parser("merge", help="fold other benchmark folders of the same GPU into one (their points replace same-key points)")
    s.add_argument("dest", help="the benchmark folder to update")
    s.add_argument("sources", nargs="+", help="benchmark folders to fold in, oldest first")
    s.add_argument("--commit", help="the commit holding the code the sources measured, where their meta.json records none or a -dirty tree")
    s.set_defaults(fn=cmd_merge)

    s = sub.add_parser("overhead", help="host time per call (functions and modules, fwd and fwd+bwd, beside torch's own) on a tiny shape")
    s.add_argument("--impl", type=_impl_globs, help=IMPL_HELP)
    s.add_argument("--op", help=OP_HELP)
    s.add_argument("--shape", default="4x4096", help="a shape small enough that the GPU waits for the host (default: 4x4096)")
    s.add_argument("--dtype", default="bf16", choices=tuple(DTYPES), help="the dtype (default: bf16)")
    s.add_argument("--device", help="cpu or cuda (default: cuda if available)")
    s.add_argument("--calls", type=int, default=200, help="calls timed per trial (default: 200)")
    s.add_argument("--trials", type=int, default=5, help="interleaved rounds; each figure is their minimum (default: 5)")
    s.add_argument("--out", help="write the rows as JSON here")
    s.add_argument("--python-profile", metavar="DIR", help="also write a cProfile text per implementation, op and measurement into DIR")
    s.set_defaults(fn=cmd_overhead)

    s = sub.add_parser("profile", help="Nsight Compute counters for benchmarked points: DRAM bytes vs the bytes model (GPU)")
    s.add_argument("dir", nargs="?", help="benchmark folder (default: this GPU's current report, reports/<gpu>/)")
    s.add_argument("--reports", default="reports", help=REPORTS_HELP)
    s.add_argument("--impl", type=_impl_globs, help="glob(s) over implementation names or DSLs (default: the best of each DSL)")
    s.add_argument("--op", help=OP_HELP)
    s.add_argument("--direction", help="fwd, bwd, fwdbwd (comma-separated)")
    s.add_argument("--n", help="row lengths N of the sweep points to profile (default: 4096,16384,262144)")
    s.add_argument("--dtype", default="bf16", choices=tuple(DTYPES), help="the dtype (default: bf16)")
    s.add_argument("--timeout", type=float, default=300, help="seconds per point before ncu is stopped")
    s.set_defaults(fn=cmd_profile)

    s = sub.add_parser("tune", help="offline tuning for implementations that pin configs (GPU)")
    s.add_argument("--impl", required=True, type=_impl_globs, help="glob(s) over implementation names or DSLs; those with a tune hook are tuned")
    s.add_argument("--op", help=OP_HELP)
    s.add_argument("--shapes", help="shape set(s) or MxN to tune for (default: sweep)")
    s.add_argument("--dtype", help="the dtype to tune for (default: bf16)")
    s.add_argument("--log-dir", default="reports/tuning", help="where the tuning logs go (default: reports/tuning)")
    s.set_defaults(fn=cmd_tune)

    s = sub.add_parser("codegen", help="print the code an implementation generates (e.g. Helion -> Triton)")
    s.add_argument("impl", help="an implementation with a codegen hook (e.g. helion)")
    s.add_argument("--op", default="rmsnorm", choices=OPS, help="the op (default: rmsnorm)")
    s.add_argument("--direction", default="fwd", choices=DIRECTIONS, help="fwd or bwd (default: fwd)")
    s.add_argument("--n", type=int, default=4096, help="the row length N (default: 4096)")
    s.add_argument("--dtype", default="bf16", choices=tuple(DTYPES), help="the dtype (default: bf16)")
    s.add_argument("--out", help="write the code to this file instead of printing it")
    s.set_defaults(fn=cmd_codegen)

    s = sub.add_parser("model", help="a Hugging Face model with its own norms and each implementation's: training (agreement, step time) or decoding (ms per token, tokens)")
    s.add_argument("--mode", default="train", choices=("train", "decode"), help="train: training steps; decode: generate with a KV cache (default: train)")
    s.add_argument("--arch", default="llama", help="llama, qwen3, gemma3, gpt2, mistral, qwen2 (comma-separated; default: llama)")
    s.add_argument("--size", default="tiny", choices=("tiny", "small", "1b"), help="model size: tiny (CI), small (4 layers, hidden 2048, 4 x 1024 tokens), 1b")
    s.add_argument("--impl", type=_impl_globs, help="glob(s) over implementation names or DSLs, comma-separated (default: all)")
    s.add_argument("--steps", type=int, help="train: training steps compared (default: 10)")
    s.add_argument("--trials", type=int, help="timing trials (train: default 6 on cuda, none on cpu; decode: 5 on cuda, 2 on cpu)")
    s.add_argument("--steps-per-trial", type=int, help="train: steps in each timing trial (default: --steps)")
    s.add_argument("--group", type=int, help="train: variants timed together, the own norms included (default: as many copies as fit in device memory)")
    s.add_argument("--compile", action="store_true", help="train: torch.compile each variant's whole model (the own norms become Inductor's)")
    s.add_argument("--batch", type=_counts, help="decode: batch sizes, comma-separated (default: 1,32; tiny 1,2)")
    s.add_argument("--prompt", type=int, help="decode: prompt tokens (default: 512; tiny 16)")
    s.add_argument("--new-tokens", type=int, help="decode: tokens generated, greedy (default: 128; tiny 8)")
    s.add_argument("--paths", help="decode: eager, cuda-graphs (comma-separated; default: both; cuda-graphs is skipped on the CPU)")
    s.add_argument("--dtype", default="bf16", help="model dtype: bf16 or fp32; decode also fp16 (default: bf16)")
    s.add_argument("--tag", help="appended to the report file names (runs of one configuration split over several commands)")
    s.add_argument("--device", help="cpu or cuda (default: cuda if available)")
    s.add_argument("--seed", type=int, default=0, help="seed of the weights and batches (default: 0)")
    s.add_argument("--out", help="report folder (default: runs/<gpu>/<date>/models)")
    fan_out(s)
    s.set_defaults(fn=cmd_model)

    s = sub.add_parser("new", help="start an implementation: impls/NAME/ with its record and the six contract functions from a template")
    s.add_argument("name", help="the folder and implementation name (lower-case letters, digits, _)")
    s.add_argument("--dsl", default="eager", choices=("eager", "triton"),
                   help="eager: plain PyTorch formulas; triton: one-row-per-program Triton kernels (default: eager)")
    s.set_defaults(fn=cmd_new)

    for name, helptext in (("tritonbench", "run TritonBench with every implementation registered"), ("generate", "generate kernels with an LLM endpoint")):
        s = sub.add_parser(name, help=helptext, add_help=False)
        s.add_argument("rest", nargs=argparse.REMAINDER)
        s.set_defaults(fn=cmd_delegate(name))
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    try:
        if argv and argv[0] in ("tritonbench", "generate"):
            # argparse.REMAINDER refuses a first argument that starts with '--': pass the rest verbatim
            args = argparse.Namespace(fn=cmd_delegate(argv[0]), rest=argv[1:])
        else:
            args = parser.parse_args(argv)
            args.argv = list(argv)  # what a fan-out's workers are started with
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
