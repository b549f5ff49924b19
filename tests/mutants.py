"""Deliberately broken implementations (never registered in impls/): the checker must reject each.
They are the eager formulas in fp32 (or the fp64 reference rounded once) with one defect each; beside
them, errors of a chosen size on either side of a tolerance (``shifted``), kernels that depend on the
batch or on the order partials arrive in (harness.run.invariance), and a slow and an interrupted
kernel for the check loop."""

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


def biased(factor: float = 1.005):
    """Every function the fp64 reference rounded once to the contract's dtypes, with its first
    output (y; dx / dh) scaled by ``factor`` before that rounding: at 1.005 each element is within
    2 ulps of bf16, all of them off in the same direction (a wrong constant, an eps counted twice)."""
    from harness.spec.ops import OPS as RECORDS

    def function(rec, direction):
        outputs = rec.fwd_outputs if direction == "fwd" else rec.bwd_outputs
        rows_arg = 0 if direction == "fwd" else [a.name for a in rec.bwd_args].index(rec.normed)
        names = [a.name for a in (rec.fwd_args if direction == "fwd" else rec.bwd_args)]

        def call(*args):
            x = args[rows_arg]
            w = args[names.index("weight")]
            out = []
            for i, (a, r) in enumerate(zip(outputs, rec.reference(direction)(*args))):
                r = r * factor if i == 0 else r
                kind = x.dtype if a.kind == "rows" else torch.float32 if a.kind == "stat" else (w.dtype if w is not None else x.dtype)
                out.append(None if r is None else r.to(kind))
            return tuple(out)

        return call

    return SimpleNamespace(**{rec.function(d): function(rec, d) for rec in RECORDS.values() if not rec.quantized for d in rec.directions})


def shifted(where: str = "all", ulps: float = 0.0, rel: float = 0.0, of_rms: float = 0.0):
    """RMSNorm's forward from the fp64 reference, y rounded once to x's dtype, with the elements
    ``where`` says ("all"; "largest" / "smallest": the element of each row of largest / smallest
    magnitude) moved by ``ulps`` spacings of x's dtype at the reference value plus ``rel`` * |ref|
    plus ``of_rms`` * the RMS of the reference row, toward larger magnitudes (negative: toward
    zero). Errors of a chosen size, independent of harness/spec/tolerances.py's numbers, to hold
    those numbers to a threshold from both sides."""
    from harness.spec import reference
    from harness.spec.tolerances import ulp

    def rmsnorm_fwd(x, weight, eps):
        y, rstd = reference.rmsnorm_fwd(x, weight, eps)
        rms = y.square().mean(-1, keepdim=True).sqrt()
        move = torch.sign(y) * (ulps * ulp(y, x.dtype) + rel * y.abs() + of_rms * rms)
        if where != "all":
            mag = y.abs() if where == "largest" else -y.abs()
            pick = torch.zeros_like(y, dtype=torch.bool).scatter_(-1, mag.argmax(-1, keepdim=True), True)
            move = torch.where(pick, move, 0.0)
        return (y + move).to(x.dtype), rstd.float()

    return SimpleNamespace(rmsnorm_fwd=rmsnorm_fwd, rmsnorm_bwd=eager.rmsnorm_bwd)


def _walked_with_x_stride(dy, x):
    # torch refuses a view past the end of dy's storage, as a kernel would read past it
    return dy if dy.stride() == x.stride() else torch.as_strided(dy, x.shape, x.stride(), dy.storage_offset())


def dy_walked_with_x_stride():
    """A backward that walks dy with x's row stride (a kernel given one stride for both): right
    while dy and x are laid out alike, wrong elements (or a read past dy's end) otherwise."""

    def rmsnorm_bwd(dy, x, weight, rstd):
        return eager.rmsnorm_bwd(_walked_with_x_stride(dy, x), x, weight, rstd)

    def layernorm_bwd(dy, x, weight, mean, rstd):
        return eager.layernorm_bwd(_walked_with_x_stride(dy, x), x, weight, mean, rstd)

    return SimpleNamespace(rmsnorm_fwd=eager.rmsnorm_fwd, rmsnorm_bwd=rmsnorm_bwd, layernorm_fwd=eager.layernorm_fwd, layernorm_bwd=layernorm_bwd)


