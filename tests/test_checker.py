"""The criterion passes correct kernels and rejects each mutant (tests/mutants.py)."""

import json

import pytest
import torch

from harness import get
from harness.run.checker import compare, poisoned_allocations, run_check
from harness.spec.contract import OPS, Implementation
from harness.spec.ops import get_op
from harness.spec.shapes import SHAPE_SETS, Shape


def mutant(factory: str, ops=("rmsnorm",)) -> Implementation:
    return Implementation(name=f"mutant-{factory}", dsl="eager", entry=f"tests.mutants:{factory}", ops=ops, devices=("cpu", "cuda"))


def test_correct_bf16_kernel_passes_every_cpu_shape_set():
    eager = get("eager")
    for name in ("smoke", "edge"):
        for shape in SHAPE_SETS[name]:
            for op in OPS:
                if get_op(op).unsupported(shape.n):  # N not a multiple of an FP8 op's group
                    continue
                for d in get_op(op).directions:
                    r = run_check(eager, op, d, shape, "bf16", "cpu")
                    assert r.passed, (name, shape, op, d, r.summary())


@pytest.mark.parametrize("m", [8192, 16384])
def test_bf16_accumulated_dweight_is_rejected(m):
    r = run_check(mutant("bf16_accumulation"), "rmsnorm", "bwd", Shape((m, 64)), "bf16", "cpu")
    assert r.status == "fail"
    by = {t.name: t for t in r.tensors}
    assert by["dx"].passed and not by["dweight"].passed, r.summary()


def test_fp32_accumulated_dweight_passes_at_the_same_size():
    r = run_check(get("eager"), "rmsnorm", "bwd", Shape((16384, 64)), "bf16", "cpu")
    assert r.passed, r.summary()


def test_nan_where_reference_is_finite_is_rejected():
    r = run_check(mutant("nan_output"), "rmsnorm", "fwd", Shape((16, 64)), "bf16", "cpu")
    assert r.status == "fail" and "NaN" in r.summary()


def test_unwritten_elements_are_detected_through_poisoned_allocations():
    r = run_check(mutant("unwritten_column"), "rmsnorm", "fwd", Shape((16, 64)), "bf16", "cpu")
    assert r.status == "fail" and "unwritten" in r.summary()


def test_poisoning_fills_empty_with_nan_and_is_undone():
    with poisoned_allocations():
        assert torch.isnan(torch.empty(64)).all()
        assert torch.isnan(torch.empty(8, dtype=torch.bfloat16)).all()
    assert not torch.are_deterministic_algorithms_enabled()


@pytest.mark.parametrize("op", ["rmsnorm", "layernorm"])
def test_wrong_eps_is_rejected(op):
    r = run_check(mutant("wrong_eps", (op,)), op, "fwd", Shape((128, 256)), "bf16", "cpu")
    assert r.status == "fail", r.summary()


def test_low_precision_statistics_are_rejected():
    r = run_check(mutant("bf16_statistics", ("layernorm",)), "layernorm", "fwd", Shape((64, 512)), "bf16", "cpu")
    assert r.status == "fail"
    assert {t.name for t in r.tensors if not t.passed} == {"mean", "rstd"}


def test_statistics_in_the_wrong_dtype_are_rejected():
    r = run_check(mutant("wrong_stats_dtype"), "rmsnorm", "fwd", Shape((8, 64)), "bf16", "cpu")
    assert r.status == "fail" and "dtype" in r.summary()


def test_a_wrong_backward_formula_is_rejected():
    r = run_check(mutant("missing_rstd_gradient"), "rmsnorm", "bwd", Shape((64, 256)), "bf16", "cpu")
    assert r.status == "fail"
    assert not {t.name: t for t in r.tensors}["dx"].passed


def test_a_crash_is_a_result_not_an_exception():
    r = run_check(mutant("crashing", ("rmsnorm", "layernorm")), "layernorm", "bwd", Shape((4, 64)), "bf16", "cpu")
    assert r.status == "error" and "simulated" in r.error


def test_unavailable_implementation_is_skipped_with_its_reason():
    impl = Implementation(name="gpu-only", dsl="eager", entry="impls.eager.kernels", devices=("cuda",))
    r = run_check(impl, "rmsnorm", "fwd", Shape((4, 64)), "bf16", "cpu")
    assert r.status == "skip" and "cuda" in r.error and not r.passed


