"""TritonBench adapter: every normbench implementation as a backend of TritonBench's ``rms_norm``
and ``layer_norm`` operators, next to TritonBench's own backends.

    normbench tritonbench --op rms_norm --mode bwd --precision bf16 --metrics latency,gbps,accuracy
    python run.py --op rms_norm --plugin harness.tools.tritonbench.plugin      # TritonBench with --plugin

How it plugs in: TritonBench's files are not edited. At run time the adapter does what
pytorch/helion's ``benchmarks/run.py`` does for Helion kernels: for each implementation it applies
TritonBench's own ``register_benchmark(operator_name=..., func_name=...)`` to a wrapper method and
sets that method on the operator class. TritonBench then builds every input, times every backend
and runs the backward (``--mode bwd`` / ``fwd_bwd``, or ``--bwd``) through its own ``get_bwd_fn``,
i.e. ``y.backward(dy)`` through autograd of ``harness.integrate.autograd.rmsnorm`` / ``layernorm``.

The wrappers take each operator's own inputs and return a zero-argument callable:
    rms_norm:   (H, x, weight), or (H, x) in TritonBench versions whose backends own a ones weight
    layer_norm: (x, normalized_shape, weight, bias, eps)
They never call TritonBench's wrappers of third-party kernels (which can break with newer libraries:
its ``quack_rms`` calls ``quack.rmsnorm(x, w, eps)``, and quack-kernels 0.6.5 binds that eps to
``bias``); normbench's ``quack`` and ``liger`` backends go through ``harness.anchor_kernels``.

Metrics added to the operators (ask for them with ``--metrics``; ``accuracy`` brings both fp64 ones):
    fp64_accuracy  1 / 0: every checked output within normbench's tolerance of the fp64 reference
                   (``harness.spec.tolerances``), for every backend, TritonBench's own included. The
                   backward is checked with a seeded dy; gradients a backend does not produce for
                   the inputs (an internal weight) are not checked. Details of failures go to stderr
                   and to the run's JSON file.
    fp64_rel_l2    the worst relative L2 error (|out - ref| / |ref|) among the checked outputs
    gbps           rms_norm only (layer_norm has its own, with the same bytes): normbench's bytes
                   model, ``harness.spec.roofline.bytes_moved(...).main``, over TritonBench's latency
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from harness.integrate import autograd
from harness.run.checker import _bwd_scales, compare
from harness.run.environment import environment
from harness.spec.contract import DTYPE_NAMES, PARAM_DTYPES, Implementation
from harness.spec.errors import describe_error
from harness.spec.ops import OPS, get_op
from harness.spec.roofline import bytes_moved

log = logging.getLogger("normbench.tritonbench")

# TritonBench operator -> normbench op, from the op records (harness.spec.ops: ``tritonbench``). add_rmsnorm
# has none: TritonBench's operators folder holds rms_norm, layer_norm and fused_rmsnorm_matmul, no
# residual + RMSNorm operator, so there is nothing to register it on.
OPERATORS = {rec.tritonbench: name for name, rec in OPS.items() if rec.tritonbench}
BACKEND_PREFIX = "normbench_"
FP64_METRICS = ("fp64_accuracy", "fp64_rel_l2")
DEFAULT_REPORT_DIR = Path("reports") / "tritonbench"
# Flags that would run operators outside this process (where nothing is registered) or that this
# command replaces.
UNSUPPORTED_FLAGS = ("--op-collection", "--isolate", "--side-a", "--side-b", "--ci")
DY_SEED = 1234

INSTALL_HINT = (
    "it is on no package registry; install it from its git repository: "
    "pip install git+https://github.com/meta-pytorch/tritonbench.git "
    "(or put a checkout of it on PYTHONPATH)"
)


# ---------------------------------------------------------------- TritonBench's API
@dataclass
class TritonBench:
    """The parts of TritonBench the adapter uses. ``load_tritonbench()`` fills it from the installed
    package; the tests fill it with a stand-in."""

    register_benchmark: Callable  # register_benchmark(operator_name=, func_name=, baseline=, enabled=, fwd_only=, label=)
    register_metric: Callable  # register_metric(skip_baseline=, x_only=); the operator comes from func.__module__
    registered_metrics: dict  # REGISTERED_METRICS: operator name -> metric names
    load_operator: Callable[[str], type]  # load_opbench_by_name
    get_parser: Callable | None = None  # get_parser(args) -> argparse.ArgumentParser
    path: Path | None = None  # where the package lives (for the commit in the run's JSON)


def load_tritonbench() -> TritonBench:
    """TritonBench's registration API; a one-line ValueError when it cannot be imported."""
    try:
        import tritonbench
    except ModuleNotFoundError as e:
        if e.name == "tritonbench":
            raise ValueError(f"TritonBench is not installed: {INSTALL_HINT}") from None
        raise ValueError(f"TritonBench does not import: {_one_line(e)} (its dependencies: pip install psutil tabulate)") from None
    try:
        from tritonbench.operators import load_opbench_by_name
        from tritonbench.utils.parser import get_parser
        from tritonbench.utils.triton_op import REGISTERED_METRICS, register_benchmark, register_metric
    except Exception as e:  # an incompatible or half-installed TritonBench
        raise ValueError(f"TritonBench does not import: {_one_line(e)} (its dependencies: pip install psutil tabulate)") from None
    paths = list(getattr(tritonbench, "__path__", []))
    return TritonBench(
        register_benchmark=register_benchmark,
        register_metric=register_metric,
        registered_metrics=REGISTERED_METRICS,
        load_operator=load_opbench_by_name,
        get_parser=get_parser,
        path=Path(paths[0]) if paths else None,
    )


