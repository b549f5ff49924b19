"""The generated documents are what the generator makes of the committed reports: the README's
implementation table and summary, and reports/LEADERBOARD.md (each regenerated here and compared)."""

from pathlib import Path

from harness.results import generated

ROOT = Path(__file__).resolve().parent.parent
README, BOARD = ROOT / "README.md", ROOT / "reports" / "LEADERBOARD.md"


def test_leaderboard_is_regenerated_from_each_gpus_current_report():
    dirs = generated.current_reports(ROOT / "reports")
    assert len(dirs) >= 2, dirs  # the H100's and the H200's
    fresh = generated.leaderboard(dirs, BOARD)
    assert generated.section(BOARD.read_text(), "leaderboard") == fresh.strip(), "run: normbench report --update-leaderboard"
    for d in dirs:
        assert f"]({d.name}/report.md)" in fresh


def test_readme_summary_is_regenerated_from_each_gpus_current_report():
    dirs = generated.current_reports(ROOT / "reports")
    fresh = generated.summary(dirs, README, BOARD)
    assert generated.section(README.read_text(), "summary") == fresh.strip(), "run: normbench report --update-leaderboard"
    assert "(reports/LEADERBOARD.md)" in fresh


def test_readme_is_a_document_not_a_table_dump():
    assert len(README.read_text().splitlines()) <= 600
    assert "<!-- leaderboard:start -->" not in README.read_text()


def test_points_below_target_count_failures_and_each_dsls_own_bar():
    from harness.results import targets

    def row(dsl, direction, n, frac, status="ok", impl=None, shape_set="small", dtype="bf16"):
        return {"impl": impl or dsl, "dsl": dsl, "op": "rmsnorm", "direction": direction, "N": n, "frac_roofline": frac,
                "status": status, "shape_set": shape_set, "dtype": dtype}  # fmt: skip

    rows = [
        row("triton", "fwd", 128, 0.91),  # at its bar
        row("triton", "fwd", 128, 0.89),  # below 90%
        row("triton", "bwd", 65536, 0.76),  # wide backward: 75%
        row("triton", "bwd", 4001, 0.69),  # odd width: 70%
        row("triton", "bwd", 1024, None, status="failed"),  # a failed point counts as below
        row("triton", "fwd", 128, 0.10, status="skip"),  # not attempted: not counted
        row("triton", "fwd", 128, 0.10, impl="llm-triton-x"),  # not the hand-written kernel
        row("triton", "fwd", 128, 0.10, shape_set="decode"),  # not a regime with a target
        row("triton", "fwd", 128, 0.10, dtype="fp16"),  # another dtype
        row("cutile", "bwd", 1024, 0.76),
        row("cute", "bwd", 65536, 0.89),  # CuTe DSL: 90% everywhere
    ]
    assert targets.below(rows) == {"triton": (3, 5), "cutile": (0, 1), "cute": (1, 1)}
    assert targets.target("eager", "fwd", 1024) is None
