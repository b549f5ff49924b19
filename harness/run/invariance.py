"""Batch invariance and determinism: properties of an implementation that the contract does not ask
for and a user may rely on (the same prompt giving the same tokens whatever else is in the batch;
two training runs of the same data giving the same weights).

Per implementation and op, on a few row lengths and dtypes:

* **batch-invariant forward**: y and the statistics (and residual_out) of a row are bitwise the
  same whether it is computed alone, in a batch of 7, or in one of 4096 rows, and wherever it sits
  in the batch (first, middle, last row);
* **batch-invariant backward**: dx (dh) of a row likewise, given the same row of dy, x and the
  statistics;
* **deterministic**: every output, dweight and dbias included (reductions over the whole batch, so
  not batch-invariant by nature), bitwise the same in three runs of the same inputs (the largest
  batch): float atomics, or partials summed in whatever order they finish, break it.

The probe: one drawn row (its x, dy, residual, statistics) is written into rows first, middle and
last of a batch whose other rows are drawn too; the outputs of those rows are compared bit for bit
with the row computed alone. The backward gets the fp64 reference forward's outputs stored as the
contract stores them (``harness.run.checker`` does the same), so it is checked on its own.
16-bit activations are probed with parameters of their dtype and with fp32 ones, whose fp32 dweight
shows a reduction's order where a 16-bit one would round it away. A property is True when every
probe agrees, else False with its first mismatch: the tensor, the batch size and row, the largest
absolute difference. None: nothing could be run.
"""

from __future__ import annotations

import time
import traceback
from dataclasses import asdict, dataclass, field

import torch

from harness.spec.contract import DTYPES, Implementation
from harness.spec.errors import describe_error
from harness.spec.inputs import make_case
from harness.spec.ops import get_op
from harness.spec.shapes import Shape

BATCHES = (1, 7, 4096)
NS = (1024, 4096)
INVARIANCE_DTYPES = ("bf16", "fp32")
RUNS = 3
PROPERTIES = ("batch_invariant_fwd", "batch_invariant_bwd", "deterministic")


@dataclass
class Mismatch:
    tensor: str
    dtype: str
    weights: str
    n: int
    batch: int
    row: int | None = None  # the probe's row in the batch; None for dweight/dbias (determinism)
    run: int | None = None  # determinism: the run that differed from the first
    max_abs: float = float("nan")

    def describe(self) -> str:
        where = f"row {self.row} of {self.batch}" if self.run is None else f"run {self.run + 1} of {RUNS} at batch {self.batch}"
        params = "" if self.weights == "same" else f"+{self.weights}"
        return f"{self.tensor} ({self.dtype}{params}, N={self.n}, {where}): max |diff| {self.max_abs:.3g}"


@dataclass
class InvarianceResult:
    """One implementation x op over every probe (dtype, weights, N)."""

    impl: str
    op: str
    device: str
    status: str = "skip"  # done | error | skip
    batch_invariant_fwd: bool | None = None
    batch_invariant_bwd: bool | None = None
    deterministic: bool | None = None
    # the first mismatch of each property that is False, by property name
    mismatches: dict = field(default_factory=dict)
    probes: list[str] = field(default_factory=list)
    batches: tuple[int, ...] = BATCHES
    error: str = ""
    traceback: str = ""
    seconds: float = 0.0

    def to_json(self) -> dict:
        return asdict(self)

    def first_mismatch(self) -> str:
        return "; ".join(f"{p}: {Mismatch(**m).describe()}" for p, m in self.mismatches.items())


def _bits(t: torch.Tensor) -> torch.Tensor:
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.detach().contiguous().view(ints[t.element_size()])


def _diff(a: torch.Tensor, b: torch.Tensor) -> float | None:
    """None when ``a`` and ``b`` are bitwise equal, else their largest absolute difference."""
    if a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b)):
        return None
    if a.shape != b.shape:
        return float("inf")
    return float(torch.nan_to_num((a.double() - b.double()).abs(), nan=float("inf")).max())


