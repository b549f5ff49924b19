"""Fan-out: one `bench`, `warm`, `check` or `model` over several GPUs, one worker process per GPU,
on this host (``--gpus N|all``) or as a SLURM job array through submitit (``--executor slurm``).

How (docs/scale-out.md has the commands):

* The parent plans the command's units (harness.run.shard), deals them into N shards balanced by
  expected cost and writes the plan to ``spec.json`` in a work folder (``OUT/.fanout/<kind>-<stamp>/``
  for a folder, beside ``--json`` for `check`).
* Each shard runs in a worker: ``python -m harness <the same arguments> --shard-spec SPEC
  --shard-index K``, with ``CUDA_VISIBLE_DEVICES`` naming its one GPU. The worker plans the same
  selection, keeps its shard's units, and runs them exactly as a serial run does (each point checked
  and timed alone on its GPU, the copy bandwidth measured on that GPU at its start), writing into its
  own folder ``shard-K/`` (results.jsonl and meta.json, warm.jsonl, check.jsonl, or the model
  reports) as it goes. Its log is ``shard-K.log``; ``shard-K.worker.json`` says which GPU (model,
  index, host) it runs on, ``shard-K.done.json`` that it finished, ``shard-K.exit.json`` how its
  process ended (written by whoever started it).
* Executors: ``processes`` (the default) starts the workers as child processes of the command;
  ``local`` and ``slurm`` submit tasks through submitit (its LocalExecutor, which CI runs, and its
  SlurmExecutor: one array task per node of ``--slurm-gpus-per-node`` GPUs), and each task starts
  its shards' workers on the GPUs it was given, the same way.
* Merge (``finish``): the shards' outputs become what a serial run of the same selection writes, plus
  the GPU that ran each point (``gpu_id`` of every row and run): `bench` merges the shard folders
  into the output folder with ``harness.results.store.merge_locked`` (one run per shard, each with
  its own copy bandwidth), `warm` appends the rows to warm.jsonl, `check` gathers the results into
  one outcome (and --json), `model` copies the reports and rebuilds models.md. The parent merges
  when its workers end; with ``--no-wait`` the SLURM array merges when its last task ends, and
  ``normbench merge DEST WORKFOLDER`` merges by hand. A report is of one GPU model: mixing models is
  refused before the start (this host) or at the merge (a cluster).
* A worker that dies loses only the point it was on: its shard's earlier points are merged, the
  command says which shards stopped and exits 1, and ``bench --resume`` measures what is left (after
  merging any earlier fan-out that was never merged).

Test hooks: ``NORMBENCH_FAKE_GPUS`` (harness.run.shard: fake GPU models for a machine without one)
and ``NORMBENCH_WORKER_MODULE`` (the module a worker runs as ``python -m``; default: harness).
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from harness.run import shard as sharding
from harness.spec.errors import UsageError

SPEC = "spec.json"
MERGED = "merged.json"
FANOUT_DIR = ".fanout"
WORKER_MODULE = "NORMBENCH_WORKER_MODULE"
EXECUTORS = ("processes", "local", "slurm")
PROGRESS_EVERY_S = 30.0
LOCAL_TIMEOUT_MIN = 7 * 24 * 60  # submitit's LocalExecutor stops a task after 2 minutes unless told
# --slurm-* options: the key cli.py passes each under, and its flag
SLURM_FLAGS = {
    "partition": "--slurm-partition", "gpus_per_node": "--slurm-gpus-per-node", "time_min": "--slurm-time",
    "cpus_per_gpu": "--slurm-cpus-per-gpu", "mem_gb": "--slurm-mem-gb", "account": "--slurm-account", "qos": "--slurm-qos",
    "constraint": "--slurm-constraint", "parallelism": "--slurm-parallelism", "setup": "--slurm-setup",
}  # fmt: skip
SLURM_DEFAULTS = {"gpus_per_node": 1, "time_min": 240, "cpus_per_gpu": 8}


# ---------------------------------------------------------------- the options
@dataclass
class Scale:
    gpus: int | str  # N or "all"
    executor: str = "processes"
    wait: bool = True
    slurm: dict = field(default_factory=dict)


def scale(gpus, executor: str | None, no_wait: bool, slurm: dict) -> Scale | None:
    """``--gpus``, ``--executor``, ``--no-wait`` and the ``--slurm-*`` options, checked (one-line
    UsageErrors); None for a serial run."""
    given = {k: v for k, v in slurm.items() if v not in (None, [], ())}
    chosen = executor or "processes"
    if given and chosen != "slurm":
        raise UsageError(f"{SLURM_FLAGS[next(iter(given))]} applies to --executor slurm only")
    if no_wait and chosen != "slurm":
        raise UsageError("--no-wait applies to --executor slurm only (a local run's workers end with it)")
    if gpus is None:
        if executor:
            raise UsageError(f"--executor {executor} needs --gpus N: one worker per GPU")
        return None
    if chosen != "slurm":
        return Scale(gpus, chosen)
    if not given.get("partition"):
        raise UsageError("--executor slurm needs --slurm-partition: the partition of GPU nodes to run on")
    if gpus == "all":
        raise UsageError("--executor slurm needs a number of GPUs, --gpus N: a cluster has no 'all'")
    opts = {**SLURM_DEFAULTS, **given}
    for name in ("gpus_per_node", "time_min", "cpus_per_gpu", "parallelism"):
        if name in opts and opts[name] < 1:
            raise UsageError(f"{SLURM_FLAGS[name]} must be >= 1, got {opts[name]}")
    if "mem_gb" in opts and not opts["mem_gb"] > 0:
        raise UsageError(f"--slurm-mem-gb must be > 0, got {opts['mem_gb']}")
    if gpus % opts["gpus_per_node"]:
        raise UsageError(f"--gpus {gpus} is not a multiple of --slurm-gpus-per-node {opts['gpus_per_node']}: each array task runs one shard on every GPU of its node")
    return Scale(gpus, "slurm", not no_wait, opts)


def host_gpus(sc: Scale) -> list[sharding.Gpu] | None:
    """The GPUs of this host a local fan-out takes (checked: enough, one model); None under SLURM."""
    if sc.executor == "slurm":
        return None
    return sharding.choose(sc.gpus, sharding.inventory())


def gpu_model(sc: Scale) -> str | None:
    """The GPU model of a local fan-out (names its default output folder); None under SLURM."""
    gpus = host_gpus(sc)
    return gpus[0].name if gpus else None


# ---------------------------------------------------------------- the work folder and its spec
def _stamp() -> str:
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime()) + f"-{os.getpid()}"


def workdir(kind: str, out: Path | None = None, json_path: Path | None = None) -> Path:
    """Where a fan-out keeps its spec, the shards' folders and the logs: under the output folder,
    beside --json, else (a local `check` without --json) a temporary folder."""
    if out is not None:
        return Path(out).resolve() / FANOUT_DIR / f"{kind}-{_stamp()}"
    if json_path is not None:
        return Path(json_path).resolve().parent / f".{Path(json_path).name}.fanout" / _stamp()
    return Path(tempfile.mkdtemp(prefix=f"normbench-{kind}-"))


def is_fanout(path: Path) -> bool:
    """Whether ``path`` is a fan-out's work folder (normbench merge takes one as a source)."""
    try:
        return bool(json.loads((Path(path) / SPEC).read_text()).get("fanout"))
    except (OSError, ValueError, AttributeError):
        return False


