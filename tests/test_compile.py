"""torch.compile entries: when dynamo is reset (a new shape), and when it must not be (a training
step alternating forward and backward of one shape). The compiled functions are swapped for the plain
formulas so the bookkeeping is tested without paying for Inductor."""

import torch

from impls.compile import kernels as K


def _counting(monkeypatch):
    resets = []
    monkeypatch.setattr(torch._dynamo, "reset", lambda: resets.append(1))
    c = K.make("default")
    c._fns = {"rmsnorm_fwd": K._rms_fwd, "rmsnorm_bwd": K._rms_bwd, "layernorm_fwd": K._ln_fwd, "layernorm_bwd": K._ln_bwd}
    return c, resets


def test_forward_backward_alternation_of_one_shape_never_resets(monkeypatch):
    c, resets = _counting(monkeypatch)
    g = torch.Generator().manual_seed(0)
    x, dy = torch.randn(8, 64, generator=g).bfloat16(), torch.randn(8, 64, generator=g).bfloat16()
    w, b = torch.randn(64, generator=g).bfloat16(), torch.randn(64, generator=g).bfloat16()
    for _ in range(3):  # as autograd drives it: forward, backward, forward, ...
        _, rstd = c.rmsnorm_fwd(x, w, 1e-6)
        c.rmsnorm_bwd(dy, x, w, rstd)
        _, mean, rstd = c.layernorm_fwd(x, w, b, 1e-5)
        c.layernorm_bwd(dy, x, w, mean, rstd)
        c.layernorm_fwd(x, None, None, 1e-5)  # no affine: a guard, not a new shape
    assert len(resets) == 1


def test_a_new_shape_or_dtype_resets(monkeypatch):
    c, resets = _counting(monkeypatch)
    for shape, dtype in (((8, 64), torch.bfloat16), ((8, 64), torch.bfloat16), ((4, 64), torch.bfloat16), ((4, 64), torch.float32)):
        c.rmsnorm_fwd(torch.ones(shape, dtype=dtype), None, 1e-6)
    assert len(resets) == 3
