"""Which GPU's tuned table an implementation with pinned launch configs reads, on any GPU.

Triton (``impls/triton/configs.json``) and Helion (``impls/helion/configs.json``) pin their
launch configs per GPU name, measured offline (``normbench tune``). A user's GPU is often not one
that was tuned. The rule, in order:

1. the table tuned on this GPU (same ``torch.cuda.get_device_name``): provenance ``tuned``;
2. else the table of a tuned GPU of the same compute capability (an H800 or GH200 reads an H100's or
   H200's: same SM, same register file and shared memory per SM, so a config that fits one fits the
   other and the best tile sizes carry over; only the bandwidth differs, which moves every config
   alike): provenance ``borrowed from <GPU> (sm_XY)``;
3. else the implementation's heuristic (a function of N alone): provenance ``heuristic``.

Why this and not tuning on first use: measured on an H100 before it had a table of its own
(``reports/experiments/borrowed-configs/``, bf16 sweep), the H200's table carried over gained 2.5
to 13.8 geomean points of copy bandwidth over the heuristics (Helion's LayerNorm backward 52 -> 66%)
and Helion's own H100 tuning added at most 0.8 more. A first-use search would buy those last
points with tens of seconds of compilation inside a user's first training step. A GPU of an
architecture with no table gets the heuristics, which the same measurement prices.

``NORMBENCH_CONFIGS`` overrides the rule, for measuring it: ``heuristic`` (what a GPU with no table
of its architecture gets), or a GPU name (read that GPU's table, whatever this GPU is).
"""

from __future__ import annotations

import os
from typing import Iterable

ENV = "NORMBENCH_CONFIGS"
HEURISTIC = "heuristic"

# The compute capability of every GPU a table was tuned on: the tables are keyed by name only.
CAPABILITY = {
    "NVIDIA H200": (9, 0),
    "NVIDIA H100 80GB HBM3": (9, 0),
}


def capability_of(device) -> tuple[int, int] | None:
    import torch

    if getattr(device, "type", device) != "cuda":
        return None
    return tuple(torch.cuda.get_device_capability(device))


def table_for(gpu: str, tuned: Iterable[str], capability: tuple[int, int] | None) -> tuple[str | None, str]:
    """(the GPU whose table to read, or None for the heuristic; the provenance to report)."""
    tuned = sorted(tuned)
    override = os.environ.get(ENV, "").strip()
    if override:
        if override == HEURISTIC:
            return None, f"heuristic ({ENV}={HEURISTIC})"
        if override not in tuned:
            raise ValueError(f"{ENV}={override!r}: no table for that GPU (tuned: {', '.join(tuned) or 'none'}; or '{HEURISTIC}')")
        return override, "tuned" if override == gpu else f"borrowed from {override} ({ENV})"
    if gpu in tuned:
        return gpu, "tuned"
    if capability is not None:
        for other in tuned:
            if CAPABILITY.get(other) == tuple(capability):
                return other, f"borrowed from {other} (sm_{capability[0]}{capability[1]})"
    return None, "heuristic"
