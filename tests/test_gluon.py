"""Gluon kernels: the launch plans, a compile for sm_90a of every op x direction x row regime x
dtype (Gluon does not run in Triton's interpreter, so without a GPU this is what CI can check), and
against fp64 (every op, add + RMSNorm, fp32 weights beside 16-bit x, overflowing statistics): the
Gluon kernels on a GPU, their code with layouts erased under Triton's interpreter on the CPU."""

import contextlib
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness.run.checker import compare, poisoned_allocations
from harness.spec import reference
from harness.spec.contract import DTYPES
from harness.spec.inputs import make_case
from harness.spec.shapes import SHAPE_SETS, Shape

from .conftest import DEVICE, HAS_CUDA
from .gpu_only_dsl import (
    CALLS,
    REGIMES,
    add_rmsnorm_failures,
    assert_compile_only_launches_nothing,
    assert_overflowed_rows_are_nan,
    compiling_or_skip,
    inputs,
    rms_bwd_scales,
    rows_of,
)

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or importlib.util.find_spec("triton.experimental.gluon") is None,
    reason="triton with triton.experimental.gluon is not installed",
)

# one shape per row regime, from the shared shape sets: rows narrower than a warp (N = 7), a
# mid-size odd row (1001), a row held in registers by many warps (2880), wide rows on the chunked
# forward / sliced backward paths (20001: fp32 only for the forward; 262144: every dtype)


