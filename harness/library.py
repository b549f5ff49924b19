"""Every implementation's contract functions as PyTorch custom ops, with their autograd formulas.

    torch.ops.normbench.<impl>_<function>     e.g. normbench::triton_rmsnorm_fwd,
                                                    normbench::compile_max_autotune_layernorm_bwd

Why custom ops: torch.compile treats a custom op as one opaque node. Dynamo never traces into the
kernels' Python (Triton's interpreter, Helion's kernels, CuTe DSL's compiler, an inner torch.compile),
so a model holding our norms compiles with ``fullgraph=True``, and whatever fails inside a DSL stays
inside that DSL's call. The compiled graph holds ``normbench::<impl>_...`` nodes, and Inductor calls
them as they are (a fallback kernel): a compiled model keeps running the chosen implementation's
kernels, through the same validated contract functions that ``normbench check`` tests.

Schemas, fake (meta) functions and autograd formulas are derived from the op records
(``harness.ops``), not written per op: a ``rows`` tensor is (..., N) in x's dtype, a ``stat`` is
(...,) fp32, a ``param`` is (N,) in the weight's dtype.

Outputs a custom op cannot return: ``None`` (dweight without a weight) becomes an empty (0,)
placeholder that the autograd formula drops; a returned tensor sharing storage with an input or an
earlier output (not allowed for an op) is cloned, a no-op check otherwise. dweight / dbias leave the
op in the weight's dtype (x's when there is no weight): the fake function promises exactly that.

Autograd: the forward op's formula calls the backward op. Its statistics outputs are not
differentiable. Gradients of unused outputs are not materialised: ``dresidual_out`` reaches
add_rmsnorm's backward as None when residual_out was not used. The backward ops have no derivative:
the contract's backward treats the statistics as constants, so a second derivative through them
would be wrong. ``torch.autograd.grad(..., create_graph=True)`` still works; differentiating its result
raises ``NotImplementedError`` instead of returning a wrong number.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from .contract import Implementation, _eps, _like_x, _stats, _vector, _x
from .ops import OPS, Arg, Op

NAMESPACE = "normbench"
_SCHEMA_TYPE = {"rows": "Tensor", "stat": "Tensor", "param": "Tensor?", "scalar": "float"}


def _schema(args: tuple[Arg, ...], outputs: tuple[Arg, ...]) -> str:
    ins = ", ".join(f"{_SCHEMA_TYPE[a.kind]}{'?' if a.optional and a.kind == 'rows' else ''} {a.name}" for a in args)
    return f"({ins}) -> ({', '.join('Tensor' for _ in outputs)})"


def _identifier(name: str) -> str:
    ident = re.sub(r"\W", "_", name)
    return ident if ident[:1].isalpha() else f"i_{ident}"


# ---------------------------------------------------------------- output metadata (fake and real)
def _first_rows(args: tuple[Arg, ...], values) -> torch.Tensor:
    return next(v for a, v in zip(args, values) if a.kind == "rows" and v is not None)


def _output_meta(args: tuple[Arg, ...], outputs: tuple[Arg, ...], values) -> list[tuple[tuple, torch.dtype]]:
    """(shape, dtype) of every output, given the op's arguments (real or fake tensors)."""
    ref = _first_rows(args, values)
    named = {a.name: v for a, v in zip(args, values)}
    weight = named.get("weight")
    n = ref.shape[-1]
    param_dtype = weight.dtype if weight is not None else ref.dtype
    meta = []
    for o in outputs:
        if o.kind == "rows":
            meta.append((tuple(ref.shape), ref.dtype))
        elif o.kind == "stat":
            meta.append((tuple(ref.shape[:-1]), torch.float32))
        elif o.name[1:] in named and named[o.name[1:]] is None:
            meta.append(((0,), ref.dtype))  # the placeholder for a gradient of an absent parameter
        else:
            meta.append(((n,), param_dtype))
    return meta


