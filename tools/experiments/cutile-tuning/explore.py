"""cuTile tuning: the host's choices (tile rows, grids, TMA or not, latency and occupancy hints,
the widths kept in one tile) timed on the sweep's bytes, bf16, against the plan's defaults.

    python tools/experiments/cutile-tuning/explore.py fwd|bwd OUT [BUDGET_S]
    python tools/experiments/cutile-tuning/explore.py grid-fwd|grid-bwd OUT [BUDGET_S]
    python tools/experiments/cutile-tuning/explore.py wide-fwd|odd-fwd|odd-bwd|fp8wide-fwd OUT [BUDGET_S]

``fwd`` / ``bwd``: the search below. ``grid-*``: the second round, a fixed grid over the knobs the
search found to matter (the worker warps, occupancy, tile rows, TMA stores), on the sweep's, the
between set's and two small widths, to choose rules per range of N that hold between the points.
``wide-fwd``: the chunked forward (rows too wide for one tile), whose second pass reads the row
again: fewer programs per SM (fewer rows in flight, so that the second read may come from L2) and
wider chunks, crossed with the worker warps and occupancy, at the widest bucket's widths and at
LayerNorm's 24576 and 32768 (chunked or whole). ``odd-*``: the odd width 4001 (rows without
16-byte strides, which TMA cannot take) under the hints that could matter there. ``fp8wide-fwd``:
the FP8-output kernels' chunked rows, chunk x grid x worker warps. The modes after ``grid`` repeat
each point's best against what the kernels run on by themselves (the table's entry; for FP8,
``fp8.fp8_tuning``, which was the norm forward's entry when the committed fp8wide run was made).

Stage 1 is a grid over the knobs expected to matter most; stage 2 tries the hints around each
point's stage-1 best. Each stage compiles its candidates first in parallel processes (cuTile's
disk cache, CUDA_TILE_CACHE_DIR), then times them one at a time in this process. The best of each
point and the defaults are timed twice more, alternating, for their spread. Writes
OUT/results.jsonl (one line per candidate) and OUT/meta.json (GPU, versions, copy bandwidth).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import multiprocessing as mp
import os
import sys
import time

import torch

sys.path.insert(0, os.getcwd())

ELEMS = 2**27
OPS = ("rmsnorm", "layernorm", "add_rmsnorm")
N_FWD = (1024, 2880, 4096, 8192, 16384, 65536)
N_BWD = (1024, 2880, 4096, 8192, 16384, 65536)


def stage1(direction: str, n: int) -> list[dict]:
    out = []
    if direction == "fwd":
        rows_max = (8192, 16384, 32768) if n > 8192 else (8192,)
        for tile, progs, tl, ts, rmax in itertools.product((4096, 16384), (0, 4), (True, False), (True, False), rows_max):
            out.append({"fwd_tile_elements": tile, "fwd_programs_per_sm": progs, "tma_load": tl, "tma_store": ts,
                        "fwd_row_max": rmax})  # fmt: skip
    else:
        rows_max = (4096, 16384) if n > 4096 else (4096,)
        for tile, progs, tl, ts, acc, rmax in itertools.product(
            (2048, 8192), (2, 4), (True, False), (True, False), (False, True), rows_max
        ):
            out.append({"bwd_tile_elements": tile, "programs_per_sm": progs, "tma_load": tl, "tma_store": ts,
                        "acc_rows": acc, "bwd_row_max": rmax})  # fmt: skip
    return out


N_GRID = (128, 512, 1024, 1536, 2304, 2880, 4096, 5120, 7168, 8192, 12288, 16384, 24576, 32768, 65536)


def grid(direction: str, n: int) -> list[dict]:
    """Tile rows only matter below the tile's width; above it, the widths kept whole (forward) or
    the slice width (backward) take their place in the grid."""
    out = []
    if direction == "fwd":
        shapes = [{"fwd_tile_elements": t, "fwd_row_max": 32768} for t in (4096, 16384)] if n < 16384 else \
            [{"fwd_tile_elements": 4096, "fwd_row_max": r} for r in (16384, 32768)]
        fixed = {"fwd_programs_per_sm": 4, "tma_load": True}
    else:
        shapes = [{"bwd_tile_elements": t, "bwd_row_max": 8192} for t in (2048, 8192)] if n < 8192 else \
            [{"bwd_tile_elements": 4096, "bwd_row_max": 8192, "bwd_slice": s} for s in (4096, 8192)]
        fixed = {"programs_per_sm": 2, "tma_load": True, "acc_rows": True}
    for shape, ww, occ, ts in itertools.product(shapes, (0, 4, 8), (0, 1, 2), (False, True)):
        out.append({**shape, **fixed, "tma_store": ts, "worker_warps": ww, "occupancy": occ})
    return out


N_WIDE = (49152, 65536, 131072, 262144)


def wide(n: int) -> list[dict]:
    """The chunked forward's candidates at width n; the widths kept whole matter only to n = 32768."""
    rows_max = (16384, 32768) if n <= 32768 else (32768,)
    out = []
    for rmax, progs, chunk, ww, occ in itertools.product(rows_max, (1, 2, 4), (4096, 8192), (0, 4, 8), (0, 1, 2)):
        out.append({"fwd_tile_elements": 4096, "fwd_row_max": rmax, "fwd_chunk": chunk, "fwd_programs_per_sm": progs,
                    "tma_load": True, "tma_store": False, "worker_warps": ww, "occupancy": occ})  # fmt: skip
    return out


