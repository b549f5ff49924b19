"""LayerNorm forward / backward in CuTe DSL (nvidia-cutlass-dsl 4.x), targeting sm_90."""
import torch

import cutlass
import cutlass.cute as cute
import cutlass.utils
from cutlass.cute.runtime import make_ptr

try:
    import cuda.bindings.driver as _cuda
except ImportError:  # older cuda-python layout
    from cuda import cuda as _cuda

F32 = cutlass.Float32
_TORCH2CUTE = {
    torch.bfloat16: cutlass.BFloat16,
    torch.float16: cutlass.Float16,
    torch.float32: cutlass.Float32,
}
_MAX_TPR = 256                    # <= 256 threads per CTA: any register allocation can launch
_SMEM_CACHE_BUDGET = 192 * 1024   # per-CTA smem used to cache wide rows in the forward
_SMEM_PER_SM = 227 * 1024


# --------------------------------------------------------------------------------------
# trace-time helpers (plain Python, no DSL control flow)
# --------------------------------------------------------------------------------------
def _rmem_list(count, n, dtype):
    """`count` register tensors of `n` elements each."""
    make = getattr(cute, "make_rmem_tensor", None) or cute.make_fragment
    return [make(cute.make_layout(n), dtype) for _ in range(count)]


def _views(sT, t, count, g):
    """Per-thread (VEC,) views sT[:, t, i, g] for i < count."""
    return [sT[None, t, i, g] for i in range(count)]


def _vsum(v):
    return v.reduce(cute.ReductionOp.ADD, init_val=0.0, reduction_profile=0)


def _inv_sqrt(v):
    m = getattr(cute, "math", None)
    if m is not None and hasattr(m, "sqrt"):
        return F32(1.0) / m.sqrt(v)          # sqrt.rn + div.rn: <= ~1.5 ulp
    if m is not None and hasattr(m, "rsqrt"):
        return m.rsqrt(v)
    return cute.arch.rsqrt(v)


# --------------------------------------------------------------------------------------
# shared per-row machinery
# --------------------------------------------------------------------------------------
class _RowOp:
    """A row is viewed as NV vectors of VEC contiguous elements. A group of TPR threads owns a
    row; thread t of the group handles vectors j = c*SPAN + k*TPR + t (k < K) of chunk c."""

    def _setup(self, dtype, N, vec, tpr, k):
        self.dtype = dtype
        self.N = N
        self.vec = vec
        self.nv = N // vec
        self.tpr = tpr
        self.k = k
        self.span = tpr * k
        self.nwarps = tpr // 32
        self.rows = 4 if tpr == 32 else 1   # rows (warps) per CTA when a warp owns a row

    def _rows_tensor(self, p, M, stride):
        return cute.make_tensor(p, cute.make_layout((self.vec, self.nv, M), stride=(1, self.vec, stride)))

    def _vec_tensor(self, p):
        return cute.make_tensor(p, cute.make_layout((self.vec, self.nv), stride=(1, self.vec)))

    def _scalar_tensor(self, p, M):
        return cute.make_tensor(p, cute.make_layout((M,), stride=(1,)))

    @cute.jit
    def _load(self, frags, src, row, c, t):
        for k in cutlass.range_constexpr(self.k):
            j = c * self.span + k * self.tpr + t
            if j < self.nv:
                frags[k].store(src[None, j, row].load())

    @cute.jit
    def _merge(self, na, sa, qa, nb, sb, qb):
        # Chan et al. merge of (count, sum, M2); bitwise symmetric in (a, b).
        n = na + nb
        s = sa + sb
        q = qa + qb
        if na * nb > 0.0:
            d = sb / nb - sa / na
            q = q + d * d * (na * nb / n)
        return n, s, q

    @cute.jit
    def _reduce_stats(self, n, s, q, t, sRed):
        for i in cutlass.range_constexpr(5):
            n2 = cute.arch.shuffle_sync_bfly(n, offset=1 << i)
            s2 = cute.arch.shuffle_sync_bfly(s, offset=1 << i)
            q2 = cute.arch.shuffle_sync_bfly(q, offset=1 << i)
            n, s, q = self._merge(n, s, q, n2, s2, q2)
        if cutlass.const_expr(self.nwarps > 1):
            w = t // 32
            if t % 32 == 0:
                sRed[0, w] = n
                sRed[1, w] = s
                sRed[2, w] = q
            cute.arch.barrier()
            n = sRed[0, 0]
            s = sRed[1, 0]
            q = sRed[2, 0]
            for i in cutlass.range_constexpr(1, self.nwarps):
                n, s, q = self._merge(n, s, q, sRed[0, i], sRed[1, i], sRed[2, i])
            cute.arch.barrier()
        return n, s, q

    @cute.jit
    def _reduce_sum2(self, a, b, t, sRed):
        for i in cutlass.range_constexpr(5):
            a = a + cute.arch.shuffle_sync_bfly(a, offset=1 << i)
            b = b + cute.arch.shuffle_sync_bfly(b, offset=1 << i)
        if cutlass.const_expr(self.nwarps > 1):
            w = t // 32
            if t % 32 == 0:
                sRed[0, w] = a
                sRed[1, w] = b
            cute.arch.barrier()
            a = sRed[0, 0]
            b = sRed[1, 0]
            for i in cutlass.range_constexpr(1, self.nwarps):
                a = a + sRed[0, i]
                b = b + sRed[1, i]
            cute.arch.barrier()
        return a, b


