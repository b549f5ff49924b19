"""Seeded random inputs for checks, tests and benchmarks. Never zeros: zeros hide unwritten outputs
and wrong indexing. Rows get log-uniform scales in [1e-3, 10], so some rows have mean(x^2) below eps
(a wrong or missing eps changes their output by a factor, not a rounding error) and some are large."""

from __future__ import annotations

import torch

from .shapes import COLUMN_SLICE_PAD, Shape

DEFAULT_EPS = 1e-5


def make_case(op: str, shape: Shape, dtype: torch.dtype, device: str = "cpu", seed: int = 0, affine: bool = True):
    """x, dy (same shape and layout), weight, bias (None when not affine / for rmsnorm), eps."""
    g = torch.Generator(device=device).manual_seed(seed)

    def rand(*dims, scale=1.0, shift=0.0):
        return torch.randn(*dims, generator=g, device=device, dtype=torch.float32) * scale + shift

    dims = shape.dims
    lead, n = dims[:-1], dims[-1]
    wide = n + COLUMN_SLICE_PAD if shape.layout == "column-slice" else n

    def tensor():
        t = rand(*lead, wide)
        if t.numel():
            row_scale = torch.pow(10.0, torch.rand(*lead, 1, generator=g, device=device) * 4 - 3)
            t = t * row_scale
        return t.to(dtype)[..., :n]

    x, dy = tensor(), rand(*lead, wide).to(dtype)[..., :n]
    weight = rand(n, scale=0.5, shift=1.0).to(dtype) if affine else None
    bias = rand(n, scale=0.2).to(dtype) if (affine and op == "layernorm") else None
    return {"x": x, "dy": dy, "weight": weight, "bias": bias, "eps": DEFAULT_EPS}