def odd(direction: str) -> list[dict]:
    """Candidates at N = 4001: TMA asked for or not (it cannot take the rows), tile rows, warps."""
    out = []
    for tl, ts, tile, ww in itertools.product((True, False), (True, False), (4096, 16384), (0, 8)):
        if direction == "fwd":
            out.append({"fwd_tile_elements": tile, "fwd_programs_per_sm": 4, "tma_load": tl, "tma_store": ts, "worker_warps": ww})
        else:
            out.append({"bwd_tile_elements": tile, "programs_per_sm": 2, "acc_rows": True, "tma_load": tl, "tma_store": ts,
                        "worker_warps": ww})  # fmt: skip
    return out


def fp8_wide() -> list[dict]:
    """The FP8 kernels' chunked rows: the chunk (its registers hold a sum-of-squares tile) crossed with
    the grid and the worker warps."""
    out = []
    for chunk, progs, ww in itertools.product((4096, 8192), (1, 2, 4), (0, 4, 8)):
        out.append({"fwd_tile_elements": 4096, "fwd_row_max": 32768, "fwd_chunk": chunk, "fwd_programs_per_sm": progs,
                    "tma_load": True, "tma_store": False, "worker_warps": ww})  # fmt: skip
    return out


def candidates(mode: str, direction: str) -> dict:
    """{(op, N): tunings} of a grid-like mode; {} first: the defaults."""
    if mode == "fp8wide":
        fp8 = ("rmsnorm_fp8_token", "rmsnorm_fp8_g128", "add_rmsnorm_fp8_token", "add_rmsnorm_fp8_g128")
        return {(op, n): [{}] + fp8_wide() for n in N_WIDE for op in fp8}
    if mode == "grid":
        points = [(op, n) for n in N_GRID for op in OPS]
        return {p: [{}] + grid(direction, p[1]) for p in points}
    if mode == "wide":
        points = [(op, n) for n in N_WIDE for op in OPS] + [("layernorm", n) for n in (24576, 32768)]
        return {p: [{}] + wide(p[1]) for p in points}
    return {(op, 4001): [{}] + odd(direction) for op in OPS}


