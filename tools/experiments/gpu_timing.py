"""What the wide-row experiment scripts share: one kernel's time (``triton.testing.do_bench``
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
