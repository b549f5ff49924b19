"""The launch plans of the contract functions (``harness.spec.validation.checked``), the autograd
layer's fast paths over them (``harness.integrate``) and the DSLs' cached launches: a warm cache
still checks what can differ between calls (shape, strides, dtype, device, requires_grad, weight
None or given, eps), gives what a cold one gives, and refuses bad input with the same error."""

import pytest
import torch

from harness.integrate.autograd import AddRMSNorm, LayerNorm, RMSNorm, add_rmsnorm, layernorm, rmsnorm
from harness.registry import get
from harness.run.checker import compare
from harness.spec import jit_launch, reference, validation

from .conftest import DEVICE


def _impl(name):
    impl = get(name)
    if not impl.available(DEVICE):
        pytest.skip(f"{name}: {impl.unavailable(DEVICE)}")
    return impl


def _draw(shape, dtype, seed, pdtype=None, n_rows=4):
    """Fresh seeded row tensors of ``shape`` (rows at varied scales) and (N,) parameters."""
    g = torch.Generator().manual_seed(seed)
    n = shape[-1]
    scale = torch.logspace(-1, 1, shape[0]).reshape(-1, *([1] * (len(shape) - 1)))
    rows = [(torch.randn(*shape, generator=g) * scale).to(DEVICE, dtype) for _ in range(n_rows)]
    w = (torch.randn(n, generator=g) * 0.5 + 1).to(DEVICE, pdtype or dtype)
    b = (torch.randn(n, generator=g) * 0.2).to(DEVICE, pdtype or dtype)
    return rows, w, b


def _reference(op, x, residual, dy, w, b, eps):
    """fp64 {y, dx, dweight, dbias} of ``op`` on (..., N) inputs (the gradients of the parameters
    given), and the term scale of each gradient (the tolerance floor where terms cancel, as
    harness.run.checker takes it)."""
    n = x.shape[-1]
    # x in its own dtype: the reference rounds residual_out to it, as the contract does
    x2, dy2 = x.reshape(-1, n), dy.reshape(-1, n).double()
    w64 = w.double() if w is not None else torch.ones(n, dtype=torch.float64, device=x.device)
    ref = {}
    if op == "rmsnorm":
        y, rstd = reference.rmsnorm_fwd(x2, w64, eps)
        dx, dw = reference.rmsnorm_bwd(dy2, x2, w64, rstd)
        xhat = x2.double() * rstd.unsqueeze(-1)
    elif op == "layernorm":
        y, mean, rstd = reference.layernorm_fwd(x2, w64, None if b is None else b.double(), eps)
        dx, dw, db = reference.layernorm_bwd(dy2, x2, w64, mean, rstd)
        xhat = (x2.double() - mean.unsqueeze(-1)) * rstd.unsqueeze(-1)
        if b is not None:
            ref["dbias"] = db
    else:
        y, h, rstd = reference.add_rmsnorm_fwd(x2, residual.reshape(-1, n), w64, eps)
        dx, dw = reference.add_rmsnorm_bwd(dy2, None, h, w64, rstd)
        xhat = h * rstd.unsqueeze(-1)
    ref.update(y=y.reshape(x.shape), dx=dx.reshape(x.shape))
    if w is not None:
        ref["dweight"] = dw
    scales = {
        "dx": (dy2 * w64 * rstd.unsqueeze(-1)).abs().reshape(x.shape),
        "dweight": (dy2 * xhat).square().sum(0).sqrt(),
        "dbias": dy2.square().sum(0).sqrt(),
    }
    return ref, scales


