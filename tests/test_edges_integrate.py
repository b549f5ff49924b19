"""Edges of the torch integration: which kernels a record runs when it shares a registered name or
differs from another only in options (eagerly and compiled), bad arguments under
torch.compile(fullgraph=True) raising what eager raises, and the rules for eps, weight_offset and the
weight's dtype, the same for every function and module."""

import math
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from harness.integrate.autograd import AddRMSNorm, LayerNorm, RMSNorm, add_rmsnorm, layernorm, norm_ops, rmsnorm
from harness.spec.contract import FUNCTIONS, Implementation

from . import counting_impl

EPS = 1e-5
N = 16

# ---------------------------------------------------------------- records that look alike
# (tag, contract function) -> calls: which of several look-alike records ran
TAGGED: Counter = Counter()


def tagged(tag: str):
    """A factory entry: the counting implementation's functions, each call also counted under ``tag``."""

    def counted(fn_name):
        fn = getattr(counting_impl, fn_name)

        def call(*args):
            TAGGED[(tag, fn_name)] += 1
            return fn(*args)

        return call

    return SimpleNamespace(**{f: counted(f) for f in FUNCTIONS if hasattr(counting_impl, f)})  # the norms: no FP8 ops


def look_alike(tag: str, name: str = "eager") -> Implementation:
    """A record named like a registered one (eager) that runs counting kernels tagged ``tag``; two of
    them differ only in options, which records leave out of their equality."""
    return Implementation(
        name=name,
        dsl="eager",
        entry=f"{__name__}:tagged",
        options={"tag": tag},
        ops=("rmsnorm", "layernorm", "add_rmsnorm"),
        devices=("cpu", "cuda"),
    )


A, B = look_alike("a"), look_alike("b")


