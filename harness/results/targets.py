"""What each DSL's hand-written kernels are held to, as a fraction of the copy bandwidth measured in
the same run (benchmarks only: never a timed test). Reports count the points below them.

A DSL's target depends on the direction and the row width: the backward's second output (the
dweight/dbias column reduction over every row) needs an exchange between CTAs that Triton, Helion
and Gluon cannot express once a row outgrows one CTA's registers, hence the lower bar above
``WIDE``; rows whose width is not a multiple of 8 get no 16-byte vectors, hence ``ODD``.
"""

from __future__ import annotations

WIDE = 32768  # above this N, the "wide" backward target applies
ODD = 0.70  # any DSL, N not a multiple of 8

# dsl -> (forward, backward up to WIDE, backward beyond WIDE)
TARGETS: dict[str, tuple[float, float, float]] = {
    "triton": (0.90, 0.85, 0.75),
    "helion": (0.90, 0.85, 0.75),
    "gluon": (0.90, 0.85, 0.75),
    "cute": (0.90, 0.90, 0.90),
    "cutile": (0.80, 0.75, 0.75),
}
# the regimes the targets are stated for (shape sets of harness.spec.shapes)
REGIMES = ("sweep", "between", "small", "perhead")


def norm_ops() -> tuple[str, ...]:
    """The ops these targets are for: the norms with a forward and a backward (the FP8-output ops
    have targets of their own, docs/fp8.md)."""
    from harness.spec.ops import OPS

    return tuple(name for name, rec in OPS.items() if "bwd" in rec.directions)


def target(dsl: str, direction: str, n: int) -> float | None:
    """The fraction a point of ``dsl`` must reach, or None where none is stated."""
    t = TARGETS.get(dsl)
    if t is None or direction not in ("fwd", "bwd"):
        return None
    if n % 8:
        return ODD
    if direction == "fwd":
        return t[0]
    return t[1] if n <= WIDE else t[2]


def below(rows: list[dict], dtype: str = "bf16") -> dict[str, tuple[int, int]]:
    """Per DSL, over its hand-written implementation (the one named after the DSL) on the
    ``REGIMES`` sets at ``dtype``: (points below target, points with a target). A point that failed
    its check or raised counts as below."""
    out: dict[str, list[int]] = {}
    ops = norm_ops()
    for r in rows:
        if r.get("op") not in ops or r["impl"] != r.get("dsl") or r.get("shape_set") not in REGIMES or r.get("dtype") != dtype:
            continue
        if r.get("weights", "same") != "same" or r.get("status") == "skip":
            continue
        t = target(r["dsl"], r["direction"], r["N"])
        if t is None:
            continue
        count = out.setdefault(r["dsl"], [0, 0])
        count[1] += 1
        frac = r.get("frac_roofline") if r.get("status") == "ok" else None
        count[0] += frac is None or frac < t
    return {k: (v[0], v[1]) for k, v in out.items()}
