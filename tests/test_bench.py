"""Benchmark bookkeeping on the CPU, with timings injected instead of measured."""

import json
import math

import pytest
import torch

from harness.results import rank, report
from harness.registry import get
from harness.results.store import load_results
from harness.run.bench import run_bench
from harness.run.timer import NOISY_SPREAD, summarize
from harness.spec.contract import Implementation
from harness.spec.roofline import bytes_moved, tbps
from harness.spec.shapes import Shape


class FakeTimer:
    """Runs the callable once (so a broken kernel still shows) and reports a fixed time per impl."""

    def __init__(self, ms_by_impl, spread=0.0):
        self.ms_by_impl, self.spread, self.current = ms_by_impl, spread, None

    def time(self, fn, graph=False):
        fn()
        ms = self.ms_by_impl[self.current]
        return [[ms] * 5, [ms * (1 + self.spread)] * 5, [ms] * 5], graph

    def sync(self):
        pass


def test_bytes_model():
    b = bytes_moved("rmsnorm", "fwd", 1024, 4096, 2)
    assert b.main == 2 * 1024 * 4096 * 2 and b.extra == 4096 * 2 + 1024 * 4
    assert bytes_moved("rmsnorm", "bwd", 8, 16, 2).main == 3 * 8 * 16 * 2
    assert bytes_moved("layernorm", "fwdbwd", 8, 16, 4).main == 5 * 8 * 16 * 4
    assert bytes_moved("layernorm", "fwd", 8, 16, 2).extra == 2 * 16 * 2 + 2 * 8 * 4
    assert tbps(4e12, 1000.0) == pytest.approx(4.0)
    with pytest.raises(ValueError):
        bytes_moved("rmsnorm", "sideways", 1, 1, 2)


def test_summary_and_noise_flag():
    s = summarize([[1.0, 1.0, 1.2], [1.0, 1.01], [1.02, 1.0]])
    assert s["ms"] == 1.0 and s["ms_p95"] == pytest.approx(1.2) and not s["noisy"]
    s = summarize([[1.0], [1.0 + 2 * NOISY_SPREAD]])
    assert s["noisy"] and s["spread"] == pytest.approx(2 * NOISY_SPREAD)


def _row(impl, n, ms, status="ok", frac=None, dsl="x", shape_set="sweep"):
    return {"impl": impl, "dsl": dsl, "external": impl == "ext", "op": "rmsnorm", "direction": "fwd", "shape_set": shape_set,
            "shape": f"{2**20 // n}x{n}", "M": 2**20 // n, "N": n, "dtype": "bf16", "status": status, "ms": ms,
            "tbps": (1.0 / ms) if ms else None, "frac_roofline": frac, "noisy": False}  # fmt: skip


def test_ranking_math_geomean_coverage_failures_excluded():
    rows = [
        _row("eager", 1024, 2.0, frac=0.25, dsl="eager"),
        _row("eager", 4096, 2.0, frac=0.25, dsl="eager"),
        _row("fast", 1024, 1.0, frac=0.5),
        _row("fast", 4096, 0.5, frac=1.0),
        _row("flaky", 1024, 0.1, frac=5.0, dsl="y"),
        _row("flaky", 4096, None, status="failed", dsl="y"),
        _row("absent", 1024, None, status="skip", dsl="z"),
    ]
    rows[4]["frac_roofline"] = 0.9
    board = rank.leaderboard(rows, "rmsnorm", "fwd")
    by = {r.impl: r for r in board}
    assert by["fast"].score == pytest.approx(math.sqrt(0.5 * 1.0))
    assert by["fast"].speedup == pytest.approx(math.sqrt(2.0 * 4.0))
    assert by["flaky"].coverage == "1/2 (partial)" and by["flaky"].score == pytest.approx(0.9)
    assert by["fast"].coverage == "2/2" and not by["fast"].partial
    assert "absent" not in by  # never attempted here: not in the ranking at all
    # flaky's geomean (0.9, over the one shape it passed) beats fast's, but it passed 1 of 2 shapes
    assert [r.impl for r in board] == ["fast", "eager", "flaky"]
    win = rank.winners(rows, "rmsnorm", "fwd")
    assert [w["best"]["impl"] for w in win] == ["flaky", "fast"]  # the failed point is never a winner
    best = rank.by_dsl(rows, "rmsnorm", "fwd")
    assert best["x"].impl == "fast" and best["eager"].impl == "eager"
    # a DSL's implementation measured on one shape only (a run cut short) does not outrank one
    # measured on every shape, however high its geomean over that shape
    rows.append(_row("cut-short", 1024, 0.01, frac=9.0))
    assert rank.by_dsl(rows, "rmsnorm", "fwd")["x"].impl == "fast"
    board = rank.leaderboard(rows, "rmsnorm", "fwd")
    assert [r.impl for r in board] == ["fast", "eager", "cut-short", "flaky"]  # partial rows kept, last
    assert board[2].coverage == "1/1 (partial)"