def _one_line(e: BaseException) -> str:
    return describe_error(e, 10_000)


# ---------------------------------------------------------------- the operators' inputs
def _mode(operator) -> str:
    """fwd | bwd | fwd_bwd | fwd_no_grad (TritonBench's Mode, read by value so no import is needed)."""
    mode = getattr(operator, "mode", None)
    return getattr(mode, "value", mode) or "fwd"


def _wants_grad(operator) -> bool:
    return _mode(operator) in ("bwd", "fwd_bwd")


def operator_inputs(operator, op: str, inputs: tuple):
    """(x, weight, bias, eps) from one input tuple of TritonBench's operator."""
    if op == "rmsnorm":
        if len(inputs) == 3:
            _, x, weight = inputs
        elif len(inputs) == 2:
            # Older rms_norm operators yield (H, x) and every backend builds a ones weight of its
            # own; ours is one in x's dtype, trainable when the mode has a backward.
            _, x = inputs
            weight = torch.ones(x.shape[-1], dtype=x.dtype, device=x.device, requires_grad=_wants_grad(operator))
        else:
            raise NotImplementedError(f"rms_norm input with {len(inputs)} values; expected (H, x[, weight])")
        return x, weight, None, float(getattr(operator, "eps", 1e-6))
    if len(inputs) != 5:
        raise NotImplementedError(f"layer_norm input with {len(inputs)} values; expected (x, normalized_shape, weight, bias, eps)")
    x, normalized_shape, weight, bias, eps = inputs
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if shape != (x.shape[-1],):
        raise NotImplementedError(f"normbench normalizes over the last dimension only; normalized_shape={shape}")
    return x, weight, bias, float(eps)


def _x_of(op: str, inputs: tuple) -> torch.Tensor:
    return inputs[1] if op == "rmsnorm" else inputs[0]


