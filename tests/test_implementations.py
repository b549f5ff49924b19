"""Cross-implementation correctness, generated from the registry: a new folder under impls/ is
tested here with no new test code. On a machine without a GPU, whatever runs on the CPU (natively or
through its DSL's interpreter) is checked on the smoke and edge shape sets; implementations marked
``cpu_cost="costly"`` on a subset of them. On the GPU machine every implementation runs everything."""

import pytest

from harness.registry import all_implementations
from harness.run.checker import OVERFLOW_DTYPES, run_check
from harness.spec.contract import DTYPES, OPS
from harness.spec.inputs import OVERFLOW_SHAPES
from harness.spec.ops import get_op
from harness.spec.shapes import SHAPE_SETS

from .conftest import DEVICE, HAS_CUDA, known_failure_marks

COSTLY_SMOKE = tuple(s for s in SHAPE_SETS["smoke"] if s.m == 3)
COSTLY_OTHER_DTYPES = (SHAPE_SETS["edge"][0], SHAPE_SETS["edge"][3], SHAPE_SETS["edge"][5])
COSTLY_EDGE = tuple(s for s in SHAPE_SETS["edge"] if s.n <= 4096)  # a compile per shape: skip the wide rows
# several blocks of rows: a dweight whose per-block partials are added in 16 bits shows only here
MANY_ROWS = tuple(s for s in SHAPE_SETS["smoke"] if (s.m, s.n) == (128, 4096))


def plan():
    for impl in sorted(all_implementations().values(), key=lambda i: i.name):
        why = impl.unavailable(DEVICE)
        for op in OPS:
            if op not in impl.ops:
                continue
            for dtype in DTYPES:
                if dtype not in impl.dtypes:
                    continue
                for set_name in ("smoke", "edge", "decode") if HAS_CUDA else ("smoke", "edge"):
                    shapes = SHAPE_SETS[set_name]
                    if not HAS_CUDA and impl.cpu_cost == "costly":
                        if dtype == "bf16":
                            shapes = COSTLY_SMOKE if set_name == "smoke" else COSTLY_EDGE
                        else:
                            shapes = COSTLY_OTHER_DTYPES if set_name == "edge" else ()
                    elif not HAS_CUDA and dtype != "bf16" and set_name == "smoke":
                        shapes = COSTLY_SMOKE + MANY_ROWS
                    if not shapes:
                        continue
                    marks = [pytest.mark.skip(reason=f"{impl.name}: {why}")] if why else []
                    if impl.meta.get("variant") == "first-shot" and impl.meta.get("has_fixes"):
                        # an LLM's verbatim output that needed fixes: its failures are a result
                        # (reported by normbench check/bench), not a regression
                        marks.append(pytest.mark.xfail(reason="first-shot LLM output with recorded fixes", strict=False))
                    marks += known_failure_marks(impl, op)
                    yield pytest.param(impl, op, dtype, set_name, shapes, id=f"{impl.name}-{op}-{dtype}-{set_name}", marks=marks)


