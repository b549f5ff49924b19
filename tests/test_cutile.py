"""cuTile kernels: the record and the launch plans (no cuda-tile needed), a compile for sm_90 of
every op x direction x row regime (cuTile has no CPU interpreter; ``tileiras`` compiles without a
GPU), the FP8 kernels' too, and on a GPU add + RMSNorm, fp32 weights, overflowing statistics and
the FP8 ops against fp64 and the exact checker. The registry-driven tests
(tests/test_implementations.py) run every shape set on the GPU."""

import importlib.util
import os
import shutil
import subprocess

import pytest
import torch

from harness.run.checker import run_check
from harness.spec.contract import DTYPES
from harness.spec.fp8 import GROUP_BLOCK
from harness.spec.inputs import make_case
from harness.spec.ops import FP8_OPS, get_op
from harness.spec.shapes import SHAPE_SETS, Shape

from .conftest import DEVICE, HAS_CUDA
from .gpu_only_dsl import (
    CALLS,
    REGIMES,
    add_rmsnorm_failures,
    assert_compile_only_launches_nothing,
    assert_overflowed_rows_are_nan,
    assert_views_pass,
    head_view,
    compiling_or_skip,
    inputs,
)

HAS_CUTILE = importlib.util.find_spec("cuda") is not None and importlib.util.find_spec("cuda.tile") is not None
needs_cutile = pytest.mark.skipif(not HAS_CUTILE, reason="cuda-tile is not installed (pip install -e '.[cutile]')")

# one shape per row regime, from the shared shape sets: narrow rows packed many to a tile (N = 7),
# a mid-size odd row (1001), a row in one tile (2880), wide rows on the chunked forward / sliced
# backward paths (20001, and the widest, 262144)


# ------------------------------------------------------------------- the record (no cuda-tile needed)
def test_record_imports_nothing_heavy_and_says_why_it_cannot_run():
    import sys

    from harness.registry import get

    impl = get("cutile")
    assert impl.dsl == "cutile" and set(impl.ops) == {"rmsnorm", "layernorm", "add_rmsnorm", *FP8_OPS}
    assert impl.extra_entries == ("impls.cutile.fp8",) and "impls/cutile/fp8.py" in impl.sources
    assert not {"impls.cutile.kernels", "impls.cutile.fp8"} & set(sys.modules) or HAS_CUTILE
    assert impl.unavailable("cpu") == "runs on cuda only, not cpu"
    why = impl.unavailable("cuda")
    if not HAS_CUDA:
        assert why == "needs a CUDA device and none is available here"
    elif not HAS_CUTILE:
        assert why == "python package 'cuda' is not installed" or why == "python package 'cuda.tile' is not installed"
    if why:
        with pytest.raises(ValueError, match="cannot run on cuda here"):
            impl.kernels("cuda")


