"""The implementation contract, and the declarative record every implementation registers.

An implementation module (``impls/<name>/...``) defines two functions per op it provides::

    rmsnorm_fwd(x, weight, eps)                                -> (y, rstd)
    rmsnorm_bwd(dy, x, weight, rstd)                           -> (dx, dweight)
    layernorm_fwd(x, weight, bias, eps)                        -> (y, mean, rstd)
    layernorm_bwd(dy, x, weight, mean, rstd)                   -> (dx, dweight, dbias)
    add_rmsnorm_fwd(x, residual, weight, eps)                  -> (y, residual_out, rstd)
    add_rmsnorm_bwd(dy, dresidual_out, residual_out, weight, rstd) -> (dh, dweight)
    rmsnorm_fp8_fwd(x, weight, eps, group)                     -> (q, scale, rstd)
    add_rmsnorm_fp8_fwd(x, residual, weight, eps, group)       -> (q, scale, residual_out, rstd)

The FP8 functions (forward only) quantize the fp32 y = x * rstd * weight, never rounded to x's dtype
first, to float8_e4m3fn with one fp32 scale per group of ``group`` elements (``group`` is N, or 128
with N a multiple of 128; the harness checks it): scale = max(amax|y|, floor) / 448, (M, N / group);
q = e4m3fn(y / scale), round to nearest even, saturating (``harness.spec.fp8``).

``add_rmsnorm`` is the norm after a residual add: ``residual_out = x + residual`` rounded to x's
dtype (what the unfused model stores), ``y = rmsnorm(residual_out)``; its backward returns
``dh = rmsnorm_bwd(dy) + dresidual_out`` (``dresidual_out`` may be None), the gradient of both x
and residual.

What a kernel function may assume (the harness guarantees it: ``harness.spec.validation``):

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

Per-head views: q and k of a fused QKV projection are (T, H, N) views whose token stride is that of
the whole projection (P heads, P > H), so no (M, N) view of their rows exists and a reshape copies
them. An implementation that sets ``row_views=True`` gets such a tensor as the 3-D view itself (unit
stride along N, any strides on T and H; row r = t*H + h at t * stride(0) + h * stride(1)), and then
every row tensor of that call 3-D, each with its own strides; the statistics stay (M,) with M = T*H
and its outputs may be (T, H, N) or (M, N). Any other implementation gets the (M, N) copy, and its
timing pays for it. A 3-D tensor that does have an (M, N) view reaches every kernel as (M, N).

Rows whose squares overflow fp32 (``harness.spec.inputs.OVERFLOW``: |x| ~ 1e30, representable in
bf16 and fp32): for an op whose record sets ``overflow`` (LayerNorm), the outputs of such a row must
be NaN, as torch's are, or the right answer, never a finite wrong number (rstd = rsqrt(inf) = 0 would
give y = bias); the backward, run on the forward's own statistics, likewise. ``normbench check``
holds every implementation to it whenever the edge set is checked (bf16 and fp32), as
tests/test_implementations.py does.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable

import torch

from harness.spec.interpreters import INTERPRETERS, loaded_without_interpreter  # noqa: F401  (re-exported)
from harness.spec.ops import OPS as OP_RECORDS

OPS = tuple(OP_RECORDS)
# what an implementation provides when its record does not say
DEFAULT_OPS = ("rmsnorm", "layernorm")
DIRECTIONS = ("fwd", "bwd")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
# every contract function, once (the FP8 ops' groupings share theirs)
FUNCTIONS = tuple(dict.fromkeys(rec.function(d) for rec in OP_RECORDS.values() for d in rec.directions))
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
    # Takes a 3-D (T, H, N) row tensor with any strides on T and H (unit stride along N) as a view:
    # the per-head q and k of a fused QKV tensor, which have no (M, N) view. Without it the
    # contract hands such a tensor over as contiguous (M, N) rows, a copy.
    row_views: bool = False
    # Further entries ("package.module" or "package.module:factory", built with ``options`` as
    # ``entry`` is) defining contract functions ``entry`` does not: ops kept in files of their own
    extra_entries: tuple[str, ...] = ()
    # FP8 ops: y is rounded to x's dtype before its amax and the division (the unfused passes store
    # it so); the checker allows that one rounding where a record declares it, and nowhere else
    rounds_before_quantizing: bool = False
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
        if device == "cpu" and self.interpreter and loaded_without_interpreter(self):
            return (
                f"its module (or triton) was imported before {self.interpreter}=1 was set in this process; "
                f"set {self.interpreter}=1 in the environment before starting Python"
            )
        return None

    def available(self, device: str = "cuda") -> bool:
        return self.unavailable(device) is None

    # -- loading
    def kernels(self, device: str = "cuda") -> SimpleNamespace:
        """The contract functions, imported lazily (``normbench list`` must work without the DSL
        installed) and wrapped so that every call is validated (``harness.spec.loading``)."""
        from harness.spec.loading import load_kernels

        return load_kernels(self, device)