# --------------------------------------------------------------------------------------
# forward
# --------------------------------------------------------------------------------------
class _LNFwd(_RowOp):
    def __init__(self, dtype, es, N, S, vec, tpr, k, nch, sc, has_w, has_b):
        self._setup(dtype, N, vec, tpr, k)
        self.S = S
        self.nch = nch          # chunks per row
        self.sc = sc            # chunks cached in shared memory (when nch > 1)
        self.has_w = has_w
        self.has_b = has_b
        self.smem_bytes = 512 + 12 * self.nwarps + sc * self.span * vec * es

    @cute.jit
    def __call__(self, pY: cute.Pointer, pX: cute.Pointer, pW: cute.Pointer, pB: cute.Pointer,
                 pMean: cute.Pointer, pRstd: cute.Pointer, M: cutlass.Int32, eps: cutlass.Float32,
                 nblocks: cutlass.Int32, stream: _cuda.CUstream):
        mX = self._rows_tensor(pX, M, self.S)
        mY = self._rows_tensor(pY, M, self.N)
        mW = self._vec_tensor(pW)
        mB = self._vec_tensor(pB)
        mMean = self._scalar_tensor(pMean, M)
        mRstd = self._scalar_tensor(pRstd, M)
        self.kernel(mY, mX, mW, mB, mMean, mRstd, M, eps, nblocks).launch(
            grid=[nblocks, 1, 1], block=[self.tpr * self.rows, 1, 1],
            smem=self.smem_bytes, stream=stream)

    @cute.jit
    def _local_stats(self, frags, c, t):
        cnt = F32(0.0)
        s = F32(0.0)
        for k in cutlass.range_constexpr(self.k):
            j = c * self.span + k * self.tpr + t
            if j < self.nv:
                cnt = cnt + float(self.vec)
                s = s + _vsum(frags[k].load().to(F32))
        q = F32(0.0)
        if cnt > 0.0:
            m = s / cnt
            for k in cutlass.range_constexpr(self.k):
                j = c * self.span + k * self.tpr + t
                if j < self.nv:
                    d = frags[k].load().to(F32) - m
                    q = q + _vsum(d * d)
        return cnt, s, q

    @cute.jit
    def _to_cache(self, frags, sX, c, t):
        for k in cutlass.range_constexpr(self.k):
            j = c * self.span + k * self.tpr + t
            if j < self.nv:
                sX[None, t, k, c].store(frags[k].load())

    @cute.jit
    def _from_cache(self, frags, sX, c, t):
        for k in cutlass.range_constexpr(self.k):
            j = c * self.span + k * self.tpr + t
            if j < self.nv:
                frags[k].store(sX[None, t, k, c].load())

    @cute.jit
    def _normalize(self, frags, mY, mW, mB, row, c, t, mean, rstd):
        for k in cutlass.range_constexpr(self.k):
            j = c * self.span + k * self.tpr + t
            if j < self.nv:
                y = (frags[k].load().to(F32) - mean) * rstd
                if cutlass.const_expr(self.has_w):
                    y = y * mW[None, j].load().to(F32)
                if cutlass.const_expr(self.has_b):
                    y = y + mB[None, j].load().to(F32)
                mY[None, j, row].store(y.to(self.dtype))

    @cute.kernel
    def kernel(self, mY: cute.Tensor, mX: cute.Tensor, mW: cute.Tensor, mB: cute.Tensor,
               mMean: cute.Tensor, mRstd: cute.Tensor, M: cutlass.Int32, eps: cutlass.Float32,
               nblocks: cutlass.Int32):
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        g = 0
        t = tid
        if cutlass.const_expr(self.rows > 1):
            g = tid // 32
            t = tid % 32
        smem = cutlass.utils.SmemAllocator()
        sRed = None
        sX = None
        if cutlass.const_expr(self.nwarps > 1):
            sRed = smem.allocate_tensor(F32, cute.make_layout((3, self.nwarps)), byte_alignment=16)
        if cutlass.const_expr(self.sc > 0):
            sX = smem.allocate_tensor(
                self.dtype, cute.make_layout((self.vec, self.tpr, self.k, self.sc)), byte_alignment=16)
        frags = _rmem_list(self.k, self.vec, self.dtype)

        for row in range(bid * self.rows + g, M, nblocks * self.rows):
            # ---- pass 1: exact centred statistics (per-thread chunks merged with Chan) ----
            n = F32(0.0)
            s = F32(0.0)
            q = F32(0.0)
            if cutlass.const_expr(self.nch == 1):
                self._load(frags, mX, row, 0, t)
                n, s, q = self._local_stats(frags, 0, t)
            else:
                if cutlass.const_expr(self.sc > 0):
                    for c in range(self.sc):
                        self._load(frags, mX, row, c, t)
                        self._to_cache(frags, sX, c, t)
                        n1, s1, q1 = self._local_stats(frags, c, t)
                        n, s, q = self._merge(n, s, q, n1, s1, q1)
                if cutlass.const_expr(self.sc < self.nch):
                    for c in range(self.sc, self.nch):
                        self._load(frags, mX, row, c, t)
                        n2, s2, q2 = self._local_stats(frags, c, t)
                        n, s, q = self._merge(n, s, q, n2, s2, q2)
            n, s, q = self._reduce_stats(n, s, q, t, sRed)
            mean = s / n
            rstd = _inv_sqrt(q / n + eps)
            if t == 0:
                mMean[row] = mean
                mRstd[row] = rstd
            # ---- pass 2: normalize (registers / smem cache / re-read) ----
            if cutlass.const_expr(self.nch == 1):
                self._normalize(frags, mY, mW, mB, row, 0, t, mean, rstd)
            else:
                if cutlass.const_expr(self.sc > 0):
                    for c in range(self.sc):
                        self._from_cache(frags, sX, c, t)
                        self._normalize(frags, mY, mW, mB, row, c, t, mean, rstd)
                if cutlass.const_expr(self.sc < self.nch):
                    for c in range(self.sc, self.nch):
                        self._load(frags, mX, row, c, t)
                        self._normalize(frags, mY, mW, mB, row, c, t, mean, rstd)


