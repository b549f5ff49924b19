"""The results store: a benchmark folder's ``results.jsonl`` (one benchmark point per line, appended
as points are measured), ``meta.json`` (the runs that wrote it: command, commit, versions, copy
bandwidth) and ``profile.json`` (``normbench profile``'s counters), read with one-line errors naming
the file (and the line), merged across runs, and written under a lock against concurrent writers."""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import re
import sys
from pathlib import Path

ROW_STATUSES = ("ok", "failed", "error", "skip")
PROFILE_FILE = "profile.json"
# Held by `bench` and `merge` while they write a folder (flock: the kernel drops it when a process dies).
LOCK_FILE = ".normbench.lock"
# Integers beyond this are no row count or length; they also overflow a float in plots.
_BIG = 2**62
# op, direction, dtype and weights name the plots' files: no path separators, no odd characters.
_NAME = re.compile(r"[A-Za-z0-9_.+-]{1,64}")


# ---------------------------------------------------------------- value checks
def _json_kind(v) -> str:
    if isinstance(v, bool):
        return "a boolean"
    return {dict: "an object", list: "a list", str: "a string", type(None): "null"}.get(type(v), "a number")


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _positive(v) -> bool:
    return _number(v) and math.isfinite(v) and v > 0


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < _BIG


# (test, what it must be)
STR = (lambda v: isinstance(v, str), "a string")
NAME = (lambda v: isinstance(v, str) and bool(_NAME.fullmatch(v)), "a name (letters, digits, '_.+-'; at most 64)")
BOOL = (lambda v: isinstance(v, bool), "a boolean")
NUMBER = (_number, "a number")
POSITIVE = (_positive, "a positive number")
NONNEG = (lambda v: _number(v) and math.isfinite(v) and v >= 0, "a number >= 0")
COUNT = (_count, "a non-negative integer")
LENGTH = (lambda v: _count(v) and v >= 1, "a positive integer")
OBJECT = (lambda v: isinstance(v, dict), "an object")
NUMBERS = (lambda v: isinstance(v, list) and all(_number(x) for x in v), "a list of numbers")

# What every results.jsonl line must hold for `rank`, `report`, `merge` and `--resume` to use it.
ROW_FIELDS = {"impl": STR, "dsl": STR, "op": NAME, "direction": NAME, "shape_set": STR, "shape": STR, "M": COUNT,
              "N": LENGTH, "dtype": NAME, "status": STR}  # fmt: skip
# What a line may hold beside them (absent or null: not recorded); "weights" absent is "same".
ROW_OPTIONAL = {"weights": (NAME, False), "run": (COUNT, False), "external": (BOOL, True), "noisy": (BOOL, True),
                "graph": (BOOL, True), "timing": (STR, True), "check": (STR, True), "reason": (STR, True), "config": (STR, True),
                "ms": (POSITIVE, True), "tbps": (POSITIVE, True), "frac_roofline": (POSITIVE, True),
                "ms_p95": (POSITIVE, True), "compile_s": (NONNEG, True), "spread": (NONNEG, True),
                "bytes_main": (COUNT, True), "bytes_extra": (COUNT, True), "trial_ms": (NUMBERS, True),
                "gpu_id": (STR, True)}  # fmt: skip
META_OPTIONAL = {"gpu": STR, "git_commit": STR, "versions": OBJECT, "copy_bandwidth_tbps": POSITIVE}
RUN_OPTIONAL = {"command": STR, "started": STR, "git_commit": STR, "measured_tree": STR, "merged_from": STR, "copy_bandwidth": OBJECT,
                "gpu_id": STR, "host": STR, "shard": STR}  # fmt: skip
PROFILE_POINT = {"impl": STR, "op": STR, "direction": STR, "shape": STR}
# read by the counters table unless the point records an error
PROFILE_COUNTERS = ("kernels", "dram_over_model", "dram_tbps", "l2_hit_pct", "warps_active_pct", "max_registers_per_thread")


def _field_problem(d: dict, key: str, check, required: bool, nullable: bool) -> str | None:
    test, what = check
    if key not in d:
        return f"no '{key}'" if required else None
    v = d[key]
    if v is None and nullable:
        return None
    if not test(v):
        shown = f" {v!r}" if isinstance(v, (int, float, str)) and not isinstance(v, bool) and len(repr(v)) <= 40 else ""
        return f"'{key}' is {_json_kind(v)}{shown}, expected {what}{' or null' if nullable else ''}"
    return None


