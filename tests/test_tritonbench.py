"""The TritonBench adapter (harness/tritonbench.py).

On CPU, against a stand-in of TritonBench: its two registries (register_benchmark, register_metric,
the latter finding the operator from the function's module path as TritonBench does) and its
rms_norm / layer_norm operator classes, with their inputs and backward. Tests against a real
TritonBench are skipped unless it is importable.
"""

from __future__ import annotations

import csv
import importlib.util
import sys
from collections import OrderedDict, defaultdict
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from harness import cli
from harness.tools import tritonbench as tbx
from harness.registry import all_implementations, get
from harness.spec.contract import Implementation
from harness.spec.roofline import bytes_moved

M, H = 8, 64


# ---------------------------------------------------------------- the stand-in
class FakeTritonBench:
    """TritonBench's registration API and two operators, as far as the adapter touches them."""

    def __init__(self, rms_layout: str = "new"):
        self.benchmarks: dict[str, OrderedDict] = {}
        self.metrics: defaultdict[str, list] = defaultdict(list)
        self.metric_options: dict[str, dict] = {}
        self.operators = {"rms_norm": make_rms_norm_operator(rms_layout), "layer_norm": make_layer_norm_operator()}
        self.metrics["layer_norm"].append("gbps")  # layer_norm's own @register_metric gbps

    def register_benchmark(self, operator_name=None, func_name=None, baseline=False, enabled=True, fwd_only=False, label=None):
        def decorator(function):
            self.benchmarks.setdefault(operator_name, OrderedDict())[func_name] = dict(
                baseline=baseline, enabled=enabled, fwd_only=fwd_only, label=label
            )

            def _inner(op_self, *args, **kwargs):
                return function(op_self, *args, **kwargs)

            return _inner

        return decorator

    def register_metric(self, skip_baseline=False, x_only=False):
        def decorator(func):
            prefix = "tritonbench.operators."
            assert func.__module__.startswith(prefix), f"TritonBench would reject module {func.__module__}"
            op_name = func.__module__[len(prefix) :].split(".")[0]
            self.metrics[op_name].append(func.__name__)
            self.metric_options[func.__name__] = dict(skip_baseline=skip_baseline, x_only=x_only)

            def _inner(op_self, *args, **kwargs):
                return func(op_self, *args, **kwargs)

            return _inner

        return decorator

    def api(self) -> tbx.TritonBench:
        return tbx.TritonBench(
            register_benchmark=self.register_benchmark,
            register_metric=self.register_metric,
            registered_metrics=self.metrics,
            load_operator=self.operators.__getitem__,
        )


class FakeOperator:
    """What BenchmarkOperator does around a backend: build it on the input, derive the timed
    function for the mode (fn._name = backend), call the custom metrics with it."""

    def __init__(self, mode: str = "fwd", dtype=torch.float32):
        self.mode = SimpleNamespace(value=mode)
        self.dtype = dtype
        self._cur_input_id = 0
        self.example_inputs = next(iter(self.get_input_iter()))

    def bench_fn(self, name: str):
        fwd = getattr(self, name)(*self.example_inputs)
        if self.mode.value == "fwd":
            fn = fwd
        elif self.mode.value == "bwd":
            fn = self.get_bwd_fn(fwd)
        else:
            bwd = self.get_bwd_fn(fwd)

            def fn():
                return fwd(), bwd()

        fn._name = name
        return fn

    def metric(self, metric: str, fn, latency_ms: float | None = 1.0):
        return getattr(self, metric)(fn, self.example_inputs, SimpleNamespace(latency=latency_ms))

    def get_bwd_fn(self, fwd_fn):
        y = fwd_fn()
        dy = torch.randn_like(y)
        return lambda: y.backward(dy, retain_graph=True)


