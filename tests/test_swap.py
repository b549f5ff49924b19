"""swap_norms: what it replaces, what it keeps (parameters, state_dict keys, eps, Gemma's 1 + w), and
that everything it leaves alone is listed."""

import copy
import dataclasses
import warnings

import pytest
import torch

from harness.integrate import autograd
from harness.integrate.swap import HF_RMSNORMS, swap_norms
from harness.registry import get
from harness.run.models import build_model, transformers_missing
from harness.spec.tolerances import TOLERANCES

from . import counting_impl

WHY = transformers_missing()
needs_transformers = pytest.mark.skipif(WHY is not None, reason=WHY or "")

# norms in each tiny model (2 layers): per layer, plus the final norm
EXPECTED = {
    "llama": {"LlamaRMSNorm": 2 * 2 + 1},
    "mistral": {"MistralRMSNorm": 2 * 2 + 1},
    "qwen2": {"Qwen2RMSNorm": 2 * 2 + 1},
    "qwen3": {"Qwen3RMSNorm": 2 * 4 + 1},  # + q_norm, k_norm over head_dim
    "gemma3": {"Gemma3RMSNorm": 2 * 6 + 1},  # 4 around attention and MLP, q_norm, k_norm
    "gpt2": {"LayerNorm": 2 * 2 + 1},
}


def _randomize_norm_weights(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or ".ln_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2 + (0 if "gemma" in type(model).__name__.lower() else 1))


@needs_transformers
@pytest.mark.parametrize("arch", list(EXPECTED))
def test_swap_keeps_parameters_keys_and_function(arch):
    model = build_model(arch, "tiny", "cpu", torch.float32, seed=0)
    _randomize_norm_weights(model)
    before = model.state_dict()
    params = dict(model.named_parameters())
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    report = swap_norms(model, "eager")
    assert report.counts() == EXPECTED[arch] and not report.unknown
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(after[k].data_ptr() == before[k].data_ptr() for k in before)  # no copies
    assert all(p is params[n] for n, p in model.named_parameters())  # an optimizer built before still works
    swapped = [m for m in model.modules() if isinstance(m, (autograd.RMSNorm, autograd.LayerNorm))]
    assert len(swapped) == sum(EXPECTED[arch].values())
    with torch.no_grad():
        out = model(input_ids=ids).logits
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    if arch in ("llama", "qwen3", "gemma3"):  # inline residual adds are reported, not fused
        assert len(report.not_fused) == 2 and "residual" in report.not_fused[0]["reason"]


@needs_transformers
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_offset_matches_hf_norm(dtype):
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    hf = Gemma3RMSNorm(96, eps=1e-6)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(96, generator=torch.Generator().manual_seed(1)) * 0.3)
    hf = hf.to(dtype)
    holder = torch.nn.Sequential(hf)
    x = torch.randn(5, 7, 96, generator=torch.Generator().manual_seed(2)).to(dtype)
    ref = hf(x)
    report = swap_norms(holder, "eager")
    new = holder[0]
    assert isinstance(new, autograd.RMSNorm) and new.weight_offset == 1.0 and new.weight is hf.weight
    assert report.swapped[0]["weight_offset"] == 1.0
    out = new(x)
    # both compute (1 + w) * xhat in fp32 and round once: the checker's per-element allowance
    t = TOLERANCES[dtype]
    tol = t.ulps * torch.finfo(dtype).eps + t.rtol
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
    # the parameter is Gemma's (zeros at init mean scale 1), so its gradient is the same too
    out.float().square().sum().backward()
    g_nb = hf.weight.grad.clone()
    hf.weight.grad = None
    Gemma3RMSNorm.forward(hf, x).float().square().sum().backward()
    torch.testing.assert_close(g_nb.float(), hf.weight.grad.float(), rtol=4 * tol, atol=4 * tol * g_nb.float().abs().max().item())


@needs_transformers
def test_eps_carried_from_every_class():
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    model = torch.nn.ModuleDict(
        {
            "llama": LlamaRMSNorm(32, eps=0.25),
            "gemma": Gemma3RMSNorm(32, eps=0.5),
            "rms": torch.nn.RMSNorm(32, eps=0.125),
            "rms_default": torch.nn.RMSNorm(32),
            "ln": torch.nn.LayerNorm(32, eps=0.75, bias=False),
        }
    )
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(0)) * 0.3  # eps comparable to x^2: visible
    refs = {k: m(x) for k, m in model.items()}
    report = swap_norms(model, "eager")
    assert {s["name"]: s["eps"] for s in report.swapped} == {"llama": 0.25, "gemma": 0.5, "rms": 0.125, "rms_default": None, "ln": 0.75}
    assert model["llama"].eps == 0.25 and model["gemma"].eps == 0.5 and model["rms_default"].eps is None
    assert model["ln"].bias is None
    for k, m in model.items():
        torch.testing.assert_close(m(x), refs[k], rtol=1e-5, atol=1e-5)


