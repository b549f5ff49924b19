import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

# ------------------------------------------------------------------------------------------
# Tuning constants (plain Python heuristics, no autotuning)
# ------------------------------------------------------------------------------------------
_PER_THREAD = 16          # tile elements held per thread
_FWD_FUSED_MAX = 16384    # forward: whole (padded) row in registers up to this width
_BWD_FUSED_MAX = 8192     # backward: row + dweight/dbias accumulators in registers up to this width
_FWD_CHUNK, _FWD_CHUNK_WARPS = 8192, 16   # wide forward: chunk walked along the row
_BWD_CHUNK, _BWD_CHUNK_WARPS = 4096, 8    # wide backward: row statistics kernel
_DX_BLOCK = 512                           # wide backward: column block of the dx kernel


# ------------------------------------------------------------------------------------------
# Forward, whole row in registers (N <= 16384)
# ------------------------------------------------------------------------------------------
@gluon.jit
def _ln_fwd_kernel(X, Y, W, B, Mean, Rstd, M, N, stride_x, stride_y, eps,
                   HAS_W: gl.constexpr, HAS_B: gl.constexpr, ROWS: gl.constexpr,
                   BLOCK_N: gl.constexpr, layout: gl.constexpr):
    row_l: gl.constexpr = gl.SliceLayout(1, layout)
    col_l: gl.constexpr = gl.SliceLayout(0, layout)
    pid = gl.program_id(0)
    rows = pid * ROWS + gl.arange(0, ROWS, layout=row_l)
    cols = gl.arange(0, BLOCK_N, layout=col_l)
    rmask = rows < M
    cmask = cols < N
    mask = gl.expand_dims(rmask, 1) & gl.expand_dims(cmask, 0)
    r64 = gl.expand_dims(rows.to(gl.int64), 1)
    cols2 = gl.expand_dims(cols, 0)
    inv_n = 1.0 / N

    x = gl.load(X + r64 * stride_x + cols2, mask=mask, other=0.0).to(gl.float32)
    mean = gl.sum(x, axis=1) * inv_n
    xc = gl.where(mask, x - gl.expand_dims(mean, 1), 0.0)          # centred (two-pass) variance
    var = gl.sum(xc * xc, axis=1) * inv_n
    rstd = gl.rsqrt(var + eps)
    y = xc * gl.expand_dims(rstd, 1)
    if HAS_W:
        w = gl.load(W + cols, mask=cmask, other=0.0).to(gl.float32)
        y = y * gl.expand_dims(w, 0)
    if HAS_B:
        b = gl.load(B + cols, mask=cmask, other=0.0).to(gl.float32)
        y = y + gl.expand_dims(b, 0)
    gl.store(Y + r64 * stride_y + cols2, y.to(Y.dtype.element_ty), mask=mask)
    gl.store(Mean + rows, mean, mask=rmask)
    gl.store(Rstd + rows, rstd, mask=rmask)


