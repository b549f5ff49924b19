"""The custom ops (harness.integrate.library): torch.library.opcheck for every implementation that runs here,
torch.compile(fullgraph=True) of a model holding each implementation's modules, which kernels a
compiled model calls, CUDA-graph capture (GPU), and process-wide side effects (subprocess)."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from harness.integrate.autograd import AddRMSNorm, LayerNorm, RMSNorm, norm_ops
from harness.registry import all_implementations
from harness.spec.ops import get_op

from . import counting_impl
from .conftest import DEVICE

ROOT = Path(__file__).parent.parent


@pytest.fixture
def fresh_dynamo():
    """Every test compiles new module instances of one code object (Sequential.forward): start from
    an empty cache so they never reach dynamo's recompile limit."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def cheaply(impl, ops):
    """On the CPU a costly implementation (torch.compile compiles each op, an interpreter runs each
    program) is checked on the first of ``ops`` (op, or weight) only."""
    return ops[:1] if DEVICE == "cpu" and impl.cpu_cost == "costly" else ops


def runnable(device=DEVICE):
    """Every implementation that runs on ``device`` here (first-shot LLM output that needed fixes
    excluded: its failures are a result, not a regression), and the test-only counting one."""
    out = [pytest.param(counting_impl.RECORD, id=counting_impl.RECORD.name)]
    for impl in sorted(all_implementations().values(), key=lambda i: i.name):
        if impl.meta.get("variant") == "first-shot" and impl.meta.get("has_fixes"):
            continue
        marks = (
            [pytest.mark.skip(reason=f"{impl.name}: {impl.unavailable(device)}")] if not impl.available(device) else []
        )
        out.append(pytest.param(impl, marks=marks, id=impl.name))
    return out


def tiny(dtype=torch.bfloat16, param_dtype=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 64, generator=g).to(DEVICE, dtype)
    w = (torch.randn(64, generator=g) * 0.5 + 1).to(DEVICE, param_dtype or dtype)
    b = (torch.randn(64, generator=g) * 0.2).to(DEVICE, param_dtype or dtype)
    return x, w, b


@pytest.mark.parametrize("impl", runnable())
def test_opcheck(impl):
    """Schema, fake (meta) function, autograd registration and AOT dispatch of every op, forward with
    inputs that require grad, backward with and without a weight; fp32 parameters for LayerNorm."""
    ops = norm_ops(impl)
    for op in cheaply(impl, impl.ops):
        if not get_op(op).offers("bwd"):  # the FP8 ops: a forward op, no autograd
            opcheck_fp8(ops, op)
            continue
        x, w, b = tiny(param_dtype=torch.float32 if op == "layernorm" else None)
        fwd_args = {
            "rmsnorm": (x, w, 1e-5),
            "layernorm": (x, w, b, 1e-5),
            "add_rmsnorm": (x, x.flip(0).clone(), w, 1e-5),
        }[op]
        out = getattr(ops, f"{op}_fwd")(*fwd_args)
        leaves = tuple(t.clone().requires_grad_() if isinstance(t, torch.Tensor) else t for t in fwd_args)
        torch.library.opcheck(getattr(ops, f"{op}_fwd"), leaves)
        saved, stats = (out[1], out[2:]) if op == "add_rmsnorm" else (x, out[1:])
        dy = torch.randn_like(x)
        grads = (dy, dy.flip(0).clone()) if op == "add_rmsnorm" else (dy,)
        for weight in cheaply(impl, (w, None)):
            torch.library.opcheck(getattr(ops, f"{op}_bwd"), (*grads, saved, weight, *stats))


def opcheck_fp8(ops, op):
    """An FP8 op's forward op: schema, fake function (q float8_e4m3fn, scale (M, N / group)) and
    dispatch, on bf16 x with fp32 weights, and its outputs' form."""
    rec = get_op(op)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 256, generator=g).to(DEVICE, torch.bfloat16)
    w = (torch.rand(256, generator=g) + 0.5).to(DEVICE)
    group = rec.group_of(x.shape[-1])
    args = (x, x.flip(0).clone(), w, 1e-5, group) if "residual" in rec.inputs else (x, w, 1e-5, group)
    fn = getattr(ops, rec.function("fwd"))
    q, scale, *_ = fn(*args)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and scale.shape == (3, 256 // group)
    torch.library.opcheck(fn, args)


def model_for(impl, seed=0):
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(64, 64)]
    if "rmsnorm" in impl.ops:
        layers += [RMSNorm(64, impl=impl), torch.nn.Linear(64, 64)]
    if "layernorm" in impl.ops:
        layers += [LayerNorm(64, impl=impl)]
    return torch.nn.Sequential(*layers).to(DEVICE)


def fwd_bwd(model, x, dy):
    x = x.detach().clone().requires_grad_(True)
    model.zero_grad(set_to_none=True)
    y = model(x)
    y.backward(dy)
    return [y, x.grad] + [p.grad for p in model.parameters()]


def assert_all_close(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


def eager_matches_compiled(fn, inputs, params=()):
    """fn's output and the gradients of its inputs and params, run eagerly and compiled with
    fullgraph=True, agree (the loss weighs the output with seeded random numbers)."""
    results = []
    for f in (fn, torch.compile(fn, fullgraph=True)):
        leaves = [t.clone().requires_grad_() for t in inputs]
        for p in params:
            p.grad = None
        out = f(*leaves)
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.device)
        (out * weights).sum().backward()
        results.append([out, *(t.grad for t in leaves), *(p.grad for p in params)])
    assert_all_close(*results)


@pytest.mark.parametrize("impl", runnable())
def test_compiled_model_fullgraph_matches_eager(impl, fresh_dynamo):
    model = model_for(impl)
    eager_matches_compiled(model, [torch.randn(3, 64, device=DEVICE)], list(model.parameters()))


