"""The generated tests (tests/test_implementations.py's plan) catch what `normbench check --shapes
smoke,edge` catches: a mutant that only the 128-row smoke shapes expose is caught in fp16 and fp32
too, where the plan checks fewer shapes than in bf16."""

import pytest

import tests.test_implementations as generated
from harness.run.checker import run_check
from harness.spec.contract import Implementation
from harness.spec.shapes import SHAPE_SETS

from . import mutants
from .conftest import DEVICE

RECORD = Implementation(name="mutant", dsl="eager", entry="impls.eager.kernels", devices=("cpu", "cuda"), ops=("rmsnorm",))


def _failing(shapes, dtype, kernels) -> list[str]:
    return [s.label for s in shapes if not run_check(RECORD, "rmsnorm", "bwd", s, dtype, DEVICE, kernels=kernels).passed]


@pytest.mark.parametrize("dtype", ["fp16"])
def test_generated_plan_catches_a_dweight_added_up_in_16_bits(dtype, monkeypatch):
    monkeypatch.setattr(generated, "all_implementations", lambda: {RECORD.name: RECORD})
    planned = [s for p in generated.plan() if p.values[2] == dtype for s in p.values[4]]
    assert planned
    kernels = mutants.dweight_16bit_row_blocks()
    # `normbench check --shapes smoke,edge` catches it (on the smoke shapes) ...
    assert _failing(SHAPE_SETS["smoke"], dtype, kernels)
    # (and only its dweight is wrong: in one block it is right, on every narrow planned shape)
    narrow = [s for s in planned if s.n <= 4096]
    assert not _failing(narrow, dtype, mutants.dweight_16bit_row_blocks(block=10**9))
    # ... and so do the generated tests
    assert _failing(planned, dtype, kernels), f"the {dtype} plan ({', '.join(s.label for s in planned)}) misses it"
