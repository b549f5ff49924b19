"""RMSNorm forward and backward written in Helion.

rmsnorm_fwd(x, weight, eps)        -> (y, rstd)
rmsnorm_bwd(dy, x, weight, rstd)   -> (dx, dweight)

All arithmetic in fp32; outputs in x's dtype (rstd in fp32).  Every kernel is
compiled with an explicit helion.Config chosen in Python from the problem shape
(no autotuning).  Nothing is compiled, launched or allocated at import time.
"""

import torch

import helion
import helion.language as hl


# =============================================================================
# Kernel bodies.  They are wrapped lazily by _kernel() with an explicit config.
# =============================================================================


def _rmsnorm_fwd_w_kernel(
    x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    m, n = x.size()
    y = x.new_empty([m, n])
    rstd = x.new_empty([m], dtype=torch.float32)
    for tile_m in hl.tile(m):
        xf = x[tile_m, :].to(torch.float32)
        r = torch.rsqrt(torch.sum(xf * xf, dim=-1) / n + eps)
        wf = weight[:].to(torch.float32)
        y[tile_m, :] = (xf * r[:, None] * wf[None, :]).to(y.dtype)
        rstd[tile_m] = r
    return y, rstd


def _rmsnorm_fwd_nw_kernel(
    x: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    m, n = x.size()
    y = x.new_empty([m, n])
    rstd = x.new_empty([m], dtype=torch.float32)
    for tile_m in hl.tile(m):
        xf = x[tile_m, :].to(torch.float32)
        r = torch.rsqrt(torch.sum(xf * xf, dim=-1) / n + eps)
        y[tile_m, :] = (xf * r[:, None]).to(y.dtype)
        rstd[tile_m] = r
    return y, rstd


def _rmsnorm_bwd_nw_kernel(
    dy: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor
) -> torch.Tensor:
    # No weight: g = dy, dx = rstd * (g - xhat * mean(g * xhat)).
    m, n = x.size()
    dx = x.new_empty([m, n])
    for tile_m in hl.tile(m):
        xf = x[tile_m, :].to(torch.float32)
        g = dy[tile_m, :].to(torch.float32)
        r = rstd[tile_m]
        xhat = xf * r[:, None]
        c = torch.sum(g * xhat, dim=-1) / n
        dx[tile_m, :] = (r[:, None] * (g - xhat * c[:, None])).to(dx.dtype)
    return dx


def _rmsnorm_bwd_w_fused_kernel(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    # One program per group of rows; whole rows in registers; the fp32 dweight
    # partial of the group is kept in registers and written once per group.
    m, n = x.size()
    g_block = hl.register_block_size(m)
    dx = x.new_empty([m, n])
    dw_part = x.new_empty([(m + g_block - 1) // g_block, n], dtype=torch.float32)
    for tile_g in hl.tile(m, block_size=g_block):
        acc = hl.zeros([n], dtype=torch.float32)
        for tile_r in hl.tile(tile_g.begin, tile_g.end):
            xf = x[tile_r, :].to(torch.float32)
            dyf = dy[tile_r, :].to(torch.float32)
            wf = weight[:].to(torch.float32)
            r = rstd[tile_r]
            xhat = xf * r[:, None]
            g = dyf * wf[None, :]
            c = torch.sum(g * xhat, dim=-1) / n
            dx[tile_r, :] = (r[:, None] * (g - xhat * c[:, None])).to(dx.dtype)
            acc = acc + torch.sum(dyf * xhat, dim=0)
        dw_part[tile_g.id, :] = acc
    return dx, dw_part


def _rmsnorm_bwd_rowdot_w_kernel(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
) -> torch.Tensor:
    # Per-row coefficient c = mean(g * xhat) with g = dy * weight (wide rows).
    m, n = x.size()
    cm = x.new_empty([m], dtype=torch.float32)
    for tile_m in hl.tile(m):
        xf = x[tile_m, :].to(torch.float32)
        g = dy[tile_m, :].to(torch.float32) * weight[:].to(torch.float32)[None, :]
        r = rstd[tile_m]
        cm[tile_m] = torch.sum(g * (xf * r[:, None]), dim=-1) / n
    return cm


def _rmsnorm_bwd_dxdw_w_kernel(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    cm: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    # 2-D grid over (row group, column block): writes dx and the fp32 dweight
    # partial sum of each row group for its column block (no atomics).
    m, n = x.size()
    g_block = hl.register_block_size(m)
    n_block = hl.register_block_size(n)
    dx = x.new_empty([m, n])
    dw_part = x.new_empty([(m + g_block - 1) // g_block, n], dtype=torch.float32)
    for tile_g, tile_n in hl.tile([m, n], block_size=[g_block, n_block]):
        wf = weight[tile_n].to(torch.float32)
        acc = hl.zeros([tile_n], dtype=torch.float32)
        for tile_r in hl.tile(tile_g.begin, tile_g.end):
            xf = x[tile_r, tile_n].to(torch.float32)
            dyf = dy[tile_r, tile_n].to(torch.float32)
            r = rstd[tile_r]
            c = cm[tile_r]
            xhat = xf * r[:, None]
            g = dyf * wf[None, :]
            dx[tile_r, tile_n] = (r[:, None] * (g - xhat * c[:, None])).to(dx.dtype)
            acc = acc + torch.sum(dyf * xhat, dim=0)
        dw_part[tile_g.id, tile_n] = acc
    return dx, dw_part


# =============================================================================
# Kernel objects with explicit configs, config selection, fallbacks.
# =============================================================================

_KERNELS: dict = {}
_FAILED: set = set()
_SMS: dict = {}


def _kernel(fn, cfg):
    """cfg = (block_sizes tuple, num_warps, reduction_loops tuple or None)."""
    key = (fn.__name__,) + tuple(cfg)
    k = _KERNELS.get(key)
    if k is None:
        block_sizes, num_warps, rloops = cfg
        kw = {"block_sizes": list(block_sizes), "num_warps": int(num_warps)}
        if rloops is not None:
            kw["reduction_loops"] = list(rloops)
        config = helion.Config(**kw)
        try:
            k = helion.kernel(config=config, static_shapes=True)(fn)
        except TypeError:
            k = helion.kernel(config=config)(fn)
        _KERNELS[key] = k
    return k


def _np2(v):
    v = max(1, int(v))
    return 1 << (v - 1).bit_length()


def _fp2(v):
    v = max(1, int(v))
    return 1 << (v.bit_length() - 1)


def _num_sms(device):
    if device.type != "cuda":
        return 1
    idx = device.index
    if idx is None:
        idx = torch.cuda.current_device()
    sms = _SMS.get(idx)
    if sms is None:
        sms = int(torch.cuda.get_device_properties(idx).multi_processor_count)
        _SMS[idx] = sms
    return sms


def _row_configs(M, N, persist_max, chunk, wide_warps):
    """Configs for the one-row-tile-per-program kernels (one rdim over N)."""
    npn = _np2(N)
    cfgs = []
    if npn <= persist_max:
        if npn <= 2048:
            bm = min(_fp2(M), 256, max(1, 4096 // npn))
            cfgs.append(((bm,), 4, None))
        elif npn <= 4096:
            cfgs.append(((1,), 8, None))
        else:
            cfgs.append(((1,), 16, None))
    else:
        cfgs.append(((1,), wide_warps, (min(chunk, npn // 2),)))
    # conservative fallback
    if npn <= 1024:
        cfgs.append(((1,), 4, None))
    else:
        cfgs.append(((1,), 4, (min(1024, npn // 2),)))
    return cfgs


def _fused_bwd_config(M, N, sms):
    npn = _np2(N)
    if npn <= 4096:
        br, nw = max(1, min(64, 4096 // npn)), 8
    else:
        br, nw = 1, 16
    g = min(1024, _fp2(max(1, M // max(1, sms))))
    br = min(br, g)
    return ((g, br), nw, None)


def _dxdw_configs(M, N):
    g = min(64, _fp2(M))
    bn = min(1024, _fp2(N))
    br = min(4, g)
    g2 = min(16, _fp2(M))
    return [((g, bn, br), 8, None), ((g2, min(256, _fp2(N)), 1), 4, None)]


def _sig(x, dy, weight):
    return (
        tuple(x.shape),
        tuple(x.stride()),
        None if dy is None else tuple(dy.stride()),
        x.dtype,
        str(x.device),
        weight is None,
    )


def _first_ok(attempts, sig):
    err = None
    for tag, thunk in attempts:
        fkey = (tag, sig)
        if fkey in _FAILED:
            continue
        try:
            return thunk()
        except Exception as e:  # compile failure etc.: try the next strategy
            _FAILED.add(fkey)
            err = e
    if err is None:
        raise RuntimeError("rmsnorm: no viable Helion kernel for this input")
    raise err


def _attempt(fn, cfg, args):
    def thunk():
        return _kernel(fn, cfg)(*args)

    return ((fn.__name__,) + tuple(cfg), thunk)


# =============================================================================
# Public API
# =============================================================================


def rmsnorm_fwd(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (y, rstd)."""
    M, N = x.shape
    eps = float(eps)
    attempts = []
    for cfg in _row_configs(M, N, 16384, 8192, 16):
        if weight is None:
            attempts.append(_attempt(_rmsnorm_fwd_nw_kernel, cfg, (x, eps)))
        else:
            attempts.append(_attempt(_rmsnorm_fwd_w_kernel, cfg, (x, weight, eps)))
    y, rstd = _first_ok(attempts, _sig(x, None, weight))
    return y, rstd


def rmsnorm_bwd(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns (dx, dweight)."""
    M, N = x.shape
    sig = _sig(x, dy, weight)

    if weight is None:
        attempts = [
            _attempt(_rmsnorm_bwd_nw_kernel, cfg, (dy, x, rstd))
            for cfg in _row_configs(M, N, 8192, 4096, 8)
        ]
        dx = _first_ok(attempts, sig)
        return dx, None

    attempts = []
    if _np2(N) <= 8192:
        cfg = _fused_bwd_config(M, N, _num_sms(x.device))
        attempts.append(
            _attempt(_rmsnorm_bwd_w_fused_kernel, cfg, (dy, x, weight, rstd))
        )

    c_cfgs = _row_configs(M, N, 16384, 4096, 8)
    d_cfgs = _dxdw_configs(M, N)
    for cc, dc in zip(c_cfgs, d_cfgs):

        def thunk(cc=cc, dc=dc):
            cm = _kernel(_rmsnorm_bwd_rowdot_w_kernel, cc)(dy, x, weight, rstd)
            return _kernel(_rmsnorm_bwd_dxdw_w_kernel, dc)(dy, x, weight, rstd, cm)

        tag = ("rowdot+dxdw",) + tuple(cc) + tuple(dc)
        attempts.append((tag, thunk))

    dx, dw_part = _first_ok(attempts, sig)
    dweight = dw_part.sum(dim=0).to(x.dtype)
    return dx, dweight
