import torch
import triton
import triton.language as tl

# ----------------------------------------------------------------------------------------------
# Tunables (plain Python, no autotune)
# ----------------------------------------------------------------------------------------------
_FWD_FUSED_MAX_BLOCK = 16384   # whole row (tile) kept in registers in the forward
_BWD_FUSED_MAX_BLOCK = 8192    # whole row + dw/db accumulators kept in registers in the backward
_TILE_ELEMS = 4096             # elements per program tile for narrow rows
_WIDE_CHUNK = 4096             # chunk width when walking a wide row
_WIDE_WARPS = 8
_DX_BLOCK_M = 4                # column-tiled dx kernel (wide backward)
_DX_BLOCK_N = 1024
_DX_WARPS = 8
_RED_BLOCK_G = 16              # partial-sum reduction kernel
_RED_MAX_BLOCK_N = 256

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


def _tile_cfg(M, N):
    block_n = max(triton.next_power_of_2(N), 16)
    block_m = max(1, _TILE_ELEMS // block_n)
    block_m = min(block_m, triton.next_power_of_2(M))
    tile = block_m * block_n
    num_warps = max(4, min(16, tile // 512))  # ~16 elements per thread per tensor
    return block_m, block_n, num_warps


# ----------------------------------------------------------------------------------------------
# Forward kernels
# ----------------------------------------------------------------------------------------------
@triton.jit
def _ln_fwd_fused_kernel(
    X, Y, W, B, Mean, Rstd,
    M, N, stride_x, eps,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    mask = row_mask[:, None] & col_mask[None, :]
    rows64 = rows.to(tl.int64)

    x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0,
                eviction_policy="evict_first").to(tl.float32)
    mean = tl.sum(x, axis=1) / N
    xc = tl.where(mask, x - mean[:, None], 0.0)
    var = tl.sum(xc * xc, axis=1) / N
    rstd = tl.rsqrt(var + eps)

    y = xc * rstd[:, None]
    if HAS_W:
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
        y = y * w[None, :]
    if HAS_B:
        b = tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)
        y = y + b[None, :]
    tl.store(Y + rows64[:, None] * N + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    tl.store(Mean + rows, mean, mask=row_mask)
    tl.store(Rstd + rows, rstd, mask=row_mask)


@triton.jit
def _ln_fwd_wide_kernel(
    X, Y, W, B, Mean, Rstd,
    N, stride_x, eps,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0)
    row64 = row.to(tl.int64)
    x_row = X + row64 * stride_x
    y_row = Y + row64 * N
    cols = tl.arange(0, BLOCK_N)
    num_chunks = tl.cdiv(N, BLOCK_N)

    # Pass 1: lane-wise Welford (each lane sees one element per chunk; a lane that is valid in
    # chunk k has seen exactly k + 1 elements).
    run_mean = tl.zeros([BLOCK_N], dtype=tl.float32)
    run_m2 = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k in range(0, num_chunks):
        offs = k * BLOCK_N + cols
        m = offs < N
        x = tl.load(x_row + offs, mask=m, other=0.0, eviction_policy="evict_last").to(tl.float32)
        inv = 1.0 / (k + 1)
        delta = x - run_mean
        new_mean = run_mean + delta * inv
        run_m2 = tl.where(m, run_m2 + delta * (x - new_mean), run_m2)
        run_mean = tl.where(m, new_mean, run_mean)

    # Combine the lanes (Chan): counts per lane are known exactly.
    cnt = tl.where(cols < N, (N - cols + (BLOCK_N - 1)) // BLOCK_N, 0).to(tl.float32)
    mean = tl.sum(run_mean * cnt, axis=0) / N
    d = run_mean - mean
    var = tl.sum(run_m2 + cnt * d * d, axis=0) / N
    rstd = tl.rsqrt(var + eps)
    tl.store(Mean + row, mean)
    tl.store(Rstd + row, rstd)

    # Pass 2: normalize, walking the row backwards (most recently read chunks first -> L2 hits).
    for i in range(0, num_chunks):
        kk = num_chunks - 1 - i
        offs2 = kk * BLOCK_N + cols
        m2 = offs2 < N
        x2 = tl.load(x_row + offs2, mask=m2, other=0.0, eviction_policy="evict_first").to(tl.float32)
        y = (x2 - mean) * rstd
        if HAS_W:
            w = tl.load(W + offs2, mask=m2, other=0.0).to(tl.float32)
            y = y * w
        if HAS_B:
            b = tl.load(B + offs2, mask=m2, other=0.0).to(tl.float32)
            y = y + b
        tl.store(y_row + offs2, y.to(Y.dtype.element_ty), mask=m2)


# ----------------------------------------------------------------------------------------------
# Backward kernels
# ----------------------------------------------------------------------------------------------
@triton.jit
def _ln_bwd_fused_kernel(
    DY, X, W, Mean, Rstd, DX, Part,
    M, N, stride_dy, stride_x,
    HAS_W: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Persistent: program pid handles row tiles pid, pid + nprog, ...; keeps fp32 column sums of
    # dy * xhat and dy in registers and writes them as one partial row each at the end.
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    if HAS_W:
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    num_tiles = tl.cdiv(M, BLOCK_M)
    for tile in range(pid, num_tiles, nprog):
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < M
        mask = row_mask[:, None] & col_mask[None, :]
        rows64 = rows.to(tl.int64)
        x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0,
                    eviction_policy="evict_first").to(tl.float32)
        dy = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0,
                     eviction_policy="evict_first").to(tl.float32)
        mean = tl.load(Mean + rows, mask=row_mask, other=0.0)
        rstd = tl.load(Rstd + rows, mask=row_mask, other=0.0)
        xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        if HAS_W:
            g = dy * w[None, :]
        else:
            g = dy
        c1 = tl.sum(g * xhat, axis=1) / N
        c2 = tl.sum(g, axis=1) / N
        dx = rstd[:, None] * (g - xhat * c1[:, None] - c2[:, None])
        tl.store(DX + rows64[:, None] * N + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        if HAS_W:
            dw_acc += dy * xhat
        db_acc += dy
    db = tl.sum(db_acc, axis=0)
    tl.store(Part + pid.to(tl.int64) * N + cols, db, mask=col_mask)
    if HAS_W:
        dw = tl.sum(dw_acc, axis=0)
        tl.store(Part + (nprog + pid).to(tl.int64) * N + cols, dw, mask=col_mask)


@triton.jit
def _ln_bwd_rowstats_kernel(
    DY, X, W, Mean, Rstd, C1, C2,
    N, stride_dy, stride_x,
    HAS_W: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Wide rows: per row c1 = mean(g * xhat), c2 = mean(g).
    row = tl.program_id(0)
    row64 = row.to(tl.int64)
    x_row = X + row64 * stride_x
    dy_row = DY + row64 * stride_dy
    mean = tl.load(Mean + row)
    rstd = tl.load(Rstd + row)
    cols = tl.arange(0, BLOCK_N)
    acc1 = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k in range(0, tl.cdiv(N, BLOCK_N)):
        offs = k * BLOCK_N + cols
        m = offs < N
        x = tl.load(x_row + offs, mask=m, other=0.0).to(tl.float32)
        dy = tl.load(dy_row + offs, mask=m, other=0.0).to(tl.float32)
        xhat = tl.where(m, (x - mean) * rstd, 0.0)
        if HAS_W:
            w = tl.load(W + offs, mask=m, other=0.0).to(tl.float32)
            g = dy * w
        else:
            g = dy
        acc1 += g * xhat
        acc2 += g
    tl.store(C1 + row, tl.sum(acc1, axis=0) / N)
    tl.store(C2 + row, tl.sum(acc2, axis=0) / N)


@triton.jit
def _ln_bwd_dx_wide_kernel(
    DY, X, W, Mean, Rstd, C1, C2, DX, Part,
    M, N, stride_dy, stride_x,
    HAS_W: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Wide rows: program (pid_n, pid_m) handles column tile pid_n for row tiles
    # pid_m, pid_m + nprog_m, ...; writes dx and one partial row of dw/db sums.
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    nprog_m = tl.num_programs(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    if HAS_W:
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    num_tiles = tl.cdiv(M, BLOCK_M)
    for tile in range(pid_m, num_tiles, nprog_m):
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < M
        mask = row_mask[:, None] & col_mask[None, :]
        rows64 = rows.to(tl.int64)
        x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0,
                    eviction_policy="evict_first").to(tl.float32)
        dy = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0,
                     eviction_policy="evict_first").to(tl.float32)
        mean = tl.load(Mean + rows, mask=row_mask, other=0.0)
        rstd = tl.load(Rstd + rows, mask=row_mask, other=0.0)
        c1 = tl.load(C1 + rows, mask=row_mask, other=0.0)
        c2 = tl.load(C2 + rows, mask=row_mask, other=0.0)
        xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        if HAS_W:
            g = dy * w[None, :]
        else:
            g = dy
        dx = rstd[:, None] * (g - xhat * c1[:, None] - c2[:, None])
        tl.store(DX + rows64[:, None] * N + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        if HAS_W:
            dw_acc += dy * xhat
        db_acc += dy
    db = tl.sum(db_acc, axis=0)
    tl.store(Part + pid_m.to(tl.int64) * N + cols, db, mask=col_mask)
    if HAS_W:
        dw = tl.sum(dw_acc, axis=0)
        tl.store(Part + (nprog_m + pid_m).to(tl.int64) * N + cols, dw, mask=col_mask)


@triton.jit
def _colsum_kernel(Part, Out, G, N, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr):
    # Out[k, n] = sum_g Part[k, g, n], fixed order -> deterministic. k = 0: dbias, k = 1: dweight.
    pid_n = tl.program_id(0)
    k = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    base = Part + (k * G).to(tl.int64) * N
    acc = tl.zeros([BLOCK_G, BLOCK_N], dtype=tl.float32)
    for g0 in range(0, G, BLOCK_G):
        rows = g0 + tl.arange(0, BLOCK_G)
        m = (rows < G)[:, None] & cmask[None, :]
        acc += tl.load(base + rows.to(tl.int64)[:, None] * N + cols[None, :], mask=m, other=0.0)
    s = tl.sum(acc, axis=0)
    tl.store(Out + k.to(tl.int64) * N + cols, s.to(Out.dtype.element_ty), mask=cmask)


# ----------------------------------------------------------------------------------------------
# Python entry points
# ----------------------------------------------------------------------------------------------
def layernorm_fwd(x, weight, bias, eps):
    """Returns (y, mean, rstd)."""
    M, N = x.shape
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    mean = torch.empty((M,), dtype=torch.float32, device=x.device)
    rstd = torch.empty((M,), dtype=torch.float32, device=x.device)
    has_w = weight is not None
    has_b = bias is not None
    w_arg = weight if has_w else x  # dummy pointer, never read
    b_arg = bias if has_b else x
    eps = float(eps)

    block_m, block_n, num_warps = _tile_cfg(M, N)
    if block_n <= _FWD_FUSED_MAX_BLOCK:
        grid = (triton.cdiv(M, block_m),)
        _ln_fwd_fused_kernel[grid](
            x, y, w_arg, b_arg, mean, rstd,
            M, N, x.stride(0), eps,
            HAS_W=has_w, HAS_B=has_b, BLOCK_M=block_m, BLOCK_N=block_n,
            num_warps=num_warps,
        )
    else:
        _ln_fwd_wide_kernel[(M,)](
            x, y, w_arg, b_arg, mean, rstd,
            N, x.stride(0), eps,
            HAS_W=has_w, HAS_B=has_b, BLOCK_N=_WIDE_CHUNK,
            num_warps=_WIDE_WARPS,
        )
    return y, mean, rstd


def layernorm_bwd(dy, x, weight, mean, rstd):
    """Returns (dx, dweight, dbias)."""
    M, N = x.shape
    dx = torch.empty((M, N), dtype=x.dtype, device=x.device)
    has_w = weight is not None
    K = 2 if has_w else 1
    w_arg = weight if has_w else x  # dummy pointer, never read
    nsm = _num_sms(x)

    block_m, block_n, num_warps = _tile_cfg(M, N)
    if block_n <= _BWD_FUSED_MAX_BLOCK:
        num_tiles = triton.cdiv(M, block_m)
        threads = num_warps * 32
        per_sm = max(1, 512 // threads)
        G = max(1, min(nsm * per_sm, num_tiles))
        part = torch.empty((K, G, N), dtype=torch.float32, device=x.device)
        _ln_bwd_fused_kernel[(G,)](
            dy, x, w_arg, mean, rstd, dx, part,
            M, N, dy.stride(0), x.stride(0),
            HAS_W=has_w, BLOCK_M=block_m, BLOCK_N=block_n,
            num_warps=num_warps,
        )
    else:
        c = torch.empty((2, M), dtype=torch.float32, device=x.device)
        c1 = c[0]
        c2 = c[1]
        _ln_bwd_rowstats_kernel[(M,)](
            dy, x, w_arg, mean, rstd, c1, c2,
            N, dy.stride(0), x.stride(0),
            HAS_W=has_w, BLOCK_N=_WIDE_CHUNK,
            num_warps=_WIDE_WARPS,
        )
        n_col = triton.cdiv(N, _DX_BLOCK_N)
        n_row_tiles = triton.cdiv(M, _DX_BLOCK_M)
        G = max(1, min(n_row_tiles, triton.cdiv(nsm * 8, n_col)))
        part = torch.empty((K, G, N), dtype=torch.float32, device=x.device)
        _ln_bwd_dx_wide_kernel[(n_col, G)](
            dy, x, w_arg, mean, rstd, c1, c2, dx, part,
            M, N, dy.stride(0), x.stride(0),
            HAS_W=has_w, BLOCK_M=_DX_BLOCK_M, BLOCK_N=_DX_BLOCK_N,
            num_warps=_DX_WARPS,
        )

    out = torch.empty((K, N), dtype=x.dtype, device=x.device)
    red_bn = min(_RED_MAX_BLOCK_N, max(16, triton.next_power_of_2(N)))
    _colsum_kernel[(triton.cdiv(N, red_bn), K)](
        part, out, G, N,
        BLOCK_G=_RED_BLOCK_G, BLOCK_N=red_bn,
        num_warps=4,
    )
    dbias = out[0]
    dweight = out[1] if has_w else None
    return dx, dweight, dbias
