from harness.spec.contract import Implementation, package

IMPLEMENTATIONS = [
    Implementation(
        name="triton",
        dsl="triton",
        entry="impls.triton.kernels",
        description=(
            "Hand-written Triton: one-pass forward, persistent backward with per-program fp32 "
            "dweight/dbias partials; the fused residual add + RMSNorm is the same kernels behind "
            "compile-time flags; fp32 or x-dtype weights; configs pinned per GPU and N bucket"
        ),
        ops=("rmsnorm", "layernorm", "add_rmsnorm"),
        devices=("cpu", "cuda"),
        requires=(package("triton"),),
        interpreter="TRITON_INTERPRET",
        sources=("impls/triton/kernels.py", "impls/triton/configs.py", "impls/triton/configs.json"),
        hooks={"tune": "impls.triton.tune:tune", "config_source": "impls.triton.configs:source"},
    )
]
