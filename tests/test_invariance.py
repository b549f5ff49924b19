"""Batch invariance and determinism (harness.run.invariance): honest implementations classified as
such, and mutants that depend on the batch or on the order partials arrive in classified as not;
the results in `normbench check --invariance`'s table and JSON, and in the generated leaderboard and
README summary where a GPU's report holds them."""

import json
import shutil
from pathlib import Path

import pytest

from harness import get
from harness.run import check
from harness.run.invariance import RUNS, check_invariance, positions
from harness.spec.contract import OPS, Implementation
from harness.spec.ops import get_op

ROOT = Path(__file__).resolve().parent.parent
# on the CPU: one row length, a batch of 40 for the GPU run's 4096 (the interpreter pays per row)
SMALL = {"ns": (1024,), "batches": (1, 7, 40)}


def mutant(factory: str, ops=("rmsnorm",)) -> Implementation:
    return Implementation(name=f"mutant-{factory}", dsl="eager", entry=f"tests.mutants:{factory}", ops=ops, devices=("cpu", "cuda"))


def props(r) -> tuple:
    return r.batch_invariant_fwd, r.batch_invariant_bwd, r.deterministic


def test_probe_rows_are_first_middle_and_last():
    assert positions(1) == [0] and positions(7) == [0, 3, 6] and positions(4096) == [0, 2048, 4095]


@pytest.mark.parametrize("name", ["eager", "triton"])
@pytest.mark.parametrize("op", OPS)
def test_honest_implementations_are_batch_invariant_and_deterministic(name, op):
    impl = get(name)
    if not impl.available("cpu"):
        pytest.skip(impl.unavailable("cpu"))
    r = check_invariance(impl, op, "cpu", **SMALL)
    assert r.status == "done", r.error
    # an op without a backward (the FP8 ops) has no backward property
    assert props(r) == (True, True if get_op(op).offers("bwd") else None, True), r.first_mismatch()
    assert r.probes == ["bf16 N=1024", "bf16+fp32 N=1024", "fp32 N=1024"] and not r.mismatches


def test_a_batch_dependent_kernel_is_not_batch_invariant():
    r = check_invariance(mutant("batch_variant"), "rmsnorm", "cpu", **SMALL)
    assert r.status == "done" and props(r) == (False, False, True), r
    fwd, bwd = r.mismatches["batch_invariant_fwd"], r.mismatches["batch_invariant_bwd"]
    assert fwd["tensor"] in ("y", "rstd") and fwd["batch"] == 7 and fwd["max_abs"] > 0
    # its dx moves by ~1e-6 relative: rounded away in bf16, seen in fp32
    assert bwd["tensor"] == "dx" and bwd["dtype"] == "fp32" and bwd["row"] in positions(bwd["batch"])
    assert "deterministic" not in r.mismatches


def test_partials_summed_in_arrival_order_are_not_deterministic():
    r = check_invariance(mutant("nondeterministic"), "rmsnorm", "cpu", **SMALL)
    assert r.status == "done" and props(r) == (True, True, False), r
    m = r.mismatches["deterministic"]
    # bf16's dweight rounds the order away; fp32 parameters beside bf16 x show it
    assert m["tensor"] == "dweight" and (m["dtype"], m["weights"]) == ("bf16", "fp32") and 1 <= m["run"] < RUNS
    assert m["batch"] == 40 and m["max_abs"] > 0
    assert "dweight (bf16+fp32, N=1024, run" in r.first_mismatch()


def test_a_crash_is_a_result_and_an_unknown_is_not_a_yes():
    r = check_invariance(mutant("crashing", ("rmsnorm", "layernorm")), "layernorm", "cpu", **SMALL)
    assert r.status == "error" and "simulated" in r.error and props(r) == (None, None, None)
    skipped = check_invariance(mutant("crashing"), "layernorm", "cpu", **SMALL)
    assert skipped.status == "skip" and "does not implement" in skipped.error and props(skipped) == (None, None, None)
    with pytest.raises(ValueError, match="batch sizes"):
        check_invariance(get("eager"), "rmsnorm", "cpu", ns=(64,), batches=(0, 4))


