import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from harness.cli import main
from harness.results.generated import impl_table
from harness.spec.contract import OPS

ROOT = Path(__file__).resolve().parent.parent


def run(*args):
    return subprocess.run([sys.executable, "-m", "harness", *args], capture_output=True, text=True, cwd=ROOT, timeout=600)


def test_list_json_shows_eager_and_compile():
    out = run("list", "--json")
    assert out.returncode == 0, out.stderr
    rows = {r["name"]: r for r in json.loads(out.stdout)}
    assert rows["eager"]["available"]["cpu"] and rows["compile"]["available"]["cpu"]
    assert rows["quack"]["external"]


@pytest.mark.parametrize(
    "args,needle",
    [
        (["check", "--impl", "nope"], "no implementation matches"),
        (["check", "--dtype", "int8"], "unknown dtype"),
        (["check", "--op", "batchnorm"], "unknown op"),
        (["check", "--shapes", "huge"], "unknown shape set"),
        (["check", "--shapes", "sweep@300000-"], "has no N in 300000..inf"),
        (["codegen", "eager"], "no codegen hook"),
        (["rank", "/nonexistent"], "no such benchmark folder"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, needle, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1


def test_a_range_of_a_shape_set_keeps_its_name_and_its_n_in_range():
    from harness.cli import _shape_sets
    from harness.spec.shapes import SHAPE_SETS, SWEEP_N

    [(name, shapes)] = _shape_sets("sweep@5120-", "cuda")
    assert name == "sweep" and [s.n for s in shapes] == [n for n in SWEEP_N if n >= 5120]
    [(_, shapes)] = _shape_sets("between@-4001", "cuda")
    assert {s.n for s in shapes} == {s.n for s in SHAPE_SETS["between"] if s.n <= 4001} and len(shapes) == 5
    [(_, shapes)] = _shape_sets("sweep@2048-4096", "cuda")
    assert [s.n for s in shapes] == [2048, 2880, 4096]


def test_bench_without_gpu_is_one_line_and_exit_2():
    pytest.importorskip("triton")
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    out = run("bench")
    assert out.returncode == 2 and out.stderr.strip().count("\n") == 0 and "CUDA GPU" in out.stderr


def test_check_passes_and_writes_json(tmp_path):
    out = run("check", "--impl", "eager", "--shapes", "smoke", "--dtype", "bf16", "--device", "cpu", "--json", str(tmp_path / "c.json"))
    assert out.returncode == 0, out.stdout + out.stderr
    data = json.loads((tmp_path / "c.json").read_text())
    assert len(data["results"]) == 15 * 2 * len(OPS) and all(r["status"] == "pass" for r in data["results"])


def test_check_that_checked_nothing_fails_with_the_reason():
    out = run("check", "--impl", "quack", "--shapes", "smoke", "--device", "cpu")
    assert out.returncode == 1 and "skipped" in out.stdout and "0 passed" in out.stdout
    assert "nothing was checked on cpu" in out.stderr and "runs on cuda only" in out.stderr


def test_readme_implementation_table_is_generated_from_the_registry():
    text = (ROOT / "README.md").read_text()
    start, end = text.index("<!-- impls:start -->"), text.index("<!-- impls:end -->")
    assert text[start:end].split("\n", 1)[1].strip() == impl_table().strip(), "run: normbench list --update-readme"


def _readme_record() -> str:
    """The record the README's "Adding one" shows, verbatim."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("### Adding one") : text.index("## Correctness")]
    return textwrap.dedent(section.split("```python\n", 1)[1].split("```", 1)[0])


@pytest.fixture
def new_folder(tmp_path, monkeypatch):
    """Adds impls/mynorm/ as the README says: its __init__.py, and kernels (eager's formulas)."""
    import impls
    from harness import registry

    def make(init_text: str):
        pkg = tmp_path / "extra" / "mynorm"
        pkg.mkdir(parents=True)
        (pkg / "__init__.py").write_text(init_text)
        shutil.copy(ROOT / "impls" / "eager" / "kernels.py", pkg / "kernels.py")
        monkeypatch.setattr(impls, "__path__", [*impls.__path__, str(tmp_path / "extra")])
        monkeypatch.setattr(registry, "_REGISTRY", None)

    yield make
    registry._REGISTRY = None
    for mod in ("impls.mynorm", "impls.mynorm.kernels"):
        sys.modules.pop(mod, None)


def test_a_folder_added_as_the_readme_says_is_checked_here(new_folder, capsys):
    new_folder(_readme_record())
    argv = ["check", "--impl", "mynorm", "--shapes", "smoke", "--dtype", "bf16", "--device", "cpu", "--quiet"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "60 passed, 0 failed" in out and "mynorm" in out
    assert main(["list", "--json"]) == 0
    row = next(r for r in json.loads(capsys.readouterr().out) if r["name"] == "mynorm")
    assert row["here"]["runs"]


def test_a_gpu_only_folder_fails_loudly_where_it_cannot_run(new_folder, capsys):
    """The record's default devices=("cuda",): on the CPU the check checks nothing and must say so."""
    record = _readme_record()
    assert 'devices=("cpu", "cuda"), ' in record
    new_folder(record.replace('devices=("cpu", "cuda"), ', ""))
    assert main(["check", "--impl", "mynorm", "--shapes", "smoke", "--device", "cpu", "--quiet"]) == 1
    captured = capsys.readouterr()
    assert "nothing was checked on cpu" in captured.err and "runs on cuda only" in captured.err
    assert main(["list", "--json"]) == 0
    row = next(r for r in json.loads(capsys.readouterr().out) if r["name"] == "mynorm")
    import torch

    assert row["here"]["runs"] == torch.cuda.is_available()
    if not torch.cuda.is_available():
        assert "runs on cuda only" in row["here"]["why_not"] and row["available"] == {"cuda": False}
        assert "none is available here" in row["why_not"]["cuda"]
        assert main(["list"]) == 0
        line = next(ln for ln in capsys.readouterr().out.splitlines() if "mynorm" in ln)
        assert "no" in line and "yes" not in line


def test_a_plain_implementation_name_does_not_select_a_dsl_of_that_name(new_folder):
    from harness.registry import select

    new_folder('from harness.spec.contract import Implementation\nIMPLEMENTATIONS = [Implementation(name="mynorm", dsl="eager", entry="impls.mynorm.kernels")]\n')
    assert [i.name for i in select("eager")] == ["eager"]
    assert {i.name for i in select("eager*")} == {"eager", "mynorm"}  # a glob still matches DSLs


def _render(renderable, width: int) -> str:
    from rich.console import Console

    con = Console(width=width, record=True, file=open(os.devnull, "w"))
    con.print(renderable)
    return con.export_text()


def test_tables_are_readable_at_100_columns():
    """Every implementation name whole on one line, no number cut off, the ulp column explained."""
    from harness.registry import all_implementations
    from harness.run.check import ULP_NOTE, Outcome, table
    from harness.run.checker import CheckResult, TensorReport

    names = sorted(all_implementations())
    results = [("smoke", CheckResult(n, "layernorm", "bwd", "128x4096", "bf16", "cpu", "pass", [TensorReport("dx", True, 1e-3, 1.2345e6, 1e-4)])) for n in names]
    text = _render(table(Outcome("cpu", results), 100), 100)
    assert "…" not in text and "max ulp" in text and text.count("1.23e+06") == len(names)
    assert all(n in text for n in names), [n for n in names if n not in text]
    assert "floor" in ULP_NOTE and "2 ulps" in ULP_NOTE


def test_check_prints_progress_lines_when_not_on_a_terminal():
    out = run("check", "--impl", "eager", "--op", "rmsnorm", "--shapes", "1x7", "--device", "cpu")
    assert out.returncode == 0, out.stderr
    assert "check [1/1] eager rmsnorm: 6 passed" in out.stdout


def test_list_and_rank_are_not_cut_at_100_columns(tmp_path):
    import os as _os

    env = {**_os.environ, "COLUMNS": "100"}
    out = subprocess.run([sys.executable, "-m", "harness", "list"], capture_output=True, text=True, cwd=ROOT, timeout=300, env=env)
    assert out.returncode == 0 and "…" not in out.stdout, out.stdout
    rows = []
    for name in ("compile-max-autotune", "helion-layernorm-claude-20261122-1", "eager"):
        rows.append({"impl": name, "dsl": "x", "op": "layernorm", "direction": "fwd", "shape_set": "sweep", "shape": "1024x1024",
                     "M": 1024, "N": 1024, "dtype": "bf16", "status": "ok", "ms": 0.0123456, "tbps": 3.21, "frac_roofline": 0.7654})  # fmt: skip
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = subprocess.run([sys.executable, "-m", "harness", "rank", str(tmp_path)], capture_output=True, text=True, cwd=ROOT, timeout=300, env=env)
    assert out.returncode == 0 and "…" not in out.stdout, out.stdout
    assert "helion-layernorm-claude-20261122-1" in out.stdout and "76.5%" in out.stdout