def test_compare_reports_ulps_and_relative_l2():
    ref = torch.linspace(1, 2, 100, dtype=torch.float64)
    out = ref.to(torch.bfloat16)
    rep = compare("y", out, ref, torch.bfloat16, (100,))
    assert rep.passed and 0 < rep.max_ulp <= 0.5 and rep.rel_l2 < 4e-3
    bad = out.clone()
    bad[3] += 0.1
    rep = compare("y", bad, ref, torch.bfloat16, (100,))
    assert not rep.passed and rep.max_ulp > 2
    assert not compare("y", out.float(), ref, torch.bfloat16, (100,)).passed  # dtype
    assert not compare("y", out[:10], ref, torch.bfloat16, (100,)).passed  # shape


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_inputs_are_fresh_random_never_zero(dtype):
    from harness.spec.contract import DTYPES
    from harness.spec.inputs import make_case

    a = make_case("layernorm", Shape((32, 100)), DTYPES[dtype], seed=1)
    b = make_case("layernorm", Shape((32, 100)), DTYPES[dtype], seed=2)
    for key in ("x", "dy", "weight", "bias"):
        assert a[key].abs().min() >= 0 and a[key].count_nonzero() > 0.9 * a[key].numel()
        assert not torch.equal(a[key], b[key])
    scales = a["x"].float().square().mean(-1)
    assert scales.min() < a["eps"] < scales.max()  # some rows are dominated by eps


def test_dh_without_dresidual_out_is_rejected():
    r = run_check(mutant("dh_without_dresidual", ("add_rmsnorm",)), "add_rmsnorm", "bwd", Shape((16, 256)), "bf16", "cpu")
    assert r.status == "fail"
    by = {t.name: t for t in r.tensors}
    assert not by["dh"].passed and by["dweight"].passed, r.summary()


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_add_rmsnorm_checks_every_output(dtype):
    eager = get("eager")
    for d, names in (("fwd", ["y", "residual_out", "rstd"]), ("bwd", ["dh", "dweight"])):
        r = run_check(eager, "add_rmsnorm", d, Shape((2, 5, 1003), "column-slice"), dtype, "cpu")
        assert r.passed and [t.name for t in r.tensors] == names, r.summary()


def test_the_offset_added_in_bf16_is_rejected():
    # in 16-bit activations losing w (~1e-3 beside 1) stays under the output's own rounding; fp32
    # activations see it at once
    r = run_check(mutant("offset_in_bf16"), "rmsnorm", "fwd", Shape((64, 512)), "fp32", "cpu", weights="offset")
    assert r.status == "fail" and not {t.name: t for t in r.tensors}["y"].passed, r.summary()
    assert run_check(get("eager"), "rmsnorm", "fwd", Shape((64, 512)), "fp32", "cpu", weights="offset").passed


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_dweight_in_x_dtype_beside_fp32_weights_is_rejected(dtype):
    r = run_check(mutant("dweight_in_x_dtype"), "rmsnorm", "bwd", Shape((16, 64)), dtype, "cpu", weights="fp32")
    assert r.status == "fail" and "dtype" in r.summary()
    # the same kernel is right when the weight has x's dtype
    assert run_check(mutant("dweight_in_x_dtype"), "rmsnorm", "bwd", Shape((16, 64)), dtype, "cpu").passed


def test_fp32_and_offset_weights_reach_the_kernels_as_fp32():
    from harness.spec.contract import DTYPES
    from harness.spec.inputs import make_case

    same = make_case("layernorm", Shape((4, 64)), DTYPES["bf16"], weights="same")
    fp32 = make_case("layernorm", Shape((4, 64)), DTYPES["bf16"], weights="fp32")
    off = make_case("layernorm", Shape((4, 64)), DTYPES["bf16"], weights="offset")
    assert same["weight"].dtype == same["bias"].dtype == torch.bfloat16
    assert fp32["weight"].dtype == fp32["bias"].dtype == torch.float32
    assert torch.equal(same["x"], fp32["x"]) and torch.equal(same["x"], off["x"])  # only the parameters differ
    assert off["weight"].dtype == torch.float32 and off["raw_weight"].dtype == torch.bfloat16
    # w is lost when 1 + w is added in bf16, kept in fp32
    assert int(((off["raw_weight"] + 1.0) == 1.0).sum()) > 48
    assert torch.equal(off["weight"], off["raw_weight"].float() + 1.0) and (off["weight"] != 1.0).all()


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_overflow_to_a_finite_wrong_number_is_rejected_and_nan_accepted(dtype):
    shape = Shape((8, 256))
    r = run_check(mutant("overflow_to_bias", ("layernorm",)), "layernorm", "fwd", shape, dtype, "cpu", overflow=True)
    assert r.status == "fail" and not {t.name: t for t in r.tensors}["y"].passed, r.summary()
    for d in ("fwd", "bwd"):  # eager returns NaN, as torch does, and its backward keeps it
        assert run_check(get("eager"), "layernorm", d, shape, dtype, "cpu", overflow=True).passed
    skipped = run_check(get("eager"), "rmsnorm", "fwd", shape, dtype, "cpu", overflow=True)
    assert skipped.status == "skip" and "overflow" in skipped.error


