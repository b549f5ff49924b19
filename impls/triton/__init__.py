from harness.contract import Implementation, package

IMPLEMENTATIONS = [
    Implementation(
        name="triton",
        dsl="triton",
        entry="impls.triton.norm_kernels",
        description=(
            "Hand-written Triton: one-pass forward, persistent backward with per-program fp32 "
            "dweight/dbias partials; configs pinned per GPU and N bucket"
        ),
        devices=("cpu", "cuda"),
        requires=(package("triton"),),
        interpreter="TRITON_INTERPRET",
        sources=("impls/triton/norm_kernels.py", "impls/triton/norm_configs.py", "impls/triton/norm_configs.json"),
        hooks={"tune": "impls.triton.norm_kernels:tune"},
    )
]