# ------------------------------------------------------------------------------------------
# Forward, wide rows (N > 16384): one program per row, walked in chunks.
# Pass 1: per-lane Welford over the full chunks (next chunk prefetched), folded across lanes,
#         tail folded in with a shift by the running mean (well conditioned).
# Pass 2: normalise walking the chunks backwards, so the most recently read ones hit L2.
# ------------------------------------------------------------------------------------------
@gluon.jit
def _ln_fwd_wide_kernel(X, Y, W, B, Mean, Rstd, N, stride_x, stride_y, eps,
                        HAS_W: gl.constexpr, HAS_B: gl.constexpr,
                        BLOCK_N: gl.constexpr, layout: gl.constexpr):
    row_l: gl.constexpr = gl.SliceLayout(1, layout)
    col_l: gl.constexpr = gl.SliceLayout(0, layout)
    rows = gl.program_id(0) + gl.arange(0, 1, layout=row_l)
    r64 = gl.expand_dims(rows.to(gl.int64), 1)
    x_row = X + r64 * stride_x
    y_row = Y + r64 * stride_y
    cols2 = gl.expand_dims(gl.arange(0, BLOCK_N, layout=col_l), 0)
    n_full = N // BLOCK_N          # >= 2 (guaranteed by the host)
    inv_n = 1.0 / N
    t_cols = cols2 + n_full * BLOCK_N
    t_mask = t_cols < N

    # ---- pass 1: statistics --------------------------------------------------------------
    x0 = gl.load(x_row + cols2)
    x_nxt = gl.load(x_row + (cols2 + BLOCK_N))
    xt_raw = gl.load(x_row + t_cols, mask=t_mask, other=0.0)
    mean_v = x0.to(gl.float32)
    m2_v = gl.zeros([1, BLOCK_N], gl.float32, layout=layout)
    for c in range(1, n_full):
        cur1 = x_nxt
        cn1 = c + 1 - (c + 1) // n_full                 # min(c + 1, n_full - 1)
        x_nxt = gl.load(x_row + (cols2 + cn1 * BLOCK_N))
        xv1 = cur1.to(gl.float32)
        delta = xv1 - mean_v
        mean_v = mean_v + delta * (1.0 / (c + 1))
        m2_v = m2_v + delta * (xv1 - mean_v)
    # x_nxt now holds chunk n_full - 1: the first chunk of pass 2.

    mean_f = gl.sum(mean_v, axis=1) * (1.0 / BLOCK_N)
    dm = mean_v - gl.expand_dims(mean_f, 1)
    m2_f = gl.sum(m2_v, axis=1) + gl.sum(dm * dm, axis=1) * n_full
    xt = xt_raw.to(gl.float32)
    dt = gl.where(t_mask, xt - gl.expand_dims(mean_f, 1), 0.0)
    s1 = gl.sum(dt, axis=1)
    s2 = gl.sum(dt * dt, axis=1)
    mean = mean_f + s1 * inv_n
    var = gl.maximum((m2_f + s2 - s1 * s1 * inv_n) * inv_n, 0.0)
    rstd = gl.rsqrt(var + eps)
    gl.store(Mean + rows, mean)
    gl.store(Rstd + rows, rstd)
    mean2 = gl.expand_dims(mean, 1)
    rstd2 = gl.expand_dims(rstd, 1)

    # ---- pass 2: normalise ---------------------------------------------------------------
    last_cols = cols2 + (n_full - 1) * BLOCK_N
    if HAS_W:
        w_nxt = gl.load(W + last_cols)
    if HAS_B:
        b_nxt = gl.load(B + last_cols)
    yt = (xt - mean2) * rstd2
    if HAS_W:
        yt = yt * gl.load(W + t_cols, mask=t_mask, other=0.0).to(gl.float32)
    if HAS_B:
        yt = yt + gl.load(B + t_cols, mask=t_mask, other=0.0).to(gl.float32)
    gl.store(y_row + t_cols, yt.to(Y.dtype.element_ty), mask=t_mask)

    for i in range(0, n_full):
        ci = n_full - 1 - i
        cc2 = cols2 + ci * BLOCK_N
        cn2 = cols2 + (ci - 1 + (n_full - ci) // n_full) * BLOCK_N   # max(ci - 1, 0)
        cur2 = x_nxt
        x_nxt = gl.load(x_row + cn2)
        if HAS_W:
            w_cur = w_nxt
            w_nxt = gl.load(W + cn2)
        if HAS_B:
            b_cur = b_nxt
            b_nxt = gl.load(B + cn2)
        yv = (cur2.to(gl.float32) - mean2) * rstd2
        if HAS_W:
            yv = yv * w_cur.to(gl.float32)
        if HAS_B:
            yv = yv + b_cur.to(gl.float32)
        gl.store(y_row + cc2, yv.to(Y.dtype.element_ty))


# ------------------------------------------------------------------------------------------
# Backward, fused (N <= 8192): persistent programs, row blocks software-pipelined,
# dweight/dbias accumulated in registers, one fp32 partial row per program.
# ------------------------------------------------------------------------------------------
@gluon.jit
def _ln_bwd_fused_kernel(DY, X, W, Mean, Rstd, DX, DWp, DBp, M, N, num_blocks,
                         stride_dy, stride_x, stride_dx,
                         HAS_W: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
                         layout: gl.constexpr):
    row_l: gl.constexpr = gl.SliceLayout(1, layout)
    col_l: gl.constexpr = gl.SliceLayout(0, layout)
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    r_ar = gl.arange(0, ROWS, layout=row_l)
    cols = gl.arange(0, BLOCK_N, layout=col_l)
    cmask = cols < N
    cols2 = gl.expand_dims(cols, 0)
    cmask2 = gl.expand_dims(cmask, 0)
    inv_n = 1.0 / N
    dw_acc = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=layout)
    db_acc = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=layout)

    p_rows = pid * ROWS + r_ar
    p_rmask = p_rows < M
    p_mask = gl.expand_dims(p_rmask, 1) & cmask2
    p64 = gl.expand_dims(p_rows.to(gl.int64), 1)
    x_nxt = gl.load(X + p64 * stride_x + cols2, mask=p_mask, other=0.0)
    dy_nxt = gl.load(DY + p64 * stride_dy + cols2, mask=p_mask, other=0.0)
    mean_nxt = gl.load(Mean + p_rows, mask=p_rmask, other=0.0)
    rstd_nxt = gl.load(Rstd + p_rows, mask=p_rmask, other=0.0)
    if HAS_W:
        w_nxt = gl.load(W + cols, mask=cmask, other=0.0)

    for blk in range(pid, num_blocks, nprog):
        x_cur = x_nxt
        dy_cur = dy_nxt
        mean_cur = mean_nxt
        rstd_cur = rstd_nxt
        # issue the loads of the next row block before working on this one
        n_rows = (blk + nprog) * ROWS + r_ar
        n_rmask = n_rows < M
        n_mask = gl.expand_dims(n_rmask, 1) & cmask2
        n64 = gl.expand_dims(n_rows.to(gl.int64), 1)
        x_nxt = gl.load(X + n64 * stride_x + cols2, mask=n_mask, other=0.0)
        dy_nxt = gl.load(DY + n64 * stride_dy + cols2, mask=n_mask, other=0.0)
        mean_nxt = gl.load(Mean + n_rows, mask=n_rmask, other=0.0)
        rstd_nxt = gl.load(Rstd + n_rows, mask=n_rmask, other=0.0)
        if HAS_W:
            w_cur = w_nxt
            w_nxt = gl.load(W + cols, mask=cmask, other=0.0)

        rstd2 = gl.expand_dims(rstd_cur, 1)
        xhat = (x_cur.to(gl.float32) - gl.expand_dims(mean_cur, 1)) * rstd2
        dy = dy_cur.to(gl.float32)
        if HAS_W:
            g = dy * gl.expand_dims(w_cur.to(gl.float32), 0)
        else:
            g = dy
        c1 = gl.sum(g * xhat, axis=1) * inv_n
        c2 = gl.sum(g, axis=1) * inv_n
        dx = (g - xhat * gl.expand_dims(c1, 1) - gl.expand_dims(c2, 1)) * rstd2
        rows = blk * ROWS + r_ar
        mask = gl.expand_dims(rows < M, 1) & cmask2
        r64 = gl.expand_dims(rows.to(gl.int64), 1)
        gl.store(DX + r64 * stride_dx + cols2, dx.to(DX.dtype.element_ty), mask=mask)
        if HAS_W:
            dw_acc += dy * xhat
        db_acc += dy

    gl.store(DBp + pid * N + cols, gl.sum(db_acc, axis=0), mask=cmask)
    if HAS_W:
        gl.store(DWp + pid * N + cols, gl.sum(dw_acc, axis=0), mask=cmask)


