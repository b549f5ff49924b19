"""`normbench model`'s timing method (one copy of the model per variant, rotated trials, spread and the
noisy mark, timing groups) and `--mode decode` on the CPU at the tiny size."""

import dataclasses
import json

import pytest
import torch

from harness.cli import main
from harness.run import decode, models

WHY = models.transformers_missing()
pytestmark = pytest.mark.skipif(WHY is not None, reason=WHY or "")


def _eager():
    from harness.registry import get

    return get("eager")


# ---------------------------------------------------------------- one copy per variant
def test_variant_copies_share_no_tensor_and_train_apart():
    template = models.build_model("llama", "tiny", "cpu", torch.bfloat16, seed=0)
    initial = {k: v.clone() for k, v in template.state_dict().items()}
    own, none = models.variant_model(template)
    swapped, report = models.variant_model(template, _eager())
    assert none is None and report.counts() == {"LlamaRMSNorm": 5}
    assert type(swapped.model.norm).__name__ == "RMSNorm" and type(own.model.norm).__name__ == "LlamaRMSNorm"
    storages = [{p.untyped_storage().data_ptr() for p in m.parameters()} for m in (template, own, swapped)]
    assert not (storages[0] & storages[1]) and not (storages[0] & storages[2]) and not (storages[1] & storages[2])
    # the same initial weights in every copy
    for m in (own, swapped):
        assert all(torch.equal(v, initial[k]) for k, v in m.state_dict().items())

    # a change to one copy (an in-place edit, then an optimizer step) reaches no other
    with torch.no_grad():
        own.model.norm.weight.add_(1.0)
    assert not torch.equal(own.model.norm.weight, initial["model.norm.weight"])
    batch = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(5))
    trainer = models.Trainer(swapped, swapped, [batch], "cpu")
    trainer.run()
    assert not torch.equal(swapped.model.layers[0].mlp.up_proj.weight, initial["model.layers.0.mlp.up_proj.weight"])
    assert all(p.grad is None for p in swapped.parameters())  # a waiting variant holds no gradients
    for m, skip in ((template, ()), (own, ("model.norm.weight",))):
        assert all(torch.equal(v, initial[k]) for k, v in m.state_dict().items() if k not in skip)
    # each variant's optimizer holds its own copy's parameters only
    other = models.Trainer(own, own, [batch], "cpu")
    assert {id(p) for p in other.params}.isdisjoint({id(p) for p in trainer.params})


# ---------------------------------------------------------------- rotation, spread, noisy
@pytest.mark.parametrize("n", [1, 2, 5])
def test_rotation_puts_every_variant_in_every_position(n):
    names = [f"v{i}" for i in range(n)]
    orders = [models.rotated(names, t) for t in range(2 * n)]
    assert all(sorted(o) == names for o in orders)  # each trial runs every variant once
    for pos in range(n):
        assert sorted(o[pos] for o in orders[:n]) == names  # n trials: every variant in every position
    assert orders[1][0] == names[1 % n] and orders[n] == names
    assert models.rotated([], 3) == []


def test_spread_and_the_noisy_mark():
    assert models.spread([100.0]) == 0.0 and models.spread([]) == 0.0
    assert models.spread([100.0, 102.0, 101.0]) == pytest.approx(0.02)
    tokens = 64
    calm = models.trial_summary([0.100, 0.102, 0.1029], tokens)
    assert calm["step_ms"] == pytest.approx(102.0) and not calm["noisy"]
    assert calm["tokens_per_s"] == pytest.approx(tokens / 0.102)
    loud = models.trial_summary([0.100, 0.1031, 0.101], tokens)
    assert loud["noisy"] and loud["spread"] == pytest.approx(0.031)
    assert models.NOISY_TRIAL_SPREAD == 0.03


class _FakeTrainer:
    """Stands in for a Trainer: a programmed time per call, every call logged."""

    def __init__(self, name, log, seconds, fail_at=None):
        self.name, self.log, self.seconds, self.fail_at, self.calls = name, log, list(seconds), fail_at, 0

    def time_steps(self, n):
        self.calls += 1
        self.log.append((self.name, n))
        if self.fail_at == self.calls:
            raise RuntimeError("simulated failure")
        return self.seconds.pop(0) if n != models.WARMUP_STEPS else 0.0


