"""Helion-specific tests: pinned configs, code generation without a GPU, the fallback, variants.

Correctness over the smoke and edge shapes comes from the registry-driven tests.
"""

from __future__ import annotations

import os
import warnings
from types import SimpleNamespace

import pytest

helion = pytest.importorskip("helion")

import torch  # noqa: E402

from harness import reference  # noqa: E402
from harness.checker import _check_tensors, compare  # noqa: E402
from harness.inputs import make_case  # noqa: E402
from harness.shapes import Shape  # noqa: E402
from impls.helion import codegen, configs, layernorm, rmsnorm  # noqa: E402

ENTRIES = ("rmsnorm_fwd", "rmsnorm_bwd", "layernorm_fwd", "layernorm_bwd")


def _pinned_points():
    return [
        (gpu, entry, dtype, int(n))
        for gpu, entries in configs.table().items()
        for entry, by_dtype in entries.items()
        for dtype, buckets in by_dtype.items()
        for n in buckets
    ]


def test_configs_json_is_well_formed():
    for gpu, entry, dtype, n in _pinned_points():
        op = entry.split("_")[0]
        hit = configs.table()[gpu][entry][dtype][str(n)]
        assert entry in ENTRIES and dtype in ("bf16", "fp16", "fp32")
        assert hit["kernel"].startswith(entry) and hasattr(rmsnorm if op == "rmsnorm" else layernorm, hit["kernel"])
        assert ("first_pass" in hit) == hit["kernel"].endswith("_split")
        configs.Pinned.from_entry(hit, "tuned").helion_config()


@pytest.mark.parametrize("point", _pinned_points() or [pytest.param(None, marks=pytest.mark.skip("no pinned configs"))])
def test_pinned_config_generates_triton_without_gpu(point):
    gpu, entry, dtype, n = point
    op, direction = entry.split("_")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a pinned point must not fall back to anything
        source = codegen.codegen(op, direction, n, dtype, gpu=gpu)
    pinned = configs.table()[gpu][entry][dtype][str(n)]
    assert f"kernel {pinned['kernel']}\n" in source
    assert "@triton.jit" in source and f"def _helion_{pinned['kernel']}(" in source
    if "first_pass" in pinned:
        assert f"def _helion_{op}_bwd_row_sums(" in source


@pytest.mark.parametrize("entry", ENTRIES)
def test_bucketed_config_fits_other_row_lengths(entry):
    """A config tuned for an N bucket compiles for every N in it, down to N = 1 (no reduction loop
    there, so the config's ``reduction_loops`` must go)."""
    gpus = [gpu for gpu, entries in configs.table().items() if entries.get(entry)]
    op, direction = entry.split("_")
    for gpu in gpus or [None]:
        source = codegen.codegen(op, direction, 1, "bf16", gpu=gpu)
        assert "@triton.jit" in source


def test_unknown_gpu_falls_back_to_the_default_config_and_says_so():
    with pytest.warns(UserWarning, match="using the default config"):
        choice = configs.pinned("rmsnorm_bwd", 4096, "bf16", "Imaginary GPU 3000")
    assert choice.source == "default"
    assert choice == configs.default_config("rmsnorm_bwd", 4096)
    assert "(default)" in codegen.codegen("rmsnorm", "bwd", 4096, "bf16", gpu="Imaginary GPU 3000").splitlines()[1]


def test_untuned_dtype_borrows_and_says_so(monkeypatch):
    fake = {"GPU X": {"rmsnorm_fwd": {"bf16": {"1024": {"kernel": "rmsnorm_fwd_kernel", "config": {"num_warps": 4}}}}}}
    monkeypatch.setattr(configs, "_TABLE", fake)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert configs.pinned("rmsnorm_fwd", 1000, "fp16", "GPU X").source == "tuned"  # same element size
    with pytest.warns(UserWarning, match="using the bf16 one"):
        assert configs.pinned("rmsnorm_fwd", 500, "fp32", "GPU X").source == "tuned for bf16"
    # fp32 rows of 1000 have the bytes of bf16 rows of 2000: no bf16 config that long, the default
    with pytest.warns(UserWarning, match="default config"):
        assert configs.pinned("rmsnorm_fwd", 1000, "fp32", "GPU X").source == "default"


