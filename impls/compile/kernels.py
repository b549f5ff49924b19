"""torch.compile of the plain formulas: what Inductor generates with no hand-written kernel.

    RMSNorm    rstd = 1/sqrt(mean(x^2) + eps);        y = x * rstd * w
    LayerNorm  mean = mean(x), rstd = 1/sqrt(var(x) + eps);  y = (x - mean) * rstd * w + b
    backward   xhat = normalized x, g = dy * w
               dx = rstd * (g - xhat * mean(g * xhat) [- mean(g) for LayerNorm])
               dw = sum_rows(dy * xhat)   [db = sum_rows(dy)]

    Add + RMSNorm  h = x + residual (rounded to x's dtype), then RMSNorm of h;
                   backward dh = dx + dresidual_out, added in fp32 and rounded once

Forward and backward are compiled as separate graphs, each written out explicitly (not derived by
autograd), so Inductor sees dx and the dweight column reduction in one graph and may fuse them.

Static shapes, without touching anyone else's compiled code: every (function, shape, strides,
dtypes, device) gets its own ``torch.compile(dynamic=False)`` of a private copy of the function (a
fresh code object). Dynamo keeps its cache and its recompile limit per code object, so each copy
compiles once for its shape and the limit is never reached, where one compiled function seeing many
shapes would fall back to a dynamic-shape graph or to eager. A global ``torch._dynamo.reset()`` on a
new shape (what this file did before, and what TritonBench does between its inputs) would also
throw away every compiled function of the user's process.

eps is a runtime input of each graph, a 0-d fp32 tensor on x's device (one per value and device,
kept): a Python float is a constant to dynamo, and with ``dynamic=False`` every new value would be a
new graph (then, past the recompile limit, eager).

Overflow: rows whose squares overflow fp32 give var = inf and rstd = rsqrt(inf) = 0, hence y = b, a
finite wrong number; torch's LayerNorm returns NaN there, and so does this one (one select, fused).
Parameters may be fp32 beside 16-bit x; gradients come back in the parameters' dtype.
"""

import types

import torch


def _rms_fwd(x, w, eps):
    xf = x.float()
    rstd = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    y = xf * rstd
    if w is not None:
        y = y * w.float()
    return y.to(x.dtype), rstd.squeeze(-1)


def _rows(t):
    """The dimensions a column reduction sums over: all but N (rows are (M, N) or per-head (T, H, N))."""
    return tuple(range(t.dim() - 1))


def _rms_bwd_f32(dy, x, w, rstd):
    r = rstd.view(x.shape[:-1]).unsqueeze(-1)
    xhat = x.float() * r
    g = dy.float() * w.float() if w is not None else dy.float()
    dx = r * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    dw = (dy.float() * xhat).sum(_rows(dy)).to(w.dtype) if w is not None else None
    return dx, dw


def _rms_bwd(dy, x, w, rstd):
    dx, dw = _rms_bwd_f32(dy, x, w, rstd)
    return dx.to(x.dtype), dw


def _add_rms_fwd(x, residual, w, eps):
    h = (x.float() + residual.float()).to(x.dtype)
    y, rstd = _rms_fwd(h, w, eps)
    return y, h, rstd


def _add_rms_bwd(dy, dres, h, w, rstd):
    dx, dw = _rms_bwd_f32(dy, h, w, rstd)
    if dres is not None:
        dx = dx + dres.float()
    return dx.to(h.dtype), dw


def _ln_fwd(x, w, b, eps):
    xf = x.float()
    var, mean = torch.var_mean(xf, -1, correction=0, keepdim=True)
    rstd = torch.where(torch.isinf(var), float("nan"), torch.rsqrt(var + eps))
    y = (xf - mean) * rstd
    if w is not None:
        y = y * w.float()
    if b is not None:
        y = y + b.float()
    return y.to(x.dtype), mean.squeeze(-1), rstd.squeeze(-1)


def _ln_bwd(dy, x, w, mean, rstd):
    r = rstd.view(x.shape[:-1]).unsqueeze(-1)
    xhat = (x.float() - mean.view(x.shape[:-1]).unsqueeze(-1)) * r
    g = dy.float() * w.float() if w is not None else dy.float()
    dx = r * (g - xhat * (g * xhat).mean(-1, keepdim=True) - g.mean(-1, keepdim=True))
    pdtype = w.dtype if w is not None else x.dtype
    dw = (dy.float() * xhat).sum(_rows(dy)).to(pdtype) if w is not None else None
    return dx.to(x.dtype), dw, dy.float().sum(_rows(dy)).to(pdtype)


