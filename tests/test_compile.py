"""torch.compile entries: one static-shape compiled copy per function and argument layout, never a
global dynamo reset (which would throw away the user's own compiled functions). A counting backend
stands in for Inductor, so dynamo's bookkeeping is tested without paying for code generation."""

import itertools

import torch

from harness.spec import reference
from impls.compile import kernels as K


def _counting():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    return backend, graphs


def _inputs(shape, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, dy = (torch.randn(*shape, generator=g).to(dtype) for _ in range(2))
    w, b = (torch.randn(shape[-1], generator=g).to(dtype) for _ in range(2))
    return x, dy, w, b


def test_forward_backward_alternation_of_one_shape_compiles_once(monkeypatch):
    monkeypatch.setattr(torch._dynamo, "reset", lambda: (_ for _ in ()).throw(AssertionError("dynamo reset")))
    backend, graphs = _counting()
    c = K.make("default", backend=backend)
    x, dy, w, b = _inputs((8, 64))
    for _ in range(3):  # as autograd drives it: forward, backward, forward, ...
        _, rstd = c.rmsnorm_fwd(x, w, 1e-6)
        c.rmsnorm_bwd(dy, x, w, rstd)
        _, mean, rstd = c.layernorm_fwd(x, w, b, 1e-5)
        c.layernorm_bwd(dy, x, w, mean, rstd)
        _, h, rstd = c.add_rmsnorm_fwd(x, dy, w, 1e-6)
        c.add_rmsnorm_bwd(dy, x, h, w, rstd)
    assert len(graphs) == 6 and len(c._fns) == 6


def test_every_shape_gets_its_own_static_graph_past_the_recompile_limit():
    backend, graphs = _counting()
    c = K.make("default", backend=backend)
    shapes = [(m, 64) for m in range(1, 2 + torch._dynamo.config.recompile_limit + 2)]
    for shape in shapes:
        c.rmsnorm_fwd(_inputs(shape)[0], None, 1e-6)
    c.rmsnorm_fwd(_inputs((4, 64), torch.float32)[0], None, 1e-6)  # a new dtype: a new copy
    assert len(graphs) == len(shapes) + 1
    # static graphs: no symbolic sizes (a dynamic fallback after the limit would have them)
    for gm in graphs:
        for node in gm.graph.nodes:
            val = node.meta.get("example_value")
            if isinstance(val, torch.Tensor):
                assert all(isinstance(d, int) for d in val.shape), node


def test_a_users_compiled_function_is_not_recompiled():
    user_backend, user_graphs = _counting()

    @torch.compile(backend=user_backend, dynamic=False)
    def users(t):
        return t * 2 + 1

    t = torch.randn(16)
    users(t)
    backend, graphs = _counting()
    c = K.make("default", backend=backend)
    for shape in ((8, 64), (4, 32), (3, 1000)):  # new shapes for the implementation
        x, dy, w, b = _inputs(shape)
        c.layernorm_fwd(x, w, b, 1e-5)
    users(t)
    assert len(user_graphs) == 1 and len(graphs) == 3


def test_layernorm_overflow_is_nan_not_the_bias():
    x = torch.full((2, 64), 1e30).bfloat16()
    x[:, ::2] = -1e30
    w, b = torch.ones(64).bfloat16(), torch.full((64,), 0.5).bfloat16()
    y, _, rstd = K._ln_fwd(x, w, b, 1e-5)
    assert torch.isnan(y).all() and torch.isnan(rstd).all()


EPS_VALUES = [float(e) for e in torch.logspace(-6, -1, 10, dtype=torch.float64)]


def _small_rows(seed=5):
    # mean(x^2) ~ 1e-4, inside the eps range: every eps value shows in the results
    g = torch.Generator().manual_seed(seed)
    x, residual = (torch.randn(6, 64, generator=g) * 0.01 for _ in range(2))
    w, b = torch.randn(64, generator=g) * 0.5 + 1, torch.randn(64, generator=g) * 0.2
    return x, residual, w, b


def _assert_matches(got, want):
    for g, r in zip(got, want):
        torch.testing.assert_close(g.double(), r, rtol=2e-5, atol=1e-6)


def test_eps_is_a_runtime_input_one_graph_for_ten_values():
    backend, graphs = _counting()
    c = K.make("default", backend=backend)
    x, residual, w, b = _small_rows()
    rstds = []
    for eps in EPS_VALUES:
        _assert_matches(c.rmsnorm_fwd(x, w, eps), reference.rmsnorm_fwd(x, w, eps))
        _assert_matches(c.layernorm_fwd(x, w, b, eps), reference.layernorm_fwd(x, w, b, eps))
        got = c.add_rmsnorm_fwd(x, residual, w, eps)
        _assert_matches(got, reference.add_rmsnorm_fwd(x, residual, w, eps))
        rstds.append(got[2])
    assert len(graphs) == 3 and len(c._fns) == 3
    assert all(not torch.equal(a, b) for a, b in itertools.pairwise(rstds))  # each call saw its own eps


def test_eps_is_a_runtime_input_under_inductor():
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("inductor")
    c = K.make("default", backend=counter)
    x, _, w, _ = _small_rows(6)
    for eps in EPS_VALUES[::3]:
        _assert_matches(c.rmsnorm_fwd(x, w, eps), reference.rmsnorm_fwd(x, w, eps))
    assert counter.frame_count == 1