def draw(seed=0, m=3, n=N, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x, residual, dy = (torch.randn(m, n, generator=g).to(dtype) for _ in range(3))
    w, b = (torch.randn(n, generator=g) * 0.5 + 1).to(dtype), (torch.randn(n, generator=g) * 0.2).to(dtype)
    return x, residual, dy, w, b


def functional(op, impl):
    """``op``'s differentiable function through ``impl``, as f(x, residual, w, b) -> y."""
    if op == "rmsnorm":
        return lambda x, r, w, b: rmsnorm(x, w, EPS, impl=impl)
    if op == "layernorm":
        return lambda x, r, w, b: layernorm(x, w, b, EPS, impl=impl)
    return lambda x, r, w, b: add_rmsnorm(x, r, w, EPS, impl=impl)[0]


def module(op, impl):
    """``op``'s module through ``impl``, as f(x, residual, w, b) -> y (its own parameters)."""
    torch.manual_seed(0)
    m = {"rmsnorm": RMSNorm, "layernorm": LayerNorm, "add_rmsnorm": AddRMSNorm}[op](N, impl=impl)
    return (lambda x, r, w, b: m(x, r)[0]) if op == "add_rmsnorm" else (lambda x, r, w, b: m(x))


def test_look_alike_records_get_ops_of_their_own():
    assert A == B == look_alike("a")  # options are not part of a record's equality
    prefixes = {norm_ops(r).prefix for r in (A, B, "eager")}
    assert len(prefixes) == 3 and norm_ops("eager").prefix == "eager"
    assert norm_ops(look_alike("a")) is norm_ops(A)  # one set of ops per distinct record and options


@pytest.mark.parametrize("compiled", [False, True], ids=["eager-mode", "compiled"])
@pytest.mark.parametrize("entry", [functional, module])
@pytest.mark.parametrize("op", ["rmsnorm", "layernorm", "add_rmsnorm"])
def test_each_look_alike_runs_its_own_kernels(op, entry, compiled):
    x, r, dy, w, b = draw()
    for impl, tag in ((A, "a"), (B, "b"), ("eager", None)):
        fn = entry(op, impl)
        if compiled:
            torch._dynamo.reset()
            fn = torch.compile(fn, fullgraph=True)  # Inductor, on the CPU here
        leaves = [t.clone().requires_grad_() for t in (x, r, w, b)]
        TAGGED.clear()
        fn(*leaves).backward(dy)
        want = {} if tag is None else {(tag, f"{op}_fwd"): 1, (tag, f"{op}_bwd"): 1}
        assert dict(TAGGED) == want, (impl if isinstance(impl, str) else impl.options, compiled)


# ---------------------------------------------------------------- bad arguments under torch.compile
_MOD = RMSNorm(N, impl=counting_impl.RECORD)
_LN = LayerNorm(N, impl=counting_impl.RECORD)
_OFFSET = RMSNorm(N, dtype=torch.float64, impl=counting_impl.RECORD, weight_offset=1.0)
BAD_CALLS = {
    # name: f(x) -> output, the error eager raises
    "weight shape": (lambda x: rmsnorm(x, torch.ones(N - 1), EPS, impl="eager"), ValueError),
    "weight dtype": (lambda x: rmsnorm(x, torch.ones(N, dtype=torch.float64), EPS, impl="eager"), TypeError),
    "bias shape": (lambda x: layernorm(x, None, torch.zeros(N + 1), EPS, impl="eager"), ValueError),
    "x dtype": (lambda x: layernorm(x.double(), None, None, EPS, impl="eager"), TypeError),
    "residual shape": (lambda x: add_rmsnorm(x, x[:1], None, EPS, impl="eager")[0], ValueError),
    "eps negative": (lambda x: rmsnorm(x, None, -1e-5, impl="eager"), ValueError),
    "eps a string": (lambda x: rmsnorm(x, None, "1e-5", impl="eager"), TypeError),
    "offset nan": (lambda x: rmsnorm(x, torch.ones(N), EPS, impl="eager", weight_offset=math.nan), ValueError),
    "offset fp64 weight": (lambda x: rmsnorm(x, torch.ones(N, dtype=torch.float64), EPS, "eager", 1.0), TypeError),
    "unknown impl": (lambda x: rmsnorm(x, None, EPS, impl="no-such-impl"), ValueError),
    "impl not a record": (lambda x: rmsnorm(x, None, EPS, impl=3), TypeError),
    "op not provided": (lambda x: layernorm(x, None, None, EPS, impl="triton-rmsnorm-claude-20261122-1"), ValueError),
    "module width": (lambda x: _MOD(x[..., : N // 2]), ValueError),
    "module x dtype": (lambda x: _LN(x.double()), TypeError),
    "module fp64 weight": (lambda x: _OFFSET(x), TypeError),
    # the stand-in's node is kept when the output is unused
    "output unused": (lambda x: (rmsnorm(x, torch.ones(N - 1), EPS, impl="eager"), x * 2)[1], ValueError),
}


def _error(fn, x):
    with pytest.raises(Exception) as info:
        fn(x)
    return type(info.value), str(info.value)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("name", list(BAD_CALLS))
def test_bad_arguments_under_compile_raise_what_eager_raises(name, dynamic):
    fn, kind = BAD_CALLS[name]
    x = draw(1)[0].requires_grad_()  # the compiled graph traces a backward too
    eager = _error(fn, x)
    assert eager[0] is kind, eager
    torch._dynamo.reset()
    compiled = _error(torch.compile(fn, fullgraph=True, backend="aot_eager", dynamic=dynamic), x)
    assert compiled == eager


@pytest.mark.parametrize("name", ["weight shape", "weight dtype"])
def test_bad_arguments_under_inductor(name):
    fn, kind = BAD_CALLS[name]
    x = draw(1)[0].requires_grad_()
    torch._dynamo.reset()
    with pytest.raises(kind, match="weight must have"):
        torch.compile(fn, fullgraph=True)(x)


# ---------------------------------------------------------------- eps, weight_offset, weight dtypes
def entry_points():
    """name -> call(x, weight, bias, eps, weight_offset) -> y, over the functions and the modules
    (built with the eps and offset, then called: either may refuse them)."""
    impl = counting_impl.RECORD

    def mod(cls, x, w, b, eps, off, **kw):
        m = cls(N, eps=eps, impl=impl, weight_offset=off, dtype=w.dtype, **kw)
        with torch.no_grad():
            m.weight.copy_(w)
        return m

    return {
        "rmsnorm": lambda x, w, b, eps, off: rmsnorm(x, w, eps, impl, off),
        "layernorm": lambda x, w, b, eps, off: layernorm(x, w, b, eps, impl, off),
        "add_rmsnorm": lambda x, w, b, eps, off: add_rmsnorm(x, x, w, eps, impl, off)[0],
        "RMSNorm": lambda x, w, b, eps, off: mod(RMSNorm, x, w, b, eps, off)(x),
        "LayerNorm": lambda x, w, b, eps, off: mod(LayerNorm, x, w, b, eps, off, bias=False)(x),
        "AddRMSNorm": lambda x, w, b, eps, off: mod(AddRMSNorm, x, w, b, eps, off)(x, x)[0],
    }


ENTRIES = entry_points()
GOOD_EPS = [1e-3, 0, np.float32(1e-3), np.float64(1e-3), np.int64(0), np.float16(1e-3)]
BAD_EPS = [(True, TypeError), (np.bool_(True), TypeError), (math.nan, ValueError), (-1e-3, ValueError),
           ("1e-3", TypeError), (1e-3 + 0j, TypeError), (torch.tensor(1e-3), TypeError)]  # fmt: skip
GOOD_OFFSETS = [1.0, 0, -0.5, np.float32(1.0), np.int64(1)]
BAD_OFFSETS = [(math.nan, ValueError), (math.inf, ValueError), (-math.inf, ValueError), (True, TypeError),
               ("1", TypeError), (1j, TypeError), (np.bool_(False), TypeError)]  # fmt: skip


@pytest.mark.parametrize("eps", GOOD_EPS, ids=repr)
@pytest.mark.parametrize("entry", list(ENTRIES))
def test_eps_any_real_number(entry, eps):
    x, _, _, w, b = draw(2)
    x = x * 0.03  # mean(x^2) ~ 1e-3: eps shows in y
    got, want = ENTRIES[entry](x, w, b, eps, 0.0), ENTRIES[entry](x, w, b, float(eps), 0.0)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("eps,error", BAD_EPS, ids=lambda v: repr(v) if not isinstance(v, type) else v.__name__)
@pytest.mark.parametrize("entry", list(ENTRIES))
def test_eps_refused(entry, eps, error):
    x, _, _, w, b = draw(2)
    with pytest.raises(error, match="eps"):
        ENTRIES[entry](x, w, b, eps, 0.0)


@pytest.mark.parametrize("offset", GOOD_OFFSETS, ids=repr)
@pytest.mark.parametrize("entry", list(ENTRIES))
def test_weight_offset_any_finite_real_number(entry, offset):
    x, _, _, w, b = draw(3)
    got = ENTRIES[entry](x, w, b, EPS, offset)
    torch.testing.assert_close(got, ENTRIES[entry](x, w, b, EPS, float(offset)), rtol=0, atol=0)
    torch.testing.assert_close(got, ENTRIES[entry](x, w + float(offset), b, EPS, 0.0), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("offset,error", BAD_OFFSETS, ids=lambda v: repr(v) if not isinstance(v, type) else v.__name__)
@pytest.mark.parametrize("entry", list(ENTRIES))
def test_weight_offset_refused(entry, offset, error):
    x, _, _, w, b = draw(3)
    with pytest.raises(error, match="weight_offset"):
        ENTRIES[entry](x, w, b, EPS, offset)


# torch.nn's modules take floating-point parameters only
BAD_WEIGHTS = [
    (entry, dtype)
    for entry in ENTRIES
    for dtype in (torch.float64, torch.int32, torch.complex64, torch.bfloat16)
    if dtype.is_floating_point or not entry[0].isupper()
]


@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("entry,wdtype", BAD_WEIGHTS, ids=lambda v: str(v).replace("torch.", ""))
def test_weight_dtype_rule_whatever_the_offset(entry, wdtype, offset):
    """fp32 x takes an fp32 weight only; fp64, integer, complex (whose imaginary part .float() would
    drop) and bf16 weights are refused, with an offset as without."""
    x, _, _, w, b = draw(4)
    with pytest.raises(TypeError, match="weight"):
        ENTRIES[entry](x, w.to(wdtype), b, EPS, offset)
