"""The cuTile table (impls/cutile/configs.json) from the grid runs of explore.py.

    python tools/experiments/cutile-tuning/pick.py GPU_NAME GRID_FWD.jsonl GRID_BWD.jsonl [LATER.jsonl ...]

Per (op, direction) and N bucket (the tile's width, next_pow2(N); 65536 stands for every wider row),
the grid candidate whose worst ratio to the best candidate over the bucket's measured widths is the
highest: a rule that holds between the points, not the winner of one. The heuristic (a GPU with no
table of its architecture) is the one candidate per direction with the best worst ratio over every
op and width. LATER runs (``explore.py wide-fwd``, ``cutile-wide-sync/sync.py``,
``cutile-wide-fwd/fwd.py``: other candidates at fewer widths) replace the grid's pick in every (op, direction, bucket) they measured, picked the same way
among their own candidates. Writes the GPU's entry and the heuristic into impls/cutile/configs.json.
"""

from __future__ import annotations

import collections
import json
import os
import sys

TABLE = os.path.join(os.path.dirname(__file__), "..", "..", "..", "impls", "cutile", "configs.json")
WIDEST_BUCKET = 65536


def bucket(n: int) -> int:
    from impls.cutile.plan import next_pow2

    return min(next_pow2(n), WIDEST_BUCKET)


SHAPE_FIELDS = ("fwd_tile_elements", "fwd_row_max", "fwd_chunk", "bwd_tile_elements", "bwd_row_max", "bwd_slice")


