"""Differentiable functions and nn.Module drop-ins on every implementation's kernels.

    y = rmsnorm(x, weight, eps, impl="triton", weight_offset=0.0)          # differentiable
    y = layernorm(x, weight, bias, eps, impl="triton")
    y, residual_out = add_rmsnorm(x, residual, weight, eps, impl="triton")  # h = x + residual; rmsnorm(h)
    RMSNorm(4096, eps=1e-6, impl="triton")                  # a torch.nn.RMSNorm
    LayerNorm(4096, eps=1e-5, bias=True, impl="triton")     # a torch.nn.LayerNorm
    AddRMSNorm(4096, eps=1e-6, impl="triton")               # forward(x, residual) -> (y, residual_out)

Everything here calls the implementation's custom ops (``harness.integrate.library``:
``torch.ops.normbench.<impl>_<function>``), whose autograd formula is the contract's backward, where
torch.compile traces; eager calls take their twin, a torch.autograd.Function around the same
validated kernels and formula, which spares the custom op's dispatch (``library._eager``).

* The implementation is chosen when a module is built: the module holds that implementation's ops,
  and ``torch.compile`` (``fullgraph=True`` works) puts those ops into the graph as opaque nodes that
  Inductor calls as they are, so a compiled model keeps running the chosen kernels.
* Parameters may be fp32 beside bf16 / fp16 activations (``RMSNorm(4096, dtype=torch.float32)``
  called with bf16 x): y comes back in x's dtype and weight.grad in fp32, reduced in fp32. Under
  ``torch.autocast`` the ops run in x's dtype too (torch's own norms would run in fp32 there).
* ``weight_offset`` (Gemma's ``(1 + w)``): the kernels are given ``w.float() + weight_offset`` as an
  fp32 weight; weight.grad is the same and comes back in the weight's dtype.
* Double backward (differentiating a gradient made with ``create_graph=True``) raises
  NotImplementedError: the kernels' backward treats the statistics as constants.

The modules subclass torch.nn.RMSNorm / torch.nn.LayerNorm: same constructor arguments (plus
``impl`` and ``weight_offset``), same parameters and state_dict keys, so one swaps into a model and
loads an existing checkpoint. Like torch.nn's, they raise ValueError when x's last dimension is not
``normalized_shape``, with or without a weight.
"""

from __future__ import annotations

import torch

from harness.integrate.library import NAMESPACE, NormOps, ops_for, registered
from harness.registry import get
from harness.spec.contract import Implementation
from harness.spec.ops import effective_weight
from harness.spec.validation import check_eps


def _record(impl) -> Implementation:
    if isinstance(impl, str):
        return get(impl)
    if not isinstance(impl, Implementation):
        raise TypeError(f"impl must be an implementation name or record, got {type(impl).__name__}")
    return impl


def norm_ops(impl: str | Implementation) -> NormOps:
    """The custom ops of an implementation given by name or record."""
    return ops_for(_record(impl))


@torch.compiler.assume_constant_result
def _forward_named(name: str, op: str) -> str:
    # run, not traced, by dynamo: discovering implementations and registering ops is not traceable
    # inside a compiled function; the op's name is a constant of the graph
    ops = registered(name)
    if ops is None:
        try:
            ops = ops_for(get(name))
        except ValueError as e:
            raise ValueError(
                f"{e}. A record outside the registry must be used once before torch.compile (or held by a module)"
            ) from None
    return ops.function(f"{op}_fwd").name().split("::")[1]


# (id of the record, op) -> (the record, its eager twin): a call skips the ops' look-up, which hashes
# every field of the record. The entry holds the record, so no other object takes its id meanwhile.
_TWINS: dict[tuple[int, str], tuple[Implementation, object]] = {}


def _forward(impl, op: str):
    """The forward custom op of ``op`` in ``impl`` (a name, or a record: inside torch.compile a
    record is looked up by its name, so one outside the registry must have been used once before)."""
    if torch.compiler.is_compiling():
        name = impl if isinstance(impl, str) else _record(impl).name
        return getattr(getattr(torch.ops, NAMESPACE), _forward_named(name, op)).default
    rec = get(impl) if isinstance(impl, str) else impl
    hit = _TWINS.get((id(rec), op))
    if hit is None:
        hit = _TWINS[(id(rec), op)] = (rec, norm_ops(rec).forward(op))
    return hit[1]


def _tensor(t, what="x"):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    return t


def _rmsnorm(fwd, x, weight, eps, weight_offset):
    return fwd(_tensor(x), effective_weight(weight, weight_offset), check_eps(eps))[0]


def _layernorm(fwd, x, weight, bias, eps, weight_offset):
    weight = effective_weight(weight, weight_offset)
    if weight is not None and bias is not None and bias.dtype != weight.dtype:
        # one parameter dtype per call (kernels may assume it): fp32, the wider, for both
        weight, bias = weight.float(), bias.float()
    return fwd(_tensor(x), weight, bias, check_eps(eps))[0]


def _add_rmsnorm(fwd, x, residual, weight, eps, weight_offset):
    y, residual_out, _ = fwd(
        _tensor(x), _tensor(residual, "residual"), effective_weight(weight, weight_offset), check_eps(eps)
    )
    return y, residual_out


def rmsnorm(x, weight, eps: float, impl: str | Implementation = "eager", weight_offset: float = 0.0):
    """Differentiable RMSNorm over the last dimension of ``x`` through ``impl``'s kernels:
    ``y = x / sqrt(mean(x^2) + eps) * (weight_offset + weight)``."""
    return _rmsnorm(_forward(impl, "rmsnorm"), x, weight, eps, weight_offset)