def test_time_group_warms_up_rotates_and_keeps_going_past_a_failure():
    log = []
    runners = {
        "own": _FakeTrainer("own", log, [0.10, 0.11, 0.10]),
        "a": _FakeTrainer("a", log, [0.20, 0.21, 0.22]),
        "b": _FakeTrainer("b", log, [0.3], fail_at=3),  # warm-up, one trial, then fails
    }
    per, failed, recompiled = models._time_group(runners, trials=3, steps=4, tag="[t]")
    assert log[:3] == [("own", models.WARMUP_STEPS), ("a", models.WARMUP_STEPS), ("b", models.WARMUP_STEPS)]
    timed = [name for name, n in log[3:]]
    # trial 2 rotated by one (b fails in it); trial 3 rotates the two left by two
    assert timed == ["own", "a", "b", "a", "b", "own", "own", "a"]
    assert per == {"own": [0.10, 0.11, 0.10], "a": [0.20, 0.21, 0.22], "b": [0.3]}
    assert "simulated failure" in failed["b"] and set(failed) == {"b"} and recompiled == {"own": 0, "a": 0, "b": 0}
    rep = models._timing_report([per["own"]], {"a": per["a"], "b": per["b"]}, {"a": 0, "b": 0}, failed, recompiled,
                                64, 3, 4, None, 0, 0)  # fmt: skip
    v = rep["variants"]
    assert set(v) == {"own", "a"} and rep["failed"] == failed
    assert v["a"]["speedup_vs_own"] == pytest.approx(0.10 / 0.21) and v["a"]["noisy"]
    assert v["own"]["spread"] == pytest.approx(0.1) and rep["noisy_above"] == 0.03


def test_groups_time_each_implementation_beside_the_own_norms(tmp_path):
    twin = dataclasses.replace(_eager(), name="eager-twin")
    rep = models.run_arch(
        "llama", "tiny", [_eager(), twin], device="cpu", steps=1, trials=2, steps_per_trial=1, group=2
    )
    timing = rep["timing"]
    assert timing["groups"] == 2 and timing["group_size"] == 1 and timing["steps_per_trial"] == 1
    v = timing["variants"]
    assert {v["eager"]["group"], v["eager-twin"]["group"]} == {0, 1}
    assert len(v["own"]["trial_ms"]) == 4 and [len(g["trial_ms"]) for g in v["own"]["groups"]] == [2, 2]
    for name in ("eager", "eager-twin"):
        own_ms = v["own"]["groups"][v[name]["group"]]["step_ms"]
        assert v[name]["speedup_vs_own"] == pytest.approx(own_ms / v[name]["step_ms"])
    assert [r["status"] for r in rep["results"]] == ["pass", "pass"]
    assert rep["own_norms_run_as"] == models.OWN_EAGER and rep["results"][0]["norms_run_as"] == models.IMPL_EAGER
    md = models.markdown([rep])
    assert "in 2 groups" in md and "trial spread" in md


# ---------------------------------------------------------------- decode
def _decode(tmp_path, *args):
    rc = main(["model", "--mode", "decode", "--device", "cpu", "--out", str(tmp_path), *args])
    return rc, {p.name: json.loads(p.read_text()) for p in tmp_path.glob("*.json")}