# --------------------------------------------------------------------------------------
# backward
# --------------------------------------------------------------------------------------
class _LNBwd(_RowOp):
    """kind = 'fused'  : one pass, row sums + dx + dw/db partials (accumulated in smem)
       kind = 'rowsum' : wide rows, per-row c1 = mean(g*xhat), c2 = mean(g)
       kind = 'tile'   : wide rows, (column tile x row group): dx + dw/db partials"""

    def __init__(self, kind, dtype, es, N, Sx, Sdy, vec, tpr, k, nch, has_w):
        self._setup(dtype, N, vec, tpr, k)
        self.kind = kind
        self.Sx = Sx
        self.Sdy = Sdy
        self.nch = nch
        self.has_w = has_w
        self.smem_bytes = 512 + 8 * self.nwarps
        if kind == "fused":
            self.smem_bytes += 2 * 4 * vec * tpr * k * self.rows

    @cute.jit
    def __call__(self, pDX: cute.Pointer, pX: cute.Pointer, pDY: cute.Pointer, pW: cute.Pointer,
                 pMean: cute.Pointer, pRstd: cute.Pointer, pC1: cute.Pointer, pC2: cute.Pointer,
                 pWSw: cute.Pointer, pWSb: cute.Pointer, M: cutlass.Int32, P: cutlass.Int32,
                 gx: cutlass.Int32, gy: cutlass.Int32, rpg: cutlass.Int32, stream: _cuda.CUstream):
        mX = self._rows_tensor(pX, M, self.Sx)
        mDY = self._rows_tensor(pDY, M, self.Sdy)
        mDX = self._rows_tensor(pDX, M, self.N)
        mW = self._vec_tensor(pW)
        mMean = self._scalar_tensor(pMean, M)
        mRstd = self._scalar_tensor(pRstd, M)
        mC1 = self._scalar_tensor(pC1, M)
        mC2 = self._scalar_tensor(pC2, M)
        mWSw = self._rows_tensor(pWSw, P, self.N)
        mWSb = self._rows_tensor(pWSb, P, self.N)
        nthr = self.tpr * self.rows
        if cutlass.const_expr(self.kind == "fused"):
            self.k_fused(mDX, mX, mDY, mW, mMean, mRstd, mWSw, mWSb, M, gx).launch(
                grid=[gx, 1, 1], block=[nthr, 1, 1], smem=self.smem_bytes, stream=stream)
        if cutlass.const_expr(self.kind == "rowsum"):
            self.k_rowsum(mX, mDY, mW, mMean, mRstd, mC1, mC2, M, gx).launch(
                grid=[gx, 1, 1], block=[nthr, 1, 1], smem=self.smem_bytes, stream=stream)
        if cutlass.const_expr(self.kind == "tile"):
            self.k_tile(mDX, mX, mDY, mW, mMean, mRstd, mC1, mC2, mWSw, mWSb, M, rpg).launch(
                grid=[gx, gy, 1], block=[nthr, 1, 1], smem=self.smem_bytes, stream=stream)

    @cute.jit
    def _rowsum_local(self, fx, fdy, mW, c, t, mean, rstd):
        a = F32(0.0)
        b = F32(0.0)
        for k in cutlass.range_constexpr(self.k):
            j = c * self.span + k * self.tpr + t
            if j < self.nv:
                xhat = (fx[k].load().to(F32) - mean) * rstd
                gv = fdy[k].load().to(F32)
                if cutlass.const_expr(self.has_w):
                    gv = gv * mW[None, j].load().to(F32)
                a = a + _vsum(gv * xhat)
                b = b + _vsum(gv)
        return a, b

    @cute.jit
    def _dx_acc(self, fx, fdy, accw, accb, mDX, mW, row, c, t, mean, rstd, c1, c2):
        for k in cutlass.range_constexpr(self.k):
            j = c * self.span + k * self.tpr + t
            if j < self.nv:
                xhat = (fx[k].load().to(F32) - mean) * rstd
                dyv = fdy[k].load().to(F32)
                gv = dyv
                if cutlass.const_expr(self.has_w):
                    gv = dyv * mW[None, j].load().to(F32)
                    accw[k].store(accw[k].load() + dyv * xhat)
                accb[k].store(accb[k].load() + dyv)
                dxv = (gv - xhat * c1 - c2) * rstd
                mDX[None, j, row].store(dxv.to(self.dtype))

    @cute.jit
    def _store_partials(self, accw, accb, mWSw, mWSb, prow, c, t):
        for k in cutlass.range_constexpr(self.k):
            j = c * self.span + k * self.tpr + t
            if j < self.nv:
                if cutlass.const_expr(self.has_w):
                    mWSw[None, j, prow].store(accw[k].load())
                mWSb[None, j, prow].store(accb[k].load())

    @cute.jit
    def _store_partials_grouped(self, sAccW, sAccB, mWSw, mWSb, prow, t):
        # rows > 1: add the R warps' accumulators in a fixed order, one partial row per CTA
        for k in cutlass.range_constexpr(self.k):
            j = k * self.tpr + t
            if j < self.nv:
                if cutlass.const_expr(self.has_w):
                    vw = sAccW[None, t, k, 0].load()
                    for r in cutlass.range_constexpr(1, self.rows):
                        vw = vw + sAccW[None, t, k, r].load()
                    mWSw[None, j, prow].store(vw)
                vb = sAccB[None, t, k, 0].load()
                for r in cutlass.range_constexpr(1, self.rows):
                    vb = vb + sAccB[None, t, k, r].load()
                mWSb[None, j, prow].store(vb)

    @cute.kernel
    def k_fused(self, mDX: cute.Tensor, mX: cute.Tensor, mDY: cute.Tensor, mW: cute.Tensor,
                mMean: cute.Tensor, mRstd: cute.Tensor, mWSw: cute.Tensor, mWSb: cute.Tensor,
                M: cutlass.Int32, nblocks: cutlass.Int32):
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        g = 0
        t = tid
        if cutlass.const_expr(self.rows > 1):
            g = tid // 32
            t = tid % 32
        smem = cutlass.utils.SmemAllocator()
        sRed = None
        if cutlass.const_expr(self.nwarps > 1):
            sRed = smem.allocate_tensor(F32, cute.make_layout((2, self.nwarps)), byte_alignment=16)
        acc_layout = cute.make_layout((self.vec, self.tpr, self.k, self.rows))
        sAccW = smem.allocate_tensor(F32, acc_layout, byte_alignment=16)
        sAccB = smem.allocate_tensor(F32, acc_layout, byte_alignment=16)
        accw = _views(sAccW, t, self.k, g)   # each thread owns its own entries: no sync needed
        accb = _views(sAccB, t, self.k, g)
        for k in cutlass.range_constexpr(self.k):
            accw[k].fill(0.0)
            accb[k].fill(0.0)
        fx = _rmem_list(self.k, self.vec, self.dtype)
        fdy = _rmem_list(self.k, self.vec, self.dtype)

        for row in range(bid * self.rows + g, M, nblocks * self.rows):
            self._load(fx, mX, row, 0, t)
            self._load(fdy, mDY, row, 0, t)
            mean = mMean[row]
            rstd = mRstd[row]
            a, b = self._rowsum_local(fx, fdy, mW, 0, t, mean, rstd)
            a, b = self._reduce_sum2(a, b, t, sRed)
            self._dx_acc(fx, fdy, accw, accb, mDX, mW, row, 0, t, mean, rstd,
                         a / float(self.N), b / float(self.N))

        if cutlass.const_expr(self.rows > 1):
            cute.arch.barrier()
            if g == 0:
                self._store_partials_grouped(sAccW, sAccB, mWSw, mWSb, bid, t)
        else:
            self._store_partials(accw, accb, mWSw, mWSb, bid, 0, t)

    @cute.kernel
    def k_rowsum(self, mX: cute.Tensor, mDY: cute.Tensor, mW: cute.Tensor, mMean: cute.Tensor,
                 mRstd: cute.Tensor, mC1: cute.Tensor, mC2: cute.Tensor,
                 M: cutlass.Int32, nblocks: cutlass.Int32):
        t, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        smem = cutlass.utils.SmemAllocator()
        sRed = None
        if cutlass.const_expr(self.nwarps > 1):
            sRed = smem.allocate_tensor(F32, cute.make_layout((2, self.nwarps)), byte_alignment=16)
        fx = _rmem_list(self.k, self.vec, self.dtype)
        fdy = _rmem_list(self.k, self.vec, self.dtype)
        for row in range(bid, M, nblocks):
            mean = mMean[row]
            rstd = mRstd[row]
            a = F32(0.0)
            b = F32(0.0)
            for c in range(self.nch):
                self._load(fx, mX, row, c, t)
                self._load(fdy, mDY, row, c, t)
                a1, b1 = self._rowsum_local(fx, fdy, mW, c, t, mean, rstd)
                a = a + a1
                b = b + b1
            a, b = self._reduce_sum2(a, b, t, sRed)
            if t == 0:
                mC1[row] = a / float(self.N)
                mC2[row] = b / float(self.N)

    @cute.kernel
    def k_tile(self, mDX: cute.Tensor, mX: cute.Tensor, mDY: cute.Tensor, mW: cute.Tensor,
               mMean: cute.Tensor, mRstd: cute.Tensor, mC1: cute.Tensor, mC2: cute.Tensor,
               mWSw: cute.Tensor, mWSb: cute.Tensor, M: cutlass.Int32, rpg: cutlass.Int32):
        t, _, _ = cute.arch.thread_idx()
        bx, by, _ = cute.arch.block_idx()
        fx = _rmem_list(self.k, self.vec, self.dtype)
        fdy = _rmem_list(self.k, self.vec, self.dtype)
        accw = _rmem_list(self.k, self.vec, F32)
        accb = _rmem_list(self.k, self.vec, F32)
        for k in cutlass.range_constexpr(self.k):
            accw[k].fill(0.0)
            accb[k].fill(0.0)
        r0 = by * rpg
        for i in range(rpg):
            row = r0 + i
            if row < M:
                self._load(fx, mX, row, bx, t)
                self._load(fdy, mDY, row, bx, t)
                self._dx_acc(fx, fdy, accw, accb, mDX, mW, row, bx, t,
                             mMean[row], mRstd[row], mC1[row], mC2[row])
        self._store_partials(accw, accb, mWSw, mWSb, by, bx, t)