# (impl, passed shapes of 11, geomean fraction): the section's shapes are the ones any implementation measured
PARTIAL_CASES = {
    "quack passed 4 of 11 with the best geomean": ([("cute", 11, 0.9), ("quack", 4, 0.98), ("eager", 11, 0.4)], ["cute", "eager", "quack"]),
    "a partial one never beats the slowest full one": ([("slow", 11, 0.01), ("fast", 10, 0.99)], ["slow", "fast"]),
    "partial ones ranked by score among themselves": ([("a", 3, 0.5), ("b", 7, 0.6), ("c", 11, 0.1)], ["c", "b", "a"]),
    "every one partial: by score": ([("a", 3, 0.5), ("b", 7, 0.6)], ["b", "a"]),
}


@pytest.mark.parametrize("case", list(PARTIAL_CASES))
def test_an_implementation_that_passed_fewer_shapes_ranks_below_every_full_one(case, tmp_path, capsys):
    import random

    from harness.cli import main

    impls, expect = PARTIAL_CASES[case]
    rng = random.Random(sum(map(ord, case)))
    ns = [2**k for k in range(10, 21)]
    rows = []
    for name, passed, frac in impls:
        for i, n in enumerate(ns):
            # the shapes an implementation missed failed their check, crashed or were skipped
            status = "ok" if i < passed else rng.choice(["failed", "error", "skip"])
            rows.append(_row(name, n, 1.0 if status == "ok" else None, status=status, frac=frac * rng.uniform(0.99, 1.01) if status == "ok" else None))
    rng.shuffle(rows)
    board = rank.leaderboard(rows, "rmsnorm", "fwd")
    assert [r.impl for r in board] == expect
    passed = {n: p for n, p, _ in impls}
    assert all(r.partial == (passed[r.impl] < 11) for r in board)
    md = report.markdown({"gpu": "Fake GPU"}, rows, rel_plots=None)
    table = md[md.index("| rank |"):]
    assert [line.split(" | ")[1] for line in table.splitlines()[2:2 + len(expect)]] == expect
    if any(p < 11 for _, p, _ in impls):
        assert "(partial)" in table and "ranked below every implementation that passed all of them" in md
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["rank", str(tmp_path / "results.jsonl")]) == 0
    ranked = [line.split("│")[2].strip() for line in capsys.readouterr().out.splitlines() if line.startswith("│ ") and line.split("│")[1].strip()]
    assert ranked == expect


def _crasher():
    return Implementation(name="crasher", dsl="eager", entry="tests.mutants:crashing", devices=("cpu",))


def _broken():
    return Implementation(name="broken", dsl="eager", entry="tests.mutants:missing_rstd_gradient", ops=("rmsnorm",), devices=("cpu",))


def test_bench_isolates_failures_writes_as_it_goes_and_resumes(tmp_path, monkeypatch):
    impls = [get("eager"), _crasher(), _broken()]
    timer = FakeTimer({"eager": 2.0, "crasher": 1.0, "broken": 1.0})
    import harness.run.bench as bench

    real = bench.measure_point

    def tracking(impl, *a, **k):
        timer.current = impl.name
        return real(impl, *a, **k)

    monkeypatch.setattr(bench, "measure_point", tracking)
    shapes = [("sweep", (Shape((64, 256)), Shape((16, 1024))))]
    common = dict(device="cpu", timer=timer, copy_bandwidth={"tbps": 0.001}, progress=False)
    _, rows = run_bench(impls, ["rmsnorm"], ["fwd", "bwd"], shapes, ["bf16"], tmp_path, **common)
    assert len(rows) == 3 * 2 * 2
    st = {(r["impl"], r["direction"]): r["status"] for r in rows}
    assert st[("crasher", "fwd")] == "error" and st[("broken", "bwd")] == "failed" and st[("broken", "fwd")] == "ok"
    assert all(r["ms"] is None for r in rows if r["status"] != "ok")
    ok = [r for r in rows if r["impl"] == "eager"]
    assert all(r["status"] == "ok" and r["ms"] == 2.0 and r["frac_roofline"] > 0 for r in ok)
    assert all(r["compile_s"] is not None for r in ok)

    # an interrupted run: drop the last lines, resume measures only those
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    (tmp_path / "results.jsonl").write_text("\n".join(lines[:5]) + "\n" + lines[5][:20])
    _, rows2 = run_bench(impls, ["rmsnorm"], ["fwd", "bwd"], shapes, ["bf16"], tmp_path, resume=True, **common)
    assert len(rows2) == 12 and len({(r["impl"], r["direction"], r["shape"]) for r in rows2}) == 12
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert len(meta["runs"]) == 2 and meta["copy_bandwidth_tbps"] == 0.001

    written = report.write_report(tmp_path)
    md = written["report"].read_text()
    assert "rmsnorm fwd" in md and "crasher" in md and "never ranked" in md
    assert (tmp_path / "results.csv").read_text().count("\n") == 13
    assert written["plots"] and all(p.stat().st_size > 1000 for p in written["plots"])
    assert load_results(tmp_path / "results.jsonl") == rows2