def _run(op, entry, impl, x, residual, w, b, eps, dy):
    """y, and x's, the weight's and the bias's gradients, through the function or a module holding
    ``w`` / ``b`` (the module's parameters then take their gradients)."""
    if entry == "module":
        n = x.shape[-1]
        cls = {"rmsnorm": RMSNorm, "layernorm": LayerNorm, "add_rmsnorm": AddRMSNorm}[op]
        kw = {"bias": b is not None} if op == "layernorm" else {}
        m = cls(
            n,
            eps=eps,
            elementwise_affine=w is not None,
            device=x.device,
            dtype=(w if w is not None else x).dtype,
            impl=impl,
            **kw,
        )
        with torch.no_grad():
            if w is not None:
                m.weight.copy_(w)
            if b is not None:
                m.bias.copy_(b)
        w, b = m.weight, getattr(m, "bias", None)
        fn = (lambda x, r: m(x, r)[0]) if op == "add_rmsnorm" else (lambda x, r: m(x))
    else:
        if w is not None:
            w = w.detach().clone().requires_grad_(True)
        if b is not None:
            b = b.detach().clone().requires_grad_(True)
        if op == "rmsnorm":
            fn = lambda x, r: rmsnorm(x, w, eps, impl)
        elif op == "layernorm":
            fn = lambda x, r: layernorm(x, w, b, eps, impl)
        else:
            fn = lambda x, r: add_rmsnorm(x, r, w, eps, impl)[0]
    with torch.no_grad():
        y_nograd = fn(x, residual)
    x = x.detach().requires_grad_(True)
    y = fn(x, residual)
    assert y.grad_fn is not None, "a forward on inputs that require grad took no autograd node"
    assert y_nograd.grad_fn is None and torch.equal(y_nograd, y.detach()), "no_grad's forward differs"
    y.backward(dy)
    return y.detach(), x.grad, (w.grad if w is not None else None), (b.grad if b is not None else None)


def _variations(op, dtype):
    """(label, x, residual, dy, w, b, eps): what may differ from one call to the next, each on fresh
    seeded inputs: the rows, their strides and leading dimensions, the dtypes, the weight's presence
    and dtype, eps."""
    out = []
    for i, (label, shape, xdtype, pdtype, eps, affine, layout) in enumerate([
        ("base", (6, 64), dtype, None, 1e-5, True, "contiguous"),
        ("same key again", (6, 64), dtype, None, 1e-5, True, "contiguous"),
        ("other M", (5, 64), dtype, None, 1e-5, True, "contiguous"),
        ("other N", (6, 48), dtype, None, 1e-5, True, "contiguous"),
        ("3-D", (2, 3, 64), dtype, None, 1e-5, True, "contiguous"),
        ("row stride", (6, 64), dtype, None, 1e-5, True, "column-slice"),
        ("column stride", (6, 64), dtype, None, 1e-5, True, "transposed"),
        ("fp32", (6, 64), torch.float32, None, 1e-5, True, "contiguous"),
        ("fp32 weight", (6, 64), dtype, torch.float32, 1e-5, True, "contiguous"),
        ("no weight", (6, 64), dtype, None, 1e-5, False, "contiguous"),
        ("other eps", (6, 64), dtype, None, 0.25, True, "contiguous"),
        ("eps 0", (6, 64), dtype, None, 0.0, True, "contiguous"),
        ("base again", (6, 64), dtype, None, 1e-5, True, "contiguous"),
    ]):  # fmt: skip
        (x, residual, dy), w, b = _draw(shape, xdtype, seed=100 + i, pdtype=pdtype, n_rows=3)
        if layout == "column-slice":  # rows 80 apart, as a column slice of a wider tensor
            x = torch.cat([x, x[:, :16]], dim=1)[:, : shape[-1]]
        elif layout == "transposed":  # unit stride along the rows, not along N
            x = x.t().contiguous().t()
        assert (layout == "contiguous") == x.is_contiguous()
        if not affine:
            w = b = None
        if op != "layernorm":
            b = None
        out.append((label, x, residual, dy, w, b, eps))
    return out


# every op and entry of eager; two of each interpreter's (they pay per program and operation); on a
# GPU the same for the DSLs that run only there
WARM_CASES = [
    ("eager", op, entry) for op in ("rmsnorm", "layernorm", "add_rmsnorm") for entry in ("function", "module")
]
WARM_CASES += [("triton", "rmsnorm", "function"), ("triton", "add_rmsnorm", "module")]
WARM_CASES += [("helion", "rmsnorm", "function"), ("helion", "layernorm", "module")]
# GPU only (skipped here): Gluon's cached Triton-JIT launches, CuTe DSL's and cuTile's launchers
WARM_CASES += [("gluon", "rmsnorm", "function"), ("gluon", "add_rmsnorm", "module"), ("cute", "layernorm", "module")]
WARM_CASES += [("cute", "rmsnorm", "function"), ("cutile", "rmsnorm", "function")]


