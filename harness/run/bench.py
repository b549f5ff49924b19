"""`normbench bench`: every implementation x op x direction x shape x dtype, checked, then timed
against the copy-bandwidth roofline measured in the same run.

Method (also in the README):
* correctness first: the point's fwd and/or bwd are checked against fp64 (harness.run.checker); a point
  that fails is recorded as failed, never timed, never ranked;
* the first call (JIT compilation, autotuning, dynamo tracing) is timed separately as ``compile_s``;
* timing with CUDA events through ``triton.testing.do_bench``, which flushes the L2 (writes a 256 MB
  buffer) before every repetition; 3 independent trials, each a median over its repetitions; the
  point's time is the median of all repetitions, with p95 and the spread of the trial medians
  ((max - min) / min), flagged noisy above 5%;
* decode shapes (launch-bound) are timed as CUDA-graph replays of 20 calls (L2 not flushed: their
  inputs are under 2 MB and stay cache-resident, as they do in a real decode step);
* other points that move at most 256 MB (kernels of tens of microseconds, which do_bench would time
  as the host's launch speed) as graph replays with the L2 flush in the graph before every call and
  the flushes' own replay subtracted (harness.run.timer);
* results are appended to ``results.jsonl`` as they come, so an interrupted run keeps what it measured
  and ``--resume`` skips points already there; ``--retry-noisy`` with it measures again the points of
  the selection that are there but noisy (a noisy timing is no result).
"""
from __future__ import annotations

import json
import os
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from harness.results.store import (
    PROFILE_FILE,
    _end_with_complete_line,
    folder_lock,
    meta_text,
    note_cut,
    point_key,
    read_meta,
    read_results,
    results_text,
    write_atomically,
)
from harness.run.checker import run_check
from harness.run.environment import environment, slug
from harness.run.environment import gpu_id as environment_gpu_id
from harness.run.timer import FLUSHED_GRAPH_MAX_BYTES, GRAPH_CALLS, GRAPH_SHAPE_SETS, NOISY_SPREAD, TRIALS, CudaTimer, summarize
from harness.spec.contract import DTYPES, Implementation
from harness.spec.errors import describe_error
from harness.spec.inputs import make_case
from harness.spec.ops import get_op
from harness.spec.roofline import bytes_moved, tbps
from harness.spec.shapes import Shape


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
    weights: str = "same"  # the parameters' variant (harness.spec.ops.WEIGHTS); rows written before it: "same"
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
    timing: str = ""  # events (do_bench), graph (decode: L2 warm) or graph+flush (short kernels)
    bytes_main: int = 0
    bytes_extra: int = 0
    tbps: float | None = None
    frac_roofline: float | None = None
    config: str = ""  # where the launch config came from, for implementations that pin them per GPU
    gpu_id: str | None = None  # which GPU of the host measured it (harness.run.environment.gpu_id)

    @property
    def key(self) -> tuple:
        return (self.impl, self.op, self.direction, self.shape, self.dtype, self.weights)


def planned_key(t: tuple) -> tuple:
    """``point_key`` of a point ``plan`` returns, before it is measured."""
    impl, op, direction, _set, shape, dtype, weights = t
    return (impl.name, op, direction, shape.label, dtype, weights)


def plan(impls, ops, directions, shape_sets, dtypes, weights=("same",)) -> list[tuple]:
    """(impl, op, direction, set name, shape, dtype, weights) per point; fp32 parameters beside fp32
    x are the "same" variant, not a point of their own; a direction an op does not have (the FP8
    ops' bwd) and a shape it does not take (N not a multiple of its group) are no points."""
    todo = []
    for set_name, shapes in shape_sets:
        for shape in shapes:
            for op in ops:
                rec = get_op(op)
                if rec.unsupported(shape.n):
                    continue
                for direction in (d for d in directions if rec.offers(d)):
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
    fwd = getattr(k, rec.function("fwd"))
    fwd_args = rec.fwd_call(case)
    if direction == "fwd":
        return lambda: fwd(*fwd_args)
    bwd = getattr(k, rec.function("bwd"))
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


def timing_mode(shape_set: str, bytes_main: int) -> str:
    """How a point is timed: graph replays with a warm L2 for the launch-bound sets (decode), graph
    replays with the flush in the graph for short kernels (at most FLUSHED_GRAPH_MAX_BYTES moved),
    else do_bench's events."""
    if shape_set in GRAPH_SHAPE_SETS:
        return "graph"
    if 0 < bytes_main <= FLUSHED_GRAPH_MAX_BYTES:
        return "graph+flush"
    return "events"