def read_spec(path: Path) -> dict:
    path = Path(path)
    try:
        spec = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"{path}: not a fan-out's spec ({getattr(e, 'strerror', None) or e})") from None
    if not isinstance(spec, dict) or not spec.get("fanout") or not isinstance(spec.get("shards"), list):
        raise UsageError(f"{path}: not a fan-out's spec")
    return spec


def _write_json(path: Path, data) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _write_spec(work: Path, kind: str, sc: Scale, parts: list[list[sharding.Unit]], gpus, argv: list[str], command: str, dest) -> Path:
    n = len(parts)
    per_task = sc.slurm.get("gpus_per_node", 1) if sc.executor == "slurm" else 1
    tasks = [list(range(n))] if sc.executor == "processes" else [list(range(i, min(n, i + per_task))) for i in range(0, n, per_task)]
    spec = {
        "fanout": 1,
        "kind": kind,
        "command": command,
        "argv": list(argv),
        "python": [sys.executable, "-m", os.environ.get(WORKER_MODULE) or "harness"],
        "cwd": os.getcwd(),
        "executor": sc.executor,
        "dest": str(Path(dest).resolve()) if dest else None,
        "created": _now(),
        "gpus": [asdict(g) for g in gpus[:n]] if gpus else None,
        "tasks": tasks,
        "merge_when_done": sc.executor == "slurm" and not sc.wait,
        "shards": [
            {"index": k, "folder": str(work / f"shard-{k}"), "cost": round(sum(u.cost for u in part), 1),
             "points": [[u.position, list(u.key)] for u in part]}
            for k, part in enumerate(parts)
        ],
    }  # fmt: skip
    work.mkdir(parents=True, exist_ok=True)
    path = work / SPEC
    _write_json(path, spec)
    return path


# ---------------------------------------------------------------- running the workers
def _marker(work: Path, k: int, what: str) -> Path:
    return work / f"shard-{k}.{what}.json"


def _count(kind: str, folder: Path) -> int:
    """Units a shard has finished so far (from what it has written)."""
    try:
        if kind == "model":
            return sum(1 for p in folder.glob("*.json"))
        name = {"bench": "results.jsonl", "warm": "warm.jsonl", "check": "check.jsonl"}[kind]
        with open(folder / name, "rb") as fh:
            lines = fh.read().split(b"\n")
        return sum(1 for ln in lines if ln.strip() and (kind != "check" or ln.startswith(b'{"result"')))
    except OSError:
        return 0


def _ended(rc: int) -> str:
    if rc == 0:
        return "finished"
    if rc < 0:
        try:
            return f"was killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"was killed by signal {-rc}"
    return f"exited with status {rc}"


def _progress(spec: dict, started: float) -> str:
    kind, shards = spec["kind"], spec["shards"]
    counts = [(_count(kind, Path(s["folder"])), len(s["points"])) for s in shards]
    done, total = sum(c for c, _ in counts), sum(t for _, t in counts)
    per = ", ".join(f"{k}: {c}/{t}" for k, (c, t) in enumerate(counts))
    return f"{kind}: {done}/{total} {_units(kind)} after {time.monotonic() - started:.0f} s (per shard {per})"


