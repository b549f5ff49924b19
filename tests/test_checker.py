"""The criterion passes correct kernels and rejects each mutant (tests/mutants.py)."""

import pytest
import torch

from harness import get
from harness.checker import compare, poisoned_allocations, run_check
from harness.contract import Implementation
from harness.shapes import SHAPE_SETS, Shape


def mutant(factory: str, ops=("rmsnorm",)) -> Implementation:
    return Implementation(name=f"mutant-{factory}", dsl="eager", entry=f"tests.mutants:{factory}", ops=ops, devices=("cpu", "cuda"))


def test_correct_bf16_kernel_passes_every_cpu_shape_set():
    eager = get("eager")
    for name in ("smoke", "edge"):
        for shape in SHAPE_SETS[name]:
            for op in ("rmsnorm", "layernorm"):
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
    from harness.contract import DTYPES
    from harness.inputs import make_case

    a = make_case("layernorm", Shape((32, 100)), DTYPES[dtype], seed=1)
    b = make_case("layernorm", Shape((32, 100)), DTYPES[dtype], seed=2)
    for key in ("x", "dy", "weight", "bias"):
        assert a[key].abs().min() >= 0 and a[key].count_nonzero() > 0.9 * a[key].numel()
        assert not torch.equal(a[key], b[key])
    scales = a["x"].float().square().mean(-1)
    assert scales.min() < a["eps"] < scales.max()  # some rows are dominated by eps
