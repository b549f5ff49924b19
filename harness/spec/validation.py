"""The contract's argument checks, and the wrapper that puts them in front of every kernel.

Every contract function of every implementation is called through ``checked``: it validates the
arguments (a clear ValueError / TypeError naming the argument, never a kernel's crash), flattens
leading dimensions to (M, N) rows without copying where a view suffices, answers M = 0 itself, and
gives the outputs back in the caller's shape. It is built from the op record (``harness.spec.ops``):
argument kinds say what each check is, so a new op needs no wrapper of its own. The same checks run
where torch.compile traces (``harness.integrate``: in the autograd layer before an op is called, and
on fake tensors in the ops); ``shape_text`` keeps their messages something dynamo can format there.

Launch plans: what the checks decide (the reshapes, copies, substitutions, and the outputs' shapes)
depends only on what ``call_key`` reads of the arguments, each tensor's type, shape, strides, dtype and
device, and each other value's type. So the first call with a given key is validated in full and
leaves a plan, and a later call with the same key runs the plan: straight to the kernel, with the
values that are not tensors (eps, group) checked again on every call. Anything that could make the
checks fail differs from the key of a call that passed them, so bad input still meets the full
checks and their error.
"""

from __future__ import annotations

import inspect
import math
import numbers
from typing import Callable

import torch

from harness.spec.contract import DTYPE_NAMES, PARAM_DTYPES
from harness.spec.fp8 import FP8_DTYPE, check_group
from harness.spec.interpreters import INTERPRETERS, interpreter_env