def layernorm(x, weight, bias, eps: float, impl: str | Implementation = "eager", weight_offset: float = 0.0):
    """Differentiable LayerNorm over the last dimension of ``x`` through ``impl``'s kernels."""
    return _layernorm(_forward(impl, "layernorm"), x, weight, bias, eps, weight_offset)


def add_rmsnorm(x, residual, weight, eps: float, impl: str | Implementation = "eager", weight_offset: float = 0.0):
    """``residual_out = x + residual`` (rounded to x's dtype), ``y = rmsnorm(residual_out)``; returns
    ``(y, residual_out)``, both differentiable (the gradient of x and of residual is the same dh)."""
    return _add_rmsnorm(_forward(impl, "add_rmsnorm"), x, residual, weight, eps, weight_offset)


def _last_dim_only(normalized_shape) -> int:
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if len(shape) != 1:
        raise ValueError(f"normbench norms normalize over the last dimension only; got normalized_shape={shape}")
    if shape[0] <= 0:
        raise ValueError(f"hidden size must be positive, got {shape[0]}")
    return shape[0]


class _ImplMixin:
    """What our modules add to torch.nn's: the implementation's ops, weight_offset, the shape check."""

    def _setup(self, impl, weight_offset):
        self.impl = _record(impl)
        self._ops = ops_for(self.impl)
        self._fwd = self._ops.function(f"{self._op}_fwd")  # a ValueError now when the op is missing
        self._fwd_eager = self._ops.eager[f"{self._op}_fwd"]
        if isinstance(weight_offset, bool) or not isinstance(weight_offset, (int, float)):
            raise TypeError(f"weight_offset must be a float, got {type(weight_offset).__name__}")
        if weight_offset and self.weight is None:
            raise ValueError(
                f"weight_offset={weight_offset} needs elementwise_affine=True (the scale is weight_offset + weight)"
            )
        self.weight_offset = float(weight_offset)

    # copied (copy.deepcopy) and pickled (torch.save) without the ops, which are looked up again
    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k not in ("_ops", "_fwd", "_fwd_eager")}

    def __setstate__(self, state):
        super().__setstate__(state)
        self._ops = ops_for(self.impl)
        self._fwd = self._ops.function(f"{self._op}_fwd")
        self._fwd_eager = self._ops.eager[f"{self._op}_fwd"]

    def _forward_fn(self):
        # the custom op where torch.compile traces (opaque to it); its eager twin otherwise
        return self._fwd if torch.compiler.is_compiling() else self._fwd_eager

    def _check(self, x):
        _tensor(x)
        n = self.normalized_shape[0]
        if x.dim() < 1 or x.shape[-1] != n:
            raise ValueError(
                f"{type(self).__name__} normalizes over a last dimension of {n}; got input of shape {tuple(x.shape)}"
            )
        return x

    def extra_repr(self):
        offset = f", weight_offset={self.weight_offset}" if self.weight_offset else ""
        return super().extra_repr() + f", impl={self.impl.name}" + offset


class RMSNorm(_ImplMixin, torch.nn.RMSNorm):
    """torch.nn.RMSNorm whose forward and backward run ``impl``'s kernels."""

    _op = "rmsnorm"

    def __init__(
        self,
        normalized_shape,
        eps=None,
        elementwise_affine=True,
        device=None,
        dtype=None,
        *,
        impl="eager",
        weight_offset=0.0,
    ):
        _last_dim_only(normalized_shape)
        super().__init__(normalized_shape, eps, elementwise_affine, device, dtype)
        self._setup(impl, weight_offset)

    def _eps_for(self, x):
        return self.eps if self.eps is not None else torch.finfo(x.dtype).eps

    def forward(self, x):
        return _rmsnorm(self._forward_fn(), self._check(x), self.weight, self._eps_for(x), self.weight_offset)


class AddRMSNorm(RMSNorm):
    """The RMSNorm after a residual add, fused: ``forward(x, residual) -> (y, residual_out)`` with
    ``residual_out = x + residual`` (x's dtype) and ``y = rmsnorm(residual_out)``. Same parameters and
    state_dict as the RMSNorm it replaces."""

    _op = "add_rmsnorm"

    @classmethod
    def from_rmsnorm(cls, norm: torch.nn.RMSNorm, *, impl="eager", weight_offset=None):
        """An AddRMSNorm sharing ``norm``'s weight (the same Parameter) and eps."""
        if not isinstance(norm, torch.nn.RMSNorm):
            raise TypeError(f"from_rmsnorm needs a torch.nn.RMSNorm, got {type(norm).__name__}")
        if weight_offset is None:
            weight_offset = getattr(norm, "weight_offset", 0.0)
        w = norm.weight
        new = cls(
            norm.normalized_shape,
            norm.eps,
            norm.elementwise_affine,
            device="meta",
            impl=impl,
            weight_offset=weight_offset,
        )
        if w is not None:
            new.weight = w
        return new

    def forward(self, x, residual):
        self._check(x)
        return _add_rmsnorm(self._forward_fn(), x, residual, self.weight, self._eps_for(x), self.weight_offset)


class LayerNorm(_ImplMixin, torch.nn.LayerNorm):
    """torch.nn.LayerNorm whose forward and backward run ``impl``'s kernels."""

    _op = "layernorm"

    def __init__(
        self,
        normalized_shape,
        eps=1e-5,
        elementwise_affine=True,
        bias=True,
        device=None,
        dtype=None,
        *,
        impl="eager",
        weight_offset=0.0,
    ):
        _last_dim_only(normalized_shape)
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device, dtype)
        self._setup(impl, weight_offset)

    def forward(self, x):
        return _layernorm(self._forward_fn(), self._check(x), self.weight, self.bias, self.eps, self.weight_offset)
