"""`normbench overhead`: host time per call, the cost the roofline tables do not show.

The benchmark times kernels (CUDA events, L2 flushed, CUDA graphs for the decode shapes), so a
Python launcher that takes 300 µs to start 4 µs of GPU work looks fine there and is slow in a
training step or under TritonBench, whose backward goes through autograd without graphs. This
measures, per implementation, op and direction, the wall time per call on a shape so small that the
GPU is idle waiting for the host (M x N = 4 x 4096 by default):

    contract   the contract function itself (validation, allocation, launch), as the benchmark calls it
    autograd   y = norm(x, ...) then y.backward(dy) through ``harness.autograd`` (fwd + bwd together)

A reference row, ``torch.nn.functional``, runs the same autograd step through PyTorch's own
``F.rms_norm`` / ``F.layer_norm``: the floor that the autograd engine and gradient accumulation set
whatever the kernels, so the rest of a row's autograd figure is the implementation's (and the
harness's) own.

Each figure is the median over ``trials`` of (wall time of ``calls`` back-to-back calls) / calls,
after a warm-up that compiles everything. The GPU is synchronized only between trials.
"""

from __future__ import annotations

import json
import statistics
import time
from functools import partial
from pathlib import Path

import torch

from . import autograd
from .contract import DTYPES
from .inputs import make_case
from .shapes import Shape


def _per_call_us(fn, device: str, calls: int, trials: int) -> float:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(3):
        fn()
    sync()
    times = []
    for _ in range(trials):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(times)


def _leaves(case: dict):
    """x, weight, bias of ``case`` as fresh leaves that require grad (None stays None)."""
    return tuple(None if t is None else t.detach().clone().requires_grad_(True) for t in (case["x"], case["weight"], case["bias"]))


def measure(impl, op: str, shape: Shape, dtype: str = "bf16", device: str = "cuda", calls: int = 200, trials: int = 5) -> dict:
    """Host microseconds per call of one implementation for one op (fwd, bwd, autograd fwd+bwd)."""
    k = impl.kernels(device)
    case = make_case(op, shape, DTYPES[dtype], device)
    out = {"impl": impl.name, "dsl": impl.dsl, "op": op, "shape": shape.label, "dtype": dtype}
    for direction in ("fwd", "bwd"):
        out[f"contract_{direction}_us"] = _per_call_us(autograd.callables(k, op, direction, case), device, calls, trials)
    x, w, b = _leaves(case)
    dy = case["dy"]

    def step():
        y = autograd.rmsnorm(x, w, case["eps"], impl) if op == "rmsnorm" else autograd.layernorm(x, w, b, case["eps"], impl)
        y.backward(dy)
        x.grad = None

    out["autograd_fwd_bwd_us"] = _per_call_us(step, device, max(calls // 4, 10), trials)
    return out


NATIVE = "torch.nn.functional"


def measure_native(op: str, shape: Shape, dtype: str = "bf16", device: str = "cuda", calls: int = 200, trials: int = 5) -> dict:
    """The reference row: the forward (no grad) and the autograd step through PyTorch's own norms."""
    case = make_case(op, shape, DTYPES[dtype], device)
    n, eps = case["x"].shape[-1], case["eps"]
    x, w, b = _leaves(case)
    if op == "rmsnorm":
        fwd = lambda: torch.nn.functional.rms_norm(x, (n,), w, eps)
    else:
        fwd = lambda: torch.nn.functional.layer_norm(x, (n,), w, b, eps)

    def forward_only():
        with torch.no_grad():
            return fwd()

    def step():
        fwd().backward(case["dy"])
        x.grad = None

    return {"impl": NATIVE, "dsl": "reference", "op": op, "shape": shape.label, "dtype": dtype,
            "contract_fwd_us": _per_call_us(forward_only, device, calls, trials), "contract_bwd_us": None,
            "autograd_fwd_bwd_us": _per_call_us(step, device, max(calls // 4, 10), trials)}  # fmt: skip


def run(impls, ops, shape: Shape, dtype: str, device: str, out_path: Path | None = None, calls: int = 200, trials: int = 5) -> list[dict]:
    from rich.progress import Progress

    from .contract import describe_error

    rows = []
    with Progress(transient=True) as bar:
        # (name, dsl, op, the measurement): the reference rows first
        todo = [(NATIVE, "reference", op, partial(measure_native, op)) for op in ops] + [
            (i.name, i.dsl, op, partial(measure, i, op)) for i in impls for op in ops if op in i.ops and not i.unavailable(device)
        ]
        task = bar.add_task("overhead", total=len(todo))
        for name, dsl, op, measure_one in todo:
            bar.update(task, description=f"{name} {op}")
            try:
                rows.append(measure_one(shape, dtype, device, calls, trials))
            except Exception as e:  # one failing implementation never stops the run
                rows.append({"impl": name, "dsl": dsl, "op": op, "shape": shape.label, "dtype": dtype, "error": describe_error(e)})
            bar.advance(task)
            if out_path is not None:
                out_path.write_text(json.dumps({"device": _device_name(device), "calls": calls, "trials": trials, "rows": rows}, indent=1) + "\n")
    return rows


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name(0) if device == "cuda" else "cpu"


def markdown(rows: list[dict]) -> list[str]:
    out = ["| implementation | op | contract fwd µs | contract bwd µs | autograd fwd+bwd µs |", "|---|---|---:|---:|---:|"]
    for r in sorted(rows, key=lambda r: (r["op"], r.get("autograd_fwd_bwd_us") or 1e9)):
        if "error" in r:
            out.append(f"| {r['impl']} | {r['op']} | {r['error'][:60]} | | |")
        else:
            us = [r[k] for k in ("contract_fwd_us", "contract_bwd_us", "autograd_fwd_bwd_us")]
            out.append(f"| {r['impl']} | {r['op']} | " + " | ".join("–" if v is None else f"{v:.1f}" for v in us) + " |")
    return out
