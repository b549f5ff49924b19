"""`normbench model`: what a faster norm buys a training step of a real model.

    normbench model --arch llama,qwen3,gemma3,gpt2 --size small --impl '*' --steps 10 --device cuda

For each architecture, a Hugging Face model is built from a config (random weights from a seed;
nothing is downloaded) and trained for K steps (forward, backward, AdamW) on seeded random tokens,
first with its own norms, then with each implementation's norms swapped in (``harness.integrate.swap``), from
the same initial weights on the same batches. Reported per implementation: whether its loss and
gradient norm agree with the model's own norms, and on a GPU the training step time and tokens/s.

Method, and why:

* One model instance serves every variant. Swapping keeps the Parameter objects (``swap_norms``), so
  switching variant is putting the other norm modules in place, and every run starts from
  ``load_state_dict`` of the initial weights with a fresh optimizer: no copies of the model, so the
  1b size fits beside a dozen variants.
* Agreement: the relative difference, against the model's own norms, of the loss and of the global
  gradient norm (fp32 L2 over all gradients, before the optimizer step) at step 1 (one forward and
  backward from identical weights) and at step K (after K-1 optimizer steps, where differences have
  grown through training). A correct kernel differs from the model's own norm by rounding only
  (Llama-style classes round twice, a kernel rounds once; both are within the check's 2 ulps of
  fp64). How much such differences move the loss depends on the model, the step and the
  dtype, so the tolerance is measured rather than guessed: control runs train the model with its own
  norms whose outputs are moved by u times the error ``normbench check`` allows a kernel (2 ulps in
  bf16, 1e-4 relative in fp32; ``harness.spec.tolerances``), u uniform in [-1, 1] per element (seeded).
  The tolerance of each quantity is ``SAFETY`` times the largest control difference (two controls
  are two samples of a random effect: the factor covers their spread), never below ``FLOOR_ULPS`` of
  the dtype's epsilon (where the controls happen to move a quantity very little), nor, for the norms'
  own gradient norm, below half the epsilon (``DWEIGHT_FLOOR``: dweight is an output rounded to the
  parameters' dtype, see there). Compared: the loss,
  the gradient norm over all parameters, and over the norms' own parameters (dweight is a small
  part of the whole). What this catches that the per-element check cannot: a bias. Differences of
  random sign average out over a model; a kernel whose every output is rounded the same way (the
  Triton 3.9 CPU interpreter converts fp32 to bf16 by truncation) moves the gradient norm by many
  times the controls' effect, though each element is within 1 ulp.
* Dtype: the model's parameters and activations are bf16 (or fp32), AdamW on them directly. fp16
  is refused: without a loss scaler AdamW's update overflows in fp16 within a step or two.
* Timing (GPU, or ``--trials`` on the CPU): only variants that agree are timed. Every variant first
  runs ``WARMUP_STEPS`` untimed steps (JIT compilation, autotuning, torch.compile); then
  ``--trials`` trials, each running every variant for K steps in an order rotated by one per trial
  (so slow drift of clocks or temperature is not charged to one variant), each preceded by one
  untimed step after the switch. A trial's time is wall time between device synchronisations over
  K steps; the variant's step time is the median of its trials, with the trials' spread
  ((max - min) / min), flagged noisy above 5% as in ``normbench bench``, and flagged "recompiled"
  where torch.compile built a graph inside a timed step. tokens/s = batch * seq / step time.
* ``--compile`` wraps the whole model in ``torch.compile``; the norm variants are switched inside
  it, so dynamo's recompile limit is raised to hold every variant's graphs. The number of graph
  breaks while compiling each variant is recorded: where a norm is an opaque call, the compiled
  graph breaks around it, which costs fusion across the norm. The controls run uncompiled, against
  an uncompiled run of the model's own norms.

Reports: ``<arch>-<size>-<eager|compiled>.json`` per architecture and mode, and ``models.md``
rebuilt from every JSON in the folder, under ``runs/<gpu>/<date>/models/`` or ``--out`` (the committed ones: ``reports/<gpu>/models/``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from harness.integrate.swap import _classify, swap_norms
from harness.run.bench import default_out_dir
from harness.run.environment import environment
from harness.run.timer import NOISY_SPREAD
from harness.spec.contract import DTYPES, Implementation
from harness.spec.errors import describe_error
from harness.spec.tolerances import TOLERANCES, ulp

# compared at step 1 and K: the loss, the gradient norm of all parameters and of the norms' own
QUANTITIES = ("loss", "grad_norm", "norm_grad_norm")
SAFETY = 4.0
FLOOR_ULPS = 1 / 32
# The norms' own gradient norm is a norm of dweight, itself an output in the parameters' dtype. The
# model's own class forms it by autograd of `weight * hidden.to(dtype)` (a reduction in that dtype),
# a kernel as an fp32 sum rounded once: two correct results that may each sit up to half an ulp
# apart, the same way across a whole vector, so their norms can differ by up to eps / 2 relative,
# which no random perturbation of the forward's outputs reproduces. Measured on a Qwen3 of the 1b
# size (65 norms, q_norm / k_norm reducing 131072 rows of 64): torch's own fused RMSNorm ("eager")
# differed from the model's class by 8.6e-4 = 0.11 eps at step 1, and the kernels here by 6e-4 to
# 2.3e-3, against 4x the controls' 9e-5 (reports/nvidia-h100/models/).
DWEIGHT_FLOOR = 1 / 2
CONTROL_SEEDS = (1, 2)
WARMUP_STEPS = 2
LR = 1e-3
MIN_TRANSFORMERS = "4.56"
INSTALL_HINT = "pip install 'normbench[models]'"


# ---------------------------------------------------------------- architectures and sizes
@dataclass(frozen=True)
class Size:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    seq: int
    batch: int


# tiny: CI on a CPU. small: 4 Llama-1B-wide layers (hidden 2048) on 4 x 1024 tokens, a vocabulary of
# 8192 so the LM head does not drown the layers: where norms are a visible part of a step.
# 1b: the shape of Llama 3.2 1B (16 layers, hidden 2048, 32 heads / 8 KV heads, MLP 8192), vocabulary 32768.
SIZES = {
    "tiny": Size(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=256, seq=32, batch=2),
    "small": Size(layers=4, hidden=2048, heads=16, kv_heads=8, head_dim=128, intermediate=5632, vocab=8192, seq=1024, batch=4),
    "1b": Size(layers=16, hidden=2048, heads=32, kv_heads=8, head_dim=64, intermediate=8192, vocab=32768, seq=2048, batch=2),
}


def _decoder_config(s: Size) -> dict:
    return dict(
        vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.intermediate, num_hidden_layers=s.layers,
        num_attention_heads=s.heads, num_key_value_heads=s.kv_heads, head_dim=s.head_dim,
        max_position_embeddings=max(s.seq, 128), attention_dropout=0.0, use_cache=False,
    )  # fmt: skip


def _gemma3_config(s: Size) -> dict:
    # half of the layers see a window of seq/2 (Gemma3 alternates local and global attention)
    return dict(_decoder_config(s), query_pre_attn_scalar=s.head_dim, sliding_window=max(s.seq // 2, 8),
                layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(s.layers)])  # fmt: skip


def _gpt2_config(s: Size) -> dict:
    return dict(
        vocab_size=s.vocab, n_embd=s.hidden, n_layer=s.layers, n_head=s.heads, n_inner=s.intermediate,
        n_positions=max(s.seq, 128), resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
        bos_token_id=0, eos_token_id=0,  # GPT-2's own (50256) lie outside the smaller vocabularies
    )  # fmt: skip


@dataclass(frozen=True)
class Arch:
    config: str  # transformers config class
    model: str  # transformers model class
    kwargs: object  # Size -> config keyword arguments


ARCHS = {
    "llama": Arch("LlamaConfig", "LlamaForCausalLM", _decoder_config),
    "mistral": Arch("MistralConfig", "MistralForCausalLM", _decoder_config),
    "qwen2": Arch("Qwen2Config", "Qwen2ForCausalLM", _decoder_config),
    "qwen3": Arch("Qwen3Config", "Qwen3ForCausalLM", _decoder_config),
    "gemma3": Arch("Gemma3TextConfig", "Gemma3ForCausalLM", _gemma3_config),
    "gpt2": Arch("GPT2Config", "GPT2LMHeadModel", _gpt2_config),
}


def transformers_missing() -> str | None:
    """Why `normbench model` cannot run here (transformers absent or too old), or None."""
    if importlib.util.find_spec("transformers") is None:
        return f"normbench model needs transformers >= {MIN_TRANSFORMERS}, which is not installed ({INSTALL_HINT})"
    from importlib.metadata import version

    have = version("transformers")
    if tuple(int(p) for p in have.split(".")[:2] if p.isdigit()) < tuple(int(p) for p in MIN_TRANSFORMERS.split(".")):
        return f"normbench model needs transformers >= {MIN_TRANSFORMERS}, found {have} ({INSTALL_HINT})"
    return None


def build_model(arch: str, size: str, device: str, dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    """``arch`` at ``size`` with seeded random weights, in ``dtype`` on ``device``, in train mode."""
    why = transformers_missing()
    if why:
        raise ValueError(why)
    import transformers

    spec = ARCHS[arch]
    config = getattr(transformers, spec.config)(**spec.kwargs(SIZES[size]))
    torch.manual_seed(seed)
    with torch.device(device):
        model = getattr(transformers, spec.model)(config)
    return model.to(dtype).train()


# ---------------------------------------------------------------- switching norms
class NormVariants:
    """One model; its own norm modules, and normbench's per implementation, put in place on demand.
    Every variant holds the same Parameter objects, so weights, optimizer and state_dict are shared."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.own = {name: mod for name, mod in model.named_modules() if name and _classify(mod)[0] is not None}
        self.reports: dict[str, object] = {}
        self._modules: dict[str, dict[str, torch.nn.Module]] = {}

    def _place(self, modules: dict[str, torch.nn.Module]) -> None:
        for name, mod in modules.items():
            parent, _, attr = name.rpartition(".")
            setattr(self.model.get_submodule(parent) if parent else self.model, attr, mod)

    def use_own(self) -> None:
        self._place(self.own)

    def use(self, impl: Implementation):
        """Put ``impl``'s norms in place (built once per implementation: the same module objects
        every time, so a compiled model finds its cached graphs again). Returns the swap report."""
        self.use_own()
        if impl.name not in self._modules:
            report = swap_norms(self.model, impl, warn=False)
            self._modules[impl.name] = {name: self.model.get_submodule(name) for name in self.own}
            self.reports[impl.name] = report
        self._place(self._modules[impl.name])
        return self.reports[impl.name]


