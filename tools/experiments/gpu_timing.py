"""What the experiment scripts share: one kernel's time (``triton.testing.do_bench``
median, L2 flushed, after a first call that compiles), and a run's meta.json (GPU, versions,
commit, the copy bandwidth before and after)."""

from __future__ import annotations

import json
import os
import time

import torch


def bench(fn) -> float:
    import triton.testing

    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


def start_meta(**extra) -> dict:
    import triton

    from harness.run.timer import measure_copy_bandwidth

    return {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "commit": os.environ.get("NORMBENCH_COMMIT"), **extra, "copy_before": measure_copy_bandwidth(trials=2),
            "started": time.time()}  # fmt: skip


def finish_meta(out_dir: str, meta: dict) -> None:
    from harness.run.timer import measure_copy_bandwidth

    meta["copy_after"] = measure_copy_bandwidth(trials=2)
    meta["time_s"] = round(time.time() - meta.pop("started"), 1)
    with open(os.path.join(out_dir, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)


def fraction(ms: list, nbytes: int, copy_tbps: float) -> float:
    """The median time's share of the copy bandwidth."""
    med = sorted(ms)[len(ms) // 2]
    return round(nbytes / (med * 1e-3) / 1e12 / copy_tbps, 4)


def write_result(f, rec: dict, nbytes: int, copy_tbps: float) -> None:
    """Add ``frac`` (per variant of ``rec["ms"]``: ``fraction`` of its timings) to a candidates
    record, append it to ``f`` as a JSON line and print its checks that did not pass, its errors and
    its fractions."""
    rec["frac"] = {k: fraction(v, nbytes, copy_tbps) for k, v in rec["ms"].items()}
    f.write(json.dumps(rec) + "\n")
    f.flush()
    bad = {k: s for k, s in rec["checks"].items() if s != "pass"}
    fracs = {k: round(v * 100, 1) for k, v in rec["frac"].items()}
    print(rec["op"], rec["N"], "not pass:", bad, rec["errors"], fracs, flush=True)


def cli(warm, jobs, run) -> None:
    """``warm I K`` | ``count`` | ``run OUT BUDGET_S [DTYPE]``, as the scripts' docstrings say."""
    import sys

    if sys.argv[1] == "warm":
        warm(int(sys.argv[2]), int(sys.argv[3]))
    elif sys.argv[1] == "count":
        print(len(jobs()))
    else:
        run(sys.argv[2], float(sys.argv[3]), *(sys.argv[4:5] or ["bf16"]))


def alternate(run, module, attr: str, variants: dict, rounds: int = 3) -> dict[str, list[float]]:
    """ms per round of ``run()`` with ``module.attr`` patched to each of ``variants`` in turn (and
    restored after every call), the variants alternating within a round so that a drift of the clocks
    hits all alike; a round's figure is the median of one trial of CUDA-graph replays with the L2
    flushed before each call, as the harness times short kernels (``harness.run.timer``)."""
    from harness.run.timer import CudaTimer

    timer = CudaTimer(warmup_ms=5, rep_ms=25, trials=1)
    real = getattr(module, attr)
    ms: dict[str, list[float]] = {}
    for _ in range(rounds):
        for name, value in variants.items():

            def fn(value=value):
                setattr(module, attr, value)
                try:
                    run()
                finally:
                    setattr(module, attr, real)

            trial = timer.time(fn, graph="flushed")[0][0]
            ms.setdefault(name, []).append(sorted(trial)[len(trial) // 2])
    return ms


def spreads(ms: dict[str, list[float]]) -> dict[str, float]:
    """Per variant, its slowest round over its fastest, less one."""
    return {k: round(max(t) / min(t) - 1, 4) for k, t in ms.items()}