def test_overflow_backward_runs_on_the_forwards_own_statistics():
    # a forward whose rstd is 0 (var overflowed, not NaN) makes the backward return zeros: rejected
    r = run_check(mutant("overflow_to_bias", ("layernorm",)), "layernorm", "bwd", Shape((8, 256)), "bf16", "cpu", overflow=True)
    assert r.status == "fail" and not {t.name: t for t in r.tensors}["dx"].passed, r.summary()


# ---------------------------------------------------------------- bias
# the ops whose outputs are rounded values (the FP8 ops' q is held exactly: tests/test_fp8.py)
ALL_OPS = tuple(op for op in OPS if not get_op(op).quantized)


def bias_shapes(elements: int) -> tuple:
    """Smoke shapes with enough elements for a mean to tell (and N > 1: at N = 1 dx is rounding noise)."""
    return tuple(s for s in SHAPE_SETS["smoke"] if s.m * s.n >= elements and s.n > 1)


@pytest.mark.parametrize("factor,elements", [(1.005, 64), (1.003, 1000)])
@pytest.mark.parametrize("direction", ["fwd", "bwd"])
@pytest.mark.parametrize("op", ALL_OPS)
def test_a_biased_kernel_fails_in_bf16(op, direction, factor, elements):
    """Rows scaled by ``factor`` (y in the forward; dx / dh in the backward), rounded once: each
    element within 2 ulps of bf16 bar a few at the top of a binade (1.005), or all of them (1.003),
    so the mean signed error is what catches it, on every smoke shape of 64 (1000) elements or more."""
    m = Implementation(name=f"mutant-biased-{factor}", dsl="eager", entry="tests.mutants:biased", ops=ALL_OPS,
                       devices=("cpu",), options={"factor": factor})  # fmt: skip
    for shape in bias_shapes(elements):
        r = run_check(m, op, direction, shape, "bf16", "cpu")
        first, *rest = r.tensors
        assert r.status == "fail" and not first.passed and all(t.passed for t in rest), (shape.label, r.summary())
        assert first.bias > first.bias_bound, (shape.label, first)
        if factor == 1.003:
            assert first.reason.startswith("biased") and first.max_ulp <= 2, (shape.label, first.reason)


def test_bias_is_reported_and_near_zero_for_a_correct_kernel():
    r = run_check(get("eager"), "layernorm", "fwd", Shape((128, 4096)), "bf16", "cpu")
    y = {t.name: t for t in r.tensors}["y"]
    assert r.passed and abs(y.bias) < y.bias_bound < 0.03 and abs(y.offset) < y.bias_bound
    assert {"bias", "offset", "bias_bound"} <= set(r.to_json()["tensors"][0])


def test_truncation_is_allowed_toward_zero_only_where_the_record_says_so():
    """Triton's CPU interpreter converts fp32 to bf16 toward zero: half an ulp of bias toward zero is
    its rounding, allowed for an implementation it runs; the same bias from eager, or away from
    zero, is not."""
    from harness.run.checker import bias_check
    from harness.spec.tolerances import allowed_error, ulp

    g = torch.Generator().manual_seed(0)
    ref = torch.randn(64, 1024, generator=g, dtype=torch.float64)
    allowed = allowed_error(ref, torch.bfloat16)
    frac = torch.rand(ref.shape, generator=g, dtype=torch.float64)
    toward_zero = ref - torch.sign(ref) * frac * ulp(ref, torch.bfloat16)
    valid = torch.ones_like(ref, dtype=torch.bool)
    assert bias_check(toward_zero, ref, allowed, torch.bfloat16, valid, toward_zero=True)[3] == ""
    assert bias_check(toward_zero, ref, allowed, torch.bfloat16, valid, toward_zero=False)[3].startswith("biased")
    away = 2 * ref - toward_zero
    assert bias_check(away, ref, allowed, torch.bfloat16, valid, toward_zero=True)[3].startswith("biased")
    triton = Implementation(name="t", dsl="triton", entry="x", devices=("cpu",), interpreter="TRITON_INTERPRET")
    from harness.run.checker import truncating_interpreter

    assert truncating_interpreter("cpu", torch.bfloat16, triton) and not truncating_interpreter("cpu", torch.bfloat16, get("eager"))
    assert not truncating_interpreter("cpu", torch.float16, triton) and not truncating_interpreter("cuda", torch.bfloat16, triton)


