"""Cross-implementation correctness, generated from the registry: a new folder under impls/ is
tested here with no new test code. On a machine without a GPU, whatever runs on the CPU (natively or
through its DSL's interpreter) is checked on the smoke and edge shape sets; fp16 and fp32 on the
edge set's rows up to 4096 columns (the wide rows, through an interpreter, took most of this
module's time: their paths run in bf16 here, in fp32 in the DSLs' own path tests, and in every dtype
on the GPU); implementations marked ``cpu_cost="costly"`` on a subset. On the GPU machine every
implementation runs everything."""

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


def _where(direction, dtype, weights="same", inputs="drawn"):
    """What a test of the contract functions runs, by known-failure field (tests/conftest.py)."""
    return {"direction": direction, "dtype": dtype, "weights": weights, "inputs": inputs, "device": DEVICE, "check": "contract"}


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
                    elif not HAS_CUDA and dtype != "bf16":
                        shapes = COSTLY_EDGE
                    shapes = tuple(s for s in shapes if not get_op(op).unsupported(s.n))  # an FP8 op's group must divide N
                    if not shapes:
                        continue
                    for direction in get_op(op).directions:
                        marks = [pytest.mark.skip(reason=f"{impl.name}: {why}")] if why else []
                        # a failure is expected only where the record says so (an anchor's departure
                        # from the contract, an LLM sample's failure explained after it was stored)
                        marks += known_failure_marks(impl, op, **_where(direction, dtype))
                        yield pytest.param(impl, op, dtype, set_name, shapes, direction,
                                           id=f"{impl.name}-{op}-{dtype}-{set_name}-{direction}", marks=marks)  # fmt: skip


