"""CuTe DSL kernels: every variant compiles for sm_90a without a GPU; on the GPU, CuTe-specific
behaviour (no recompilation for a new M, deterministic backward). Correctness against the fp64
reference is the registry-driven tests' job."""

import math
import os

import pytest
import torch

pytest.importorskip("cutlass")
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # compile for Hopper with no driver present

from harness.shapes import SHAPE_SETS  # noqa: E402
from impls.cute import kernels as K  # noqa: E402

# every N of the CPU shape sets (smoke and edge), plus the widest row (a 16-CTA cluster)
CPU_N = sorted({s.n for name in ("smoke", "edge") for s in SHAPE_SETS[name] if s.n > 0} | {262144})
VARIANTS = [(op, d) for op in ("rmsnorm", "layernorm") for d in ("fwd", "bwd")]


@pytest.mark.parametrize("n", CPU_N)
@pytest.mark.parametrize("op,direction", VARIANTS)
def test_compiles_bf16(op, direction, n):
    assert K.compile_only(op, direction, torch.bfloat16, n) > 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("op,direction", VARIANTS)
def test_compiles_other_dtypes(op, direction, dtype):
    assert K.compile_only(op, direction, dtype, 4096) > 0


@pytest.mark.parametrize("op,direction", VARIANTS)
def test_compiles_narrow_vectors_and_no_affine(op, direction):
    # a row stride that is not a multiple of 8 forces 4-element vectors; weight=None drops dweight
    assert K.compile_only(op, direction, torch.bfloat16, 1000, vec=4, affine=False) > 0


def test_launch_shapes_cover_the_row_once():
    for n in (1, 7, 1000, 1001, 4096, 7168, 16384, 65536, 262144):
        for elem in (2, 4):
            vec = math.gcd(n, 16 // elem)
            for op in ("rmsnorm", "layernorm"):
                for direction in ("fwd", "bwd"):
                    L = K.launch_shape(n, elem, vec, direction, op)
                    assert L.cluster_n * L.chunk >= n  # every column is covered
                    assert (L.cluster_n - 1) * L.chunk < n  # and no CTA of a cluster is empty
                    assert L.cluster_n == 1 or L.rows_per_cta == 1
                    assert L.chunk * elem <= 2 * 32 * 1024 or L.cluster_n == 16
                    assert not L.stage_x or (direction == "fwd" and L.threads_per_row >= 32)
                    few = K.launch_shape(n, elem, vec, direction, op, few_rows=True)
                    assert few == L if L.cluster_n > 1 or not L.stage_x else not few.stage_x


def test_few_rows_compile_an_unstaged_forward():
    """LayerNorm rows of 16 KB are staged in shared memory for many rows, not for a decode batch."""
    assert K.launch_shape(8192, 2, 8, "fwd", "layernorm").stage_x
    assert not K.launch_shape(8192, 2, 8, "fwd", "layernorm", few_rows=True).stage_x
    assert K.compile_only("layernorm", "fwd", torch.bfloat16, 8192, few_rows=True) > 0


def test_vector_width_respects_strides_and_alignment():
    x = torch.empty(4, 1024, dtype=torch.bfloat16)
    assert K.vector_width(1000, torch.bfloat16, x[:, :1000]) == 8
    assert K.vector_width(1000, torch.bfloat16, x[:, 1:1001]) == 1  # pointer off by one element
    assert K.vector_width(1000, torch.bfloat16, torch.empty(4, 1004, dtype=torch.bfloat16)[:, :1000]) == 4
    assert K.vector_width(1003, torch.bfloat16, x[:, :1003]) == 1


@pytest.mark.gpu
def test_new_m_does_not_recompile():
    x = torch.randn(300, 2880, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2880, device="cuda", dtype=torch.bfloat16)
    K.rmsnorm_fwd(x, w, 1e-5)
    keys = set(K.COMPILE_SECONDS)
    for m in (1, 17, 299):
        _, rstd = K.rmsnorm_fwd(x[:m], w, 1e-5)
        K.rmsnorm_bwd(x[:m], x[:m], w, rstd)
    K.rmsnorm_bwd(x, x, w, K.rmsnorm_fwd(x, w, 1e-5)[1])
    assert len(set(K.COMPILE_SECONDS) - keys) == 1  # the backward, compiled once


@pytest.mark.gpu
@pytest.mark.parametrize("n", [4096, 65536])
def test_backward_is_deterministic(n):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1000, n, device="cuda", dtype=torch.bfloat16, generator=g)
    dy = torch.randn(1000, n, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=g)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=g)
    _, mean, rstd = K.layernorm_fwd(x, w, b, 1e-5)
    first = K.layernorm_bwd(dy, x, w, mean, rstd)
    for _ in range(3):
        again = K.layernorm_bwd(dy, x, w, mean, rstd)
        assert all(torch.equal(a, b) for a, b in zip(first, again))