def _validate(impl: Implementation, args: tuple[Arg, ...], values):
    """The contract's argument checks, run on fake tensors too: under torch.compile a bad argument
    is the same clear ValueError / TypeError as in eager."""
    ref_arg = next(a for a in args if a.kind == "rows")
    ref = _first_rows(args, values)
    m, n = _x(ref, impl, ref_arg.name)
    for a, v in zip(args, values):
        if a.kind == "rows" and v is not None and v is not ref:
            _like_x(v, ref, a.name)
        elif a.kind == "param":
            _vector(v, n, ref, a.name)
        elif a.kind == "stat":
            _stats(v, m, ref, a.name)
        elif a.kind == "scalar":
            _eps(v)


def _fake(impl: Implementation, args, outputs):
    def fake(*values):
        _validate(impl, args, values)
        ref = _first_rows(args, values)
        return tuple(ref.new_empty(shape, dtype=dtype) for shape, dtype in _output_meta(args, outputs, values))

    return fake


def _storage(t: torch.Tensor):
    return t.untyped_storage().data_ptr() if t.numel() else None


def _real(impl: Implementation, fn_name: str, args, outputs):
    def run(*values):
        ref = _first_rows(args, values)
        out = getattr(impl.kernels(ref.device.type), fn_name)(*values)
        seen = {_storage(v) for v in values if isinstance(v, torch.Tensor)}
        fixed = []
        for o, t, (shape, dtype) in zip(outputs, out, _output_meta(args, outputs, values)):
            if t is None and shape == (0,):
                t = ref.new_empty(shape, dtype=dtype)
            elif o.kind == "param" and isinstance(t, torch.Tensor) and t.dtype != dtype:
                t = t.to(dtype)  # dbias in x's dtype beside an fp32 weight: the weight's dtype here
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != dtype:
                got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise TypeError(f"implementation '{impl.name}': {fn_name} returned {o.name} as {got}, expected {shape} {dtype}")
            if _storage(t) in seen and _storage(t) is not None:
                t = t.clone()
            seen.add(_storage(t))
            fixed.append(t)
        return tuple(fixed)

    return run


# ---------------------------------------------------------------- autograd formulas
def _grad_of(arg: Arg, fwd_outputs: tuple[Arg, ...]) -> str | None:
    """The forward output whose gradient this backward argument is ('dy' -> 'y'), if any."""
    name = arg.name[1:] if arg.name.startswith("d") else None
    return name if name in {o.name for o in fwd_outputs} else None


def _autograd(op: Op, bwd):
    fwd_in = [a.name for a in op.fwd_args]
    fwd_out = [a.name for a in op.fwd_outputs]
    saved_names = [a.name for a in op.bwd_args if _grad_of(a, op.fwd_outputs) is None]
    bwd_out = [a.name for a in op.bwd_outputs]

    def setup_context(ctx, inputs, output):
        named = dict(zip(fwd_in, inputs))
        named.update(zip(fwd_out, output))
        ctx.save_for_backward(*(named[n] for n in saved_names))
        ctx.mark_non_differentiable(*(named[n] for n in op.stats))
        ctx.set_materialize_grads(False)
        ctx.param_dtypes = {p: named[p].dtype for p in op.params if named.get(p) is not None}

    def backward(ctx, *grads):
        g = dict(zip(fwd_out, grads))
        saved = dict(zip(saved_names, ctx.saved_tensors))
        values = []
        for a in op.bwd_args:
            out_name = _grad_of(a, op.fwd_outputs)
            if out_name is None:
                values.append(saved[a.name])
                continue
            t = g[out_name]
            if t is None and not a.optional:  # only the other outputs were used
                t = torch.zeros_like(_first_rows(op.bwd_args, [saved.get(b.name) for b in op.bwd_args]))
            values.append(t)
        result = dict(zip(bwd_out, bwd(*values)))
        first = result[bwd_out[0]]
        grads_in = []
        for a, needed in zip(op.fwd_args, ctx.needs_input_grad):
            if not needed or a.kind == "scalar":
                grads_in.append(None)
            elif a.kind == "rows":  # dx; add_rmsnorm's dh is the gradient of both x and residual
                grads_in.append(result.get(f"d{a.name}", first))
            else:
                t = result.get(f"d{a.name}")
                grads_in.append(None if t is None else t.to(ctx.param_dtypes[a.name]))
        return tuple(grads_in)

    return backward, setup_context


