"""Helion's names this package uses, taken at import time, after repairing what a failed import of
helion leaves behind.

The failure this guards against (seen on an H100: after a torch.compile over a model holding a Helion
norm failed, every later Helion call in the process raised ``module 'helion' has no attribute
'Config'``). The first ``import helion`` ran inside the compiled forward: the harness loads an
implementation's module on first use, and dynamo, after a graph break on the import, still compiles
the frames the import executes. A dynamo error in one of them (here in scipy, which helion's
autotuner imports through sklearn) propagated out of the import. Python then dropped the modules
whose execution failed (``helion``, ``helion.language``, ...) from ``sys.modules`` but kept those
that had finished, among them ``helion.autotuner.config_spec``, whose global ``helion`` is the
half-built package object: one that never got its ``Config``. The next ``import helion`` builds a
new, complete package, but config_spec keeps the old one, and its ``default_config()`` (which
``configs.fit`` calls before every compile) fails with the AttributeError.

So on import, every ``helion.*`` module's module-valued globals that name a module of which
``sys.modules`` now holds a different object are pointed at that object (``rebind_stale_modules``).
Objects taken from a half-built module (``from helion.x import y``) cannot be found this way;
Helion's own modules refer to the package as a module, which is the case that failed. The names
this package needs from helion are bound here once, so a ``helion`` that lacks one fails at import
with an ImportError naming it, not at the first kernel call.
"""

from __future__ import annotations

import sys
import types

import helion
from helion import Config, Kernel, RefMode, kernel


def rebind_stale_modules() -> list[str]:
    """Point helion's modules' stale module references at the live modules; returns what it fixed
    ("module.global" names)."""
    live = {name: mod for name, mod in list(sys.modules.items()) if name == "helion" or name.startswith("helion.")}
    fixed = []
    for name, mod in live.items():
        if not isinstance(mod, types.ModuleType):
            continue
        for attr, value in list(vars(mod).items()):
            current = live.get(getattr(value, "__name__", None)) if isinstance(value, types.ModuleType) else None
            if current is not None and current is not value:
                setattr(mod, attr, current)
                fixed.append(f"{name}.{attr}")
    return fixed


REBOUND = rebind_stale_modules()

__all__ = ["Config", "Kernel", "RefMode", "helion", "kernel", "rebind_stale_modules", "REBOUND"]
