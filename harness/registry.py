"""Automatic discovery: every subpackage of ``impls/`` that lists ``IMPLEMENTATIONS`` registers
itself (the external baselines in ``impls/external`` too). There is no central list. The harness
never imports an implementation by name: ``impls`` is found and imported here as a plugin root."""

from __future__ import annotations

import fnmatch
import importlib
import pkgutil
import warnings

from harness.spec.contract import Implementation

_REGISTRY: dict[str, Implementation] | None = None
# Import errors of a package's ``__init__`` (which must not import its DSL): shown by `list`.
DISCOVERY_ERRORS: dict[str, str] = {}


def _discover() -> dict[str, Implementation]:
    impls = importlib.import_module("impls")
    found: dict[str, Implementation] = {}
    modules = []
    for info in sorted(pkgutil.iter_modules(impls.__path__), key=lambda i: i.name):
        if not info.ispkg:
            continue
        try:
            modules.append(importlib.import_module(f"impls.{info.name}"))
        except Exception as e:  # one broken folder must not hide the others
            DISCOVERY_ERRORS[f"impls.{info.name}"] = f"{type(e).__name__}: {e}"
            warnings.warn(f"impls.{info.name} failed to import: {e}", stacklevel=2)
    for mod in modules:
        # a package may register part of itself and report what it could not (impls.llm's samples)
        DISCOVERY_ERRORS.update(getattr(mod, "DISCOVERY_ERRORS", {}))
        for impl in getattr(mod, "IMPLEMENTATIONS", ()):
            if not isinstance(impl, Implementation):
                raise TypeError(f"{mod.__name__}.IMPLEMENTATIONS holds {type(impl).__name__}, not Implementation")
            if impl.name in found:
                raise ValueError(f"implementation name '{impl.name}' is registered twice ({mod.__name__})")
            found[impl.name] = impl
    return found


def all_implementations() -> dict[str, Implementation]:
    global _REGISTRY
    if _REGISTRY is None:
        _REGISTRY = _discover()
    return _REGISTRY


def get(name: str) -> Implementation:
    """The implementation called ``name``; a ValueError naming the known ones otherwise."""
    if not isinstance(name, str):
        raise TypeError(f"implementation name must be a str, got {type(name).__name__}")
    reg = all_implementations()
    if name not in reg:
        raise ValueError(f"unknown implementation '{name}'; known: {', '.join(sorted(reg))}")
    return reg[name]


def select(pattern: str | None = None, op: str | None = None) -> list[Implementation]:
    """Implementations whose name or DSL matches the glob(s) ``pattern`` (comma-separated; a glob
    starting with '!' excludes, e.g. ``*,!compile-max-autotune``). A plain word that is an
    implementation's name means that implementation only, so ``eager`` never also picks up a new
    folder that declares ``dsl="eager"``."""
    reg = all_implementations()
    pats = [p.strip() for p in (pattern or "*").split(",") if p.strip()]
    keep = [p for p in pats if not p.startswith("!")] or ["*"]
    drop = [p[1:] for p in pats if p.startswith("!")]

    def hit(i, globs):
        return any(fnmatch.fnmatch(i.name, p) or (p not in reg and fnmatch.fnmatch(i.dsl, p)) for p in globs)

    out = [i for i in reg.values() if hit(i, keep) and not (drop and hit(i, drop)) and (op is None or op in i.ops)]
    if not out and pattern:
        raise ValueError(f"no implementation matches '{pattern}'; known: {', '.join(sorted(reg))}")
    return out
