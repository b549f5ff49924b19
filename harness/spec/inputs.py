"""Seeded random inputs for checks, tests and benchmarks. Never zeros: zeros hide unwritten outputs
and wrong indexing. Rows get log-uniform scales in [1e-3, 10], so some rows have mean(x^2) below eps
(a wrong or missing eps changes their output by a factor, not a rounding error) and some are large.

What a case holds is the op's record (``harness.spec.ops``): every row tensor and parameter its contract
functions take, under the contract's names, plus ``eps`` (and, for the FP8 ops, the ``group`` their
record fixes). The draws for x, dy, weight and bias come
first and in that order for every op, so adding an op or a variant never changes the inputs (and the
results) of the existing ones.

Weight variants (``harness.spec.ops.WEIGHTS``): "same" (parameters in x's dtype), "fp32" (fp32 parameters
beside 16-bit x), "offset" (w drawn small, ~1e-3, in x's dtype, and the kernels get
``effective_weight(w, OFFSET)`` in fp32: 1 + w added in bf16 would round back to 1).

Overflow (``OVERFLOW``): LayerNorm rows of magnitude ~1e30, representable in bf16 and fp32, whose
squares overflow fp32. Torch's LayerNorm returns NaN there; an implementation must too (or the right
answer): a finite wrong number (y = bias when the variance overflows to inf and rstd to 0) fails. Only
ops that list "overflow" in their record get it (RMSNorm in torch returns y = 0 there, see ops.py).
"""

from __future__ import annotations

import torch

from harness.spec.ops import OFFSET, check_weights, effective_weight, get_op
from harness.spec.shapes import COLUMN_SLICE_PAD, Shape, head_sliced, parent_heads, sliced

DEFAULT_EPS = 1e-5
# the row magnitude of the overflow inputs: x^2 ~ 1e60 overflows fp32 (max 3.4e38)
OVERFLOW = 1e30
# the scale of the "offset" variant's w: well below bf16's spacing at 1 (2^-7)
OFFSET_WEIGHT_SCALE = 1e-3
# where the overflow inputs are checked: a row in one tile, and a row too wide for one (looped paths)
OVERFLOW_SHAPES = (Shape((8, 256)), Shape((3, 20001)))


def make_case(
    op: str,
    shape: Shape,
    dtype: torch.dtype,
    device: str = "cpu",
    seed: int = 0,
    affine: bool = True,
    weights: str = "same",
    overflow: bool = False,
):
    """The op's inputs by contract name (x, dy, weight, bias, residual, dresidual_out, ...) and eps.
    Parameters an op does not take are None, and so is every optional tensor when ``affine`` is
    False (weight, bias, dresidual_out); ``weight`` is what the kernels get (for "offset", the
    fp32 effective weight; the stored w and the offset are kept as ``raw_weight`` / ``weight_offset``)."""
    rec = get_op(op)
    check_weights(weights)
    g = torch.Generator(device=device).manual_seed(seed)

    def rand(*dims, scale=1.0, shift=0.0):
        return torch.randn(*dims, generator=g, device=device, dtype=torch.float32) * scale + shift

    dims = shape.dims
    lead, n = dims[:-1], dims[-1]

    def width(name):
        return n + COLUMN_SLICE_PAD if sliced(shape.layout, name) else n

    def parent(name):
        """The leading dims of the tensor ``name`` is a view of: (T, P) for a per-head view."""
        return (lead[0], parent_heads(shape.layout)) if head_sliced(shape.layout, name) else lead

    def tensor(name):
        outer = parent(name)
        t = rand(*outer, width(name))
        if t.numel():
            row_scale = torch.pow(10.0, torch.rand(*outer, 1, generator=g, device=device) * 4 - 3)
            t = t * row_scale
        if overflow:
            t = t / t.abs().amax(-1, keepdim=True).clamp_min(1e-30) * OVERFLOW
        t = t.to(dtype)[..., :n]
        return t[:, : lead[1]] if outer != lead else t

    x, dy = tensor("x"), rand(*lead, width("dy")).to(dtype)[..., :n]
    pdtype = torch.float32 if weights == "fp32" else dtype
    wscale, wshift = (OFFSET_WEIGHT_SCALE, 0.0) if weights == "offset" else (0.5, 1.0)
    raw_weight = rand(n, scale=wscale, shift=wshift).to(pdtype) if affine else None
    bias = rand(n, scale=0.2).to(pdtype) if (affine and "bias" in rec.params) else None
    case = {"x": x, "dy": dy, "bias": bias, "eps": DEFAULT_EPS}
    # the other row inputs (residual, dresidual_out): drawn after the shared ones
    for name in rec.inputs:
        if name not in case and name != "weight":
            case[name] = tensor(name)
    if not affine:  # the case without its optional tensors: no weight, no bias, no dresidual_out
        case.update({a.name: None for a in rec.bwd_args if a.optional and a.kind == "rows"})
    offset = OFFSET if weights == "offset" else 0.0
    case.update(weight=effective_weight(raw_weight, offset), raw_weight=raw_weight, weight_offset=offset)
    if any(a.kind == "group" for a in rec.fwd_args):  # the FP8 ops: the group the record fixes
        case["group"] = rec.group_of(n)
    return case
