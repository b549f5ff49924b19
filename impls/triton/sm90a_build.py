"""Build the pinned configs' kernels for sm_90a without a GPU, and report their resources.

    python -m impls.triton.sm90a_build [--gpu "NVIDIA H200"] [--ops rmsnorm,add_rmsnorm] [N ...]
    python -m impls.triton.sm90a_build --ops add_rmsnorm --direction fwd --config '{"warps": 32, "chunk": 32768}' 65536

Triton compiles through ptxas (shipped with it) with no driver, so registers, stack (spills) and
how many programs of a config fit on an SM can be read on any machine: one line per op, direction
and N (default: the sweep's), with the config ``configs.lookup`` gives that GPU. The kernels
are specialised as a launch on the sweep shapes would be (pointers, N and row strides divisible
by 16, bf16 rows); wanted = the programs per SM a persistent grid launches. A guide for choosing
configs, not a measurement: time them on the GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile

os.environ.pop("TRITON_INTERPRET", None)  # compiled kernels, not the interpreter's

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from harness.spec.occupancy import resident_programs  # noqa: E402

from . import configs as C  # noqa: E402
from . import kernels as K  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
FLAGS = {"rmsnorm": (False, False), "layernorm": (True, False), "add_rmsnorm": (False, True)}  # LAYERNORM, fused


def build(kernel, pointers: dict, constexprs: dict, warps: int, odd: bool = False):
    """Compile ``kernel`` with these pointer dtypes and compile-time values; other arguments are
    i32 (fp32 for eps). ``odd``: N and the row strides no multiple of 16 (pointers still are)."""
    sig = {}
    for name in kernel.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in pointers:
            sig[name] = "*" + pointers[name]
        else:
            sig[name] = "fp32" if name == "eps" else "i32"
    aligned = [(i,) for i, a in enumerate(kernel.arg_names)
               if sig[a][0] == "*" or (not odd and (a == "N" or a.startswith("stride")))]  # fmt: skip
    src = ASTSource(
        fn=kernel, signature=sig, constexprs={(kernel.arg_names.index(k),): v for k, v in constexprs.items()},
        attrs={i: [["tt.divisibility", 16]] for i in aligned},
    )  # fmt: skip
    return triton.compile(src, target=TARGET, options={"num_warps": warps})


def resources(compiled) -> tuple[int, int]:
    """(registers per thread, stack bytes per thread) from the cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.run([CUOBJDUMP, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True).stdout
    return int(re.search(r"REG:(\d+)", out).group(1)), int(re.search(r"STACK:(\d+)", out).group(1))


def pinned_configs():
    """(GPU, table key, op, direction, N or bucket as written, Config) of every pinned entry of the
    row kernels' tables (not the ``*_odd`` ones)."""
    for gpu, table in C.pinned_table().items():
        for key, by_n in table.items():
            if key.endswith("_odd"):
                continue
            op, _, direction = key.rpartition("_")
            for n, entry in by_n.items():
                yield gpu, key, op, direction, n, C.Config(**entry)


def pinned_waits() -> dict:
    """``harness.spec.ptx.spin_barriers`` of every pinned config that exchanges row sums (``sync``),
    by "gpu op N", and of a control that spreads its slots over two warps (2 rows x 32 slices): the
    barriers inside its waits for sibling programs (``kernels._await_sums``)."""
    from harness.spec.ptx import spin_barriers

    out = {f"{gpu} {key} {n}": spin_barriers(build_config(op, direction, C.bucket(int(n)), cfg).asm["ptx"])
           for gpu, key, op, direction, n, cfg in pinned_configs() if cfg.sync}  # fmt: skip
    spread = C.Config(rows=2, warps=8, slice=4096, sync=True)
    out["control: 2 rows x 32 slices"] = spin_barriers(build_config("rmsnorm", "bwd", 131072, spread).asm["ptx"])
    return out


def pinned_residency() -> dict:
    """Per pinned exchanging config (``sync``) that asks for several programs per SM: [the programs
    its sm_90a binary lets an SM hold (registers, shared memory), the programs per SM it asks for].
    The launcher runs the smaller (``kernels.launch_bwd``), so a table entry whose binary holds
    fewer promises what no launch runs."""
    out = {}
    for gpu, key, op, direction, n, cfg in pinned_configs():
        if cfg.sync and cfg.programs_per_sm > 1:
            compiled = build_config(op, direction, C.bucket(int(n)), cfg)
            held = resident_programs(cfg.warps, resources(compiled)[0], compiled.metadata.shared)
            out[f"{gpu} {key} {n}"] = [held, cfg.programs_per_sm]
    return out


def pinned_vectors() -> dict:
    """Per pinned realigned config (the ``*_odd`` tables), built at the bucket's N - 1 (an odd row):
    its 16-byte global loads and stores, and those of the element-wise row kernel it replaces (the
    same config with ``realign`` off), which has none."""
    from dataclasses import replace

    def vectors(ptx: str) -> int:
        return len(re.findall(r"(?:ld|st)\.global[.\w]*\.v4", ptx))

    out = {}
    for gpu, table in C.pinned_table().items():
        for key, by_n in table.items():
            if not key.endswith("_odd"):
                continue
            op, _, direction = key[: -len("_odd")].rpartition("_")
            for b, entry in by_n.items():
                cfg = C.Config(**entry)
                n = int(b) - 1
                out[f"{gpu} {key} {b}"] = [vectors(build_config(op, direction, n, c).asm["ptx"])
                                           for c in (cfg, replace(cfg, realign=False))]  # fmt: skip
    return out


def build_config(op: str, direction: str, n: int, cfg: C.Config, x_dtype="bf16", w_dtype="bf16"):
    layernorm, fused = FLAGS[op]
    rows = dict.fromkeys(("X", "R", "Y", "H", "DY", "DRES", "DX"), x_dtype)
    fp32 = dict.fromkeys(("MEAN", "RSTD", "ROW_SUMS", "DW_PARTIAL", "DB_PARTIAL"), "fp32")
    pointers = {**rows, **fp32, "W": w_dtype, "B": w_dtype}
    whole_row = {"BLOCK_N": C.bucket(n), "EXACT_N": n if cfg.exact_n else 0, "VIEWS": False}  # (M, N) rows
    odd = n % 8 != 0  # N and the row strides no multiple of 16 either
    if cfg.realign and odd and not (cfg.chunk or cfg.slice):  # bf16 rows that fill no whole vectors
        flags = {"LAYERNORM": layernorm, "ROWS": cfg.rows, "BLOCK_N": C.bucket(n), "VEC": 16 // DTYPES[x_dtype].itemsize}
        if direction == "fwd":
            flags |= {"HAS_RESIDUAL": fused, "HAS_WEIGHT": True, "HAS_BIAS": layernorm}
            return build(K._norm_fwd_odd_kernel, pointers, flags, cfg.warps, odd)
        flags |= {"HAS_WEIGHT": True, "HAS_DRESIDUAL": fused}
        return build(K._norm_bwd_odd_kernel, pointers, flags, cfg.warps, odd)
    if direction == "fwd":
        flags = {"LAYERNORM": layernorm, "HAS_RESIDUAL": fused, "HAS_WEIGHT": True, "HAS_BIAS": layernorm, "ROWS": cfg.rows}
        if cfg.slice and cfg.sync:  # the exchanging slices, their posts in int64 slots
            sliced = {"SLICE": cfg.slice, "SLICES_P2": triton.next_power_of_2(triton.cdiv(n, cfg.slice)),
                      "VIEWS": False, "AHEAD": cfg.ahead}  # fmt: skip
            return build(K._norm_fwd_sync_kernel, {**pointers, "STATS": "i64"}, {**flags, **sliced}, cfg.warps, odd)
        if cfg.chunk:
            return build(K._norm_fwd_chunked_kernel, pointers, {**flags, "CHUNK": cfg.chunk, "VIEWS": False}, cfg.warps, odd)
        return build(K._norm_fwd_row_kernel, pointers, {**flags, **whole_row}, cfg.warps, odd)
    flags = {"LAYERNORM": layernorm, "HAS_WEIGHT": True, "HAS_DRESIDUAL": fused, "ROWS": cfg.rows}
    if cfg.slice:
        slices = triton.cdiv(n, cfg.slice)
        sliced = {"SLICE": cfg.slice, "SLICES": slices, "SLICES_P2": triton.next_power_of_2(slices),
                  "SUMS_GIVEN": cfg.row_sums or cfg.sync, "STREAM": min(cfg.chunk or cfg.slice, cfg.slice),
                  "VIEWS": False, "SYNC": cfg.sync, "AHEAD": cfg.ahead}  # fmt: skip
        if cfg.sync:  # the posted row sums: int64 slots
            pointers = {**pointers, "ROW_SUMS": "i64"}
        return build(K._norm_bwd_slice_kernel, pointers, {**flags, **sliced}, cfg.warps, odd)
    row = {**flags, **whole_row, "REREAD": cfg.reread, "PREFETCH": cfg.prefetch, "ACC_ROWS": cfg.acc_rows}
    return build(K._norm_bwd_row_kernel, pointers, row, cfg.warps, odd)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpu", default="NVIDIA H200", help="whose pinned configs (configs.json) to build")
    p.add_argument("--ops", default=",".join(FLAGS))
    p.add_argument("--direction", default="fwd,bwd")
    p.add_argument("--config", help="a Config as JSON, instead of the GPU's")
    p.add_argument("--weight-dtype", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--waits", action="store_true", help="print ``pinned_waits()`` as JSON instead")
    p.add_argument("--vectors", action="store_true", help="print ``pinned_vectors()`` as JSON instead")
    p.add_argument("--residency", action="store_true", help="print ``pinned_residency()`` as JSON instead")
    p.add_argument("n", nargs="*", type=int, help="row lengths (default: the sweep's)")
    a = p.parse_args(argv)
    if a.waits:
        print(json.dumps(pinned_waits()))
        return 0
    if a.vectors:
        print(json.dumps(pinned_vectors()))
        return 0
    if a.residency:
        print(json.dumps(pinned_residency()))
        return 0
    from harness.spec.shapes import SWEEP_N

    for n in a.n or SWEEP_N:
        for direction in a.direction.split(","):
            for op in a.ops.split(","):
                if op not in FLAGS:
                    raise SystemExit(f"unknown op {op!r}; known: {', '.join(FLAGS)}")
                if a.config:
                    cfg = C.Config(**json.loads(a.config))
                else:  # what a launch with these dtypes runs (``for_weight``)
                    cfg = C.for_weight(C.lookup(a.gpu, op, direction, n), direction, DTYPES[a.weight_dtype], DTYPES["bf16"])
                compiled = build_config(op, direction, n, cfg, w_dtype=a.weight_dtype)
                regs, stack = resources(compiled)
                fit = resident_programs(cfg.warps, regs, compiled.metadata.shared)
                wanted = cfg.programs_per_sm if direction == "bwd" or cfg.persistent else 1
                short = {k: v for k, v in cfg.to_json().items() if v or k == "prefetch"}
                print(f"{op:11s} {direction} N={n:6d} regs {regs:3d} stack {stack:3d} B  programs/SM: {fit} fit, "
                      f"{wanted} wanted{'  (not all resident)' if fit < wanted else ''}  {short}", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
