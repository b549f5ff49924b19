import math

import torch

import cutlass
import cutlass.cute as cute
import cutlass.utils
from cutlass.cute.runtime import from_dlpack

try:
    import cuda.bindings.driver as cuda
except ImportError:  # older cuda-python layout
    from cuda import cuda


# ----------------------------------------------------------------------------------------------
# configuration
# ----------------------------------------------------------------------------------------------
_THREADS = 256            # threads per CTA (kept at 256 so register use can never block a launch)
_E_TARGET = 16            # preferred elements per thread held in registers
_E_MAX = 32               # max elements per thread held in registers
_SMEM_BUDGET = 200 * 1024  # bytes of shared memory used to stage a wide row (forward)

_TORCH_TO_CUTLASS = {
    torch.bfloat16: cutlass.BFloat16,
    torch.float16: cutlass.Float16,
    torch.float32: cutlass.Float32,
}

_COMPILED = {}
_SM_COUNT = {}


def _ceil_div(a, b):
    return (a + b - 1) // b


def _log2(n):
    return int(round(math.log2(n)))


def _row_plan(NV, vec):
    """NV = number of vectors per row. Returns (threads per row, rows per CTA, chunks, register chunks)."""
    kt = max(1, _E_TARGET // vec)
    km = max(1, _E_MAX // vec)
    tpr = 1
    while tpr < _THREADS and tpr * kt < NV:
        tpr *= 2
    K = _ceil_div(NV, tpr)
    KR = min(K, km)
    rpc = _THREADS // tpr if K <= km else 1
    return tpr, rpc, K, KR


def _pick_vec(N, esize, ptrs, strides):
    vec = max(1, 16 // esize)
    while vec > 1:
        nbytes = vec * esize
        if (N % vec == 0 and all(p % nbytes == 0 for p in ptrs)
                and all(s % vec == 0 for s in strides)):
            return vec
        vec //= 2
    return 1


def _num_sms(device):
    idx = device.index if device.index is not None else torch.cuda.current_device()
    n = _SM_COUNT.get(idx)
    if n is None:
        n = torch.cuda.get_device_properties(idx).multi_processor_count
        _SM_COUNT[idx] = n
    return n


def _stream(device):
    return cuda.CUstream(torch.cuda.current_stream(device).cuda_stream)


def _t2(t, align):
    # 2-D (rows, N), unit stride along N, dynamic rows and row stride
    return from_dlpack(t.detach(), assumed_align=align).mark_layout_dynamic(leading_dim=1)


def _t1(t, align):
    # 1-D with a dynamic length
    return from_dlpack(t.detach(), assumed_align=align).mark_layout_dynamic(leading_dim=0)


def _t1_static(t, align):
    return from_dlpack(t.detach(), assumed_align=align)


# ----------------------------------------------------------------------------------------------
# small trace-time helpers (no dynamic control flow inside)
# ----------------------------------------------------------------------------------------------
def _make_frag(n, dtype):
    maker = getattr(cute, "make_rmem_tensor", None)
    if maker is None:
        maker = cute.make_fragment
    return maker(cute.make_layout((n,)), dtype)


def _rsqrt(v):
    m = getattr(cute, "math", None)
    if m is not None and hasattr(m, "rsqrt"):
        return m.rsqrt(v)
    return cute.arch.rsqrt(v)


def _row_view(t, N, vec):
    # (rows, N) view with static N and a dynamic row stride known to be a multiple of vec
    s0 = t.stride[0]
    if vec > 1:
        s0 = cute.assume(s0, divby=vec)
    return cute.make_tensor(t.iterator, cute.make_layout((t.shape[0], N), stride=(s0, 1)))


def _dense_view(t, N):
    # freshly allocated contiguous (rows, N)
    return cute.make_tensor(t.iterator, cute.make_layout((t.shape[0], N), stride=(N, 1)))


def _vload(t1d, vec, idx):
    return cute.local_tile(t1d, (vec,), (idx,)).load()


def _vstore(t1d, vec, idx, val):
    cute.local_tile(t1d, (vec,), (idx,)).store(val)


def _vsum(v):
    return v.reduce(cute.ReductionOp.ADD, init_val=0.0, reduction_profile=0)


# ----------------------------------------------------------------------------------------------
# forward
# ----------------------------------------------------------------------------------------------
class _FwdOp:
    def __init__(self, cdtype, esize, N, vec, has_weight):
        self.cdtype = cdtype
        self.N = N
        self.vec = vec
        self.NV = N // vec
        self.has_weight = has_weight
        self.tpr, self.rpc, self.K, self.KR = _row_plan(self.NV, vec)
        self.nthreads = self.tpr * self.rpc
        self.nwarps = _ceil_div(self.nthreads, 32)
        self.red_smem = self.tpr > 32
        self.wpr = max(1, self.tpr // 32)
        self.shfl_steps = _log2(min(self.tpr, 32))
        self.US = 1
        self.KS = 0
        self.UG = 1
        self.KG = 0
        self.NGG = 0
        rest = self.K - self.KR
        if rest > 0:
            u = max(1, 32 // vec)
            cap = _SMEM_BUDGET // (self.tpr * vec * esize)
            self.US = min(u, rest)
            self.KS = (min(rest, cap) // self.US) * self.US
            self.KG = rest - self.KS
            if self.KG > 0:
                self.UG = min(u, self.KG)
                self.NGG = _ceil_div(self.KG, self.UG)
        smem = 0
        if self.KS > 0:
            smem += self.KS * self.tpr * vec * esize + 16
        if self.red_smem:
            smem += self.nwarps * 4 + 16
        self.smem_bytes = smem + 64 if smem > 0 else 0

    @cute.jit
    def __call__(self, mX: cute.Tensor, mW: cute.Tensor, mY: cute.Tensor, mRstd: cute.Tensor,
                 eps: cutlass.Float32, stream: cuda.CUstream):
        M = mX.shape[0]
        mXv = _row_view(mX, self.N, self.vec)
        mYv = _dense_view(mY, self.N)
        self.kernel(mXv, mW, mYv, mRstd, eps, M).launch(
            grid=[(M + (self.rpc - 1)) // self.rpc, 1, 1],
            block=[self.nthreads, 1, 1],
            smem=self.smem_bytes,
            stream=stream,
        )

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mW: cute.Tensor, mY: cute.Tensor, mRstd: cute.Tensor,
               eps: cutlass.Float32, M: cutlass.Int32):
        tpr = self.tpr
        vec = self.vec
        NV = self.NV
        KR = self.KR
        KS = self.KS
        US = self.US
        KG = self.KG
        UG = self.UG
        NGG = self.NGG
        f32 = cutlass.Float32

        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = tidx % tpr
        rloc = tidx // tpr
        row = bidx * self.rpc + rloc
        row_ld = row
        if cutlass.const_expr(self.rpc > 1):
            row_ld = row % M

        smem = cutlass.utils.SmemAllocator()
        sX = None
        sRed = None
        if cutlass.const_expr(KS > 0):
            sX = smem.allocate_tensor(self.cdtype, cute.make_layout((vec, tpr, KS)), byte_alignment=16)
        if cutlass.const_expr(self.red_smem):
            sRed = smem.allocate_tensor(f32, cute.make_layout((self.nwarps,)), byte_alignment=16)

        gX = mX[row_ld, None]
        gY = mY[row_ld, None]

        # ---- pass 1: sum of squares (register chunks, staged chunks, re-read chunks) ----
        ss = f32(0.0)
        xs = []
        for k in cutlass.range_constexpr(KR):
            ck = lane + k * tpr
            if cutlass.const_expr((k + 1) * tpr <= NV):
                xk = _vload(gX, vec, ck).to(f32)
                ss = ss + _vsum(xk * xk)
                xs.append(xk)
            else:
                xk = _vload(gX, vec, ck % NV).to(f32)
                pk = _vsum(xk * xk)
                if ck < NV:
                    ss = ss + pk
                xs.append(xk)

        if cutlass.const_expr(KS > 0):
            for gs1 in cutlass.range(KS // US):
                raw1 = []
                for u1 in cutlass.range_constexpr(US):
                    c1 = lane + (KR + gs1 * US + u1) * tpr
                    raw1.append(_vload(gX, vec, c1 % NV))
                for v1 in cutlass.range_constexpr(US):
                    s1 = gs1 * US + v1
                    d1 = lane + (KR + s1) * tpr
                    sX[None, lane, s1].store(raw1[v1])
                    x1 = raw1[v1].to(f32)
                    p1 = _vsum(x1 * x1)
                    if d1 < NV:
                        ss = ss + p1

        if cutlass.const_expr(KG > 0):
            for gg1 in cutlass.range(NGG):
                raw2 = []
                for u2 in cutlass.range_constexpr(UG):
                    c2 = lane + (KR + KS + gg1 * UG + u2) * tpr
                    raw2.append(_vload(gX, vec, c2 % NV).to(f32))
                for v2 in cutlass.range_constexpr(UG):
                    d2 = lane + (KR + KS + gg1 * UG + v2) * tpr
                    p2 = _vsum(raw2[v2] * raw2[v2])
                    if d2 < NV:
                        ss = ss + p2

        # weights of the register chunks (issued before the reduction)
        wr = []
        if cutlass.const_expr(self.has_weight):
            for kw in cutlass.range_constexpr(KR):
                cw = lane + kw * tpr
                if cutlass.const_expr((kw + 1) * tpr > NV):
                    cw = cw % NV
                wr.append(_vload(mW, vec, cw).to(f32))

        # ---- row reduction (deterministic: butterfly, then fixed-order sum over warps) ----
        for i in cutlass.range_constexpr(self.shfl_steps):
            ss = ss + cute.arch.shuffle_sync_bfly(ss, offset=1 << i)
        if cutlass.const_expr(self.red_smem):
            if tidx % 32 == 0:
                sRed[tidx // 32] = ss
            cute.arch.barrier()
            tot = f32(0.0)
            for i2 in cutlass.range_constexpr(self.wpr):
                tot = tot + sRed[rloc * self.wpr + i2]
            ss = tot

        rstd = _rsqrt(ss / f32(self.N) + eps)
        if row < M:
            if lane == 0:
                mRstd[row] = rstd

        # ---- pass 2: re-read chunks (reverse order, L2-hot), staged chunks, register chunks ----
        if cutlass.const_expr(KG > 0):
            for gg2 in cutlass.range(NGG):
                base2 = KR + KS + (NGG - 1 - gg2) * UG
                xl3 = []
                wl3 = []
                for u3 in cutlass.range_constexpr(UG):
                    c3 = (lane + (base2 + u3) * tpr) % NV
                    xl3.append(_vload(gX, vec, c3).to(f32))
                    if cutlass.const_expr(self.has_weight):
                        wl3.append(_vload(mW, vec, c3).to(f32))
                for v3 in cutlass.range_constexpr(UG):
                    d3 = lane + (base2 + v3) * tpr
                    y3 = xl3[v3] * rstd
                    if cutlass.const_expr(self.has_weight):
                        y3 = y3 * wl3[v3]
                    o3 = y3.to(self.cdtype)
                    if d3 < NV:
                        _vstore(gY, vec, d3, o3)

        if cutlass.const_expr(KS > 0):
            for gs2 in cutlass.range(KS // US):
                xl4 = []
                wl4 = []
                for u4 in cutlass.range_constexpr(US):
                    s4 = gs2 * US + u4
                    xl4.append(sX[None, lane, s4].load().to(f32))
                    if cutlass.const_expr(self.has_weight):
                        wl4.append(_vload(mW, vec, (lane + (KR + s4) * tpr) % NV).to(f32))
                for v4 in cutlass.range_constexpr(US):
                    d4 = lane + (KR + gs2 * US + v4) * tpr
                    y4 = xl4[v4] * rstd
                    if cutlass.const_expr(self.has_weight):
                        y4 = y4 * wl4[v4]
                    o4 = y4.to(self.cdtype)
                    if d4 < NV:
                        _vstore(gY, vec, d4, o4)

        outs = []
        for k6 in cutlass.range_constexpr(KR):
            y6 = xs[k6] * rstd
            if cutlass.const_expr(self.has_weight):
                y6 = y6 * wr[k6]
            outs.append(y6.to(self.cdtype))
        if row < M:
            for k7 in cutlass.range_constexpr(KR):
                c7 = lane + k7 * tpr
                if cutlass.const_expr((k7 + 1) * tpr <= NV):
                    _vstore(gY, vec, c7, outs[k7])
                else:
                    if c7 < NV:
                        _vstore(gY, vec, c7, outs[k7])


# ----------------------------------------------------------------------------------------------
# backward, rows that fit in registers: persistent CTAs, dweight partials per thread slot
# ----------------------------------------------------------------------------------------------
class _BwdRegOp:
    def __init__(self, cdtype, esize, N, vec, has_weight):
        self.cdtype = cdtype
        self.N = N
        self.vec = vec
        self.NV = N // vec
        self.has_weight = has_weight
        self.tpr, self.rpc, K, self.KR = _row_plan(self.NV, vec)
        assert K == self.KR
        self.nthreads = self.tpr * self.rpc
        self.nwarps = _ceil_div(self.nthreads, 32)
        self.red_smem = self.tpr > 32
        self.wpr = max(1, self.tpr // 32)
        self.shfl_steps = _log2(min(self.tpr, 32))
        self.smem_bytes = self.nwarps * 2 * 4 + 64 if self.red_smem else 0

    @cute.jit
    def __call__(self, mX: cute.Tensor, mDY: cute.Tensor, mW: cute.Tensor, mRstd: cute.Tensor,
                 mDX: cute.Tensor, mDWp: cute.Tensor, G: cutlass.Int32, stream: cuda.CUstream):
        M = mX.shape[0]
        mXv = _row_view(mX, self.N, self.vec)
        mDYv = _row_view(mDY, self.N, self.vec)
        mDXv = _dense_view(mDX, self.N)
        mDWv = mDWp
        if cutlass.const_expr(self.has_weight):
            mDWv = _dense_view(mDWp, self.N)
        self.kernel(mXv, mDYv, mW, mRstd, mDXv, mDWv, M, G).launch(
            grid=[G, 1, 1],
            block=[self.nthreads, 1, 1],
            smem=self.smem_bytes,
            stream=stream,
        )

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mDY: cute.Tensor, mW: cute.Tensor, mRstd: cute.Tensor,
               mDX: cute.Tensor, mDW: cute.Tensor, M: cutlass.Int32, G: cutlass.Int32):
        tpr = self.tpr
        vec = self.vec
        NV = self.NV
        KR = self.KR
        rpc = self.rpc
        f32 = cutlass.Float32

        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = tidx % tpr
        rloc = tidx // tpr

        smem = cutlass.utils.SmemAllocator()
        sRed = None
        if cutlass.const_expr(self.red_smem):
            sRed = smem.allocate_tensor(f32, cute.make_layout((self.nwarps, 2)), byte_alignment=16)

        acc = []
        if cutlass.const_expr(self.has_weight):
            for ka in cutlass.range_constexpr(KR):
                fa = _make_frag(vec, f32)
                for ia in cutlass.range_constexpr(vec):
                    fa[ia] = f32(0.0)
                acc.append(fa)

        ngroups = (M + (rpc - 1)) // rpc
        iters = (ngroups - bidx + (G - 1)) // G
        for it in cutlass.range(iters):
            row = (bidx + it * G) * rpc + rloc
            row_ld = row
            rs = f32(0.0)
            if cutlass.const_expr(rpc > 1):
                row_ld = row % M
                if row < M:
                    rs = mRstd[row]
            else:
                rs = mRstd[row]
            gX = mX[row_ld, None]
            gDY = mDY[row_ld, None]

            xh = []
            gv = []
            dyl = []
            for k in cutlass.range_constexpr(KR):
                ck = lane + k * tpr
                if cutlass.const_expr((k + 1) * tpr > NV):
                    ck = ck % NV
                xv = _vload(gX, vec, ck).to(f32)
                dv = _vload(gDY, vec, ck).to(f32)
                xh.append(xv * rs)
                dyl.append(dv)
                if cutlass.const_expr(self.has_weight):
                    gv.append(dv * _vload(mW, vec, ck).to(f32))
                else:
                    gv.append(dv)

            dot = f32(0.0)
            for k2 in cutlass.range_constexpr(KR):
                pk = _vsum(gv[k2] * xh[k2])
                if cutlass.const_expr((k2 + 1) * tpr <= NV):
                    dot = dot + pk
                else:
                    if lane + k2 * tpr < NV:
                        dot = dot + pk

            for i in cutlass.range_constexpr(self.shfl_steps):
                dot = dot + cute.arch.shuffle_sync_bfly(dot, offset=1 << i)
            if cutlass.const_expr(self.red_smem):
                buf = it % 2
                if tidx % 32 == 0:
                    sRed[tidx // 32, buf] = dot
                cute.arch.barrier()
                tot = f32(0.0)
                for i2 in cutlass.range_constexpr(self.wpr):
                    tot = tot + sRed[rloc * self.wpr + i2, buf]
                dot = tot
            mean = dot / f32(self.N)

            if row < M:
                gDX = mDX[row, None]
                for k3 in cutlass.range_constexpr(KR):
                    c3 = lane + k3 * tpr
                    o3 = ((gv[k3] - xh[k3] * mean) * rs).to(self.cdtype)
                    if cutlass.const_expr((k3 + 1) * tpr <= NV):
                        _vstore(gDX, vec, c3, o3)
                    else:
                        if c3 < NV:
                            _vstore(gDX, vec, c3, o3)

            # rows past M have rs == 0, so they add exactly zero here
            if cutlass.const_expr(self.has_weight):
                for k4 in cutlass.range_constexpr(KR):
                    acc[k4].store(acc[k4].load() + dyl[k4] * xh[k4])

        if cutlass.const_expr(self.has_weight):
            gP = mDW[bidx * rpc + rloc, None]
            for k5 in cutlass.range_constexpr(KR):
                c5 = lane + k5 * tpr
                if cutlass.const_expr((k5 + 1) * tpr <= NV):
                    _vstore(gP, vec, c5, acc[k5].load())
                else:
                    if c5 < NV:
                        _vstore(gP, vec, c5, acc[k5].load())


# ----------------------------------------------------------------------------------------------
# backward, wide rows: (1) per-row mean(g * xhat), (2) column-slab dx + dweight partials
# ----------------------------------------------------------------------------------------------
class _BwdDotOp:
    def __init__(self, cdtype, esize, N, vec, has_weight):
        self.cdtype = cdtype
        self.N = N
        self.vec = vec
        self.NV = N // vec
        self.has_weight = has_weight
        self.T = _THREADS
        self.K = _ceil_div(self.NV, self.T)
        self.U = max(1, min(self.K, 32 // vec))
        self.NG = _ceil_div(self.K, self.U)
        self.nwarps = self.T // 32
        self.smem_bytes = self.nwarps * 4 + 64

    @cute.jit
    def __call__(self, mX: cute.Tensor, mDY: cute.Tensor, mW: cute.Tensor, mRstd: cute.Tensor,
                 mMean: cute.Tensor, stream: cuda.CUstream):
        M = mX.shape[0]
        mXv = _row_view(mX, self.N, self.vec)
        mDYv = _row_view(mDY, self.N, self.vec)
        self.kernel(mXv, mDYv, mW, mRstd, mMean).launch(
            grid=[M, 1, 1],
            block=[self.T, 1, 1],
            smem=self.smem_bytes,
            stream=stream,
        )

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mDY: cute.Tensor, mW: cute.Tensor, mRstd: cute.Tensor,
               mMean: cute.Tensor):
        vec = self.vec
        NV = self.NV
        T = self.T
        U = self.U
        f32 = cutlass.Float32

        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()

        smem = cutlass.utils.SmemAllocator()
        sRed = smem.allocate_tensor(f32, cute.make_layout((self.nwarps,)), byte_alignment=16)

        rs = mRstd[bidx]
        gX = mX[bidx, None]
        gDY = mDY[bidx, None]

        dot = f32(0.0)
        for g in cutlass.range(self.NG):
            xl = []
            dl = []
            wl = []
            for u in cutlass.range_constexpr(U):
                c = (tidx + (g * U + u) * T) % NV
                xl.append(_vload(gX, vec, c).to(f32))
                dl.append(_vload(gDY, vec, c).to(f32))
                if cutlass.const_expr(self.has_weight):
                    wl.append(_vload(mW, vec, c).to(f32))
            for v in cutlass.range_constexpr(U):
                d = tidx + (g * U + v) * T
                xhv = xl[v] * rs
                gvv = dl[v]
                if cutlass.const_expr(self.has_weight):
                    gvv = gvv * wl[v]
                p = _vsum(gvv * xhv)
                if d < NV:
                    dot = dot + p

        for i in cutlass.range_constexpr(5):
            dot = dot + cute.arch.shuffle_sync_bfly(dot, offset=1 << i)
        if tidx % 32 == 0:
            sRed[tidx // 32] = dot
        cute.arch.barrier()
        tot = f32(0.0)
        for i2 in cutlass.range_constexpr(self.nwarps):
            tot = tot + sRed[i2]
        if tidx == 0:
            mMean[bidx] = tot / f32(self.N)


class _BwdSlabOp:
    def __init__(self, cdtype, esize, N, vec, has_weight):
        self.cdtype = cdtype
        self.N = N
        self.vec = vec
        self.NV = N // vec
        self.has_weight = has_weight
        self.T = _THREADS
        self.KR = max(1, 16 // vec)
        self.SV = self.T * self.KR          # vectors per column slab
        self.S = _ceil_div(self.NV, self.SV)  # number of slabs

    @cute.jit
    def __call__(self, mX: cute.Tensor, mDY: cute.Tensor, mW: cute.Tensor, mRstd: cute.Tensor,
                 mMean: cute.Tensor, mDX: cute.Tensor, mDWp: cute.Tensor,
                 R: cutlass.Int32, T: cutlass.Int32, stream: cuda.CUstream):
        M = mX.shape[0]
        mXv = _row_view(mX, self.N, self.vec)
        mDYv = _row_view(mDY, self.N, self.vec)
        mDXv = _dense_view(mDX, self.N)
        mDWv = mDWp
        if cutlass.const_expr(self.has_weight):
            mDWv = _dense_view(mDWp, self.N)
        self.kernel(mXv, mDYv, mW, mRstd, mMean, mDXv, mDWv, M, R).launch(
            grid=[T, self.S, 1],
            block=[self.T, 1, 1],
            smem=0,
            stream=stream,
        )

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mDY: cute.Tensor, mW: cute.Tensor, mRstd: cute.Tensor,
               mMean: cute.Tensor, mDX: cute.Tensor, mDW: cute.Tensor,
               M: cutlass.Int32, R: cutlass.Int32):
        vec = self.vec
        NV = self.NV
        KR = self.KR
        T = self.T
        f32 = cutlass.Float32

        tidx, _, _ = cute.arch.thread_idx()
        bx, by, _ = cute.arch.block_idx()

        cks = []
        cls = []
        wv = []
        acc = []
        for k in cutlass.range_constexpr(KR):
            ck = by * self.SV + k * T + tidx
            cl = ck % NV
            cks.append(ck)
            cls.append(cl)
            if cutlass.const_expr(self.has_weight):
                wv.append(_vload(mW, vec, cl).to(f32))
                fa = _make_frag(vec, f32)
                for ia in cutlass.range_constexpr(vec):
                    fa[ia] = f32(0.0)
                acc.append(fa)

        r0 = bx * R
        nrows = M - r0
        if nrows > R:
            nrows = R
        for i in cutlass.range(nrows):
            row = r0 + i
            rs = mRstd[row]
            mu = mMean[row]
            gX = mX[row, None]
            gDY = mDY[row, None]
            gDX = mDX[row, None]
            xl = []
            dl = []
            for k2 in cutlass.range_constexpr(KR):
                xl.append(_vload(gX, vec, cls[k2]).to(f32))
                dl.append(_vload(gDY, vec, cls[k2]).to(f32))
            for k3 in cutlass.range_constexpr(KR):
                xh = xl[k3] * rs
                gg = dl[k3]
                if cutlass.const_expr(self.has_weight):
                    gg = gg * wv[k3]
                o = ((gg - xh * mu) * rs).to(self.cdtype)
                if cks[k3] < NV:
                    _vstore(gDX, vec, cks[k3], o)
                if cutlass.const_expr(self.has_weight):
                    acc[k3].store(acc[k3].load() + dl[k3] * xh)

        if cutlass.const_expr(self.has_weight):
            gP = mDW[bx, None]
            for k4 in cutlass.range_constexpr(KR):
                if cks[k4] < NV:
                    _vstore(gP, vec, cks[k4], acc[k4].load())


# ----------------------------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------------------------
def _get_compiled(key, make_op, *args):
    fn = _COMPILED.get(key)
    if fn is None:
        fn = cute.compile(make_op(), *args)
        _COMPILED[key] = fn
    return fn


def rmsnorm_fwd(x: torch.Tensor, weight, eps: float):
    """Returns (y, rstd)."""
    M, N = x.shape
    dtype = x.dtype
    cdt = _TORCH_TO_CUTLASS[dtype]
    esize = x.element_size()
    has_w = weight is not None
    y = torch.empty((M, N), dtype=dtype, device=x.device)
    rstd = torch.empty((M,), dtype=torch.float32, device=x.device)

    ptrs = [x.data_ptr(), y.data_ptr()] + ([weight.data_ptr()] if has_w else [])
    vec = _pick_vec(N, esize, ptrs, [x.stride(0)])
    align = vec * esize

    mX = _t2(x, align)
    mY = _t2(y, align)
    mR = _t1(rstd, 4)
    mW = _t1_static(weight, align) if has_w else mR
    stream = _stream(x.device)
    eps = float(eps)

    key = ("fwd", dtype, N, vec, has_w)
    fn = _get_compiled(key, lambda: _FwdOp(cdt, esize, N, vec, has_w), mX, mW, mY, mR, eps, stream)
    fn(mX, mW, mY, mR, eps, stream)
    return y, rstd


def rmsnorm_bwd(dy: torch.Tensor, x: torch.Tensor, weight, rstd: torch.Tensor):
    """Returns (dx, dweight)."""
    M, N = x.shape
    dtype = x.dtype
    cdt = _TORCH_TO_CUTLASS[dtype]
    esize = x.element_size()
    has_w = weight is not None
    dev = x.device
    dx = torch.empty((M, N), dtype=dtype, device=dev)

    ptrs = [x.data_ptr(), dy.data_ptr(), dx.data_ptr()] + ([weight.data_ptr()] if has_w else [])
    vec = _pick_vec(N, esize, ptrs, [x.stride(0), dy.stride(0)])
    align = vec * esize
    NV = N // vec
    tpr, rpc, K, KR = _row_plan(NV, vec)

    mX = _t2(x, align)
    mDY = _t2(dy, align)
    mDX = _t2(dx, align)
    mR = _t1(rstd, 4)
    mW = _t1_static(weight, align) if has_w else mR
    stream = _stream(dev)
    nsm = _num_sms(dev)

    part = None
    if K == KR:
        ngroups = _ceil_div(M, rpc)
        G = max(1, min(ngroups, 2 * nsm))
        if has_w:
            part = torch.empty((G * rpc, N), dtype=torch.float32, device=dev)
            mP = _t2(part, 16)
        else:
            mP = mR
        key = ("bwd_reg", dtype, N, vec, has_w)
        fn = _get_compiled(key, lambda: _BwdRegOp(cdt, esize, N, vec, has_w),
                           mX, mDY, mW, mR, mDX, mP, G, stream)
        fn(mX, mDY, mW, mR, mDX, mP, G, stream)
    else:
        mean = torch.empty((M,), dtype=torch.float32, device=dev)
        mMean = _t1(mean, 4)
        key1 = ("bwd_dot", dtype, N, vec, has_w)
        fn1 = _get_compiled(key1, lambda: _BwdDotOp(cdt, esize, N, vec, has_w),
                            mX, mDY, mW, mR, mMean, stream)
        fn1(mX, mDY, mW, mR, mMean, stream)

        kr2 = max(1, 16 // vec)
        S = _ceil_div(NV, _THREADS * kr2)
        R = max(1, min(64, (M * S) // (4 * nsm)))
        T = _ceil_div(M, R)
        if has_w:
            part = torch.empty((T, N), dtype=torch.float32, device=dev)
            mP = _t2(part, 16)
        else:
            mP = mR
        key2 = ("bwd_slab", dtype, N, vec, has_w)
        fn2 = _get_compiled(key2, lambda: _BwdSlabOp(cdt, esize, N, vec, has_w),
                            mX, mDY, mW, mR, mMean, mDX, mP, R, T, stream)
        fn2(mX, mDY, mW, mR, mMean, mDX, mP, R, T, stream)

    dweight = part.sum(dim=0).to(dtype) if has_w else None
    return dx, dweight
