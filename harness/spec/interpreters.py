"""How a DSL runs without a GPU: the environment variable that switches its interpreter on.

Triton's must be set before triton is first imported (it decorates its own language functions then),
and Helion, torch.compile and Inductor import triton too. So on a machine without a GPU, where triton
can only run through its interpreter, importing the harness sets TRITON_INTERPRET=1 unless triton is
already imported (``cpu_triton``, again before anything is loaded for the CPU): using Helion or
torch.compile first no longer leaves Triton unusable for the rest of the process. Helion refuses
HELION_INTERPRET=1 (its eager reference mode) while TRITON_INTERPRET=1 is set, so around a
Helion-interpreted import or call on the CPU the harness swaps the two (``interpreter_env``);
triton, already imported, keeps its interpreter.
"""

from __future__ import annotations

import contextlib
import os
import sys

import torch

INTERPRETERS = {"triton": "TRITON_INTERPRET", "helion": "HELION_INTERPRET"}


def loaded_without_interpreter(impl) -> bool:
    """Too late to switch Triton's interpreter on: triton (whose language functions are decorated
    at import, and which every Triton kernel module imports) was imported while it was off."""
    if impl.interpreter != INTERPRETERS["triton"] or os.environ.get(impl.interpreter, "0") == "1":
        return False
    return "triton" in sys.modules


def cpu_triton() -> None:
    """On a machine without a GPU, switch Triton's interpreter on before triton's first import (see
    the module docstring). Does nothing once triton is imported, or where a GPU could run it."""
    if "triton" not in sys.modules and not torch.cuda.is_available():
        os.environ[INTERPRETERS["triton"]] = "1"


@contextlib.contextmanager
def interpreter_env(impl, device: str):
    """On the CPU, HELION_INTERPRET=1 and no TRITON_INTERPRET for the duration (see the module docstring)."""
    if device != "cpu" or impl.interpreter != INTERPRETERS["helion"]:
        yield
        return
    cpu_triton()
    if "triton" not in sys.modules:
        # import triton now, under the interpreter setting cpu_triton chose: imported first while
        # TRITON_INTERPRET is off below (Helion imports it), it would stay compiled-only for the
        # rest of the process and every Triton kernel after it would fail on the CPU
        try:
            import triton  # noqa: F401
        except ImportError:
            pass
    saved = {k: os.environ.get(k) for k in ("HELION_INTERPRET", "TRITON_INTERPRET")}
    os.environ["HELION_INTERPRET"] = "1"
    os.environ.pop("TRITON_INTERPRET", None)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


cpu_triton()