def missing_ops(model: torch.nn.Module, impl: Implementation) -> list[str]:
    """The ops the model's norms need that ``impl`` does not provide."""
    need = {spec.op for _, mod in model.named_modules() if (spec := _classify(mod)[0]) is not None}
    return sorted(need - set(impl.ops))


@contextlib.contextmanager
def perturbed_norms(modules, seed: int, device: str):
    """Every output y of ``modules`` moved by u times the error the checker allows a kernel
    (harness.spec.tolerances: 2 ulps of y in bf16 / fp16, 1e-4 * |y| in fp32; its row floor left out),
    u uniform in [-1, 1] (seeded): the calibration of the agreement tolerance."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def hook(_mod, _inp, out):
        t = TOLERANCES[out.dtype]
        y = out.float()
        u = torch.rand(out.shape, generator=gen, device=out.device, dtype=torch.float32) * 2 - 1
        return (y + u * (t.ulps * ulp(y, out.dtype) + t.rtol * y.abs())).to(out.dtype)

    handles = [m.register_forward_hook(hook) for m in modules]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


# ---------------------------------------------------------------- training
def _grad_norm(params) -> torch.Tensor:
    norms = [p.grad.float().norm() for p in params if p.grad is not None]
    return torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class Trainer:
    """K training steps of ``model`` (through ``forward``: the model or its compiled wrapper)."""

    def __init__(self, model, forward, batches, device: str, lr: float = LR, initial: dict | None = None, norm_params=()):
        self.model, self.forward, self.batches, self.device, self.lr = model, forward, batches, device, lr
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.norm_params = list(norm_params)
        self.initial = initial or {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.opt = None

    def step(self, batch, measure: bool):
        self.opt.zero_grad(set_to_none=True)
        loss = self.forward(input_ids=batch, labels=batch).loss
        loss.backward()
        gn = (_grad_norm(self.params), _grad_norm(self.norm_params)) if measure else None
        self.opt.step()
        return loss.detach(), gn

    def fresh(self) -> None:
        """The initial weights and a new optimizer."""
        self.model.load_state_dict(self.initial)
        self.opt = torch.optim.AdamW(self.params, lr=self.lr)

    def run(self) -> dict:
        """From the initial weights: loss and gradient norm at every step."""
        self.fresh()
        out = [self.step(b, measure=True) for b in self.batches]
        return {q: [float(g[i]) for _, g in out] for i, q in enumerate(QUANTITIES[1:])} | {"loss": [float(l) for l, _ in out]}

    def time_steps(self, n: int) -> float:
        """Seconds per step over ``n`` steps, between device synchronisations."""
        _sync(self.device)
        t0 = time.perf_counter()
        for i in range(n):
            self.step(self.batches[i % len(self.batches)], measure=False)
        _sync(self.device)
        return (time.perf_counter() - t0) / n


def rel_diffs(run: dict, ref: dict) -> dict:
    """Relative difference of loss and gradient norm at step 1 and step K."""
    out = {}
    for q in QUANTITIES:
        for label, i in (("1", 0), ("K", -1)):
            a, b = run[q][i], ref[q][i]
            out[f"{q}@{label}"] = abs(a - b) / abs(b) if b else abs(a - b)
    return out


def tolerances(controls: list[dict], dtype: torch.dtype) -> dict:
    eps = torch.finfo(dtype).eps
    keys = controls[0].keys()
    return {k: max(SAFETY * max(c[k] for c in controls), (DWEIGHT_FLOOR if k.startswith("norm_") else FLOOR_ULPS) * eps) for k in keys}


def _worst(diffs: dict, tol: dict) -> str:
    """The quantity furthest beyond (or least within) its tolerance; a NaN first."""
    return max(diffs, key=lambda k: diffs[k] / tol[k] if diffs[k] == diffs[k] and tol[k] else math.inf)


def verdict(diffs: dict, tol: dict) -> bool:
    # a NaN difference compares False: it fails
    return all(diffs[k] <= tol[k] for k in tol)


# ---------------------------------------------------------------- one architecture
def _dynamo_count(what: str) -> int:
    """Graph breaks ("graph_break") or graphs compiled ("unique_graphs") so far in this process."""
    try:
        from torch._dynamo.utils import counters

        return sum(counters["graph_break"].values()) if what == "graph_break" else counters["stats"][what]
    except Exception:
        return 0


def _raise_recompile_limit(n: int) -> None:
    import torch._dynamo.config as dc

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dc, name):
            setattr(dc, name, max(getattr(dc, name), n))


def _log(msg: str) -> None:
    print(msg, flush=True)


def run_arch(arch: str, size: str, impls: list[Implementation], *, device: str, dtype: str = "bf16",
             steps: int = 10, compile: bool = False, trials: int = 0, seed: int = 0) -> dict:  # fmt: skip
    """Build ``arch``, train it with its own norms and with each implementation's; the report dict."""
    tdtype = DTYPES[dtype]
    tag = f"[{arch} {size}{' compiled' if compile else ''}]"
    model = build_model(arch, size, device, tdtype, seed)
    s = SIZES[size]
    gen = torch.Generator().manual_seed(seed + 1)
    batches = [torch.randint(0, s.vocab, (s.batch, s.seq), generator=gen).to(device) for _ in range(steps)]
    variants = NormVariants(model)
    forward = model
    if compile:
        _raise_recompile_limit(8 * (len(impls) + 2))
        forward = torch.compile(model)
    norm_params = [p for m in variants.own.values() for p in m.parameters()]
    trainer = Trainer(model, forward, batches, device, norm_params=norm_params)
    t0 = time.perf_counter()

    # the model's own norms, and the controls that calibrate the tolerance (uncompiled)
    variants.use_own()
    own = trainer.run()
    _log(f"{tag} own norms: loss {own['loss'][0]:.4f} -> {own['loss'][-1]:.4f} over {steps} steps ({time.perf_counter() - t0:.1f} s)")
    plain = Trainer(model, model, batches, device, initial=trainer.initial, norm_params=norm_params)
    own_plain = plain.run() if compile else own
    controls = []
    for c in CONTROL_SEEDS:
        with perturbed_norms(variants.own.values(), seed=1000 + c, device=device):
            controls.append(rel_diffs(plain.run(), own_plain))
    tol = tolerances(controls, tdtype)
    _log(f"{tag} tolerance (x{SAFETY:g} the controls): " + ", ".join(f"{k} {v:.2e}" for k, v in tol.items()))

    results = []
    for impl in impls:
        r = {"impl": impl.name, "dsl": impl.dsl, "external": impl.external, "status": "skip", "reason": ""}
        results.append(r)
        why = impl.unavailable(device) or (
            f"does not provide {', '.join(m)}" if (m := missing_ops(model, impl)) else None
        )
        if why:
            r["reason"] = why
            _log(f"{tag} {impl.name}: skipped ({why})")
            continue
        t1 = time.perf_counter()
        breaks = _dynamo_count("graph_break")
        try:
            report = variants.use(impl)
            run = trainer.run()
        except Exception as e:  # one failing implementation must not stop the others
            r.update(status="error", reason=describe_error(e))
            _log(f"{tag} {impl.name}: error ({r['reason']})")
            continue
        finally:
            variants.use_own()
        d = rel_diffs(run, own)
        ok = verdict(d, tol)
        r.update(status="pass" if ok else "fail", **run, rel_diff=d, swapped=report.counts(), unknown=report.unknown,
                 seconds=round(time.perf_counter() - t1, 2))  # fmt: skip
        if compile:
            r["graph_breaks"] = _dynamo_count("graph_break") - breaks
        worst = _worst(d, tol)
        _log(f"{tag} {impl.name}: {r['status']} (worst {worst} {d[worst]:.2e} vs tolerance {tol[worst]:.2e}; {r['seconds']} s)")

    timing = _time_variants(trainer, variants, impls, results, trials, steps, tag) if trials else None
    first = next((variants.reports[i.name] for i in impls if i.name in variants.reports), None)
    return {
        "arch": arch,
        "size": size,
        "size_config": asdict(s),
        "model_class": type(model).__name__,
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "params": sum(p.numel() for p in model.parameters()),
        "tokens_per_step": s.batch * s.seq,
        "dtype": dtype,
        "device": device,
        "compile": compile,
        "steps": steps,
        "lr": LR,
        "seed": seed,
        "norms": {name: type(m).__name__ for name, m in variants.own.items()},
        "not_fused": first.not_fused if first else [],
        "tolerance": {"safety": SAFETY, "floor_ulps": FLOOR_ULPS, "controls": controls, "tol": tol},
        "own": own,
        "own_uncompiled": own_plain if compile else None,
        "results": results,
        "timing": timing,
    }