def test_plans_cover_every_row_with_power_of_two_tiles():
    from impls.cutile.plan import BWD_ROW_MAX, FWD_ROW_MAX, MAX_ROWS, backward_groups, next_pow2, plan

    ns = sorted({s.n for shapes in SHAPE_SETS.values() for s in shapes if s.n} | {1, 2, 31, 65537})
    for n in ns:
        for m in (1, 3, 37, 128, 131072):
            for direction, limit in (("fwd", FWD_ROW_MAX), ("bwd", BWD_ROW_MAX)):
                p = plan(direction, m, n)
                assert p.width & (p.width - 1) == 0 and p.rows & (p.rows - 1) == 0, (m, n, p)
                assert 1 <= p.rows <= min(m, MAX_ROWS), (m, n, p)
                assert p.pieces * p.width >= n > (p.pieces - 1) * p.width, (m, n, p)
                assert (p.width == next_pow2(n)) == (p.pieces == 1) and p.width <= limit, (m, n, p)
                groups = backward_groups(m, p, 132)
                assert 1 <= groups <= -(-m // p.rows), (m, n, groups)


def test_plan_rejects_bad_arguments():
    from impls.cutile.plan import plan

    with pytest.raises(ValueError, match="direction"):
        plan("sideways", 4, 64)
    with pytest.raises(ValueError, match="N must be"):
        plan("fwd", 4, 0)
    with pytest.raises(ValueError, match="M must be"):
        plan("bwd", 0, 64)


# ---------------------------------------------------------------------------- compile for sm_90
@pytest.fixture(scope="module")
def cutile_kernels():
    """The kernels module, after checking that one kernel compiles here; a skip with the exact
    reason when the toolchain (tileiras, its libNVVM and ptxas) cannot."""
    if not HAS_CUTILE:
        pytest.skip("cuda-tile is not installed (pip install -e '.[cutile]')")
    from impls.cutile import kernels

    compiled = compiling_or_skip(kernels, "cuTile cannot compile for sm_90")
    assert compiled and compiled[0][1][:4] == b"\x7fELF"
    return kernels


# bf16 x with fp32 weights at every regime; fp32 on three (narrow, mid, sliced backward); fp16
# (the same plans as bf16) on the widest row. A compile takes 0.3-5 s on 2 CPU cores.
COMPILES = [(n, "bf16", "fp32") for n in sorted(REGIMES)] + [(n, "fp32", "fp32") for n in (7, 2880, 20001)]
COMPILES += [(262144, "fp16", "fp16")]


@pytest.mark.slow
@pytest.mark.parametrize("n,dtype,param_dtype", COMPILES, ids=[f"{n}-{d}-{p}weight" for n, d, p in COMPILES])
def test_every_kernel_compiles_for_sm90(cutile_kernels, n, dtype, param_dtype):
    """Each op and direction compiles to an sm_90 cubin through the host code the GPU runs."""
    from impls.cutile import configs
    from impls.cutile.plan import plan, realigned

    k = cutile_kernels
    shape = REGIMES[n]
    x, dy, w, b, s = inputs(shape, DTYPES[dtype], DTYPES[param_dtype])
    for (op, direction), call in CALLS.items():
        with k.compile_only() as compiled:
            call(k, x, dy, w, b, s)
        names = [name for name, _ in compiled]
        d = direction.split("-")[0]
        t = configs.choose(op, d, n, x.device)
        p = plan(d, x.shape[0], n, t)
        odd = "_odd" if realigned(x.shape[0], n, x.element_size(), p, t) else ""  # 16-bit odd rows from 2048
        if direction == "fwd":
            assert names == [f"_fwd{odd}_kernel"], (op, names)
        else:
            assert names == (["_bwd_row_sums_kernel"] if p.wide else []) + [f"_bwd{odd}_kernel", "_sum_partials_kernel"], names
        for name, cubin in compiled:
            # an ELF whose e_flags name the SM: 90 in bits 8-15 (sm_90)
            assert cubin[:4] == b"\x7fELF" and len(cubin) > 1000, (op, direction, name)
            assert (int.from_bytes(cubin[0x30:0x34], "little") >> 8) & 0xFF == 90, (op, direction, name)


def _nvdisasm() -> str | None:
    """A disassembler for sm_90 cubins: on the PATH, or the one Triton's wheel ships."""
    found = shutil.which("nvdisasm")
    spec = importlib.util.find_spec("triton")  # found, not imported
    if found is None and spec is not None:
        for root in spec.submodule_search_locations or ():
            path = os.path.join(root, "backends", "nvidia", "bin", "nvdisasm")
            if os.access(path, os.X_OK):
                return path
    return found


# The FP8 kernels, bf16 x with fp32 weights (the offset variant reaches them as fp32 weights too):
# each code path (a row in one tile or walked in chunks, x per token or per 1 x 128 block) once, the
# residual on two of them, so that every pair of op, grouping and row regime is compiled. N = 1000
# is a padded row, several to a tile; 40960 runs as five chunks (the norm forward's tuning without a
# GPU: the heuristic, whose rows are whole up to 32768).
FP8_COMPILES = [("rmsnorm_fp8", "token", 1000), ("rmsnorm_fp8", "g128", 40960),
                ("add_rmsnorm_fp8", "g128", 512), ("add_rmsnorm_fp8", "token", 40960)]  # fmt: skip


def _compile_fp8(op, grouping, n) -> bytes:
    from impls.cutile import fp8

    x = torch.randn(64, n).bfloat16()
    w = torch.ones(n)
    group = n if grouping == "token" else GROUP_BLOCK
    with fp8.compile_only() as compiled:
        if op == "rmsnorm_fp8":
            fp8.rmsnorm_fp8_fwd(x, w, 1e-5, group)
        else:
            fp8.add_rmsnorm_fp8_fwd(x, x.clone(), w, 1e-5, group)
    assert [name for name, _ in compiled] == ["_fp8_kernel"], compiled
    return compiled[0][1]


@pytest.mark.slow
@pytest.mark.parametrize("op,grouping,n", FP8_COMPILES, ids=[f"{o}-{g}-{n}" for o, g, n in FP8_COMPILES])
def test_fp8_kernels_compile_for_sm90(cutile_kernels, op, grouping, n):
    """One kernel per call, an sm_90 cubin, on the row path the plan gives N."""
    from impls.cutile import configs
    from impls.cutile.plan import plan

    tuning = configs.choose(op.removesuffix("_fp8"), "fwd", n, torch.device("cpu"))
    assert plan("fwd", 64, n, tuning).wide == (n > 32768)
    cubin = _compile_fp8(op, grouping, n)
    assert cubin[:4] == b"\x7fELF" and (int.from_bytes(cubin[0x30:0x34], "little") >> 8) & 0xFF == 90


def test_fp8_conversion_is_the_hardware_saturating_one(cutile_kernels, tmp_path):
    """``ct.astype(v, ct.float8_e4m3fn)`` (Tile IR's ftof, which has no saturation attribute) comes
    out of tileiras as F2FP.SATFINITE.E4M3.F32 on sm_90: nearest even, +-448 past the range, NaN
    kept; no conversion without SATFINITE. Read from the SASS (a disassembler takes about a second:
    one kernel, the 1 x 128 blocks of a row in one tile)."""
    nvdisasm = _nvdisasm()
    if nvdisasm is None:
        pytest.skip("no nvdisasm here (on the PATH or in Triton's wheel)")
    (tmp_path / "k.cubin").write_bytes(_compile_fp8("add_rmsnorm_fp8", "g128", 512))
    sass = subprocess.run(
        [nvdisasm, "-c", str(tmp_path / "k.cubin")], capture_output=True, text=True, check=True
    ).stdout
    converts = [line for line in sass.splitlines() if "F2FP" in line and "E4M3" in line]
    assert converts and all("F2FP.SATFINITE.E4M3.F32" in line for line in converts), converts


def test_compile_only_leaves_nothing_launched(cutile_kernels):
    """Outside ``compile_only`` a CPU tensor reaches a real launch, which fails loudly (no GPU)."""
    assert_compile_only_launches_nothing(cutile_kernels)


@needs_cutile
def test_rows_past_int32_indexing_are_refused():
    from impls.cutile import kernels

    # a view whose rows lie 2^31 elements apart, on the meta device: no memory behind it
    x = torch.empty(2, 8, device="meta").as_strided((2, 8), (2**31, 1))
    with pytest.raises(ValueError, match="int32"):
        kernels.rmsnorm_fwd(x, None, 1e-5)


# ---------------------------------------------------------------------------- per-head views
# (T, H, N) views of a fused QKV tensor (row_views): the per-head set's and the edge set's views,
# and a wide one (the sliced backward's row sums read the view too)
VIEWS = sorted({(s.dims[1], s.dims[2], int(s.layout.rsplit("-", 1)[1])) for name in ("perhead", "edge")
                for s in SHAPE_SETS[name] if s.layout.startswith("head-slice-")}) + [(2, 20001, 3)]  # fmt: skip


@needs_cutile
def test_head_rows_keep_tiles_within_tokens_or_copy():
    from impls.cutile.kernels import MIN_VIEW_ROWS, head_rows

    assert [head_rows(h, 16) for h in (64, 32, 16, 8, 2, 1)] == [16, 16, 16, 8, 2, 1]  # H a power of two
    assert head_rows(24, 32) == head_rows(40, 16) == 8  # a power of two dividing H, the tile within a token
    assert head_rows(12, 32) == MIN_VIEW_ROWS == 4 and head_rows(6, 32) == head_rows(3, 32) == 0  # copied
    assert head_rows(3, 1) == 1  # a row a tile (wide rows): any view


@needs_cutile
def test_host_side_passes_views_in_place_and_copies_the_rest():
    """What the kernels are handed (no GPU: the decision only): a view goes in place with the rows
    a tile takes from a token, and every other row tensor of the call as a (T, H, N) view of its
    memory; a 3-D tensor with an (M, N) view goes as that view; heads no tile fits are copied."""
    from impls.cutile.kernels import _as_rows
    from impls.cutile.plan import Plan

    p = Plan(32, 128, 1)
    x, dy = head_view(5, 8, 128, 48), torch.randn(5, 8, 128)
    (x2, dy2, none), p2, hr = _as_rows((x, dy, None), 128, p)
    assert x2 is x and dy2.shape == (5, 8, 128) and dy2.data_ptr() == dy.data_ptr() and none is None
    assert (p2, hr) == (p, 8)  # 4 tokens of 8 heads a tile
    (x2,), p2, hr = _as_rows((head_view(3, 24, 128, 40),), 128, p)
    assert x2.dim() == 3 and (p2, hr) == (Plan(8, 128, 1), 8)  # 8 rows a tile, within a token
    (x2, dy2), p2, hr = _as_rows((head_view(5, 3, 96, 7), torch.randn(5, 3, 96)), 96, Plan(32, 128, 1))
    assert x2.shape == dy2.shape == (15, 96) and x2.is_contiguous() and hr == 0  # copied: 3 heads
    (x2,), p2, hr = _as_rows((torch.randn(5, 8, 128),), 128, p)
    assert x2.shape == (40, 128) and hr == 0 and p2 == p  # contiguous: (M, N) rows
    (x2,), _, hr = _as_rows((head_view(1, 8, 128, 48),), 128, p)
    assert x2.shape == (8, 128) and hr == 0  # one token: its heads are rows


@pytest.mark.slow
@pytest.mark.parametrize("h,n,p", VIEWS, ids=[f"{h}x{n}-of-{p}" for h, n, p in VIEWS])
def test_views_compile_for_sm90(cutile_kernels, h, n, p):
    """Every op, direction and the FP8 ops on a per-head view, through the host code the GPU runs:
    the view reaches the kernels as 3-D (no copy) where a tile fits its heads."""
    from impls.cutile import fp8

    k = cutile_kernels
    x, dy, w = head_view(9, h, n, p), torch.randn(9, h, n).bfloat16(), torch.ones(n)
    res, rstd, mean = head_view(9, h, n, p), torch.ones(9 * h), torch.zeros(9 * h)
    calls = [
        ("rmsnorm_fwd", k.rmsnorm_fwd, (x, w, 1e-6)), ("layernorm_fwd", k.layernorm_fwd, (x, w, w, 1e-6)),
        ("add_rmsnorm_fwd", k.add_rmsnorm_fwd, (x, res, w, 1e-6)), ("rmsnorm_bwd", k.rmsnorm_bwd, (dy, x, w, rstd)),
        ("layernorm_bwd", k.layernorm_bwd, (dy, x, w, mean, rstd)), ("add_rmsnorm_bwd", k.add_rmsnorm_bwd, (dy, dy, x, w, rstd)),
        ("rmsnorm_fp8_fwd", fp8.rmsnorm_fp8_fwd, (x, w, 1e-6, n)),
    ]  # fmt: skip
    if n % GROUP_BLOCK == 0:
        calls.append(("add_rmsnorm_fp8_fwd", fp8.add_rmsnorm_fp8_fwd, (x, res, w, 1e-6, GROUP_BLOCK)))
    for name, fn, args in calls:
        with k.compile_only() as compiled:
            fn(*args)
        assert compiled and all(c[:4] == b"\x7fELF" for _, c in compiled), name
        if n > 8192 and name.endswith("_bwd"):
            assert compiled[0][0] == "_bwd_row_sums_kernel", (name, [c for c, _ in compiled])


# --------------------------------------------------------------------- against fp64, on a GPU
@pytest.fixture(scope="module")
def contract():
    from harness.registry import get

    impl = get("cutile")
    why = impl.unavailable(DEVICE)
    if why:
        pytest.skip(f"cutile: {why}")
    return impl.kernels(DEVICE)


# views no shape set has: 24 heads (tiles of 8 rows within a token), 8 heads over tiles of several
# tokens with a last tile past T, 2 wide heads (the sliced backward), 6 heads of 96 (copied)
GPU_VIEWS = [Shape((37, 24, 128), "head-slice-40"), Shape((37, 8, 128), "head-slice-10"),
             Shape((9, 2, 20001), "head-slice-3"), Shape((6, 6, 96), "head-slice-7")]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_views_against_the_reference(contract, dtype):
    """Every op over per-head views, through the harness (which hands the views over as they are):
    forward and backward against fp64, the FP8 ops against the exact checker."""
    assert_views_pass("cutile", GPU_VIEWS, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,param_dtype", [("bf16", "x"), ("bf16", "fp32"), ("fp16", "fp32"), ("fp32", "x")])
def test_add_rmsnorm_against_fp64(contract, dtype, param_dtype):
    """y, residual_out (bit for bit the rounded sum), rstd, and dh with and without
    dresidual_out, dweight in the weight's dtype, on every shape of the smoke and edge sets."""
    for shape in SHAPE_SETS["smoke"] + SHAPE_SETS["edge"]:
        if shape.m == 0:
            continue
        bad = add_rmsnorm_failures(contract, shape, dtype, param_dtype, DEVICE)
        assert not bad, f"{shape.label} {dtype} weight {param_dtype}: {bad}"


@pytest.mark.gpu
@pytest.mark.parametrize("n", [64, 20001])  # a row in one tile; the chunked forward and sliced backward
@pytest.mark.parametrize("op", ["rmsnorm", "layernorm"])
def test_overflowing_statistics_give_nan_not_a_finite_value(contract, op, n):
    """bf16 rows near 1e30: x^2 overflows fp32. y and, through the saved rstd, dx are NaN in that
    row; the rows beside stay finite."""
    assert_overflowed_rows_are_nan(contract, op, n, DEVICE)


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["rmsnorm", "layernorm"])
def test_backward_is_deterministic(contract, op):
    """dweight / dbias from per-program partials added in a fixed order: the same bits twice."""
    k = contract
    shape = SHAPE_SETS["sweep"][0]  # 131072 x 1024: many row blocks per program
    case = make_case(op, shape, torch.bfloat16, DEVICE, seed=6)
    x, dy, w = case["x"], case["dy"], case["weight"]
    stats = torch.zeros(x.shape[0], device=DEVICE), torch.ones(x.shape[0], device=DEVICE)
    if op == "layernorm":
        first, second = (k.layernorm_bwd(dy, x, w, *stats) for _ in range(2))
    else:
        first, second = (k.rmsnorm_bwd(dy, x, w, stats[1]) for _ in range(2))
    for a, b in zip(first, second):
        assert a is None or torch.equal(a, b)


# FP8 rows beyond the shape sets: many rows to a tile, a column slice, the widest row in one tile,
# and a chunked row whose last chunk is one 1 x 128 block (its other 31 blocks' scales clipped)
FP8_SHAPES = (
    Shape((64, 256)),
    Shape((37, 1024), "column-slice"),
    Shape((37, 1001)),
    Shape((5, 8192)),
    Shape((3, 8320)),
)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "dtype,weights", [("bf16", "same"), ("bf16", "fp32"), ("bf16", "offset"), ("fp16", "fp32"), ("fp32", "same")]
)
def test_fp8_against_the_exact_checker(contract, dtype, weights):
    """q, the scales, residual_out and rstd of both FP8 ops, per token and per 1 x 128 block, as the
    exact checker holds them (harness.run.checker: q within one e4m3 rounding boundary, the scales
    from fp32's y)."""
    from harness.registry import get

    failures = []
    for op in FP8_OPS:
        for shape in FP8_SHAPES:
            if get_op(op).unsupported(shape.n):
                continue
            r = run_check(get("cutile"), op, "fwd", shape, dtype, DEVICE, kernels=contract, weights=weights)
            if not r.passed:
                failures.append(f"{op} {shape.label}: {r.status} {r.summary()}")
    assert not failures, "\n".join(failures)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [256, 8320])  # a row in one tile; a chunked row