def _units(kind: str) -> str:
    return "architectures" if kind == "model" else "points"


def _run_processes(spec_path: Path, spec: dict, shard_ids: list[int], gpus: list[sharding.Gpu]) -> tuple[dict[int, int], bool]:
    """Start shard ``shard_ids[i]``'s worker on ``gpus[i]``, wait for all of them; {shard: exit
    status}, and whether Ctrl-C stopped them (they get it too, and then up to 30 s to stop)."""
    work = Path(spec_path).parent
    host = platform.node().split(".")[0]
    threads = str(max(1, _cores() // max(1, len(shard_ids))))
    procs = {}
    for k, gpu in zip(shard_ids, gpus):
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpu.visible, "NORMBENCH_GPU_ID": gpu.id, "NORMBENCH_GPU_NAME": gpu.name}
        env.setdefault("OMP_NUM_THREADS", threads)  # N workers on one host's cores
        cmd = [*spec["python"], *spec["argv"], "--shard-spec", str(spec_path), "--shard-index", str(k)]
        log = open(work / f"shard-{k}.log", "ab")
        procs[k] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=spec.get("cwd")), log, gpu)
    ids = ", ".join(g.id for g in gpus)
    total = sum(len(spec["shards"][k]["points"]) for k in shard_ids)
    print(f"{spec['kind']}: {total} {_units(spec['kind'])} in {len(procs)} shards on GPUs {ids} ({gpus[0].name}); logs: {work}/shard-K.log", flush=True)
    codes: dict[int, int] = {}
    started = last = time.monotonic()
    interrupted = False

    def reap():
        for k, (p, log, gpu) in procs.items():
            if k not in codes and (rc := p.poll()) is not None:
                codes[k] = rc
                log.close()
                _write_json(_marker(work, k, "exit"), {"status": rc, "gpu_id": gpu.id, "host": host, "at": _now()})
                n = len(spec["shards"][k]["points"])
                print(f"{spec['kind']}: shard {k} on GPU {gpu.id} {_ended(rc)} after {_count(spec['kind'], Path(spec['shards'][k]['folder']))}/{n} "
                      f"{_units(spec['kind'])} ({time.monotonic() - started:.0f} s)", flush=True)  # fmt: skip

    try:
        while len(codes) < len(procs):
            reap()
            if time.monotonic() - last >= PROGRESS_EVERY_S:
                print(_progress({**spec, "shards": [spec["shards"][k] for k in shard_ids]}, started), flush=True)
                last = time.monotonic()
            time.sleep(0.2)
    except KeyboardInterrupt:  # from a terminal the workers got it too; from kill -INT, they get it now
        interrupted = True
        for wait_s, then in ((5, signal.SIGINT), (25, None)):
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline and any(p.poll() is None for p, _, _ in procs.values()):
                time.sleep(0.2)
            for p, _, _ in procs.values():
                if then and p.poll() is None:
                    with contextlib.suppress(OSError):
                        p.send_signal(then)
        for p, _, _ in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        reap()
    return codes, interrupted


def run_task(spec_path: str, task: int) -> dict:
    """One submitit task (a SLURM array task, or a LocalExecutor job): the shards of
    ``spec["tasks"][task]``, one worker per GPU this task was given; with --no-wait, the merge
    when every shard has ended."""
    spec_path = Path(spec_path)
    spec = read_spec(spec_path)
    if spec.get("cwd") and Path(spec["cwd"]).is_dir():
        os.chdir(spec["cwd"])
    shard_ids = spec["tasks"][task]
    gpus = sharding.inventory()
    if len(gpus) < len(shard_ids):
        raise RuntimeError(f"task {task} sees {len(gpus)} GPU(s) ({sharding.describe(gpus)}) for its {len(shard_ids)} shards")
    if spec["executor"] == "slurm":
        host = platform.node().split(".")[0]
        gpus = [sharding.Gpu(f"{host}:{g.id}", g.name, g.visible) for g in gpus]
    codes, _ = _run_processes(spec_path, spec, shard_ids, gpus[: len(shard_ids)])
    if spec.get("merge_when_done"):
        _merge_when_all_ended(spec_path)
    return {str(k): v for k, v in codes.items()}


def _merge_when_all_ended(spec_path: Path) -> None:
    """The last task of a --no-wait array merges (under a lock on the work folder: once)."""
    from harness.results.store import folder_lock

    work = spec_path.parent
    try:
        spec = read_spec(spec_path)
        if not all(_marker(work, s["index"], "exit").exists() for s in spec["shards"]):
            return
        with folder_lock(work, "merge"):
            if (work / MERGED).exists() or not spec_path.exists():
                return
            fin = finish(spec_path, Path(spec["dest"]))
        print(summary(fin), flush=True)
        for p in fin.problems:
            print(f"normbench: {fin.kind}: {p}", flush=True)
    except (ValueError, OSError) as e:  # another task merged (or merges), or the shards cannot be merged: said in this task's log
        print(f"normbench: merge of {work}: {e}", flush=True)


def _submitit():
    try:
        import submitit
    except ImportError:
        raise UsageError("--executor local and slurm need submitit: pip install submitit (normbench's dev and cluster extras hold it)") from None
    return submitit


