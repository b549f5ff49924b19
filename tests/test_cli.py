import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from harness.cli import main
from harness.results.generated import impl_table
from harness.spec.contract import OPS
from harness.spec.ops import get_op

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
    # every op's directions on the 15 smoke shapes; the 1 x 128 FP8 ops skip N not a multiple of 128
    assert len(data["results"]) == 15 * sum(len(get_op(op).directions) for op in OPS)
    assert all(r["status"] == "pass" or (r["status"] == "skip" and get_op(r["op"]).group) for r in data["results"])


def test_check_that_checked_nothing_fails_with_the_reason():
    out = run("check", "--impl", "quack", "--shapes", "smoke", "--device", "cpu")
    assert out.returncode == 1 and "skipped" in out.stdout and "0 passed" in out.stdout
    assert "nothing was checked on cpu" in out.stderr and "runs on cuda only" in out.stderr


def test_readme_implementation_table_is_generated_from_the_registry():
    text = (ROOT / "README.md").read_text()
    start, end = text.index("<!-- impls:start -->"), text.index("<!-- impls:end -->")
    assert text[start:end].split("\n", 1)[1].strip() == impl_table().strip(), "run: normbench list --update-readme"


# The folder the "Adding one" tests add: a name nobody gives an implementation of their own, so that
# a user's impls/mynorm (the README's example name) never meets it.
NEW = "zz_readme_ex"