# ---------------------------------------------------------------- tolerances at their threshold
# (dtype, the constant held, the mutant's error just above it (caught), just below (passes), shape).
# Errors come in the dtype's own spacings or in fractions of |ref| or of the row's RMS, never from
# harness/spec/tolerances.py, so loosening or tightening a constant there 10x fails one of these.
RTOL32 = 1e-4  # fp32's documented criterion: 1e-4 relative
THRESHOLDS = [
    ("bf16", "ulps", dict(where="largest", ulps=-3.5), dict(where="largest", ulps=-1.5)),
    ("bf16", "floor", dict(where="smallest", of_rms=2 * 2**-9), dict(where="smallest", of_rms=0.5 * 2**-9)),
    ("bf16", "bias", dict(ulps=0.15), dict(ulps=0.025)),
    ("fp16", "ulps", dict(where="largest", ulps=-3.5), dict(where="largest", ulps=-1.5)),
    ("fp16", "floor", dict(where="smallest", of_rms=2 * 2**-12), dict(where="smallest", of_rms=0.5 * 2**-12)),
    ("fp16", "bias", dict(ulps=0.15), dict(ulps=0.025)),
    ("fp32", "rtol", dict(where="largest", rel=-1.5 * RTOL32), dict(where="largest", rel=-0.5 * RTOL32)),
    ("fp32", "floor", dict(where="smallest", of_rms=2 * 2**-16), dict(where="smallest", of_rms=0.5 * 2**-16)),
    ("fp32", "bias", dict(rel=7e-6), dict(rel=1.2e-6)),
]


@pytest.mark.parametrize("dtype,held,above,below", THRESHOLDS, ids=[f"{t[0]}-{t[1]}" for t in THRESHOLDS])
def test_an_error_just_above_the_tolerance_fails_and_just_below_passes(dtype, held, above, below):
    from tests import mutants

    shape = Shape((128, 4096)) if held == "bias" else Shape((64, 256))
    impl = mutant("shifted")
    caught = run_check(impl, "rmsnorm", "fwd", shape, dtype, "cpu", kernels=mutants.shifted(**above))
    passes = run_check(impl, "rmsnorm", "fwd", shape, dtype, "cpu", kernels=mutants.shifted(**below))
    y_caught, y_passes = caught.tensors[0], passes.tensors[0]
    assert caught.status == "fail" and not y_caught.passed, y_caught
    assert passes.passed, passes.summary()
    if held == "bias":  # every element within its tolerance: the mean alone decides
        assert y_caught.reason.startswith("biased"), y_caught.reason
        assert 1 < y_caught.bias / y_caught.bias_bound < 5 and 0.2 < y_passes.bias / y_passes.bias_bound < 1
    else:  # one element per row moved, in a direction that keeps the mean near zero
        assert "64 elements over tolerance" in y_caught.reason, y_caught.reason


# ---------------------------------------------------------------- dy laid out unlike x
def test_dy_and_x_come_with_different_row_strides_in_the_edge_set():
    from harness.spec.contract import DTYPES
    from harness.spec.inputs import make_case

    layouts = {s.layout: s for s in SHAPE_SETS["edge"]}
    for layout, sliced in (("dy-column-slice", ("dy", "dresidual_out")), ("x-column-slice", ("x", "residual"))):
        case = make_case("add_rmsnorm", layouts[layout], DTYPES["bf16"])
        n = layouts[layout].n
        for name in ("x", "residual", "dy", "dresidual_out"):
            assert case[name].stride(0) == (n + 24 if name in sliced else n), (layout, name)


@pytest.mark.parametrize("op", ["rmsnorm", "layernorm"])
def test_a_backward_that_walks_dy_with_xs_stride_is_caught(op):
    m = mutant("dy_walked_with_x_stride", ("rmsnorm", "layernorm"))
    caught = []
    for shape in SHAPE_SETS["edge"]:
        r = run_check(m, op, "bwd", shape, "bf16", "cpu")
        if shape.layout in ("dy-column-slice", "x-column-slice"):
            assert r.status in ("fail", "error"), (shape.label, r.summary())
            caught.append(shape.layout)
        elif shape.n <= 4096:  # right wherever dy and x share a layout, column slices included
            assert r.passed, (shape.label, r.summary())
    assert sorted(caught) == ["dy-column-slice", "x-column-slice"]


