"""Shape sets: data shared by `normbench check`, the tests and the benchmark (never re-typed).

A shape is the full shape of x; ``layout`` says how the row tensors are laid out in memory:
"contiguous"; "column-slice" (each of them wider[:, :N], a view with row stride > N); or one side a
column slice and the other contiguous, since the contract lets dy's row stride differ from x's:
"dy-column-slice" (the gradients dy, dresidual_out sliced; x, residual contiguous) and
"x-column-slice" (x, residual sliced; dy, dresidual_out contiguous); "head-slice-P" (x and
residual are (T, H, N) views of the first H heads of a contiguous (T, P, N) tensor, as q and k are
views of a fused QKV projection's output: a token stride of P*N, not H*N, so no (T*H, N) view of them
exists; the gradients contiguous, as attention's are).
"""

from __future__ import annotations

from dataclasses import dataclass

SWEEP_ELEMENTS = 2**27  # M * N for every sweep point: big enough to dwarf the L2 of an H100/H200
SWEEP_N = (1024, 2048, 2880, 4096, 5120, 7168, 8192, 16384, 32768, 65536, 262144)
# Between and beside the sweep's N, at the sweep's bytes per point: a kernel tuned to the eleven sweep
# N shows here. Hidden sizes of current models that the sweep lacks (1536, 2304, 3072, 3584, 6144,
# 12288), an odd width (4001: no 16-byte vectors), and widths between the
# sweep's wide points (10240, 24576, 49152, 131072).
BETWEEN_N = (1536, 2304, 3072, 3584, 4001, 6144, 10240, 12288, 24576, 49152, 131072)
# Small rows, at the sweep's bytes per point: QK-norm normalizes over head_dim (64-256) with M =
# tokens x heads in the millions; per-head LayerNorm and small-hidden models.
SMALL_N = (64, 128, 256, 512)
COLUMN_SLICE_PAD = 24  # extra columns of the wider tensor a column-slice shape is cut from
LAYOUTS = ("contiguous", "column-slice", "dy-column-slice", "x-column-slice", "head-slice-P")
HEAD_SLICE = "head-slice-"
# the drawn row tensors that are gradients (laid out by the "dy-" side of a layout)
GRADIENTS = ("dy", "dresidual_out")


def parent_heads(layout: str) -> int:
    """P of a "head-slice-P" layout (the heads of the tensor the views are cut from), else 0."""
    if not layout.startswith(HEAD_SLICE):
        return 0
    p = layout[len(HEAD_SLICE) :]
    if not p.isdigit() or int(p) < 1:
        raise ValueError(f"bad layout '{layout}': expected head-slice-P with P a positive integer")
    return int(p)


def head_sliced(layout: str, tensor: str) -> bool:
    """Whether ``tensor`` is a per-head view of a wider (T, P, N) tensor (x and residual of a
    "head-slice-P" layout)."""
    return layout.startswith(HEAD_SLICE) and tensor not in GRADIENTS


def sliced(layout: str, tensor: str) -> bool:
    """Whether ``tensor`` (a drawn row tensor: x, dy, residual, dresidual_out) is a column slice."""
    if layout == "column-slice":
        return True
    if layout == "dy-column-slice":
        return tensor in GRADIENTS
    if layout == "x-column-slice":
        return tensor not in GRADIENTS
    return False


@dataclass(frozen=True)
class Shape:
    dims: tuple[int, ...]  # x's shape, N last
    layout: str = "contiguous"

    @property
    def n(self) -> int:
        return self.dims[-1]

    @property
    def m(self) -> int:
        m = 1
        for d in self.dims[:-1]:
            m *= d
        return m

    @property
    def label(self) -> str:
        s = "x".join(map(str, self.dims))
        return s if self.layout == "contiguous" else f"{s}:{self.layout}"

    def to_json(self) -> dict:
        return {"dims": list(self.dims), "layout": self.layout, "M": self.m, "N": self.n, "label": self.label}

    @staticmethod
    def from_json(d: dict) -> "Shape":
        return Shape(tuple(d["dims"]), d.get("layout", "contiguous"))


