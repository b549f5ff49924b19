"""`normbench bench`: every implementation x op x direction x shape x dtype, checked, then timed
against the copy-bandwidth roofline measured in the same run.

Method (also in the README):
* correctness first: the point's fwd and/or bwd are checked against fp64 (harness.checker); a point
  that fails is recorded as failed, never timed, never ranked;
* the first call (JIT compilation, autotuning, dynamo tracing) is timed separately as ``compile_s``;
* timing with CUDA events through ``triton.testing.do_bench``, which flushes the L2 (writes a 256 MB
  buffer) before every repetition; 3 independent trials, each a median over its repetitions; the
  point's time is the median of all repetitions, with p95 and the spread of the trial medians
  ((max - min) / min), flagged noisy above 5%;
* decode shapes (launch-bound) are timed as CUDA-graph replays of 20 calls (L2 not flushed: their
  inputs are under 2 MB and stay cache-resident, as they do in a real decode step);
* results are appended to ``results.jsonl`` as they come, so an interrupted run keeps what it measured
  and ``--resume`` skips points already there.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .checker import run_check
from .contract import DTYPES, Implementation, describe_error
from .inputs import make_case
from .ops import get_op
from .roofline import bytes_moved, tbps
from .shapes import Shape

NOISY_SPREAD = 0.05
TRIALS = 3
GRAPH_CALLS = 20
GRAPH_SHAPE_SETS = ("decode",)


@dataclass
class Point:
    impl: str
    dsl: str
    external: bool
    op: str
    direction: str
    shape_set: str
    shape: str
    M: int
    N: int
    dtype: str
    weights: str = "same"  # the parameters' variant (harness.ops.WEIGHTS); rows written before it: "same"
    status: str = "skip"  # ok | failed | error | skip
    reason: str = ""
    check: str = ""
    compile_s: float | None = None
    ms: float | None = None  # median over all repetitions of all trials
    ms_p95: float | None = None
    trial_ms: list = field(default_factory=list)
    spread: float | None = None
    noisy: bool = False
    graph: bool = False
    bytes_main: int = 0
    bytes_extra: int = 0
    tbps: float | None = None
    frac_roofline: float | None = None
    config: str = ""  # where the launch config came from, for implementations that pin them per GPU

    @property
    def key(self) -> tuple:
        return (self.impl, self.op, self.direction, self.shape, self.dtype, self.weights)


class CudaTimer:
    """Times a zero-argument callable on the GPU; returns one list of repetition times (ms) per trial."""

    def __init__(self, warmup_ms: int = 25, rep_ms: int = 100, trials: int = TRIALS):
        self.warmup_ms, self.rep_ms, self.trials = warmup_ms, rep_ms, trials

    def time(self, fn, graph: bool = False) -> tuple[list[list[float]], bool]:
        import triton.testing

        if graph:
            try:
                return [self._graph_trial(fn) for _ in range(self.trials)], True
            except Exception:  # not capturable (host syncs, allocations): plain timing instead
                torch.cuda.synchronize()
        trials = []
        for _ in range(self.trials):
            t = triton.testing.do_bench(fn, warmup=self.warmup_ms, rep=self.rep_ms, return_mode="all")
            trials.append(list(t) if isinstance(t, (list, tuple)) else [float(t)])
        return trials, False

    def _graph_trial(self, fn) -> list[float]:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(GRAPH_CALLS):
                fn()
        g.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(20):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / GRAPH_CALLS)
        return times

    def sync(self):
        torch.cuda.synchronize()


def _percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    i = min(len(s) - 1, max(0, round(q * (len(s) - 1))))
    return s[i]


def summarize(trials: list[list[float]]) -> dict:
    """Median and p95 over all repetitions, spread of the trial medians, noisy flag."""
    flat = [t for tr in trials for t in tr]
    if not flat:
        raise ValueError("no timings")
    meds = [statistics.median(tr) for tr in trials if tr]
    spread = (max(meds) - min(meds)) / min(meds) if min(meds) > 0 else 0.0
    return {
        "ms": statistics.median(flat),
        "ms_p95": _percentile(flat, 0.95),
        "trial_ms": meds,
        "spread": spread,
        "noisy": spread > NOISY_SPREAD,
    }


# ---------------------------------------------------------------- environment
def _version(mod: str):
    try:
        from importlib.metadata import version

        return version(mod)
    except Exception:
        return None


def environment(device: str = "cuda") -> dict:
    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "versions": {
            p: _version(p)
            for p in ("triton", "helion", "nvidia-cutlass-dsl", "quack-kernels", "liger-kernel", "tritonbench")
        },
        "host": platform.node(),
    }
    if device == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(
            gpu=props.name,
            sm_count=props.multi_processor_count,
            capability=f"{props.major}.{props.minor}",
            memory_gib=round(props.total_memory / 2**30, 1),
        )
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True, timeout=20
            )
            env["driver"] = out.stdout.strip().splitlines()[0] if out.stdout.strip() else None
        except Exception:
            env["driver"] = None
    else:
        env["gpu"] = "cpu"
    env["git_commit"] = git_commit()
    return env


def git_commit() -> str | None:
    """The checkout's commit (``-dirty`` with uncommitted changes); NORMBENCH_COMMIT where the tree
    is a copy without git history (as on the lent GPU machine)."""
    if os.environ.get("NORMBENCH_COMMIT"):
        return os.environ["NORMBENCH_COMMIT"]
    root = Path(__file__).resolve().parent.parent
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        commit = out.stdout.strip()
        if out.returncode != 0 or not all(c in "0123456789abcdef" for c in commit) or len(commit) < 7:
            return None
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, timeout=10)
        return f"{commit}{'-dirty' if dirty.stdout.strip() else ''}" if commit else None
    except Exception:
        return os.environ.get("NORMBENCH_COMMIT")


def slug(text: str) -> str:
    return "".join(c.lower() if c.isalnum() else "-" for c in text).strip("-").replace("--", "-")


# ---------------------------------------------------------------- the run
# What every results.jsonl line must hold for `rank`, `report`, `merge` and `--resume` to use it.
ROW_FIELDS = {"impl": str, "dsl": str, "op": str, "direction": str, "shape_set": str, "shape": str, "M": int, "N": int, "dtype": str, "status": str}
ROW_STATUSES = ("ok", "failed", "error", "skip")


def read_meta(path: Path) -> dict:
    """A benchmark folder's meta.json; a one-line ValueError naming the file (and line) otherwise."""
    path = Path(path)
    text = _read_text(path, "meta.json")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: line {e.lineno}: not valid JSON ({e.msg})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object (meta.json), got {_json_kind(data)}")
    runs = data.get("runs", [])
    if not isinstance(runs, list) or not all(isinstance(r, dict) for r in runs):
        raise ValueError(f"{path}: 'runs' must be a list of JSON objects")
    for r in runs:
        if not isinstance(r.get("copy_bandwidth") or {}, dict) or not _number_or_none((r.get("copy_bandwidth") or {}).get("tbps")):
            raise ValueError(f"{path}: a run's 'copy_bandwidth' must be an object with a number 'tbps'")
    if not _number_or_none(data.get("copy_bandwidth_tbps")):
        raise ValueError(f"{path}: 'copy_bandwidth_tbps' must be a number, got {data['copy_bandwidth_tbps']!r}")
    return data


