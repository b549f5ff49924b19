"""Fan-out (--gpus, --executor; harness.run.shard and harness.run.fanout) on the CPU: the partition
of the planned points, and fan-outs of small selections over 2 fake GPUs (NORMBENCH_FAKE_GPUS)
whose workers are real processes: a bench whose worker dies and resumes into what a serial run
writes, a check through submitit's local executor, and the refusals."""

import json
import os
from collections import Counter
from pathlib import Path

import pytest

from harness.cli import main
from harness.registry import get, select
from harness.results.store import load_results, point_key
from harness.run import bench, fanout, shard
from harness.spec.shapes import SHAPE_SETS, Shape

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["--impl", "eager", "--op", "rmsnorm", "--direction", "fwd,bwd", "--shapes", "4x64,8x32", "--dtype", "fp32"]


@pytest.fixture
def two_gpus(monkeypatch):
    """Two fake GPUs of one model; workers find the tests package; no CUDA_VISIBLE_DEVICES."""
    monkeypatch.setenv(shard.FAKE_GPUS, "Fake GPU,Fake GPU")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("NORMBENCH_COMMIT", "f00d")  # the workers' commit, without a git call each
    monkeypatch.chdir(ROOT)


def _one_line_exit_2(argv, capsys, needle):
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert needle in err, err
    return err


# ---------------------------------------------------------------- the partition
def _full_plan():
    sets = [("sweep", SHAPE_SETS["sweep"]), ("decode", SHAPE_SETS["decode"])]
    return bench.plan(select(None), ["rmsnorm", "layernorm", "add_rmsnorm"], ["fwd", "bwd"], sets, ["bf16"])


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_shards_partition_the_plan_stably_and_balanced_by_cost(n):
    todo = _full_plan()
    units = shard.bench_units(todo)
    assert len(units) == len({bench.planned_key(t) for t in todo}) > 100
    parts = shard.partition(units, n)
    keys = [u.key for p in parts for u in p]
    assert len(keys) == len(set(keys)) == len(units) and set(keys) == {u.key for u in units}  # none lost, none twice
    assert [[u.key for u in p] for p in parts] == [[u.key for u in p] for p in shard.partition(shard.bench_units(_full_plan()), n)]  # stable
    assert all([u.position for u in p] == sorted(u.position for u in p) for p in parts)  # plan order within a shard
    loads = [sum(u.cost for u in p) for p in parts]
    assert max(loads) - min(loads) <= max(u.cost for u in units) + 1e-9
    # the max-autotune searches, the costliest points, are spread over the shards first
    search = Counter(k for k, p in enumerate(parts) for u in p if u.key[0] == "compile-max-autotune")
    assert sum(search.values()) > n and max(search.values()) - min(search[k] for k in range(n)) <= 1


def test_expected_cost_orders_searches_compiles_and_the_rest():
    s = Shape((4096, 4096))
    mat, comp, eager = get("compile-max-autotune"), get("compile"), get("eager")
    assert shard.expected_cost(mat, "bwd", s) > shard.expected_cost(mat, "fwd", s) > shard.expected_cost(comp, "fwd", s) > shard.expected_cost(eager, "fwd", s)
    assert shard.expected_cost(eager, "fwdbwd", s, timed=False) == 2 * shard.expected_cost(eager, "fwd", s, timed=False)
    assert shard.expected_cost(comp, "fwd", s, device="cpu") > shard.expected_cost(eager, "fwd", s, device="cpu")
    units = [shard.Unit((i,), c, i) for i, c in enumerate([1, 1, 1, 10, 10])]
    assert [[u.key[0] for u in p] for p in shard.partition(units, 2)] == [[0, 2, 3], [1, 4]]


