"""Launching a Triton-JIT kernel (Triton's and Gluon's) from the compiled kernel of an earlier call.

``kernel[grid](*args)`` binds and specializes every argument on every call (each pointer's dtype
and 16-byte alignment, each integer's value class), builds the compile-cache key from them and the
options, and looks the compiled kernel up before it launches: host time that a norm moving a few
kilobytes (a decoding step) pays in full, twice or three times per call. ``launch`` keeps the
compiled kernel that a call returned, under a key at least as fine as Triton's specialization (each
integer, string and compile-time argument (Gluon's layouts too) by its value, each float that is a
runtime argument by its type, each tensor by its dtype and whether its address is 16-byte aligned;
the grid, the warps, the current device), and launches a later call with the same key through it
(``CompiledKernel[grid](*args)``), which is what ``kernel[grid]`` does once it has found it.

It falls back to ``kernel[grid](...)`` for a first call, where no compiled kernel comes back (Triton's
interpreter on the CPU), for an argument of a kind the key does not know, or for a kernel whose
parameters the call does not all pass positionally. What it does not re-check per call: Triton's
check that the globals a kernel reads have not changed since it was compiled, and options set
through Triton's knobs after the first call (debug, instrumentation); changing those in a process
needs ``clear()``.
"""

from __future__ import annotations

import torch

# compiled kernels by launch key; past this many (a new key per M, for one) they start over
LIMIT = 4096
_COMPILED: dict[tuple, object] = {}
_CONSTEXPRS: dict[object, frozenset] = {}  # kernel -> positions of its compile-time parameters
_Tensor = torch.Tensor


class _Unkeyed(Exception):
    pass


def _spec(a, constexpr: bool):
    if isinstance(a, _Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    t = type(a)
    if t is float and not constexpr:  # a runtime fp32 argument: its value is no part of the binary
        return float
    if a is None or t in (int, bool, float, str):
        return (t, a)
    if constexpr:  # Gluon's layouts: frozen dataclasses, equal when they compile alike
        hash(a)  # unhashable: no key
        return (t, a)
    raise _Unkeyed


def _key(kernel, grid: tuple, args: tuple, num_warps: int, device) -> tuple | None:
    constexprs = _CONSTEXPRS.get(kernel)
    if constexprs is None:
        params = getattr(kernel, "params", None)
        if params is None or len(params) != len(args):
            return None
        constexprs = _CONSTEXPRS[kernel] = frozenset(p.num for p in params if p.is_constexpr)
    elif len(args) != len(kernel.params):
        return None
    try:
        specs = tuple([_spec(a, i in constexprs) for i, a in enumerate(args)])
    except (_Unkeyed, TypeError):
        return None
    return (kernel, device, grid, num_warps, specs)


def _grid3(grid) -> tuple:
    grid = tuple(grid)
    return grid + (1,) * (3 - len(grid))


def launch(kernel, grid, args: tuple, num_warps: int):
    """``kernel[grid](*args, num_warps=num_warps)`` (see the module docstring); returns what that
    returns: the compiled kernel on a GPU."""
    grid = _grid3(grid)
    device = _current_device()
    key = _key(kernel, grid, args, num_warps, device) if device is not None else None
    compiled = _COMPILED.get(key) if key is not None else None
    if compiled is not None:
        compiled[grid](*args)
        return compiled
    compiled = kernel[grid](*args, num_warps=num_warps)
    if key is not None and _is_compiled(compiled):
        if len(_COMPILED) >= LIMIT:
            _COMPILED.clear()
        _COMPILED[key] = compiled
    return compiled


def launch_named(kernel, grid, args: dict, num_warps: int):
    """``launch`` for arguments given by name (Gluon's launches): positional in the kernel's order
    where every parameter is named, else ``kernel[grid](**args, ...)`` as it is."""
    names = getattr(kernel, "arg_names", None)
    if names is None or len(names) != len(args) or any(n not in args for n in names):
        return kernel[_grid3(grid)](**args, num_warps=num_warps)
    return launch(kernel, grid, tuple([args[n] for n in names]), num_warps)


def clear() -> None:
    _COMPILED.clear()


_CUDA: list = []  # [whether CUDA is available], asked once


def _current_device():
    """The current CUDA device, which Triton launches on and keys its compiled kernels by; None
    without CUDA (the interpreter)."""
    if not _CUDA:
        _CUDA.append(torch.cuda.is_available())
    return torch.cuda.current_device() if _CUDA[0] else None


def _is_compiled(obj) -> bool:
    # Triton's CompiledKernel (the interpreter returns None); imported here, as triton is optional
    try:
        from triton.compiler.compiler import CompiledKernel
    except ImportError:
        return False
    return isinstance(obj, CompiledKernel)


class _Launcher:
    __slots__ = ("kernel",)

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        kernel = self.kernel
        return lambda *args, num_warps: launch(kernel, grid, args, num_warps)


_LAUNCHERS: dict = {}


def fast(kernel) -> _Launcher:
    """``fast(kernel)[grid](*args, num_warps=w)``: ``launch`` spelled as ``kernel[grid](...)``."""
    got = _LAUNCHERS.get(kernel)
    if got is None:
        got = _LAUNCHERS[kernel] = _Launcher(kernel)
    return got