SHAPE_SETS: dict[str, tuple[Shape, ...]] = {
    # CPU- and interpreter-friendly.
    "smoke": tuple(Shape((m, n)) for m in (1, 3, 128) for n in (1, 7, 64, 1000, 4096)),
    "edge": (
        Shape((96, 1000), "column-slice"),  # non-contiguous rows: a column slice of a wider tensor
        Shape((4, 33, 256)),  # 3-D (B, S, N)
        Shape((2, 5, 1003), "column-slice"),  # 3-D and strided
        Shape((0, 512)),  # M = 0
        Shape((2, 0, 64)),  # M = 0 in 3-D
        Shape((37, 1001)),  # N not a multiple of 8
        Shape((64, 2880)),  # N = 2880 (gpt-oss hidden size), not a power of two
        # rows too wide for one register tile: the looped / sliced / clustered paths, which the
        # sweep reaches only in bf16 and only on a GPU
        Shape((3, 20001)),  # wide and odd: narrow vectors on the wide path
        Shape((2, 262144)),  # the widest sweep row
        # wide odd widths: a register tile padded to the next power of two, vectors of one element,
        # CuTe's clusters of whole-warp CTAs (16383: one 16-bit CTA, a 2-CTA fp32 cluster; 65537: a
        # 16-CTA fp32 cluster); 131080 is the narrowest 16-bit row whose power-of-two CTAs left the
        # cluster's last CTA without columns (a launch over the shared-memory limit before the fix)
        Shape((2, 16383)),
        Shape((2, 65537)),
        Shape((2, 131080)),
        # dy's row stride unlike x's (the contract allows it): a backward that walks dy with x's
        # stride reads the wrong elements, or past dy's end
        Shape((24, 520), "dy-column-slice"),
        Shape((24, 520), "x-column-slice"),
        # per-head views of a fused QKV tensor (rows at t * P * N + h * N): no (M, N) view exists
        Shape((5, 3, 96), "head-slice-7"),
        Shape((4, 2, 1003), "head-slice-5"),
    ),
    # The GPU ranking: equal bytes at every N, so each point moves the same data.
    "sweep": tuple(Shape((SWEEP_ELEMENTS // n, n)) for n in SWEEP_N),
    # Off the sweep's N, same bytes per point: performance between the tuned points.
    "between": tuple(Shape((SWEEP_ELEMENTS // n, n)) for n in BETWEEN_N),
    # Small rows, same bytes per point.
    "small": tuple(Shape((SWEEP_ELEMENTS // n, n)) for n in SMALL_N),
    # QK-norm's inputs as a model holds them: q and k as (tokens, heads, head_dim) views of a fused
    # QKV projection's output (Llama-3-8B: 32 q + 8 k + 8 v heads of 128; Qwen3-32B: 64 + 8 + 8 of
    # 128), each beside the same shape made contiguous: the difference is what the strides cost.
    # Only the views' own bytes count (the parent's other heads are never touched).
    "perhead": tuple(
        s
        for t, h, p in ((32768, 32, 48), (32768, 8, 48), (16384, 64, 80), (16384, 8, 80))
        for s in (Shape((t, h, 128), f"head-slice-{p}"), Shape((t, h, 128)))
    ),
    # Latency-bound decode steps.
    "decode": tuple(Shape((m, n)) for m in (1, 16, 128) for n in (4096, 8192)),
}


def shape_set(name: str) -> tuple[Shape, ...]:
    if name not in SHAPE_SETS:
        raise ValueError(f"unknown shape set '{name}'; known: {', '.join(SHAPE_SETS)}")
    return SHAPE_SETS[name]


def parse_shape(text: str) -> Shape:
    """'MxN', 'BxSxN' or 'MxN:LAYOUT' (LAYOUTS) -> Shape (for --shape on the command line)."""
    dims_s, _, layout = text.partition(":")
    try:
        dims = tuple(int(d) for d in dims_s.lower().split("x"))
    except ValueError:
        raise ValueError(f"bad shape '{text}': expected e.g. 4096x8192 or 4096x8192:column-slice") from None
    if not dims or any(d < 0 for d in dims):
        raise ValueError(f"bad shape '{text}': dimensions must be non-negative integers")
    layout = layout or "contiguous"
    if layout.startswith(HEAD_SLICE):
        p = parent_heads(layout)
        if len(dims) != 3 or p < dims[1]:
            raise ValueError(f"bad shape '{text}': a head-slice-P shape is TxHxN with H <= P")
    elif layout not in LAYOUTS:
        raise ValueError(f"bad layout '{layout}': expected {', '.join(LAYOUTS)}")
    return Shape(dims, layout)