def key(t: dict, direction: str, n: int) -> str:
    """What a candidate does at width n: its tile plan (rows, width, pieces: the fields that set the
    tile, several of which do nothing at a given width) and its other knobs."""
    from impls.cutile.plan import Tuning, plan

    p = plan(direction, 2**27 // n, n, Tuning(**t))
    rest = {k: v for k, v in t.items() if k not in SHAPE_FIELDS}
    # within a bucket the width is one: rows and whether the row is cut tell the plans apart
    return json.dumps({"plan": [p.rows, p.width, p.wide], **rest}, sort_keys=True)


CONCRETE: dict = {}  # (direction, op, N, key) -> the measured tuning


def _candidates(r: dict) -> list[dict]:
    """explore.py's records as they are (one per candidate); a record of cutile-wide-sync/sync.py
    (one per (op, N), its candidates' tunings and fractions side by side: the table's entry among
    them, as all of its fields) as one per candidate, each tuning without the fields at their
    ``Tuning()`` defaults, as the table keeps them."""
    if "tunings" not in r:
        return [r]
    from dataclasses import asdict

    from impls.cutile.plan import Tuning

    default = asdict(Tuning())
    direction = record_direction(r)
    return [{"op": r["op"], "direction": direction, "N": r["N"], "frac": r["frac"][name],
             "tuning": {k: v for k, v in t.items() if default[k] != v}}
            for name, t in r["tunings"].items() if name in r["frac"] and not r["checks"].get(name, "pass") != "pass"]  # fmt: skip


def load(path: str):
    """(op, N) -> {key: fraction}; the plan's defaults ({}) left out: not a table entry."""
    by = collections.defaultdict(dict)
    with open(path) as f:
        lines = f.readlines()
    for r in (c for line in lines for c in _candidates(json.loads(line))):
        if "frac" in r and r["tuning"]:
            k = key(r["tuning"], r["direction"], r["N"])
            by[(r["op"], r["N"])][k] = max(r["frac"], by[(r["op"], r["N"])].get(k, 0))
            CONCRETE[(r["direction"], r["op"], r["N"], k)] = r["tuning"]
    return by


def best_rule(by, points, direction):
    """The candidate measured at every point with the highest worst ratio to the points' best, as
    the tuning measured at the widest of them (whose tile fields give the same plan at the rest)."""
    def rest(k):
        d = json.loads(k)
        d["plan"] = d["plan"][0::2]  # rows and cut or not: the width is the bucket's (or wider, at 65536)
        return json.dumps(d, sort_keys=True)

    per_point = {p: {rest(k): k for k in by[p]} for p in points}
    common = set.intersection(*(set(v) for v in per_point.values()))
    score = {c: min(by[p][per_point[p][c]] / max(by[p].values()) for p in points) for c in common}
    # ties (equal fractions, to the 4 decimals kept) go to the last key in sorted order: the same
    # table on every run, whatever the string hashing
    top = max(sorted(score, reverse=True), key=lambda c: (score[c], sum(by[p][per_point[p][c]] for p in points)))
    widest = max(points, key=lambda p: p[1])
    tuning = CONCRETE[(direction, widest[0], widest[1], per_point[widest][top])]
    return tuning, score[top], [by[p][per_point[p][top]] for p in sorted(points)]


def pick(by, direction: str) -> tuple[dict, dict]:
    table, notes = {}, {}
    for op in sorted({op for op, _ in by}):
        entries = {}
        for b in sorted({bucket(n) for o, n in by if o == op}):
            points = [(o, n) for o, n in by if o == op and bucket(n) == b]
            # a bucket's candidates differ in tile shape below and above the tile's width: rules
            # are compared only where every point measured them
            rule, worst, fracs = best_rule(by, points, direction)
            entries[str(b)] = rule
            notes[f"{op}_{direction} {b}"] = {"N": sorted(n for _, n in points), "worst_ratio_to_best": round(worst, 3),
                                               "fractions": fracs}  # fmt: skip
        table[f"{op}_{direction}"] = entries
    return table, notes


def heuristic(entries: dict, direction: str) -> dict:
    """One tuning per direction for GPUs with no table of their architecture: each field's most
    frequent value over this GPU's entries of that direction (ties: the smaller value)."""
    rules = [r for k, v in entries.items() if k.endswith("_" + direction) for r in v.values()]
    out = {}
    for field in sorted({f for r in rules for f in r}):
        votes = collections.Counter(json.dumps(r[field]) for r in rules if field in r)
        out[field] = json.loads(max(votes, key=lambda v: (votes[v], -float(json.loads(v)))))
    return out


def is_sync_run(path: str) -> bool:
    with open(path) as f:
        return "tunings" in json.loads(f.readline())


def record_direction(r: dict) -> str:
    """A record's direction: its own field (explore.py's), else that of the script that wrote it:
    cutile-wide-fwd/fwd.py's candidates exchange in the forward (``fwd_sync``), sync.py's in the
    backward."""
    if "direction" in r:
        return r["direction"]
    return "fwd" if any(t.get("fwd_sync") for t in r.get("tunings", {}).values()) else "bwd"


def direction_of(path: str) -> str:
    with open(path) as f:
        return record_direction(json.loads(f.readline()))


def main(gpu: str, fwd_path: str, bwd_path: str, *later: str):
    table = {}
    if os.path.exists(TABLE):
        with open(TABLE) as f:
            table = json.load(f)
    table.pop("_heuristic", None)
    entries, notes = {}, {}
    for direction, path in (("fwd", fwd_path), ("bwd", bwd_path)):
        t, nt = pick(load(path), direction)
        entries.update(t)
        notes.update(nt)
    # the exchanging backward's runs (sync.py) last, after the heuristic: measured on one GPU's
    # wide rows, they leave the rule for GPUs without a table as the grid found it
    later = sorted(later, key=is_sync_run)
    for path in later:
        if is_sync_run(path) and "_heuristic" not in table:
            table["_heuristic"] = {"fwd": heuristic(entries, "fwd"), "bwd": heuristic(entries, "bwd")}
        t, nt = pick(load(path), direction_of(path))
        for name, buckets in t.items():
            entries[name].update(buckets)
        notes.update({k: {**v, "from": os.path.relpath(path)} for k, v in nt.items()})
    table[gpu] = entries
    if not any(is_sync_run(p) for p in later):
        table["_heuristic"] = {"fwd": heuristic(entries, "fwd"), "bwd": heuristic(entries, "bwd")}
    with open(TABLE, "w") as f:
        json.dump(table, f, indent=1, sort_keys=True)
        f.write("\n")
    for k, v in notes.items():
        print(k, v)


if __name__ == "__main__":
    main(*sys.argv[1:])