# ---------------------------------------------------------------- the check command
def _registered(monkeypatch, impl: Implementation) -> str:
    from harness import registry

    monkeypatch.setattr(registry, "_REGISTRY", {**registry.all_implementations(), impl.name: impl})
    return impl.name


def test_the_default_check_holds_the_overflow_rule(monkeypatch, capsys):
    """A LayerNorm that gives y = bias where the variance overflows (finite and wrong) passes the
    ordinary inputs: the default check (the edge set) fails it, as the tests do."""
    from harness.cli import main
    from harness.run.check import OVERFLOW_SET, _points
    from harness.spec.inputs import OVERFLOW_SHAPES

    name = _registered(monkeypatch, mutant("overflow_to_bias", ("layernorm",)))
    argv = ["check", "--impl", name, "--op", "layernorm", "--dtype", "bf16,fp16", "--device", "cpu", "--quiet"]
    assert main([*argv, "--shapes", "smoke"]) == 0
    capsys.readouterr()
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert "(overflow inputs)" in out and f"{OVERFLOW_SHAPES[0].label} (overflow inputs): y:" in out
    pts = _points(get("eager"), "layernorm", ["fwd"], ["bf16", "fp16", "fp32"], [("edge", ())], False)
    assert [(p[3], p[5]) for p in pts if p[4] == OVERFLOW_SET] == [(dt, s) for dt in ("bf16", "fp32") for s in OVERFLOW_SHAPES]
    assert all(p[6] for p in pts)
    assert not [p for p in _points(get("eager"), "rmsnorm", ["fwd"], ["bf16"], [("edge", ())], False)]  # rmsnorm: no overflow rule
    only = _points(get("eager"), "layernorm", ["fwd"], ["bf16"], [("smoke", SHAPE_SETS["smoke"][:2])], True)
    assert [p[6] for p in only] == [True, True]  # --overflow: the selected shapes, on overflowing inputs


def test_progress_lines_come_within_a_long_group(monkeypatch, capsys):
    from harness.run import check

    monkeypatch.setattr(check, "PROGRESS_EVERY_S", 0.4)
    impl = Implementation(name="mutant-slow", dsl="eager", entry="tests.mutants:slow", ops=("rmsnorm",), devices=("cpu",), options={"seconds": 0.6})
    out = check.run([impl], ["rmsnorm"], ["fwd"], ["bf16"], [("custom", (Shape((2, 8)),) * 3)], "cpu")
    assert out.passed == 3
    lines = capsys.readouterr().out.splitlines()
    beats = [ln for ln in lines if "points, on fwd bf16 2x8" in ln]
    assert beats and lines.index(beats[0]) < lines.index(next(ln for ln in lines if "3 passed" in ln)), lines
    assert beats[0].startswith("check [1/1] mutant-slow rmsnorm: ")


def test_ctrl_c_keeps_what_was_checked(monkeypatch, capsys, tmp_path):
    from harness.cli import main

    impl = Implementation(name="mutant-interrupting", dsl="eager", entry="tests.mutants:interrupting", ops=("rmsnorm",),
                          devices=("cpu",), options={"after": 2, "tag": str(tmp_path)})  # fmt: skip
    name = _registered(monkeypatch, impl)
    path = tmp_path / "c.json"
    argv = ["check", "--impl", name, "--direction", "fwd", "--dtype", "bf16", "--shapes", "smoke", "--device", "cpu", "--json", str(path)]
    assert main(argv) == 130
    out = capsys.readouterr().out
    assert "2 passed, 0 failed" in out and "interrupted" in out
    data = json.loads(path.read_text())
    assert data["interrupted"] is True and [r["status"] for r in data["results"]] == ["pass", "pass"]


# ---------------------------------------------------------------- per-head views (row_views)
def test_head_slice_views_have_a_token_stride_of_the_parents_heads():
    from harness.spec.contract import DTYPES
    from harness.spec.inputs import make_case

    heads = [s for s in SHAPE_SETS["edge"] if s.layout.startswith("head-slice-")]
    assert heads
    for shape in heads:
        t, h, n = shape.dims
        p = int(shape.layout.rsplit("-", 1)[1])
        case = make_case("add_rmsnorm", shape, DTYPES["bf16"])
        for name in ("x", "residual"):
            assert case[name].shape == (t, h, n) and case[name].stride() == (p * n, n, 1), (shape.label, name)
        for name in ("dy", "dresidual_out"):  # gradients come contiguous, as attention's do
            assert case[name].is_contiguous(), (shape.label, name)


