"""How the L2 flush before each timed call weighs on a point, by size: a negation (one read, one
write: a forward's traffic), a two-input add (two reads, one write: a backward's) and ``copy_`` of S
bytes per tensor, each timed at every size as the harness times its short points (``CudaTimer``'s
flushed graph replays: the flush and the call captured together, the flushes alone subtracted),
with three flushes:

* ``zero``: ``cache.zero_()`` of 256 MB, what ``triton.testing.do_bench`` and the harness do. It
  leaves the L2 full of dirty lines, which the timed call writes back to DRAM as its own accesses
  evict them: traffic that is not the kernel's. Its own last writes stay in L2 (written back during
  the next flush): traffic of the kernel's that is not timed.
* ``read``: a sum over a 256 MB buffer: the L2 is left holding clean lines, so nothing is owed, and
  the kernel's last writes still stay in L2.
* ``zero+read``: both, in that order.

Each is a fraction of the copy bandwidth the harness measures (1 GiB ``copy_``, do_bench): what a
kernel as simple as an elementwise one reaches at a point's size under the harness's flush is the
ceiling of that size's points.

python tools/experiments/flush-method/flush.py OUT
"""

from __future__ import annotations

import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from gpu_timing import finish_meta, start_meta

MB = 2**20
SIZES_MB = (8, 16, 32, 64, 128, 256, 512, 1024)
FLUSH_BYTES = 256 * MB
CALLS, REPS, TRIALS = 10, 10, 3


def flushes():
    cache = torch.empty(FLUSH_BYTES, dtype=torch.int8, device="cuda")
    words = cache.view(torch.int32)
    out = torch.empty((), dtype=torch.int64, device="cuda")

    def zero():
        cache.zero_()

    def read():
        torch.sum(words, 0, dtype=torch.int64, out=out)

    def zero_read():
        cache.zero_()
        torch.sum(words, 0, dtype=torch.int64, out=out)

    return {"zero": zero, "read": read, "zero+read": zero_read}


def graph_ms(fn, flush) -> list[float]:
    """Per-call ms of ``fn`` with ``flush`` before each call inside a CUDA graph, the flushes' own
    graph subtracted (the harness's flushed-graph trial, with the flush as a parameter)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            flush()
            fn()
    torch.cuda.current_stream().wait_stream(s)
    both, alone = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(both):
        for _ in range(CALLS):
            flush()
            fn()
    with torch.cuda.graph(alone):
        for _ in range(CALLS):
            flush()
    both.replay()
    alone.replay()
    torch.cuda.synchronize()

    def replay(g):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        return a.elapsed_time(b)

    return [max(replay(both) - replay(alone), 1e-6) / CALLS for _ in range(REPS)]


def main(out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    meta = start_meta(flush_bytes=FLUSH_BYTES, calls=CALLS, reps=REPS, trials=TRIALS)
    copy = meta["copy_before"]["tbps"]
    fl = flushes()
    rows = []
    for size in SIZES_MB:
        n = size * MB // 2
        a = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        c = torch.empty_like(a)
        kinds = {
            "copy": (lambda a=a, c=c: c.copy_(a), 2),
            "neg": (lambda a=a, c=c: torch.neg(a, out=c), 2),
            "add": (lambda a=a, b=b, c=c: torch.add(a, b, out=c), 3),
        }
        for kind, (fn, tensors) in kinds.items():
            moved = tensors * size * MB
            rec = {"kind": kind, "mb_per_tensor": size, "bytes_moved": moved}
            for name, flush in fl.items():
                trials = [statistics.median(graph_ms(fn, flush)) for _ in range(TRIALS)]
                ms = statistics.median(trials)
                rec[name] = {"ms": ms, "trial_ms": trials, "spread": (max(trials) - min(trials)) / min(trials),
                             "tbps": moved / (ms * 1e-3) / 1e12, "frac_copy": moved / (ms * 1e-3) / 1e12 / copy}  # fmt: skip
            rows.append(rec)
            print(kind, size, {k: round(rec[k]["frac_copy"], 3) for k in fl}, flush=True)
        del a, b, c, kinds
        torch.cuda.empty_cache()
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(rows, f, indent=1)
    finish_meta(out_dir, meta)


if __name__ == "__main__":
    main(sys.argv[1])