@pytest.mark.parametrize("name,op,entry", WARM_CASES, ids=["-".join(c) for c in WARM_CASES])
def test_a_warm_cache_checks_what_differs_and_gives_the_cold_answer(name, op, entry):
    impl = _impl(name)
    validation.clear_plans()
    failures = []
    for label, x, residual, dy, w, b, eps in _variations(op, torch.bfloat16):
        if entry == "module" and label == "other eps":
            continue  # a module's eps is its own
        warm = _run(op, entry, impl, x, residual, w, b, eps, dy)
        validation.clear_plans()
        cold = _run(op, entry, impl, x, residual, w, b, eps, dy)
        for what, a, c in zip(("y", "dx", "dweight", "dbias"), warm, cold):
            if (a is None) != (c is None) or (a is not None and not torch.equal(a, c)):
                failures.append(f"{label}: {what} differs between a warm and a cold cache")
        ref, scales = _reference(op, x, residual, dy, w, b, eps)
        got = dict(zip(("y", "dx", "dweight", "dbias"), warm))
        assert (got["dweight"] is None) == (w is None), f"{label}: dweight is {got['dweight']}"
        for what, r in ref.items():
            rep = compare(what, got[what].to(x.dtype), r, x.dtype, r.shape, scales.get(what))
            if not rep.passed:
                failures.append(f"{label}: {what}: {rep.reason}")
        # the next variation starts from a cache this one warmed (cold runs cleared it)
        _run(op, entry, impl, x, residual, w, b, eps, dy)
    assert not failures, "\n".join(failures)


def _bad_calls(op):
    """(label, call) pairs of bad input: each after a good call with the same impl, on a cache that
    call warmed. A call is (x, residual, weight, bias, eps, weight_offset)."""
    (x, residual, _), w, b = _draw((6, 64), torch.bfloat16, seed=7, n_rows=3)
    good = {
        "x": x,
        "residual": residual,
        "weight": w,
        "bias": b if op == "layernorm" else None,
        "eps": 1e-5,
        "offset": 0.0,
    }
    bad = {
        "weight shape": {"weight": w[:48]},
        "weight int": {"weight": torch.ones(64, dtype=torch.int32, device=x.device)},
        "weight fp16 beside bf16": {"weight": w.half()},
        "weight 2-D": {"weight": w.reshape(8, 8)},
        "weight not a tensor": {"weight": [1.0] * 64},
        "x int": {"x": torch.ones(6, 64, dtype=torch.int64, device=x.device), "weight": None, "bias": None},
        "x 0-D": {"x": x[0, 0], "weight": None, "bias": None},
        "x empty N": {"x": x[:, :0], "weight": None, "bias": None},
        "x not a tensor": {"x": x.tolist()},
        "x on meta": {"x": x.to("meta")},
        "weight on meta": {"weight": w.to("meta")},
        "x fp64": {"x": x.double(), "weight": None, "bias": None},
        "eps negative": {"eps": -1.0},
        "eps nan": {"eps": float("nan")},
        "eps bool": {"eps": True},
        "eps str": {"eps": "1e-5"},
        "offset nan": {"offset": float("nan")},
        "offset without weight": {"offset": 1.0, "weight": None},
    }
    if op == "layernorm":
        bad["bias shape"] = {"bias": b[:32]}
        bad["bias int"] = {"bias": torch.ones(64, dtype=torch.int32, device=x.device)}
    if op == "add_rmsnorm":
        bad["residual shape"] = {"residual": residual[:, :32]}
        bad["residual dtype"] = {"residual": residual.float()}
        bad["residual not a tensor"] = {"residual": 1.0}
    return good, bad


def _call(op, impl, c):
    if op == "rmsnorm":
        return rmsnorm(c["x"], c["weight"], c["eps"], impl, c["offset"])
    if op == "layernorm":
        return layernorm(c["x"], c["weight"], c["bias"], c["eps"], impl, c["offset"])
    return add_rmsnorm(c["x"], c["residual"], c["weight"], c["eps"], impl, c["offset"])


def _error(fn):
    try:
        fn()
    except (ValueError, TypeError) as e:
        return type(e), str(e)
    return None


