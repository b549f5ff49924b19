"""Correctness: one implementation x op x direction x shape x dtype against the fp64 reference.

Checked tensors: every output the op's record (harness.spec.ops) names: y, residual_out and the
statistics (fwd); dx / dh, dweight, dbias (bwd). Every op goes through the same code: the forward's
arguments come from the drawn case, the backward's from the case and the reference forward's outputs
rounded as the contract stores them (statistics fp32, rows in x's dtype). For each we report the max
absolute error, the max error in ulps of the output dtype at the reference value, and the relative L2
error; a tensor passes when every element is within ``harness.spec.tolerances.allowed_error``, is finite
where the reference is, has the contract's shape and dtype, and its errors average out: the mean
signed error over the tensor (in units of each element's allowed error, signed by the reference: a
scale bias; and plain: an offset) within its sampling noise and a small floor
(``harness.spec.tolerances``: ``BIAS_Z``, ``Tol.bias``). A kernel whose every element is within 2 ulps
can still be off by 0.5% throughout; only the mean shows it.

The FP8 ops (q, scale) have a rule of their own (``_check_quantized``; harness.spec.tolerances): scale
and q against the exact quantization of the fp64 y at the implementation's own statistics, q * scale
within half an e4m3 step, and an allowance for y rounded to x's dtype first only where the record
declares it (``rounds_before_quantizing``).

Unwritten outputs: kernels allocate their own outputs, so the checker poisons the allocator instead
of the buffers: under ``torch.use_deterministic_algorithms`` PyTorch fills every ``torch.empty`` with
NaN, and an element a kernel forgot to write stays NaN and fails the finite check.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
import traceback
from dataclasses import asdict, dataclass, field

import torch

from harness.spec.contract import DTYPE_NAMES, DTYPES, Implementation
from harness.spec.errors import describe_error
from harness.spec.fp8 import FP8_DTYPE, e4m3_round, e4m3_step, quantize
from harness.spec.inputs import OVERFLOW, make_case
from harness.spec.interpreters import INTERPRETERS
from harness.spec.ops import check_weights, get_op
from harness.spec.shapes import Shape
from harness.spec.tolerances import (
    BIAS_MIN_COLUMNS,
    BIAS_MIN_ELEMENTS,
    BIAS_Z,
    Q_BAND_REL,
    SCALE_REL,
    SCALE_ULPS,
    TOLERANCES,
    TOWARD_ZERO_ULPS,
    allowed_error,
    rounding_allowance,
    ulp,
)


@dataclass
class TensorReport:
    name: str
    passed: bool
    max_abs: float = float("nan")
    max_ulp: float = float("nan")
    rel_l2: float = float("nan")
    reason: str = ""
    # mean signed error in units of the allowed error: signed by the reference (> 0: too large in
    # magnitude) and plain; and the bound both are held to (nan: too few elements to tell)
    bias: float = float("nan")
    offset: float = float("nan")
    bias_bound: float = float("nan")
    # q of the FP8 ops: elements one e4m3 step from the exact rounding, passed because y / scale lies
    # within the reference's rounding tolerance of a rounding boundary (None: not a quantized tensor)
    boundary: int | None = None


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
    gpu_id: str | None = None  # which GPU of the host checked it (harness.run.environment.gpu_id)

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

    @classmethod
    def from_json(cls, d: dict) -> "CheckResult":
        return cls(**{**d, "tensors": [TensorReport(**t) for t in d.get("tensors", [])]})


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


def truncating_interpreter(device, dtype, impl: Implementation | None = None) -> bool:
    """Whether bf16 outputs on ``device`` come from Triton's CPU interpreter, which converts fp32 to
    bf16 by truncation (a GPU rounds to nearest even): ``impl``'s record says so where given, else
    the environment (TRITON_INTERPRET=1)."""
    if dtype != torch.bfloat16 or device is None or torch.device(device).type != "cpu":
        return False
    if impl is not None:
        return impl.interpreter == INTERPRETERS["triton"]
    return os.environ.get(INTERPRETERS["triton"]) == "1"


def _mean_and_stderr(e: torch.Tensor, valid: torch.Tensor) -> tuple[float, float]:
    """The mean of ``e`` over ``valid`` elements of its rows (dim 0) and its standard error, taken
    over elements and, from 8 rows (columns) on, over rows (columns): the rows' sums about the mean,
    as elements of a row share its statistics, and the columns', as elements of a column share its
    weight and bias, so their errors need not be independent; the largest. Fewer rows give
    too noisy a spread; there the floor (``Tol.bias``) covers an fp32 statistic's error, which moves
    a row by ~1e-7, a thousandth of fp32's rtol. nan where fewer than ``BIAS_MIN_ELEMENTS``."""
    e = torch.where(valid, e, 0.0)
    count = valid.sum()
    n = int(count)
    if n < BIAS_MIN_ELEMENTS:
        return float("nan"), float("nan")
    mean = e.sum() / count
    dev = torch.where(valid, e - mean, 0.0)
    se_elem = (dev.square().sum() / (n - 1)).sqrt() / n**0.5
    rows = int((valid.sum(-1) > 0).sum())
    cols = int((valid.sum(0) > 0).sum())
    se = se_elem
    if rows >= 8:
        se = torch.maximum(se, (dev.sum(-1).square().sum() * rows / (rows - 1)).sqrt() / n)
    if cols >= 8 and e.shape[-1] > 1:  # elements of a column share its weight and bias
        se = torch.maximum(se, (dev.sum(0).square().sum() * cols / (cols - 1)).sqrt() / n)
    return float(mean), float(se)