def make_rms_norm_operator(layout: str):
    class Operator(FakeOperator):
        eps = 1e-6

        def get_input_iter(self):
            grad = self.mode.value in ("bwd", "fwd_bwd")
            x = torch.randn(M, H, dtype=self.dtype, requires_grad=grad)
            if layout == "old":  # (H, x): each backend owns a ones weight
                yield H, x
            else:
                yield H, x, torch.nn.Parameter(torch.ones(H, dtype=self.dtype), requires_grad=grad)

        def torch_rms(self, H, x, weight=None):  # a correct TritonBench backend
            return lambda: F.rms_norm(x, (H,), weight, self.eps)

        def wrong_rms(self, H, x, weight=None):  # a backend 1% off
            return lambda: F.rms_norm(x, (H,), weight, self.eps) * 1.01

    Operator.__module__ = "tritonbench.operators.rms_norm.operator"
    return Operator


def make_layer_norm_operator():
    class Operator(FakeOperator):
        def get_input_iter(self):
            x = (-2.3 + 0.5 * torch.randn(M, H, dtype=self.dtype)).requires_grad_()
            w = torch.rand(H, dtype=self.dtype, requires_grad=True)
            b = torch.rand(H, dtype=self.dtype, requires_grad=True)
            yield x, (H,), w, b, 1e-5

        def torch_layer_norm(self, *args):
            return lambda: F.layer_norm(*args)

        def wrong_layer_norm(self, x, shape, w, b, eps):  # a dbias that is twice what it should be
            return lambda: F.layer_norm(x, shape, w, b * 2 - b.detach(), eps)

        def gbps(self, fn, args, metrics):  # the operator's own
            return "layer_norm's own gbps"

    Operator.__module__ = "tritonbench.operators.layer_norm.operator"
    return Operator


@pytest.fixture
def fake():
    return FakeTritonBench()


def expected_backends(tb_op: str, device: str = "cpu") -> set[str]:
    op = tbx.OPERATORS[tb_op]
    return {tbx.backend_name(i.name) for i in all_implementations().values() if op in i.ops and i.available(device)}


# ---------------------------------------------------------------- registration
def test_backend_names_are_prefixed_identifiers():
    assert tbx.backend_name("eager") == "normbench_eager"
    assert tbx.backend_name("compile-max-autotune") == "normbench_compile_max_autotune"
    assert tbx.backend_name("llm-triton.v2").isidentifier()


def test_every_available_implementation_is_registered_on_both_operators(fake):
    result = tbx.register_all(device="cpu", tb=fake.api())
    for tb_op, cls in fake.operators.items():
        names = result[tb_op]["backends"]
        assert set(names) == expected_backends(tb_op) and "normbench_eager" in names
        assert list(fake.benchmarks[tb_op]) == names
        for name in names:
            # fwd_only=False: every implementation has the backward (the contract's four functions)
            assert fake.benchmarks[tb_op][name] == dict(baseline=False, enabled=True, fwd_only=False, label=name)
            assert callable(getattr(cls, name))
        # what is not available here is reported, with the reason
        skipped = result[tb_op]["skipped"]
        assert "quack" in skipped and "cuda" in skipped["quack"].lower()
        assert not set(map(tbx.backend_name, skipped)) & set(names)


def test_impl_glob_selects_and_unknown_glob_is_an_error(fake):
    result = tbx.register_all(device="cpu", pattern="eager", tb=fake.api())
    assert result["rms_norm"]["backends"] == ["normbench_eager"] == result["layer_norm"]["backends"]
    with pytest.raises(ValueError, match="no implementation matches"):
        tbx.register_all(device="cpu", pattern="nope*", tb=FakeTritonBench().api())


def test_metrics_registered_once_gbps_only_where_missing(fake):
    for _ in range(2):  # the --plugin hook runs at every operator construction
        tbx.register_all(device="cpu", pattern="eager", tb=fake.api())
    assert fake.metrics["rms_norm"] == ["fp64_accuracy", "fp64_rel_l2", "gbps"]
    assert fake.metrics["layer_norm"] == ["gbps", "fp64_accuracy", "fp64_rel_l2"]
    # the fp64 verdict is reported for the baseline too
    assert fake.metric_options["fp64_accuracy"] == dict(skip_baseline=False, x_only=False)
    op = fake.operators["layer_norm"]()
    assert op.metric("gbps", op.bench_fn("normbench_eager")) == "layer_norm's own gbps"


