import torch
import triton
import triton.language as tl

# Rows whose power-of-two padded width is at most this are held whole in registers
# (one tile of BLOCK_M rows x BLOCK_N columns per step). Wider rows are walked in chunks.
_FUSED_MAX_N = 16384
_TILE_ELEMS = 4096
_WIDE_FWD_BLOCK = 4096
_WIDE_BWD_STATS_BLOCK = 4096
_WIDE_BWD_COL_BLOCK = 1024

_SM_CACHE = {}


def _num_sms(t):
    if t.is_cuda:
        idx = t.device.index
        if idx is None:
            idx = torch.cuda.current_device()
        n = _SM_CACHE.get(idx)
        if n is None:
            n = torch.cuda.get_device_properties(idx).multi_processor_count
            _SM_CACHE[idx] = n
        return n
    return 4


def _tile_config(M, N):
    BLOCK_N = triton.next_power_of_2(N)
    BLOCK_M = max(1, _TILE_ELEMS // BLOCK_N)
    BLOCK_M = min(BLOCK_M, triton.next_power_of_2(M))
    elems = BLOCK_M * BLOCK_N
    num_warps = min(16, max(1, elems // 256))
    return BLOCK_M, BLOCK_N, num_warps


# --------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------
@triton.jit
def _fwd_fused_kernel(
    X, R, W, Y, H, RSTD,
    M, N,
    stride_x, stride_r, stride_y, stride_h,
    eps,
    HAS_W: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    mask = row_mask[:, None] & col_mask[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    cols2 = cols[None, :]

    x_raw = tl.load(X + rows64 * stride_x + cols2, mask=mask, other=0.0)
    r_raw = tl.load(R + rows64 * stride_r + cols2, mask=mask, other=0.0)
    # sum in fp32, rounded once to x's dtype; statistics from the stored value
    h = (x_raw.to(tl.float32) + r_raw.to(tl.float32)).to(x_raw.dtype)
    tl.store(H + rows64 * stride_h + cols2, h, mask=mask)
    hf = h.to(tl.float32)

    rstd = tl.rsqrt(tl.sum(hf * hf, axis=1) / N + eps)
    tl.store(RSTD + rows, rstd, mask=row_mask)

    y = hf * rstd[:, None]
    if HAS_W:
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
        y = y * w[None, :]
    tl.store(Y + rows64 * stride_y + cols2, y.to(x_raw.dtype), mask=mask)


@triton.jit
def _fwd_wide_kernel(
    X, R, W, Y, H, RSTD,
    N,
    stride_x, stride_r, stride_y, stride_h,
    eps,
    HAS_W: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    X += row * stride_x
    R += row * stride_r
    Y += row * stride_y
    H += row * stride_h
    cols0 = tl.arange(0, BLOCK_N)

    # pass 1: residual_out = x + residual (stored), sum of squares of the stored value
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        cols = start + cols0
        mask = cols < N
        x_raw = tl.load(X + cols, mask=mask, other=0.0)
        r_raw = tl.load(R + cols, mask=mask, other=0.0)
        h = (x_raw.to(tl.float32) + r_raw.to(tl.float32)).to(x_raw.dtype)
        tl.store(H + cols, h, mask=mask)
        hf = h.to(tl.float32)
        acc += hf * hf
    rstd = tl.rsqrt(tl.sum(acc, axis=0) / N + eps)
    tl.store(RSTD + row, rstd)

    # make this program's residual_out stores visible to all of its threads
    tl.debug_barrier()

    # pass 2: y from residual_out as stored (re-read, mostly from L2)
    for start in range(0, N, BLOCK_N):
        cols = start + cols0
        mask = cols < N
        h_raw = tl.load(H + cols, mask=mask, other=0.0)
        y = h_raw.to(tl.float32) * rstd
        if HAS_W:
            w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
            y = y * w
        tl.store(Y + cols, y.to(h_raw.dtype), mask=mask)


def add_rmsnorm_fwd(x, residual, weight, eps):
    """Returns (y, residual_out, rstd)."""
    M, N = x.shape
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    residual_out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    rstd = torch.empty((M,), dtype=torch.float32, device=x.device)
    has_w = weight is not None
    w = weight if has_w else x  # dummy pointer when there is no weight
    eps = float(eps)

    if triton.next_power_of_2(N) <= _FUSED_MAX_N:
        BLOCK_M, BLOCK_N, num_warps = _tile_config(M, N)
        grid = (triton.cdiv(M, BLOCK_M),)
        _fwd_fused_kernel[grid](
            x, residual, w, y, residual_out, rstd,
            M, N,
            x.stride(0), residual.stride(0), y.stride(0), residual_out.stride(0),
            eps,
            HAS_W=has_w, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
            num_warps=num_warps,
        )
    else:
        _fwd_wide_kernel[(M,)](
            x, residual, w, y, residual_out, rstd,
            N,
            x.stride(0), residual.stride(0), y.stride(0), residual_out.stride(0),
            eps,
            HAS_W=has_w, BLOCK_N=_WIDE_FWD_BLOCK,
            num_warps=8,
        )
    return y, residual_out, rstd


# --------------------------------------------------------------------------------------
# Backward
# --------------------------------------------------------------------------------------
@triton.jit
def _bwd_fused_kernel(
    DY, DRES, H, W, RSTD, DH, DW_PART,
    M, N, rows_per_prog,
    stride_dy, stride_dres, stride_h, stride_dh,
    HAS_W: tl.constexpr,
    HAS_DRES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    cols2 = cols[None, :]
    row_start = pid * rows_per_prog
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)

    for i in range(0, rows_per_prog, BLOCK_M):
        rows = row_start + i + tl.arange(0, BLOCK_M)
        row_mask = rows < M
        mask = row_mask[:, None] & col_mask[None, :]
        rows64 = rows.to(tl.int64)[:, None]

        dy = tl.load(DY + rows64 * stride_dy + cols2, mask=mask, other=0.0,
                     eviction_policy="evict_first").to(tl.float32)
        h_raw = tl.load(H + rows64 * stride_h + cols2, mask=mask, other=0.0,
                        eviction_policy="evict_first")
        h = h_raw.to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
        xhat = h * rstd[:, None]
        if HAS_W:
            w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
            acc += dy * xhat
            g = dy * w[None, :]
        else:
            g = dy
        c = tl.sum(g * xhat, axis=1) / N
        dh = rstd[:, None] * (g - xhat * c[:, None])
        if HAS_DRES:
            dres = tl.load(DRES + rows64 * stride_dres + cols2, mask=mask, other=0.0,
                           eviction_policy="evict_first").to(tl.float32)
            dh = dh + dres
        tl.store(DH + rows64 * stride_dh + cols2, dh.to(h_raw.dtype), mask=mask)

    if HAS_W:
        dw = tl.sum(acc, axis=0)
        tl.store(DW_PART + pid.to(tl.int64) * N + cols, dw, mask=col_mask)


@triton.jit
def _bwd_wide_stats_kernel(
    DY, H, W, RSTD, C,
    N,
    stride_dy, stride_h,
    HAS_W: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # C[row] = mean(g * xhat) = rstd * sum(g * h) / N
    row = tl.program_id(0).to(tl.int64)
    DY += row * stride_dy
    H += row * stride_h
    cols0 = tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        cols = start + cols0
        mask = cols < N
        g = tl.load(DY + cols, mask=mask, other=0.0).to(tl.float32)
        h = tl.load(H + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_W:
            w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
            g = g * w
        acc += g * h
    rstd = tl.load(RSTD + row)
    c = tl.sum(acc, axis=0) * rstd / N
    tl.store(C + row, c)


@triton.jit
def _bwd_wide_dx_kernel(
    DY, DRES, H, W, RSTD, C, DH, DW_PART,
    M, N, rows_per_prog,
    stride_dy, stride_dres, stride_h, stride_dh,
    HAS_W: tl.constexpr,
    HAS_DRES: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    if HAS_W:
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    row_start = pid_m * rows_per_prog

    for i in range(0, rows_per_prog):
        row = row_start + i
        row_ok = row < M
        mask = col_mask & row_ok
        row64 = row.to(tl.int64)
        dy = tl.load(DY + row64 * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        h_raw = tl.load(H + row64 * stride_h + cols, mask=mask, other=0.0)
        h = h_raw.to(tl.float32)
        rstd = tl.load(RSTD + row, mask=row_ok, other=0.0)
        c = tl.load(C + row, mask=row_ok, other=0.0)
        xhat = h * rstd
        if HAS_W:
            acc += dy * xhat
            g = dy * w
        else:
            g = dy
        dh = rstd * (g - xhat * c)
        if HAS_DRES:
            dres = tl.load(DRES + row64 * stride_dres + cols, mask=mask, other=0.0).to(tl.float32)
            dh = dh + dres
        tl.store(DH + row64 * stride_dh + cols, dh.to(h_raw.dtype), mask=mask)

    if HAS_W:
        tl.store(DW_PART + pid_m.to(tl.int64) * N + cols, acc, mask=col_mask)


def add_rmsnorm_bwd(dy, dresidual_out, residual_out, weight, rstd):
    """Returns (dh, dweight)."""
    M, N = residual_out.shape
    device = residual_out.device
    dh = torch.empty((M, N), dtype=residual_out.dtype, device=device)
    has_w = weight is not None
    has_dres = dresidual_out is not None
    dres = dresidual_out if has_dres else dy  # dummy pointer when absent
    w = weight if has_w else dy  # dummy pointer when absent
    part = None

    if triton.next_power_of_2(N) <= _FUSED_MAX_N:
        BLOCK_M, BLOCK_N, num_warps = _tile_config(M, N)
        n_blocks = triton.cdiv(M, BLOCK_M)
        max_progs = _num_sms(dy) * max(1, 32 // num_warps)
        n_progs = max(1, min(n_blocks, max_progs))
        rows_per_prog = triton.cdiv(n_blocks, n_progs) * BLOCK_M
        n_progs = triton.cdiv(M, rows_per_prog)
        if has_w:
            part = torch.empty((n_progs, N), dtype=torch.float32, device=device)
        _bwd_fused_kernel[(n_progs,)](
            dy, dres, residual_out, w, rstd, dh, part if has_w else dy,
            M, N, rows_per_prog,
            dy.stride(0), dres.stride(0), residual_out.stride(0), dh.stride(0),
            HAS_W=has_w, HAS_DRES=has_dres, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
            num_warps=num_warps,
        )
    else:
        c = torch.empty((M,), dtype=torch.float32, device=device)
        _bwd_wide_stats_kernel[(M,)](
            dy, residual_out, w, rstd, c,
            N,
            dy.stride(0), residual_out.stride(0),
            HAS_W=has_w, BLOCK_N=_WIDE_BWD_STATS_BLOCK,
            num_warps=8,
        )
        BN = _WIDE_BWD_COL_BLOCK
        n_col = triton.cdiv(N, BN)
        target = _num_sms(dy) * 8
        n_row_groups = max(1, min(M, triton.cdiv(target, n_col)))
        rows_per_prog = triton.cdiv(M, n_row_groups)
        n_row_groups = triton.cdiv(M, rows_per_prog)
        if has_w:
            part = torch.empty((n_row_groups, N), dtype=torch.float32, device=device)
        _bwd_wide_dx_kernel[(n_col, n_row_groups)](
            dy, dres, residual_out, w, rstd, c, dh, part if has_w else dy,
            M, N, rows_per_prog,
            dy.stride(0), dres.stride(0), residual_out.stride(0), dh.stride(0),
            HAS_W=has_w, HAS_DRES=has_dres, BLOCK_N=BN,
            num_warps=4,
        )

    dweight = None
    if has_w:
        # fixed-order fp32 reduction of the per-program partial sums, cast at the end
        dweight = part.sum(dim=0).to(weight.dtype)
    return dh, dweight
