"""`normbench new NAME [--dsl eager|triton]`: a new implementation folder to start from.

Writes ``impls/NAME/__init__.py`` (the record, as the README's "Adding one" shows it) and
``impls/NAME/kernels.py`` (a copy of a template in ``harness/tools/templates/``: the six contract
functions as plain PyTorch formulas, or as one-row-per-program Triton kernels), which pass
``normbench check --impl NAME --device cpu`` as they are. It never overwrites: an existing folder,
a name already registered, or a name that cannot be a package under ``impls/`` is refused.
"""

from __future__ import annotations

import keyword
import re
from pathlib import Path

IMPLS_DIR = Path(__file__).resolve().parents[2] / "impls"
TEMPLATES = Path(__file__).resolve().parent / "templates"
NAME = re.compile(r"[a-z][a-z0-9_]{0,63}")

# per DSL: the kernels template, the record's fields after name/dsl/entry, and what it is
DSLS = {
    "eager": (
        "eager_kernels.py",
        'devices=("cpu", "cuda"),',
        "RMSNorm, LayerNorm and add + RMSNorm as plain PyTorch formulas in fp32",
    ),
    "triton": (
        "triton_kernels.py",
        'devices=("cpu", "cuda"), interpreter="TRITON_INTERPRET", requires=(package("triton"),),',
        "Triton: one program per row, the row in registers; dweight from per-row partials summed by torch",
    ),
}

INIT = '''from harness.spec.contract import {imports}

IMPLEMENTATIONS = [
    Implementation(
        name="{name}", dsl="{dsl}", entry="impls.{name}.kernels", description="{description}",
        {fields}
        ops=("rmsnorm", "layernorm", "add_rmsnorm"), sources=("impls/{name}/kernels.py",),
    )
]
'''


def check_name(name: str, impls_dir: Path | None = None) -> None:
    """A ValueError unless ``name`` can be a new folder and implementation: a lower-case Python
    identifier (it is a package under ``impls``), no folder of that name, no implementation of that
    name registered already."""
    impls_dir = IMPLS_DIR if impls_dir is None else impls_dir
    if not impls_dir.is_dir():
        raise ValueError(f"{impls_dir} is not a folder: run normbench new in a checkout of normbench")
    if not isinstance(name, str):
        raise TypeError(f"the name must be a str, got {type(name).__name__}")
    if not NAME.fullmatch(name) or keyword.iskeyword(name):
        shown = "".join(c if c.isprintable() else "?" for c in name[:60])
        raise ValueError(
            f"bad name '{shown}': it names a package under impls/, so lower-case letters, digits and _ "
            "(a letter first, at most 64), not a Python keyword; for example mynorm"
        )
    if (impls_dir / name).exists():
        raise ValueError(f"{impls_dir / name} exists already: choose another name (nothing was written)")
    from harness.registry import all_implementations

    if name in all_implementations():
        raise ValueError(f"an implementation named '{name}' is registered already: choose another name (nothing was written)")


def new(name: str, dsl: str = "eager", impls_dir: Path | None = None) -> list[Path]:
    """Writes ``impls_dir/name/__init__.py`` and ``kernels.py``; returns their paths."""
    if dsl not in DSLS:
        raise ValueError(f"unknown --dsl '{dsl}'; choose from {', '.join(DSLS)}")
    impls_dir = IMPLS_DIR if impls_dir is None else Path(impls_dir)
    check_name(name, impls_dir)
    template, fields, description = DSLS[dsl]
    folder = impls_dir / name
    folder.mkdir(parents=False)
    init, kernels = folder / "__init__.py", folder / "kernels.py"
    imports = "Implementation, package" if "package(" in fields else "Implementation"
    init.write_text(INIT.format(imports=imports, name=name, dsl=dsl, description=description, fields=fields))
    kernels.write_text((TEMPLATES / template).read_text())
    from harness import registry

    registry._REGISTRY = None  # discovered again, with the new folder, when next asked
    return [init, kernels]


def main(name: str, dsl: str) -> int:
    paths = new(name, dsl)
    for p in paths:
        print(f"wrote {p}")
    print(f"next: normbench check --impl {name} --device cpu --shapes smoke; then normbench list --update-readme")
    return 0
