"""RMSNorm and LayerNorm, forward and backward, hand-written in Triton.

Per row of N elements, all arithmetic in fp32 (x, dy, w, b are upcast right after loading):

    RMSNorm     rstd = 1 / sqrt(mean(x^2) + eps)                          xhat = x * rstd
    LayerNorm   mean = mean(x),  rstd = 1 / sqrt(mean((x - mean)^2) + eps)  xhat = (x - mean) * rstd
    forward     y = xhat * w (+ b)
    backward    g = dy * w,  c1 = mean(g * xhat),  c2 = mean(g) (LayerNorm; 0 for RMSNorm)
                dx = rstd * (g - xhat * c1 - c2)
                dw = sum over rows of dy * xhat,   db = sum over rows of dy

RMSNorm is LayerNorm without the centring, so every kernel takes ``LAYERNORM`` as a compile-time
flag. Memory traffic is what matters: the forward reads x once and writes y; the backward reads x
and dy once and writes dx, and its column reductions (dw, db) ride along in the same pass.

How a row is walked (``Config``, chosen per GPU and N bucket in ``norm_configs``):

* whole row: a [ROWS, next_pow2(N)] tile in registers, one read of everything;
* whole row read twice (backward, ``reread``): the second read, for dx, comes from L1/L2, which
  leaves the registers to the dw/db accumulators (rows of ~8-16K elements);
* chunked, for rows too wide for registers: pass 1 walks the row in column chunks for the row
  reductions, pass 2 walks it again *backwards* to write y / dx, so that it starts on the chunks
  pass 1 read last, which are still in L2 (a forward walk would start on the ones evicted first).

The backward is persistent: a grid of a few programs per SM (``programs_per_sm``), each walking a
contiguous range of row blocks, loading the next block while it computes the current one, and
accumulating dw / db over its rows in fp32; it writes one partial row, and ``_sum_partials_kernel``
adds the partials in a fixed order (deterministic, no atomics).

Interpreter notes (CI runs these under TRITON_INTERPRET=1): no arithmetic on bf16 values (it is
silently wrong there), no libdevice (``tl.rsqrt`` instead), no atomics.
"""

from __future__ import annotations

import json
import os

import torch
import triton
import triton.language as tl

from .norm_configs import Config, bucket, candidates, choose, device_name, search, sm_count