def _readme_record(name: str = NEW) -> str:
    """The record the README's "Adding one" shows, verbatim but for its name (mynorm), given as ``name``."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("### Adding one") : text.index("## Correctness")]
    record = textwrap.dedent(section.split("```python\n", 1)[1].split("```", 1)[0])
    assert 'name="mynorm"' in record and '"impls.mynorm.kernels"' in record, record
    return record.replace("mynorm", name)


def _package(folder: Path, init_text: str) -> None:
    folder.mkdir(parents=True)
    (folder / "__init__.py").write_text(init_text)
    shutil.copy(ROOT / "impls" / "eager" / "kernels.py", folder / "kernels.py")


@pytest.fixture(params=["alone", "beside-a-user-mynorm"])
def new_folder(request, tmp_path, monkeypatch):
    """Adds impls/<NEW>/ as the README says: its __init__.py, and kernels (eager's formulas); in the
    second run beside an impls/mynorm/ of a user's own, made from the README's record as it stands."""
    import impls
    from harness import registry

    paths = [*impls.__path__]
    if request.param == "beside-a-user-mynorm":
        _package(tmp_path / "user" / "mynorm", _readme_record("mynorm"))
        paths.append(str(tmp_path / "user"))

    def make(init_text: str):
        _package(tmp_path / "extra" / NEW, init_text)
        monkeypatch.setattr(impls, "__path__", [*paths, str(tmp_path / "extra")])
        monkeypatch.setattr(registry, "_REGISTRY", None)

    yield make
    registry._REGISTRY = None
    for mod in [m for m in sys.modules if m.split(".")[:2] in (["impls", NEW], ["impls", "mynorm"])]:
        sys.modules.pop(mod)


def test_a_folder_added_as_the_readme_says_is_checked_here(new_folder, capsys):
    new_folder(_readme_record())
    argv = ["check", "--impl", NEW, "--shapes", "smoke", "--dtype", "bf16", "--device", "cpu", "--quiet"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "60 passed, 0 failed" in out and NEW in out
    assert main(["list", "--json"]) == 0
    row = next(r for r in json.loads(capsys.readouterr().out) if r["name"] == NEW)
    assert row["here"]["runs"]


def test_a_gpu_only_folder_fails_loudly_where_it_cannot_run(new_folder, capsys):
    """The record's default devices=("cuda",): on the CPU the check checks nothing and must say so."""
    record = _readme_record()
    assert 'devices=("cpu", "cuda"), ' in record
    new_folder(record.replace('devices=("cpu", "cuda"), ', ""))
    assert main(["check", "--impl", NEW, "--shapes", "smoke", "--device", "cpu", "--quiet"]) == 1
    captured = capsys.readouterr()
    assert "nothing was checked on cpu" in captured.err and "runs on cuda only" in captured.err
    assert main(["list", "--json"]) == 0
    row = next(r for r in json.loads(capsys.readouterr().out) if r["name"] == NEW)
    import torch

    assert row["here"]["runs"] == torch.cuda.is_available()
    if not torch.cuda.is_available():
        assert "runs on cuda only" in row["here"]["why_not"] and row["available"] == {"cuda": False}
        assert "none is available here" in row["why_not"]["cuda"]
        assert main(["list"]) == 0
        line = next(ln for ln in capsys.readouterr().out.splitlines() if NEW in ln)
        assert "no" in line and "yes" not in line


def test_a_plain_implementation_name_does_not_select_a_dsl_of_that_name(new_folder):
    from harness.registry import select

    new_folder(f'from harness.spec.contract import Implementation\nIMPLEMENTATIONS = [Implementation(name="{NEW}", dsl="eager", entry="impls.{NEW}.kernels")]\n')
    assert [i.name for i in select("eager")] == ["eager"]
    assert NEW in {i.name for i in select("eager*")} and "eager" in {i.name for i in select("eager*")}  # a glob still matches DSLs


def test_the_contract_states_the_overflow_rule():
    """Rows whose squares overflow fp32: NaN or the right answer, never a finite wrong number, for
    the ops whose record says so (LayerNorm), in the README's contract and in the contract module."""
    from harness.spec import contract
    from harness.spec.ops import OPS

    assert [name for name, op in OPS.items() if op.overflow] == ["layernorm"]
    readme = (ROOT / "README.md").read_text()
    for text in (readme[readme.index("## The contract") : readme.index("## Implementations")], contract.__doc__):
        flat = " ".join(text.split())
        assert "overflow fp32" in flat and "NaN" in flat and "LayerNorm" in flat, flat[:300]
        assert "never a finite wrong number" in flat


@pytest.fixture
def new_impls(tmp_path, monkeypatch):
    """`normbench new` pointed at an impls folder of its own, which the registry also reads."""
    import impls
    from harness import registry
    from harness.tools import new

    folder = tmp_path / "impls"
    folder.mkdir()
    monkeypatch.setattr(new, "IMPLS_DIR", folder)
    monkeypatch.setattr(impls, "__path__", [*impls.__path__, str(folder)])
    monkeypatch.setattr(registry, "_REGISTRY", None)
    yield folder
    registry._REGISTRY = None
    for mod in [m for m in sys.modules if m.startswith(f"impls.{NEW}")]:
        sys.modules.pop(mod)


@pytest.mark.slow
@pytest.mark.parametrize("dsl,narrowed", [("eager", []), ("triton", ["--dtype", "bf16"])])
def test_normbench_new_writes_a_folder_that_passes_check(new_impls, dsl, narrowed, capsys):
    """The template of each DSL, as written, passes the check of the smoke set on the CPU (Triton's
    in its interpreter, on bf16, where the interpreter truncates its conversions)."""
    from harness.tools import new

    assert new.IMPLS_DIR == new_impls and new.TEMPLATES.is_dir()
    name = f"{NEW}_{dsl}"
    assert main(["new", name, "--dsl", dsl]) == 0
    assert sorted(p.name for p in (new_impls / name).iterdir()) == ["__init__.py", "kernels.py"]
    assert f"wrote {new_impls / name / 'kernels.py'}" in capsys.readouterr().out
    assert main(["check", "--impl", name, "--device", "cpu", "--shapes", "smoke", "--quiet", *narrowed]) == 0
    out = capsys.readouterr().out
    assert re.search(r"\b[1-9]\d* passed, 0 failed", out), out[-500:]
    assert main(["list", "--json"]) == 0
    row = next(r for r in json.loads(capsys.readouterr().out) if r["name"] == name)
    assert row["dsl"] == dsl and row["here"]["runs"]


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["new", "taken"], "exists already"),  # a folder of that name
        (["new", "quack"], "registered already"),  # no folder, but an implementation of that name
        (["new", "1norm"], "bad name"),
        (["new", "my-norm"], "bad name"),
        (["new", "MyNorm"], "bad name"),
        (["new", "class"], "bad name"),
        (["new", "a/b"], "bad name"),
        (["new", ""], "bad name"),
        (["new", "two\nlines"], "bad name"),
        (["new", "fine", "--dsl", "cute"], "invalid choice"),
        (["new"], "required"),
    ],
)  # fmt: skip
def test_normbench_new_refuses_in_one_line_and_writes_nothing(new_impls, argv, needle, capsys):
    (new_impls / "taken").mkdir()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1, err
    assert [p.name for p in new_impls.iterdir()] == ["taken"] and not any((new_impls / "taken").iterdir())


def test_normbench_new_writes_into_the_checkout_impls_folder():
    from harness.tools import new

    assert new.IMPLS_DIR == ROOT / "impls"


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
