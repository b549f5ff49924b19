# CuTe backward launch knobs, timed per (variant, op, N) on the sweep's bytes; outputs compared with the
# baseline variant's. Also times torch's slot reduction of the partials alone.
import json, os, sys, time, math
import torch, triton.testing
from harness import roofline, registry
from harness.bench import callables
from harness.inputs import make_case
from harness.shapes import Shape, SWEEP_ELEMENTS
from impls.cute import kernels as K

OUT = os.environ["OUT"]; deadline = time.time() + float(sys.argv[1]) if len(sys.argv) > 1 else 1e18
tag = sys.argv[2] if len(sys.argv) > 2 else "x"
copy = roofline.measure_copy_bandwidth()["tbps"]
NS = [int(v) for v in os.environ.get("XNS", "1024,2048,2880,4096,5120,7168,8192,16384,32768,65536,262144,3072,6144,12288").split(",")]
OPS = os.environ.get("XOPS", "rmsnorm,layernorm,add_rmsnorm").split(",")
BASE = dict(_WHOLE_WARPS_RMS=True, _BWD_THREADS_PER_SM=512, _MAX_STAGES=4, _VECS_PER_THREAD={"fwd": 4, "bwd": 2})
VARIANTS = json.loads(os.environ.get("XVARS", "{}")) or {
    "base": {}, "t768": {"_BWD_THREADS_PER_SM": 768}, "t1024": {"_BWD_THREADS_PER_SM": 1024},
    "s3": {"_MAX_STAGES": 3},
    "v4": {"_VECS_PER_THREAD": {"fwd": 4, "bwd": 4}}, "v4t1024": {"_VECS_PER_THREAD": {"fwd": 4, "bwd": 4}, "_BWD_THREADS_PER_SM": 1024},
    "c16": {"_MAX_CHUNK_BYTES_BWD": 16384}, "c16t1024": {"_MAX_CHUNK_BYTES_BWD": 16384, "_BWD_THREADS_PER_SM": 1024},
}
_slot_new = K.slot_threads
def setv(v):
    v = dict(v); rule = v.pop("_SLOT_RULE", "new")
    K.slot_threads = _slot_new if rule == "new" else (lambda s: 8 if s <= 16 else 64)
    for a, b in {**BASE, **v}.items(): setattr(K, a, b)
    K.planned_launch.cache_clear(); K.kernel_key.cache_clear(); K._COMPILED.clear(); K._RESIDENT.clear()
res = []
f = open(f"{OUT}/xbwd-{tag}.jsonl", "w")
for op in OPS:
    for n in NS:
        if time.time() > deadline: break
        m = SWEEP_ELEMENTS // n
        case = make_case(op, Shape((m, n)), torch.bfloat16, "cuda", seed=1)
        b = roofline.bytes_moved(op, "bwd", m, n, 2)
        ref = None
        for name, v in VARIANTS.items():
            if time.time() > deadline: break
            setv(v)
            row = dict(variant=name, op=op, N=n, M=m)
            try:
                fn = callables(K, op, "bwd", case)
                t0 = time.time(); outs = fn(); torch.cuda.synchronize(); row["first_s"] = round(time.time() - t0, 2)
                key = [kk for kk in K._COMPILED if kk[1] == "bwd"][-1]
                kern = K._COMPILED[key][1]
                row["launch"] = str(kern.launch); row["ring"] = str(kern.ring); row["resident"] = K._RESIDENT.get(key)
                outs = [o for o in outs if o is not None]
                if ref is None: ref = [o.float().clone() for o in outs]
                else:
                    row["err"] = [float(((o.float() - r).abs().max() / r.abs().max().clamp_min(1e-30))) for o, r in zip(outs, ref)]
                ms = triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")
                L = kern.launch; slots = min(-(-m // L.rows_per_cta), row["resident"] or 1) * L.rows_per_cta
                P = torch.empty((2 if op == "layernorm" else 1, slots, n), device="cuda")
                row["slots"] = slots
                row["reduce_ms"] = triton.testing.do_bench(lambda: [p.sum(0).to(torch.bfloat16) for p in P], warmup=5, rep=20, return_mode="median")
                del P
                row["ms"] = ms; row["frac"] = round(roofline.tbps(b.main, ms) / copy, 4)
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            res.append(row); f.write(json.dumps(row) + "\n"); f.flush()
            print(f"{op:12s} {n:7d} {name:10s} {row.get('frac', row.get('error'))} {row.get('err','')} {row.get('launch','')[:0]}", flush=True)
        del case, ref
        torch.cuda.empty_cache()
json.dump({"copy_tbps": copy, "gpu": torch.cuda.get_device_name(0)}, open(f"{OUT}/xbwd-{tag}-meta.json", "w"))
