from harness.spec.contract import Implementation

_COMMON = dict(dsl="compile", entry="impls.compile.kernels:make", devices=("cpu", "cuda"), sources=("impls/compile/kernels.py",), cpu_cost="costly",
               ops=("rmsnorm", "layernorm", "add_rmsnorm"))

IMPLEMENTATIONS = [
    Implementation(
        name="compile",
        description="torch.compile (mode=default, dynamic=False) of the plain fp32 formulas",
        options={"mode": "default"},
        **_COMMON,
    ),
    Implementation(
        name="compile-max-autotune",
        description="torch.compile (mode=max-autotune-no-cudagraphs, dynamic=False) of the plain fp32 formulas",
        options={"mode": "max-autotune-no-cudagraphs"},
        **_COMMON,
    ),
]
