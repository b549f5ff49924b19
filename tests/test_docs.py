"""Documents a reader follows: every relative link in the README, docs/ and reports/ READMEs
resolves (to a file, a folder, or a heading of a Markdown file)."""

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _documents() -> list[Path]:
    out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "*.md"], capture_output=True, text=True)
    names = out.stdout.splitlines() if out.returncode == 0 else [p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*.md")]
    return [ROOT / n for n in names if not n.startswith(("impls/llm/", ".venv/")) and (ROOT / n).exists()]


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_anchor(m[1]) for m in re.finditer(r"^#+ (.*)$", path.read_text(), flags=re.M)}


@pytest.mark.parametrize("doc", _documents(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(doc):
    broken = []
    for target in LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("mailto:"):
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(target)
    assert not broken, f"{doc.relative_to(ROOT)}: {broken}"
