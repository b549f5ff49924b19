"""Triton-specific tests: config selection, the kernel paths the generic smoke/edge checks do not
reach under the interpreter (column-chunked rows, column-sliced backward, the persistent backward's
row split), the fused add + RMSNorm and fp32 weights beside 16-bit x on every path, and rows whose
statistics overflow fp32. The generic correctness tests over every registered implementation live
elsewhere."""

import importlib.util
import itertools
import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)
if not torch.cuda.is_available():
    # Triton's own @jit helpers (tl.cdiv, ...) only run under the interpreter if the variable is set
    # before triton is first imported, not merely before our kernels are.
    os.environ["TRITON_INTERPRET"] = "1"

from harness.run.checker import compare, poisoned_allocations, run_check  # noqa: E402
from harness.spec.contract import DTYPES, Implementation, package  # noqa: E402
from harness.spec.inputs import make_case  # noqa: E402
from harness.spec.ops import get_op  # noqa: E402
from harness.spec.shapes import SHAPE_SETS, Shape  # noqa: E402
from impls.triton import configs as C  # noqa: E402  (imports no triton kernels)

IMPL = Implementation(
    name="triton-test", dsl="triton", entry="impls.triton.kernels", devices=("cpu", "cuda"),
    requires=(package("triton"),), interpreter="TRITON_INTERPRET", ops=("rmsnorm", "layernorm", "add_rmsnorm"),
    row_views=True,
)  # fmt: skip
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _kernels(fwd_cfg, bwd_cfg):
    """The contract functions pinned to explicit configs, behind the harness's own input handling
    (reshaping, M = 0), for run_check: what ``normbench tune`` checks each candidate with."""
    IMPL.kernels(DEVICE)  # sets TRITON_INTERPRET on the CPU before the module is imported
    from impls.triton.tune import pinned_kernels

    return pinned_kernels(IMPL, fwd_cfg, bwd_cfg)


def check(kernels, op_name, direction, shape, dtype="bf16", weight_dtype=None, dresidual=True, seed=0):
    """Check one point of any op against its fp64 reference, as ``harness.run.checker`` does (poisoned
    allocations, its tolerances and tolerance scales), driven by the op's record, with the
    parameters in ``weight_dtype`` (fp32 beside 16-bit x: mixed precision) and dresidual_out
    optional. Returns the failing tensors' reports."""
    op = get_op(op_name)
    dt = DTYPES[dtype]
    values = dict(make_case(op_name, shape, dt, DEVICE, seed))
    other = make_case(op_name, shape, dt, DEVICE, seed + 1)  # residual and dresidual_out drawn like x and dy
    values.setdefault("residual", other["x"])
    values.setdefault("dresidual_out", other["dy"])
    params = make_case(op_name, shape, DTYPES[weight_dtype or dtype], DEVICE, seed)
    values.update(weight=params["weight"], bias=params["bias"])
    x, n = values["x"], shape.n
    fn = getattr(kernels, op.function(direction))
    ref_fwd = op.reference_fwd(*(values[a.name] for a in op.fwd_args))
    if direction == "fwd":
        args, ref, outputs, scales = [values[a.name] for a in op.fwd_args], ref_fwd, op.fwd_outputs, {}
    else:
        # the backward gets the reference statistics rounded to fp32, residual_out as stored
        given, ref_given = dict(values), dict(values)
        for a, t in zip(op.fwd_outputs, ref_fwd):
            if a.kind == "stat":
                given[a.name], ref_given[a.name] = t.float(), t
            elif a.name == "residual_out":
                given[a.name] = ref_given[a.name] = t.to(dt)
        if not dresidual:
            given["dresidual_out"] = ref_given["dresidual_out"] = None
        args = [given[a.name] for a in op.bwd_args]
        ref, outputs = op.reference_bwd(*(ref_given[a.name] for a in op.bwd_args)), op.bwd_outputs
        saved = given.get("residual_out", x).double().reshape(-1, n)
        dy, rstd = values["dy"].double().reshape(-1, n), ref_given["rstd"].reshape(-1, 1)
        w = values["weight"].double() if values["weight"] is not None else 1.0
        rows_scale = (dy * w * rstd).abs()
        if given["dresidual_out"] is not None:
            rows_scale = rows_scale + given["dresidual_out"].double().reshape(-1, n).abs()
        scales = {"rows": rows_scale.reshape(x.shape), "dweight": (dy * saved * rstd).square().sum(0).sqrt(),
                  "dbias": dy.square().sum(0).sqrt()}  # fmt: skip
    with poisoned_allocations():
        out = fn(*args)
    assert isinstance(out, tuple) and len(out) == len(outputs), f"{op.function(direction)} returned {out!r:.200}"
    kinds = {"rows": (dt, x.shape), "stat": (torch.float32, x.shape[:-1])}
    kinds["param"] = (values["weight"].dtype if values["weight"] is not None else dt, (n,))
    reports = [
        compare(a.name, o, r, *kinds[a.kind], scales.get("rows" if a.kind == "rows" else a.name))
        for a, o, r in zip(outputs, out, ref)
    ]  # fmt: skip
    return [r for r in reports if not r.passed]


# ------------------------------------------------------------------------------- configs
def test_bucket_is_the_register_tile_width():
    assert [C.bucket(n) for n in (1, 7, 16, 17, 1000, 2880, 4096, 4097, 262144)] == [
        16, 16, 16, 32, 1024, 4096, 4096, 8192, 262144,
    ]  # fmt: skip