def slurm_parameters(sc: Scale, kind: str, tasks: int) -> dict:
    """submitit SlurmExecutor's parameters (sbatch's, by submitit's names) for ``tasks`` array tasks."""
    o = sc.slurm
    params = {
        "job_name": f"normbench-{kind}",
        "partition": o["partition"],
        "nodes": 1,
        "ntasks_per_node": 1,
        "gpus_per_node": o["gpus_per_node"],
        "cpus_per_task": o["cpus_per_gpu"] * o["gpus_per_node"],
        "time": o["time_min"],
        "array_parallelism": o.get("parallelism") or tasks,
        "stderr_to_stdout": True,
    }
    if o.get("mem_gb"):
        params["mem"] = f"{o['mem_gb']:g}GB"
    for name in ("account", "qos", "constraint"):
        if o.get(name):
            params[name] = o[name]
    if o.get("setup"):
        params["setup"] = list(o["setup"])
    return params


def _submit(spec_path: Path, spec: dict, sc: Scale, gpus) -> list:
    submitit = _submitit()
    work = spec_path.parent
    folder = work / "submitit"
    tasks = spec["tasks"]
    if sc.executor == "local":
        ex = submitit.LocalExecutor(folder=folder)
        jobs = []
        for t, shard_ids in enumerate(tasks):
            try:
                visible = [int(gpus[k].id) for k in shard_ids]
            except ValueError:
                raise UsageError(f"--executor local needs GPUs named by index, not {', '.join(gpus[k].id for k in shard_ids)}") from None
            ex.update_parameters(timeout_min=LOCAL_TIMEOUT_MIN, gpus_per_node=len(visible), visible_gpus=visible, tasks_per_node=1)
            jobs.append(ex.submit(run_task, str(spec_path), t))
    else:
        ex = submitit.SlurmExecutor(folder=folder)
        ex.update_parameters(**slurm_parameters(sc, spec["kind"], len(tasks)))
        jobs = ex.map_array(run_task, [str(spec_path)] * len(tasks), list(range(len(tasks))))
    _write_json(work / "jobs.json", {"executor": sc.executor, "jobs": [j.job_id for j in jobs]})
    total = sum(len(s["points"]) for s in spec["shards"])
    where = f"SLURM array {jobs[0].job_id.split('_')[0]}" if sc.executor == "slurm" else "submitit local tasks"
    print(f"{spec['kind']}: {total} {_units(spec['kind'])} in {len(spec['shards'])} shards, {len(jobs)} {where}; logs: {folder}/ and {work}/shard-K.log", flush=True)
    return jobs


def _wait(jobs: list, spec_path: Path, spec: dict) -> tuple[list[str], bool]:
    """Wait for submitit's ``jobs``; the tasks that failed (one line each), and whether Ctrl-C
    stopped the wait (a SLURM array goes on; local tasks are cancelled)."""
    started = last = time.monotonic()
    slurm = spec["executor"] == "slurm"
    try:
        while not all(j.done() for j in jobs):
            if time.monotonic() - last >= PROGRESS_EVERY_S:
                print(_progress(spec, started), flush=True)
                last = time.monotonic()
            time.sleep(5 if slurm else 0.5)
    except KeyboardInterrupt:
        if slurm:
            raise UsageError(f"stopped waiting; the SLURM array {jobs[0].job_id.split('_')[0]} goes on (scancel stops it): "
                             f"merge its shards when it has ended with `normbench merge {spec['dest']} {spec_path.parent}`") from None  # fmt: skip
        for j in jobs:
            with contextlib.suppress(Exception):
                j.cancel(check=False)
        return [], True
    failed = []
    for t, j in enumerate(jobs):
        try:
            exc = j.exception()
        except Exception as e:  # a task killed before it wrote its result
            exc = e
        if exc is not None:
            line = next((ln for ln in reversed(str(exc).strip().splitlines()) if ln.strip()), type(exc).__name__)
            failed.append(f"task {t} (job {j.job_id}) failed: {line.strip()[:300]}; its log: {spec_path.parent / 'submitit'}")
    return failed, False


# ---------------------------------------------------------------- the workers' side
@dataclass
class Shard:
    spec_path: Path
    spec: dict
    index: int
    folder: Path
    keys: set
    gpu_id: str | None
    host: str

    @property
    def command(self) -> str:
        return self.spec["command"]

    @property
    def label(self) -> str:
        return f"{self.index}/{len(self.spec['shards'])}"

    def check_plan(self, planned) -> None:
        """Every unit of this shard must be in the worker's own plan of the selection."""
        missing = self.keys - set(planned)
        if missing:
            raise UsageError(f"shard {self.index}: {len(missing)} of its {len(self.keys)} units are not in this worker's plan (e.g. {min(missing, key=str)}): "
                             "a worker must run the checkout and the packages of the command that planned it")  # fmt: skip

    def done(self, status: int = 0) -> int:
        _write_json(_marker(self.spec_path.parent, self.index, "done"), {"status": status, "at": _now()})
        return status