def _check_all(impl, op, direction, shapes, dtype, **variant):
    failures = []
    for shape in shapes:
        r = run_check(impl, op, direction, shape, dtype, DEVICE, **variant)
        if not r.passed:
            failures.append(f"{shape.label}: {r.status} {r.summary()}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
@pytest.mark.parametrize("impl,op,dtype,set_name,shapes", list(plan()))
def test_matches_fp64_reference(impl, op, dtype, set_name, shapes, direction):
    _check_all(impl, op, direction, shapes, dtype)


# Weight variants: fp32 parameters beside 16-bit x, and weight_offset = 1 (fp32 activations too: the
# offset added in bf16 shows only there). A few shapes: the variants change the parameters, not the
# row paths the main plan covers.
VARIANTS = (("fp32", ("bf16", "fp16")), ("offset", ("bf16", "fp16", "fp32")))
VARIANT_SHAPES = (SHAPE_SETS["edge"][5], SHAPE_SETS["edge"][0])  # 37x1001, 96x1000 column slice
COSTLY_VARIANTS = (("fp32", ("bf16",)), ("offset", ("fp32",)))


def _marks(impl, why, what, direction):
    marks = [pytest.mark.skip(reason=f"{impl.name}: {why}")] if why else []
    known = known_failure_marks(impl, what)
    if known:
        marks += known
    elif impl.external:
        marks.append(pytest.mark.xfail(reason=f"a third-party library: a failure on {what} is its result", strict=False))
    elif impl.meta.get("variant") == "first-shot":
        # an LLM's verbatim output predates mixed parameters and the overflow check: a failure
        # here is a result of the sample (normbench check reports it), not a regression
        marks.append(pytest.mark.xfail(reason=f"first-shot LLM output, written before {what} were checked", strict=False))
    return marks


def variant_plan():
    for impl in sorted(all_implementations().values(), key=lambda i: i.name):
        costly = not HAS_CUDA and impl.cpu_cost == "costly"
        for op in impl.ops:
            for weights, dtypes in COSTLY_VARIANTS if costly else VARIANTS:
                for dtype in (d for d in dtypes if d in impl.dtypes):
                    shapes = VARIANT_SHAPES[:1] if costly else VARIANT_SHAPES
                    what = "fp32 parameters" if dtype != "fp32" else "the offset weight"  # fp32 beside fp32 x: not mixed
                    for d in ("fwd", "bwd"):
                        marks = _marks(impl, impl.unavailable(DEVICE), what, d)
                        yield pytest.param(impl, op, dtype, weights, shapes, d, id=f"{impl.name}-{op}-{dtype}-{weights}-{d}", marks=marks)


@pytest.mark.parametrize("impl,op,dtype,weights,shapes,direction", list(variant_plan()))
def test_weight_variants(impl, op, dtype, weights, shapes, direction):
    _check_all(impl, op, direction, shapes, dtype, weights=weights)


def overflow_plan():
    for impl in sorted(all_implementations().values(), key=lambda i: i.name):
        costly = not HAS_CUDA and impl.cpu_cost == "costly"
        for op in (o for o in impl.ops if get_op(o).overflow):
            for dtype in tuple(d for d in OVERFLOW_DTYPES if d in impl.dtypes)[: 1 if costly else None]:
                shapes = OVERFLOW_SHAPES[:1] if costly else OVERFLOW_SHAPES
                for d in ("fwd", "bwd"):
                    marks = _marks(impl, impl.unavailable(DEVICE), "overflowing inputs", d)
                    yield pytest.param(impl, op, dtype, shapes, d, id=f"{impl.name}-{op}-{dtype}-{d}", marks=marks)


@pytest.mark.parametrize("impl,op,dtype,shapes,direction", list(overflow_plan()))
def test_overflow_gives_nan_or_the_right_answer(impl, op, dtype, shapes, direction):
    """Rows whose squares overflow fp32 (harness.spec.inputs.OVERFLOW): NaN as torch returns, or the
    right answer; never a finite wrong number (the backward runs on the forward's own statistics)."""
    _check_all(impl, op, direction, shapes, dtype, overflow=True)


def _affine_free_params():
    for i in all_implementations().values():
        if not i.available(DEVICE) or (i.meta.get("variant") == "first-shot" and i.meta.get("has_fixes")):
            continue
        yield pytest.param(i, marks=known_failure_marks(i, *i.ops), id=i.name)


@pytest.mark.parametrize("impl", list(_affine_free_params()))
def test_without_affine_parameters(impl):
    """weight=None (elementwise_affine=False), bias=None, and dresidual_out=None (add_rmsnorm)."""
    shape = SHAPE_SETS["edge"][5]
    for op in impl.ops:
        for direction in ("fwd", "bwd"):
            r = run_check(impl, op, direction, shape, "bf16", DEVICE, affine=False)
            assert r.passed, (op, direction, r.summary())


def test_every_record_is_well_formed():
    for impl in all_implementations().values():
        assert impl.ops and impl.dtypes and impl.devices
        assert impl.cpu_cost in ("cheap", "costly")
        for src in impl.sources:
            from pathlib import Path

            assert (Path(__file__).parent.parent / src).exists(), f"{impl.name}: missing source {src}"
