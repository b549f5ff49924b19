"""What the tests of the GPU-only DSLs (Gluon, cuTile) share. Compiled without a GPU: one shape per
row regime, the shared drawn tensors made on the CPU, and one call per op and direction of the
contract (plus the optional-argument variants), so that every kernel a GPU would launch gets
compiled. Run: rows whose squares overflow fp32 give NaN, never a finite value; add + RMSNorm
against fp64 with the checker's tolerance scales."""

import pytest
import torch

from harness.run.checker import compare, poisoned_allocations
from harness.spec import reference
from harness.spec.contract import DTYPES
from harness.spec.inputs import make_case
from harness.spec.shapes import SHAPE_SETS

# narrow, mid, a non-power of two, a row too wide for one tile, the widest
REGIMES = {s.n: s for s in SHAPE_SETS["smoke"] + SHAPE_SETS["edge"] if s.n in (7, 1001, 2880, 20001, 262144)}


def inputs(shape, dtype, param_dtype):
    """x, dy, weight, bias and a statistic, made on the CPU (compile_only reads dtypes, strides and
    alignment only)."""
    case = make_case("layernorm", shape, dtype)
    x = case["x"].reshape(-1, shape.n)
    dy = case["dy"].reshape(-1, shape.n)
    w, b = case["weight"].to(param_dtype), case["bias"].to(param_dtype)
    stat = torch.ones(x.shape[0], dtype=torch.float32)
    return x, dy, w, b, stat


def head_view(t: int, h: int, n: int, p: int, dtype=torch.bfloat16) -> torch.Tensor:
    """The first h of p heads of a contiguous (T, P, N) tensor, as the per-head sets cut q and k."""
    return torch.zeros(t, p, n, dtype=dtype)[:, :h]


CALLS = {
    ("rmsnorm", "fwd"): lambda k, x, dy, w, b, s: k.rmsnorm_fwd(x, w, 1e-5),
    ("rmsnorm", "bwd"): lambda k, x, dy, w, b, s: k.rmsnorm_bwd(dy, x, w, s),
    ("layernorm", "fwd"): lambda k, x, dy, w, b, s: k.layernorm_fwd(x, w, b, 1e-5),
    ("layernorm", "bwd"): lambda k, x, dy, w, b, s: k.layernorm_bwd(dy, x, w, s, s),
    ("add_rmsnorm", "fwd"): lambda k, x, dy, w, b, s: k.add_rmsnorm_fwd(x, dy, w, 1e-5),
    ("add_rmsnorm", "bwd"): lambda k, x, dy, w, b, s: k.add_rmsnorm_bwd(dy, dy.clone(), x, w, s),
    ("add_rmsnorm", "bwd-no-dresidual"): lambda k, x, dy, w, b, s: k.add_rmsnorm_bwd(dy, None, x, w, s),
    ("layernorm", "bwd-no-affine"): lambda k, x, dy, w, b, s: k.layernorm_bwd(dy, x, None, s, s),
}


# A compiler the kernels need that is not on this machine: (the exception type, the first line of its
# message or the clause that line starts with), as the toolchains raise them. Only these skip.
TOOLCHAIN_ABSENT = (
    (RuntimeError, "Cannot find ptxas"),  # Triton (Gluon): triton.knobs, no ptxas shipped or on TRITON_PTXAS_PATH
    (FileNotFoundError, "'tileiras' compiler not found,"),  # cuTile: no tileiras wheel, none on PATH or CUDA_HOME
)


