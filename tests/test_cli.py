import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness.cli import main, markdown_impl_table
from harness.contract import OPS

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
        (["codegen", "eager"], "no codegen hook"),
        (["rank", "/nonexistent"], "no results.jsonl"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, needle, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1


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


def test_check_reports_unavailable_as_skipped_not_passed():
    out = run("check", "--impl", "quack", "--shapes", "smoke", "--device", "cpu")
    assert out.returncode == 0 and "skipped" in out.stdout and "0 passed" in out.stdout


def test_readme_implementation_table_is_generated_from_the_registry():
    text = (ROOT / "README.md").read_text()
    start, end = text.index("<!-- impls:start -->"), text.index("<!-- impls:end -->")
    assert text[start:end].split("\n", 1)[1].strip() == markdown_impl_table().strip(), "run: normbench list --update-readme"