def test_leaderboard_and_summary_are_regenerated_from_each_gpus_report(tmp_path):
    from harness.results import generated

    rows = [_row("eager", 1024, 2.0, frac=0.25, dsl="eager"), _row("ext", 1024, 1.0, frac=0.5, dsl="external")]
    dirs = []
    for gpu in ("gpu-a", "gpu-b"):
        d = tmp_path / "reports" / gpu
        d.mkdir(parents=True)
        (d / "results.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
        (d / "meta.json").write_text(json.dumps({"gpu": f"Fake {gpu}", "copy_bandwidth_tbps": 4.0}))
        dirs.append(d)
    (tmp_path / "reports" / "experiments" / "x").mkdir(parents=True)  # not a GPU's current report
    assert generated.current_reports(tmp_path / "reports") == dirs
    board, readme = tmp_path / "reports" / "LEADERBOARD.md", tmp_path / "README.md"
    board.write_text("# Leaderboard\n<!-- leaderboard:start -->\nSTALE-TABLE\n<!-- leaderboard:end -->\n")
    readme.write_text("intro\n<!-- summary:start -->\nSTALE\n<!-- summary:end -->\nrest\n")
    generated.update_leaderboard(dirs, board, readme)
    text, summary = board.read_text(), readme.read_text()
    assert "STALE-TABLE" not in text and "ext (external)" in text and "## Fake gpu-a" in text and "## Fake gpu-b" in text
    assert "](gpu-a/report.md)" in text  # links relative to the leaderboard's folder
    assert "STALE" not in summary and summary.startswith("intro") and summary.endswith("rest\n")
    assert "**Fake gpu-b** ([report](reports/gpu-b/report.md))" in summary and "| 50% |" in summary
    with pytest.raises(ValueError, match="no <!-- summary:start -->"):
        generated.update_leaderboard(dirs, board, board)


def test_merge_replaces_points_and_keeps_each_runs_provenance(tmp_path, monkeypatch, capsys):
    from harness.cli import main
    from harness.results.store import merge_results

    monkeypatch.setenv("NORMBENCH_COMMIT", "aaaa")
    eager = get("eager")
    shapes = [("sweep", (Shape((64, 256)), Shape((16, 1024))))]
    main_dir, redo = tmp_path / "main", tmp_path / "redo"
    run_bench([eager], ["rmsnorm"], ["fwd", "bwd"], shapes, ["bf16"], main_dir, device="cpu", timer=_timer_for("eager", 2.0), copy_bandwidth={"tbps": 0.001}, progress=False)
    monkeypatch.setenv("NORMBENCH_COMMIT", "bbbb")
    run_bench([eager], ["rmsnorm"], ["bwd"], shapes[:1], ["bf16"], redo, device="cpu", timer=_timer_for("eager", 1.0), copy_bandwidth={"tbps": 0.002}, progress=False)
    assert all(r["run"] == 0 for r in load_results(redo / "results.jsonl"))

    rows = merge_results(main_dir, [redo])
    assert len(rows) == 4 and len({(r["direction"], r["shape"]) for r in rows}) == 4  # replaced, not duplicated
    by = {(r["direction"], r["shape"]): r for r in rows}
    assert by[("bwd", "64x256")]["ms"] == 1.0 and by[("bwd", "64x256")]["run"] == 1  # the re-run's point, its run
    assert by[("fwd", "64x256")]["ms"] == 2.0 and by[("fwd", "64x256")]["run"] == 0
    meta = json.loads((main_dir / "meta.json").read_text())
    assert [r["git_commit"] for r in meta["runs"]] == ["aaaa", "bbbb"] and meta["runs"][1]["merged_from"] == str(redo)
    # each point keeps the fraction of its own run's copy bandwidth
    assert by[("bwd", "64x256")]["frac_roofline"] == pytest.approx(by[("bwd", "64x256")]["tbps"] / 0.002)

    other = tmp_path / "other"
    other.mkdir()
    (other / "results.jsonl").write_text("")
    (other / "meta.json").write_text(json.dumps({"gpu": "NVIDIA H100 80GB HBM3", "runs": []}))
    with pytest.raises(ValueError, match="different GPUs"):
        merge_results(main_dir, [other])
    with pytest.raises(ValueError, match="the folder being merged into"):
        merge_results(main_dir, [main_dir])
    assert main(["merge", str(main_dir), str(tmp_path / "nowhere")]) == 2
    assert "not a benchmark folder" in capsys.readouterr().err
    clean = tmp_path / "clean"
    monkeypatch.setenv("NORMBENCH_COMMIT", "ffff")
    run_bench([eager], ["rmsnorm"], ["bwd"], shapes[:1], ["bf16"], clean, device="cpu", timer=_timer_for("eager", 1.0), copy_bandwidth={"tbps": 0.002}, progress=False)
    assert main(["merge", str(main_dir), str(clean), "--commit", "cccc"]) == 0
    runs = json.loads((main_dir / "meta.json").read_text())["runs"]
    assert runs[-1]["git_commit"] == "ffff"  # a clean recorded commit is never overridden
    dirty = tmp_path / "dirty"
    monkeypatch.setenv("NORMBENCH_COMMIT", "dddd-dirty")
    run_bench([eager], ["rmsnorm"], ["fwd"], shapes[:1], ["bf16"], dirty, device="cpu", timer=_timer_for("eager", 1.0), copy_bandwidth={"tbps": 0.002}, progress=False)
    merge_results(main_dir, [dirty], commit="eeee")
    last = json.loads((main_dir / "meta.json").read_text())["runs"][-1]
    assert last["git_commit"] == "eeee" and last["measured_tree"] == "dddd-dirty"
    md = (main_dir / "report.md").read_text()
    assert "commit `aaaa`" in md and "commit `bbbb`" in md


def test_merge_of_a_folder_from_before_runs_were_numbered(tmp_path):
    """Its points name no run and only its newest run knows its commit: merge guesses neither."""
    from harness.results.store import merge_results

    main_dir, old = tmp_path / "main", tmp_path / "old"
    for d, runs, commit in ((main_dir, [{"command": "a", "git_commit": "aaaa"}], "aaaa"),
                            (old, [{"command": "b"}, {"command": "c"}], "cccc")):
        d.mkdir()
        (d / "meta.json").write_text(json.dumps({"gpu": "Fake GPU", "runs": runs, "git_commit": commit}))
    row = _row("eager", 1024, 2.0, frac=0.5, dsl="eager")
    (main_dir / "results.jsonl").write_text("")
    (old / "results.jsonl").write_text(json.dumps(row) + "\n")
    rows = merge_results(main_dir, [old])
    assert "run" not in rows[0]
    runs = json.loads((main_dir / "meta.json").read_text())["runs"]
    assert [r["git_commit"] for r in runs] == ["aaaa", None, "cccc"]


def _timer_for(name, ms):
    t = FakeTimer({name: ms})
    t.current = name
    return t


def test_bytes_model_comes_from_the_op_record():
    # add_rmsnorm: x, residual read + y, residual_out written; dy, dresidual_out, residual_out read + dh written
    assert bytes_moved("add_rmsnorm", "fwd", 8, 16, 2).main == 4 * 8 * 16 * 2
    assert bytes_moved("add_rmsnorm", "bwd", 8, 16, 2).main == 4 * 8 * 16 * 2
    assert bytes_moved("add_rmsnorm", "fwdbwd", 8, 16, 2).main == 8 * 8 * 16 * 2
    # fp32 parameters beside bf16 x: the weight read and the dweight write at 4 bytes each
    assert bytes_moved("add_rmsnorm", "bwd", 8, 16, 2, param_size=4).extra == 16 * 4 + 8 * 4 + 16 * 4
    assert bytes_moved("layernorm", "fwd", 8, 16, 2, param_size=4).extra == 2 * 16 * 4 + 2 * 8 * 4
    with pytest.raises(ValueError, match="unknown op"):
        bytes_moved("softmax", "fwd", 1, 1, 2)


def test_callables_wire_the_backward_from_the_record():
    from harness.run.bench import callables
    from harness.spec.contract import DTYPES
    from harness.spec.inputs import make_case

    k = get("eager").kernels("cpu")
    case = make_case("add_rmsnorm", Shape((8, 64)), DTYPES["bf16"])
    y, h, _ = callables(k, "add_rmsnorm", "fwd", case)()
    dh, dw = callables(k, "add_rmsnorm", "bwd", case)()
    dh2, dw2 = callables(k, "add_rmsnorm", "fwdbwd", case)()
    assert torch.equal(h, case["x"] + case["residual"]) and torch.equal(dh, dh2) and torch.equal(dw, dw2)
    # the backward got residual_out and dresidual_out, not x
    expect, _ = k.add_rmsnorm_bwd(case["dy"], case["dresidual_out"], h, case["weight"], k.add_rmsnorm_fwd(case["x"], case["residual"], case["weight"], case["eps"])[2])
    assert torch.equal(dh, expect)


def test_weight_variants_are_points_of_their_own_ranked_apart(tmp_path, monkeypatch):
    import harness.run.bench as bench

    timer = FakeTimer({"eager": 2.0})
    timer.current = "eager"
    shapes = [("sweep", (Shape((16, 256)),))]
    common = dict(device="cpu", timer=timer, copy_bandwidth={"tbps": 0.001}, progress=False)
    weights = ("same", "fp32", "offset")
    todo = bench.plan([get("eager")], ["add_rmsnorm"], ["fwd"], shapes, ["bf16", "fp32"], weights)
    assert sorted((t[5], t[6]) for t in todo) == [("bf16", "fp32"), ("bf16", "offset"), ("bf16", "same"), ("fp32", "offset"), ("fp32", "same")]
    _, rows = run_bench([get("eager")], ["add_rmsnorm"], ["fwd", "bwd"], shapes, ["bf16"], tmp_path, weights=weights, **common)
    assert len(rows) == 6 and all(r["status"] == "ok" for r in rows)
    assert len({bench.point_key(r) for r in rows}) == 6  # no collision between variants
    by = {(r["direction"], r["weights"]): r for r in rows}
    assert by[("fwd", "fp32")]["bytes_extra"] > by[("fwd", "same")]["bytes_extra"]
    secs = rank.sections(rows)
    assert ("add_rmsnorm", "fwd", "sweep", "bf16+fp32") in secs and ("add_rmsnorm", "bwd", "sweep", "bf16+offset") in secs
    assert [r.impl for r in rank.leaderboard(rows, "add_rmsnorm", "fwd", "sweep", "bf16+offset")] == ["eager"]
    # a row from before the variant existed is "same" and still ranks
    old = {k: v for k, v in by[("fwd", "same")].items() if k != "weights"}
    assert bench.point_key(old)[-1] == "same" and rank.leaderboard([old], "add_rmsnorm", "fwd")[0].passed == 1
    md = report.write_report(tmp_path)["report"].read_text()
    assert "add_rmsnorm fwd — sweep, bf16+fp32" in md and "add_rmsnorm bwd — sweep, bf16+offset" in md


def test_retry_noisy_measures_again_only_the_selected_noisy_points(tmp_path):
    """--resume --retry-noisy: the folder's noisy points of the selection are measured again and
    replace their rows; noisy points outside the selection and clean points stay as they were."""
    timer = FakeTimer({"eager": 2.0}, spread=2 * NOISY_SPREAD)
    timer.current = "eager"
    shapes = [("sweep", (Shape((64, 256)), Shape((16, 1024))))]
    common = dict(device="cpu", timer=timer, copy_bandwidth={"tbps": 0.001}, progress=False)
    _, rows = run_bench([get("eager")], ["rmsnorm"], ["fwd", "bwd"], shapes, ["bf16"], tmp_path, **common)
    assert len(rows) == 4 and all(r["noisy"] for r in rows)
    timer.spread = 0.0
    _, again = run_bench([get("eager")], ["rmsnorm"], ["fwd"], shapes, ["bf16"], tmp_path, resume=True, retry_noisy=True, **common)
    kept = load_results(tmp_path / "results.jsonl")
    assert kept == again and len(kept) == 4
    by = {(r["direction"], r["shape"]): r for r in kept}
    assert all(not by[("fwd", s)]["noisy"] and by[("fwd", s)]["run"] == 1 for s in ("64x256", "16x1024"))
    assert all(by[("bwd", s)]["noisy"] and by[("bwd", s)]["run"] == 0 for s in ("64x256", "16x1024"))
    # without the flag a noisy point counts as measured: nothing is run again
    timer.spread = 2 * NOISY_SPREAD
    _, same = run_bench([get("eager")], ["rmsnorm"], ["fwd", "bwd"], shapes, ["bf16"], tmp_path, resume=True, **common)
    assert [r for r in same if r["run"] == 2] == [] and len(same) == 4
    with pytest.raises(ValueError, match="goes with resume"):
        run_bench([get("eager")], ["rmsnorm"], ["fwd"], shapes, ["bf16"], tmp_path / "new", retry_noisy=True, **common)
    assert not (tmp_path / "new").exists()


def test_between_points_are_drawn_on_the_sweeps_axes(tmp_path, monkeypatch):
    """N between the sweep's go into the sweep's plot as markers of the implementation's colour (one
    figure per op, direction and dtype), and the report embeds that plot under both sections."""
    import matplotlib.axes

    drawn = []
    scatter = matplotlib.axes.Axes.scatter
    monkeypatch.setattr(matplotlib.axes.Axes, "scatter", lambda ax, x, y, **kw: drawn.append(sorted(x)) or scatter(ax, x, y, **kw))
    rows = [_row("fast", 1024, 1.0, frac=0.5), _row("fast", 4096, 0.5, frac=1.0),
            _row("fast", 1536, 0.9, frac=0.55, shape_set="between"), _row("fast", 3072, 0.8, frac=0.6, shape_set="between"),
            _row("only", 4001, 1.2, frac=0.4, dsl="y", shape_set="between")]  # fmt: skip
    written = report.plots({"gpu": "Fake GPU", "copy_bandwidth_tbps": 4.0}, rows, tmp_path)
    assert [p.name for p in written] == ["plot-rmsnorm-fwd-bf16.png"] and written[0].stat().st_size > 0
    assert sorted(drawn) == [[1536, 3072], [4001]]
    text = report.markdown({"gpu": "Fake GPU", "copy_bandwidth_tbps": 4.0}, rows)
    assert text.count("(plot-rmsnorm-fwd-bf16.png)") == 2 and "## rmsnorm fwd — between, bf16" in text


def test_error_text_reaches_reports_without_terminal_colour_codes():
    """CuTe DSL's compiler colours its errors; a crashed point is recorded and reported as plain text."""
    from harness.spec.errors import describe_error

    coloured = "\x1b[91m\x1b[1merror[INTERNAL]:\x1b[0m The compiler could not build valid IR\nmore"
    assert describe_error(RuntimeError(coloured)) == "RuntimeError: error[INTERNAL]: The compiler could not build valid IR"
    crashed = dict(_row("fast", 1024, None, status="error"), reason=f"DSLRuntimeError: {coloured}")
    md = report.markdown({"gpu": "Fake GPU"}, [_row("fast", 4096, 0.5, frac=1.0), crashed], rel_plots=None)
    assert "fast 1024x1024: error — DSLRuntimeError: error[INTERNAL]: The compiler" in md and "\x1b" not in md


def _eager_bench(out, **kw):
    shapes = [("sweep", (Shape((16, 256)), Shape((4, 1024))))]
    args = {"device": "cpu", "timer": _timer_for("eager", 2.0), "copy_bandwidth": {"tbps": 0.001}, "progress": False}
    return run_bench([get("eager")], kw.pop("ops", ["rmsnorm"]), ["fwd"], shapes, ["bf16"], out, **{**args, **kw})


def test_a_second_run_into_a_folder_is_refused_while_the_first_holds_it(tmp_path, monkeypatch):
    """Two runs into one folder: the second refuses to start while the first runs (it would measure
    the same points again, and one meta.json would lose the other's run); once the first has
    finished, a resumed run reads meta.json afresh and both runs are recorded."""
    from harness.run import bench

    real, second = bench.measure_point, []

    def measure(*a, **k):
        if not second:  # halfway through the first run, a second one starts on the same folder
            with pytest.raises(ValueError) as e:
                _eager_bench(tmp_path, resume=True, command="second")
            second.append(str(e.value))
        return real(*a, **k)

    monkeypatch.setattr(bench, "measure_point", measure)
    _eager_bench(tmp_path, command="first")
    assert len(second) == 1 and "being written by another normbench process" in second[0] and "bench" in second[0]
    assert "\n" not in second[0]
    monkeypatch.setattr(bench, "measure_point", real)
    _eager_bench(tmp_path, resume=True, ops=["rmsnorm", "layernorm"], command="third")
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert [r["command"] for r in meta["runs"]] == ["first", "third"]
    rows = load_results(tmp_path / "results.jsonl")
    assert sorted((r["op"], r["run"]) for r in rows) == [("layernorm", 1)] * 2 + [("rmsnorm", 0)] * 2
    assert not (tmp_path / ".normbench.lock").exists()


def test_resume_on_another_gpu_is_refused_and_leaves_the_folder_as_it_was(tmp_path, monkeypatch):
    from harness.run import bench

    _eager_bench(tmp_path)
    report.write_report(tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    real = bench.environment
    monkeypatch.setattr(bench, "environment", lambda device: {**real(device), "gpu": "NVIDIA H200"})
    with pytest.raises(ValueError) as e:
        _eager_bench(tmp_path, resume=True, ops=["layernorm"])
    assert str(e.value) == f"{tmp_path} was measured on cpu, this is NVIDIA H200: --resume adds points of the same GPU only (use another --out)"
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    # the same GPU resumes
    monkeypatch.setattr(bench, "environment", real)
    assert len(_eager_bench(tmp_path, resume=True, ops=["layernorm"])[1]) == 4


def test_starting_over_removes_what_the_old_run_left(tmp_path):
    """`--overwrite` (a run without --resume): the old report, CSV, plots and counters go with the
    old points, so the new report shows none of them; other files in the folder stay."""
    _eager_bench(tmp_path, ops=["layernorm"])
    report.write_report(tmp_path)
    profile = {"points": [{"impl": "eager", "op": "layernorm", "direction": "fwd", "shape": "16x256", "kernels": 1, "dram_over_model": 3.21,
                           "dram_tbps": 1.0, "l2_hit_pct": 1.0, "warps_active_pct": 1.0, "max_registers_per_thread": 1.0}]}  # fmt: skip
    (tmp_path / "profile.json").write_text(json.dumps(profile))
    (tmp_path / "warm.jsonl").write_text("{}\n")  # the warm-up's record for the next run
    assert "Hardware counters" in report.write_report(tmp_path)["report"].read_text()
    old = {p.name for p in tmp_path.iterdir()}
    assert {"plot-layernorm-fwd-bf16.png", "report.md", "results.csv", "profile.json"} <= old
    meta, rows = _eager_bench(tmp_path, ops=["rmsnorm"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["meta.json", "results.jsonl", "warm.jsonl"]
    assert {r["op"] for r in rows} == {"rmsnorm"} and len(meta["runs"]) == 1
    md = report.write_report(tmp_path, meta, rows)["report"].read_text()
    assert "Hardware counters" not in md and "layernorm" not in md
    assert sorted(p.name for p in tmp_path.glob("plot-*")) == ["plot-rmsnorm-fwd-bf16.png"]


def test_every_implementation_keeps_one_colour_in_every_plot():
    """One colour per implementation across plots (fixed by the registry's names), no two series
    of a plot alike, and a failed or crashed point marked where it would otherwise leave a gap."""
    import random

    import matplotlib.pyplot as plt

    from harness.registry import all_implementations

    names = sorted(all_implementations())
    colors = report.colours()
    assert len({colors[n] for n in names}) == len(names)
    # a name no longer registered takes a colour after the registry's, which keep theirs
    extra = report.colours(["zz-gone", "aa-gone", "eager"])
    assert {n: extra[n] for n in names} == colors and len(set(extra.values())) == len(names) + 2
    assert len(set(report.colours([f"old-{i}" for i in range(40)]).values())) == len(names) + 40  # past the palette too
    # no two registry colours near alike (tab20's pairs were: cutile and eager, helion and triton)
    from matplotlib.colors import to_rgb

    rgb = [to_rgb(colors[n]) for n in names]
    assert min(sum((a - b) ** 2 for a, b in zip(p, q)) ** 0.5 for i, p in enumerate(rgb) for q in rgb[i + 1 :]) > 0.15

    rng = random.Random(12)
    meta = {"gpu": "Fake GPU", "copy_bandwidth_tbps": 4.0}

    def series_colours(fig) -> dict:
        ax = fig.axes[0]
        out = {ln.get_label(): ln.get_color() for ln in ax.lines if not ln.get_label().startswith(("_", "copy", "90%", "x:"))}
        return out

    seen = {}
    for trial in range(4):
        picked = rng.sample(names, rng.randint(2, len(names)))
        rows = [_row(n, 2**k, rng.uniform(0.5, 2.0), frac=0.5) for n in picked for k in (10, 12, 14)]
        fig = report.figure(meta, rows, "rmsnorm", "fwd", "bf16")
        got = series_colours(fig)
        plt.close(fig)
        assert set(got) == set(picked) and len(set(got.values())) == len(picked)
        for n, c in got.items():
            assert seen.setdefault(n, c) == c == colors[n]


def test_a_failed_point_is_drawn_at_the_floor_in_its_colour():
    import matplotlib.pyplot as plt

    rows = [_row("helion", 1024, 1.0, frac=0.5), _row("helion", 4096, None, status="failed"), _row("helion", 16384, 0.5, frac=0.9),
            _row("triton", 1024, 1.0, frac=0.5), _row("triton", 4096, None, status="error"),
            _row("broken", 1024, None, status="failed"), _row("absent", 1024, None, status="skip"),
            _row("helion", 3072, None, status="failed", shape_set="between")]  # fmt: skip
    colors = report.colours(r["impl"] for r in rows)
    fig = report.figure({"gpu": "Fake GPU"}, rows, "rmsnorm", "fwd", "bf16")
    ax = fig.axes[0]
    marks = {c.get_gid().split(":", 1)[1]: c for c in ax.collections if (c.get_gid() or "").startswith("failed:")}
    assert set(marks) == {"helion", "triton", "broken"}  # an implementation that only failed is drawn too; a skipped one is not
    assert sorted(map(tuple, marks["helion"].get_offsets().tolist())) == [(3072, 0), (4096, 0)]
    assert marks["triton"].get_offsets().tolist() == [[4096, 0]]
    for name, c in marks.items():
        assert tuple(c.get_edgecolor()[0][:3]) == pytest.approx(plt.matplotlib.colors.to_rgb(colors[name]))
        assert not c.get_clip_on()  # at y = 0, half of it would be cut by the axes
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert report.FAILED_LABEL in legend and "broken" in legend and "absent" not in legend
    plt.close(fig)
    # and none when nothing failed
    fig = report.figure({"gpu": "Fake GPU"}, rows[:1], "rmsnorm", "fwd", "bf16")
    assert report.FAILED_LABEL not in [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    plt.close(fig)


def test_short_kernels_are_timed_in_flushed_graphs_and_say_so(tmp_path, monkeypatch):
    """Points moving at most FLUSHED_GRAPH_MAX_BYTES ask the timer for flushed graph replays, decode
    for warm ones, the rest for do_bench; each row records what it got (a timer that could not
    capture falls back to events and says so)."""
    from harness.run.bench import timing_mode
    from harness.run.timer import FLUSHED_GRAPH_MAX_BYTES

    assert timing_mode("perhead", FLUSHED_GRAPH_MAX_BYTES) == "graph+flush"
    assert timing_mode("perhead", FLUSHED_GRAPH_MAX_BYTES + 1) == "events"
    assert timing_mode("decode", FLUSHED_GRAPH_MAX_BYTES + 1) == "graph"
    assert timing_mode("sweep", 0) == "events"

    asked = []

    class Timer(FakeTimer):
        def time(self, fn, graph=False):
            asked.append(graph)
            trials, _ = super().time(fn, graph)
            return trials, graph == "flushed"  # captures flushed graphs only

    import harness.run.bench as bench

    monkeypatch.setattr(bench, "FLUSHED_GRAPH_MAX_BYTES", 2 * 64 * 256 * 4)  # 64x256 fp32 fwd: short
    timer = Timer({"eager": 1.0})
    timer.current = "eager"
    shapes = [("sweep", (Shape((64, 256)), Shape((64, 512)))), ("decode", (Shape((4, 256)),))]
    _, rows = run_bench([get("eager")], ["rmsnorm"], ["fwd"], shapes, ["fp32"], tmp_path, device="cpu", timer=timer,
                        copy_bandwidth={"tbps": 0.001}, progress=False)  # fmt: skip
    got = {r["shape"]: (r["timing"], r["graph"]) for r in rows}
    assert got == {"64x256": ("graph+flush", True), "64x512": ("events", False), "4x256": ("events", False)}
    assert asked == ["flushed", False, True]
    assert all(r["timing"] == got[r["shape"]][0] for r in load_results(tmp_path / "results.jsonl"))


@pytest.mark.gpu
def test_a_flushed_graph_times_a_short_copy_near_the_copy_bandwidth_whatever_the_host_adds():
    """A 64 MB copy (~20 us) timed as flushed graph replays, its callable padded with 300 us of host
    work: near the copy bandwidth all the same (do_bench would time the host's 300 us)."""
    import time as _time

    from harness.run.timer import CudaTimer, measure_copy_bandwidth

    x = torch.randint(0, 255, (2**25,), dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)

    def slow_host_copy():
        t0 = _time.perf_counter()
        while _time.perf_counter() - t0 < 300e-6:
            pass
        y.copy_(x)

    trials, used = CudaTimer(trials=2).time(slow_host_copy, graph="flushed")
    assert used
    got = tbps(2 * x.numel(), summarize(trials)["ms"])
    bw = measure_copy_bandwidth(0.5)["tbps"]
    assert 0.5 * bw < got < 1.2 * bw, (got, bw)


def test_section_rows_follow_the_rows_they_are_given():
    """The section index is rebuilt whenever the list holds other rows (another list, an appended
    row), and callers get their own list."""

    def row(op, dtype="bf16", weights="same"):
        return {"op": op, "direction": "fwd", "shape_set": "sweep", "dtype": dtype, "weights": weights}

    a = [row("rmsnorm"), row("layernorm"), row("rmsnorm", weights="fp32")]
    assert rank.section_rows(a, "rmsnorm", "fwd", "sweep", "bf16") == [a[0]]
    assert rank.section_rows(a, "rmsnorm", "fwd", "sweep", "bf16+fp32") == [a[2]]
    a.append(row("rmsnorm"))
    got = rank.section_rows(a, "rmsnorm", "fwd", "sweep", "bf16")
    assert got == [a[0], a[3]] and got[1] is a[3]
    got.clear()  # the caller's list, not the index's
    b = [row("rmsnorm", dtype="fp16")]
    assert rank.section_rows(b, "rmsnorm", "fwd", "sweep", "bf16") == []
    assert rank.section_rows(b, "rmsnorm", "fwd", "sweep", "fp16") == [b[0]]
    assert rank.section_rows(a, "rmsnorm", "fwd", "sweep", "bf16") == [a[0], a[3]]
    a[3] = row("layernorm")  # another row in the same place
    assert rank.section_rows(a, "rmsnorm", "fwd", "sweep", "bf16") == [a[0]]
