from harness.spec.contract import Implementation, cuda, package
from harness.spec.ops import FP8_OPS

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
            "kernels; fp32 weights beside 16-bit x; NaN where the statistics overflow; per-head (T, H, N) views "
            "read in place (two row strides); tens of rows per program for small rows"
        ),
        ops=("rmsnorm", "layernorm", "add_rmsnorm", *FP8_OPS),
        # the FP8 ops (norm + quantization to float8_e4m3fn, forward only) in a file of their own
        extra_entries=("impls.gluon.fp8",),
        devices=("cuda",),
        # (T, H, N) per-head views of a fused QKV tensor read in place (two row strides)
        row_views=True,
        # cuda() first: looking for triton.experimental.gluon imports triton, which on a CPU machine
        # must wait until Triton's interpreter is switched on (see harness.spec.interpreters.INTERPRETERS)
        requires=(cuda(), package("triton"), package("triton.experimental.gluon")),
        sources=("impls/gluon/kernels.py", "impls/gluon/plan.py", "impls/gluon/interpret.py", "impls/gluon/fp8.py"),
    )
]
