"""The FP8 ops (rmsnorm_fp8, add_rmsnorm_fp8: norm + quantization to float8_e4m3fn, per token and
per 1 x 128 block): the exact e4m3 arithmetic of the reference, the contract's group rule, the
checker's rule (tests/fp8_mutants.py: each defect rejected, the same code without it passed, the
unfused baseline's rounding allowed only where declared), every implementation that runs here on a
zero row and on rows whose largest |y| / scale sits at 448, Triton's conversion under its
interpreter, Helion's generated Triton, and the bytes model and benchmark plan of forward-only ops.
The generic checks over every shape set are tests/test_implementations.py's."""

import importlib.util

import numpy as np
import pytest
import torch

from harness.registry import all_implementations
from harness.run.checker import _check_tensors, run_check
from harness.spec.contract import Implementation
from harness.spec.fp8 import AMAX_FLOOR, E4M3_MAX, FP8_DTYPE, GROUP_BLOCK, check_group, e4m3_round, e4m3_step, quantize
from harness.spec.inputs import make_case
from harness.spec.ops import FP8_OPS, expand_ops, get_op
from harness.spec.shapes import Shape

from . import fp8_mutants
from .conftest import DEVICE, HAS_CUDA

SHAPE = Shape((64, 1024))


def _finite_e4m3() -> torch.Tensor:
    """Every finite float8_e4m3fn value, ascending, as fp64 (from the 256 bit patterns)."""
    v = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8_DTYPE).double()
    return torch.unique(v[torch.isfinite(v)])


# ---------------------------------------------------------------- the reference's arithmetic
def test_e4m3_round_is_nearest_even_saturating_and_agrees_with_torch():
    values = _finite_e4m3()
    assert values.max() == E4M3_MAX and len(values) == 253  # 2 * 126 nonzero + one zero (-0 = +0)
    assert torch.equal(e4m3_round(values), values)
    lo, hi = values[:-1], values[1:]
    mid = (lo + hi) / 2
    # a tie goes to the value whose last mantissa bit is 0 (zero counts as even)
    even = torch.where((lo / e4m3_step(lo)).remainder(2) == 0, lo, hi)
    assert torch.equal(e4m3_round(mid), even)
    nudge = (hi - lo) * 2.0**-20
    assert torch.equal(e4m3_round(mid - nudge), lo) and torch.equal(e4m3_round(mid + nudge), hi)
    for past in (448.00003, 463.9, 464.0, 480.0, 1e30):
        assert e4m3_round(torch.tensor([past, -past], dtype=torch.float64)).tolist() == [448.0, -448.0]
    # torch's own cast (round to nearest even, saturating) on random fp32 across every binade
    g = torch.Generator().manual_seed(3)
    v = torch.randn(200_000, generator=g) * torch.exp2(torch.randint(-14, 10, (200_000,), generator=g).float())
    assert torch.equal(e4m3_round(v.double()), v.to(FP8_DTYPE).double())


def test_quantize_floors_a_zero_row_and_rounds_pow2_scales_up():
    y = torch.zeros(3, 256, dtype=torch.float64)
    y[1] = torch.linspace(-3, 5, 256, dtype=torch.float64)
    y[2, :128] = 1e-12  # below the floor: its block's scale is the floor's
    q, scale = quantize(y, 128)
    assert scale.shape == (3, 2) and torch.isfinite(scale).all()
    assert torch.equal(scale[0], torch.full((2,), AMAX_FLOOR / E4M3_MAX, dtype=torch.float64))
    assert (q[0] == 0).all() and (q[2, 128:] == 0).all() and q[1].abs().max() == E4M3_MAX
    # 1e-12 / (1e-10 / 448) = 4.48: nearest e4m3 4.5, no longer 448
    assert scale[2, 0] == AMAX_FLOOR / E4M3_MAX and (q[2, :128] == 4.5).all()
    q2, s2 = quantize(y, 128, pow2_scale=True)
    mantissa, _ = torch.frexp(s2)
    assert (mantissa == 0.5).all() and (s2 >= scale).all() and (s2 < 2 * scale).all()
    assert q2.abs().max() <= E4M3_MAX and q2[1].abs().max() < E4M3_MAX