def _time_variants(trainer, variants, impls, results, trials, steps, tag) -> dict:
    """Step time of the model's own norms and of every agreeing implementation (see the module
    docstring: warm-up, rotated order, median of trials)."""
    by_name = {i.name: i for i in impls}
    names = list(dict.fromkeys(["own"] + [r["impl"] for r in results if r["status"] == "pass"]))

    def use(name):
        if name == "own":
            variants.use_own()
        else:
            variants.use(by_name[name])

    trainer.fresh()
    per = {n: [] for n in names}
    failed = {}
    # graphs torch.compile built inside timed steps (the untimed step after a switch should absorb
    # any recompilation; a count here means a timing includes compilation)
    compiled_in_timing = {n: 0 for n in names}

    def timed(name, n) -> float | None:
        use(name)
        try:
            return trainer.time_steps(n)
        except Exception as e:  # recorded; the other variants go on
            failed[name] = describe_error(e)
            return None

    for name in names:
        timed(name, WARMUP_STEPS)
    for t in range(trials):
        live = [n for n in names if n not in failed]
        k = t % max(len(live), 1)
        for name in live[k:] + live[:k]:
            if timed(name, 1) is None:
                continue
            graphs = _dynamo_count("unique_graphs")
            if (sec := timed(name, steps)) is not None:
                per[name].append(sec)
            compiled_in_timing[name] += _dynamo_count("unique_graphs") - graphs
        _log(f"{tag} timing trial {t + 1}/{trials} done")
    names = [n for n in names if n not in failed]
    variants.use_own()
    out = {}
    for name in names:
        ms = [x * 1e3 for x in per[name]]
        spread = (max(ms) - min(ms)) / min(ms) if ms and min(ms) > 0 else 0.0
        step_ms = statistics.median(ms)
        out[name] = {"step_ms": step_ms, "trial_ms": ms, "spread": spread, "noisy": spread > NOISY_SPREAD,
                     "tokens_per_s": trainer.batches[0].numel() / (step_ms / 1e3),
                     "graphs_compiled_while_timed": compiled_in_timing[name]}  # fmt: skip
    own_ms = out["own"]["step_ms"] if "own" in out else None
    for name, row in out.items():
        row["speedup_vs_own"] = own_ms / row["step_ms"] if own_ms else None
    return {"trials": trials, "steps_per_trial": steps, "warmup_steps": WARMUP_STEPS, "variants": out, "failed": failed}


