"""Bad input on the command line and in report files: one line on stderr naming what is wrong
(the file and the line, for a file), exit status 2, no traceback, and nothing written or deleted.

One table per entry point; the report-file cases run through every command that reads them."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness.cli import main
from harness.run.bench import run_bench

ROOT = Path(__file__).resolve().parent.parent
META = {"gpu": "Fake GPU", "copy_bandwidth_tbps": 4.0, "runs": [{"command": "normbench bench", "copy_bandwidth": {"tbps": 4.0}}]}


def _point(impl="eager", n=1024, ms=2.0):
    return {"impl": impl, "dsl": "eager", "external": False, "op": "rmsnorm", "direction": "fwd", "shape_set": "sweep",
            "shape": f"{2**20 // n}x{n}", "M": 2**20 // n, "N": n, "dtype": "bf16", "status": "ok", "ms": ms,
            "tbps": 1.0 / ms, "frac_roofline": 0.25, "noisy": False, "run": 0}  # fmt: skip


def _folder(path: Path, results: str | None = None, meta: str | None = None) -> Path:
    """A benchmark folder; ``results`` / ``meta`` replace the valid files ('DIR': a folder instead)."""
    path.mkdir(parents=True)
    good = "".join(json.dumps(_point(n=n)) + "\n" for n in (1024, 2048, 4096))
    for name, text in (("results.jsonl", good if results is None else results), ("meta.json", json.dumps(META) if meta is None else meta)):
        if text == "DIR":
            (path / name).mkdir()
        else:
            (path / name).write_text(text)
    return path


def _one_line_exit_2(argv, capsys, *needles):
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err
    return err


GOOD = "".join(json.dumps(_point(n=n)) + "\n" for n in (1024, 2048))
# (results.jsonl text, meta.json text, what the message must name)
BAD_FILES = {
    "results-empty-object": ("{}\n", None, ["results.jsonl", "line 1", "no 'impl'"]),
    "results-foreign-object": ('{"foo": 1}\n', None, ["results.jsonl", "line 1", "no 'impl'"]),
    "results-list": ("[1, 2]\n", None, ["results.jsonl", "line 1", "a list"]),
    "results-number": ("5\n", None, ["results.jsonl", "line 1", "a number"]),
    "results-not-json": ("hello\n" + GOOD, None, ["results.jsonl", "line 1", "not valid JSON"]),
    "results-bad-middle-line": (GOOD + "{oops\n" + GOOD, None, ["results.jsonl", "line 3", "not valid JSON"]),
    "results-bad-status": (json.dumps({**_point(), "status": "great"}) + "\n", None, ["results.jsonl", "line 1", "unknown status"]),
    "results-string-M": (json.dumps({**_point(), "M": "8"}) + "\n", None, ["results.jsonl", "line 1", "'M'"]),
    "results-ok-without-time": (json.dumps({**_point(), "ms": None}) + "\n", None, ["results.jsonl", "line 1", "'ms'"]),
    "results-directory": ("DIR", None, ["results.jsonl", "is a directory"]),
    # rows `rank` took but `report` (or a merge, after rewriting its destination) choked on
    "results-ok-tbps-null": (GOOD + json.dumps({**_point(), "tbps": None}) + "\n", None, ["results.jsonl", "line 3", "'tbps'"]),
    "results-ok-tbps-missing": (json.dumps({k: v for k, v in _point().items() if k != "tbps"}) + "\n", None, ["results.jsonl", "line 1", "'tbps'"]),
    "results-check-a-list": (json.dumps({**_point(), "check": ["pass"]}) + "\n", None, ["results.jsonl", "line 1", "'check' is a list"]),
    "results-run-null": (GOOD + json.dumps({**_point(), "run": None}) + "\n", None, ["results.jsonl", "line 3", "'run' is null"]),
    "results-weights-list": (json.dumps({**_point(), "weights": ["fp32"]}) + "\n", None, ["results.jsonl", "line 1", "'weights' is a list"]),
    "results-op-a-path": (json.dumps({**_point(), "op": "../x"}) + "\n", None, ["results.jsonl", "line 1", "'op'"]),
    "results-huge-integer": ('{"M": ' + "9" * 5000 + "}\n", None, ["results.jsonl", "line 1", "not readable JSON"]),
    "results-nested-too-deep": ("[" * 100000 + "]" * 100000 + "\n", None, ["results.jsonl", "line 1", "not readable JSON"]),
    "results-lone-surrogate": (json.dumps({**_point(), "impl": "\ud800"}) + "\n", None, ["results.jsonl", "line 1", "not valid Unicode"]),
    "results-infinite-time": (json.dumps({**_point(), "ms": float("inf")}) + "\n", None, ["results.jsonl", "line 1", "'ms'"]),
    "meta-list": (None, "[]", ["meta.json", "a list"]),
    "meta-number": (None, "3", ["meta.json", "a number"]),
    "meta-not-json": (None, "{\n  nope", ["meta.json", "line 2", "not valid JSON"]),
    "meta-empty-file": (None, "", ["meta.json", "line 1", "not valid JSON"]),
    "meta-runs-not-a-list": (None, '{"runs": 5}', ["meta.json", "'runs'"]),
    "meta-copy-bandwidth-string": (None, '{"copy_bandwidth_tbps": "fast"}', ["meta.json", "copy_bandwidth_tbps"]),
    "meta-directory": (None, "DIR", ["meta.json", "is a directory"]),
    "meta-run-started-int": (None, json.dumps({**META, "runs": [{**META["runs"][0], "started": 20261123}]}), ["meta.json", "run 0", "'started'"]),
    "meta-run-copy-bandwidth-list": (None, json.dumps({**META, "runs": [{"copy_bandwidth": [4.0]}]}), ["meta.json", "run 0", "'copy_bandwidth'"]),
    "meta-run-commit-number": (None, json.dumps({**META, "runs": [{"git_commit": 1234}]}), ["meta.json", "run 0", "'git_commit'"]),
    "meta-versions-list": (None, json.dumps({**META, "versions": ["torch"]}), ["meta.json", "'versions'"]),
    "meta-gpu-object": (None, json.dumps({**META, "gpu": {"name": "H100"}}), ["meta.json", "'gpu'"]),
}


def _snapshot(d: Path) -> dict:
    return {p.name: (p.read_bytes() if p.is_file() else "DIR") for p in sorted(d.iterdir())}


@pytest.mark.parametrize("case", list(BAD_FILES))
@pytest.mark.parametrize("command", ["rank", "report", "merge-dest", "merge-source"])
def test_report_files_of_the_wrong_shape(command, case, tmp_path, capsys):
    results, meta, needles = BAD_FILES[case]
    bad = _folder(tmp_path / "bad", results, meta)
    before = _snapshot(bad)
    if command == "rank":
        argv = ["rank", str(bad)]
    elif command == "report":
        argv = ["report", str(bad)]
    elif command == "merge-dest":
        argv = ["merge", str(bad), str(_folder(tmp_path / "good"))]
    else:
        argv = ["merge", str(_folder(tmp_path / "good")), str(bad)]
    good = tmp_path / "good"
    before_good = _snapshot(good) if good.exists() else None
    _one_line_exit_2(argv, capsys, str(bad), *needles)
    assert _snapshot(bad) == before
    if before_good is not None:  # the other folder of a merge, its destination included, as it was
        assert _snapshot(good) == before_good


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_resume_refuses_a_damaged_folder_and_leaves_it_as_it_was(case, tmp_path):
    results, meta, needles = BAD_FILES[case]
    bad = _folder(tmp_path / "bad", results, meta)
    before = _snapshot(bad)
    with pytest.raises(ValueError) as e:
        run_bench([], ["rmsnorm"], ["fwd"], [], ["bf16"], bad, resume=True, device="cpu", copy_bandwidth={"tbps": 1.0}, progress=False)
    assert all(n in str(e.value) for n in needles) and "\n" not in str(e.value)
    assert _snapshot(bad) == before


def test_resume_drops_only_a_cut_off_last_line_and_says_so(tmp_path, capsys):
    here = json.dumps({**META, "gpu": "cpu"})  # resumed on this machine's device
    d = _folder(tmp_path / "run", results=GOOD + json.dumps(_point(n=4096))[:30], meta=here)
    run_bench([], ["rmsnorm"], ["fwd"], [], ["bf16"], d, resume=True, device="cpu", copy_bandwidth={"tbps": 1.0}, progress=False)
    assert (d / "results.jsonl").read_text() == GOOD  # the complete lines byte for byte, the cut one gone
    err = capsys.readouterr().err
    assert "line 3 is cut off" in err and len(err.strip().splitlines()) == 1
    # a complete last line without its newline is kept (and ended), not dropped
    d2 = _folder(tmp_path / "run2", results=GOOD.rstrip("\n"), meta=here)
    run_bench([], ["rmsnorm"], ["fwd"], [], ["bf16"], d2, resume=True, device="cpu", copy_bandwidth={"tbps": 1.0}, progress=False)
    assert (d2 / "results.jsonl").read_text() == GOOD


def test_rank_with_nothing_to_rank_fails(tmp_path, capsys):
    _one_line_exit_2(["rank", str(_folder(tmp_path / "empty", results=""))], capsys, "no benchmark points")
    skipped = json.dumps({**_point(), "status": "skip", "ms": None, "tbps": None, "frac_roofline": None}) + "\n"
    _one_line_exit_2(["rank", str(_folder(tmp_path / "skipped", results=skipped))], capsys, "nothing to rank", "skipped")
    # and one that has something prints it, exit 0
    assert main(["rank", str(_folder(tmp_path / "ok"))]) == 0
    assert "eager" in capsys.readouterr().out


def _unwritable(tmp_path) -> str:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    return str(blocker / "sub" / "out")


# argv (with {T} for a scratch folder) -> what the one line must say. Every case must fail before
# any work: the check cases would take seconds if they ran first.
BAD_ARGS = [
    (["check", "--impl", "eager", "--json", "{T}"], "is a folder"),
    (["check", "--impl", "eager", "--json", "{BLOCKED}"], "not a folder"),
    (["check", "--shapes", "4x0"], "must be >= 1"),
    (["check", "--shapes", "4x"], "bad shape"),
    (["check", "--shapes", "2x3x0:column-slice"], "must be >= 1"),
    (["check", "--seed", "x"], "check: argument --seed"),
    (["check", "--nope"], "unrecognized arguments"),
    # a seed torch cannot take (or folds onto another) is bad input, not an implementation's error
    (["check", "--impl", "eager", "--seed", str(2**70)], "check: argument --seed: must be an integer from 0 to 2**63 - 1"),
    (["check", "--impl", "eager", "--seed", str(2**63)], "check: argument --seed"),
    (["check", "--impl", "eager", "--seed", "-1"], "check: argument --seed: must be an integer from 0"),
    # an empty --impl would select every implementation (an empty --op is refused already)
    (["check", "--impl", "", "--device", "cuda"], "check: argument --impl: '' names no implementation"),
    (["check", "--impl", ",", "--device", "cuda"], "check: argument --impl: ',' names no implementation"),
    (["bench", "--impl", " "], "bench: argument --impl"),
    (["warm", "--out", "{T}/w", "--impl", ""], "warm: argument --impl"),
    (["overhead", "--impl", "", "--device", "cuda"], "overhead: argument --impl"),
    (["profile", "--impl", ""], "profile: argument --impl"),
    (["tune", "--impl", ""], "tune: argument --impl"),
    (["model", "--impl", "", "--device", "cuda"], "model: argument --impl"),
    (["list", "--json", "--markdown"], "list: argument --markdown: not allowed with argument --json"),
    (["list", "--update-readme", "--json", "--readme", "{T}/missing.md"], "not allowed with argument --update-readme"),
    (["bench", "--resume", "--overwrite", "--out", "{GOOD}"], "bench: argument --overwrite: not allowed with argument --resume"),
    (["bench", "--retry-noisy", "--out", "{T}/b"], "--retry-noisy measures again the noisy points of a folder: it goes with --resume"),
    (["overhead", "--shape", "4x0"], "must be >= 1"),
    (["overhead", "--out", "{T}"], "is a folder"),
    (["codegen", "helion", "--out", "{BLOCKED}"], "not a folder"),
    (["codegen", "helion", "--n", "x"], "codegen: argument --n"),
    (["list", "--update-readme", "--readme", "{T}/missing.md"], "no such file"),
    (["list", "--update-readme", "--readme", "{T}"], "is a folder"),
    (["report", "{GOOD}", "--update-leaderboard", "--readme", "{T}/missing.md"], "no such file"),
    (["report", "{GOOD}", "--update-leaderboard", "--leaderboard", "{T}/missing.md"], "no such file"),
    (["rank", "{T}/nowhere"], "no such benchmark folder"),
    (["merge", "{GOOD}"], "merge: the following arguments are required"),
    (["tune", "--impl", "helion"], "needs a CUDA GPU"),
    (["warm", "--out", "{T}/w"], "needs a CUDA GPU"),
    (["warm", "--out", "{T}/w", "--jobs", "0"], "--jobs must be >= 1"),
    (["warm", "--impl", "eager"], "warm: the following arguments are required: --out"),
    (["bench", "--out", "{GOOD}", "--impl", "eager"], "already holds benchmark results"),
    (["tritonbench", "--op"], "tritonbench: argument --op: expected one argument"),
    (["generate", "--samples", "x"], "generate"),
    (["frobnicate"], "invalid choice"),
    ([], "the following arguments are required"),
]


@pytest.mark.parametrize("argv,needle", BAD_ARGS, ids=[" ".join(a) or "(none)" for a, _ in BAD_ARGS])
def test_bad_arguments_are_one_line_and_exit_2(argv, needle, tmp_path, capsys):
    import torch

    if (argv[:1] == ["tune"] or argv[:1] == ["warm"] and "--jobs" not in argv) and torch.cuda.is_available():
        pytest.skip("a GPU is present")
    good = _folder(tmp_path / "good")
    before = _snapshot(good)
    subs = {"{T}": str(tmp_path), "{BLOCKED}": _unwritable(tmp_path), "{GOOD}": str(good)}
    argv = [subs.get(a, a) for a in argv]
    argv = [a.replace("{T}", str(tmp_path)) for a in argv]
    err = _one_line_exit_2(argv, capsys, needle)
    assert "--device" not in err or argv[:1] != ["tune"]
    assert _snapshot(good) == before and not (tmp_path / "missing.md").exists()


def test_report_update_leaderboard_checks_the_readme_before_writing_the_report(tmp_path, capsys):
    good = _folder(tmp_path / "good")
    _one_line_exit_2(["report", str(good), "--update-leaderboard", "--readme", str(tmp_path / "no.md")], capsys, "no such file")
    assert not (good / "report.md").exists()


def test_tritonbench_help_exits_0_even_without_tritonbench():
    out = subprocess.run([sys.executable, "-m", "harness", "tritonbench", "--help"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "normbench tritonbench" in out.stdout and "Traceback" not in out.stderr


def test_every_option_has_help_text():
    from harness.cli import build_parser

    parser = build_parser()
    subs = next(a for a in parser._actions if a.dest == "cmd").choices
    missing = [f"{name} {opt.option_strings or opt.dest}" for name, sub in subs.items() for opt in sub._actions
               if opt.dest not in ("help", "rest") and not opt.help]  # fmt: skip
    assert not missing, missing


@pytest.mark.parametrize("where", ["proc", "under-a-file"])
def test_unwritable_output_folder(tmp_path, capsys, where):
    """Paths that nobody can create, root included (CI runs as root): under /proc, and under a
    regular file."""
    if where == "proc":
        if not Path("/proc").is_dir():
            pytest.skip("no /proc on this system")
        out, needle = "/proc/normbench/c.json", "cannot write"
    else:
        (tmp_path / "plain").write_text("")
        out, needle = str(tmp_path / "plain" / "c.json"), "not a folder"
    _one_line_exit_2(["check", "--impl", "eager", "--json", out], capsys, needle)
