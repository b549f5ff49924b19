"""Correctness: one implementation x op x direction x shape x dtype against the fp64 reference.

Checked tensors: y and the statistics (fwd); dx, dweight, dbias (bwd). For each we report the max
absolute error, the max error in ulps of the output dtype at the reference value, and the relative L2
error; a tensor passes when every element is within ``harness.tolerances.allowed_error``, is finite
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

from . import reference
from .contract import DTYPE_NAMES, DTYPES, Implementation, describe_error
from .inputs import make_case
from .shapes import Shape
from .tolerances import allowed_error, ulp


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


def compare(name: str, out, ref: torch.Tensor | None, dtype: torch.dtype, shape, scale=None) -> TensorReport:
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
    max_abs = float(torch.nan_to_num(err, nan=float("inf")).max())
    max_ulp = float(torch.nan_to_num(err / ulp(ref, dtype), nan=float("inf")).max())
    ref_norm = float(ref.norm())
    rel_l2 = float(torch.nan_to_num(err, nan=float("inf")).norm()) / ref_norm if ref_norm else max_abs
    n_bad_finite = int(nonfinite.sum())
    if n_bad_finite:
        return TensorReport(name, False, max_abs, max_ulp, rel_l2, f"{n_bad_finite} NaN/Inf (or unwritten) elements")
    over = err > allowed_error(ref, dtype, scale)
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
) -> CheckResult:
    """Check one point. Never raises for a kernel's failure: that is recorded as status 'error'."""
    res = CheckResult(impl.name, op, direction, shape.label, dtype, device, "skip")
    why = impl.unavailable(device)
    if why is None and op not in impl.ops:
        why = f"does not implement {op}"
    if why is None and dtype not in impl.dtypes:
        why = f"does not support {dtype}"
    if why:
        res.error = why
        return res
    t0 = time.perf_counter()
    try:
        k = kernels or impl.kernels(device)
        case = make_case(op, shape, DTYPES[dtype], device, seed, affine)
        res.tensors = _check_tensors(k, op, direction, case)
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


def _check_tensors(k, op, direction, case) -> list[TensorReport]:
    x, dy, w, b, eps = case["x"], case["dy"], case["weight"], case["bias"], case["eps"]
    dt = x.dtype
    m_shape = x.shape[:-1]
    vec = (x.shape[-1],)
    layer = op == "layernorm"
    if direction == "fwd":
        ref = reference.layernorm_fwd(x, w, b, eps) if layer else reference.rmsnorm_fwd(x, w, eps)
        with poisoned_allocations():
            out = k.layernorm_fwd(x, w, b, eps) if layer else k.rmsnorm_fwd(x, w, eps)
        names = ("y", "mean", "rstd") if layer else ("y", "rstd")
        if not isinstance(out, tuple) or len(out) != len(names):
            raise TypeError(f"{op}_fwd must return a tuple ({', '.join(names)})")
        dtypes = (dt,) + (torch.float32,) * (len(names) - 1)
        shapes = (x.shape,) + (m_shape,) * (len(names) - 1)
        return [compare(nm, o, r, d, s) for nm, o, r, d, s in zip(names, out, ref, dtypes, shapes)]
    # backward: kernels get the reference statistics rounded to fp32, so dx is checked on its own
    if layer:
        _, mean, rstd = reference.layernorm_fwd(x, w, b, eps)
        stats = (mean.float(), rstd.float())
        ref = reference.layernorm_bwd(dy, x, w, mean, rstd)
        names = ("dx", "dweight", "dbias")
    else:
        _, rstd = reference.rmsnorm_fwd(x, w, eps)
        stats = (rstd.float(),)
        ref = reference.rmsnorm_bwd(dy, x, w, rstd)
        names = ("dx", "dweight")
    with poisoned_allocations():
        out = k.layernorm_bwd(dy, x, w, *stats) if layer else k.rmsnorm_bwd(dy, x, w, *stats)
    if not isinstance(out, tuple) or len(out) != len(names):
        raise TypeError(f"{op}_bwd must return a tuple ({', '.join(names)})")
    shapes = (x.shape, vec, vec)
    # The magnitude of each result's terms, for the tolerance floor (see harness.tolerances).
    dy64, r64 = dy.double().reshape(-1, x.shape[-1]), rstd.reshape(-1, 1)
    dx_terms = (dy64 * (w.double() if w is not None else 1.0) * r64).abs().reshape(x.shape)
    dw_terms = (dy64 * x.double().reshape(dy64.shape) * r64).square().sum(0).sqrt()
    scales = (dx_terms, dw_terms, dy64.square().sum(0).sqrt())
    return [compare(nm, o, r, dt, s, sc) for nm, o, r, s, sc in zip(names, out, ref, shapes, scales)]


def dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES[dtype]
