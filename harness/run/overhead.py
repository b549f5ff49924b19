"""`normbench overhead`: host time per call, the cost the roofline tables do not show.

The benchmark times kernels (CUDA events, L2 flushed, CUDA graphs for the decode shapes), so a
Python launcher that takes 300 µs to start 4 µs of GPU work looks fine there and is slow in a
training step, in decoding or under TritonBench, whose calls go through autograd without graphs.
This measures, per implementation and op, the wall time per call on a shape so small that the GPU
is idle waiting for the host (M x N = 4 x 4096 by default), beside PyTorch's own call in the same run:

    fwd             the function (``harness.integrate.autograd.rmsnorm`` ...) under ``torch.no_grad()``
    fwd_bwd         y = norm(x, ...) then y.backward(dy) through the function, inputs and
                    parameters requiring grad
    module_fwd      the module (``RMSNorm`` ...), its parameters requiring grad, under ``torch.no_grad()``
    module_fwd_bwd  the module's forward, then backward
    contract_fwd / contract_bwd   the contract functions themselves (validation, allocation,
                    launch), as the benchmark calls them
    kernel_fwd      the implementation's own forward function on the (M, N) rows, without the
                    harness's validation (on the CPU with eager, where that differs from torch's
                    own call, the kernels' extra work)
    launch_fwd      the DSL's own launcher alone: the compiled kernels that one kernel_fwd call
                    launched (Triton, Gluon, Helion: Triton's ``CompiledKernel[grid](*args)``),
                    launched again with the same arguments; the floor of the forward's host cost
                    in that DSL, with no allocation and no argument handling of ours
    custom_op_fwd_bwd  the autograd step through the forward custom op itself (what a torch.compile
                    graph calls; eager calls go through the functions and modules above)

With ``--python-profile DIR`` each of them is also run once more under cProfile, one text file per
row and measurement in DIR: the Python functions the host time goes to.

The reference row, ``torch.nn.functional``, runs the same four (fwd, fwd_bwd, module_fwd,
module_fwd_bwd) through PyTorch's own composition of the op (the op record's ``native``:
``F.rms_norm``, ``F.layer_norm``, ``x + residual`` then ``F.rms_norm``) and its own modules
(``torch.nn.RMSNorm``, ``torch.nn.LayerNorm``; for add_rmsnorm a ``torch.nn.RMSNorm`` after the
add). Every other row gets each of the four as a ratio to the reference's (``*_x``): what the
implementation and the harness cost beyond torch's own call. On the CPU with ``--impl eager``, whose
kernels are ATen's, that ratio is mostly the harness's own cost (see docs/method.md for where the
CPU kernels differ from torch's).

Method: every measurement of every row is set up and warmed first (compiles included); then
``rounds`` rounds each time every measurement once, ``calls`` back-to-back calls (a quarter as many
autograd steps), in alternating order; a figure is the minimum over the rounds of (wall time) /
calls. Interleaving puts the reference and the implementations under the same load, and the minimum
drops the rounds a busy host slowed. The GPU is synchronized only at the end of each timing. On the
CPU the run uses one intra-op thread (recorded as ``threads``): on a shared host a second thread that
was descheduled costs milliseconds per call of 4 x 4096, which is no host cost of the call's own; and
it times the calling thread's CPU time (``clock``), all of a call's work with one thread, which the
other processes of a busy host do not inflate as they do wall time.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from harness.integrate import autograd
from harness.run.bench import callables
from harness.spec import jit_launch
from harness.spec.contract import DTYPES
from harness.spec.inputs import make_case
from harness.spec.interpreters import interpreter_env
from harness.spec.ops import get_op
from harness.spec.shapes import Shape
from harness.spec.validation import as_rows

NATIVE = "torch.nn.functional"
# the measurements the reference row has too, each with a ratio column (``<name>_x``)
COMPARED = ("fwd_us", "fwd_bwd_us", "module_fwd_us", "module_fwd_bwd_us")
OWN = ("kernel_fwd_us", "launch_fwd_us", "contract_fwd_us", "contract_bwd_us", "custom_op_fwd_bwd_us")


def ratio_key(key: str) -> str:
    return key.removesuffix("_us") + "_x"


def _leaves(rec, case: dict):
    """The forward's arguments from ``case``, its tensors as fresh leaves that require grad."""
    return tuple(
        case[a.name].detach().clone().requires_grad_(True)
        if a.kind != "scalar" and case[a.name] is not None
        else case[a.name]
        for a in rec.fwd_args
    )


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _step(fwd, args: tuple, dy, params=()):
    """One autograd step: the forward on ``args``, then backward of its first output with dy; the
    gradients of the leaves and ``params`` dropped, as an optimizer's zero_grad(set_to_none) does."""
    leaves = [t for t in (*args, *params) if isinstance(t, torch.Tensor) and t.requires_grad]

    def step():
        _first(fwd(*args)).backward(dy)
        for t in leaves:
            t.grad = None

    return step