def _row_problem(row) -> str | None:
    if not isinstance(row, dict):
        return f"expected a JSON object (one benchmark point), got {_json_kind(row)}"
    for key in ROW_FIELDS:
        if key not in row:
            return f"not a benchmark point: no '{key}'"
    for key, check in ROW_FIELDS.items():
        if problem := _field_problem(row, key, check, True, False):
            return problem
    if row["status"] not in ROW_STATUSES:
        return f"unknown status '{row['status']}' (expected {', '.join(ROW_STATUSES)})"
    for key, (check, nullable) in ROW_OPTIONAL.items():
        if problem := _field_problem(row, key, check, False, nullable):
            return problem
    if row["status"] == "ok":
        for key in ("ms", "tbps"):
            if row.get(key) is None:
                return f"status 'ok' without {'a time' if key == 'ms' else 'a bandwidth'} ('{key}')"
    return None


def meta_problem(data) -> str | None:
    """What is wrong with a parsed meta.json (None: nothing)."""
    if not isinstance(data, dict):
        return f"expected a JSON object (meta.json), got {_json_kind(data)}"
    for key, check in META_OPTIONAL.items():
        if problem := _field_problem(data, key, check, False, True):
            return problem
    runs = data.get("runs", [])
    if not isinstance(runs, list) or not all(isinstance(r, dict) for r in runs):
        return "'runs' must be a list of JSON objects"
    for i, r in enumerate(runs):
        for key, check in RUN_OPTIONAL.items():
            if problem := _field_problem(r, key, check, False, True):
                return f"run {i}: {problem}"
        if r.get("copy_bandwidth") is not None and (problem := _field_problem(r["copy_bandwidth"], "tbps", POSITIVE, False, True)):
            return f"run {i}: 'copy_bandwidth': {problem}"
    return None


def profile_problem(data) -> str | None:
    """What is wrong with a parsed profile.json (None: nothing)."""
    if not isinstance(data, dict):
        return f"expected a JSON object (profile.json), got {_json_kind(data)}"
    points = data.get("points", [])
    if not isinstance(points, list):
        return f"'points' is {_json_kind(points)}, expected a list"
    for i, p in enumerate(points):
        if not isinstance(p, dict):
            return f"point {i}: expected an object, got {_json_kind(p)}"
        for key, check in PROFILE_POINT.items():
            if problem := _field_problem(p, key, check, True, False):
                return f"point {i}: {problem}"
        if problem := _field_problem(p, "error", STR, False, True) or _field_problem(p, "tbps", NUMBER, False, True):
            return f"point {i}: {problem}"
        if not p.get("error"):
            for key in PROFILE_COUNTERS:
                if problem := _field_problem(p, key, NUMBER, True, True):
                    return f"point {i}: {problem}"
    return None


# ---------------------------------------------------------------- reading
def _read_text(path: Path, what: str) -> str:
    if path.is_dir():
        raise ValueError(f"{path}: is a directory, not a {what} file")
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None


def _parse(text: str) -> object:
    """JSON text, or a ValueError whose text starts with the line (for the caller to prefix the file)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"line {e.lineno}: not valid JSON ({e.msg})") from None
    except (ValueError, RecursionError) as e:  # an integer of thousands of digits; nesting too deep
        raise ValueError(f"not readable JSON ({type(e).__name__}: {str(e).splitlines()[0][:80]})") from None
    try:  # "\ud800" is valid JSON, but no file or terminal takes it
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("holds a string that is not valid Unicode (a lone surrogate escape)") from None
    return data


def _read_json(path: Path, what: str, problem_of) -> dict:
    path = Path(path)
    text = _read_text(path, what)
    try:
        data = _parse(text)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    problem = problem_of(data)
    if problem:
        raise ValueError(f"{path}: {problem}")
    return data


def read_meta(path: Path) -> dict:
    """A benchmark folder's meta.json; a one-line ValueError naming the file (and line) otherwise."""
    return _read_json(path, "meta.json", meta_problem)


def read_profile(path: Path) -> dict:
    """A benchmark folder's profile.json; a one-line ValueError naming the file otherwise."""
    return _read_json(path, PROFILE_FILE, profile_problem)


def read_results(path: Path) -> tuple[list[dict], int | None]:
    """The points of a results.jsonl and the number of a cut-off last line (None if there is none).

    An interrupted run can leave only its last line unfinished (no newline, not valid JSON): that
    line is left out and its number returned. Any other line that is not a benchmark point is a
    ValueError naming the file and the line; nothing is dropped silently."""
    path = Path(path)
    text = _read_text(path, "results.jsonl")
    lines = text.split("\n")
    rows, cut = [], None
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = _parse(line)
        except ValueError as e:
            if i == len(lines) and not text.endswith("\n") and str(e).startswith("line "):
                cut = i
                continue
            raise ValueError(f"{path}: line {i}: {str(e).removeprefix('line 1: ')}") from None
        problem = _row_problem(row)
        if problem:
            raise ValueError(f"{path}: line {i}: {problem}")
        rows.append(row)
    return rows, cut