@pytest.mark.parametrize("op", ["rmsnorm", "layernorm", "add_rmsnorm"])
def test_bad_input_on_a_warm_cache_gets_the_cold_error(op):
    impl = _impl("eager")
    good, bad = _bad_calls(op)
    for label, change in bad.items():
        call = {**good, **change}
        validation.clear_plans()
        cold = _error(lambda call=call: _call(op, impl, call))
        assert cold is not None, f"{label}: accepted on a cold cache"
        for _ in range(2):  # warm: the good call's plans, and the bad call after them
            _call(op, impl, good)
        warm = _error(lambda call=call: _call(op, impl, call))
        assert warm == cold, f"{label}: warm {warm} != cold {cold}"
        # and the good call still runs after it
        _call(op, impl, good)


def test_a_module_on_a_warm_cache_refuses_the_wrong_width():
    impl = _impl("eager")
    m = RMSNorm(64, impl=impl, device=DEVICE, dtype=torch.bfloat16)
    (x, _), _, _ = _draw((4, 64), torch.bfloat16, seed=3, n_rows=2)
    for _ in range(2):
        m(x)
    with pytest.raises(ValueError, match="last dimension of 64"):
        m(x[:, :32])
    m.weight.data = m.weight.data.float()  # the weight's dtype changes under a warm cache
    assert m(x).dtype == torch.bfloat16
    m.weight = torch.nn.Parameter(torch.ones(64, dtype=torch.int32, device=DEVICE), requires_grad=False)
    with pytest.raises(TypeError, match="weight must have x's dtype"):
        m(x)


def test_a_hit_skips_the_checks_and_every_new_key_meets_them(monkeypatch):
    """The cache is used (a repeated call validates nothing in full) and keyed by what can differ
    (each new shape, stride, dtype, requires_grad or weight presence is checked in full once)."""
    impl = _impl("eager")
    validation.clear_plans()
    calls = []
    real = validation.check_args
    monkeypatch.setattr(validation, "check_args", lambda *a: calls.append(a[0].name) or real(*a))
    (x, dy), w, _ = _draw((6, 64), torch.bfloat16, seed=11, n_rows=2)
    with torch.no_grad():
        rmsnorm(x, w, 1e-5, impl)
    first = len(calls)
    assert first == 1, calls  # the forward's contract function, checked once
    with torch.no_grad():
        for _ in range(3):
            rmsnorm(x, w, 1e-5, impl)
            rmsnorm(x, w, 0.5, impl)  # eps: checked on every call, no new plan
    assert len(calls) == first, "a repeated call was validated in full"
    with torch.no_grad():
        for other in (x[:5], x.float(), x.reshape(2, 3, 64), x.t().contiguous().t()):
            before = len(calls)
            rmsnorm(other, w if other.dtype == w.dtype else w.float(), 1e-5, impl)
            rmsnorm(other, w if other.dtype == w.dtype else w.float(), 1e-5, impl)
            assert len(calls) == before + 1, "a new key is checked in full once"
        before = len(calls)
        rmsnorm(x, None, 1e-5, impl)
        assert len(calls) == before + 1, "weight None is a key of its own"
    # requires_grad: the forward under autograd, its backward (a plan of its own), then both again
    before = len(calls)
    for _ in range(2):
        xg = x.detach().requires_grad_(True)
        rmsnorm(xg, w, 1e-5, impl).backward(dy)
    assert len(calls) == before + 1, calls[before:]  # the backward's first call; the forward's plan is the same
    with pytest.raises(ValueError, match="must be >= 0"):
        rmsnorm(x, w, -1.0, impl)


def test_requires_grad_decides_whether_autograd_records():
    impl = _impl("eager")
    (x, dy), w, _ = _draw((6, 64), torch.bfloat16, seed=5, n_rows=2)
    assert rmsnorm(x, w, 1e-5, impl).grad_fn is None  # nothing requires grad
    wg = w.detach().requires_grad_(True)
    y = rmsnorm(x, wg, 1e-5, impl)  # only the weight requires grad (inference in train mode)
    assert y.grad_fn is not None
    y.backward(dy)
    assert wg.grad is not None and wg.grad.dtype == w.dtype
    with torch.inference_mode():
        assert not rmsnorm(x, wg, 1e-5, impl).requires_grad


# ---------------------------------------------------------------- the DSLs' launches
class _Param:
    def __init__(self, num, constexpr):
        self.num, self.is_constexpr = num, constexpr


class _Compiled:
    """Stands for a CompiledKernel: ``compiled[grid](*args)`` records the launch."""

    def __init__(self, log):
        self.log = log

    def __getitem__(self, grid):
        return lambda *args: self.log.append(("handle", grid, args))