def test_fp32_borrows_the_16_bit_config_of_rows_of_the_same_bytes():
    """The H200's bf16 resident backward at N = 16384 asks 393 KB of shared memory for fp32 rows of
    16384 (the limit is 227 KB): fp32 takes the bf16 entry of N = 32768, the split backward."""
    gpu = "NVIDIA H200"
    tuned = configs.table()[gpu]["rmsnorm_bwd"]["bf16"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert configs.pinned("rmsnorm_bwd", 16384, "fp32", gpu).entry() == {k: tuned["32768"][k] for k in ("kernel", "config", "first_pass")}
        assert configs.pinned("rmsnorm_bwd", 4096, "fp32", gpu).config == tuned["8192"]["config"]


def test_n_buckets():
    tuned = [1024, 4096, 262144]
    assert configs.bucket(1, tuned) == 1024
    assert configs.bucket(1024, tuned) == 1024
    assert configs.bucket(1025, tuned) == 4096
    assert configs.bucket(2**20, tuned) is None  # longer than anything tuned: the default


def test_few_rows_shrink_the_resident_backwards_block():
    """Decode sizes: a block of rows tuned for tens of thousands of rows would leave most SMs idle;
    the rows per program shrink (a power of two, at least one step) until each SM has a program."""
    tuned = configs.Pinned("rmsnorm_bwd_resident", {"block_sizes": [32, 2], "num_warps": 8}, "tuned")
    assert configs.for_rows(tuned, 32768, 132) is tuned  # the sweep's M: enough programs already
    assert configs.for_rows(tuned, 4096, 132) is tuned  # 128 programs of 32 rows; 32 is what M / SMs asks
    assert configs.for_rows(tuned, 1000, 132).config == {"block_sizes": [8, 2], "num_warps": 8}
    assert configs.for_rows(tuned, 128, 132).config["block_sizes"] == [2, 2]  # one step per program
    assert configs.for_rows(tuned, 1, 132).config["block_sizes"] == [2, 2]
    assert "rows per program for M=1" in configs.for_rows(tuned, 1, 132).source
    split = configs.default_config("layernorm_bwd", 65536)
    assert configs.for_rows(split, 1, 132) is split  # its grid also spans the columns


def test_one_binary_for_every_m():
    """Dynamic shapes: a new M binds to the same kernel (no recompile), N is specialized."""
    k = rmsnorm.rmsnorm_fwd_kernel
    w = torch.ones(512, dtype=torch.bfloat16)
    a = k.bind((torch.zeros(3, 512, dtype=torch.bfloat16), w, 1e-5))
    b = k.bind((torch.zeros(4096, 512, dtype=torch.bfloat16)[:, :512], w, 1e-5))
    strided = k.bind((torch.zeros(70, 600, dtype=torch.bfloat16)[:, :512], w, 1e-5))
    assert a is b is strided
    assert k.bind((torch.zeros(3, 520, dtype=torch.bfloat16), torch.ones(520, dtype=torch.bfloat16), 1e-5)) is not a


@pytest.mark.parametrize("op", ["rmsnorm", "layernorm"])
def test_split_backward_in_eager_mode(op):
    """The CPU path runs the backward variant the default picks for N, the resident one for the
    shapes CI checks; run the split one (row sums, then [rows x columns] tiles) here."""
    mod = rmsnorm if op == "rmsnorm" else layernorm

    def eager(kernel):
        return helion.kernel(kernel.fn, static_shapes=False, ref_mode=helion.RefMode.EAGER)

    case = make_case(op, Shape((6, 1003), "column-slice"), torch.float32, "cpu")
    x, dy, w, eps = case["x"], case["dy"], case["weight"], case["eps"]
    if op == "rmsnorm":
        _, rstd = reference.rmsnorm_fwd(x, w, eps)
        ref = reference.rmsnorm_bwd(dy, x, w, rstd)
        c = eager(mod.rmsnorm_bwd_row_sums)(dy, x, w, rstd.float())
        dx, dw_partial = eager(mod.rmsnorm_bwd_split)(dy, x, w, rstd.float(), c)
        got = (dx, dw_partial.sum(0))
    else:
        _, mean, rstd = reference.layernorm_fwd(x, w, None, eps)
        ref = reference.layernorm_bwd(dy, x, w, mean, rstd)
        sums = eager(mod.layernorm_bwd_row_sums)(dy, x, w, mean.float(), rstd.float())
        dx, dw_partial, db_partial = eager(mod.layernorm_bwd_split)(dy, x, w, mean.float(), rstd.float(), *sums)
        got = (dx, dw_partial.sum(0), db_partial.sum(0))
    for name, out, r in zip(("dx", "dweight", "dbias"), got, ref):
        report = compare(name, out, r, torch.float32, r.shape)
        assert report.passed, report.reason


@pytest.mark.skipif(
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
    reason="runs Helion's generated Triton in Triton's CPU interpreter (CI without a GPU)",
)
@pytest.mark.parametrize("op", ["rmsnorm", "layernorm"])
@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_generated_triton_under_the_interpreter(op, direction, monkeypatch):
    """Eager mode runs kernel bodies as PyTorch ops; this runs the Triton that Helion generates (the
    masks, the padded row length: where Helion's own bugs show), with small blocks so that a row of
    1003 is padded, looped over and split, through the checker's comparison."""
    import triton.language as tl
    from torch._inductor.runtime.triton_compat import libdevice

    monkeypatch.setattr(libdevice, "rsqrt", lambda v: tl.math.rsqrt(v))  # no libdevice in the interpreter
    mod = rmsnorm if op == "rmsnorm" else layernorm

    def run(kernel, config, *args):
        bound = kernel.bind(args)
        return bound.compile_config(configs.fit(config, bound))(*args)

    def forward(*args):
        return run(getattr(mod, f"{op}_fwd_kernel"), fwd_config, *args)

    def backward(dy, x, w, *stats):
        if split:
            sums = run(getattr(mod, f"{op}_bwd_row_sums"), {"block_sizes": [2], "reduction_loops": [128]}, dy, x, w, *stats)
            sums = sums if isinstance(sums, tuple) else (sums,)
            config = {"block_sizes": [4, 256, 2]}
            dx, *partials = run(getattr(mod, f"{op}_bwd_split"), config, dy, x, w, *stats, *sums)
        else:
            dx, *partials = run(getattr(mod, f"{op}_bwd_resident"), {"block_sizes": [4, 2]}, dy, x, w, *stats)
        dw = partials[0].sum(0).to(x.dtype) if w is not None else None
        return (dx, dw, partials[1].sum(0).to(x.dtype)) if op == "layernorm" else (dx, dw)

    case = make_case(op, Shape((6, 1003), "column-slice"), torch.bfloat16, "cpu")
    k = SimpleNamespace(**{f"{op}_fwd": forward, f"{op}_bwd": backward})
    for fwd_config, split in (({"block_sizes": [2], "reduction_loops": [None]}, False), ({"block_sizes": [1], "reduction_loops": [256]}, True)):
        for report in _check_tensors(k, op, direction, case):
            assert report.passed, f"{report.name} ({'split' if split else 'resident'}): {report.reason}"


@pytest.mark.gpu
def test_gpu_launch_pins_a_config_and_never_autotunes(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    # Not `import helion.runtime.kernel as hk`: helion.runtime re-exports the `kernel` decorator
    # under that name, so the attribute lookup finds the function, not the module.
    from helion.runtime.kernel import BoundKernel

    def refuse(*a, **k):
        raise AssertionError("Helion started autotuning")

    monkeypatch.setattr(BoundKernel, "autotune", refuse)
    configs.reload()
    x = torch.randn(256, 4096, dtype=torch.bfloat16, device="cuda")
    w = torch.ones(4096, dtype=torch.bfloat16, device="cuda")
    # The guard is live: a kernel called without a config does reach the patched method.
    unpinned = helion.kernel(rmsnorm.rmsnorm_fwd_kernel.fn, static_shapes=False, autotune_effort="full")
    with pytest.raises(AssertionError, match="started autotuning"):
        unpinned(x, w, 1e-5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an untuned GPU falls back to the default: fine here
        y, rstd = rmsnorm.rmsnorm_fwd(x, w, 1e-5)
        wide = torch.randn(64, 32768, dtype=torch.bfloat16, device="cuda")  # the split backward
        dx, dw = rmsnorm.rmsnorm_bwd(wide, wide, torch.ones(32768, dtype=torch.bfloat16, device="cuda"),
                                     torch.ones(64, device="cuda"))
    expected = x.float() * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(y.float(), expected, rtol=2e-2, atol=2e-2)
    assert dx.shape == wide.shape and dw.shape == (32768,)
