"""Deliberately broken implementations (never registered in impls/): the checker must reject each.
They are the eager formulas in fp32 with one defect each."""

from types import SimpleNamespace

import torch

from impls.eager import kernels as eager


def _rms_bwd_bf16_accumulation(dy, x, weight, rstd):
    dx, _ = eager.rmsnorm_bwd(dy, x, weight, rstd)
    # dweight summed row by row in bf16: the accumulator loses low bits once it grows
    xhat = (x.float() * rstd.view(-1, 1)).to(torch.bfloat16)
    acc = torch.zeros(x.shape[-1], dtype=torch.bfloat16, device=x.device)
    for i in range(x.shape[0]):
        acc = acc + dy[i].to(torch.bfloat16) * xhat[i]
    return dx, acc.to(weight.dtype)


def bf16_accumulation():
    return SimpleNamespace(rmsnorm_fwd=eager.rmsnorm_fwd, rmsnorm_bwd=_rms_bwd_bf16_accumulation)


def _rms_fwd_nan(x, weight, eps):
    y, rstd = eager.rmsnorm_fwd(x, weight, eps)
    y = y.clone()
    y.view(-1)[y.numel() // 2] = float("nan")
    return y, rstd


def nan_output():
    return SimpleNamespace(rmsnorm_fwd=_rms_fwd_nan, rmsnorm_bwd=eager.rmsnorm_bwd)


def _rms_fwd_unwritten(x, weight, eps):
    y_ref, rstd = eager.rmsnorm_fwd(x, weight, eps)
    y = torch.empty_like(y_ref)  # poisoned by the checker
    y[:, :-1] = y_ref[:, :-1]  # forgets the last column
    return y, rstd


def unwritten_column():
    return SimpleNamespace(rmsnorm_fwd=_rms_fwd_unwritten, rmsnorm_bwd=eager.rmsnorm_bwd)


def _rms_fwd_wrong_eps(x, weight, eps):
    return eager.rmsnorm_fwd(x, weight, eps * 10)


def _ln_fwd_no_eps(x, weight, bias, eps):
    return eager.layernorm_fwd(x, weight, bias, 0.0)


def wrong_eps():
    return SimpleNamespace(
        rmsnorm_fwd=_rms_fwd_wrong_eps, rmsnorm_bwd=eager.rmsnorm_bwd, layernorm_fwd=_ln_fwd_no_eps, layernorm_bwd=eager.layernorm_bwd
    )


def _ln_fwd_bf16_stats(x, weight, bias, eps):
    y, mean, rstd = eager.layernorm_fwd(x, weight, bias, eps)
    return y, mean.to(torch.bfloat16).float(), rstd.to(torch.bfloat16).float()


def bf16_statistics():
    return SimpleNamespace(layernorm_fwd=_ln_fwd_bf16_stats, layernorm_bwd=eager.layernorm_bwd)


def _rms_fwd_stats_bf16_dtype(x, weight, eps):
    y, rstd = eager.rmsnorm_fwd(x, weight, eps)
    return y, rstd.to(torch.bfloat16)


def wrong_stats_dtype():
    return SimpleNamespace(rmsnorm_fwd=_rms_fwd_stats_bf16_dtype, rmsnorm_bwd=eager.rmsnorm_bwd)


def _rms_bwd_no_rstd_term(dy, x, weight, rstd):
    # forgets the gradient through rstd: dx = rstd * dy * w
    dx = (rstd.view(-1, 1) * dy.float() * weight.float()).to(x.dtype)
    _, dw = eager.rmsnorm_bwd(dy, x, weight, rstd)
    return dx, dw


def missing_rstd_gradient():
    return SimpleNamespace(rmsnorm_fwd=eager.rmsnorm_fwd, rmsnorm_bwd=_rms_bwd_no_rstd_term)


def _raises(*a, **k):
    raise RuntimeError("kernel launch failed (simulated)")


def crashing():
    return SimpleNamespace(rmsnorm_fwd=_raises, rmsnorm_bwd=_raises, layernorm_fwd=_raises, layernorm_bwd=_raises)


def dweight_16bit_row_blocks(block: int = 100):
    """Each block of ``block`` rows (one program's share) sums its dweight partial in fp32, but the
    partials are added up in x's dtype: the bug `normbench check --shapes smoke,edge` caught in fp16
    on the 128-row smoke shapes. With 100 rows per block no edge shape spans two blocks' worth of
    error, so only a 128-row shape shows it."""

    def rmsnorm_bwd(dy, x, weight, rstd):
        n = x.shape[-1]
        dy2, x2 = dy.reshape(-1, n), x.reshape(-1, n)  # the checker hands 3-D shapes over as they are
        dx, _ = eager.rmsnorm_bwd(dy2, x2, weight, rstd.reshape(-1))
        acc = torch.zeros(n, dtype=x.dtype, device=x.device)
        for part in (dy2.float() * x2.float() * rstd.reshape(-1, 1)).split(block):
            acc = acc + part.sum(0).to(x.dtype)
        return dx.reshape(x.shape), acc.to(weight.dtype)

    return SimpleNamespace(rmsnorm_fwd=eager.rmsnorm_fwd, rmsnorm_bwd=rmsnorm_bwd)


def _add_rms_bwd_no_dresidual(dy, dresidual_out, residual_out, weight, rstd):
    # forgets the gradient that reaches h through the residual stream
    return eager.add_rmsnorm_bwd(dy, None, residual_out, weight, rstd)


def dh_without_dresidual():
    return SimpleNamespace(add_rmsnorm_fwd=eager.add_rmsnorm_fwd, add_rmsnorm_bwd=_add_rms_bwd_no_dresidual)


def _rms_fwd_weight_in_bf16(x, weight, eps):
    # the (offset + w) weight rounded to bf16, as an add of the offset in bf16 leaves it: 1 + w -> 1
    return eager.rmsnorm_fwd(x, weight.to(torch.bfloat16).to(weight.dtype), eps)


def offset_in_bf16():
    return SimpleNamespace(rmsnorm_fwd=_rms_fwd_weight_in_bf16, rmsnorm_bwd=eager.rmsnorm_bwd)


def _rms_bwd_dweight_in_x_dtype(dy, x, weight, rstd):
    dx, dw = eager.rmsnorm_bwd(dy, x, weight, rstd)
    return dx, dw.to(x.dtype)


def dweight_in_x_dtype():
    return SimpleNamespace(rmsnorm_fwd=eager.rmsnorm_fwd, rmsnorm_bwd=_rms_bwd_dweight_in_x_dtype)


def _ln_fwd_overflow_to_bias(x, weight, bias, eps):
    # var = inf -> rstd = rsqrt(inf) = 0 -> y = bias: finite and wrong where torch returns NaN
    xf = x.float()
    var, mean = torch.var_mean(xf, -1, correction=0, keepdim=True)
    rstd = torch.rsqrt(var + eps)
    y = (xf - mean) * rstd * weight.float() + bias.float()
    return y.to(x.dtype), mean.squeeze(-1), rstd.squeeze(-1)


def overflow_to_bias():
    return SimpleNamespace(layernorm_fwd=_ln_fwd_overflow_to_bias, layernorm_bwd=eager.layernorm_bwd)