# ---------------------------------------------------------------- reports
def report_name(rep: dict) -> str:
    return f"{rep['arch']}-{rep['size']}-{'compiled' if rep['compile'] else 'eager'}.json"


def _fmt(x, spec=".2e"):
    return "–" if x is None else format(x, spec)


def markdown(reps: list[dict]) -> str:
    lines = ["# Models: a training step with each implementation's norms", ""]
    for rep in sorted(reps, key=lambda r: (r["size"], r["arch"], r["compile"])):
        mode = "torch.compile" if rep["compile"] else "eager"
        lines += [
            f"## {rep['arch']} ({rep['model_class']}), {rep['size']}, {rep['dtype']}, {mode}, {rep['device']}",
            "",
            f"{rep['params'] / 1e6:.1f} M parameters, {rep['tokens_per_step']} tokens per step, {rep['steps']} AdamW steps "
            f"(lr {rep['lr']}); norms: " + ", ".join(f"{n} x {c}" for c, n in _count(rep["norms"]).items()) + ".",
            "Agreement: relative difference from the model's own norms of the loss, the gradient norm (all parameters) "
            "and the norms' gradient norm, at step 1 and K, with its ratio to the tolerance; "
            f"tolerance {rep['tolerance']['safety']:g} x the largest difference of {len(rep['tolerance']['controls'])} "
            "control runs whose norm outputs were moved by up to the error `normbench check` allows: "
            + ", ".join(f"{k} {v:.1e}" for k, v in rep["tolerance"]["tol"].items()) + ".",
            "",
            "| implementation | agrees | worst difference (x tolerance) | step ms | tokens/s | vs own |",
            "|---|---|---|---|---|---|",
        ]
        timing = (rep.get("timing") or {}).get("variants", {})
        t = timing.get("own")
        lines.append(f"| model's own norms | – | – | {_ms(t)} | {_fmt(t and t['tokens_per_s'], ',.0f')} | 1.00x |")
        tol = rep["tolerance"]["tol"]
        for r in rep["results"]:
            if r["status"] in ("skip", "error"):
                lines.append(f"| {r['impl']} | {r['status']}: {r['reason']} | | | | |")
                continue
            d, t = r["rel_diff"], timing.get(r["impl"])
            worst = _worst(d, tol)
            speed = _fmt(t and t["speedup_vs_own"], ".2f") + ("x" if t else "")
            name = r["impl"] + (f" ({r['graph_breaks']} graph breaks)" if r.get("graph_breaks") else "")
            lines.append(
                f"| {name} | {'yes' if r['status'] == 'pass' else '**no**'} | {worst} {_fmt(d[worst])} ({d[worst] / tol[worst]:.2f}x) | "
                f"{_ms(t)} | {_fmt(t and t['tokens_per_s'], ',.0f')} | {speed} |"
            )
        if not timing:
            lines += ["", "Not timed (step times are measured on a GPU, or with --trials)."]
        for name, why in ((rep.get("timing") or {}).get("failed") or {}).items():
            lines += ["", f"Timing of {name} failed: {why}"]
        lines.append("")
    return "\n".join(lines)


