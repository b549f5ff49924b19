"""``normbench codegen helion``: the Triton source Helion generates for a kernel's pinned config.

No GPU needed: the kernel is bound to CPU tensors of the requested N and dtype and
``BoundKernel.to_triton_code(config)`` returns what a GPU would compile. M does not matter (shapes
are dynamic: one binary serves every M), so two rows stand in for it.

Whose config: the current CUDA device's when there is one, else the first GPU in configs.json with
configs for this entry point, else the default config. Each kernel's source starts with a header
saying which, along with the kernel and the config (the split backward runs two kernels).
"""

from __future__ import annotations

import torch

from . import configs, layernorm, rmsnorm


def example_args(op: str, direction: str, n: int, dtype: str, m: int = 2) -> tuple:
    """CPU stand-ins for the contract function's arguments (with weight and bias)."""
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    x = torch.zeros(m, n, dtype=dt)
    w = torch.ones(n, dtype=dt)
    stat = torch.ones(m, dtype=torch.float32)
    if direction == "fwd":
        return (x, w, torch.zeros(n, dtype=dt), 1e-5) if op == "layernorm" else (x, w, 1e-5)
    dy = torch.zeros(m, n, dtype=dt)
    return (dy, x, w, stat, stat.clone()) if op == "layernorm" else (dy, x, w, stat)


def launches(op: str, direction: str, choice: configs.Pinned, args: tuple) -> list:
    """(kernel, config, arguments) for each kernel the contract function runs with ``choice``."""
    mod = rmsnorm if op == "rmsnorm" else layernorm
    if direction == "fwd":
        return [(getattr(mod, f"{op}_fwd_kernel"), choice.config, args)]
    if choice.kernel != f"{op}_bwd_split":
        return [(getattr(mod, choice.kernel), choice.config, args)]
    row_stats = args[-1]  # the per-row sums are (M,) fp32, like the statistics
    sums = (row_stats,) if op == "rmsnorm" else (row_stats, row_stats)
    return [
        (getattr(mod, f"{op}_bwd_row_sums"), choice.first_pass, args),
        (getattr(mod, f"{op}_bwd_split"), choice.config, args + sums),
    ]


def which_gpu(entry: str) -> str | None:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return next((gpu for gpu, entries in configs.table().items() if entries.get(entry)), None)


def codegen(op: str, direction: str, n: int, dtype: str = "bf16", gpu: str | None = None) -> str:
    entry = f"{op}_{direction}"
    gpu = gpu or which_gpu(entry)
    choice = configs.pinned(entry, n, dtype, gpu) if gpu else configs.default_config(entry, n)
    whose = f"{choice.source} for {gpu}" if choice.source != "default" else "default"
    parts = []
    for kernel, config, args in launches(op, direction, choice, example_args(op, direction, n, dtype)):
        bound = kernel.bind(args)
        fitted = configs.fit(config, bound)
        parts.append(
            f"# Helion {entry}, N={n}, {dtype}: kernel {kernel.name}\n"
            f"# config ({whose}): {fitted}\n" + bound.to_triton_code(fitted)
        )
    return "\n\n".join(parts)