def load_shard(spec_path: str, index: int, device: str = "cuda") -> Shard:
    """The shard a worker runs (``--shard-spec``, ``--shard-index``); records which GPU it runs on."""
    from harness.run.environment import gpu_id

    path = Path(spec_path).resolve()
    spec = read_spec(path)
    if not 0 <= index < len(spec["shards"]):
        raise UsageError(f"--shard-index {index}: {path} has shards 0 to {len(spec['shards']) - 1}")
    s = spec["shards"][index]
    folder = Path(s["folder"])
    folder.mkdir(parents=True, exist_ok=True)
    host = platform.node().split(".")[0]
    name = os.environ.get("NORMBENCH_GPU_NAME") or device
    if device == "cuda":
        import torch

        if torch.cuda.is_available():
            name = torch.cuda.get_device_name(0)
    gid = gpu_id(device)
    _write_json(_marker(path.parent, index, "worker"), {"gpu": name, "gpu_id": gid, "host": host, "pid": os.getpid(), "started": _now()})
    return Shard(path, spec, index, folder, {sharding.key_of(k) for _, k in s["points"]}, gid, host)


def bench_worker(sh: Shard, impls, ops, directions, shape_sets, dtypes, weights, timer, device: str = "cuda") -> int:
    from harness.run import bench

    sh.check_plan(bench.planned_key(t) for t in bench.plan(impls, ops, directions, shape_sets, dtypes, weights))
    bench.run_bench(impls, ops, directions, shape_sets, dtypes, sh.folder, device=device, timer=timer, command=sh.command, progress=False,
                    weights=weights, only=sh.keys, gpu_id=sh.gpu_id, run_info={"shard": sh.label, "host": sh.host})  # fmt: skip
    return sh.done(0)


def warm_worker(sh: Shard, impls, ops, directions, shape_sets, dtypes, weights, jobs: int, device: str = "cuda") -> int:
    from harness.run import bench, warm

    sh.check_plan(bench.planned_key(t) for t in warm.warm_plan(impls, ops, directions, shape_sets, dtypes, sh.folder, device, weights))
    warm.run_warm(impls, ops, directions, shape_sets, dtypes, sh.folder, jobs, device=device, weights=weights, progress=False, only=sh.keys, gpu_id=sh.gpu_id)
    return sh.done(0)


def check_worker(sh: Shard, impls, ops, directions, dtypes, shape_sets, device: str, invariance: dict | None, **kwargs) -> int:
    """A shard of `check`: each result streamed to check.jsonl as it comes (a worker that dies keeps
    what it checked), then the implementations skipped whole and the invariance probes."""
    from harness.run import check
    from harness.run.environment import environment

    planned = [check.point_key(pt) for pt in check.plan(impls, ops, directions, dtypes, shape_sets, kwargs.get("overflow", False))]
    if invariance is not None:
        planned += [check.invariance_key(i, op) for i in impls for op in ops if op in i.ops]
    sh.check_plan(planned)
    with (sh.folder / "check.jsonl").open("w") as fh:
        fh.write(json.dumps({"environment": environment(device)}) + "\n")

        def stream(shape_set, r):
            fh.write(json.dumps({"result": {**r.to_json(), "shape_set": shape_set}}) + "\n")
            fh.flush()

        out = check.run(impls, ops, directions, dtypes, shape_sets, device, invariance=invariance, only=sh.keys, gpu_id=sh.gpu_id, on_result=stream, **kwargs)
        fh.write(json.dumps({"end": {"skipped": out.skipped, "invariance": out.invariance, "interrupted": out.interrupted}}) + "\n")
    return sh.done(130 if out.interrupted else 0)


def model_shard(sh: Shard, archs: list[str]) -> list[str]:
    """The architectures of a `model` worker's shard (its reports go into the shard's folder)."""
    sh.check_plan((a,) for a in archs)
    return [a for a in archs if (a,) in sh.keys]