def _number_or_none(v) -> bool:
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))


def _read_text(path: Path, what: str) -> str:
    if path.is_dir():
        raise ValueError(f"{path}: is a directory, not a {what} file")
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None


def _json_kind(v) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(type(v), "a number")


def _row_problem(row) -> str | None:
    if not isinstance(row, dict):
        return f"expected a JSON object (one benchmark point), got {_json_kind(row)}"
    for key, typ in ROW_FIELDS.items():
        if key not in row:
            return f"not a benchmark point: no '{key}'"
        if not isinstance(row[key], typ) or isinstance(row[key], bool):
            return f"'{key}' is {_json_kind(row[key])}, expected {'an integer' if typ is int else 'a string'}"
    if row["status"] not in ROW_STATUSES:
        return f"unknown status '{row['status']}' (expected {', '.join(ROW_STATUSES)})"
    for key in ("ms", "tbps", "frac_roofline"):
        v = row.get(key)
        if not _number_or_none(v) or (v is not None and not v > 0):
            return f"'{key}' must be a positive number or null, got {v!r}"
    if row["status"] == "ok" and row.get("ms") is None:
        return "status 'ok' without a time ('ms')"
    return None


def read_results(path: Path) -> tuple[list[dict], int | None]:
    """The points of a results.jsonl and the number of a cut-off last line (None if there is none).

    An interrupted run can leave only its last line unfinished (no newline, not valid JSON): that
    line is left out and its number returned. Any other line that is not a benchmark point is a
    ValueError naming the file and the line; nothing is dropped silently."""
    path = Path(path)
    text = _read_text(path, "results.jsonl")
    lines = text.split("\n")
    rows, cut = [], None
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            if i == len(lines) and not text.endswith("\n"):
                cut = i
                continue
            raise ValueError(f"{path}: line {i}: not valid JSON ({e.msg})") from None
        problem = _row_problem(row)
        if problem:
            raise ValueError(f"{path}: line {i}: {problem}")
        rows.append(row)
    return rows, cut