def positions(batch: int) -> list[int]:
    """The rows the probe takes in a batch: first, middle, last."""
    return sorted({0, batch // 2, batch - 1})


def _batch_args(args, kinds, probe: int, batch: int) -> list:
    """The call's arguments for a batch of ``batch`` rows: the first rows of the drawn ones, with row
    ``probe`` copied into the probe positions; parameters and eps as they are."""
    out = []
    for a, kind in zip(args, kinds):
        if kind in ("rows", "stat") and a is not None:
            t = a[:batch].clone()
            t[positions(batch)] = a[probe]
            out.append(t)
        else:
            out.append(a)
    return out


def _probe(k, rec, direction: str, args, batches, key) -> tuple[Mismatch | None, Mismatch | None]:
    """(the first batch-invariance mismatch, the first determinism mismatch) of one direction."""
    fn = getattr(k, rec.function(direction))
    arg_recs = rec.fwd_args if direction == "fwd" else rec.bwd_args
    outs_rec = rec.fwd_outputs if direction == "fwd" else rec.bwd_outputs
    kinds = [a.kind for a in arg_recs]
    probe = max(batches)  # the drawn row past the largest batch's
    smallest = min(batches)
    alone = variant = largest = None
    for b in sorted(set(batches)):
        out = fn(*_batch_args(args, kinds, probe, b))
        alone = out if alone is None else alone
        for o_rec, o, a in zip(outs_rec, out, alone):
            if o_rec.kind not in ("rows", "stat", "fp8", "scale") or variant is not None:
                continue
            for row in positions(b):
                d = _diff(o[row], a[0 if smallest == 1 else positions(smallest)[0]])
                if d is not None:
                    variant = Mismatch(o_rec.name, *key, batch=b, row=row, max_abs=d)
                    break
        largest = out
    big_args = _batch_args(args, kinds, probe, probe)
    for run in range(1, RUNS):
        again = fn(*big_args)
        for o_rec, o, a in zip(outs_rec, again, largest):
            d = None if (o is None and a is None) else _diff(o, a) if (o is not None and a is not None) else float("inf")
            if d is not None:
                return variant, Mismatch(o_rec.name, *key, batch=probe, run=run, max_abs=d)
    return variant, None


def probes(dtypes) -> list[tuple[str, str]]:
    """(dtype, weights) pairs: 16-bit x with parameters of its dtype and with fp32 ones."""
    return [(dt, w) for dt in dtypes for w in (("same", "fp32") if dt != "fp32" else ("same",))]


def check_invariance(
    impl: Implementation, op: str, device: str = "cpu", dtypes=INVARIANCE_DTYPES, ns=NS, batches=BATCHES, seed: int = 0, kernels=None
) -> InvarianceResult:
    """Batch invariance (forward, backward) and determinism of ``impl``'s ``op``; never raises for
    a kernel's failure (status 'error', with what was found before it)."""
    rec = get_op(op)
    if not batches or min(batches) < 1:
        raise ValueError(f"batch sizes must be >= 1, got {batches}")
    res = InvarianceResult(impl.name, op, device, batches=tuple(batches))
    why = impl.unavailable(device)
    if why is None and op not in impl.ops:
        why = f"does not implement {op}"
    dtypes = [dt for dt in dtypes if dt in impl.dtypes]
    if why is None and not dtypes:
        why = "supports none of the dtypes probed"
    if why:
        res.error = why
        return res
    # an op without a backward (the FP8 ops) has no backward property: None
    found = {p: True for p in PROPERTIES if rec.offers("bwd") or p != "batch_invariant_bwd"}
    t0 = time.perf_counter()
    try:
        k = kernels or impl.kernels(device)
        for dt, weights in probes(dtypes):
            for n in ns:
                key = (dt, weights, n)
                case = make_case(op, Shape((max(batches) + 1, n)), DTYPES[dt], device, seed, weights=weights)
                fwd_args = rec.fwd_call(case)
                probed = [("fwd", fwd_args, "batch_invariant_fwd")]
                if rec.offers("bwd"):
                    ref = rec.reference_fwd(*fwd_args)
                    stored = [r.to(case["x"].dtype) if a.kind == "rows" else r.float() for a, r in zip(rec.fwd_outputs, ref)]
                    probed.append(("bwd", rec.bwd_call(case, stored), "batch_invariant_bwd"))
                for direction, args, prop in probed:
                    variant, nondet = _probe(k, rec, direction, args, batches, key)
                    if variant is not None and found[prop]:
                        found[prop] = False
                        res.mismatches[prop] = asdict(variant)
                    if nondet is not None and found["deterministic"]:
                        found["deterministic"] = False
                        res.mismatches["deterministic"] = asdict(nondet)
                res.probes.append(f"{dt}{'' if weights == 'same' else '+' + weights} N={n}")
        res.status = "done"
    except Exception as e:  # a crashing kernel is a result, not the end of the run
        res.status = "error"
        res.error = describe_error(e, 500)
        res.traceback = traceback.format_exc(limit=6)
    # a mismatch found before a crash stands; an agreement stands only if every probe ran
    for p, holds in found.items():
        setattr(res, p, holds if (res.status == "done" or not holds) else None)
    res.seconds = time.perf_counter() - t0
    return res
