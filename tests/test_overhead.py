"""`normbench overhead`: host time per call, measured on CPU with the eager kernels."""

import json

from harness.cli import main
from harness.registry import get
from harness.run.overhead import COMPARED, OWN, markdown, ratio_key, run
from harness.spec.contract import Implementation
from harness.spec.shapes import Shape


def test_overhead_rows_and_a_failing_implementation_is_recorded(tmp_path):
    broken = Implementation(name="broken", dsl="x", entry="no.such.module", ops=("rmsnorm",), devices=("cpu",))
    out = tmp_path / "overhead.json"
    rows = run([get("eager"), broken], ["rmsnorm", "layernorm"], Shape((4, 256)), "bf16", "cpu", out, calls=3, trials=2)
    by = {(r["impl"], r["op"]): r for r in rows}
    native = "torch.nn.functional"
    assert set(by) == {
        ("eager", "rmsnorm"),
        ("eager", "layernorm"),
        ("broken", "rmsnorm"),
        (native, "rmsnorm"),
        (native, "layernorm"),
    }
    for op in ("rmsnorm", "layernorm"):
        ref, r = by[(native, op)], by[("eager", op)]
        assert all(ref[k] > 0 for k in COMPARED) and not any(k in ref for k in OWN)
        # eager launches no Triton-JIT kernel: no launcher floor of its own
        assert all(r[k] > 0 for k in COMPARED + OWN if k != "launch_fwd_us") and "launch_fwd_us" not in r
        # each compared figure beside its ratio to torch's, from the same run
        assert all(r[ratio_key(k)] == r[k] / ref[k] for k in COMPARED)
    assert "error" in by[("broken", "rmsnorm")]
    saved = json.loads(out.read_text())
    assert saved["device"] == "cpu" and len(saved["rows"]) == 5 and saved["rounds"] == 2
    assert saved["environment"]["git_commit"] is None or len(saved["environment"]["git_commit"]) >= 40
    table = "\n".join(markdown(rows))
    assert "| eager | rmsnorm |" in table and "| broken | rmsnorm |" in table and f"| {native} | layernorm |" in table


def test_overhead_cli_errors_are_one_line(capsys):
    assert main(["overhead", "--device", "cpu", "--shape", "4xq"]) == 2
    assert main(["overhead", "--device", "cpu", "--calls", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(e.startswith("normbench: error:") for e in err)


def test_every_op_is_measured_from_its_record():
    rows = run([get("eager")], ["add_rmsnorm"], Shape((4, 256)), "bf16", "cpu", calls=3, trials=2)
    by = {r["impl"]: r for r in rows}
    assert "error" not in by["eager"], by["eager"]
    assert all(by["eager"][k] > 0 for k in COMPARED + OWN if k != "launch_fwd_us")
    # the reference row runs x + residual then F.rms_norm (and torch.nn.RMSNorm) through autograd
    assert all(by["torch.nn.functional"][k] > 0 for k in COMPARED)


def test_python_profile_names_the_kernel_call_per_measurement(tmp_path):
    """--python-profile: one table per row and measurement, and the eager forward's table has ATen's
    fused RMSNorm among its functions, called once per timed call."""
    folder = tmp_path / "pyprof"
    assert main(["overhead", "--device", "cpu", "--impl", "eager", "--op", "rmsnorm", "--shape", "4x256",
                 "--calls", "8", "--trials", "1", "--python-profile", str(folder)]) == 0  # fmt: skip
    index = (folder / "index.txt").read_text().split()
    keys = [k.removesuffix("_us") for k in COMPARED + OWN if k != "launch_fwd_us"]
    assert sorted(index) == sorted([f"eager-rmsnorm-{k}.txt" for k in keys] + [f"torch_nn_functional-rmsnorm-{k}.txt" for k in keys[:4]])
    lines = (folder / "eager-rmsnorm-kernel_fwd.txt").read_text().splitlines()
    fused = [line for line in lines if "_fused_rms_norm" in line]
    assert fused and fused[0].split("|")[2].strip() == "1", lines[:6]
    assert main(["overhead", "--device", "cpu", "--python-profile", str(index and folder / "index.txt")]) == 2
