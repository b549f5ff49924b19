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
