from harness.spec.contract import Implementation, capability, cuda, package

IMPLEMENTATIONS = [
    Implementation(
        name="cutile",
        dsl="cutile",
        entry="impls.cutile.kernels",
        description=(
            "Hand-written cuTile Python (cuda-tile 1.7, tileiras 13.4): zero-padded [rows, 2^k] tiles "
            "loaded by tile index from strided arrays, one-pass forward with the row in one tile "
            "(chunked two-pass for wide rows), persistent backward with per-program fp32 dweight/dbias "
            "partials summed in a fixed order (column slices for wide rows); add + RMSNorm through the "
            "same kernels; fp32 weights beside 16-bit x; NaN where the statistics overflow"
        ),
        ops=("rmsnorm", "layernorm", "add_rmsnorm"),
        devices=("cuda",),
        # Tile IR runs on Ampere and newer (driver r580+); cuda() first so that a machine without
        # a GPU reads that reason rather than a missing package; "cuda" before "cuda.tile", whose
        # lookup imports its parent and raises where there is none
        requires=(cuda(), capability(8, 0), package("cuda"), package("cuda.tile")),
        sources=("impls/cutile/kernels.py", "impls/cutile/plan.py"),
    )
]
