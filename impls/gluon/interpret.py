"""The Gluon kernels' code run by Triton's interpreter, layouts erased: a CPU check of their math.

Gluon kernels do not run in Triton's interpreter (``TRITON_INTERPRET=1`` leaves ``gluon.jit``
alone). But apart from their layouts, the kernels here use only operations Triton has under the
same names (load, store, arange, expand_dims, where, rsqrt, a sum reduction, ...), and
``convert_layout``, which only moves elements between threads (without layouts: nothing). So each
kernel's Python function is re-bound to globals in which ``gl`` is ``_ErasedGluon`` below (layouts
become ``None``, every operation the ``triton.language`` one) and run as an interpreted Triton
function.
This checks, against fp64 on the CPU, the kernels' arithmetic, masks, indexing, compile-time
flags and host code, everything but the layouts; the layouts are what the sm_90a compile in the
tests checks (a layout that does not fit its tensor fails to compile). It is not Gluon running:
the implementation's record stays CUDA-only, and this is used by tests/test_gluon.py only.
"""

from __future__ import annotations

import contextlib
import os
import types

_ERASED: dict = {}


class _ErasedGluon:
    """``gl`` with layouts dropped. Attributes are looked up on ``triton.language`` at call time,
    after the interpreter has patched it."""

    def __init__(self):
        import triton.language as tl

        self._tl = tl
        for name in ("constexpr", "float32", "int32", "int64"):
            setattr(self, name, getattr(tl, name))

    def __getattr__(self, name):
        tl = self._tl
        if name in ("SliceLayout", "BlockedLayout"):
            return lambda *args, **kwargs: None
        if name == "convert_layout":
            # moves elements between threads, never changes them: with the layouts gone, nothing
            return lambda x, layout, **kwargs: x
        if name in ("arange", "zeros", "full"):
            return lambda *args, layout=None, **kwargs: getattr(tl, name)(*args, **kwargs)
        if name == "reduce":
            # the kernels reduce with their ``_add`` or ``_min`` (the exchanges' waits): the
            # interpreter's numpy sum or min
            def reduce(x, axis, combine_fn):
                combine = tl.standard._elementwise_min if combine_fn.__name__ == "_min" else tl.standard._sum_combine
                return tl.reduce(x, axis, combine)

            return reduce
        return getattr(tl, name)


def _available():
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def erased(module) -> dict:
    """{name: interpreted copy} of every Gluon function in ``module``, each seeing the others'
    copies and ``gl`` erased."""
    if module in _ERASED:
        return _ERASED[module]
    if not _available():
        raise RuntimeError("the layout-erased interpreter needs TRITON_INTERPRET=1 before triton is imported")
    import triton.language as tl
    from triton.experimental.gluon._runtime import GluonJITFunction
    from triton.runtime.interpreter import InterpretedFunction

    class Interpreted(InterpretedFunction):
        def rewrite(self):
            # the interpreter knows constexpr parameters by their annotation's text, "tl.constexpr"
            fn = super().rewrite()
            fn.__annotations__ = {k: "tl.constexpr" if v == "gl.constexpr" else v for k, v in fn.__annotations__.items()}
            return fn

    gluon_fns = {name: f for name, f in vars(module).items() if isinstance(f, GluonJITFunction)}
    scope = dict(vars(module))
    scope.update(gl=_ErasedGluon(), tl=tl)
    copies = {}
    for name, f in gluon_fns.items():
        fn = types.FunctionType(f.fn.__code__, scope, f.fn.__name__, f.fn.__defaults__, f.fn.__closure__)
        copies[name] = Interpreted(fn)
    # Device functions are called as their rewritten Python functions: an interpreted call would patch
    # triton.language again on every call (the kernel's launch has patched it already).
    scope.update({name: f.rewrite() for name, f in copies.items()})
    _ERASED[module] = copies
    return copies


@contextlib.contextmanager
def layouts_erased():
    """Inside, the contract functions of ``impls.gluon.kernels`` run their kernels this way."""
    from . import kernels

    copies = erased(kernels)
    kernels._INTERPRETED.append(copies)
    try:
        yield
    finally:
        kernels._INTERPRETED.pop()


def erased_contract():
    """The contract functions, each running its kernels layout-erased (an ``Implementation``
    entry factory, for a CPU-only record built by the tests)."""
    from harness.spec.contract import FUNCTIONS

    from . import kernels

    def run_erased(fn):
        def call(*args):
            with layouts_erased():
                return fn(*args)

        call.__name__ = fn.__name__
        return call

    # the contract functions the kernels define (the contract has ops Gluon does not implement)
    return types.SimpleNamespace(**{name: run_erased(getattr(kernels, name)) for name in FUNCTIONS if hasattr(kernels, name)})
