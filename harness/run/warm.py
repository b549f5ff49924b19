"""`normbench warm`: run each point's first call (compilation and autotuning) in parallel processes,
so that a later `normbench bench` finds every search done in the on-disk caches.

Why: torch.compile's max-autotune searches each shape's reduction kernels one candidate after
another (coordinate descent: compile a config, time it, step), 30-70 s per backward point on an
H100 / H200, and almost all of that is the CPU compiling candidates while the GPU waits. One
process per point-queue overlaps those compiles; only the candidates' timings need the GPU, and
two of them running at once would skew which config wins. So every timing Inductor's autotuner
takes (``CachingAutotuner.bench``: the max-autotune sweep and each coordinate-descent trial), and
every input a worker draws on the GPU, holds an exclusive lock on one file that all workers
share: the searches compile side by side and time one at a time, as they would alone.

What it leaves: Inductor's and Triton's on-disk caches (``TORCHINDUCTOR_CACHE_DIR``,
``TRITON_CACHE_DIR``: the defaults, or whatever the caller sets for both commands), with each
kernel's chosen config. A `normbench bench` of the same points then compiles from them: its
``compile_s`` is a cache hit, not the search, so ``warm.jsonl`` (written here, one line per point)
keeps each point's search seconds, with the host's 1-minute load average when it ended. Nothing
is checked or timed here: correctness and timing are `normbench bench`'s, in one process, with the
GPU to itself.

How close a warmed search comes to one alone (compile-max-autotune, 8 workers on 16 host cores,
fp16 sweep; ``compile-max-autotune-sequential-control/`` in both GPUs' 2026-11-24 report folders):
17 of 20 points within 1.2 points of the fraction of copy bandwidth the search alone reached, one
2.2 points lower (H100), three on the H200 (all at N = 7168) 17-24 points lower. The lock keeps
the candidates' timings apart on the GPU but not on the host, which meanwhile compiles for the
other workers; fewer ``jobs`` leave it quieter, and one is the search alone.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from pathlib import Path

_LOCK_PATH: str | None = None
_LOCK_DEPTH = 0


@contextlib.contextmanager
def gpu_exclusive():
    """Hold the workers' shared lock (re-entrant within a process; a no-op outside a warm worker)."""
    global _LOCK_DEPTH
    if _LOCK_PATH is None or _LOCK_DEPTH:
        _LOCK_DEPTH += 1
        try:
            yield
        finally:
            _LOCK_DEPTH -= 1
        return
    with open(_LOCK_PATH, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        _LOCK_DEPTH += 1
        try:
            yield
        finally:
            _LOCK_DEPTH -= 1
            fcntl.flock(f, fcntl.LOCK_UN)


def exclusive_method(cls, name: str) -> None:
    """Make ``cls.name`` run under ``gpu_exclusive`` (once per class)."""
    original = getattr(cls, name)
    if getattr(original, "_normbench_exclusive", False):
        return

    def locked(*args, **kwargs):
        with gpu_exclusive():
            return original(*args, **kwargs)

    locked._normbench_exclusive = True
    setattr(cls, name, locked)


def _inductor_autotuner():
    """Inductor times every autotuning candidate through ``CachingAutotuner.bench`` (torch 2.11 and
    2.13 alike). Without it a parallel search would time candidates side by side: refuse."""
    try:
        from torch._inductor.runtime.triton_heuristics import CachingAutotuner
    except ImportError as e:
        raise ValueError(f"normbench warm needs torch's Inductor with Triton ({e})") from None
    if not callable(getattr(CachingAutotuner, "bench", None)):
        raise ValueError("this torch's Inductor has no CachingAutotuner.bench to keep the workers' timings apart: warm cannot run here")
    return CachingAutotuner


def _lock_inductor_timings() -> None:
    exclusive_method(_inductor_autotuner(), "bench")


def _init_worker(lock_path: str) -> None:
    global _LOCK_PATH
    _LOCK_PATH = lock_path
    _lock_inductor_timings()


def warm_point(impl_name: str, op: str, direction: str, shape, dtype: str, weights: str, device: str) -> dict:
    """One point's first call, as `normbench bench` makes it (same inputs, same callables)."""
    import torch

    from harness.registry import get
    from harness.run.bench import callables
    from harness.spec.contract import DTYPES
    from harness.spec.errors import describe_error
    from harness.spec.inputs import make_case

    row = {"impl": impl_name, "op": op, "direction": direction, "shape": shape.label, "dtype": dtype, "weights": weights}
    impl = get(impl_name)
    t0 = time.perf_counter()
    try:
        k = impl.kernels(device)
        with gpu_exclusive():
            case = make_case(op, shape, DTYPES[dtype], device, 0, weights=weights)
        callables(k, op, direction, case)()
        if device == "cuda":
            torch.cuda.synchronize()
        row["status"] = "ok"
    except Exception as e:  # one point that does not compile never stops the others
        row["status"] = "error"
        row["reason"] = describe_error(e)
    row["search_s"] = round(time.perf_counter() - t0, 2)
    # the host's CPU load as the search ends, beside its cores: whether the searches of a fan-out
    # wait for the CPU that compiles their candidates (docs/scale-out.md)
    row["load_1m"], row["cores"] = round(os.getloadavg()[0], 1), os.cpu_count()
    return row


def warm_plan(impls, ops, directions, shape_sets, dtypes, out_dir: Path, device: str = "cuda", weights=("same",)) -> list[tuple]:
    """The points ``run_warm`` searches (``bench.plan``'s tuples): those that run on ``device``,
    less those ``out_dir``'s results already hold (a bench --resume skips them)."""
    from harness.results.store import load_results, point_key
    from harness.run.bench import plan, planned_key

    results = Path(out_dir) / "results.jsonl"
    done = {point_key(r) for r in load_results(results)} if results.is_file() else set()
    return [
        t for t in plan(impls, ops, directions, shape_sets, dtypes, weights)
        if t[0].unavailable(device) is None and t[5] in t[0].dtypes and planned_key(t) not in done
    ]  # fmt: skip


def run_warm(impls, ops, directions, shape_sets, dtypes, out_dir: Path, jobs: int, device: str = "cuda", weights=("same",), progress: bool = True,
             only: set | None = None, gpu_id: str | None = None) -> list[dict]:  # fmt: skip
    """Warm every planned point over ``jobs`` processes; rows of ``out_dir/warm.jsonl`` (appended).
    ``only``: the keys (``bench.planned_key``) of the points to warm (a fan-out's shard); ``gpu_id``
    is recorded with every row (default: ``environment.gpu_id``)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from harness.run.bench import planned_key
    from harness.run.environment import gpu_id as environment_gpu_id

    out_dir.mkdir(parents=True, exist_ok=True)
    todo = [t for t in warm_plan(impls, ops, directions, shape_sets, dtypes, out_dir, device, weights) if only is None or planned_key(t) in only]
    gpu_id = gpu_id if gpu_id is not None else environment_gpu_id(device)
    if not todo:
        return []
    _inductor_autotuner()  # refuse here, in one line, rather than in every worker
    jobs = min(jobs, len(todo))
    lock = out_dir / ".warm.lock"
    lock.touch()
    # the costly points first, so that the last worker does not start a 60 s search alone
    todo.sort(key=lambda t: (t[2] == "fwd", -t[4].n))
    rows = []
    cols = (TextColumn("[bold]warm"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("{task.description}"))
    # spawn: each worker gets a CUDA context of its own (a forked one cannot)
    with (
        ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn"), initializer=_init_worker, initargs=(str(lock),)) as pool,
        Progress(*cols, disable=not progress, transient=False) as bar,
        (out_dir / "warm.jsonl").open("a") as fh,
    ):
        task = bar.add_task("", total=len(todo))
        futures = [pool.submit(warm_point, impl.name, op, d, shape, dtype, w, device) for impl, op, d, _set, shape, dtype, w in todo]
        try:
            for f in as_completed(futures):
                row = {**f.result(), "gpu_id": gpu_id}
                rows.append(row)
                fh.write(json.dumps(row) + "\n")
                fh.flush()
                bar.update(task, advance=1, description=f"{row['impl']} {row['op']} {row['direction']} {row['shape']} {row['dtype']}: {row['search_s']} s")
        except BaseException:  # Ctrl-C or a dead worker: drop the queued points, not wait for them
            pool.shutdown(wait=False, cancel_futures=True)
            raise
    with contextlib.suppress(OSError):
        os.unlink(lock)
    return rows