def _no_double_backward(op_name: str):
    def backward(ctx, *grads):
        raise NotImplementedError(
            f"double backward through {op_name} is not supported: its backward treats the "
            "statistics (mean, rstd) as constants, so a second derivative would be wrong. Use "
            "torch.nn.functional.rms_norm / layer_norm where second derivatives are needed."
        )

    return backward, lambda ctx, inputs, output: None


# ---------------------------------------------------------------- registration
@dataclass(frozen=True)
class NormOps:
    """One implementation's registered ops: ``rmsnorm_fwd``, ``rmsnorm_bwd``, ... (OpOverloads; the
    functions it does not provide are None)."""

    impl: Implementation
    prefix: str  # normbench::<prefix>_<function>
    rmsnorm_fwd: object = None
    rmsnorm_bwd: object = None
    layernorm_fwd: object = None
    layernorm_bwd: object = None
    add_rmsnorm_fwd: object = None
    add_rmsnorm_bwd: object = None

    # a module holding these is deep-copied (an EMA copy) and pickled (torch.save) as the same ops
    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        return ops_for, (self.impl,)

    def function(self, fn_name: str):
        f = getattr(self, fn_name)
        if f is None:
            raise ValueError(f"implementation '{self.impl.name}' does not provide {fn_name.rpartition('_')[0]} (it provides {', '.join(self.impl.ops)})")
        return f


_REGISTERED: dict[Implementation, NormOps] = {}
_BY_NAME: dict[str, NormOps] = {}  # the first record registered under each name
_PREFIXES: set[str] = set()


def registered(name: str) -> NormOps | None:
    """The ops already registered for the implementation called ``name``, if any."""
    return _BY_NAME.get(name)


def _define(impl: Implementation, qualname: str, fn_name: str, args, outputs):
    opdef = torch.library.custom_op(
        f"{NAMESPACE}::{qualname}", _real(impl, fn_name, args, outputs), mutates_args=(), schema=_schema(args, outputs)
    )
    opdef.register_fake(_fake(impl, args, outputs))
    return opdef


def ops_for(impl: Implementation) -> NormOps:
    """The custom ops of ``impl`` (registered on first use; importing the kernels waits for a call)."""
    if impl in _REGISTERED:
        return _REGISTERED[impl]
    base = _identifier(impl.name)
    prefix, i = base, 1
    while prefix in _PREFIXES:  # two records with one sanitised name ('a-b', 'a_b', a test's copy)
        i += 1
        prefix = f"{base}_{i}"
    _PREFIXES.add(prefix)
    found = {}
    for name in impl.ops:
        op = OPS[name]
        fwd = _define(impl, f"{prefix}_{name}_fwd", f"{name}_fwd", op.fwd_args, op.fwd_outputs)
        bwd = _define(impl, f"{prefix}_{name}_bwd", f"{name}_bwd", op.bwd_args, op.bwd_outputs)
        bwd_overload = getattr(getattr(torch.ops, NAMESPACE), f"{prefix}_{name}_bwd").default
        backward, setup = _no_double_backward(f"{NAMESPACE}::{prefix}_{name}")
        bwd.register_autograd(backward, setup_context=setup)
        backward, setup = _autograd(op, bwd_overload)
        fwd.register_autograd(backward, setup_context=setup)
        found[f"{name}_fwd"] = getattr(getattr(torch.ops, NAMESPACE), f"{prefix}_{name}_fwd").default
        found[f"{name}_bwd"] = bwd_overload
    _REGISTERED[impl] = NormOps(impl, prefix, **found)
    _BY_NAME.setdefault(impl.name, _REGISTERED[impl])
    return _REGISTERED[impl]