@pytest.mark.parametrize("grouping", ["token", "g128"])
def test_fp8_overflowing_statistics_give_nan(contract, grouping, n):
    """A bf16 row near 1e30 (x^2 overflows fp32): rstd NaN, and q and that row's scales NaN, never
    the floor's scale or a saturated 448; the rows beside stay finite."""
    g = torch.Generator(device=DEVICE).manual_seed(5)
    x = torch.randn(3, n, generator=g, device=DEVICE)
    x[1] *= 1e30
    x = x.to(torch.bfloat16)
    w = torch.ones(n, device=DEVICE, dtype=torch.bfloat16)
    q, scale, rstd = contract.rmsnorm_fp8_fwd(x, w, 1e-5, n if grouping == "token" else GROUP_BLOCK)
    q = q.float()
    assert torch.isnan(rstd[1]) and torch.isnan(q[1]).all() and torch.isnan(scale[1]).all()
    assert torch.isfinite(q[[0, 2]]).all() and torch.isfinite(scale[[0, 2]]).all()


# ---------------------------------------------------------------------------- the tuned table
def test_table_lookup_takes_the_bucket_or_the_nearest_and_the_heuristic_without_a_gpu():
    from impls.cutile import configs
    from impls.cutile.plan import Tuning

    table = configs._table()
    gpu = configs.gpus()[0]
    entries = table[gpu]["rmsnorm_fwd"]
    assert configs._nearest(entries, 5120) == entries["8192"]  # next_pow2(5120)
    assert configs._nearest(entries, 262144) == entries[str(max(map(int, entries)))]  # past the widest
    assert configs._nearest(entries, 64) == entries[str(min(map(int, entries)))]  # below the narrowest
    cpu = torch.device("cpu")
    assert configs.choose("rmsnorm", "bwd", 4096, cpu) == Tuning(**table["_heuristic"]["bwd"])
    assert configs.source("rmsnorm", "fwd", 4096, "bf16", cpu).startswith("heuristic")
    for gpu in configs.gpus():  # every entry names fields of Tuning only, for both directions of each op
        assert {f"{op}_{d}" for op in ("rmsnorm", "layernorm", "add_rmsnorm") for d in ("fwd", "bwd")} <= set(table[gpu])
        for buckets in table[gpu].values():
            for rule in buckets.values():
                Tuning(**rule)