def test_decode_eager_on_the_cpu_matches_the_own_tokens(tmp_path):
    rc, reps = _decode(tmp_path, "--arch", "llama,gpt2", "--impl", "eager", "--batch", "2", "--trials", "3")
    assert rc == 0
    assert set(reps) == {f"{a}-tiny-decode-b2-{p}.json" for a in ("llama", "gpt2") for p in ("eager", "cuda-graphs")}
    for arch in ("llama", "gpt2"):
        rep = reps[f"{arch}-tiny-decode-b2-eager.json"]
        assert rep["mode"] == "decode" and rep["batch"] == 2 and rep["prompt"] == 16 and rep["new_tokens"] == 8
        assert rep["command"].startswith("normbench") and rep["environment"]
        assert rep["skipped"] is None and rep["failed"] == {}
        own, eager = rep["variants"]
        assert own["impl"] == "own" and eager["impl"] == "eager" and eager["swapped"]
        assert len(rep["own_tokens"]) == 2 and all(len(r) == 8 for r in rep["own_tokens"])
        for row in (own, eager):
            # a trial a loaded CPU makes useless is dropped, not timed at 0 (test_decode_timing_...)
            assert row["status"] == "ok" and row["per_token_ms"] > 0 and row["tokens_per_s"] > 0
            assert row["prefill_ms"] > 0 and len(row["trial_per_token_ms"]) + row["dropped_trials"] == 3
            assert row["repeatable"] and row["spread"] >= 0.0
        assert own["speedup_vs_own"] == 1.0 and "tokens" not in own
        tok = eager["tokens"]
        assert tok == {
            "rows": 2,
            "new_tokens": 8,
            "identical_rows": 2,
            "same_first": 8,
            "first_split": [None, None],
            "splits": [],
        }
        graphs = reps[f"{arch}-tiny-decode-b2-cuda-graphs.json"]
        assert graphs["skipped"] == decode.NO_GRAPHS_OFF_CUDA and graphs["variants"] == []
    md = (tmp_path / "models-decode.md").read_text()
    assert "Skipped: CUDA graphs need a CUDA device" in md and "| eager | eager |" in md and "| 2/2 | never |" in md
    assert not (tmp_path / "models.md").exists() or "decode" not in (tmp_path / "models.md").read_text()


def test_decode_records_where_tokens_part_and_survives_a_crash(tmp_path):
    from harness.spec.contract import Implementation

    def mutant(factory):
        return Implementation(
            name=f"mutant-{factory}", dsl="eager", entry=f"tests.mutants:{factory}", ops=("rmsnorm",), devices=("cpu",)
        )

    impls = [mutant("nan_output"), mutant("crashing"), _eager()]
    rc = decode.run(["llama"], "tiny", impls, device="cpu", batches=[2], paths=["eager"], trials=1, out=tmp_path)
    rep = json.loads((tmp_path / "llama-tiny-decode-b2-eager.json").read_text())
    rows = {r["impl"]: r for r in rep["variants"]}
    assert rc == 1 and rows["mutant-crashing"]["status"] == "error" and "simulated" in rows["mutant-crashing"]["reason"]
    assert rows["eager"]["status"] == "ok" and rows["eager"]["tokens"]["identical_rows"] == 2
    nan = rows["mutant-nan_output"]["tokens"]
    assert nan["identical_rows"] < 2 and nan["same_first"] < 8 and nan["splits"]
    split = nan["splits"][0]
    assert (
        split["step"] == nan["first_split"][split["row"]] and split["own_margin"] >= 0 and split["own_margin_ulps"] >= 0
    )


