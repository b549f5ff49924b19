"""`normbench` for the fan-out tests, on the CPU: ``python -m tests.fanout_worker bench ...`` is
``python -m harness bench ...`` with what needs a GPU replaced (the CUDA check, the timer, the copy
bandwidth, the device), so that a fan-out's workers (NORMBENCH_WORKER_MODULE=tests.fanout_worker)
and a serial run (``install()`` in the test's process) run the same bench code on the CPU.

``NORMBENCH_TEST_DIE_SHARD=K`` and ``NORMBENCH_TEST_DIE_AFTER=P``: shard K's worker kills itself
(SIGKILL, as the kernel's OOM killer or a node failure would) as it starts its point P + 1."""

import os
import signal
import sys


class FakeTimer:
    """Runs the callable once and reports 1 ms for every repetition of 3 trials."""

    def time(self, fn, graph=False):
        fn()
        return [[1.0] * 3] * 3, graph

    def sync(self):
        pass


def install() -> None:
    from harness import cli
    from harness.run import bench

    real = bench.run_bench
    if getattr(real, "_fake", False):
        return

    def run_bench(*a, **k):
        return real(*a, **{**k, "device": "cpu", "timer": FakeTimer(), "copy_bandwidth": {"tbps": 0.5}})

    real_environment = bench.environment

    def environment(device):  # the GPU model a fan-out's worker was started on, as a GPU's name
        return {**real_environment(device), "gpu": os.environ.get("NORMBENCH_GPU_NAME", "cpu")}

    run_bench._fake = True
    bench.run_bench = run_bench
    bench.environment = environment
    cli._require_cuda = lambda command: None


def _die_after(points: int) -> None:
    from harness.run import bench

    real, started = bench.measure_point, [0]

    def measure(*a, **k):
        if started[0] == points:
            os.kill(os.getpid(), signal.SIGKILL)
        started[0] += 1
        return real(*a, **k)

    bench.measure_point = measure


if __name__ == "__main__":
    install()
    argv = sys.argv[1:]
    shard = argv[argv.index("--shard-index") + 1] if "--shard-index" in argv else None
    if shard is not None and shard == os.environ.get("NORMBENCH_TEST_DIE_SHARD"):
        _die_after(int(os.environ["NORMBENCH_TEST_DIE_AFTER"]))
    from harness.cli import main

    sys.exit(main(argv))