def test_pinned_table_is_well_formed():
    with open(C.CONFIG_FILE) as f:
        raw = json.load(f)
    for gpu, table in raw.items():
        if gpu.startswith("_"):
            continue
        for key, by_bucket in table.items():
            odd = key.endswith("_odd")  # the realigned kernels' table: whole rows, by bucket
            op, _, direction = key.removesuffix("_odd").rpartition("_")
            assert op in ("rmsnorm", "layernorm", "add_rmsnorm") and direction in ("fwd", "bwd"), key
            for b, entry in by_bucket.items():
                cfg = C.Config(**entry)
                assert not odd or (cfg.realign and not (cfg.chunk or cfg.slice) and C.bucket(int(b)) == int(b)), (
                    f"{gpu} {key} {b}: a realigned whole-row config, by bucket")
                assert int(b) >= 1, f"{gpu} {key}: {b} is not an N"
                assert cfg.chunk == 0 or C.bucket(cfg.chunk) == cfg.chunk, f"{gpu} {key} {b}: chunk"
                assert cfg.slice == 0 or C.bucket(cfg.slice) == cfg.slice, f"{gpu} {key} {b}: slice"
                assert not cfg.row_sums or direction == "bwd", f"{gpu} {key} {b}: row sums are bwd only"
                assert not cfg.slice or direction == "bwd" or cfg.sync, f"{gpu} {key} {b}: forward slices exchange"
                assert cfg.rows >= 1 and cfg.rows & (cfg.rows - 1) == 0, f"{gpu} {key} {b}: rows must be a power of two"
                assert cfg.warps in (1, 2, 4, 8, 16, 32) and cfg.programs_per_sm >= 1
                assert cfg.ahead in (1, 2) and (cfg.ahead == 1 or cfg.slice), f"{gpu} {key} {b}: ahead"
                if cfg.sync:  # the launcher would fall back to the row-sums kernel otherwise
                    slots = cfg.rows * C.bucket(-(-C.bucket(int(b)) // cfg.slice))
                    assert cfg.slice and slots <= 32, f"{gpu} {key} {b}: {slots} slots to wait on"


def test_a_config_loading_other_than_one_or_two_blocks_ahead_is_refused():
    for ahead in (0, 3):
        with pytest.raises(ValueError, match="ahead must be 1 or 2"):
            C.Config(slice=256, sync=True, ahead=ahead)


def _sm90a_build(flag: str):
    """``python -m impls.triton.sm90a_build FLAG``'s JSON line, run in a process of its own: this
    one may run Triton's interpreter, which cannot compile."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "impls.triton.sm90a_build", flag], env=env, check=False,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_pinned_exchanging_backwards_wait_within_each_warp():
    """Each pinned ``sync`` config, built for sm_90a: no barrier inside the loop that waits for the
    siblings (see ``kernels._await_sums``), and a control that has some, so the count is real."""
    waits = _sm90a_build("--waits")
    control = waits.pop("control: 2 rows x 32 slices")
    assert waits, "no pinned config exchanges row sums"
    assert all(v == 0 for v in waits.values()), waits
    assert control > 0


def test_pinned_exchanging_backwards_fit_the_programs_per_sm_they_ask_for():
    """Each pinned ``sync`` config that asks for several programs per SM, built for sm_90a: its
    binary lets an SM hold that many (else the launcher, which caps them at what the binary holds,
    would run fewer than the table says)."""
    held = _sm90a_build("--residency")
    assert held, "no pinned exchanging config asks for several programs per SM"
    assert all(h >= wanted for h, wanted in held.values()), held


def test_exchanging_forward_builds_post_and_wait_within_each_warp():
    """The exchanging forward's candidates (``configs.FWD_EXCHANGE``), built for sm_90a at the
    widest N up to 262144 whose slots fit one warp (8192-column slices: 32 slices, one warp's worth)
    and the first at N = 20000 (3 slices, the last short): one atomic exchange per posted value
    (LayerNorm posts two), one wait loop polling every posted plane (LayerNorm's two together:
    ``kernels._await_slots``), no barrier inside a wait loop and 16-byte loads. Spills are
    recorded, not held to zero: 16384-column slices on 16 warps spill (the fused add's 32 bytes a
    thread at 262144) and were measured faster anyway (docs/kernels/triton.md)."""
    code = """
import json, re
from impls.triton import sm90a_build as B  # first: it sets up the compile-only target
from harness.spec.ptx import poll_loops, spin_barriers
from impls.triton import configs as C, kernels as K
out = {}
for op in ("rmsnorm", "layernorm", "add_rmsnorm"):
    for i, cfg in enumerate(C.FWD_EXCHANGE):
        widest = max(n for n in (65536, 131072, 262144) if K.slots_fit(cfg.rows, -(-n // cfg.slice)))
        for n in (widest, 20000) if i == 0 else (widest,):
            k = B.build_config(op, "fwd", n, cfg)
            ptx = k.asm["ptx"]
            out[f"{op} {n} {i}"] = dict(exch=len(re.findall(r"atom[.\\w]*\\.exch", ptx)), loops=poll_loops(ptx),
                                        barriers=spin_barriers(ptx), stack=B.resources(k)[1],
                                        v4=len(re.findall(r"ld\\.global[.\\w]*\\.v4", ptx)),
                                        pinned=any(C.lookup(g, op, "fwd", w) == cfg for g in C.pinned_table()
                                                   for w in (16384, 32768, 65536, 131072, 262144)))
print(json.dumps(out))
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, check=False, capture_output=True, text=True,
                          timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    built = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(built) == 3 * (len(C.FWD_EXCHANGE) + 1)
    assert any(b["pinned"] for b in built.values()), "no pinned config among the candidates"
    for key, b in built.items():
        posts = 2 if key.startswith("layernorm") else 1
        assert b["exch"] == posts and b["loops"] == [posts], (key, b)  # one wait loop polling each plane
        assert b["barriers"] == 0 and b["v4"] > 0, (key, b)


def test_exchanging_forward_grid_keeps_every_sibling_resident():
    """One program per SM: groups x slices programs, no more than the SMs, every row block in some
    group; none (the chunked forward instead) where the slices outnumber the SMs or a block's slots
    pass one warp's 32."""
    from impls.triton import kernels as K

    cfg = C.FWD_EXCHANGE[0]
    for n, m in itertools.product((8192, 16384, 20000, 24576, 49152, 131072, 262144), (1, 7, 512, 8192)):
        groups, slices = K.exchange_grid(cfg, m, n, 132)
        assert slices == -(-n // cfg.slice) and 1 <= groups <= m
        assert groups == min(m, 132 // slices) and groups * slices <= 132  # as many groups as the SMs hold
    assert K.exchange_grid(cfg, 512, 262144, 132) == (4, 32)
    assert K.exchange_grid(cfg, 512, 262144, 16) == (0, 32)  # 32 slices, 16 SMs
    assert K.exchange_grid(replace(cfg, rows=2), 512, 262144, 132) == (0, 32)  # 64 slots
    assert K.exchange_grid(replace(cfg, rows=2), 512, 131072, 132) == (8, 16)


def test_only_the_measured_winner_pins_the_exchanging_forward():
    """The chunked forward everywhere but where the exchange measured faster (the H100's RMSNorm
    and fused add at the 131072 and 262144 buckets, LayerNorm at 131072:
    reports/experiments/triton-wide-fwd/): no other table entry, heuristic or search candidate of
    the forward exchanges (an entry with ``sync`` and ``slice`` would)."""
    h100 = "NVIDIA H100 80GB HBM3"
    pinned = {(h100, "rmsnorm", 131072), (h100, "rmsnorm", 262144), (h100, "layernorm", 131072),
              (h100, "add_rmsnorm", 131072), (h100, "add_rmsnorm", 262144)}  # fmt: skip
    for gpu, n, op in itertools.product(C.pinned_table(), (16384, 24576, 32768, 49152, 65536, 98304, 131072, 262144),
                                        ("rmsnorm", "layernorm", "add_rmsnorm")):  # fmt: skip
        cfg = C.lookup(gpu, op, "fwd", n)
        assert cfg.sync == ((gpu, op, C.bucket(n)) in pinned), (gpu, op, n)
        assert not cfg.sync or cfg.slice, (gpu, op, n)
    for n in (16384, 65536, 262144):
        assert not C.heuristic("fwd", n).sync and not any(c.sync for c in C.candidates("fwd", n))
    entry = json.loads('{"rows": 1, "warps": 8, "slice": 8192, "sync": true}')  # as a table would pin it
    assert C.Config(**entry) == C.FWD_EXCHANGE[0]


def test_pinned_realigned_configs_move_whole_vectors():
    """Each pinned realigned config, built for sm_90a at an odd N: 16-byte loads and stores, where
    the element-wise row kernel it replaces (the same config, ``realign`` off) has none."""
    vectors = _sm90a_build("--vectors")
    assert vectors, "no realigned config is pinned"
    for key, (realigned, element_wise) in vectors.items():
        assert realigned > 0 and element_wise == 0, (key, realigned, element_wise)


def test_odd_rows_read_the_realigned_table_first():
    gpu = "NVIDIA H100 80GB HBM3"
    odd = C.pinned(gpu, "layernorm", "bwd", 4001, odd=True)
    assert odd.realign and odd == C.Config(**C.pinned_table()[gpu]["layernorm_bwd_odd"]["4096"])
    assert not C.pinned(gpu, "layernorm", "bwd", 4001).realign  # rows that fill whole vectors
    assert C.is_odd(4001, torch.float16) and C.is_odd(4004, torch.bfloat16) and not C.is_odd(4096, torch.bfloat16)
    assert not C.is_odd(4001, torch.float32)  # element-wise: 4 bytes an access (see is_odd)
    # a bucket without a realigned entry keeps the element-wise row kernel
    assert not C.pinned(gpu, "rmsnorm", "fwd", 1001, odd=True).realign


def test_realigned_rows_are_those_of_one_stride_and_aligned_starts():
    from impls.triton import kernels as K

    cfg = C.Config(rows=2, realign=True)
    x = torch.empty(37, 1001, dtype=torch.bfloat16)
    assert K.realigned(cfg, 1001, 0, (x, torch.empty_like(x))) == (1001, 8)
    assert K.realigned(replace(cfg, realign=False), 1001, 0, (x, x)) == (0, 0)
    assert K.realigned(replace(cfg, chunk=256), 1001, 0, (x, x)) == (0, 0)
    assert K.realigned(cfg, 1001, 0, (x, torch.empty(37, 1024, dtype=torch.bfloat16)[:, :1001])) == (0, 0)
    assert K.realigned(cfg, 1001, 0, (x, torch.empty(37 * 1001 + 1, dtype=torch.bfloat16)[1:].view(37, 1001))) == (0, 0)
    assert K.realigned(cfg, 1001, 5, (x, x)) == (0, 0)  # per-head views: the row kernel
    y = torch.empty(37, 1024, dtype=torch.bfloat16)
    assert K.realigned(cfg, 1024, 0, (y, y)) == (0, 0)  # whole vectors already
    assert K.realigned(cfg, 1002, 0, (torch.empty(3, 1002),) * 2) == (1002, 4)  # fp32: 4 to a vector
    for m in (1, 9, 37, 10**6):  # a multiple of the vector: a program's rows share their offset
        grid = K.realigned_grid(C.Config(rows=2, programs_per_sm=3), m, 8, torch.device("cpu"))
        assert grid % 8 == 0 and grid >= 8


@pytest.mark.parametrize("gpu", sorted(C.pinned_table()))
def test_known_gpus_have_every_sweep_point_pinned(gpu):
    for op in ("rmsnorm", "layernorm"):
        for direction in ("fwd", "bwd"):
            for shape in SHAPE_SETS["sweep"]:
                cfg = C.pinned(gpu, op, direction, shape.n)
                assert cfg is not None, f"{gpu} {op} {direction} N={shape.n} is not pinned"
                assert C.lookup(gpu, op, direction, shape.n) == cfg


def test_exact_n_entries_take_precedence_over_the_bucket(monkeypatch):
    by_n = {"8192": {"rows": 1, "warps": 16}, "5120": {"rows": 2, "warps": 8, "chunk": 1024}}
    table = {"GPU X": {"rmsnorm_fwd": by_n}}
    monkeypatch.setattr(C, "_PINNED", table)
    assert C.lookup("GPU X", "rmsnorm", "fwd", 5120) == C.Config(rows=2, warps=8, chunk=1024)
    assert C.lookup("GPU X", "rmsnorm", "fwd", 7168) == C.Config(rows=1, warps=16)
    assert C.lookup("GPU X", "rmsnorm", "bwd", 7168) == C.heuristic("bwd", 7168)


def test_fused_add_borrows_the_configs_of_rmsnorm(monkeypatch):
    by_n = {"4096": {"rows": 1, "warps": 8, "programs_per_sm": 2}, "65536": {"rows": 1, "warps": 32, "chunk": 32768}}
    monkeypatch.setattr(C, "_PINNED", {"GPU X": {"rmsnorm_fwd": by_n, "rmsnorm_bwd": by_n}})
    assert C.lookup("GPU X", "add_rmsnorm", "bwd", 4096) == C.lookup("GPU X", "rmsnorm", "bwd", 4096)
    assert C.lookup("GPU X", "add_rmsnorm", "fwd", 4096) == C.Config(rows=1, warps=8, programs_per_sm=2)
    # chunked forward: half the chunk, two input rows in the registers of one
    assert C.lookup("GPU X", "add_rmsnorm", "fwd", 65536) == C.Config(rows=1, warps=32, chunk=16384)
    assert C.lookup("GPU X", "add_rmsnorm", "fwd", 262144).chunk == C.heuristic("fwd", 262144).chunk // 2
    # RMSNorm's whole-row re-read backward does not hold the fused op's third row tensor: wide rows
    # take the sliced heuristic (measured on an H100: 9% of copy bandwidth against 64%)
    monkeypatch.setattr(C, "_PINNED", {"GPU X": {"rmsnorm_bwd": {"16384": {"rows": 1, "warps": 16, "reread": True}}}})
    assert C.lookup("GPU X", "rmsnorm", "bwd", 16384).reread
    assert C.lookup("GPU X", "add_rmsnorm", "bwd", 16384) == C.heuristic("bwd", 16384)
    # a table of its own, once measured, wins
    monkeypatch.setattr(C, "_PINNED", {"GPU X": {"rmsnorm_fwd": by_n, "add_rmsnorm_fwd": {"65536": {"rows": 2}}}})
    assert C.lookup("GPU X", "add_rmsnorm", "fwd", 65536) == C.Config(rows=2)


def test_forward_candidates_of_a_non_power_of_two_n_include_its_exact_n_twins():
    whole = [c for c in C.candidates("fwd", 5120) if not c.chunk]
    assert {c for c in whole if c.exact_n} == {replace(c, exact_n=True) for c in whole if not c.exact_n}
    assert not any(c.exact_n for c in C.candidates("fwd", 4096) + C.candidates("bwd", 5120))


def test_backward_candidates_of_wide_rows_include_whole_rows_without_prefetch():
    from impls.triton import tune

    assert C.Config(rows=1, warps=32, prefetch=False) in C.candidates("bwd", 16384)
    assert all(c.prefetch for c in C.candidates("bwd", 4096))
    # tables and logs written before the field read the same: it is left out at its default
    assert "prefetch" not in C.Config(rows=2).to_json()
    assert C.Config(prefetch=False).to_json()["prefetch"] is False
    assert tune._config({"rows": 2, "warps": 8, "check": "pass", "ms": 1.0}) == C.Config(rows=2, warps=8)


def test_small_row_candidates_sum_dw_per_tile_row_once():
    # the H100's small-row winners are in the search space, and only short rows get them
    assert C.Config(rows=32, warps=8, programs_per_sm=2, acc_rows=True) in C.candidates("bwd", 128)
    assert C.Config(rows=64, warps=8) in C.candidates("fwd", 128)
    assert not any(c.acc_rows for c in C.candidates("bwd", 1024))
    # left out of the tables at its default, like prefetch
    assert "acc_rows" not in C.Config(rows=2).to_json()
    assert C.Config(acc_rows=True).to_json()["acc_rows"] is True


def test_fp32_weights_take_one_row_per_reread_tile():
    """Two-row re-read tiles spill with an fp32 weight beside 16-bit rows (sm90a_resources.txt);
    everything else keeps the config measured with weights of x's dtype."""
    two = C.Config(rows=2, warps=16, reread=True)
    assert C.for_weight(two, "bwd", torch.float32, torch.bfloat16) == C.Config(rows=1, warps=16, reread=True)
    assert C.for_weight(two, "bwd", torch.bfloat16, torch.bfloat16) == two
    assert C.for_weight(two, "bwd", torch.float32, torch.float32) == two  # fp32 rows: measured so
    for cfg in (C.Config(rows=2, warps=8), C.Config(rows=1, warps=16, slice=8192, row_sums=True)):
        assert C.for_weight(cfg, "bwd", torch.float32, torch.float16) == cfg
    assert C.for_weight(C.Config(rows=2, reread=True), "fwd", torch.float32, torch.bfloat16).rows == 2


def _job(op, direction, n, times: dict):
    """A tuning job's result: {config: ms}, the fastest as best."""
    tried = [{**cfg.to_json(), "check": "pass", "ms": ms} for cfg, ms in times.items()]
    return {"op": op, "direction": direction, "n": n, "tried": tried, "best": min(tried, key=lambda r: r["ms"])}


def test_tuning_pins_the_bucket_winner_and_exact_n_only_past_the_noise(tmp_path, monkeypatch):
    from impls.triton import tune

    a, b, c = C.Config(rows=1, warps=8), C.Config(rows=2, warps=16, reread=True), C.Config(rows=1, warps=16)
    results = [
        _job("rmsnorm", "bwd", 8192, {a: 1.0, b: 1.1}),  # the bucket's own N: its winner is the bucket's
        _job("rmsnorm", "bwd", 5120, {a: 1.0, b: 0.5}),  # a wins the bucket, but b is 2x faster here
        _job("rmsnorm", "bwd", 7168, {a: 1.01, b: 1.0}),  # within the noise: no exact-N entry
        _job("rmsnorm", "bwd", 2880, {c: 0.3, a: 0.4}),  # no power of two in the bucket: its widest N
        _job("rmsnorm", "fwd", 1024, {a: 1.0}),
        {"op": "rmsnorm", "direction": "fwd", "n": 2048, "tried": [], "best": None, "error": "boom"},
    ]
    tables = tune.winners(results)
    assert tables == {"rmsnorm_bwd": {"8192": a.to_json(), "5120": b.to_json(), "4096": c.to_json()},
                      "rmsnorm_fwd": {"1024": a.to_json()}}  # fmt: skip
    path = tmp_path / "configs.json"
    path.write_text(json.dumps({"_doc": "x", "GPU Y": {"rmsnorm_fwd": {"16": {"rows": 4}}},
                                "GPU X": {"rmsnorm_bwd": {"16": {"rows": 4}}, "layernorm_fwd": {"16": {"rows": 3}}}}))  # fmt: skip
    monkeypatch.setattr(C, "CONFIG_FILE", str(path))
    monkeypatch.setattr(C, "_PINNED", None)
    tune.pin("GPU X", tables)
    data = json.loads(path.read_text())
    assert data["GPU X"]["rmsnorm_bwd"] == tables["rmsnorm_bwd"]  # replaced as a whole
    assert data["GPU X"]["layernorm_fwd"] == {"16": {"rows": 3}} and data["GPU Y"] == {"rmsnorm_fwd": {"16": {"rows": 4}}}
    assert C.lookup("GPU X", "rmsnorm", "bwd", 5120) == b and C.lookup("GPU X", "rmsnorm", "bwd", 7168) == a


def test_unknown_gpu_falls_back_to_the_heuristic():
    for n in (1, 1000, 4096, 8192, 16384, 262144):
        for direction in ("fwd", "bwd"):
            cfg = C.lookup("Some Future GPU", "rmsnorm", direction, n)
            assert cfg == C.heuristic(direction, n)
            assert cfg.chunk == 0 or cfg.chunk < C.bucket(n)  # wide rows are chunked, not one tile


def test_cpu_never_reads_the_pinned_table_nor_autotunes(monkeypatch):
    monkeypatch.setenv(C.AUTOTUNE_ENV, "1")
    cfg = C.choose("rmsnorm", "bwd", 4096, torch.device("cpu"), launch=lambda c: pytest.fail("timed on CPU"))
    assert cfg == C.interpreter_config("bwd", 4096)


# ------------------------------------------------------------------------------- kernel paths
ROW = C.Config(rows=4, warps=4)
CHUNKED_FWD = C.Config(rows=4, warps=4, chunk=256)
SLICED_BWD = C.Config(rows=2, warps=4, slice=256, row_sums=True, programs_per_sm=2)

PATHS = {
    # (fwd config, bwd config): each reaches a kernel or a row split the defaults do not
    "row, M < programs": (ROW, C.Config(rows=1, warps=4, programs_per_sm=8)),
    "row, M % rows != 0": (C.Config(rows=8), C.Config(rows=8, programs_per_sm=1)),
    "row, re-read": (ROW, C.Config(rows=2, programs_per_sm=2, reread=True)),
    "row, exact N": (C.Config(rows=4, warps=4, exact_n=True), C.Config(rows=2, programs_per_sm=2, reread=True, exact_n=True)),
    "row, no prefetch": (ROW, C.Config(rows=2, programs_per_sm=3, prefetch=False)),
    "row, dw per tile row": (C.Config(rows=8), C.Config(rows=4, programs_per_sm=3, acc_rows=True)),
    "chunked / sliced with row sums": (CHUNKED_FWD, SLICED_BWD),
    "one chunk / slice per row": (C.Config(rows=1, chunk=1024), C.Config(rows=4, slice=2048, row_sums=True, programs_per_sm=2)),
    # 4 slices of 1001 columns, each streamed in 2 tiles by its siblings; 10 row groups
    "sliced, streamed": (ROW, C.Config(rows=1, warps=4, slice=256, chunk=128, programs_per_sm=10)),
    # the siblings exchange their row sums (on the GPU; the interpreter falls back to the row-sums
    # kernel), loads two blocks ahead
    "sliced, exchanged": (ROW, C.Config(rows=1, warps=4, slice=256, sync=True, ahead=2)),
    "sliced, exchanged, 2 rows": (ROW, C.Config(rows=2, warps=4, slice=256, sync=True)),
    # rows of an odd width (37 x 1001: every offset within a vector) read realigned
    "row, realigned": (C.Config(rows=2, warps=4, realign=True), C.Config(rows=2, programs_per_sm=2, realign=True)),
    "row, realigned, 1 row": (C.Config(rows=1, realign=True), C.Config(rows=1, programs_per_sm=1, realign=True)),
}
# the per-head view's rows (T, H, N) have no (M, N) view: the kernels get it as it is
SHAPES = [Shape((37, 1001)), Shape((2, 5, 130), "column-slice"), Shape((3, 4, 130), "head-slice-6")]


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("op", ["rmsnorm", "layernorm"])
@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_kernel_paths(path, op, direction):
    kernels = _kernels(*PATHS[path])
    points = [(shape, "bf16", True) for shape in SHAPES]
    if path in ("chunked / sliced with row sums", "row, re-read", "row, exact N", "row, no prefetch", "sliced, streamed",
                "row, dw per tile row", "sliced, exchanged", "row, realigned"):  # fmt: skip
        points += [(SHAPES[0], "fp32", True), (SHAPES[0], "bf16", False)]
    for shape, dtype, affine in points:
        r = run_check(IMPL, op, direction, shape, dtype, DEVICE, affine=affine, kernels=kernels)
        assert r.passed, f"{path} {shape.label} {dtype} affine={affine}: {r.status} {r.summary()}\n{r.traceback}"


# the fused add and fp32 parameters beside 16-bit x, on every path: a 3-D strided shape whose rows
# (N = 1003) span several chunks / slices of the configs above, 10 rows (a partial row block)
MIXED_SHAPE = SHAPE_SETS["edge"][2]
MIXED_POINTS = [  # (op, x dtype, parameter dtype, dresidual_out given)
    ("add_rmsnorm", "bf16", None, True),
    ("add_rmsnorm", "fp16", "fp32", False),
    ("layernorm", "bf16", "fp32", True),
]


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_add_rmsnorm_and_fp32_weights(path, direction):
    kernels = _kernels(*PATHS[path])
    shape = Shape((37, 1001)) if "realigned" in path else MIXED_SHAPE  # (per-head views are never realigned)
    for op, dtype, weight_dtype, dres in MIXED_POINTS:
        bad = check(kernels, op, direction, shape, dtype, weight_dtype, dres)
        assert not bad, f"{path} {op} {dtype} weight {weight_dtype} dresidual={dres}: " + "; ".join(
            f"{r.name}: {r.reason}" for r in bad
        )


@pytest.mark.parametrize("path", ["row, M % rows != 0", "chunked / sliced with row sums", "row, realigned"])
def test_add_rmsnorm_is_the_unfused_pair(path):
    """residual_out is torch's own x + residual (one rounding to x's dtype), and y / rstd are bit
    for bit RMSNorm's of residual_out as stored, on the same path: a per-head view's row kernel and,
    for contiguous rows of an odd width, the realigned kernel."""
    kernels = _kernels(*PATHS[path])
    for dtype, shape in itertools.product(("bf16", "fp16", "fp32"), (MIXED_SHAPE, Shape((37, 1001)))):
        case = make_case("rmsnorm", shape, DTYPES[dtype], DEVICE, seed=3)
        residual = make_case("rmsnorm", shape, DTYPES[dtype], DEVICE, seed=4)["x"] * 100
        y, h, rstd = kernels.add_rmsnorm_fwd(case["x"], residual, case["weight"], case["eps"])
        assert torch.equal(h, case["x"] + residual), dtype
        # h laid out as x is (a strided view), so that the plain norm takes the fused one's kernel
        h_as_x = torch.empty_strided(case["x"].shape, case["x"].stride(), dtype=h.dtype, device=DEVICE).copy_(h)
        y_unfused, rstd_unfused = kernels.rmsnorm_fwd(h_as_x, case["weight"], case["eps"])
        assert torch.equal(y, y_unfused) and torch.equal(rstd, rstd_unfused), dtype


@pytest.mark.parametrize("path", ["row, M % rows != 0", "chunked / sliced with row sums"])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning", "ignore:invalid value encountered:RuntimeWarning")
def test_rows_whose_statistics_overflow_give_nan(path, dtype):
    """|x| ~ 1e30: x^2 overflows fp32, so rsqrt(mean) would be 0 and y = 0 (or the bias), finite
    and wrong. torch's LayerNorm gives NaN for such rows (on the GPU; its CPU kernels vary with N
    and dtype), its rms_norm 0, which we do not copy: every op must give non-finite y there
    (wherever torch's is non-finite included), NaN dx from the NaN rstd, and leave the other rows
    be."""
    import torch.nn.functional as F

    kernels = _kernels(*PATHS[path])
    shape = SHAPE_SETS["smoke"][8]  # 3 x 1000: several chunks on the chunked path
    assert shape.dims == (3, 1000)
    case = make_case("layernorm", shape, DTYPES[dtype], DEVICE)
    x, dy, w, b, eps = case["x"], case["dy"], case["weight"], case["bias"], case["eps"]
    x[1] = (x[1].float() * 1e30).to(x.dtype)
    huge = torch.tensor([False, True, False], device=DEVICE)

    def assert_only_huge_row_nonfinite(t, what):
        finite = torch.isfinite(t)
        assert not finite[huge].any(), f"{what}: finite values in the overflowing row"
        assert finite[~huge].all(), f"{what}: non-finite values in the other rows"

    y, mean, rstd = kernels.layernorm_fwd(x, w, b, eps)
    assert_only_huge_row_nonfinite(y, "layernorm y")
    assert not torch.isfinite(y)[~torch.isfinite(F.layer_norm(x, (shape.n,), w, b, eps))].any()
    assert_only_huge_row_nonfinite(kernels.layernorm_bwd(dy, x, w, mean, rstd)[0], "layernorm dx")

    y, rstd = kernels.rmsnorm_fwd(x, w, eps)
    assert_only_huge_row_nonfinite(y, "rmsnorm y")
    assert_only_huge_row_nonfinite(kernels.rmsnorm_bwd(dy, x, w, rstd)[0], "rmsnorm dx")

    y, h, rstd = kernels.add_rmsnorm_fwd(x, x, w, eps)  # h = 2x: finite, its square is not
    assert torch.isfinite(h).all()
    assert_only_huge_row_nonfinite(y, "add_rmsnorm y")
    assert_only_huge_row_nonfinite(kernels.add_rmsnorm_bwd(dy, dy, h, w, rstd)[0], "add_rmsnorm dh")


# The exchanging forward on the interpreter: 4 slices of 256 columns (the last 233 wide) of
# (11, 1001) rows, 2 rows a block, 4 row groups of uneven ranges; 5 slices of 32 columns (the last
# 2 wide) of per-head views, two blocks loaded ahead.
EXCHANGE_FWD = C.Config(rows=2, warps=4, slice=256, sync=True)
EXCHANGE_FWD_NARROW = C.Config(rows=2, warps=4, slice=32, sync=True, ahead=2)


def _exchange_on_the_interpreter(monkeypatch, sms=16):
    """``launch_fwd`` running the exchanging kernel itself where the interpreter would fall back:
    twice on the same slots, its programs running one after another. The first launch posts
    every slice (a program's waits run out on the siblings that start after it, a bound of one
    re-read); the second finds every slot posted and writes every output again. Both post the same
    bits, so the second computes what a GPU launch, whose siblings run together, does."""
    from impls.triton import kernels as K

    def launch(cfg, x, weight, bias, eps, layernorm, y, mean, rstd, residual=None, residual_out=None):
        m, n, _ = K.row_shape(x)
        groups, slices = K.exchange_grid(cfg, m, n, sms)
        assert cfg.sync and groups, (cfg, m, n)
        stats = torch.zeros((1 + int(layernorm), m, slices), dtype=torch.int64, device=x.device)
        for _ in range(2):
            compiled = K.launch_fwd_exchange(cfg, x, weight, bias, eps, layernorm, y, mean, rstd, residual,
                                             residual_out, groups, stats, 1)  # fmt: skip
        return compiled

    monkeypatch.setattr(K, "launch_fwd", launch)


@pytest.mark.skipif(DEVICE != "cpu", reason="the interpreter's sequential programs")
@pytest.mark.parametrize("op", ["rmsnorm", "layernorm", "add_rmsnorm"])
def test_exchanging_forward_against_the_reference(op, monkeypatch):
    wide = _kernels(EXCHANGE_FWD, SLICED_BWD)
    narrow = _kernels(EXCHANGE_FWD_NARROW, SLICED_BWD)
    _exchange_on_the_interpreter(monkeypatch)
    points = [(wide, Shape((11, 1001)), "bf16", True), (wide, Shape((11, 1001)), "fp32", True),
              (wide, Shape((11, 1001)), "bf16", False), (narrow, SHAPES[2], "bf16", True)]  # fmt: skip
    for kernels, shape, dtype, affine in points:
        r = run_check(IMPL, op, "fwd", shape, dtype, DEVICE, affine=affine, kernels=kernels)
        assert r.passed, f"{shape.label} {dtype} affine={affine}: {r.status} {r.summary()}\n{r.traceback}"
    # fp32 parameters beside 16-bit rows (the fused add: fp16 rows), strided rows
    bad = check(wide, op, "fwd", MIXED_SHAPE, "fp16" if op == "add_rmsnorm" else "bf16", "fp32")
    assert not bad, "; ".join(f"{r.name}: {r.reason}" for r in bad)


@pytest.mark.skipif(DEVICE != "cpu", reason="the interpreter's sequential programs")
def test_exchanging_forward_gives_nan_not_a_hang_where_a_sibling_never_posts():
    """One launch on the interpreter: each program waits out its bound on the siblings that start
    after it, so every slice but the last gets NaN rows (statistics included: slice 0 stores them),
    and the last slice, which finds every post, gets the same bits as with all posted."""
    from impls.triton import kernels as K

    g = torch.Generator().manual_seed(11)
    m, n = 9, 1001
    x = torch.randn(m, n, generator=g).to(torch.bfloat16)
    w, b = (torch.randn(n, generator=g).to(torch.bfloat16) for _ in range(2))
    groups, slices = K.exchange_grid(EXCHANGE_FWD, m, n, 16)
    assert slices == 4 and groups > 1
    outs = []
    for launches in (1, 2):
        y = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
        mean, rstd = torch.full((m,), float("nan")), torch.full((m,), float("nan"))
        stats = torch.zeros((2, m, slices), dtype=torch.int64)
        for _ in range(launches):
            K.launch_fwd_exchange(EXCHANGE_FWD, x, w, b, 1e-5, True, y, mean, rstd, None, None, groups, stats, 1)
        outs.append((y, mean, rstd))
    (y1, mean1, rstd1), (y2, _, _) = outs
    last = 3 * EXCHANGE_FWD.slice
    assert torch.isnan(y1[:, :last].float()).all() and torch.isnan(rstd1).all() and torch.isnan(mean1).all()
    assert torch.isfinite(y2.float()).all() and torch.equal(y1[:, last:], y2[:, last:])
    assert (stats >> 32 == 1).all()  # every slot posted


@pytest.mark.skipif(DEVICE != "cpu", reason="the interpreter's fallback")
def test_exchanging_forward_falls_back_to_the_chunked_one_where_siblings_cannot_wait(monkeypatch):
    """On the interpreter (and wherever ``exchange_grid`` gives no groups) a ``sync`` forward config
    runs the chunked forward, in chunks of the slice's width."""
    from impls.triton import kernels as K

    kernels = _kernels(EXCHANGE_FWD, SLICED_BWD)
    monkeypatch.setattr(K, "launch_fwd_exchange", lambda *a, **k: pytest.fail("exchanging kernel launched"))
    r = run_check(IMPL, "layernorm", "fwd", Shape((11, 1001)), "bf16", DEVICE, kernels=kernels)
    assert r.passed, f"{r.status} {r.summary()}\n{r.traceback}"


def test_chunked_layernorm_variance_of_an_offset_row():
    """Rows with a large mean: the chunked kernel's merged variance must not cancel."""
    kernels = _kernels(CHUNKED_FWD, SLICED_BWD)
    x = torch.randn(3, 1000, device=DEVICE) * 1e-2 + 300.0
    y, mean, rstd = kernels.layernorm_fwd(x, None, None, 1e-5)
    var = x.double().var(-1, unbiased=False)
    torch.testing.assert_close(rstd.double(), torch.rsqrt(var + 1e-5), rtol=2e-3, atol=0)


def test_backward_is_deterministic():
    kernels = _kernels(ROW, C.Config(rows=2, programs_per_sm=3))
    g = torch.Generator(device=DEVICE).manual_seed(0)
    x, dy = (torch.randn(67, 300, generator=g, device=DEVICE) for _ in range(2))
    w = torch.randn(300, generator=g, device=DEVICE)
    _, mean, rstd = kernels.layernorm_fwd(x, w, None, 1e-5)
    a = kernels.layernorm_bwd(dy, x, w, mean, rstd)
    b = kernels.layernorm_bwd(dy, x, w, mean, rstd)
    for t, u in zip(a, b):
        assert torch.equal(t, u)


# ------------------------------------------------------------------------------- GPU only
# Pinned configs the compiler spills registers for, kept because they measured fastest anyway:
# (gpu, op, direction, N) -> why.
KNOWN_SPILLS = {
    ("NVIDIA H200", "rmsnorm", "bwd", 16384): "re-read row kernel: 16 spilled registers, 72% of copy "
    "bandwidth; the spill-free sliced kernels measured 48-58% (and Liger 48%)",
    ("NVIDIA H100 80GB HBM3", "rmsnorm", "bwd", 16384): "whole-row kernel without prefetch (an offline "
    "sm_90a build spills 16-64 B), the fastest of the 9 candidates of `normbench tune` all the same "
    "(2.38 TB/s; the re-read row kernel 2.33 with 16 spilled registers, the spill-free sliced ones "
    "1.73-2.20: reports/experiments/triton-tuning/nvidia-h100/tune/)",
    # RMSNorm's re-read configs, borrowed: an offline sm_90a build gives them 8-32 bytes of stack
    **{("NVIDIA H200", "add_rmsnorm", "bwd", n): "re-read row kernel borrowed from RMSNorm, not timed yet"
       for n in (5120, 7168, 8192, 16384)},
    # the exchanging forward's 16384-column slices on 16 warps (an offline sm_90a build: 24-32 bytes)
    **{("NVIDIA H100 80GB HBM3", op, "fwd", 262144): "exchanging 16384-column slices on 16 warps, faster "
       "than every spill-free candidate: RMSNorm 80.7%, the fused add 94.2% against 52-71% and 71-82% "
       "(reports/experiments/triton-wide-fwd/round-two/)" for op in ("rmsnorm", "add_rmsnorm")},
}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pinned_configs_compile_without_spills():
    from harness.spec.tuned import capability_of, table_for
    from impls.triton import kernels as K

    # the configs this GPU runs: its own table, a borrowed one, or the heuristic's (no skip)
    name, cap = torch.cuda.get_device_name(), capability_of(torch.device("cuda"))
    gpu = table_for(name, C.pinned_table(), cap)[0] or name
    for n in (s.n for s in SHAPE_SETS["sweep"]):
        x = torch.randn(4, n, device="cuda", dtype=torch.bfloat16)
        w = torch.ones(n, device="cuda", dtype=torch.bfloat16)
        for op in ("rmsnorm", "layernorm", "add_rmsnorm"):
            layernorm, fused = op == "layernorm", op == "add_rmsnorm"
            y, mean, rstd = (torch.empty_like(x), torch.empty(4, device="cuda"), torch.empty(4, device="cuda"))
            extra = (x, torch.empty_like(x)) if fused else ()  # residual, residual_out
            k = K.launch_fwd(C.lookup(name, op, "fwd", n, cap), x, w, w, 1e-5, layernorm, y, mean, rstd, *extra)
            assert k.n_spills == 0 or (gpu, op, "fwd", n) in KNOWN_SPILLS, f"{op} fwd N={n}: {k.n_spills} spills"
            sums = torch.empty(1 + layernorm, n, device="cuda", dtype=x.dtype)
            k = K.launch_bwd(C.lookup(name, op, "bwd", n, cap), x, x, w, mean, rstd, layernorm, y, sums, *extra[:1])
            assert k.n_spills == 0 or (gpu, op, "bwd", n) in KNOWN_SPILLS, f"{op} bwd N={n}: {k.n_spills} spills"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_autotune_mode_picks_a_candidate(monkeypatch):
    monkeypatch.setenv(C.AUTOTUNE_ENV, "1")
    kernels = _kernels(None, None)
    r = run_check(IMPL, "rmsnorm", "bwd", Shape((512, 2880)), "bf16", "cuda", kernels=kernels)
    assert r.passed, r.summary()
    assert any(k[1:4] == ("rmsnorm", "bwd", 4096) for k in C._SEARCHED)


def test_fp8_launch_shapes_read_their_table_then_the_heuristic(monkeypatch):
    """The FP8 ops' launch shapes (``fp8.resolve``): an exact N's entry, else its bucket's, else the
    heuristic; every entry a shape the kernels take; and the config source the benchmark records."""
    IMPL.kernels(DEVICE)
    from harness.spec.ops import FP8_OPS, expand_ops
    from impls.triton import fp8

    ops = set(expand_ops(FP8_OPS))
    for gpu, table in fp8._tables().items():
        for op, by_n in table.items():
            assert op in ops, f"{gpu}: {op}"
            for n, e in by_n.items():
                assert set(e) == {"rows", "warps", "chunk"} and e["rows"] & (e["rows"] - 1) == 0, (gpu, op, n)
                assert e["warps"] in (1, 2, 4, 8, 16, 32) and (e["chunk"] == 0 or C.bucket(e["chunk"]) == e["chunk"] >= 128)
    h100 = "NVIDIA H100 80GB HBM3"
    monkeypatch.setattr(fp8, "_RESOLVED", {})  # what was resolved for the real device
    monkeypatch.setattr(fp8, "device_name", lambda d: h100)
    monkeypatch.setattr(fp8, "capability_of", lambda d: (9, 0))
    gpu = torch.device("cuda")
    by_n = fp8._tables()[h100]["rmsnorm_fp8_token"]
    exact = next(n for n in by_n if C.bucket(int(n)) != int(n))
    e = by_n[exact]
    assert fp8.resolve("rmsnorm_fp8_token", int(exact), gpu) == ((e["rows"], e["warps"], e["chunk"]), "tuned")
    bucket = next(n for n in by_n if C.bucket(int(n)) == int(n) and str(int(n) // 2 + 1) not in by_n)
    e = by_n[bucket]
    assert fp8.resolve("rmsnorm_fp8_token", int(bucket) // 2 + 1, gpu)[0] == (e["rows"], e["warps"], e["chunk"])
    missing = next(n for n in (64, 128, 512, 1024, 2048) if str(n) not in by_n)
    assert fp8.resolve("rmsnorm_fp8_token", missing, gpu) == (fp8.heuristic(missing),
                                                              f"heuristic (no entry for N={missing} in the table of {h100})")  # fmt: skip
    assert C.source("rmsnorm_fp8_token", "fwd", int(exact), "bf16", gpu) == "tuned"
    # NORMBENCH_CONFIGS: a GPU with norm tables but no FP8 entries gives the heuristic; one unknown
    # to every table is refused, as the norms refuse it
    monkeypatch.setenv("NORMBENCH_CONFIGS", "NVIDIA H200")
    assert fp8.resolve("rmsnorm_fp8_token", int(exact), gpu)[0] == fp8.heuristic(int(exact))
    monkeypatch.setenv("NORMBENCH_CONFIGS", "no such GPU")
    with pytest.raises(ValueError, match="no table for that GPU"):
        fp8.resolve("rmsnorm_fp8_token", int(exact), gpu)
    monkeypatch.delenv("NORMBENCH_CONFIGS")
    monkeypatch.setattr(fp8, "device_name", lambda d: "a GPU of another architecture")
    monkeypatch.setattr(fp8, "capability_of", lambda d: (8, 0))
    fp8._RESOLVED.clear()  # a device keeps its name: only a test changes it
    assert fp8.resolve("rmsnorm_fp8_token", int(exact), gpu) == (fp8.heuristic(int(exact)), "heuristic")


@pytest.mark.parametrize("group", [256, 128])
def test_fp8_reads_per_head_views_in_place(group):
    """Per-head (T, H, N) views of x and the residual reach the FP8 kernels uncopied (a reshape of
    such a view is a clone of its storage; the interpreter's own transfers are copies, not clones),
    and the outputs are the reference's."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from harness.run.checker import _check_tensors

    class Clones(TorchDispatchMode):
        def __init__(self, storages):
            super().__init__()
            self.storages, self.seen = storages, []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            reads = [a for a in args if isinstance(a, torch.Tensor)]
            if func.overloadpacket in (torch.ops.aten.clone, torch.ops.aten.contiguous) and any(
                a.untyped_storage().data_ptr() in self.storages for a in reads
            ):
                self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    from harness.registry import get

    k = get("triton").kernels(DEVICE)
    g = torch.Generator().manual_seed(group)
    for op in ("rmsnorm_fp8_token" if group == 256 else "rmsnorm_fp8_g128",
               "add_rmsnorm_fp8_token" if group == 256 else "add_rmsnorm_fp8_g128"):  # fmt: skip
        case = make_case(op, Shape((5, 3, 256)), torch.bfloat16, DEVICE, seed=group)
        case["x"] = torch.randn(5, 7, 256, generator=g).to(DEVICE, torch.bfloat16)[:, 1:4]
        if "residual" in case:
            case["residual"] = torch.randn(5, 6, 256, generator=g).to(DEVICE, torch.bfloat16)[:, 2:5]
        spy = Clones({case[t].untyped_storage().data_ptr() for t in ("x", "residual") if t in case})
        with spy:
            reports = _check_tensors(k, get_op(op), "fwd", case, rounded=False)
        assert not spy.seen, (op, spy.seen)
        assert all(r.passed for r in reports), [f"{r.name}: {r.reason}" for r in reports if not r.passed]
