from harness.contract import Implementation

IMPLEMENTATIONS = [
    Implementation(
        name="eager",
        dsl="eager",
        entry="impls.eager.kernels",
        description="PyTorch eager: F.rms_norm / F.layer_norm and ATen's own backward kernels; add_rmsnorm as the unfused add + norm (the speedup baseline)",
        devices=("cpu", "cuda"),
        sources=("impls/eager/kernels.py",),
        ops=("rmsnorm", "layernorm", "add_rmsnorm"),
    )
]