def _end_with_complete_line(path: Path) -> None:
    """Before appending: cut a line an interrupted run left unfinished (load_results has said so),
    or end a complete last line with its newline; every other byte stays as it was."""
    text = path.read_text()
    if not text or text.endswith("\n"):
        return
    head, _, last = text.rpartition("\n")
    try:
        json.loads(last)
        path.write_text(text + "\n")
    except json.JSONDecodeError:
        path.write_text(head + "\n" if head else "")


def load_results(path: Path, note=None) -> list[dict]:
    """The points of ``path`` ([] when it does not exist); a cut-off last line is left out with a
    one-line note (to stderr, or to ``note``)."""
    path = Path(path)
    if not path.exists():
        return []
    rows, cut = read_results(path)
    note_cut(path, cut, note)
    return rows


def note_cut(path: Path, cut: int | None, note=None) -> None:
    """Say that line ``cut`` of ``path`` is left out (nothing when ``cut`` is None)."""
    if cut:
        msg = f"{path}: line {cut} is cut off (an interrupted run) and is left out"
        (note or (lambda m: print(f"normbench: note: {m}", file=sys.stderr)))(msg)


def point_key(d: dict) -> tuple:
    return (d["impl"], d["op"], d["direction"], d["shape"], d["dtype"], d.get("weights", "same"))


# ---------------------------------------------------------------- writing
@contextlib.contextmanager
def folder_lock(folder: Path, command: str):
    """Hold ``folder`` for ``command`` (bench, merge): a second writer of the same folder is refused
    at once with one line, rather than waiting hours for a benchmark or interleaving its writes."""
    folder = Path(folder)
    path = folder / LOCK_FILE
    for _ in range(5):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise ValueError(f"{folder}: cannot write in it ({e.strerror})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip()
            os.close(fd)
            raise ValueError(
                f"{folder} is being written by another normbench process ({holder or 'unknown'}): "
                f"{command} refuses to write it at the same time; run it again when that one has finished"
            ) from None
        # the holder before us removes the file as it lets go: hold the file at the path, not a removed one
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    else:
        raise ValueError(f"{folder}: could not take its lock file {path}")
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()}, normbench {command}\n".encode(), 0)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
        os.close(fd)


def _refuse_if_busy(folder: Path) -> None:
    """A folder that `bench` is still writing is no source to merge: its run is not finished."""
    path = Path(folder) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # no lock file: nobody writes it (writers create it)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip()
        raise ValueError(f"{folder} is being written by another normbench process ({holder or 'unknown'}): merge it when that one has finished") from None
    finally:
        os.close(fd)


def write_atomically(files: dict[Path, str], check=None) -> None:
    """Write every file of ``files`` (path -> text) to a temporary file beside it, ``check`` each
    temporary file (a reader that raises ValueError on what it does not accept), then put them in
    place with os.replace: a reader never sees a half-written file, and a check that fails leaves
    every file as it was."""
    tmps = {}
    try:
        for path, text in files.items():
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmps[path] = tmp
            with open(tmp, "w") as fh:
                fh.write(text)
                fh.flush()
                os.fsync(fh.fileno())
            if check:
                check(path, tmp)
        for path, tmp in tmps.items():
            os.replace(tmp, path)
    finally:
        for tmp in tmps.values():
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()


def meta_text(meta: dict) -> str:
    return json.dumps(meta, indent=2)


