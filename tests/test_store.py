"""The results store: merging benchmark folders (checked before anything is written, written
atomically, each run recorded once, a skipped point never over a measured one), the folder lock
against concurrent writers, and every command that reads a folder's files (rank, report, merge) on
hand-edited files: a result, or one line naming the file, never a traceback."""

import copy
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from harness.cli import main
from harness.results import store
from harness.results.store import folder_lock, merge_results

ROOT = Path(__file__).resolve().parent.parent
GPU = "Fake GPU"


def _point(impl="eager", n=1024, ms=2.0, status="ok", direction="fwd", run=0, shape_set="sweep"):
    ok = status == "ok"
    return {"impl": impl, "dsl": impl, "external": False, "op": "rmsnorm", "direction": direction, "shape_set": shape_set,
            "shape": f"{2**20 // n}x{n}", "M": 2**20 // n, "N": n, "dtype": "bf16", "weights": "same", "status": status,
            "reason": "" if status != "skip" else "runs on cuda only", "check": "pass" if ok else "",
            "ms": ms if ok else None, "tbps": 1.0 / ms if ok else None, "frac_roofline": 0.25 / ms if ok else None,
            "noisy": False, "run": run}  # fmt: skip


def _run(started, command="normbench bench", tbps=4.0, commit="aaaa"):
    return {"command": command, "started": started, "copy_bandwidth": {"tbps": tbps}, "git_commit": commit}


