"""Loading an implementation: its module imported on first use (``normbench list`` must work without
the DSL installed), its contract functions checked to exist and wrapped with the contract's
validation (``harness.spec.validation``), both cached per record and device."""

from __future__ import annotations

import importlib
import os
from types import SimpleNamespace

from harness.spec.contract import FUNCTIONS, Implementation, split_function
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


def load_raw(impl: Implementation, device: str):
    """The implementation's module (or what its factory returns) with its contract functions."""
    if device == "cpu":
        cpu_triton()
        if impl.interpreter == INTERPRETERS["triton"]:
            os.environ[impl.interpreter] = "1"
    key = _key(impl)
    if key in _RAW_CACHE:
        return _RAW_CACHE[key]
    mod_name, _, factory = impl.entry.partition(":")
    with interpreter_env(impl, device):
        mod = importlib.import_module(mod_name)
        raw = getattr(mod, factory)(**impl.options) if factory else mod
    for fn in FUNCTIONS:
        if split_function(fn)[0] in impl.ops and not callable(getattr(raw, fn, None)):
            raise TypeError(f"implementation '{impl.name}' ({impl.entry}) does not define {fn}()")
    _RAW_CACHE[key] = raw
    return raw


def load_kernels(impl: Implementation, device: str = "cuda") -> SimpleNamespace:
    """The implementation's contract functions, validated on every call; a ValueError naming the
    reason when it cannot run on ``device`` here."""
    why = impl.unavailable(device)
    if why:
        raise ValueError(f"implementation '{impl.name}' cannot run on {device} here: {why}")
    key = (*_key(impl), device)
    if key not in _KERNEL_CACHE:
        raw = load_raw(impl, device)
        fns = {}
        for fn in FUNCTIONS:
            op, direction = split_function(fn)
            if op in impl.ops:
                fns[fn] = checked(impl, get_op(op), direction, getattr(raw, fn))
        _KERNEL_CACHE[key] = SimpleNamespace(**fns, raw=raw, impl=impl)
    return _KERNEL_CACHE[key]
