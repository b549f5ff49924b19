"""The second GPU run: the Helion small-row backward's search around the first run's winners (the
loop pipelining that won at N = 256 and 512, on every step size and warp count), pinned into
configs.json when it wins; then every point of the small set (bf16; fp16 at N = 128), the per-head
set and N = 4001 timed at the working tree's kernels for both DSLs, and Gluon's narrow-vector rule
at N = 4001 with 16 and 32 elements per lane beside the default 8.

Writes ``$OUT/after.json`` (points as regimes.py writes them) and ``$OUT/helion_tune2.json``.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from regimes import ODD, OPS, SMALL, collected, timed

from harness.registry import get
from harness.run.timer import measure_copy_bandwidth
from harness.spec.shapes import SHAPE_SETS


def round2_jobs(gpu: str, sms: int) -> list[dict]:
    from impls.helion import configs
    from impls.helion.tune import _pow2_floor

    jobs = []
    for op in ("rmsnorm", "layernorm"):
        for shape in SMALL:
            m, n, entry = shape.m, shape.n, f"{op}_bwd"
            cands = [configs.pinned(entry, n, "bf16", gpu).entry()]
            for step_elements in (2048, 4096, 8192):
                step = step_elements // n
                few = max(step, _pow2_floor(m // (4 * sms)))
                for warps in (4, 8):
                    for stages in (2, 3):
                        c = {"kernel": f"{op}_bwd_heads", "config": {"block_sizes": [few, step, 1], "num_warps": warps,
                                                                       "range_num_stages": [0, stages, 0]}}  # fmt: skip
                        if c not in cands:
                            cands.append(c)
            jobs.append({"entry": entry, "m": m, "n": n, "dtype": "bf16", "candidates": cands})
    return jobs


def pin(results: list[dict], gpu: str) -> None:
    from impls.helion import configs, tune

    data = json.loads(configs.CONFIG_FILE.read_text())
    by_gpu = data["gpus"][gpu]
    for r in results:
        best = r["best"]
        if best is None or best == r["candidates"][0]:
            continue
        by_gpu[r["entry"]]["bf16"][str(r["n"])] = {
            **configs.Pinned.from_entry(best, "tuned").entry(), "ms": best["ms"], "tb_s": best["tb_s"], "tuned": "2026-11-26"}  # fmt: skip
    configs.CONFIG_FILE.write_text(tune._dump(data))
    configs.reload()


def main() -> None:
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    from impls.gluon import plan
    from impls.helion import tune

    gpu = torch.cuda.get_device_name()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    copy = measure_copy_bandwidth()
    roof = copy["tbps"]
    print("gpu", gpu, "copy TB/s", round(roof, 3), flush=True)
    import triton

    env = {"gpu": gpu, "copy_bandwidth": copy, "torch": torch.__version__, "triton": triton.__version__}
    ctx = mp.get_context("spawn")
    lock = ctx.Lock()
    pool = ctx.Pool(12, initializer=tune._init_worker, initargs=(lock,))
    pending = pool.map_async(tune._run_job, round2_jobs(gpu, sms), chunksize=1)

    rows = []
    gluon = get("gluon").kernels("cuda")
    points = [(s, "bf16") for s in SMALL + tuple(SHAPE_SETS["perhead"]) + ODD]
    points += [(s, "fp16") for s in SMALL if s.n == 128]
    for shape, dtype in points:
        for op in OPS:
            for d in ("fwd", "bwd"):
                rows.append({"impl": "gluon", "variant": "new", **timed(gluon, op, d, shape, dtype, lock, roof)})
    for per_lane in (16, 32):
        plan.NARROW_ELEMENTS = per_lane
        for op in OPS:
            for d in ("fwd", "bwd"):
                rows.append(
                    {"impl": "gluon", "variant": f"narrow{per_lane}", **timed(gluon, op, d, ODD[0], "bf16", lock, roof)}
                )
    plan.NARROW_ELEMENTS = None
    print("gluon done", round(time.perf_counter() - started, 1), flush=True)

    results = collected(pending, pool, roof, "pinned", ("config",))
    (out / "helion_tune2.json").write_text(json.dumps({**env, "jobs": results}, indent=1) + "\n")
    pin(results, gpu)
    (out / "configs.json").write_text(Path("impls/helion/configs.json").read_text())
    print("helion tuned", round(time.perf_counter() - started, 1), flush=True)

    helion = get("helion").kernels("cuda")
    for shape, dtype in points:
        for op in OPS:
            for d in ("fwd", "bwd"):
                rows.append({"impl": "helion", "variant": "new", **timed(helion, op, d, shape, dtype, lock, roof)})
    (out / "after.json").write_text(json.dumps({**env, "rows": rows}, indent=1) + "\n")
    print("all timed", round(time.perf_counter() - started, 1), flush=True)


if __name__ == "__main__":
    main()