def results_text(rows: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def _check_written(path: Path, tmp: Path) -> None:
    try:
        if path.name == "meta.json":
            read_meta(tmp)
        else:
            _, cut = read_results(tmp)
            if cut:
                raise ValueError(f"line {cut} is cut off")
    except ValueError as e:
        raise ValueError(f"{path}: left as it was: what would be written is not readable back ({e})") from None


def _run_id(r: dict, commit: str | None) -> tuple | None:
    """What tells a run apart wherever its folder was copied or merged: when it started, its
    command, the copy bandwidth it measured, the code it measured (``commit``: what it recorded,
    before any --commit of a merge) and, for the shards of a fan-out (which start together with one
    command), its shard and GPU; runs that recorded no start time cannot be told apart."""
    if not r.get("started"):
        return None
    return (r["started"], r.get("command"), (r.get("copy_bandwidth") or {}).get("tbps"), commit, r.get("shard"), r.get("gpu_id"))


def _recorded_commit(r: dict, fallback: str | None = None) -> str | None:
    """The commit a run recorded itself (a merge's --commit moves it to ``measured_tree``)."""
    return r["measured_tree"] if "measured_tree" in r else (r.get("git_commit") or fallback)


def _benchmark_folder(d: Path) -> None:
    if not (d / "results.jsonl").exists() or not (d / "meta.json").exists():
        raise ValueError(f"{d} is not a benchmark folder (no results.jsonl and meta.json)")


def merge_results(dest: Path, sources: list[Path], commit: str | None = None, names: list[str] | None = None) -> list[dict]:
    """Fold benchmark folders measured elsewhere (another run, a re-run of one implementation)
    into ``dest``: their runs are appended to ``dest``'s, and each of their points replaces the point
    with the same key (implementation, op, direction, shape, dtype, weights) in ``dest``, except that
    a skipped point (not run where the source measured) never replaces a measured one. Points keep
    their own run's copy bandwidth, so every fraction stays the one measured next to it. ``commit``
    names the commit holding the code a source measured where its meta records none (a tree copied
    without git history) or a dirty tree (uncommitted changes, committed since); the recorded value
    is kept as ``measured_tree``.

    Every source is read and checked in full before ``dest`` is written; a source whose runs
    ``dest`` already records (merged before) is refused; ``dest`` is written atomically and under
    its lock (``folder_lock``), so a concurrent `bench` or `merge` of it is refused. ``names``: what
    each source's runs record as ``merged_from`` (default: the source's path)."""
    dest = Path(dest)
    _benchmark_folder(dest)
    with folder_lock(dest, "merge"):
        return merge_locked(dest, sources, commit, names)


def merge_locked(dest: Path, sources: list[Path], commit: str | None = None, names: list[str] | None = None,
                 update: dict | None = None) -> list[dict]:  # fmt: skip
    """``merge_results`` for a caller that holds ``dest``'s ``folder_lock`` already (a fan-out
    merging its shards into the folder it holds for the whole run); ``update``: fields of
    ``dest``'s meta.json to set in the same write (a fan-out's environment and copy bandwidth)."""
    dest = Path(dest)
    meta_path, results_path = dest / "meta.json", dest / "results.jsonl"
    _benchmark_folder(dest)
    meta, rows = read_meta(meta_path), load_results(results_path)
    runs = list(meta.get("runs", []))
    seen = {_run_id(r, _recorded_commit(r)): ("", i) for i, r in enumerate(runs) if r.get("started")}
    if (dest / PROFILE_FILE).exists():  # the report written after the merge reads it
        read_profile(dest / PROFILE_FILE)
    for n, src in enumerate(map(Path, sources)):
        if src.resolve() == dest.resolve():
            raise ValueError(f"{src} is the folder being merged into")
        _benchmark_folder(src)
        _refuse_if_busy(src)
        smeta, srows = read_meta(src / "meta.json"), load_results(src / "results.jsonl")
        if smeta.get("gpu") != meta.get("gpu"):
            raise ValueError(f"{src} was measured on {smeta.get('gpu')!r}, {dest} on {meta.get('gpu')!r}: results of different GPUs are never merged")
        offset = len(runs)
        sruns = smeta.get("runs", [])
        for i, r in enumerate(sruns):
            # the folder-level commit is its newest run's: an older run that recorded none stays unknown
            recorded = r.get("git_commit") or (smeta.get("git_commit") if i == len(sruns) - 1 else None)
            rid = _run_id(r, _recorded_commit(r, recorded))
            if rid in seen:
                where, j = seen[rid]
                raise ValueError(f"{src}: its run {i} (started {r['started']}) is already recorded in {dest} "
                                 f"(run {j}{', from ' + where if where else ''}): it was merged before")  # fmt: skip
            if rid:
                seen[rid] = (str(src), offset + i)
            if commit and (not recorded or recorded.endswith("-dirty")):
                r = {**r, "git_commit": commit, "measured_tree": recorded}
            runs.append({**r, "git_commit": r.get("git_commit") or recorded, "merged_from": names[n] if names else str(src)})
        measured = {point_key(r) for r in rows if r["status"] != "skip"}
        taken = []
        for r in srows:
            r = dict(r)
            # points written before runs were numbered name none: only a one-run folder says whose they are
            if "run" in r:
                r["run"] = offset + r["run"]
            elif len(sruns) == 1:
                r["run"] = offset
            if r["status"] == "skip" and point_key(r) in measured:
                continue
            taken.append(r)
        new = {point_key(r) for r in taken}
        rows = [r for r in rows if point_key(r) not in new] + taken
    meta.update(update or {})
    meta["runs"] = runs
    write_atomically({results_path: results_text(rows), meta_path: meta_text(meta)}, check=_check_written)
    return rows