def test_group_is_n_or_128_dividing_n():
    assert check_group(1000, 1000) == 1000 and check_group(128, 4096) == GROUP_BLOCK
    for bad, n, err in ((128, 1000, ValueError), (64, 4096, ValueError), (True, 1, TypeError), (128.0, 256, TypeError)):
        with pytest.raises(err):
            check_group(bad, n)
    k = all_implementations()["eager"].kernels("cpu")
    x, w = torch.randn(4, 1000).bfloat16(), torch.ones(1000)
    with pytest.raises(ValueError, match="multiple of 128"):
        k.rmsnorm_fp8_fwd(x, w, 1e-5, 128)
    with pytest.raises(ValueError, match="group must be N"):
        k.add_rmsnorm_fp8_fwd(x, x, w, 1e-5, 500)
    # 3-D x: scales keep its leading dimensions
    q, scale, rstd = k.rmsnorm_fp8_fwd(torch.randn(2, 3, 256).bfloat16(), torch.ones(256), 1e-5, 128)
    assert q.shape == (2, 3, 256) and q.dtype == FP8_DTYPE and scale.shape == (2, 3, 2) and rstd.shape == (2, 3)
    assert [r.name for r in (get_op(o) for o in expand_ops(["rmsnorm_fp8"]))] == [
        "rmsnorm_fp8_token",
        "rmsnorm_fp8_g128",
    ]


# ---------------------------------------------------------------- the checker's rule
def mutant(defect: str, **kw) -> Implementation:
    return Implementation(
        name=f"mutant-fp8-{defect}", dsl="eager", entry="tests.fp8_mutants:fp8", options={"defect": defect},
        ops=FP8_OPS, devices=("cpu", "cuda"), **kw,
    )  # fmt: skip


# (defect, the ops it shows on, the tensors that must fail)
DEFECTS = [
    ("rounded_scale", FP8_OPS, {"scale"}),
    ("truncate", FP8_OPS, {"q", "q*scale"}),
    ("no_saturation", FP8_OPS, {"q"}),
    ("group_off_by_one", ("rmsnorm_fp8_g128", "add_rmsnorm_fp8_g128"), {"scale", "q"}),
    ("row_amax", ("rmsnorm_fp8_g128", "add_rmsnorm_fp8_g128"), {"scale", "q"}),
]


@pytest.mark.parametrize("op", FP8_OPS)
def test_the_fused_formula_passes(op):
    for dtype in ("bf16", "fp32"):
        r = run_check(mutant("none"), op, "fwd", SHAPE, dtype, DEVICE)
        assert r.passed, (dtype, r.summary())
        q = next(t for t in r.tensors if t.name == "q")
        assert q.boundary is not None and q.max_ulp <= 1


@pytest.mark.parametrize("defect,ops,failing", DEFECTS, ids=[d[0] for d in DEFECTS])
def test_each_defect_is_rejected(defect, ops, failing):
    dtypes = ("bf16",) if defect == "rounded_scale" else ("bf16", "fp32")  # fp32 x: no rounding to show
    for op in ops:
        for dtype in dtypes:
            r = run_check(mutant(defect), op, "fwd", SHAPE, dtype, DEVICE)
            bad = {t.name for t in r.tensors if not t.passed}
            assert r.status == "fail" and failing <= bad, (op, dtype, r.summary())
            assert {t.name for t in r.tensors if t.passed} >= {"rstd"}, (op, dtype, r.summary())