def main_grid(direction: str, out_dir: str, budget_s: float, mode: str = "grid"):
    import triton

    from harness.run.timer import measure_copy_bandwidth

    t0 = time.time()
    os.makedirs(out_dir, exist_ok=True)
    os.environ.setdefault("CUDA_TILE_CACHE_DIR", "/tmp/cutile-cache")
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "commit": os.environ.get("NORMBENCH_COMMIT"), "direction": direction, "mode": mode,
            "copy_before": measure_copy_bandwidth(trials=2)}  # fmt: skip
    copy = meta["copy_before"]["tbps"]
    cands = candidates(mode, direction)
    points = list(cands)
    warm([(op, direction, n, cands[(op, n)]) for op, n in points], workers=14)
    k = kernels()
    best = {}
    with open(os.path.join(out_dir, "results.jsonl"), "w") as f:
        for op, n in points:
            if time.time() - t0 > budget_s * (1.0 if mode == "grid" else 0.8):
                meta.setdefault("skipped", []).append([op, n])
                continue
            recs = time_point(k, op, direction, n, cands[(op, n)], mode, copy)
            f.writelines(json.dumps(r) + "\n" for r in recs)
            f.flush()
            ok = [r for r in recs if "ms" in r]
            if ok:
                best[(op, n)] = min(ok, key=lambda r: r["ms"][0])
            print("done", op, n, round(time.time() - t0), flush=True)
        if mode != "grid":  # the best against the table's own entry, alternating
            from dataclasses import asdict

            from impls.cutile import configs

            for (op, n), b in best.items():
                if time.time() - t0 > budget_s:
                    break
                if "fp8" in op:  # what the FP8 kernels run on by themselves
                    from impls.cutile.fp8 import fp8_tuning

                    table = asdict(fp8_tuning(ELEMS // n, n, op.startswith("add_"), torch.device("cuda"))[0])
                else:
                    table = asdict(configs.choose(op, direction, n, torch.device("cuda")))
                rep = repeat_point(k, op, direction, n, b["tuning"], table, copy)
                f.write(json.dumps({**rep, "base": "table"}) + "\n")
                f.flush()
                print("repeat", op, n, rep["default_frac"], "->", rep["best_frac"], rep["best_ms"], b["tuning"], flush=True)
    meta["copy_after"] = measure_copy_bandwidth(trials=2)
    meta["time_s"] = round(time.time() - t0, 1)
    with open(os.path.join(out_dir, "meta.json"), "w") as fm:
        json.dump(meta, fm, indent=1)


def stage2(best: dict) -> list[dict]:
    out = [dict(best, occupancy=o) for o in (1, 2, 4, 8)]
    out += [dict(best, latency=lat) for lat in (2, 5, 9)]
    out += [dict(best, worker_warps=w) for w in (4, 8)]
    return out


def kernels():
    from harness.registry import get

    return get("cutile").kernels("cuda")


def case_of(op, direction, n):
    from harness.spec.inputs import make_case
    from harness.spec.shapes import Shape

    return make_case(op, Shape((ELEMS // n, n)), torch.bfloat16, "cuda")


@contextlib.contextmanager
def tuned(tuning):
    """The plan's tuning replaced by ``tuning``'s fields while inside (every call reads it)."""
    from impls.cutile import plan as P

    old = P.set_tuning(**tuning)
    try:
        yield
    finally:
        P.TUNING = old


def run_once(k, op, direction, case):
    """One call (compiling it on the tuning in force); returns the callable."""
    from harness.run.bench import callables

    fn = callables(k, op, direction, case)
    fn()
    return fn


def timed_under(k, op, direction, case, tuning) -> float:
    """The call timed on ``tuning``: the tuning stays in force while do_bench calls it."""
    with tuned(tuning):
        return timed(run_once(k, op, direction, case))


def time_point(k, op, direction, n, tunings, stage, copy) -> list[dict]:
    """One record per candidate at (op, N): its median ms and fraction of ``copy`` TB/s, or its error."""
    from harness.spec.roofline import bytes_moved

    nbytes = bytes_moved(op, direction, ELEMS // n, n, 2).main
    case = case_of(op, direction, n)
    recs = []
    for t in tunings:
        rec = {"op": op, "direction": direction, "N": n, "stage": stage, "tuning": t}
        try:
            rec["ms"] = [round(timed_under(k, op, direction, case, t), 5)]
            rec["frac"] = round(nbytes / (rec["ms"][0] * 1e-3) / 1e12 / copy, 4)
        except Exception as e:  # noqa: BLE001
            rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        recs.append(rec)
    del case
    torch.cuda.empty_cache()
    return recs


def warm_group(args):
    """One (op, N)'s candidates compiled (and run once) in a worker process."""
    op, direction, n, tunings = args
    k = kernels()
    case = case_of(op, direction, n)
    errors = []
    for t in tunings:
        try:
            with tuned(t):
                run_once(k, op, direction, case)
        except Exception as e:  # noqa: BLE001
            errors.append((t, f"{type(e).__name__}: {str(e)[:200]}"))
    torch.cuda.synchronize()
    return op, n, errors


def warm(groups, workers: int):
    t0 = time.time()
    ctx = mp.get_context("spawn")
    with ctx.Pool(workers) as pool:
        for op, n, errors in pool.imap_unordered(warm_group, groups):
            for t, e in errors[:3]:
                print("warm error", op, n, t, e, flush=True)
    print(f"warm {sum(len(g[3]) for g in groups)} candidates in {time.time() - t0:.0f} s", flush=True)


def timed(fn):
    import triton.testing

    return triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median")


def main(direction: str, out_dir: str, budget_s: float):
    import triton

    from harness.run.timer import measure_copy_bandwidth

    t0 = time.time()
    os.makedirs(out_dir, exist_ok=True)
    os.environ.setdefault("CUDA_TILE_CACHE_DIR", "/tmp/cutile-cache")
    import cuda.tile as ct

    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "cuda_tile": getattr(ct, "__version__", "?"), "commit": os.environ.get("NORMBENCH_COMMIT"),
            "direction": direction, "copy_before": measure_copy_bandwidth(trials=2)}  # fmt: skip
    copy = meta["copy_before"]["tbps"]
    ns = N_FWD if direction == "fwd" else N_BWD
    points = [(op, n) for op in OPS for n in ns]
    cands = {p: [{}] + stage1(direction, p[1]) for p in points}
    warm([(op, direction, n, cands[(op, n)]) for op, n in points], workers=min(14, len(points)))
    k = kernels()
    with open(os.path.join(out_dir, "results.jsonl"), "w") as f:
        _search(k, direction, points, cands, copy, budget_s, t0, meta, f)
    meta["copy_after"] = measure_copy_bandwidth(trials=2)
    meta["time_s"] = round(time.time() - t0, 1)
    with open(os.path.join(out_dir, "meta.json"), "w") as fm:
        json.dump(meta, fm, indent=1)


def _search(k, direction, points, cands, copy, budget_s, t0, meta, f):
    """Stage 1 at every point, stage 2 around each point's best, then the repeats; records to ``f``."""
    best = {}
    for op, n in points:
        if time.time() - t0 > budget_s * 0.55:
            meta.setdefault("skipped_stage1", []).append([op, n])
            continue
        recs = time_point(k, op, direction, n, cands[(op, n)], 1, copy)
        for r in recs:
            f.write(json.dumps(r) + "\n")
        f.flush()
        ok = [r for r in recs if "ms" in r]
        if ok:
            best[(op, n)] = min(ok, key=lambda r: r["ms"][0])
            print(op, n, "default", recs[0].get("frac"), "best", best[(op, n)]["frac"], best[(op, n)]["tuning"], flush=True)
    s2 = {p: stage2(b["tuning"]) for p, b in best.items()}
    if time.time() - t0 < budget_s * 0.6:
        warm([(op, direction, n, s2[(op, n)]) for op, n in s2], workers=min(14, len(s2)))
    for (op, n), tunings in s2.items():
        if time.time() - t0 > budget_s * 0.85:
            meta.setdefault("skipped_stage2", []).append([op, n])
            continue
        recs = time_point(k, op, direction, n, tunings, 2, copy)
        for r in recs:
            f.write(json.dumps(r) + "\n")
        f.flush()
        ok = [r for r in recs if "ms" in r]
        if ok and min(r["ms"][0] for r in ok) < best[(op, n)]["ms"][0]:
            best[(op, n)] = min(ok, key=lambda r: r["ms"][0])
    # spread: the best and the defaults twice more, alternating
    for (op, n), b in best.items():
        if time.time() - t0 > budget_s:
            break
        rep = repeat_point(k, op, direction, n, b["tuning"], {}, copy)
        f.write(json.dumps(rep) + "\n")
        f.flush()
        print("repeat", op, n, rep["default_frac"], "->", rep["best_frac"], rep["best_ms"], b["tuning"], flush=True)


def repeat_point(k, op, direction, n, best: dict, base: dict, copy) -> dict:
    """``best`` and ``base`` (the defaults, or the table's entry) timed twice more each, alternating."""
    from harness.spec.roofline import bytes_moved

    nbytes = bytes_moved(op, direction, ELEMS // n, n, 2).main
    case = case_of(op, direction, n)
    rep = {"op": op, "direction": direction, "N": n, "stage": "repeat", "best": best, "best_ms": [], "default_ms": []}
    if base:
        rep["base_tuning"] = base
    for _ in range(2):
        rep["best_ms"].append(round(timed_under(k, op, direction, case, best), 5))
        rep["default_ms"].append(round(timed_under(k, op, direction, case, base), 5))
    rep["best_frac"] = round(nbytes / (min(rep["best_ms"]) * 1e-3) / 1e12 / copy, 4)
    rep["default_frac"] = round(nbytes / (min(rep["default_ms"]) * 1e-3) / 1e12 / copy, 4)
    del case
    torch.cuda.empty_cache()
    return rep


if __name__ == "__main__":
    mode, out, budget = sys.argv[1], sys.argv[2], float(sys.argv[3]) if len(sys.argv) > 3 else 480
    if mode.split("-")[0] in ("grid", "wide", "odd", "fp8wide"):
        main_grid(mode.split("-")[1], out, budget, mode.split("-")[0])
    else:
        main(mode, out, budget)
