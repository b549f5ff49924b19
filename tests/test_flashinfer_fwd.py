"""harness.tools.flashinfer_fwd without a GPU: the CLI's answer when FlashInfer is missing, and the point
checker on FlashInfer-like fakes (CPU, fp32 math): right ones pass, wrong ones are marked failed or
error with their reason, and failed points are never timed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from harness.tools import flashinfer_fwd as ff
from harness.spec.shapes import Shape

ROOT = Path(__file__).resolve().parent.parent
SHAPES = (Shape((8, 256)), Shape((3, 1000)))


def _rms(h, eps):
    return torch.rsqrt(h.square().mean(-1, keepdim=True) + eps)


def fake(add_rounded=True, scale=1.0, gemma_one=1.0, write_residual=True, add_residual=True):
    """A flashinfer.norm look-alike in fp32 on the CPU; the keywords plant one departure each."""

    def rmsnorm(x, w, eps):
        xf = x.float()
        return (xf * _rms(xf, eps) * w.float() * scale).to(x.dtype)

    def gemma_rmsnorm(x, w, eps):
        xf = x.float()
        return (xf * _rms(xf, eps) * (w.float() + gemma_one)).to(x.dtype)

    def fused_add_rmsnorm(x, residual, w, eps):
        s = x.float() + residual.float() if add_residual else x.float()
        if write_residual:
            residual.copy_(s.to(residual.dtype))
        h = s.to(x.dtype).float() if add_rounded else s  # FlashInfer's kernel normalises s itself
        x.copy_((h * _rms(h, eps) * w.float() * scale).to(x.dtype))

    return SimpleNamespace(rmsnorm=rmsnorm, gemma_rmsnorm=gemma_rmsnorm, fused_add_rmsnorm=fused_add_rmsnorm)


def _check(fi, name, weights, dtype="bf16", shape=SHAPES[0]):
    return ff.check_point(fi, ff.VARIANTS[name], shape, dtype, weights, device="cpu")


POINTS = [(v.name, w) for v in ff.VARIANTS.values() for w in v.weights]


def test_imports_and_variants():
    assert set(ff.VARIANTS) == {"rmsnorm", "fused_add_rmsnorm", "gemma_rmsnorm"}
    assert ff.VARIANTS["gemma_rmsnorm"].weights == ("offset",)
    assert ff.VARIANTS["fused_add_rmsnorm"].op == "add_rmsnorm"


def test_cli_without_flashinfer_exits_2_with_one_line():
    # sys.modules["flashinfer"] = None makes every import of it fail, whatever is installed
    code = "import sys; sys.modules['flashinfer'] = None; from harness.tools.flashinfer_fwd import main; sys.exit(main([]))"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    text = (r.stdout + r.stderr).strip()
    assert len(text.splitlines()) == 1 and "flashinfer" in text, text


def test_main_without_flashinfer(monkeypatch, capsys):
    def missing():
        raise ModuleNotFoundError("No module named 'flashinfer'")

    monkeypatch.setattr(ff, "load_flashinfer", missing)
    assert ff.main(["--shapes", "decode"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "No module named 'flashinfer'" in err


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("name,weights", POINTS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.label)
def test_correct_fake_passes(name, weights, dtype, shape):
    status, reports, err, _ = _check(fake(), name, weights, dtype, shape)
    assert status == "pass", (err, [r.reason for r in reports])
    assert [r.name for r in reports] == (["y", "residual_out"] if name == "fused_add_rmsnorm" else ["y"])


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_unrounded_sum_is_within_the_tolerance(dtype):
    """FlashInfer normalises the fp32 sum, the contract the sum rounded to x's dtype: half an ulp of
    h apart, which the 2-ulp tolerance covers; the point passes and its max error is recorded."""
    status, reports, err, _ = _check(fake(add_rounded=False), "fused_add_rmsnorm", "same", dtype)
    assert status == "pass", (err, [r.reason for r in reports])
    assert 0 < reports[0].max_ulp <= 2


@pytest.mark.parametrize(
    "planted,name,weights,tensor",
    [
        (dict(scale=1 + 2**-5), "rmsnorm", "same", "y"),  # a perturbed y
        (dict(scale=1 + 2**-5), "rmsnorm", "fp32", "y"),
        (dict(gemma_one=0.0), "gemma_rmsnorm", "offset", "y"),  # xhat * w instead of xhat * (1 + w)
        (dict(write_residual=False), "fused_add_rmsnorm", "same", "residual_out"),  # residual not updated
        (dict(add_residual=False), "fused_add_rmsnorm", "same", "y"),  # normalises x alone
        (dict(scale=1 + 2**-5, add_rounded=False), "fused_add_rmsnorm", "fp32", "y"),
    ],
)
def test_wrong_fake_fails(planted, name, weights, tensor):
    status, reports, _, _ = _check(fake(**planted), name, weights)
    assert status == "fail"
    bad = {r.name for r in reports if not r.passed}
    assert tensor in bad and all(r.reason for r in reports if not r.passed)


def test_raising_fake_is_an_error_with_its_message():
    def rmsnorm(x, w, eps):
        raise RuntimeError("Check failed: weight dtype\nsecond line")

    status, reports, err, tb = _check(SimpleNamespace(rmsnorm=rmsnorm), "rmsnorm", "fp32")
    assert status == "error" and reports == []
    assert err == "RuntimeError: Check failed: weight dtype" and "Traceback" in tb


def test_failed_point_is_recorded_not_timed(tmp_path):
    class Timer:  # would time a point that reached it
        def sync(self):
            raise AssertionError("a failed point was timed")

    p = ff.measure(fake(scale=1.1), ff.VARIANTS["rmsnorm"], "decode", SHAPES[0], "bf16", "same", "cpu", Timer(), roof=3.0)
    assert p.status == "failed" and p.ms is None and p.tbps is None and "over tolerance" in p.check
    assert p.ranked is False and p.bytes_main == 2 * 8 * 256 * 2  # x read + y written, bf16
    q = ff.measure(fake(), ff.VARIANTS["fused_add_rmsnorm"], "decode", SHAPES[0], "bf16", "fp32", "cpu", None)
    assert q.check == "pass" and q.bytes_main == 4 * 8 * 256 * 2
    meta = {"gpu": "cpu", "flashinfer": "fake", "torch": torch.__version__, "git_commit": None, "copy_bandwidth": {"tbps": 3.0}}
    ff.write(tmp_path, meta, [p, q])
    md = (tmp_path / "flashinfer.md").read_text()
    assert "| failed |" in md and "over tolerance" in md
    import json

    data = json.loads((tmp_path / "flashinfer.json").read_text())
    assert [d["status"] for d in data["points"]] == ["failed", "skip"]


def test_plan_keeps_dtypes_whole():
    todo = ff.plan(list(ff.VARIANTS.values()), [("decode", ff.shape_set("decode"))], ["bf16", "fp16"])
    dtypes = [t[3] for t in todo]
    assert dtypes == sorted(dtypes, key=["bf16", "fp16"].index) and len(todo) == 2 * 6 * 5
