from harness.spec.contract import Implementation, package
from harness.spec.ops import FP8_OPS

IMPLEMENTATIONS = [
    Implementation(
        name="helion",
        dsl="helion",
        entry="impls.helion.kernels",
        description=(
            "Helion tile-first kernels (hl.tile over rows, fp32 row reductions; backward with fp32 "
            "dweight/dbias partials per row block), one helion.Config pinned per GPU and N bucket; "
            "add_rmsnorm is the RMSNorm kernels specialized for the residual tensors (the sum rounded "
            "to x's dtype before the statistics), on RMSNorm's configs (its wide forward on an entry of its own); fp32 weights loaded as such; per-head "
            "(T, H, N) views tiled over tokens and heads in place; small rows with per-row dweight accumulators"
        ),
        ops=("rmsnorm", "layernorm", "add_rmsnorm", *FP8_OPS),
        # the FP8 ops (norm + quantization to float8_e4m3fn, forward only) in a file of their own
        extra_entries=("impls.helion.fp8",),
        devices=("cpu", "cuda"),
        # (T, H, N) per-head views of a fused QKV tensor read in place (two row strides)
        row_views=True,
        requires=(package("helion"),),
        # The kernels pick Helion's eager reference mode for CPU tensors themselves; the harness
        # setting HELION_INTERPRET=1 before the import is harmless.
        interpreter="HELION_INTERPRET",
        sources=(
            "impls/helion/kernels.py", "impls/helion/configs.py", "impls/helion/imports.py", "impls/helion/fp8.py",
        ),  # fmt: skip
        hooks={"tune": "impls.helion.tune:tune", "codegen": "impls.helion.codegen:codegen", "config_source": "impls.helion.configs:source"},
    )
]
