"""Correctness: one implementation x op x direction x shape x dtype against the fp64 reference.

Checked tensors: every output the op's record (harness.spec.ops) names: y, residual_out and the
statistics (fwd); dx / dh, dweight, dbias (bwd). Every op goes through the same code: the forward's
arguments come from the drawn case, the backward's from the case and the reference forward's outputs
rounded as the contract stores them (statistics fp32, rows in x's dtype). For each we report the max
absolute error, the max error in ulps of the output dtype at the reference value, and the relative L2
error; a tensor passes when every element is within ``harness.spec.tolerances.allowed_error``, is finite
where the reference is, and has the contract's shape and dtype.

Unwritten outputs: kernels allocate their own outputs, so the checker poisons the allocator instead
of the buffers: under ``torch.use_deterministic_algorithms`` PyTorch fills every ``torch.empty`` with
NaN, and an element a kernel forgot to write stays NaN and fails the finite check.
"""

from __future__ import annotations

import contextlib
import time
import traceback
from dataclasses import asdict, dataclass, field

import torch

from harness.spec.contract import DTYPE_NAMES, DTYPES, Implementation
from harness.spec.errors import describe_error
from harness.spec.inputs import OVERFLOW, make_case
from harness.spec.ops import check_weights, get_op
from harness.spec.shapes import Shape
from harness.spec.tolerances import TOLERANCES, allowed_error, ulp


@dataclass
class TensorReport:
    name: str
    passed: bool
    max_abs: float = float("nan")
    max_ulp: float = float("nan")
    rel_l2: float = float("nan")
    reason: str = ""


@dataclass
class CheckResult:
    impl: str
    op: str
    direction: str
    shape: str
    dtype: str
    device: str
    status: str  # pass | fail | error | skip
    tensors: list[TensorReport] = field(default_factory=list)
    error: str = ""
    seconds: float = 0.0
    traceback: str = ""
    weights: str = "same"  # harness.spec.ops.WEIGHTS
    overflow: bool = False

    @property
    def passed(self) -> bool:
        return self.status == "pass"

    def summary(self) -> str:
        if self.status in ("error", "skip"):
            return self.error
        bad = [t for t in self.tensors if not t.passed]
        worst = bad or self.tensors
        return "; ".join(f"{t.name}: {t.reason or f'{t.max_ulp:.2g} ulp, relL2 {t.rel_l2:.1e}'}" for t in worst)

    def to_json(self) -> dict:
        return asdict(self)


@contextlib.contextmanager
def poisoned_allocations():
    """Every torch.empty inside is NaN-filled (ints: their max), so unwritten elements show."""
    prev = torch.are_deterministic_algorithms_enabled()
    prev_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    prev_fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = prev_fill
        torch.use_deterministic_algorithms(prev, warn_only=prev_warn)


# dtypes the overflow inputs exist in (fp16's largest value is 65504)
OVERFLOW_DTYPES = ("bf16", "fp32")