def _outcome(tmp_path):
    impls = [get("eager"), mutant("batch_variant"), mutant("nondeterministic")]
    out = check.run(impls, ["rmsnorm"], ["fwd"], ["bf16"], [("custom", ())], "cpu", quiet=True,
                    invariance={**SMALL, "dtypes": ("bf16", "fp32")})  # fmt: skip
    assert not out.interrupted and [r["impl"] for r in out.invariance] == [i.name for i in impls]
    return out


def test_check_prints_and_writes_the_invariance(tmp_path):
    from rich.console import Console

    out = _outcome(tmp_path)
    with open(tmp_path / "screen", "w") as screen:
        con = Console(width=160, record=True, file=screen)
        check.print_summary(out, con)
    text = con.export_text()
    assert "batch invariance" in text and "mutant-nondeterministic" in text and "dweight (bf16+fp32" in text
    check.write_json(out, tmp_path / "c.json", "normbench check --invariance")
    data = json.loads((tmp_path / "c.json").read_text())
    by = {r["impl"]: r for r in data["invariance"]}
    assert by["eager"]["deterministic"] is True and by["mutant-batch_variant"]["batch_invariant_fwd"] is False
    assert by["mutant-nondeterministic"]["mismatches"]["deterministic"]["tensor"] == "dweight"
    # a plain check writes no such key
    check.write_json(check.Outcome("cpu"), tmp_path / "plain.json", "normbench check")
    assert "invariance" not in json.loads((tmp_path / "plain.json").read_text())


def test_the_leaderboard_and_the_readme_show_a_gpus_invariance_when_its_report_has_it(tmp_path):
    from harness.results import generated

    src = generated.current_reports(ROOT / "reports")[0]
    gpu = tmp_path / "reports" / src.name
    gpu.mkdir(parents=True)
    for f in ("results.jsonl", "meta.json"):
        shutil.copy(src / f, gpu / f)
    board, readme = tmp_path / "reports" / "LEADERBOARD.md", tmp_path / "README.md"
    before = generated.leaderboard([gpu], board), generated.summary([gpu], readme, board)
    assert "invariance" not in before[0] + before[1]  # no checks/invariance.json: nothing shown

    check.write_json(_outcome(tmp_path), gpu / "checks" / "invariance.json", "normbench check --invariance")
    good = json.loads((gpu / "checks" / "invariance.json").read_text())["invariance"][0]
    lb, sm = generated.leaderboard([gpu], board), generated.summary([gpu], readme, board)
    assert lb.startswith(before[0].rstrip()) and sm.startswith(before[1].rstrip())  # added after, nothing changed
    assert f"]({src.name}/checks/invariance.json)" in lb
    assert "| `eager` | yes / yes / yes |" in lb and "| `mutant-batch_variant` | **no** / **no** / yes |" in lb
    assert "rmsnorm deterministic: dweight (bf16+fp32, N=1024, run" in lb
    assert "| `eager` | yes | yes | yes |" in sm and "| `mutant-nondeterministic` | yes | yes | no (rmsnorm) |" in sm

    for bad, needle in (({"results": []}, "no 'invariance' list"), ({"invariance": [{**good, "deterministic": "yes"}]}, "deterministic is not")):
        (gpu / "checks" / "invariance.json").write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=f"invariance.json: .*{needle}"):
            generated.leaderboard([gpu], board)


def test_check_invariance_on_the_command_line(tmp_path, capsys):
    """`normbench check --invariance`: the GPU run's batches (1, 7, 4096), the dtypes asked for."""
    from harness.cli import main

    path = tmp_path / "invariance.json"
    argv = ["check", "--impl", "eager", "--op", "rmsnorm", "--direction", "fwd", "--dtype", "bf16", "--shapes", "1x7",
            "--device", "cpu", "--quiet", "--invariance", "--json", str(path)]  # fmt: skip
    assert main(argv) == 0
    assert "batch invariance and determinism" in capsys.readouterr().out
    [row] = json.loads(path.read_text())["invariance"]
    assert (row["impl"], row["op"], row["status"]) == ("eager", "rmsnorm", "done")
    assert row["batches"] == [1, 7, 4096] and row["probes"] == ["bf16 N=1024", "bf16 N=4096", "bf16+fp32 N=1024", "bf16+fp32 N=4096"]
    assert row["batch_invariant_fwd"] is row["batch_invariant_bwd"] is row["deterministic"] is True
