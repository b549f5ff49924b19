"""impls/llm: the sample folder format, the first-shot / after-fix records, patches applied in
memory, provenance, and robustness of discovery. The samples here are written into tmp folders
(plain-PyTorch code standing in for generated kernels, so no DSL has to run); the prompts are the
committed ones."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness.spec import reference
from harness.run.checker import run_check
from harness.spec.shapes import Shape
from impls.llm import SAMPLE_ERRORS, discover, records_for
from impls.llm.generate import add_fix, store_sample
from impls.llm.patches import PatchError, apply_patch, make_patch
from impls.llm.samples import DSLS, OPS, parse_prompt_name, read_sample, sha256_file

REPO = Path(__file__).resolve().parent.parent
PROMPTS = REPO / "prompts"
RMSNORM_PROMPT = PROMPTS / "triton-rmsnorm.v1.md"

# A correct RMSNorm in plain PyTorch, shaped like a generated module (it is registered as llm-triton:
# the loader does not care what the code uses, and this runs without any DSL).
GOOD_RMSNORM = """import torch


def rmsnorm_fwd(x, weight, eps):
    xf = x.float()
    rstd = torch.rsqrt(xf.square().mean(-1) + eps)
    y = xf * rstd[:, None]
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype), rstd


def rmsnorm_bwd(dy, x, weight, rstd):
    xhat = x.float() * rstd[:, None]
    g = dy.float() * weight.float() if weight is not None else dy.float()
    dx = rstd[:, None] * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    dw = (dy.float() * xhat).sum(0).to(x.dtype) if weight is not None else None
    return dx.to(x.dtype), dw
"""
# The same with a typical first-shot bug: y is returned in fp32, not in x's dtype.
BUGGY_RMSNORM = GOOD_RMSNORM.replace("return y.to(x.dtype), rstd", "return y, rstd")
# A correct fused add + RMSNorm in plain PyTorch; dweight in the weight's dtype (x's or fp32).
GOOD_ADD_RMSNORM = """import torch


def add_rmsnorm_fwd(x, residual, weight, eps):
    h = (x.float() + residual.float()).to(x.dtype)
    hf = h.float()
    rstd = torch.rsqrt(hf.square().mean(-1) + eps)
    y = hf * rstd[:, None]
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype), h, rstd


def add_rmsnorm_bwd(dy, dresidual_out, residual_out, weight, rstd):
    xhat = residual_out.float() * rstd[:, None]
    g = dy.float() * weight.float() if weight is not None else dy.float()
    dh = rstd[:, None] * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    if dresidual_out is not None:
        dh = dh + dresidual_out.float()
    dw = (dy.float() * xhat).sum(0).to(weight.dtype) if weight is not None else None
    return dh.to(residual_out.dtype), dw