def _end_with_complete_line(path: Path) -> None:
    """Before appending: cut a line an interrupted run left unfinished (load_results has said so),
    or end a complete last line with its newline; every other byte stays as it was."""
    text = path.read_text()
    if not text or text.endswith("\n"):
        return
    head, _, last = text.rpartition("\n")
    try:
        json.loads(last)
        path.write_text(text + "\n")
    except json.JSONDecodeError:
        path.write_text(head + "\n" if head else "")


def load_results(path: Path, note=None) -> list[dict]:
    """The points of ``path`` ([] when it does not exist); a cut-off last line is left out with a
    one-line note (to stderr, or to ``note``)."""
    path = Path(path)
    if not path.exists():
        return []
    rows, cut = read_results(path)
    if cut:
        msg = f"{path}: line {cut} is cut off (an interrupted run) and is left out"
        (note or (lambda m: print(f"normbench: note: {m}", file=sys.stderr)))(msg)
    return rows


def point_key(d: dict) -> tuple:
    return (d["impl"], d["op"], d["direction"], d["shape"], d["dtype"], d.get("weights", "same"))


def planned_key(t: tuple) -> tuple:
    """``point_key`` of a point ``plan`` returns, before it is measured."""
    impl, op, direction, _set, shape, dtype, weights = t
    return (impl.name, op, direction, shape.label, dtype, weights)


def plan(impls, ops, directions, shape_sets, dtypes, weights=("same",)) -> list[tuple]:
    """(impl, op, direction, set name, shape, dtype, weights) per point; fp32 parameters beside fp32
    x are the "same" variant, not a point of their own."""
    todo = []
    for set_name, shapes in shape_sets:
        for shape in shapes:
            for op in ops:
                for direction in directions:
                    for dtype in dtypes:
                        for w in weights:
                            if w == "fp32" and dtype == "fp32":
                                continue
                            todo += [(impl, op, direction, set_name, shape, dtype, w) for impl in impls if op in impl.ops]
    return todo


def callables(k, op: str, direction: str, case: dict):
    """A zero-argument callable running ``direction`` (fwd | bwd | fwdbwd) of ``op`` on ``case``
    through the contract functions directly (no autograd overhead): what the benchmark times. The
    op record wires the backward: its arguments are the case's tensors and one forward run's
    outputs (statistics, residual_out), computed up front for ``bwd``."""
    rec = get_op(op)
    fwd, bwd = getattr(k, rec.function("fwd")), getattr(k, rec.function("bwd"))
    fwd_args = rec.fwd_call(case)
    if direction == "fwd":
        return lambda: fwd(*fwd_args)
    if direction == "bwd":
        bwd_args = rec.bwd_call(case, fwd(*fwd_args))
        return lambda: bwd(*bwd_args)

    def both():
        return bwd(*rec.bwd_call(case, fwd(*fwd_args)))

    return both


def config_source(impl: Implementation, op: str, directions, n: int, dtype: str, device) -> str:
    """The implementation's own account of where its launch configs come from (its
    ``config_source`` hook: tuned on this GPU, borrowed, heuristic), per direction."""
    src = impl.hook("config_source")
    if src is None:
        return ""
    try:
        return "; ".join(f"{d}: {src(op, d, n, dtype, torch.device(device))}" for d in directions)
    except Exception as e:  # provenance is a label: it never fails a point
        return f"unknown ({type(e).__name__}: {e})"


