"""torch.compile entries: one static-shape compiled copy per function and argument layout, never a
global dynamo reset (which would throw away the user's own compiled functions). A counting backend
stands in for Inductor, so dynamo's bookkeeping is tested without paying for code generation."""

import torch

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