def bias_check(o, ref, allowed, dtype, valid, toward_zero=False) -> tuple[float, float, float, str]:
    """(scale bias, offset, bound, reason: "" when within it) of a tensor's errors, in units of the
    allowed error: the mean of sign(ref) * (out - ref) / allowed, and of (out - ref) / allowed, each
    held to ``BIAS_Z`` standard errors plus the dtype's ``Tol.bias``. ``toward_zero``: the outputs
    were converted by truncation (Triton's CPU interpreter in bf16): up to ``TOWARD_ZERO_ULPS`` of
    bias toward zero is allowed, in that direction only."""
    n = ref.shape[-1] if ref.dim() >= 2 else 1
    if 1 < n < BIAS_MIN_COLUMNS or (ref.dim() >= 2 and n == 1):
        # rows this short take a few values set by the parameters (LayerNorm at N = 1 gives
        # y = bias on every row): their errors are one or a few roundings, not a sample
        return float("nan"), float("nan"), float("nan"), ""
    e = ((o - ref) / allowed).reshape(-1, n)
    sign = torch.sign(ref).reshape(-1, n)
    valid = (valid & torch.isfinite(o) & torch.isfinite(ref)).reshape(-1, n)
    bias, se_b = _mean_and_stderr(e * sign, valid & (sign != 0))
    offset, se_o = _mean_and_stderr(e, valid)
    if math.isnan(bias) or math.isnan(offset):
        return bias, offset, float("nan"), ""
    floor = TOLERANCES[dtype].bias
    bound = BIAS_Z * max(se_b, se_o) + floor
    slack = 0.0
    if toward_zero and dtype == torch.bfloat16:
        share = (TOWARD_ZERO_ULPS * ulp(ref, dtype) / allowed).reshape(-1, n)
        slack = float(torch.where(valid, share, 0.0).sum() / valid.sum())
    if not -(bound + slack) <= bias <= bound:
        return bias, offset, bound, (
            f"biased: mean error {bias:+.3g} of the allowed error toward "
            f"{'larger' if bias > 0 else 'smaller'} magnitudes (bound {bound:.2g}"
            + (f", {slack:.2g} more toward zero" if slack else "") + f"; {int(valid.sum())} elements)"
        )  # fmt: skip
    if abs(offset) > bound + slack:
        return bias, offset, bound, f"biased: mean signed error {offset:+.3g} of the allowed error (bound {bound + slack:.2g}; {int(valid.sum())} elements)"
    return bias, offset, bound, ""