"""
SHAPE = Shape((3, 70))

pytestmark = pytest.mark.skipif(
    __import__("importlib").util.find_spec("triton") is None, reason="the llm-triton records require triton installed"
)


def answer(code: str) -> str:
    return f"Here you go.\n\n```python\n{code}```\n\nDone.\n"


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("NORMBENCH_LLM_CACHE", str(tmp_path / "cache"))


def store(tmp_path, code: str, model: str, prompt: Path = RMSNORM_PROMPT) -> Path:
    # every test its own model name: records are cached by name for the whole pytest run
    return store_sample(prompt, answer(code), model, {"temperature": 0.0}, tmp_path / "llm", date="2026-01-02")


# ---------------------------------------------------------------- patches
@pytest.mark.parametrize(
    "old,new",
    [
        ("a\nb\nc\n", "a\nB\nc\n"),
        ("a\nb\nc", "a\nb\nc\nd"),  # no newline at the end, before and after
        ("a\nb\nc", "a\nb\nc\n"),
        ("x = 1\f\ny = 2\n", "x = 1\f\ny = 3\n"),  # a form feed is not a line break here
        (
            "\n".join(map(str, range(40))) + "\n",
            "\n".join(map(str, range(40))).replace("7\n", "seven\n").replace("33", "") + "\n",
        ),
        ("", "new file\n"),
    ],
)
def test_patch_round_trip(old, new):
    assert apply_patch(old, make_patch(old, new)) == new


def test_hand_written_patch_with_headers_and_no_newline_marker():
    patch = (
        "diff -u a/raw.py b/raw.py\n--- a/raw.py\n+++ b/raw.py\n"
        "@@ -1,2 +1,2 @@\n a = 1\n-b = 2\n\\ No newline at end of file\n+b = 3\n"
    )
    assert apply_patch("a = 1\nb = 2", patch) == "a = 1\nb = 3\n"


def test_patch_that_does_not_match_is_refused():
    patch = make_patch("a\nb\nc\n", "a\nB\nc\n")
    with pytest.raises(PatchError, match="does not apply at line 2"):
        apply_patch("a\nX\nc\n", patch, what="01-fix.patch")
    with pytest.raises(PatchError, match="no hunk"):
        apply_patch("a\n", "just text\n")


# ---------------------------------------------------------------- records
def test_sample_without_fixes_is_one_first_shot_record(tmp_path):
    folder = store(tmp_path, GOOD_RMSNORM, "test/no-fix")
    (impl,) = records_for(folder)
    assert impl.name == folder.name == "triton-rmsnorm-no-fix-20260102-1"
    assert impl.dsl == "llm-triton" and impl.ops == ("rmsnorm",)
    assert impl.meta["variant"] == "first-shot" and impl.meta["first_shot"] is True and impl.meta["sibling"] is None
    assert impl.interpreter == "TRITON_INTERPRET" and "cpu" in impl.devices
    assert impl.prompt == "prompts/triton-rmsnorm.v1.md"
    for direction in ("fwd", "bwd"):
        r = run_check(impl, "rmsnorm", direction, SHAPE, "bf16", "cpu")
        assert r.passed, r.summary()


def test_first_shot_and_after_fix_are_both_runnable(tmp_path):
    folder = store(tmp_path, BUGGY_RMSNORM, "test/with-fix")
    raw_before = (folder / "raw.py").read_bytes()
    patch = add_fix(folder, GOOD_RMSNORM, "dtype: y was returned in fp32 instead of x's dtype")
    assert patch.parent == folder / "patches" and re.fullmatch(
        r"01-dtype-y-was-returned-in-fp32[a-z-]*\.patch", patch.name
    )
    rel = f"patches/{patch.name}"
    assert (folder / "raw.py").read_bytes() == raw_before  # the verbatim output is never edited
    meta = json.loads((folder / "metadata.json").read_text())
    assert meta["fixes"] == [{"patch": rel, "reason": "dtype: y was returned in fp32 instead of x's dtype"}]
    assert meta["raw_sha256"] == __import__("hashlib").sha256(raw_before).hexdigest()

    first, fixed = records_for(folder)
    assert (first.name, fixed.name) == (f"{folder.name}-first-shot", folder.name)
    assert (first.meta["variant"], fixed.meta["variant"]) == ("first-shot", "after-fix")
    assert first.meta["sibling"] == fixed.name and fixed.meta["sibling"] == first.name
    assert fixed.meta["fixes"][0]["reason"].startswith("dtype:")
    assert any(s.endswith(rel) for s in fixed.sources)

    bad = run_check(first, "rmsnorm", "fwd", SHAPE, "bf16", "cpu")
    assert bad.status == "fail" and "dtype torch.float32" in bad.summary()
    assert run_check(first, "rmsnorm", "bwd", SHAPE, "bf16", "cpu").passed
    for direction in ("fwd", "bwd"):
        assert run_check(fixed, "rmsnorm", direction, SHAPE, "bf16", "cpu").passed
    # the patched code was materialized for import, named after the sample, not written next to raw.py
    assert sorted(p.name for p in folder.iterdir()) == ["completion.md", "metadata.json", "patches", "raw.py"]
    assert any(p.name.startswith(folder.name + ".after-fix.") for p in (tmp_path / "cache").iterdir())


def test_fixes_stack_in_order(tmp_path):
    folder = store(tmp_path, BUGGY_RMSNORM, "test/two-fixes")
    step1 = GOOD_RMSNORM.replace("import torch\n", "import torch  # first fix\n")
    add_fix(folder, step1.replace("return y.to(x.dtype), rstd", "return y, rstd"), "comment", slug="one")
    add_fix(folder, step1, "dtype", slug="two")
    sample = read_sample(folder)
    assert [f["patch"] for f in sample.fixes] == ["patches/01-one.patch", "patches/02-two.patch"]
    assert sample.source("after-fix") == step1
    assert sample.source("after-fix", upto=1) == step1.replace("return y.to(x.dtype), rstd", "return y, rstd")
    assert sample.source("first-shot") == BUGGY_RMSNORM
    with pytest.raises(ValueError, match="identical"):
        add_fix(folder, step1, "nothing")
    with pytest.raises(ValueError, match="one-line reason"):
        add_fix(folder, GOOD_RMSNORM, "two\nlines")


def test_metadata_records_the_prompt_and_its_hash(tmp_path):
    folder = store(tmp_path, GOOD_RMSNORM, "test/provenance")
    meta = json.loads((folder / "metadata.json").read_text())
    assert meta["prompt"] == "prompts/triton-rmsnorm.v1.md"
    assert meta["prompt_sha256"] == sha256_file(RMSNORM_PROMPT)
    assert meta["generator"]["model"] == "test/provenance"
    assert meta["sampling"] == {"temperature": 0.0} and meta["date"] == "2026-01-02" and meta["attempts"] == 1
    assert (folder / "raw.py").read_text() == GOOD_RMSNORM  # exactly the code block
    assert (folder / "completion.md").read_text() == answer(GOOD_RMSNORM)
    (impl,) = records_for(folder)
    assert impl.meta["prompt_sha256_ok"] is True
    meta["prompt_sha256"] = "0" * 64  # as if the prompt had been edited after generation
    (folder / "metadata.json").write_text(json.dumps(meta))
    (impl,) = records_for(folder)
    assert impl.meta["prompt_sha256_ok"] is False


def test_code_that_does_not_import_registers_and_fails_as_an_error(tmp_path):
    folder = store(tmp_path, "import torch\n\ndef rmsnorm_fwd(x, weight, eps)\n    return x\n", "test/syntax-error")
    missing = store(tmp_path, "import torch\nimport no_such_dsl_module\n", "test/import-error")
    for f, expect in ((folder, "SyntaxError"), (missing, "ModuleNotFoundError")):
        (impl,) = records_for(f)  # discovery reads metadata only: no error here
        r = run_check(impl, "rmsnorm", "fwd", SHAPE, "bf16", "cpu")
        assert r.status == "error"
        assert "does not import" in r.error and expect in r.error, r.error


def test_malformed_folders_are_skipped_not_fatal(tmp_path):
    good = store(tmp_path, GOOD_RMSNORM, "test/discovery")
    root = good.parent
    (root / "no-metadata").mkdir()
    (root / "no-metadata" / "raw.py").write_text("x = 1\n")
    (root / "bad-json").mkdir()
    (root / "bad-json" / "metadata.json").write_text("{not json")
    unlisted = store(tmp_path, GOOD_RMSNORM, "test/unlisted-patch")
    (unlisted / "patches").mkdir()
    (unlisted / "patches" / "01-x.patch").write_text("")
    (root / ".triton-rmsnorm-in-progress").mkdir()  # a sample being written: ignored
    SAMPLE_ERRORS.clear()
    with pytest.warns(UserWarning):
        names = [i.name for i in discover(root)]
    assert names == [good.name]
    errors = {Path(k).name: v for k, v in SAMPLE_ERRORS.items()}
    assert set(errors) == {"no-metadata", "bad-json", unlisted.name}
    assert "not listed in metadata.json" in errors[unlisted.name]
    SAMPLE_ERRORS.clear()


def test_every_sample_loads_through_one_entry_point(tmp_path):
    """One loader for every DSL: whether Triton's interpreter was switched on in time is decided by
    triton's own import, not by the entry module, so the records need no module per DSL."""
    t = records_for(store(tmp_path, GOOD_RMSNORM, "test/entry-t"))[0]
    h = records_for(store(tmp_path, GOOD_RMSNORM, "test/entry-h", PROMPTS / "helion-rmsnorm.v1.md"))[0]
    c = records_for(store(tmp_path, GOOD_RMSNORM, "test/entry-c", PROMPTS / "cute-rmsnorm.v1.md"))[0]
    g = records_for(store(tmp_path, GOOD_RMSNORM, "test/entry-g", PROMPTS / "gluon-rmsnorm.v1.md"))[0]
    assert {r.entry for r in (t, h, c, g)} == {"impls.llm.samples:load_module"}
    assert (t.dsl, t.interpreter) == ("llm-triton", "TRITON_INTERPRET")
    assert (h.dsl, h.interpreter, c.dsl, c.devices) == ("llm-helion", "HELION_INTERPRET", "llm-cute", ("cuda",))
    assert (g.dsl, g.interpreter, g.devices) == ("llm-gluon", None, ("cuda",))