def test_perhead_set_pairs_every_view_with_its_contiguous_shape():
    views = [s for s in SHAPE_SETS["perhead"] if s.layout != "contiguous"]
    plain = {s.dims for s in SHAPE_SETS["perhead"] if s.layout == "contiguous"}
    assert views and {s.dims for s in views} == plain


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_a_row_views_kernel_that_ignores_the_token_stride_is_caught(direction):
    def record(factory):
        return Implementation(name=f"mutant-{factory}", dsl="eager", entry=f"tests.mutants:{factory}", ops=("rmsnorm",), devices=("cpu",), row_views=True)

    for shape in (s for s in SHAPE_SETS["edge"] if s.layout.startswith("head-slice-")):
        wrong = run_check(record("heads_read_as_packed"), "rmsnorm", direction, shape, "bf16", "cpu")
        assert wrong.status == "fail", (shape.label, wrong.summary())
        right = run_check(record("heads_reshaped"), "rmsnorm", direction, shape, "bf16", "cpu")
        assert right.passed, (shape.label, right.summary())


def test_row_views_decides_whether_a_per_head_view_reaches_the_kernel_uncopied():
    import torch

    from harness.spec.ops import get_op
    from harness.spec.validation import checked

    seen = []

    def rmsnorm_fwd(x, weight, eps):
        seen.append(x)
        xf = x.float()
        rstd = torch.rsqrt(xf.square().mean(-1) + eps)
        return (xf * rstd[..., None] * weight.float()).to(x.dtype), rstd.reshape(-1)

    g = torch.Generator().manual_seed(7)
    parent = torch.randn(6, 5, 32, generator=g)
    view, w = parent[:, :3], torch.randn(32, generator=g)
    for row_views in (True, False):
        impl = Implementation(name="probe", dsl="eager", entry="x", devices=("cpu",), row_views=row_views)
        y, rstd = checked(impl, get_op("rmsnorm"), "fwd", rmsnorm_fwd)(view, w, 1e-6)
        got = seen.pop()
        if row_views:  # the view itself: same storage, same strides
            assert got.data_ptr() == parent.data_ptr() and got.stride() == (160, 32, 1)
        else:  # (M, N) rows: no such view exists, so a copy
            assert got.shape == (18, 32) and got.is_contiguous() and got.data_ptr() != parent.data_ptr()
        expect = view * torch.rsqrt(view.square().mean(-1, keepdim=True) + 1e-6) * w
        assert y.shape == view.shape and rstd.shape == (6, 3)
        torch.testing.assert_close(y, expect)
    # a view that has an (M, N) view goes as (M, N) rows either way: kernels keep their 2-D path
    impl = Implementation(name="probe", dsl="eager", entry="x", devices=("cpu",), row_views=True)
    checked(impl, get_op("rmsnorm"), "fwd", rmsnorm_fwd)(parent[:2], w, 1e-6)
    assert seen.pop().dim() == 2


def test_rows_of_one_or_two_elements_are_not_held_to_the_bias_bound():
    """LayerNorm at N = 1 gives y = bias in every row: 128 copies of one rounding of an fp32 bias,
    whose mean error is that rounding, not a sample's. It failed as biased; rows of N <= 2 are
    exempt (their few values are set by the parameters), wider ones keep the bound."""
    from harness.run.checker import bias_check
    from harness.spec.tolerances import allowed_error

    r = run_check(get("eager"), "layernorm", "fwd", Shape((128, 1)), "bf16", "cpu", weights="fp32")
    assert r.passed, r.summary()
    ref = torch.full((128, 1), 1.0 + 2**-9, dtype=torch.float64)  # halfway: rounds the same way in every row
    out = ref.to(torch.bfloat16).double()
    allowed = allowed_error(ref, torch.bfloat16)
    valid = torch.ones_like(ref, dtype=torch.bool)
    assert bias_check(out, ref, allowed, torch.bfloat16, valid)[3] == ""
    wide = torch.randn(128, 64, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    scaled = (wide * 1.003).to(torch.bfloat16).double()
    assert bias_check(scaled, wide, allowed_error(wide, torch.bfloat16), torch.bfloat16, torch.ones_like(valid).expand(128, 64))[3].startswith("biased")