def test_the_declared_rounding_is_the_only_one_allowed():
    """The scale of the bf16-rounded y passes only for a record that declares it stores y in x's
    dtype first (the unfused baseline), and eager fails without the declaration; truncation fails
    even with it."""
    declared = {"rounds_before_quantizing": True}
    for op in ("rmsnorm_fp8_token", "add_rmsnorm_fp8_g128"):
        assert run_check(mutant("rounded_scale", **declared), op, "fwd", SHAPE, "bf16", DEVICE).passed
        assert not run_check(mutant("truncate", **declared), op, "fwd", SHAPE, "bf16", DEVICE).passed
        eager = all_implementations()["eager"]
        assert eager.rounds_before_quantizing and run_check(eager, op, "fwd", SHAPE, "bf16", DEVICE).passed
        strict = Implementation(
            name="eager-strict", dsl="eager", entry="impls.eager.kernels", extra_entries=("impls.eager.fp8",),
            ops=FP8_OPS, devices=("cpu", "cuda"),
        )  # fmt: skip
        r = run_check(strict, op, "fwd", SHAPE, "bf16", DEVICE)
        assert r.status == "fail" and "scale" in {t.name for t in r.tensors if not t.passed}, r.summary()


def test_boundary_elements_are_counted_in_the_json():
    r = run_check(all_implementations()["eager"], "rmsnorm_fp8_g128", "fwd", SHAPE, "bf16", DEVICE)
    q = next(t for t in r.to_json()["tensors"] if t["name"] == "q")
    # eager's y is rounded to bf16 first: about one element in 60 crosses a rounding boundary
    assert r.passed and 0 < q["boundary"] < SHAPE.m * SHAPE.n // 10 and q["max_ulp"] == 1


# ---------------------------------------------------------------- every implementation here
def implementations():
    for impl in sorted(all_implementations().values(), key=lambda i: i.name):
        if set(FP8_OPS) & set(impl.ops):
            why = impl.unavailable(DEVICE)
            yield pytest.param(
                impl, id=impl.name, marks=[pytest.mark.skip(reason=f"{impl.name}: {why}")] if why else []
            )


def _past_448(row: torch.Tensor, weight, eps) -> bool:
    """Whether fp32's y / scale at the row's largest |y| comes out above 448 (the fused formula's
    rounding: what a conversion must saturate)."""
    y = fp8_mutants._norm(row[None], None, weight, eps)[0][0]
    a = y.abs().max()
    return bool(a / (a / E4M3_MAX) > E4M3_MAX)


def special_case(op: str, dtype=torch.bfloat16) -> dict:
    """A drawn case whose row 0 is zeros (x and residual), row 1 tiny (its amax below the floor),
    and rows 2-3 one spike each, of either sign (residual 0 there), sized so that fp32's y / scale
    at the spike lands past 448: each block's largest |y| / scale sits at 448, or just above it."""
    case = make_case(op, Shape((16, 256)), dtype, DEVICE, seed=7)
    for name in ("x", "residual"):
        if name in case:
            t = case[name].clone()
            t[0] = 0
            t[1] = 1e-30 if dtype != torch.float16 else 0
            if name == "residual":
                t[2:4] = 0
            else:
                w = case["weight"].cpu() if case["weight"] is not None else None
                for row, sign in ((2, 1.0), (3, -1.0)):
                    kept = t[row].clone()
                    for col in range(256):  # the spike's weight sets the mantissa of y there
                        t[row] = kept
                        t[row, col] = sign * 1000.0
                        if _past_448(t[row].cpu(), w, case["eps"]):
                            break
                    else:
                        raise AssertionError(f"no column puts row {row}'s spike past 448")
            case[name] = t
    return case