# ------------------------------------------------------------------------------------------
# Backward, wide rows (N > 8192), step 1: per-row c1 = mean(g * xhat), c2 = mean(g)
# ------------------------------------------------------------------------------------------
@gluon.jit
def _ln_bwd_stats_kernel(DY, X, W, Mean, Rstd, C1, C2, N, stride_dy, stride_x,
                         HAS_W: gl.constexpr, BLOCK_N: gl.constexpr, layout: gl.constexpr):
    row_l: gl.constexpr = gl.SliceLayout(1, layout)
    col_l: gl.constexpr = gl.SliceLayout(0, layout)
    rows = gl.program_id(0) + gl.arange(0, 1, layout=row_l)
    r64 = gl.expand_dims(rows.to(gl.int64), 1)
    x_row = X + r64 * stride_x
    dy_row = DY + r64 * stride_dy
    cols2 = gl.expand_dims(gl.arange(0, BLOCK_N, layout=col_l), 0)
    n_full = N // BLOCK_N          # >= 2 (guaranteed by the host)
    t_cols = cols2 + n_full * BLOCK_N
    t_mask = t_cols < N

    x_nxt = gl.load(x_row + cols2)
    dy_nxt = gl.load(dy_row + cols2)
    if HAS_W:
        w_nxt = gl.load(W + cols2)
    xt_raw = gl.load(x_row + t_cols, mask=t_mask, other=0.0)
    dyt_raw = gl.load(dy_row + t_cols, mask=t_mask, other=0.0)
    mean2 = gl.expand_dims(gl.load(Mean + rows), 1)
    rstd2 = gl.expand_dims(gl.load(Rstd + rows), 1)
    acc1 = gl.zeros([1, BLOCK_N], gl.float32, layout=layout)
    acc2 = gl.zeros([1, BLOCK_N], gl.float32, layout=layout)
    for c in range(0, n_full):
        off_n = cols2 + (c + 1 - (c + 1) // n_full) * BLOCK_N    # min(c + 1, n_full - 1)
        x_cur = x_nxt
        dy_cur = dy_nxt
        x_nxt = gl.load(x_row + off_n)
        dy_nxt = gl.load(dy_row + off_n)
        if HAS_W:
            w_cur = w_nxt
            w_nxt = gl.load(W + off_n)
        xhat = (x_cur.to(gl.float32) - mean2) * rstd2
        g = dy_cur.to(gl.float32)
        if HAS_W:
            g = g * w_cur.to(gl.float32)
        acc1 += g * xhat
        acc2 += g

    gt = dyt_raw.to(gl.float32)
    if HAS_W:
        gt = gt * gl.load(W + t_cols, mask=t_mask, other=0.0).to(gl.float32)
    acc1 += gt * ((xt_raw.to(gl.float32) - mean2) * rstd2)
    acc2 += gt
    inv_n = 1.0 / N
    gl.store(C1 + rows, gl.sum(acc1, axis=1) * inv_n)
    gl.store(C2 + rows, gl.sum(acc2, axis=1) * inv_n)


# ------------------------------------------------------------------------------------------
# Backward, wide rows, step 2: 2-D tiles (column block x row group), dx plus fp32 partial
# dweight/dbias per row group. Row blocks software-pipelined.
# ------------------------------------------------------------------------------------------
@gluon.jit
def _ln_bwd_dx_kernel(DY, X, W, Mean, Rstd, C1, C2, DX, DWp, DBp, M, N, num_blocks,
                      stride_dy, stride_x, stride_dx,
                      HAS_W: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
                      layout: gl.constexpr):
    row_l: gl.constexpr = gl.SliceLayout(1, layout)
    col_l: gl.constexpr = gl.SliceLayout(0, layout)
    pid_n = gl.program_id(0)
    pid_m = gl.program_id(1)
    nprog_m = gl.num_programs(1)
    r_ar = gl.arange(0, ROWS, layout=row_l)
    cols = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=col_l)
    cmask = cols < N
    cols2 = gl.expand_dims(cols, 0)
    cmask2 = gl.expand_dims(cmask, 0)
    if HAS_W:
        w2 = gl.expand_dims(gl.load(W + cols, mask=cmask, other=0.0).to(gl.float32), 0)
    dw_acc = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=layout)
    db_acc = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=layout)

    p_rows = pid_m * ROWS + r_ar
    p_rmask = p_rows < M
    p_mask = gl.expand_dims(p_rmask, 1) & cmask2
    p64 = gl.expand_dims(p_rows.to(gl.int64), 1)
    x_nxt = gl.load(X + p64 * stride_x + cols2, mask=p_mask, other=0.0)
    dy_nxt = gl.load(DY + p64 * stride_dy + cols2, mask=p_mask, other=0.0)
    mean_nxt = gl.load(Mean + p_rows, mask=p_rmask, other=0.0)
    rstd_nxt = gl.load(Rstd + p_rows, mask=p_rmask, other=0.0)
    c1_nxt = gl.load(C1 + p_rows, mask=p_rmask, other=0.0)
    c2_nxt = gl.load(C2 + p_rows, mask=p_rmask, other=0.0)

    for blk in range(pid_m, num_blocks, nprog_m):
        x_cur = x_nxt
        dy_cur = dy_nxt
        mean_cur = mean_nxt
        rstd_cur = rstd_nxt
        c1_cur = c1_nxt
        c2_cur = c2_nxt
        n_rows = (blk + nprog_m) * ROWS + r_ar
        n_rmask = n_rows < M
        n_mask = gl.expand_dims(n_rmask, 1) & cmask2
        n64 = gl.expand_dims(n_rows.to(gl.int64), 1)
        x_nxt = gl.load(X + n64 * stride_x + cols2, mask=n_mask, other=0.0)
        dy_nxt = gl.load(DY + n64 * stride_dy + cols2, mask=n_mask, other=0.0)
        mean_nxt = gl.load(Mean + n_rows, mask=n_rmask, other=0.0)
        rstd_nxt = gl.load(Rstd + n_rows, mask=n_rmask, other=0.0)
        c1_nxt = gl.load(C1 + n_rows, mask=n_rmask, other=0.0)
        c2_nxt = gl.load(C2 + n_rows, mask=n_rmask, other=0.0)

        rstd2 = gl.expand_dims(rstd_cur, 1)
        xhat = (x_cur.to(gl.float32) - gl.expand_dims(mean_cur, 1)) * rstd2
        dy = dy_cur.to(gl.float32)
        if HAS_W:
            g = dy * w2
        else:
            g = dy
        dx = (g - xhat * gl.expand_dims(c1_cur, 1) - gl.expand_dims(c2_cur, 1)) * rstd2
        rows = blk * ROWS + r_ar
        mask = gl.expand_dims(rows < M, 1) & cmask2
        r64 = gl.expand_dims(rows.to(gl.int64), 1)
        gl.store(DX + r64 * stride_dx + cols2, dx.to(DX.dtype.element_ty), mask=mask)
        if HAS_W:
            dw_acc += dy * xhat
        db_acc += dy

    gl.store(DBp + pid_m * N + cols, gl.sum(db_acc, axis=0), mask=cmask)
    if HAS_W:
        gl.store(DWp + pid_m * N + cols, gl.sum(dw_acc, axis=0), mask=cmask)


