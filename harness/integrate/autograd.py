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
validated kernels and formula, which spares the custom op's dispatch (``library._eager``). A call
with nothing to differentiate (``torch.no_grad()``, inference, no input that requires grad) runs the
kernels without the Function; a call like an earlier one (the same shapes, strides, dtypes and
devices) runs the launch plan that call left (``harness.spec.validation.checked``), its arguments
checked by what can differ from that call.

* The implementation is chosen when a module is built: the module holds that implementation's ops,
  and ``torch.compile`` (``fullgraph=True`` works) puts those ops into the graph as opaque nodes that
  Inductor calls as they are, so a compiled model keeps running the chosen kernels.
* Parameters may be fp32 beside bf16 / fp16 activations (``RMSNorm(4096, dtype=torch.float32)``
  called with bf16 x): y comes back in x's dtype and weight.grad in fp32, reduced in fp32. Under
  ``torch.autocast`` the ops run in x's dtype too (torch's own norms would run in fp32 there).
* ``weight_offset`` (Gemma's ``(1 + w)``): the kernels are given ``w.float() + weight_offset`` as an
  fp32 weight; weight.grad is the same and comes back in the weight's dtype. The weight is held to
  the same dtype rule (x's or fp32) whatever the offset.
* Each parameter's gradient comes back in that parameter's dtype. LayerNorm without a weight but with
  an fp32 bias beside 16-bit x is given an fp32 weight of ones (y is the same), so the backward
  reduces dbias to fp32 instead of x's dtype; the ones' gradient is dropped.
* Double backward (differentiating a gradient made with ``create_graph=True``) raises
  NotImplementedError: the kernels' backward treats the statistics as constants. torch.func's
  ``grad``, ``vjp`` and ``vmap`` work; ``jvp`` raises NotImplementedError (``harness.integrate.library``).
* Bad arguments are the same ValueError / TypeError eagerly and under torch.compile
  (``fullgraph=True`` included), where they are raised when the compiled code runs.

The modules subclass torch.nn.RMSNorm / torch.nn.LayerNorm: same constructor arguments (plus
``impl`` and ``weight_offset``), same parameters and state_dict keys, so one swaps into a model and
loads an existing checkpoint. Like torch.nn's, they raise ValueError when x's last dimension is not
``normalized_shape``, with or without a weight.
"""

from __future__ import annotations

import torch

from harness.integrate.library import NAMESPACE, NormOps, deferred_error, missing_op, ops_for
from harness.registry import all_implementations, get
from harness.spec.contract import Implementation
from harness.spec.ops import OPS, effective_weight
from harness.spec.validation import (
    check_args,
    check_eps,
    check_param_dtype,
    check_tensor,
    check_weight_offset,
    shape_text,
)


def _record(impl) -> Implementation:
    if isinstance(impl, str):
        return get(impl)
    if not isinstance(impl, Implementation):
        raise TypeError(f"impl must be an implementation name or record, got {type(impl).__name__}")
    return impl


def norm_ops(impl: str | Implementation) -> NormOps:
    """The custom ops of an implementation given by name or record."""
    return ops_for(_record(impl))


# ---------------------------------------------------------------- the contract's forward arguments
def _tensor(t, what="x"):
    check_tensor(t, what)
    return t


def _weight(x, weight, weight_offset):
    # the raw weight is held to the dtype rule whatever the offset: weight.float() + offset would
    # take any dtype, and the kernels would only see its fp32 result
    if weight is not None:
        check_tensor(weight, "weight")
        check_param_dtype(weight, x, "weight")
    if type(weight_offset) is float and weight_offset == 0.0:  # no offset: the weight as it is
        return weight
    return effective_weight(weight, weight_offset)


def _eps(eps) -> float:
    # a Python float checked here; anything else converted or refused by check_eps
    return eps if type(eps) is float and eps >= 0 else check_eps(eps)


def _rmsnorm_args(x, weight, eps, weight_offset):
    return _tensor(x), _weight(x, weight, weight_offset), _eps(eps)


def _layernorm_args(x, weight, bias, eps, weight_offset):
    weight = _weight(_tensor(x), weight, weight_offset)
    if bias is not None:
        check_tensor(bias, "bias")
        check_param_dtype(bias, x, "bias")
        if weight is None and bias.dtype != x.dtype and x.dim() >= 1:
            # the backward returns dbias in the weight's dtype, x's without one: an fp32 weight of
            # ones (y unchanged) makes dbias the bias's fp32, never rounded through x's dtype
            weight = torch.ones(x.shape[-1], dtype=bias.dtype, device=x.device)
        elif weight is not None and bias.dtype != weight.dtype:
            # one parameter dtype per call (kernels may assume it): fp32, the wider, for both
            weight, bias = weight.float(), bias.float()
    return x, weight, bias, _eps(eps)


def _add_rmsnorm_args(x, residual, weight, eps, weight_offset):
    return _tensor(x), _tensor(residual, "residual"), _weight(x, weight, weight_offset), _eps(eps)


_ARGS = {"rmsnorm": _rmsnorm_args, "layernorm": _layernorm_args, "add_rmsnorm": _add_rmsnorm_args}
_N_OUT = {"rmsnorm": 1, "layernorm": 1, "add_rmsnorm": 2}  # y (and residual_out): the statistics stay inside


def _traced(impl: Implementation, fwd, op: str, args: tuple):
    """Under torch.compile: ``fwd`` (the forward custom op) on the validated contract arguments, or,
    for a bad argument, stand-ins whose graph node raises its ValueError / TypeError when the graph
    runs (dynamo would report an error raised while it traces as an error of its own)."""
    try:
        values = check_args(impl, OPS[op].fwd_args, 0, _ARGS[op](*args))[3]
    except (ValueError, TypeError) as e:
        return deferred_error(args[0], e, _N_OUT[op])
    return fwd(*values)[: _N_OUT[op]]


# ---------------------------------------------------------------- the functions
@torch.compiler.assume_constant_result
def _resolve(impl, op: str):
    """(record, name of its forward op), for torch.compile. Dynamo runs this rather than tracing it
    (discovering implementations and registering ops cannot be traced) and keeps the result as a
    constant of the graph; a record is passed as itself, under a guard on its identity, so one that
    shares a registered name gets its own ops. (None, "") for an unknown name and (record, "") for
    an op it lacks: the caller raises those where dynamo traces."""
    rec = all_implementations().get(impl) if isinstance(impl, str) else impl
    if rec is None or op not in rec.ops:
        return rec, ""
    return rec, ops_for(rec).function(f"{op}_fwd").name().split("::")[1]


def _compiled(impl, op: str, args: tuple):
    """A function's call under torch.compile: ``impl`` resolved to its forward op, then ``_traced``;
    a bad ``impl`` is deferred like a bad argument."""
    try:
        if not isinstance(impl, (str, Implementation)):
            _record(impl)  # the TypeError
        rec, name = _resolve(impl, op)
        if rec is None:
            get(impl)  # the ValueError naming the known implementations
        if not name:
            raise missing_op(rec, op)
    except (ValueError, TypeError) as e:
        return deferred_error(args[0], e, _N_OUT[op])
    return _traced(rec, getattr(getattr(torch.ops, NAMESPACE), name).default, op, args)


# (name or id of the record, op) -> (the record, its eager twin): a call skips the ops' look-up, which
# hashes every field of the record. The entry holds the record, so no other object takes its id meanwhile.
_TWINS: dict[tuple, tuple[Implementation, object]] = {}


def _forward(impl, op: str):
    """The eager twin of ``op``'s forward in ``impl`` (a name or a record)."""
    # a name always means the registry's record: keyed by itself, it skips the look-up
    key = (impl, op) if type(impl) is str else (id(impl), op)
    hit = _TWINS.get(key)
    if hit is None:
        rec = get(impl) if isinstance(impl, str) else impl
        hit = _TWINS[key] = (rec, norm_ops(rec).forward(op))
    return hit[1]


def rmsnorm(x, weight, eps: float, impl: str | Implementation = "eager", weight_offset: float = 0.0):
    """Differentiable RMSNorm over the last dimension of ``x`` through ``impl``'s kernels:
    ``y = x / sqrt(mean(x^2) + eps) * (weight_offset + weight)``."""
    if torch.compiler.is_compiling():
        return _compiled(impl, "rmsnorm", (x, weight, eps, weight_offset))[0]
    return _forward(impl, "rmsnorm")(*_rmsnorm_args(x, weight, eps, weight_offset))[0]


def layernorm(x, weight, bias, eps: float, impl: str | Implementation = "eager", weight_offset: float = 0.0):
    """Differentiable LayerNorm over the last dimension of ``x`` through ``impl``'s kernels."""
    if torch.compiler.is_compiling():
        return _compiled(impl, "layernorm", (x, weight, bias, eps, weight_offset))[0]
    return _forward(impl, "layernorm")(*_layernorm_args(x, weight, bias, eps, weight_offset))[0]


def add_rmsnorm(x, residual, weight, eps: float, impl: str | Implementation = "eager", weight_offset: float = 0.0):
    """``residual_out = x + residual`` (rounded to x's dtype), ``y = rmsnorm(residual_out)``; returns
    ``(y, residual_out)``, both differentiable (the gradient of x and of residual is the same dh)."""
    if torch.compiler.is_compiling():
        return tuple(_compiled(impl, "add_rmsnorm", (x, residual, weight, eps, weight_offset)))
    y, residual_out, _ = _forward(impl, "add_rmsnorm")(*_add_rmsnorm_args(x, residual, weight, eps, weight_offset))
    return y, residual_out


# ---------------------------------------------------------------- the modules
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
        if self.eps is not None:
            # stored as a Python float: torch.compile traces a NumPy scalar as an array
            self.eps = check_eps(self.eps)
        offset = check_weight_offset(weight_offset)
        if offset and self.weight is None:
            raise ValueError(
                f"weight_offset={offset} needs elementwise_affine=True (the scale is weight_offset + weight)"
            )
        self.set_impl(impl)
        self.weight_offset = offset

    def set_impl(self, impl: str | Implementation) -> None:
        """Run ``impl``'s kernels from now on (a ValueError, the module unchanged, when ``impl`` does
        not provide this module's op)."""
        impl = _record(impl)
        ops = ops_for(impl)
        fwd = ops.function(f"{self._op}_fwd")
        self.impl, self._ops, self._fwd, self._fwd_eager = impl, ops, fwd, ops.eager[f"{self._op}_fwd"]

    # copied (copy.deepcopy) and pickled (torch.save) without the ops, which are looked up again
    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k not in ("_ops", "_fwd", "_fwd_eager")}

    def __setstate__(self, state):
        super().__setstate__(state)
        self.set_impl(self.impl)

    def _check(self, x):
        _tensor(x)
        n = self.normalized_shape[0]
        if x.dim() < 1 or x.shape[-1] != n:
            raise ValueError(
                f"{type(self).__name__} normalizes over a last dimension of {n}; got input of shape {shape_text(x)}"
            )
        return x

    def _call(self, x, *rest):
        """The forward: the eager twin, or under torch.compile the custom op (opaque to it)."""
        if torch.compiler.is_compiling():
            try:
                self._check(x)
            except (ValueError, TypeError) as e:
                return deferred_error(x, e, _N_OUT[self._op])
            return _traced(self.impl, self._fwd, self._op, self._args(x, *rest))
        return self._fwd_eager(*_ARGS[self._op](*self._args(self._check(x), *rest)))

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

    def _args(self, x):
        return x, self.weight, self._eps_for(x), self.weight_offset

    def forward(self, x):
        return self._call(x)[0]


class AddRMSNorm(RMSNorm):
    """The RMSNorm after a residual add, fused: ``forward(x, residual) -> (y, residual_out)`` with
    ``residual_out = x + residual`` (x's dtype) and ``y = rmsnorm(residual_out)``. Same parameters and
    state_dict as the RMSNorm it replaces."""

    _op = "add_rmsnorm"

    @classmethod
    def from_rmsnorm(cls, norm: torch.nn.RMSNorm, *, impl=None, weight_offset=None):
        """An AddRMSNorm sharing ``norm``'s weight (the same Parameter) and eps, running ``impl``'s
        kernels: by default ``norm``'s own implementation (eager for a torch.nn.RMSNorm), and its
        weight_offset."""
        if not isinstance(norm, torch.nn.RMSNorm):
            raise TypeError(f"from_rmsnorm needs a torch.nn.RMSNorm, got {type(norm).__name__}")
        if impl is None:
            impl = norm.impl if isinstance(norm, RMSNorm) else "eager"
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

    def _args(self, x, residual):
        return x, residual, self.weight, self._eps_for(x), self.weight_offset

    def forward(self, x, residual):
        y, residual_out = self._call(x, residual)[:2]
        return y, residual_out


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

    def _args(self, x):
        return x, self.weight, self.bias, self.eps, self.weight_offset

    def forward(self, x):
        return self._call(x)[0]
