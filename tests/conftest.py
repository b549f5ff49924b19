import os

import torch

if not torch.cuda.is_available():
    # Triton decorates its own language functions (tl.sum, tl.cdiv) when it is first imported, so
    # the interpreter must be on before anything (Helion included) imports triton.
    # (Helion's own interpreter is switched on around each call: harness.spec.interpreters.interpreter_env)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"


def known_failure_marks(impl, *what) -> list:
    """An expected (non-strict) failure for each of ``what`` (ops, or a named check) that the
    record's ``meta["known_failures"]`` documents: an anchor's departure from the contract, or an
    LLM sample's failure explained after it was stored."""
    known = "; ".join(why for key, why in getattr(impl, "meta", {}).get("known_failures", {}).items() if key in what)
    return [pytest.mark.xfail(reason=f"{impl.name}: {known}", strict=False)] if known else []


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (runs on the GPU machine: pytest -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