FORMULAS = {
    "rmsnorm_fwd": _rms_fwd,
    "rmsnorm_bwd": _rms_bwd,
    "layernorm_fwd": _ln_fwd,
    "layernorm_bwd": _ln_bwd,
    "add_rmsnorm_fwd": _add_rms_fwd,
    "add_rmsnorm_bwd": _add_rms_bwd,
}


def _private_copy(fn, tag: int):
    """``fn`` with a code object of its own, so dynamo gives it a cache (and a recompile limit) of
    its own."""
    name = f"{fn.__name__}_{tag}"
    code = fn.__code__.replace(co_name=name, co_qualname=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


def _key(t):
    return None if t is None else (tuple(t.shape), t.stride(), t.dtype, t.device.type)


# Functions whose rounding to x's dtype in the middle is part of the contract: residual_out is
# rounded before it is normalised. Inductor drops a down-cast followed by an up-cast (it normalised
# the fp32 sum: rstd off by ~1e-3 at N = 1) unless it emulates precision casts, which these
# functions ask for (and the others, which round only their outputs, do not need).
EXACT_CASTS = ("add_rmsnorm_fwd",)


class _Compiled:
    """The contract functions, one static-shape compiled copy per function and argument layout
    (and per value of ``static``: Python arguments a graph is specialised on, such as the FP8 ops'
    group)."""

    FORMULAS = FORMULAS
    EXACT_CASTS = EXACT_CASTS

    def __init__(self, mode: str, backend: str = "inductor"):
        self._opts = dict(mode=mode, dynamic=False) if backend == "inductor" else dict(backend=backend, dynamic=False)
        # torch.compile takes a mode or options, not both: the mode's options, plus the emulation
        self._exact = (
            dict(options={**torch._inductor.list_mode_options(mode), "emulate_precision_casts": True}, dynamic=False)
            if backend == "inductor"
            else self._opts
        )
        self._fns: dict = {}
        self._eps: dict = {}

    def _run(self, name, *args, static=()):
        # keyed on every tensor's shape, strides and dtype: a weight present or None is a guard of
        # one compiled copy, not a new copy
        key = (name, *static, *(_key(a) for a in args if isinstance(a, torch.Tensor)))
        fn = self._fns.get(key)
        if fn is None:
            opts = self._exact if name in self.EXACT_CASTS else self._opts
            fn = self._fns[key] = torch.compile(_private_copy(self.FORMULAS[name], len(self._fns)), **opts)
        return fn(*args, *static)

    def _eps_tensor(self, eps: float, device: torch.device) -> torch.Tensor:
        key = (eps, device)
        t = self._eps.get(key)
        if t is None:
            # torch.full launches a fill kernel (no host-to-device copy), so this is capturable too;
            # a tensor made during CUDA-graph capture is filled only by replays, so it is not kept
            t = torch.full((), eps, dtype=torch.float32, device=device)
            if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
                if len(self._eps) >= 64:
                    self._eps.clear()
                self._eps[key] = t
        return t

    def rmsnorm_fwd(self, x, weight, eps):
        return self._run("rmsnorm_fwd", x, weight, self._eps_tensor(eps, x.device))

    def rmsnorm_bwd(self, dy, x, weight, rstd):
        return self._run("rmsnorm_bwd", dy, x, weight, rstd)

    def layernorm_fwd(self, x, weight, bias, eps):
        return self._run("layernorm_fwd", x, weight, bias, self._eps_tensor(eps, x.device))

    def layernorm_bwd(self, dy, x, weight, mean, rstd):
        return self._run("layernorm_bwd", dy, x, weight, mean, rstd)

    def add_rmsnorm_fwd(self, x, residual, weight, eps):
        return self._run("add_rmsnorm_fwd", x, residual, weight, self._eps_tensor(eps, x.device))

    def add_rmsnorm_bwd(self, dy, dresidual_out, residual_out, weight, rstd):
        return self._run("add_rmsnorm_bwd", dy, dresidual_out, residual_out, weight, rstd)


def make(mode: str = "default", backend: str = "inductor") -> _Compiled:
    return _Compiled(mode, backend)