def toolchain_absent(e: BaseException) -> str | None:
    """'<type>: <first line>' when ``e`` (or an exception it was raised from) is one of
    TOOLCHAIN_ABSENT, matched by exact type and exact text; None for anything else."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        first = (str(e).strip().splitlines() or [""])[0]
        for kind, text in TOOLCHAIN_ABSENT:
            if type(e) is kind and (first == text or (text.endswith(",") and first.startswith(text))):
                return f"{type(e).__name__}: {first[:300]}"
        e = e.__cause__ or e.__context__
    return None


def compiling_or_skip(k, dsl: str):
    """The kernels of ``k`` compiled for one small forward, or a skip naming the compiler this
    machine lacks (TOOLCHAIN_ABSENT). Any other compile error propagates: the test fails with it
    (a layout that does not fit a warp, a stale API, a poisoned compiler state), never skips."""
    x = torch.ones(1, 16, dtype=torch.float32)
    try:
        with k.compile_only() as compiled:
            k.rmsnorm_fwd(x, None, 1e-5)
    except Exception as e:
        why = toolchain_absent(e)
        if why is None:
            raise
        pytest.skip(f"{dsl} here: {why}")
    return compiled


def assert_compile_only_launches_nothing(k):
    """Inside ``compile_only`` one kernel is compiled and nothing runs; outside it, a CPU tensor
    reaches a real launch, which fails loudly (no GPU)."""
    x = torch.ones(2, 16)
    with k.compile_only() as compiled:
        k.rmsnorm_fwd(x, None, 1e-5)
    assert len(compiled) == 1
    with pytest.raises(Exception):
        k.rmsnorm_fwd(x, None, 1e-5)


def assert_overflowed_rows_are_nan(k, op: str, n: int, device: str) -> None:
    """bf16 rows near 1e30: x^2 overflows fp32. y and, through the saved rstd, dx are NaN in that
    row; the rows beside stay finite."""
    g = torch.Generator(device=device).manual_seed(5)
    x = torch.randn(3, n, generator=g, device=device)
    x[1] *= 1e30
    x = x.to(torch.bfloat16)
    dy = torch.randn(3, n, generator=g, device=device).to(torch.bfloat16)
    w = torch.ones(n, device=device, dtype=torch.bfloat16)
    b = torch.full((n,), 0.5, device=device, dtype=torch.bfloat16)
    if op == "layernorm":
        y, mean, rstd = k.layernorm_fwd(x, w, b, 1e-5)
        dx = k.layernorm_bwd(dy, x, w, mean, rstd)[0]
    else:
        y, rstd = k.rmsnorm_fwd(x, w, 1e-5)
        dx = k.rmsnorm_bwd(dy, x, w, rstd)[0]
    for name, t in (("y", y), ("dx", dx)):
        assert not torch.isfinite(t[1]).any(), f"{name}: an overflowed row came back finite"
        assert torch.isfinite(t[[0, 2]]).all(), f"{name}: a row beside the overflowed one is not finite"


def assert_views_pass(impl: str, shapes, dtype: str) -> None:
    """Every op of ``impl`` over per-head views, through the harness (which hands the views over as
    they are): forward and backward against fp64, the FP8 ops against the exact checker."""
    from harness.registry import get
    from harness.run.checker import run_check
    from harness.spec.ops import OPS, get_op

    failures = []
    for op in get(impl).ops:
        for shape in shapes:
            if get_op(op).unsupported(shape.n):
                continue
            for direction in OPS[op].directions:
                r = run_check(get(impl), op, direction, shape, dtype, "cuda")
                if not r.passed:
                    failures.append(f"{op} {direction} {shape.label}: {r.status} {r.summary()}")
    assert not failures, "\n".join(failures)


def rows_of(t, n):
    return t.reshape(-1, n)


def rms_bwd_scales(dy, h, w, rstd, dres):
    """The checker's tolerance scales for RMSNorm's backward on h (harness.run.checker._check_tensors),
    with |dresidual_out| added to dh's."""
    dy64, r64 = dy.double(), rstd.reshape(-1, 1)
    dx_terms = (dy64 * (w.double() if w is not None else 1.0) * r64).abs()
    if dres is not None:
        dx_terms = dx_terms + dres.double().abs()
    return dx_terms, (dy64 * h.double() * r64).square().sum(0).sqrt()


def add_rmsnorm_failures(k, shape, dtype, param_dtype, device) -> list[str]:
    """add + RMSNorm's forward and backward (with and without dresidual_out) on one shape, with
    weights in x's dtype ("x") or fp32: the failing tensors' reports."""
    case = make_case("rmsnorm", shape, DTYPES[dtype], device, seed=1)
    res = make_case("rmsnorm", shape, DTYPES[dtype], device, seed=2)["x"]
    dres = make_case("rmsnorm", shape, DTYPES[dtype], device, seed=3)["dy"]
    x, dy, w, n = case["x"], case["dy"], case["weight"], shape.n
    w = w if param_dtype == "x" else w.float()
    y_ref, h_ref, rstd_ref = reference.add_rmsnorm_fwd(x, res, w, case["eps"])
    with poisoned_allocations():
        y, h, rstd = k.add_rmsnorm_fwd(x, res, w, case["eps"])
    if device != "cpu" or dtype != "bf16":
        # the sum rounded once to x's dtype, bit for bit what the unfused pair stores
        assert torch.equal(h, (x.float() + res.float()).to(x.dtype)), f"{shape.label}: residual_out"
    else:
        # Triton's interpreter truncates fp32 -> bf16 (a GPU rounds to nearest even): here h is
        # within an ulp of the rounded sum, and y and rstd must be those of h as it was stored
        y_ref, rstd_ref = reference.rmsnorm_fwd(h, w, case["eps"])
    reports = [
        compare("y", y, y_ref, x.dtype, x.shape),
        compare("residual_out", h, h_ref, x.dtype, x.shape),
        compare("rstd", rstd, rstd_ref, torch.float32, x.shape[:-1]),
    ]
    h_in = h_ref.to(x.dtype)  # the backward gets residual_out as the unfused model stored it
    for d in (dres, None):
        dh_ref, dw_ref = reference.add_rmsnorm_bwd(dy, d, h_in, w, rstd_ref)
        with poisoned_allocations():
            dh, dw = k.add_rmsnorm_bwd(dy, d, h_in, w, rstd_ref.float())
        dres_rows = None if d is None else rows_of(d, n)
        dh_scale, dw_scale = rms_bwd_scales(rows_of(dy, n), rows_of(h_in, n), w, rstd_ref, dres_rows)
        reports += [
            compare("dh" if d is not None else "dh (no dresidual_out)", dh, dh_ref, x.dtype, x.shape, dh_scale.reshape(x.shape)),  # fmt: skip
            compare("dweight", dw, dw_ref, w.dtype, w.shape, dw_scale),
        ]
    return [f"{r.name}: {r.reason}" for r in reports if not r.passed]