# ==================================================================================== forward
@triton.jit(do_not_specialize=["M", "eps"])
def _norm_fwd_row_kernel(
    X, W, B, Y, MEAN, RSTD,
    M, N, stride_x, stride_y, eps,
    LAYERNORM: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < M
    mask = row_mask[:, None] & (cols < N)[None, :]
    rows = rows.to(tl.int64)  # row * stride overflows int32 beyond 2^31 elements

    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if LAYERNORM:
        mean = tl.sum(x, axis=1) / N
        # centre in registers before squaring (two-pass variance): E[x^2] - E[x]^2 cancels badly
        x = tl.where(mask, x - mean[:, None], 0.0)
        tl.store(MEAN + rows, mean, mask=row_mask)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / N + eps)
    tl.store(RSTD + rows, rstd, mask=row_mask)

    y = x * rstd[:, None]
    if HAS_WEIGHT:
        y = y * tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        y = y + tl.load(B + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M", "eps"])
def _norm_fwd_chunked_kernel(
    X, W, B, Y, MEAN, RSTD,
    M, N, stride_x, stride_y, eps,
    LAYERNORM: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    ROWS: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_mask = rows < M
    rows = rows.to(tl.int64)
    x_rows = X + rows[:, None] * stride_x
    n_chunks = tl.cdiv(N, CHUNK)

    # pass 1: the statistics
    if LAYERNORM:
        # Chan et al.'s merge of per-chunk (mean, sum of squared deviations): no E[x^2] - E[x]^2
        mean = tl.zeros([ROWS], dtype=tl.float32)
        m2 = tl.zeros([ROWS], dtype=tl.float32)
        for c in range(0, n_chunks):
            cols = c * CHUNK + tl.arange(0, CHUNK)
            mask = row_mask[:, None] & (cols < N)[None, :]
            x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            seen = tl.cast(c * CHUNK, tl.float32)
            count = tl.cast(tl.minimum(N - c * CHUNK, CHUNK), tl.float32)
            chunk_mean = tl.sum(x, axis=1) / count
            dev = tl.where(mask, x - chunk_mean[:, None], 0.0)
            delta = chunk_mean - mean
            mean = mean + delta * (count / (seen + count))
            m2 = m2 + tl.sum(dev * dev, axis=1) + delta * delta * (seen * count / (seen + count))
        rstd = tl.rsqrt(m2 / N + eps)
        tl.store(MEAN + rows, mean, mask=row_mask)
    else:
        sum_sq = tl.zeros([ROWS, CHUNK], dtype=tl.float32)
        for c in range(0, n_chunks):
            cols = c * CHUNK + tl.arange(0, CHUNK)
            mask = row_mask[:, None] & (cols < N)[None, :]
            x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            sum_sq += x * x
        rstd = tl.rsqrt(tl.sum(sum_sq, axis=1) / N + eps)
    tl.store(RSTD + rows, rstd, mask=row_mask)

    # pass 2, last chunk first (still in L2): y
    for i in range(0, n_chunks):
        cols = (n_chunks - 1 - i) * CHUNK + tl.arange(0, CHUNK)
        col_mask = cols < N
        mask = row_mask[:, None] & col_mask[None, :]
        x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if LAYERNORM:
            x = x - mean[:, None]
        y = x * rstd[:, None]
        if HAS_WEIGHT:
            y = y * tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        if HAS_BIAS:
            y = y + tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


def launch_fwd(cfg: Config, x, weight, bias, eps, layernorm: bool, y, mean, rstd):
    """Run the forward with ``cfg`` into y / mean / rstd; returns the compiled kernel (its
    ``n_regs`` and ``n_spills`` are the compiler's report)."""
    M, N = x.shape
    kernel, width = (_norm_fwd_chunked_kernel, cfg.chunk) if cfg.chunk else (_norm_fwd_row_kernel, bucket(N))
    return kernel[(triton.cdiv(M, cfg.rows),)](
        x, x if weight is None else weight, x if bias is None else bias, y, mean, rstd,  # x: never read
        M, N, x.stride(0), y.stride(0), eps,
        layernorm, weight is not None, bias is not None,
        cfg.rows, width, num_warps=cfg.warps,
    )  # fmt: skip


def norm_fwd(x, weight, bias, eps, layernorm: bool, config: Config | None = None):
    """(y, mean or None, rstd); ``config`` overrides the pinned/heuristic choice."""
    M, N = x.shape
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    rstd = torch.empty(M, dtype=torch.float32, device=x.device)
    mean = torch.empty(M, dtype=torch.float32, device=x.device) if layernorm else rstd  # unused for RMSNorm

    def launch(cfg: Config):
        return launch_fwd(cfg, x, weight, bias, eps, layernorm, y, mean, rstd)

    launch(config or choose("layernorm" if layernorm else "rmsnorm", "fwd", N, x.device, launch, x.dtype))
    return y, (mean if layernorm else None), rstd


# =================================================================================== backward
@triton.jit
def _row_block_range(M, ROWS: tl.constexpr):
    """This program's contiguous range of row blocks: as even as possible (sizes differ by at most
    one), so no program idles while another finishes a double share."""
    n_blocks = tl.cdiv(M, ROWS)
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    share = n_blocks // programs
    extra = n_blocks % programs
    first = pid * share + tl.minimum(pid, extra)
    return first, first + share + (pid < extra).to(tl.int32)


@triton.jit(do_not_specialize=["M"])
def _norm_bwd_row_kernel(
    DY, X, W, MEAN, RSTD, DX, DW_PARTIAL, DB_PARTIAL,
    M, N, stride_dy, stride_x, stride_dx,
    LAYERNORM: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, REREAD: tl.constexpr,
):  # fmt: skip
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    if REREAD:
        w_cols = W + cols  # re-read each row instead (L1-resident): its registers go to dw
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    db = tl.zeros([BLOCK_N], dtype=tl.float32)

    first, last = _row_block_range(M, ROWS)
    end = tl.minimum(M, last * ROWS)  # rows from here on are the next program's
    # Software pipelining by hand: the next block's loads are issued before this block's math, so a
    # program always has a block in flight while it computes. The prefetched values wait in
    # registers in their storage dtype (for bf16, half the registers of the fp32 math).
    rows = first * ROWS + tl.arange(0, ROWS)
    row_mask = rows < end
    mask = row_mask[:, None] & col_mask[None, :]
    x_next = tl.load(X + rows.to(tl.int64)[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    dy_next = tl.load(DY + rows.to(tl.int64)[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0)
    rstd_next = tl.load(RSTD + rows, mask=row_mask, other=0.0)
    mean_next = tl.load(MEAN + rows, mask=row_mask, other=0.0) if LAYERNORM else rstd_next
    for block in range(first, last):
        x, dy, rstd, mean = x_next.to(tl.float32), dy_next.to(tl.float32), rstd_next, mean_next
        mask = (rows < end)[:, None] & col_mask[None, :]
        x_ptrs = X + rows.to(tl.int64)[:, None] * stride_x + cols[None, :]
        dy_ptrs = DY + rows.to(tl.int64)[:, None] * stride_dy + cols[None, :]
        dx_ptrs = DX + rows.to(tl.int64)[:, None] * stride_dx + cols[None, :]

        rows += ROWS
        row_mask = rows < end
        next_mask = row_mask[:, None] & col_mask[None, :]
        x_next = tl.load(x_ptrs + ROWS * stride_x, mask=next_mask, other=0.0)
        dy_next = tl.load(dy_ptrs + ROWS * stride_dy, mask=next_mask, other=0.0)
        rstd_next = tl.load(RSTD + rows, mask=row_mask, other=0.0)
        mean_next = tl.load(MEAN + rows, mask=row_mask, other=0.0) if LAYERNORM else rstd_next

        if REREAD and HAS_WEIGHT:
            w = tl.load(w_cols, mask=col_mask, other=0.0).to(tl.float32)
        if LAYERNORM:
            x = x - mean[:, None]
        xhat = x * rstd[:, None]  # padding lanes hold junk here, but dy (hence g) is 0 there
        g = dy * w[None, :] if HAS_WEIGHT else dy
        c1 = tl.sum(g * xhat, axis=1) / N
        if LAYERNORM:
            c2 = tl.sum(g, axis=1) / N
        if REREAD:
            # Rows too wide to keep x, dy and the accumulators in registers together: read the row
            # again (it was read a moment ago: L1/L2 hits, no DRAM traffic) rather than spill.
            # evict_first marks the last use; it also keeps the compiler from reusing the first read.
            x = tl.load(x_ptrs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
            dy = tl.load(dy_ptrs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
            if LAYERNORM:
                x = x - mean[:, None]
            xhat = x * rstd[:, None]
            if HAS_WEIGHT:
                g = dy * tl.load(w_cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
            else:
                g = dy
        if LAYERNORM:
            dx = (g - xhat * c1[:, None] - c2[:, None]) * rstd[:, None]
            db += tl.sum(dy, axis=0)
        else:
            dx = (g - xhat * c1[:, None]) * rstd[:, None]
        if HAS_WEIGHT:
            dw += tl.sum(dy * xhat, axis=0)
        tl.store(dx_ptrs, dx.to(DX.dtype.element_ty), mask=mask)

    partial = tl.program_id(0).to(tl.int64) * N + cols
    if HAS_WEIGHT:
        tl.store(DW_PARTIAL + partial, dw, mask=col_mask)
    if LAYERNORM:
        tl.store(DB_PARTIAL + partial, db, mask=col_mask)


@triton.jit(do_not_specialize=["M"])
def _norm_bwd_chunked_kernel(
    DY, X, W, MEAN, RSTD, DX, DW_PARTIAL, DB_PARTIAL,
    M, N, stride_dy, stride_x, stride_dx,
    LAYERNORM: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    ROWS: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    n_chunks = tl.cdiv(N, CHUNK)
    partial_row = tl.program_id(0).to(tl.int64) * N
    first, last = _row_block_range(M, ROWS)
    for block in range(first, last):
        rows = block * ROWS + tl.arange(0, ROWS)
        row_mask = rows < M
        rows = rows.to(tl.int64)
        x_rows = X + rows[:, None] * stride_x
        dy_rows = DY + rows[:, None] * stride_dy
        rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
        if LAYERNORM:
            mean = tl.load(MEAN + rows, mask=row_mask, other=0.0)

        # pass 1: the row reductions c1 (and c2), accumulated lane-wise, reduced once at the end
        sum_gxhat = tl.zeros([ROWS, CHUNK], dtype=tl.float32)
        sum_g = tl.zeros([ROWS, CHUNK], dtype=tl.float32)
        for c in range(0, n_chunks):
            cols = c * CHUNK + tl.arange(0, CHUNK)
            col_mask = cols < N
            mask = row_mask[:, None] & col_mask[None, :]
            x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            if LAYERNORM:
                x = x - mean[:, None]
            if HAS_WEIGHT:
                g = dy * tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
            else:
                g = dy
            sum_gxhat += g * x  # times rstd once, below
            if LAYERNORM:
                sum_g += g
        c1 = tl.sum(sum_gxhat, axis=1) * rstd / N
        c2 = tl.sum(sum_g, axis=1) / N

        # pass 2, last chunk first (still in L2): dx, and this block's dw/db added into the program's
        # partial row, which only this program touches (plain read-add-write, no atomics)
        for i in range(0, n_chunks):
            cols = (n_chunks - 1 - i) * CHUNK + tl.arange(0, CHUNK)
            col_mask = cols < N
            mask = row_mask[:, None] & col_mask[None, :]
            x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            if LAYERNORM:
                x = x - mean[:, None]
            xhat = x * rstd[:, None]
            if HAS_WEIGHT:
                g = dy * tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
            else:
                g = dy
            dx = (g - xhat * c1[:, None] - c2[:, None]) * rstd[:, None]
            tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
            # the first block starts the partial from zero instead of reading it (it is uninitialised);
            # a vector compare, as `col_mask & (block > first)` comes out int32 in the interpreter
            seen = cols < tl.where(block > first, N, 0)
            if HAS_WEIGHT:
                dw = tl.load(DW_PARTIAL + partial_row + cols, mask=seen, other=0.0) + tl.sum(dy * xhat, axis=0)
                tl.store(DW_PARTIAL + partial_row + cols, dw, mask=col_mask)
            if LAYERNORM:
                db = tl.load(DB_PARTIAL + partial_row + cols, mask=seen, other=0.0) + tl.sum(dy, axis=0)
                tl.store(DB_PARTIAL + partial_row + cols, db, mask=col_mask)
            # the next block reads these partials back; a barrier makes the stores visible whichever
            # thread of the program the compiler's layouts assign to the read
            tl.debug_barrier()


@triton.jit
def _sum_partials_kernel(PARTIALS, OUT, P, N, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """OUT[k, :] = sum over p of PARTIALS[k, p, :], in fp32, always in the same order."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.program_id(1).to(tl.int64)
    acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    for p0 in range(0, P, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        mask = (p < P)[:, None] & (cols < N)[None, :]
        acc += tl.load(PARTIALS + (k * P + p[:, None]) * N + cols[None, :], mask=mask, other=0.0)
    tl.store(OUT + k * N + cols, tl.sum(acc, axis=0).to(OUT.dtype.element_ty), mask=cols < N)


def launch_bwd(cfg: Config, dy, x, weight, mean, rstd, layernorm: bool, dx, sums):
    """Run the backward with ``cfg`` into dx and ``sums`` (rows: dw if weight, then db if
    layernorm); returns the compiled main kernel (see ``launch_fwd``)."""
    M, N = x.shape
    n_sums = sums.shape[0]
    programs = min(triton.cdiv(M, cfg.rows), cfg.programs_per_sm * sm_count(x.device))
    partials = torch.empty((max(n_sums, 1), programs, N), dtype=torch.float32, device=x.device)
    args = (
        dy, x, x if weight is None else weight, rstd if mean is None else mean, rstd, dx,  # x, rstd: never read
        partials[0], partials[n_sums - 1],
        M, N, dy.stride(0), x.stride(0), dx.stride(0),
        layernorm, weight is not None, cfg.rows,
    )  # fmt: skip
    if cfg.chunk:
        compiled = _norm_bwd_chunked_kernel[(programs,)](*args, cfg.chunk, num_warps=cfg.warps)
    else:
        compiled = _norm_bwd_row_kernel[(programs,)](*args, bucket(N), cfg.reread, num_warps=cfg.warps)
    if n_sums:
        if x.is_cuda:
            # narrow column strips, so that even N = 1024 spreads over dozens of SMs: a handful of
            # programs each walking all the partials would cost as much as the main kernel
            block_n = min(max(bucket(N) // 256, 16), 256)
            block_p = 4096 // block_n
        else:  # the interpreter pays per program and per operation, not per element
            block_n, block_p = min(bucket(N), 16384), 16
        grid = (triton.cdiv(N, block_n), n_sums)
        _sum_partials_kernel[grid](partials, sums, programs, N, block_p, block_n, num_warps=4)
    return compiled


def norm_bwd(dy, x, weight, mean, rstd, layernorm: bool, config: Config | None = None):
    """(dx, dw or None, db or None); ``config`` overrides the pinned/heuristic choice."""
    M, N = x.shape
    has_weight = weight is not None
    dx = torch.empty((M, N), dtype=x.dtype, device=x.device)
    n_sums = int(has_weight) + int(layernorm)
    sums = torch.empty((n_sums, N), dtype=x.dtype, device=x.device)

    def launch(cfg: Config):
        return launch_bwd(cfg, dy, x, weight, mean, rstd, layernorm, dx, sums)

    launch(config or choose("layernorm" if layernorm else "rmsnorm", "bwd", N, x.device, launch, x.dtype))
    dw = sums[0] if has_weight else None
    db = sums[n_sums - 1] if layernorm else None
    return dx, dw, db


# ============================================================================ the contract
def rmsnorm_fwd(x, weight, eps):
    y, _, rstd = norm_fwd(x, weight, None, eps, layernorm=False)
    return y, rstd


def rmsnorm_bwd(dy, x, weight, rstd):
    dx, dw, _ = norm_bwd(dy, x, weight, None, rstd, layernorm=False)
    return dx, dw


def layernorm_fwd(x, weight, bias, eps):
    return norm_fwd(x, weight, bias, eps, layernorm=True)


def layernorm_bwd(dy, x, weight, mean, rstd):
    return norm_bwd(dy, x, weight, mean, rstd, layernorm=True)


# ============================================================================ `normbench tune`
def tune(op, shapes, dtype, log_dir=None) -> dict:
    """Search ``candidates()`` on each shape (CUDA); returns the winners in ``norm_configs.json``'s
    layout, {gpu: {"<op>_<direction>": {bucket: config}}}, for pinning."""
    from harness.contract import DTYPES
    from harness.inputs import make_case

    layernorm = op == "layernorm"
    gpu = device_name(torch.device("cuda"))
    out: dict = {}
    for shape in shapes:
        case = make_case(op, shape, DTYPES[dtype] if isinstance(dtype, str) else dtype, "cuda")
        x, w, b, eps = case["x"].reshape(-1, shape.n), case["weight"], case["bias"], case["eps"]
        dy = case["dy"].reshape(-1, shape.n)
        y, mean, rstd = norm_fwd(x, w, b, eps, layernorm)
        runs = {
            "fwd": lambda cfg: norm_fwd(x, w, b, eps, layernorm, config=cfg),
            "bwd": lambda cfg: norm_bwd(dy, x, w, mean, rstd, layernorm, config=cfg),
        }
        for direction, run in runs.items():
            best, times = search(run, candidates(direction, shape.n))
            out.setdefault(gpu, {}).setdefault(f"{op}_{direction}", {})[str(bucket(shape.n))] = best.to_json()
            if log_dir:
                os.makedirs(log_dir, exist_ok=True)
                with open(os.path.join(log_dir, f"triton_{op}_{direction}_{shape.label}.json"), "w") as f:
                    json.dump([{**c.to_json(), "ms": t} for c, t in times.items()], f, indent=1)
    return out
