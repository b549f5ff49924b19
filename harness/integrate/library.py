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
(``harness.spec.ops``), not written per op: a ``rows`` tensor is (..., N) in x's dtype, a ``stat`` is
(...,) fp32, a ``param`` is (N,) in the weight's dtype.

Forward-only ops (the FP8 ops, whose q has no gradient) get a forward op and no autograd formula,
one per contract function (the records of its groupings share it): ``normbench::triton_rmsnorm_fp8_fwd``.

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

torch.func: ``grad`` and ``vjp`` work (the eager twin is a setup_context-style autograd.Function);
``vmap`` runs the kernels once per batch element (they have no batch dimension of their own, and a
batched weight needs a dweight per element); ``jvp`` (forward mode) raises NotImplementedError: the
contract has no forward-mode derivative.

One set of ops per distinct record: records compare by their declared fields only, so two that
differ only in ``options`` (another torch.compile mode) are equal; the ops are keyed like the loaded
kernels (``harness.spec.loading``), by record and options. The registry's record of a name gets the
plain prefix (``normbench::eager_rmsnorm_fwd``); any other record, a test's copy sharing the name
included, gets a prefix of its own (``eager_2``).

Bad arguments under torch.compile: dynamo reports an exception raised while it traces as its own
error (``Unsupported``, ``TorchRuntimeError``), never as the ValueError / TypeError eager raises. The
autograd functions and modules therefore validate before they call a forward op, and where that
fails while tracing they put ``normbench::argument_error`` into the graph instead: it raises the eager
error, type and message, when the graph runs (``deferred_error``). The ops' fake functions validate
too, for a direct call of an op.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from harness.registry import all_implementations
from harness.spec.contract import Implementation
from harness.spec.fp8 import FP8_DTYPE, check_group
from harness.spec.ops import OPS, Arg, Op
from harness.spec.validation import check_eps, check_like_x, check_stats, check_vector, check_x, checked

NAMESPACE = "normbench"
_SCHEMA_TYPE = {"rows": "Tensor", "stat": "Tensor", "param": "Tensor?", "scalar": "float", "group": "int"}


def _schema(args: tuple[Arg, ...], outputs: tuple[Arg, ...]) -> str:
    ins = ", ".join(f"{_SCHEMA_TYPE[a.kind]}{'?' if a.optional and a.kind == 'rows' else ''} {a.name}" for a in args)
    return f"({ins}) -> ({', '.join('Tensor' for _ in outputs)})"


def _identifier(name: str) -> str:
    ident = re.sub(r"\W", "_", name)
    return ident if ident[:1].isalpha() else f"i_{ident}"


# ---------------------------------------------------------------- output metadata (fake and real)
@dataclass(frozen=True)
class _Signature:
    """One contract function's arguments and outputs, with the positions a call needs (computed once)."""

    args: tuple[Arg, ...]
    outputs: tuple[Arg, ...]

    @property
    def ref(self) -> int:  # the first row tensor (x, dy): never None, it fixes shape and dtype
        return next(i for i, a in enumerate(self.args) if a.kind == "rows")

    @property
    def weight(self) -> int | None:
        return next((i for i, a in enumerate(self.args) if a.name == "weight"), None)

    @property
    def grad_of_param(self) -> tuple[int | None, ...]:
        """Per output: the argument position of the parameter it is the gradient of (dweight)."""
        pos = {a.name: i for i, a in enumerate(self.args)}
        return tuple(pos.get(o.name[1:]) if o.kind == "param" else None for o in self.outputs)