def check_tensor(t, what: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")


def shape_text(t: torch.Tensor) -> str:
    """``str(tuple(t.shape))``, built one size at a time: under torch.compile with dynamic shapes,
    dynamo can format a symbolic size on its own (specialising it) but not a tuple of them, and the
    autograd layer formats these messages while dynamo traces (``harness.integrate.library``)."""
    dims = [f"{d}" for d in t.shape]
    return "(" + ", ".join(dims) + ("," if len(dims) == 1 else "") + ")"


def _same_device(t: torch.Tensor | None, x: torch.Tensor, what: str):
    if t is not None and t.device != x.device:
        raise ValueError(f"{what} is on {t.device} but x is on {x.device}")


def check_x(x, impl, what: str = "x") -> tuple[int, int]:
    """The row tensor a call is shaped by: (M, N) of an (..., N) tensor of a dtype and device the
    implementation takes."""
    check_tensor(x, what)
    if x.dim() < 1:
        raise ValueError(f"{what} must have at least one dimension (..., N)")
    n = x.shape[-1]
    if n == 0:
        raise ValueError(f"{what} has N = 0 along its last dimension: nothing to normalize")
    if not x.dtype.is_floating_point:
        raise TypeError(f"{what} must be a floating-point tensor, got {x.dtype}")
    if x.dtype not in DTYPE_NAMES or DTYPE_NAMES[x.dtype] not in impl.dtypes:
        raise TypeError(f"implementation '{impl.name}' supports {', '.join(impl.dtypes)}; {what} is {x.dtype}")
    dev = x.device.type
    if dev not in impl.devices:
        raise ValueError(f"implementation '{impl.name}' runs on {', '.join(impl.devices)} tensors; {what} is on {dev}")
    return x.numel() // n, n


def check_vector(t, n: int, x: torch.Tensor, what: str):
    """A parameter (weight, bias): None, or (N,) on x's device in x's dtype or fp32; contiguous."""
    if t is None:
        return None
    check_tensor(t, what)
    if t.dim() != 1 or t.shape[0] != n:
        raise ValueError(f"{what} must have shape ({n},) to match x's last dimension, got {shape_text(t)}")
    _same_device(t, x, what)
    check_param_dtype(t, x, what)
    return t.contiguous()


def check_param_dtype(t: torch.Tensor, x: torch.Tensor, what: str) -> None:
    """A parameter's dtype: x's, or fp32 beside 16-bit x."""
    if t.dtype != x.dtype and t.dtype not in PARAM_DTYPES:
        raise TypeError(f"{what} must have x's dtype {x.dtype} or float32, got {t.dtype}")


def check_like_x(t, x: torch.Tensor, what: str) -> None:
    """A tensor that must match x in shape, dtype and device (dy, residual, ...)."""
    check_tensor(t, what)
    if t.shape != x.shape:
        raise ValueError(f"{what} has shape {shape_text(t)} but x has {shape_text(x)}")
    _same_device(t, x, what)
    if t.dtype != x.dtype:
        raise TypeError(f"{what} must have x's dtype {x.dtype}, got {t.dtype}")


def check_stats(t, m: int, x: torch.Tensor, what: str) -> torch.Tensor:
    """A per-row statistic (rstd, mean): M fp32 values on x's device; contiguous (M,)."""
    check_tensor(t, what)
    if t.numel() != m:
        raise ValueError(f"{what} must hold one value per row ({m}), got shape {shape_text(t)}")
    if t.dtype != torch.float32:
        raise TypeError(f"{what} must be float32, got {t.dtype}")
    _same_device(t, x, what)
    return t if t.dim() == 1 and t.is_contiguous() else t.reshape(m).contiguous()


def _real(v, what: str) -> float:
    # a Python or NumPy int or float (NumPy registers its scalars as numbers.Real); a bool is a
    # number to Python but never a meant one here
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        hint = ""
        if torch.compiler.is_compiling() and type(v).__name__ == "ndarray":
            # dynamo traces a NumPy scalar as an array, whose value it cannot read while tracing
            hint = " (a NumPy scalar is an array inside torch.compile: pass float(...))"
        raise TypeError(f"{what} must be a real number (int or float), got {type(v).__name__}{hint}")
    return float(v)


def check_eps(eps) -> float:
    """eps: a real number >= 0 (NaN refused), as a Python float."""
    value = _real(eps, "eps")
    if not value >= 0:
        raise ValueError(f"eps must be >= 0, got {value}")
    return value


def check_weight_offset(offset) -> float:
    """weight_offset: a finite real number, as a Python float."""
    value = _real(offset, "weight_offset")
    if not -math.inf < value < math.inf:  # NaN too (math.isfinite takes no symbolic float under torch.compile)
        raise ValueError(f"weight_offset must be finite, got {value}")
    return value


def as_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """(..., N) -> (M, N) with unit stride along N, without copying when a view suffices."""
    t2 = t.reshape(-1, n) if t.dim() != 2 else t
    if n > 1 and t2.stride(1) != 1:
        t2 = t2.contiguous()
    return t2


def has_no_row_view(t: torch.Tensor) -> bool:
    """A 3-D (T, H, N) tensor with unit stride along N whose rows no (T*H, N) view reaches: the
    per-head views of a fused QKV tensor (token stride P*N with P > H)."""
    return (
        t.dim() == 3
        and t.shape[0] > 1
        and t.shape[1] > 1
        and t.stride(0) != t.shape[1] * t.stride(1)
        and (t.shape[2] <= 1 or t.stride(2) == 1)
    )


def as_head_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """(T, H, N) with unit stride along N, as given when it is: an implementation that declares
    ``row_views`` addresses row t*H + h at t * stride(0) + h * stride(1) itself."""
    return t if n <= 1 or t.stride(2) == 1 else t.contiguous()


def shaping_arg(op, direction: str) -> int:
    """Position of the row tensor a call is shaped by: x in a forward; in a backward the tensor the
    norm is differentiated at (x, or residual_out), not dy."""
    args = op.fwd_args if direction == "fwd" else op.bwd_args
    name = args[0].name if direction == "fwd" else op.normed
    return next(i for i, a in enumerate(args) if a.name == name)


def check_args(impl, args, ref_i: int, values) -> tuple[int, int, torch.Tensor, list]:
    """Validate one call's ``values`` against the op record's ``args``: (M, N, the row tensor the
    call is shaped by, the values with parameters and statistics made contiguous and eps a float).
    The checks the custom ops' fake functions run too."""
    ref = values[ref_i]
    m, n = check_x(ref, impl, args[ref_i].name)
    out = list(values)
    for i, (a, v) in enumerate(zip(args, values)):
        if a.kind == "rows":
            if i != ref_i and not (v is None and a.optional):
                check_like_x(v, ref, a.name)
        elif a.kind == "param":
            out[i] = check_vector(v, n, ref, a.name)
        elif a.kind == "stat":
            out[i] = check_stats(v, m, ref, a.name)
        elif a.kind == "scalar":
            out[i] = check_eps(v)
        elif a.kind == "group":
            out[i] = check_group(v, n)
    return m, n, ref, out


# launch plans kept per contract function: past this many keys (shapes, dtypes, ...) they start over
PLAN_LIMIT = 256
_PLANS: list[dict] = []  # every checked function's plans (clear_plans)
_Tensor = torch.Tensor


def clear_plans() -> None:
    """Drop every launch plan: the next call of each key is validated in full again."""
    for plans in _PLANS:
        plans.clear()


def call_key(values) -> tuple:
    """What the checks and the launch of a call depend on (see the module docstring): a tensor's
    type, shape, strides, dtype and device; any other value's type."""
    return tuple(
        [(type(v), v.shape, v.stride(), v.dtype, v.device) if isinstance(v, _Tensor) else type(v) for v in values]
    )


def _eps(v) -> float:
    # a Python float is checked here; anything else by check_eps, which converts it or refuses it
    return v if type(v) is float and v >= 0 else check_eps(v)


def checked(
    impl, op, direction: str, fn: Callable, after: Callable | None = None, flat_stats: bool = False
) -> Callable:
    """``fn`` (a raw contract function) behind the contract's validation, (..., N) <-> (M, N)
    reshaping, M = 0 and the ``handles_no_affine`` substitution, all read from the op record, with a
    launch plan per ``call_key`` (see the module docstring). ``flat_stats``: the statistics come back
    as the kernels give them, (M,), not in x's leading shape (for a caller that only hands them to the
    backward, which takes either: a reshape each way saved).

    ``after(values, out)``, when given, sees the validated values and the outputs of each plan's
    first call, and may raise (the plan is then not kept) or return a function ``(values, out) ->
    out`` that every call of the plan applies to its outputs (or None)."""
    args = op.fwd_args if direction == "fwd" else op.bwd_args
    outputs = op.fwd_outputs if direction == "fwd" else op.bwd_outputs
    ref_i = shaping_arg(op, direction)
    positions = {a.name: i for i, a in enumerate(args)}
    weight_i = positions.get("weight")
    # per output: the argument position of the parameter it is the gradient of (dweight <- weight)
    grad_of = tuple(positions.get(o.name[1:]) if o.kind == "param" else None for o in outputs)
    signature = inspect.Signature([inspect.Parameter(a.name, inspect.Parameter.POSITIONAL_OR_KEYWORD) for a in args])

    group_i = positions.get("group")

    def empty(values, ref, m, n):
        lead = ref.shape[:-1]
        out = []
        for o, p in zip(outputs, grad_of):
            if o.kind == "rows":
                out.append(torch.empty(ref.shape, dtype=ref.dtype, device=ref.device))
            elif o.kind == "stat":
                out.append(torch.empty(lead, dtype=torch.float32, device=ref.device))
            elif o.kind == "fp8":
                out.append(torch.empty(ref.shape, dtype=FP8_DTYPE, device=ref.device))
            elif o.kind == "scale":
                out.append(torch.empty((*lead, n // values[group_i]), dtype=torch.float32, device=ref.device))
            elif p is not None and values[p] is None:
                out.append(None)
            else:
                w = values[weight_i] if weight_i is not None else None
                out.append(torch.zeros(n, dtype=w.dtype if w is not None else ref.dtype, device=ref.device))
        return tuple(out)

    kinds = tuple(a.kind for a in args)

    def launcher(raw, ref, m: int, n: int) -> Callable:
        """The launch of every call whose key is that of ``raw`` (validated: ``ref`` its row tensor,
        (M, N) its rows): the per-call work those checks left, decided once."""
        # a per-head view goes to an implementation that reads it in place as 3-D (every row
        # tensor of the call then 3-D); any other gets (M, N) rows, copied where no view exists
        head_rows = impl.row_views and has_no_row_view(ref)
        prep = []  # (position, what each call does to its value there)
        for i, (kind, v) in enumerate(zip(kinds, raw)):
            if kind == "rows" and v is not None:
                if head_rows:
                    if n > 1 and v.stride(2) != 1:
                        prep.append((i, lambda v: as_head_rows(v, n)))
                elif v.dim() != 2 or (n > 1 and v.stride(1) != 1):
                    prep.append((i, lambda v: as_rows(v, n)))
            elif kind == "param":
                if v is None:
                    if i == weight_i and not impl.handles_no_affine:
                        prep.append(
                            (i, lambda v, dtype=ref.dtype, device=ref.device: torch.ones(n, dtype=dtype, device=device))
                        )
                elif not v.is_contiguous():
                    prep.append((i, torch.Tensor.contiguous))
            elif kind == "stat":
                if v.dim() != 1 or not v.is_contiguous():
                    prep.append((i, lambda v: v.reshape(m).contiguous()))
            elif kind == "scalar":
                prep.append((i, _eps))
            elif kind == "group":
                prep.append((i, lambda v: check_group(v, n)))
        interpreted = ref.device.type == "cpu" and impl.interpreter == INTERPRETERS["helion"]
        drop = tuple(p is not None and raw[p] is None for p in grad_of)
        drop = drop if any(drop) else None
        shape, lead = ref.shape, ref.shape[:-1]
        # already (M, N): a reshape per output costs host time (~5 us each)
        reshape = None if ref.dim() == 2 else tuple(
            (lambda o: o.reshape(shape)) if k.kind in ("rows", "fp8")
            else (None if flat_stats else lambda o: o.reshape(lead)) if k.kind == "stat"
            else (lambda o: o.reshape((*lead, -1))) if k.kind == "scale" else None
            for k in outputs
        )  # fmt: skip

        def run(values):
            if prep:
                values = list(values)
                for i, f in prep:
                    values[i] = f(values[i])
            if interpreted:
                with interpreter_env(impl, "cpu"):
                    out = fn(*values)
            else:
                out = fn(*values)
            if drop is not None:
                out = tuple(None if d else o for o, d in zip(out, drop))
            if reshape is not None:
                out = tuple(o if f is None else f(o) for o, f in zip(out, reshape))
            return out

        return run

    plans: dict = {}
    _PLANS.append(plans)

    def call(*values, **named):
        if named or len(values) != len(args):
            values = tuple(signature.bind(*values, **named).args)
        try:
            key = call_key(values)
            run = plans.get(key)
        except (RuntimeError, TypeError):  # a value no key holds (a sparse tensor has no strides): the full checks
            key = run = None
        if run is not None:
            return run(values)
        m, n, ref, valid = check_args(impl, args, ref_i, values)
        if m == 0:
            return empty(valid, ref, m, n)
        run = launcher(values, ref, m, n)
        out = run(values)
        if after is not None:
            post = after(valid, out)
            if post is not None:
                out = post(values, out)
                run = _then(run, post)
        if key is not None:
            if len(plans) >= PLAN_LIMIT:
                plans.clear()
            plans[key] = run
        return out

    call.__name__ = call.__qualname__ = op.function(direction)
    call.__signature__ = signature
    # what a caller needs to wrap the same function with an ``after`` of its own (harness.integrate)
    call.op, call.direction, call.raw, call.plans = op, direction, fn, plans
    return call


def _then(run: Callable, post: Callable) -> Callable:
    def planned(values):
        return post(values, run(values))

    return planned