def _cores() -> int:
    """The cores this process may run on (a SLURM task's allocation, where it has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 2


def default_jobs(sc: Scale | None, spec_path: str | None = None, index: int = 0) -> int:
    """`warm --jobs` unless given: half of this host's cores over the GPUs that search at once on it
    (a fan-out's workers on this host, a SLURM task's on its node), at most 8."""
    cores = _cores()
    here = 1
    if spec_path:
        spec = read_spec(Path(spec_path))
        here = next((len(t) for t in spec["tasks"] if index in t), 1)
    elif sc is not None and sc.executor != "slurm":
        here = len(host_gpus(sc))
    return max(1, min(8, cores // 2 // here))


# ---------------------------------------------------------------- the parent's side
@dataclass
class Finished:
    """What a fan-out left: where it merged, and one line per shard that did not finish."""

    kind: str
    dest: Path | None
    work: Path
    problems: list[str] = field(default_factory=list)
    interrupted: bool = False
    submitted: str | None = None  # --no-wait: what was submitted, and how it merges
    meta: dict | None = None  # bench
    rows: list | None = None  # bench, warm
    outcome: object = None  # check
    status: int = 0  # model: 1 when an implementation disagreed
    shards: int = 0
    removed: bool = False  # the work folder was removed (everything merged)

    @property
    def exit_status(self) -> int:
        return 130 if self.interrupted else (1 if self.problems else self.status)


def _launch(kind: str, sc: Scale, units: list[sharding.Unit], gpus, work: Path, argv, command, dest, holding_lock=False) -> Finished:
    """Deal ``units`` into shards, run them (or submit them: --no-wait), merge them into ``dest``."""
    n = min(len(gpus) if gpus else sc.gpus, len(units))
    parts = sharding.partition(units, n)
    spec_path = _write_spec(work, kind, sc, parts, gpus, argv, command, dest)
    spec = read_spec(spec_path)
    failed, interrupted = [], False
    if sc.executor == "processes":
        _, interrupted = _run_processes(spec_path, spec, list(range(n)), gpus[:n])
    else:
        jobs = _submit(spec_path, spec, sc, gpus)
        if not sc.wait:
            array = jobs[0].job_id.split("_")[0]
            per = sc.slurm["gpus_per_node"]
            msg = (f"submitted {len(jobs)} tasks ({per} GPU{'s' if per > 1 else ''} each, {n} shards) as SLURM array {array} to partition "
                   f"{sc.slurm['partition']}; logs: {work}/submitit/ and {work}/shard-K.log. Its last task merges the shards into {dest}; "
                   f"if a task dies first: normbench merge {dest} {work}")  # fmt: skip
            return Finished(kind, Path(dest) if dest else None, work, submitted=msg, shards=n)
        failed, interrupted = _wait(jobs, spec_path, spec)
    fin = finish(spec_path, Path(dest) if dest else None, holding_lock=holding_lock, write_report=kind != "bench")
    fin.problems = failed + fin.problems
    fin.interrupted = interrupted
    return fin


def _shard_problems(spec: dict, work: Path) -> list[str]:
    out = []
    for s in spec["shards"]:
        k = s["index"]
        if _read_json(_marker(work, k, "done")) is not None:
            continue
        ex, wk = _read_json(_marker(work, k, "exit")), _read_json(_marker(work, k, "worker")) or {}
        how = _ended(ex["status"]) if ex else "has not ended (or was stopped with its task)"
        gpu = f" on GPU {wk['gpu_id']}" if wk.get("gpu_id") else ""
        out.append(f"shard {k}{gpu} {how} after {_count(spec['kind'], Path(s['folder']))} of {len(s['points'])} {_units(spec['kind'])}; log: {work}/shard-{k}.log")
    return out


def _one_model(spec: dict, work: Path) -> None:
    seen = {}
    for s in spec["shards"]:
        wk = _read_json(_marker(work, s["index"], "worker"))
        if wk and wk.get("gpu"):
            seen.setdefault(wk["gpu"], []).append(f"shard {s['index']} on {wk.get('host')}")
    if len(seen) > 1:
        said = "; ".join(f"{gpu}: {', '.join(where)}" for gpu, where in seen.items())
        raise ValueError(f"the shards ran on different GPU models ({said}): a report is of one GPU model, so nothing was merged "
                         "(pin one model, e.g. with --slurm-constraint)")  # fmt: skip


def finish(spec_path: Path, dest: Path | None, holding_lock: bool = False, write_report: bool = True) -> Finished:
    """Merge a fan-out's shards (``dest``: the folder, or for `check` the JSON file, to merge into);
    once merged, the work folder is removed if every shard finished, and kept (with its logs)
    otherwise. ``holding_lock``: the caller holds ``dest``'s folder lock (`bench`);
    ``write_report``: `bench`'s report.md, CSV and plots (the command writes them itself)."""
    spec_path = Path(spec_path)
    spec, work = read_spec(spec_path), spec_path.parent
    done = _read_json(work / MERGED)
    if done:
        raise UsageError(f"{work} was merged into {done.get('into')} at {done.get('at')}: its shards are there already")
    _one_model(spec, work)
    fin = Finished(spec["kind"], dest, work, problems=_shard_problems(spec, work), shards=len(spec["shards"]))
    {"bench": _finish_bench, "warm": _finish_warm, "check": _finish_check, "model": _finish_model}[spec["kind"]](spec, work, fin, holding_lock, write_report)
    _write_json(work / MERGED, {"into": str(dest) if dest else None, "at": _now()})
    if not fin.problems:
        shutil.rmtree(work, ignore_errors=True)
        with contextlib.suppress(OSError):
            work.parent.rmdir()  # OUT/.fanout, when no other fan-out is in it
        fin.removed = True
    return fin


def _shard_folders(spec: dict, *names: str) -> list[tuple[dict, Path]]:
    return [(s, Path(s["folder"])) for s in spec["shards"] if all((Path(s["folder"]) / n).exists() for n in names)]


def _finish_bench(spec, work, fin, holding_lock, write_report):
    from harness.results import report
    from harness.results.store import folder_lock, load_results, merge_locked, meta_text, read_meta, write_atomically

    dest = fin.dest
    shards = _shard_folders(spec, "meta.json", "results.jsonl")
    metas = [read_meta(f / "meta.json") for _, f in shards]
    gpus = sorted({str(m.get("gpu")) for m in metas})
    if len(gpus) > 1:
        raise ValueError(f"the shards were measured on different GPUs ({', '.join(gpus)}): a report is of one GPU model, so nothing was merged")
    lock = contextlib.nullcontext() if holding_lock else folder_lock(dest, "merge")
    dest.mkdir(parents=True, exist_ok=True)
    with lock:
        if metas:
            base = metas[0]
            meta_path, results_path = dest / "meta.json", dest / "results.jsonl"
            have = read_meta(meta_path).get("gpu") if meta_path.exists() else None
            if have not in (None, base.get("gpu")):
                raise ValueError(f"{dest} was measured on {have}, the shards on {base.get('gpu')}: results of different GPUs are never merged")
            fresh = {meta_path: meta_text({"gpu": base.get("gpu"), "runs": []}), results_path: ""}
            write_atomically({path: text for path, text in fresh.items() if not path.exists()})  # a new folder
            update = {k: v for k, v in base.items() if k != "runs"}
            update["copy_bandwidth_tbps"] = statistics.median(m["copy_bandwidth_tbps"] for m in metas if m.get("copy_bandwidth_tbps"))
            update["finished"] = max((m.get("finished") or "" for m in metas), default="") or _now()
            names = [f"shard {s['index']}/{len(spec['shards'])} of {work.name}" for s, _ in shards]
            merge_locked(dest, [f for _, f in shards], names=names, update=update)
        if (dest / "meta.json").exists():
            fin.meta, fin.rows = read_meta(dest / "meta.json"), load_results(dest / "results.jsonl")
            if fin.rows and write_report:
                report.write_report(dest, fin.meta, fin.rows)