def _metadata(sig: _Signature):
    ref_i, w_i, grad_of = sig.ref, sig.weight, sig.grad_of_param
    kinds = tuple(o.kind for o in sig.outputs)
    group_i = next((i for i, a in enumerate(sig.args) if a.kind == "group"), None)

    def meta(values) -> list[tuple[tuple, torch.dtype]]:
        """(shape, dtype) of every output, given the op's arguments (real or fake tensors)."""
        ref = values[ref_i]
        weight = values[w_i] if w_i is not None else None
        param_dtype = weight.dtype if weight is not None else ref.dtype
        out = []
        for kind, p in zip(kinds, grad_of):
            if kind == "rows":
                out.append((tuple(ref.shape), ref.dtype))
            elif kind == "stat":
                out.append((tuple(ref.shape[:-1]), torch.float32))
            elif kind == "fp8":
                out.append((tuple(ref.shape), FP8_DTYPE))
            elif kind == "scale":
                out.append(((*ref.shape[:-1], ref.shape[-1] // values[group_i]), torch.float32))
            elif p is not None and values[p] is None:
                out.append(((0,), ref.dtype))  # the placeholder for a gradient of an absent parameter
            else:
                out.append(((ref.shape[-1],), param_dtype))
        return out

    return meta


def _validate(impl: Implementation, sig: _Signature, values):
    """The contract's argument checks, run on fake tensors too: a direct call of an op under
    torch.compile with a bad argument fails while it is traced (dynamo wraps the error; the autograd
    layer validates before it calls an op: see the module docstring)."""
    ref = values[sig.ref]
    m, n = check_x(ref, impl, sig.args[sig.ref].name)
    for a, v in zip(sig.args, values):
        if a.kind == "rows" and v is not None and v is not ref:
            check_like_x(v, ref, a.name)
        elif a.kind == "param":
            check_vector(v, n, ref, a.name)
        elif a.kind == "stat":
            check_stats(v, m, ref, a.name)
        elif a.kind == "scalar":
            check_eps(v)
        elif a.kind == "group":
            check_group(v, n)


def _fake(impl: Implementation, sig: _Signature):
    meta = _metadata(sig)

    def fake(*values):
        _validate(impl, sig, values)
        ref = values[sig.ref]
        return tuple(ref.new_empty(shape, dtype=dtype) for shape, dtype in meta(values))

    return fake


def _storage(t: torch.Tensor):
    return t.untyped_storage().data_ptr() if t.numel() else None


def _real(impl: Implementation, fn_name: str, sig: _Signature, op: bool):
    """The validated contract function on the arguments' device, its outputs checked against what the
    op promises (a TypeError naming the implementation otherwise). For the custom op (``op``) they
    are also made what an op may return: the placeholder for a gradient of an absent parameter, and
    a copy of a tensor sharing storage with an input or an earlier output. The eager twin keeps None
    and aliases, which autograd.Function takes, and spares itself the storage look-ups; for an op
    with a backward its statistics stay (M,), which only that backward reads.

    The outputs' shapes and dtypes follow from what the contract function's launch plan is keyed by
    (``harness.spec.validation.checked``), so they are checked on each plan's first call; a later
    call of the plan only converts what that call found to convert (dbias in x's dtype beside an
    fp32 weight), and, for the op, looks for shared storage."""
    meta, ref_i, outputs = _metadata(sig), sig.ref, sig.outputs
    functions = {}  # torch.device -> the validated contract function
    flat = []  # [whether the statistics stay (M,)]: the twin of an op with a backward, which reads them

    def verify(values, out):
        convert = {}  # output position -> the dtype every call converts it to
        for i, (o, t, (shape, dtype)) in enumerate(zip(outputs, out, meta(values))):
            if t is None and shape == (0,):
                continue
            if o.kind == "stat" and flat[0]:  # (checked(flat_stats))
                shape = (values[ref_i].numel() // values[ref_i].shape[-1],)
            if o.kind == "param" and isinstance(t, torch.Tensor) and t.dtype != dtype:
                convert[i] = dtype  # dbias in x's dtype beside an fp32 weight: the weight's dtype here
                t = t.to(dtype)
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != dtype:
                got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise TypeError(
                    f"implementation '{impl.name}': {fn_name} returned {o.name} as {got}, expected {shape} {dtype}"
                )
        if op:
            placeholders = {
                i: dtype for i, (t, (shape, dtype)) in enumerate(zip(out, meta(values))) if t is None and shape == (0,)
            }
            return lambda values, out: _as_op_outputs(values, out, convert, placeholders, ref_i)
        if not convert:
            return None
        return lambda values, out: tuple(t.to(convert[i]) if i in convert else t for i, t in enumerate(out))

    def run(*values):
        ref = values[ref_i]
        fn = functions.get(ref.device)
        if fn is None:
            contract = getattr(impl.kernels(ref.device.type), fn_name)
            if not flat:
                flat.append(not op and bool(contract.op.bwd_args))
            fn = functions[ref.device] = checked(
                impl, contract.op, contract.direction, contract.raw, after=verify, flat_stats=flat[0]
            )
        return fn(*values)

    return run


def _as_op_outputs(values, out, convert: dict, placeholders: dict, ref_i: int) -> tuple:
    """What a custom op may return (see ``_real``): placeholders for None, the conversions, and a copy
    of a tensor sharing storage with an input or an earlier output."""
    seen = {_storage(v) for v in values if isinstance(v, torch.Tensor)}
    fixed = []
    for i, t in enumerate(out):
        if i in placeholders:
            fixed.append(values[ref_i].new_empty((0,), dtype=placeholders[i]))
            continue
        if i in convert:
            t = t.to(convert[i])
        ptr = _storage(t)
        if ptr is not None and ptr in seen:
            t = t.clone()
        seen.add(ptr)
        fixed.append(t)
    return tuple(fixed)


# ---------------------------------------------------------------- autograd formulas
def _grad_of(arg: Arg, fwd_outputs: tuple[Arg, ...]) -> str | None:
    """The forward output whose gradient this backward argument is ('dy' -> 'y'), if any."""
    name = arg.name[1:] if arg.name.startswith("d") else None
    return name if name in {o.name for o in fwd_outputs} else None


def _autograd(op: Op, bwd):
    fwd_out = [a.name for a in op.fwd_outputs]
    saved_names = [a.name for a in op.bwd_args if _grad_of(a, op.fwd_outputs) is None]
    # what the forward saves, as positions in (*inputs, *outputs)
    fwd_names = [a.name for a in op.fwd_args] + fwd_out
    saved_at = [fwd_names.index(n) for n in saved_names]
    # where each backward argument comes from: (True, saved index) or (False, forward output index),
    # and whether a gradient that was not materialised must be zeros (not optional)
    plan = [
        (True, saved_names.index(a.name), False)
        if _grad_of(a, op.fwd_outputs) is None
        else (False, fwd_out.index(_grad_of(a, op.fwd_outputs)), not a.optional)
        for a in op.bwd_args
    ]
    # a row tensor among the saved ones: the shape of a gradient that was not materialised
    saved_rows = next(saved_names.index(a.name) for a in op.bwd_args if a.name in saved_names and a.kind == "rows")
    bwd_out = [a.name for a in op.bwd_outputs]
    # per forward input: which backward output is its gradient (dx; add_rmsnorm's dh is both x's and
    # residual's), or None (eps); and for a parameter, its place among the parameters, whose dtypes
    # the gradients come back in
    params = [i for i, a in enumerate(op.fwd_args) if a.kind == "param"]
    grads_plan = [
        (
            None if a.kind == "scalar" else bwd_out.index(f"d{a.name}") if f"d{a.name}" in bwd_out else 0,
            params.index(i) if i in params else None,
        )
        for i, a in enumerate(op.fwd_args)
    ]
    stat_index = [fwd_out.index(n) for n in op.stats]

    def setup_context(ctx, inputs, output):
        both = (*inputs, *output)
        ctx.save_for_backward(*[both[i] for i in saved_at])
        ctx.mark_non_differentiable(*[output[i] for i in stat_index])
        ctx.set_materialize_grads(False)
        ctx.param_dtypes = [None if inputs[i] is None else inputs[i].dtype for i in params]

    def backward(ctx, *grads):
        saved = ctx.saved_tensors
        values = []
        for from_saved, i, zeros in plan:
            t = saved[i] if from_saved else grads[i]
            if t is None and zeros:  # only the other outputs were used
                t = torch.zeros_like(saved[saved_rows])
            values.append(t)
        result = bwd(*values)
        grads_in = []
        for needed, (i, param) in zip(ctx.needs_input_grad, grads_plan):
            if not needed or i is None:
                grads_in.append(None)
                continue
            g = result[i]
            if param is not None and g.dtype != ctx.param_dtypes[param]:
                g = g.to(ctx.param_dtypes[param])
            grads_in.append(g)
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


def _vmap_per_element(fn):
    """A torch.func.vmap rule: ``fn`` once per batch element, its outputs stacked along dim 0. The
    kernels take no batch dimension of their own, and folding the batch into the rows would sum
    dweight over the whole batch where vmap wants one per element."""

    def rule(info, in_dims, *args):
        per = [
            fn(*(a.select(d, i) if d is not None else a for a, d in zip(args, in_dims))) for i in range(info.batch_size)
        ]
        outs, dims = [], []
        for column in zip(*per):
            none = column[0] is None
            outs.append(None if none else torch.stack(column))
            dims.append(None if none else 0)
        return tuple(outs), tuple(dims)

    return rule


def _no_jvp(op_name: str):
    def jvp(ctx, *tangents):
        raise NotImplementedError(
            f"torch.func.jvp (forward-mode AD) through {op_name} is not supported: the kernels "
            "provide a backward only. Use torch.func.vjp or torch.func.grad (reverse mode), or "
            "torch.nn.functional.rms_norm / layer_norm where a forward-mode derivative is needed."
        )

    return jvp


# ---------------------------------------------------------------- argument errors under torch.compile
_ERRORS = {"ValueError": ValueError, "TypeError": TypeError}


def _argument_error(like, kind: str, message: str):
    raise _ERRORS.get(kind, ValueError)(message)


def _argument_error_fake(like, kind: str, message: str):
    return like.new_empty(like.shape) if like is not None else torch.empty(0)


_argument_error_op = torch.library.custom_op(
    f"{NAMESPACE}::argument_error",
    _argument_error,
    mutates_args=(),
    schema="(Tensor? like, str kind, str message) -> Tensor",
)
_argument_error_op.register_fake(_argument_error_fake)
# a formula, never run (the forward raises first), so that a graph tracing x's gradient through the
# stand-in is still a graph
_argument_error_op.register_autograd(
    lambda ctx, grad: (None, None, None), setup_context=lambda ctx, inputs, output: None
)
if hasattr(_argument_error_op, "register_effect"):
    # an effect orders the node and keeps it when its output is unused (a pure op would be dropped)
    from torch._library.effects import EffectType

    _argument_error_op.register_effect(EffectType.ORDERED)


def deferred_error(like, error: Exception, n_outputs: int = 1) -> tuple:
    """Inside torch.compile: ``n_outputs`` stand-ins shaped like ``like`` (x) whose graph node raises
    ``error`` (its type and message) when the compiled code runs (see the module docstring)."""
    like = like if isinstance(like, torch.Tensor) else None
    kind = "TypeError" if isinstance(error, TypeError) else "ValueError"
    out = getattr(torch.ops, NAMESPACE).argument_error(like, kind, error.args[0] if error.args else "")
    return (out,) * n_outputs


def missing_op(impl: Implementation, op: str) -> ValueError:
    """The error for an op ``impl`` does not provide (raised eagerly, and where dynamo traces)."""
    return ValueError(f"implementation '{impl.name}' does not provide {op} (it provides {', '.join(impl.ops)})")


# ---------------------------------------------------------------- registration
@dataclass(frozen=True)
class NormOps:
    """One implementation's registered ops, by contract function: ``ops.rmsnorm_fwd`` (an OpOverload)."""

    impl: Implementation
    prefix: str  # normbench::<prefix>_<function>
    functions: dict = field(default_factory=dict, hash=False, compare=False)
    # forward function -> the same computation as an autograd.Function, for eager calls (see _eager)
    eager: dict = field(default_factory=dict, hash=False, compare=False)

    def __getattr__(self, name):
        functions = self.__dict__.get("functions", {})
        if name in functions:
            return functions[name]
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def forward(self, op: str):
        """The callable for ``op``'s differentiable forward: the custom op while torch.compile traces,
        the eager twin (same kernels, same validation, same autograd formula) otherwise."""
        if torch.compiler.is_compiling():
            return self.function(f"{op}_fwd")
        self.function(f"{op}_fwd")  # the same ValueError for an op it does not provide
        return self.eager[f"{op}_fwd"]

    def function(self, fn_name: str):
        if fn_name not in self.functions:
            raise missing_op(self.impl, fn_name.rpartition("_")[0])
        return self.functions[fn_name]


def record_key(impl: Implementation) -> tuple:
    """What tells two records' kernels apart: the record and its options (``options`` is left out of
    the record's equality; ``harness.spec.loading`` keys its caches the same way)."""
    return (impl, repr(sorted(impl.options.items())))


_REGISTERED: dict[tuple, NormOps] = {}
_PREFIXES: set[str] = set()


def _prefix(impl: Implementation) -> str:
    base = _identifier(impl.name)
    official = all_implementations().get(impl.name)
    # the registry's record keeps the plain name whatever was registered first; a copy sharing its
    # name (other kernels, other options) must not take it
    i = 2 if official is not None and record_key(official) != record_key(impl) else 1
    prefix = base if i == 1 else f"{base}_{i}"
    while prefix in _PREFIXES:  # two records with one sanitised name ('a-b', 'a_b')
        i += 1
        prefix = f"{base}_{i}"
    _PREFIXES.add(prefix)
    return prefix


def _define(impl: Implementation, qualname: str, fn_name: str, args, outputs):
    """The custom op, and the same validated function for the eager twin."""
    sig = _Signature(args, outputs)
    opdef = torch.library.custom_op(
        f"{NAMESPACE}::{qualname}", _real(impl, fn_name, sig, op=True), mutates_args=(), schema=_schema(args, outputs)
    )
    opdef.register_fake(_fake(impl, sig))
    opdef.register_vmap(_vmap_per_element(getattr(getattr(torch.ops, NAMESPACE), qualname).default))
    return opdef, _real(impl, fn_name, sig, op=False)


def _eager(op: Op, op_name: str, fwd_run, bwd_run):
    """``op``'s forward as a torch.autograd.Function around the functions the custom ops wrap.

    Why a twin: a Python custom op pays its dispatch (autograd wrapper, redispatch, the dynamo guard
    around its body) on every call. Measured on an H100 at 4 x 4096 (bf16), a forward and backward
    through the custom ops cost 757-1594 us of host time against 160 us for
    torch.nn.functional.rms_norm (``reports/experiments/overhead/before-eager_twin/overhead-4x4096-bf16.json``), which
    made every small model slower with a faster kernel. Outside torch.compile nothing needs the op to
    be opaque, so eager calls take this twin; compiled code still sees the custom ops.

    Its backward calls the contract's backward directly, or, where that result could be
    differentiated again (create_graph=True) or sits under a torch.func transform, through a second
    Function whose derivative raises the double-backward error and which has a vmap rule (a custom
    op's registered autograd does not run under torch.func)."""
    in_transform = torch._C._functorch.peek_interpreter_stack
    transforms_active = torch._C._are_functorch_transforms_active
    no_second, _ = _no_double_backward(op_name)

    class EagerBackward(torch.autograd.Function):
        forward = staticmethod(bwd_run)
        backward = staticmethod(no_second)
        vmap = staticmethod(_vmap_per_element(bwd_run))

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

    backward_apply = _apply(EagerBackward)

    def bwd(*values):
        if torch.is_grad_enabled() or in_transform() is not None:
            return backward_apply(*values)
        return bwd_run(*values)

    differentiate, setup = _autograd(op, bwd)

    class Eager(torch.autograd.Function):
        # the closures themselves, not methods calling them: one Python frame less per call; forward
        # and setup_context apart, as torch.func's transforms need
        forward = staticmethod(fwd_run)
        setup_context = staticmethod(setup)
        backward = staticmethod(differentiate)
        vmap = staticmethod(_vmap_per_element(fwd_run))
        jvp = staticmethod(_no_jvp(op_name))

    Eager.__name__ = Eager.__qualname__ = f"{op.name}_eager"
    EagerBackward.__name__ = EagerBackward.__qualname__ = f"{op.name}_eager_backward"
    apply = _apply(Eager)
    tensors = tuple(i for i, a in enumerate(op.fwd_args) if a.kind in ("rows", "param"))

    def forward(*values):
        # nothing to differentiate (torch.no_grad(), inference, or no input that requires grad): the
        # kernels alone, as Function.apply would run them, without its bookkeeping
        if torch.is_grad_enabled():
            for i in tensors:
                v = values[i]
                if isinstance(v, torch.Tensor) and v.requires_grad:
                    return apply(*values)
        if transforms_active():  # torch.func's: the Function, whatever requires grad
            return apply(*values)
        return fwd_run(*values)

    return forward


def _apply(fn: type) -> Callable:
    """``fn.apply`` (an autograd.Function with ``setup_context``) without its per-call
    ``inspect.signature`` binding of the forward's arguments (torch 2.13), which cost more host time
    than the rest of the Function's Python: our forwards take ``*values``, so that binding changes
    nothing. Under a torch.func transform the full ``fn.apply``, which routes the call through the
    transform."""
    base = super(torch.autograd.Function, fn).apply  # torch._C._FunctionBase.apply, bound to fn
    full = fn.apply
    transforms_active = torch._C._are_functorch_transforms_active
    from torch._functorch.utils import unwrap_dead_wrappers

    def apply(*values):
        if transforms_active():
            return full(*values)
        return base(*unwrap_dead_wrappers(values))

    return apply


def ops_for(impl: Implementation) -> NormOps:
    """The custom ops of ``impl`` (registered on first use; importing the kernels waits for a call)."""
    key = record_key(impl)
    if key in _REGISTERED:
        return _REGISTERED[key]
    prefix = _prefix(impl)
    found, eager = {}, {}
    for name in impl.ops:
        op = OPS[name]
        if not op.offers("bwd"):
            # forward only (the FP8 ops: no gradient through a quantization), one op per contract
            # function, which the records of its groupings share
            fn = op.function("fwd")
            if fn not in found:
                _, fwd_run = _define(impl, f"{prefix}_{fn}", fn, op.fwd_args, op.fwd_outputs)
                found[fn] = getattr(getattr(torch.ops, NAMESPACE), f"{prefix}_{fn}").default
                eager[fn] = fwd_run
            continue
        fwd, fwd_run = _define(impl, f"{prefix}_{name}_fwd", f"{name}_fwd", op.fwd_args, op.fwd_outputs)
        bwd, bwd_run = _define(impl, f"{prefix}_{name}_bwd", f"{name}_bwd", op.bwd_args, op.bwd_outputs)
        bwd_overload = getattr(getattr(torch.ops, NAMESPACE), f"{prefix}_{name}_bwd").default
        backward, setup = _no_double_backward(f"{NAMESPACE}::{prefix}_{name}")
        bwd.register_autograd(backward, setup_context=setup)
        backward, setup = _autograd(op, bwd_overload)
        fwd.register_autograd(backward, setup_context=setup)
        found[f"{name}_fwd"] = getattr(getattr(torch.ops, NAMESPACE), f"{prefix}_{name}_fwd").default
        found[f"{name}_bwd"] = bwd_overload
        eager[f"{name}_fwd"] = _eager(op, f"{NAMESPACE}::{prefix}_{name}", fwd_run, bwd_run)
    _REGISTERED[key] = NormOps(impl, prefix, found, eager)
    return _REGISTERED[key]
