"""`normbench overhead`: host time per call, the cost the roofline tables do not show.

The benchmark times kernels (CUDA events, L2 flushed, CUDA graphs for the decode shapes), so a
Python launcher that takes 300 µs to start 4 µs of GPU work looks fine there and is slow in a
training step or under TritonBench, whose backward goes through autograd without graphs. This
measures, per implementation, op and direction, the wall time per call on a shape so small that the
GPU is idle waiting for the host (M x N = 4 x 4096 by default):

    contract   the contract function itself (validation, allocation, launch), as the benchmark calls it
    autograd   y = norm(x, ...) then y.backward(dy) through ``harness.integrate.autograd`` (fwd + bwd together)
    custom op  the same step through the implementation's forward custom op itself (what a
               torch.compile graph calls; eager calls through ``harness.integrate.autograd`` take its twin)

A reference row, ``torch.nn.functional``, runs the same autograd step through PyTorch's own
composition of the op (the op record's ``native``: ``F.rms_norm``, ``F.layer_norm``, ``x + residual``
then ``F.rms_norm``): the floor that the autograd engine and gradient accumulation set whatever the
kernels, so the rest of a row's autograd figure is the implementation's (and the harness's) own.
Every op is driven from its record; an op the autograd layer has no function for gets no autograd
figure (None).

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

from harness.integrate import autograd
from harness.run.bench import callables
from harness.spec.contract import DTYPES
from harness.spec.inputs import make_case
from harness.spec.ops import get_op
from harness.spec.shapes import Shape


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


def _leaves(rec, case: dict):
    """The forward's arguments from ``case``, its tensors as fresh leaves that require grad."""
    return tuple(
        case[a.name].detach().clone().requires_grad_(True) if a.kind != "scalar" and case[a.name] is not None else case[a.name]
        for a in rec.fwd_args
    )


def _step(fwd, rec, case: dict):
    """One autograd step: the forward on fresh leaves, then backward of its first output with dy."""
    args = _leaves(rec, case)

    def step():
        out = fwd(*args)
        (out[0] if isinstance(out, tuple) else out).backward(case["dy"])
        for t in args:
            if isinstance(t, torch.Tensor):
                t.grad = None

    return step


def measure(impl, op: str, shape: Shape, dtype: str = "bf16", device: str = "cuda", calls: int = 200, trials: int = 5) -> dict:
    """Host microseconds per call of one implementation for one op (fwd, bwd, autograd fwd+bwd)."""
    rec = get_op(op)
    k = impl.kernels(device)
    case = make_case(op, shape, DTYPES[dtype], device)
    out = {"impl": impl.name, "dsl": impl.dsl, "op": op, "shape": shape.label, "dtype": dtype}
    for direction in ("fwd", "bwd"):
        out[f"contract_{direction}_us"] = _per_call_us(callables(k, op, direction, case), device, calls, trials)
    differentiable = getattr(autograd, op, None)
    step = _step(lambda *args: differentiable(*args, impl=impl), rec, case) if differentiable else None
    out["autograd_fwd_bwd_us"] = _per_call_us(step, device, max(calls // 4, 10), trials) if step else None
    # the same step through the custom op itself, what torch.compile's graphs call (eager calls take
    # its autograd.Function twin: harness.integrate.library._eager)
    custom = _step(autograd.norm_ops(impl).function(f"{op}_fwd"), rec, case)
    out["custom_op_fwd_bwd_us"] = _per_call_us(custom, device, max(calls // 4, 10), trials)
    return out


NATIVE = "torch.nn.functional"


def measure_native(op: str, shape: Shape, dtype: str = "bf16", device: str = "cuda", calls: int = 200, trials: int = 5) -> dict:
    """The reference row: the forward (no grad) and the autograd step through PyTorch's own norms."""
    rec = get_op(op)
    case = make_case(op, shape, DTYPES[dtype], device)
    args = _leaves(rec, case)

    def forward_only():
        with torch.no_grad():
            return rec.native(*args)

    return {"impl": NATIVE, "dsl": "reference", "op": op, "shape": shape.label, "dtype": dtype,
            "contract_fwd_us": _per_call_us(forward_only, device, calls, trials), "contract_bwd_us": None,
            "autograd_fwd_bwd_us": _per_call_us(_step(rec.native, rec, case), device, max(calls // 4, 10), trials)}  # fmt: skip


def run(impls, ops, shape: Shape, dtype: str, device: str, out_path: Path | None = None, calls: int = 200, trials: int = 5) -> list[dict]:
    from rich.progress import Progress

    from harness.spec.errors import describe_error

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
    out = ["| implementation | op | contract fwd µs | contract bwd µs | autograd fwd+bwd µs | custom op fwd+bwd µs |", "|---|---|---:|---:|---:|---:|"]
    for r in sorted(rows, key=lambda r: (r["op"], r.get("autograd_fwd_bwd_us") or 1e9)):
        if "error" in r:
            out.append(f"| {r['impl']} | {r['op']} | {r['error'][:60]} | | | |")
        else:
            us = [r.get(k) for k in ("contract_fwd_us", "contract_bwd_us", "autograd_fwd_bwd_us", "custom_op_fwd_bwd_us")]
            out.append(f"| {r['impl']} | {r['op']} | " + " | ".join("–" if v is None else f"{v:.1f}" for v in us) + " |")
    return out
