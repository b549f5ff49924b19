import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@gluon.jit
def _fwd_rows_kernel(X, R, W, Y, RO, RSTD, M, N, stride_x, stride_r, eps,
                     HAS_W: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                     layout: gl.constexpr):
    # A [BLOCK_M, BLOCK_N] tile holds BLOCK_M whole rows (BLOCK_N >= N).
    row_l: gl.constexpr = gl.SliceLayout(1, layout)
    col_l: gl.constexpr = gl.SliceLayout(0, layout)
    pid = gl.program_id(0)
    rows = pid * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_l)
    cols = gl.arange(0, BLOCK_N, layout=col_l)
    rmask = rows < M
    cmask = cols < N
    mask = gl.expand_dims(rmask, 1) & gl.expand_dims(cmask, 0)
    rows64 = rows.to(gl.int64)
    c2 = gl.expand_dims(cols, 0)

    x = gl.load(X + (gl.expand_dims(rows64 * stride_x, 1) + c2), mask=mask, other=0.0).to(gl.float32)
    r = gl.load(R + (gl.expand_dims(rows64 * stride_r, 1) + c2), mask=mask, other=0.0).to(gl.float32)
    h = (x + r).to(RO.dtype.element_ty)  # the one rounding of the forward
    o_off = gl.expand_dims(rows64 * N, 1) + c2
    gl.store(RO + o_off, h, mask=mask)

    hf = h.to(gl.float32)  # statistics from residual_out as stored
    ss = gl.sum(hf * hf, axis=1)
    rstd = gl.rsqrt(ss / N + eps)
    gl.store(RSTD + rows, rstd, mask=rmask)

    y = hf * gl.expand_dims(rstd, 1)
    if HAS_W:
        w = gl.load(W + cols, mask=cmask, other=0.0).to(gl.float32)
        y = y * gl.expand_dims(w, 0)
    gl.store(Y + o_off, y.to(Y.dtype.element_ty), mask=mask)


@gluon.jit
def _fwd_wide_kernel(X, R, W, Y, RO, RSTD, N, stride_x, stride_r, eps,
                     HAS_W: gl.constexpr, BLOCK_N: gl.constexpr, layout: gl.constexpr):
    # One program per row; the row is walked in [1, BLOCK_N] chunks.
    row_l: gl.constexpr = gl.SliceLayout(1, layout)
    col_l: gl.constexpr = gl.SliceLayout(0, layout)
    row = gl.program_id(0)
    rows = row + gl.arange(0, 1, layout=row_l)
    rows64 = rows.to(gl.int64)
    cols0 = gl.arange(0, BLOCK_N, layout=col_l)
    xb = gl.expand_dims(rows64 * stride_x, 1)
    rb = gl.expand_dims(rows64 * stride_r, 1)
    ob = gl.expand_dims(rows64 * N, 1)

    acc = gl.zeros([1, BLOCK_N], gl.float32, layout=layout)
    for start in range(0, N, BLOCK_N):
        c2 = gl.expand_dims(start + cols0, 0)
        mask = c2 < N
        x = gl.load(X + (xb + c2), mask=mask, other=0.0).to(gl.float32)
        r = gl.load(R + (rb + c2), mask=mask, other=0.0).to(gl.float32)
        h = (x + r).to(RO.dtype.element_ty)
        gl.store(RO + (ob + c2), h, mask=mask)
        hf = h.to(gl.float32)
        acc += hf * hf
    ss = gl.sum(acc, axis=1)
    rstd = gl.rsqrt(ss / N + eps)
    gl.store(RSTD + rows, rstd)
    rstd2 = gl.expand_dims(rstd, 1)

    # Second pass re-reads residual_out (written by the very same threads, mostly L2-resident).
    for start in range(0, N, BLOCK_N):
        c2 = gl.expand_dims(start + cols0, 0)
        mask = c2 < N
        hf = gl.load(RO + (ob + c2), mask=mask, other=0.0).to(gl.float32)
        y = hf * rstd2
        if HAS_W:
            w = gl.load(W + c2, mask=mask, other=0.0).to(gl.float32)
            y = y * w
        gl.store(Y + (ob + c2), y.to(Y.dtype.element_ty), mask=mask)