class FooRMSNorm(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(n))

    def forward(self, x):
        return x


class LlamaRMSNorm(torch.nn.Module):
    """Named like transformers' class, but with a bias its forward would use: not swapped."""

    def __init__(self, n):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(n))
        self.bias = torch.nn.Parameter(torch.zeros(n))
        self.variance_epsilon = 1e-6


def test_unknown_norms_are_listed_and_warned():
    model = torch.nn.ModuleDict(
        {
            "group": torch.nn.GroupNorm(2, 8),
            "foo": FooRMSNorm(8),
            "ln2d": torch.nn.LayerNorm((4, 8)),
            "fake_llama": LlamaRMSNorm(8),
            "ok": torch.nn.LayerNorm(8),
        }
    )
    with pytest.warns(UserWarning, match="left these norms as they were"):
        report = swap_norms(model, "eager")
    unknown = {u["name"]: u for u in report.unknown}
    assert set(unknown) == {"group", "foo", "ln2d", "fake_llama"}
    assert "last" in unknown["ln2d"]["reason"] and "structure" in unknown["fake_llama"]["reason"]
    assert [s["name"] for s in report.swapped] == ["ok"] and isinstance(model["ok"], autograd.LayerNorm)
    assert type(model["fake_llama"]) is LlamaRMSNorm and "LlamaRMSNorm" in HF_RMSNORMS


def test_op_the_implementation_lacks_is_listed():
    from harness.registry import all_implementations

    ln_only = next((i for i in all_implementations().values() if i.ops == ("layernorm",) and i.available("cpu")), None)
    if ln_only is None:
        pytest.skip("no LayerNorm-only implementation runs here")
    model = torch.nn.Sequential(torch.nn.RMSNorm(8), torch.nn.LayerNorm(8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = swap_norms(model, ln_only)
    assert [s["name"] for s in report.swapped] == ["1"]
    assert report.unknown == [{"name": "0", "class": "RMSNorm", "reason": f"'{ln_only.name}' does not provide rmsnorm"}]


def test_reswap_changes_the_implementation_and_bad_input_is_refused():
    model = torch.nn.Sequential(torch.nn.RMSNorm(8))
    swap_norms(model, "eager")
    first = model[0]
    report = swap_norms(model, get("eager"))
    assert model[0] is first and report.counts() == {"RMSNorm": 1}
    with pytest.raises(TypeError, match="torch.nn.Module"):
        swap_norms("not a model")
    with pytest.raises(ValueError, match="unknown implementation"):
        swap_norms(model, "no-such-impl")
    with pytest.raises(TypeError, match="implementation name or record"):
        swap_norms(model, 3)


def _normbench_norms(impl="eager"):
    return torch.nn.ModuleDict(
        {
            "rms": autograd.RMSNorm(8, impl=impl),
            "ln": autograd.LayerNorm(8, impl=impl),
            "add": autograd.AddRMSNorm(8, impl=impl),
        }
    )


def _run_counted(model, x):
    counting_impl.CALLS.clear()
    out = [model["rms"](x), model["ln"](x), model["add"](x, x.flip(0))[0]]
    return dict(counting_impl.CALLS), out


def test_reswap_runs_the_new_kernels_as_a_copy_does():
    """Swapping normbench norms replaces the kernels they run, not only the name they report: the
    module and a deepcopy of it run the same kernels and agree."""
    model = _normbench_norms()
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    report = swap_norms(model, counting_impl.RECORD)
    assert [s["op"] for s in report.swapped] == ["rmsnorm", "layernorm", "add_rmsnorm"]
    assert all(f"impl={counting_impl.RECORD.name}" in repr(m) for m in model.values())
    every = {"rmsnorm_fwd": 1, "layernorm_fwd": 1, "add_rmsnorm_fwd": 1}
    calls, out = _run_counted(model, x)
    calls_copy, out_copy = _run_counted(copy.deepcopy(model), x)
    assert calls == calls_copy == every
    for a, b in zip(out, out_copy):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    swap_norms(model, "eager")
    assert _run_counted(model, x)[0] == {}


def test_add_rmsnorm_swap_to_an_implementation_without_it_is_refused():
    without = dataclasses.replace(counting_impl.RECORD, name="test-no-add-rmsnorm", ops=("rmsnorm", "layernorm"))
    model = _normbench_norms(counting_impl.RECORD)
    with pytest.raises(ValueError, match="'add'.*'test-no-add-rmsnorm' does not provide add_rmsnorm"):
        swap_norms(model, without)
    assert all(m.impl is counting_impl.RECORD for m in model.values())  # nothing changed
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    assert _run_counted(model, x)[0] == {"rmsnorm_fwd": 1, "layernorm_fwd": 1, "add_rmsnorm_fwd": 1}