def _finish_warm(spec, work, fin, holding_lock, write_report):
    rows = []
    for _, folder in _shard_folders(spec, "warm.jsonl"):
        rows += [json.loads(ln) for ln in (folder / "warm.jsonl").read_text().splitlines() if ln.strip()]
    fin.dest.mkdir(parents=True, exist_ok=True)
    with (fin.dest / "warm.jsonl").open("a") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")
    fin.rows = rows


def _finish_check(spec, work, fin, holding_lock, write_report):
    from harness.run.check import Outcome, write_json
    from harness.run.checker import CheckResult

    order = {sharding.key_of(k): pos for s in spec["shards"] for pos, k in s["points"]}
    results, probes, env, device = [], [], None, None
    out = Outcome("cuda")
    for _, folder in _shard_folders(spec, "check.jsonl"):
        for line in (folder / "check.jsonl").read_text().splitlines():
            try:
                d = json.loads(line)
            except ValueError:  # a line a dying worker cut off
                continue
            if "environment" in d and env is None:
                env = d["environment"]
            elif "result" in d:
                r = dict(d["result"])
                sname = r.pop("shape_set")
                res = CheckResult.from_json(r)
                device = device or res.device
                results.append((order.get((res.impl, res.op, res.direction, res.dtype, sname, res.shape, res.overflow), 1 << 60), sname, res))
            elif "end" in d:
                for name, why in d["end"].get("skipped", {}).items():
                    out.skipped.setdefault(name, why)
                probes += [(order.get(("invariance", p["impl"], p["op"]), 1 << 60), p) for p in d["end"].get("invariance") or []]
                out.interrupted |= bool(d["end"].get("interrupted"))
                if d["end"].get("invariance") is not None:
                    out.invariance = out.invariance or []
    out.device = device or (env or {}).get("device") or ("cpu" if (env or {}).get("gpu") == "cpu" else "cuda")
    out.results = [(s, r) for _, s, r in sorted(results, key=lambda t: t[0])]
    if out.invariance is not None:
        out.invariance = [p for _, p in sorted(probes, key=lambda t: t[0])]
    fin.outcome = out
    if fin.dest is not None:
        write_json(out, fin.dest, spec["command"], env=env or {})


def _finish_model(spec, work, fin, holding_lock, write_report):
    from harness.run import models

    fin.dest.mkdir(parents=True, exist_ok=True)
    status = 0
    for _, folder in _shard_folders(spec):
        for p in sorted(folder.glob("*.json")):
            rep = json.loads(p.read_text())
            shutil.copyfile(p, fin.dest / p.name)
            if any(r.get("status") in ("fail", "error") for r in rep.get("results", [])):
                status = 1
    models.write_markdown(fin.dest)
    fin.status = status


def merge(dest: Path, work: Path) -> Finished:
    """``normbench merge DEST WORKFOLDER``: a fan-out's shards, merged by hand (a --no-wait array
    whose task died before the last one could merge, or a fan-out whose parent was stopped)."""
    spec_path = Path(work) / SPEC
    kind = read_spec(spec_path)["kind"]
    if kind == "check" and Path(dest).is_dir():
        raise UsageError(f"{dest}: a check's shards merge into a JSON file, not a folder")
    return finish(spec_path, Path(dest))


def _leftovers(out: Path, kind: str) -> list[Path]:
    """Earlier fan-outs of ``kind`` into ``out`` that were never merged (their parent was stopped)."""
    found = []
    for spec_path in sorted((Path(out) / FANOUT_DIR).glob(f"{kind}-*/{SPEC}")):
        if not (spec_path.parent / MERGED).exists():
            found.append(spec_path)
    return found


def _abandon_leftovers(out: Path, kind: str) -> None:
    """A run that starts ``out`` over: earlier fan-outs never merged into it are never merged now."""
    for spec_path in _leftovers(out, kind):
        _write_json(spec_path.parent / MERGED, {"into": None, "at": _now(), "abandoned": f"{out} was started over"})