class _NativeAddRMSNorm(torch.nn.RMSNorm):
    """The unfused pair a model runs: the residual add, then torch.nn.RMSNorm."""

    def forward(self, x, residual):
        h = x + residual
        return super().forward(h), h


def _module(impl, op: str, case: dict):
    """The op's module (ours, or torch's for ``impl=None``) holding the case's parameters, and the
    module's inputs (x, and residual for add_rmsnorm) as leaves requiring grad."""
    x, n = case["x"], case["x"].shape[-1]
    pdtype = case["weight"].dtype
    kw = {"device": x.device, "dtype": pdtype}
    if impl is not None:
        kw["impl"] = impl
    if op == "layernorm":
        m = (torch.nn.LayerNorm if impl is None else autograd.LayerNorm)(n, eps=case["eps"], **kw)
    elif op == "rmsnorm":
        m = (torch.nn.RMSNorm if impl is None else autograd.RMSNorm)(n, eps=case["eps"], **kw)
    else:
        m = (_NativeAddRMSNorm if impl is None else autograd.AddRMSNorm)(n, eps=case["eps"], **kw)
    with torch.no_grad():
        m.weight.copy_(case["weight"])
        if getattr(m, "bias", None) is not None:
            m.bias.copy_(case["bias"])
    names = ("x", "residual") if op == "add_rmsnorm" else ("x",)
    inputs = tuple(case[k].detach().clone().requires_grad_(True) for k in names)
    return m, inputs


def _compared(fn, module, module_inputs, rec, case: dict) -> dict:
    """The four compared measurements of a function ``fn`` (taking the forward's arguments) and a
    module: name -> (callable, grad mode, share of ``calls``)."""
    args = _leaves(rec, case)
    return {
        "fwd_us": (lambda: fn(*args), False, 1),
        "fwd_bwd_us": (_step(fn, args, case["dy"]), True, 4),
        "module_fwd_us": (lambda: module(*module_inputs), False, 1),
        "module_fwd_bwd_us": (_step(module, module_inputs, case["dy"], tuple(module.parameters())), True, 4),
    }


def measured(op: str) -> bool:
    """Whether ``op`` is measured here: it has a differentiable function and module (forward-only
    ops have neither) and a backward."""
    return callable(getattr(autograd, op, None)) and bool(get_op(op).bwd_args)


def measurements(impl, op: str, shape: Shape, dtype: str = "bf16", device: str = "cuda") -> dict:
    """One implementation's measurements of one op (``impl=None``: the ``torch.nn.functional``
    reference row): name -> (callable, grad mode, share of ``calls``)."""
    rec = get_op(op)
    case = make_case(op, shape, DTYPES[dtype], device)
    if impl is None:
        return _compared(rec.native, *_module(None, op, case), rec, case)
    fn = getattr(autograd, op)
    out = _compared(lambda *args: fn(*args, impl=impl), *_module(impl, op, case), rec, case)
    k = impl.kernels(device)
    out["kernel_fwd_us"] = (_raw_forward(impl, k.raw, rec, case, device), False, 1)
    launches = _launches(out["kernel_fwd_us"][0])
    if launches:
        out["launch_fwd_us"] = (lambda: jit_launch.replay(launches), False, 1)
    out["contract_fwd_us"] = (callables(k, op, "fwd", case), False, 1)
    out["contract_bwd_us"] = (callables(k, op, "bwd", case), False, 1)
    # the step through the custom op itself, what torch.compile's graphs call
    out["custom_op_fwd_bwd_us"] = (
        _step(autograd.norm_ops(impl).function(f"{op}_fwd"), _leaves(rec, case), case["dy"]),
        True,
        4,
    )
    return out