# ------------------------------------------------------------------------------------------
# Deterministic reduction of the (G, N) fp32 partials into dweight / dbias (fixed order)
# ------------------------------------------------------------------------------------------
@gluon.jit
def _reduce_partials_kernel(DWp, DBp, DW, DB, G, N,
                            HAS_W: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
                            layout: gl.constexpr):
    row_l: gl.constexpr = gl.SliceLayout(1, layout)
    col_l: gl.constexpr = gl.SliceLayout(0, layout)
    r_ar = gl.arange(0, ROWS, layout=row_l)
    cols = gl.program_id(0) * BLOCK_N + gl.arange(0, BLOCK_N, layout=col_l)
    cmask = cols < N
    cols2 = gl.expand_dims(cols, 0)
    cmask2 = gl.expand_dims(cmask, 0)
    acc_w = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=layout)
    acc_b = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=layout)
    for r0 in range(0, G, ROWS):
        prow = r0 + r_ar
        pmask = gl.expand_dims(prow < G, 1) & cmask2
        offs = gl.expand_dims(prow, 1) * N + cols2
        acc_b += gl.load(DBp + offs, mask=pmask, other=0.0)
        if HAS_W:
            acc_w += gl.load(DWp + offs, mask=pmask, other=0.0)
    gl.store(DB + cols, gl.sum(acc_b, axis=0).to(DB.dtype.element_ty), mask=cmask)
    if HAS_W:
        gl.store(DW + cols, gl.sum(acc_w, axis=0).to(DW.dtype.element_ty), mask=cmask)