@gluon.jit
def _bwd_rows_kernel(DY, DRO, RO, W, RSTD, DH, DWP, M, N, stride_dy, stride_dro, stride_ro,
                     num_tiles,
                     HAS_DRO: gl.constexpr, HAS_W: gl.constexpr,
                     BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, layout: gl.constexpr):
    # Persistent: each program walks tiles of BLOCK_M whole rows and keeps its dweight
    # partial sums in registers; they are written once to DWP[pid, :].
    row_l: gl.constexpr = gl.SliceLayout(1, layout)
    col_l: gl.constexpr = gl.SliceLayout(0, layout)
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    cols = gl.arange(0, BLOCK_N, layout=col_l)
    cmask = cols < N
    c2 = gl.expand_dims(cols, 0)
    cm2 = gl.expand_dims(cmask, 0)
    arange_m = gl.arange(0, BLOCK_M, layout=row_l)

    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=layout)
    for tile in range(pid, num_tiles, nprog):
        rows = tile * BLOCK_M + arange_m
        rmask = rows < M
        mask = gl.expand_dims(rmask, 1) & cm2
        rows64 = rows.to(gl.int64)
        dy = gl.load(DY + (gl.expand_dims(rows64 * stride_dy, 1) + c2), mask=mask, other=0.0).to(gl.float32)
        h = gl.load(RO + (gl.expand_dims(rows64 * stride_ro, 1) + c2), mask=mask, other=0.0).to(gl.float32)
        rstd = gl.load(RSTD + rows, mask=rmask, other=0.0)
        rstd2 = gl.expand_dims(rstd, 1)
        xhat = h * rstd2
        if HAS_W:
            acc += dy * xhat
            w = gl.load(W + cols, mask=cmask, other=0.0).to(gl.float32)
            g = dy * gl.expand_dims(w, 0)
        else:
            g = dy
        c = gl.sum(g * xhat, axis=1) / N
        dh = rstd2 * (g - xhat * gl.expand_dims(c, 1))
        if HAS_DRO:
            dro = gl.load(DRO + (gl.expand_dims(rows64 * stride_dro, 1) + c2), mask=mask, other=0.0).to(gl.float32)
            dh = dh + dro
        gl.store(DH + (gl.expand_dims(rows64 * N, 1) + c2), dh.to(DH.dtype.element_ty), mask=mask)
    if HAS_W:
        dw = gl.sum(acc, axis=0)
        gl.store(DWP + pid * N + cols, dw, mask=cmask)


@gluon.jit
def _bwd_stats_kernel(DY, RO, W, RSTD, C, N, stride_dy, stride_ro,
                      HAS_W: gl.constexpr, BLOCK_N: gl.constexpr, layout: gl.constexpr):
    # Wide rows, step 1: C[row] = mean(g * xhat) over the row.
    row_l: gl.constexpr = gl.SliceLayout(1, layout)
    col_l: gl.constexpr = gl.SliceLayout(0, layout)
    row = gl.program_id(0)
    rows = row + gl.arange(0, 1, layout=row_l)
    rows64 = rows.to(gl.int64)
    cols0 = gl.arange(0, BLOCK_N, layout=col_l)
    dyb = gl.expand_dims(rows64 * stride_dy, 1)
    rob = gl.expand_dims(rows64 * stride_ro, 1)
    rstd2 = gl.expand_dims(gl.load(RSTD + rows), 1)

    acc = gl.zeros([1, BLOCK_N], gl.float32, layout=layout)
    for start in range(0, N, BLOCK_N):
        c2 = gl.expand_dims(start + cols0, 0)
        mask = c2 < N
        dy = gl.load(DY + (dyb + c2), mask=mask, other=0.0).to(gl.float32)
        h = gl.load(RO + (rob + c2), mask=mask, other=0.0).to(gl.float32)
        xhat = h * rstd2
        if HAS_W:
            w = gl.load(W + c2, mask=mask, other=0.0).to(gl.float32)
            g = dy * w
        else:
            g = dy
        acc += g * xhat
    c = gl.sum(acc, axis=1) / N
    gl.store(C + rows, c)