def batch_variant():
    """A kernel whose result depends on the batch: rstd (and the backward's dx) nudged by a term
    that grows with M (another code path for larger batches, a split reduction), each still far
    inside the tolerance."""

    def nudge(m):
        return 1.0 + 2.0**-20 * min(m - 1, 8)

    def rmsnorm_fwd(x, weight, eps):
        xf = x.float()
        rstd = torch.rsqrt(xf.square().mean(-1) + eps) * nudge(x.shape[0])
        y = xf * rstd[:, None] * (weight.float() if weight is not None else 1.0)
        return y.to(x.dtype), rstd

    def rmsnorm_bwd(dy, x, weight, rstd):
        dx, dw = eager.rmsnorm_bwd(dy, x, weight, rstd)
        return (dx.float() * nudge(x.shape[0])).to(dx.dtype), dw

    return SimpleNamespace(rmsnorm_fwd=rmsnorm_fwd, rmsnorm_bwd=rmsnorm_bwd)


def nondeterministic(block: int = 8):
    """dweight as float atomics leave it: per-block fp32 partials (``block`` rows each) added in
    whatever order the blocks finish, emulated by a fresh random order on every call."""

    def rmsnorm_bwd(dy, x, weight, rstd):
        dx, _ = eager.rmsnorm_bwd(dy, x, weight, rstd)
        if weight is None:
            return dx, None
        parts = [p.sum(0) for p in (dy.float() * x.float() * rstd[:, None]).split(block)]
        acc = torch.zeros(x.shape[-1], dtype=torch.float32, device=x.device)
        for i in torch.randperm(len(parts)).tolist():
            acc = acc + parts[i]
        return dx, acc.to(weight.dtype)

    return SimpleNamespace(rmsnorm_fwd=eager.rmsnorm_fwd, rmsnorm_bwd=rmsnorm_bwd)


def interrupting(after: int = 2, tag: str = ""):
    """Ctrl-C in the middle of a run: the forward works ``after`` times, then raises
    KeyboardInterrupt (``tag`` keeps one test's counter from another's: loaded kernels are cached
    per record and options)."""
    calls = []

    def rmsnorm_fwd(x, weight, eps):
        calls.append(1)
        if len(calls) > after:
            raise KeyboardInterrupt
        return eager.rmsnorm_fwd(x, weight, eps)

    return SimpleNamespace(rmsnorm_fwd=rmsnorm_fwd, rmsnorm_bwd=eager.rmsnorm_bwd)


def slow(seconds: float = 0.5):
    """A correct forward that takes ``seconds`` a call (a compile, an interpreter on a wide row)."""
    import time

    def rmsnorm_fwd(x, weight, eps):
        time.sleep(seconds)
        return eager.rmsnorm_fwd(x, weight, eps)

    return SimpleNamespace(rmsnorm_fwd=rmsnorm_fwd, rmsnorm_bwd=eager.rmsnorm_bwd)


def _packed(t):
    """A (T, H, N) per-head view read as if its heads were packed (token stride H * N): what a kernel
    given one row stride does with the view of a fused QKV tensor. Rows past the first token's read
    the parent's other heads (right only while the view is contiguous)."""
    if t.dim() != 3:
        return t
    return torch.as_strided(t, (t.shape[0] * t.shape[1], t.shape[2]), (t.stride(1), 1), t.storage_offset())


def heads_read_as_packed():
    """A ``row_views`` kernel that takes its per-head views' row r at r * N (one row stride)."""

    def rmsnorm_fwd(x, weight, eps):
        return eager.rmsnorm_fwd(_packed(x), weight, eps)

    def rmsnorm_bwd(dy, x, weight, rstd):
        return eager.rmsnorm_bwd(_packed(dy), _packed(x), weight, rstd)

    return SimpleNamespace(rmsnorm_fwd=rmsnorm_fwd, rmsnorm_bwd=rmsnorm_bwd)


def heads_reshaped():
    """The honest ``row_views`` kernel: the per-head view flattened by torch (a copy), as eager."""

    def rows(t):
        return t.reshape(-1, t.shape[-1]) if t.dim() == 3 else t

    def rmsnorm_fwd(x, weight, eps):
        return eager.rmsnorm_fwd(rows(x), weight, eps)

    def rmsnorm_bwd(dy, x, weight, rstd):
        return eager.rmsnorm_bwd(rows(dy), rows(x), weight, rstd)

    return SimpleNamespace(rmsnorm_fwd=rmsnorm_fwd, rmsnorm_bwd=rmsnorm_bwd)
