"""Timing on the GPU: CUDA events through ``triton.testing.do_bench`` (L2 flushed before every
repetition), CUDA-graph replay for launch-bound shapes, and the device-to-device copy bandwidth every
fraction is measured against. The method is in docs/method.md.

Why short kernels get a graph with the flush inside it: do_bench records the start event behind the
L2 flush (a 256 MB write, ~60-85 us), so the host has that long to launch the timed call. A call whose
host path takes longer (a Python launcher under a busy host: 50-300 us) leaves the GPU idle after the
start event, and the idle time is timed. A kernel of a few tens of microseconds is then timed as the
host's speed: the same point measured 8% alone beside three busy processes and 35% in another run.
Captured in a CUDA graph, the host is out of the loop; the flush stays in the graph before every call,
and a second graph of the flushes alone is subtracted."""

from __future__ import annotations

import statistics

import torch

from harness.spec.roofline import tbps

NOISY_SPREAD = 0.05
TRIALS = 3
GRAPH_CALLS = 20
GRAPH_SHAPE_SETS = ("decode",)
# points whose main bytes are at most this are timed as flushed graph replays (at 3-4.3 TB/s, under
# ~90 us: the flush's head start): the per-head set's k-sized views and the like
FLUSHED_GRAPH_MAX_BYTES = 2**28
L2_FLUSH_BYTES = 256 * 2**20  # what do_bench writes before every repetition
FLUSHED_CALLS = 10
FLUSHED_REPS = 10


class CudaTimer:
    """Times a zero-argument callable on the GPU; returns one list of repetition times (ms) per trial."""

    def __init__(self, warmup_ms: int = 25, rep_ms: int = 100, trials: int = TRIALS):
        self.warmup_ms, self.rep_ms, self.trials = warmup_ms, rep_ms, trials

    def time(self, fn, graph: bool | str = False) -> tuple[list[list[float]], bool]:
        """``graph``: False (do_bench), True (graph replays, L2 warm: decode) or "flushed" (graph
        replays with the L2 flush before every call, the flushes' own time subtracted). Returns the
        trials and whether a graph was used (a call that cannot be captured falls back to do_bench)."""
        import triton.testing

        if graph:
            trial = self._flushed_graph_trial if graph == "flushed" else self._graph_trial
            try:
                return [trial(fn) for _ in range(self.trials)], True
            except Exception:  # not capturable (host syncs, allocations): plain timing instead
                torch.cuda.synchronize()
        trials = []
        for _ in range(self.trials):
            t = triton.testing.do_bench(fn, warmup=self.warmup_ms, rep=self.rep_ms, return_mode="all")
            trials.append(list(t) if isinstance(t, (list, tuple)) else [float(t)])
        return trials, False

    def _graph_trial(self, fn) -> list[float]:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(GRAPH_CALLS):
                fn()
        g.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(20):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / GRAPH_CALLS)
        return times

    def _flushed_graph_trial(self, fn) -> list[float]:
        cache = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device="cuda")
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                cache.zero_()
                fn()
        torch.cuda.current_stream().wait_stream(s)
        both, flushes = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(both):
            for _ in range(FLUSHED_CALLS):
                cache.zero_()
                fn()
        with torch.cuda.graph(flushes):
            for _ in range(FLUSHED_CALLS):
                cache.zero_()
        both.replay()
        flushes.replay()
        torch.cuda.synchronize()

        def replay_ms(g) -> float:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            return a.elapsed_time(b)

        times = []
        for _ in range(FLUSHED_REPS):  # interleaved, so a drift of the clocks hits both alike
            t = replay_ms(both) - replay_ms(flushes)
            times.append(max(t, 1e-6) / FLUSHED_CALLS)
        del both, flushes, cache
        return times

    def sync(self):
        torch.cuda.synchronize()


def _percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    i = min(len(s) - 1, max(0, round(q * (len(s) - 1))))
    return s[i]


def summarize(trials: list[list[float]]) -> dict:
    """Median and p95 over all repetitions, spread of the trial medians, noisy flag."""
    flat = [t for tr in trials for t in tr]
    if not flat:
        raise ValueError("no timings")
    meds = [statistics.median(tr) for tr in trials if tr]
    spread = (max(meds) - min(meds)) / min(meds) if min(meds) > 0 else 0.0
    return {
        "ms": statistics.median(flat),
        "ms_p95": _percentile(flat, 0.95),
        "trial_ms": meds,
        "spread": spread,
        "noisy": spread > NOISY_SPREAD,
    }


def measure_copy_bandwidth(gib: float = 1.0, trials: int = 3) -> dict:
    """Device-to-device copy of a ``gib`` GiB buffer, timed like every benchmark point (CUDA events,
    L2 flushed, median). Bytes counted: read + written. Returns TB/s per trial and their median."""
    import functools

    import triton.testing

    n = int(gib * 2**30)
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy = functools.partial(dst.copy_, src)
    per_trial = []
    for _ in range(trials):
        ms = triton.testing.do_bench(copy, warmup=25, rep=200, return_mode="median")
        per_trial.append(tbps(2 * n, ms))
    del src, dst, copy  # give the 2 GiB back before the benchmark allocates
    torch.cuda.empty_cache()
    return {"tbps": statistics.median(per_trial), "trials_tbps": per_trial, "bytes": 2 * n, "method": "copy_ of a uint8 buffer, do_bench median"}