def record_timing(p: Point, fn, timer: CudaTimer) -> None:
    """Time ``fn`` (already run once: compiled and warm) into ``p``: the trials' summary, whether
    CUDA-graph replay was used and how (``timing_mode``), and TB/s of the main bytes."""
    mode = timing_mode(p.shape_set, p.bytes_main)
    trials, used = timer.time(fn, graph={"events": False, "graph": True, "graph+flush": "flushed"}[mode])
    p.graph = bool(used)
    p.timing = mode if p.graph else "events"
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
    only: set | None = None,
    gpu_id: str | None = None,
    run_info: dict | None = None,
    retry_noisy: bool = False,
) -> list[dict]:
    """Run the benchmark, appending to ``out_dir/results.jsonl``; returns the folder's meta and all
    its rows (those kept by ``resume`` and those measured now), for the report to take as they are.

    The folder is held for the whole run (``folder_lock``): a second `bench` or a `merge` of it is
    refused while this one runs, so meta.json, read under the lock, records every run. ``resume``
    refuses a folder measured on another GPU; without it, the run starts the folder over, removing
    what the last one derived from its points (report, CSV, plots, counters).

    ``only``: the keys (``planned_key``) of the planned points to run, the others left out (a
    fan-out's shard, harness.run.fanout); ``gpu_id``: recorded with every point and the run
    (default: ``environment.gpu_id``); ``run_info``: more fields of the run's record in meta.json
    (a shard's number and host); ``retry_noisy`` (with ``resume``): the folder's noisy points of this
    selection are measured again, their rows removed before the run starts (an interrupted run leaves
    them to the next ``resume``)."""
    if retry_noisy and not resume:
        raise ValueError("retry_noisy measures again the noisy points of a folder: it goes with resume")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    gpu_id = gpu_id if gpu_id is not None else environment_gpu_id(device)
    with folder_lock(out_dir, "bench"):
        return _run_bench(impls, ops, directions, shape_sets, dtypes, out_dir, resume, device, timer, copy_bandwidth,
                          command, progress, weights, only, gpu_id, run_info or {}, retry_noisy)  # fmt: skip


# What a run, `report` and `profile` write into a benchmark folder from its points; a run that
# starts the folder over removes them, so no report shows another run's counters or plots.
DERIVED = ("results.jsonl", "meta.json", "results.csv", "report.md", PROFILE_FILE, "plot-*.png")


def _start_over(out_dir: Path) -> None:
    for pattern in DERIVED:
        for path in out_dir.glob(pattern):
            if path.is_file():
                path.unlink()


def noisy_in(rows: list[dict], planned: list[tuple]) -> set:
    """The keys of ``rows`` marked noisy that ``planned`` (``plan``'s points) would measure."""
    keys = {planned_key(t) for t in planned}
    return {point_key(r) for r in rows if r.get("noisy") and point_key(r) in keys}


def _run_bench(impls, ops, directions, shape_sets, dtypes, out_dir: Path, resume, device, timer, copy_bandwidth, command,
               progress, weights, only, gpu_id, run_info, retry_noisy=False):  # fmt: skip
    results_path = out_dir / "results.jsonl"
    meta_path = out_dir / "meta.json"
    timer = timer or CudaTimer()
    env = environment(device)
    kept, cut = read_results(results_path) if (resume and results_path.exists()) else ([], None)
    meta = read_meta(meta_path) if (resume and meta_path.exists()) else {}
    if resume and meta.get("gpu") not in (None, env["gpu"]):
        raise ValueError(f"{out_dir} was measured on {meta['gpu']}, this is {env['gpu']}: --resume adds points of the same GPU only (use another --out)")
    note_cut(results_path, cut)
    if resume and results_path.exists():
        _end_with_complete_line(results_path)
    if not resume:
        _start_over(out_dir)
    planned = plan(impls, ops, directions, shape_sets, dtypes, weights)
    again = noisy_in(kept, planned) if retry_noisy else set()
    if again:
        kept = [r for r in kept if point_key(r) not in again]
        write_atomically({results_path: results_text(kept)})
    done = {point_key(r) for r in kept}
    if copy_bandwidth is None:
        from harness.run.timer import measure_copy_bandwidth

        copy_bandwidth = measure_copy_bandwidth()
    runs = meta.get("runs", [])
    run_index = len(runs)
    # per run, so a folder that several runs (or `normbench merge`) wrote says which code measured which point
    runs.append({"command": command, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "copy_bandwidth": copy_bandwidth,
                 "git_commit": env["git_commit"], "torch": env["torch"], "versions": env["versions"], "gpu_id": gpu_id, **run_info})  # fmt: skip
    meta.update(env)
    meta["runs"] = runs
    meta["copy_bandwidth_tbps"] = copy_bandwidth["tbps"]
    meta["method"] = {"trials": TRIALS, "noisy_spread": NOISY_SPREAD, "graph_calls": GRAPH_CALLS, "graph_shape_sets": GRAPH_SHAPE_SETS,
                      "flushed_graph_max_bytes": FLUSHED_GRAPH_MAX_BYTES}
    write_atomically({meta_path: meta_text(meta)})

    todo = [t for t in planned if planned_key(t) not in done and (only is None or planned_key(t) in only)]
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
            p.gpu_id = gpu_id
            if p.tbps is not None and roof:
                p.frac_roofline = p.tbps / roof
            row = {**asdict(p), "run": run_index}
            fh.write(json.dumps(row) + "\n")
            fh.flush()
            kept.append(row)
            bar.advance(task)
    meta["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    write_atomically({meta_path: meta_text(meta)})
    return meta, kept


def default_out_dir(gpu: str) -> Path:
    """Where a run goes unless told: ``runs/<gpu>/<date>`` (not committed). Its points join the
    GPU's current report with ``normbench merge reports/<gpu> runs/<gpu>/<date>``."""
    return Path("runs") / slug(gpu) / time.strftime("%Y-%m-%d", time.gmtime())