def test_compare_tokens_reports_the_first_split_and_its_margin():
    own = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    other = torch.tensor([[1, 2, 9, 4], [5, 6, 7, 8]])
    top = torch.zeros(4, 2, 2)
    top[2, 0] = torch.tensor([2.0, 2.0**-6])  # a margin of one bf16 ulp at 2.0 (eps 2**-7 times 2)
    out = decode.compare_tokens(own, other, top, torch.bfloat16)
    assert out["identical_rows"] == 1 and out["same_first"] == 2 and out["first_split"] == [2, None]
    assert out["splits"] == [
        {"row": 0, "step": 2, "own_token": 3, "token": 9, "own_margin": 2.0**-6, "own_margin_ulps": 1.0}
    ]


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--mode", "decode", "--batch", "0"], "--batch"),
        (["--mode", "decode", "--batch", "one"], "argument --batch"),
        (["--mode", "decode", "--new-tokens", "1"], "--new-tokens"),
        (["--mode", "decode", "--prompt", "0"], "--prompt"),
        (["--mode", "decode", "--paths", "graphs"], "unknown path"),
        (["--mode", "decode", "--paths", "cuda-graphs"], "CUDA graphs need a CUDA device"),
        (["--mode", "decode", "--trials", "0"], "--trials"),
        (["--mode", "decode", "--compile"], "--compile is an option of --mode train"),
        (["--mode", "decode", "--steps", "3"], "--steps is an option of --mode train"),
        (["--mode", "decode", "--dtype", "fp8"], "--dtype"),
        (["--batch", "1"], "--batch is an option of --mode decode"),
        (["--new-tokens", "4"], "--new-tokens is an option of --mode decode"),
        (["--steps-per-trial", "0"], "--steps-per-trial"),
        (["--group", "1"], "--group"),
        (["--mode", "serve"], "argument --mode"),
        (["--tag", "../up"], "--tag"),
        (["--mode", "decode", "--tag", "A B"], "--tag"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(args, needle, capsys, tmp_path, monkeypatch):
    def build(*a, **k):
        raise AssertionError("a model was built before the arguments were checked")

    monkeypatch.setattr(models, "build_model", build)
    monkeypatch.setattr(decode, "build_model", build)
    rc = main(["model", "--arch", "llama", "--device", "cpu", "--out", str(tmp_path), *args])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and needle in err and len(err.splitlines()) == 1, err


def test_a_tag_names_the_report_files(tmp_path):
    assert (
        models.report_name({"arch": "llama", "size": "1b", "compile": True, "tag": "part-2"})
        == "llama-1b-compiled-part-2.json"
    )
    assert models.report_name({"arch": "llama", "size": "1b", "compile": False}) == "llama-1b-eager.json"
    rep = {"arch": "qwen3", "size": "1b", "batch": 32, "path": "cuda-graphs", "tag": "a"}
    assert decode.report_name(rep) == "qwen3-1b-decode-b32-cuda-graphs-a.json"
    rc, reps = _decode(
        tmp_path,
        "--impl",
        "eager",
        "--batch",
        "1",
        "--new-tokens",
        "2",
        "--paths",
        "eager",
        "--trials",
        "1",
        "--tag",
        "t1",
    )
    assert (
        rc == 0
        and set(reps) == {"llama-tiny-decode-b1-eager-t1.json"}
        and reps["llama-tiny-decode-b1-eager-t1.json"]["tag"] == "t1"
    )


@pytest.mark.gpu
def test_decode_on_cuda_eager_and_under_cuda_graphs(tmp_path):
    rc = main(["model", "--mode", "decode", "--arch", "llama,gpt2", "--impl", "eager,triton,cute", "--batch", "1,4",
               "--device", "cuda", "--out", str(tmp_path)])  # fmt: skip
    reps = [json.loads(p.read_text()) for p in tmp_path.glob("*-decode-*.json")]
    assert rc == 0 and len(reps) == 8
    for rep in reps:
        rows = {r["impl"]: r for r in rep["variants"]}
        assert set(rows) == {"own", "eager", "triton", "cute"} and all(r["status"] == "ok" for r in rows.values()), rows
        assert all(r["per_token_ms"] > 0 and r["repeatable"] for r in rows.values())
        if rep["path"] == "cuda-graphs":
            # every variant's decode step captured whole: no graph break, no graph Inductor declined
            assert all(r["graph_breaks"] == 0 and r["cudagraph_skips"] == 0 for r in rows.values()), rows


def test_decode_timing_drops_a_trial_whose_n_tokens_were_not_the_slower():
    """(t1, tn) per trial: a 1-token generate no faster than the N-token one gives no per-token time,
    and a run of only such trials has none (never 0 ms a token)."""
    t = decode._timing([(0.010, 0.009), (0.002, 0.009), (0.002, 0.016)], batch=2, new_tokens=8)
    assert t["trial_per_token_ms"] == pytest.approx([1.0, 2.0]) and t["per_token_ms"] == pytest.approx(1.5)
    assert t["dropped_trials"] == 1 and t["noisy"] is True and t["tokens_per_s"] == pytest.approx(2 / 1.5e-3)
    none = decode._timing([(0.010, 0.009)], batch=2, new_tokens=8)
    assert none["per_token_ms"] is None and none["dropped_trials"] == 1 and none["noisy"] is True
    row = {"impl": "eager", "status": "ok", "norms_run_as": decode.IMPL_EAGER, **none}
    rep = {"arch": "llama", "model_class": "LlamaForCausalLM", "size": "tiny", "dtype": "bf16", "batch": 2, "prompt": 16,
           "new_tokens": 8, "path": "eager", "device": "cpu", "params": 1e6, "path_detail": "eager", "warmup_generates": 2,
           "trials": 1, "noisy_above": 0.03, "variants": [row]}  # fmt: skip
    md = decode.markdown([rep])
    assert "| – (noisy, 1 trial dropped) |" in md
    clean = decode._timing([(0.002, 0.009), (0.002, 0.009)], batch=1, new_tokens=8)
    assert clean["dropped_trials"] == 0 and clean["noisy"] is False and clean["per_token_ms"] == pytest.approx(1.0)