def _launches(fn) -> list:
    """The compiled Triton-JIT launches (Triton, Gluon, Helion) of one call of ``fn``, after a first
    call that compiles: empty for a DSL that launches otherwise."""
    fn()
    with jit_launch.recording() as launches:
        fn()
    return launches


def _raw_forward(impl, raw, rec, case: dict, device: str):
    n = case["x"].shape[-1]
    args = tuple(
        as_rows(v, n) if a.kind == "rows" and v is not None else v for a, v in zip(rec.fwd_args, rec.fwd_call(case))
    )
    fn = getattr(raw, rec.function("fwd"))

    def call():
        with interpreter_env(impl, device):
            return fn(*args)

    return call


def _sync(device: str):
    return torch.cuda.synchronize if device == "cuda" else (lambda: None)


def _clock(device: str):
    """Wall time with a GPU (the host's time until the GPU has what it was given); on the CPU the
    calling thread's own CPU time, which with one intra-op thread is all of a call's work: a host
    that other processes share does not add the time they hold its cores."""
    return time.perf_counter if device == "cuda" else time.thread_time


def _time(fn, grad: bool, calls: int, sync, clock=time.perf_counter) -> float:
    with torch.set_grad_enabled(grad):
        t0 = clock()
        for _ in range(calls):
            fn()
        sync()
        return (clock() - t0) / calls * 1e6


def run(impls, ops, shape: Shape, dtype: str, device: str, out_path: Path | None = None, calls: int = 200,
        trials: int = 5, command: str | None = None, python_profile: Path | None = None) -> list[dict]:  # fmt: skip
    """Rows of host µs per call (see the module docstring): the ``torch.nn.functional`` row of each op
    first, then each implementation's; ``trials`` is the number of interleaved rounds. On the CPU
    with one intra-op thread."""
    threads = torch.get_num_threads()
    if device == "cpu":
        # one intra-op thread: a call's host cost, not the wait for a second thread that a shared
        # host has descheduled (milliseconds per call on 2 busy cores, on ops of 4 x 4096)
        torch.set_num_threads(1)
    try:
        return _run(impls, ops, shape, dtype, device, out_path, calls, trials, command, python_profile)
    finally:
        torch.set_num_threads(threads)


