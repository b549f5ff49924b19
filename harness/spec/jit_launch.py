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

import operator

import torch

# compiled kernels by launch key; past this many (a new key per M, for one) they start over
LIMIT = 4096
_COMPILED: dict[tuple, object] = {}
_Tensor = torch.Tensor
_PLAIN = frozenset((int, bool, str, type(None)))
# (id(kernel), the arguments' types) -> (kernel, tensors' getter, keyed values' getter), or None
# where an argument is of a kind the key does not know. The entry holds the kernel, so its id is
# never reused; by id, as hashing a JITFunction hashes its source key on every call.
_LAYOUTS: dict[tuple, tuple | None] = {}


def _getter(positions: list):
    if len(positions) >= 2:
        return operator.itemgetter(*positions)
    if positions:
        (i,) = positions
        return lambda args: (args[i],)
    return lambda args: ()


def _layout(kernel, args: tuple, types: tuple) -> tuple | None:
    """Which arguments of a call with these ``types`` the key takes by value (ints, bools, strings,
    None, compile-time floats and Gluon's layouts, frozen dataclasses equal when they compile
    alike), which as tensors (dtype, 16-byte alignment), and which by type alone (runtime floats:
    their value is no part of the binary); None where one is of a kind it does not know."""
    params = getattr(kernel, "params", None)
    if params is None or len(params) != len(args):
        return None
    constexprs = {p.num for p in params if p.is_constexpr}
    tensors, values = [], []
    for i, (a, t) in enumerate(zip(args, types)):
        if t in _PLAIN or (t is float and i in constexprs):
            values.append(i)
        elif t is float:
            continue
        elif isinstance(a, _Tensor):
            tensors.append(i)
        elif i in constexprs:
            try:
                hash(a)
            except TypeError:  # unhashable: no key
                return None
            values.append(i)
        else:
            return None
    return kernel, _getter(tensors), _getter(values)


def _key(kernel, grid: tuple, args: tuple, num_warps, device) -> tuple | None:
    """The launch key (see the module docstring), or None where an argument is of a kind it does
    not know: the arguments' types, the values of those taken by value, each tensor's dtype and
    alignment, in as few Python steps as it can (this runs on every launch)."""
    types = tuple(map(type, args))
    kid = id(kernel)
    try:
        layout = _LAYOUTS[(kid, types)]
    except KeyError:
        layout = _LAYOUTS[(kid, types)] = _layout(kernel, args, types)
    if layout is None:
        return None
    tensors = layout[1](args)
    return (
        kid, device, grid, num_warps, types, layout[2](args),
        tuple([t.dtype for t in tensors]), tuple([t.data_ptr() & 15 == 0 for t in tensors]),
    )  # fmt: skip


def _grid3(grid) -> tuple:
    grid = tuple(grid)
    return grid + (1,) * (3 - len(grid))


def launch(kernel, grid, args: tuple, num_warps: int, num_stages: int | None = None):
    """``kernel[grid](*args, num_warps=num_warps[, num_stages=num_stages])`` (see the module
    docstring); returns what that returns: the compiled kernel on a GPU."""
    grid = _grid3(grid)
    device = _current_device()
    key = _key(kernel, grid, args, (num_warps, num_stages), device) if device is not None else None
    try:
        compiled = _COMPILED.get(key) if key is not None else None
    except TypeError:  # a value unhashable where an earlier one of its type was not: no key
        key = compiled = None
    if compiled is not None:
        compiled[grid](*args)
        if _RECORDING:
            _RECORDING[-1].append((compiled, grid, args))
        return compiled
    if num_stages is None:
        compiled = kernel[grid](*args, num_warps=num_warps)
    else:
        compiled = kernel[grid](*args, num_warps=num_warps, num_stages=num_stages)
    if key is not None and _is_compiled(compiled):
        if len(_COMPILED) >= LIMIT:
            _COMPILED.clear()
        _COMPILED[key] = compiled
        if _RECORDING:
            _RECORDING[-1].append((compiled, grid, args))
    return compiled


_RECORDING: list[list] = []


class recording:
    """``with recording() as launches: fn()``: the (compiled kernel, grid, arguments) of each launch
    ``fn`` made through the cache, in order. ``replay(launches)`` launches them again as they are:
    the host cost of the DSL's own launcher for that call, and nothing of the code around it
    (``normbench overhead``'s floor)."""

    def __enter__(self) -> list:
        _RECORDING.append([])
        return _RECORDING[-1]

    def __exit__(self, *exc) -> None:
        _RECORDING.pop()


def replay(launches: list) -> None:
    for compiled, grid, args in launches:
        compiled[grid](*args)


def launch_named(kernel, grid, args: dict, num_warps: int):
    """``launch`` for arguments given by name (Gluon's launches): positional in the kernel's order
    where every parameter is named, else ``kernel[grid](**args, ...)`` as it is."""
    names = getattr(kernel, "arg_names", None)
    if names is not None and len(names) == len(args):
        try:
            ordered = tuple([args[n] for n in names])
        except KeyError:
            pass
        else:
            return launch(kernel, grid, ordered, num_warps)
    return kernel[_grid3(grid)](**args, num_warps=num_warps)


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
    got = _LAUNCHERS.get(id(kernel))  # by id, as in ``_key``; the launcher holds the kernel
    if got is None:
        got = _LAUNCHERS[id(kernel)] = _Launcher(kernel)
    return got
