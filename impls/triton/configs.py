"""Launch configurations for ``kernels``: pinned per GPU and N bucket, searched only on request.

A ``Config`` says how a kernel walks the (M, N) input:

* ``rows``: rows per tile, processed together (several short rows per program keep enough bytes in
  flight; the row reductions stay per row).
* ``warps``: ``num_warps``.
* ``chunk``: forward: 0 keeps a whole row (padded to the N bucket, the next power of two) in
  registers; otherwise rows are walked in column chunks of this many elements, twice (see
  ``kernels``). Backward, sliced: the width of the tiles in which a program streams the
  other slices of its rows (without ``row_sums``).
* ``programs_per_sm``: the size of the persistent grid: the backward's always, the chunked
  forward's with ``persistent``.
* ``persistent``: chunked forward only: a grid of ``programs_per_sm`` programs per SM, each walking
  several row blocks, instead of one program per row block (a little faster on the widest rows).
* ``reread``: backward, whole-row kernel only: read each row a second time (from L1/L2) for dx
  instead of holding x and dy in registers across the row reductions, leaving the registers to the
  dw/db accumulators (for rows too wide to keep both).
* ``slice``: backward: 0 gives each program whole rows; otherwise each program owns a column
  slice this wide of a group of rows (rows too wide for one program's dw/db accumulators).
  Forward: only with ``sync`` (the exchanging slices below); without it the forward ignores it.
* ``row_sums``: sliced backward: the row reductions come from a first kernel over every (row,
  slice) instead of each program streaming the rest of its rows.
* ``sync``: sliced backward: the programs that share a row block post their slices' row sums to
  each other through global memory and wait for the rest (one program per SM, so that they are all
  resident), instead of ``row_sums``' first kernel: x and dy are read once. On the interpreter,
  whose programs run one after another, it falls back to ``row_sums``. Forward, with ``slice``:
  each program reads its slice of a row block once, posts the slice's partial statistics to its
  siblings and waits for theirs (``kernels._norm_fwd_sync_kernel``), instead of the chunked
  forward's two walks of each row; where every sibling cannot be resident (a row's slices
  outnumber the SMs, or rows x slices padded to a power of two pass 32) and on the interpreter,
  the chunked forward runs, in chunks of ``chunk`` or else of the slice's width. No table pins it
  yet: an entry such as ``{"rows": 1, "warps": 8, "slice": 8192, "sync": true}`` would.
* ``ahead``: sliced backward and exchanging forward: how many row blocks a program's loads run
  ahead of its math (1 or 2; two keep a second block in flight while a ``sync`` program waits for
  its siblings).
* ``prefetch``: backward, whole-row kernel only: load the next row block while computing this one
  (software pipelining by hand; the default). Off, its registers go to a wider row instead.
* ``acc_rows``: backward, whole-row kernel only: dw/db accumulated per tile row ([rows, N]) and
  summed over the rows once at the end, instead of summed over each row block (a cross-warp
  reduction per block, which short rows, many to a tile, pay on every block).
* ``realign``: whole-row kernels, rows whose length is no multiple of a 16-byte vector (N = 4001):
  the realigned kernels read and write each row's body in whole vectors from its first aligned
  element, its head and tail element-wise, on a persistent grid of ``programs_per_sm`` per SM
  (rounded down to a multiple of the vector) whose programs each take rows of one offset within a
  vector. Off, such rows take the row kernels element-wise. Pinned in a table of its own per op
  and direction (``<op>_<direction>_odd``, by bucket, for 16-bit rows: ``is_odd``), which such rows
  read first; searched by tools/experiments/triton-odd-rows/explore.py (``normbench tune`` leaves
  these tables alone).
* ``exact_n``: whole-row kernels only: compile for the exact row length (one compile per N instead
  of per bucket), so the vector slots of the padded tile that lie wholly past N vanish at compile
  time rather than being masked at run time. It is no general win: it helped the LayerNorm forward
  at N = 2880 but made some backwards spill and some wide forwards much slower, so it is pinned
  only where it was measured to win.

Where a config comes from, in order:

1. ``NORMBENCH_TRITON_AUTOTUNE=1``: each candidate of ``candidates()`` is timed on the caller's own
   tensors (``triton.testing.do_bench``, median) the first time a (GPU, op, direction, bucket, dtype)
   is seen in this process; the winner is cached for the rest of the process.
2. ``configs.json``: the winners measured per GPU (bf16, the sweep shapes), by the name
   ``torch.cuda.get_device_name`` reports; a GPU without a table of its own reads that of a tuned
   GPU of the same compute capability (``harness.spec.tuned``: an H800 reads the H100's). ``normbench
   tune --impl triton`` (``tune``) writes a GPU's table.
3. ``heuristic()``: for a GPU of an architecture with no table (and ``interpreter_config()`` for
   the CPU interpreter).

The bucket is ``next_pow2(N)``: it is the register tile width, so every N in a bucket compiles to
the same kernel. A table may also hold an exact N (a sweep point whose own best beat its bucket's
config by more than the noise); it takes precedence over the bucket. The tables are keyed by N
alone, not dtype: the register footprint is fp32 whatever the input dtype (the autotune cache
is keyed by x's dtype, the bytes of a row, whatever the weight's). The fused add + RMSNorm borrows
RMSNorm's tables and heuristic, adapted (``BORROWS``), on a GPU whose table has no add_rmsnorm
entries of its own. The tables were measured with weights of x's dtype; ``for_weight`` adapts a
backward config to an fp32 weight beside 16-bit rows (see there).

Measurements behind these choices: docs/kernels/triton.md.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, replace

import torch

from harness.spec.tuned import ENV as TUNED_ENV
from harness.spec.tuned import capability_of, table_for

CONFIG_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs.json")
AUTOTUNE_ENV = "NORMBENCH_TRITON_AUTOTUNE"
MIN_BLOCK = 16  # the narrowest tile: keeps layouts ordinary for N = 1
INTERPRETER_SMS = 4  # "SMs" of the CPU interpreter: any small number; programs run one after another

# Widest N bucket whose row lives whole in registers, for the heuristic (64K 32-bit registers per
# SM: a 32768-wide fp32 row is half of them; the backward holds x, dy and the dw/db accumulators).
FWD_TILE_MAX = 32768
BWD_TILE_MAX = 8192
# Widest bucket searched with many rows to a tile (QK-norm's head_dim and small hidden sizes).
SMALL_ROWS = 512


LATE_DEFAULTS = {"prefetch": True, "acc_rows": False, "sync": False, "ahead": 1, "realign": False}


@dataclass(frozen=True)
class Config:
    rows: int = 1
    warps: int = 4
    chunk: int = 0
    programs_per_sm: int = 1
    reread: bool = False
    slice: int = 0
    row_sums: bool = False
    persistent: bool = False
    exact_n: bool = False
    prefetch: bool = True
    acc_rows: bool = False
    sync: bool = False
    ahead: int = 1
    realign: bool = False

    def __post_init__(self):
        # the sliced kernel keeps one or two blocks of loads in flight; another count would compute
        # one block with another's rows
        if self.ahead not in (1, 2):
            raise ValueError(f"Config.ahead must be 1 or 2, got {self.ahead!r}")

    def to_json(self) -> dict:
        """The fields that differ from the defaults of the fields added last (``LATE_DEFAULTS``), so
        that the tables written before them read the same."""
        out = asdict(self)
        for name, default in LATE_DEFAULTS.items():
            if out[name] == default:
                del out[name]
        return out


def bucket(n: int) -> int:
    return max(MIN_BLOCK, 1 << (max(n, 1) - 1).bit_length())


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


_SMS: dict = {}  # device -> its SM count (asked once: a launch needs it every time)


def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return INTERPRETER_SMS
    if device not in _SMS:
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[device]


def _clamp(v: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, v))


def interpreter_config(direction: str, n: int) -> Config:
    """The CPU interpreter pays per operation, not per element: few programs, big tiles."""
    rows = _clamp(32768 // bucket(n), 1, 64)
    if bucket(n) <= 32768:  # (realigned where a row does not fill whole vectors: that path checked too)
        return Config(rows=rows, realign=True)
    return Config(rows=1, chunk=8192) if direction == "fwd" else Config(rows=1, slice=8192, row_sums=True)


def heuristic(direction: str, n: int) -> Config:
    """A config for a GPU without pinned data, shaped after the H200 winners: ~8-32 fp32 elements
    per thread per tile; small rows several to a tile and, in the backward, several programs per SM
    (each keeps a block in flight while it computes); rows past the register budget chunked."""
    b = bucket(n)
    if direction == "fwd":
        if b <= FWD_TILE_MAX:
            rows = _clamp(2048 // b, 1, 16)
            return Config(rows=rows, warps=_clamp(rows * b // 512, 4, 16))
        return Config(rows=1, warps=16, chunk=8192)
    if b <= BWD_TILE_MAX:
        rows = _clamp(2048 // b, 2, 16) if b <= 2048 else 1
        programs = 4 if b <= 1024 else 2 if b <= 4096 else 1
        return Config(rows=rows, warps=_clamp(rows * b // 512, 4, 16), programs_per_sm=programs)
    return Config(rows=1, warps=8, programs_per_sm=2, slice=4096, row_sums=True)


def candidates(direction: str, n: int) -> list[Config]:
    """The search space of the autotune mode, kept small (a few dozen configs at most)."""
    b = bucket(n)
    out = []
    if direction == "fwd":
        if b <= 32768:
            for rows in (1, 2, 4, 8):
                for warps in (4, 8, 16, 32):
                    per_thread = rows * b // (32 * warps)
                    if rows * b <= max(b, 16384) and 8 <= per_thread <= 64:
                        out.append(Config(rows=rows, warps=warps))
            if b <= SMALL_ROWS:  # many short rows to a tile (2048-16384 elements)
                out += [Config(rows=t // b, warps=w) for t in (2048, 4096, 8192, 16384) for w in (4, 8, 16)
                        if t // b > 8 and 8 <= t // (32 * w) <= 64]  # fmt: skip
            if n != b:  # each also compiled for the exact N (the LayerNorm forward's winner on some N)
                out += [replace(c, exact_n=True) for c in out]
        if b >= 16384:
            for c in (8192, 16384, 32768):
                for w in (8, 16, 32):
                    if c < b and 8 <= c // (32 * w) <= 64:
                        out += [
                            Config(rows=1, warps=w, chunk=c),
                            Config(rows=1, warps=w, chunk=c, persistent=True, programs_per_sm=2),
                        ]
        return out or [heuristic(direction, n)]
    if b <= 8192:
        for rows in (1, 2, 4):
            for warps in (4, 8, 16):
                per_thread = rows * b // (32 * warps)
                if rows * b <= max(b, 8192) and 4 <= per_thread <= 32:
                    # more programs per SM only while they can all be resident (persistent grid)
                    out += [Config(rows=rows, warps=warps, programs_per_sm=p) for p in (1, 2, 4) if p * warps <= 16]
    if b <= SMALL_ROWS:  # tiles of 2048-8192 elements, dw / db summed over the rows once (the winners)
        out += [Config(rows=t // b, warps=w, programs_per_sm=p, acc_rows=True) for t in (2048, 4096, 8192)
                for w in (4, 8) for p in (2, 4) if 4 <= t // (32 * w) <= 32]  # fmt: skip
    if 4096 <= b <= 16384:
        out += [Config(rows=r, warps=w, reread=True) for r, w in ((1, 16), (2, 16), (1, 32))]
    if 8192 <= b <= 16384:  # a whole row per program, its registers not shared with a prefetched one
        out += [Config(rows=1, warps=w, prefetch=False) for w in (16, 32)]
    if b >= 16384:
        out += [Config(rows=1, warps=16, slice=8192, row_sums=True), Config(rows=1, warps=8, programs_per_sm=2, slice=4096, row_sums=True)]
    if b == 16384:
        out += [Config(rows=1, warps=16, slice=8192, chunk=c) for c in (4096, 8192)]
    return out or [heuristic(direction, n)]


# The exchanging sliced forward's candidates (``sync`` with ``slice``), timed against the pinned
# forward by tools/experiments/triton-wide-fwd/fwd.py: 8192-column slices (32 slices, the most one
# warp's slots hold, at N = 262144) on 8 warps with one or two blocks loaded ahead, and on 16 warps
# with two; two rows a block on 8 and 16 warps (twice the bytes per exchange; at most 16 slices);
# 16384-column slices on 16 warps (RMSNorm's build does not spill; LayerNorm's and the fused add's
# do). Not in ``candidates()`` (``normbench tune`` does not search them); the H100 table pins the
# exchange where it measured faster (docs/kernels/triton.md).
FWD_EXCHANGE = (
    Config(rows=1, warps=8, slice=8192, sync=True),
    Config(rows=1, warps=8, slice=8192, sync=True, ahead=2),
    Config(rows=1, warps=16, slice=8192, sync=True, ahead=2),
    Config(rows=2, warps=8, slice=8192, sync=True),
    Config(rows=2, warps=16, slice=8192, sync=True),
    Config(rows=1, warps=16, slice=16384, sync=True),
)


# ------------------------------------------------------------------------------ pinned tables
_PINNED: dict | None = None



def _fused_add_config(cfg: Config, direction: str, n: int) -> Config:
    """RMSNorm's config as the fused add + RMSNorm runs it. The same tile keeps twice the bytes in
    flight (x and residual in, y and residual_out out; dy, residual_out and dresidual_out in, dh
    out), and the fp32 math is RMSNorm's, so the whole-row tiles and the backward carry over: built
    for sm_90a without a GPU (``sm90a_build``; its output for a pinned table is in
    ``sm90a_resources.txt``), the fused kernels take about RMSNorm's registers (whole-row forward
    up to N = 32768: no stack; backward: the programs per SM the config launches all fit, the
    re-read kernels with a little more stack than RMSNorm's). The chunked forward's chunk is
    halved, so that a chunk of x and residual holds what RMSNorm's chunk of x does: the full chunk
    spilled to the stack, the halved one did not.

    The forward and the backward up to N = 8192 run well on RMSNorm's configs, but RMSNorm's
    whole-row re-read backward above that collapses with the fused backward's third row tensor,
    dresidual_out, on top of a kernel sized for two, where the column-sliced backward of the
    heuristic does not: above BWD_TILE_MAX the fused backward takes the sliced heuristic instead."""
    if direction == "fwd" and cfg.chunk:
        return replace(cfg, chunk=max(MIN_BLOCK, cfg.chunk // 2))
    if direction == "bwd" and cfg.reread and bucket(n) > BWD_TILE_MAX:
        return heuristic("bwd", n)
    return cfg


# Ops measured on no GPU yet: the op whose table (and heuristic) they use meanwhile, and how its
# configs are adapted.
BORROWS = {"add_rmsnorm": ("rmsnorm", _fused_add_config)}


def pinned_table() -> dict:
    """{gpu name: {"rmsnorm_fwd": {bucket (str): config dict}, ...}} from ``configs.json``."""
    global _PINNED
    if _PINNED is None:
        with open(CONFIG_FILE) as f:
            _PINNED = {k: v for k, v in json.load(f).items() if not k.startswith("_")}
    return _PINNED


def is_odd(n: int, dtype) -> bool:
    """16-bit rows of ``n`` elements that do not fill whole 16-byte vectors: the rows the realigned
    kernels' tables are for. fp32 rows are not: their element-wise accesses move 4 bytes each, and
    realigned on the bf16 tables they lost as often as they won (H100, N = 2047-7001:
    reports/experiments/triton-odd-rows/)."""
    return dtype is not None and dtype.itemsize == 2 and n % 8 != 0


def pinned(gpu: str, op: str, direction: str, n: int, odd: bool = False) -> Config | None:
    """An entry for exactly N (a sweep point that beat its bucket's config), else for N's bucket;
    for ``odd`` rows (``is_odd``), the bucket's entry in the realigned kernels' table first. An op
    without a table of its own on this GPU uses the one it borrows (``BORROWS``)."""
    tables = pinned_table().get(gpu, {})
    if f"{op}_{direction}" not in tables and op in BORROWS:
        source, adapt = BORROWS[op]
        cfg = pinned(gpu, source, direction, n, odd)
        return adapt(cfg, direction, n) if cfg else None
    entry = tables.get(f"{op}_{direction}_odd", {}).get(str(bucket(n))) if odd else None
    table = tables.get(f"{op}_{direction}", {})
    entry = entry or table.get(str(n)) or table.get(str(bucket(n)))
    return Config(**entry) if entry else None


def for_weight(cfg: Config, direction: str, weight_dtype, x_dtype) -> Config:
    """A config measured with weights of x's dtype, as an fp32 weight beside 16-bit rows runs it.

    Built for sm_90a (``sm90a_build --weight-dtype fp32``, ``sm90a_resources.txt``), the two-row
    re-read backward (N = 5120-8192) spills with an fp32 weight where its bf16 twin barely does,
    and ran several times slower there. One row per tile builds with no spill: the re-read
    backward takes one row per tile with an fp32 weight.
    Loading the weight as volatile (no hoisting out of the row loop) changed nothing: the spill is
    the fp32 weight tile itself, twice as wide as bf16's. The forward builds spill-free up to
    N = 16384 with either weight and is left alone."""
    if direction == "bwd" and cfg.reread and cfg.rows > 1 and weight_dtype == torch.float32 and x_dtype != torch.float32:
        return replace(cfg, rows=1)
    return cfg


# ------------------------------------------------------------------------------ choosing
_SEARCHED: dict = {}


def search(launch, configs: list[Config]) -> tuple[Config, dict]:
    """Time ``launch(config)`` for each config (median ms); the fastest and every timing."""
    import triton.testing

    times = {}
    for cfg in configs:
        try:
            times[cfg] = triton.testing.do_bench(lambda: launch(cfg), warmup=10, rep=40, return_mode="median")
        except Exception as e:  # a config the compiler rejects (out of resources) is just not a candidate
            times[cfg] = float("inf")
            print(f"configs: {cfg} failed: {type(e).__name__}: {str(e)[:200]}")
    return min(times, key=times.get), times


# (op, direction, N, device, NORMBENCH_CONFIGS) -> (the pinned table read, the config): the look-up
# (the GPU's name and capability, the table's entry, a Config built from it) would otherwise cost
# host time on every launch. A table re-read or replaced since (``_PINNED``) is looked up again.
_CHOSEN: dict = {}


def choose(op: str, direction: str, n: int, device: torch.device, launch=None, dtype=None) -> Config:
    """The config to launch with (see the module docstring for the order)."""
    if device.type == "cuda" and (launch is None or os.environ.get(AUTOTUNE_ENV, "0") != "1"):
        odd = is_odd(n, dtype)
        key = (op, direction, n, device, os.environ.get(TUNED_ENV), odd)
        hit = _CHOSEN.get(key)
        if hit is not None and hit[0] is _PINNED:
            return hit[1]
        cfg = lookup(device_name(device), op, direction, n, capability_of(device), odd)
        _CHOSEN[key] = (_PINNED, cfg)
        return cfg
    gpu = device_name(device)
    if device.type == "cuda" and launch is not None and os.environ.get(AUTOTUNE_ENV, "0") == "1":
        key = (gpu, op, direction, bucket(n), dtype)
        if key not in _SEARCHED:
            _SEARCHED[key] = search(launch, candidates(direction, n))[0]
        return _SEARCHED[key]
    if device.type != "cuda":
        return interpreter_config(direction, n)
    return lookup(gpu, op, direction, n, capability_of(device), is_odd(n, dtype))


def resolve(gpu: str, op: str, direction: str, n: int, capability=None, odd: bool = False) -> tuple[Config, str]:
    """The config and where it comes from: the table ``harness.spec.tuned`` picks for this GPU (its own,
    or one of a GPU of the same compute capability) at N, else the heuristic (adapted for an op
    that borrows another's configs)."""
    table_gpu, how = table_for(gpu, pinned_table(), capability)
    found = pinned(table_gpu, op, direction, n, odd) if table_gpu else None
    if found:
        return found, how
    cfg = BORROWS[op][1](heuristic(direction, n), direction, n) if op in BORROWS else heuristic(direction, n)
    return cfg, how if table_gpu is None else f"heuristic (no entry for N={n} in the table of {table_gpu})"


def lookup(gpu: str, op: str, direction: str, n: int, capability=None, odd: bool = False) -> Config:
    return resolve(gpu, op, direction, n, capability, odd)[0]


def source(op: str, direction: str, n: int, dtype: str, device) -> str:
    """Where the config of one launch comes from (the benchmark records it per point)."""
    if "fp8" in op:  # the FP8 ops' launch shapes have a table of their own (``fp8.resolve``)
        from . import fp8

        return fp8.source(op, n, device)
    if device.type != "cuda":
        return "interpreter"
    if os.environ.get(AUTOTUNE_ENV, "0") == "1":
        return f"searched on first use ({AUTOTUNE_ENV}=1)"
    return resolve(device_name(device), op, direction, n, capability_of(device))[1]
