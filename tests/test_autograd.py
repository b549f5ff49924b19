"""The autograd functions and modules: double backward, normalized_shape, fp32 parameters beside
16-bit activations, weight_offset, and add_rmsnorm / AddRMSNorm, against the fp64 reference."""

import pytest
import torch

from harness.spec import reference
from harness.integrate.autograd import AddRMSNorm, LayerNorm, RMSNorm, add_rmsnorm, layernorm, rmsnorm
from harness.run.checker import compare

from . import counting_impl
from .conftest import DEVICE, known_failure_marks
from .test_custom_ops import runnable

EPS = 1e-5


def draw(dtype=torch.bfloat16, param_dtype=None, m=6, n=64, seed=0):
    """x, residual, dy, dresidual_out, weight, bias: fresh seeded tensors (rows at varied scales)."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randn(m, n, generator=g) * torch.logspace(-1, 1, m).unsqueeze(1) for _ in range(4)]
    params = [torch.randn(n, generator=g) * 0.5 + 1, torch.randn(n, generator=g) * 0.2]
    return [t.to(DEVICE, dtype) for t in rows] + [t.to(DEVICE, param_dtype or dtype) for t in params]


def call(op, impl, x, residual, w, b, weight_offset=0.0):
    """The differentiable function of ``op``: its outputs (y, and residual_out for add_rmsnorm)."""
    if op == "rmsnorm":
        return (rmsnorm(x, w, EPS, impl, weight_offset),)
    if op == "layernorm":
        return (layernorm(x, w, b, EPS, impl, weight_offset),)
    return add_rmsnorm(x, residual, w, EPS, impl, weight_offset)


def expected(op, x, residual, dy, dres, w_eff, b):
    """fp64 reference outputs and input gradients {name: tensor}, and the term scale of each
    gradient that cancels (the tolerance floor, as harness.run.checker takes it)."""
    if op == "add_rmsnorm":
        y, h, rstd = reference.add_rmsnorm_fwd(x, residual, w_eff, EPS)
        dh, dw = reference.add_rmsnorm_bwd(dy, dres, h, w_eff, rstd)
        ref = {"y": y, "residual_out": h, "dx": dh, "dresidual": dh, "dweight": dw}
        xhat = h * rstd.unsqueeze(-1)
    elif op == "rmsnorm":
        y, rstd = reference.rmsnorm_fwd(x, w_eff, EPS)
        dx, dw = reference.rmsnorm_bwd(dy, x, w_eff, rstd)
        ref = {"y": y, "dx": dx, "dweight": dw}
        xhat = x.double() * rstd.unsqueeze(-1)
    else:
        y, mean, rstd = reference.layernorm_fwd(x, w_eff, b, EPS)
        dx, dw, db = reference.layernorm_bwd(dy, x, w_eff, mean, rstd)
        ref = {"y": y, "dx": dx, "dweight": dw, "dbias": db}
        xhat = (x.double() - mean.unsqueeze(-1)) * rstd.unsqueeze(-1)
    dy64 = dy.double()
    dx_terms = (dy64 * w_eff.double() * rstd.unsqueeze(-1)).abs()
    scales = {
        "dx": dx_terms,
        "dresidual": dx_terms,
        "dweight": (dy64 * xhat).square().sum(0).sqrt(),
        "dbias": dy64.square().sum(0).sqrt(),
    }
    return ref, scales


def check_against_reference(op, impl, dtype, param_dtype=None, weight_offset=0.0, use_residual_out=True):
    x, residual, dy, dres, w, b = draw(dtype, param_dtype)
    leaves = {"x": x, "residual": residual, "weight": w, "bias": b}
    for t in leaves.values():
        t.requires_grad_(True)
    outs = call(op, impl, x, residual, w, b, weight_offset)
    if op != "add_rmsnorm" or not use_residual_out:
        dres = None
    torch.autograd.backward(outs[:1] if dres is None else outs, (dy,) if dres is None else (dy, dres))
    got = {"y": outs[0], "dx": x.grad, "dweight": w.grad}
    if op == "add_rmsnorm":
        got.update(residual_out=outs[1], dresidual=residual.grad)
    if op == "layernorm":
        got["dbias"] = b.grad
    w_eff = w.detach().double() + weight_offset
    ref, scales = expected(
        op, x.detach(), residual.detach(), dy, dres, w_eff, b.detach() if op == "layernorm" else None
    )
    failures = []
    for name, r in ref.items():
        out = got[name]
        if name in ("dweight", "dbias"):
            # Returned in the parameter's dtype; checked to x's precision: whether a kernel reduces
            # dweight beside an fp32 weight to fp32 precision is the kernel checker's business
            # (harness.run.checker), the plumbing of the gradient is this test's.
            want = (w if name == "dweight" else b).dtype
            assert out.dtype == want, f"{name} is {out.dtype}, the parameter {want}"
            out = out.to(x.dtype)
        scale, rounded = scales.get(name), None
        if name in ("dx", "dresidual") and op == "add_rmsnorm" and dres is not None:
            # as the checker allows: the unfused pair rounds the norm's dx before adding dresidual_out
            scale, rounded = scale + dres.double().abs(), r - dres.double()
        rep = compare(name, out, r, x.dtype, r.shape, scale, rounded_term=rounded)
        if not rep.passed:
            failures.append(f"{name}: {rep.reason}")
    assert not failures, "\n".join(failures)


# these tests check the autograd functions (which cast a gradient to its parameter's dtype): an entry
# about the contract functions alone does not apply to them
CHECKS = "autograd"


def cases(ops=("rmsnorm", "layernorm", "add_rmsnorm"), **runs):
    """(implementation, op) pairs, each marked with the known failures that fall inside ``runs``
    (the dtype, weights and kind of check the test runs: see conftest.known_failure_marks)."""
    for p in runnable():
        impl = p.values[0]
        for op in ops:
            if op in impl.ops:
                yield pytest.param(impl, op, marks=[*p.marks, *known_failure_marks(impl, op, **runs)], id=f"{impl.name}-{op}")


@pytest.mark.parametrize("impl,op", list(cases(dtype="fp32", inputs="drawn", device=DEVICE)))
def test_double_backward_is_a_clear_error(impl, op):
    x, residual, dy, _, w, b = draw(torch.float32)
    x.requires_grad_(True)
    w.requires_grad_(True)
    (y, *_) = call(op, impl, x, residual, w, b)
    dx, _ = torch.autograd.grad(y, (x, w), dy, create_graph=True)
    assert dx.requires_grad  # create_graph=True itself works; a second derivative does not
    with pytest.raises(NotImplementedError, match="double backward .* not supported"):
        torch.autograd.grad((dx * dy).sum(), x)


@pytest.mark.parametrize("impl,op", list(cases(dtype="bf16", weights="fp32", inputs="drawn", device=DEVICE, check=CHECKS)))
def test_fp32_parameters_with_bf16_activations(impl, op):
    check_against_reference(op, impl, torch.bfloat16, param_dtype=torch.float32)


@pytest.mark.parametrize("impl,op", list(cases(dtype="bf16", weights="offset", inputs="drawn", device=DEVICE, check=CHECKS)))
@pytest.mark.parametrize("param_dtype", [None, torch.float32], ids=["w-bf16", "w-fp32"])
def test_weight_offset_against_fp64_reference(impl, op, param_dtype):
    check_against_reference(op, impl, torch.bfloat16, param_dtype=param_dtype, weight_offset=1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("use_residual_out", [True, False], ids=["residual-used", "residual-unused"])
def test_add_rmsnorm_against_fp64_reference(dtype, use_residual_out):
    check_against_reference("add_rmsnorm", counting_impl.RECORD, dtype, use_residual_out=use_residual_out)


def test_modules_keep_x_dtype_with_fp32_parameters():
    x = draw(torch.bfloat16)[0].requires_grad_(True)
    fused = AddRMSNorm(64, dtype=torch.float32, impl=counting_impl.RECORD)
    for m in (RMSNorm(64, dtype=torch.float32), LayerNorm(64, dtype=torch.float32), fused):
        m.to(DEVICE)
        y = m(x) if not isinstance(m, AddRMSNorm) else m(x, x.detach())[0]
        y.sum().backward()
        assert y.dtype == torch.bfloat16 and m.weight.grad.dtype == torch.float32
    with torch.autocast(DEVICE, dtype=torch.bfloat16):  # torch's norms would give fp32 here
        assert RMSNorm(64).to(DEVICE)(x).dtype == torch.bfloat16


@pytest.mark.parametrize("cls", [RMSNorm, LayerNorm, AddRMSNorm])
@pytest.mark.parametrize("affine", [False, True])
def test_normalized_shape_is_enforced(cls, affine):
    m = cls(4096, elementwise_affine=affine, impl=counting_impl.RECORD)
    x = torch.randn(2, 32)
    with pytest.raises(ValueError, match="last dimension of 4096"):
        m(x) if cls is not AddRMSNorm else m(x, x)
    ref = (
        torch.nn.RMSNorm(4096, elementwise_affine=affine)
        if cls is not LayerNorm
        else torch.nn.LayerNorm(4096, elementwise_affine=affine)
    )
    with pytest.raises(RuntimeError):  # as torch.nn refuses it
        ref(x)


def test_add_rmsnorm_module_replaces_rmsnorm():
    norm = RMSNorm(64, eps=1e-6, weight_offset=1.0)
    torch.nn.init.normal_(norm.weight)
    fused = AddRMSNorm.from_rmsnorm(norm, impl=counting_impl.RECORD)
    assert fused.weight is norm.weight and fused.eps == norm.eps and fused.weight_offset == 1.0
    assert fused.state_dict().keys() == norm.state_dict().keys() == torch.nn.RMSNorm(64).state_dict().keys()
    x, r = torch.randn(3, 64), torch.randn(3, 64)
    y, h = fused(x, r)
    torch.testing.assert_close(h, x + r)
    torch.testing.assert_close(y, norm(x + r))
    y, h = AddRMSNorm.from_rmsnorm(torch.nn.RMSNorm(64, elementwise_affine=False), impl=counting_impl.RECORD)(x, r)
    torch.testing.assert_close(y, torch.nn.functional.rms_norm(x + r, (64,)))


def test_bad_arguments_are_clear_errors():
    x = torch.randn(3, 64)
    with pytest.raises(TypeError, match="eps"):
        rmsnorm(x, None, "1e-5")
    with pytest.raises(TypeError, match="weight_offset"):
        RMSNorm(64, weight_offset="1")
    with pytest.raises(ValueError, match="weight_offset"):
        RMSNorm(64, elementwise_affine=False, weight_offset=1.0)
    with pytest.raises(ValueError, match="does not provide add_rmsnorm"):
        AddRMSNorm(64, impl="triton-layernorm-claude-20261122-1")
    with pytest.raises(ValueError, match="residual"):
        add_rmsnorm(x, x[:2], None, EPS, counting_impl.RECORD)
    with pytest.raises(TypeError, match="impl"):
        rmsnorm(x, None, EPS, impl=3)


def test_modules_deepcopy_and_pickle_with_their_implementation():
    import copy
    import io

    m = torch.nn.Sequential(RMSNorm(64, impl=counting_impl.RECORD), LayerNorm(64, weight_offset=1.0))
    x = torch.randn(3, 64)
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    for other in (copy.deepcopy(m), torch.load(buf, weights_only=False)):
        assert other[0].impl == counting_impl.RECORD and other[0]._ops is m[0]._ops
        assert other[1].weight is not m[1].weight
        counting_impl.CALLS.clear()
        torch.testing.assert_close(other(x), m(x))
        assert counting_impl.CALLS["rmsnorm_fwd"] == 2


@pytest.mark.parametrize("impl,op", list(cases(("layernorm",), dtype="bf16", inputs="drawn", device=DEVICE)))
def test_layernorm_fp32_bias_without_weight_gets_an_fp32_dbias(impl, op):
    """No weight, an fp32 bias beside bf16 x: dbias comes back fp32, as the kernels give it beside an
    fp32 weight of ones, and within the fp32 tolerance where they reduce it to fp32 there (a dbias
    rounded through bf16 is off by ~2^-9 of its size, far past it); y and dx as without a bias."""
    g = torch.Generator().manual_seed(7)
    rows = torch.logspace(-1, 1, 64).unsqueeze(1)
    x, dy = ((torch.randn(64, 64, generator=g) * rows).to(DEVICE, torch.bfloat16) for _ in range(2))
    bias = (torch.randn(64, generator=g) * 0.2).to(DEVICE)
    dbias = {}
    for weight in (None, torch.ones(64, device=DEVICE)):
        xl, b = x.clone().requires_grad_(True), bias.clone().requires_grad_(True)
        y = layernorm(xl, weight, b, EPS, impl)
        y.backward(dy)
        assert b.grad.dtype == torch.float32
        dbias["none" if weight is None else "ones"] = b.grad
    ref_db = dy.double().sum(0)
    scale = dy.double().square().sum(0).sqrt()
    torch.testing.assert_close(dbias["none"], dbias["ones"], rtol=1e-5, atol=1e-5 * float(scale.max()))
    if compare("dbias", dbias["ones"], ref_db, torch.float32, ref_db.shape, scale).passed:
        # (else the kernels round dbias to x's dtype beside an fp32 weight too: theirs to fix, and
        # the kernel checker's to report)
        rep = compare("dbias", dbias["none"], ref_db, torch.float32, ref_db.shape, scale)
        assert rep.passed, rep.reason
    ref_y, mean, rstd = reference.layernorm_fwd(x, None, bias, EPS)
    ref_dx = reference.layernorm_bwd(dy, x, None, mean, rstd)[0]
    assert compare("y", y, ref_y, torch.bfloat16, ref_y.shape).passed
    dx_terms = (dy.double() * rstd.unsqueeze(-1)).abs()
    assert compare("dx", xl.grad, ref_dx, torch.bfloat16, ref_dx.shape, dx_terms).passed


def test_from_rmsnorm_keeps_the_implementation():
    norm = RMSNorm(64, impl=counting_impl.RECORD, weight_offset=1.0)
    fused = AddRMSNorm.from_rmsnorm(norm)
    assert fused.impl is counting_impl.RECORD and fused.weight_offset == 1.0
    x, r = draw(torch.float32)[:2]
    counting_impl.CALLS.clear()
    fused(x, r)
    assert counting_impl.CALLS == {"add_rmsnorm_fwd": 1}
    assert AddRMSNorm.from_rmsnorm(norm, impl="eager").impl.name == "eager"  # unless told otherwise
    assert AddRMSNorm.from_rmsnorm(torch.nn.RMSNorm(64)).impl.name == "eager"


# ---------------------------------------------------------------- torch.func
OPS3 = ("rmsnorm", "layernorm", "add_rmsnorm")
FUNC_IMPLS = [pytest.param(counting_impl.RECORD, id="counting"), pytest.param("eager", id="eager")]


def _zeros_for_none(grads, like):
    return [torch.zeros_like(t) if g is None else g for g, t in zip(grads, like)]


@pytest.mark.parametrize("impl", FUNC_IMPLS)
@pytest.mark.parametrize("op", OPS3)
def test_torch_func_grad_matches_autograd(op, impl):
    x, residual, dy, _, w, b = draw(torch.float32)

    def loss(x, residual, w, b):
        return (call(op, impl, x, residual, w, b)[0] * dy).sum()

    got = torch.func.grad(loss, argnums=(0, 1, 2, 3))(x, residual, w, b)
    leaves = [t.clone().requires_grad_(True) for t in (x, residual, w, b)]
    want = _zeros_for_none(torch.autograd.grad(loss(*leaves), leaves, allow_unused=True), leaves)
    for g, ref in zip(got, want):
        torch.testing.assert_close(g, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("batched_params", [False, True], ids=["shared-params", "batched-params"])
@pytest.mark.parametrize("impl", FUNC_IMPLS)
@pytest.mark.parametrize("op", OPS3)
def test_torch_func_vmap_matches_a_loop(op, impl, batched_params):
    cases = [draw(torch.float32, seed=s) for s in range(4)]
    xs, rs = (torch.stack([c[i] for c in cases]) for i in (0, 1))
    w, b = cases[0][4], cases[0][5]
    ws, bs = (torch.stack([c[i] for c in cases]) for i in (4, 5)) if batched_params else (w, b)
    p_dim = 0 if batched_params else None

    def f(x, residual, w, b):
        return call(op, impl, x, residual, w, b)

    got = torch.func.vmap(f, in_dims=(0, 0, p_dim, p_dim))(xs, rs, ws, bs)
    for i in range(len(cases)):
        want = f(xs[i], rs[i], ws[i] if batched_params else w, bs[i] if batched_params else b)
        for g, ref in zip(got, want):
            torch.testing.assert_close(g[i], ref, rtol=0, atol=0)


@pytest.mark.parametrize("impl", FUNC_IMPLS)
@pytest.mark.parametrize("op", OPS3)
def test_per_sample_gradients_vmap_of_grad(op, impl):
    cases = [draw(torch.float32, seed=s) for s in range(3)]
    xs, rs, dys = (torch.stack([c[i] for c in cases]) for i in (0, 1, 2))
    w, b = cases[0][4], cases[0][5]

    def loss(w, b, x, residual, dy):
        return (call(op, impl, x, residual, w, b)[0] * dy).sum()

    got = torch.func.vmap(torch.func.grad(loss, argnums=(0, 1)), in_dims=(None, None, 0, 0, 0))(w, b, xs, rs, dys)
    for i in range(len(cases)):
        leaves = [w.clone().requires_grad_(True), b.clone().requires_grad_(True)]
        want = _zeros_for_none(
            torch.autograd.grad(loss(*leaves, xs[i], rs[i], dys[i]), leaves, allow_unused=True), leaves
        )
        for g, ref in zip(got, want):
            torch.testing.assert_close(g[i], ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", FUNC_IMPLS)
@pytest.mark.parametrize("op", OPS3)
def test_torch_func_jvp_is_a_clear_error(op, impl):
    x, residual, _, _, w, b = draw(torch.float32)
    with pytest.raises(NotImplementedError, match=r"torch\.func\.jvp .* not supported.* Use torch\.func\.vjp"):
        torch.func.jvp(lambda x: call(op, impl, x, residual, w, b)[0], (x,), (torch.ones_like(x),))


def test_torch_func_grad_over_a_module():
    m = LayerNorm(64, impl=counting_impl.RECORD)
    x, _, dy = draw(torch.float32)[:3]
    params = {k: v.detach() for k, v in m.named_parameters()}
    got = torch.func.grad(lambda p: (torch.func.functional_call(m, p, (x,)) * dy).sum())(params)
    (m(x) * dy).sum().backward()
    for k, p in m.named_parameters():
        torch.testing.assert_close(got[k], p.grad, rtol=1e-5, atol=1e-5)
