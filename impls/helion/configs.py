"""Which helion.Config each Helion kernel runs with: pinned per GPU and row length, never autotuned.

Called without a config, Helion autotunes a kernel the first time it sees a shape (minutes). Here
every call goes through ``launch()``, which binds the kernel to its arguments and runs the function
``BoundKernel.compile_config(config)`` returns for the pinned config, so no search ever starts.

Where the config comes from (``pinned()``):

1. ``configs.json``, written by ``normbench tune --impl helion`` on a GPU machine (``tune.py``;
   a GPU without a table of its own reads that of a tuned GPU of the same compute capability,
   ``harness.spec.tuned``):
   GPU name (``torch.cuda.get_device_name``) -> entry point ("rmsnorm_bwd") -> dtype -> N bucket ->
   ``{"kernel": which kernel of the entry point, "config": helion.Config fields}`` (plus
   ``"first_pass"``, the config of the split backward's first kernel). The N bucket of a row length
   is the smallest tuned N >= it: a config tuned for shorter rows is no guess for longer ones (whole
   rows in registers stop fitting). A dtype with no entries of its own borrows those of the other
   16-bit dtype (same bytes per element) silently, or else of any tuned dtype, with a warning, at
   the bucket of rows of the same bytes: fp32 rows of N take the bf16 config of 2N, since what a
   config must fit (pipelined loads staged in shared memory, rows held in registers) scales with
   bytes per row (the bf16 config of N = 16384 asks more shared memory for fp32 rows of 16384 than
   a Hopper CTA may have).
2. ``default_config()`` when configs.json has no bucket for the GPU, entry point and N, with a
   warning that says so (once per entry point, GPU, dtype and N). It is derived from N alone:
   whole rows in registers while they fit (forward up to N = 32768, backward up to 16384) with
   about 16 elements per thread; wider rows loop over 8192-column chunks (forward, and the split
   backward's row sums), and the split backward's second kernel takes tiles of 128 rows x 1024
   columns, walked 4 rows at a time.

A forward entry may name the exchanging forward (``*_fwd_sync``, ``kernels.py``): its ``config``
stays the row kernel's (``*_fwd_kernel``, which runs on the CPU, for per-head views and where a
row's slices outnumber the SMs), and its ``sync`` field is the exchanging kernel's own config,
block sizes [rows a step, slice width] and its warps (``fwd_sync_config``). The H100's fused-add
entries above N = 32768 and its RMSNorm entry at the 262144 key (131072-262144 columns) name it:
there x (and the residual) read once on 16384-column slices of 16 warps won; LayerNorm's never
does (docs/kernels/helion.md), e.g. under "add_rmsnorm_fwd" -> "bf16" -> "262144":
``{"kernel": "rmsnorm_fwd_sync", "config": {"block_sizes": [1], "reduction_loops": [16384],
"num_warps": 32}, "sync": {"block_sizes": [1, 16384], "num_warps": 16}}``.

A backward entry may name the exchanging kernel (``*_bwd_sync``, ``kernels.py``) where it would
name the split one: its ``config`` and ``first_pass`` are still the split kernels', which run where
the exchange cannot (on the CPU, or with more slices than SMs), and the exchanging kernel takes the
split kernel's column tiles as its slices and its rows per step as its own (``sync_config``).

The entry points are rmsnorm's and layernorm's: add_rmsnorm runs rmsnorm's kernels (specialized for
the residual tensors) with rmsnorm's entries at the same N, except that its (M, N) forward reads
"add_rmsnorm_fwd" where the GPU's table has it (``FALLBACK_ENTRY``): it moves twice RMSNorm's row
tensors, so a kernel that loses for RMSNorm can win for it. Where the two agree its entries are
copies of rmsnorm's, which ``normbench tune`` does not refresh (copy them again after re-tuning
RMSNorm; a test compares them). Only its own 16-bit entries are read: fp32 rows and per-head
(T, H, N) views keep rmsnorm_fwd's. The dtype key is x's (what sets a row's bytes), whatever the
weight's dtype; an fp32 weight is one more (N,) vector per program. The FP8
norms (``fp8.py``) have one entry point, ``FP8_ENTRY``, for both groupings and the fused add; with
no table entries their config is ``fp8_default_config()``, taken without a warning.

Rows per program for few rows (``for_rows()``): the resident backward's ``block_sizes[0]`` (rows
per program) is tuned at the sweep's M, tens of thousands of rows. At decode sizes (M <= 128) that
block leaves all but a handful of SMs idle while each program walks its rows one step at a time, so
when the tuned block gives fewer programs than SMs it is shrunk to about M / SMs rows (a power of
two, at least one step of rows), so that every SM gets a program where M allows, at the cost of
one more compile per distinct block. The tuner turns this off (``FEW_ROWS_RULE``): it checks each
candidate on a few rows with exactly the binary that it then times on the full M, where the rule
would not act anyway.

Per-head views ((T, H, N) rows, ``kernels.py``): the kernels over tokens and heads run the config
pinned for rows of N, reshaped by ``heads_config``: the same rows per program and per step, as
many of them heads as H allows. Their block sizes count tokens and heads, so one config serves
every (T, H) of a model without a table of its own.

The realigned kernels (``kernels.py``, ``*_odd``: 16-bit rows of 1024 < N <= 8192 that fill no
whole 16-byte vectors) have a table of their own, configs.json's ``realigned``: GPU -> "<op>_<
direction>" -> N bucket -> ``{"kernel", "config", "programs_per_sm"}``, add_rmsnorm falling back to
rmsnorm's entry; without one, ``realigned_default()``. ``programs_per_sm`` sizes their persistent
grid (``realigned_programs``). Searched by tools/experiments/helion-odd-rows/explore.py
(``normbench tune`` leaves the table alone).

``force(entry, choice)`` makes every call of an entry point run one ``Pinned``, whatever the N, GPU
or dtype, until lifted (experiments: a candidate's check and timing through the contract functions).
Forcing "rmsnorm_fwd" forces the fused add's forward too, unless "add_rmsnorm_fwd" is forced itself:
the experiments time add_rmsnorm's candidates by forcing rmsnorm's entry.

On the CPU nothing is compiled: ``launch()`` runs the same kernel code in Helion's eager reference
mode (what HELION_INTERPRET=1 selects; here it is chosen by the tensors' device, so it does not
matter what the environment said when this package was imported), and configs play no part.

Measurements behind these choices: docs/kernels/helion.md.
"""

