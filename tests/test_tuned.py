"""Which tuned table an implementation with per-GPU configs reads (harness/tuned.py), and that the
benchmark and report say so."""

import warnings

import pytest
import torch

from harness.spec import tuned
from harness.registry import get
from harness.results.report import _config_section
from harness.run.bench import config_source
from impls.helion import configs as helion_configs
from impls.triton import configs as C

TABLES = ["NVIDIA H200", "Some sm_80 GPU"]


@pytest.fixture(autouse=True)
def _no_override(monkeypatch):
    monkeypatch.delenv(tuned.ENV, raising=False)
    monkeypatch.setitem(tuned.CAPABILITY, "Some sm_80 GPU", (8, 0))


def test_own_table_first_then_same_capability_then_heuristic():
    assert tuned.table_for("NVIDIA H200", TABLES, (9, 0)) == ("NVIDIA H200", "tuned")
    assert tuned.table_for("NVIDIA H100 80GB HBM3", TABLES, (9, 0)) == ("NVIDIA H200", "borrowed from NVIDIA H200 (sm_90)")
    assert tuned.table_for("NVIDIA A100-SXM4-80GB", TABLES, (8, 0)) == ("Some sm_80 GPU", "borrowed from Some sm_80 GPU (sm_80)")
    assert tuned.table_for("NVIDIA B200", TABLES, (10, 0)) == (None, "heuristic")
    assert tuned.table_for("NVIDIA B200", TABLES, None) == (None, "heuristic")


def test_override_forces_a_table_or_the_heuristic(monkeypatch):
    monkeypatch.setenv(tuned.ENV, "heuristic")
    assert tuned.table_for("NVIDIA H200", TABLES, (9, 0))[0] is None
    monkeypatch.setenv(tuned.ENV, "Some sm_80 GPU")
    assert tuned.table_for("NVIDIA H200", TABLES, (9, 0)) == ("Some sm_80 GPU", f"borrowed from Some sm_80 GPU ({tuned.ENV})")
    monkeypatch.setenv(tuned.ENV, "No Such GPU")
    with pytest.raises(ValueError, match="no table for that GPU"):
        tuned.table_for("NVIDIA H200", TABLES, (9, 0))


def test_triton_reads_the_borrowed_table_and_says_where_from(monkeypatch):
    h200 = "NVIDIA H200"
    # the first tuned table of the same capability, in name order
    first = sorted(g for g in C.pinned_table() if tuned.CAPABILITY.get(g) == (9, 0))[0]
    for n in (1024, 2880, 16384, 262144):
        for direction in ("fwd", "bwd"):
            assert C.resolve(h200, "rmsnorm", direction, n, (9, 0)) == (C.pinned(h200, "rmsnorm", direction, n), "tuned")
            cfg, how = C.resolve("NVIDIA H800", "rmsnorm", direction, n, (9, 0))
            assert (cfg, how) == (C.pinned(first, "rmsnorm", direction, n), f"borrowed from {first} (sm_90)")
            cfg, how = C.resolve("NVIDIA B200", "rmsnorm", direction, n, (10, 0))
            assert (cfg, how) == (C.heuristic(direction, n), "heuristic")
    monkeypatch.setenv(tuned.ENV, "heuristic")
    assert C.resolve(h200, "layernorm", "bwd", 2880, (9, 0))[0] == C.heuristic("bwd", 2880)


def test_helion_reads_the_borrowed_table_and_says_where_from():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a borrowed table is no reason to warn
        own = helion_configs.pinned("rmsnorm_bwd", 4096, "bf16", "NVIDIA H200", (9, 0))
        borrowed = helion_configs.pinned("rmsnorm_bwd", 4096, "bf16", "NVIDIA H800", (9, 0))
    assert own.source == "tuned"
    # the first tuned table of the same capability, in name order
    first = sorted(g for g in helion_configs.table() if tuned.CAPABILITY.get(g) == (9, 0))[0]
    assert borrowed.config == helion_configs.pinned("rmsnorm_bwd", 4096, "bf16", first, (9, 0)).config
    assert borrowed.source == f"tuned, borrowed from {first} (sm_90)"
    with pytest.warns(UserWarning, match="default config"):
        other = helion_configs.pinned("rmsnorm_bwd", 4096, "bf16", "NVIDIA B200", (10, 0))
    assert other.source == "default"


def test_the_benchmark_records_provenance_and_the_report_counts_it():
    cpu = torch.device("cpu")
    assert config_source(get("triton"), "rmsnorm", ("fwd", "bwd"), 4096, "bf16", cpu) == "fwd: interpreter; bwd: interpreter"
    assert config_source(get("eager"), "rmsnorm", ("fwd",), 4096, "bf16", cpu) == ""
    rows = [
        {"impl": "triton", "status": "ok", "config": "fwd: borrowed from NVIDIA H200 (sm_90)"},
        {"impl": "triton", "status": "ok", "config": "fwd: tuned; bwd: tuned"},
        {"impl": "triton", "status": "failed", "config": "fwd: tuned"},
        {"impl": "eager", "status": "ok"},
    ]
    text = "\n".join(_config_section(rows))
    assert "| triton | borrowed from NVIDIA H200 (sm_90) | 1 |" in text
    assert "| triton | tuned | 2 |" in text and "eager" not in text
    assert _config_section([{"impl": "eager", "status": "ok"}]) == []