@pytest.mark.parametrize("impl", list(implementations()))
def test_zero_and_saturated_rows(impl):
    """A zero row gives the floor's finite scale and q = 0; each block's largest |y| gives q = +-448
    exactly, never NaN; everything else as the checker holds it. The no-saturation defect fails on
    the same case."""
    k = impl.kernels(DEVICE)
    for op in (o for o in FP8_OPS if o in impl.ops):
        rec = get_op(op)
        case = special_case(op)
        reports = _check_tensors(k, rec, "fwd", case, rounded=impl.rounds_before_quantizing)
        assert all(r.passed for r in reports), (op, [f"{r.name}: {r.reason}" for r in reports if not r.passed])
        out = dict(zip([a.name for a in rec.fwd_outputs], getattr(k, rec.function("fwd"))(*rec.fwd_call(case))))
        q, scale = out["q"].double(), out["scale"].double()
        floor = torch.tensor(AMAX_FLOOR, dtype=torch.float32) / E4M3_MAX
        assert torch.isfinite(scale).all() and torch.allclose(scale[0].cpu(), floor.double(), rtol=2**-22, atol=0), (
            scale[0]
        )
        assert (q[0] == 0).all() and (q[1] == 0).all() and not torch.isnan(q).any()
        blocks = q.unflatten(-1, (-1, case["group"]))[2:]
        assert (blocks.abs().amax(-1) == E4M3_MAX).all(), op
        assert q[2].max() == E4M3_MAX and q[3].min() == -E4M3_MAX
        bad = _check_tensors(mutant("no_saturation").kernels(DEVICE), rec, "fwd", case)
        assert any(not r.passed and "NaN" in r.reason for r in bad), op


# ---------------------------------------------------------------- Triton's conversion
if importlib.util.find_spec("triton") is not None:
    import triton
    import triton.language as tl

    from impls.triton.fp8 import _to_e4m3

    @triton.jit
    def _convert(V, Q, N: tl.constexpr):
        offs = tl.arange(0, N)
        tl.store(Q + offs, _to_e4m3(tl.load(V + offs)))


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_conversion_rounds_to_nearest_even_and_saturates():
    """``_to_e4m3`` on every tie between e4m3 values, either side of each, and past 448: the
    interpreter's own conversion gets ties, subnormals and saturation wrong, the kernel's rounding
    by hand must not (on a GPU: the hardware conversion)."""
    e4 = _finite_e4m3()
    lo, hi = e4[:-1], e4[1:]
    mid = ((lo + hi) / 2).float()
    below, above = torch.nextafter(mid, torch.full_like(mid, -1e9)), torch.nextafter(mid, torch.full_like(mid, 1e9))
    past = torch.tensor([448.00003, 463.9, 464.0, 480.0, 1e30, -1e30, 2.0**-10, 3 * 2.0**-10])
    v = torch.cat([mid, below, above, e4.float(), past])
    n = triton.next_power_of_2(v.numel())
    vals = torch.zeros(n)
    vals[: v.numel()] = v
    q = torch.empty(n, dtype=FP8_DTYPE)
    vals, q = vals.to(DEVICE), q.to(DEVICE)
    _convert[(1,)](vals, q, N=n)
    assert torch.equal(q.double().cpu(), e4m3_round(vals.double().cpu()))