def compare(
    name: str, out, ref: torch.Tensor | None, dtype: torch.dtype, shape, scale=None, nonfinite_ok=False, rounded_term=None
) -> TensorReport:
    """``nonfinite_ok``: a NaN/Inf element passes (inputs that overflow fp32, where torch returns
    NaN); every finite element must still be within tolerance. ``rounded_term``: a term of the result
    that the contract lets an implementation store in ``dtype`` before the last add (the unfused
    add_rmsnorm backward rounds dx, then adds dresidual_out): its rounding is allowed on top."""
    if ref is None:
        if out is not None:
            return TensorReport(name, False, reason="expected None (no weight/bias), got a tensor")
        return TensorReport(name, True, 0.0, 0.0, 0.0)
    if not isinstance(out, torch.Tensor):
        return TensorReport(name, False, reason=f"expected a tensor, got {type(out).__name__}")
    if tuple(out.shape) != tuple(shape):
        return TensorReport(name, False, reason=f"shape {tuple(out.shape)}, expected {tuple(shape)}")
    if out.dtype != dtype:
        return TensorReport(name, False, reason=f"dtype {out.dtype}, expected {dtype}")
    if out.device != ref.device:
        return TensorReport(name, False, reason=f"on {out.device}, expected {ref.device}")
    if ref.numel() == 0:
        return TensorReport(name, True, 0.0, 0.0, 0.0)
    o = out.detach().to(torch.float64)
    err = (o - ref).abs()
    nonfinite = ~torch.isfinite(o) & torch.isfinite(ref)
    if nonfinite_ok:
        err = torch.where(nonfinite, 0.0, err)
        nonfinite = torch.zeros_like(nonfinite)
    max_abs = float(torch.nan_to_num(err, nan=float("inf")).max())
    max_ulp = float(torch.nan_to_num(err / ulp(ref, dtype), nan=float("inf")).max())
    ref_norm = float(ref.norm())
    rel_l2 = float(torch.nan_to_num(err, nan=float("inf")).norm()) / ref_norm if ref_norm else max_abs
    n_bad_finite = int(nonfinite.sum())
    if n_bad_finite:
        return TensorReport(name, False, max_abs, max_ulp, rel_l2, f"{n_bad_finite} NaN/Inf (or unwritten) elements")
    allowed = allowed_error(ref, dtype, scale)
    if rounded_term is not None:
        tol = TOLERANCES[dtype]
        allowed = allowed + torch.maximum(tol.ulps * ulp(rounded_term, dtype), tol.rtol * rounded_term.abs())
    over = err > allowed
    n_over = int(over.sum())
    if n_over:
        idx = tuple(int(i) for i in torch.nonzero(over)[0])
        reason = (
            f"{n_over} elements over tolerance (max {max_ulp:.3g} ulp, relL2 {rel_l2:.2e}; "
            f"first at {idx}: got {float(o[idx]):.6g}, ref {float(ref[idx]):.6g})"
        )
        return TensorReport(name, False, max_abs, max_ulp, rel_l2, reason)
    return TensorReport(name, True, max_abs, max_ulp, rel_l2)


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def run_check(
    impl: Implementation,
    op: str,
    direction: str,
    shape: Shape,
    dtype: str = "bf16",
    device: str = "cpu",
    seed: int = 0,
    affine: bool = True,
    kernels=None,
    weights: str = "same",
    overflow: bool = False,
) -> CheckResult:
    """Check one point. Never raises for a kernel's failure: that is recorded as status 'error'.
    ``weights``: the parameters' variant (harness.spec.ops.WEIGHTS); ``overflow``: inputs whose squares
    overflow fp32 (harness.spec.inputs.OVERFLOW), where NaN is accepted and the backward runs on the
    implementation's own forward statistics, as a training step would."""
    rec = get_op(op)
    check_weights(weights)
    res = CheckResult(impl.name, op, direction, shape.label, dtype, device, "skip", weights=weights, overflow=overflow)
    why = impl.unavailable(device)
    if why is None and op not in impl.ops:
        why = f"does not implement {op}"
    if why is None and dtype not in impl.dtypes:
        why = f"does not support {dtype}"
    if why is None and overflow and not rec.overflow:
        why = f"{op} is not checked on overflowing inputs (harness.spec.ops)"
    if why is None and overflow and dtype not in OVERFLOW_DTYPES:
        why = f"overflow inputs (~{OVERFLOW:g}) are not representable in {dtype}"
    if why:
        res.error = why
        return res
    t0 = time.perf_counter()
    try:
        k = kernels or impl.kernels(device)
        case = make_case(op, shape, DTYPES[dtype], device, seed, affine, weights, overflow)
        res.tensors = _check_tensors(k, rec, direction, case, overflow)
        _sync(device)
        res.status = "pass" if all(t.passed for t in res.tensors) else "fail"
    except Exception as e:  # a crashing kernel is a result, not the end of the run
        res.status = "error"
        res.error = describe_error(e, 500)
        res.tensors = []
        if isinstance(e, torch.cuda.OutOfMemoryError):
            torch.cuda.empty_cache()
        res.traceback = traceback.format_exc(limit=6)
    res.seconds = time.perf_counter() - t0
    return res