def _supported(impl: Implementation, x: torch.Tensor, weight, bias):
    """NotImplementedError (TritonBench's 'not supported' cell) for inputs outside the contract."""
    if DTYPE_NAMES.get(x.dtype) not in impl.dtypes:
        raise NotImplementedError(f"{impl.name} supports {', '.join(impl.dtypes)}, not {x.dtype}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.dtype != x.dtype and t.dtype not in PARAM_DTYPES:
            raise NotImplementedError(f"{name} is {t.dtype} but x is {x.dtype}; normbench kernels take x's dtype or fp32")


# ---------------------------------------------------------------- backends
def backend_name(impl_name: str) -> str:
    """``normbench_<implementation>``, as a Python identifier (TritonBench looks it up with getattr)."""
    return BACKEND_PREFIX + re.sub(r"\W", "_", impl_name)


def backend_method(impl: Implementation, op: str) -> Callable:
    """The method TritonBench calls with one input tuple; it returns the forward as a zero-argument
    callable, differentiable through the implementation's own backward kernels."""

    def backend(self, *inputs):
        x, weight, bias, eps = operator_inputs(self, op, inputs)
        _supported(impl, x, weight, bias)
        args = get_op(op).fwd_call({"x": x, "weight": weight, "bias": bias, "eps": eps})
        differentiable = getattr(autograd, op)  # harness.integrate.autograd's function of the same name
        return lambda: differentiable(*args, impl=impl)

    backend.__name__ = backend.__qualname__ = backend_name(impl.name)
    backend.__doc__ = impl.description
    return backend


def implementations_for(tb_op: str, device: str, pattern: str | None = None):
    """(implementations to register, {name: why not}) for one TritonBench operator on ``device``."""
    from harness.registry import select

    op = OPERATORS[tb_op]
    chosen, skipped = [], {}
    for impl in select(pattern, op=op):
        why = impl.unavailable(device)
        if why:
            skipped[impl.name] = why
        else:
            chosen.append(impl)
    names = [backend_name(i.name) for i in chosen]
    clash = {n for n in names if names.count(n) > 1}
    if clash:
        raise ValueError(f"implementation names collide as TritonBench backends: {', '.join(sorted(clash))}")
    return chosen, skipped


def register_operator(tb: TritonBench, tb_op: str, impls: list[Implementation]) -> list[str]:
    """Register ``impls`` as backends of TritonBench's ``tb_op`` and add the metrics; returns the
    backend names. Safe to call again (TritonBench's registries are keyed by name)."""
    if tb_op not in OPERATORS:
        raise ValueError(f"unknown TritonBench operator '{tb_op}'; choose from {', '.join(OPERATORS)}")
    operator_cls = tb.load_operator(tb_op)
    op = OPERATORS[tb_op]
    names = []
    for impl in impls:
        name = backend_name(impl.name)
        # Every implementation provides the backward (the contract's four functions), so no
        # backend is forward-only.
        method = tb.register_benchmark(
            operator_name=tb_op, func_name=name, baseline=False, enabled=True, fwd_only=False, label=name
        )(backend_method(impl, op))
        setattr(operator_cls, name, method)
        names.append(name)
    _register_metrics(tb, tb_op, operator_cls)
    return names


# ---------------------------------------------------------------- metrics
def _register_metrics(tb: TritonBench, tb_op: str, operator_cls: type):
    op = OPERATORS[tb_op]
    metrics = {"fp64_accuracy": _fp64_accuracy_metric(op), "fp64_rel_l2": _fp64_rel_l2_metric(op)}
    already = tb.registered_metrics.get(tb_op, ())
    if "gbps" not in already and not hasattr(operator_cls, "gbps"):
        metrics["gbps"] = _gbps_metric(op)
    for name, func in metrics.items():
        if name in tb.registered_metrics.get(tb_op, ()):
            continue
        func.__name__ = func.__qualname__ = name
        # register_metric finds the operator from the function's module path
        # (tritonbench.operators.<name>...), so the function claims the operator's module.
        func.__module__ = operator_cls.__module__
        setattr(operator_cls, name, tb.register_metric()(func))


def _latency_ms(latency) -> float | None:
    if latency is None:
        return None
    ms = getattr(latency, "p50", latency)  # TritonBench's Latency; a plain float in stand-ins
    try:
        ms = float(ms)
    except (TypeError, ValueError):
        return None
    return ms if ms > 0 else None


def _gbps_metric(op: str):
    def gbps(self, fn, example_inputs, metrics):
        ms = _latency_ms(getattr(metrics, "latency", None))
        if ms is None:
            return None
        x = _x_of(op, example_inputs)
        n = x.shape[-1]
        direction = {"bwd": "bwd", "fwd_bwd": "fwdbwd"}.get(_mode(self), "fwd")
        nbytes = bytes_moved(op, direction, x.numel() // n, n, x.element_size()).main
        return nbytes / (ms * 1e-3) / 1e9

    return gbps


def _fp64_accuracy_metric(op: str):
    def fp64_accuracy(self, fn, example_inputs, metrics):
        return fp64_verdict(self, op, getattr(fn, "_name", None)).passed

    return fp64_accuracy


def _fp64_rel_l2_metric(op: str):
    def fp64_rel_l2(self, fn, example_inputs, metrics):
        return fp64_verdict(self, op, getattr(fn, "_name", None)).rel_l2

    return fp64_rel_l2


@dataclass
class Verdict:
    passed: bool | None  # None: nothing could be checked
    rel_l2: float | None = None  # the worst among the checked outputs
    checked: list[str] = field(default_factory=list)
    detail: str = ""


def fp64_verdict(operator, op: str, fn_name: str | None) -> Verdict:
    """Check backend ``fn_name`` on the operator's current input against the fp64 reference, in the
    operator's mode. Cached per (input, backend): the two fp64 metrics share one check. Never raises:
    a metric that raised would end TritonBench's whole run."""
    key = (getattr(operator, "_cur_input_id", None), id(operator.example_inputs), fn_name)
    cache = operator.__dict__.setdefault("_normbench_verdicts", {})
    if key not in cache:
        try:
            verdict = _check_backend(operator, op, fn_name)
        except Exception as e:  # the backend's failure is a result, not the end of the run
            verdict = Verdict(None, detail=f"check did not run: {_one_line(e)}")
        if verdict.passed is False or verdict.detail:
            log.warning("normbench fp64 check of %s, input %s: %s", fn_name, key[0], verdict.detail or "failed")
            operator.__dict__.setdefault("_normbench_fp64_notes", []).append(
                {"backend": fn_name, "input_id": key[0], "passed": verdict.passed, "detail": verdict.detail}
            )
        cache.clear()  # one input at a time: keep memory flat
        cache[key] = verdict
    return cache[key]


def _check_backend(operator, op: str, fn_name: str | None) -> Verdict:
    if not fn_name or not callable(getattr(operator, fn_name, None)):
        return Verdict(None, detail=f"no backend named {fn_name!r} on the operator")
    inputs = tuple(operator.example_inputs)
    x, weight, bias, eps = operator_inputs(operator, op, inputs)
    backward = _wants_grad(operator)
    if op == "rmsnorm" and len(inputs) == 2 and fn_name.startswith(BACKEND_PREFIX):
        # Our wrappers also take the (H, x, weight) layout: hand them the ones weight explicitly,
        # so that dweight is checked too.
        inputs = (*inputs, weight)
    leaves = {}
    if backward:
        # Fresh leaves, so gradients can be read without touching TritonBench's tensors; the
        # backend is built again on them (every backend is a function of the operator's inputs).
        inputs, leaves = _with_fresh_leaves(op, inputs)
    out = getattr(operator, fn_name)(*inputs)()
    y = out if isinstance(out, torch.Tensor) else next((t for t in out if isinstance(t, torch.Tensor)), None)
    if y is None:
        return Verdict(None, detail="the backend returned no tensor")
    x_, w_, b_ = (t.detach() if t is not None else None for t in (x, weight, bias))
    rec = get_op(op)
    case = {"x": x_, "weight": w_, "bias": b_, "eps": eps}
    ref_out = rec.reference_fwd(*rec.fwd_call(case))
    ref_y = ref_out[0]
    # A backend may return another dtype (older rms_norm baselines multiply by an fp32 weight):
    # its values are judged in x's dtype, the precision the comparison is about.
    y_seen = y.detach().to(x.dtype) if y.dtype != x.dtype else y.detach()
    # y is checked in every mode: a backward on a wrong forward means nothing.
    reports = [compare("y", y_seen, ref_y, x.dtype, x.shape)]
    if backward:
        reports += _check_grads(rec, y, case, leaves, ref_out)
    errors = [r.rel_l2 for r in reports if not math.isnan(r.rel_l2)]
    bad = [r for r in reports if not r.passed]
    # TritonBench's CSV is ';'-separated: keep ';' out of the text.
    detail = ", ".join(f"{r.name}: {r.reason}" for r in bad).replace(";", ",")
    return Verdict(not bad, max(errors) if errors else None, [r.name for r in reports], detail)


def _with_fresh_leaves(op: str, inputs: tuple):
    def leaf(t):
        return t.detach().clone().requires_grad_(True) if isinstance(t, torch.Tensor) else t

    if op == "rmsnorm":
        new = (inputs[0], leaf(inputs[1]), *(leaf(t) for t in inputs[2:]))
        leaves = {"dx": new[1], "dweight": new[2] if len(new) > 2 else None}
    else:
        x, shape, w, b, eps = inputs
        new = (leaf(x), shape, leaf(w), leaf(b), eps)
        leaves = {"dx": new[0], "dweight": new[2], "dbias": new[3]}
    return new, {k: v for k, v in leaves.items() if isinstance(v, torch.Tensor)}


def _check_grads(rec, y, case, leaves, ref_out):
    if not y.requires_grad or not leaves:
        return []
    g = torch.Generator(device=y.device).manual_seed(DY_SEED)
    dy = torch.randn(y.shape, generator=g, device=y.device, dtype=torch.float32).to(y.dtype)
    names = list(leaves)
    grads = torch.autograd.grad(y, [leaves[n] for n in names], dy, allow_unused=True)
    case = {**case, "dy": dy}
    ref_args = dict(zip((a.name for a in rec.bwd_args), rec.bwd_call(case, ref_out)))
    ref = dict(zip((a.name for a in rec.bwd_outputs), rec.reference_bwd(*ref_args.values())))
    # the magnitude of each gradient's terms, the tolerance floor of results that cancel (the checker's)
    scales = _bwd_scales(rec, case, ref_args)
    reports = []
    for name, grad in zip(names, grads):
        if grad is None or ref.get(name) is None:
            continue  # the backend does not differentiate this input (e.g. its own internal weight)
        reports.append(compare(name, grad, ref[name], leaves[name].dtype, leaves[name].shape, scales["rows" if name == "dx" else name]))
    return reports


# ---------------------------------------------------------------- TritonBench's --plugin hook
def register_all(device: str | None = None, pattern: str | None = None, tb: TritonBench | None = None, ops=None) -> dict:
    """Register every available implementation on the given TritonBench operators (default both);
    returns {operator: {"backends": [...], "skipped": {impl: why}}}."""
    tb = tb or load_tritonbench()
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    out = {}
    for tb_op in ops or OPERATORS:
        impls, skipped = implementations_for(tb_op, device, pattern)
        out[tb_op] = {"backends": register_operator(tb, tb_op, impls), "skipped": skipped}
    return out


def plugin():
    """For TritonBench's ``--plugin harness.tools.tritonbench.plugin`` (versions that have it): called with
    no arguments when an operator is built. Registers every implementation available on this
    machine's default device, on both operators."""
    register_all()


# ---------------------------------------------------------------- `normbench tritonbench`
USAGE = """usage: normbench tritonbench [--op rms_norm|layer_norm] [--impl GLOB] [--report-dir DIR] [TritonBench args ...]

Runs TritonBench's rms_norm and/or layer_norm operator (default: both, one after the other) with every
available normbench implementation registered as a backend named normbench_<implementation>.

  --op OPS          rms_norm, layer_norm or both (comma-separated)
  --impl GLOB       normbench implementations to register (globs over names or DSLs; default: all available)
  --report-dir DIR  where the CSV and JSON of each run go (default: reports/tritonbench/<device>/)

Everything else goes to TritonBench, e.g. --mode fwd|bwd|fwd_bwd (or --bwd), --precision bf16,
--metrics latency,gbps,accuracy,fp64_accuracy,fp64_rel_l2, --num-inputs N, --only, --skip,
--keep-going, --device cuda|cpu. Asking for `accuracy` also reports fp64_accuracy and fp64_rel_l2.
"""


def _parse_own_args(argv: list[str]):
    if any(a in ("-h", "--help") for a in argv):
        return None, argv
    from harness.spec.errors import OneLineParser  # a usage error is one line, as everywhere in normbench

    p = OneLineParser(prog="normbench tritonbench", add_help=False, allow_abbrev=False)
    p.add_argument("--op", default=",".join(OPERATORS))
    p.add_argument("--impl", default=None)
    p.add_argument("--report-dir", default=None)
    ours, rest = p.parse_known_args(argv)
    ops = [o.strip() for o in ours.op.split(",") if o.strip()]
    bad = [o for o in ops if o not in OPERATORS]
    if bad or not ops:
        raise ValueError(f"unknown TritonBench operator '{','.join(bad) or ours.op}'; choose from {', '.join(OPERATORS)}")
    for flag in UNSUPPORTED_FLAGS:
        if any(a == flag or a.startswith(flag + "=") for a in rest):
            raise ValueError(f"{flag} is not supported by `normbench tritonbench` (it runs TritonBench in this process, one operator at a time)")
    ours.ops = ops
    return ours, rest


def _parse_tritonbench_args(tb: TritonBench, tb_op: str, rest: list[str]):
    argv = ["--op", tb_op, *rest]
    try:
        tb_args, extra = tb.get_parser(argv).parse_known_args(argv)
    except SystemExit as e:  # argparse already printed its message
        if e.code in (0, None):
            raise
        raise ValueError("TritonBench rejected the arguments (its message is above)") from None
    metrics = [m for m in (tb_args.metrics or "").split(",") if m]
    if "accuracy" in metrics:
        metrics += [m for m in FP64_METRICS if m not in metrics]
    if "gbps" in metrics and "latency" not in metrics:  # some TritonBench versions time only for latency
        metrics.insert(0, "latency")
    if metrics:
        tb_args.metrics = ",".join(metrics)
    return tb_args, extra


def _operator_details(tb_op: str, tb_args, backends: list[str]) -> str:
    """TritonBench's --list-backends / --list-metrics table, with ours registered."""
    try:
        from tritonbench.utils.list_operator_details import list_operator_details
    except ImportError:  # a TritonBench without it (or a pruned copy): our part only
        return f"{tb_op}: normbench backends {', '.join(backends)}; metrics {', '.join(FP64_METRICS)}"
    return list_operator_details(operators=[tb_op], show_metrics=tb_args.list_metrics, show_backends=tb_args.list_backends)


def _run_operator(bench, tb_args):
    import inspect

    # TritonBench renamed --iter to --rep and added --sleep; pass what this version has.
    params = inspect.signature(bench.run).parameters
    kwargs = {"warmup": tb_args.warmup}
    rep = getattr(tb_args, "rep", None) or getattr(tb_args, "iter", None)
    if rep is not None:
        kwargs["rep"] = rep
    if "sleep" in params and getattr(tb_args, "sleep", None) is not None:
        kwargs["sleep"] = tb_args.sleep
    bench.run(**kwargs)


def _device_label(device: str) -> str:
    from harness.run.environment import slug

    if device == "cuda" and torch.cuda.is_available():
        return slug(torch.cuda.get_device_name(0))
    return device


def _dtype_label(bench) -> str:
    # TritonBench's default precision ("bypass") leaves dtype None: the operators then make fp32 inputs.
    dtype = getattr(bench, "dtype", None) or torch.float32
    return DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def _input_range_label(tb_args) -> str:
    """'' for a run over all inputs; '-from<i>[-n<k>]' otherwise, so that runs split over the
    inputs (--input-id / --num-inputs) do not overwrite each other's files."""
    start = str(getattr(tb_args, "input_id", 0) or 0).replace(",", "_")
    num = getattr(tb_args, "num_inputs", None)
    if start == "0" and num is None:
        return ""
    return f"-from{start}" + (f"-n{num}" if num is not None else "")


def _tritonbench_commit(tb: TritonBench) -> str:
    if os.environ.get("TRITONBENCH_COMMIT"):
        return os.environ["TRITONBENCH_COMMIT"]
    if tb.path is None:
        return "unknown"
    # a copy without git metadata sits inside some other repository (ours, on the GPU machine), whose
    # HEAD git would report: only a repository whose top level holds the tritonbench package counts
    git = ["git", "-C", str(tb.path), "rev-parse", "--show-toplevel", "HEAD"]
    try:
        out = subprocess.run(git, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    lines = out.stdout.split()
    if out.returncode != 0 or len(lines) != 2 or not (Path(lines[0]) / "tritonbench" / "operators").is_dir():
        return "unknown"
    return lines[1]


def _write_outputs(bench, tb_args, out_dir: Path, stem: str, sidecar: dict) -> Path:
    """Our CSV (TritonBench's own format, ';'-separated) and JSON beside it; and the files
    TritonBench's own --output / --output-json / --output-dir flags ask for."""
    result = bench.output
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path = out_dir / f"{stem}.csv"
    with open(csv_path, "w", newline="") as f:
        result.write_csv_to_file(f)
    sidecar["notes"] = bench.__dict__.get("_normbench_fp64_notes", [])
    (out_dir / f"{stem}.json").write_text(json.dumps(sidecar, indent=1, default=str) + "\n")
    if getattr(tb_args, "output", None):
        with open(tb_args.output, "w", newline="") as f:
            result.write_csv_to_file(f)
    if getattr(tb_args, "output_json", None):
        with open(tb_args.output_json, "w") as f:
            result.write_json_to_file(f)
    if getattr(tb_args, "output_dir", None):
        os.makedirs(tb_args.output_dir, exist_ok=True)
        with open(os.path.join(tb_args.output_dir, f"{stem}.csv"), "w", newline="") as f:
            result.write_csv_to_file(f)
    return csv_path


def main(argv: list[str]) -> int:
    argv = list(argv)
    if argv[:1] == ["--"]:  # `normbench tritonbench -- --op ...`
        argv = argv[1:]
    ours, rest = _parse_own_args(argv)
    if ours is None:  # --help: ours, then TritonBench's (argparse prints it and exits 0)
        print(USAGE)
        try:
            tb = load_tritonbench()
        except ValueError as e:  # help is still help: say why TritonBench's own options are missing
            print(f"(TritonBench's own options are not listed: {e})")
            return 0
        tb.get_parser(["--help"])
        return 0
    tb = load_tritonbench()
    for tb_op in ours.ops:
        tb_args, extra = _parse_tritonbench_args(tb, tb_op, rest)
        impls, skipped = implementations_for(tb_op, tb_args.device, ours.impl)
        backends = register_operator(tb, tb_op, impls)
        print(f"[normbench] {tb_op}: registered {', '.join(backends) or 'no backend'}", file=sys.stderr)
        for name, why in skipped.items():
            print(f"[normbench] {tb_op}: skipped {name}: {why}", file=sys.stderr)
        if getattr(tb_args, "list_backends", False) or getattr(tb_args, "list_metrics", False):
            print(_operator_details(tb_op, tb_args, backends))
            continue
        bench = tb.load_operator(tb_op)(tb_args=tb_args, extra_args=extra)
        dtype = _dtype_label(bench)
        stem = f"{tb_op}-{_mode(bench)}-{dtype}" + _input_range_label(tb_args)
        out_dir = Path(ours.report_dir) if ours.report_dir else DEFAULT_REPORT_DIR / _device_label(tb_args.device)
        sidecar = {
            "command": "normbench tritonbench " + " ".join(shlex.quote(a) for a in argv),
            "operator": tb_op,
            "mode": _mode(bench),
            "dtype": dtype,
            "tritonbench_commit": _tritonbench_commit(tb),
            "environment": environment(tb_args.device),
            "backends": backends,
            "skipped": skipped,
        }
        try:
            _run_operator(bench, tb_args)
        except Exception as e:
            raise RuntimeError(
                f"TritonBench's {tb_op} run stopped: {_one_line(e)} (partial results in {out_dir}; "
                "--keep-going records a failing backend in the table instead)"
            ) from e
        finally:
            if getattr(bench, "output", None) is not None:
                csv_path = _write_outputs(bench, tb_args, out_dir, stem, sidecar)
                if not getattr(tb_args, "skip_print", False):
                    if getattr(tb_args, "csv", False):
                        bench.output.write_csv_to_file(sys.stdout)
                    else:
                        print(bench.output)
                print(f"[normbench] wrote {csv_path} and {csv_path.with_suffix('.json')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
