"""Planning a fan-out (``--gpus``, ``--executor``; harness.run.fanout runs it): the GPUs of this
host, the units of work of a command with their expected cost, and their partition into shards.

A unit is what one worker runs alone and a serial run would run in the same way: a benchmark point
(``bench.planned_key``) for `bench` and `warm`, a checked point or an implementation's invariance
probes (``check.point_key``, ``check.invariance_key``) for `check`, an architecture for `model`
(its implementations share one model, one set of control runs and rotated timing trials, which a
split would break). Units are named by JSON-able keys, so a shard is a list of keys that a worker,
planning the same selection, picks out of its own plan.

Balance: every unit has an expected cost in seconds (``expected_cost``: a rough model, what counts
is the order of magnitude), and the units are dealt costliest first, each to the shard with the
least cost so far (longest processing time first). So compile-max-autotune's searches (30-70 s a
backward point) are spread over the shards before anything else, and no shard ends with more than
one unit's cost above another. The deal is deterministic (ties by plan order): the same selection
gives the same shards on every run. Within a shard the units keep their plan order.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass

from harness.spec.errors import UsageError

# Test hook: a comma-separated list of GPU models, one per fake GPU (ids 0, 1, ...), taken instead of
# this host's GPUs, so that the fan-out runs on a machine without one (its workers on the CPU).
FAKE_GPUS = "NORMBENCH_FAKE_GPUS"


# ---------------------------------------------------------------- the GPUs of this host
@dataclass(frozen=True)
class Gpu:
    id: str  # the host's index (nvidia-smi's); a SLURM task prefixes its node's name
    name: str  # the model, as the driver names it (and torch.cuda.get_device_name)
    visible: str  # what CUDA_VISIBLE_DEVICES takes to show this GPU alone: its UUID where known


def _nvidia_smi() -> list[Gpu] | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,name,uuid", "--format=csv,noheader"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    gpus = []
    for line in out.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 3 and parts[0].isdigit():
            gpus.append(Gpu(parts[0], ",".join(parts[1:-1]), parts[-1]))
    return gpus


def _torch_gpus() -> list[Gpu]:
    """The GPUs CUDA shows this process (CUDA_VISIBLE_DEVICES applied by CUDA itself)."""
    import torch

    if not torch.cuda.is_available():
        return []
    shown = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")] if "CUDA_VISIBLE_DEVICES" in os.environ else []
    gpus = []
    for i in range(torch.cuda.device_count()):
        ident = shown[i] if i < len(shown) else str(i)
        gpus.append(Gpu(ident, torch.cuda.get_device_name(i), ident))
    return gpus


def _visible(gpus: list[Gpu]) -> list[Gpu]:
    """``gpus`` as CUDA_VISIBLE_DEVICES shows them: in its order, by index or UUID (a prefix of it),
    up to its first entry that names none (where CUDA stops too); all of them where it is unset."""
    if "CUDA_VISIBLE_DEVICES" not in os.environ:
        return gpus
    out = []
    for entry in (e.strip() for e in os.environ["CUDA_VISIBLE_DEVICES"].split(",")):
        hit = next((g for g in gpus if entry and (entry == g.id or (entry.startswith("GPU-") and g.visible.startswith(entry)))), None)
        if hit is None:
            break
        out.append(hit)
    return out


def inventory() -> list[Gpu]:
    """The GPUs this process may use: nvidia-smi's list (torch's where nvidia-smi is missing) as
    CUDA_VISIBLE_DEVICES shows it, or the fake list of ``NORMBENCH_FAKE_GPUS``."""
    fake = os.environ.get(FAKE_GPUS)
    if fake is not None:
        return _visible([Gpu(str(i), name.strip(), str(i)) for i, name in enumerate(fake.split(",")) if name.strip()])
    smi = _nvidia_smi()
    return _visible(smi) if smi is not None else _torch_gpus()


def describe(gpus: list[Gpu]) -> str:
    return "; ".join(f"{g.id}: {g.name}" for g in gpus)


def choose(request, gpus: list[Gpu]) -> list[Gpu]:
    """The GPUs ``--gpus N|all`` takes of ``gpus``: the first N, or all; one model only."""
    if not gpus:
        where = f" (CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']!r})" if "CUDA_VISIBLE_DEVICES" in os.environ else ""
        raise UsageError(f"--gpus {request}: this host has no CUDA GPU that this process may use{where}")
    if request != "all" and request > len(gpus):
        raise UsageError(f"--gpus {request}, but this host has {len(gpus)} GPU{'s' if len(gpus) != 1 else ''} ({describe(gpus)})")
    chosen = gpus if request == "all" else gpus[:request]
    models = sorted({g.name for g in chosen})
    if len(models) > 1:
        raise UsageError(
            f"--gpus {request}: the GPUs are not all one model ({describe(chosen)}): a report is of one GPU model; "
            "choose GPUs of one model with CUDA_VISIBLE_DEVICES"
        )
    return chosen


# ---------------------------------------------------------------- units and their cost
@dataclass(frozen=True)
class Unit:
    key: tuple  # JSON-able (strings, numbers, booleans)
    cost: float  # expected seconds
    position: int  # in the serial run's order


# Rough seconds on an H100 / H200 (docs/method.md): a max-autotune search per point (30-70 s a
# backward point; a forward about half), torch.compile's default compile per shape, and every
# other DSL's first call (a JIT compile, a cached config).
SEARCH_S = {"fwd": 25.0, "bwd": 45.0}
COMPILE_S = {"compile": 5.0, "cute": 3.0, "helion": 2.0}
FIRST_CALL_S = 1.0
TIMING_S = 1.5  # 3 trials of do_bench's warm-up and repetitions, the check against fp64 beside them
CPU_COSTLY = 20.0  # a "costly" implementation on the CPU (torch.compile, an interpreter) against eager


def searches(impl) -> bool:
    """Whether ``impl``'s first call searches configs per shape at length (torch.compile's max-autotune)."""
    return "max-autotune" in str((impl.options or {}).get("mode", ""))


def expected_cost(impl, direction: str, shape, device: str = "cuda", timed: bool = True) -> float:
    """Expected seconds of one point: its first call (a search, a compile), and ``timed``, the
    check and the timing a benchmark adds (`warm` runs the first call only). On the CPU, what an
    implementation costs there (``cpu_cost``) times the elements."""
    directions = ("fwd", "bwd") if direction == "fwdbwd" else (direction,)
    if device == "cpu":
        per = CPU_COSTLY if impl.cpu_cost == "costly" else 1.0
        return len(directions) * per * (1.0 + shape.m * shape.n / 2**20)
    if searches(impl):
        first = sum(SEARCH_S.get(d, SEARCH_S["bwd"]) for d in directions)
    else:
        first = len(directions) * COMPILE_S.get(impl.dsl, FIRST_CALL_S)
    return first + (TIMING_S * (1.0 + shape.m * shape.n / 2**28) if timed else 0.0)


def bench_units(todo: list[tuple], device: str = "cuda", timed: bool = True) -> list[Unit]:
    """Units of ``bench.plan``'s points (a key planned twice, by two shape sets, is one unit)."""
    from harness.run.bench import planned_key

    units: dict[tuple, Unit] = {}
    for i, t in enumerate(todo):
        impl, _op, direction, _set, shape, _dtype, _w = t
        key, cost = planned_key(t), expected_cost(impl, direction, shape, device, timed)
        u = units.get(key)
        units[key] = Unit(key, cost + (u.cost if u else 0.0), u.position if u else i)
    return list(units.values())