class _Kernel:
    """Stands for a JITFunction: ``kernel[grid](*args, num_warps=w)`` records a full launch."""

    def __init__(self, constexprs=(False, False, False, True)):
        self.params = [_Param(i, c) for i, c in enumerate(constexprs)]
        self.arg_names = [f"a{i}" for i in range(len(constexprs))]
        self.log = []

    def __getitem__(self, grid):
        def run(*args, num_warps, num_stages=None):
            self.log.append(("full", grid, args))
            return _Compiled(self.log)

        return run


@pytest.fixture
def fake_gpu(monkeypatch):
    monkeypatch.setattr(jit_launch, "_current_device", lambda: 0)
    monkeypatch.setattr(jit_launch, "_is_compiled", lambda obj: isinstance(obj, _Compiled))
    jit_launch.clear()
    yield
    jit_launch.clear()


def test_a_triton_launch_reuses_the_compiled_kernel_for_the_same_key(fake_gpu):
    k = _Kernel()
    x = torch.zeros(64)
    for eps in (1e-5, 0.5):  # a runtime float's value is no part of the key
        jit_launch.fast(k)[(4,)](x, 64, eps, 128, num_warps=4)
    assert [e[0] for e in k.log] == ["full", "handle"]
    assert k.log[1] == ("handle", (4, 1, 1), (x, 64, 0.5, 128))
    changed = {
        "grid": ((5,), (x, 64, 0.5, 128), 4),
        "int": ((4,), (x, 65, 0.5, 128), 4),
        "constexpr": ((4,), (x, 64, 0.5, 256), 4),
        "warps": ((4,), (x, 64, 0.5, 128), 8),
        "dtype": ((4,), (x.half(), 64, 0.5, 128), 4),
        "misaligned pointer": ((4,), (x[1:], 64, 0.5, 128), 4),
        "bool for int": ((4,), (x, True, 0.5, 128), 4),
    }
    for label, (grid, args, warps) in changed.items():
        k.log.clear()
        jit_launch.launch(k, grid, args, warps)
        assert [e[0] for e in k.log] == ["full"], label
    k.log.clear()
    jit_launch.launch(k, (4,), (x, 64, 0.25, 128), 4)
    assert [e[0] for e in k.log] == ["handle"]


def test_a_triton_launch_falls_back_where_it_cannot_key(fake_gpu, monkeypatch):
    k = _Kernel()
    x = torch.zeros(64)
    thing = object()
    # a parameter left out; a runtime argument of no known kind; an unhashable compile-time one
    for args in [(x, 64, 1e-5), (x, thing, 1e-5, 128), (x, 64, 1e-5, [128])]:
        for _ in range(2):
            jit_launch.launch(k, (4,), args, 4)
    assert [e[0] for e in k.log] == ["full"] * 6
    # a hashable compile-time value (Gluon's layouts are frozen dataclasses) is keyed by its value
    k.log.clear()
    for _ in range(2):
        jit_launch.launch(k, (4,), (x, 64, 1e-5, (1, 8)), 4)
    assert [e[0] for e in k.log] == ["full", "handle"]
    monkeypatch.setattr(jit_launch, "_current_device", lambda: None)  # the interpreter: no GPU
    k.log.clear()
    for _ in range(2):
        jit_launch.launch(k, (4,), (x, 64, 1e-5, 128), 4)
    assert [e[0] for e in k.log] == ["full", "full"]


def test_gluon_launches_by_name_in_the_kernels_order(fake_gpu):
    k = _Kernel()
    x = torch.zeros(64)
    for _ in range(2):
        jit_launch.launch_named(k, (2, 3), {"a3": 8, "a1": 64, "a0": x, "a2": 1.0}, 4)
    assert k.log == [("full", (2, 3, 1), (x, 64, 1.0, 8)), ("handle", (2, 3, 1), (x, 64, 1.0, 8))]