@pytest.mark.parametrize("mode,direction", [("fwd", "fwd"), ("bwd", "bwd"), ("fwd_bwd", "fwdbwd")])
def test_rms_norm_gbps_uses_normbench_bytes_model(fake, mode, direction):
    tbx.register_all(device="cpu", pattern="eager", tb=fake.api())
    op = fake.operators["rms_norm"](mode, torch.bfloat16)
    fn = op.bench_fn("normbench_eager")
    expected = bytes_moved("rmsnorm", direction, M, H, 2).main / 2e-3 / 1e9
    assert op.metric("gbps", fn, latency_ms=2.0) == pytest.approx(expected)
    assert op.metric("gbps", fn, latency_ms=None) is None


# ---------------------------------------------------------------- the callables
@pytest.mark.parametrize("layout", ["new", "old"])
@pytest.mark.parametrize("mode", ["fwd", "bwd", "fwd_bwd"])
def test_rms_norm_backend_runs_in_every_mode(layout, mode):
    fake = FakeTritonBench(rms_layout=layout)
    tbx.register_all(device="cpu", pattern="eager", tb=fake.api())
    op = fake.operators["rms_norm"](mode)
    fwd = op.normbench_eager(*op.example_inputs)
    y = fwd()
    x = op.example_inputs[1]
    torch.testing.assert_close(y, F.rms_norm(x.detach(), (H,), None, 1e-6))
    if mode != "fwd":
        assert y.requires_grad  # the backward goes through autograd of harness.integrate.autograd.rmsnorm
        op.bench_fn("normbench_eager")()
        if layout == "new":
            assert op.example_inputs[2].grad is not None and x.grad is not None


@pytest.mark.parametrize("mode", ["fwd", "bwd", "fwd_bwd"])
def test_layer_norm_backend_runs_in_every_mode(fake, mode):
    tbx.register_all(device="cpu", pattern="eager", tb=fake.api())
    op = fake.operators["layer_norm"](mode)
    x, shape, w, b, eps = op.example_inputs
    torch.testing.assert_close(op.normbench_eager(*op.example_inputs)(), F.layer_norm(x, shape, w, b, eps))
    if mode != "fwd":
        op.bench_fn("normbench_eager")()
        assert x.grad is not None and w.grad is not None and b.grad is not None


def test_unsupported_dtype_is_not_supported_rather_than_a_crash(fake):
    bf16_only = Implementation(name="bf16-only", dsl="eager", entry="impls.eager.kernels", dtypes=("bf16",), devices=("cpu",))
    method = tbx.backend_method(bf16_only, "rmsnorm")
    op = fake.operators["rms_norm"]("fwd", torch.float32)
    with pytest.raises(NotImplementedError, match="supports bf16"):  # TritonBench: "not supported"
        method(op, *op.example_inputs)


def test_layer_norm_over_more_than_the_last_dimension_is_not_supported(fake):
    method = tbx.backend_method(all_implementations()["eager"], "layernorm")
    op = fake.operators["layer_norm"]()
    x, _, w, b, eps = op.example_inputs
    with pytest.raises(NotImplementedError, match="last dimension"):
        method(op, x, (M, H), w, b, eps)