from __future__ import annotations

import functools
import json
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from harness.spec.jit_launch import launch as launch_jit
from harness.spec.ops import FP8_OPS
from harness.spec.tuned import capability_of, table_for

from .imports import Config, Kernel, RefMode
from .imports import kernel as helion_kernel

CONFIG_FILE = Path(__file__).with_name("configs.json")
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
ITEMSIZE = {name: dtype.itemsize for dtype, name in DTYPE_NAMES.items()}
SAME_SIZE = {"bf16": "fp16", "fp16": "bf16"}


@dataclass(frozen=True)
class Pinned:
    kernel: str  # the name of the kernel function (an entry point may have several)
    config: dict = field(hash=False)  # helion.Config keyword arguments
    source: str = "default"  # "tuned", "tuned for <dtype>" or "default"
    # the split backward's first kernel (the per-row sums) has a config of its own
    first_pass: dict | None = field(default=None, hash=False)
    # the realigned kernels' persistent grid: programs per SM (see realigned_programs)
    programs_per_sm: int | None = None
    # the exchanging forward's own config (``*_fwd_sync``: block sizes [rows a step, slice width]);
    # ``config`` is then the row kernel's, which runs where the exchange cannot
    sync: dict | None = field(default=None, hash=False)

    def helion_config(self) -> Config:
        return Config(**self.config)

    def entry(self) -> dict:
        """The configs.json form."""
        out = {"kernel": self.kernel, "config": self.config}
        if self.programs_per_sm is not None:
            out["programs_per_sm"] = self.programs_per_sm
        if self.sync is not None:
            out["sync"] = self.sync
        return out if self.first_pass is None else {**out, "first_pass": self.first_pass}

    @staticmethod
    def from_entry(hit: dict, source: str) -> "Pinned":
        return Pinned(
            hit["kernel"], hit["config"], source, hit.get("first_pass"), hit.get("programs_per_sm"), hit.get("sync")
        )


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def walks_rows(kernel: str) -> bool:
    """Whether a kernel's first two block sizes are rows per program and rows per step: the
    resident backwards (``*_bwd_resident``, and ``*_bwd_heads`` on (M, 1, N) rows)."""
    return kernel.endswith(("_bwd_resident", "_bwd_heads"))