def test_gluon_sample_is_gpu_only(tmp_path):
    """Gluon kernels do not run in Triton's interpreter: on the CPU a gluon sample is skipped with
    the reason, never imported (its code here would run fine, so an import would show as a pass)."""
    folder = store(tmp_path, GOOD_RMSNORM, "test/gluon", PROMPTS / "gluon-rmsnorm.v1.md")
    assert folder.name == "gluon-rmsnorm-gluon-20260102-1"
    (impl,) = records_for(folder)
    assert impl.prompt == "prompts/gluon-rmsnorm.v1.md" and impl.description.startswith("Gluon RMSNorm generated by")
    assert {r.kind for r in impl.requires} == {"cuda", "capability", "package"}
    assert "runs on cuda only" in impl.unavailable("cpu")
    r = run_check(impl, "rmsnorm", "fwd", SHAPE, "bf16", "cpu")
    assert r.status == "skip" and "cuda" in r.error
    if not torch.cuda.is_available():
        assert "CUDA device" in impl.unavailable("cuda")


@pytest.mark.parametrize("weights", ["same", "fp32"])
def test_add_rmsnorm_sample_registers_and_is_checked(tmp_path, weights):
    """An op whose name holds an underscore: the prompt name, the folder name and the record."""
    folder = store(tmp_path, GOOD_ADD_RMSNORM, f"test/add-{weights}", PROMPTS / "triton-add_rmsnorm.v1.md")
    assert folder.name == f"triton-add_rmsnorm-add-{weights}-20260102-1"
    meta = json.loads((folder / "metadata.json").read_text())
    assert (meta["dsl"], meta["op"], meta["prompt"]) == ("triton", "add_rmsnorm", "prompts/triton-add_rmsnorm.v1.md")
    (impl,) = records_for(folder)
    assert impl.ops == ("add_rmsnorm",) and impl.dsl == "llm-triton"
    assert impl.description.startswith("Triton fused add + RMSNorm generated by")
    for direction in ("fwd", "bwd"):
        for affine in (True, False):
            r = run_check(impl, "add_rmsnorm", direction, SHAPE, "bf16", "cpu", seed=3, affine=affine, weights=weights)
            assert r.passed, (direction, affine, r.summary())


