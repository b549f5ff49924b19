from harness.spec.contract import Implementation, cuda, package

IMPLEMENTATIONS = [
    Implementation(
        name="gluon",
        dsl="gluon",
        entry="impls.gluon.kernels",
        description=(
            "Hand-written Gluon (Triton's explicit-layout layer; triton 3.6-3.9): BlockedLayouts of "
            "128-bit vectors chosen from N and the element size, one-pass forward with the row in "
            "registers (chunked two-pass for wide rows), persistent backward with per-program fp32 "
            "dweight/dbias partials (column slices for wide rows); add + RMSNorm through the same "
            "kernels; fp32 weights beside 16-bit x; NaN where the statistics overflow"
        ),
        ops=("rmsnorm", "layernorm", "add_rmsnorm"),
        devices=("cuda",),
        # cuda() first: looking for triton.experimental.gluon imports triton, which on a CPU machine
        # must wait until Triton's interpreter is switched on (see harness.spec.interpreters.INTERPRETERS)
        requires=(cuda(), package("triton"), package("triton.experimental.gluon")),
        sources=("impls/gluon/kernels.py", "impls/gluon/plan.py", "impls/gluon/interpret.py"),
    )
]