def for_rows(choice: Pinned, m: int, sms: int) -> Pinned:
    """``choice`` for a matrix of m rows on a GPU of ``sms`` SMs: the resident backward's rows per
    program shrunk, when the tuned block leaves SMs without a program (see the module docstring)."""
    if not walks_rows(choice.kernel):
        return choice
    rows, step = choice.config["block_sizes"][:2]
    if -(-m // rows) >= sms:
        return choice
    fewer = max(step, _next_pow2(-(-m // sms)))
    if fewer >= rows:
        return choice
    config = {**choice.config, "block_sizes": [fewer, step, *choice.config["block_sizes"][2:]]}
    return replace(choice, config=config, source=f"{choice.source}, {fewer} rows per program for M={m}")


# The FP8 norms' one entry point (fp8.py): per token and per 1 x 128 block, with or without the
# fused add, they run its config at N, in the terms of the per-token kernel (the block kernel counts
# the same column loop in 128-column blocks). No tuner covers them: a GPU without entries for it in
# configs.json runs fp8_default_config, which is their design rather than a stopgap, so it is taken
# without the fallback's warning.
FP8_ENTRY = "rmsnorm_fp8_fwd"


def fp8_default_config(n: int) -> Pinned:
    """The FP8 norms' config from N: whole rows in registers up to 32768 columns with about 16
    elements per thread, several rows a program for short ones (the RMSNorm forward's fallback);
    wider rows one a program, walked in 8192-column chunks by 32 warps. The chunk is the RMSNorm
    forward fallback's; with 32 warps rather than its 16 that chunk took 5-23% less time in the
    RMSNorm forward's tuning runs on the H100 and H200 at N = 32768-262144 (the candidates' table in
    reports/experiments/helion-tuning/tune/), not measured on these kernels."""
    width = _next_pow2(n)
    if width <= 32768:
        rows = min(64, max(1, 4096 // width))
        warps = min(16, max(4, rows * width // 512))
        return Pinned("rmsnorm_fp8_row_kernel", {"block_sizes": [rows], "reduction_loops": [None], "num_warps": warps})
    return Pinned("rmsnorm_fp8_row_kernel", {"block_sizes": [1], "reduction_loops": [8192], "num_warps": 32})


# An entry point that runs another's kernels, read in the table where a GPU pins it and else
# replaced by that other (in the table, the defaults and ``force``): the fused add's forward, whose
# table entries may differ from RMSNorm's (see the module docstring).
FALLBACK_ENTRY = {"add_rmsnorm_fwd": "rmsnorm_fwd"}


def entry_of(op: str, direction: str) -> str:
    """The entry point an op's (M, N) rows read in the table: the fused add's forward its own
    (``FALLBACK_ENTRY``), its backward rmsnorm's."""
    if op == "add_rmsnorm":
        return "add_rmsnorm_fwd" if direction == "fwd" else "rmsnorm_bwd"
    return f"{op}_{direction}"


def default_config(entry: str, n: int) -> Pinned:
    """The documented fallback (see the module docstring), from the row length alone."""
    if entry == FP8_ENTRY:
        return fp8_default_config(n)
    entry = FALLBACK_ENTRY.get(entry, entry)
    op, direction = entry.split("_")
    width = _next_pow2(n)
    if direction == "fwd":
        if width <= 32768:
            rows = min(64, max(1, 4096 // width))
            warps = min(16, max(4, rows * width // 512))
            return Pinned(f"{op}_fwd_kernel", {"block_sizes": [rows], "reduction_loops": [None], "num_warps": warps})
        return Pinned(f"{op}_fwd_kernel", {"block_sizes": [1], "reduction_loops": [8192], "num_warps": 16})
    if width <= 16384:
        rows_per_step = min(64, max(1, 2048 // width))
        warps = min(16, max(4, rows_per_step * width // 512))
        return Pinned(f"{op}_bwd_resident", {"block_sizes": [64, rows_per_step], "num_warps": warps})
    return Pinned(
        f"{op}_bwd_split",
        {"block_sizes": [128, 1024, 4], "num_warps": 8},
        first_pass={"block_sizes": [1], "reduction_loops": [8192], "num_warps": 32},
    )


def sync_config(config: dict) -> dict:
    """The exchanging backward's config (block sizes [rows per step, slice width]) for an entry's
    split config ([rows per program, columns, rows per step]): the split kernel's column tile as
    the slice, its step as the step, on the same warps."""
    _, columns, step = config["block_sizes"]
    return {"block_sizes": [step, columns], **{k: v for k, v in config.items() if k in ("num_warps", "num_stages")}}


def fwd_sync_config(choice: Pinned) -> dict:
    """The exchanging forward's config (block sizes [rows a step, slice width]) of an entry naming
    it: its ``sync`` field, which such an entry must have."""
    if choice.sync is None:
        raise ValueError(f"helion: an entry naming {choice.kernel} needs a 'sync' config (block sizes [rows a step, slice width])")
    return choice.sync


# ---------------------------------------------------------------- the pinned table
_TABLE: dict | None = None
_WARNED: set = set()


def table() -> dict:
    """configs.json's ``gpus`` mapping (loaded once; ``reload()`` after tuning)."""
    global _TABLE
    if _TABLE is None:
        _TABLE = json.loads(CONFIG_FILE.read_text())["gpus"] if CONFIG_FILE.exists() else {}
    return _TABLE


def reload() -> None:
    global _TABLE, _REALIGNED
    _TABLE = _REALIGNED = None
    _CHOICE.clear()
    _CHOICE_ODD.clear()
    _FEW_ROWS.clear()


# Rows whose length is not a multiple of this do not take the small-row ``*_heads`` entries: their
# backward fails to trace in Helion 1.4 at N = 7 on the GPU (a (T, 1, 7) block against the symbolic
# row length), so they keep the entries of the next tuned N that runs a row kernel, as before.
HEADS_MIN_MULTIPLE = 8


def bucket(n: int, tuned: list[int]) -> int | None:
    """The tuned N whose config a row of length n uses: the smallest >= n (None if none is)."""
    above = [t for t in tuned if t >= n]
    return min(above) if above else None


def pinned(entry: str, n: int, dtype: str, gpu: str, capability=None) -> Pinned:
    """The config ``entry`` (e.g. "rmsnorm_bwd") runs with for rows of length n on ``gpu``: from the
    table ``harness.spec.tuned`` picks (this GPU's, else one of a GPU of the same compute capability),
    else the default. An entry of ``FALLBACK_ENTRY`` takes its own bucket in x's dtype or the one of
    the same size, else its fallback's config: its entries were measured on 16-bit rows only, so
    fp32 does not borrow them."""
    if entry in FALLBACK_ENTRY:
        own = _from_table(entry, n, dtype, gpu, capability, any_dtype=False)
        return own or pinned(FALLBACK_ENTRY[entry], n, dtype, gpu, capability)
    hit = _from_table(entry, n, dtype, gpu, capability, any_dtype=True)
    if hit is not None:
        return hit
    fallback = default_config(entry, n)
    if entry == FP8_ENTRY:
        return fallback
    _warn_once(
        (entry, gpu, dtype, n),
        f"helion {entry}: no tuned config for {gpu} ({dtype}, N={n}) in {CONFIG_FILE.name}; "
        f"using the default config {fallback.config} (run `normbench tune --impl helion` on this GPU)",
    )
    return fallback


def _from_table(entry: str, n: int, dtype: str, gpu: str, capability, any_dtype: bool) -> Pinned | None:
    """``pinned``'s table entry for ``entry`` at n's bucket: in x's dtype or the same-size one, then
    (``any_dtype``) in any tuned dtype at the bucket of rows of the same bytes, with a warning; None
    where there is none."""
    table_gpu, how = table_for(gpu, table(), capability)
    by_dtype = table().get(table_gpu, {}).get(entry, {}) if table_gpu else {}
    borrowed = "" if how == "tuned" else f", {how}"
    for candidate in (dtype, SAME_SIZE.get(dtype), *(sorted(by_dtype) if any_dtype else ())):
        same_bytes_n = max(1, n * ITEMSIZE[dtype] // ITEMSIZE.get(candidate, ITEMSIZE[dtype]))
        keys = by_dtype.get(candidate or "", {})
        if n % HEADS_MIN_MULTIPLE:
            keys = {k: v for k, v in keys.items() if not v["kernel"].endswith("_heads")}
        b = bucket(same_bytes_n, [int(k) for k in keys])
        if b is not None:
            hit = by_dtype[candidate][str(b)]
            if candidate in (dtype, SAME_SIZE.get(dtype)):
                return Pinned.from_entry(hit, "tuned" + borrowed)
            _warn_once(
                (entry, gpu, dtype, b),
                f"helion {entry}: no {dtype} config tuned for {table_gpu} at N={n}; using the {candidate} one of rows of the same bytes (N bucket {b})",
            )
            return Pinned.from_entry(hit, f"tuned for {candidate}{borrowed}")
    return None


def _warn_once(key, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, stacklevel=4)


# ---------------------------------------------------------------- realigned rows
# Row lengths (lo, hi] that take the realigned kernels when they fill no whole 16-byte vectors: the
# whole-row buckets above 1024 (the Triton kernels' realigned tables cover the same), where a row is
# long enough for its body to be most of it and short enough to stay in registers.
REALIGNED_N = (1024, 8192)
_REALIGNED: dict | None = None


def is_odd(n: int, dtype: torch.dtype) -> bool:
    """16-bit rows of ``n`` elements that fill no whole 16-byte vectors, of a length the realigned
    kernels take. fp32 rows are not: their element-wise accesses already move 4 bytes each."""
    return dtype.itemsize == 2 and n % 8 != 0 and REALIGNED_N[0] < n <= REALIGNED_N[1]


def realigned_default(op: str, direction: str, n: int) -> Pinned:
    """The realigned kernels' config from N: rows of up to 4096 on 4 warps with two programs per
    SM, two rows to a forward step, one to a backward step (its accumulators take the registers a
    second row would); longer rows one a step on 8 warps, one program per SM. First the Triton
    realigned kernels' H100 pins; at N = 4001 the backward's 8 warps measured 47-61% of copy
    bandwidth where 4 gave 67-84% (reports/experiments/helion-odd-rows/)."""
    family = "rmsnorm" if op == "add_rmsnorm" else op
    short = _next_pow2(n) <= 4096
    rows = 2 if direction == "fwd" and short else 1
    warps = 4 if short else 8
    return Pinned(f"{family}_{direction}_odd", {"block_sizes": [rows], "num_warps": warps}, programs_per_sm=2 if short else 1)


def realigned_table() -> dict:
    """configs.json's ``realigned`` mapping: GPU -> "<op>_<direction>" (add_rmsnorm has its own)
    -> N bucket -> ``{"kernel", "config", "programs_per_sm"}``, for 16-bit rows (bf16 and fp16 move
    the same bytes)."""
    global _REALIGNED
    if _REALIGNED is None:
        _REALIGNED = json.loads(CONFIG_FILE.read_text()).get("realigned", {}) if CONFIG_FILE.exists() else {}
    return _REALIGNED


def realigned_pinned(op: str, direction: str, n: int, gpu: str, capability=None) -> Pinned:
    """The realigned kernels' config for rows of n: this GPU's (or one of the same compute
    capability's) entry for the op at N's bucket, add_rmsnorm falling back to rmsnorm's, else
    ``realigned_default`` (no warning: the default is measured on Triton's twin kernels)."""
    try:
        table_gpu, how = table_for(gpu, realigned_table(), capability)
    except ValueError:  # a GPU named by the environment with no realigned entries: the default
        table_gpu, how = None, "heuristic"
    entries = realigned_table().get(table_gpu, {}) if table_gpu else {}
    for key in (f"{op}_{direction}", f"rmsnorm_{direction}" if op == "add_rmsnorm" else None):
        by_n = entries.get(key or "", {})
        b = bucket(n, [int(k) for k in by_n])
        if b is not None:
            return Pinned.from_entry(by_n[str(b)], "tuned" if how == "tuned" else f"tuned, {how}")
    return realigned_default(op, direction, n)


_CHOICE_ODD: dict[tuple, Pinned] = {}


def choose_realigned(op: str, direction: str, x: torch.Tensor) -> Pinned:
    """``realigned_pinned`` for inputs like x, cached per device; on the CPU the default (eager
    mode: block sizes play no part)."""
    key = (op, direction, x.shape[-1], x.device)
    choice = _CHOICE_ODD.get(key)
    if choice is None:
        if x.device.type != "cuda":
            choice = realigned_default(op, direction, x.shape[-1])
        else:
            gpu = torch.cuda.get_device_name(x.device)
            choice = realigned_pinned(op, direction, x.shape[-1], gpu, capability_of(x.device))
        _CHOICE_ODD[key] = choice
    return choice


def realigned_programs(choice: Pinned, m: int, vec: int, device) -> int:
    """The realigned kernels' persistent grid: a multiple of ``vec``, so that all of a program's
    rows start at one offset within a vector; ``programs_per_sm`` per SM rounded down (rounded up,
    the programs past what the SMs hold run as a second wave), no more than the row tiles need,
    at least one vector's worth. The CPU counts as one SM."""
    rows = choice.config["block_sizes"][0]
    sms = sm_count(device)
    programs = min((choice.programs_per_sm or 1) * sms // vec, -(-(-(-m // rows)) // vec))
    return max(programs, 1) * vec


def sm_count(device) -> int:
    """SMs of ``device``, cached (one for the CPU)."""
    if device.type != "cuda":
        return 1
    if device not in _SMS:
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[device]


# ---------------------------------------------------------------- launching
# What to run, per (entry point, dtype, N, device); and per (kernel, config, argument metadata) the
# callable that runs it: the compiled function, or the eager twin on the CPU. The latter is keyed on
# exact shapes and strides, at least as fine as Helion's own specialization, so a hit never needs
# Helion's (slower) bind().
_CHOICE: dict[tuple, Pinned] = {}
FEW_ROWS_RULE = True
_FEW_ROWS: dict[tuple, Pinned] = {}
_SMS: dict[torch.device, int] = {}
_COMPILED: dict[tuple, object] = {}
_EAGER: dict[str, Kernel] = {}


# the row tensors a direction of an op stages, over its entry point's (see choose)
FUSED_ADD_ROWS = {"fwd": 1.0, "bwd": 1.5}
# Up to this N the fused add's backward runs RMSNorm's own config at N (see fused_pinned)
FUSED_OWN_CONFIG_MAX_N = 4096


def fused_pinned(entry: str, n: int, dtype: str, gpu: str, capability, rows: float) -> Pinned:
    """The config of a kernel staging ``rows`` times the row tensors ``entry`` was tuned with: the
    fused add's backward stages dresidual_out beside dy and residual_out (1.5). Where RMSNorm's
    config at N keeps whole rows resident and N > FUSED_OWN_CONFIG_MAX_N, it takes the config of
    rows 1.5x as long instead (as fp32 takes that of rows twice as long). There the longer rows'
    config won or held even, and at the widest resident N RMSNorm's own config asks more shared
    memory than a CTA may have; on short rows and on the column-split kernel it lost, so those keep
    RMSNorm's own config."""
    own = pinned(entry, n, dtype, gpu, capability)
    if rows == 1.0 or n <= FUSED_OWN_CONFIG_MAX_N or not own.kernel.endswith("_bwd_resident"):
        return own
    return pinned(entry, max(1, int(n * rows)), dtype, gpu, capability)


# entry point -> the choice every call of it runs (``force``)
FORCED: dict[str, Pinned] = {}


def force(entry: str, choice: Pinned | None) -> Pinned | None:
    """Every call of ``entry`` (e.g. "rmsnorm_bwd", which add_rmsnorm's backward runs too) runs
    ``choice`` from now on, whatever the N, GPU or dtype; None lifts it. Returns the previous one.
    Forcing "rmsnorm_fwd" forces the fused add's (M, N) forward too, unless "add_rmsnorm_fwd" is
    forced itself (``choose``)."""
    old = FORCED.pop(entry, None)
    if choice is not None:
        FORCED[entry] = choice
    return old


def choose(entry: str, x: torch.Tensor, rows: float = 1.0) -> Pinned:
    """The pinned choice for ``entry`` on inputs like ``x`` ((M, N), or (T, H, N): M = T * H rows).
    ``rows``: the row tensors the kernel stages per row, over what the entry was tuned with: the
    fused add's backward stages dresidual_out beside dy and residual_out (1.5), so it may take the
    config of rows 1.5x as long, as fp32 takes that of rows twice as long, where that is measured to
    pay (``fused_pinned``). A forced choice (``force``) comes back as it is: the entry's own, else
    its fallback's (``FALLBACK_ENTRY``), ahead of either's table entry, so that an experiment forcing
    rmsnorm's forward times the fused add's with it as before the add had entries of its own."""
    if FORCED:
        for forced in (entry, FALLBACK_ENTRY.get(entry)):
            if forced in FORCED:
                return FORCED[forced]
    n = x.shape[-1]
    key = (entry, x.dtype, n, x.device, rows)
    choice = _CHOICE.get(key)
    if choice is None:
        if x.device.type != "cuda":
            # Eager reference mode runs kernel bodies as PyTorch ops on whole tensors: block sizes
            # play no part; take the variant the default would.
            choice = _CHOICE[key] = default_config(entry, n)
        else:
            gpu = torch.cuda.get_device_name(x.device)
            choice = _CHOICE[key] = fused_pinned(entry, n, DTYPE_NAMES[x.dtype], gpu, capability_of(x.device), rows)
    if x.device.type != "cuda" or not FEW_ROWS_RULE or not walks_rows(choice.kernel):
        return choice
    m = x.shape[0] if x.dim() == 2 else x.numel() // max(n, 1)
    few_key = (*key, m)
    if few_key not in _FEW_ROWS:
        _FEW_ROWS[few_key] = for_rows(choice, m, sm_count(x.device))
    return _FEW_ROWS[few_key]


def heads_config(choice: Pinned, h: int) -> dict:
    """``choice``'s config (for rows of N) for the kernels over (T, H, N) rows (``*_heads``), whose
    block sizes count tokens and heads: the same rows per program and per step, as many of them
    heads (up to H, a power of two) as fit; the loops' settings of the resident backward's two row
    loops kept, the heads loop's left at Helion's default. A ``*_heads`` config of H = 1 (the small
    rows' own, (M, 1, N)) comes back as it is."""
    config = dict(choice.config)
    heads = _next_pow2(h)
    blocks = config["block_sizes"]
    if choice.kernel.endswith("_heads") and blocks[2:] == [1] and h == 1:
        return config
    if "_fwd" in choice.kernel:
        per_tile = min(heads, blocks[0])
        config["block_sizes"] = [max(1, blocks[0] // per_tile), per_tile]
        return config
    rows, step = blocks[0], blocks[1]
    per_step = min(heads, step)
    tokens_per_step = max(1, step // per_step)
    config["block_sizes"] = [max(tokens_per_step, rows // heads), tokens_per_step, per_step]
    for key, value in config.items():
        if key.startswith("range_") and isinstance(value, list):
            config[key] = [*value[:2], *([0] * (3 - len(value[:2])))]
    return config


def source(op: str, direction: str, n: int, dtype: str, device) -> str:
    """Where the config of one launch comes from (the benchmark records it per point)."""
    if getattr(device, "type", device) != "cuda":
        return "interpreter"
    if op in FP8_OPS:  # every FP8 record runs the one FP8 entry's config (fp8.py)
        return pinned(FP8_ENTRY, n, dtype, torch.cuda.get_device_name(device), capability_of(device)).source
    if dtype in SAME_SIZE and is_odd(n, torch.bfloat16):  # (M, N) rows take the realigned kernels
        gpu = torch.cuda.get_device_name(device)
        return "realigned, " + realigned_pinned(op, direction, n, gpu, capability_of(device)).source
    entry = entry_of(op, direction)
    rows = FUSED_ADD_ROWS[direction] if op == "add_rmsnorm" else 1.0  # the benchmark's backward has a dresidual_out
    return fused_pinned(entry, n, dtype, torch.cuda.get_device_name(device), capability_of(device), rows).source


def _arg_key(a):
    if isinstance(a, torch.Tensor):
        return (a.dtype, tuple(a.shape), a.stride(), a.device)
    return a if a is None else type(a)


# id of a config dict -> (the dict, its JSON): a launch keys its compiled function by the config's
# content without serialising it on every call. The entry holds the dict, so its id stays its own.
_CONFIG_TEXT: dict[int, tuple[dict, str]] = {}


def _config_text(config: dict) -> str:
    hit = _CONFIG_TEXT.get(id(config))
    if hit is None or hit[0] is not config:
        if len(_CONFIG_TEXT) >= 1024:  # configs made per call (heads_config) would pile up
            _CONFIG_TEXT.clear()
        hit = _CONFIG_TEXT[id(config)] = (config, json.dumps(config, sort_keys=True))
    return hit[1]


def launch(kernel: Kernel, config: dict, *args):
    """Run ``kernel`` on ``args`` with ``config`` pinned (compiled on first use, never tuned)."""
    key = (kernel.name, _config_text(config), *map(_arg_key, args))
    run = _COMPILED.get(key)
    if run is None:
        if args[0].device.type != "cuda":
            if kernel.name not in _EAGER:
                _EAGER[kernel.name] = helion_kernel(kernel.fn, static_shapes=False, ref_mode=RefMode.EAGER)
            run = _EAGER[kernel.name]
        else:
            # The compiled function for exactly this config: a BoundKernel is shared by every
            # config of its specialization, so pinning it (set_config) would not stay put.
            bound = kernel.bind(args)
            run = _fast(bound.compile_config(fit(config, bound)))
        _COMPILED[key] = run
    return run(*args)


def _fast(compiled):
    """The compiled host function launching through ``harness.spec.jit_launch`` (a repeated launch
    goes straight to the Triton kernel compiled for the first) instead of Helion's default
    launcher, which binds every argument again on each call; as it is where the function takes no
    ``_launcher`` (a Helion that has none)."""
    import inspect

    if "_launcher" not in inspect.signature(compiled).parameters:
        return compiled
    return functools.partial(compiled, _launcher=_launcher)


def _launcher(triton_kernel, grid, *args, num_warps: int, num_stages: int, **extra):
    if extra:  # Helion's own launch options (cooperative grids, persistent state...): its launcher
        from helion.runtime import default_launcher

        return default_launcher(triton_kernel, grid, *args, num_warps=num_warps, num_stages=num_stages, **extra)
    return launch_jit(triton_kernel, grid, args, num_warps, num_stages)


def fit(config: dict, bound) -> Config:
    """``config`` (tuned for an N bucket) fitted to the bound kernel's own N: a row short enough to
    need no reduction loop (N = 1) has no ``reduction_loops`` entry to set, for instance."""
    spec = dict(bound.config_spec.default_config())
    fitted = {}
    for key, value in config.items():
        if isinstance(value, list):
            if not isinstance(spec.get(key), list):
                continue
            value = value[: len(spec[key])]
        fitted[key] = value
    return Config(**fitted)


def use(entry: str, n: int, dtype: str, gpu: str, choice: Pinned) -> None:
    """Pin ``choice`` for (entry, N bucket n, dtype, gpu) in this process only (the tuner's hook:
    it times candidates through the same ``choose()`` and ``launch()`` the contract functions use)."""
    table().setdefault(gpu, {}).setdefault(entry, {}).setdefault(dtype, {})[str(n)] = choice.entry()
    _CHOICE.clear()
    _FEW_ROWS.clear()