def test_compiled_model_calls_the_chosen_implementation(fresh_dynamo):
    """The graph holds the chosen implementation's ops (opaque: dynamo never traces its kernels), and
    running the compiled model calls its contract functions, forward and backward."""
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("inductor")
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 64), RMSNorm(64, impl=counting_impl.RECORD), LayerNorm(64, impl="eager")
    ).to(DEVICE)
    compiled = torch.compile(model, fullgraph=True, backend=counter)
    x, dy = torch.randn(3, 64, device=DEVICE), torch.randn(3, 64, device=DEVICE)
    fwd_bwd(compiled, x, dy)  # compiles
    counting_impl.CALLS.clear()
    got = fwd_bwd(compiled, x, dy)
    assert counting_impl.CALLS == {"rmsnorm_fwd": 1, "rmsnorm_bwd": 1}
    assert counter.frame_count == 1
    graph = counter.graphs[0].code
    prefix = norm_ops(counting_impl.RECORD).prefix
    assert f"normbench.{prefix}_rmsnorm_fwd" in graph and "normbench.eager_layernorm_fwd" in graph
    assert_all_close(got, fwd_bwd(model, x, dy))


def test_compiled_add_rmsnorm_residual_stream(fresh_dynamo):
    norm = AddRMSNorm(64, impl=counting_impl.RECORD).to(DEVICE)
    lin = torch.nn.Linear(64, 64).to(DEVICE)

    def block(x, residual):
        y, h = norm(lin(x), residual)
        return y * h  # both outputs used: dresidual_out is not None

    eager_matches_compiled(block, [torch.randn(3, 64, device=DEVICE), torch.randn(3, 64, device=DEVICE)], [norm.weight])


@pytest.mark.gpu
@pytest.mark.parametrize("impl", runnable("cuda"))
def test_cuda_graph_capture_of_forward_and_backward(impl):
    model = model_for(impl)
    x = torch.randn(8, 64, device="cuda", requires_grad=True)
    dy = torch.randn(8, 64, device="cuda")

    def step():
        model.zero_grad(set_to_none=False)
        x.grad = None
        y = model(x)
        y.backward(dy)
        return y

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    model.zero_grad(set_to_none=True)  # gradients allocated (not accumulated) inside the capture
    x.grad = None
    with torch.cuda.graph(graph):
        y = model(x)
        y.backward(dy)
    with torch.no_grad():
        x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert_all_close([y, x.grad] + [p.grad for p in model.parameters()], fwd_bwd(model_for(impl), x, dy))


SIDE_EFFECTS = """
import os
os.environ.pop("TRITON_INTERPRET", None)
os.environ.pop("HELION_INTERPRET", None)
import torch
from harness import get
from harness.integrate.autograd import RMSNorm
from harness.run.checker import run_check
from harness.spec.shapes import SHAPE_SETS

# a model holding a Helion module, compiled with fullgraph=True: dynamo must not trace Helion
model = torch.nn.Sequential(torch.nn.Linear(64, 64), RMSNorm(64, impl="helion"))
x = torch.randn(3, 64, requires_grad=True)
torch.compile(model, fullgraph=True, backend="eager")(x).sum().backward()
# then Helion directly, then Triton (Helion was used first)
for name in ("helion", "triton"):
    for direction in ("fwd", "bwd"):
        r = run_check(get(name), "rmsnorm", direction, SHAPE_SETS["edge"][5], "bf16", "cpu")
        print(name, direction, r.status, r.summary())
"""


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU interpreters' process-wide state")
def test_helion_first_then_compile_then_triton_in_one_process():
    for name in ("helion", "triton"):
        why = all_implementations()[name].unavailable("cpu")
        if why and "imported before" not in why:
            pytest.skip(f"{name}: {why}")
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("TRITON_INTERPRET", "HELION_INTERPRET")}
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SIDE_EFFECTS)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert [ln.split()[:3] for ln in lines] == [[n, d, "pass"] for n in ("helion", "triton") for d in ("fwd", "bwd")], (
        proc.stdout
    )


def test_compiled_functions_by_name_and_by_record(fresh_dynamo):
    from harness.integrate.autograd import add_rmsnorm, rmsnorm

    def f(x, w):
        y, h = add_rmsnorm(x, x.flip(0), w, 1e-5, impl=counting_impl.RECORD, weight_offset=1.0)
        return rmsnorm(y, w, 1e-5, impl="eager") + h

    eager_matches_compiled(f, [torch.randn(3, 64, device=DEVICE), torch.randn(64, device=DEVICE)])


def test_eager_calls_take_the_twin_and_compiled_code_the_custom_op():
    """Outside torch.compile the differentiable forward is an autograd.Function around the same
    validated kernels (no custom-op dispatch per call); in a compiled graph it is the custom op."""
    from harness.integrate.autograd import norm_ops, rmsnorm

    ops = norm_ops("eager")
    twin = ops.forward("rmsnorm")
    assert twin is ops.eager["rmsnorm_fwd"] and twin is not ops.function("rmsnorm_fwd")
    with pytest.raises(ValueError, match="does not provide"):
        norm_ops("triton-rmsnorm-claude-20261122-1").forward("layernorm")
    targets = []

    def backend(gm, example_inputs):
        targets.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    x, w, _ = tiny(torch.float32)
    f = torch.compile(lambda x, w: rmsnorm(x, w, 1e-6, impl="eager"), backend=backend, fullgraph=True)
    torch.testing.assert_close(f(x, w), rmsnorm(x, w, 1e-6, impl="eager"))
    assert any(t.startswith("normbench.") for t in targets), targets
