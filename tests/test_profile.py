"""`normbench profile`: parsing ncu's CSV, the bytes-model ratio, which points get profiled, and the
whole flow against a stand-in `ncu` executable (no GPU needed)."""

import json
import os
import stat
import sys

import pytest

from harness.results import counters
from harness.run import profile
from harness.cli import main

HEADER = '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"'


def _ncu_rows(kernel_id: int, name: str, values: dict) -> list[str]:
    return [f'"{kernel_id}","1","python3","h","{name}","1","7","(256, 1, 1)","(132, 1, 1)","0","9.0","Command line profiler metrics","{profile.METRICS[k]}","unit","{v}"' for k, v in values.items()]


# a backward in two kernels: the main one moved 1.5x the model (x and dy read twice), the partial
# reduction a little more; numbers with thousands separators as ncu prints them
MODEL_BYTES = 3 * 2**27 * 2
CANNED = "\n".join(
    ["==PROF== Connected to process 1", HEADER]
    + _ncu_rows(0, "bwd_main", {"time_ns": "200,000", "dram_read_bytes": f"{2 * 2**28 * 2:,}", "dram_write_bytes": f"{2**28:,}", "dram_pct_of_peak": "80", "l2_hit_pct": "40", "warps_active_pct": "50", "registers_per_thread": "128"})
    + _ncu_rows(1, "bwd_partials", {"time_ns": "10,000", "dram_read_bytes": "1,000,000", "dram_write_bytes": "1,000", "dram_pct_of_peak": "20", "l2_hit_pct": "90", "warps_active_pct": "30", "registers_per_thread": "32"})
    + ["==PROF== Disconnected from process 1"]
)


def test_parse_and_summarize_against_the_bytes_model():
    kernels = profile.parse_ncu_csv(CANNED)
    assert [k["kernel"] for k in kernels] == ["bwd_main", "bwd_partials"]
    assert kernels[0]["time_ns"] == 200_000 and kernels[0]["dram_read_bytes"] == 2 * 2**28 * 2
    s = profile.summarize(kernels, MODEL_BYTES)
    dram = 2 * 2**28 * 2 + 2**28 + 1_001_000
    assert s["kernels"] == 2
    assert s["dram_bytes"] == dram
    assert s["dram_over_model"] == pytest.approx(dram / MODEL_BYTES)
    assert 1.6 < s["dram_over_model"] < 1.7  # x and dy twice: (2 + 2 + 1) / 3
    assert s["dram_tbps"] == pytest.approx(dram / 210_000 / 1e3)
    # percentages are weighted by kernel time, not averaged per kernel
    assert s["l2_hit_pct"] == pytest.approx((40 * 200_000 + 90 * 10_000) / 210_000)
    assert s["max_registers_per_thread"] == 128


def test_parse_ignores_chatter_and_unknown_metrics():
    text = "some program output\n" + HEADER + "\n" + _ncu_rows(3, "k", {"time_ns": "5"})[0] + '\n"3","1","p","h","k","1","7","b","g","0","9.0","s","other__metric","u","n/a"'
    (k,) = profile.parse_ncu_csv(text)
    assert k["time_ns"] == 5 and "other__metric" not in k
    assert profile.parse_ncu_csv("==ERROR== no kernels were profiled") == []


def _row(impl, dsl, op, direction, n, frac, status="ok", dtype="bf16"):
    m = 2**27 // n
    return {"impl": impl, "dsl": dsl, "external": dsl == "external", "op": op, "direction": direction, "shape_set": "sweep", "shape": f"{m}x{n}",
            "M": m, "N": n, "dtype": dtype, "status": status, "tbps": 4 * frac, "frac_roofline": frac, "ms": 1 / frac,
            "bytes_main": 3 * m * n * 2, "bytes_extra": 0, "noisy": False}  # fmt: skip


ROWS = [
    _row("triton", "triton", "rmsnorm", "bwd", 4096, 0.9),
    _row("triton", "triton", "rmsnorm", "bwd", 262144, 0.4),
    _row("triton-rmsnorm-llm", "llm-triton", "rmsnorm", "bwd", 4096, 0.5),
    _row("cute", "cute", "rmsnorm", "bwd", 4096, 0.8),
    _row("cute", "cute", "rmsnorm", "bwd", 262144, 0.1, status="failed"),
    _row("quack", "external", "rmsnorm", "bwd", 4096, 0.85),
    _row("triton", "triton", "rmsnorm", "fwd", 4096, 0.95),
    _row("triton", "triton", "rmsnorm", "fwd", 4096, 0.95, dtype="fp16"),
]