def test_the_gpus_are_this_hosts_as_cuda_visible_devices_shows_them(monkeypatch):
    monkeypatch.setenv(shard.FAKE_GPUS, "Fake A,Fake A,Fake B,Fake A")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,0,7,1")  # CUDA stops at the first entry that names no GPU
    assert [g.id for g in shard.inventory()] == ["3", "0"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert [g.id for g in shard.choose(2, shard.inventory())] == ["0", "1"]
    with pytest.raises(ValueError, match=r"not all one model \(0: Fake A; 1: Fake A; 2: Fake B; 3: Fake A\)"):
        shard.choose("all", shard.inventory())


# ---------------------------------------------------------------- bad arguments
BAD = [
    (["bench", "--gpus", "0"], "bench: argument --gpus: expected a number of GPUs >= 1 or 'all', got 0"),
    (["bench", "--gpus", "abc"], "bench: argument --gpus: expected a number of GPUs or 'all', got 'abc'"),
    (["check", "--gpus", "9", "--device", "cpu", "--impl", "eager"], "--gpus 9, but this host has 2 GPUs (0: Fake GPU; 1: Fake GPU)"),
    (["warm", "--gpus", "9", "--out", "{T}/w"], "--gpus 9, but this host has 2 GPUs"),
    (["model", "--gpus", "3", "--device", "cpu", "--arch", "llama,gpt2"], "--gpus 3, but this host has 2 GPUs"),
    (["bench", "--gpus", "2", "--executor", "slurm", "--out", "{T}/b"], "--executor slurm needs --slurm-partition"),
    (["check", "--gpus", "2", "--executor", "slurm", "--slurm-gpus-per-node", "2"], "--executor slurm needs --slurm-partition"),
    (["bench", "--gpus", "all", "--executor", "slurm", "--slurm-partition", "gpu", "--out", "{T}/b"], "needs a number of GPUs, --gpus N"),
    (["bench", "--gpus", "6", "--executor", "slurm", "--slurm-partition", "gpu", "--slurm-gpus-per-node", "4", "--out", "{T}/b"], "not a multiple"),
    (["bench", "--gpus", "4", "--executor", "slurm", "--slurm-partition", "gpu", "--slurm-time", "0"], "--slurm-time must be >= 1"),
    (["bench", "--gpus", "4", "--executor", "slurm", "--slurm-partition", "gpu"], "bench --executor slurm needs --out"),
    (["bench", "--executor", "local"], "--executor local needs --gpus N"),
    (["bench", "--gpus", "2", "--slurm-partition", "gpu"], "--slurm-partition applies to --executor slurm only"),
    (["check", "--gpus", "2", "--no-wait"], "--no-wait applies to --executor slurm only"),
    (["bench", "--gpus", "2", "--executor", "cluster"], "argument --executor: invalid choice"),
]


@pytest.mark.parametrize("argv,needle", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_fan_out_arguments_are_one_line_and_exit_2(argv, needle, two_gpus, tmp_path, capsys):
    _one_line_exit_2([a.replace("{T}", str(tmp_path)) for a in argv], capsys, needle)
    assert not any(tmp_path.iterdir())  # refused before anything was written


@pytest.mark.parametrize("gpus", ["2", "all"])
def test_gpus_of_two_models_are_refused(gpus, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv(shard.FAKE_GPUS, "NVIDIA H100 80GB HBM3,NVIDIA H200")
    err = _one_line_exit_2(["bench", "--gpus", gpus, "--out", str(tmp_path / "b"), *SMALL], capsys, "not all one model")
    assert "0: NVIDIA H100 80GB HBM3; 1: NVIDIA H200" in err and "one GPU model" in err
    assert not (tmp_path / "b").exists()


def test_shards_of_two_gpu_models_are_never_merged(tmp_path, capsys):
    """On a cluster the nodes may differ: the merge refuses, naming which shard ran where."""
    work = tmp_path / "fan" / ".fanout" / "bench-x"
    parts = [[shard.Unit(("eager", "rmsnorm", "fwd", "4x64", "fp32", "same"), 1.0, 0)], [shard.Unit(("eager", "rmsnorm", "bwd", "4x64", "fp32", "same"), 1.0, 1)]]
    fanout._write_spec(work, "bench", fanout.Scale(2, "slurm", False, {"gpus_per_node": 1}), parts, None, [], "normbench bench", tmp_path / "fan")
    for k, (gpu, host) in enumerate([("NVIDIA H100 80GB HBM3", "node1"), ("NVIDIA A100-SXM4-80GB", "node7")]):
        (work / f"shard-{k}.worker.json").write_text(json.dumps({"gpu": gpu, "gpu_id": f"{host}:0", "host": host}))
    err = _one_line_exit_2(["merge", str(tmp_path / "fan"), str(work)], capsys, "the shards ran on different GPU models")
    assert "NVIDIA H100 80GB HBM3: shard 0 on node1; NVIDIA A100-SXM4-80GB: shard 1 on node7" in err
    assert not (tmp_path / "fan" / "results.jsonl").exists()


# ---------------------------------------------------------------- fan-outs
def _serial_bench(out: Path, monkeypatch) -> None:
    from tests import fanout_worker

    monkeypatch.setattr(bench, "run_bench", bench.run_bench)  # restored after the test
    monkeypatch.setattr(bench, "environment", bench.environment)
    from harness import cli

    monkeypatch.setattr(cli, "_require_cuda", cli._require_cuda)
    fanout_worker.install()
    assert main(["bench", *SMALL, "--out", str(out)]) == 0


def test_a_dead_worker_loses_only_its_point_and_resume_completes_what_a_serial_run_writes(two_gpus, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(fanout.WORKER_MODULE, "tests.fanout_worker")
    monkeypatch.setenv("NORMBENCH_TEST_DIE_SHARD", "1")
    monkeypatch.setenv("NORMBENCH_TEST_DIE_AFTER", "1")
    out = tmp_path / "fanned"
    argv = ["bench", *SMALL, "--gpus", "2", "--out", str(out)]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "shard 1 on GPU 1 was killed by SIGKILL after 1 of 2 points" in err and "--resume" in err
    first = load_results(out / "results.jsonl")
    assert len(first) == 3 and len({point_key(r) for r in first}) == 3  # shard 0's two, and shard 1's one before it died
    assert {r["gpu_id"] for r in first} == {"0", "1"}
    first_work = [p.parent for p in (out / ".fanout").glob("bench-*/shard-1.log")]  # kept, with the dead worker's log
    assert len(first_work) == 1 and (first_work[0] / "merged.json").exists()

    monkeypatch.delenv("NORMBENCH_TEST_DIE_SHARD")
    assert main([*argv, "--resume"]) == 0
    rows = load_results(out / "results.jsonl")
    meta = json.loads((out / "meta.json").read_text())
    planned = {bench.planned_key(t) for t in bench.plan([get("eager")], ["rmsnorm"], ["fwd", "bwd"], [("custom", (Shape((4, 64)), Shape((8, 32))))], ["fp32"])}
    assert [point_key(r) for r in rows if point_key(r) in {point_key(f) for f in first}] == [point_key(r) for r in first]  # kept as they were
    assert sorted(point_key(r) for r in rows) == sorted(planned)  # every point once
    assert len(rows) == 4 and len(meta["runs"]) == 3 and all(r["status"] == "ok" for r in rows)
    for r in rows:  # each point names its GPU, as its run does
        assert r["gpu_id"] in ("0", "1") and meta["runs"][r["run"]]["gpu_id"] == r["gpu_id"]
    assert [r["shard"] for r in meta["runs"]] == ["0/2", "1/2", "0/1"]  # the resume's one point left: one shard

    serial = tmp_path / "serial"
    _serial_bench(serial, monkeypatch)
    srows, smeta = load_results(serial / "results.jsonl"), json.loads((serial / "meta.json").read_text())
    assert {point_key(r) for r in srows} == {point_key(r) for r in rows}
    assert {tuple(sorted(r)) for r in srows} == {tuple(sorted(r)) for r in rows}  # the same fields in every row
    assert set(smeta) == set(meta)  # and in meta.json; each shard's run adds its shard, host and merge
    assert all(set(r) - set(smeta["runs"][0]) == {"shard", "host", "merged_from"} for r in meta["runs"])
    assert {r["gpu_id"] for r in srows} == {None}  # a serial run on the CPU names no GPU
    assert [p.name for p in sorted(out.glob("[!.]*"))] == [p.name for p in sorted(serial.glob("[!.]*"))]  # report, CSV, plots too
    assert [p.name for p in (out / ".fanout").iterdir()] == [p.name for p in first_work]  # the resume's work folder went once merged


def test_retry_noisy_fans_out_only_the_noisy_points_and_the_merge_replaces_them(two_gpus, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(fanout.WORKER_MODULE, "tests.fanout_worker")
    out = tmp_path / "fanned"
    argv = ["bench", *SMALL, "--gpus", "2", "--out", str(out)]
    assert main(argv) == 0
    capsys.readouterr()
    rows = load_results(out / "results.jsonl")
    noisy = point_key(rows[1])
    (out / "results.jsonl").write_text("".join(json.dumps({**r, "noisy": point_key(r) == noisy}) + "\n" for r in rows))
    assert main([*argv, "--resume"]) == 0  # a noisy point counts as measured without the flag
    assert len(json.loads((out / "meta.json").read_text())["runs"]) == 2
    assert main([*argv, "--resume", "--retry-noisy"]) == 0
    after = {point_key(r): r for r in load_results(out / "results.jsonl")}
    meta = json.loads((out / "meta.json").read_text())
    assert set(after) == {point_key(r) for r in rows} and not any(r["noisy"] for r in after.values())
    assert [k for k, r in after.items() if r["run"] >= 2] == [noisy]  # the one point, in the third run's shard
    assert [r["shard"] for r in meta["runs"]] == ["0/2", "1/2", "0/1"]


def test_check_round_trips_through_submitit_local_executor(two_gpus, tmp_path, capsys):
    pytest.importorskip("submitit")
    sel = ["check", "--device", "cpu", "--impl", "eager", "--op", "rmsnorm", "--shapes", "4x64,2x96,8x32", "--dtype", "fp32,bf16", "--quiet"]
    assert main([*sel, "--json", str(tmp_path / "serial.json")]) == 0
    assert main([*sel, "--gpus", "2", "--executor", "local", "--json", str(tmp_path / "fanned.json")]) == 0
    out = capsys.readouterr().out
    assert "in 2 shards, 2 submitit local tasks" in out and "gathered 2 shards" in out
    serial, fanned = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("serial", "fanned"))
    assert set(serial) == set(fanned)

    def points(d):
        return {(r["impl"], r["op"], r["direction"], r["dtype"], r["shape"], r["shape_set"]): r for r in d["results"]}

    assert points(serial).keys() == points(fanned).keys() and len(points(fanned)) == 12
    assert all(set(r) == set(serial["results"][0]) for r in fanned["results"])
    assert [r["status"] for r in serial["results"]] == [r["status"] for r in fanned["results"]] == ["pass"] * 12  # in the serial run's order
    assert {r["gpu_id"] for r in serial["results"]} == {None} and Counter(r["gpu_id"] for r in fanned["results"]) == {"0": 6, "1": 6}
    assert not (tmp_path / ".fanned.json.fanout").exists()


def _shards_by_hand(dest: Path, ended: list[bool]) -> Path:
    """A --no-wait fan-out's work folder whose two shards were measured (on the CPU, in this process):
    shard k's task has ended where ``ended[k]``."""
    from tests.fanout_worker import FakeTimer

    todo = bench.plan([get("eager")], ["rmsnorm"], ["fwd", "bwd"], [("custom", (Shape((4, 64)), Shape((8, 32))))], ["fp32"])
    parts = shard.partition(shard.bench_units(todo), 2)
    sc = fanout.scale(2, "slurm", True, {"partition": "gpu"})
    work = dest / fanout.FANOUT_DIR / "bench-by-hand"
    spec_path = fanout._write_spec(work, "bench", sc, parts, None, ["bench"], "normbench bench --gpus 2 --executor slurm --no-wait", dest)
    for k, part in enumerate(parts):
        bench.run_bench([get("eager")], ["rmsnorm"], ["fwd", "bwd"], [("custom", (Shape((4, 64)), Shape((8, 32))))], ["fp32"], work / f"shard-{k}",
                        device="cpu", timer=FakeTimer(), copy_bandwidth={"tbps": 0.5 + k}, command="normbench bench", progress=False,
                        only={u.key for u in part}, gpu_id=f"node{k}:0", run_info={"shard": f"{k}/2", "host": f"node{k}"})  # fmt: skip
        (work / f"shard-{k}.worker.json").write_text(json.dumps({"gpu": "cpu", "gpu_id": f"node{k}:0", "host": f"node{k}"}))
        if ended[k]:
            (work / f"shard-{k}.done.json").write_text("{}")
            (work / f"shard-{k}.exit.json").write_text('{"status": 0}')
    return spec_path


def test_a_no_wait_array_merges_itself_when_its_last_task_ends(tmp_path, capsys):
    dest = tmp_path / "out"
    spec_path = _shards_by_hand(dest, [True, False])
    fanout._merge_when_all_ended(spec_path)  # the first task to end: shard 1's task runs on
    assert not (dest / "results.jsonl").exists()
    (spec_path.parent / "shard-1.done.json").write_text("{}")
    (spec_path.parent / "shard-1.exit.json").write_text('{"status": 0}')
    fanout._merge_when_all_ended(spec_path)  # the last one merges
    rows, meta = load_results(dest / "results.jsonl"), json.loads((dest / "meta.json").read_text())
    assert len(rows) == 4 and {r["gpu_id"] for r in rows} == {"node0:0", "node1:0"} and (dest / "report.md").exists()
    assert [r["copy_bandwidth"]["tbps"] for r in meta["runs"]] == [0.5, 1.5] and meta["copy_bandwidth_tbps"] == 1.0
    assert not spec_path.parent.exists() and "merged 2 shards" in capsys.readouterr().out
    fanout._merge_when_all_ended(spec_path)  # a task that ends after the merge finds nothing to do


def test_shards_of_a_fan_out_that_never_merged_are_merged_by_hand_once(two_gpus, tmp_path, capsys):
    dest = tmp_path / "out"
    spec_path = _shards_by_hand(dest, [True, False])
    work = spec_path.parent
    # --resume of the folder refuses while a shard may still be running, and says how to merge it
    err = _one_line_exit_2(["bench", *SMALL, "--gpus", "2", "--out", str(dest), "--resume"], capsys, "have not ended (1)")
    assert f"normbench merge {dest} {work}" in err
    assert main(["merge", str(dest), str(work)]) == 1  # merged, and said that shard 1 had not ended
    captured = capsys.readouterr()
    assert "shard 1 on GPU node1:0 has not ended" in captured.err and "merged 2 shards" in captured.out
    assert len(load_results(dest / "results.jsonl")) == 4 and (dest / "report.md").exists()
    _one_line_exit_2(["merge", str(dest), str(work)], capsys, f"was merged into {dest}")


def test_slurm_array_is_what_the_options_say():
    """The sbatch script submitit writes for `--executor slurm` (not submitted: no cluster here)."""
    pytest.importorskip("submitit")
    from submitit.slurm.slurm import _make_sbatch_string

    sc = fanout.scale(8, "slurm", False, {"partition": "gpu", "gpus_per_node": 4, "time_min": 120, "constraint": "h100", "account": "lab",
                                         "mem_gb": 256.0, "setup": ["source .venv/bin/activate"]})  # fmt: skip
    params = fanout.slurm_parameters(sc, "bench", 2)
    text = _make_sbatch_string(command="python -m submitit.core._submit F", folder="/tmp/f", map_count=2, **params)
    for line in ("--job-name=normbench-bench", "--partition=gpu", "--gpus-per-node=4", "--cpus-per-task=32", "--time=120", "--array=0-1%2",
                 "--constraint=h100", "--account=lab", "--mem=256GB", "--nodes=1", "--ntasks-per-node=1"):  # fmt: skip
        assert f"#SBATCH {line}\n" in text, (line, text)
    assert "source .venv/bin/activate" in text


def test_compare_runs_reports_the_wall_ratio_and_the_points_within_noise(tmp_path):
    """tools/compare_runs.py, which tools/scale_out.sh runs on the serial and fanned-out folders."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("compare_runs", ROOT / "tools" / "compare_runs.py")
    cr = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cr)

    def folder(name, fracs, spread=0.02):
        d = tmp_path / name
        d.mkdir()
        rows = [{"impl": "eager", "dsl": "eager", "op": "rmsnorm", "direction": "fwd", "shape_set": "sweep", "shape": f"8x{n}", "M": 8, "N": n,
                 "dtype": "bf16", "status": "ok", "ms": 1.0, "tbps": f, "frac_roofline": f, "spread": spread} for n, f in fracs.items()]  # fmt: skip
        (d / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return d

    serial, fanned = folder("s", {64: 0.50, 128: 0.80, 256: 0.90}), folder("f", {64: 0.505, 128: 0.70, 256: 0.90, 512: 0.1})
    c = cr.compare(serial, fanned, wall=(100.0, 27.0))
    assert c["wall_s"]["ratio"] == pytest.approx(0.27) and c["points"]["both"] == 3 and c["points"]["only_fanned"] == 1
    assert c["within_noise"] == 2 and c["worst"][0]["point"][3] == "8x128"  # 12.5% off against a 2% spread
    assert "**0.270x**" in cr.markdown(c) and "2 of 3" in cr.markdown(c)