# --------------------------------------------------------------------------------------
# host side
# --------------------------------------------------------------------------------------
_COMPILED = {}
_SMS = {}


def _cdiv(a, b):
    return -(-a // b)


def _dev_index(dev):
    return dev.index if dev.index is not None else torch.cuda.current_device()


def _num_sms(idx):
    if idx not in _SMS:
        _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SMS[idx]


def _gptr(cdt, addr, align):
    return make_ptr(cdt, addr, cute.AddressSpace.gmem, assumed_align=align)


def _stream(dev):
    return _cuda.CUstream(torch.cuda.current_stream(dev).cuda_stream)


def _pick_vec(es, N, ptrs, strides):
    vec = max(1, 16 // es)
    while vec > 1:
        if (N % vec == 0 and all(s % vec == 0 for s in strides)
                and all(p % (vec * es) == 0 for p in ptrs)):
            break
        vec //= 2
    return vec


def _run(key, op, args):
    fn = _COMPILED.get(key)
    if fn is None:
        fn = cute.compile(op, *args)
        _COMPILED[key] = fn
    fn(*args)


def layernorm_fwd(x, weight, bias, eps):
    """Returns (y, mean, rstd)."""
    M, N = x.shape
    dev = x.device
    idx = _dev_index(dev)
    y = torch.empty((M, N), dtype=x.dtype, device=dev)
    mean = torch.empty((M,), dtype=torch.float32, device=dev)
    rstd = torch.empty((M,), dtype=torch.float32, device=dev)
    cdt = _TORCH2CUTE[x.dtype]
    es = x.element_size()
    S = x.stride(0) if M > 1 else N
    has_w, has_b = weight is not None, bias is not None
    ptrs = [x.data_ptr(), y.data_ptr()] + [t.data_ptr() for t in (weight, bias) if t is not None]
    vec = _pick_vec(es, N, ptrs, (S,))
    nv = N // vec
    kt = 4 * (16 // (vec * es))            # ~64 bytes of a row per thread per chunk
    tpr = 32
    while tpr < _MAX_TPR and tpr * kt < nv:
        tpr *= 2
    k = min(_cdiv(nv, tpr), 2 * kt)
    nch = _cdiv(nv, tpr * k)
    sc = 0 if nch == 1 else min(nch, _SMEM_CACHE_BUDGET // (tpr * k * vec * es))
    op = _LNFwd(cdt, es, N, S, vec, tpr, k, nch, sc, has_w, has_b)
    occ = max(1, min(2048 // (tpr * op.rows), _SMEM_PER_SM // (op.smem_bytes + 1024)))
    nblocks = max(1, min(_cdiv(M, op.rows), _num_sms(idx) * occ))
    al = vec * es
    px = _gptr(cdt, x.data_ptr(), al)
    with torch.cuda.device(idx):
        args = (_gptr(cdt, y.data_ptr(), al), px,
                _gptr(cdt, weight.data_ptr(), al) if has_w else px,
                _gptr(cdt, bias.data_ptr(), al) if has_b else px,
                _gptr(F32, mean.data_ptr(), 4), _gptr(F32, rstd.data_ptr(), 4),
                cutlass.Int32(M), cutlass.Float32(eps), cutlass.Int32(nblocks), _stream(dev))
        _run(("fwd", idx, x.dtype, N, S, vec, has_w, has_b), op, args)
    return y, mean, rstd


def layernorm_bwd(dy, x, weight, mean, rstd):
    """Returns (dx, dweight, dbias)."""
    M, N = x.shape
    dev = x.device
    idx = _dev_index(dev)
    dx = torch.empty((M, N), dtype=x.dtype, device=dev)
    cdt = _TORCH2CUTE[x.dtype]
    es = x.element_size()
    Sx = x.stride(0) if M > 1 else N
    Sdy = dy.stride(0) if M > 1 else N
    has_w = weight is not None
    ptrs = [x.data_ptr(), dy.data_ptr(), dx.data_ptr()] + ([weight.data_ptr()] if has_w else [])
    vec = _pick_vec(es, N, ptrs, (Sx, Sdy))
    nv = N // vec
    kt = 4 * (16 // (vec * es))
    sms = _num_sms(idx)
    al = vec * es
    f32 = torch.float32
    with torch.cuda.device(idx):
        stream = _stream(dev)
        px = _gptr(cdt, x.data_ptr(), al)
        pmean = _gptr(F32, mean.data_ptr(), 4)
        prstd = _gptr(F32, rstd.data_ptr(), 4)
        common = (_gptr(cdt, dx.data_ptr(), al), px, _gptr(cdt, dy.data_ptr(), al),
                  _gptr(cdt, weight.data_ptr(), al) if has_w else px, pmean, prstd)
        tpr = 32
        while tpr < _MAX_TPR and tpr * kt < nv:
            tpr *= 2
        k = _cdiv(nv, tpr)
        if k <= 2 * kt:
            # ---- fused single pass ----
            op = _LNBwd("fused", cdt, es, N, Sx, Sdy, vec, tpr, k, 1, has_w)
            occ = max(1, min(2048 // (tpr * op.rows), _SMEM_PER_SM // (op.smem_bytes + 1024)))
            nb = max(1, min(_cdiv(M, op.rows), sms * occ))
            ws_b = torch.empty((nb, N), dtype=f32, device=dev)
            ws_w = torch.empty((nb, N), dtype=f32, device=dev) if has_w else ws_b
            args = common + (pmean, prstd,
                             _gptr(F32, ws_w.data_ptr(), 4 * vec), _gptr(F32, ws_b.data_ptr(), 4 * vec),
                             cutlass.Int32(M), cutlass.Int32(nb), cutlass.Int32(nb),
                             cutlass.Int32(1), cutlass.Int32(1), stream)
            _run(("bwd-fused", idx, x.dtype, N, Sx, Sdy, vec, has_w), op, args)
        else:
            # ---- wide rows: row sums, then (column tile x row group) dx + partials ----
            cbuf = torch.empty((2, M), dtype=f32, device=dev)
            pc1 = _gptr(F32, cbuf[0].data_ptr(), 4)
            pc2 = _gptr(F32, cbuf[1].data_ptr(), 4)
            op_r = _LNBwd("rowsum", cdt, es, N, Sx, Sdy, vec, _MAX_TPR, kt,
                          _cdiv(nv, _MAX_TPR * kt), has_w)
            gr = max(1, min(M, sms * (2048 // _MAX_TPR)))
            args_r = common + (pc1, pc2, pmean, pmean, cutlass.Int32(M), cutlass.Int32(1),
                               cutlass.Int32(gr), cutlass.Int32(1), cutlass.Int32(1), stream)
            _run(("bwd-rowsum", idx, x.dtype, N, Sx, Sdy, vec, has_w), op_r, args_r)

            k2 = max(1, kt // 2)
            op_t = _LNBwd("tile", cdt, es, N, Sx, Sdy, vec, _MAX_TPR, k2, 1, has_w)
            ntiles = _cdiv(nv, _MAX_TPR * k2)
            nrg = max(1, min(M, _cdiv(sms * 4, ntiles)))
            rpg = _cdiv(M, nrg)
            nrg = _cdiv(M, rpg)
            ws_b = torch.empty((nrg, N), dtype=f32, device=dev)
            ws_w = torch.empty((nrg, N), dtype=f32, device=dev) if has_w else ws_b
            args_t = common + (pc1, pc2,
                               _gptr(F32, ws_w.data_ptr(), 4 * vec), _gptr(F32, ws_b.data_ptr(), 4 * vec),
                               cutlass.Int32(M), cutlass.Int32(nrg), cutlass.Int32(ntiles),
                               cutlass.Int32(nrg), cutlass.Int32(rpg), stream)
            _run(("bwd-tile", idx, x.dtype, N, Sx, Sdy, vec, has_w), op_t, args_t)
    # fixed-order fp32 reduction of the per-block partials, cast at the end
    dweight = ws_w.sum(dim=0).to(x.dtype) if has_w else None
    dbias = ws_b.sum(dim=0).to(x.dtype)
    return dx, dweight, dbias
