"""Device time of each kernel a backward launches (torch.profiler, the mean over 10 calls after 3
warm-up calls), bf16, per implementation, op and (M, N); the line beside each shape is the time the
bytes model (x and dy read, dx written) takes at 3 TB/s.

    python tools/experiments/kernel_times.py cute,triton,quack 131072x128,1048576x128 rmsnorm,layernorm OUT.json

Written for the CuTe DSL backward's short rows (reports/experiments/cute-backward/short-rows-fold/):
the harness times a backward whole, and this says which of its kernels takes the time."""
import sys, json, torch
from torch.profiler import profile, ProfilerActivity
from harness.registry import get

names = sys.argv[1].split(",")
shapes = [tuple(map(int, s.split("x"))) for s in sys.argv[2].split(",")]
ops = sys.argv[3].split(",") if len(sys.argv) > 3 else ["rmsnorm"]
reps = 10
out = []
for name in names:
    k = get(name).kernels()
    for op in ops:
        for m, n in shapes:
            g = torch.Generator(device="cuda").manual_seed(0)
            x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, generator=g)
            dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, generator=g)
            w = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=g)
            b = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=g)
            if op == "rmsnorm":
                _, rstd = k.rmsnorm_fwd(x, w, 1e-6)
                f = lambda: k.rmsnorm_bwd(dy, x, w, rstd)
            else:
                _, mean, rstd = k.layernorm_fwd(x, w, b, 1e-6)
                f = lambda: k.layernorm_bwd(dy, x, w, mean, rstd)
            for _ in range(3):
                f()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as p:
                for _ in range(reps):
                    f()
                torch.cuda.synchronize()
            kern = {}
            for e in p.key_averages():
                t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
                if t and e.count:
                    kern[e.key[:90]] = (e.count / reps, t / reps)
            total = sum(v[1] for v in kern.values())
            row = {"impl": name, "op": op, "shape": f"{m}x{n}", "kernels": kern, "total_us": total,
                   "model_us": 3 * m * n * 2 / 3.0e6}
            out.append(row)
            print(f"{name:7s} {op:9s} {m}x{n}: {total:7.1f} us (3 units at 3 TB/s: {row['model_us']:.1f})")
            for kname, (c, t) in sorted(kern.items(), key=lambda kv: -kv[1][1]):
                print(f"      {t:7.1f} us  x{c:.0f}  {kname}")
json.dump(out, open(sys.argv[4] if len(sys.argv) > 4 else "/tmp/prof.json", "w"), indent=1)
