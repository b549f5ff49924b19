"""The implementation contract, and the declarative record every implementation registers.

An implementation module (``impls/<name>/...``) defines two functions per op it provides::

    rmsnorm_fwd(x, weight, eps)                                -> (y, rstd)
    rmsnorm_bwd(dy, x, weight, rstd)                           -> (dx, dweight)
    layernorm_fwd(x, weight, bias, eps)                        -> (y, mean, rstd)
    layernorm_bwd(dy, x, weight, mean, rstd)                   -> (dx, dweight, dbias)
    add_rmsnorm_fwd(x, residual, weight, eps)                  -> (y, residual_out, rstd)
    add_rmsnorm_bwd(dy, dresidual_out, residual_out, weight, rstd) -> (dh, dweight)

``add_rmsnorm`` is the norm after a residual add: ``residual_out = x + residual`` rounded to x's
dtype (what the unfused model stores), ``y = rmsnorm(residual_out)``; its backward returns
``dh = rmsnorm_bwd(dy) + dresidual_out`` (``dresidual_out`` may be None), the gradient of both x
and residual.

What a kernel function may assume (the harness guarantees it, see ``checked_call``):

* ``x`` and ``dy`` are 2-D ``(M, N)`` with ``M >= 1``, ``N >= 1`` and unit stride along N; the row
  stride is arbitrary (a column slice of a wider tensor arrives as a view, not a copy).
* ``weight`` / ``bias`` are contiguous 1-D ``(N,)`` tensors on x's device, of x's dtype or float32
  (mixed precision: fp32 parameters beside 16-bit activations), or ``None``.
  ``weight=None`` means ``elementwise_affine=False`` (scale 1, no dweight: return ``None``);
  ``bias=None`` means no bias in the forward. The backward is not told whether a bias exists and
  always returns dbias = sum over rows of dy (x's dtype); the autograd layer drops it when unused.
* ``rstd`` / ``mean`` are contiguous fp32 ``(M,)``.
* ``eps`` is a Python float (a runtime argument: kernels must not specialise on it).

* ``residual`` / ``dresidual_out`` / ``residual_out`` are 2-D like x, same dtype (``dresidual_out``
  may be ``None``).

What it must return: y / dx / residual_out / dh in x's dtype, shape (M, N), contiguous; statistics
fp32 (M,); dweight / dbias in the weight's dtype (x's or fp32), reduced over all rows in fp32
(``None`` for dweight when weight is None).

An implementation that does not want to handle ``weight=None`` itself sets
``handles_no_affine=False`` and the harness passes a ones vector (and drops dweight) instead.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import re
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable

import torch

from .ops import OPS as OP_RECORDS  # noqa: E402  (the op records: harness/ops.py)

OPS = tuple(OP_RECORDS)
# what an implementation provides when its record does not say
DEFAULT_OPS = ("rmsnorm", "layernorm")
DIRECTIONS = ("fwd", "bwd")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
FUNCTIONS = tuple(f"{op}_{d}" for op in OPS for d in DIRECTIONS)
# parameter dtypes a kernel may be given beside x's own (16-bit x with fp32 weights)
PARAM_DTYPES = (torch.float32,)


@dataclass(frozen=True)
class ContractFunctions:
    rmsnorm_fwd: Callable
    rmsnorm_bwd: Callable
    layernorm_fwd: Callable
    layernorm_bwd: Callable
    add_rmsnorm_fwd: Callable
    add_rmsnorm_bwd: Callable

    def __iter__(self):
        return iter(getattr(self, f) for f in self.__dataclass_fields__)


def contract_functions(norm_fwd: Callable, norm_bwd: Callable) -> ContractFunctions:
    """The six contract functions of kernels written once for the three ops behind flags:
    ``norm_fwd(x, residual, weight, bias, eps, layernorm) -> (y, residual_out, mean, rstd)`` and
    ``norm_bwd(dy, dresidual_out, x, weight, mean, rstd, layernorm) -> (dx, dweight, dbias)``, with
    None for what an op does not have."""

    def rmsnorm_fwd(x, weight, eps):
        y, _, _, rstd = norm_fwd(x, None, weight, None, eps, layernorm=False)
        return y, rstd

    def rmsnorm_bwd(dy, x, weight, rstd):
        dx, dw, _ = norm_bwd(dy, None, x, weight, None, rstd, layernorm=False)
        return dx, dw

    def layernorm_fwd(x, weight, bias, eps):
        y, _, mean, rstd = norm_fwd(x, None, weight, bias, eps, layernorm=True)
        return y, mean, rstd

    def layernorm_bwd(dy, x, weight, mean, rstd):
        return norm_bwd(dy, None, x, weight, mean, rstd, layernorm=True)

    def add_rmsnorm_fwd(x, residual, weight, eps):
        y, h, _, rstd = norm_fwd(x, residual, weight, None, eps, layernorm=False)
        return y, h, rstd

    def add_rmsnorm_bwd(dy, dresidual_out, residual_out, weight, rstd):
        dh, dw, _ = norm_bwd(dy, dresidual_out, residual_out, weight, None, rstd, layernorm=False)
        return dh, dw

    return ContractFunctions(rmsnorm_fwd, rmsnorm_bwd, layernorm_fwd, layernorm_bwd, add_rmsnorm_fwd, add_rmsnorm_bwd)


def split_function(fn_name: str) -> tuple[str, str]:
    """'add_rmsnorm_fwd' -> ('add_rmsnorm', 'fwd')."""
    op, _, direction = fn_name.rpartition("_")
    return op, direction

# How a DSL runs without a GPU: the environment variable that switches its interpreter on.
# Triton's must be set before triton is first imported (it decorates its own language functions
# then), and Helion, torch.compile and Inductor import triton too. So on a machine without a GPU,
# where triton can only run through its interpreter, importing the harness sets TRITON_INTERPRET=1
# unless triton is already imported (``_cpu_triton``, again before anything is loaded for the CPU):
# using Helion or torch.compile first no longer leaves Triton unusable for the rest of the process.
# Helion refuses HELION_INTERPRET=1 (its eager reference mode) while TRITON_INTERPRET=1 is set, so
# around a Helion-interpreted import or call on the CPU the harness swaps the two
# (``interpreter_env``); triton, already imported, keeps its interpreter.
INTERPRETERS = {"triton": "TRITON_INTERPRET", "helion": "HELION_INTERPRET"}


# ---------------------------------------------------------------- requirements ("available here?")
@dataclass(frozen=True)
class Requirement:
    """One thing an implementation needs; ``missing(device)`` returns a reason or None."""

    kind: str  # "package" | "cuda" | "capability"
    value: Any = None

    def missing(self, device: str) -> str | None:
        if self.kind == "package":
            if importlib.util.find_spec(self.value) is None:
                return f"python package '{self.value}' is not installed"
            return None
        if self.kind == "cuda":
            if device != "cuda":
                return "needs a CUDA device (runs on GPU only)"
            if not torch.cuda.is_available():
                return "needs a CUDA device and none is available here"
            return None
        if self.kind == "capability":
            if device != "cuda":
                return None
            if not torch.cuda.is_available():
                return "needs a CUDA device and none is available here"
            cc = torch.cuda.get_device_capability()
            if cc < tuple(self.value):
                need = ".".join(map(str, self.value))
                return f"needs compute capability >= {need} (this GPU is {cc[0]}.{cc[1]})"
            return None
        raise ValueError(f"unknown requirement kind {self.kind!r}")


def package(name: str) -> Requirement:
    return Requirement("package", name)


def cuda() -> Requirement:
    return Requirement("cuda")


def capability(major: int, minor: int = 0) -> Requirement:
    return Requirement("capability", (major, minor))


# ---------------------------------------------------------------- the record
@dataclass(frozen=True)
class Implementation:
    """One declarative record per implementation. ``impls/<pkg>/__init__.py`` lists these in
    ``IMPLEMENTATIONS``; the registry finds them, nothing else needs editing."""

    name: str
    dsl: str  # eager | compile | triton | helion | cute | llm-<dsl> | external
    entry: str  # "package.module" defining the four functions, or "package.module:factory"
    description: str = ""
    ops: tuple[str, ...] = DEFAULT_OPS
    dtypes: tuple[str, ...] = tuple(DTYPES)
    devices: tuple[str, ...] = ("cuda",)
    requires: tuple[Requirement, ...] = ()
    sources: tuple[str, ...] = ()
    options: dict = field(default_factory=dict, hash=False, compare=False)
    interpreter: str | None = None  # env var enabling a CPU interpreter (see INTERPRETERS)
    external: bool = False  # a third-party library, shown as an external baseline only
    prompt: str | None = None  # LLM-generated kernels: the prompt file they came from
    handles_no_affine: bool = True
    # "cheap" or "costly": how expensive a run on the CPU is (torch.compile compiles every shape, an
    # interpreter runs per program); the test suite checks a costly one on fewer CPU shapes.
    cpu_cost: str = "cheap"
    # Optional entry points ("module:function") the CLI calls for DSL-specific work:
    #   "tune":    tune(op, shapes, dtype, log_dir) -> dict      (`normbench tune`)
    #   "codegen": codegen(op, direction, n, dtype) -> str       (`normbench codegen`)
    #   "config_source": source(op, direction, n, dtype, device) -> str  (recorded per benchmark
    #              point: "tuned", "borrowed from <GPU> (sm_90)", "heuristic", ...)
    hooks: dict = field(default_factory=dict, hash=False, compare=False)
    meta: dict = field(default_factory=dict, hash=False, compare=False)

    def hook(self, name: str):
        """The callable behind ``hooks[name]``, imported on demand; None when not provided."""
        target = self.hooks.get(name)
        if not target:
            return None
        mod_name, _, attr = target.partition(":")
        return getattr(importlib.import_module(mod_name), attr)

    def __post_init__(self):
        bad = set(self.ops) - set(OPS)
        if bad:
            raise ValueError(f"{self.name}: unknown ops {sorted(bad)}")
        bad = set(self.dtypes) - set(DTYPES)
        if bad:
            raise ValueError(f"{self.name}: unknown dtypes {sorted(bad)}")

    # -- availability
    def unavailable(self, device: str = "cuda") -> str | None:
        """None if this implementation can run on ``device`` here, else the reason why not."""
        if device not in self.devices:
            return f"runs on {', '.join(self.devices)} only, not {device}"
        for req in self.requires:
            why = req.missing(device)
            if why:
                return why
        if device == "cpu" and self.interpreter and _loaded_without_interpreter(self):
            return (
                f"its module (or triton) was imported before {self.interpreter}=1 was set in this process; "
                f"set {self.interpreter}=1 in the environment before starting Python"
            )
        return None

    def available(self, device: str = "cuda") -> bool:
        return self.unavailable(device) is None

    # -- loading
    def kernels(self, device: str = "cuda") -> SimpleNamespace:
        """Import the module (lazily: ``normbench list`` must work without the DSL installed)
        and return the four functions, wrapped so that every call is validated."""
        why = self.unavailable(device)
        if why:
            raise ValueError(f"implementation '{self.name}' cannot run on {device} here: {why}")
        key = (self, device)
        if key not in _KERNEL_CACHE:
            raw = _load_raw(self, device)
            _KERNEL_CACHE[key] = SimpleNamespace(
                **{fn: _checked(self, fn, getattr(raw, fn)) for fn in FUNCTIONS if split_function(fn)[0] in self.ops},
                raw=raw,
                impl=self,
            )
        return _KERNEL_CACHE[key]


_KERNEL_CACHE: dict = {}
_RAW_CACHE: dict = {}


def _module_name(impl: Implementation) -> str:
    return impl.entry.split(":")[0]


def _loaded_without_interpreter(impl: Implementation) -> bool:
    """Too late to switch Triton's interpreter on: the module, or triton itself (whose language
    functions are decorated at import), was imported while it was off."""
    import sys

    if impl.interpreter != INTERPRETERS["triton"] or os.environ.get(impl.interpreter, "0") == "1":
        return False
    return _module_name(impl) in sys.modules or "triton" in sys.modules


def _cpu_triton():
    """On a machine without a GPU, switch Triton's interpreter on before triton's first import (see
    INTERPRETERS). Does nothing once triton is imported, or where a GPU could run it."""
    import sys

    if "triton" not in sys.modules and not torch.cuda.is_available():
        os.environ[INTERPRETERS["triton"]] = "1"


@contextlib.contextmanager
def interpreter_env(impl: Implementation, device: str):
    """On the CPU, HELION_INTERPRET=1 and no TRITON_INTERPRET for the duration (see INTERPRETERS)."""
    if device != "cpu" or impl.interpreter != INTERPRETERS["helion"]:
        yield
        return
    _cpu_triton()
    saved = {k: os.environ.get(k) for k in ("HELION_INTERPRET", "TRITON_INTERPRET")}
    os.environ["HELION_INTERPRET"] = "1"
    os.environ.pop("TRITON_INTERPRET", None)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


_cpu_triton()


def _load_raw(impl: Implementation, device: str):
    if device == "cpu":
        _cpu_triton()
        if impl.interpreter == INTERPRETERS["triton"]:
            os.environ[impl.interpreter] = "1"
    if impl in _RAW_CACHE:
        return _RAW_CACHE[impl]
    mod_name, _, factory = impl.entry.partition(":")
    with interpreter_env(impl, device):
        mod = importlib.import_module(mod_name)
        raw = getattr(mod, factory)(**impl.options) if factory else mod
    for fn in FUNCTIONS:
        if split_function(fn)[0] in impl.ops and not callable(getattr(raw, fn, None)):
            raise TypeError(f"implementation '{impl.name}' ({impl.entry}) does not define {fn}()")
    _RAW_CACHE[impl] = raw
    return raw


# Terminal colour codes: CuTe DSL's compiler errors carry them, and a report is not a terminal.
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def plain_text(text: str) -> str:
    """``text`` without terminal escape codes."""
    return _ANSI.sub("", text)


def describe_error(e: BaseException, limit: int = 400) -> str:
    """'ExceptionType: first line of the message': how a failed point is recorded in a report."""
    lines = plain_text(str(e)).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:limit]


# ---------------------------------------------------------------- input validation
def _is_tensor(t, what: str):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")


def _float_dtype(t: torch.Tensor, what: str, impl: Implementation):
    if not t.dtype.is_floating_point:
        raise TypeError(f"{what} must be a floating-point tensor, got {t.dtype}")
    if t.dtype not in DTYPE_NAMES or DTYPE_NAMES[t.dtype] not in impl.dtypes:
        ok = ", ".join(impl.dtypes)
        raise TypeError(f"implementation '{impl.name}' supports {ok}; {what} is {t.dtype}")


def _device_ok(t: torch.Tensor, impl: Implementation, what: str):
    dev = t.device.type
    if dev not in impl.devices:
        raise ValueError(
            f"implementation '{impl.name}' runs on {', '.join(impl.devices)} tensors; {what} is on {dev}"
        )


def _same_device(t: torch.Tensor | None, x: torch.Tensor, what: str):
    if t is not None and t.device != x.device:
        raise ValueError(f"{what} is on {t.device} but x is on {x.device}")


def _vector(t, n: int, x: torch.Tensor, what: str):
    if t is None:
        return None
    _is_tensor(t, what)
    if t.dim() != 1 or t.shape[0] != n:
        raise ValueError(f"{what} must have shape ({n},) to match x's last dimension, got {tuple(t.shape)}")
    _same_device(t, x, what)
    if t.dtype != x.dtype and t.dtype not in PARAM_DTYPES:
        raise TypeError(f"{what} must have x's dtype {x.dtype} or float32, got {t.dtype}")
    return t.contiguous()


def _like_x(t, x: torch.Tensor, what: str):
    """A tensor that must match x in shape, dtype and device (dy, residual, ...)."""
    _is_tensor(t, what)
    if t.shape != x.shape:
        raise ValueError(f"{what} has shape {tuple(t.shape)} but x has {tuple(x.shape)}")
    _same_device(t, x, what)
    if t.dtype != x.dtype:
        raise TypeError(f"{what} must have x's dtype {x.dtype}, got {t.dtype}")


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """(..., N) -> (M, N) with unit stride along N, without copying when a view suffices."""
    t2 = t.reshape(-1, n) if t.dim() != 2 else t
    if n > 1 and t2.stride(1) != 1:
        t2 = t2.contiguous()
    return t2


def _stats(t, m: int, x: torch.Tensor, what: str):
    _is_tensor(t, what)
    if t.numel() != m:
        raise ValueError(f"{what} must hold one value per row ({m}), got shape {tuple(t.shape)}")
    if t.dtype != torch.float32:
        raise TypeError(f"{what} must be float32, got {t.dtype}")
    _same_device(t, x, what)
    return t if t.dim() == 1 and t.is_contiguous() else t.reshape(m).contiguous()


def _eps(eps):
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"eps must be a float, got {type(eps).__name__}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    return float(eps)


def _x(x, impl: Implementation, what: str = "x") -> tuple[int, int]:
    _is_tensor(x, what)
    if x.dim() < 1:
        raise ValueError(f"{what} must have at least one dimension (..., N)")
    n = x.shape[-1]
    if n == 0:
        raise ValueError(f"{what} has N = 0 along its last dimension: nothing to normalize")
    _float_dtype(x, what, impl)
    _device_ok(x, impl, what)
    return x.numel() // n, n


def _checked(impl: Implementation, fn_name: str, fn: Callable) -> Callable:
    """Wrap a raw contract function with validation, (..., N) <-> (M, N) reshaping and M = 0."""
    op, direction = split_function(fn_name)
    layer = op == "layernorm"
    fused_add = op == "add_rmsnorm"

    def ones_if_needed(w, x, n):
        if w is None and not impl.handles_no_affine:
            return torch.ones(n, dtype=x.dtype, device=x.device)
        return w

    def forward(x, residual, weight, bias, eps):
        m, n = _x(x, impl)
        eps = _eps(eps)
        if fused_add:
            _like_x(residual, x, "residual")
        w = _vector(weight, n, x, "weight")
        b = _vector(bias, n, x, "bias")
        lead = x.shape[:-1]
        if m == 0:
            y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
            st = torch.empty(lead, dtype=torch.float32, device=x.device)
            if fused_add:
                return y, y.clone(), st
            return (y, st, st.clone()) if layer else (y, st)
        w = ones_if_needed(w, x, n)
        x2 = _rows(x, n)
        with interpreter_env(impl, x.device.type):
            if fused_add:
                out = fn(x2, _rows(residual, n), w, eps)
            else:
                out = fn(x2, w, b, eps) if layer else fn(x2, w, eps)
        if x.dim() == 2:  # already (M, N): a reshape per output costs host time (~5 us each)
            return tuple(out)
        return tuple(o.reshape(x.shape) if o.dim() == 2 else o.reshape(lead) for o in out)

    def backward(dy, dres, x, weight, stats):
        m, n = _x(x, impl, "residual_out" if fused_add else "x")
        _like_x(dy, x, "dy")
        if dres is not None:
            _like_x(dres, x, "dresidual_out")
        w = _vector(weight, n, x, "weight")
        names = ("mean", "rstd") if layer else ("rstd",)
        stats = [_stats(s, m, x, name) for s, name in zip(stats, names)]
        has_w = w is not None
        if m == 0:
            dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
            zero = torch.zeros(n, dtype=w.dtype if has_w else x.dtype, device=x.device)
            dw = zero if has_w else None
            return (dx, dw, zero.clone()) if layer else (dx, dw)
        w = ones_if_needed(w, x, n)
        with interpreter_env(impl, x.device.type):
            if fused_add:
                dx, dw, *db = fn(_rows(dy, n), None if dres is None else _rows(dres, n), _rows(x, n), w, *stats)
            else:
                dx, dw, *db = fn(_rows(dy, n), _rows(x, n), w, *stats)
        return (dx if x.dim() == 2 else dx.reshape(x.shape), dw if has_w else None, *db)

    if fn_name == "rmsnorm_fwd":

        def rmsnorm_fwd(x, weight, eps):
            return forward(x, None, weight, None, eps)

        return rmsnorm_fwd
    if fn_name == "layernorm_fwd":

        def layernorm_fwd(x, weight, bias, eps):
            return forward(x, None, weight, bias, eps)

        return layernorm_fwd
    if fn_name == "add_rmsnorm_fwd":

        def add_rmsnorm_fwd(x, residual, weight, eps):
            return forward(x, residual, weight, None, eps)

        return add_rmsnorm_fwd
    if fn_name == "rmsnorm_bwd":

        def rmsnorm_bwd(dy, x, weight, rstd):
            return backward(dy, None, x, weight, (rstd,))

        return rmsnorm_bwd
    if fn_name == "add_rmsnorm_bwd":

        def add_rmsnorm_bwd(dy, dresidual_out, residual_out, weight, rstd):
            return backward(dy, dresidual_out, residual_out, weight, (rstd,))

        return add_rmsnorm_bwd

    def layernorm_bwd(dy, x, weight, mean, rstd):
        return backward(dy, None, x, weight, (mean, rstd))

    return layernorm_bwd
