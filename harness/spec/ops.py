"""The ops, one declarative record each: what every part of the harness reads about an op.

An op is its two contract functions (argument and output names, with the kind of each tensor), its
fp64 reference, the tensors its inputs draw, and its bytes model. The checker, the benchmark, the
autograd layer, the custom ops and TritonBench read these records; adding an op is one record here,
its reference in ``harness.spec.reference``, and its functions in the implementations that provide it.

Tensor kinds (what shape and dtype a tensor has, given x of shape (M, N)):
    rows   (M, N) in x's dtype                  x, dy, y, dx, residual, residual_out, dh, ...
    stat   (M,) fp32                            rstd, mean
    param  (N,) in the weight's dtype           weight, bias, dweight, dbias (x's dtype or fp32)
    fp8    (M, N) float8_e4m3fn                 q, the quantized y of the FP8 ops
    scale  (M, N / group) fp32                  scale, one per group of q (harness.spec.fp8)
and the scalars: eps (a real number >= 0) and group (an int: N, or 128).

Forward-only ops (``directions``): the FP8 ops quantize y for an FP8 GEMM and have no backward. Two
records may share contract functions (``contract``): the FP8 ops are one record per grouping, one
scale per row (group = N) and one per 1 x 128 block (group = 128; only shapes with N a multiple of
128), because each is its own workload, ranked on its own; the record fixes the group its cases pass.

A backward's arguments come by name: an argument the forward returns (rstd, residual_out) is taken
from the forward's outputs, every other one (dy, x, weight) from the drawn case. That one rule is how
the checker, the benchmark's callables and the overhead measurement wire a backward, for every op.

Weight variants (``WEIGHTS``), an axis of checks and benchmark points beside the dtype:
    same    weight and bias in x's dtype (the default, and the only variant of older results)
    fp32    weight and bias in fp32 beside 16-bit x (mixed precision)
    offset  Gemma's y = xhat * (1 + w): w drawn small, stored in x's dtype, and passed to the kernels
            as ``effective_weight(w, 1.0)``, fp32; the add is in fp32 because in bf16 it would
            round 1 + w back to 1 and lose w
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from harness.spec import reference
from harness.spec.fp8 import GROUP_BLOCK


@dataclass(frozen=True)
class Arg:
    name: str
    kind: str  # rows | stat | param | scalar
    optional: bool = False  # may be None (weight, bias, dresidual_out)


def _rows(name, optional=False):
    return Arg(name, "rows", optional)


def _stat(name):
    return Arg(name, "stat")


def _param(name):
    return Arg(name, "param", True)


def _fp8(name):
    return Arg(name, "fp8")


def _scale(name):
    return Arg(name, "scale")


EPS = Arg("eps", "scalar")
GROUP = Arg("group", "group")


def _native_rmsnorm(x, weight, eps):
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)


def _native_layernorm(x, weight, bias, eps):
    return torch.nn.functional.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def _native_add_rmsnorm(x, residual, weight, eps):
    h = x + residual
    return _native_rmsnorm(h, weight, eps), h


@dataclass(frozen=True)
class Op:
    name: str
    fwd_args: tuple[Arg, ...]
    fwd_outputs: tuple[Arg, ...]
    bwd_args: tuple[Arg, ...]
    bwd_outputs: tuple[Arg, ...]
    reference_fwd: Callable
    reference_bwd: Callable
    # inputs drawn at random for a check or a benchmark point (see harness.spec.inputs.make_case);
    # every other backward argument is a forward output
    inputs: tuple[str, ...]
    # row tensors (M x N elements) read + written, per direction: the bytes model's main bytes
    rows_moved: dict
    params: tuple[str, ...] = ("weight",)  # (N,) parameters, in the order the forward takes them
    tritonbench: str | None = None  # TritonBench's operator of this op, where it has one
    description: str = ""
    # checked on inputs whose squares overflow fp32 (harness.spec.inputs.OVERFLOW): NaN or the right
    # answer, never a finite wrong one. LayerNorm only: torch's LayerNorm returns NaN there (on the
    # CPU for rows of one block; its wide-row CPU path returns y = bias, which eager corrects),
    # while torch's RMSNorm returns y = 0 (rsqrt(inf) = 0): holding RMSNorm to NaN would fail torch.
    overflow: bool = False
    # PyTorch's own differentiable composition, taking the forward's arguments: the floor rows of
    # `normbench overhead` and what the unfused model runs
    native: Callable | None = None
    # the directions it has contract functions for: ("fwd",) for the FP8 ops
    directions: tuple[str, ...] = ("fwd", "bwd")
    # the stem of its contract functions where records share them (the FP8 ops' groupings); "": name
    contract: str = ""
    # the ``group`` argument its cases pass (ops with one): None = N, one scale per row
    group: int | None = None

    @property
    def stats(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.fwd_outputs if a.kind == "stat")

    @property
    def normed(self) -> str:
        """The row tensor the backward differentiates the norm at (x, or residual_out)."""
        return next(a.name for a in self.bwd_args[1:] if a.kind == "rows" and not a.optional)

    @property
    def quantized(self) -> bool:
        """Whether its forward returns FP8 values (and their scales)."""
        return any(a.kind == "fp8" for a in self.fwd_outputs)

    def offers(self, direction: str) -> bool:
        """Whether it has ``direction`` (fwd, bwd, or fwdbwd: both)."""
        return all(d in self.directions for d in (("fwd", "bwd") if direction == "fwdbwd" else (direction,)))

    def group_of(self, n: int) -> int:
        """The group its cases pass for rows of N elements."""
        return n if self.group is None else self.group

    def unsupported(self, n: int) -> str | None:
        """Why rows of N elements are no point of this op (a group that does not divide N), or None."""
        if self.group is not None and n % self.group:
            return f"{self.name} quantizes groups of {self.group} and N = {n} is not a multiple of {self.group}"
        return None

    def function(self, direction: str) -> str:
        return f"{self.contract or self.name}_{direction}"

    def reference(self, direction: str) -> Callable:
        return {"fwd": self.reference_fwd, "bwd": self.reference_bwd}[direction]

    def fwd_call(self, case: dict) -> tuple:
        """The forward's arguments, in contract order, from a drawn case."""
        return tuple(case[a.name] for a in self.fwd_args)

    def bwd_call(self, case: dict, fwd_out) -> tuple:
        """The backward's arguments: what the forward returned (``fwd_out``, in ``fwd_outputs``
        order) where the forward returns it, the case's tensor otherwise."""
        produced = {a.name: t for a, t in zip(self.fwd_outputs, fwd_out)}
        return tuple(produced[a.name] if a.name in produced else case[a.name] for a in self.bwd_args)

    def rows_of(self, direction: str) -> int:
        """Row tensors (M x N, x's dtype) a perfect kernel reads + writes; fwdbwd is the sum of both."""
        if not self.offers(direction):
            raise ValueError(f"{self.name} has no {direction} (it has {', '.join(self.directions)})")
        if direction == "fwdbwd":
            return self.rows_moved["fwd"] + self.rows_moved["bwd"]
        return self.rows_moved[direction]

    def quantized_bytes(self, m: int, n: int) -> int:
        """Bytes of the forward's FP8 outputs: q at one byte an element, the fp32 scales."""
        per = {"fp8": m * n, "scale": m * (n // self.group_of(n)) * 4}
        return sum(per.get(a.kind, 0) for a in self.fwd_outputs)


# the FP8 ops' groupings: (record suffix, the group its cases pass (None: N), what the scales are)
_GROUPINGS = (("token", None, "one scale per row"), ("g128", GROUP_BLOCK, f"one scale per 1 x {GROUP_BLOCK} block"))

OPS: dict[str, Op] = {
    op.name: op
    for op in (
        Op(
            name="rmsnorm",
            fwd_args=(_rows("x"), _param("weight"), EPS),
            fwd_outputs=(_rows("y"), _stat("rstd")),
            bwd_args=(_rows("dy"), _rows("x"), _param("weight"), _stat("rstd")),
            bwd_outputs=(_rows("dx"), _param("dweight")),
            reference_fwd=reference.rmsnorm_fwd,
            reference_bwd=reference.rmsnorm_bwd,
            inputs=("x", "dy", "weight"),
            rows_moved={"fwd": 2, "bwd": 3},
            tritonbench="rms_norm",
            native=_native_rmsnorm,
            description="y = x / sqrt(mean(x^2) + eps) * w",
        ),
        Op(
            name="layernorm",
            fwd_args=(_rows("x"), _param("weight"), _param("bias"), EPS),
            fwd_outputs=(_rows("y"), _stat("mean"), _stat("rstd")),
            bwd_args=(_rows("dy"), _rows("x"), _param("weight"), _stat("mean"), _stat("rstd")),
            bwd_outputs=(_rows("dx"), _param("dweight"), _param("dbias")),
            reference_fwd=reference.layernorm_fwd,
            reference_bwd=reference.layernorm_bwd,
            inputs=("x", "dy", "weight", "bias"),
            rows_moved={"fwd": 2, "bwd": 3},
            params=("weight", "bias"),
            tritonbench="layer_norm",
            native=_native_layernorm,
            overflow=True,
            description="y = (x - mean(x)) / sqrt(var(x) + eps) * w + b",
        ),
        Op(
            name="add_rmsnorm",
            fwd_args=(_rows("x"), _rows("residual"), _param("weight"), EPS),
            fwd_outputs=(_rows("y"), _rows("residual_out"), _stat("rstd")),
            bwd_args=(_rows("dy"), _rows("dresidual_out", optional=True), _rows("residual_out"), _param("weight"), _stat("rstd")),
            bwd_outputs=(_rows("dh"), _param("dweight")),
            reference_fwd=reference.add_rmsnorm_fwd,
            reference_bwd=reference.add_rmsnorm_bwd,
            inputs=("x", "residual", "dy", "dresidual_out", "weight"),
            rows_moved={"fwd": 4, "bwd": 4},
            tritonbench=None,  # TritonBench has no residual + RMSNorm operator (README)
            native=_native_add_rmsnorm,
            description="residual_out = x + residual (rounded to x's dtype); y = rmsnorm(residual_out)",
        ),
        # FP8 output, forward only: one record per grouping (see the module docstring)
        *(
            Op(
                name=f"rmsnorm_fp8_{grouping}",
                fwd_args=(_rows("x"), _param("weight"), EPS, GROUP),
                fwd_outputs=(_fp8("q"), _scale("scale"), _stat("rstd")),
                bwd_args=(),
                bwd_outputs=(),
                reference_fwd=reference.rmsnorm_fp8_fwd,
                reference_bwd=None,
                inputs=("x", "weight"),
                rows_moved={"fwd": 1},  # x read; q (1 byte) and the scales: quantized_bytes
                directions=("fwd",),
                contract="rmsnorm_fp8",
                group=group,
                description=f"y = rmsnorm(x) in fp32; q = e4m3fn(y / scale), {what}",
            )
            for grouping, group, what in _GROUPINGS
        ),
        *(
            Op(
                name=f"add_rmsnorm_fp8_{grouping}",
                fwd_args=(_rows("x"), _rows("residual"), _param("weight"), EPS, GROUP),
                fwd_outputs=(_fp8("q"), _scale("scale"), _rows("residual_out"), _stat("rstd")),
                bwd_args=(),
                bwd_outputs=(),
                reference_fwd=reference.add_rmsnorm_fp8_fwd,
                reference_bwd=None,
                inputs=("x", "residual", "weight"),
                rows_moved={"fwd": 3},  # x, residual read, residual_out written; q and the scales beside
                directions=("fwd",),
                contract="add_rmsnorm_fp8",
                group=group,
                description=f"residual_out = x + residual (rounded to x's dtype); q = e4m3fn(rmsnorm(residual_out) / scale), {what}",
            )
            for grouping, group, what in _GROUPINGS
        ),
    )
}
# the FP8 ops' records, in the order an implementation lists them
FP8_OPS = tuple(name for name, op in OPS.items() if op.quantized)


WEIGHTS = ("same", "fp32", "offset")
# the weight_offset of the "offset" variant (Gemma's (1 + w))
OFFSET = 1.0


def check_weights(name: str) -> str:
    if name not in WEIGHTS:
        raise ValueError(f"unknown weights variant '{name}'; known: {', '.join(WEIGHTS)}")
    return name


def op_stems() -> tuple[str, ...]:
    """The contract stems records share ("rmsnorm_fp8": its per-token and 1 x 128 records)."""
    return tuple(dict.fromkeys(op.contract for op in OPS.values() if op.contract and op.contract not in OPS))


def expand_ops(names) -> list[str]:
    """Op names, a shared contract stem standing for each of its records, in the records' order."""
    out = []
    for name in names:
        if name in OPS:
            out.append(name)
        elif name in op_stems():
            out += [n for n, op in OPS.items() if op.contract == name]
        else:
            raise ValueError(f"unknown op '{name}'; known: {', '.join((*OPS, *op_stems()))}")
    return list(dict.fromkeys(out))


def get_op(name: str) -> Op:
    if name not in OPS:
        raise ValueError(f"unknown op '{name}'; known: {', '.join(OPS)}")
    return OPS[name]


def effective_weight(weight, offset: float = 0.0):
    """The weight the kernels see: ``weight`` itself, or ``weight.float() + offset`` (Gemma's
    ``(1 + w)`` scale, added in fp32) when there is an offset. Differentiable: the gradient reaches
    ``weight`` unchanged, in its own dtype. ``offset`` is a finite real number; with one, ``weight``
    must still be a tensor of a contract dtype (``.float()`` would take fp64, integers, and complex
    numbers, dropping their imaginary part); the rule that it has x's dtype or fp32 is the caller's
    (``harness.spec.validation.check_param_dtype``), which knows x."""
    # imported here: validation imports contract, which imports this module
    from harness.spec.validation import check_weight_offset

    offset = check_weight_offset(offset)
    if offset == 0:
        return weight
    if weight is None:
        raise ValueError(f"weight_offset={offset} needs a weight (the scale is weight_offset + weight)")
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
    if weight.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"weight must be float32, bfloat16 or float16, got {weight.dtype}")
    return weight.float() + offset
