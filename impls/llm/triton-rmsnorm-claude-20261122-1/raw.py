import torch
import triton
import triton.language as tl

# ----------------------------------------------------------------------------
# Tunables (plain Python heuristics, no autotune)
# ----------------------------------------------------------------------------
_FUSED_MAX_BLOCK_N = 16384   # widest (power-of-2 padded) row kept fully in registers
_TILE_ELEMS = 4096           # target elements per 2-D tile for narrow rows
_FWD_CHUNK = 8192            # chunk width of the wide-row forward kernel
_BWD_DOT_CHUNK = 4096        # chunk width of the wide-row backward row-dot kernel
_BWD_COL_BLOCK = 1024        # column block of the wide-row backward dx/dweight kernel
_BWD_COL_ROWS = 4            # rows per tile of the wide-row backward dx/dweight kernel

_SM_COUNT_CACHE = {}


def _num_sms(t: torch.Tensor) -> int:
    if t.is_cuda:
        idx = t.device.index
        if idx is None:
            idx = torch.cuda.current_device()
        n = _SM_COUNT_CACHE.get(idx)
        if n is None:
            n = torch.cuda.get_device_properties(idx).multi_processor_count
            _SM_COUNT_CACHE[idx] = n
        return n
    return 4


def _tile_rows(M: int, block_n: int) -> int:
    if block_n >= _TILE_ELEMS:
        return 1
    return max(1, min(_TILE_ELEMS // block_n, triton.next_power_of_2(M)))


def _num_warps(elems: int) -> int:
    return max(4, min(16, elems // 512))


# ----------------------------------------------------------------------------
# Forward kernels
# ----------------------------------------------------------------------------
@triton.jit
def _rms_fwd_fused_kernel(
    X, W, Y, RSTD,
    M, N,
    stride_xm, stride_ym,
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
    rows64 = rows.to(tl.int64)

    x = tl.load(X + rows64[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    ss = tl.sum(x * x, axis=1)
    rstd = tl.rsqrt(ss / N + eps)
    tl.store(RSTD + rows, rstd, mask=row_mask)

    y = x * rstd[:, None]
    if HAS_W:
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
        y = y * w[None, :]
    tl.store(Y + rows64[:, None] * stride_ym + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _rms_fwd_chunked_kernel(
    X, W, Y, RSTD,
    N,
    stride_xm, stride_ym,
    eps,
    HAS_W: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_xm
    y_row = Y + row * stride_ym
    cols = tl.arange(0, BLOCK_N)
    num_chunks = (N + BLOCK_N - 1) // BLOCK_N

    # pass 1: sum of squares (keep x in L2 for pass 2)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for c in range(0, num_chunks):
        offs = c * BLOCK_N + cols
        m = offs < N
        x = tl.load(x_row + offs, mask=m, other=0.0, eviction_policy="evict_last").to(tl.float32)
        acc += x * x
    rstd = tl.rsqrt(tl.sum(acc, axis=0) / N + eps)
    tl.store(RSTD + row, rstd)

    # pass 2: walk the chunks in reverse so the most recently read ones hit L2
    for i in range(0, num_chunks):
        c = num_chunks - 1 - i
        offs = c * BLOCK_N + cols
        m = offs < N
        x = tl.load(x_row + offs, mask=m, other=0.0, eviction_policy="evict_first").to(tl.float32)
        y = x * rstd
        if HAS_W:
            w = tl.load(W + offs, mask=m, other=0.0).to(tl.float32)
            y = y * w
        tl.store(y_row + offs, y.to(Y.dtype.element_ty), mask=m, eviction_policy="evict_first")


# ----------------------------------------------------------------------------
# Backward kernels
# ----------------------------------------------------------------------------
@triton.jit
def _rms_bwd_fused_kernel(
    DY, X, W, RSTD, DX, DW_PART,
    M, N,
    stride_dym, stride_xm, stride_dxm,
    tiles_per_prog,
    HAS_W: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    first_tile = pid * tiles_per_prog
    for t in range(0, tiles_per_prog):
        rows = (first_tile + t) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < M
        mask = row_mask[:, None] & col_mask[None, :]
        rows64 = rows.to(tl.int64)

        x = tl.load(X + rows64[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows64[:, None] * stride_dym + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)

        xhat = x * rstd[:, None]
        if HAS_W:
            acc += dy * xhat
            w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
            g = dy * w[None, :]
        else:
            g = dy
        c = tl.sum(g * xhat, axis=1) / N
        dx = (g - xhat * c[:, None]) * rstd[:, None]
        tl.store(DX + rows64[:, None] * stride_dxm + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)

    if HAS_W:
        dw = tl.sum(acc, axis=0)
        tl.store(DW_PART + pid * N + cols, dw, mask=col_mask)


@triton.jit
def _rms_bwd_rowdot_kernel(
    DY, X, W, DOT,
    N,
    stride_dym, stride_xm,
    chunks_per_split, S,
    HAS_W: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # DOT[row, s] = sum over the columns of split s of dy * w * x
    row = tl.program_id(0)
    s = tl.program_id(1)
    row64 = row.to(tl.int64)
    x_row = X + row64 * stride_xm
    dy_row = DY + row64 * stride_dym
    cols = tl.arange(0, BLOCK_N)
    start = s * (chunks_per_split * BLOCK_N)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for c in range(0, chunks_per_split):
        offs = start + c * BLOCK_N + cols
        m = offs < N
        x = tl.load(x_row + offs, mask=m, other=0.0).to(tl.float32)
        dy = tl.load(dy_row + offs, mask=m, other=0.0).to(tl.float32)
        if HAS_W:
            w = tl.load(W + offs, mask=m, other=0.0).to(tl.float32)
            dy = dy * w
        acc += dy * x
    tl.store(DOT + row * S + s, tl.sum(acc, axis=0))


@triton.jit
def _rms_bwd_cols_kernel(
    DY, X, W, RSTD, DOT, DX, DW_PART,
    M, N,
    stride_dym, stride_xm, stride_dxm,
    S, tiles_per_prog,
    HAS_W: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    if HAS_W:
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    sidx = tl.arange(0, BLOCK_S)
    s_mask = sidx < S
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    first_tile = pid_m * tiles_per_prog
    for t in range(0, tiles_per_prog):
        rows = (first_tile + t) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < M
        mask = row_mask[:, None] & col_mask[None, :]
        rows64 = rows.to(tl.int64)

        rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
        dots = tl.load(DOT + rows[:, None] * S + sidx[None, :],
                       mask=row_mask[:, None] & s_mask[None, :], other=0.0)
        c = tl.sum(dots, axis=1) * rstd / N  # mean(g * xhat) per row

        x = tl.load(X + rows64[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows64[:, None] * stride_dym + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        xhat = x * rstd[:, None]
        if HAS_W:
            acc += dy * xhat
            g = dy * w[None, :]
        else:
            g = dy
        dx = (g - xhat * c[:, None]) * rstd[:, None]
        tl.store(DX + rows64[:, None] * stride_dxm + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)

    if HAS_W:
        tl.store(DW_PART + pid_m * N + cols, tl.sum(acc, axis=0), mask=col_mask)


# ----------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------
def rmsnorm_fwd(x: torch.Tensor, weight, eps: float):
    """Returns (y, rstd)."""
    M, N = x.shape
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    rstd = torch.empty((M,), dtype=torch.float32, device=x.device)
    has_w = weight is not None
    w = weight if has_w else x
    eps = float(eps)

    block_n = triton.next_power_of_2(N)
    if block_n <= _FUSED_MAX_BLOCK_N:
        block_m = _tile_rows(M, block_n)
        nw = _num_warps(block_m * block_n)
        grid = (triton.cdiv(M, block_m),)
        _rms_fwd_fused_kernel[grid](
            x, w, y, rstd,
            M, N,
            x.stride(0), y.stride(0),
            eps,
            HAS_W=has_w, BLOCK_M=block_m, BLOCK_N=block_n,
            num_warps=nw,
        )
    else:
        _rms_fwd_chunked_kernel[(M,)](
            x, w, y, rstd,
            N,
            x.stride(0), y.stride(0),
            eps,
            HAS_W=has_w, BLOCK_N=_FWD_CHUNK,
            num_warps=16,
        )
    return y, rstd


def rmsnorm_bwd(dy: torch.Tensor, x: torch.Tensor, weight, rstd: torch.Tensor):
    """Returns (dx, dweight)."""
    M, N = x.shape
    dev = x.device
    dx = torch.empty((M, N), dtype=x.dtype, device=dev)
    has_w = weight is not None
    w = weight if has_w else x
    sms = _num_sms(x)

    block_n = triton.next_power_of_2(N)
    if block_n <= _FUSED_MAX_BLOCK_N:
        block_m = _tile_rows(M, block_n)
        nw = _num_warps(block_m * block_n)
        occ = 1 if nw >= 16 else (2 if nw >= 8 else 4)
        num_tiles = triton.cdiv(M, block_m)
        grid_size = max(1, min(num_tiles, sms * occ))
        tiles_per_prog = triton.cdiv(num_tiles, grid_size)
        grid_size = triton.cdiv(num_tiles, tiles_per_prog)
        dw_part = torch.empty((grid_size, N), dtype=torch.float32, device=dev) if has_w else None
        _rms_bwd_fused_kernel[(grid_size,)](
            dy, x, w, rstd, dx, dw_part if has_w else rstd,
            M, N,
            dy.stride(0), x.stride(0), dx.stride(0),
            tiles_per_prog,
            HAS_W=has_w, BLOCK_M=block_m, BLOCK_N=block_n,
            num_warps=nw,
        )
    else:
        # 1) per-row partial dots sum(dy * w * x) over column splits
        ch = _BWD_DOT_CHUNK
        chunks_per_split = 4 if M * triton.cdiv(N, 4 * ch) >= 2 * sms else 1
        S = triton.cdiv(N, chunks_per_split * ch)
        dot = torch.empty((M, S), dtype=torch.float32, device=dev)
        _rms_bwd_rowdot_kernel[(M, S)](
            dy, x, w, dot,
            N,
            dy.stride(0), x.stride(0),
            chunks_per_split, S,
            HAS_W=has_w, BLOCK_N=ch,
            num_warps=8,
        )
        # 2) dx and per-row-group dweight partials over column blocks
        bm, bn = _BWD_COL_ROWS, _BWD_COL_BLOCK
        cb = triton.cdiv(N, bn)
        num_tiles = triton.cdiv(M, bm)
        tiles_per_prog = max(1, min(16, num_tiles, (num_tiles * cb) // (4 * sms)))
        groups = triton.cdiv(num_tiles, tiles_per_prog)
        dw_part = torch.empty((groups, N), dtype=torch.float32, device=dev) if has_w else None
        block_s = max(2, triton.next_power_of_2(S))
        _rms_bwd_cols_kernel[(cb, groups)](
            dy, x, w, rstd, dot, dx, dw_part if has_w else dot,
            M, N,
            dy.stride(0), x.stride(0), dx.stride(0),
            S, tiles_per_prog,
            HAS_W=has_w, BLOCK_M=bm, BLOCK_N=bn, BLOCK_S=block_s,
            num_warps=8,
        )

    dweight = dw_part.sum(dim=0).to(x.dtype) if has_w else None
    return dx, dweight