def record_timing(p: Point, fn, timer: CudaTimer) -> None:
    """Time ``fn`` (already run once: compiled and warm) into ``p``: the trials' summary, whether
    CUDA-graph replay was used (the graph shape sets), and TB/s of the main bytes."""
    trials, p.graph = timer.time(fn, graph=p.shape_set in GRAPH_SHAPE_SETS)
    s = summarize(trials)
    p.ms, p.ms_p95, p.trial_ms, p.spread, p.noisy = s["ms"], s["ms_p95"], s["trial_ms"], s["spread"], s["noisy"]
    p.tbps = tbps(p.bytes_main, p.ms)


def measure_point(impl: Implementation, op, direction, set_name, shape: Shape, dtype, device, timer, seed=0, weights="same") -> Point:
    p = Point(impl.name, impl.dsl, impl.external, op, direction, set_name, shape.label, shape.m, shape.n, dtype, weights)
    # fp32 parameters (the offset variant's weight is folded to fp32; its bias, kept in x's dtype,
    # is counted at 4 bytes too: extra bytes only, never in TB/s)
    param_size = 4 if weights != "same" else None
    b = bytes_moved(op, direction, shape.m, shape.n, DTYPES[dtype].itemsize, param_size=param_size)
    p.bytes_main, p.bytes_extra = b.main, b.extra
    why = impl.unavailable(device)
    if why is None and dtype not in impl.dtypes:
        why = f"does not support {dtype}"
    if why:
        p.reason = why
        return p
    try:
        k = impl.kernels(device)
        case = make_case(op, shape, DTYPES[dtype], device, seed, weights=weights)
        t0 = time.perf_counter()
        fn = callables(k, op, direction, case)
        fn()
        timer.sync()
        p.compile_s = time.perf_counter() - t0
        checks = ("fwd", "bwd") if direction == "fwdbwd" else (direction,)
        for d in checks:
            r = run_check(impl, op, d, shape, dtype, device, seed=seed + 1, kernels=k, weights=weights)
            if not r.passed:
                p.status = "failed" if r.status == "fail" else "error"
                p.check = f"{d}: {r.summary()}"
                return p
        p.check = "pass"
        p.config = config_source(impl, op, checks, shape.n, dtype, device)
        record_timing(p, fn, timer)
        p.status = "ok"
    except Exception as e:  # one failing implementation never stops the run
        p.status = "error"
        p.reason = describe_error(e)
        if isinstance(e, torch.cuda.OutOfMemoryError):
            torch.cuda.empty_cache()
        if os.environ.get("NORMBENCH_DEBUG"):
            traceback.print_exc()
    return p


