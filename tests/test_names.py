"""What the README promises a newcomer, and what committed files are called: the CPU install line,
the torch and triton CI pairs, the LLM samples' recorded generator, and report folders named by
what they hold."""

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
    # a full `normbench check` is long on a CPU: the Quick start says how to narrow it
    assert re.search(r"--impl [\w,]+", quick) and "--shapes smoke" in quick
    assert "pip install -q torch==2.13.0" in (ROOT / ".ci" / "run").read_text()


def test_quick_start_and_ci_say_which_torch_and_triton_ci_pairs_and_why():
    """CI pins torch 2.13 beside triton 3.9, which that torch's CUDA wheels do not pin: both places
    say so, with the versions CI installs and why torch 2.15 is not an option there."""
    ci = (ROOT / ".ci" / "run").read_text()
    torch_pin = re.search(r"torch==([\d.]+)", ci).group(1)
    triton_pin = re.search(r"'triton==([\d.]+)'", ci).group(1)
    readme = (ROOT / "README.md").read_text()
    quick = " ".join(readme[readme.index("## Quick start") : readme.index("## The contract")].split())
    comments = " ".join(line.lstrip("# ") for line in ci.splitlines() if line.startswith("#"))
    for text in (quick, comments):
        assert f"torch {torch_pin}" in text and f"triton {triton_pin}" in text, text[:200]
        assert "torch 2.15" in text and "2.14.1" in text and "interpreter" in text


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


# an LLM sample's name as committed files cite it: <dsl>-<op>-<model>-<YYYYMMDD>-<k>
SAMPLE_NAME = re.compile(r"\b(?:triton|helion|cute|gluon)-(?:add_rmsnorm|rmsnorm|layernorm)-[a-z][a-z0-9-]*?-\d{8}-\d+\b")
# a report folder is named by what it holds: a date, a GPU, or words (a dtype, a variant letter)
REPORT_WORD = re.compile(r"[a-z_]+|bf16|fp16|fp32|fp8|h100|h200|[A-Z]")


def test_committed_files_cite_only_stored_samples_and_name_report_folders_by_content():
    samples = {f.name for f in (ROOT / "impls" / "llm").iterdir() if (f / "metadata.json").is_file()}
    for path in _tracked("reports", "README.md", "impls"):
        p = ROOT / path
        if p.is_file() and p.suffix in (".md", ".json", ".jsonl", ".csv", ".log", ".txt", ".py"):
            cited = set(SAMPLE_NAME.findall(p.read_text(errors="replace")))
            assert cited <= samples, (path, cited - samples)
    for path in _tracked("reports"):
        for part in Path(path).parent.parts[1:]:
            ok = re.fullmatch(r"\d{4}-\d{2}-\d{2}", part) or all(REPORT_WORD.fullmatch(w) for w in part.split("-"))
            assert ok, (path, part)


def test_committed_results_name_registered_implementations():
    from harness.registry import all_implementations

    names = set(all_implementations())
    for path in _tracked("reports"):
        if path.endswith("results.jsonl"):
            llm = {json.loads(line)["impl"] for line in (ROOT / path).read_text().splitlines() if '"llm-' in line}
            assert llm <= names, (path, llm - names)