# ---------------------------------------------------------------- Helion's generated Triton
@pytest.mark.skipif(HAS_CUDA, reason="runs Helion's generated Triton in Triton's CPU interpreter")
@pytest.mark.parametrize("op", ["rmsnorm_fp8_token", "add_rmsnorm_fp8_g128"])
def test_helion_generated_triton_under_the_interpreter(op, monkeypatch):
    """Helion's eager mode runs kernel bodies as PyTorch ops; here the Triton it generates runs (the
    masks of a padded row, the reduction loops, the block scales at the tile index), under Triton's
    interpreter with its fp32 -> e4m3 conversion replaced by PyTorch's (nearest even, saturating,
    as a GPU converts): the interpreter's own is what test_triton_conversion_... shows wrong."""
    pytest.importorskip("helion")
    import os

    import triton.language as tl
    from torch._inductor.runtime.triton_compat import libdevice
    from triton.runtime import interpreter

    from impls.helion import configs
    from impls.helion import fp8 as hfp8

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton's interpreter is not on")
    convert = interpreter._convert_float

    def exact(data, src, dst, rounding):
        if dst == tl.float8e4nv and src == tl.float32:
            return (
                torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32)).to(FP8_DTYPE).view(torch.uint8).numpy()
            )
        return convert(data, src, dst, rounding)

    def run(kernel, config, *args):
        bound = kernel.bind(args)
        return bound.compile_config(configs.fit(config, bound))(*args)

    monkeypatch.setattr(interpreter, "_convert_float", exact)
    monkeypatch.setattr(libdevice, "rsqrt", lambda v: tl.math.rsqrt(v))  # the interpreter has no libdevice
    monkeypatch.setattr(hfp8, "launch", run)
    monkeypatch.delenv("HELION_INTERPRET", raising=False)
    rec = get_op(op)
    # rows padded to a power of two and looped over in 256 columns (a reduction loop), 2 rows a tile
    monkeypatch.setattr(hfp8, "config", lambda n: {"block_sizes": [2], "reduction_loops": [256]})
    k = hfp8
    # fp16: the interpreter converts fp32 to bf16 toward zero, which residual_out would show
    case = make_case(op, Shape((5, 1024)), torch.float16, "cpu", seed=2)
    case["weight"] = case["weight"].float()
    reports = _check_tensors(k, rec, "fwd", case)
    assert all(r.passed for r in reports), [f"{r.name}: {r.reason}" for r in reports if not r.passed]


def test_helion_fp8_reads_per_head_views_in_place():
    """Per-head (T, H, N) views (row_views: heads 1-3 of a 7-head parent, no (M, N) view of their
    rows) reach Helion's FP8 kernels uncopied: no clone or copy of x's or residual's storage during
    the call (a reshape of such a view is a clone), in Helion's eager mode, for both groupings, with
    a residual that is itself a view or contiguous, and weights of x's dtype, fp32 or none; the
    outputs against the fp64 reference as the checker holds them."""
    pytest.importorskip("helion")
    import sys
    from types import SimpleNamespace

    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    from harness.registry import get

    impl = get("helion")
    if impl.unavailable("cpu"):
        pytest.skip(f"helion: {impl.unavailable('cpu')}")
    aten = torch.ops.aten

    def tile_load() -> bool:
        """Whether the copy being dispatched is Helion's eager mode loading a tile: Helion 1.5's
        ref_mode.device_load clones a subscript of a tensor (what a GPU loads into registers)."""
        frame = sys._getframe()
        while frame is not None:
            if frame.f_code.co_name == "device_load" and "ref_mode" in frame.f_code.co_filename:
                return True
            frame = frame.f_back
        return False

    class CopySpy(TorchDispatchMode):
        """Records every clone or copy (a ``_to_copy`` too, where it keeps the dtype: one that
        converts is a tile's load) that reads or writes one of ``storages``, but a tile's load."""

        def __init__(self):
            super().__init__()
            self.storages, self.seen = set(), []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            op = func.overloadpacket
            copy = op in (aten.clone, aten.contiguous, aten.copy_, aten.copy) or (
                op is aten._to_copy and kwargs.get("dtype", args[0].dtype) == args[0].dtype
            )
            if copy and not tile_load():
                tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
                if any(t.untyped_storage().data_ptr() in self.storages for t in tensors):
                    self.seen.append(str(func))
            return func(*args, **kwargs)

    spy = CopySpy()

    def spied(fn):
        def call(*args):
            with spy:
                return fn(*args)

        return call

    k = impl.kernels("cpu")
    spied_k = SimpleNamespace(**{f: spied(getattr(k, f)) for f in ("rmsnorm_fp8_fwd", "add_rmsnorm_fp8_fwd")})
    g = torch.Generator().manual_seed(11)

    def heads(span: tuple[int, int] | None) -> torch.Tensor:
        """Heads ``span`` (three of 256) of a seeded (5, 7, 256) bf16 parent; None: a contiguous (5, 3, 256)."""
        if span is None:
            return torch.randn(5, 3, 256, generator=g).bfloat16()
        return torch.randn(5, 7, 256, generator=g).bfloat16()[:, span[0] : span[1]]

    shape, runs = Shape((5, 3, 256)), 0  # make_case for the parameters and eps; x and residual below
    for op in FP8_OPS:
        rec = get_op(op)
        for weights, affine in (("same", True), ("fp32", True), ("same", False)):
            for residual in ("view", "contiguous") if "residual" in rec.inputs else (None,):
                case = make_case(op, shape, torch.bfloat16, "cpu", seed=runs, affine=affine, weights=weights)
                case["x"] = heads((1, 4))
                if residual is not None:
                    case["residual"] = heads((2, 5) if residual == "view" else None)
                assert case["x"].dim() == 3 and not case["x"].is_contiguous()
                spy.storages = {case[t].untyped_storage().data_ptr() for t in ("x", "residual") if t in case}
                spy.seen = []
                reports = _check_tensors(spied_k, rec, "fwd", case, rounded=impl.rounds_before_quantizing)
                where = (op, weights, affine, residual)
                assert not spy.seen, (where, f"copies of a per-head view: {spy.seen}")
                bad = [f"{r.name}: {r.reason}" for r in reports if not r.passed]
                assert not bad, (where, bad)
                runs += 1
    assert runs == 18


