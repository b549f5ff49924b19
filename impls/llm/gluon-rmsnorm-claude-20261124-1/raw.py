import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

# ----------------------------------------------------------------------------
# Tuning constants (plain Python, no autotune)
# ----------------------------------------------------------------------------
_FWD_SINGLE_MAX = 16384   # widest padded row kept whole in registers (forward)
_BWD_SINGLE_MAX = 8192    # widest padded row kept whole in registers (backward)
_FWD_CHUNK = 8192         # chunk width for the per-row two-pass forward
_FWD_CHUNK_WARPS = 16
_SPLIT_BLOCK = 1024       # column tile of the column-split kernels
_SPLIT_ROWS = 2
_SPLIT_WARPS = 4

_SM_COUNT = {}


def _num_sms(device):
    idx = device.index if device.index is not None else torch.cuda.current_device()
    n = _SM_COUNT.get(idx)
    if n is None:
        n = torch.cuda.get_device_properties(idx).multi_processor_count
        _SM_COUNT[idx] = n
    return n


def _cdiv(a, b):
    return (a + b - 1) // b


def _next_pow2(n):
    return 1 << max(0, int(n) - 1).bit_length()


def _vec(elem_size, block_n):
    # 16-byte vectors along the row
    return max(1, min(16 // elem_size, block_n))


def _blocked(rows, block_n, vec, num_warps):
    tpw_n = min(32, max(1, block_n // vec))
    tpw_m = 32 // tpw_n
    wpc_n = min(num_warps, max(1, block_n // (vec * tpw_n)))
    wpc_m = num_warps // wpc_n
    return gl.BlockedLayout([1, vec], [tpw_m, tpw_n], [wpc_m, wpc_n], [1, 0])


def _row_tile(M, N, elem_size, max_block, per_thread=16, min_tile=2048, max_warps=16):
    block_n = min(_next_pow2(N), max_block)
    vec = _vec(elem_size, block_n)
    rows = 1
    if block_n < min_tile:
        rows = max(1, min(min_tile // block_n, _next_pow2(M)))
    nw = max(1, min(max_warps, (rows * block_n) // (32 * per_thread)))
    return block_n, vec, rows, nw


def _align(vec, N, *strides):
    # If N and all row strides are multiples of vec, pass them divided by vec and
    # multiply back in the kernel by a constexpr so the compiler can prove alignment.
    if N % vec == 0 and all(s % vec == 0 for s in strides):
        return vec
    return 1


# ----------------------------------------------------------------------------
# Forward kernels
# ----------------------------------------------------------------------------
@gluon.jit
def _fwd_row_kernel(X, Y, W, RSTD, M, N_a, sx_a, sy_a, eps,
                    HAS_W: gl.constexpr, ALIGN: gl.constexpr, ROWS: gl.constexpr,
                    BLOCK_N: gl.constexpr, layout: gl.constexpr):
    row_l: gl.constexpr = gl.SliceLayout(1, layout)
    col_l: gl.constexpr = gl.SliceLayout(0, layout)
    N = N_a * ALIGN
    pid = gl.program_id(0)
    rows = pid * ROWS + gl.arange(0, ROWS, layout=row_l)
    cols = gl.arange(0, BLOCK_N, layout=col_l)
    rmask = rows < M
    cmask = cols < N
    mask = gl.expand_dims(rmask, 1) & gl.expand_dims(cmask, 0)
    rows64 = rows.to(gl.int64)
    cols2 = gl.expand_dims(cols, 0)

    x_ptrs = X + (gl.expand_dims(rows64 * sx_a * ALIGN, 1) + cols2)
    x = gl.load(x_ptrs, mask=mask, other=0.0).to(gl.float32)
    ss = gl.sum(x * x, axis=1)
    rstd = gl.rsqrt(ss / N + eps)
    gl.store(RSTD + rows, rstd, mask=rmask)

    y = x * gl.expand_dims(rstd, 1)
    if HAS_W:
        w = gl.load(W + cols, mask=cmask, other=0.0).to(gl.float32)
        y = y * gl.expand_dims(w, 0)
    y_ptrs = Y + (gl.expand_dims(rows64 * sy_a * ALIGN, 1) + cols2)
    gl.store(y_ptrs, y.to(Y.dtype.element_ty), mask=mask)


@gluon.jit
def _fwd_chunked_kernel(X, Y, W, RSTD, M, N_a, sx_a, sy_a, eps,
                        HAS_W: gl.constexpr, ALIGN: gl.constexpr,
                        BLOCK_N: gl.constexpr, layout: gl.constexpr):
    # One row per program; pass 1 accumulates sum(x^2) chunk by chunk, pass 2
    # walks the chunks in reverse order (most recently read data first: cache reuse).
    row_l: gl.constexpr = gl.SliceLayout(1, layout)
    col_l: gl.constexpr = gl.SliceLayout(0, layout)
    N = N_a * ALIGN
    pid = gl.program_id(0)
    rows = pid + gl.arange(0, 1, layout=row_l)
    rmask = rows < M
    rmask2 = gl.expand_dims(rmask, 1)
    rows64 = rows.to(gl.int64)
    x_row = X + gl.expand_dims(rows64 * sx_a * ALIGN, 1)
    y_row = Y + gl.expand_dims(rows64 * sy_a * ALIGN, 1)
    cols = gl.arange(0, BLOCK_N, layout=col_l)

    acc = gl.zeros([1, BLOCK_N], gl.float32, layout=layout)
    for start in range(0, N, BLOCK_N):
        c = start + cols
        m = rmask2 & gl.expand_dims(c < N, 0)
        x = gl.load(x_row + gl.expand_dims(c, 0), mask=m, other=0.0).to(gl.float32)
        acc += x * x
    ss = gl.sum(acc, axis=1)
    rstd = gl.rsqrt(ss / N + eps)
    gl.store(RSTD + rows, rstd, mask=rmask)
    rstd2 = gl.expand_dims(rstd, 1)

    nchunks = (N + BLOCK_N - 1) // BLOCK_N
    for i in range(0, nchunks):
        start = (nchunks - 1 - i) * BLOCK_N
        c = start + cols
        cm = c < N
        m = rmask2 & gl.expand_dims(cm, 0)
        c2 = gl.expand_dims(c, 0)
        x = gl.load(x_row + c2, mask=m, other=0.0).to(gl.float32)
        y = x * rstd2
        if HAS_W:
            w = gl.load(W + c, mask=cm, other=0.0).to(gl.float32)
            y = y * gl.expand_dims(w, 0)
        gl.store(y_row + c2, y.to(Y.dtype.element_ty), mask=m)


@gluon.jit
def _fwd_sumsq_kernel(X, PART, M, N_a, sx_a,
                      ALIGN: gl.constexpr, ROWS: gl.constexpr,
                      BLOCK_C: gl.constexpr, layout: gl.constexpr):
    # Column-split partial sum of squares: PART[pid_n, row]
    row_l: gl.constexpr = gl.SliceLayout(1, layout)
    col_l: gl.constexpr = gl.SliceLayout(0, layout)
    N = N_a * ALIGN
    pid_m = gl.program_id(0)
    pid_n = gl.program_id(1)
    rows = pid_m * ROWS + gl.arange(0, ROWS, layout=row_l)
    cols = pid_n * BLOCK_C + gl.arange(0, BLOCK_C, layout=col_l)
    rmask = rows < M
    cmask = cols < N
    mask = gl.expand_dims(rmask, 1) & gl.expand_dims(cmask, 0)
    rows64 = rows.to(gl.int64)
    x_ptrs = X + (gl.expand_dims(rows64 * sx_a * ALIGN, 1) + gl.expand_dims(cols, 0))
    x = gl.load(x_ptrs, mask=mask, other=0.0).to(gl.float32)
    part = gl.sum(x * x, axis=1)
    gl.store(PART + pid_n.to(gl.int64) * M + rows, part, mask=rmask)


@gluon.jit
def _fwd_apply_kernel(X, Y, W, SS, RSTD, M, N_a, sx_a, sy_a, eps,
                      HAS_W: gl.constexpr, ALIGN: gl.constexpr, ROWS: gl.constexpr,
                      BLOCK_C: gl.constexpr, layout: gl.constexpr):
    row_l: gl.constexpr = gl.SliceLayout(1, layout)
    col_l: gl.constexpr = gl.SliceLayout(0, layout)
    N = N_a * ALIGN
    pid_m = gl.program_id(0)
    pid_n = gl.program_id(1)
    rows = pid_m * ROWS + gl.arange(0, ROWS, layout=row_l)
    cols = pid_n * BLOCK_C + gl.arange(0, BLOCK_C, layout=col_l)
    rmask = rows < M
    cmask = cols < N
    mask = gl.expand_dims(rmask, 1) & gl.expand_dims(cmask, 0)
    rows64 = rows.to(gl.int64)
    cols2 = gl.expand_dims(cols, 0)

    ss = gl.load(SS + rows, mask=rmask, other=0.0)
    rstd = gl.rsqrt(ss / N + eps)
    gl.store(RSTD + rows, rstd, mask=rmask & (pid_n == 0))

    x = gl.load(X + (gl.expand_dims(rows64 * sx_a * ALIGN, 1) + cols2),
                mask=mask, other=0.0).to(gl.float32)
    y = x * gl.expand_dims(rstd, 1)
    if HAS_W:
        w = gl.load(W + cols, mask=cmask, other=0.0).to(gl.float32)
        y = y * gl.expand_dims(w, 0)
    gl.store(Y + (gl.expand_dims(rows64 * sy_a * ALIGN, 1) + cols2),
             y.to(Y.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------
# Backward kernels
# ----------------------------------------------------------------------------
@gluon.jit
def _bwd_row_kernel(DY, X, W, RSTD, DX, DWP, M, N_a, sdy_a, sx_a, sdx_a,
                    HAS_W: gl.constexpr, ALIGN: gl.constexpr, ROWS: gl.constexpr,
                    BLOCK_N: gl.constexpr, layout: gl.constexpr):
    # Persistent: program pid handles row tiles pid, pid + P, ...; whole rows in
    # registers; dweight partial per program in registers, written once to DWP[pid].
    row_l: gl.constexpr = gl.SliceLayout(1, layout)
    col_l: gl.constexpr = gl.SliceLayout(0, layout)
    N = N_a * ALIGN
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    cols = gl.arange(0, BLOCK_N, layout=col_l)
    cmask = cols < N
    cmask2 = gl.expand_dims(cmask, 0)
    cols2 = gl.expand_dims(cols, 0)
    if HAS_W:
        w2 = gl.expand_dims(gl.load(W + cols, mask=cmask, other=0.0).to(gl.float32), 0)
    acc = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=layout)
    rr = gl.arange(0, ROWS, layout=row_l)
    num_tiles = (M + ROWS - 1) // ROWS
    for tile in range(pid, num_tiles, nprog):
        rows = tile * ROWS + rr
        rmask = rows < M
        mask = gl.expand_dims(rmask, 1) & cmask2
        rows64 = rows.to(gl.int64)
        x = gl.load(X + (gl.expand_dims(rows64 * sx_a * ALIGN, 1) + cols2),
                    mask=mask, other=0.0).to(gl.float32)
        dy = gl.load(DY + (gl.expand_dims(rows64 * sdy_a * ALIGN, 1) + cols2),
                     mask=mask, other=0.0).to(gl.float32)
        rstd = gl.load(RSTD + rows, mask=rmask, other=0.0)
        rstd2 = gl.expand_dims(rstd, 1)
        xhat = x * rstd2
        if HAS_W:
            g = dy * w2
            acc += dy * xhat
        else:
            g = dy
        c = gl.sum(g * xhat, axis=1) / N
        dx = rstd2 * (g - xhat * gl.expand_dims(c, 1))
        gl.store(DX + (gl.expand_dims(rows64 * sdx_a * ALIGN, 1) + cols2),
                 dx.to(DX.dtype.element_ty), mask=mask)
    if HAS_W:
        dw = gl.sum(acc, axis=0)
        gl.store(DWP + pid.to(gl.int64) * N + cols, dw, mask=cmask)


@gluon.jit
def _bwd_dot_kernel(DY, X, W, RSTD, PART, M, N_a, sdy_a, sx_a,
                    HAS_W: gl.constexpr, ALIGN: gl.constexpr, ROWS: gl.constexpr,
                    BLOCK_C: gl.constexpr, layout: gl.constexpr):
    # Wide rows, step 1: PART[pid_n, row] = sum over the column tile of g * xhat
    row_l: gl.constexpr = gl.SliceLayout(1, layout)
    col_l: gl.constexpr = gl.SliceLayout(0, layout)
    N = N_a * ALIGN
    pid_m = gl.program_id(0)
    pid_n = gl.program_id(1)
    rows = pid_m * ROWS + gl.arange(0, ROWS, layout=row_l)
    cols = pid_n * BLOCK_C + gl.arange(0, BLOCK_C, layout=col_l)
    rmask = rows < M
    cmask = cols < N
    mask = gl.expand_dims(rmask, 1) & gl.expand_dims(cmask, 0)
    rows64 = rows.to(gl.int64)
    cols2 = gl.expand_dims(cols, 0)
    x = gl.load(X + (gl.expand_dims(rows64 * sx_a * ALIGN, 1) + cols2),
                mask=mask, other=0.0).to(gl.float32)
    dy = gl.load(DY + (gl.expand_dims(rows64 * sdy_a * ALIGN, 1) + cols2),
                 mask=mask, other=0.0).to(gl.float32)
    rstd = gl.load(RSTD + rows, mask=rmask, other=0.0)
    xhat = x * gl.expand_dims(rstd, 1)
    if HAS_W:
        w = gl.load(W + cols, mask=cmask, other=0.0).to(gl.float32)
        g = dy * gl.expand_dims(w, 0)
    else:
        g = dy
    part = gl.sum(g * xhat, axis=1)
    gl.store(PART + pid_n.to(gl.int64) * M + rows, part, mask=rmask)


@gluon.jit
def _bwd_col_kernel(DY, X, W, RSTD, CDOT, DX, DWP, M, N_a, sdy_a, sx_a, sdx_a,
                    HAS_W: gl.constexpr, ALIGN: gl.constexpr, ROWS: gl.constexpr,
                    BLOCK_C: gl.constexpr, layout: gl.constexpr):
    # Wide rows, step 2: program (pid_n, pid_g) owns one column tile and the row
    # tiles pid_g, pid_g + G, ...; writes dx and one dweight partial DWP[pid_g, tile].
    row_l: gl.constexpr = gl.SliceLayout(1, layout)
    col_l: gl.constexpr = gl.SliceLayout(0, layout)
    N = N_a * ALIGN
    pid_n = gl.program_id(0)
    pid_g = gl.program_id(1)
    ng = gl.num_programs(1)
    cols = pid_n * BLOCK_C + gl.arange(0, BLOCK_C, layout=col_l)
    cmask = cols < N
    cmask2 = gl.expand_dims(cmask, 0)
    cols2 = gl.expand_dims(cols, 0)
    if HAS_W:
        w2 = gl.expand_dims(gl.load(W + cols, mask=cmask, other=0.0).to(gl.float32), 0)
    acc = gl.zeros([ROWS, BLOCK_C], gl.float32, layout=layout)
    rr = gl.arange(0, ROWS, layout=row_l)
    num_tiles = (M + ROWS - 1) // ROWS
    for tile in range(pid_g, num_tiles, ng):
        rows = tile * ROWS + rr
        rmask = rows < M
        mask = gl.expand_dims(rmask, 1) & cmask2
        rows64 = rows.to(gl.int64)
        x = gl.load(X + (gl.expand_dims(rows64 * sx_a * ALIGN, 1) + cols2),
                    mask=mask, other=0.0).to(gl.float32)
        dy = gl.load(DY + (gl.expand_dims(rows64 * sdy_a * ALIGN, 1) + cols2),
                     mask=mask, other=0.0).to(gl.float32)
        rstd = gl.load(RSTD + rows, mask=rmask, other=0.0)
        cd = gl.load(CDOT + rows, mask=rmask, other=0.0)
        rstd2 = gl.expand_dims(rstd, 1)
        xhat = x * rstd2
        if HAS_W:
            g = dy * w2
            acc += dy * xhat
        else:
            g = dy
        c = cd / N
        dx = rstd2 * (g - xhat * gl.expand_dims(c, 1))
        gl.store(DX + (gl.expand_dims(rows64 * sdx_a * ALIGN, 1) + cols2),
                 dx.to(DX.dtype.element_ty), mask=mask)
    if HAS_W:
        dw = gl.sum(acc, axis=0)
        gl.store(DWP + pid_g.to(gl.int64) * N + cols, dw, mask=cmask)


# ----------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------
def rmsnorm_fwd(x: torch.Tensor, weight, eps: float):
    """Returns (y, rstd)."""
    M, N = x.shape
    dev = x.device
    y = torch.empty((M, N), dtype=x.dtype, device=dev)
    rstd = torch.empty((M,), dtype=torch.float32, device=dev)
    has_w = weight is not None
    w = weight if has_w else x
    elem = x.element_size()
    sx = x.stride(0)
    eps = float(eps)

    if _next_pow2(N) <= _FWD_SINGLE_MAX:
        block_n, vec, rows, nw = _row_tile(M, N, elem, _FWD_SINGLE_MAX)
        al = _align(vec, N, sx)
        layout = _blocked(rows, block_n, vec, nw)
        _fwd_row_kernel[(_cdiv(M, rows),)](
            x, y, w, rstd, M, N // al, sx // al, N // al, eps,
            HAS_W=has_w, ALIGN=al, ROWS=rows, BLOCK_N=block_n, layout=layout,
            num_warps=nw)
    elif M >= 2 * _num_sms(dev):
        vec = _vec(elem, _FWD_CHUNK)
        al = _align(vec, N, sx)
        layout = _blocked(1, _FWD_CHUNK, vec, _FWD_CHUNK_WARPS)
        _fwd_chunked_kernel[(M,)](
            x, y, w, rstd, M, N // al, sx // al, N // al, eps,
            HAS_W=has_w, ALIGN=al, BLOCK_N=_FWD_CHUNK, layout=layout,
            num_warps=_FWD_CHUNK_WARPS)
    else:
        # few very wide rows: split each row over many programs
        vec = _vec(elem, _SPLIT_BLOCK)
        al = _align(vec, N, sx)
        layout = _blocked(_SPLIT_ROWS, _SPLIT_BLOCK, vec, _SPLIT_WARPS)
        ncb = _cdiv(N, _SPLIT_BLOCK)
        nrb = _cdiv(M, _SPLIT_ROWS)
        part = torch.empty((ncb, M), dtype=torch.float32, device=dev)
        _fwd_sumsq_kernel[(nrb, ncb)](
            x, part, M, N // al, sx // al,
            ALIGN=al, ROWS=_SPLIT_ROWS, BLOCK_C=_SPLIT_BLOCK, layout=layout,
            num_warps=_SPLIT_WARPS)
        ss = part.sum(dim=0)  # fixed-order fp32 reduction over column tiles
        _fwd_apply_kernel[(nrb, ncb)](
            x, y, w, ss, rstd, M, N // al, sx // al, N // al, eps,
            HAS_W=has_w, ALIGN=al, ROWS=_SPLIT_ROWS, BLOCK_C=_SPLIT_BLOCK,
            layout=layout, num_warps=_SPLIT_WARPS)
    return y, rstd


def rmsnorm_bwd(dy: torch.Tensor, x: torch.Tensor, weight, rstd: torch.Tensor):
    """Returns (dx, dweight)."""
    M, N = x.shape
    dev = x.device
    dx = torch.empty((M, N), dtype=x.dtype, device=dev)
    has_w = weight is not None
    w = weight if has_w else x
    elem = x.element_size()
    sx = x.stride(0)
    sdy = dy.stride(0)
    nsm = _num_sms(dev)
    dweight = None

    if _next_pow2(N) <= _BWD_SINGLE_MAX:
        block_n, vec, rows, nw = _row_tile(M, N, elem, _BWD_SINGLE_MAX)
        al = _align(vec, N, sx, sdy)
        layout = _blocked(rows, block_n, vec, nw)
        num_tiles = _cdiv(M, rows)
        cps = max(2, min(8, 32 // nw))
        P = max(1, min(num_tiles, nsm * cps))
        dwp = torch.empty((P, N), dtype=torch.float32, device=dev) if has_w else rstd
        _bwd_row_kernel[(P,)](
            dy, x, w, rstd, dx, dwp, M, N // al, sdy // al, sx // al, N // al,
            HAS_W=has_w, ALIGN=al, ROWS=rows, BLOCK_N=block_n, layout=layout,
            num_warps=nw)
        if has_w:
            dweight = dwp.sum(dim=0).to(weight.dtype)
    else:
        vec = _vec(elem, _SPLIT_BLOCK)
        al = _align(vec, N, sx, sdy)
        layout = _blocked(_SPLIT_ROWS, _SPLIT_BLOCK, vec, _SPLIT_WARPS)
        ncb = _cdiv(N, _SPLIT_BLOCK)
        nrb = _cdiv(M, _SPLIT_ROWS)
        part = torch.empty((ncb, M), dtype=torch.float32, device=dev)
        _bwd_dot_kernel[(nrb, ncb)](
            dy, x, w, rstd, part, M, N // al, sdy // al, sx // al,
            HAS_W=has_w, ALIGN=al, ROWS=_SPLIT_ROWS, BLOCK_C=_SPLIT_BLOCK,
            layout=layout, num_warps=_SPLIT_WARPS)
        cdot = part.sum(dim=0)  # (M,) sum of g * xhat per row, fixed order
        G = max(1, min(nrb, _cdiv(8 * nsm, ncb)))
        dwp = torch.empty((G, N), dtype=torch.float32, device=dev) if has_w else rstd
        _bwd_col_kernel[(ncb, G)](
            dy, x, w, rstd, cdot, dx, dwp, M, N // al, sdy // al, sx // al, N // al,
            HAS_W=has_w, ALIGN=al, ROWS=_SPLIT_ROWS, BLOCK_C=_SPLIT_BLOCK,
            layout=layout, num_warps=_SPLIT_WARPS)
        if has_w:
            dweight = dwp.sum(dim=0).to(weight.dtype)
    return dx, dweight
