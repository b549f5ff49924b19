"""FlashInfer's forward norms as an external anchor: checked against normbench's fp64 reference and
timed against the copy bandwidth measured in the same run, but never ranked.

FlashInfer (``flashinfer.norm``) does not meet normbench's contract: its forwards return no rstd
(there is no backward to feed), ``fused_add_rmsnorm`` works in place, and it normalises the fp32 sum
x + residual before rounding it, where the contract normalises residual_out rounded to x's dtype.
So it is not an implementation (``impls/``) and never enters a ranking; this module measures what
its forwards deliver on normbench's own inputs, shapes, tolerances and bytes model:

    rmsnorm        flashinfer.norm.rmsnorm(x, w, eps) -> y                 vs rmsnorm, weights "same"/"fp32"
    add_rmsnorm    flashinfer.norm.fused_add_rmsnorm(x, residual, w, eps), in place:
                   residual <- x + residual (residual_out), x <- y        vs add_rmsnorm, "same"/"fp32"
    gemma_rmsnorm  flashinfer.norm.gemma_rmsnorm(x, w, eps) -> y, y = xhat * (1 + w)
                                                                           vs rmsnorm, weights "offset"

Every point is checked first (y, and residual_out for add_rmsnorm, against the fp64 reference of
the op record, with ``harness.spec.tolerances`` for the output dtype; rstd is not produced and not
checked); a point that fails or raises is recorded as failed / error with its reason and is not
timed. Passing points are timed like ``normbench bench`` (``harness.run.bench.CudaTimer``: do_bench,
3 trials, CUDA-graph replays for the decode set). Bytes are the op record's forward bytes model
(``harness.spec.roofline.bytes_moved``); TB/s counts the main bytes only. The in-place add is timed on
scratch copies made once, so the values drift over the repetitions (residual keeps accumulating):
a memory-bound kernel's time does not depend on them.

    python -m harness.tools.flashinfer_fwd [--out DIR] [--shapes sweep,decode] [--dtype bf16[,fp16]]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from harness.run.bench import Point, default_out_dir, record_timing
from harness.run.checker import compare, poisoned_allocations
from harness.run.environment import environment
from harness.run.timer import CudaTimer
from harness.spec.contract import DTYPES
from harness.spec.errors import describe_error
from harness.spec.inputs import make_case
from harness.spec.ops import get_op
from harness.spec.roofline import bytes_moved
from harness.spec.shapes import Shape, shape_set

IMPL = "flashinfer"
ROWS = ("y", "residual_out")  # the row outputs checked (rstd is not returned)


@dataclass(frozen=True)
class Variant:
    name: str  # FlashInfer's function in flashinfer.norm
    op: str  # normbench's op record: reference, inputs, bytes model
    weights: tuple[str, ...]  # the weight variants (harness.spec.ops.WEIGHTS) it is measured with


VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant("rmsnorm", "rmsnorm", ("same", "fp32")),
        Variant("fused_add_rmsnorm", "add_rmsnorm", ("same", "fp32")),
        Variant("gemma_rmsnorm", "rmsnorm", ("offset",)),
    )
}


@dataclass
class FiPoint(Point):
    """A benchmark point (``harness.run.bench.Point``) of a FlashInfer function."""

    function: str = ""  # FlashInfer's function in flashinfer.norm
    ranked: bool = False  # never: FlashInfer returns no rstd (not normbench's contract)
    tensors: list = field(default_factory=list)  # checker.TensorReport of y (and residual_out)
    traceback: str = ""

    @property
    def us(self) -> float | None:
        return None if self.ms is None else self.ms * 1e3


def new_point(variant: Variant, weights: str, set_name: str, shape: Shape, dtype: str, **fields) -> FiPoint:
    return FiPoint(IMPL, "external", True, variant.op, "fwd", set_name, shape.label, shape.m, shape.n, dtype, weights,
                   function=variant.name, **fields)  # fmt: skip


def load_flashinfer():
    """``flashinfer.norm`` (raises ImportError, or whatever its import raises)."""
    import flashinfer.norm as fi_norm

    return fi_norm


def flashinfer_version() -> str | None:
    try:
        import flashinfer

        return getattr(flashinfer, "__version__", None)
    except Exception:
        return None


def call(fi, variant: Variant, case: dict):
    """A zero-argument callable running ``variant`` on ``case``; returns {name: row output}.
    fused_add_rmsnorm runs on clones (it writes its inputs): y is the clone of x, residual_out the
    clone of residual."""
    x, w, eps = case["x"], case["weight"], case["eps"]
    if variant.name == "rmsnorm":
        return lambda: {"y": fi.rmsnorm(x, w, eps)}
    if variant.name == "gemma_rmsnorm":
        # FlashInfer adds the 1 itself: it gets the stored w (x's dtype), not the fp32 1 + w
        raw = case["raw_weight"]
        return lambda: {"y": fi.gemma_rmsnorm(x, raw, eps)}
    if variant.name == "fused_add_rmsnorm":
        residual = case["residual"]

        def run():
            y, h = x.clone(), residual.clone()
            fi.fused_add_rmsnorm(y, h, w, eps)
            return {"y": y, "residual_out": h}

        return run
    raise ValueError(f"unknown FlashInfer function '{variant.name}'")


def timed_call(fi, variant: Variant, case: dict):
    """What is timed: the call alone (fused_add_rmsnorm in place on scratch copies made once)."""
    if variant.name != "fused_add_rmsnorm":
        return call(fi, variant, case)
    y, h, w, eps = case["x"].clone(), case["residual"].clone(), case["weight"], case["eps"]
    return lambda: fi.fused_add_rmsnorm(y, h, w, eps)


def check_outputs(variant: Variant, case: dict, out: dict) -> list:
    """TensorReports of the row outputs against the op record's fp64 reference (its forward's
    row outputs: y, and residual_out for add_rmsnorm)."""
    rec = get_op(variant.op)
    ref = dict(zip((a.name for a in rec.fwd_outputs), rec.reference_fwd(*rec.fwd_call(case))))
    x = case["x"]
    reports = []
    for name in ROWS:
        if name not in ref:
            continue
        reports.append(compare(name, out.get(name), ref[name], x.dtype, x.shape))
    return reports


def clear_cuda_error() -> str | None:
    """Read (and so reset) the CUDA runtime's last error after a point raised. A launch FlashInfer
    refuses (cudaFuncSetAttribute over the shared-memory limit: fused_add_rmsnorm keeps a row of
    fp32 in shared memory) leaves it set, and the next torch launch would report it as its own."""
    if not torch.cuda.is_available():
        return None
    try:
        from cuda.bindings import runtime  # cuda-bindings (the GPU image has it)

        err = runtime.cudaGetLastError()
        err = err[0] if isinstance(err, tuple) else err
        return None if int(err) == 0 else str(err)
    except Exception:
        pass
    try:
        import ctypes

        for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
            try:
                code = ctypes.CDLL(name).cudaGetLastError()
                return None if code == 0 else f"cudaError {code}"
            except OSError:
                continue
    except Exception:
        pass
    return None


def check_point(fi, variant: Variant, shape: Shape, dtype: str, weights: str, device: str = "cuda", seed: int = 1):
    """(status, reports, error, traceback): "pass" | "fail" | "error". Never raises."""
    try:
        case = make_case(variant.op, shape, DTYPES[dtype], device, seed, weights=weights)
        with poisoned_allocations():  # an unwritten element of a fresh output stays NaN
            out = call(fi, variant, case)()
        if device == "cuda":
            torch.cuda.synchronize()
        reports = check_outputs(variant, case, out)
        return ("pass" if all(r.passed for r in reports) else "fail"), reports, "", ""
    except Exception as e:  # a crashing kernel is a result
        if isinstance(e, torch.cuda.OutOfMemoryError):
            torch.cuda.empty_cache()
        tb = traceback.format_exc(limit=6)
        if device == "cuda":
            pending = clear_cuda_error()
            tb += f"\n(CUDA last error cleared after it: {pending})" if pending else ""
        return "error", [], describe_error(e, 500), tb


def summary(reports) -> str:
    bad = [t for t in reports if not t.passed]
    return "; ".join(f"{t.name}: {t.reason or f'{t.max_ulp:.2g} ulp, relL2 {t.rel_l2:.1e}'}" for t in (bad or reports))


def measure(fi, variant: Variant, set_name: str, shape: Shape, dtype: str, weights: str, device="cuda", timer=None, roof=None) -> FiPoint:
    p = new_point(variant, weights, set_name, shape, dtype)
    # the stored w FlashInfer reads: fp32 for "fp32", x's dtype for "same" and "offset" (gemma adds the
    # 1); the model's extra bytes count the rstd write, which FlashInfer does not do
    b = bytes_moved(variant.op, "fwd", shape.m, shape.n, DTYPES[dtype].itemsize, param_size=4 if weights == "fp32" else None)
    p.bytes_main, p.bytes_extra = b.main, b.extra
    status, reports, err, tb = check_point(fi, variant, shape, dtype, weights, device)
    p.tensors = [asdict(r) for r in reports]
    if status != "pass":
        p.status = "failed" if status == "fail" else "error"
        p.check = summary(reports) if reports else err
        p.reason, p.traceback = err, tb
        return p
    p.check = "pass"
    if timer is None:  # checked only (the CPU tests)
        return p
    try:
        case = make_case(variant.op, shape, DTYPES[dtype], device, 0, weights=weights)
        fn = timed_call(fi, variant, case)
        t0 = time.perf_counter()
        fn()
        timer.sync()
        p.compile_s = time.perf_counter() - t0
        record_timing(p, fn, timer)
        p.frac_roofline = p.tbps / roof if roof else None
        p.status = "ok"
    except Exception as e:
        p.status = "error"
        p.reason = f"timing: {describe_error(e)}"
        p.traceback = traceback.format_exc(limit=6)
        if isinstance(e, torch.cuda.OutOfMemoryError):
            torch.cuda.empty_cache()
        clear_cuda_error()
    return p


def plan(variants, shape_sets, dtypes) -> list[tuple]:
    """(variant, set name, shape, dtype, weights): dtype outermost, so a run cut short keeps whole dtypes."""
    return [
        (v, set_name, shape, dtype, w)
        for dtype in dtypes
        for set_name, shapes in shape_sets
        for shape in shapes
        for v in variants
        for w in v.weights
    ]


class Heartbeat:
    """Prints a line every ``every`` seconds while a long step (FlashInfer's JIT build) runs."""

    def __init__(self, what: str, every: float = 30.0):
        self.what, self.every, self.t0 = what, every, time.perf_counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.wait(self.every):
            print(f"[flashinfer] {self.what}: still running, {time.perf_counter() - self.t0:.0f} s", flush=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()


def build_jit(fi) -> dict:
    """Build (or load from the cache) FlashInfer's CUDA norm module before the first point, so
    its compile time is reported apart and a failed build is reported once."""
    info = {"use_cuda_norm": bool(getattr(fi, "_USE_CUDA_NORM", None)), "seconds": None, "error": None}
    get = getattr(fi, "get_norm_module", None)
    if get is None:
        info["note"] = "flashinfer.norm has no get_norm_module: built on first call instead"
        return info
    print("[flashinfer] building the JIT norm module (nvcc; minutes on a cold cache)", flush=True)
    t0 = time.perf_counter()
    try:
        with Heartbeat("JIT build"):
            get()
        info["seconds"] = time.perf_counter() - t0
        print(f"[flashinfer] JIT norm module ready in {info['seconds']:.1f} s", flush=True)
    except Exception as e:
        info["seconds"] = time.perf_counter() - t0
        info["error"] = describe_error(e, 2000)
        # "Ninja build failed. Ninja output: ..." carries the compiler's messages after its first line
        info["output"] = str(e)[-12000:]
        info["traceback"] = traceback.format_exc(limit=8)
        print(f"[flashinfer] JIT build failed after {info['seconds']:.1f} s: {info['error']}\n{info['output']}", flush=True)
    return info


def markdown(meta: dict, points: list[FiPoint]) -> str:
    cb = meta.get("copy_bandwidth") or {}
    lines = [
        f"# FlashInfer forward (external anchor, not ranked) on {meta.get('gpu')}",
        "",
        f"flashinfer {meta.get('flashinfer')}, torch {meta.get('torch')}, commit {meta.get('git_commit')}; "
        f"copy bandwidth {cb.get('tbps', float('nan')):.3f} TB/s. "
        "Checked against normbench's fp64 reference and tolerances; FlashInfer returns no rstd, so it does "
        "not meet the contract and is never ranked. Failed points are not timed.",
        "",
        "| function | op | weights | set | shape | dtype | status | max ulp (y / residual_out) | µs | TB/s | of copy | reason |",
        "|---|---|---|---|---|---|---|---|---:|---:|---:|---|",
    ]
    for p in points:
        ulps = " / ".join(f"{t['max_ulp']:.3g}" for t in p.tensors) or "-"
        us = f"{p.us:.2f}" if p.us is not None else "-"
        tb = f"{p.tbps:.3f}" if p.tbps is not None else "-"
        fr = f"{p.frac_roofline:.1%}" if p.frac_roofline is not None else "-"
        why = "" if p.status == "ok" else (p.check if p.status == "failed" else p.reason).replace("|", "\\|")
        lines.append(f"| {p.function} | {p.op} | {p.weights} | {p.shape_set} | {p.shape} | {p.dtype} | {p.status} | {ulps} | {us} | {tb} | {fr} | {why} |")
    return "\n".join(lines) + "\n"


def write(out: Path, meta: dict, points: list[FiPoint]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    data = {**meta, "points": [{**asdict(p), "us": p.us} for p in points]}
    (out / "flashinfer.json").write_text(json.dumps(data, indent=2))
    (out / "flashinfer.md").write_text(markdown(meta, points))


def run(args) -> int:
    try:
        fi = load_flashinfer()
    except Exception as e:
        print(f"normbench: flashinfer is not importable ({describe_error(e)}); nothing measured", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("normbench: FlashInfer's norms need a CUDA GPU; none is visible", file=sys.stderr)
        return 2
    variants = [VARIANTS[v] for v in args.functions]
    sets = [(s, shape_set(s)) for s in args.shapes]
    env = environment("cuda")
    out = Path(args.out) if args.out else default_out_dir(env.get("gpu", "cpu")) / IMPL
    meta = {
        **env,
        "flashinfer": flashinfer_version(),
        "flashinfer_path": str(Path(fi.__file__).resolve().parent.parent),
        "env": {k: os.environ.get(k) for k in ("CUDA_HOME", "FLASHINFER_USE_CUDA_NORM", "FLASHINFER_WORKSPACE_BASE", "FLASHINFER_EXTRA_CUDAFLAGS")},
        "command": " ".join(sys.argv),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "note": "external anchor: FlashInfer returns no rstd (not normbench's contract); never ranked",
        "method": "check vs fp64 reference (harness.run.checker.compare, harness.spec.tolerances), then harness.run.bench.CudaTimer",
    }
    print(f"[flashinfer] {meta['flashinfer']} from {meta['flashinfer_path']} on {env.get('gpu')}", flush=True)
    meta["jit"] = build_jit(fi)
    from harness.run.timer import measure_copy_bandwidth

    meta["copy_bandwidth"] = measure_copy_bandwidth()
    roof = meta["copy_bandwidth"]["tbps"]
    print(f"[flashinfer] copy bandwidth {roof:.3f} TB/s", flush=True)
    points: list[FiPoint] = []
    todo = plan(variants, sets, args.dtype)
    timer = CudaTimer()
    last_shape = None
    for i, (v, set_name, shape, dtype, w) in enumerate(todo, 1):
        if shape != last_shape:
            torch.cuda.empty_cache()
            last_shape = shape
        if meta["jit"].get("error"):  # every call would rebuild (and fail) again: recorded, not retried
            p = new_point(v, w, set_name, shape, dtype, status="error")
            p.reason = f"JIT build failed: {meta['jit']['error']}"
        else:
            p = measure(fi, v, set_name, shape, dtype, w, "cuda", timer, roof)
        points.append(p)
        res = f"{p.us:.2f} us, {p.tbps:.3f} TB/s ({p.frac_roofline:.1%})" if p.status == "ok" else (p.check or p.reason)
        print(f"[flashinfer] {i}/{len(todo)} {v.name} {w} {set_name} {shape.label} {dtype}: {p.status} {res}", flush=True)
        write(out, meta, points)
    meta["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    write(out, meta, points)
    counts = {s: sum(p.status == s for p in points) for s in ("ok", "failed", "error")}
    print(f"[flashinfer] wrote {out / 'flashinfer.json'} and {out / 'flashinfer.md'}: {counts}", flush=True)
    return 0


def _csv(choices=None):
    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in items if choices is not None and t not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(choices or ())}; got '{text}'")
        return items

    return parse


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.tools.flashinfer_fwd", description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="output folder (default: runs/<gpu>/<date>/flashinfer)")
    ap.add_argument("--shapes", type=_csv(), default=["sweep", "decode"], help="shape sets (harness.spec.shapes), default sweep,decode")
    ap.add_argument("--dtype", type=_csv(("bf16", "fp16")), default=["bf16"], help="bf16 and/or fp16 (FlashInfer's norms take no fp32 x)")
    ap.add_argument("--functions", type=_csv(tuple(VARIANTS)), default=list(VARIANTS), help=f"default {','.join(VARIANTS)}")
    args = ap.parse_args(argv)
    try:
        for s in args.shapes:
            shape_set(s)
    except ValueError as e:
        print(f"normbench: {e}", file=sys.stderr)
        return 2
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
