"""fp32 -> float8_e4m3fn in Triton's CPU interpreter: its own conversion (.to(tl.float8e4nv)), the
kernels' rounding by hand (impls/triton/fp8.py: _to_e4m3), and the exact value (harness.spec.fp8)."""

import json
import os
import platform

# before triton's first import: its language functions are bound to the interpreter then
os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from harness.spec.fp8 import e4m3_round  # noqa: E402
from impls.triton.fp8 import _to_e4m3  # noqa: E402


@triton.jit
def native(V, Q, N: tl.constexpr):
    o = tl.arange(0, N)
    tl.store(Q + o, tl.load(V + o).to(tl.float8e4nv))


@triton.jit
def by_hand(V, Q, N: tl.constexpr):
    o = tl.arange(0, N)
    tl.store(Q + o, _to_e4m3(tl.load(V + o)))


probes = [
    17.0,
    19.0,
    0.0009765625,
    0.00146484375,
    0.0029296875,
    1.0625,
    448.00003,
    463.9,
    464.0,
    480.0,
    1000.0,
    -1000.0,
]
n = 16
v = torch.zeros(n)
v[: len(probes)] = torch.tensor(probes)
rows = []
outs = {}
for name, k in (("interpreter .to(float8e4nv)", native), ("_to_e4m3 (by hand)", by_hand)):
    q = torch.empty(n, dtype=torch.float8_e4m3fn)
    k[(1,)](v, q, N=n)
    outs[name] = [x if x == x else "NaN" for x in q.double()[: len(probes)].tolist()]
exact = e4m3_round(v.double())[: len(probes)].tolist()
# every tie between e4m3 values and both neighbours of each: how many the interpreter gets wrong
vals = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).double()
e4 = torch.unique(vals[torch.isfinite(vals)])
mid = ((e4[:-1] + e4[1:]) / 2).float()
allv = torch.cat([mid, torch.nextafter(mid, mid - 1), torch.nextafter(mid, mid + 1), e4.float()])
m = triton.next_power_of_2(allv.numel())
buf = torch.zeros(m)
buf[: allv.numel()] = allv
wrong = {}
for name, k in (("interpreter .to(float8e4nv)", native), ("_to_e4m3 (by hand)", by_hand)):
    q = torch.empty(m, dtype=torch.float8_e4m3fn)
    k[(1,)](buf, q, N=m)
    got = q.double()
    ref = e4m3_round(buf.double())
    wrong[name] = int(((got != ref) & ~(got.isnan() & ref.isnan())).sum())
print(
    json.dumps(
        {
            "command": "PYTHONPATH=. python tools/experiments/fp8_interpreter_conversion.py",
            "environment": {
                "python": platform.python_version(),
                "torch": torch.__version__,
                "triton": triton.__version__,
                "TRITON_INTERPRET": "1",
                "device": "cpu",
            },
            "probes": [
                {"value": p, "exact": e, **{k: outs[k][i] for k in outs}} for i, (p, e) in enumerate(zip(probes, exact))
            ],
            "grid_values_tested": int(allv.numel()),
            "wrong_of_grid": wrong,
        },
        indent=1,
    )
)
