"""The criterion passes correct kernels and rejects each mutant (tests/mutants.py)."""

import pytest
import torch

from harness import get
from harness.run.checker import compare, poisoned_allocations, run_check
from harness.spec.contract import OPS, Implementation
from harness.spec.shapes import SHAPE_SETS, Shape


def mutant(factory: str, ops=("rmsnorm",)) -> Implementation:
    return Implementation(name=f"mutant-{factory}", dsl="eager", entry=f"tests.mutants:{factory}", ops=ops, devices=("cpu", "cuda"))


def test_correct_bf16_kernel_passes_every_cpu_shape_set():
    eager = get("eager")
    for name in ("smoke", "edge"):
        for shape in SHAPE_SETS[name]:
            for op in OPS:
                for d in ("fwd", "bwd"):
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
