from harness.spec.contract import Implementation, capability, cuda, package
from harness.spec.ops import FP8_OPS

IMPLEMENTATIONS = [
    Implementation(
        name="cutile",
        dsl="cutile",
        entry="impls.cutile.kernels",
        description=(
            "Hand-written cuTile Python (cuda-tile 1.7, tileiras 13.4): zero-padded [rows, 2^k] tiles "
            "loaded by tile index from strided arrays, persistent one-pass forward with the row in one tile "
            "(chunked two-pass for wide rows), persistent backward with per-program fp32 dweight/dbias "
            "partials summed in a fixed order (column slices for wide rows); tile rows, TMA and the "
            "compiler's occupancy and worker-warp hints pinned per GPU and N bucket; add + RMSNorm through the "
            "same kernels; fp32 weights beside 16-bit x; NaN where the statistics overflow; per-head (T, H, N) "
            "views read in place as 3-D tiles of whole heads; FP8 output (per token or 1 x 128 blocks) from the "
            "same tiles and table"
        ),
        ops=("rmsnorm", "layernorm", "add_rmsnorm", *FP8_OPS),
        # the FP8 ops (norm + quantization to float8_e4m3fn, forward only) in a file of their own
        extra_entries=("impls.cutile.fp8",),
        devices=("cuda",),
        # Tile IR runs on Ampere and newer (driver r580+); cuda() first so that a machine without
        # a GPU reads that reason rather than a missing package; "cuda" before "cuda.tile", whose
        # lookup imports its parent and raises where there is none
        requires=(cuda(), capability(8, 0), package("cuda"), package("cuda.tile")),
        sources=("impls/cutile/kernels.py", "impls/cutile/plan.py", "impls/cutile/configs.py",
                 "impls/cutile/configs.json", "impls/cutile/fp8.py"),
        hooks={"config_source": "impls.cutile.configs:source"},
        # per-head (T, H, N) views of a fused QKV tensor read in place (kernels.py: "Per-head views")
        row_views=True,
    )
]