def test_triton_chooses_a_config_once_per_key(monkeypatch):
    from impls.triton import configs as C

    looked = []
    monkeypatch.setattr(C, "device_name", lambda d: "GPU X")
    monkeypatch.setattr(C, "capability_of", lambda d: (9, 0))
    monkeypatch.setattr(C, "lookup", lambda *a: looked.append(a) or C.Config(rows=len(looked)))
    monkeypatch.setattr(C, "_PINNED", {"GPU X": {}})
    monkeypatch.setattr(C, "_CHOSEN", {})
    monkeypatch.delenv("NORMBENCH_CONFIGS", raising=False)
    dev = torch.device("cuda", 0)
    first = C.choose("rmsnorm", "fwd", 4096, dev)
    assert C.choose("rmsnorm", "fwd", 4096, dev) is first and len(looked) == 1
    C.choose("rmsnorm", "fwd", 2048, dev)
    C.choose("rmsnorm", "bwd", 4096, dev)
    assert len(looked) == 3
    monkeypatch.setenv("NORMBENCH_CONFIGS", "heuristic")  # another table: looked up again
    C.choose("rmsnorm", "fwd", 4096, dev)
    monkeypatch.setattr(C, "_PINNED", {"GPU X": {}})  # the table re-read (tune pins a config)
    C.choose("rmsnorm", "fwd", 4096, dev)
    assert len(looked) == 5


def test_helion_serialises_a_config_once():
    from impls.helion import configs as C

    config = {"block_sizes": [4], "num_warps": 4}
    text = C._config_text(config)
    assert C._config_text(config) is text
    assert C._config_text(dict(config)) == text  # equal content, another dict: the same compiled function
    assert C._config_text({"block_sizes": [4], "num_warps": 8}) != text


def test_helion_launches_through_the_cache_unless_it_asks_for_its_own_options(fake_gpu, monkeypatch):
    """Helion's compiled host function is given a launcher that keys like Triton's launches (num_stages
    in the key); a launch with options of Helion's own goes to Helion's launcher."""
    pytest.importorskip("helion")
    import helion.runtime

    from impls.helion import configs

    def host(x, n, *, _launcher=None):
        return _launcher(k, (2,), x, n, 1e-5, 128, num_warps=4, num_stages=3)

    k = _Kernel()
    x = torch.zeros(64)
    run = configs._fast(host)
    for _ in range(2):
        run(x, 64)
    assert [e[0] for e in k.log] == ["full", "handle"]
    k.log.clear()
    configs._launcher(k, (2,), x, 64, 1e-5, 128, num_warps=4, num_stages=2)  # other stages: another binary
    assert [e[0] for e in k.log] == ["full"]
    assert configs._fast(lambda x, n: None).__name__ == "<lambda>"  # no _launcher: left as it is
    seen = []
    monkeypatch.setattr(helion.runtime, "default_launcher", lambda *a, **kw: seen.append(kw))
    configs._launcher(k, (2,), x, 64, 1e-5, 128, num_warps=4, num_stages=3, launch_cooperative_grid=True)
    assert seen == [{"num_warps": 4, "num_stages": 3, "launch_cooperative_grid": True}]


def test_a_recorded_call_replays_its_launches_alone(fake_gpu):
    """jit_launch.recording: the compiled launches of one call, first or cached, in order, and
    replay launches exactly those again (normbench overhead's launcher floor)."""
    k = _Kernel()
    x = torch.zeros(64)
    with jit_launch.recording() as launches:
        jit_launch.launch(k, (4,), (x, 64, 1e-5, 128), 4)  # compiles
        jit_launch.launch(k, (2,), (x, 32, 1e-5, 128), 4)
        jit_launch.launch(k, (4,), (x, 64, 0.5, 128), 4)  # the first's compiled kernel
    assert [(g, a[1]) for _, g, a in launches] == [((4, 1, 1), 64), ((2, 1, 1), 32), ((4, 1, 1), 64)]
    assert launches[0][0] is launches[2][0]
    k.log.clear()
    jit_launch.replay(launches)
    assert k.log == [("handle", g, a) for _, g, a in launches]
    jit_launch.launch(k, (4,), (x, 64, 0.5, 128), 4)  # outside the block: nothing recorded
    assert len(launches) == 3


def test_a_compile_time_value_unhashable_after_a_hashable_one_falls_back(fake_gpu):
    """The key's layout is built per argument types; a tuple constant that holds a list the second
    time (same type, unhashable) launches in full rather than raising."""
    k = _Kernel()
    x = torch.zeros(64)
    for const in [(1, 8), (1, [8])]:
        jit_launch.launch(k, (4,), (x, 64, 1e-5, const), 4)
    assert [e[0] for e in k.log] == ["full", "full"]
