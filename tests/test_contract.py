"""Bad input at the public entry points, M = 0, and the nn.Module drop-ins."""

import pytest
import torch

from harness import get
from harness.integrate.autograd import LayerNorm, RMSNorm, layernorm, rmsnorm
from harness.spec.contract import Implementation

K = get("eager").kernels("cpu")


def x_w(m=4, n=16, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    return torch.randn(m, n, generator=g).to(dtype), torch.randn(n, generator=g).to(dtype)


@pytest.mark.parametrize(
    "call,exc,match",
    [
        (lambda x, w: K.rmsnorm_fwd(x, w[:-1], 1e-5), ValueError, "shape"),
        (lambda x, w: K.rmsnorm_fwd(x.to(torch.int32), w, 1e-5), TypeError, "floating"),
        (lambda x, w: K.rmsnorm_fwd(x, w.double(), 1e-5), TypeError, "dtype"),
        (lambda x, w: K.rmsnorm_fwd(x, w, "1e-5"), TypeError, "eps"),
        (lambda x, w: K.rmsnorm_fwd(x, w, -1.0), ValueError, "eps"),
        (lambda x, w: K.rmsnorm_fwd(x[:, :0], w[:0], 1e-5), ValueError, "N = 0"),
        (lambda x, w: K.rmsnorm_fwd(x.tolist(), w, 1e-5), TypeError, "Tensor"),
        (lambda x, w: K.rmsnorm_fwd(torch.tensor(1.0), w, 1e-5), ValueError, "dimension"),
        (lambda x, w: K.layernorm_fwd(x, w, w[:3], 1e-5), ValueError, "bias"),
        (lambda x, w: K.rmsnorm_bwd(x[:2], x, w, torch.ones(4)), ValueError, "dy"),
        (lambda x, w: K.rmsnorm_bwd(x, x, w, torch.ones(3)), ValueError, "rstd"),
        (lambda x, w: K.rmsnorm_bwd(x, x, w, torch.ones(4, dtype=torch.float64)), TypeError, "float32"),
        (lambda x, w: K.layernorm_bwd(x, x, w, torch.ones(4), torch.ones(4, 2)), ValueError, "rstd"),
        (lambda x, w: K.rmsnorm_fwd(x, w.to("meta"), 1e-5), ValueError, "weight is on meta"),
    ],
)
def test_bad_input_is_a_clear_error(call, exc, match):
    x, w = x_w()
    with pytest.raises(exc, match=match):
        call(x, w)


def test_cpu_tensors_to_a_cuda_only_implementation():
    impl = Implementation(name="cuda-only", dsl="eager", entry="impls.eager.kernels", devices=("cuda",))
    with pytest.raises(ValueError, match="cannot run on cpu"):
        impl.kernels("cpu")


def test_unknown_implementation():
    with pytest.raises(ValueError, match="unknown implementation 'nope'.*eager"):
        get("nope")
    with pytest.raises(ValueError, match="unknown implementation"):
        RMSNorm(16, impl="nope")


def test_m_zero_returns_empty_outputs():
    x, w = x_w()
    e = x[:0]
    y, rstd = K.rmsnorm_fwd(e, w, 1e-5)
    assert y.shape == (0, 16) and rstd.shape == (0,) and rstd.dtype == torch.float32
    dx, dw = K.rmsnorm_bwd(e, e, w, rstd)
    assert dx.shape == (0, 16) and torch.equal(dw, torch.zeros_like(w))
    y3, mean, rstd3 = K.layernorm_fwd(torch.empty(2, 0, 16, dtype=x.dtype), w, w, 1e-5)
    assert y3.shape == (2, 0, 16) and mean.shape == (2, 0)


def test_leading_dims_and_strided_rows_round_trip():
    x, w = x_w(12, 40)
    x3 = x.reshape(3, 4, 40)
    y3, rstd3 = K.rmsnorm_fwd(x3, w, 1e-5)
    y2, rstd2 = K.rmsnorm_fwd(x, w, 1e-5)
    assert y3.shape == (3, 4, 40) and rstd3.shape == (3, 4)
    assert torch.equal(y3.reshape(12, 40), y2)
    wide = torch.randn(12, 64).to(x.dtype)
    ys, _ = K.rmsnorm_fwd(wide[:, :40], w, 1e-5)
    yc, _ = K.rmsnorm_fwd(wide[:, :40].contiguous(), w, 1e-5)
    assert torch.equal(ys, yc)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_modules_are_drop_ins_for_torch_nn(dtype):
    ref = torch.nn.RMSNorm(32, eps=1e-6, dtype=dtype)
    torch.nn.init.normal_(ref.weight)
    mine = RMSNorm(32, eps=1e-6, dtype=dtype)
    mine.load_state_dict(ref.state_dict())
    assert isinstance(mine, torch.nn.RMSNorm) and mine.state_dict().keys() == ref.state_dict().keys()
    x = torch.randn(2, 5, 32, dtype=dtype, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    y, y2 = mine(x), ref(x2)
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(y, y2, **tol)
    g = torch.randn_like(y)
    y.backward(g)
    y2.backward(g)
    torch.testing.assert_close(x.grad, x2.grad, **tol)
    torch.testing.assert_close(mine.weight.grad, ref.weight.grad, **tol)

    lref = torch.nn.LayerNorm(32, bias=False, dtype=dtype)
    lmine = LayerNorm(32, bias=False, dtype=dtype)
    lmine.load_state_dict(lref.state_dict())
    assert lmine.bias is None and lmine.state_dict().keys() == lref.state_dict().keys()
    torch.testing.assert_close(lmine(x.detach()), lref(x.detach()), **tol)


def test_no_affine_module_and_functional_gradients():
    m = LayerNorm(16, elementwise_affine=False)
    x = torch.randn(3, 16, requires_grad=True)
    m(x).pow(2).sum().backward()
    x2 = x.detach().clone().requires_grad_(True)
    torch.nn.functional.layer_norm(x2, (16,)).pow(2).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, atol=1e-5, rtol=1e-5)
    w = torch.randn(16, requires_grad=True)
    b = torch.randn(16, requires_grad=True)
    layernorm(x.detach(), w, b, 1e-5).sum().backward()
    torch.testing.assert_close(b.grad, torch.full((16,), 3.0))
    rmsnorm(x.detach(), w, 1e-5).sum().backward()


def test_module_rejects_multi_dim_normalized_shape():
    with pytest.raises(ValueError, match="last dimension"):
        RMSNorm((4, 8))