def _table_cases():
    from impls.cutile import configs

    table = configs._table()
    return [(gpu, name, int(b)) for gpu in table if not gpu.startswith("_") for name, bs in table[gpu].items() for b in bs]


@pytest.mark.slow
@pytest.mark.parametrize("gpu,name,bucket", _table_cases(), ids=lambda v: str(v).replace(" ", "_"))
def test_every_table_entry_compiles_for_sm90(cutile_kernels, gpu, name, bucket):
    """Each pinned entry compiles at its bucket's width (65536 also at 262144, which takes it),
    through the host code the GPU runs, with the entry set as the tuning."""
    from impls.cutile import configs
    from impls.cutile import plan as P

    op, direction = name.rsplit("_", 1)
    k = cutile_kernels
    for n in (bucket, 262144) if bucket == 65536 else (bucket,):
        shape = Shape((max(64, 2**18 // n), n))
        x, dy, w, b, s = inputs(shape, torch.bfloat16, torch.bfloat16)
        old = P.set_tuning(**configs._table()[gpu][name][str(bucket)])
        try:
            with k.compile_only() as compiled:
                CALLS[(op, direction)](k, x, dy, w, b, s)
        finally:
            P.TUNING = old
        assert compiled and all(c[:4] == b"\x7fELF" for _, c in compiled), (name, n)


# ---------------------------------------------------------------------------- realigned rows
def test_realigned_rows_are_chosen_exactly_where_they_apply():
    """16-bit rows whose length is no multiple of 8, in one tile, at least ODD_MIN_N wide and 8 rows;
    not fp32, not N % 8 == 0, not wide rows (chunks, slices), not with ``realign`` off."""
    from impls.cutile.plan import ODD_MIN_N, Tuning, plan, realigned

    def takes(m, n, itemsize=2, direction="fwd", t=None):
        return realigned(m, n, itemsize, plan(direction, m, n, t), t)

    for n in (2049, 2999, 4001, 5003, 8191):
        assert takes(37, n) and takes(33546, n, direction="fwd", t=Tuning(fwd_row_max=8192)), n
    assert takes(64, 4001, direction="bwd") and not takes(64, 5003, direction="bwd")  # the backward's 4096 tile
    assert takes(64, 5003, direction="bwd", t=Tuning(bwd_row_max=8192))
    assert not takes(37, 4000) and not takes(37, 4008) and takes(37, 4004) and takes(37, 4002)
    assert not takes(37, 4001, itemsize=4) and not takes(7, 4001) and takes(8, 4001)
    assert not takes(37, ODD_MIN_N - 1) and takes(37, ODD_MIN_N + 1)
    assert not takes(37, 20001) and not takes(37, 4001, t=Tuning(realign=False))


@needs_cutile
def test_realigned_rows_need_contiguous_aligned_rows():
    """The tensors' conditions: (M, N) rows of row stride N starting on 16 bytes, every tensor."""
    from impls.cutile.kernels import takes_realigned
    from impls.cutile.plan import plan

    p = plan("fwd", 37, 2999)
    x = torch.zeros(37, 2999, dtype=torch.bfloat16)
    assert takes_realigned((x, None), 37, 2999, p, None) and takes_realigned((x, x.clone()), 37, 2999, p, None)
    shifted = torch.zeros(37 * 2999 + 1, dtype=torch.bfloat16)[1:].view(37, 2999)  # 2 bytes off
    column_slice = torch.zeros(37, 3008, dtype=torch.bfloat16)[:, :2999]
    for other in (shifted, column_slice):
        assert not takes_realigned((x, other), 37, 2999, p, None)
        assert not takes_realigned((other, None), 37, 2999, p, None)


def _realigned_rows(x: torch.Tensor, w: torch.Tensor, eps: float, layernorm: bool):
    """The realigned kernels' forward emulated in torch on the flat array, with ``phase_split`` and
    ``edge_columns`` (what the kernels compute in cuTile): per phase, the bodies read as rows of
    stride 8N from an aligned start, the edges element-wise, the weight shifted by the head; y
    written back through the same offsets. Returns (y, rstd) and the set of offsets written."""
    from impls.cutile.plan import PHASES, VEC, phase_split, edge_columns

    m, n = x.shape
    flat, y = x.double().reshape(-1), torch.full((m * n,), float("nan"), dtype=torch.float64)
    rstd = torch.full((m,), float("nan"), dtype=torch.float64)
    written = []
    for phase in range(PHASES):
        start, head, body = phase_split(phase, n)
        assert start % VEC == 0 and body % VEC == 0 and 0 <= head < VEC and 0 <= n - head - body < VEC
        rows = torch.arange(phase, m, PHASES)
        body_at = start + (rows - phase)[:, None] * n + torch.arange(body)[None, :]  # stride 8N per phase row
        assert (body_at[:, 0] % VEC == 0).all()
        edge = torch.tensor(edge_columns(head, body, n), dtype=torch.long)
        edge_at = rows[:, None] * n + edge[None, :]
        xb, xe = flat[body_at], flat[edge_at]
        wb, we = w.double()[head : head + body], w.double()[edge]
        if layernorm:
            mean = (xb.sum(1, keepdim=True) + xe.sum(1, keepdim=True)) / n
            xb, xe = xb - mean, xe - mean
        r = torch.rsqrt(((xb * xb).sum(1, keepdim=True) + (xe * xe).sum(1, keepdim=True)) / n + eps)
        y[body_at], y[edge_at] = xb * r * wb, xe * r * we
        rstd[rows] = r[:, 0]
        written += body_at.reshape(-1).tolist() + edge_at.reshape(-1).tolist()
    return y.view(m, n), rstd, written


@pytest.mark.parametrize("n", [1001, 2999, 4001, 5002, 5003])
def test_realigned_layout_covers_every_element_once_and_normalises_rows(n):
    """The phases' bodies and edges cover every element of 37 rows exactly once, and the per-row
    sums over body + edge give the fp64 reference's y and rstd."""
    from harness.spec import reference

    m = 37
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(m, n, generator=g).bfloat16(), torch.randn(n, generator=g).bfloat16()
    for layernorm in (False, True):
        y, rstd, written = _realigned_rows(x, w, 1e-5, layernorm)
        assert sorted(written) == list(range(m * n)), n
        if layernorm:
            y_ref, _, rstd_ref = reference.layernorm_fwd(x, w, None, 1e-5)
        else:
            y_ref, rstd_ref = reference.rmsnorm_fwd(x, w, 1e-5)
        torch.testing.assert_close(y, y_ref.double(), rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(rstd, rstd_ref.double().reshape(-1), rtol=1e-9, atol=1e-9)


# every op and direction at two odd widths: bf16 with fp32 weights, and fp16 with fp16 weights
ODD_COMPILES = [(4001, "bf16", "fp32"), (5003, "fp16", "fp16")]


@pytest.mark.slow
@pytest.mark.parametrize("n,dtype,param_dtype", ODD_COMPILES, ids=[f"{n}-{d}-{p}weight" for n, d, p in ODD_COMPILES])
def test_realigned_kernels_compile_for_sm90_with_whole_vectors(cutile_kernels, n, dtype, param_dtype):
    """Each op and direction takes the realigned kernels at odd widths and compiles for sm_90; the
    forward's bodies move as TMA boxes or 128-bit accesses (read from the SASS where a disassembler
    is at hand)."""
    from impls.cutile import configs
    from impls.cutile.plan import plan

    k = cutile_kernels
    x, dy, w, b, s = inputs(Shape((37, n)), DTYPES[dtype], DTYPES[param_dtype])
    nvdisasm = _nvdisasm()
    for (op, direction), call in CALLS.items():
        with k.compile_only() as compiled:
            call(k, x, dy, w, b, s)
        names = [name for name, _ in compiled]
        t = configs.choose(op, direction.split("-")[0], n, x.device)
        if plan(direction.split("-")[0], 37, n, t).wide:
            assert "_fwd_odd_kernel" not in names and "_bwd_odd_kernel" not in names, (op, direction, names)
            continue
        if direction == "fwd":
            assert names == ["_fwd_odd_kernel"], (op, names)
        else:
            assert names == ["_bwd_odd_kernel"] + (["_sum_partials_kernel"] if len(names) > 1 else []), names
        cubin = compiled[0][1]
        assert cubin[:4] == b"\x7fELF" and (int.from_bytes(cubin[0x30:0x34], "little") >> 8) & 0xFF == 90
        if nvdisasm and direction == "fwd" and op == "rmsnorm":
            import tempfile

            with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                f.write(cubin)
                f.flush()
                sass = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout
            assert "UTMALDG.2D" in sass or "LDG.E.128" in sass, "the bodies' loads are not whole vectors"
            assert "UTMASTG.2D" in sass or "STG.E.128" in sass, "the bodies' stores are not whole vectors"


# ------------------------------------------------------------ exchanging slices (Tuning.sync)
def test_exchanging_grid_is_one_program_per_sm_or_none():
    """The exchanging backward's whole grid fits the SMs (its programs wait for each other), with
    no program without a row block; a row with more slices than SMs gets none (the first kernel's
    sums then)."""
    from impls.cutile.plan import Tuning, plan, sync_groups

    for n in (10240, 20001, 65536, 262144):
        for m in (1, 3, 512, 16384):
            for sms in (1, 8, 132):
                p = plan("bwd", m, n, Tuning(bwd_row_max=8192, bwd_slice=8192))
                groups = sync_groups(m, p, sms)
                if p.pieces > sms:
                    assert groups == 0, (m, n, sms)
                else:
                    assert 1 <= groups <= -(-m // p.rows) and groups * p.pieces <= sms, (m, n, sms, groups)


def _sass(cubin: bytes, nvdisasm: str) -> str:
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout


SYNC_TUNING = {"bwd_row_max": 8192, "bwd_slice": 8192, "bwd_tile_elements": 8192, "sync": True}


@pytest.mark.slow
@pytest.mark.parametrize("n", [20001, 262144])  # 3 slices, the last ragged; 32
def test_exchanging_backward_compiles_for_sm90(cutile_kernels, monkeypatch, n):
    """With ``sync`` the sliced backward is one kernel that posts its sums with a 64-bit atomic
    exchange and polls its siblings' with atomics inside the wait loop, where a plain load was
    hoisted out of it (from the SASS where a disassembler is at hand); with more slices than SMs it
    keeps the first kernel's sums."""
    from impls.cutile import plan as P

    k = cutile_kernels
    x, dy, w, b, s = inputs(Shape((37, n)), torch.bfloat16, torch.float32)
    nvdisasm = _nvdisasm()
    old = P.set_tuning(**SYNC_TUNING)
    try:
        for sms, first in ((132, []), (2, ["_bwd_row_sums_kernel"])):
            monkeypatch.setattr(k, "SM_COUNT_WITHOUT_GPU", sms)
            for op in ("rmsnorm", "layernorm", "add_rmsnorm"):
                with k.compile_only() as compiled:
                    CALLS[(op, "bwd")](k, x, dy, w, b, s)
                names = [name for name, _ in compiled]
                sliced = "_bwd_kernel" if first else "_bwd_sync_kernel"
                assert names == first + [sliced, "_sum_partials_kernel"], (op, sms, names)
                if nvdisasm and not first and op == "layernorm":
                    sass = _sass(compiled[0][1], nvdisasm)
                    assert "ATOMG.E.EXCH.64.STRONG.GPU" in sass, "the sums are not posted by a 64-bit exchange"
                    assert sass.count("ATOMG.E.OR.64.STRONG.GPU") >= 2, "the siblings' sums are not re-read in the loop"
    finally:
        P.TUNING = old


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_exchanging_backward_against_the_reference(contract, dtype):
    """The exchanging slices against fp64 (ragged last slice, a last row block past M, per-head
    views of wide heads), and the same bits on a second call."""
    from harness.registry import get
    from harness.run.bench import callables
    from impls.cutile import plan as P

    old = P.set_tuning(**SYNC_TUNING)
    try:
        failures = []
        for op in ("rmsnorm", "layernorm", "add_rmsnorm"):
            for shape in (Shape((37, 20001)), Shape((300, 32768)), Shape((9, 2, 20001), "head-slice-3")):
                r = run_check(get("cutile"), op, "bwd", shape, dtype, DEVICE, kernels=contract)
                if not r.passed:
                    failures.append(f"{op} {shape.label}: {r.status} {r.summary()}")
            case = make_case(op, Shape((300, 32768)), DTYPES[dtype], DEVICE, seed=3)
            fn = callables(contract, op, "bwd", case)
            first, second = fn(), fn()
            for a, b in zip(first, second):
                assert a is None or torch.equal(a, b), op
        assert not failures, "\n".join(failures)
    finally:
        P.TUNING = old


# ---------------------------------------------------- the forward's exchanging slices (Tuning.fwd_sync)
FWD_SYNC_TUNING = {"fwd_sync": True, "fwd_slice": 8192, "fwd_tile_elements": 8192, "worker_warps": 8, "occupancy": 1}


def test_exchanging_forward_plan_is_asked_for_and_its_grid_fits_the_sms():
    """``fwd_sync_plan``: None unless the tuning asks for it and the row is wider than one slice;
    slices covering the row (the last partial), rows from the tile elements; its grid (the
    backward's ``sync_groups``) one program per SM or none."""
    from impls.cutile.plan import Plan, Tuning, fwd_sync_plan, sync_groups

    assert fwd_sync_plan(512, 262144) is None and fwd_sync_plan(512, 262144, Tuning()) is None
    t = Tuning(**FWD_SYNC_TUNING)
    assert fwd_sync_plan(512, 8192, t) is None  # one slice: nothing to exchange
    assert fwd_sync_plan(37, 20001, t) == Plan(1, 8192, 3)
    assert fwd_sync_plan(37, 20001, Tuning(fwd_sync=True, fwd_slice=4096, fwd_tile_elements=8192)) == Plan(2, 4096, 5)
    assert fwd_sync_plan(1, 20001, Tuning(fwd_sync=True, fwd_slice=4096, fwd_tile_elements=8192)).rows == 1
    with pytest.raises(ValueError, match="power of two"):
        fwd_sync_plan(4, 20001, Tuning(fwd_sync=True, fwd_slice=6000))
    for n in (16385, 20001, 65536, 262144):
        for m in (1, 3, 512):
            p = fwd_sync_plan(m, n, t)
            assert p.pieces * p.width >= n > (p.pieces - 1) * p.width and p.pieces >= 2, (m, n, p)
            for sms in (1, 2, 132):
                groups = sync_groups(m, p, sms)
                assert groups == 0 if p.pieces > sms else 1 <= groups <= -(-m // p.rows) and groups * p.pieces <= sms


def test_table_pins_the_exchanging_forward_only_where_it_was_picked():
    """The exchanging forward where pick.py chose it from reports/experiments/cutile-wide-fwd/ (the
    H100's RMSNorm and fused add in their widest bucket, 49152 columns and up); LayerNorm, the
    narrower buckets and the heuristic (GPUs without a table) keep the forward that walks rows."""
    from impls.cutile import configs
    from impls.cutile.plan import Tuning, fwd_sync_plan

    table = configs._table()
    assert not table["_heuristic"]["fwd"].get("fwd_sync", False)
    for g in configs.gpus():
        for op in ("rmsnorm", "layernorm", "add_rmsnorm"):
            for b, rule in table[g][f"{op}_fwd"].items():
                pinned = g == "NVIDIA H100 80GB HBM3" and op != "layernorm" and b == "65536"
                assert rule.get("fwd_sync", False) == pinned, (g, op, b)
                assert (fwd_sync_plan(512, 262144, Tuning(**rule)) is not None) == pinned, (g, op, b)


def _launched(k, monkeypatch) -> list:
    """(kernel name, grid) of every launch from now on, each also compiled as ``compile_only`` does."""
    launches = []
    real = k._launch

    def record(kernel, grid, args):
        launches.append((k._name(kernel), grid))
        real(kernel, grid, args)

    monkeypatch.setattr(k, "_launch", record)
    return launches


@pytest.mark.slow
@pytest.mark.parametrize("n", [20001, 262144])  # 3 slices, the last partial; 32
def test_exchanging_forward_compiles_for_sm90(cutile_kernels, monkeypatch, n):
    """With ``fwd_sync`` the forward is one kernel on a grid of groups x slices that fits the SMs,
    posting its partial statistics with 64-bit atomic exchanges (two planes for LayerNorm) and
    polling its siblings' with atomics in the wait loop (from the SASS where a disassembler is at
    hand); with more slices than SMs, the chunked forward; without the table's entry pinning it,
    the forward of the table."""
    from impls.cutile import plan as P

    k = cutile_kernels
    x, dy, w, b, s = inputs(Shape((37, n)), torch.bfloat16, torch.float32)
    nvdisasm = _nvdisasm()
    slices = -(-n // 8192)
    launches = _launched(k, monkeypatch)
    old = P.set_tuning(**FWD_SYNC_TUNING)
    try:
        for sms in (132, 2):
            monkeypatch.setattr(k, "SM_COUNT_WITHOUT_GPU", sms)
            for op in ("rmsnorm", "layernorm", "add_rmsnorm"):
                launches.clear()
                with k.compile_only() as compiled:
                    CALLS[(op, "fwd")](k, x, dy, w, b, s)
                (name, grid), = launches
                if sms == 2:
                    assert name == "_fwd_kernel", (op, launches)
                    continue
                assert name == "_fwd_sync_kernel" and grid[1] == slices and grid[0] * grid[1] <= sms, (op, launches)
                assert grid[0] == min(37, sms // slices), (op, grid)  # one row a block: every group has rows
                if nvdisasm and n == 20001:
                    sass = _sass(compiled[0][1], nvdisasm)
                    exch = sass.count("ATOMG.E.EXCH.64.STRONG.GPU")
                    assert exch >= (2 if op == "layernorm" else 1), (op, "the statistics are not posted by a 64-bit exchange")
                    assert sass.count("ATOMG.E.OR.64.STRONG.GPU") >= 2, (op, "the siblings' parts are not re-read in the loop")
    finally:
        P.TUNING = old
    launches.clear()
    with k.compile_only():
        CALLS[("rmsnorm", "fwd")](k, x, dy, w, b, s)
    assert [name for name, _ in launches] in (["_fwd_kernel"], ["_fwd_odd_kernel"]), launches  # N = 20001: realigned


@pytest.mark.slow
def test_exchanging_forward_takes_what_the_forward_takes(cutile_kernels, monkeypatch):
    """fp32 rows, no weight, bf16 rows with fp32 weights and per-head (T, H, N) views (read in
    place, one row a tile) all take the exchanging slices and compile."""
    from impls.cutile import plan as P

    k = cutile_kernels
    monkeypatch.setattr(k, "SM_COUNT_WITHOUT_GPU", 132)
    launches = _launched(k, monkeypatch)
    view = head_view(9, 2, 20001, 3)
    res = head_view(9, 2, 20001, 3)
    w32, w16 = torch.ones(20001), torch.ones(20001, dtype=torch.bfloat16)
    x32 = torch.randn(5, 20001)
    calls = [
        ("fp32 layernorm", lambda: k.layernorm_fwd(x32, torch.ones(20001), torch.zeros(20001), 1e-5)),
        ("no weight", lambda: k.layernorm_fwd(view.reshape(-1, 20001).contiguous(), None, None, 1e-5)),
        ("fp32 weight view", lambda: k.rmsnorm_fwd(view, w32, 1e-5)),
        ("view + residual", lambda: k.add_rmsnorm_fwd(view, res, w16, 1e-5)),
    ]
    old = P.set_tuning(**FWD_SYNC_TUNING)
    try:
        for what, call in calls:
            launches.clear()
            with k.compile_only() as compiled:
                call()
            assert [name for name, _ in launches] == ["_fwd_sync_kernel"], (what, launches)
            assert compiled[0][1][:4] == b"\x7fELF", what
    finally:
        P.TUNING = old


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,weights", [("bf16", "same"), ("bf16", "fp32"), ("fp32", "same")])
def test_exchanging_forward_against_the_reference(contract, dtype, weights):
    """The exchanging slices' y, residual_out, mean and rstd against fp64 (a partial last slice, a
    last row block past M with two rows a tile, per-head views of wide heads, rows of more slices
    than a GPU has SMs, which take the chunked forward), and the same bits on a second call."""
    from harness.registry import get
    from harness.run.bench import callables
    from impls.cutile import plan as P

    failures = []
    for tuning in (FWD_SYNC_TUNING, {**FWD_SYNC_TUNING, "fwd_slice": 4096, "worker_warps": 4}, {**FWD_SYNC_TUNING, "fwd_slice": 512}):
        old = P.set_tuning(**tuning)
        try:
            for op in ("rmsnorm", "layernorm", "add_rmsnorm"):
                for shape in (Shape((37, 20001)), Shape((300, 32768)), Shape((9, 2, 20001), "head-slice-3"), Shape((3, 131072))):
                    r = run_check(get("cutile"), op, "fwd", shape, dtype, DEVICE, kernels=contract, weights=weights)
                    if not r.passed:
                        failures.append(f"{tuning} {op} {shape.label}: {r.status} {r.summary()}")
                case = make_case(op, Shape((300, 32768)), DTYPES[dtype], DEVICE, seed=4, weights=weights)
                fn = callables(contract, op, "fwd", case)
                first, second = fn(), fn()
                for a, b in zip(first, second):
                    assert a is None or torch.equal(a, b), (tuning, op)
        finally:
            P.TUNING = old
    assert not failures, "\n".join(failures)
