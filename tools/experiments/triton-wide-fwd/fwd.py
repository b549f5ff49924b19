"""Triton's forward for wide rows: column slices that read their slice once and exchange their
partial row statistics (``Config.sync`` with ``slice``, ``kernels._norm_fwd_sync_kernel``) against
the forward the table picks today ("pinned": the chunked forward, which reads each row twice, or
the whole row in registers). For op in rmsnorm, layernorm, add_rmsnorm and N in WIDE_N, M = 2^27 / N:
every candidate (``configs.FWD_EXCHANGE``: 8192-column slices on 8 warps one or two blocks ahead,
on 16 warps two ahead, two rows a block on 8 and 16 warps, 16384-column slices on 16 warps) is
checked against the fp64 reference on (CHECK_M, N) rows with the harness's checker, then all are
timed alternately, three rounds (``gpu_timing.bench``: do_bench median, L2 flushed). Two
diagnostics ride along, never checked and never pinned ("nowait ..."): candidates launched with a
wait bound of 0, so that each program posts, reads the slots once and goes on (rows whose siblings
had not posted come out NaN): the time of the exchange without its waiting, against which the
candidate's own time shows what the waits cost. Bytes: the harness's forward model (x (+ residual) read once, y (+ residual_out) written
once; the statistics and parameters left out as in the wide-sync experiments). The kernels are
compiled first in WARM parallel processes on 64-row inputs (Triton's disk cache).

    python tools/experiments/triton-wide-fwd/fwd.py OUT [DTYPE]      (GPU; DTYPE bf16 by default)
    python tools/experiments/triton-wide-fwd/fwd.py --dry [DTYPE]    (no GPU: lists the candidates)

Environment: WIDE_N (default 16384,24576,32768,49152,65536,131072,262144), BUDGET_S (default 150:
no new (op, N) starts after it, counted from the start), CHECK_M (default 300), WARM (default 8
processes; 0 skips). Writes OUT/results.jsonl (one line per (op, N): configs, grids, checks,
errors, ms per round, fractions of the copy bandwidth) and OUT/meta.json, and prints one line per
(op, N).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(HERE))

from harness.spec.roofline import bytes_moved
from impls.triton import configs as C

ELEMS = 2**27
OPS = ("rmsnorm", "layernorm", "add_rmsnorm")
WIDE_N = tuple(int(n) for n in os.environ.get("WIDE_N", "16384,24576,32768,49152,65536,131072,262144").split(","))
CHECK_M = int(os.environ.get("CHECK_M", "300"))
H100 = "NVIDIA H100 80GB HBM3"
SMS = 132  # the H100's, for --dry


def name(cfg) -> str:
    if cfg is None:
        return "pinned"
    return f"s{cfg.slice} w{cfg.warps} r{cfg.rows} a{cfg.ahead}"


# the candidates also timed without waiting (see the docstring)
NOWAIT = (C.FWD_EXCHANGE[2], C.FWD_EXCHANGE[4])


def without_waiting(fn):
    """``fn`` with the exchanging forward's wait bound at 0 (its ``spin`` default) while it runs."""
    from impls.triton import kernels as K

    def run():
        defaults = K.launch_fwd_exchange.__defaults__
        K.launch_fwd_exchange.__defaults__ = (0,)
        try:
            return fn()
        finally:
            K.launch_fwd_exchange.__defaults__ = defaults

    return run


def candidates():
    return (None, *C.FWD_EXCHANGE)


def jobs(dtype="bf16"):
    return [(op, n, dtype, cfg) for n in WIDE_N for op in OPS for cfg in candidates()]


_IMPL = {}


def kernels_for(cfg):
    from harness.registry import get
    from impls.triton.tune import pinned_kernels

    if "triton" not in _IMPL:
        _IMPL["triton"] = get("triton")
    return pinned_kernels(_IMPL["triton"], cfg, None)


def launcher(op, m, n, dtype):
    """(case, cfg -> a zero-argument callable running the forward on it)."""
    from harness.run.bench import callables
    from harness.spec.contract import DTYPES
    from harness.spec.inputs import make_case
    from harness.spec.shapes import Shape

    case = make_case(op, Shape((m, n)), DTYPES[dtype], "cuda")
    return case, lambda cfg: callables(kernels_for(cfg), op, "fwd", case)


def warm(i, k, dtype="bf16"):
    import torch

    for op, n, dt, cfg in jobs(dtype)[i::k]:
        try:
            case, launch = launcher(op, 64, n, dt)
            launch(cfg)()
            del case
        except Exception as e:  # noqa: BLE001
            print("warm fail", op, n, name(cfg), type(e).__name__, str(e)[:300], flush=True)
    torch.cuda.synchronize()


