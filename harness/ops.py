"""The ops, one declarative record each: what every part of the harness reads about an op.

An op is its two contract functions (argument and output names, with the kind of each tensor), its
fp64 reference, the tensors its inputs draw, and its bytes model. The checker, the benchmark, the
autograd layer, the custom ops and TritonBench read these records; adding an op is one record here,
its reference in ``harness.reference``, and its functions in the implementations that provide it.

Tensor kinds (what shape and dtype a tensor has, given x of shape (M, N)):
    rows   (M, N) in x's dtype                  x, dy, y, dx, residual, residual_out, dh, ...
    stat   (M,) fp32                            rstd, mean
    param  (N,) in the weight's dtype           weight, bias, dweight, dbias (x's dtype or fp32)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from . import reference


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


EPS = Arg("eps", "scalar")


@dataclass(frozen=True)
class Op:
    name: str
    fwd_args: tuple[Arg, ...]
    fwd_outputs: tuple[Arg, ...]
    bwd_args: tuple[Arg, ...]
    bwd_outputs: tuple[Arg, ...]
    reference_fwd: Callable
    reference_bwd: Callable
    # inputs drawn at random for a check or a benchmark point (see harness.inputs.make_case);
    # every other backward argument is a forward output
    inputs: tuple[str, ...]
    # row tensors (M x N elements) read + written, per direction: the bytes model's main bytes
    rows_moved: dict
    params: tuple[str, ...] = ("weight",)  # (N,) parameters, in the order the forward takes them
    tritonbench: str | None = None  # TritonBench's operator of this op, where it has one
    description: str = ""

    @property
    def stats(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.fwd_outputs if a.kind == "stat")

    def function(self, direction: str) -> str:
        return f"{self.name}_{direction}"


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
            description="residual_out = x + residual (rounded to x's dtype); y = rmsnorm(residual_out)",
        ),
    )
}


def get_op(name: str) -> Op:
    if name not in OPS:
        raise ValueError(f"unknown op '{name}'; known: {', '.join(OPS)}")
    return OPS[name]


def effective_weight(weight, offset: float = 0.0):
    """The weight the kernels see: ``weight`` itself, or ``weight.float() + offset`` (Gemma's
    ``(1 + w)`` scale, added in fp32) when there is an offset. Differentiable: the gradient reaches
    ``weight`` unchanged, in its own dtype."""
    if isinstance(offset, bool) or not isinstance(offset, (int, float)):
        raise TypeError(f"weight_offset must be a float, got {type(offset).__name__}")
    if offset == 0:
        return weight
    if weight is None:
        raise ValueError(f"weight_offset={offset} needs a weight (the scale is weight_offset + weight)")
    return weight.float() + offset
