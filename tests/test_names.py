"""What the README promises a newcomer, and what committed files are called: the CPU install line,
the LLM samples' recorded generator, and report folders named by what they hold."""

import json
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _tracked(*paths) -> list[str]:
    out = subprocess.run(["git", "-C", str(ROOT), "ls-files", *paths], capture_output=True, text=True)
    return out.stdout.splitlines() if out.returncode == 0 else [p.relative_to(ROOT).as_posix() for p in ROOT.glob("reports/**/*")]


def test_quick_start_gives_a_cpu_build_of_pytorch_and_ci_keeps_its_pin():
    readme = (ROOT / "README.md").read_text()
    quick = readme[readme.index("## Quick start") : readme.index("## The contract")]
    cpu = "pip install torch --index-url https://download.pytorch.org/whl/cpu"
    assert cpu in quick
    # the CPU build comes first, the extras (which would pull a CUDA torch) after it
    assert quick.index(cpu) < quick.index("pip install -e '.[triton,helion,cute,dev]'")
    assert re.search(r"takes a while\*\*: \d+ minutes on 2 CPU cores", quick)  # the expected time of `normbench check` on the CPU
    assert "pip install -q torch==2.13.0" in (ROOT / ".ci" / "run").read_text()


def test_llm_samples_record_the_model_and_how_it_was_run():
    from impls.llm.samples import read_sample, sample_folders

    folders = sample_folders(ROOT / "impls" / "llm")
    assert folders
    for folder in folders:
        s = read_sample(folder)
        gen = s.metadata["generator"]
        assert gen["model"] == "claude" and gen["provider"] == "Anthropic" and "fresh context" in gen["how"]
        assert "endpoint" not in gen and "no endpoint" in gen["how"]
        # the folder is <dsl>-<op>-<model>-<date>-<k>
        assert re.fullmatch(rf"{s.dsl}-{s.op}-claude-{s.metadata['date'].replace('-', '')}-\d+", folder.name), folder.name


def test_no_made_up_model_name_or_working_names_in_committed_files():
    for path in _tracked("reports", "README.md", "impls"):
        p = ROOT / path
        if p.is_file() and p.suffix in (".md", ".json", ".jsonl", ".csv", ".log", ".txt", ".py"):
            assert "claude-subagent" not in p.read_text(errors="replace"), path
        assert not any(re.fullmatch(r"session\d.*", part) for part in Path(path).parts), path


def test_committed_results_name_registered_implementations():
    from harness.registry import all_implementations

    names = set(all_implementations())
    for path in _tracked("reports"):
        if path.endswith("results.jsonl"):
            llm = {json.loads(line)["impl"] for line in (ROOT / path).read_text().splitlines() if '"llm-' in line}
            assert llm <= names, (path, llm - names)
