"""Properties of what reads files and arguments: any JSON value in any field of results.jsonl,
meta.json or profile.json gives `rank`, `report` and `merge` a valid result or a one-line
ValueError naming the file (and the line, for results.jsonl), never another exception; the
command-line validators give a value or a one-line error for any text."""

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness import cli
from harness.results import rank, report, store
from harness.spec.errors import UsageError

FAST = settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
FEW = settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))

scalars = (
    st.none() | st.booleans() | st.integers() | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12)
    | st.sampled_from(["", "ok", "skip", "failed", "bf16", "fwd", "rmsnorm", "sweep", "$x$", "a/b", "\x00"])
)  # fmt: skip
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)

ROW = {"impl": "eager", "dsl": "eager", "external": False, "op": "rmsnorm", "direction": "fwd", "shape_set": "sweep",
       "shape": "1024x1024", "M": 1024, "N": 1024, "dtype": "bf16", "weights": "same", "status": "ok", "reason": "",
       "check": "pass", "compile_s": 0.5, "ms": 2.0, "ms_p95": 2.1, "trial_ms": [2.0, 2.0, 2.0], "spread": 0.0, "noisy": False,
       "graph": False, "bytes_main": 4 << 20, "bytes_extra": 4096, "tbps": 0.5, "frac_roofline": 0.25, "config": "", "run": 0}  # fmt: skip
RUN = {"command": "normbench bench", "started": "2026-11-01T10:00:00Z", "copy_bandwidth": {"tbps": 4.0}, "git_commit": "aaaa"}
META = {"gpu": "Fake GPU", "copy_bandwidth_tbps": 4.0, "versions": {"triton": "3.6"}, "git_commit": "aaaa", "runs": [RUN]}
POINT = {"impl": "eager", "op": "rmsnorm", "direction": "fwd", "shape": "1024x1024", "tbps": 0.5, "kernels": 1, "dram_over_model": 1.0,
         "dram_tbps": 1.0, "l2_hit_pct": 1.0, "warps_active_pct": 1.0, "max_registers_per_thread": 32.0}  # fmt: skip


@st.composite
def edited(draw, base: dict):
    """``base`` as a hand edit may leave it: fields dropped, replaced by any JSON value, or added."""
    d = dict(base)
    for _ in range(draw(st.integers(1, 3))):
        key = draw((st.sampled_from(sorted(d)) | st.text(max_size=6)) if d else st.text(max_size=6))
        if draw(st.booleans()) and key in d:
            del d[key]
        else:
            d[key] = draw(json_values)
    return d


