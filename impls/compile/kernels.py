"""torch.compile of the plain formulas: what Inductor generates with no hand-written kernel.

    RMSNorm    rstd = 1/sqrt(mean(x^2) + eps);        y = x * rstd * w
    LayerNorm  mean = mean(x), rstd = 1/sqrt(var(x) + eps);  y = (x - mean) * rstd * w + b
    backward   xhat = normalized x, g = dy * w
               dx = rstd * (g - xhat * mean(g * xhat) [- mean(g) for LayerNorm])
               dw = sum_rows(dy * xhat)   [db = sum_rows(dy)]

Forward and backward are compiled as separate graphs, each written out explicitly (not derived by
autograd), so Inductor sees dx and the dweight column reduction in one graph and may fuse them.
``dynamic=False`` and a dynamo reset whenever the shape changes, as TritonBench does: every shape gets
its own static-shape kernels instead of a dynamic-shape fallback after the recompile limit.
"""

import torch


def _rms_fwd(x, w, eps: float):
    xf = x.float()
    rstd = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    y = xf * rstd
    if w is not None:
        y = y * w.float()
    return y.to(x.dtype), rstd.squeeze(-1)


def _rms_bwd(dy, x, w, rstd):
    r = rstd.unsqueeze(-1)
    xhat = x.float() * r
    g = dy.float() * w.float() if w is not None else dy.float()
    dx = r * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    dw = (dy.float() * xhat).sum(0).to(w.dtype) if w is not None else None
    return dx.to(x.dtype), dw


def _ln_fwd(x, w, b, eps: float):
    xf = x.float()
    var, mean = torch.var_mean(xf, -1, correction=0, keepdim=True)
    rstd = torch.rsqrt(var + eps)
    y = (xf - mean) * rstd
    if w is not None:
        y = y * w.float()
    if b is not None:
        y = y + b.float()
    return y.to(x.dtype), mean.squeeze(-1), rstd.squeeze(-1)


def _ln_bwd(dy, x, w, mean, rstd):
    r = rstd.unsqueeze(-1)
    xhat = (x.float() - mean.unsqueeze(-1)) * r
    g = dy.float() * w.float() if w is not None else dy.float()
    dx = r * (g - xhat * (g * xhat).mean(-1, keepdim=True) - g.mean(-1, keepdim=True))
    dw = (dy.float() * xhat).sum(0).to(x.dtype) if w is not None else None
    return dx.to(x.dtype), dw, dy.float().sum(0).to(x.dtype)


class _Compiled:
    """The four contract functions, compiled with one mode; dynamo is reset when the shape changes."""

    def __init__(self, mode: str):
        opts = dict(mode=mode, dynamic=False)
        self._fns = {
            "rmsnorm_fwd": torch.compile(_rms_fwd, **opts),
            "rmsnorm_bwd": torch.compile(_rms_bwd, **opts),
            "layernorm_fwd": torch.compile(_ln_fwd, **opts),
            "layernorm_bwd": torch.compile(_ln_bwd, **opts),
        }
        self._key = None

    def _run(self, name, x, *args):
        # keyed on x alone (the forward's input, the backward's saved input), so a training step's
        # forward and backward of one shape share compiled state and only a new shape resets dynamo;
        # a weight/bias present or None is a guard of the compiled graph, not a reason to reset
        # (resetting on it reset dynamo at every fwd/bwd alternation: 110 ms a step on the H200)
        key = (tuple(x.shape), x.stride(), x.dtype, x.device.type)
        if key != self._key:
            torch._dynamo.reset()
            self._key = key
        return self._fns[name](*args)

    def rmsnorm_fwd(self, x, weight, eps):
        return self._run("rmsnorm_fwd", x, x, weight, eps)

    def rmsnorm_bwd(self, dy, x, weight, rstd):
        return self._run("rmsnorm_bwd", x, dy, x, weight, rstd)

    def layernorm_fwd(self, x, weight, bias, eps):
        return self._run("layernorm_fwd", x, x, weight, bias, eps)

    def layernorm_bwd(self, dy, x, weight, mean, rstd):
        return self._run("layernorm_bwd", x, dy, x, weight, mean, rstd)


def make(mode: str = "default") -> _Compiled:
    return _Compiled(mode)
