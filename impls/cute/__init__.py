"""CuTe DSL kernels (nvidia-cutlass-dsl), written here; Quack is the external anchor, not a dependency."""

from harness.spec.contract import Implementation, capability, cuda, package

IMPLEMENTATIONS = [
    Implementation(
        name="cute",
        dsl="cute",
        entry="impls.cute.kernels",
        description=(
            "CuTe DSL: 128-bit vector copies, warp/smem/cluster (DSMEM) row reductions, persistent backward; "
            "add_rmsnorm as the RMSNorm kernels with a residual row; fp32 weights beside 16-bit x; "
            "launch shapes checked against Hopper's limits before compiling"
        ),
        ops=("rmsnorm", "layernorm", "add_rmsnorm"),
        devices=("cuda",),
        requires=(cuda(), capability(9, 0), package("cutlass"), package("tvm_ffi")),
        sources=("impls/cute/kernels.py", "impls/cute/plan.py"),
    )
]
