"""What the harness derives from an implementation's four functions: autograd functions,
nn.Module drop-ins, and the forward / backward / forward+backward callables the benchmark times.

    y = rmsnorm(x, weight, eps, impl="triton")                 # differentiable
    y = layernorm(x, weight, bias, eps, impl="triton")
    RMSNorm(4096, eps=1e-6, impl="triton")                     # a torch.nn.RMSNorm
    LayerNorm(4096, eps=1e-5, bias=True, impl="triton")        # a torch.nn.LayerNorm

The modules subclass torch.nn.RMSNorm / torch.nn.LayerNorm: same constructor arguments, same
parameters and state_dict keys, so one swaps into a model and loads an existing checkpoint.
"""

from __future__ import annotations

import torch

from .contract import Implementation
from .registry import get


def _resolve(impl, device: torch.device):
    if isinstance(impl, str):
        impl = get(impl)
    if not isinstance(impl, Implementation):
        raise TypeError(f"impl must be an implementation name or record, got {type(impl).__name__}")
    return impl.kernels(device.type)


class _RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, k):
        y, rstd = k.rmsnorm_fwd(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        ctx.k = k
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = ctx.k.rmsnorm_bwd(dy.contiguous(), x, weight, rstd)
        return dx, dw if ctx.needs_input_grad[1] else None, None, None


class _LayerNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, k):
        y, mean, rstd = k.layernorm_fwd(x, weight, bias, eps)
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.k = k
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, rstd = ctx.saved_tensors
        dx, dw, db = ctx.k.layernorm_bwd(dy.contiguous(), x, weight, mean, rstd)
        dw = dw if ctx.needs_input_grad[1] else None
        db = db if (ctx.has_bias and ctx.needs_input_grad[2]) else None
        return dx, dw, db, None, None


def rmsnorm(x, weight, eps: float, impl: str | Implementation = "eager"):
    """Differentiable RMSNorm over the last dimension of ``x`` through ``impl``'s kernels."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    return _RMSNormFn.apply(x, weight, eps, _resolve(impl, x.device))


def layernorm(x, weight, bias, eps: float, impl: str | Implementation = "eager"):
    """Differentiable LayerNorm over the last dimension of ``x`` through ``impl``'s kernels."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    return _LayerNormFn.apply(x, weight, bias, eps, _resolve(impl, x.device))


def _last_dim_only(normalized_shape) -> int:
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if len(shape) != 1:
        raise ValueError(f"normbench norms normalize over the last dimension only; got normalized_shape={shape}")
    if shape[0] <= 0:
        raise ValueError(f"hidden size must be positive, got {shape[0]}")
    return shape[0]


class RMSNorm(torch.nn.RMSNorm):
    """torch.nn.RMSNorm whose forward and backward run ``impl``'s kernels."""

    def __init__(
        self, normalized_shape, eps=None, elementwise_affine=True, device=None, dtype=None, *, impl="eager", weight_offset=0.0
    ):
        _last_dim_only(normalized_shape)
        super().__init__(normalized_shape, eps, elementwise_affine, device, dtype)
        self.impl = get(impl) if isinstance(impl, str) else impl
        self.weight_offset = float(weight_offset)

    def forward(self, x):
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        w = self.weight
        if self.weight_offset and w is not None:  # Gemma's (offset + w), in fp32
            w = w.float() + self.weight_offset
        return rmsnorm(x, w, eps, self.impl)

    def extra_repr(self):
        return super().extra_repr() + f", impl={self.impl.name}"


class LayerNorm(torch.nn.LayerNorm):
    """torch.nn.LayerNorm whose forward and backward run ``impl``'s kernels."""

    def __init__(
        self, normalized_shape, eps=1e-5, elementwise_affine=True, bias=True, device=None, dtype=None, *, impl="eager"
    ):
        _last_dim_only(normalized_shape)
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device, dtype)
        self.impl = get(impl) if isinstance(impl, str) else impl

    def forward(self, x):
        return layernorm(x, self.weight, self.bias, self.eps, self.impl)

    def extra_repr(self):
        return super().extra_repr() + f", impl={self.impl.name}"


def callables(k, op: str, direction: str, case: dict):
    """A zero-argument callable running ``direction`` (fwd | bwd | fwdbwd) of ``op`` on ``case``
    through the contract functions directly (no autograd overhead): what the benchmark times.
    The backward is given statistics from one forward run up front."""
    x, dy, w, b, eps = case["x"], case["dy"], case["weight"], case["bias"], case["eps"]
    if op == "rmsnorm":
        fwd, bwd = k.rmsnorm_fwd, k.rmsnorm_bwd
        if direction == "fwd":
            return lambda: fwd(x, w, eps)
        if direction == "bwd":
            _, rstd = fwd(x, w, eps)
            return lambda: bwd(dy, x, w, rstd)

        def both():
            _, rstd = fwd(x, w, eps)
            return bwd(dy, x, w, rstd)

        return both
    fwd, bwd = k.layernorm_fwd, k.layernorm_bwd
    if direction == "fwd":
        return lambda: fwd(x, w, b, eps)
    if direction == "bwd":
        _, mean, rstd = fwd(x, w, b, eps)
        return lambda: bwd(dy, x, w, mean, rstd)

    def both_ln():
        _, mean, rstd = fwd(x, w, b, eps)
        return bwd(dy, x, w, mean, rstd)

    return both_ln