# ---------------------------------------------------------------- bytes model and benchmark plan
def test_forward_only_ops_in_the_bytes_model_and_the_plan():
    from harness.run.bench import plan
    from harness.spec.roofline import bytes_moved

    m, n = 4096, 4096
    token, block = bytes_moved("rmsnorm_fp8_token", "fwd", m, n, 2), bytes_moved("rmsnorm_fp8_g128", "fwd", m, n, 2)
    # x read (2 bytes), q written (1), the scales (4 bytes each: one a row, one per 128 columns)
    assert token.main == 3 * m * n + 4 * m and block.main == 3 * m * n + 4 * m * n // 128
    assert token.extra == 2 * n + 4 * m  # the weight read (x's dtype), rstd written
    fused = bytes_moved("add_rmsnorm_fp8_token", "fwd", m, n, 2)
    assert fused.main == (3 * 2 + 1) * m * n + 4 * m  # x, residual read, residual_out written, q
    for direction in ("bwd", "fwdbwd"):
        with pytest.raises(ValueError, match="has no"):
            bytes_moved("rmsnorm_fp8_token", direction, m, n, 2)
    eager = all_implementations()["eager"]
    shapes = [("s", (Shape((8, 1000)), Shape((8, 1024))))]
    points = plan([eager], list(FP8_OPS), ["fwd", "bwd", "fwdbwd"], shapes, ["bf16"])
    got = {(op, d, s.n) for _, op, d, _, s, _, _ in points}
    assert got == {(op, "fwd", n) for op in FP8_OPS for n in (1000, 1024) if not get_op(op).unsupported(n)}