# ---------------------------------------------------------------- the fp64 verdict
@pytest.mark.parametrize("layout", ["new", "old"])
@pytest.mark.parametrize("mode", ["fwd", "bwd", "fwd_bwd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp64_verdict_passes_ours_and_theirs_and_catches_a_wrong_backend(layout, mode, dtype):
    fake = FakeTritonBench(rms_layout=layout)
    tbx.register_all(device="cpu", pattern="eager", tb=fake.api())
    op = fake.operators["rms_norm"](mode, dtype)
    for name, ok in (("normbench_eager", True), ("torch_rms", True), ("wrong_rms", False)):
        fn = op.bench_fn(name)
        assert op.metric("fp64_accuracy", fn) is ok, name
        err = op.metric("fp64_rel_l2", fn)
        assert (err < 1e-2) if ok else (err > 5e-3), (name, err)
    verdict = tbx.fp64_verdict(op, "rmsnorm", "normbench_eager")
    want = ["y"] if mode == "fwd" else ["y", "dx", "dweight"]
    assert verdict.checked == want
    notes = op.__dict__["_normbench_fp64_notes"]
    assert [n["backend"] for n in notes] == ["wrong_rms"] and "over tolerance" in notes[0]["detail"]
    assert ";" not in notes[0]["detail"]  # TritonBench's CSV is ';'-separated


def test_fp64_verdict_checks_layer_norm_gradients(fake):
    tbx.register_all(device="cpu", pattern="eager", tb=fake.api())
    op = fake.operators["layer_norm"]("bwd", torch.bfloat16)
    assert op.metric("fp64_accuracy", op.bench_fn("normbench_eager")) is True
    assert tbx.fp64_verdict(op, "layernorm", "normbench_eager").checked == ["y", "dx", "dweight", "dbias"]
    # (PyTorch's CPU layer_norm backward in bf16 fails the fp64 check: TritonBench's backend in fp32)
    op = fake.operators["layer_norm"]("bwd", torch.float32)
    assert op.metric("fp64_accuracy", op.bench_fn("torch_layer_norm")) is True
    assert op.metric("fp64_accuracy", op.bench_fn("wrong_layer_norm")) is False
    assert "dbias" in op.__dict__["_normbench_fp64_notes"][-1]["detail"]


def test_fp64_verdict_never_raises(fake):
    tbx.register_all(device="cpu", pattern="eager", tb=fake.api())
    op = fake.operators["rms_norm"]()
    op.broken = lambda *inputs: (_ for _ in ()).throw(RuntimeError("kernel launch failed"))
    verdict = tbx.fp64_verdict(op, "rmsnorm", "broken")
    assert verdict.passed is None and "kernel launch failed" in verdict.detail


# ---------------------------------------------------------------- the command
def test_missing_tritonbench_is_one_line_and_exit_2(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tritonbench", None)  # import tritonbench -> ModuleNotFoundError
    with pytest.raises(ValueError, match="TritonBench is not installed: .*pip install git\\+https://github.com/meta-pytorch/tritonbench"):
        tbx.main(["--op", "rms_norm"])
    assert cli.main(["tritonbench"]) == 2
    err = capsys.readouterr().err.strip()
    assert "TritonBench is not installed" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--op", "batch_norm"], "unknown TritonBench operator"),
        (["--op", "rms_norm", "--isolate"], "--isolate is not supported"),
        (["--op-collection", "all"], "--op-collection is not supported"),
    ],
)
def test_bad_arguments_are_value_errors(argv, needle):
    with pytest.raises(ValueError, match=needle):
        tbx.main(argv)


def test_cli_passes_options_through(capsys):
    assert cli.main(["tritonbench", "--op", "batch_norm"]) == 2
    assert "unknown TritonBench operator" in capsys.readouterr().err


def test_plugin_registers_on_both_operators(fake, monkeypatch):
    monkeypatch.setattr(tbx, "load_tritonbench", fake.api)
    tbx.plugin()
    assert "normbench_eager" in fake.benchmarks["rms_norm"] and "normbench_eager" in fake.benchmarks["layer_norm"]


# ---------------------------------------------------------------- a real TritonBench
HAS_TRITONBENCH = importlib.util.find_spec("tritonbench") is not None
needs_tritonbench = pytest.mark.skipif(
    not HAS_TRITONBENCH, reason="TritonBench is not installed (pip install git+https://github.com/meta-pytorch/tritonbench.git)"
)


def read_csv(path):
    rows = list(csv.reader(path.open(), delimiter=";"))
    return [dict(zip(rows[0], r)) for r in rows[1:]]


@needs_tritonbench
@pytest.mark.slow
def test_real_tritonbench_on_cpu(tmp_path):
    argv = ["--op", "rms_norm", "--impl", "eager", "--device", "cpu", "--num-inputs", "1", "--mode", "bwd",
            "--only", "llama_rms,normbench_eager", "--metrics", "latency,gbps,accuracy",
            "--warmup", "1", "--report-dir", str(tmp_path)]  # fmt: skip
    assert tbx.main(argv) == 0
    row = read_csv(tmp_path / "rms_norm-bwd-fp32-from0-n1.csv")[0]
    assert float(row["normbench_eager-fp64_accuracy"]) == 1.0 and float(row["normbench_eager-gbps"]) > 0
    assert "llama_rms-fp64_accuracy" in row and (tmp_path / "rms_norm-bwd-fp32-from0-n1.json").exists()


@needs_tritonbench
@pytest.mark.gpu
@pytest.mark.parametrize("tb_op", ["rms_norm", "layer_norm"])
def test_real_tritonbench_on_gpu(tb_op, tmp_path):
    argv = ["--op", tb_op, "--mode", "fwd_bwd", "--precision", "bf16", "--num-inputs", "1", "--keep-going",
            "--metrics", "latency,gbps,accuracy", "--report-dir", str(tmp_path)]  # fmt: skip
    assert tbx.main(argv) == 0
    row = read_csv(tmp_path / f"{tb_op}-fwd_bwd-bf16-from0-n1.csv")[0]
    for name in expected_backends(tb_op, "cuda"):
        assert float(row[f"{name}-fp64_accuracy"]) == 1.0, name


def test_operators_come_from_the_op_records_and_take_fp32_parameters():
    from harness.tools import tritonbench as tbm
    from harness.spec.ops import OPS

    # add_rmsnorm has no TritonBench operator to be registered on (README)
    assert tbm.OPERATORS == {"rms_norm": "rmsnorm", "layer_norm": "layernorm"} and OPS["add_rmsnorm"].tritonbench is None
    x = torch.randn(4, 64).bfloat16()
    tbm._supported(get("eager"), x, torch.ones(64), torch.zeros(64))  # fp32 parameters beside bf16 x
    with pytest.raises(NotImplementedError, match="fp32"):
        tbm._supported(get("eager"), x, torch.ones(64, dtype=torch.float64), None)


def test_tritonbench_commit_is_its_own_checkouts_not_an_enclosing_repositorys(tmp_path):
    """A TritonBench copy without git metadata inside another repository (ours, on the GPU machine)
    must not report that repository's HEAD as TritonBench's commit."""
    import subprocess

    def commit_of(root):
        return tbx._tritonbench_commit(SimpleNamespace(path=root / "tritonbench"))

    git = ["git", "-c", "user.name=n", "-c", "user.email=n@n"]
    outer = tmp_path / "outer"
    (outer / "copy" / "tritonbench" / "operators").mkdir(parents=True)
    subprocess.run([*git, "init", "-q", str(outer)], check=True)
    subprocess.run([*git, "-C", str(outer), "commit", "-q", "--allow-empty", "-m", "outer"], check=True)
    assert commit_of(outer / "copy") == "unknown"

    checkout = tmp_path / "checkout"
    (checkout / "tritonbench" / "operators").mkdir(parents=True)
    subprocess.run([*git, "init", "-q", str(checkout)], check=True)
    subprocess.run([*git, "-C", str(checkout), "commit", "-q", "--allow-empty", "-m", "tb"], check=True)
    head = subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert commit_of(checkout) == head
