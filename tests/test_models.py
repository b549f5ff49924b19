"""`normbench model`: tiny models trained with their own norms and each CPU-capable implementation's;
agreement verdicts, reports, the timing path, broken implementations and bad input."""

import json

import pytest

from harness.run import models
from harness.cli import main
from harness.spec.contract import Implementation

WHY = models.transformers_missing()
pytestmark = pytest.mark.skipif(WHY is not None, reason=WHY or "")


def _model(tmp_path, *args):
    rc = main(["model", "--size", "tiny", "--steps", "2", "--device", "cpu", "--out", str(tmp_path), *args])
    reps = {p.name: json.loads(p.read_text()) for p in tmp_path.glob("*.json")}
    return rc, reps


def _statuses(rep):
    return {r["impl"]: r["status"] for r in rep["results"]}


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3", "gpt2"])
def test_eager_and_helion_agree_in_bf16(arch, tmp_path):
    rc, reps = _model(tmp_path, "--arch", arch, "--impl", "eager,helion")
    rep = reps[f"{arch}-tiny-eager.json"]
    assert rc == 0, rep["results"]
    assert _statuses(rep) == {"eager": "pass", "helion": "pass"}
    for r in rep["results"]:
        assert len(r["loss"]) == 2 and all(v == v for v in r["loss"])  # two finite steps
        assert set(r["rel_diff"]) == set(rep["tolerance"]["tol"])
    assert rep["own"]["loss"][0] != rep["own"]["loss"][1]  # the optimizer moved the weights
    # the controls moved the quantities (the tolerance is measured, not the floor everywhere)
    assert any(v > 0 for c in rep["tolerance"]["controls"] for v in c.values())
    md = (tmp_path / "models.md").read_text()
    assert f"## {arch}" in md and "| eager | yes |" in md


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_triton_kernels_agree_in_fp32(arch, tmp_path):
    # fp32: Triton 3.9's CPU interpreter converts fp32 to bf16 by truncation (every output rounded
    # toward zero), a bias this comparison rightly rejects and the GPU does not have (see README)
    rc, reps = _model(tmp_path, "--arch", arch, "--impl", "triton,llm-triton", "--dtype", "fp32")
    rep = reps[f"{arch}-tiny-eager.json"]
    st = _statuses(rep)
    assert rc == 0 and st.pop("triton") == "pass"
    # the LLM-written kernels each provide one op: the one of the model's norm runs, the others are
    # skipped with the reason
    op = "rmsnorm" if arch == "llama" else "layernorm"
    assert list(st.values()).count("pass") == 1 and set(st.values()) == {"pass", "skip"}
    assert any(r["status"] == "skip" and op in r["reason"] for r in rep["results"])


@pytest.mark.slow
def test_norm_level_compile_agrees(tmp_path):
    rc, reps = _model(tmp_path, "--arch", "qwen3", "--impl", "compile,!compile-max-autotune")
    assert rc == 0 and _statuses(reps["qwen3-tiny-eager.json"]) == {"compile": "pass"}


def test_control_perturbation_is_within_the_check_allowance():
    import torch

    from harness.spec.tolerances import TOLERANCES, ulp

    norm = torch.nn.RMSNorm(64, dtype=torch.bfloat16)
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    y0 = norm(x)
    with models.perturbed_norms([norm], seed=1, device="cpu"):
        y1 = norm(x)
    diff = (y1.float() - y0.float()).abs()
    allowed = TOLERANCES[torch.bfloat16].ulps * ulp(y0.float(), torch.bfloat16)
    assert (diff <= allowed).all() and (diff > 0).float().mean() > 0.3
    assert torch.equal(norm(x), y0)  # the hook is gone


def _mutant(factory):
    return Implementation(name=f"mutant-{factory}", dsl="eager", entry=f"tests.mutants:{factory}", ops=("rmsnorm",), devices=("cpu",))