def test_select_points_best_of_each_dsl_passed_only():
    pts = profile.select_points(ROWS, {4096, 262144})
    got = sorted((p["impl"], p["direction"], p["N"]) for p in pts)
    assert got == [("cute", "bwd", 4096), ("quack", "bwd", 4096), ("triton", "bwd", 4096), ("triton", "bwd", 262144),
                   ("triton", "fwd", 4096), ("triton-rmsnorm-llm", "bwd", 4096)]  # fmt: skip
    assert all(p["dtype"] == "bf16" and p["status"] == "ok" for p in pts)


def test_select_points_by_glob_op_and_direction():
    pts = profile.select_points(ROWS, {4096}, impl="llm-*,quack", directions=["bwd"])
    assert sorted(p["impl"] for p in pts) == ["quack", "triton-rmsnorm-llm"]
    assert profile.select_points(ROWS, {4096}, ops=["layernorm"]) == []


@pytest.fixture
def fake_ncu(tmp_path, monkeypatch):
    """An `ncu` on PATH that records its command line and prints the canned CSV."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (tmp_path / "canned.csv").write_text(CANNED)
    script = bindir / "ncu"
    script.write_text(f"#!{sys.executable}\nimport sys, pathlib\n"
                      f"pathlib.Path({str(tmp_path / 'argv.json')!r}).write_text(__import__('json').dumps(sys.argv[1:]))\n"
                      f"print(pathlib.Path({str(tmp_path / 'canned.csv')!r}).read_text())\n")  # fmt: skip
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    return tmp_path


def test_profile_end_to_end_with_a_stand_in_ncu(fake_ncu, tmp_path):
    report = tmp_path / "report"
    report.mkdir()
    (report / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    result = profile.profile(report, ns=[262144])
    (p,) = result["points"]
    assert (p["impl"], p["N"], p["kernels"]) == ("triton", 262144, 2)
    assert p["dram_over_model"] == pytest.approx((2 * 2**28 * 2 + 2**28 + 1_001_000) / p["bytes_main"])
    argv = json.loads((tmp_path / "argv.json").read_text())
    assert argv[:2] == ["--clock-control", "none"] and "--print-units" in argv and "base" in argv
    assert "run_one('triton', 'rmsnorm', 'bwd', '512x262144', 'bf16')" in argv[-1]
    # a second run merges by point instead of appending duplicates
    profile.profile(report, ns=[262144, 4096], impl="triton")
    saved = json.loads((report / "profile.json").read_text())["points"]
    assert sorted((q["direction"], q["N"]) for q in saved) == [("bwd", 4096), ("bwd", 262144), ("fwd", 4096)]
    md = "\n".join(counters.markdown(report))
    assert "DRAM / model" in md and "| rmsnorm | bwd | 512x262144 | triton | 2 |" in md


def test_profile_records_a_failing_child_without_stopping(tmp_path, monkeypatch):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    script = bindir / "ncu"
    script.write_text(f"#!{sys.executable}\nimport sys\nprint('==ERROR== The application returned an error code (1).', file=sys.stderr)\nsys.exit(1)\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    report = tmp_path / "report"
    report.mkdir()
    (report / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    result = profile.profile(report, ns=[4096], directions=["bwd"])
    assert len(result["points"]) == 4 and all("no kernel profiled (exit 1)" in p["error"] for p in result["points"])
    assert "returned an error code" in result["points"][0]["error"]


def test_profile_errors_are_one_line(tmp_path, monkeypatch, capsys):
    report = tmp_path / "report"
    report.mkdir()
    with pytest.raises(ValueError, match="no results.jsonl"):
        profile.profile(report)
    (report / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    with pytest.raises(ValueError, match="no passed sweep point"):
        profile.profile(report, ns=[1000])
    monkeypatch.setattr(profile, "find_ncu", lambda: None)
    with pytest.raises(ValueError, match="ncu .* not found"):
        profile.profile(report, ns=[4096])
    if not __import__("torch").cuda.is_available():
        assert main(["profile", str(report)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "needs a CUDA GPU" in err[0]