def _run(impls, ops, shape: Shape, dtype: str, device: str, out_path, calls: int, trials: int, command,
         python_profile) -> list[dict]:  # fmt: skip
    from rich.progress import Progress

    from harness.spec.errors import describe_error

    sync, clock = _sync(device), _clock(device)
    rows, timed = [], []  # timed: (row, name, callable, grad mode, calls)
    ops = [op for op in ops if measured(op)]
    todo = [(None, op) for op in ops] + [
        (i, op) for i in impls for op in ops if op in i.ops and not i.unavailable(device)
    ]
    with Progress(transient=True) as bar:
        task = bar.add_task("overhead: warm-up", total=len(todo) * (1 + trials))
        for impl, op in todo:
            name, dsl = (NATIVE, "reference") if impl is None else (impl.name, impl.dsl)
            row = {"impl": name, "dsl": dsl, "op": op, "shape": shape.label, "dtype": dtype}
            rows.append(row)
            bar.update(task, description=f"warm-up {name} {op}")
            try:
                found = measurements(impl, op, shape, dtype, device)
                for key, (fn, grad, share) in found.items():
                    for _ in range(3):  # compiles, autotunes, fills every cache
                        _time(fn, grad, 1, sync)
                    timed.append((row, key, fn, grad, max(calls // share, 10)))
            except Exception as e:  # noqa: BLE001  (one failing implementation never stops the run)
                row["error"] = describe_error(e)
            bar.advance(task)
        best: dict[tuple[int, str], float] = {}
        for r in range(trials):
            bar.update(task, description=f"overhead: round {r + 1} of {trials}")
            for row, key, fn, grad, n in timed if r % 2 == 0 else reversed(timed):
                if "error" in row:
                    continue
                try:
                    us = _time(fn, grad, n, sync, clock)
                except Exception as e:  # noqa: BLE001  (one failing implementation never stops the run)
                    row["error"] = describe_error(e)
                    continue
                best[(id(row), key)] = min(us, best.get((id(row), key), us))
            bar.advance(task, len(todo))
            _fill(rows, timed, best)
            if out_path is not None:
                _write(out_path, rows, device, shape, dtype, calls, r + 1, command)
        if python_profile is not None:
            bar.update(task, description="overhead: Python profiles")
            _profile_all(python_profile, timed, sync)
    return rows


def _profile_all(folder: Path, timed, sync) -> None:
    """One cProfile text per (row, measurement), after the timed rounds: where a call's host time
    goes, function by function (``<impl>-<op>-<measurement>.txt``, sorted by own time, and an index
    of them). cProfile's own cost inflates every figure; the shares are what to read."""
    import cProfile
    import pstats

    folder.mkdir(parents=True, exist_ok=True)
    index = []
    for row, key, fn, grad, n in timed:
        if "error" in row:
            continue
        prof = cProfile.Profile()
        with torch.set_grad_enabled(grad):
            prof.enable()
            for _ in range(n):
                fn()
            sync()
            prof.disable()
        name = f"{row['impl'].replace('.', '_')}-{row['op']}-{key.removesuffix('_us')}.txt"
        head = f"# {row['impl']} {row['op']} {key}: {n} calls under cProfile, figures per call\n"
        (folder / name).write_text(head + "\n".join(_profile_table(pstats.Stats(prof), n)) + "\n")
        index.append(name)
    (folder / "index.txt").write_text("\n".join(index) + "\n")


def _profile_table(stats, calls: int, top: int = 40) -> list[str]:
    """The ``top`` functions by own time: calls, own µs and cumulative µs, each per timed call."""
    out = ["| function | calls | own µs | cumulative µs |", "|---|---:|---:|---:|"]
    entries = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:top]
    for (file, line, func), (_, ncalls, own, cum, _) in entries:
        where = func if file == "~" else f"{Path(file).name}:{line}({func})"
        out.append(f"| {where} | {ncalls / calls:.3g} | {own / calls * 1e6:.2f} | {cum / calls * 1e6:.2f} |")
    return out


def _fill(rows: list[dict], timed, best: dict) -> None:
    for row, key, *_ in timed:
        if "error" not in row and (id(row), key) in best:
            row[key] = best[(id(row), key)]
    native = {r["op"]: r for r in rows if r["impl"] == NATIVE and "error" not in r}
    for r in rows:
        ref = native.get(r["op"])
        if r["impl"] == NATIVE or "error" in r or ref is None:
            continue
        for key in COMPARED:
            if r.get(key) is not None and ref.get(key):
                r[ratio_key(key)] = r[key] / ref[key]


def _write(path: Path, rows, device: str, shape: Shape, dtype: str, calls: int, rounds: int, command) -> None:
    from harness.run.environment import environment

    meta = {"device": _device_name(device), "command": command, "shape": shape.label, "dtype": dtype, "calls": calls,
            "rounds": rounds, "statistic": "min over interleaved rounds", "threads": torch.get_num_threads(),
            "clock": "wall (time.perf_counter)" if device == "cuda" else "thread CPU time (time.thread_time)",
            "environment": environment(device), "rows": rows}  # fmt: skip
    path.write_text(json.dumps(meta, indent=1) + "\n")


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name(0) if device == "cuda" else "cpu"


def _us(v) -> str:
    return "–" if v is None else f"{v:.1f}"


def markdown(rows: list[dict]) -> list[str]:
    """The rows as a table: µs per call, and each compared figure's ratio to torch's."""
    out = [
        (
            "| implementation | op | fwd µs | x | fwd+bwd µs | x | module fwd µs | x | module fwd+bwd µs | x "
            "| kernel fwd µs | launch fwd µs | contract fwd µs | contract bwd µs | custom op fwd+bwd µs |"
        ),
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in sorted(rows, key=lambda r: (r["op"], r["impl"] != NATIVE, r.get("fwd_bwd_us") or 1e9)):
        if "error" in r:
            out.append(f"| {r['impl']} | {r['op']} | {r['error'][:80]} |" + " |" * 12)
            continue
        cells = []
        for key in COMPARED:
            ratio = r.get(ratio_key(key))
            cells += [_us(r.get(key)), "" if ratio is None else f"{ratio:.2f}"]
        cells += [_us(r.get(key)) for key in OWN]
        out.append(f"| {r['impl']} | {r['op']} | " + " | ".join(cells) + " |")
    return out