def test_discovery_imports_no_dsl(tmp_path):
    """impls.llm (and impls.llm.generate) import with triton, helion and cutlass unavailable."""
    store(tmp_path, GOOD_RMSNORM, "test/no-dsl")
    store(tmp_path, GOOD_ADD_RMSNORM, "test/no-dsl-gluon", PROMPTS / "gluon-add_rmsnorm.v1.md")
    code = (
        "import sys\n"
        "for m in ('triton', 'helion', 'cutlass'): sys.modules[m] = None  # importing them now fails\n"
        "import impls.llm, impls.llm.generate\n"
        f"print(len(impls.llm.discover({str(tmp_path / 'llm')!r})))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "2"


# ---------------------------------------------------------------- prompts
def _python_blocks(text: str) -> str:
    return "\n".join(re.findall(r"```python\n(.*?)```", text, flags=re.S))


def _fp32_params(dsl: str, op: str) -> bool:
    """Whether a v1 prompt allows fp32 parameters beside 16-bit x: the ones written after mixed
    precision joined the contract do; the first Triton, Helion and CuTe DSL RMSNorm and LayerNorm
    prompts (never edited) say weight has x's dtype."""
    return dsl == "gluon" or op == "add_rmsnorm"


def test_prompt_names_say_dsl_and_op():
    assert parse_prompt_name("prompts/triton-add_rmsnorm.v1.md") == ("triton", "add_rmsnorm")
    assert parse_prompt_name("gluon-layernorm.v12.md") == ("gluon", "layernorm")


@pytest.mark.parametrize(
    "name",
    ["triton-add-rmsnorm.v1.md", "gluon_rmsnorm.v1.md", "triton-_rmsnorm.v1.md", "mojo-rmsnorm.v1.md",
     "triton-groupnorm.v1.md", "triton-rmsnorm.md"],
)  # fmt: skip
def test_prompt_names_that_do_not_say_a_known_target_are_refused(name):
    with pytest.raises(ValueError, match="does not say its target"):
        parse_prompt_name(name)


@pytest.mark.parametrize("dsl", DSLS)
@pytest.mark.parametrize("op", OPS)
def test_prompt_reference_code_matches_the_harness_reference(dsl, op):
    """The PyTorch code a prompt shows (Model and the reference functions) computes what the
    checker checks against: a wrong formula in a prompt would doom every sample made from it."""
    text = (PROMPTS / f"{dsl}-{op}.v1.md").read_text()
    assert f"{op}_fwd" in text and f"{op}_bwd" in text and "get_init_inputs" in text
    ns: dict = {}
    exec(_python_blocks(text), ns)
    gen = torch.Generator().manual_seed(0)
    m, n, eps = 5, 37, 1e-5
    x, dy = torch.randn(m, n, generator=gen) + 0.5, torch.randn(m, n, generator=gen)
    residual, dresidual = torch.randn(m, n, generator=gen), torch.randn(m, n, generator=gen)
    w, b = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    model = ns["Model"](*ns["get_init_inputs"]())
    assert [tuple(p.shape) for p in model.parameters()] == [(ns["hidden_size"],)] * (2 if op == "layernorm" else 1)
    model = ns["Model"](n, eps=eps)
    with torch.no_grad():
        model.weight.copy_(w)
        if op == "layernorm":
            model.bias.copy_(b)
    if op == "rmsnorm":
        got = ns["rmsnorm_fwd_reference"](x, w, eps) + ns["rmsnorm_bwd_reference"](
            dy, x, w, reference.rmsnorm_fwd(x, w, eps)[1].float()
        )
        want = reference.rmsnorm_fwd(x, w, eps) + reference.rmsnorm_bwd(dy, x, w, reference.rmsnorm_fwd(x, w, eps)[1])
        model_y = model(x)
    elif op == "layernorm":
        _, mean, rstd = reference.layernorm_fwd(x, w, b, eps)
        got = ns["layernorm_fwd_reference"](x, w, b, eps) + ns["layernorm_bwd_reference"](
            dy, x, w, mean.float(), rstd.float()
        )
        want = reference.layernorm_fwd(x, w, b, eps) + reference.layernorm_bwd(dy, x, w, mean, rstd)
        model_y = model(x)
    else:
        fwd = reference.add_rmsnorm_fwd(x, residual, w, eps)
        h, rstd = fwd[1], fwd[2]
        got = ns["add_rmsnorm_fwd_reference"](x, residual, w, eps)
        want = fwd
        for dres in (dresidual, None):  # no gradient from later blocks: dh is the norm's alone
            got += ns["add_rmsnorm_bwd_reference"](dy, dres, h.to(x.dtype), w, rstd.float())
            want += reference.add_rmsnorm_bwd(dy, dres, h, w, rstd)
        xr, rr = x.clone().requires_grad_(), residual.clone().requires_grad_()
        model_y, model_h = model(xr, rr)
        torch.testing.assert_close(model_h.double(), h, rtol=1e-6, atol=1e-6)
        # the backward the prompt states is autograd's: x and residual both receive dh
        torch.autograd.backward((model_y, model_h), (dy, dresidual))
        for grad in (xr.grad, rr.grad):
            torch.testing.assert_close(grad.double(), want[3], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(model.weight.grad.double(), want[4], rtol=1e-4, atol=1e-4)
        model_y = model_y.detach()
    for g, r in zip(got, want, strict=True):
        torch.testing.assert_close(g.double(), r, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(model_y.double(), want[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("dsl", "op"), [(d, o) for d in DSLS for o in OPS if _fp32_params(d, o)])
def test_prompt_reference_code_keeps_fp32_parameters(dsl, op):
    """Mixed precision: with bf16 x and fp32 parameters, the prompt's reference returns the
    activations in bf16 and the parameter gradients in fp32, as the checker expects."""
    text = (PROMPTS / f"{dsl}-{op}.v1.md").read_text()
    assert "**or float32**" in text and "the weight's dtype" in text
    ns: dict = {}
    exec(_python_blocks(text), ns)
    gen = torch.Generator().manual_seed(1)
    m, n, eps = 4, 19, 1e-6
    x, dy, residual = (torch.randn(m, n, generator=gen).bfloat16() for _ in range(3))
    w, b = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    if op == "rmsnorm":
        y, rstd = ns["rmsnorm_fwd_reference"](x, w, eps)
        grads = ns["rmsnorm_bwd_reference"](dy, x, w, rstd)
    elif op == "layernorm":
        y, mean, rstd = ns["layernorm_fwd_reference"](x, w, b, eps)
        grads = ns["layernorm_bwd_reference"](dy, x, w, mean, rstd)
    else:
        y, h, rstd = ns["add_rmsnorm_fwd_reference"](x, residual, w, eps)
        assert h.dtype == torch.bfloat16
        grads = ns["add_rmsnorm_bwd_reference"](dy, None, h, w, rstd)
    assert y.dtype == grads[0].dtype == torch.bfloat16
    assert [g.dtype for g in grads[1:]] == [torch.float32] * (len(grads) - 1)