# ------------------------------------------------------------------------------------------
# Host-side helpers
# ------------------------------------------------------------------------------------------
def _next_pow2(n):
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _cdiv(a, b):
    return (a + b - 1) // b


@functools.lru_cache(maxsize=None)
def _num_sms(device_index):
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.lru_cache(maxsize=None)
def _layout_2d(block_n, num_warps, vec):
    """Row-major blocked layout for a [rows, block_n] tile; also returns the rows it covers."""
    vec = max(1, min(vec, block_n))
    tpw_n = min(32, block_n // vec)
    tpw_m = 32 // tpw_n
    wpc_n = min(num_warps, max(1, block_n // (vec * tpw_n)))
    wpc_m = num_warps // wpc_n
    layout = gl.BlockedLayout([1, vec], [tpw_m, tpw_n], [wpc_m, wpc_n], [1, 0])
    return layout, tpw_m * wpc_m


@functools.lru_cache(maxsize=None)
def _row_tile(block_n, vec, max_warps=16):
    """(num_warps, rows per tile, layout) for a [rows, block_n] tile of ~16 elements/thread."""
    num_warps = max(4, min(max_warps, block_n // (32 * _PER_THREAD)))
    rows = max(1, (num_warps * 32 * _PER_THREAD) // block_n)
    layout, rows_covered = _layout_2d(block_n, num_warps, vec)
    return num_warps, max(rows, rows_covered), layout


def _reduce_partials(dwp, dbp, dweight, dbias, G, N):
    has_w = dweight is not None
    block = min(_next_pow2(N), 64 if N <= 65536 else 256)
    num_warps = 4
    layout, rows_covered = _layout_2d(block, num_warps, 4)
    rows = max(rows_covered, (num_warps * 32 * _PER_THREAD) // block)
    _reduce_partials_kernel[(_cdiv(N, block),)](
        dwp if has_w else dbp, dbp, dweight if has_w else dbias, dbias, G, N,
        HAS_W=has_w, ROWS=rows, BLOCK_N=block, layout=layout, num_warps=num_warps)


# ------------------------------------------------------------------------------------------
# Public API
# ------------------------------------------------------------------------------------------
def layernorm_fwd(x, weight, bias, eps):
    M, N = x.shape
    dev = x.device
    y = torch.empty((M, N), dtype=x.dtype, device=dev)
    mean = torch.empty((M,), dtype=torch.float32, device=dev)
    rstd = torch.empty((M,), dtype=torch.float32, device=dev)
    has_w = weight is not None
    has_b = bias is not None
    w = weight if has_w else mean      # dummy pointer, never read
    b = bias if has_b else mean
    vec = max(1, 16 // x.element_size())
    block_n = _next_pow2(N)
    eps = float(eps)
    with torch.cuda.device(dev):
        if block_n <= _FWD_FUSED_MAX:
            nw, rows, layout = _row_tile(block_n, vec)
            _ln_fwd_kernel[(_cdiv(M, rows),)](
                x, y, w, b, mean, rstd, M, N, x.stride(0), y.stride(0), eps,
                HAS_W=has_w, HAS_B=has_b, ROWS=rows, BLOCK_N=block_n, layout=layout,
                num_warps=nw)
        else:  # N > 16384 >= 2 * _FWD_CHUNK
            layout, _ = _layout_2d(_FWD_CHUNK, _FWD_CHUNK_WARPS, vec)
            _ln_fwd_wide_kernel[(M,)](
                x, y, w, b, mean, rstd, N, x.stride(0), y.stride(0), eps,
                HAS_W=has_w, HAS_B=has_b, BLOCK_N=_FWD_CHUNK, layout=layout,
                num_warps=_FWD_CHUNK_WARPS)
    return y, mean, rstd


def layernorm_bwd(dy, x, weight, mean, rstd):
    M, N = x.shape
    dev = x.device
    has_w = weight is not None
    pdtype = weight.dtype if has_w else x.dtype
    dx = torch.empty((M, N), dtype=x.dtype, device=dev)
    dweight = torch.empty((N,), dtype=pdtype, device=dev) if has_w else None
    dbias = torch.empty((N,), dtype=pdtype, device=dev)
    w = weight if has_w else mean      # dummy pointer, never read
    vec = max(1, 16 // max(x.element_size(), dy.element_size()))
    block_n = _next_pow2(N)
    with torch.cuda.device(dev):
        sms = _num_sms(torch.cuda.current_device())
        if block_n <= _BWD_FUSED_MAX:
            nw, rows, layout = _row_tile(block_n, vec)
            num_blocks = _cdiv(M, rows)
            G = max(1, min(num_blocks, sms * max(1, 16 // nw)))
            dbp = torch.empty((G, N), dtype=torch.float32, device=dev)
            dwp = torch.empty((G, N), dtype=torch.float32, device=dev) if has_w else dbp
            _ln_bwd_fused_kernel[(G,)](
                dy, x, w, mean, rstd, dx, dwp, dbp, M, N, num_blocks,
                dy.stride(0), x.stride(0), dx.stride(0),
                HAS_W=has_w, ROWS=rows, BLOCK_N=block_n, layout=layout, num_warps=nw)
        else:  # N > 8192 >= 2 * _BWD_CHUNK
            c1 = torch.empty((M,), dtype=torch.float32, device=dev)
            c2 = torch.empty((M,), dtype=torch.float32, device=dev)
            s_layout, _ = _layout_2d(_BWD_CHUNK, _BWD_CHUNK_WARPS, vec)
            _ln_bwd_stats_kernel[(M,)](
                dy, x, w, mean, rstd, c1, c2, N, dy.stride(0), x.stride(0),
                HAS_W=has_w, BLOCK_N=_BWD_CHUNK, layout=s_layout,
                num_warps=_BWD_CHUNK_WARPS)
            nw, rows, layout = _row_tile(_DX_BLOCK, vec)
            num_blocks = _cdiv(M, rows)
            n_col_blocks = _cdiv(N, _DX_BLOCK)
            G = max(1, min(num_blocks, (sms * 4) // n_col_blocks))
            dbp = torch.empty((G, N), dtype=torch.float32, device=dev)
            dwp = torch.empty((G, N), dtype=torch.float32, device=dev) if has_w else dbp
            _ln_bwd_dx_kernel[(n_col_blocks, G)](
                dy, x, w, mean, rstd, c1, c2, dx, dwp, dbp, M, N, num_blocks,
                dy.stride(0), x.stride(0), dx.stride(0),
                HAS_W=has_w, ROWS=rows, BLOCK_N=_DX_BLOCK, layout=layout, num_warps=nw)
        _reduce_partials(dwp, dbp, dweight, dbias, G, N)
    return dx, dweight, dbias