# ---------------------------------------------------------------- Gluon: compiled for sm_90a
# (N, x's dtype): a small row of 16-bit x (the small-row tile), a mid one, the chunked path, fp32 x
GLUON_COMPILES = [
    (256, torch.bfloat16),
    (4096, torch.bfloat16),
    (262144, torch.bfloat16),
    (4096, torch.float32),
    (1000, torch.float16),
]


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or importlib.util.find_spec("triton.experimental.gluon") is None,
    reason="triton with triton.experimental.gluon is not installed",
)
@pytest.mark.parametrize("n,dtype", GLUON_COMPILES, ids=[f"{n}-{str(d)[6:]}" for n, d in GLUON_COMPILES])
def test_gluon_compiles_for_sm90a_with_the_hardware_conversion(n, dtype):
    """Gluon does not run in Triton's interpreter: every FP8 kernel variant (per row, per 1 x 128
    block, with and without the residual) compiles for sm_90a, converts with cvt.rn.satfinite
    (nearest even, saturating), and stores q as wide as x's vectors (16-bit x: 8 bytes a thread)."""
    from impls.gluon import fp8 as gfp8

    from .gpu_only_dsl import toolchain_absent

    x = torch.randn(4, n).to(dtype)
    w = torch.ones(n)
    for group in (n, 128) if n % 128 == 0 else (n,):
        for residual in (None, x.clone()):
            try:
                with gfp8.compile_only() as compiled:
                    if residual is None:
                        gfp8.rmsnorm_fp8_fwd(x, w, 1e-5, group)
                    else:
                        gfp8.add_rmsnorm_fp8_fwd(x, residual, w, 1e-5, group)
            except Exception as e:
                why = toolchain_absent(e)
                if why is None:
                    raise
                pytest.skip(f"Gluon cannot compile for sm_90a here: {why}")
            (kernel,) = compiled
            ptx = kernel.asm["ptx"]
            assert ".target sm_90a" in ptx and "cvt.rn.satfinite.e4m3x2.f32" in ptx, (n, group)
            # 16-bit x whose rows are whole 16-byte vectors (N a multiple of 16: the compiler can prove
            # each row's alignment; N = 1000 it cannot, and stores q a byte at a time)
            if dtype != torch.float32 and residual is None:
                packed = "st.global.v2.b32" in ptx
                assert packed == (n % 16 == 0), f"N = {n}, group {group}: q stored 8 bytes a thread: {packed}"


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or importlib.util.find_spec("triton.experimental.gluon") is None,
    reason="triton with triton.experimental.gluon is not installed",
)
@pytest.mark.parametrize("n,group", [(256, 256), (256, 128), (65536, 65536), (65536, 128)])
@pytest.mark.parametrize("fused_add", [False, True], ids=["rmsnorm_fp8", "add_rmsnorm_fp8"])
def test_gluon_fp8_compiles_for_per_head_views_for_sm90a(n, group, fused_add, monkeypatch):
    """Per-head (T, H, N) views (3 of 7 heads of a fused tensor; the residual a contiguous (T, H, N)
    tensor, strides unlike x's) reach the FP8 kernel, whole-row and chunked, in place: the launch gets
    their own pointers and (token, head) strides with HEADS set, and x is still read in 128-bit vectors."""
    from impls.gluon import fp8 as gfp8

    from .gpu_only_dsl import toolchain_absent

    x = torch.randn(5, 7, n).to(torch.bfloat16)[:, 1:4]
    residual = torch.randn(5, 3, n).to(torch.bfloat16)
    w = torch.ones(n)
    launches = []
    compile_kernel = gfp8.compile_kernel

    def recorded(kernel, args, constexprs, num_warps):
        launches.append((args, constexprs))
        return compile_kernel(kernel, args, constexprs, num_warps)

    monkeypatch.setattr(gfp8, "compile_kernel", recorded)
    try:
        with gfp8.compile_only() as compiled:
            if fused_add:
                gfp8.add_rmsnorm_fp8_fwd(x, residual, w, 1e-5, group)
            else:
                gfp8.rmsnorm_fp8_fwd(x, w, 1e-5, group)
    except Exception as e:
        why = toolchain_absent(e)
        if why is None:
            raise
        pytest.skip(f"Gluon cannot compile for sm_90a here: {why}")
    ((args, constexprs),), (kernel,) = launches, compiled
    views = [("x", "X", x)] + [("r", "R", residual)] * fused_add
    for name, arg, view in views:
        assert args[arg].data_ptr() == view.data_ptr(), f"{name} copied"
        assert (args[f"stride_{name}"], args[f"hstride_{name}"]) == view.stride()[:2], name
    assert constexprs["HEADS"] and args["NH"] == 3
    assert "ld.global.v4" in kernel.asm["ptx"], (n, group)