def run_bench(
    impls: list[Implementation],
    ops,
    directions,
    shape_sets: list[tuple[str, tuple[Shape, ...]]],
    dtypes,
    out_dir: Path,
    resume: bool = False,
    device: str = "cuda",
    timer=None,
    copy_bandwidth: dict | None = None,
    command: str = "",
    progress: bool = True,
    weights=("same",),
) -> list[dict]:
    """Run the benchmark, appending to ``out_dir/results.jsonl``; returns all rows of the file."""
    out_dir.mkdir(parents=True, exist_ok=True)
    results_path = out_dir / "results.jsonl"
    meta_path = out_dir / "meta.json"
    timer = timer or CudaTimer()
    if not resume and results_path.exists():
        results_path.unlink()
    kept = load_results(results_path) if resume else []
    meta = read_meta(meta_path) if (resume and meta_path.exists()) else {}
    if resume and results_path.exists():
        _end_with_complete_line(results_path)
    done = {point_key(r) for r in kept}
    if copy_bandwidth is None:
        from .roofline import measure_copy_bandwidth

        copy_bandwidth = measure_copy_bandwidth()
    runs = meta.get("runs", [])
    env = environment(device)
    run_index = len(runs)
    # per run, so a folder that several runs (or `normbench merge`) wrote says which code measured which point
    runs.append({"command": command, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "copy_bandwidth": copy_bandwidth,
                 "git_commit": env["git_commit"], "torch": env["torch"], "versions": env["versions"]})  # fmt: skip
    meta.update(env)
    meta["runs"] = runs
    meta["copy_bandwidth_tbps"] = copy_bandwidth["tbps"]
    meta["method"] = {"trials": TRIALS, "noisy_spread": NOISY_SPREAD, "graph_calls": GRAPH_CALLS, "graph_shape_sets": GRAPH_SHAPE_SETS}
    meta_path.write_text(json.dumps(meta, indent=2))

    todo = [t for t in plan(impls, ops, directions, shape_sets, dtypes, weights) if planned_key(t) not in done]
    roof = copy_bandwidth["tbps"]
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    cols = (TextColumn("[bold]bench"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("{task.description}"))
    with Progress(*cols, disable=not progress, transient=False) as bar, results_path.open("a") as fh:
        task = bar.add_task("", total=len(todo))
        last_shape = None
        for impl, op, direction, set_name, shape, dtype, weights_variant in todo:
            bar.update(task, description=f"{impl.name} {op} {direction} {shape.label} {dtype} {weights_variant}")
            if shape != last_shape and device == "cuda":
                torch.cuda.empty_cache()
                last_shape = shape
            p = measure_point(impl, op, direction, set_name, shape, dtype, device, timer, weights=weights_variant)
            if p.tbps is not None and roof:
                p.frac_roofline = p.tbps / roof
            fh.write(json.dumps({**asdict(p), "run": run_index}) + "\n")
            fh.flush()
            bar.advance(task)
    meta["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    meta_path.write_text(json.dumps(meta, indent=2))
    return load_results(results_path)


def merge_results(dest: Path, sources: list[Path], commit: str | None = None) -> list[dict]:
    """Fold benchmark folders measured elsewhere (another run, a re-run of one implementation)
    into ``dest``: their runs are appended to ``dest``'s, and each of their points replaces the point
    with the same key (implementation, op, direction, shape, dtype, weights) in ``dest``. Points keep their
    own run's copy bandwidth, so every fraction stays the one measured next to it. ``commit`` names
    the commit holding the code a source measured where its meta records none (a tree copied
    without git history) or a dirty tree (uncommitted changes, committed since); the recorded value
    is kept as ``measured_tree``."""
    dest = Path(dest)
    meta_path, results_path = dest / "meta.json", dest / "results.jsonl"
    if not results_path.exists() or not meta_path.exists():
        raise ValueError(f"{dest} is not a benchmark folder (no results.jsonl and meta.json)")
    meta, rows = read_meta(meta_path), load_results(results_path)
    for src in map(Path, sources):
        if src.resolve() == dest.resolve():
            raise ValueError(f"{src} is the folder being merged into")
        if not (src / "results.jsonl").exists() or not (src / "meta.json").exists():
            raise ValueError(f"{src} is not a benchmark folder (no results.jsonl and meta.json)")
        smeta, srows = read_meta(src / "meta.json"), load_results(src / "results.jsonl")
        if smeta.get("gpu") != meta.get("gpu"):
            raise ValueError(f"{src} was measured on {smeta.get('gpu')!r}, {dest} on {meta.get('gpu')!r}: results of different GPUs are never merged")
        offset = len(meta.get("runs", []))
        sruns = smeta.get("runs", [])
        merged = []
        for i, r in enumerate(sruns):
            # the folder-level commit is its newest run's: an older run that recorded none stays unknown
            recorded = r.get("git_commit") or (smeta.get("git_commit") if i == len(sruns) - 1 else None)
            if commit and (not recorded or recorded.endswith("-dirty")):
                r = {**r, "git_commit": commit, "measured_tree": recorded}
            merged.append({**r, "git_commit": r.get("git_commit") or recorded, "merged_from": str(src)})
        meta["runs"] = meta.get("runs", []) + merged
        for r in srows:
            # points written before runs were numbered name none: only a one-run folder says whose they are
            if "run" in r:
                r["run"] = offset + r["run"]
            elif len(sruns) == 1:
                r["run"] = offset
        new = {point_key(r) for r in srows}
        rows = [r for r in rows if point_key(r) not in new] + srows
    results_path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    meta_path.write_text(json.dumps(meta, indent=2))
    return rows


def default_out_dir(gpu: str) -> Path:
    return Path("reports") / slug(gpu) / time.strftime("%Y-%m-%d", time.gmtime())