def _check_all(impl, op, direction, shapes, dtype, **variant):
    failures = []
    for shape in shapes:
        r = run_check(impl, op, direction, shape, dtype, DEVICE, **variant)
        if not r.passed:
            failures.append(f"{shape.label}: {r.status} {r.summary()}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("impl,op,dtype,set_name,shapes,direction", list(plan()))
def test_matches_fp64_reference(impl, op, dtype, set_name, shapes, direction):
    _check_all(impl, op, direction, shapes, dtype)


# Weight variants: fp32 parameters beside 16-bit x, and weight_offset = 1 (fp32 activations too: the
# offset added in bf16 shows only there). A few shapes: the variants change the parameters, not the
# row paths the main plan covers.
VARIANTS = (("fp32", ("bf16", "fp16")), ("offset", ("bf16", "fp16", "fp32")))
VARIANT_SHAPES = (SHAPE_SETS["edge"][5], SHAPE_SETS["edge"][0])  # 37x1001, 96x1000 column slice
VARIANT_SHAPES_G128 = (SHAPE_SETS["edge"][1],)  # 4x33x256
COSTLY_VARIANTS = (("fp32", ("bf16",)), ("offset", ("fp32",)))


def _marks(impl, why, **where):
    marks = [pytest.mark.skip(reason=f"{impl.name}: {why}")] if why else []
    return marks + known_failure_marks(impl, **where)


def variant_plan():
    for impl in sorted(all_implementations().values(), key=lambda i: i.name):
        costly = not HAS_CUDA and impl.cpu_cost == "costly"
        for op in impl.ops:
            for weights, dtypes in COSTLY_VARIANTS if costly else VARIANTS:
                for dtype in (d for d in dtypes if d in impl.dtypes):
                    shapes = VARIANT_SHAPES[:1] if costly else VARIANT_SHAPES
                    if get_op(op).group:  # the 1 x 128 FP8 ops: N a multiple of 128
                        shapes = VARIANT_SHAPES_G128[:1] if costly else VARIANT_SHAPES_G128
                    for d in get_op(op).directions:
                        marks = _marks(impl, impl.unavailable(DEVICE), op=op, **_where(d, dtype, weights))
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
                    marks = _marks(impl, impl.unavailable(DEVICE), op=op, **_where(d, dtype, inputs="overflow"))
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
        yield pytest.param(i, marks=known_failure_marks(i, *i.ops, **_where(("fwd", "bwd"), "bf16")), id=i.name)


@pytest.mark.parametrize("impl", list(_affine_free_params()))
def test_without_affine_parameters(impl):
    """weight=None (elementwise_affine=False), bias=None, and dresidual_out=None (add_rmsnorm)."""
    for op in impl.ops:
        shape = SHAPE_SETS["edge"][1 if get_op(op).group else 5]  # 4x33x256 where N must be a multiple of 128
        for direction in get_op(op).directions:
            r = run_check(impl, op, direction, shape, "bf16", DEVICE, affine=False)
            assert r.passed, (op, direction, r.summary())


def test_every_record_is_well_formed():
    for impl in all_implementations().values():
        assert impl.ops and impl.dtypes and impl.devices
        assert impl.cpu_cost in ("cheap", "costly")
        for src in impl.sources:
            from pathlib import Path

            assert (Path(__file__).parent.parent / src).exists(), f"{impl.name}: missing source {src}"


# ------------------------------------------- eager: ATen's native kernels, whatever torch routes to
OVERRIDE_PROBE = """
import json
import torch
from torch._native import registry
from harness.registry import get
from harness.run.environment import aten_rms_norm
from harness.spec import reference

calls = []


def zeros(x, normalized_shape, weight, eps):
    calls.append(1)
    return torch.zeros_like(x), torch.zeros(x.shape[0], 1)


# a DSL override of ATen's RMSNorm at the CPU key, as torch registers its vendored Quack at CUDA
registry.register_op_override("normbench_probe", "aten", "_fused_rms_norm", "CPU", lambda *a, **k: True, zeros)
registry.reenable_op_overrides(enable_dsl_names="normbench_probe")
g = torch.Generator().manual_seed(11)
x, residual, w = torch.randn(5, 64, generator=g), torch.randn(5, 64, generator=g), torch.randn(64, generator=g)
out = {"record": aten_rms_norm("cpu"), "torch_overridden": not torch.nn.functional.rms_norm(x, (64,), w, 1e-5).any().item()}
k = get("eager").kernels("cpu")
before = len(calls)
y, rstd = k.rmsnorm_fwd(x, w, 1e-5)
y_add, h, _ = k.add_rmsnorm_fwd(x, residual, w, 1e-5)
out["eager_calls_the_override"] = len(calls) > before
out["eager_y_err"] = (y.double() - reference.rmsnorm_fwd(x, w, 1e-5)[0]).abs().max().item()
out["eager_add_y_err"] = (y_add.double() - reference.rmsnorm_fwd(h, w, 1e-5)[0]).abs().max().item()
out["override_on_after"] = not torch.nn.functional.rms_norm(x, (64,), w, 1e-5).any().item()
print(json.dumps(out))
"""


def test_eager_runs_aten_native_rms_norm_where_torch_routes_it_elsewhere():
    """torch 2.13+ routes ATen's RMSNorm to its vendored Quack where a CUDA build accepts the
    installed nvidia-cutlass-dsl; the same registry takes an override at the CPU key, so here one that
    returns zeros stands in for it (in a process of its own: it changes torch's dispatcher). F.rms_norm
    then runs it and the environment record says so; eager's functions run ATen's own kernel and
    leave the override in place for everything else."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("torch._native.registry")
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, "-c", OVERRIDE_PROBE], capture_output=True, text=True, cwd=root, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["torch_overridden"] and out["override_on_after"]
    assert out["record"]["kernel"] == "normbench_probe override" and "aten._fused_rms_norm" in out["record"]["why"]
    assert not out["eager_calls_the_override"]
    assert out["eager_y_err"] < 1e-5 and out["eager_add_y_err"] < 1e-5, out


def test_every_environment_record_says_which_kernel_aten_rms_norm_runs():
    """meta.json's environment (bench, check --json, model, tritonbench): aten_rms_norm is
    {"kernel": "native" | "vendored quack" | "<dsl> override", "why": one sentence}."""
    import json

    import torch

    from harness.run.environment import aten_rms_norm, environment

    for device in ("cpu", "cuda"):
        record = environment(device)["aten_rms_norm"]
        assert record == json.loads(json.dumps(record)) and set(record) == {"kernel", "why"}
        assert record["kernel"] in ("native", "vendored quack") or record["kernel"].endswith(" override")
        assert isinstance(record["why"], str) and len(record["why"]) > 20 and "\n" not in record["why"]
        assert record == aten_rms_norm(device)
    if not torch.backends.cuda.is_built():
        assert aten_rms_norm("cuda") == {"kernel": "native", "why": f"torch {torch.__version__} is a CPU build"}
