"""Cross-implementation correctness, generated from the registry: a new folder under impls/ is
tested here with no new test code. On a machine without a GPU, whatever runs on the CPU (natively or
through its DSL's interpreter) is checked on the smoke and edge shape sets; implementations marked
``cpu_cost="costly"`` on a subset of them. On the GPU machine every implementation runs everything."""

import pytest

from harness.checker import run_check
from harness.contract import DTYPES, OPS
from harness.registry import all_implementations
from harness.shapes import SHAPE_SETS

from .conftest import DEVICE, HAS_CUDA

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
                    yield pytest.param(impl, op, dtype, set_name, shapes, id=f"{impl.name}-{op}-{dtype}-{set_name}", marks=marks)


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
@pytest.mark.parametrize("impl,op,dtype,set_name,shapes", list(plan()))
def test_matches_fp64_reference(impl, op, dtype, set_name, shapes, direction):
    failures = []
    for shape in shapes:
        r = run_check(impl, op, direction, shape, dtype, DEVICE)
        if not r.passed:
            failures.append(f"{shape.label}: {r.status} {r.summary()}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize(
    "impl",
    [i for i in all_implementations().values() if i.available(DEVICE) and not (i.meta.get("variant") == "first-shot" and i.meta.get("has_fixes"))],
    ids=lambda i: i.name,
)
def test_without_affine_parameters(impl):
    """weight=None (elementwise_affine=False) and bias=None."""
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
