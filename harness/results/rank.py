"""Ranking math over benchmark rows (``results.jsonl``): pure functions, no GPU.

* score of an implementation for one op x direction = geometric mean of its fraction of the copy
  roofline over the sweep points it passed; coverage = points passed / points attempted (a point
  that failed its check or raised counts as attempted, never as passed; unavailable ones as neither);
* speedup vs eager = geometric mean of eager's time / its time over the points both passed;
* per-shape winner: the fastest passed point at each shape;
* order: an implementation that passed fewer shapes than the section holds ranks below every one
  that passed all of them, whatever its score (a geomean over the four easiest of eleven shapes is
  no rival for one over all eleven); its row stays, marked partial;
* per DSL: the best-scoring implementation of each DSL side by side (one measured on every shape
  before one measured on some).

Points of another weight variant than "same" (fp32 parameters, the Gemma offset) are ranked apart:
their ``dtype`` axis reads "bf16+fp32" / "bf16+offset" (``precision``), so every table, plot and
section gains them with no code of its own; rows written before the variant existed are "same".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

BASELINE = "eager"


@dataclass
class Ranked:
    impl: str
    dsl: str
    external: bool
    score: float | None  # geomean fraction of roofline
    tbps: float | None  # geomean TB/s
    passed: int
    attempted: int
    speedup: float | None
    noisy: int
    us: float | None = None  # geomean time per call, microseconds
    shapes: int = 0  # how many shapes the section holds (measured by any implementation)

    @property
    def partial(self) -> bool:
        """Passed on fewer shapes than the section holds."""
        return self.passed < self.shapes

    @property
    def coverage(self) -> str:
        return f"{self.passed}/{self.attempted}" + (" (partial)" if self.partial else "")


def geomean(xs) -> float | None:
    xs = [x for x in xs if x is not None and x > 0]
    if not xs:
        return None
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def precision(r: dict) -> str:
    """The dtype axis of a row: its dtype, with its weight variant where that is not "same"."""
    w = r.get("weights", "same")
    return r["dtype"] if w == "same" else f"{r['dtype']}+{w}"


def section_of(r: dict) -> tuple[str, str, str, str]:
    return (r["op"], r["direction"], r["shape_set"], precision(r))


# rows -> {section: its rows}, for the last list of rows asked about: a report asks for hundreds of
# sections of one list, and filtering the whole list for each took most of its time (7,000 rows).
# The index holds the rows themselves, so that no other row can take one of their ids meanwhile.
_INDEX: tuple[list[dict], tuple[int, ...], dict] | None = None


def section_rows(rows, op, direction, shape_set, dtype) -> list[dict]:
    """The rows of one (op, direction, shape set, precision) section, in their order."""
    global _INDEX
    ids = tuple(map(id, rows))  # the very same row objects, in the same order
    if _INDEX is None or _INDEX[1] != ids:
        index: dict[tuple, list[dict]] = {}
        for r in rows:
            index.setdefault(section_of(r), []).append(r)
        _INDEX = (list(rows), ids, index)
    return list(_INDEX[2].get((op, direction, shape_set, dtype), ()))


def leaderboard(rows: list[dict], op: str, direction: str, shape_set: str = "sweep", dtype: str = "bf16") -> list[Ranked]:
    sel = section_rows(rows, op, direction, shape_set, dtype)
    shapes = len({r["shape"] for r in sel})
    base = {r["shape"]: r["ms"] for r in sel if r["impl"] == BASELINE and r["status"] == "ok"}
    out = []
    for name in sorted({r["impl"] for r in sel}):
        mine = [r for r in sel if r["impl"] == name]
        attempted = [r for r in mine if r["status"] != "skip"]
        ok = [r for r in attempted if r["status"] == "ok"]
        if not attempted:
            continue
        speed = geomean(base[r["shape"]] / r["ms"] for r in ok if r["shape"] in base and r["ms"])
        out.append(
            Ranked(
                name,
                mine[0]["dsl"],
                bool(mine[0].get("external")),
                geomean(r.get("frac_roofline") for r in ok),
                geomean(r.get("tbps") for r in ok),
                len(ok),
                len(attempted),
                speed,
                sum(1 for r in ok if r.get("noisy")),
                geomean(r["ms"] * 1e3 for r in ok if r.get("ms")),
                shapes,
            )
        )
    out.sort(key=lambda r: (r.partial, r.score is None, -(r.score or 0), r.impl))
    return out


def winners(rows: list[dict], op: str, direction: str, shape_set: str = "sweep", dtype: str = "bf16") -> list[dict]:
    """Per shape (in N order): the fastest passed point and the runner-up."""
    sel = [r for r in section_rows(rows, op, direction, shape_set, dtype) if r["status"] == "ok"]
    shapes = sorted({(r["N"], r["M"], r["shape"]) for r in sel})
    out = []
    for n, m, label in shapes:
        pts = sorted((r for r in sel if r["shape"] == label), key=lambda r: r["ms"])
        out.append({"shape": label, "N": n, "M": m, "best": pts[0], "runner_up": pts[1] if len(pts) > 1 else None})
    return out


def shapes_in(rows: list[dict], op: str, direction: str, shape_set: str = "sweep", dtype: str = "bf16") -> int:
    """How many shapes the section holds (measured by any implementation)."""
    return len({r["shape"] for r in section_rows(rows, op, direction, shape_set, dtype)})


def by_dsl(rows: list[dict], op: str, direction: str, shape_set: str = "sweep", dtype: str = "bf16") -> dict[str, Ranked]:
    """The best implementation of each DSL. One measured on every shape of the section beats one
    measured on some only (a run that hit its time limit), whatever their scores: a geomean over
    the two easiest shapes is no rival for one over all eleven."""
    shapes = shapes_in(rows, op, direction, shape_set, dtype)
    best: dict[str, Ranked] = {}
    for r in leaderboard(rows, op, direction, shape_set, dtype):
        if r.score is None:
            continue
        cur = best.get(r.dsl)
        if cur is None or (r.attempted == shapes, r.score) > (cur.attempted == shapes, cur.score):
            best[r.dsl] = r
    return best


def sections(rows: list[dict]) -> list[tuple[str, str, str, str]]:
    """The (op, direction, shape_set, dtype) combinations present in ``rows``, in a stable order."""
    order_dir = {"fwd": 0, "bwd": 1, "fwdbwd": 2}
    order_set = {"sweep": 0, "between": 1, "small": 2, "perhead": 3, "decode": 4}
    combos = {section_of(r) for r in rows}
    return sorted(combos, key=lambda c: (order_set.get(c[2], 9), c[2], c[0], order_dir.get(c[1], 9), c[3]))
