from harness.spec.contract import Implementation, package
from harness.spec.ops import FP8_OPS

IMPLEMENTATIONS = [
    Implementation(
        name="triton",
        dsl="triton",
        entry="impls.triton.kernels",
        description=(
            "Hand-written Triton: one-pass forward, persistent backward with per-program fp32 "
            "dweight/dbias partials; the fused residual add + RMSNorm is the same kernels behind "
            "compile-time flags; fp32 or x-dtype weights; per-head (T, H, N) views read in place; configs "
            "pinned per GPU and N bucket"
        ),
        ops=("rmsnorm", "layernorm", "add_rmsnorm", *FP8_OPS),
        # the FP8 ops (norm + quantization to float8_e4m3fn, forward only) in a file of their own
        extra_entries=("impls.triton.fp8",),
        devices=("cpu", "cuda"),
        row_views=True,
        requires=(package("triton"),),
        interpreter="TRITON_INTERPRET",
        sources=(
            "impls/triton/kernels.py", "impls/triton/configs.py", "impls/triton/configs.json", "impls/triton/fp8.py",
            "impls/triton/fp8_configs.json",
        ),  # fmt: skip
        hooks={"tune": "impls.triton.tune:tune", "config_source": "impls.triton.configs:source"},
    )
]