def compare(
    name: str, out, ref: torch.Tensor | None, dtype: torch.dtype, shape, scale=None, nonfinite_ok=False, rounded_term=None,
    toward_zero=None,
) -> TensorReport:  # fmt: skip
    """``nonfinite_ok``: a NaN/Inf element passes (inputs that overflow fp32, where torch returns
    NaN); every finite element must still be within tolerance. ``rounded_term``: a term of the result
    that the contract lets an implementation store in ``dtype`` before the last add (the unfused
    add_rmsnorm backward rounds dx, then adds dresidual_out): its rounding is allowed on top.
    ``toward_zero``: see ``bias_check``; None: where Triton's interpreter is on and ``out`` is a bf16
    CPU tensor (a caller that knows which implementation made ``out`` says so: ``run_check`` does)."""
    if toward_zero is None:
        toward_zero = out is not None and truncating_interpreter(getattr(out, "device", None), dtype)
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
    bias, offset, bound, biased = bias_check(o, ref, allowed, dtype, ~over, toward_zero)
    stats = {"bias": bias, "offset": offset, "bias_bound": bound}
    if n_over:
        idx = tuple(int(i) for i in torch.nonzero(over)[0])
        reason = (
            f"{n_over} elements over tolerance (max {max_ulp:.3g} ulp, relL2 {rel_l2:.2e}; "
            f"first at {idx}: got {float(o[idx]):.6g}, ref {float(ref[idx]):.6g})"
        )
        return TensorReport(name, False, max_abs, max_ulp, rel_l2, reason, **stats)
    return TensorReport(name, not biased, max_abs, max_ulp, rel_l2, biased, **stats)


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
    if why is None and not rec.offers(direction):
        why = f"{op} has no {direction} (it has {', '.join(rec.directions)})"
    if why is None:
        why = rec.unsupported(shape.n)
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
        res.tensors = _check_tensors(k, rec, direction, case, overflow, truncating_interpreter(device, DTYPES[dtype], impl),
                                     rounded=impl.rounds_before_quantizing)  # fmt: skip
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
    if arg.kind == "fp8":
        return FP8_DTYPE, x.shape
    if arg.kind == "scale":
        return torch.float32, (*x.shape[:-1], x.shape[-1] // case["group"])
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


def _check_tensors(k, rec, direction, case, overflow=False, toward_zero=None, rounded=False) -> list[TensorReport]:
    """Check the outputs of ``k``'s functions for ``rec`` (an op record or its name) on ``case``;
    ``toward_zero``: see ``bias_check``; ``rounded``: the implementation declares
    ``rounds_before_quantizing`` (FP8 ops)."""
    rec = get_op(rec) if isinstance(rec, str) else rec
    if rec.quantized:
        return _check_quantized(k, rec, case, toward_zero, rounded)
    fwd_args = rec.fwd_call(case)
    ref_fwd = rec.reference_fwd(*fwd_args)
    if direction == "fwd":
        names = [a.name for a in rec.fwd_outputs]
        out = _call(k, rec.function("fwd"), fwd_args, names)
        return [compare(a.name, o, r, *_expected(a, case), nonfinite_ok=overflow, toward_zero=toward_zero)
                for a, o, r in zip(rec.fwd_outputs, out, ref_fwd)]  # fmt: skip
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
        reports.append(compare(a.name, o, r, *_expected(a, case), scales["rows" if rows else a.name], overflow, extra, toward_zero))
    return reports


# ---------------------------------------------------------------- FP8 ops
def _own(out, ref: torch.Tensor) -> torch.Tensor:
    """The implementation's output ``out`` in fp64 where it is usable as the statistics of its own
    y (a tensor of the reference's shape, finite), else the reference's."""
    if isinstance(out, torch.Tensor) and tuple(out.shape) == tuple(ref.shape) and out.device == ref.device:
        o = out.detach().to(torch.float64)
        if bool(torch.isfinite(o).all()):
            return o
    return ref


def _form(name, out, dtype, shape, device) -> TensorReport | None:
    """A failing report when ``out`` is not a tensor of ``shape`` and ``dtype`` on ``device``."""
    if not isinstance(out, torch.Tensor):
        return TensorReport(name, False, reason=f"expected a tensor, got {type(out).__name__}")
    if tuple(out.shape) != tuple(shape):
        return TensorReport(name, False, reason=f"shape {tuple(out.shape)}, expected {tuple(shape)}")
    if out.dtype != dtype:
        return TensorReport(name, False, reason=f"dtype {out.dtype}, expected {dtype}")
    if out.device != device:
        return TensorReport(name, False, reason=f"on {out.device}, expected {device}")
    return None


def _per_element(s: torch.Tensor, group: int) -> torch.Tensor:
    """(..., G) scales -> (..., G * group), each repeated over its group."""
    return s.repeat_interleave(group, dim=-1)


def _check_quantized(k, rec, case, toward_zero=None, rounded=False) -> list[TensorReport]:
    """The FP8 ops' rule (harness.spec.tolerances: SCALE_ULPS, SCALE_REL, Q_BAND_REL): the row
    outputs and statistics as for any op; scale and q against the exact quantization of the fp64 y
    at the implementation's own statistics; q * scale within half an e4m3 step of that y.
    ``rounded``: the implementation stores y in x's dtype first (``rounds_before_quantizing``)."""
    fwd_args = rec.fwd_call(case)
    names = [a.name for a in rec.fwd_outputs]
    ref = dict(zip(names, rec.reference_fwd(*fwd_args)))
    out = dict(zip(names, _call(k, rec.function("fwd"), fwd_args, names)))
    x, w, group = case["x"], case["weight"], case["group"]
    reports = {
        a.name: compare(a.name, out[a.name], ref[a.name], *_expected(a, case), toward_zero=toward_zero)
        for a in rec.fwd_outputs
        if a.kind in ("rows", "stat")
    }
    if x.numel() == 0:
        reports.update({a.name: _form(a.name, out[a.name], *_expected(a, case), x.device) or TensorReport(a.name, True, 0.0, 0.0, 0.0)
                        for a in rec.fwd_outputs if a.kind in ("fp8", "scale")})  # fmt: skip
        return [reports[n] for n in names]
    slack = rounding_allowance(x.dtype) if rounded else 0.0
    # y at the implementation's own statistics, each checked above: its rstd (and residual_out)
    normed = _own(out["residual_out"], ref["residual_out"]) if "residual_out" in ref else x.detach().to(torch.float64)
    y = normed * _own(out["rstd"], ref["rstd"]).unsqueeze(-1)
    if w is not None:
        y = y * w.detach().to(torch.float64)
    _, s_own = quantize(y, group)

    s = out["scale"]
    bad = _form("scale", s, *_expected(rec.fwd_outputs[names.index("scale")], case), x.device)
    s_use = s_own
    if bad is None:
        s64 = s.detach().to(torch.float64)
        u = ulp(s_own, torch.float32)
        err = torch.nan_to_num((s64 - s_own).abs(), nan=float("inf"))
        over = err > SCALE_ULPS * u + (SCALE_REL + slack) * s_own
        stats = (float(err.max()), float((err / u).max()), float(err.norm() / s_own.norm()))
        if bool(over.any()):
            idx = tuple(int(i) for i in torch.nonzero(over)[0])
            bad = TensorReport("scale", False, *stats, f"{int(over.sum())} of {over.numel()} scales over tolerance (max {stats[1]:.3g} ulp of fp32; "
                               f"first at {idx}: got {float(s64[idx]):.8g}, expected {float(s_own[idx]):.8g})")  # fmt: skip
        else:
            s_use = s64
    reports["scale"] = bad or TensorReport("scale", True, *stats)

    q = out["q"]
    bad = _form("q", q, FP8_DTYPE, x.shape, x.device)
    if bad is None:
        q64 = q.detach().to(torch.float64)
        nan = torch.isnan(q64)
        if bool(nan.any()):
            bad = TensorReport("q", False, reason=f"{int(nan.sum())} NaN (or unwritten) elements")
    if bad is not None:
        reports["q"] = bad
        return [reports[n] for n in names]
    v = y / _per_element(s_use, group)
    band = (Q_BAND_REL + slack) * v.abs()
    exact, lo, hi = e4m3_round(v), e4m3_round(v - band), e4m3_round(v + band)
    ok = (q64 == lo) | (q64 == hi)
    off = q64 != exact
    steps = (q64 - exact).abs() / e4m3_step(torch.maximum(q64.abs(), exact.abs()))
    stats = (float((q64 - exact).abs().max()), float(steps.max()), float((q64 - exact).norm() / exact.norm().clamp_min(1e-300)))
    n_bad = int((~ok).sum())
    boundary = int((off & ok).sum())
    if n_bad:
        idx = tuple(int(i) for i in torch.nonzero(~ok)[0])
        reports["q"] = TensorReport("q", False, *stats, f"{n_bad} elements off the exact e4m3 rounding (max {stats[1]:.3g} e4m3 steps; "
                                    f"first at {idx}: got {float(q64[idx]):.6g}, exact {float(exact[idx]):.6g} of y/scale = "
                                    f"{float(v[idx]):.9g})", boundary=boundary)  # fmt: skip
    else:
        reports["q"] = TensorReport("q", True, *stats, boundary=boundary)
    # the dequantized values, at the step the exact scale gives y
    deq = q64 * _per_element(s_use, group)
    s_el = _per_element(s_own, group)
    err = (deq - y).abs()
    half = 0.5 * e4m3_step(torch.maximum(y.abs(), deq.abs()) / s_el) * s_el
    allowed = half * (1 + Q_BAND_REL) + (Q_BAND_REL + slack) * y.abs()
    over = err > allowed
    stats = (float(err.max()), float((err / (2 * half)).max()), float(err.norm() / y.norm().clamp_min(1e-300)))
    if bool(over.any()):
        idx = tuple(int(i) for i in torch.nonzero(over)[0])
        deq_report = TensorReport("q*scale", False, *stats, f"{int(over.sum())} dequantized elements beyond half an e4m3 step of y "
                                  f"(first at {idx}: got {float(deq[idx]):.6g}, y {float(y[idx]):.6g})")  # fmt: skip
    else:
        deq_report = TensorReport("q*scale", True, *stats)
    return [reports[n] for n in names] + [deq_report]


def dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES[dtype]
