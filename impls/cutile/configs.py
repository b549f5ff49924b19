"""The cuTile kernels' host choices per GPU, op, direction and N bucket (``configs.json``).

cuTile leaves threads and layouts to its compiler, but what the host passes decides most of the
speed: the rows per tile, a persistent forward grid or not, TMA for loads and stores, and the
compiler's occupancy and worker-warp hints (``plan.Tuning``). Measured on an H100, the same kernels
went from 20-66% of the copy bandwidth on the first guesses to 72-96% up to N = 8192
(docs/kernels/cutile.md), and the best hints differ between ops and widths, often by tens of
points, so they are a table like Triton's and Helion's, not one rule. The bucket is the tile's
width (next_pow2(N)); rows wider than the widest bucket take it; a missing bucket takes the
nearest. Which GPU's table a GPU reads (its own, one of the same architecture, or the heuristic)
is ``harness.spec.tuned``'s rule. An entry asks for the exchanging wide forward with
``"fwd_sync": true`` (its slice ``fwd_slice``, its tile rows from ``fwd_tile_elements``); entries
without the field keep the forward they had (``Tuning``'s defaults). The table is written by ``tools/experiments/cutile-tuning/pick.py``
from the grid runs in ``reports/experiments/cutile-tuning/``.
"""

from __future__ import annotations

import functools
import json
import os

from harness.spec.tuned import capability_of, table_for

from .plan import Tuning, next_pow2

_PATH = os.path.join(os.path.dirname(__file__), "configs.json")


@functools.cache
def _table() -> dict:
    with open(_PATH) as f:
        return json.load(f)


def gpus() -> list[str]:
    return [k for k in _table() if not k.startswith("_")]


@functools.cache
def _gpu_of(device) -> tuple[str | None, str]:
    import torch

    if getattr(device, "type", device) != "cuda":
        return None, "heuristic (no GPU)"
    return table_for(torch.cuda.get_device_name(device), gpus(), capability_of(device))


def _nearest(entries: dict, n: int) -> dict:
    b = next_pow2(n)
    keys = sorted(int(k) for k in entries)
    if b > keys[-1]:
        return entries[str(keys[-1])]
    return entries[str(min(keys, key=lambda k: (abs(k.bit_length() - b.bit_length()), k)))]


@functools.cache
def choose(op: str, direction: str, n: int, device) -> Tuning:
    """The tuning a call of ``op``'s ``direction`` at width ``n`` runs on ``device``."""
    gpu, _ = _gpu_of(device)
    entries = _table().get(gpu, {}).get(f"{op}_{direction}") if gpu else None
    if not entries:
        return Tuning(**_table()["_heuristic"][direction])
    return Tuning(**_nearest(entries, n))


def source(op: str, direction: str, n: int, dtype: str, device) -> str:
    """Provenance for the reports: tuned on this GPU, borrowed, or the heuristic."""
    return _gpu_of(device)[1]