def _ms(t) -> str:
    if not t:
        return "–"
    flags = [f for f, on in (("noisy", t["noisy"]), ("recompiled", t.get("graphs_compiled_while_timed"))) if on]
    return f"{t['step_ms']:.2f}" + (f" ({', '.join(flags)})" if flags else "")


def _count(names: dict) -> dict:
    out: dict[str, int] = {}
    for c in names.values():
        out[c] = out.get(c, 0) + 1
    return out


def write_reports(out: Path, rep: dict, command: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / report_name(rep)
    path.write_text(json.dumps({"command": command, "environment": environment(rep["device"]), **rep}, indent=1))
    reps = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    (out / "models.md").write_text(markdown([r for r in reps if "arch" in r and "results" in r]))
    return path


# ---------------------------------------------------------------- entry point (harness.cli calls it)
def run(archs: list[str], size: str, impls: list[Implementation], *, device: str, steps: int, compile: bool,
        trials: int | None, out: Path | None, dtype: str = "bf16", seed: int = 0) -> int:  # fmt: skip
    """`normbench model`: exit status 0 when every implementation that ran agrees, 1 otherwise."""
    why = transformers_missing()
    if why:
        raise ValueError(why)
    bad = [a for a in archs if a not in ARCHS]
    if bad or not archs:
        raise ValueError(f"unknown --arch '{','.join(bad)}'; choose from {', '.join(ARCHS)}")
    if size not in SIZES:
        raise ValueError(f"unknown --size '{size}'; choose from {', '.join(SIZES)}")
    if dtype not in ("bf16", "fp32"):
        raise ValueError(f"--dtype must be bf16 or fp32 (fp16 training needs a loss scaler), got '{dtype}'")
    if steps < 1:
        raise ValueError(f"--steps must be >= 1, got {steps}")
    if trials is None:
        trials = 5 if device == "cuda" else 0
    if trials < 0:
        raise ValueError(f"--trials must be >= 0, got {trials}")
    if out is None:
        gpu = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
        out = default_out_dir(gpu) / "models"
    _output_folder(Path(out))
    why = {i.name: i.unavailable(device) for i in impls}
    if impls and all(why.values()):  # known before any model is built
        _nothing_compared(device, why)
        return 1
    command = "normbench " + " ".join(shlex.quote(x) for x in sys.argv[1:])
    status = 0
    for arch in archs:
        rep = run_arch(arch, size, impls, device=device, dtype=dtype, steps=steps, compile=compile, trials=trials, seed=seed)
        path = write_reports(out, rep, command)
        if any(r["status"] in ("fail", "error") for r in rep["results"]):
            status = 1
        _log(f"wrote {path} and {out / 'models.md'}")
        if all(r["status"] == "skip" for r in rep["results"]):  # as `check`: a run that compared nothing fails
            _nothing_compared(device, {r["impl"]: r["reason"] for r in rep["results"]}, arch)
            status = 1
    return status


def _nothing_compared(device: str, why: dict, arch: str | None = None) -> None:
    reasons = "; ".join(f"{name}: {reason}" for name, reason in why.items())
    print(f"normbench: model: nothing was compared{' in ' + arch if arch else ''} on {device}: every selected implementation "
          f"was skipped ({reasons})", file=sys.stderr)  # fmt: skip


def _output_folder(out: Path) -> None:
    """The report folder, made (or found writable) before any model is trained: a path that is a
    file, or lies under one, is a one-line ValueError, not an error after minutes of training."""
    up = out
    while not up.exists() and up != up.parent:
        up = up.parent
    if up.exists() and not up.is_dir():
        raise ValueError(f"--out {out}: {'exists and is not a folder' if up == out else f'{up} is not a folder'}")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"--out {out}: cannot write in it ({e.strerror or e})") from None