def test_broken_kernels_fail_and_do_not_stop_the_others(tmp_path):
    from harness.registry import get

    impls = [_mutant("missing_rstd_gradient"), _mutant("nan_output"), _mutant("crashing"), get("eager")]
    rc = models.run(["llama"], "tiny", impls, device="cpu", steps=2, compile=False, trials=1, out=tmp_path)
    rep = json.loads((tmp_path / "llama-tiny-eager.json").read_text())
    assert rc == 1
    assert _statuses(rep) == {
        "mutant-missing_rstd_gradient": "fail",
        "mutant-nan_output": "fail",
        "mutant-crashing": "error",
        "eager": "pass",
    }
    crash = next(r for r in rep["results"] if r["status"] == "error")
    assert "simulated" in crash["reason"]
    # the timing path (forced on the CPU by trials=1): only what agrees is timed, against the own norms
    timing = rep["timing"]["variants"]
    assert set(timing) == {"own", "eager"}
    assert all(t["step_ms"] > 0 and len(t["trial_ms"]) == 1 and t["tokens_per_s"] > 0 for t in timing.values())
    assert timing["own"]["speedup_vs_own"] == 1.0
    assert "| mutant-crashing | error: RuntimeError" in (tmp_path / "models.md").read_text()


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--arch", "bert"], "unknown arch"),
        (["--arch", "llama", "--steps", "0"], "--steps"),
        (["--arch", "llama", "--dtype", "fp16"], "loss scaler"),
        (["--arch", "llama", "--trials", "-1"], "--trials"),
        (["--arch", "llama", "--impl", "no-such"], "no implementation matches"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, needle, capsys, tmp_path):
    rc = main(["model", "--device", "cpu", "--out", str(tmp_path), *args])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and needle in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_an_output_path_that_is_no_folder_fails_before_any_training(where, tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "report.md"
    blocker.write_text("kept")
    out = blocker if where == "a file" else blocker / "models"

    def train(*a, **k):
        raise AssertionError("trained before the output path was checked")

    monkeypatch.setattr(models, "run_arch", train)
    rc = main(["model", "--arch", "llama", "--impl", "eager", "--device", "cpu", "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and f"--out {out}" in err and "not a folder" in err, err
    assert blocker.read_text() == "kept"


def test_a_run_that_compared_nothing_fails_with_the_reasons(tmp_path, monkeypatch, capsys):
    """As `check`: every selected implementation skipped is exit 1, with why, not a quiet 0."""
    real = models.run_arch
    trained = []
    monkeypatch.setattr(models, "run_arch", lambda *a, **k: trained.append(a[0]) or real(*a, **k))
    # GPU-only implementations on the CPU: known before any model is built
    rc = main(["model", "--arch", "llama", "--impl", "quack,liger", "--device", "cpu", "--out", str(tmp_path / "a")])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and trained == [] and len(err.splitlines()) == 1, err
    assert "nothing was compared on cpu" in err and "quack: " in err and "liger: " in err and "cuda" in err
    # an implementation without the model's op (an RMSNorm-only sample in GPT-2, whose norms are LayerNorms)
    rc = main(["model", "--arch", "gpt2", "--size", "tiny", "--steps", "1", "--impl", "triton-rmsnorm-claude-20261122-1",
               "--device", "cpu", "--out", str(tmp_path / "b")])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert rc == 1 and trained == ["gpt2"], err
    assert "nothing was compared in gpt2 on cpu" in err and "does not provide layernorm" in err


def test_without_transformers_one_line_and_exit_2(monkeypatch, capsys):
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else object())
    rc = main(["model", "--arch", "llama", "--device", "cpu"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "transformers" in err and "normbench[models]" in err and len(err.splitlines()) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True])
def test_every_implementation_on_cuda(compiled, tmp_path):
    # compiled: whole-model torch.compile of every variant costs tens of seconds each; a subset
    # the LLM samples' first shots predate fp32 parameters (Gemma's 1 + w): their failures are results
    impls = "eager,triton,cute" if compiled else "*,!compile-max-autotune,!llm-*"
    args = ["model", "--arch", "llama,qwen3,gemma3,gpt2", "--size", "tiny", "--steps", "3", "--trials", "2",
            "--impl", impls, "--device", "cuda", "--out", str(tmp_path)] + (["--compile"] if compiled else [])  # fmt: skip
    rc = main(args)
    reps = [json.loads(p.read_text()) for p in tmp_path.glob("*.json")]
    assert len(reps) == 4
    for rep in reps:
        st = _statuses(rep)
        assert "fail" not in st.values() and "error" not in st.values(), rep["results"]
        assert st["cute"] == "pass" and rep["timing"]["variants"]["own"]["step_ms"] > 0
    assert rc == 0


def test_a_compiled_model_counts_compilation_among_its_controls(tmp_path):
    """Whole-model torch.compile: the compiled variants are compared with the compiled model, whose
    own difference from the uncompiled run (Inductor's rounding) is a control beside the perturbed
    runs; the report's text says so."""
    from harness.registry import get

    rc = models.run(["llama"], "tiny", [get("eager")], device="cpu", steps=2, compile=True, trials=0, out=tmp_path)
    rep = json.loads((tmp_path / "llama-tiny-compiled.json").read_text())
    controls = rep["tolerance"]["controls"]
    assert rc == 0 and len(controls) == len(models.CONTROL_SEEDS) + 1
    assert controls[-1] == models.rel_diffs(rep["own"], rep["own_uncompiled"])
    assert all(rep["tolerance"]["tol"][k] >= models.SAFETY * controls[-1][k] for k in controls[-1])
    assert "compiled model with its own norms against the uncompiled one" in (tmp_path / "models.md").read_text()