# ------------------------------------------------------------------------------- launch plans
def test_plans_use_128_bit_vectors_and_whole_warps():
    from impls.gluon.plan import VECTOR_BYTES, WARP, next_pow2, plan

    for n in sorted({s.n for shapes in SHAPE_SETS.values() for s in shapes if s.n} | {1, 2, 31, 65537}):
        for elem in (2, 4):
            for direction in ("fwd", "bwd"):
                p = plan(direction, n, elem)
                t = p.tile
                assert t.threads[0] * t.threads[1] == WARP, (n, elem, t)
                # 16-byte vectors unless the row is narrower than one, or N is not a multiple of
                # one (every row must start on a vector boundary): then the widest that divides N
                assert (
                    t.vec * elem == VECTOR_BYTES
                    or t.vec == t.width
                    or (n * elem % VECTOR_BYTES and n % t.vec == 0 and (n // t.vec) % 2)
                ), (n, elem, t)
                assert n % t.vec == 0, (n, elem, t)
                # threads and warps along N never exceed the tile: no lane holds a copy of another's
                assert t.vec * t.threads[1] * t.warps[1] <= t.width, (n, elem, t)
                assert p.pieces * t.width >= n, (n, elem, p)
                if p.pieces == 1:
                    assert t.width == next_pow2(n)
                else:
                    assert (p.pieces - 1) * t.width < n, (n, elem, p)


def test_small_rows_take_tens_of_rows_per_program():
    """QK-norm's rows (N = 64-512 of 16-bit x): a program moves at least 1 KB of x per warp, each
    lane more than one 16-byte vector of it, so that a million rows are not a million tiny loads."""
    from impls.gluon.plan import VECTOR_BYTES, WARP, plan

    for n in (64, 128, 256, 512):
        for direction in ("fwd", "bwd"):
            t = plan(direction, n, 2).tile
            assert t.vec * 2 == VECTOR_BYTES and t.rows * n * 2 >= 1024 * t.num_warps, (n, direction, t)
            assert t.rows * n >= 2 * t.vec * WARP * t.num_warps, (n, direction, t)


def test_layernorm_backward_takes_two_rows_a_program_on_8_warp_rows():
    """LayerNorm's backward of 16-bit rows in a 4096-wide tile (8 warps) moves two rows a program;
    the RMSNorm kernels' (the fused add's too), fp32 rows and 16-warp tiles keep one."""
    from impls.gluon.plan import plan

    for n in (2304, 2880, 3072, 3584, 4096):
        ln, rms = plan("bwd", n, 2, layernorm=True).tile, plan("bwd", n, 2).tile
        assert (ln.rows, ln.warps) == (2, (2, 8)) and (rms.rows, rms.warps) == (1, (1, 8)), (n, ln, rms)
        assert plan("bwd", n, 4, layernorm=True).tile.rows == 1
        assert plan("fwd", n, 2, layernorm=True) == plan("fwd", n, 2)
    for n in (4001, 5120, 8192):
        assert plan("bwd", n, 2, layernorm=True).tile.rows == 1


def test_resident_programs_count_the_binding_limit():
    from harness.spec.occupancy import resident_programs

    assert resident_programs(4, 32, 0) == 16  # threads: 2048 / 128
    assert resident_programs(4, 128, 0) == 4  # registers: 65536 / (128 * 128)
    assert resident_programs(16, 128, 1024) == 1
    assert resident_programs(4, 40, 100 * 1024) == 2  # shared memory
    assert resident_programs(1, 16, 0) == 32  # at most 32 programs


def test_the_backward_grid_reads_the_binary_once_per_key(monkeypatch):
    """The persistent backward's programs per SM come from the compiled binary's registers and
    shared memory, compiled once per key; without a GPU, the thread limit's count."""
    from types import SimpleNamespace

    from harness.spec.occupancy import resident_programs
    from impls.gluon import kernels
    from impls.gluon.plan import programs_per_sm, tile

    warmed = []

    class Binary:
        n_regs, metadata = 128, SimpleNamespace(shared=1024)

        def _init_handles(self):
            pass

    class Kernel:
        def warmup(self, grid, **kwargs):
            warmed.append(kwargs["num_warps"])
            return Binary()

    monkeypatch.setattr(kernels, "_RESIDENT", {})
    t = tile(128, 2, direction="bwd")
    for _ in range(3):
        assert kernels._resident(Kernel(), {}, {}, t, ("key",), True) == resident_programs(4, 128, 1024) == 4
    assert warmed == [t.num_warps]
    assert kernels._resident(Kernel(), {}, {}, t, ("other",), False) == programs_per_sm(t) == 16
    assert warmed == [t.num_warps]


def test_spread_slices_cover_16_bit_rows_between_one_program_and_the_wide_slices():
    """16-bit rows in 16-byte vectors above ``BWD_ROW_MAX`` and within ``SPREAD_SLICES``' bounds
    take narrow exchanging slices, several programs per SM; fp32 rows, odd widths and wider rows
    keep the 8192-column slices."""
    from impls.gluon import plan as P

    for layernorm, bounds in P.SPREAD_SLICES.items():
        low = P.BWD_ROW_MAX + 8
        for (most_n, columns, warps, per_sm), first in zip(bounds, (low, *(b[0] + 8 for b in bounds))):
            for n in (first, most_n):
                p = P.plan("bwd", n, 2, layernorm)
                assert (p.tile.width, p.tile.num_warps, p.per_sm, p.exchange) == (columns, warps, per_sm, True), (n, p)
                assert p.pieces == -(-n // columns) and p.tile.rows == 1 and p.tile.vec == 8
        wider = P.plan("bwd", bounds[-1][0] * 2, 2, layernorm)
        assert wider.tile.width == P.BWD_SLICE and wider.per_sm == 1
        for n, elem_size in ((12288, 4), (10001, 2)):  # fp32 rows; no 16-byte vectors
            assert P.plan("bwd", n, elem_size, layernorm).per_sm == 1
    assert P.plan("bwd", P.BWD_ROW_MAX, 2).pieces == 1


@pytest.mark.parametrize("held", [1, 3, 4])
def test_spread_slices_grid_stays_resident(monkeypatch, held):
    """The exchanging siblings must all be resident: the grid is at most the plan's programs per SM
    and at most what the binary lets an SM hold (``_resident``), in whole row groups."""
    from impls.gluon import kernels as k
    from impls.gluon.plan import plan

    launched = []
    monkeypatch.setattr(
        k, "_launch", lambda kernel, grid, args, constexprs, warps: launched.append((kernel, grid, constexprs))
    )
    monkeypatch.setattr(k, "sm_count", lambda device: 132)
    monkeypatch.setattr(k, "_resident", lambda *args: held)
    for n in (12288, 24576):
        for layernorm, fused in ((False, False), (True, False), (False, True)):
            p = plan("bwd", n, 2, layernorm)
            x = torch.empty(1, n, dtype=torch.bfloat16).expand(2048, n)  # nothing runs: no memory
            launched.clear()
            with k.compile_only():
                k.norm_bwd(
                    x, x if fused else None, x, x[0], x[:, 0].float() if layernorm else None, x[:, 0].float(), layernorm
                )
            (grid,), constexprs = next((g, c) for kern, g, c in launched if kern is k._bwd_kernel)
            assert constexprs["SYNC"] and constexprs["SLICES"] == p.pieces, (n, layernorm)
            want = min(held, p.per_sm) * 132 // p.pieces * p.pieces
            assert grid % p.pieces == 0 and grid == want, (n, layernorm, grid, want)


@pytest.mark.slow
def test_spread_slices_compile_and_wait_within_a_warp(gluon_kernels):
    """The narrow exchanging slices (bf16, N = 12288 and 32768) compile for sm_90a for every op:
    no row-sums kernel, the plan's warps, a barrier-free wait, 128-bit loads."""
    from harness.spec.ptx import spin_barriers
    from impls.gluon.plan import plan

    k = gluon_kernels
    for n in (12288, 32768):
        x = torch.randn(2, n, dtype=torch.bfloat16)
        w = torch.randn(n, dtype=torch.bfloat16)
        for layernorm, fused in ((False, False), (True, False), (False, True)):
            with k.compile_only() as compiled:
                k.norm_bwd(
                    x, x if fused else None, x, w, torch.zeros(2) if layernorm else None, torch.ones(2), layernorm
                )
            names = [c.metadata.name for c in compiled]
            assert names == ["_bwd_kernel", "_sum_partials_kernel"], (n, layernorm, fused, names)
            main = compiled[0]
            assert main.metadata.num_warps == plan("bwd", n, 2, layernorm).tile.num_warps
            assert spin_barriers(main.asm["ptx"]) == 0, (n, layernorm, fused)
            assert "ld.global.v4" in main.asm["ptx"], (n, layernorm, fused)


# ------------------------------------- the wide forward: column slices exchanging their statistics
FWD_OPS = ("rmsnorm", "layernorm", "add_rmsnorm")
WIDE_FWD_N = (16384, 24576, 32768, 49152, 65536, 131072, 262144)
FWD_CALLS = {
    "rmsnorm": lambda k, x, w, b: k.rmsnorm_fwd(x, w, 1e-5),
    "layernorm": lambda k, x, w, b: k.layernorm_fwd(x, w, b, 1e-5),
    "add_rmsnorm": lambda k, x, w, b: k.add_rmsnorm_fwd(x, x, w, 1e-5),
}


def _pin_fwd_exchange(monkeypatch, n: int, elem_size: int, entry: tuple) -> None:
    """``plan.FWD_EXCHANGE`` with ``entry`` for every op at n's bucket, as a pin or an experiment sets it."""
    from impls.gluon import plan as P

    monkeypatch.setattr(P, "FWD_EXCHANGE", {(op, elem_size, P.next_pow2(n)): entry for op in FWD_OPS})


def _spy_launches(monkeypatch, k) -> list:
    """(kernel, grid, args, constexprs) of every launch from here on; nothing runs or compiles."""
    launched = []

    def record(kernel, grid, args, constexprs, warps):
        launched.append((kernel, grid, args, constexprs))

    monkeypatch.setattr(k, "_launch", record)
    return launched


def test_the_forward_exchanges_only_where_an_entry_pins_it(monkeypatch):
    """The plan's ``FWD_EXCHANGE`` entries (RMSNorm and the fused add, 16-bit rows of 49152-131072
    columns: where the exchange measured faster) launch ``_fwd_sliced_kernel``; every other op,
    width and dtype launches ``_fwd_kernel`` (whole row or chunked), as before the exchanging slices
    existed."""
    from impls.gluon import kernels as k
    from impls.gluon import plan as P

    assert set(P.FWD_EXCHANGE) == {(op, 2, b) for op in ("rmsnorm", "add_rmsnorm") for b in (65536, 131072)}
    launched = _spy_launches(monkeypatch, k)
    monkeypatch.setattr(k, "sm_count", lambda device: 132)
    for n in WIDE_FWD_N:
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.empty(1, n, dtype=dtype).expand(4, n)  # nothing runs: no memory
            w = torch.empty(n, dtype=dtype)
            for op, call in FWD_CALLS.items():
                pinned = op != "layernorm" and dtype == torch.bfloat16 and 32768 < n <= 131072
                assert (P.fwd_exchange_plan(op, n, x.element_size()) is not None) == pinned, (op, n, dtype)
                launched.clear()
                with k.compile_only():
                    call(k, x, w, w)
                assert [kern for kern, *_ in launched] == [k._fwd_sliced_kernel if pinned else k._fwd_kernel], (op, n, dtype)
                if not pinned:
                    assert launched[0][3]["CHUNKED"] == P.plan("fwd", n, x.element_size()).wide


def test_fwd_exchange_plan_reads_its_entry():
    """An entry's slice tile (a warp's lanes along N in 16-byte vectors, its warps along N, its rows
    within each thread), the slices and programs per SM; none for rows off 16-byte vectors or with
    more slices than a warp holds slots; a malformed entry raises."""
    from impls.gluon import plan as P

    before = P.FWD_EXCHANGE
    try:
        P.FWD_EXCHANGE = {("layernorm", 2, 32768): (4096, 4, 2, 2), ("rmsnorm", 4, 262144): (4096, 8, 1, 1)}
        p = P.fwd_exchange_plan("layernorm", 24576, 2)
        t = p.tile
        assert (t.width, t.vec, t.threads, t.warps, t.rows, p.pieces, p.per_sm, p.exchange) == (
            4096, 8, (1, 32), (1, 4), 2, 6, 2, True
        )  # fmt: skip
        assert P.fwd_exchange_plan("layernorm", 20001, 2) is None  # no 16-byte vectors
        assert P.fwd_exchange_plan("rmsnorm", 24576, 2) is None  # no entry for this op
        assert P.fwd_exchange_plan("layernorm", 24576, 4) is None  # nor for fp32 rows
        assert P.fwd_exchange_plan("rmsnorm", 262144, 4).pieces == 64  # 64 slots of 128 a warp holds
        P.FWD_EXCHANGE = {("rmsnorm", 4, 262144): (1024, 8, 1, 1)}
        assert P.fwd_exchange_plan("rmsnorm", 262144, 4) is None  # 256 slices: more slots than a warp holds
        for bad in ((3072, 4, 1, 1), (1024, 8, 1, 1), (4096, 4, 0, 1)):
            P.FWD_EXCHANGE = {("rmsnorm", 2, 32768): bad}
            with pytest.raises(ValueError, match="FWD_EXCHANGE entry"):
                P.fwd_exchange_plan("rmsnorm", 32768, 2)
    finally:
        P.FWD_EXCHANGE = before


@pytest.mark.parametrize("entry", [(8192, 8, 1, 1), (4096, 4, 1, 2), (4096, 8, 2, 2)])
@pytest.mark.parametrize("held", [1, 3])
def test_exchanging_forward_grid_keeps_every_sibling_resident(monkeypatch, entry, held):
    """Pinned, the forward launches G row groups x S slices: G from ``exchange_groups`` over the SMs
    times the programs each holds (the entry's, no more than the binary allows), so that every
    sibling is resident; its slots zeroed int64, one plane per posted statistic. Where the slices
    outnumber those programs the old forward runs."""
    from harness.spec.occupancy import exchange_groups
    from impls.gluon import kernels as k
    from impls.gluon import plan as P

    launched = _spy_launches(monkeypatch, k)
    monkeypatch.setattr(k, "sm_count", lambda device: 132)
    monkeypatch.setattr(k, "_resident", lambda *args: held)
    for n in (24576, 65536):
        _pin_fwd_exchange(monkeypatch, n, 2, entry)
        x = torch.empty(1, n, dtype=torch.bfloat16).expand(512, n)
        w = torch.empty(n, dtype=torch.bfloat16)
        for op, call in FWD_CALLS.items():
            p = P.fwd_exchange_plan(op, n, 2)
            launched.clear()
            with k.compile_only():
                call(k, x, w, w)
            ((kernel, (grid,), args, constexprs),) = launched
            assert kernel is k._fwd_sliced_kernel, (op, n)
            per_sm = min(entry[3], held)
            groups = exchange_groups(-(-512 // entry[2]), p.pieces, per_sm * 132)
            assert grid == groups * p.pieces and 0 < grid <= per_sm * 132, (op, n, grid)
            assert args["SLICES"] == p.pieces == -(-n // entry[0]) and constexprs["ROWS"] == entry[2]
            assert constexprs["SLOTS"] >= p.pieces and constexprs["BLOCK_N"] == entry[0]
            for plane in ("SUMS", "M2S"):
                assert args[plane].dtype == torch.int64 and args[plane].shape == (512, p.pieces)
                assert not args[plane].any()
            assert (args["SUMS"].data_ptr() != args["M2S"].data_ptr()) == (op == "layernorm")
    # 256 slices of 256 columns: more than 132 SMs hold at once -> the one-program-a-row forward
    _pin_fwd_exchange(monkeypatch, 65536, 2, (256, 1, 1, 1))
    x = torch.empty(1, 65536, dtype=torch.bfloat16).expand(512, 65536)
    launched.clear()
    with k.compile_only():
        k.rmsnorm_fwd(x, None, 1e-5)
    assert [kern for kern, *_ in launched] == [k._fwd_kernel]


def test_plan_rejects_bad_arguments():
    from impls.gluon.plan import plan, tile

    with pytest.raises(ValueError, match="direction"):
        plan("sideways", 64, 2)
    with pytest.raises(ValueError, match="N must be"):
        plan("fwd", 0, 2)
    with pytest.raises(ValueError, match="power of two"):
        tile(1000, 2)


# ---------------------------------------------------------------------------- compile for sm_90a
@pytest.fixture(scope="module")
def gluon_kernels():
    """The kernels module, after checking that one kernel compiles here; a skip with the exact
    reason when the toolchain (Triton's compiler or its ptxas) cannot."""
    from impls.gluon import kernels

    compiled = compiling_or_skip(kernels, "Gluon cannot compile for sm_90a")
    assert compiled and compiled[0].asm.get("cubin")
    return kernels


# bf16 x with fp32 weights at every regime; fp32 on its own three (narrow, mid, chunked forward);
# fp16 (the same plans as bf16) on two
COMPILES = [(n, "bf16", "fp32") for n in sorted(REGIMES)] + [(n, "fp32", "fp32") for n in (7, 2880, 20001)]
COMPILES += [(n, "fp16", "fp16") for n in (2880, 262144)]


@pytest.mark.slow
@pytest.mark.parametrize("n,dtype,param_dtype", COMPILES, ids=[f"{n}-{d}-{p}weight" for n, d, p in COMPILES])
def test_every_kernel_compiles_for_sm90a(gluon_kernels, n, dtype, param_dtype):
    """Each op and direction compiles to a cubin through the host code the GPU runs, with
    128-bit global accesses wherever the row stride allows them."""
    from harness.spec.ptx import spin_barriers
    from impls.gluon.plan import plan

    k = gluon_kernels
    shape = REGIMES[n]
    x, dy, w, b, s = inputs(shape, DTYPES[dtype], DTYPES[param_dtype])
    runs = [(op_dir, call, True) for op_dir, call in CALLS.items()]
    runs += [(op_dir, call, False) for op_dir, call in CALLS.items() if op_dir[1] != "fwd"]
    for (op, direction), call, exchange in runs:
        wide = plan(direction[:3], n, x.element_size()).wide
        if not exchange and not wide:
            continue
        before, k.EXCHANGE = k.EXCHANGE, exchange
        try:
            with k.compile_only() as compiled:
                call(k, x, dy, w, b, s)
        finally:
            k.EXCHANGE = before
        names = [c.metadata.name for c in compiled]
        if direction == "fwd":
            assert names == ["_fwd_kernel"], (op, names)
        else:
            # wide rows: the slices exchange their row sums, or (EXCHANGE off) a first kernel sums them
            swaps = exchange and plan("bwd", n, x.element_size(), op == "layernorm").exchange
            main = (["_bwd_row_sums_kernel"] if wide and not swaps else []) + ["_bwd_kernel"]
            assert names == main + ["_sum_partials_kernel"], (op, direction, names)
            # the wait for the siblings runs within each warp: no barrier in its loop
            waits = spin_barriers(compiled[-2].asm["ptx"])
            assert waits == (0 if wide and swaps else None), (op, direction, exchange, waits)
        for c in compiled:
            assert len(c.asm["cubin"]) > 1000, (op, direction, c.metadata.name)
            ptx = c.asm["ptx"]
            assert ".target sm_90a" in ptx
            if x.stride(0) * x.element_size() % 16 == 0 and c.metadata.name != "_sum_partials_kernel":
                assert "ld.global.v4" in ptx, f"{op} {direction} {c.metadata.name}: no 128-bit loads"


@pytest.mark.slow
def test_many_slices_exchange_on_8_warps_and_wait_within_a_warp(gluon_kernels):
    """From ``EXCHANGE_WIDE`` slices the exchanging backward takes 8-warp slice programs; every
    wait loop of theirs is barrier-free; past ``EXCHANGE_SLICES`` the row-sums kernel returns."""
    from harness.spec.ptx import spin_barriers
    from impls.gluon import plan as P

    k = gluon_kernels
    for n, exchange in ((131072, True), (262144, False)):
        x = torch.randn(2, n, dtype=torch.bfloat16)
        w = torch.randn(n, dtype=torch.bfloat16)
        for layernorm in (False, True):
            with k.compile_only() as compiled:
                k.norm_bwd(x, None, x, w, torch.zeros(2) if layernorm else None, torch.ones(2), layernorm)
            names = [c.metadata.name for c in compiled]
            main = compiled[names.index("_bwd_kernel")]
            assert ("_bwd_row_sums_kernel" in names) != exchange, (n, layernorm, names)
            assert main.metadata.num_warps == (P.BWD_SLICE_WARPS if exchange else 16), (n, layernorm)
            assert spin_barriers(main.asm["ptx"]) == (0 if exchange else None), (n, layernorm)


@pytest.mark.slow
def test_layernorm_backward_waits_once_for_both_sums_up_to_the_paired_limit(gluon_kernels):
    """LayerNorm's exchanging backward, compiled for sm_90a: one wait loop polling both planes of
    sums up to ``PAIRED_SLICES_MAX`` slices a row (49152 columns: 12), and a loop per plane past it
    (131072: 16), each loop polling one plane's slots; RMSNorm's one loop either way."""
    from harness.spec.ptx import poll_loops
    from impls.gluon import plan as P

    k = gluon_kernels
    loops = {}
    for n in (49152, 131072):
        x = torch.randn(2, n, dtype=torch.bfloat16)
        w = torch.randn(n, dtype=torch.bfloat16)
        for layernorm in (False, True):
            with k.compile_only() as compiled:
                k.norm_bwd(x, None, x, w, torch.zeros(2) if layernorm else None, torch.ones(2), layernorm)
            main = compiled[[c.metadata.name for c in compiled].index("_bwd_kernel")]
            loops[(n, layernorm)] = poll_loops(main.asm["ptx"])
    assert P.plan("bwd", 49152, 2, True).pieces <= k.PAIRED_SLICES_MAX < P.plan("bwd", 131072, 2, True).pieces
    one_plane = loops[(131072, False)]
    assert len(one_plane) == 1 and len(loops[(49152, False)]) == 1, loops
    assert loops[(49152, True)] == [2 * loops[(49152, False)][0]], loops  # both planes, one loop
    assert loops[(131072, True)] == one_plane * 2, loops  # a loop per plane


@pytest.mark.slow
def test_small_rows_and_head_views_compile_with_128_bit_accesses(gluon_kernels):
    """QK-norm's rows (N = 128, the small-row tile) as (M, N) rows and as (T, NH, N) views of 3 of 7
    heads (two row strides): every kernel compiles for sm_90a, with 128-bit loads."""
    k = gluon_kernels
    parent = torch.randn(4, 7, 128).to(torch.bfloat16)
    w, b = torch.ones(128, dtype=torch.bfloat16), torch.zeros(128, dtype=torch.bfloat16)
    for x in (parent.reshape(28, 128), parent[:, :3]):
        dy = torch.randn(x.shape).to(torch.bfloat16)
        s = torch.ones(x.numel() // 128)
        for (op, direction), call in CALLS.items():
            with k.compile_only() as compiled:
                call(k, x, dy, w, b, s)
            for c in compiled:
                if c.metadata.name != "_sum_partials_kernel":
                    assert "ld.global.v4" in c.asm["ptx"], f"{op} {direction} {tuple(x.shape)} {c.metadata.name}"


def test_compile_only_leaves_nothing_launched(gluon_kernels):
    """Outside ``compile_only`` a CPU tensor reaches a real launch, which fails loudly (no GPU)."""
    assert_compile_only_launches_nothing(gluon_kernels)


class _Raising:
    """A kernels module whose compile raises ``error``."""

    def __init__(self, error):
        self.error = error

    def compile_only(self):
        return contextlib.nullcontext([])

    def rmsnorm_fwd(self, *args):
        raise self.error


def _chained(outer, cause):
    try:
        raise outer from cause
    except ValueError as e:
        return e


@pytest.mark.parametrize(
    "error,skips",
    [
        (RuntimeError("Cannot find ptxas"), True),
        (FileNotFoundError("'tileiras' compiler not found, make sure it is available as a python package"), True),
        (_chained(ValueError("compiling _fwd_kernel"), RuntimeError("Cannot find ptxas")), True),
        # what the suite once skipped on: the compiler itself broken by an earlier test
        (RuntimeError("at 9:11:\n    rows = gl.program_id(0) * ROWS"), False),
        (RuntimeError("Cannot find ptxas-blackwell"), False),
        (ValueError("Cannot find ptxas"), False),
        (FileNotFoundError("[Errno 2] No such file or directory: 'cuobjdump'"), False),
        (TypeError("BlockedLayout.__init__() got an unexpected keyword argument"), False),
    ],
    ids=["no-ptxas", "no-tileiras", "no-ptxas-under-a-wrapper", "compile-error", "other-tool", "other-type",
         "other-file", "api-change"],
)  # fmt: skip
def test_a_compile_error_skips_only_for_a_missing_compiler(error, skips):
    """compiling_or_skip: a skip names the compiler this machine lacks; any other error is the
    test's failure (a skip would hide the kernels' compile coverage)."""
    with pytest.raises(BaseException) as raised:
        compiling_or_skip(_Raising(error), "X")
    if skips:
        assert isinstance(raised.value, pytest.skip.Exception), raised.value
        assert "Cannot find ptxas" in str(raised.value) or "tileiras" in str(raised.value)
    else:
        assert raised.value is error, f"{type(raised.value).__name__}: {raised.value}"


def test_a_layout_of_64_threads_per_warp_fails_to_compile_as_a_failure(monkeypatch):
    """A mutant plan: BlockedLayouts whose threads per warp multiply to 64 on a 32-thread warp.
    Its compile fails, and compiling_or_skip reports that as an error, not a skip."""
    from impls.gluon import kernels, plan

    monkeypatch.setattr(plan, "WARP", 64)
    assert plan.tile(1024, 2).threads[0] * plan.tile(1024, 2).threads[1] == 64
    with pytest.raises(BaseException) as raised:
        compiling_or_skip(kernels, "Gluon cannot compile for sm_90a")
    assert not isinstance(raised.value, pytest.skip.Exception), f"skipped: {raised.value}"


ORDER_PROBE = """
import torch
import triton
import triton.language as tl


@triton.jit
def _row_sum(X, N: tl.constexpr):
    x = tl.load(X + tl.arange(0, N))
    tl.store(X, tl.sum(x, axis=0))  # tl.sum: a Triton function the interpreter calls in the kernel


def test_a_kernel_in_the_interpreter():
    x = torch.ones(16)
    _row_sum[(1,)](x, 16)
    assert x[0] == 16


def test_gluon_then_compiles_for_sm90a():
    from impls.gluon import kernels
    from tests.gpu_only_dsl import compiling_or_skip

    assert compiling_or_skip(kernels, "Gluon")
"""


@pytest.mark.slow
@pytest.mark.skipif(HAS_CUDA, reason="the interaction is the CPU interpreter's")
def test_gluon_compiles_after_an_interpreted_kernel_in_the_same_process(tmp_path):
    """In the suite's order (a Triton kernel run in the interpreter, then the Gluon compile), in a
    fresh process under this suite's conftest, with an empty compile cache (a warm one hides a
    broken compiler: it is never called)."""
    (tmp_path / "test_order.py").write_text(ORDER_PROBE)
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "cache"), "TRITON_INTERPRET": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest", "-rs", str(tmp_path / "test_order.py")],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=600,
    )  # fmt: skip
    summary = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr[-2000:]
    assert out.returncode == 0 and "2 passed" in summary and "skipped" not in summary, out.stdout[-4000:]


# ---------------------------------------------- against fp64: on a GPU, or layout-erased on the CPU
@pytest.fixture(scope="module")
def contract():
    """The contract functions, validated by the harness: on a GPU the Gluon kernels themselves;
    on the CPU the same kernels' code under Triton's interpreter with layouts erased
    (impls/gluon/interpret.py), which checks everything but the layouts."""
    import dataclasses

    from harness.registry import get
    from harness.spec.contract import package

    impl = get("gluon")
    if HAS_CUDA:
        return impl, impl.kernels("cuda")
    import triton

    if tuple(int(v) for v in triton.__version__.split(".")[:2]) < (3, 9):
        pytest.skip(
            f"the layout-erased CPU run needs Triton's interpreter from 3.9 (CI's); {triton.__version__}'s "
            "keeps loop bounds as 1-element arrays, which Python's range() refuses"
        )
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the layout-erased CPU run needs TRITON_INTERPRET=1 (set by tests/conftest.py without a GPU)")
    erased = dataclasses.replace(
        impl, name="gluon-layouts-erased", devices=("cpu",), entry="impls.gluon.interpret:erased_contract",
        interpreter="TRITON_INTERPRET", requires=(package("triton"),),
    )  # fmt: skip
    return erased, erased.kernels("cpu")


# On the CPU the interpreter pays per program: every row regime, few rows. Beside the smoke rows:
# a strided 3-D case, per-head views read in place (two row strides), 19 row blocks over 16 persistent programs (some walk two: the backward's
# loop), the backward's column slices (N = 20001: 3 slices; fp32's forward chunks), bf16's forward
# chunks (N = 262144; its backward slices are N = 20001's path, 14 s more in the interpreter).
_EDGE = {s.label: s for s in SHAPE_SETS["edge"]}
CPU_SHAPES = tuple(s for s in SHAPE_SETS["smoke"] if s.m == 3) + tuple(
    _EDGE[label] for label in ("2x5x1003:column-slice", "5x3x96:head-slice-7", "37x1001", "3x20001", "2x262144")
)
# other dtypes than bf16: the smoke rows and the wide path
CPU_SHAPES_OTHER = tuple(s for s in CPU_SHAPES if s.m == 3 and s.n != 1000)


def _shapes(dtype, direction="fwd"):
    if HAS_CUDA:
        return SHAPE_SETS["smoke"] + SHAPE_SETS["edge"]
    shapes = CPU_SHAPES if dtype == "bf16" else CPU_SHAPES_OTHER
    return tuple(s for s in shapes if direction == "fwd" or s.n != 262144)


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
@pytest.mark.parametrize("op", ["rmsnorm", "layernorm"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_norms_against_fp64(contract, op, direction, dtype):
    """The harness's own check (harness.run.checker.run_check), every shape regime."""
    from harness.run.checker import run_check

    impl, k = contract
    bad = []
    for shape in _shapes(dtype, direction):
        r = run_check(impl, op, direction, shape, dtype, DEVICE, kernels=k)
        if not r.passed:
            bad.append(f"{shape.label}: {r.status} {r.summary()}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("dtype,param_dtype", [("bf16", "x"), ("bf16", "fp32"), ("fp16", "fp32"), ("fp32", "x")])
def test_add_rmsnorm_against_fp64(contract, dtype, param_dtype):
    """y, residual_out (the sum rounded to x's dtype), rstd, and dh with and without
    dresidual_out, dweight in the weight's dtype."""
    _, k = contract
    # bf16 with fp32 weights on every CPU shape, the other pairs on the smoke rows and the wide path
    for shape in _shapes("bf16" if (dtype, param_dtype) == ("bf16", "fp32") else "other", "bwd"):
        bad = add_rmsnorm_failures(k, shape, dtype, param_dtype, DEVICE)
        assert not bad, f"{shape.label} {dtype} weight {param_dtype}: {bad}"


@pytest.mark.parametrize("op", ["rmsnorm", "layernorm"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_fp32_weights_beside_16_bit_x(contract, op, dtype):
    """y, dx in x's dtype; dweight, dbias in fp32 (the weight's), all against fp64."""
    _, k = contract
    for shape in _shapes(dtype, "bwd"):
        case = make_case(op, shape, DTYPES[dtype], DEVICE, seed=4)
        x, dy, eps, n = case["x"], case["dy"], case["eps"], shape.n
        w = case["weight"].float()
        b = case["bias"].float() if case["bias"] is not None else None
        fwd_args = (x, w, b, eps) if op == "layernorm" else (x, w, eps)
        ref = getattr(reference, f"{op}_fwd")(*fwd_args)
        with poisoned_allocations():
            out = getattr(k, f"{op}_fwd")(*fwd_args)
        stats = ref[1:]  # (mean, rstd) or (rstd,)
        dref = getattr(reference, f"{op}_bwd")(dy, x, w, *stats)
        with poisoned_allocations():
            dout = getattr(k, f"{op}_bwd")(dy, x, w, *(s.float() for s in stats))
        xc = rows_of(x, n).double() - stats[0].reshape(-1, 1) if op == "layernorm" else rows_of(x, n)
        dx_scale, dw_scale = rms_bwd_scales(rows_of(dy, n), xc, w, ref[-1], None)
        scales = (dx_scale.reshape(x.shape), dw_scale, rows_of(dy, n).double().square().sum(0).sqrt())
        reports = [compare("y", out[0], ref[0], x.dtype, x.shape)]
        names, dtypes, shapes_ = ("dx", "dweight", "dbias"), (x.dtype, torch.float32, torch.float32), (x.shape, w.shape, w.shape)
        reports += [compare(*a) for a in zip(names, dout, dref, dtypes, shapes_, scales)]
        bad = [f"{r.name}: {r.reason}" for r in reports if not r.passed]
        assert not bad, f"{op} {shape.label} {dtype}: {bad}"


@pytest.mark.parametrize("n", [64, 20001])  # the row-in-registers paths; the backward's column slices
@pytest.mark.parametrize("op", ["rmsnorm", "layernorm"])
def test_overflowing_statistics_give_nan_not_a_finite_value(contract, op, n):
    """bf16 rows near 1e30: x^2 overflows fp32. torch's LayerNorm returns NaN there (on the CPU at
    N = 64; at N = 20001 it returns the bias, a finite wrong value), its rms_norm returns 0: here both
    give NaN in y and, through the saved rstd, in dx, at every N; the rows beside stay finite."""
    _, k = contract
    assert_overflowed_rows_are_nan(k, op, n, DEVICE)


# ------------------------------------------ rows of an odd width: the realigned kernels
# 37 x 1001: every offset of a row within a 16-byte vector, 8 persistent programs on the CPU (one
# per offset), each walking several tiles, its last one partly past M. The 1024 bucket has no
# realigned entry in the plan (its rows take the element-wise kernels), so these tests give it one,
# of one or of two rows a program.
ODD_SHAPE = Shape((37, 1001))


def _realigned_rule(rows: int) -> dict:
    from impls.gluon import plan as P

    ops = ("rmsnorm", "layernorm", "add_rmsnorm")
    return {**P.REALIGNED, **{(d, op, 1024): (rows, 4, 2) for d in ("fwd", "bwd") for op in ops}}


def _launched(monkeypatch) -> list:
    """The names of the kernels the Gluon host code launches from here on."""
    from impls.gluon import kernels

    names, launch = [], kernels._launch

    def spy(kernel, grid, *args):
        names.append(kernel.fn.__name__)
        return launch(kernel, grid, *args)

    monkeypatch.setattr(kernels, "_launch", spy)
    return names


@pytest.mark.parametrize("dtype,rows", [("bf16", 1), ("fp16", 2)])
def test_realigned_rows_against_fp64(contract, monkeypatch, dtype, rows):
    """Every op and direction on the realigned kernels, against fp64 (the harness's check): weights
    in x's dtype, in fp32, and none (the fused add's backward then without dresidual_out). The
    fused add's bf16 forward on the CPU as ``test_add_rmsnorm_against_fp64`` checks it (the
    interpreter truncates h), with and without dresidual_out."""
    from harness.run.checker import run_check
    from impls.gluon import kernels, plan

    monkeypatch.setattr(plan, "REALIGNED", _realigned_rule(rows))
    impl, k = contract
    launched = _launched(monkeypatch)
    x = torch.empty(ODD_SHAPE.dims, dtype=DTYPES[dtype])
    bad = []
    for op in ("rmsnorm", "layernorm", "add_rmsnorm"):
        for direction in ("fwd", "bwd"):
            assert kernels.realigned(direction, op, ODD_SHAPE.n, 0, (x,))[0], (op, direction)
            main = "_fwd_odd_kernel" if direction == "fwd" else "_bwd_odd_kernel"
            if (op, direction, dtype) == ("add_rmsnorm", "fwd", "bf16") and not HAS_CUDA:
                for param_dtype in ("x", "fp32"):
                    launched.clear()
                    failures = add_rmsnorm_failures(k, ODD_SHAPE, dtype, param_dtype, DEVICE)
                    bad += [f"{op} weights {param_dtype}: {b}" for b in failures]
                    assert {"_fwd_odd_kernel", "_bwd_odd_kernel"} <= set(launched), (op, launched)
                continue
            for affine, weights in ((True, "same"), (True, "fp32"), (False, "same")):
                launched.clear()
                r = run_check(impl, op, direction, ODD_SHAPE, dtype, DEVICE, affine=affine, weights=weights, kernels=k)
                if not r.passed:
                    bad.append(f"{op} {direction} weights={weights if affine else None}: {r.status} {r.summary()}")
                assert main in launched, (op, direction, launched)
    assert not bad, "\n".join(bad)


def test_realigned_rows_are_16_bit_whole_rows_of_one_stride_and_aligned_starts(monkeypatch):
    """The realigned kernels take 16-bit (M, N) rows of an odd width that the plan realigns, every
    row tensor of one stride from a 16-byte aligned start; anything else keeps the element-wise
    kernels. Their grid is a multiple of 8 (a program's rows keep one offset within a vector)."""
    from impls.gluon import kernels as K
    from impls.gluon import plan as P

    bf16 = torch.bfloat16
    x = torch.empty(37, 2047, dtype=bf16)
    r, stride = K.realigned("fwd", "rmsnorm", 2047, 0, (x, torch.empty_like(x)))
    assert stride == 2047 and r == P.realigned_plan("fwd", "rmsnorm", 2047, 2) and r.tile.vec == 8
    assert K.realigned("bwd", "add_rmsnorm", 4001, 0, (torch.empty(3, 4001, dtype=torch.float16),) * 4)[1] == 4001
    refused = {
        "an unaligned start": (2047, 0, (x, torch.empty(37 * 2047 + 1, dtype=bf16)[1:].view(37, 2047))),
        "unequal strides": (2047, 0, (x, torch.empty(37, 2048, dtype=bf16)[:, :2047])),
        "per-head views": (2047, 5, (x, x)),
        "a 3-D tensor beside (M, N) rows": (2047, 0, (x, torch.empty(37, 1, 2047, dtype=bf16))),
        "whole vectors already": (2048, 0, (torch.empty(3, 2048, dtype=bf16),) * 2),
        "fp32 rows": (2047, 0, (torch.empty(3, 2047),) * 2),
        "a bucket the plan keeps element-wise": (1001, 0, (torch.empty(3, 1001, dtype=bf16),) * 2),
    }
    for why, (n, heads, tensors) in refused.items():
        assert K.realigned("fwd", "rmsnorm", n, heads, tensors) == (None, 0), why
    # rows too wide for one program (the backward's slices) stay element-wise whatever the entries
    monkeypatch.setattr(P, "REALIGNED", {**P.REALIGNED, ("bwd", "rmsnorm", 16384): (1, 16, 1)})
    wide = (torch.empty(2, 16383, dtype=bf16),) * 2
    assert K.realigned("bwd", "rmsnorm", 16383, 0, wide) == (None, 0)
    assert K.realigned("fwd", "rmsnorm", 16383, 0, wide) == (None, 0)  # (no entry)
    monkeypatch.setattr(K, "SM_COUNT_WITHOUT_GPU", 132)
    for m in (1, 9, 37, 10**6):
        grid = K._realigned_grid(K._fwd_odd_kernel, {"W": x, "B": x}, {}, r, m, x, (False,) * 4)
        assert grid % 8 == 0 and 8 <= grid <= max(8, r.programs_per_sm * 132), (m, grid)
        assert (grid - 8) * r.tile.rows < m, (m, grid)  # no more than the row tiles need


def test_realigned_tiles_keep_their_rows_within_each_thread():
    """Every realigned entry's tile: 16-byte vectors, the entry's warps along N and its rows within
    each thread (the backward's per-tile sums of dw and db over the rows cross no warp)."""
    from impls.gluon import plan as P

    assert P.REALIGNED
    for (direction, op, bucket), (rows, warps, per_sm) in P.REALIGNED.items():
        r = P.realigned_plan(direction, op, bucket - 1, 2)
        t = r.tile
        assert (t.width, t.vec * 2, t.rows, t.num_warps, r.programs_per_sm) == (bucket, 16, rows, warps, per_sm)
        assert t.threads == (1, 32) and t.warps == (1, warps), (direction, op, bucket, t)
        assert P.realigned_plan(direction, op, bucket - 1, 4) is None  # fp32: element-wise


def _vector_accesses(ptx: str) -> int:
    return len(re.findall(r"(?:ld|st)\.global[.\w]*\.v4", ptx))


ODD_COMPILES = [(2047, "bf16", "fp32"), (4001, "bf16", "bf16"), (4001, "fp16", "fp32"), (7001, "bf16", "fp32")]


@pytest.mark.slow
@pytest.mark.parametrize("n,dtype,param_dtype", ODD_COMPILES, ids=[f"{n}-{d}-{p}weight" for n, d, p in ODD_COMPILES])
def test_realigned_kernels_move_16_byte_vectors(gluon_kernels, monkeypatch, n, dtype, param_dtype):
    """Built for sm_90a at an odd N, the plan's realigned kernels load and store 16-byte vectors
    (ld/st.global.v4), every op and direction; the element-wise kernels they replace (the plan
    without realigned entries) have none."""
    from impls.gluon import plan as P

    k = gluon_kernels
    x, dy, w, b, s = inputs(Shape((64, n)), DTYPES[dtype], DTYPES[param_dtype])
    for rule in ("realigned", "element-wise"):
        if rule == "element-wise":
            monkeypatch.setattr(P, "REALIGNED", {})
        for (op, direction), call in CALLS.items():
            with k.compile_only() as compiled:
                call(k, x, dy, w, b, s)
            main = compiled[0]
            want = ("_fwd" if direction == "fwd" else "_bwd") + ("_odd_kernel" if rule == "realigned" else "_kernel")
            assert main.metadata.name == want, (op, direction, rule, [c.metadata.name for c in compiled])
            vectors = _vector_accesses(main.asm["ptx"])
            assert (vectors > 0) == (rule == "realigned"), (op, direction, rule, vectors)


# ------------------------------- the wide forward's exchanging slices: compiled, and against fp64
@pytest.mark.slow
def test_exchanging_forward_compiles_with_one_post_per_statistic_and_a_barrier_free_wait(gluon_kernels, monkeypatch):
    """Pinned (8192-column slices on 8 warps), every op's forward compiles for sm_90a (bf16 rows with
    fp32 weights, fp32 rows) to the slice kernel alone: one atomic exchange per posted statistic
    (LayerNorm two), volatile re-reads of the slots in one wait loop without a barrier (LayerNorm's
    two planes polled together), 128-bit loads;
    its 24 and 32 slices of 16-bit rows share a binary (the slot tile is 32 wide)."""
    from harness.spec.ptx import poll_loops, spin_barriers

    k = gluon_kernels
    monkeypatch.setattr(k, "SM_COUNT_WITHOUT_GPU", 132)  # as on an H100: the grid holds 32 slices
    for n, dtype in ((262144, torch.bfloat16), (196608, torch.bfloat16), (49152, torch.float32)):
        _pin_fwd_exchange(monkeypatch, n, torch.empty(0, dtype=dtype).element_size(), (8192, 8, 1, 1))
        x = torch.randn(2, n).to(dtype)
        w, b = torch.randn(n), torch.randn(n)
        polls = {}
        for op, call in FWD_CALLS.items():
            with k.compile_only() as compiled:
                call(k, x, w, b)
            assert [c.metadata.name for c in compiled] == ["_fwd_sliced_kernel"], (op, n)
            main = compiled[0]
            ptx = main.asm["ptx"]
            assert main.metadata.num_warps == 8
            posts = len(re.findall(r"atom\.global[.\w]*\.exch\.b64", ptx))
            assert posts == (2 if op == "layernorm" else 1), (op, n, posts)
            assert "ld.volatile.global.b64" in ptx and spin_barriers(ptx) == 0, (op, n)
            assert "ld.global.v4" in ptx and "st.global.v4" in ptx, (op, n)
            polls[op] = poll_loops(ptx)
        # one wait loop; LayerNorm's polls both planes in it (twice RMSNorm's loads, one loop)
        assert all(len(p) == 1 for p in polls.values()), (n, polls)
        assert polls["layernorm"][0] == 2 * polls["rmsnorm"][0], (n, polls)


def _fwd_exchange_on_the_cpu(monkeypatch, n: int, elem_size: int, entry: tuple) -> list:
    """Pin ``entry`` at n's bucket, size the CPU run's grid for 8 SMs (two row groups of 4 slices),
    and return the launched kernels' names as they run."""
    from impls.gluon import kernels

    _pin_fwd_exchange(monkeypatch, n, elem_size, entry)
    monkeypatch.setattr(kernels, "SM_COUNT_WITHOUT_GPU", 8)
    return _launched(monkeypatch)


# 4 slices of 512 columns, the last of 464; 9 rows over two row groups (one walks 5 blocks, the
# other 4); and 5 tokens x 3 of 7 heads read in place
FWD_EXCHANGE_N = 2000
FWD_EXCHANGE_SHAPES = (Shape((9, FWD_EXCHANGE_N)), Shape((5, 3, FWD_EXCHANGE_N), "head-slice-7"))


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_exchanging_forward_against_fp64(contract, monkeypatch, dtype):
    """Every op's forward on the exchanging slices (one row a block and two), against fp64 through
    the harness's check (outputs poisoned): weights in x's dtype, in fp32 and none; per-head views;
    the fused add's h bit for bit (``add_rmsnorm_failures``). On the CPU the layout-erased kernel
    runs twice, the second run finding every sibling's post (``_fwd_exchange``)."""
    from harness.run.checker import run_check

    impl, k = contract
    elem_size = DTYPES[dtype].itemsize
    bad = []
    for entry in ((512, 2, 1, 1), (512, 2, 2, 1)) if dtype == "bf16" else ((512, 2, 1, 1),):
        launched = _fwd_exchange_on_the_cpu(monkeypatch, FWD_EXCHANGE_N, elem_size, entry)
        for shape in FWD_EXCHANGE_SHAPES if dtype == "bf16" else FWD_EXCHANGE_SHAPES[:1]:
            for op in ("rmsnorm", "layernorm"):
                variants = ((True, "same"), (False, "same")) + (((True, "fp32"),) if dtype != "fp32" else ())
                for affine, weights in variants if shape.layout == "contiguous" else variants[:1]:
                    launched.clear()
                    r = run_check(impl, op, "fwd", shape, dtype, DEVICE, affine=affine, weights=weights, kernels=k)
                    if not r.passed:
                        bad.append(f"{entry} {op} {shape.label} {weights}, {affine}: {r.status} {r.summary()}")
                    where = (entry, op, shape.label, affine, weights, r.status)
                    assert "_fwd_sliced_kernel" in launched and "_fwd_kernel" not in launched, (where, launched)
            for param_dtype in ("x", "fp32") if dtype != "fp32" else ("x",):
                launched.clear()
                failures = add_rmsnorm_failures(k, shape, dtype, param_dtype, DEVICE)
                bad += [f"{entry} add_rmsnorm {shape.label} weights {param_dtype}: {f}" for f in failures]
                assert "_fwd_sliced_kernel" in launched, launched
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("op", ["rmsnorm", "layernorm"])
def test_exchanging_forward_gives_nan_where_the_statistics_overflow(contract, monkeypatch, op):
    """bf16 rows near 1e30 (x^2 overflows fp32) through the exchanging slices: NaN in that row's y
    and, through its rstd, dx; the rows beside finite."""
    _, k = contract
    launched = _fwd_exchange_on_the_cpu(monkeypatch, FWD_EXCHANGE_N, 2, (512, 2, 1, 1))
    assert_overflowed_rows_are_nan(k, op, FWD_EXCHANGE_N, DEVICE)
    assert "_fwd_sliced_kernel" in launched


@pytest.mark.skipif(HAS_CUDA, reason="the programs' order is the CPU interpreter's")
@pytest.mark.parametrize("op", ["rmsnorm", "layernorm"])
def test_a_sibling_that_never_posts_gives_nan_not_a_hang(contract, monkeypatch, op):
    """The interpreter runs the programs one after another; its first run alone (no re-reads) is a
    sibling that never posted for the earlier slices: their columns of y, and the statistics the
    first slice stores, come back NaN, while the last slice, which found every post, is right."""
    from impls.gluon import kernels

    _, k = contract
    _fwd_exchange_on_the_cpu(monkeypatch, FWD_EXCHANGE_N, 2, (512, 2, 1, 1))
    runs, launch = [], kernels._launch

    def first_run_only(kernel, grid, args, constexprs, warps):
        runs.append(args["SPIN"])
        if len(runs) == 1:
            launch(kernel, grid, args, constexprs, warps)

    monkeypatch.setattr(kernels, "_launch", first_run_only)
    case = make_case(op, Shape((9, FWD_EXCHANGE_N)), torch.bfloat16, DEVICE, seed=6)
    args = (case["x"], case["weight"], *((case["bias"],) if op == "layernorm" else ()), case["eps"])
    with poisoned_allocations():
        out = getattr(k, f"{op}_fwd")(*args)
    ref = getattr(reference, f"{op}_fwd")(*args)
    assert runs == [0, 0]
    y, rstd = out[0], out[-1]
    assert torch.isnan(y[:, :512]).all() and torch.isnan(rstd).all()
    last = slice(3 * 512, FWD_EXCHANGE_N)
    assert compare("y", y[:, last], ref[0][:, last], torch.bfloat16, y[:, last].shape).passed
