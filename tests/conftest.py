import importlib.util
import os

import torch

if not torch.cuda.is_available():
    # Triton decorates its own language functions (tl.sum, tl.cdiv) when it is first imported, so
    # the interpreter must be on before anything (Helion included) imports triton.
    # (Helion's own interpreter is switched on around each call: harness.spec.interpreters.interpreter_env)
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if os.environ["TRITON_INTERPRET"] == "1" and importlib.util.find_spec("torch._inductor") is not None:
        # Inductor's triton_helpers (maximum, minimum, ...) are jit functions, decorated as the
        # interpreter's only if imported while it is on; Helion's generated code calls them, and a
        # test that imports them first with the interpreter off (Helion's eager mode) left them
        # compiled-only for every later interpreted kernel of the process
        import torch._inductor.runtime.triton_helpers  # noqa: F401

import pytest  # noqa: E402

from harness.spec.ops import OPS  # noqa: E402


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


# Triton's interpreter (3.9) swaps triton.language's functions for its own while it runs a kernel,
# and two of its swaps outlive the run, which broke every later sm_90a compile of the Gluon kernels
# in the same process ("CompilationError: at 9:11": gl.program_id(0) * ROWS) on a cold compile
# cache. (1) Gluon wraps triton.language's functions (gl.rsqrt = builtin(tl.math.rsqrt)) when it is
# first imported, and the interpreter's first launch is what imports it, in the middle of its swap:
# Gluon is imported here, before any launch. (2) A Triton function called inside a kernel (tl.sum)
# swaps triton.language.core's functions (mul, arange, ...) and never swaps them back: after every
# test the objects below get back the attributes they had here.
_TRITON_LANGUAGE: list = []
_MISSING = object()
if _has("triton"):
    import triton.language as _tl  # noqa: E402

    if _has("triton.experimental.gluon"):
        import triton.experimental.gluon.language  # noqa: E402, F401

    for _obj in (_tl, _tl.core, _tl.math, *(getattr(_tl.core, n, None) for n in ("tensor", "dtype", "condition", "tensor_descriptor_base"))):
        if _obj is not None:
            _TRITON_LANGUAGE.append((_obj, dict(vars(_obj))))


def restore_triton_language() -> list[str]:
    """Gives triton.language's modules and classes back the attributes they had when this file was
    imported; returns the names it had to restore."""
    restored = []
    for obj, saved in _TRITON_LANGUAGE:
        now = vars(obj)
        if isinstance(obj, type):  # a class gains no attributes of its own; a module gains submodules
            for name in [n for n in now if n not in saved]:
                delattr(obj, name)
                restored.append(f"{obj.__name__}.{name}")
        for name, value in saved.items():
            if now.get(name, _MISSING) is not value:
                setattr(obj, name, value)
                restored.append(f"{obj.__name__}.{name}")
    return restored


def pytest_runtest_teardown(item, nextitem):
    restore_triton_language()


HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"


# What a known failure's key may name, as "field=value[,value...]" terms separated by spaces (a bare
# word is an op): where the failure shows. A field it leaves out: the failure shows for every value.
KNOWN_FAILURE_FIELDS = {
    "op": tuple(OPS),  # every op record, the FP8 ones too
    "dtype": ("bf16", "fp16", "fp32"),
    "direction": ("fwd", "bwd"),
    "device": ("cpu", "cuda"),
    "weights": ("same", "fp32", "offset"),  # the parameters (harness.spec.ops.WEIGHTS)
    "inputs": ("drawn", "overflow"),  # harness.spec.inputs: the usual draw, or rows whose squares overflow fp32
    # what is checked: the contract functions against fp64 (tests/test_implementations.py), or the
    # autograd functions built on them (tests/test_autograd.py)
    "check": ("contract", "autograd"),
}
def known_failure_where(key: str) -> dict[str, set[str]]:
    """'op=add_rmsnorm dtype=bf16 device=cpu' -> {"op": {"add_rmsnorm"}, "dtype": {"bf16"}, "device": {"cpu"}};
    a ValueError for a field or value KNOWN_FAILURE_FIELDS does not have (a typo would mark nothing)."""
    where: dict[str, set[str]] = {}
    for term in key.split():
        field, sep, values = term.partition("=")
        if not sep:
            field, values = "op", term
        allowed = KNOWN_FAILURE_FIELDS.get(field)
        if allowed is None:
            raise ValueError(f"known failure '{key}': unknown field '{field}'; fields: {', '.join(KNOWN_FAILURE_FIELDS)}")
        chosen = set(values.split(","))
        if not chosen <= set(allowed):
            raise ValueError(f"known failure '{key}': {field} takes {', '.join(allowed)}, not {', '.join(sorted(chosen - set(allowed)))}")
        where.setdefault(field, set()).update(chosen)
    return where


def known_failure_marks(impl, *ops, **runs) -> list:
    """One strict expected failure for the entries of the record's ``meta["known_failures"]``
    ({where: why}, see KNOWN_FAILURE_FIELDS) that fall inside what the test runs: ``ops`` and, by
    field, ``runs`` (a value or a collection of values). A field the test does not give is taken as
    every value, except ``check``: an entry about one kind of check marks only tests that say they
    are that kind. A test marked so that passes is an error (XPASS, strict): the entry is stale or
    too broad."""
    runs = {k: {v} if isinstance(v, str) else set(v) for k, v in runs.items()}
    if ops:
        runs["op"] = set(ops)
    unknown = set(runs) - set(KNOWN_FAILURE_FIELDS)
    if unknown:
        raise ValueError(f"known_failure_marks: unknown fields {sorted(unknown)}")
    why = []
    for key, reason in getattr(impl, "meta", {}).get("known_failures", {}).items():
        where = known_failure_where(key)
        if all(where[f] & runs[f] if f in runs else f != "check" for f in where):
            why.append(f"[{key}] {reason}")
    return [pytest.mark.xfail(reason=f"{impl.name}: {'; '.join(why)}", strict=True)] if why else []


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (runs on the GPU machine: pytest -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
