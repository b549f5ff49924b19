"""`normbench warm`: the points' first calls spread over processes, their GPU timings one at a time."""

import json
import time
from multiprocessing import get_context

from harness.run import warm
from harness.registry import get
from harness.spec.shapes import Shape


def _hold(lock_path: str, seconds: float) -> tuple[float, float]:
    """In a fresh process: take the workers' lock, sleep, and say when it was held."""
    warm._LOCK_PATH = lock_path
    with warm.gpu_exclusive():
        start = time.monotonic()
        time.sleep(seconds)
        return start, time.monotonic()


def test_the_lock_keeps_processes_out_of_each_other(tmp_path):
    lock = tmp_path / "lock"
    lock.touch()
    with get_context("spawn").Pool(3) as pool:
        spans = sorted(pool.starmap(_hold, [(str(lock), 0.3)] * 3))
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert start >= end, spans


def test_exclusive_method_locks_once_and_reenters(tmp_path, monkeypatch):
    lock = tmp_path / "lock"
    lock.touch()
    monkeypatch.setattr(warm, "_LOCK_PATH", str(lock))
    depths = []

    class Timer:
        def bench(self, inner=False):
            depths.append(warm._LOCK_DEPTH)
            return self.bench(inner=False) if inner else 1.5

    warm.exclusive_method(Timer, "bench")
    first = Timer.bench
    warm.exclusive_method(Timer, "bench")  # a second worker init does not wrap it twice
    assert Timer.bench is first
    # the nested call re-enters the lock this process holds instead of waiting on itself
    assert Timer().bench(inner=True) == 1.5
    assert depths == [1, 2] and warm._LOCK_DEPTH == 0


def test_inductor_candidate_timings_are_locked(tmp_path, monkeypatch):
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    monkeypatch.setattr(CachingAutotuner, "bench", CachingAutotuner.bench)  # restored after the test
    monkeypatch.setattr(warm, "_LOCK_PATH", None)
    warm._init_worker(str(tmp_path / "lock"))
    assert getattr(CachingAutotuner.bench, "_normbench_exclusive", False)


def test_warm_runs_every_point_once_and_records_it(tmp_path):
    shapes = (Shape((3, 40)), Shape((2, 96)))
    impls = [get("eager")]
    rows = warm.run_warm(impls, ["rmsnorm", "layernorm"], ["fwd", "bwd"], [("custom", shapes)], ["fp32"], tmp_path, jobs=2, device="cpu", progress=False)
    assert sorted((r["op"], r["direction"], r["shape"]) for r in rows) == sorted(
        (op, d, s.label) for op in ("rmsnorm", "layernorm") for d in ("fwd", "bwd") for s in shapes
    )
    assert all(r["status"] == "ok" and r["search_s"] >= 0 for r in rows), rows
    assert all(r["load_1m"] >= 0 and r["cores"] >= 1 for r in rows), rows
    written = [json.loads(line) for line in (tmp_path / "warm.jsonl").read_text().splitlines()]
    assert written == rows
    assert not (tmp_path / ".warm.lock").exists()


def test_a_point_that_fails_is_recorded_and_the_rest_go_on(tmp_path):
    bad = Shape((2, 0))  # no row to normalise: the contract refuses it
    rows = warm.run_warm([get("eager")], ["rmsnorm"], ["fwd"], [("custom", (bad, Shape((2, 64))))], ["fp32"], tmp_path, jobs=1, device="cpu", progress=False)
    by_shape = {r["shape"]: r for r in rows}
    assert by_shape["2x64"]["status"] == "ok"
    assert by_shape["2x0"]["status"] == "error" and "nothing to normalize" in by_shape["2x0"]["reason"]


def test_points_the_folder_already_measured_are_not_warmed_again(tmp_path):
    measured = {"impl": "eager", "dsl": "eager", "external": False, "op": "rmsnorm", "direction": "fwd", "shape_set": "custom", "shape": "3x40",
                "M": 3, "N": 40, "dtype": "fp32", "weights": "same", "status": "ok", "ms": 0.01, "tbps": 0.1, "run": 0}  # fmt: skip
    (tmp_path / "results.jsonl").write_text(json.dumps(measured) + "\n")
    rows = warm.run_warm([get("eager")], ["rmsnorm"], ["fwd", "bwd"], [("custom", (Shape((3, 40)),))], ["fp32"], tmp_path, jobs=1, device="cpu", progress=False)
    assert [(r["direction"], r["shape"]) for r in rows] == [("bwd", "3x40")]


def test_nothing_to_warm_starts_no_worker(tmp_path, monkeypatch):
    def no_pool(*a, **k):
        raise AssertionError("a worker pool was started for no point")

    monkeypatch.setattr(warm, "ProcessPoolExecutor", no_pool)
    # cuTile runs on cuda only: on the CPU its points are not planned
    assert warm.run_warm([get("cutile")], ["rmsnorm"], ["fwd"], [("custom", (Shape((2, 64)),))], ["bf16"], tmp_path, jobs=4, device="cpu", progress=False) == []