def _row(n=1024, **kw):
    return {**ROW, "shape": f"{2**20 // n}x{n}", "M": 2**20 // n, "N": n, **kw}


def _folder(root: Path, rows_text: str, meta, profile=None) -> Path:
    d = Path(tempfile.mkdtemp(dir=root))
    (d / "results.jsonl").write_text(rows_text)
    (d / "meta.json").write_text(json.dumps(meta))
    if profile is not None:
        (d / "profile.json").write_text(json.dumps(profile))
    return d


def _refused(e: ValueError, path: Path, line: int | None = None) -> None:
    text = str(e)
    assert "\n" not in text and str(path) in text, text
    if line is not None:
        assert f"line {line}" in text, text


def _use(meta, rows, d: Path, plots: bool) -> None:
    """Everything `rank` and `report` do with a folder they accepted."""
    for sec in rank.sections(rows):
        rank.leaderboard(rows, *sec)
        rank.winners(rows, *sec)
        rank.by_dsl(rows, *sec)
    report.markdown(meta, rows)
    if plots:
        report.write_report(d, meta, rows)
    else:
        report.write_csv(rows, d / "results.csv")


@pytest.fixture(scope="module")
def scratch():
    d = Path(tempfile.mkdtemp(prefix="normbench-properties-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _second_line(scratch, row, plots: bool):
    """A folder whose results.jsonl holds a good point, then ``row``: refused naming line 2, or used."""
    d = _folder(scratch, json.dumps(_row(2048)) + "\n" + json.dumps(row) + "\n", META)
    try:
        meta, rows = report.load(d)
    except ValueError as e:
        _refused(e, d / "results.jsonl", line=2)
        return
    _use(meta, rows, d, plots=plots)


@FAST
@given(row=edited(ROW) | json_values)
def test_any_results_line(scratch, row):
    _second_line(scratch, row, plots=False)


@FEW
@given(row=edited(_row(4096)))
def test_any_results_line_plotted(scratch, row):
    _second_line(scratch, row, plots=True)


@FAST
@given(meta=edited(META) | st.builds(lambda run: {**META, "runs": [RUN, run]}, edited(RUN)) | json_values)
def test_any_meta(scratch, meta):
    d = _folder(scratch, json.dumps(_row()) + "\n", meta)
    try:
        meta, rows = report.load(d)
    except ValueError as e:
        _refused(e, d / "meta.json")
        return
    _use(meta, rows, d, plots=False)


@FAST
@given(profile=edited({"points": [POINT]}) | st.builds(lambda p: {"points": [POINT, p]}, edited(POINT) | edited({**POINT, "error": "x"})) | json_values)
def test_any_profile(scratch, profile):
    d = _folder(scratch, json.dumps(_row()) + "\n", META, profile)
    try:
        meta, rows = report.load(d)
    except ValueError as e:
        _refused(e, d / "profile.json")
        return
    from harness.results.counters import markdown

    markdown(d)
    _use(meta, rows, d, plots=False)


@FAST
@given(row=edited(_row(4096, ms=1.0)), run=edited({**RUN, "started": "2026-11-02T10:00:00Z"}))
def test_any_merge_source(scratch, row, run):
    """A source is taken whole, or refused with the destination left byte for byte as it was."""
    dest = _folder(scratch, json.dumps(_row()) + "\n" + json.dumps(_row(4096)) + "\n", META)
    src = _folder(scratch, json.dumps(row) + "\n", {**META, "runs": [run]})
    before = {p.name: p.read_bytes() for p in dest.iterdir()}
    try:
        store.merge_results(dest, [src])
    except ValueError as e:
        _refused(e, src)
        assert {p.name: p.read_bytes() for p in dest.iterdir()} == before
        return
    meta, rows = report.load(dest)  # what a merge wrote, the report reads
    _use(meta, rows, dest, plots=False)


# ---------------------------------------------------------------- command-line validators
words = st.text(max_size=24) | st.lists(st.sampled_from(["rmsnorm", "layernorm", "bf16", "fp32", "eager", "triton*", "!cute", "", " ", "x"]), max_size=4).map(",".join)
shape_texts = words | st.from_regex(r"[0-9x]{0,12}(:[a-z-]{0,14})?", fullmatch=True) | st.from_regex(r"[a-z]{0,6}@[0-9]{0,8}-[0-9]{0,8}", fullmatch=True)


def _one_line_usage(e: Exception) -> None:
    # ValueError: what harness.spec's parsers raise, one line and exit status 2 as a UsageError is
    assert isinstance(e, (ValueError, argparse.ArgumentTypeError)) and "\n" not in str(e), repr(e)


@FAST
@given(text=shape_texts)
def test_any_shapes_argument(text):
    try:
        sets = cli._shape_sets(text, "cpu")
    except ValueError as e:
        _one_line_usage(e)
        return
    assert sets and all(name and shapes and all(s.n >= 1 for s in shapes) for name, shapes in sets)


@FAST
@given(text=words)
def test_any_comma_list(text):
    from harness.registry import select
    from harness.spec.contract import DTYPES, OPS

    for allowed, what in ((OPS, "op"), (tuple(DTYPES), "dtype")):
        try:
            items = cli._split(text, allowed, what)
        except UsageError as e:
            _one_line_usage(e)
        else:
            assert items and set(items) <= set(allowed)
    try:
        globs = cli._impl_globs(text)
    except argparse.ArgumentTypeError as e:
        _one_line_usage(e)
        globs = [g.strip() for g in text.split(",") if g.strip()]
        assert not globs or any(not c.isprintable() or c.isspace() for g in globs for c in g)
        return
    try:
        assert select(globs)
    except ValueError as e:
        assert "\n" not in str(e) and "no implementation matches" in str(e)


@FAST
@given(seed=st.integers(min_value=-(2**70), max_value=2**70).map(str) | st.text(max_size=12))
def test_any_seed(seed):
    parser = cli.build_parser()
    try:
        a = parser.parse_args(["check", "--seed", seed])
    except UsageError as e:
        _one_line_usage(e)
        assert "--seed" in str(e)
        return
    assert 0 <= a.seed < 2**63
    import torch

    torch.Generator().manual_seed(a.seed)  # every seed it takes, torch takes
