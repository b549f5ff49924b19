"""The results store: a benchmark folder's ``results.jsonl`` (one benchmark point per line, appended
as points are measured) and ``meta.json`` (the runs that wrote it: command, commit, versions, copy
bandwidth), read with one-line errors naming the file and line, and merged across runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

# What every results.jsonl line must hold for `rank`, `report`, `merge` and `--resume` to use it.
ROW_FIELDS = {"impl": str, "dsl": str, "op": str, "direction": str, "shape_set": str, "shape": str, "M": int, "N": int, "dtype": str, "status": str}
ROW_STATUSES = ("ok", "failed", "error", "skip")


def read_meta(path: Path) -> dict:
    """A benchmark folder's meta.json; a one-line ValueError naming the file (and line) otherwise."""
    path = Path(path)
    text = _read_text(path, "meta.json")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: line {e.lineno}: not valid JSON ({e.msg})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object (meta.json), got {_json_kind(data)}")
    runs = data.get("runs", [])
    if not isinstance(runs, list) or not all(isinstance(r, dict) for r in runs):
        raise ValueError(f"{path}: 'runs' must be a list of JSON objects")
    for r in runs:
        if not isinstance(r.get("copy_bandwidth") or {}, dict) or not _number_or_none((r.get("copy_bandwidth") or {}).get("tbps")):
            raise ValueError(f"{path}: a run's 'copy_bandwidth' must be an object with a number 'tbps'")
    if not _number_or_none(data.get("copy_bandwidth_tbps")):
        raise ValueError(f"{path}: 'copy_bandwidth_tbps' must be a number, got {data['copy_bandwidth_tbps']!r}")
    return data


def _number_or_none(v) -> bool:
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))


def _read_text(path: Path, what: str) -> str:
    if path.is_dir():
        raise ValueError(f"{path}: is a directory, not a {what} file")
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None


def _json_kind(v) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(type(v), "a number")


def _row_problem(row) -> str | None:
    if not isinstance(row, dict):
        return f"expected a JSON object (one benchmark point), got {_json_kind(row)}"
    for key, typ in ROW_FIELDS.items():
        if key not in row:
            return f"not a benchmark point: no '{key}'"
        if not isinstance(row[key], typ) or isinstance(row[key], bool):
            return f"'{key}' is {_json_kind(row[key])}, expected {'an integer' if typ is int else 'a string'}"
    if row["status"] not in ROW_STATUSES:
        return f"unknown status '{row['status']}' (expected {', '.join(ROW_STATUSES)})"
    for key in ("ms", "tbps", "frac_roofline"):
        v = row.get(key)
        if not _number_or_none(v) or (v is not None and not v > 0):
            return f"'{key}' must be a positive number or null, got {v!r}"
    if row["status"] == "ok" and row.get("ms") is None:
        return "status 'ok' without a time ('ms')"
    return None


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
            row = json.loads(line)
        except json.JSONDecodeError as e:
            if i == len(lines) and not text.endswith("\n"):
                cut = i
                continue
            raise ValueError(f"{path}: line {i}: not valid JSON ({e.msg})") from None
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
    if cut:
        msg = f"{path}: line {cut} is cut off (an interrupted run) and is left out"
        (note or (lambda m: print(f"normbench: note: {m}", file=sys.stderr)))(msg)
    return rows


def point_key(d: dict) -> tuple:
    return (d["impl"], d["op"], d["direction"], d["shape"], d["dtype"], d.get("weights", "same"))


def merge_results(dest: Path, sources: list[Path], commit: str | None = None) -> list[dict]:
    """Fold benchmark folders measured elsewhere (another run, a re-run of one implementation)
    into ``dest``: their runs are appended to ``dest``'s, and each of their points replaces the point
    with the same key (implementation, op, direction, shape, dtype, weights) in ``dest``. Points keep their
    own run's copy bandwidth, so every fraction stays the one measured next to it. ``commit`` names
    the commit holding the code a source measured where its meta records none (a tree copied
    without git history) or a dirty tree (uncommitted changes, committed since); the recorded value
    is kept as ``measured_tree``."""
    dest = Path(dest)
    meta_path, results_path = dest / "meta.json", dest / "results.jsonl"
    if not results_path.exists() or not meta_path.exists():
        raise ValueError(f"{dest} is not a benchmark folder (no results.jsonl and meta.json)")
    meta, rows = read_meta(meta_path), load_results(results_path)
    for src in map(Path, sources):
        if src.resolve() == dest.resolve():
            raise ValueError(f"{src} is the folder being merged into")
        if not (src / "results.jsonl").exists() or not (src / "meta.json").exists():
            raise ValueError(f"{src} is not a benchmark folder (no results.jsonl and meta.json)")
        smeta, srows = read_meta(src / "meta.json"), load_results(src / "results.jsonl")
        if smeta.get("gpu") != meta.get("gpu"):
            raise ValueError(f"{src} was measured on {smeta.get('gpu')!r}, {dest} on {meta.get('gpu')!r}: results of different GPUs are never merged")
        offset = len(meta.get("runs", []))
        sruns = smeta.get("runs", [])
        merged = []
        for i, r in enumerate(sruns):
            # the folder-level commit is its newest run's: an older run that recorded none stays unknown
            recorded = r.get("git_commit") or (smeta.get("git_commit") if i == len(sruns) - 1 else None)
            if commit and (not recorded or recorded.endswith("-dirty")):
                r = {**r, "git_commit": commit, "measured_tree": recorded}
            merged.append({**r, "git_commit": r.get("git_commit") or recorded, "merged_from": str(src)})
        meta["runs"] = meta.get("runs", []) + merged
        for r in srows:
            # points written before runs were numbered name none: only a one-run folder says whose they are
            if "run" in r:
                r["run"] = offset + r["run"]
            elif len(sruns) == 1:
                r["run"] = offset
        new = {point_key(r) for r in srows}
        rows = [r for r in rows if point_key(r) not in new] + srows
    results_path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    meta_path.write_text(json.dumps(meta, indent=2))
    return rows