def check_units(points: list[tuple], probes: list[tuple], device: str) -> list[Unit]:
    """Units of ``check.plan``'s points and of the invariance probes [(impl, op)]: the probes run
    after every point, as in a serial run, and cost a few shapes' worth each."""
    from harness.run.check import invariance_key, point_key

    units = [Unit(point_key(pt), expected_cost(pt[0], pt[2], pt[5], device, timed=False) / 4, i) for i, pt in enumerate(points)]
    n = len(units)
    from harness.spec.shapes import Shape

    probe_shape = Shape((4096, 4096))
    units += [Unit(invariance_key(impl, op), 6 * expected_cost(impl, "fwdbwd", probe_shape, device, timed=False), n + i) for i, (impl, op) in enumerate(probes)]
    return units


def model_units(archs: list[str]) -> list[Unit]:
    """One unit per architecture (the same cost: the same implementations on a model of one size)."""
    return [Unit((arch,), 1.0, i) for i, arch in enumerate(archs)]


# ---------------------------------------------------------------- the partition
def partition(units: list[Unit], n: int) -> list[list[Unit]]:
    """``units`` dealt into ``n`` shards, costliest first, each to the shard with the least expected
    cost so far (ties: the lower shard; equal costs: plan order); each shard in plan order. Every
    unit is in exactly one shard, and the same units give the same shards."""
    if n < 1:
        raise ValueError(f"cannot deal units into {n} shards")
    shards: list[list[Unit]] = [[] for _ in range(n)]
    loads = [0.0] * n
    for u in sorted(units, key=lambda u: (-u.cost, u.position)):
        k = min(range(n), key=lambda j: (loads[j], j))
        shards[k].append(u)
        loads[k] += u.cost
    return [sorted(s, key=lambda u: u.position) for s in shards]


def key_of(value) -> tuple:
    """A key read back from JSON (lists) as the tuple it was."""
    return tuple(key_of(v) if isinstance(v, list) else v for v in value)
