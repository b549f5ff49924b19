"""Build the Triton that Helion generates for sm_90a without a GPU, and count its 16-byte accesses
(or the exchanging backward's atomics).

    python -m impls.helion.sm90a_build --vectors [N ...]
    python -m impls.helion.sm90a_build --sync [N ...]
    python -m impls.helion.sm90a_build --sync-fwd [N ...]

Helion binds a kernel to CPU tensors and compiles its Triton; running the host function with a
launcher that only records what it would launch gives the Triton kernel and its arguments, which
Triton compiles through ptxas (shipped with it) with no driver. The arguments are specialised as a
launch would specialise them: tensors' data pointers divisible by 16, integers equal to 1 (unit
strides) compile-time constants, other integers (M, N-sized strides, the grid) plain i32 with no
divisibility claimed.

``--vectors`` prints, per op and direction at an odd row length (default 4001, bf16, weight and
bias in x's dtype), the ``ld.global.v4`` / ``st.global.v4`` of the realigned kernel with its
default config and of the element-wise kernel the same rows take without it, as JSON: the
realigned ones must have some, the element-wise ones have none (tests/test_helion.py).

``--sync`` prints, per op at a wide row length (default 24576, bf16), the exchanging backward's
(``*_bwd_sync``) atomic exchanges and its waits (``harness.spec.ptx.atomic_waits``), as JSON;
``--sync-fwd`` the same of the exchanging forward (``*_fwd_sync``).
"""

from __future__ import annotations

import argparse
import json
import os
import re

os.environ.pop("TRITON_INTERPRET", None)  # compiled kernels, not the interpreter's

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from harness.spec.ptx import atomic_waits  # noqa: E402

from . import codegen, configs, kernels  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
POINTEE = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32", torch.int64: "i64"}


def build(kernel, config: dict, args: tuple):
    """The sm_90a build of ``kernel`` (a Helion kernel) with ``config`` on ``args`` (CPU tensors)."""
    bound = kernel.bind(args)
    launched = {}

    def record(triton_kernel, grid, *kernel_args, num_warps, num_stages, **extra):
        launched.update(fn=triton_kernel, args=kernel_args, num_warps=num_warps, num_stages=num_stages)

    bound.compile_config(configs.fit(config, bound))(*args, _launcher=record)
    fn = launched["fn"]
    signature, constexprs, attrs = {}, {}, {}
    for i, (name, value) in enumerate(zip(fn.arg_names, launched["args"])):
        if fn.params[i].is_constexpr or value is None or (isinstance(value, int) and value == 1):
            signature[name], constexprs[(i,)] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name], attrs[(i,)] = "*" + POINTEE[value.dtype], [["tt.divisibility", 16]]
        else:
            signature[name] = "fp32" if isinstance(value, float) else "i32"
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=TARGET, options={"num_warps": launched["num_warps"], "num_stages": launched["num_stages"]})


def vectors(ptx: str) -> int:
    """16-byte global loads and stores in ``ptx``."""
    return len(re.findall(r"(?:ld|st)\.global[.\w]*\.v4", ptx))


# the realigned kernel of each op and direction, after its arguments in codegen's example order
REALIGNED = {
    ("rmsnorm", "fwd"): "rmsnorm_fwd_odd", ("add_rmsnorm", "fwd"): "rmsnorm_fwd_odd",
    ("layernorm", "fwd"): "layernorm_fwd_odd", ("rmsnorm", "bwd"): "rmsnorm_bwd_odd",
    ("add_rmsnorm", "bwd"): "rmsnorm_bwd_odd", ("layernorm", "bwd"): "layernorm_bwd_odd",
}  # fmt: skip


def realigned_vectors(n: int = 4001, m: int = 64) -> dict:
    """{"op direction N": [realigned kernel's 16-byte accesses, element-wise kernel's]}."""
    out = {}
    for (op, direction), name in REALIGNED.items():
        args = codegen.example_args(op, direction, n, "bf16", m)
        element_wise = configs.default_config(f"{codegen.KERNELS_OF[op]}_{direction}", n)
        (kernel, config, kernel_args), *_ = codegen.launches(op, direction, element_wise, args)
        choice = configs.realigned_default(op, direction, n)
        programs = configs.realigned_programs(choice, m, 8, torch.device("cpu"))
        out[f"{op} {direction} {n}"] = [
            vectors(build(getattr(kernels, name), choice.config, (*kernel_args, programs)).asm["ptx"]),
            vectors(build(kernel, config, kernel_args).asm["ptx"]),
        ]
    return out


# the exchanging backward's config for --sync: 2 rows a step, 4096-column slices, on 8 warps
SYNC_SPLIT = {"block_sizes": [128, 4096, 2], "num_warps": 8}


# the exchanging forward's for --sync-fwd: the row kernel's fallback, and one row a step of
# 8192-column slices on 8 warps
SYNC_FWD = {"block_sizes": [1], "reduction_loops": [8192], "num_warps": 16}
SYNC_FWD_OWN = {"block_sizes": [1, 8192], "num_warps": 8}


def sync_builds(n: int = 24576, m: int = 64, direction: str = "bwd") -> dict:
    """{"op N": [atomic exchanges, waits]} of each op's exchanging backward (or forward), built for
    sm_90a."""
    out = {}
    for op in ("rmsnorm", "layernorm", "add_rmsnorm"):
        family = codegen.KERNELS_OF[op]
        if direction == "bwd":
            choice = configs.Pinned(f"{family}_bwd_sync", SYNC_SPLIT)
        else:
            choice = configs.Pinned(f"{family}_fwd_sync", SYNC_FWD, sync=SYNC_FWD_OWN)
        args = codegen.example_args(op, direction, n, "bf16", m)
        ((kernel, config, kernel_args),) = codegen.launches(op, direction, choice, args)
        ptx = build(kernel, config, kernel_args).asm["ptx"]
        out[f"{op} {n}"] = [len(re.findall(r"atom\.global[.\w]*\.exch", ptx)), atomic_waits(ptx)]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vectors", action="store_true", help="print ``realigned_vectors()`` as JSON")
    p.add_argument("--sync", action="store_true", help="print ``sync_builds()`` as JSON")
    p.add_argument("--sync-fwd", action="store_true", help="print ``sync_builds(direction='fwd')`` as JSON")
    p.add_argument("n", nargs="*", type=int, help="row lengths (default 4001, or 24576 with --sync)")
    a = p.parse_args(argv)
    if a.vectors + a.sync + a.sync_fwd != 1:
        p.error("pass one of --vectors, --sync and --sync-fwd")
    if any(n < 1 for n in a.n):
        p.error(f"row lengths must be >= 1, got {' '.join(map(str, a.n))}")
    out = {}
    for n in a.n or [4001 if a.vectors else 24576]:
        out.update(realigned_vectors(n) if a.vectors else sync_builds(n, direction="fwd" if a.sync_fwd else "bwd"))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
