"""The architecture is a contract: pyproject.toml's import-linter contracts hold (the harness in
layers, the harness never importing an implementation, implementation folders independent), and
the checker does catch a violation."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytest.importorskip("importlinter", reason="import-linter is in the dev extra: pip install -e '.[dev]'")


def _lint(config: Path, cwd: Path) -> subprocess.CompletedProcess:
    code = "import sys\nfrom importlinter.cli import lint_imports\nsys.exit(lint_imports(config_filename=sys.argv[1], no_cache=True))"
    env = {**os.environ, "PYTHONPATH": str(cwd)}
    return subprocess.run([sys.executable, "-c", code, str(config)], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_the_repository_keeps_its_import_contracts():
    out = _lint(ROOT / "pyproject.toml", ROOT)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "Contracts: 4 kept, 0 broken." in out.stdout, out.stdout[-2000:]


def test_an_upward_import_breaks_the_layers(tmp_path):
    """The same kind of contract on a two-layer package with one import going up: it must fail."""
    pkg = tmp_path / "toy"
    (pkg / "spec").mkdir(parents=True)
    (pkg / "run").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "spec" / "__init__.py").write_text("from toy.run import bench  # an import from a lower layer back up\n")
    (pkg / "run" / "__init__.py").write_text("")
    (pkg / "run" / "bench.py").write_text("from toy import spec\n")
    cfg = tmp_path / "pyproject.toml"
    cfg.write_text(textwrap.dedent("""
        [tool.importlinter]
        root_packages = ["toy"]
        [[tool.importlinter.contracts]]
        name = "toy layers"
        type = "layers"
        layers = ["toy.run", "toy.spec"]
    """))
    out = _lint(cfg, tmp_path)
    assert out.returncode != 0 and "toy.spec is not allowed to import toy.run" in out.stdout, out.stdout[-2000:]
