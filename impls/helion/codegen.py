"""``normbench codegen helion``: the Triton source Helion generates for a kernel's pinned config.

No GPU needed: the kernel is bound to CPU tensors of the requested N and dtype and
``BoundKernel.to_triton_code(config)`` returns what a GPU would compile. M does not matter (shapes
are dynamic: one binary serves every M), so two rows stand in for it.

Whose config: the current CUDA device's when there is one, else the first GPU in configs.json with
configs for this entry point, else the default config. Each kernel's source starts with a header
saying which, along with the kernel and the config (the split backward runs two kernels).
``add_rmsnorm`` shows rmsnorm's kernels specialized for the residual tensors, with rmsnorm's config.
"""

from __future__ import annotations

import torch

from . import configs, kernels


# add_rmsnorm runs rmsnorm's kernels (with the residual tensors) and rmsnorm's pinned configs
KERNELS_OF = {"rmsnorm": "rmsnorm", "layernorm": "layernorm", "add_rmsnorm": "rmsnorm"}


def example_args(op: str, direction: str, n: int, dtype: str, m: int = 2) -> tuple:
    """CPU stand-ins for the contract function's arguments (with weight and bias)."""
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    x = torch.zeros(m, n, dtype=dt)
    w = torch.ones(n, dtype=dt)
    stat = torch.ones(m, dtype=torch.float32)
    if direction == "fwd":
        return {"layernorm": (x, w, torch.zeros(n, dtype=dt), 1e-5), "rmsnorm": (x, w, 1e-5)}.get(op, (x, x.clone(), w, 1e-5))
    dy = torch.zeros(m, n, dtype=dt)
    return {"layernorm": (dy, x, w, stat, stat.clone()), "rmsnorm": (dy, x, w, stat)}.get(op, (dy, dy.clone(), x, w, stat))


def launches(op: str, direction: str, choice: configs.Pinned, args: tuple) -> list:
    """(kernel, config, arguments) for each kernel the contract function runs with ``choice``."""
    family = KERNELS_OF[op]
    if family == "rmsnorm":
        # the kernels' own argument lists: the residual tensors (None for plain RMSNorm) beside x / dy
        if direction == "fwd":
            x, residual, w, eps = args if op == "add_rmsnorm" else (args[0], None, *args[1:])
            args = (x, residual, None if residual is None else torch.empty_like(x), w, eps)
        elif op == "rmsnorm":
            args = (args[0], None, *args[1:])
    if direction == "fwd" and choice.kernel == f"{family}_fwd_sync":
        # one group of every slice, the slots zeroed (and LayerNorm's slice counts), as the launcher passes them
        config = configs.fwd_sync_config(choice)
        m, n = args[0].shape
        width = config["block_sizes"][1]
        slots = torch.zeros((m, -(-n // width)) if family == "rmsnorm" else (m, -(-n // width), 2), dtype=torch.int64)
        grid = (slots, 1, -(-m // config["block_sizes"][0]), 0, kernels.SPIN_LIMIT)
        counts = () if family == "rmsnorm" else (kernels._slice_counts(n, width, args[0].device),)
        return [(kernels.rmsnorm_fwd_sync if family == "rmsnorm" else kernels.layernorm_fwd_sync, config, args + counts + grid)]
    if direction == "fwd":
        return [(getattr(kernels, f"{family}_fwd_kernel"), choice.config, args)]
    if choice.kernel == f"{family}_bwd_heads":
        # the kernel over (T, H, N) rows takes (M, N) rows as (M, 1, N), the statistics as (M, 1)
        weight = 3 if family == "rmsnorm" else 2  # (dy, dresidual, x, weight, rstd) or (dy, x, weight, mean, rstd)
        heads = tuple(a if i == weight or a is None else a[:, None] for i, a in enumerate(args))
        return [(getattr(kernels, choice.kernel), configs.heads_config(choice, 1), heads)]
    if choice.kernel == f"{family}_bwd_sync":
        # one group of every slice; the slots zeroed, as the launcher passes them
        config = configs.sync_config(choice.config)
        x = args[2] if family == "rmsnorm" else args[1]
        m, n = x.shape
        slices = -(-n // config["block_sizes"][1])
        slots = torch.zeros((m, slices) if family == "rmsnorm" else (m, slices, 2), dtype=torch.int64)
        blocks = -(-m // config["block_sizes"][0])
        return [(getattr(kernels, choice.kernel), config, args + (slots, 1, blocks, 0, kernels.SPIN_LIMIT))]
    if choice.kernel != f"{family}_bwd_split":
        return [(getattr(kernels, choice.kernel), choice.config, args)]
    row_stats = args[-1]  # the per-row sums are (M,) fp32, like the statistics
    if family == "rmsnorm":  # the row sums take no dresidual
        return [
            (kernels.rmsnorm_bwd_row_sums, choice.first_pass, (args[0], *args[2:])),
            (kernels.rmsnorm_bwd_split, choice.config, args + (row_stats,)),
        ]
    return [
        (kernels.layernorm_bwd_row_sums, choice.first_pass, args),
        (kernels.layernorm_bwd_split, choice.config, args + (row_stats, row_stats)),
    ]


def which_gpu(entry: str) -> str | None:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return next((gpu for gpu, entries in configs.table().items() if entries.get(entry)), None)


def codegen(op: str, direction: str, n: int, dtype: str = "bf16", gpu: str | None = None) -> str:
    if op not in KERNELS_OF:  # the FP8-output kernels' configs and arguments are fp8.py's own
        raise ValueError(f"codegen covers {', '.join(KERNELS_OF)}; {op!r} is not one of them")
    entry = configs.entry_of(op, direction)
    gpu = gpu or which_gpu(entry)
    choice = configs.pinned(entry, n, dtype, gpu) if gpu else configs.default_config(entry, n)
    whose = f"{choice.source} for {gpu}" if choice.source != "default" else "default"
    if entry != f"{op}_{direction}":
        whose += f", {entry}'s"
    parts = []
    for kernel, config, args in launches(op, direction, choice, example_args(op, direction, n, dtype)):
        bound = kernel.bind(args)
        fitted = configs.fit(config, bound)
        parts.append(
            f"# Helion {op}_{direction}, N={n}, {dtype}: kernel {kernel.name}\n"
            f"# config ({whose}): {fitted}\n" + bound.to_triton_code(fitted)
        )
    return "\n\n".join(parts)
