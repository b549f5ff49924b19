"""CuTe DSL kernels (nvidia-cutlass-dsl), written here; Quack is the external anchor, not a dependency."""

from harness.spec.contract import Implementation, capability, cuda, package
from harness.spec.ops import FP8_OPS

IMPLEMENTATIONS = [
    Implementation(
        name="cute",
        dsl="cute",
        entry="impls.cute.kernels",
        description=(
            "CuTe DSL: 128-bit vector copies, warp/smem/cluster (DSMEM) row reductions, persistent backward; "
            "add_rmsnorm as the RMSNorm kernels with a residual row; fp32 weights beside 16-bit x; "
            "launch shapes checked against Hopper's limits before compiling; per-head (T, H, N) views read "
            "in place (a hierarchical row mode); FP8 output (per token and "
            "per 1 x 128 block) on the forward's launch shapes, block scales by warp shuffles"
        ),
        ops=("rmsnorm", "layernorm", "add_rmsnorm", *FP8_OPS),
        # the FP8 ops (norm + quantization to float8_e4m3fn, forward only) in a file of their own
        extra_entries=("impls.cute.fp8",),
        devices=("cuda",),
        # per-head (T, H, N) views of a fused QKV tensor are read in place (kernels.py: "Per-head views")
        row_views=True,
        requires=(cuda(), capability(9, 0), package("cutlass"), package("tvm_ffi")),
        sources=("impls/cute/kernels.py", "impls/cute/plan.py", "impls/cute/fp8.py"),
    )
]