def _folder(path: Path, rows, runs, gpu=GPU) -> Path:
    path.mkdir(parents=True)
    (path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (path / "meta.json").write_text(json.dumps({"gpu": gpu, "copy_bandwidth_tbps": 4.0, "runs": runs}))
    return path


def _snapshot(d: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def _dest(tmp_path):
    rows = [_point(impl, n) for impl in ("eager", "triton") for n in (1024, 4096)]
    return _folder(tmp_path / "dest", rows, [_run("2026-11-01T10:00:00Z")])


def _source(tmp_path, name="src", started="2026-11-02T10:00:00Z", rows=None):
    rows = rows if rows is not None else [_point("triton", n, ms=1.0) for n in (1024, 4096)]
    return _folder(tmp_path / name, rows, [_run(started, tbps=4.1, commit="bbbb")])


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


# A source row or run of each kind that `merge` took, rewriting its destination, and that the
# report then refused: (where, mutation, what the message names)
BAD_SOURCES = {
    "tbps null": ("row", lambda r: r.update(tbps=None), ["results.jsonl", "line 2", "'tbps'"]),
    "tbps missing": ("row", lambda r: r.pop("tbps"), ["results.jsonl", "line 2", "'tbps'"]),
    "check a list": ("row", lambda r: r.update(check=["pass"]), ["results.jsonl", "line 2", "'check' is a list"]),
    "reason a number": ("row", lambda r: r.update(reason=3), ["results.jsonl", "line 2", "'reason'"]),
    "run null": ("row", lambda r: r.update(run=None), ["results.jsonl", "line 2", "'run' is null"]),
    "run a string": ("row", lambda r: r.update(run="0"), ["results.jsonl", "line 2", "'run'"]),
    "noisy a string": ("row", lambda r: r.update(noisy="yes"), ["results.jsonl", "line 2", "'noisy'"]),
    "started an int": ("run", lambda r: r.update(started=20261102), ["meta.json", "run 0", "'started'"]),
    "copy bandwidth tbps a string": ("run", lambda r: r.update(copy_bandwidth={"tbps": "4"}), ["meta.json", "run 0", "'tbps'"]),
    "commit a list": ("run", lambda r: r.update(git_commit=["bbbb"]), ["meta.json", "run 0", "'git_commit'"]),
}


@pytest.mark.parametrize("case", list(BAD_SOURCES))
def test_merge_checks_every_source_before_writing_the_destination(case, tmp_path, capsys):
    where, mutate, needles = BAD_SOURCES[case]
    dest = _dest(tmp_path)
    good = _source(tmp_path, "good")
    rows = [_point("triton", n, ms=1.0) for n in (1024, 4096)]
    runs = [_run("2026-11-03T10:00:00Z", tbps=4.2)]
    mutate(rows[1] if where == "row" else runs[0])
    bad = _folder(tmp_path / "bad", rows, runs)
    before = _snapshot(dest)
    # the good source comes first: nothing of it is written either
    assert main(["merge", str(dest), str(good), str(bad)]) == 2
    err = _one_line(capsys)
    assert str(bad) in err and all(n in err for n in needles), err
    assert _snapshot(dest) == before
    assert main(["report", str(dest)]) == 0, capsys.readouterr().err


def test_merging_a_source_twice_is_refused_and_records_each_run_once(tmp_path, capsys):
    dest, src = _dest(tmp_path), _source(tmp_path)
    assert main(["merge", str(dest), str(src)]) == 0
    capsys.readouterr()
    before = _snapshot(dest)
    assert main(["merge", str(dest), str(src)]) == 2
    err = _one_line(capsys)
    assert "already recorded" in err and "merged before" in err and str(src) in err
    assert _snapshot(dest) == before
    # the same run under another path (a copy of the folder), and twice in one command
    import shutil

    shutil.copytree(src, tmp_path / "copy")
    assert main(["merge", str(dest), str(tmp_path / "copy")]) == 2 and "already recorded" in _one_line(capsys)
    dest2 = _folder(tmp_path / "dest2", [], [_run("2026-11-01T09:00:00Z")])
    assert main(["merge", str(dest2), str(src), str(src)]) == 2 and "already recorded" in _one_line(capsys)
    assert json.loads((dest2 / "meta.json").read_text())["runs"] == [_run("2026-11-01T09:00:00Z")]
    # a --commit given for the first merge does not hide the run from the second
    dirty = _folder(tmp_path / "dirty", [_point("triton", 1024, ms=0.5)], [_run("2026-11-05T10:00:00Z", commit="cccc-dirty")])
    merge_results(dest, [dirty], commit="dddd")
    with pytest.raises(ValueError, match="already recorded"):
        merge_results(dest, [dirty], commit="dddd")
    runs = json.loads((dest / "meta.json").read_text())["runs"]
    assert [r["started"] for r in runs] == ["2026-11-01T10:00:00Z", "2026-11-02T10:00:00Z", "2026-11-05T10:00:00Z"]
    # another run that happens to share a start second is no duplicate (its copy bandwidth differs)
    twin = _folder(tmp_path / "twin", [_point("triton", 1024, ms=0.7)], [_run("2026-11-05T10:00:00Z", tbps=4.3, commit="cccc-dirty")])
    assert len(merge_results(dest, [twin])) == 4


# (dest status, source status) -> whose point the merged folder keeps
SKIP_CASES = [("ok", "skip", "dest"), ("failed", "skip", "dest"), ("error", "skip", "dest"), ("skip", "skip", "source"),
              ("skip", "ok", "source"), ("ok", "ok", "source"), ("ok", "failed", "source"), (None, "skip", "source")]  # fmt: skip


@pytest.mark.parametrize("dest_status,src_status,kept", SKIP_CASES)
def test_a_skipped_point_never_replaces_a_measured_one(dest_status, src_status, kept, tmp_path):
    rows = [_point("eager", 4096)] + ([_point("quack", 1024, status=dest_status)] if dest_status else [])
    dest = _folder(tmp_path / "dest", rows, [_run("2026-11-01T10:00:00Z")])
    src = _source(tmp_path, rows=[_point("quack", 1024, ms=0.5, status=src_status)])
    merged = merge_results(dest, [src])
    quack = [r for r in merged if r["impl"] == "quack"]
    assert len(quack) == 1 and quack[0]["status"] == (dest_status if kept == "dest" else src_status)
    assert quack[0]["run"] == (0 if kept == "dest" else 1)
    assert store.load_results(dest / "results.jsonl") == merged


def test_merge_writes_nothing_it_cannot_read_back(tmp_path, monkeypatch):
    """What is written goes to a temporary file beside the destination's, is read back, and only
    then replaces it: a write that comes out wrong leaves the destination as it was."""
    dest, src = _dest(tmp_path), _source(tmp_path)
    before = _snapshot(dest)
    real = json.dumps

    class Garbling:
        loads = staticmethod(json.loads)
        JSONDecodeError = json.JSONDecodeError

        @staticmethod
        def dumps(obj, **kw):
            text = real(obj, **kw)
            return text[: len(text) // 2] if isinstance(obj, dict) and obj.get("impl") == "triton" else text

    monkeypatch.setattr(store, "json", Garbling)
    with pytest.raises(ValueError, match="left as it was") as e:
        merge_results(dest, [src])
    assert "\n" not in str(e.value) and "results.jsonl" in str(e.value)
    assert _snapshot(dest) == before  # no temporary file left behind either


HOLD = """
import sys
from harness.results.store import folder_lock
with folder_lock(sys.argv[1], sys.argv[2]):
    print("held", flush=True)
    sys.stdin.read()
"""


@pytest.fixture
def held(tmp_path):
    """A folder held by another process, as a running `bench` holds its folder."""
    procs = []

    def hold(folder: Path, command="bench"):
        p = subprocess.Popen([sys.executable, "-c", HOLD, str(folder), command], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        procs.append(p)
        assert p.stdout.readline().strip() == "held"
        return p

    yield hold
    for p in procs:
        p.stdin.close()
        p.wait(timeout=60)


def test_a_folder_another_process_writes_is_refused(tmp_path, held, capsys):
    from harness.registry import get
    from harness.run.bench import run_bench
    from harness.spec.shapes import Shape

    dest, src = _dest(tmp_path), _source(tmp_path)
    before = _snapshot(dest)
    proc = held(dest, "bench")
    assert main(["merge", str(dest), str(src)]) == 2
    err = _one_line(capsys)
    assert "being written by another normbench process" in err and str(proc.pid) in err and "bench" in err
    with pytest.raises(ValueError, match="being written by another normbench process"):
        run_bench([get("eager")], ["rmsnorm"], ["fwd"], [("sweep", (Shape((4, 64)),))], ["bf16"], dest, resume=True,
                  device="cpu", copy_bandwidth={"tbps": 4.0}, progress=False)  # fmt: skip
    proc.stdin.close()
    proc.wait(timeout=60)
    assert {p for p in _snapshot(dest)} == set(before)  # the lock file goes with its holder
    # a source still being written is no finished run to merge
    held(src, "bench")
    assert main(["merge", str(dest), str(src)]) == 2 and "merge it when that one has finished" in _one_line(capsys)
    assert _snapshot(dest) == before


def test_the_lock_is_let_go_when_its_holder_dies(tmp_path):
    import os
    import signal

    d = _dest(tmp_path)
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(d), "bench"], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    os.kill(p.pid, signal.SIGKILL)
    p.wait(timeout=60)
    assert (d / store.LOCK_FILE).exists()  # left behind, but no longer held
    with folder_lock(d, "merge"):
        pass
    assert not (d / store.LOCK_FILE).exists()


# ---------------------------------------------------------------- hand-edited files, key by key
def _json_kinds(rng):
    """A value of each wrong kind, drawn per test so the table stays small."""
    return [None, rng.choice([True, False]), rng.randint(-(2**70), 2**70), rng.uniform(-1e6, 1e6), "x" * rng.randint(0, 3), [rng.random()], {"k": rng.random()}]


PROFILE = {"ncu": "/usr/bin/ncu", "metrics": {}, "points": [
    {"impl": "eager", "dsl": "eager", "op": "rmsnorm", "direction": "fwd", "shape": "256x4096", "N": 4096, "dtype": "bf16",
     "tbps": 2.0, "kernels": 1, "dram_over_model": 1.01, "dram_tbps": 2.9, "l2_hit_pct": 3.0, "warps_active_pct": 50.0,
     "max_registers_per_thread": 32.0},
    {"impl": "triton", "dsl": "triton", "op": "rmsnorm", "direction": "fwd", "shape": "256x4096", "N": 4096, "dtype": "bf16",
     "tbps": 2.5, "error": "no kernel profiled (exit 1)"},
]}  # fmt: skip
META = {"gpu": GPU, "driver": "1", "cuda": "13.0", "torch": "2.11", "versions": {"triton": "3.6"}, "git_commit": "aaaa",
        "copy_bandwidth_tbps": 4.0, "note": "hand-written", "runs": [_run("2026-11-01T10:00:00Z"), _run("2026-11-02T10:00:00Z", tbps=4.1)]}  # fmt: skip
ROWS = [_point("eager", n) for n in (1024, 4096)] + [_point("triton", 1024, ms=1.0), _point("triton", 4096, status="failed"),
        _point("triton", 2048, ms=1.0, shape_set="between", run=1)]  # fmt: skip


def _mutations():
    """(file, path to the value, operation): every key of each file dropped, nulled and given a wrong kind."""
    out = []
    for key in ROWS[2]:
        out += [("results.jsonl", (2, key), op) for op in ("drop", "null", "kind")]
    for key in META:
        out += [("meta.json", (key,), op) for op in ("drop", "null", "kind")]
    for key in META["runs"][0]:
        out += [("meta.json", ("runs", 0, key), op) for op in ("drop", "null", "kind")]
    out += [("meta.json", ("runs", 0, "copy_bandwidth", "tbps"), op) for op in ("drop", "null", "kind")]
    for key in ("points",):
        out += [("profile.json", (key,), op) for op in ("drop", "null", "kind")]
    for i in (0, 1):
        for key in PROFILE["points"][i]:
            out += [("profile.json", ("points", i, key), op) for op in ("drop", "null", "kind")]
    return out


MUTATIONS = _mutations()


@pytest.mark.parametrize("name,where,op", MUTATIONS, ids=[f"{n}:{'.'.join(map(str, w))}:{o}" for n, w, o in MUTATIONS])
def test_report_and_rank_on_a_hand_edited_file(name, where, op, tmp_path, capsys):
    rng = random.Random(f"{name}{where}{op}")
    data = {"results.jsonl": copy.deepcopy(ROWS), "meta.json": copy.deepcopy(META), "profile.json": copy.deepcopy(PROFILE)}
    parent = data[name]
    for k in where[:-1]:
        parent = parent[k]
    if op == "drop":
        parent.pop(where[-1])
    elif op == "null":
        parent[where[-1]] = None
    else:
        kinds = [v for v in _json_kinds(rng) if type(v) is not type(parent[where[-1]])]
        parent[where[-1]] = rng.choice(kinds)
    d = tmp_path / "run"
    d.mkdir()
    (d / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in data["results.jsonl"]))
    (d / "meta.json").write_text(json.dumps(data["meta.json"]))
    (d / "profile.json").write_text(json.dumps(data["profile.json"]))
    before = _snapshot(d)
    results = {}
    for command in ("rank", "report"):
        code = main([command, str(d)])
        err = capsys.readouterr().err.strip()
        results[command] = code
        assert code in (0, 2), err
        if code == 2:
            assert len(err.splitlines()) == 1 and "Traceback" not in err, err
            assert str(d / name) in err, err  # the file at fault
            if name == "results.jsonl":
                assert "line 3" in err, err
            assert _snapshot(d) == before  # a refused folder is not written
    # what rank takes, report takes (and the other way round: both read a folder the same way)
    assert results["rank"] == results["report"]
    if results["report"] == 0:
        assert (d / "report.md").exists() and (d / "results.csv").exists()