def _expected(arg, case) -> tuple:
    """(dtype, shape) the contract gives an output of ``arg``'s kind."""
    x, w = case["x"], case["weight"]
    if arg.kind == "rows":
        return x.dtype, x.shape
    if arg.kind == "stat":
        return torch.float32, x.shape[:-1]
    return (w.dtype if w is not None else x.dtype), (x.shape[-1],)


def _call(k, fn_name, args, names):
    with poisoned_allocations():
        out = getattr(k, fn_name)(*args)
    if not isinstance(out, tuple) or len(out) != len(names):
        raise TypeError(f"{fn_name} must return a tuple ({', '.join(names)})")
    return out


def _bwd_scales(rec, case, ref_args: dict) -> dict:
    """The magnitude of each gradient's terms, for the tolerance floor (see harness.spec.tolerances):
    rows: rstd * dy * w (plus the gradients added to it: dresidual_out); dweight: the column L2
    norms of dy * xhat; dbias: those of dy."""
    n = case["x"].shape[-1]
    dy = case["dy"].double().reshape(-1, n)
    rstd = ref_args["rstd"].double().reshape(-1, 1)
    w = case["weight"]
    rows = (dy * (w.double() if w is not None else 1.0) * rstd).abs()
    added = [ref_args[a.name].double().reshape(-1, n) for a in rec.bwd_args if a.kind == "rows" and a.optional and ref_args[a.name] is not None]
    for t in added:
        rows = rows + t.abs()
    xhat = ref_args[rec.normed].double().reshape(-1, n) * rstd  # LayerNorm too: an upper bound of its terms
    shape = case["x"].shape
    return {
        "rows": rows.reshape(shape),
        "dweight": (dy * xhat).square().sum(0).sqrt(),
        "dbias": dy.square().sum(0).sqrt(),
        # the norm's own dx, which an unfused backward stores before adding the other gradients
        "rounded_term": (lambda dh: (dh.reshape(-1, n) - sum(added)).reshape(shape)) if added else None,
    }


def _check_tensors(k, rec, direction, case, overflow=False) -> list[TensorReport]:
    """Check the outputs of ``k``'s functions for ``rec`` (an op record or its name) on ``case``."""
    rec = get_op(rec) if isinstance(rec, str) else rec
    fwd_args = rec.fwd_call(case)
    ref_fwd = rec.reference_fwd(*fwd_args)
    if direction == "fwd":
        names = [a.name for a in rec.fwd_outputs]
        out = _call(k, rec.function("fwd"), fwd_args, names)
        return [compare(a.name, o, r, *_expected(a, case), nonfinite_ok=overflow) for a, o, r in zip(rec.fwd_outputs, out, ref_fwd)]
    if overflow:  # the chain a training step runs: the implementation's own forward outputs
        fwd_out = getattr(k, rec.function("fwd"))(*fwd_args)
    else:  # the reference's, rounded as the contract stores them, so the backward is checked on its own
        fwd_out = [r.to(case["x"].dtype) if a.kind == "rows" else r.float() for a, r in zip(rec.fwd_outputs, ref_fwd)]
    ref_args = dict(zip((a.name for a in rec.bwd_args), rec.bwd_call(case, ref_fwd)))
    ref = rec.reference_bwd(*ref_args.values())
    names = [a.name for a in rec.bwd_outputs]
    out = _call(k, rec.function("bwd"), rec.bwd_call(case, fwd_out), names)
    scales = _bwd_scales(rec, case, ref_args)
    term = scales["rounded_term"]
    reports = []
    for a, o, r in zip(rec.bwd_outputs, out, ref):
        rows = a.kind == "rows"
        extra = term(r) if (rows and term) else None
        reports.append(compare(a.name, o, r, *_expected(a, case), scales["rows" if rows else a.name], overflow, extra))
    return reports


def dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES[dtype]