def warm_all(dtype):
    k = int(os.environ.get("WARM", "8"))
    if k <= 0:
        return
    procs = [
        subprocess.Popen([sys.executable, os.path.abspath(__file__), "warm", str(i), str(k), dtype]) for i in range(k)
    ]
    for p in procs:
        p.wait()


def pinned_config(op, n):
    import torch

    from harness.spec.tuned import capability_of

    dev = torch.device("cuda", torch.cuda.current_device())
    return C.lookup(torch.cuda.get_device_name(dev), op, "fwd", n, capability_of(dev))


def run(out_dir, dtype="bf16"):
    import torch
    from gpu_timing import bench, finish_meta, start_meta, write_result

    from harness.run.checker import run_check
    from harness.spec.contract import DTYPES
    from harness.spec.shapes import Shape
    from impls.triton import kernels as K

    t0 = time.time()
    budget = float(os.environ.get("BUDGET_S", "150"))
    os.makedirs(out_dir, exist_ok=True)
    warm_all(dtype)
    meta = start_meta(dtype=dtype, variants=[name(c) for c in candidates()], widths=WIDE_N, check_m=CHECK_M,
                      warm_s=round(time.time() - t0, 1))  # fmt: skip
    copy = meta["copy_before"]["tbps"]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    kernels_for(None)
    size = DTYPES[dtype].itemsize
    with open(os.path.join(out_dir, "results.jsonl"), "w") as f:
        for n in WIDE_N:
            for op in OPS:
                if time.time() - t0 > budget:
                    meta.setdefault("skipped", []).append([op, n])
                    print("budget spent: skip", op, n, flush=True)
                    continue
                m = ELEMS // n
                nbytes = bytes_moved(op, "fwd", m, n, size).main
                rec = {"op": op, "N": n, "M": m, "dtype": dtype, "bytes": nbytes, "configs": {}, "grid": {},
                       "checks": {}, "errors": {}, "ms": {}}  # fmt: skip
                case, launch = launcher(op, m, n, dtype)
                runs = {}
                for cfg in candidates():
                    key = name(cfg)
                    rec["configs"][key] = (cfg or pinned_config(op, n)).to_json()
                    if cfg is not None:
                        rec["grid"][key] = list(K.exchange_grid(cfg, m, n, sms))
                    try:
                        chk = run_check(
                            _IMPL["triton"], op, "fwd", Shape((CHECK_M, n)), dtype, "cuda", kernels=kernels_for(cfg)
                        )
                        rec["checks"][key] = chk.status
                        if chk.status != "pass":
                            rec["errors"][key] = chk.summary()[:400]
                            continue
                        fn = launch(cfg)
                        fn()
                        torch.cuda.synchronize()
                        runs[key] = fn
                    except Exception as e:  # noqa: BLE001 -- a candidate that does not build is a result too
                        rec["errors"][key] = f"{type(e).__name__}: {str(e)[:300]}"
                for cfg in NOWAIT:
                    if name(cfg) in runs and K.exchange_grid(cfg, m, n, sms)[0]:
                        runs["nowait " + name(cfg)] = without_waiting(launch(cfg))
                        rec["checks"]["nowait " + name(cfg)] = "diagnostic: not checked"
                for _ in range(3):
                    for key, fn in runs.items():
                        rec["ms"].setdefault(key, []).append(round(bench(fn), 5))
                write_result(f, rec, nbytes, copy)
                del runs, case, launch
                torch.cuda.empty_cache()
    finish_meta(out_dir, meta)


def dry(dtype="bf16"):
    """The candidates per (op, N) with their grids on an H100 (132 SMs) and the H100 table's pick."""
    from harness.spec.contract import DTYPES
    from impls.triton import kernels as K

    size = DTYPES[dtype].itemsize
    for n in WIDE_N:
        for op in OPS:
            m = ELEMS // n
            line = [f"{op:11s} N={n:6d} M={m:5d} bytes={bytes_moved(op, 'fwd', m, n, size).main}",
                    f"pinned(H100)={C.lookup(H100, op, 'fwd', n).to_json()}"]  # fmt: skip
            for cfg in C.FWD_EXCHANGE:
                groups, slices = K.exchange_grid(cfg, m, n, SMS)
                line.append(f"{name(cfg)}: {groups}x{slices}" + ("" if groups else " (chunked fallback)"))
            print("  ".join(line))
    print(len(jobs(dtype)), "jobs")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    if sys.argv[1] == "warm":
        warm(int(sys.argv[2]), int(sys.argv[3]), *(sys.argv[4:5] or ["bf16"]))
    elif sys.argv[1] == "--dry":
        dry(*(sys.argv[2:3] or ["bf16"]))
    else:
        run(sys.argv[1], *(sys.argv[2:3] or ["bf16"]))
