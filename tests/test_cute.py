"""CuTe DSL kernels: every variant compiles for sm_90a without a GPU, and every launch shape the
host side can pick is one Hopper accepts (or a clear ValueError); the FP8-output kernels compile to
the hardware's saturating conversion and vector-wide stores of q, and their 1 x 128 blocks map onto
lane groups; per-head (T, H, N) views are read in place or copied as ``view_rows`` decides, and
the kernels' own tiles of a view, run on the CPU, read the contract's rows. On the GPU:
add_rmsnorm, fp32 weights and per-head views against the fp64 reference, the FP8 ops against the
exact checker, NaN where the statistics overflow, and CuTe-specific behaviour (no recompilation
for a new M, deterministic backward). The registry-driven tests check the rest."""

import math
import os
import re

import pytest
import torch

# compile for Hopper with no driver present: read when cutlass is imported (set after it, the DSL
# detects no GPU and targets sm_100a)
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
pytest.importorskip("cutlass")

import cutlass
from cutlass import cute
from cutlass.cute.runtime import from_dlpack

from harness.spec import reference  # noqa: E402
from harness.run.checker import _check_tensors, compare, poisoned_allocations, run_check  # noqa: E402
from harness.spec.fp8 import GROUP_BLOCK  # noqa: E402
from harness.spec.inputs import make_case  # noqa: E402
from harness.spec.shapes import SHAPE_SETS, Shape  # noqa: E402
from impls.cute import fp8 as F8  # noqa: E402
from impls.cute import kernels as K  # noqa: E402
from impls.cute import plan as P  # noqa: E402

from .gpu_only_dsl import assert_views_pass, head_view  # noqa: E402

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
# every N of the CPU shape sets (smoke and edge), plus the widest row (a 16-CTA cluster)
CPU_N = sorted({s.n for name in ("smoke", "edge") for s in SHAPE_SETS[name] if s.n > 0} | {262144})
ALL_N = sorted({s.n for shapes in SHAPE_SETS.values() for s in shapes if s.n > 0})
VARIANTS = [(op, d) for op in ("rmsnorm", "layernorm") for d in ("fwd", "bwd")]