@gluon.jit
def _bwd_cols_kernel(DY, DRO, RO, W, RSTD, C, DH, DWP, M, N, stride_dy, stride_dro, stride_ro,
                     rows_per_group,
                     HAS_DRO: gl.constexpr, HAS_W: gl.constexpr,
                     BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, layout: gl.constexpr):
    # Wide rows, step 2: program (column block, row group) writes dh for its block and the
    # dweight partial sums of its row group into DWP[group, cols].
    row_l: gl.constexpr = gl.SliceLayout(1, layout)
    col_l: gl.constexpr = gl.SliceLayout(0, layout)
    pid_n = gl.program_id(0)
    pid_g = gl.program_id(1)
    cols = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=col_l)
    cmask = cols < N
    c2 = gl.expand_dims(cols, 0)
    cm2 = gl.expand_dims(cmask, 0)
    if HAS_W:
        w2 = gl.expand_dims(gl.load(W + cols, mask=cmask, other=0.0).to(gl.float32), 0)
    arange_m = gl.arange(0, BLOCK_M, layout=row_l)
    row_start = pid_g * rows_per_group

    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=layout)
    for r0 in range(row_start, row_start + rows_per_group, BLOCK_M):
        rows = r0 + arange_m
        rmask = rows < M
        mask = gl.expand_dims(rmask, 1) & cm2
        rows64 = rows.to(gl.int64)
        dy = gl.load(DY + (gl.expand_dims(rows64 * stride_dy, 1) + c2), mask=mask, other=0.0).to(gl.float32)
        h = gl.load(RO + (gl.expand_dims(rows64 * stride_ro, 1) + c2), mask=mask, other=0.0).to(gl.float32)
        rstd = gl.load(RSTD + rows, mask=rmask, other=0.0)
        c = gl.load(C + rows, mask=rmask, other=0.0)
        rstd2 = gl.expand_dims(rstd, 1)
        xhat = h * rstd2
        if HAS_W:
            acc += dy * xhat
            g = dy * w2
        else:
            g = dy
        dh = rstd2 * (g - xhat * gl.expand_dims(c, 1))
        if HAS_DRO:
            dro = gl.load(DRO + (gl.expand_dims(rows64 * stride_dro, 1) + c2), mask=mask, other=0.0).to(gl.float32)
            dh = dh + dro
        gl.store(DH + (gl.expand_dims(rows64 * N, 1) + c2), dh.to(DH.dtype.element_ty), mask=mask)
    if HAS_W:
        dw = gl.sum(acc, axis=0)
        gl.store(DWP + pid_g * N + cols, dw, mask=cmask)


# ----------------------------------------------------------------------------------------------
# Host-side configuration (plain functions of N / dtype; no autotuning)
# ----------------------------------------------------------------------------------------------


def _cdiv(a, b):
    return (a + b - 1) // b


def _next_pow2(n):
    n = int(n)
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


@functools.lru_cache(maxsize=None)
def _sm_count(device_index):
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _dev_index(t):
    return t.device.index if t.device.index is not None else torch.cuda.current_device()


