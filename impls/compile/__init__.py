from harness.spec.contract import Implementation
from harness.spec.ops import FP8_OPS

_COMMON = dict(
    dsl="compile", entry="impls.compile.kernels:make", devices=("cpu", "cuda"), sources=("impls/compile/kernels.py",),
    cpu_cost="costly", ops=("rmsnorm", "layernorm", "add_rmsnorm"), row_views=True,
)  # fmt: skip
# the FP8 ops (impls/compile/fp8.py) in the default mode only: a max-autotune search per shape and
# group would double what the CPU tests compile for a reduction Inductor's heuristics already fuse
_FP8 = {
    "ops": (*_COMMON["ops"], *FP8_OPS),
    "extra_entries": ("impls.compile.fp8:make",),
    "sources": (*_COMMON["sources"], "impls/compile/fp8.py"),
}

IMPLEMENTATIONS = [
    Implementation(
        name="compile",
        description="torch.compile (mode=default, dynamic=False) of the plain fp32 formulas",
        options={"mode": "default"},
        **{**_COMMON, **_FP8},
    ),
    Implementation(
        name="compile-max-autotune",
        description="torch.compile (mode=max-autotune-no-cudagraphs, dynamic=False) of the plain fp32 formulas",
        options={"mode": "max-autotune-no-cudagraphs"},
        **_COMMON,
    ),
]
