"""Loading an implementation: its module imported on first use (``normbench list`` must work without
the DSL installed), its contract functions checked to exist and wrapped with the contract's
validation (``harness.spec.validation``), both cached per record and device."""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from types import SimpleNamespace

from harness.spec.contract import Implementation
from harness.spec.interpreters import INTERPRETERS, cpu_triton, interpreter_env
from harness.spec.ops import get_op
from harness.spec.validation import checked

_KERNEL_CACHE: dict = {}
_RAW_CACHE: dict = {}


def _key(impl: Implementation) -> tuple:
    # Records compare by their declared fields only (``options`` and ``hooks`` are dicts, left out
    # of equality): two records that differ only in options (another torch.compile mode) must not
    # share kernels, so the options are part of the key.
    return (impl, repr(sorted(impl.options.items())))


def _functions(impl: Implementation) -> list[tuple[str, str, str]]:
    """(contract function, op, direction) of every function the record's ops need, each once."""
    out = {}
    for op in impl.ops:
        rec = get_op(op)
        for d in rec.directions:
            out.setdefault(rec.function(d), (op, d))
    return [(fn, op, d) for fn, (op, d) in out.items()]


def _entry(impl: Implementation, entry: str):
    mod_name, _, factory = entry.partition(":")
    mod = importlib.import_module(mod_name)
    return getattr(mod, factory)(**impl.options) if factory else mod


class _Entries:
    """The functions of several entries (``entry``, then ``extra_entries``): the first that defines
    a name provides it."""

    def __init__(self, entries):
        self._entries = entries

    def __getattr__(self, name):
        for e in self.__dict__["_entries"]:
            if hasattr(e, name):
                return getattr(e, name)
        raise AttributeError(name)


def load_raw(impl: Implementation, device: str):
    """The implementation's module (or what its factory returns) with its contract functions; with
    ``extra_entries``, the functions of all of them."""
    if device == "cpu":
        cpu_triton()
        if impl.interpreter == INTERPRETERS["triton"]:
            os.environ[impl.interpreter] = "1"
    key = _key(impl)
    if key in _RAW_CACHE:
        return _RAW_CACHE[key]
    with interpreter_env(impl, device):
        entries = [_entry(impl, e) for e in (impl.entry, *impl.extra_entries)]
    raw = entries[0] if len(entries) == 1 else _Entries(entries)
    for fn, _, _ in _functions(impl):
        if not callable(getattr(raw, fn, None)):
            raise TypeError(f"implementation '{impl.name}' ({', '.join((impl.entry, *impl.extra_entries))}) does not define {fn}()")
    _RAW_CACHE[key] = raw
    return raw


def checked_functions(impl: Implementation, raw) -> dict[str, Callable]:
    """The contract functions of ``impl``'s ops that ``raw`` defines, each behind the harness's own
    input handling (``checked``: validation, reshaping, M = 0), by name."""
    return {fn: checked(impl, get_op(op), direction, getattr(raw, fn)) for fn, op, direction in _functions(impl)
            if hasattr(raw, fn)}  # fmt: skip


def load_kernels(impl: Implementation, device: str = "cuda") -> SimpleNamespace:
    """The implementation's contract functions, validated on every call; a ValueError naming the
    reason when it cannot run on ``device`` here."""
    why = impl.unavailable(device)
    if why:
        raise ValueError(f"implementation '{impl.name}' cannot run on {device} here: {why}")
    key = (*_key(impl), device)
    if key not in _KERNEL_CACHE:
        raw = load_raw(impl, device)
        _KERNEL_CACHE[key] = SimpleNamespace(**checked_functions(impl, raw), raw=raw, impl=impl)
    return _KERNEL_CACHE[key]