def _warps_for(block_n):
    return min(16, max(4, block_n // 1024))


@functools.lru_cache(maxsize=None)
def _rows_cfg(block_n, elem_size):
    """Layout for [BLOCK_M, BLOCK_N] tiles of whole rows. Returns (block_m, num_warps, layout)."""
    nw = _warps_for(block_n)
    vec = max(1, min(16 // elem_size, block_n))
    tpw_n = min(32, block_n // vec)
    tpw_m = 32 // tpw_n
    wpc_n = min(nw, max(1, block_n // (vec * tpw_n)))
    wpc_m = nw // wpc_n
    foot_m = tpw_m * wpc_m
    block_m = max(foot_m, (nw * 32 * 16) // block_n)  # about 16 elements per thread
    layout = gl.BlockedLayout([1, vec], [tpw_m, tpw_n], [wpc_m, wpc_n], [1, 0])
    return block_m, nw, layout


@functools.lru_cache(maxsize=None)
def _chunk_cfg(elem_size, nw):
    """Layout for [1, CHUNK] chunks of one row. Returns (chunk, layout)."""
    vec = max(1, 16 // elem_size)
    chunk = vec * 32 * nw * 2
    layout = gl.BlockedLayout([1, vec], [1, 32], [1, nw], [1, 0])
    return chunk, layout


_FWD_MAX_ROW_BYTES = 65536  # whole row in registers up to this many bytes (bf16: N <= 32768)
_BWD_MAX_ROW_BYTES = 32768  # (bf16: N <= 16384)


# ----------------------------------------------------------------------------------------------
# Public functions
# ----------------------------------------------------------------------------------------------


def add_rmsnorm_fwd(x, residual, weight, eps):
    M, N = x.shape
    dev = x.device
    y = torch.empty((M, N), dtype=x.dtype, device=dev)
    residual_out = torch.empty((M, N), dtype=x.dtype, device=dev)
    rstd = torch.empty((M,), dtype=torch.float32, device=dev)
    has_w = weight is not None
    w = weight if has_w else x
    es = x.element_size()
    block_n = _next_pow2(N)
    eps = float(eps)

    if block_n * es <= _FWD_MAX_ROW_BYTES:
        block_m, nw, layout = _rows_cfg(block_n, es)
        grid = (_cdiv(M, block_m),)
        _fwd_rows_kernel[grid](
            x, residual, w, y, residual_out, rstd, M, N, x.stride(0), residual.stride(0), eps,
            HAS_W=has_w, BLOCK_M=block_m, BLOCK_N=block_n, layout=layout, num_warps=nw,
        )
    else:
        nw = 8
        chunk, layout = _chunk_cfg(es, nw)
        _fwd_wide_kernel[(M,)](
            x, residual, w, y, residual_out, rstd, N, x.stride(0), residual.stride(0), eps,
            HAS_W=has_w, BLOCK_N=chunk, layout=layout, num_warps=nw,
        )
    return y, residual_out, rstd


def add_rmsnorm_bwd(dy, dresidual_out, residual_out, weight, rstd):
    M, N = dy.shape
    dev = dy.device
    dh = torch.empty((M, N), dtype=residual_out.dtype, device=dev)
    has_w = weight is not None
    has_dro = dresidual_out is not None
    w = weight if has_w else dy
    dro = dresidual_out if has_dro else dy
    es = dy.element_size()
    block_n = _next_pow2(N)
    sms = _sm_count(_dev_index(dy))

    if block_n * es <= _BWD_MAX_ROW_BYTES:
        block_m, nw, layout = _rows_cfg(block_n, es)
        num_tiles = _cdiv(M, block_m)
        nprog = max(1, min(num_tiles, sms * max(1, 32 // nw)))
        dwp = torch.empty((nprog, N), dtype=torch.float32, device=dev) if has_w else dh
        _bwd_rows_kernel[(nprog,)](
            dy, dro, residual_out, w, rstd, dh, dwp, M, N,
            dy.stride(0), dro.stride(0), residual_out.stride(0), num_tiles,
            HAS_DRO=has_dro, HAS_W=has_w, BLOCK_M=block_m, BLOCK_N=block_n, layout=layout,
            num_warps=nw,
        )
    else:
        # Step 1: per-row mean(g * xhat).
        nw_a = 8
        chunk_a, layout_a = _chunk_cfg(es, nw_a)
        cbuf = torch.empty((M,), dtype=torch.float32, device=dev)
        _bwd_stats_kernel[(M,)](
            dy, residual_out, w, rstd, cbuf, N, dy.stride(0), residual_out.stride(0),
            HAS_W=has_w, BLOCK_N=chunk_a, layout=layout_a, num_warps=nw_a,
        )
        # Step 2: column blocks x row groups: dh and dweight partials.
        nw_b = 4
        chunk_b, layout_b = _chunk_cfg(es, nw_b)
        ncb = _cdiv(N, chunk_b)
        groups = max(1, min(M, _cdiv(sms * 8, ncb), 65535))
        rows_per_group = _cdiv(M, groups)
        groups = _cdiv(M, rows_per_group)
        dwp = torch.empty((groups, N), dtype=torch.float32, device=dev) if has_w else dh
        _bwd_cols_kernel[(ncb, groups)](
            dy, dro, residual_out, w, rstd, cbuf, dh, dwp, M, N,
            dy.stride(0), dro.stride(0), residual_out.stride(0), rows_per_group,
            HAS_DRO=has_dro, HAS_W=has_w, BLOCK_M=1, BLOCK_N=chunk_b, layout=layout_b,
            num_warps=nw_b,
        )

    # Fixed-order (deterministic) fp32 reduction of the per-program partial sums, then cast.
    dweight = dwp.sum(dim=0).to(weight.dtype) if has_w else None
    return dh, dweight