def _regime(n: int, dtype: torch.dtype, op: str = "rmsnorm") -> str:
    L = P.launch_shape(n, dtype.itemsize, math.gcd(n, 16 // dtype.itemsize), "fwd", op)
    return "clustered" if L.cluster_n > 1 else ("staged" if L.stage_x else "narrow")


def _regime_n(dtype: torch.dtype) -> dict[str, int]:
    """One N of the shape sets per row-width regime of the forward (RMSNorm's thresholds)."""
    found = {}
    for n in ALL_N:
        found.setdefault(_regime(n, dtype), n)
    assert set(found) == {"narrow", "staged", "clustered"}, found
    return found


REGIMES = [(dt, regime, n) for dt in (BF16, FP32) for regime, n in sorted(_regime_n(dt).items())]


# ---------------------------------------------------------------------------- compiles (sm_90a)
@pytest.mark.parametrize("n", CPU_N)
@pytest.mark.parametrize("op,direction", VARIANTS)
def test_compiles_bf16(op, direction, n):
    assert K.compile_only(op, direction, BF16, n) > 0


@pytest.mark.parametrize("dtype", [FP16, FP32])
@pytest.mark.parametrize("op,direction", VARIANTS)
def test_compiles_other_dtypes(op, direction, dtype):
    assert K.compile_only(op, direction, dtype, 4096) > 0


@pytest.mark.parametrize("op,direction", VARIANTS)
def test_compiles_narrow_vectors_and_no_affine(op, direction):
    # a row stride that is not a multiple of 8 forces 4-element vectors; weight=None drops dweight
    assert K.compile_only(op, direction, BF16, 1000, vec=4, wdtype=None) > 0


@pytest.mark.parametrize("dtype,regime,n", REGIMES, ids=lambda v: getattr(v, "__name__", str(v)))
@pytest.mark.parametrize("direction,dres", [("fwd", False), ("bwd", True), ("bwd", False)])
def test_add_rmsnorm_compiles(direction, dres, dtype, regime, n):
    """The fused add in every row-width regime: residual staged beside x, dresidual_out in the ring."""
    assert K.compile_only("add_rmsnorm", direction, dtype, n, residual=dres) > 0


@pytest.mark.parametrize("dtype,regime,n", [r for r in REGIMES if r[0] != FP32], ids=str)
@pytest.mark.parametrize("op,direction", VARIANTS + [("add_rmsnorm", "fwd"), ("add_rmsnorm", "bwd")])
def test_fp32_weights_compile(op, direction, dtype, regime, n):
    """fp32 weight (and bias) beside 16-bit x: two 128-bit loads per vector of x."""
    assert K.compile_only(op, direction, dtype, n, wdtype=FP32, residual=op == "add_rmsnorm") > 0


def test_fp16_x_with_fp32_weights_and_narrow_vectors_compile():
    for op, direction in VARIANTS:
        assert K.compile_only(op, direction, FP16, 20001, wdtype=FP32) > 0
        assert K.compile_only(op, direction, FP16, 1000, vec=2, wdtype=FP32) > 0


def _compiled_smem(key, compiled=K._COMPILED) -> int:
    """The dynamic shared memory the DSL itself computed for this compiled kernel: the i64 stored
    into the launch configuration's third field, in the host function's LLVM IR."""
    ir = str(compiled[key][0].ir_module)
    cfg = r"!llvm\.struct<\(array<3 x i32>, array<3 x i32>, i64, ptr, ptr, i32\)>"
    gep = re.search(rf"(%\d+) = llvm\.getelementptr %\d+\[0, 2\] : \(!llvm\.ptr\) -> !llvm\.ptr, {cfg}", ir)
    assert gep, "launch configuration not found in the host IR"
    store = re.search(rf"llvm\.store (%\d+), {gep.group(1)} : i64", ir)
    const = re.search(rf"{store.group(1)} = llvm\.mlir\.constant\((\d+) : i64\)", ir)
    return int(const.group(1))


@pytest.mark.parametrize(
    "op,direction,dtype,n,residual",
    [("layernorm", "bwd", FP32, 20001, False), ("layernorm", "bwd", FP32, 262144, False),
     ("add_rmsnorm", "bwd", BF16, 65536, True), ("add_rmsnorm", "fwd", BF16, 16384, True),
     ("layernorm", "fwd", BF16, 65536, False), ("rmsnorm", "fwd", BF16, 4096, False),
     ("layernorm", "bwd", BF16, 131080, False),
     ("layernorm", "bwd", BF16, 64, False), ("add_rmsnorm", "bwd", BF16, 128, True)],  # fmt: skip  # short rows fold
)
def test_shared_memory_model_matches_the_compiler(op, direction, dtype, n, residual):
    """check_launch judges shared memory by shared_memory_bytes: it must be what the kernel allocates."""
    vec = math.gcd(n, 16 // dtype.itemsize)
    K.compile_only(op, direction, dtype, n, residual=residual)
    key = K.kernel_key(op, direction, dtype, n, vec, dtype, dtype if op == "layernorm" and direction == "fwd" else None,
                       residual)  # fmt: skip
    launch, smem = P.planned_launch(n, dtype.itemsize, vec, direction, key[0], False, key[7])
    assert _compiled_smem(key) == smem <= P.SMEM_LIMIT


def test_whole_warp_launch_compiles():
    """Just past a power-of-two width a power-of-two thread count would leave a CTA of the cluster
    empty: those rows get a whole-warp thread count instead (bf16 N = 131080: 352 or so)."""
    for direction in ("fwd", "bwd"):
        L = P.launch_shape(131080, 2, 8, direction, "layernorm")
        assert L.threads_per_row & (L.threads_per_row - 1) and L.threads_per_row % 32 == 0
        assert (L.cluster_n - 1) * L.chunk < 131080 <= L.cluster_n * L.chunk
        assert K.compile_only("layernorm", direction, BF16, 131080) > 0


# ---------------------------------------------------------------------------- launch shapes
def _sweep_variants():
    # the launch depends on the op through the forward's staging threshold and the backward's cap
    # on columns per CTA (LayerNorm and the fused add only); shared memory also on what is
    # staged / in the ring: these five are the largest of each launch
    return (("layernorm", "fwd", False), ("add_rmsnorm", "fwd", True),
            ("layernorm", "bwd", False), ("rmsnorm", "bwd", True), ("rmsnorm", "bwd", False))


def _swept_n(dense_up_to: int, step: int) -> list[int]:
    """Every N up to ``dense_up_to``, then every ``step``-th (odd: every residue mod 8 and 16 comes
    round) up to 2^18 + 4096, past the widest sweep row."""
    return list(range(1, dense_up_to + 1)) + list(range(dense_up_to + 1, 2**18 + 4097, step))


def test_every_launch_up_to_the_widest_sweep_row_is_valid():
    """N in 2- and 4-byte elements (bf16 and fp16 share every launch; an fp32 weight changes none:
    it lives in registers) at its natural vector width: every launch shape passes check_launch, and
    no CTA of a cluster is empty. (Every N to 2^18 + 4096 passes too: 4 minutes on 2 cores.) Failing
    before: the LayerNorm backward at bf16 N = 131080, fp32 N = 81924 (halving the cluster doubled
    the shared memory past 227 KB: CUDA_ERROR_INVALID_VALUE at launch)."""
    ns = sorted(set(_swept_n(2**16, 7)) | {81924, 131080, 135176})
    for elem in (2, 4):
        for n in ns:
            vec = math.gcd(n, 16 // elem)
            for op, direction, residual in _sweep_variants():
                L, _ = P.planned_launch.__wrapped__(n, elem, vec, direction, op, False, residual)
                assert not P._leaves_a_cta_empty(n // vec, L.cluster_n, L.threads_per_row, L.vecs_per_thread)


def test_narrow_vector_and_few_row_launches_are_valid():
    """Rows whose stride or pointer forces narrower vectors (1 or 2 elements), and decode batches
    (few_rows: the forward unstaged)."""
    for elem in (2, 4):
        for n in _swept_n(20000, 101):
            for vec in {1, math.gcd(n, 2)}:
                for op, direction, residual in _sweep_variants():
                    P.planned_launch.__wrapped__(n, elem, vec, direction, op, direction == "fwd", residual)


def test_launch_shape_checks_reject_invalid_shapes():
    good = P.launch_shape(4096, 2, 8)
    P.check_launch(good, 4096, 1024)
    bad = [
        (P.Launch(8, 2048, 2048, 1, 1), 16384, 0, "threads per CTA"),
        (P.Launch(8, 48, 96, 1, 1), 384, 0, "threads per row"),
        (P.Launch(8, 512, 512, 32, 1), 131072, 0, "cluster of 32"),
        (P.Launch(8, 64, 128, 2, 1), 1024, 0, "rows per CTA in a cluster"),
        (P.Launch(8, 512, 512, 1, 1), 4097, 0, "vectors of 8"),
        (P.Launch(8, 128, 128, 1, 1), 4096, 0, "not covered"),
        (good, 4096, P.SMEM_LIMIT + 1, "shared memory"),
    ]
    for launch, n, smem, words in bad:
        with pytest.raises(ValueError, match=words):
            P.check_launch(launch, n, smem)


def test_rows_out_of_reach_raise_a_clear_error():
    """Past the widest rows a 16-CTA cluster holds, the launch is refused before compiling."""
    with pytest.raises(ValueError, match=r"layernorm bwd at N = 1048576 .*shared memory per CTA"):
        K.kernel_key("layernorm", "bwd", FP32, 2**20, 4, FP32)
    with pytest.raises(ValueError, match="add_rmsnorm fwd"):
        K.kernel_key("add_rmsnorm", "fwd", FP32, 2**21, 4, FP32)
    # the widest sweep row fits every variant, with or without the residual row
    for op in ("rmsnorm", "layernorm", "add_rmsnorm"):
        for direction in ("fwd", "bwd"):
            K.kernel_key(op, direction, FP32, 262144, 4, FP32, None, op == "add_rmsnorm")


def test_rows_beyond_32_bits_are_refused():
    with pytest.raises(ValueError, match="32-bit"):
        K._check_call(P.MAX_ROWS + 1)


def test_launch_shapes_cover_the_row_once():
    for n in (1, 7, 1000, 1001, 4096, 7168, 16384, 65536, 131080, 262144):
        for elem in (2, 4):
            vec = math.gcd(n, 16 // elem)
            for op, residual in (("rmsnorm", False), ("rmsnorm", True), ("layernorm", False), ("add_rmsnorm", True)):
                for direction in ("fwd", "bwd"):
                    L = P.launch_shape(n, elem, vec, direction, op, residual=residual)
                    assert L.cluster_n * L.chunk >= n  # every column is covered
                    assert (L.cluster_n - 1) * L.chunk < n  # and no CTA of a cluster is empty
                    assert L.cluster_n == 1 or L.rows_per_cta == 1
                    assert L.chunk * elem <= 2 * 32 * 1024 or L.cluster_n == 16
                    assert not L.stage_x or (direction == "fwd" and L.threads_per_row >= 32)
                    few = P.launch_shape(n, elem, vec, direction, op, few_rows=True, residual=residual)
                    assert few == L if L.cluster_n > 1 or not L.stage_x else not few.stage_x


def test_backward_tiles_of_whole_warps():
    """Past a non-power-of-two row the backward's tile is the fewest whole warps, not the next power
    of two, which left threads idle."""
    for op, residual, n, tpr in (("layernorm", False, 2304, 160), ("rmsnorm", True, 2304, 160),
                                 ("rmsnorm", False, 5120, 320), ("rmsnorm", False, 2880, 192)):
        L = P.launch_shape(n, 2, 8, "bwd", op, residual=residual)
        assert (L.threads_per_row, L.threads_per_row * L.vecs_per_thread * 8 >= n) == (tpr, True)
        assert K.compile_only(op, "bwd", BF16, n, residual=residual) > 0


def test_backward_columns_per_cta_capped_for_layernorm_and_the_fused_add():
    """LayerNorm's and the fused add's backward take at most 8192 columns per CTA, in clusters of
    up to 8: in 16-bit types dbias back in registers and a ring of 4 stages (32 KB per CTA gave 2).
    fp32 rows (8192 columns per 32 KB already), plain RMSNorm, and rows that would need a 16-CTA
    cluster keep the 32 KB chunk."""
    def plan(n, op, residual=False, elem=2):
        launch, _ = P.planned_launch(n, elem, 16 // elem, "bwd", op, False, residual)
        return launch.cluster_n, P.backward_ring(launch, elem, op, residual)

    for op, residual in (("layernorm", False), ("rmsnorm", True)):
        for n, cluster in ((8192, 1), (10240, 2), (16384, 2), (32768, 4), (65536, 8), (131072, 8), (262144, 16)):
            cluster_n, ring = plan(n, op, residual)
            assert cluster_n == cluster, (op, n, cluster_n)
            if n <= 65536:
                assert (ring.stages, ring.dbias_in_smem) == (4, False), (op, n, ring)
        assert [plan(n, op, residual, elem=4)[0] for n in (5120, 8192, 16384, 65536)] == [1, 1, 2, 8]
    assert [plan(n, "rmsnorm")[0] for n in (16384, 32768, 65536)] == [1, 2, 4]
    assert plan(16384, "rmsnorm")[1].stages == 3
    assert plan(131072, "layernorm")[1].dbias_in_smem  # 32 KB per CTA there: dbias in shared memory
    assert K.compile_only("layernorm", "bwd", BF16, 16384) > 0
    assert K.compile_only("rmsnorm", "bwd", BF16, 10240, residual=True) > 0


def test_few_rows_compile_an_unstaged_forward():
    """LayerNorm rows of 16 KB are staged in shared memory for many rows, not for a decode batch."""
    assert P.launch_shape(8192, 2, 8, "fwd", "layernorm").stage_x
    assert not P.launch_shape(8192, 2, 8, "fwd", "layernorm", few_rows=True).stage_x
    assert K.compile_only("layernorm", "fwd", BF16, 8192, few_rows=True) > 0


def test_vector_width_respects_strides_and_alignment():
    x = torch.empty(4, 1024, dtype=BF16)
    assert P.vector_width(1000, BF16, x[:, :1000]) == 8
    assert P.vector_width(1000, BF16, x[:, 1:1001]) == 1  # pointer off by one element
    assert P.vector_width(1000, BF16, torch.empty(4, 1004, dtype=BF16)[:, :1000]) == 4
    assert P.vector_width(1003, BF16, x[:, :1003]) == 1


def test_vector_width_aligns_fp32_weights_to_a_whole_vector():
    """An fp32 weight beside bf16 x is read 8 elements (32 bytes) per vector of x."""
    x = torch.empty(4, 1024, dtype=BF16)
    w = torch.empty(1024 + 8, dtype=FP32)
    assert P.vector_width(1024, BF16, x, w[:1024]) == 8
    assert P.vector_width(1024, BF16, x, w[4:1028]) == 4  # 16-byte aligned only
    assert P.vector_width(1024, BF16, x, w[1:1025]) == 1


def test_compile_keys_carry_the_parameter_dtypes():
    same = K.kernel_key("rmsnorm", "fwd", BF16, 4096, 8, BF16)
    mixed = K.kernel_key("rmsnorm", "fwd", BF16, 4096, 8, FP32)
    assert same != mixed and same[-1] == mixed[-1]  # a kernel each, one launch shape
    # the fused backward without dresidual_out is RMSNorm's own kernel
    fused = K.kernel_key("add_rmsnorm", "bwd", BF16, 4096, 8, BF16)
    assert fused == K.kernel_key("rmsnorm", "bwd", BF16, 4096, 8, BF16)


# ---------------------------------------------------------------------------- per-head views
# (T, H, N) views of a fused QKV tensor (row_views): the per-head set's heads at N = 128, and the
# edge set's two views
PERHEAD_H = sorted({s.dims[1] for s in SHAPE_SETS["perhead"]})
EDGE_VIEWS = [s for s in SHAPE_SETS["edge"] if s.layout.startswith("head-slice-")]
NORM_VARIANTS = VARIANTS + [("add_rmsnorm", "fwd"), ("add_rmsnorm", "bwd")]


def test_vector_width_takes_a_views_token_and_head_strides():
    base = torch.empty(4096, dtype=BF16)
    assert P.vector_width(128, BF16, head_view(4, 8, 128, 48)) == 8
    assert P.vector_width(96, BF16, base.as_strided((3, 2, 96), (296, 96, 1))) == 8
    assert P.vector_width(96, BF16, base.as_strided((3, 2, 96), (300, 96, 1))) == 4  # the token stride
    assert P.vector_width(96, BF16, base.as_strided((3, 2, 96), (304, 100, 1))) == 4  # the head stride
    assert P.vector_width(96, BF16, base.as_strided((1, 2, 96), (3, 96, 1))) == 8  # one token: no stride
    assert P.vector_width(1003, BF16, head_view(4, 2, 1003, 5)) == 1


@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_view_rows_reads_every_perhead_shape_in_place(dtype):
    """Every per-head view of the perhead set and the edge set's H = 2 view go in place with the
    usual launch; the edge set's H = 3 view (3 neither divides nor is divided by a tile of 8 to 32
    rows, and gcd(3, R) = 1 row is no warp) is copied."""
    for shape in [s for s in SHAPE_SETS["perhead"] if s.layout != "contiguous"] + EDGE_VIEWS:
        _, h, n = shape.dims
        vec = math.gcd(16 // dtype.itemsize, n)
        for op, direction in NORM_VARIANTS:
            launch = K.kernel_key(op, direction, dtype, n, vec, dtype, None, op == "add_rmsnorm")[-1]
            want = 0 if h == 3 else launch.rows_per_cta
            assert P.view_rows(launch, h) == want, (shape.label, op, direction, launch)


def test_view_rows_takes_fewer_rows_or_copies_where_the_tile_does_not_fit():
    fwd = P.launch_shape(128, 2, 8)  # 32 rows of 4 threads
    assert (fwd.rows_per_cta, fwd.threads_per_row) == (32, 4)
    assert [P.view_rows(fwd, h) for h in (64, 32, 16, 8, 2)] == [32] * 5  # R divides H, or H divides R
    assert P.view_rows(fwd, 24) == P.view_rows(fwd, 40) == 8  # a CTA of gcd(H, 32) = 8 rows, 32 threads
    assert P.view_rows(fwd, 28) == P.view_rows(fwd, 12) == P.view_rows(fwd, 3) == 0  # 4 rows: 16 threads
    bwd = P.launch_shape(128, 2, 8, "bwd")  # 16 rows of 8 threads
    assert (bwd.rows_per_cta, bwd.threads_per_row) == (16, 8)
    assert P.view_rows(bwd, 28) == 4 and P.view_rows(bwd, 3) == 0
    wide = P.launch_shape(4096, 2, 8)  # a row a CTA: any view
    assert wide.rows_per_cta == 1 and P.view_rows(wide, 3) == 1
    capped = P.launch_shape(128, 2, 8, rows=8)
    assert (capped.rows_per_cta, capped.num_threads) == (8, 32)
    P.check_launch(capped, 128, P.shared_memory_bytes(capped, 2, "rmsnorm", "fwd"))


def _forward_key(op, dtype, n, residual):
    def key_of(rows, heads, views, cap):
        vec = P.vector_width(n, dtype, *(t for t in rows if t is not None))
        return K.kernel_key(op, "fwd", dtype, n, vec, dtype, None, residual, False, heads, views, cap)

    return key_of


def test_host_side_passes_views_in_place_and_copies_the_rest():
    """What the host side hands the kernels (no GPU: the decision only): views whose tiles fit go
    as they are, with their heads in the compile key; a view whose heads no tile fits is copied to
    (M, N) rows; a 3-D tensor with an (M, N) view (contiguous, like dy) goes as that view."""
    n = 128
    key_of = _forward_key("add_rmsnorm", BF16, n, True)
    x, res = head_view(5, 8, n, 48), head_view(5, 8, n, 48)
    key, (x2, r2) = K._planned(key_of, (x, res), n)
    assert x2 is x and r2 is res and key[8:10] == (8, (True, True)) and key[-1].rows_per_cta == 32
    # residual contiguous: (M, N) rows of the same memory beside the view
    dense = torch.zeros(5, 8, n, dtype=BF16)
    key, (x2, r2) = K._planned(key_of, (x, dense), n)
    assert x2 is x and r2.shape == (40, n) and r2.data_ptr() == dense.data_ptr() and key[8:10] == (8, (True, False))
    # 24 heads: a tile of 32 rows would cross tokens unevenly; 8 rows a CTA instead
    key, (x2, _) = K._planned(key_of, (head_view(3, 24, n, 40), None), n)
    assert x2.dim() == 3 and key[-1].rows_per_cta == 8 and key[-1].num_threads == 32
    # 3 heads of 96: copied, and the key is that of (M, N) rows
    key_of = _forward_key("rmsnorm", BF16, 96, False)
    x = head_view(5, 3, 96, 7)
    key, (x2, r2) = K._planned(key_of, (x, None), 96)
    assert r2 is None and x2.shape == (15, 96) and x2.is_contiguous() and x2.data_ptr() != x.data_ptr()
    assert key[8:10] == (0, ()) and key == key_of((x2, None), 0, (), 0)
    # (M, N) rows, and a view of one token: no views at all, the usual key
    rows = torch.zeros(6, 96, dtype=BF16)
    assert K._planned(key_of, (rows, None), 96) == (key_of((rows, None), 0, (), 0), (rows, None))
    key, (x2, _) = K._planned(key_of, (head_view(1, 3, 96, 7), None), 96)
    assert x2.shape == (3, 96) and key[8:10] == (0, ())


def _walk_view(launch, dtype, heads: int, n: int, views: list[tuple[int, int, int]]) -> list[tuple]:
    """Where the kernels' threads read a (T, H, N) view: for each (T, token stride, head stride) in
    ``views``, the offset each (row, column) is read at, by the first and last element of every
    vector, through the kernels' own as_rows, tiled copy, tiles and coordinate tensor, with T and
    the strides runtime values, as on the GPU. Compiled for the CPU (a host function, no kernel)
    and run there. Every tile is taken both ways the kernels take it: the forward by its index,
    the backward from the tiles' mode; (M, N) int64 each, -1 where nothing was read."""
    R, vec, vpt = launch.rows_per_cta, launch.vec, launch.vecs_per_thread
    tiler = (R, launch.chunk)
    ends = sorted({0, vec - 1})

    @cute.jit
    def walk(by_index: cute.Tensor, by_mode: cute.Tensor, T: cutlass.Int32, sT: cutlass.Int64, sH: cutlass.Int64):
        base = cute.make_identity_tensor(2**31 - 1)  # a tensor whose every element is its offset
        view = K.as_rows(cute.make_tensor(base.iterator, cute.make_layout((T, heads, n), stride=(sT, sH, 1))))
        M = cute.size(view, mode=[0])
        tiled = K._tiled_copy(K._TORCH2CUTE[dtype], launch)
        for tidx in cutlass.range(launch.num_threads):
            thr = tiled.get_slice(tidx)
            tiles = thr.partition_S(cute.local_tile(view, tiler, (None, 0)))
            coords = thr.partition_S(cute.local_tile(cute.make_identity_tensor((M, n)), tiler, (None, 0)))
            for tile in cutlass.range(cute.ceil_div(M, R)):
                one = thr.partition_S(cute.local_tile(view, tiler, (tile, 0)))
                for k in cutlass.range_constexpr(vpt):
                    for e in cutlass.range_constexpr(len(ends)):
                        row, col = coords[(ends[e], 0), 0, k, tile]
                        if row < M and col < n:
                            by_index[row, col] = one[(ends[e], 0), 0, k]
                            by_mode[row, col] = tiles[(ends[e], 0), 0, k, tile]

    out = []
    for tokens, s_t, s_h in views:
        by_index, by_mode = (torch.full((tokens * heads, n), -1, dtype=torch.int64) for _ in range(2))
        walk(from_dlpack(by_index), from_dlpack(by_mode), cutlass.Int32(tokens), cutlass.Int64(s_t), cutlass.Int64(s_h))
        out.append((by_index, by_mode))
    return out


# (dtype, direction, N, H): H a multiple of the tile's rows (several tiles a token in the backward),
# the tile a multiple of H (whole tokens, and a last tile past T), 24 and 40 heads (8 rows a CTA),
# one row a CTA (N = 1003: one-element vectors)
WALKS = [(BF16, "fwd", 128, 64), (FP32, "bwd", 128, 32), (BF16, "fwd", 128, 8), (FP32, "fwd", 128, 8),
         (BF16, "fwd", 128, 24), (BF16, "bwd", 128, 40), (BF16, "fwd", 1003, 2)]  # fmt: skip


@pytest.mark.parametrize("dtype,direction,n,heads", WALKS, ids=str)
def test_views_tiles_address_the_contracts_rows(dtype, direction, n, heads):
    """Row r = t * H + h of a per-head view, column c, is read at t * stride(0) + h * stride(1) + c,
    by the thread whose coordinate says (r, c), in the launch the host side picks: every row and
    vector once, for several T (a last tile past T among them) and strides (heads of a wider
    tensor, and heads laid out before tokens)."""
    vec = math.gcd(16 // dtype.itemsize, n)
    launch = P.launch_shape(n, dtype.itemsize, vec, direction)
    launch = P.launch_shape(n, dtype.itemsize, vec, direction, rows=P.view_rows(launch, heads))
    views = [(t, (heads + 3) * n, n) for t in (1, 3, 5, 8)] + [(3, n, 7 * n)]
    ends = torch.zeros(n, dtype=torch.bool)
    ends[::vec] = ends[vec - 1 :: vec] = True
    for (tokens, s_t, s_h), walked in zip(views, _walk_view(launch, dtype, heads, n, views)):
        r, c = torch.arange(tokens * heads)[:, None], torch.arange(n)[None, :]
        want = torch.where(ends, (r // heads) * s_t + (r % heads) * s_h + c, -1)
        for got in walked:
            assert torch.equal(got, want), (tokens, s_t, s_h)


@pytest.mark.parametrize("heads", PERHEAD_H)
@pytest.mark.parametrize("dtype", [BF16, FP32])
@pytest.mark.parametrize("op,direction", NORM_VARIANTS)
def test_perhead_views_compile(op, direction, dtype, heads):
    """The perhead set's views at N = 128: x (and the residual) in the forward, x in the backward
    (dy comes contiguous)."""
    assert K.compile_only(op, direction, dtype, 128, heads=heads) > 0


@pytest.mark.parametrize("dtype", [BF16, FP32])
@pytest.mark.parametrize("op,direction", NORM_VARIANTS)
def test_edge_views_compile(op, direction, dtype):
    """The edge set's view that is read in place: 2 heads of 1003 (one-element vectors, a row a
    CTA); and 24 heads, which take a CTA of fewer rows."""
    assert K.compile_only(op, direction, dtype, 1003, vec=1, heads=2) > 0
    vec = 16 // dtype.itemsize
    rows = P.view_rows(P.launch_shape(128, dtype.itemsize, vec, direction), 24)
    assert 0 < rows < 16 and K.compile_only(op, direction, dtype, 128, heads=24, rows=rows) > 0


@pytest.mark.parametrize("views", [(True, False, True), (False, True, True), (True, True, True)])
def test_backward_views_in_any_row_tensor_compile(views):
    """dy, x (residual_out) and dresidual_out each a view or (M, N) rows on its own."""
    assert K.compile_only("add_rmsnorm", "bwd", BF16, 128, residual=True, heads=32, views=views) > 0
    assert K.compile_only("layernorm", "bwd", FP32, 128, heads=8, views=(*views[:2], False)) > 0


def test_wide_views_compile():
    """Views of rows wide enough to be staged or to take a cluster (a row a CTA)."""
    for op, direction, dtype, n in (("add_rmsnorm", "fwd", BF16, 16384), ("layernorm", "fwd", BF16, 65536),
                                    ("rmsnorm", "bwd", BF16, 65536), ("layernorm", "bwd", FP32, 20000)):  # fmt: skip
        assert K.compile_only(op, direction, dtype, n, heads=4) > 0
    assert F8.compile_only("add_rmsnorm_fp8", BF16, 16384, GROUP_BLOCK, heads=4) > 0


@pytest.mark.parametrize("heads", PERHEAD_H)
@pytest.mark.parametrize("dtype", [BF16, FP32])
@pytest.mark.parametrize("op", ["rmsnorm_fp8", "add_rmsnorm_fp8"])
def test_fp8_views_compile(op, dtype, heads):
    """The FP8 ops read the views in place too: per token at N = 128 (a 1 x 128 block is the row),
    per block at N = 256, and the edge set's 2 heads of 1003 (per token)."""
    assert F8.compile_only(op, dtype, 128, 128, heads=heads) > 0
    assert F8.compile_only(op, dtype, 256, GROUP_BLOCK, heads=heads) > 0
    if heads == PERHEAD_H[0]:
        assert F8.compile_only(op, dtype, 1003, 1003, vec=1, heads=2) > 0


def test_view_keys_carry_the_heads():
    rows = K.kernel_key("rmsnorm", "fwd", BF16, 128, 8, BF16)
    view = K.kernel_key("rmsnorm", "fwd", BF16, 128, 8, BF16, None, False, False, 8, (True, False))
    assert rows != view and rows[-1] == view[-1] and view[8:10] == (8, (True, False))
    assert K.kernel_key("rmsnorm", "fwd", BF16, 128, 8, BF16, None, False, False, 0, (True, False)) == rows


# views that take each way in: R divides H, H divides R (a last tile past T, and whole tiles),
# fewer rows a CTA (24 heads; 28 heads in the backward, copied in the 16-bit forward), several rows
# a CTA at N = 1000, a copy (3 heads), and per-block FP8 scales (N = 256)
GPU_VIEWS = [Shape((3, 64, 128), "head-slice-80"), Shape((5, 8, 128), "head-slice-12"),
             Shape((8, 8, 128), "head-slice-10"), Shape((3, 24, 128), "head-slice-40"),
             Shape((3, 28, 128), "head-slice-36"), Shape((3, 4, 1000), "head-slice-6"),
             Shape((6, 3, 96), "head-slice-7"), Shape((4, 4, 256), "head-slice-6")]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_views_against_the_reference(dtype):
    """Every op over per-head views, through the harness (which hands the views over as they are):
    forward and backward against fp64, the FP8 ops against the exact checker."""
    assert_views_pass("cute", GPU_VIEWS, dtype)


# ---------------------------------------------------------------------------- on the GPU
def _cases(dtypes=(BF16, FP16, FP32)):
    shapes = [s for name in ("smoke", "edge") for s in SHAPE_SETS[name] if s.m > 0]
    return [(s, dt) for s in shapes for dt in dtypes]


def _kernels():
    from harness.registry import get

    return get("cute").kernels("cuda")


def _assert_all(reports):
    bad = [f"{r.name}: {r.reason}" for r in reports if not r.passed]
    assert not bad, "; ".join(bad)


@pytest.mark.gpu
@pytest.mark.parametrize("wdtype", ["x", FP32])
@pytest.mark.parametrize("shape,dtype", _cases(), ids=str)
def test_add_rmsnorm_against_reference(shape, dtype, wdtype):
    k = _kernels()
    a, b = make_case("rmsnorm", shape, dtype, "cuda", seed=1), make_case("rmsnorm", shape, dtype, "cuda", seed=2)
    x, res, dy, dres = a["x"], b["x"], a["dy"], b["dy"]
    w = a["weight"] if wdtype == "x" else a["weight"].float()
    eps = a["eps"]
    y_ref, h_ref, rstd_ref = reference.add_rmsnorm_fwd(x, res, w, eps)
    with poisoned_allocations():
        y, h, rstd = k.add_rmsnorm_fwd(x, res, w, eps)
    _assert_all([compare("y", y, y_ref, dtype, x.shape), compare("residual_out", h, h_ref, dtype, x.shape),
                 compare("rstd", rstd, rstd_ref, FP32, x.shape[:-1])])  # fmt: skip
    # y must be rmsnorm(residual_out) as stored: the same kernel on h gives the same bits
    assert torch.equal(y, k.rmsnorm_fwd(h, w, eps)[0])
    n = x.shape[-1]
    r64 = rstd_ref.reshape(-1, 1)
    for d in (dres, None):
        dh_ref, dw_ref = reference.add_rmsnorm_bwd(dy, d, h, w, rstd_ref)
        with poisoned_allocations():
            dh, dw = k.add_rmsnorm_bwd(dy, d, h, w, rstd_ref.float())
        dy64 = dy.double().reshape(-1, n)
        dh_terms = (dy64 * w.double() * r64).abs() + (d.double().reshape(-1, n).abs() if d is not None else 0)
        dw_terms = (dy64 * h.double().reshape(-1, n) * r64).square().sum(0).sqrt()
        _assert_all([compare("dh", dh, dh_ref, dtype, x.shape, dh_terms.reshape(x.shape)),
                     compare("dweight", dw, dw_ref, w.dtype, (n,), dw_terms)])  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["rmsnorm", "layernorm"])
@pytest.mark.parametrize("shape,dtype", _cases((BF16, FP16)), ids=str)
def test_fp32_weights_against_reference(op, shape, dtype):
    k = _kernels()
    c = make_case(op, shape, dtype, "cuda", seed=3)
    x, dy, eps = c["x"], c["dy"], c["eps"]
    w = c["weight"].float()
    b = c["bias"].float() if c["bias"] is not None else None
    n = x.shape[-1]
    if op == "layernorm":
        y_ref, mean, rstd = reference.layernorm_fwd(x, w, b, eps)
        with poisoned_allocations():
            y, *_ = k.layernorm_fwd(x, w, b, eps)
            dx, dw, db = k.layernorm_bwd(dy, x, w, mean.float(), rstd.float())
        dx_ref, dw_ref, db_ref = reference.layernorm_bwd(dy, x, w, mean, rstd)
    else:
        y_ref, rstd = reference.rmsnorm_fwd(x, w, eps)
        with poisoned_allocations():
            y, _ = k.rmsnorm_fwd(x, w, eps)
            dx, dw = k.rmsnorm_bwd(dy, x, w, rstd.float())
        dx_ref, dw_ref = reference.rmsnorm_bwd(dy, x, w, rstd)
        db, db_ref = None, None
    dy64, r64 = dy.double().reshape(-1, n), rstd.reshape(-1, 1)
    xhat_terms = dy64 * (x.double().reshape(-1, n) - (mean.reshape(-1, 1) if op == "layernorm" else 0)) * r64
    reports = [compare("y", y, y_ref, dtype, x.shape),
               compare("dx", dx, dx_ref, dtype, x.shape, (dy64 * w.double() * r64).abs().reshape(x.shape)),
               compare("dweight", dw, dw_ref, FP32, (n,), xhat_terms.square().sum(0).sqrt())]  # fmt: skip
    if op == "layernorm":
        reports.append(compare("dbias", db, db_ref, FP32, (n,), dy64.square().sum(0).sqrt()))
    _assert_all(reports)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [64, 4096, 16384, 65536])
@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_overflowing_statistics_give_nan(dtype, n):
    """Rows near 1e30: x^2 overflows fp32. torch's LayerNorm returns NaN there; rsqrt(inf) = 0
    would give a finite y = b (LayerNorm) or 0 (RMSNorm, what torch returns: a finite wrong number).
    Every such row must come out non-finite, in y and in dx, and ordinary rows stay finite."""
    k = _kernels()
    g = torch.Generator(device="cuda").manual_seed(4)
    x = torch.randn(4, n, device="cuda", generator=g).to(dtype)
    x[1] = x[1].float().mul(1e30).to(dtype)
    x[3, 0] = 3e30
    w = torch.randn(n, device="cuda", generator=g).to(dtype)
    b = torch.randn(n, device="cuda", generator=g).to(dtype)
    dy = torch.randn(4, n, device="cuda", generator=g).to(dtype)
    big = torch.tensor([False, True, False, True], device="cuda")
    torch_ln = torch.nn.functional.layer_norm(x.float(), (n,), w.float(), b.float())
    y, mean, rstd = k.layernorm_fwd(x, w, b, 1e-5)
    assert not torch.isfinite(y[~torch.isfinite(torch_ln)]).any()  # non-finite wherever torch's is
    dx, _, _ = k.layernorm_bwd(dy, x, w, mean, rstd)
    y2, rstd2 = k.rmsnorm_fwd(x, w, 1e-5)
    dx2, _ = k.rmsnorm_bwd(dy, x, w, rstd2)
    y3, _, _ = k.add_rmsnorm_fwd(x, torch.zeros_like(x), w, 1e-5)
    for t in (y, dx, y2, dx2, y3):
        assert not torch.isfinite(t[big]).any()
        assert torch.isfinite(t[~big]).all()


@pytest.mark.gpu
def test_new_m_does_not_recompile():
    # a width no other test compiles for, so the backward's compile is this test's own
    x = torch.randn(300, 2872, device="cuda", dtype=BF16)
    w = torch.randn(2872, device="cuda", dtype=BF16)
    K.rmsnorm_fwd(x, w, 1e-5)
    keys = set(K.COMPILE_SECONDS)
    for m in (1, 17, 299):
        _, rstd = K.rmsnorm_fwd(x[:m], w, 1e-5)
        K.rmsnorm_bwd(x[:m], x[:m], w, rstd)
    K.rmsnorm_bwd(x, x, w, K.rmsnorm_fwd(x, w, 1e-5)[1])
    new = set(K.COMPILE_SECONDS) - keys
    # the backward, compiled once; its dweight sum (SlotSum) once per CTA shape: few slots, many
    assert len([k for k in new if k[0] != "slot_sum"]) == 1
    assert 1 <= len([k for k in new if k[0] == "slot_sum"]) <= 4


@pytest.mark.gpu
@pytest.mark.parametrize("n", [128, 4096, 65536])  # 128: 16 rows per CTA, folded in shared memory
def test_backward_is_deterministic(n):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1000, n, device="cuda", dtype=BF16, generator=g)
    dy = torch.randn(1000, n, device="cuda", dtype=BF16, generator=g)
    w = torch.randn(n, device="cuda", dtype=BF16, generator=g)
    b = torch.randn(n, device="cuda", dtype=BF16, generator=g)
    _, mean, rstd = K.layernorm_fwd(x, w, b, 1e-5)
    first = K.layernorm_bwd(dy, x, w, mean, rstd)
    for _ in range(3):
        again = K.layernorm_bwd(dy, x, w, mean, rstd)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


# ---------------------------------------------------------------------------- spills (sm_90a)
_SPILL_PROBE = """
import os, sys, torch
from impls.cute import kernels as K
BF16, FP32 = torch.bfloat16, torch.float32
for op, n, wdtype in (("add_rmsnorm", 16384, BF16), ("add_rmsnorm", 32768, BF16), ("add_rmsnorm", 16384, FP32),
                      ("rmsnorm", 16384, FP32), ("rmsnorm", 32768, FP32)):
    K.compile_only(op, "fwd", BF16, n, wdtype=wdtype, residual=op == "add_rmsnorm")
"""


def test_staged_forwards_do_not_spill(tmp_path):
    """The staged fused add (x and the residual, 2 x 8 vectors per thread) and a staged row beside an
    fp32 weight spilled 150-344 B per thread at 80 / 64 registers (39-56% of copy bandwidth for the
    fused add from N = 16384); they are built for sm_90a here and cuobjdump must report no stack."""
    import subprocess
    import sys

    import triton

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(cuobjdump):
        pytest.skip("triton ships no cuobjdump here")
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="cubin", CUTE_DSL_DUMP_DIR=str(tmp_path))
    subprocess.run([sys.executable, "-c", _SPILL_PROBE], check=True, env=env, cwd=os.path.dirname(os.path.dirname(__file__)))
    cubins = sorted(tmp_path.glob("*.cubin"))
    assert len(cubins) == 5, [c.name for c in cubins]
    for cubin in cubins:
        usage = subprocess.run([cuobjdump, "-res-usage", str(cubin)], check=True, capture_output=True, text=True).stdout
        stacks = [int(s) for s in re.findall(r"STACK:(\d+)", usage)]
        assert stacks and max(stacks) == 0, f"{cubin.name}: {usage}"


@pytest.mark.parametrize("n,pdtype,with_bias,threads", [(16384, BF16, True, 64), (1000, FP32, False, 8), (4001, FP16, True, 64)])
def test_slot_sum_compiles(n, pdtype, with_bias, threads):
    """The backward's dweight / dbias reduction (SlotSum), for 16-bit and fp32 parameters, a width
    with no 4-wide fp32 vector, and both CTA shapes (slot_threads)."""
    K.compile_slot_sum(n, pdtype, with_bias, threads)
    assert K.COMPILE_SECONDS[("slot_sum", n, pdtype, with_bias, threads)] > 0


def test_backward_ring_rounds_ctas_up_only_without_spilling_or_losing_a_stage():
    """3 CTAs of 192 threads (LayerNorm at N = 2880), 2 of 320; not 2 of 384 (768 threads: 85
    registers), and not the fused add's ring, which would lose a stage; its 4-CTA rings take 3."""
    def ring(n, op="layernorm", residual=False):
        launch, _ = P.planned_launch(n, 2, 8, "bwd", op, False, residual)
        return launch.num_threads, P.backward_ring(launch, 2, op, residual)

    assert [(t, r.ctas_per_sm, r.stages) for t, r in (ring(2880), ring(5120), ring(6144))] == [(192, 3, 4), (320, 2, 4), (384, 1, 4)]
    threads, add = ring(2880, "rmsnorm", residual=True)
    assert (threads, add.ctas_per_sm, add.stages) == (192, 2, 4)
    threads, add = ring(1024, "rmsnorm", residual=True)
    assert (threads, add.ctas_per_sm, add.stages) == (128, 4, 3)
    assert ring(1024)[1].stages == 4


# ---------------------------------------------------------------------------- FP8 output
# (op, x's dtype, N, grouping, weight dtype). Register rows: per row (a thread's 4 vectors converted
# at once) and per block over a run of 2 vectors (N = 256: 16 rows a CTA, 8 lanes a block); staged
# rows with an fp32 weight from L2 a vector at a time; a staged cluster per row (the second
# exchange, its own mbarrier); 4-byte vectors (fp32 x: 32 lanes a block); one-element vectors
# (N = 1001) without a weight. 1-3 s of compile each on 2 cores.
FP8_COMPILES = [
    ("rmsnorm_fp8", BF16, 4096, "token", BF16),
    ("add_rmsnorm_fp8", FP16, 256, "g128", FP32),
    ("add_rmsnorm_fp8", BF16, 16384, "g128", FP32),
    ("rmsnorm_fp8", FP16, 65536, "token", FP32),
    ("rmsnorm_fp8", FP32, 4096, "g128", FP32),
    ("rmsnorm_fp8", BF16, 1001, "token", None),
]


def _fp8_key(op, dtype, n, grouping, wdtype):
    return F8._key_of(op, dtype, n, n if grouping == "token" else GROUP_BLOCK, None, wdtype, False)


def _store_bytes(ptx: str) -> list[int]:
    """Bytes of each global store in the kernel's PTX (st.global.v4.b16: 8)."""
    return [int(v or 1) * int(b) // 8 for v, b in re.findall(r"st\.global(?:\.v(\d))?\.b(\d+)", ptx)]


def _fp8_id(v) -> str:
    return str(v).removeprefix("torch.")


@pytest.mark.parametrize("op,dtype,n,grouping,wdtype", FP8_COMPILES, ids=_fp8_id)
def test_fp8_compiles_to_the_hardware_conversion_and_vector_stores(op, dtype, n, grouping, wdtype):
    """Built for sm_90a: y converted by cvt.rn.satfinite.e4m3x2.f32 (nearest even, saturating), one
    instruction per pair of a thread's elements; a clamp to +-448 before it; the scale an IEEE
    division and reciprocal; q stored one vector of vec bytes per store (never a byte at a time
    where the vector is wider)."""
    ptx = F8.compiled_ptx(op, dtype, n, n if grouping == "token" else GROUP_BLOCK, wdtype=wdtype)
    L = _fp8_key(op, dtype, n, grouping, wdtype)[-1]
    body = ptx[ptx.index(".entry"):]
    assert ".target sm_90a" in ptx
    assert len(re.findall(r"cvt\.rn\.satfinite\.e4m3x2\.f32", body)) == -(-L.vec * L.vecs_per_thread // 2)
    assert "0f43E00000" in body and "0fC3E00000" in body  # the clamp's +-448
    assert "div.rn.f32" in body and "rcp.rn.f32" in body and not re.search(r"div\.(approx|full)\.f32", body)
    stores = _store_bytes(body)
    if L.vec > 1:
        assert min(stores) >= min(L.vec, 4), stores
        assert stores.count(L.vec) >= L.vecs_per_thread, stores


@pytest.mark.parametrize("case", [FP8_COMPILES[1], FP8_COMPILES[3]], ids=["narrow-g128", "cluster-token"])
def test_fp8_shared_memory_model_matches_the_compiler(case):
    """Its reduction buffer has a slot, and in a cluster an mbarrier, per exchange."""
    key = _fp8_key(*case)
    F8.compile_kernel(key)
    op, dtype, n, _, _, per_row, _, _, launch = key
    smem = F8.shared_memory_bytes(launch, dtype.itemsize, op == "add_rmsnorm_fp8", per_row)
    assert _compiled_smem(key, F8._COMPILED) == smem <= P.SMEM_LIMIT


def test_fp8_blocks_are_lane_groups_of_one_warp():
    """Every 1 x 128 block of a row is exactly one (lane group, run of vectors) of block_lanes in
    one warp, and the group's first lane at the run's first vector is at the block's first column
    (the lane that stores its scale), at every N of the shape sets that 128 divides, 16- and
    32-bit x, vectors of 4 or more, many rows and few; narrower vectors are refused (copied
    first). Every launch also passes check_launch with this kernel's shared memory."""
    ns = sorted({s.n for shapes in SHAPE_SETS.values() for s in shapes if s.n > 0 and s.n % GROUP_BLOCK == 0}
                | {128, 384, 640, 16512, 32896})  # fmt: skip
    for n in ns:
        for dtype in (BF16, FP32):
            for vec in sorted({16 // dtype.itemsize, 4}):
                for op in ("rmsnorm_fp8", "add_rmsnorm_fp8"):
                    for few in (False, True):
                        L = F8.kernel_key(op, dtype, n, vec, dtype, False, few)[-1]
                        assert F8.blocks_fit(L), (n, dtype, vec, L)
                        lanes, run = F8.block_lanes(L)
                        tpr, S = L.threads_per_row, L.vec * L.threads_per_row
                        owner = {}
                        for rank in range(L.cluster_n):
                            for t in range(tpr):
                                for k in range(L.vecs_per_thread):
                                    col = rank * L.chunk + k * S + t * L.vec
                                    if col >= n:
                                        continue
                                    group = (rank, t // lanes, k // run)
                                    assert owner.setdefault(col // GROUP_BLOCK, group) == group, (n, L, col)
                                    if t % lanes == 0 and k % run == 0:
                                        assert col % GROUP_BLOCK == 0, (n, L, col)
                        assert sorted(owner) == list(range(n // GROUP_BLOCK)), (n, L)
                        assert lanes <= 32 and 32 % lanes == 0 and tpr % lanes == 0, (n, L)
                        assert len(set(owner.values())) == n // GROUP_BLOCK, (n, L)
    for vec in (1, 2):
        assert not F8.blocks_fit(F8.kernel_key("rmsnorm_fp8", BF16, 4096, vec, BF16, False)[-1])


def test_fp8_record():
    from harness.registry import get
    from harness.spec.ops import FP8_OPS

    impl = get("cute")
    assert set(FP8_OPS) <= set(impl.ops) and impl.extra_entries == ("impls.cute.fp8",)
    assert "impls/cute/fp8.py" in impl.sources


# (shape, what it reaches): many rows a CTA and a run of vectors per block; a column slice; a row
# of one-element vectors (per token only); staged rows, many and few (few: the register path);
# a cluster of register rows; staged clusters, the widest 16 CTAs
FP8_SHAPES = [Shape((64, 256)), Shape((37, 1024), "column-slice"), Shape((37, 1001)), Shape((300, 16384)),
              Shape((5, 16384)), Shape((3, 16512)), Shape((300, 65536)), Shape((2, 262144))]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize(
    "dtype,weights", [("bf16", "same"), ("bf16", "fp32"), ("bf16", "offset"), ("fp16", "fp32"), ("fp32", "same")]
)
def test_fp8_against_the_exact_checker(dtype, weights):
    """q, the scales, residual_out and rstd of both FP8 ops, per token and per 1 x 128 block, as the
    exact checker holds them, in every row regime."""
    from harness.registry import get
    from harness.spec.ops import FP8_OPS, get_op

    failures = []
    for op in FP8_OPS:
        for shape in FP8_SHAPES:
            if get_op(op).unsupported(shape.n):
                continue
            for affine in (True, False) if weights == "same" else (True,):
                r = run_check(get("cute"), op, "fwd", shape, dtype, "cuda", weights=weights, affine=affine)
                if not r.passed:
                    failures.append(f"{op} {shape.label} affine={affine}: {r.status} {r.summary()}")
    assert not failures, "\n".join(failures)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [256, 4096, 16384, 65536])
def test_fp8_add_is_the_norm_of_residual_out_and_misaligned_rows_match(n):
    """add_rmsnorm_fp8's q, scales and rstd are rmsnorm_fp8's on residual_out, to the bit; rows
    whose vectors are too narrow for lane-group blocks (a view 2 elements off) pass the exact
    checker, and where the 1 x 128 blocks do not fit a warp at those vectors (every N here but 256,
    whose rows span few enough lanes) they are copied and give what the contiguous rows give."""
    k = _kernels()
    g = torch.Generator(device="cuda").manual_seed(6)
    x = torch.randn(300, n, device="cuda", generator=g).to(BF16)
    res = torch.randn(300, n, device="cuda", generator=g).to(BF16)
    w = torch.randn(n, device="cuda", generator=g)
    for group in (n, GROUP_BLOCK):
        q, scale, h, rstd = k.add_rmsnorm_fp8_fwd(x, res, w, 1e-5, group)
        assert torch.equal(h, (x.float() + res.float()).to(BF16))
        q2, scale2, rstd2 = k.rmsnorm_fp8_fwd(h, w, 1e-5, group)
        assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8))
        assert torch.equal(scale, scale2) and torch.equal(rstd, rstd2)
    for op in ("rmsnorm_fp8_token", "rmsnorm_fp8_g128"):
        case = make_case(op, Shape((300, n)), BF16, "cuda", seed=7)
        wide = torch.zeros(300, n + 2, device="cuda", dtype=BF16)
        wide[:, 2:] = case["x"]
        case["x"] = wide[:, 2:]  # a 4-byte pointer: 2-element vectors
        _assert_all(_check_tensors(k, op, "fwd", case))
        vec = P.vector_width(n, BF16, case["x"], case["weight"])
        key = F8.kernel_key("rmsnorm_fp8", BF16, n, vec, case["weight"].dtype, False, False)
        assert F8.blocks_fit(key[-1]) == (n == 256), (n, vec)
        if op.endswith("g128") and n != 256:  # copied: the contiguous rows' kernel, the same bits
            shifted = k.rmsnorm_fp8_fwd(case["x"], case["weight"], case["eps"], GROUP_BLOCK)
            plain = k.rmsnorm_fp8_fwd(case["x"].contiguous(), case["weight"], case["eps"], GROUP_BLOCK)
            assert all(torch.equal(a.float(), b.float()) for a, b in zip(shifted, plain))


@pytest.mark.gpu
@pytest.mark.parametrize("n", [256, 16384, 65536])  # register rows, a staged row, a staged cluster
@pytest.mark.parametrize("grouping", ["token", "g128"])
def test_fp8_overflowing_statistics_give_nan(grouping, n):
    """A bf16 row near 1e30 (x^2 overflows fp32): rstd NaN, and q and that row's scales NaN, never
    the floor's scale or a saturated 448; the rows beside stay finite."""
    k = _kernels()
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(3, n, generator=g, device="cuda")
    x[1] *= 1e30
    x = x.to(BF16)
    w = torch.ones(n, device="cuda", dtype=BF16)
    q, scale, rstd = k.rmsnorm_fp8_fwd(x, w, 1e-5, n if grouping == "token" else GROUP_BLOCK)
    q = q.float()
    assert torch.isnan(rstd[1]) and torch.isnan(q[1]).all() and torch.isnan(scale[1]).all()
    assert torch.isfinite(q[[0, 2]]).all() and torch.isfinite(scale[[0, 2]]).all()


@pytest.mark.gpu
def test_fp8_new_m_does_not_recompile():
    n = 2944  # a width no other test compiles for
    x = torch.randn(400, n, device="cuda", dtype=BF16)
    w = torch.randn(n, device="cuda", dtype=BF16)
    k = _kernels()
    for group in (n, GROUP_BLOCK):
        before = set(F8.COMPILE_SECONDS)
        for m in (1, 17, 131, 400):
            k.rmsnorm_fp8_fwd(x[:m], w, 1e-5, group)
        # one kernel, and at most a second for few rows (no more rows than SMs)
        assert 1 <= len(set(F8.COMPILE_SECONDS) - before) <= 2


# ---------------------------------------------------------------------------- rows of an odd width
ODD_N = [1999, 4001, 6007]


@pytest.mark.parametrize("op,residual", [("rmsnorm", False), ("layernorm", False), ("rmsnorm", True)])
def test_realigned_launch_is_one_row_per_cta_covering_the_span(op, residual):
    for n in range(1001, 8200, 37):
        L = P.realigned_launch(n, 2, op, residual)
        if n % 8 == 0 or L is None:
            continue
        span = P.realigned_span(n, 8)
        assert span % 8 == 0 and n + 7 <= span < n + 15
        assert L.vec == 8 and L.cluster_n == 1 and L.rows_per_cta == 1 and L.chunk >= span
        assert L.min_registers == P.REALIGNED_MIN_REGISTERS
        ring = P.backward_ring(L, 2, op, residual)
        assert ring.ctas_per_sm * L.num_threads * L.min_registers <= 65536 or ring.ctas_per_sm == 1
        assert P.shared_memory_bytes(L, 2, op, "bwd", residual) <= P.SMEM_LIMIT
    # 16-bit rows only, of an odd width, one row per CTA
    assert P.realigned_launch(4001, 4, op, residual) is None
    assert P.realigned_launch(4096, 2, op, residual) is None
    assert P.realigned_launch(1001, 2, op, residual) is None  # two rows per CTA, at other offsets
    assert P.realigned_launch(40001, 2, op, residual) is None  # a cluster


def test_realigned_rows_are_taken_only_where_every_tensor_qualifies():
    m, n = 37, 4001
    dy, x, dres, dx = (torch.randn(m, n, dtype=BF16) for _ in range(4))
    flat = K._realigned((dy, x, None, dx), n, "rmsnorm")
    assert len(flat) == 4 and flat[2] is None
    assert all(t.dim() == 1 and t.data_ptr() == s.data_ptr() for t, s in zip(flat[::3], (dy, dx)))  # views, no copy
    assert len(K._realigned((dy, x, dres, dx), n, "rmsnorm")) == 4
    wide = torch.randn(m, n + 1, dtype=BF16)
    assert K._realigned((dy, wide[:, :n], None, dx), n, "rmsnorm") == ()  # a row stride of n + 1
    shifted = torch.randn(m * n + 1, dtype=BF16)[1:].view(m, n)
    assert K._realigned((dy, shifted, None, dx), n, "rmsnorm") == ()  # a start off the 16-byte grid
    assert K._realigned(tuple(t.float() for t in (dy, x)) + (None, dx.float()), n, "layernorm") == ()
    assert K._realigned((dy[:, :4000].contiguous(), x[:, :4000].contiguous(), None, dx[:, :4000].contiguous()),
                        4000, "layernorm") == ()  # fmt: skip
    x7 = torch.randn(m, 1001, dtype=BF16)
    assert K._realigned((x7, x7, None, x7), 1001, "rmsnorm") == ()
    try:
        K.REALIGN_BACKWARD = False
        assert K._realigned((dy, x, None, dx), n, "rmsnorm") == ()
    finally:
        K.REALIGN_BACKWARD = True


def _ptx_counts(ptx: str) -> tuple[int, int]:
    """(16-byte cp.async copies, 16-byte global stores) in a kernel's PTX."""
    return len(re.findall(r"cp\.async\.c[ag]\.shared\.global\S* \[[^]]+\], \[[^]]+\], 16", ptx)), len(
        re.findall(r"st\.global\S*\.v4", ptx))


@pytest.mark.parametrize("op,residual", [("rmsnorm", False), ("layernorm", False), ("rmsnorm", True)])
@pytest.mark.parametrize("dtype,wdtype", [(BF16, "x"), (FP16, FP32), (BF16, None)])
def test_realigned_backward_compiles_to_whole_vectors(op, residual, dtype, wdtype):
    """The realigned backward moves its rows by 16-byte cp.async and stores dx 16 bytes at a time;
    the element-wise kernel it replaces has neither (so this test can fail)."""
    for n in ODD_N:
        assert K.compile_only(op, "bwd", dtype, n, vec=8, wdtype=wdtype, residual=residual, realign=True) > 0
        key = K.kernel_key(op, "bwd", dtype, n, 8, dtype if wdtype == "x" else wdtype, None, residual, realign=True)
        copies, stores = _ptx_counts(K._COMPILED[key][0].__ptx__)
        assert copies >= 2 * (3 if residual else 2) and stores >= 1, (n, copies, stores)
    K.compile_only(op, "bwd", dtype, ODD_N[0], wdtype=wdtype, residual=residual)
    key = K.kernel_key(op, "bwd", dtype, ODD_N[0], 1, dtype if wdtype == "x" else wdtype, None, residual)
    assert _ptx_counts(K._COMPILED[key][0].__ptx__) == (0, 0)


def test_realigned_keys_refuse_what_the_kernel_cannot_take():
    with pytest.raises(ValueError, match="not read realigned"):
        K.kernel_key("rmsnorm", "bwd", BF16, 4096, 8, BF16, realign=True)
    with pytest.raises(ValueError, match="not read realigned"):
        K.kernel_key("rmsnorm", "fwd", BF16, 4001, 8, BF16, realign=True)


REALIGNED_SHAPES = [Shape((37, 4001)), Shape((5, 5003)), Shape((19, 2999)), Shape((1, 6007)), Shape((300, 8191))]


@pytest.mark.gpu
@pytest.mark.parametrize("weights", ["same", "fp32"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("op", ["rmsnorm", "layernorm", "add_rmsnorm"])
def test_realigned_backward_against_the_reference(op, dtype, weights):
    """Rows of an odd width, every offset within a vector (37 rows), fewer rows than CTAs, one row,
    and a last row whose span runs past the tensor."""
    from harness.registry import get

    impl = get("cute")
    k = impl.kernels("cuda")
    for shape in REALIGNED_SHAPES:
        r = run_check(impl, op, "bwd", shape, dtype, "cuda", kernels=k, weights=weights)
        assert r.status in ("pass", "skip"), f"{shape}: {r.summary()}"


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["rmsnorm", "layernorm"])
def test_realigned_rows_keep_to_themselves(op):
    """A realigned row's first and last vector hold its neighbours' elements: an inf in row 3 must
    leave every other row's dx as it was, bit for bit."""
    k = _kernels()
    c = make_case(op, Shape((37, 4001)), BF16, "cuda", seed=5)
    x, dy, w = c["x"], c["dy"], c["weight"]
    if op == "layernorm":
        _, mean, rstd = reference.layernorm_fwd(x, w, c["bias"], c["eps"])
        run = lambda a, b: k.layernorm_bwd(b, a, w, mean.float(), rstd.float())[0]  # noqa: E731
    else:
        _, rstd = reference.rmsnorm_fwd(x, w, c["eps"])
        run = lambda a, b: k.rmsnorm_bwd(b, a, w, rstd.float())[0]  # noqa: E731
    assert K._realigned((dy, x, None, torch.empty_like(x)), 4001, op)
    clean = run(x, dy)
    x2, dy2 = x.clone(), dy.clone()
    x2[3], dy2[3] = float("inf"), float("inf")
    dirty = run(x2, dy2)
    others = [r for r in range(37) if r != 3]
    assert torch.equal(clean[others], dirty[others])
    assert torch.isfinite(clean).all()
