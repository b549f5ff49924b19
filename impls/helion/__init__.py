from harness.spec.contract import Implementation, package

IMPLEMENTATIONS = [
    Implementation(
        name="helion",
        dsl="helion",
        entry="impls.helion.kernels",
        description=(
            "Helion tile-first kernels (hl.tile over rows, fp32 row reductions; backward with fp32 "
            "dweight/dbias partials per row block), one helion.Config pinned per GPU and N bucket; "
            "add_rmsnorm is the RMSNorm kernels specialized for the residual tensors (the sum rounded "
            "to x's dtype before the statistics), on RMSNorm's configs; fp32 weights loaded as such"
        ),
        ops=("rmsnorm", "layernorm", "add_rmsnorm"),
        devices=("cpu", "cuda"),
        requires=(package("helion"),),
        # The kernels pick Helion's eager reference mode for CPU tensors themselves; the harness
        # setting HELION_INTERPRET=1 before the import is harmless.
        interpreter="HELION_INTERPRET",
        sources=("impls/helion/kernels.py", "impls/helion/configs.py", "impls/helion/imports.py"),
        hooks={"tune": "impls.helion.tune:tune", "codegen": "impls.helion.codegen:codegen", "config_source": "impls.helion.configs:source"},
    )
]