def _adopt_leftovers(out: Path, kind: str) -> None:
    """Before a --resume: merge earlier fan-outs into ``out`` whose parent stopped before merging
    (not those from before ``out`` was last started over); refuse while one may still be running."""
    from harness.results.store import read_meta

    runs = (read_meta(out / "meta.json").get("runs") or []) if (out / "meta.json").exists() else []
    since = runs[0].get("started") if runs else None
    for spec_path in _leftovers(out, kind):
        work, spec = spec_path.parent, read_spec(spec_path)
        if since and spec.get("created", "") < since:
            continue  # from before the folder's first run: another folder's shards, once
        running = [s["index"] for s in spec["shards"] if not (_marker(work, s["index"], "exit").exists() or _marker(work, s["index"], "done").exists())]
        if running:
            raise UsageError(f"{work} holds shards of an earlier fan-out into {out} that have not ended ({', '.join(map(str, running))}): once its "
                             f"workers or jobs have ended, merge what they measured with `normbench merge {out} {work}`, then --resume")  # fmt: skip
        fin = finish(spec_path, Path(out), holding_lock=True, write_report=False)
        print(f"{kind}: merged the shards of an earlier fan-out ({work}) into {out} first" + (f" ({len(fin.problems)} had stopped early)" if fin.problems else ""))


# ---------------------------------------------------------------- the commands
def bench(sc: Scale, impls, ops, directions, shape_sets, dtypes, weights, out: Path, resume: bool, argv, command: str,
          retry_noisy: bool = False) -> Finished:  # fmt: skip
    """`bench --gpus`: the planned points (less those ``out`` holds, with --resume; its noisy ones
    measured again with ``retry_noisy``, their new rows replacing them at the merge) over the GPUs;
    merged into ``out`` with the report written, or submitted (--no-wait)."""
    from harness.results.store import folder_lock, load_results, point_key, read_meta
    from harness.run import bench as bench_run

    gpus = host_gpus(sc)
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    with folder_lock(out, "bench"):
        held: list = []  # the folder's rows, with --resume
        if resume:
            _adopt_leftovers(out, "bench")
            if (out / "meta.json").exists() and gpus:
                have = read_meta(out / "meta.json").get("gpu")
                if have not in (None, gpus[0].name):
                    raise UsageError(f"{out} was measured on {have}, these GPUs are {gpus[0].name}: --resume adds points of the same GPU only (use another --out)")
            if (out / "results.jsonl").exists():
                held = load_results(out / "results.jsonl")
        else:
            bench_run._start_over(out)
            _abandon_leftovers(out, "bench")
        planned = bench_run.plan(impls, ops, directions, shape_sets, dtypes, weights)
        done = {point_key(r) for r in held} - (bench_run.noisy_in(held, planned) if retry_noisy else set())
        todo = [t for t in planned if bench_run.planned_key(t) not in done]
        units = sharding.bench_units(todo)
        if not units:
            fin = Finished("bench", out, out)
            if (out / "meta.json").exists():
                fin.meta, fin.rows = read_meta(out / "meta.json"), load_results(out / "results.jsonl")
            return fin
        return _launch("bench", sc, units, gpus, workdir("bench", out), argv, command, out, holding_lock=True)


def warm(sc: Scale, impls, ops, directions, shape_sets, dtypes, weights, out: Path, argv, command: str) -> Finished:
    """`warm --gpus`: the searches over the GPUs (each worker with its own --jobs processes)."""
    from harness.run import warm as warm_run

    gpus = host_gpus(sc)
    todo = warm_run.warm_plan(impls, ops, directions, shape_sets, dtypes, out, "cuda", weights)
    units = sharding.bench_units(todo, timed=False)
    if not units:
        return Finished("warm", Path(out), Path(out), rows=[])
    return _launch("warm", sc, units, gpus, workdir("warm", out), argv, command, out)


def check(sc: Scale, impls, ops, directions, dtypes, shape_sets, device: str, json_path: Path | None, argv, command: str,
          invariance: dict | None = None, overflow: bool = False) -> Finished:  # fmt: skip
    """`check --gpus`: the points (and invariance probes) over the GPUs, gathered into one outcome."""
    from harness.run import check as check_run

    gpus = host_gpus(sc)
    if sc.executor == "slurm" and json_path is None:
        raise UsageError("check --executor slurm needs --json FILE, on a file system the nodes share: the shards are written beside it")
    points = check_run.plan(impls, ops, directions, dtypes, shape_sets, overflow)
    probes = [(i, op) for i in impls for op in ops if op in i.ops] if invariance is not None else []
    units = sharding.check_units(points, probes, device)
    if not units:
        raise UsageError("check: the selection has no point to check")
    return _launch("check", sc, units, gpus, workdir("check", json_path=json_path), argv, command, json_path)


def model(sc: Scale, archs: list[str], out: Path, argv, command: str) -> Finished:
    """`model --gpus`: one architecture per shard unit, the reports gathered into ``out``."""
    gpus = host_gpus(sc)
    return _launch("model", sc, sharding.model_units(archs), gpus, workdir("model", out), argv, command, out)


def summary(fin: Finished) -> str:
    """One line on what a fan-out merged, or what it submitted."""
    if fin.submitted:
        return fin.submitted
    where = "" if fin.removed else f"; its work folder, with the logs, is kept: {fin.work}"
    if fin.kind == "bench":
        n = len(fin.rows or [])
        return f"bench: merged {fin.shards} shards into {fin.dest}: {n} points{where}"
    if fin.kind == "warm":
        return f"warm: merged {fin.shards} shards' searches into {fin.dest}/warm.jsonl{where}"
    if fin.kind == "check":
        return f"check: gathered {fin.shards} shards{' into ' + str(fin.dest) if fin.dest else ''}{where}"
    return f"model: gathered {fin.shards} shards' reports into {fin.dest}{where}"
