"""`normbench model`: what a faster norm buys a training step of a real model.

    normbench model --arch llama,qwen3,gemma3,gpt2 --size small --impl '*' --steps 10 --device cuda

For each architecture, a Hugging Face model is built from a config (random weights from a seed;
nothing is downloaded) and trained for K steps (forward, backward, AdamW) on seeded random tokens,
first with its own norms, then with each implementation's norms swapped in (``harness.integrate.swap``), from
the same initial weights on the same batches. Reported per implementation: whether its loss and
gradient norm agree with the model's own norms, and on a GPU the training step time and tokens/s.

Method, and why:

* Every variant is its own deep copy of one initial model (``variant_model``), with its norms
  swapped in and an AdamW of its own: no ``load_state_dict`` or optimizer rebuilt at a switch of
  variant, no module swapped in and out of a shared (or compiled) model, nothing of one variant's
  state (weights, optimizer moments, compiled graphs, allocator blocks sized for it) carried into
  another's timed steps. The same copy is trained for the agreement run and then timed, so every
  variant has been through the same K steps when its timing starts. Where the copies of every
  variant do not fit in device memory together (``--impl '*'`` at 1b on an 80 GB GPU: each copy
  holds its weights and AdamW's two moments), the implementations are timed in groups, the model's
  own norms in every group (``--group``; by default as many as fit, from the own copy's measured
  footprint), and each implementation's speedup is against the own norms of its group.
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
  ``--trials`` trials (6 on a GPU), each running every variant for ``--steps-per-trial`` steps (K
  unless given) in an order rotated by one per trial (``rotated``: slow drift of clocks or
  temperature is shared out, not charged to one variant). A trial's time is wall time between
  device synchronisations, with Python's garbage collector run before the trial and paused inside
  it (a collection inside a timed step of a model this size is a slow trial of its own); the
  variant's step time is the median of its trials, with the trials' spread ((max - min) / min,
  ``spread``), marked noisy above ``NOISY_TRIAL_SPREAD`` (3%), and "recompiled" where torch.compile
  built a graph inside a timed step. tokens/s = batch * seq / step time.
* ``--compile`` wraps each variant's copy in ``torch.compile`` (whole model, default mode). With the
  model's own norms that is Inductor's norms: the modules' ops traced and fused with their
  neighbours; with an implementation's, the norm is a custom op (``harness.integrate.library``) that
  Inductor calls as an opaque kernel. The report names which ran (``norms_run_as``). The number of
  graph breaks while compiling each variant is recorded. The controls run uncompiled, against an
  uncompiled run of the model's own norms; the compiled model with its own norms against that same
  run is one more control (its difference is compilation's rounding, which a variant compared with
  the compiled model carries as well: on Qwen3 at the 1b size, step K a loss spike, it was 0.88x of
  the two perturbation controls' tolerance).

Reports: ``<arch>-<size>-<eager|compiled>.json`` per architecture and mode, and ``models.md``
rebuilt from every training JSON in the folder (``--mode decode``, ``harness.run.decode``, writes
``*-decode-*.json`` and ``models-decode.md`` beside them), under ``runs/<gpu>/<date>/models/`` or ``--out`` (the committed ones: ``reports/<gpu>/models/``).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import importlib.util
import json
import math
import os
import re
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
from harness.run.environment import gpu_id as environment_gpu_id
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
TRIALS_CUDA = 6
# A variant whose trials spread more than this is marked noisy: above it, two variants a few percent
# apart cannot be told apart (normbench bench marks at 5%; a model step is long and steadier).
NOISY_TRIAL_SPREAD = 0.03
# Device memory left free beside the copies of one timing group (the step's own transient memory is
# measured on the model's own norms, and this covers what another variant may need beyond it).
MEMORY_MARGIN = 4 << 30
TRANSIENT_FACTOR = 1.25
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


def build_model(
    arch: str, size: str, device: str, dtype: torch.dtype, seed: int = 0, positions: int = 0
) -> torch.nn.Module:
    """``arch`` at ``size`` with seeded random weights, in ``dtype`` on ``device``, in train mode.
    ``positions``: the longest sequence it must take (decoding a prompt past the size's own), which
    raises the position table where the architecture has one (GPT-2's learned positions)."""
    why = transformers_missing()
    if why:
        raise ValueError(why)
    import transformers

    spec = ARCHS[arch]
    kwargs = spec.kwargs(SIZES[size])
    for key in ("max_position_embeddings", "n_positions"):
        if key in kwargs:
            kwargs[key] = max(kwargs[key], positions)
    config = getattr(transformers, spec.config)(**kwargs)
    torch.manual_seed(seed)
    with torch.device(device):
        model = getattr(transformers, spec.model)(config)
    return model.to(dtype).train()


# ---------------------------------------------------------------- one copy per variant
def own_norms(model: torch.nn.Module) -> dict[str, str]:
    """The model's norms that ``swap_norms`` replaces: module name -> class name."""
    return {name: type(mod).__name__ for name, mod in model.named_modules() if name and _classify(mod)[0] is not None}


def variant_model(template: torch.nn.Module, impl: Implementation | None = None):
    """(a deep copy of ``template``, the swap report): the same initial weights, no tensor shared with
    the template or any other copy, and ``impl``'s norms swapped in (None: the model's own norms, and
    no report)."""
    model = copy.deepcopy(template)
    return model, (swap_norms(model, impl, warn=False) if impl is not None else None)


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
    """Training steps of one variant's ``model`` (through ``forward``: the model or its compiled
    wrapper), with an AdamW of its own, from the weights the model holds."""

    def __init__(self, model, forward, batches, device: str, lr: float = LR, norm_params=()):
        self.model, self.forward, self.batches, self.device, self.lr = model, forward, batches, device, lr
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.norm_params = list(norm_params)
        self.opt = torch.optim.AdamW(self.params, lr=lr)

    def step(self, batch, measure: bool):
        self.opt.zero_grad(set_to_none=True)
        loss = self.forward(input_ids=batch, labels=batch).loss
        loss.backward()
        gn = (_grad_norm(self.params), _grad_norm(self.norm_params)) if measure else None
        self.opt.step()
        return loss.detach(), gn

    def free_grads(self) -> None:
        """Gradients dropped between runs: a variant waiting for its turn holds weights and moments only."""
        self.opt.zero_grad(set_to_none=True)

    def run(self) -> dict:
        """One step per batch from the weights held now: loss and gradient norms at every step."""
        out = [self.step(b, measure=True) for b in self.batches]
        self.free_grads()
        return {q: [float(g[i]) for _, g in out] for i, q in enumerate(QUANTITIES[1:])} | {"loss": [float(l) for l, _ in out]}

    def time_steps(self, n: int) -> float:
        """Seconds per step over ``n`` steps, between device synchronisations."""
        _sync(self.device)
        t0 = time.perf_counter()
        for i in range(n):
            self.step(self.batches[i % len(self.batches)], measure=False)
        _sync(self.device)
        sec = (time.perf_counter() - t0) / n
        self.free_grads()
        return sec


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


OWN_COMPILED = "Inductor: the model's own norm modules traced and compiled with the rest of the model"
OWN_EAGER = "the model's own norm modules (PyTorch eager)"
IMPL_COMPILED = "custom op: the implementation's kernels, an opaque call inside the compiled graph"
IMPL_EAGER = "the implementation's kernels (harness.integrate.autograd modules)"


def rotated(names: list, t: int) -> list:
    """Trial ``t``'s order: ``names`` rotated by ``t``, so over as many trials as names every variant
    runs once in every position."""
    k = t % len(names) if names else 0
    return names[k:] + names[:k]


def spread(values) -> float:
    """(max - min) / min of a variant's trial times (0 for fewer than two)."""
    values = list(values)
    return (max(values) - min(values)) / min(values) if len(values) > 1 and min(values) > 0 else 0.0


def trial_summary(seconds: list[float], tokens: int) -> dict:
    """Median step time of a variant's trials, the trials, their spread and the noisy mark."""
    ms = [x * 1e3 for x in seconds]
    step_ms = statistics.median(ms) if ms else None
    s = spread(ms)
    return {"step_ms": step_ms, "trial_ms": ms, "spread": s, "noisy": s > NOISY_TRIAL_SPREAD,
            "tokens_per_s": tokens / (step_ms / 1e3) if step_ms else None}  # fmt: skip


@contextlib.contextmanager
def _gc_paused():
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _allocated(device: str) -> int:
    return torch.cuda.memory_allocated() if device == "cuda" else 0


def _release(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def group_size(device: str, n: int, resident: int, transient: int, requested: int | None) -> int:
    """How many implementations are timed beside the own norms in one group: ``requested - 1`` when
    ``--group`` is given, else as many copies of ``resident`` bytes as the device has room for beside
    one step's ``transient`` bytes (all of them off a GPU)."""
    if requested:
        return max(requested - 1, 1)
    if device != "cuda" or n == 0:
        return max(n, 1)
    free, _ = torch.cuda.mem_get_info()
    free += torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    room = free - TRANSIENT_FACTOR * transient - MEMORY_MARGIN
    return max(1, min(n, int(room // max(resident, 1))))


def run_arch(arch: str, size: str, impls: list[Implementation], *, device: str, dtype: str = "bf16",
             steps: int = 10, compile: bool = False, trials: int = 0, seed: int = 0,
             steps_per_trial: int | None = None, group: int | None = None) -> dict:  # fmt: skip
    """Build ``arch``, train a copy of it with its own norms and one with each implementation's; the report dict."""
    tdtype = DTYPES[dtype]
    tag = f"[{arch} {size}{' compiled' if compile else ''}]"
    template = build_model(arch, size, device, tdtype, seed)
    s = SIZES[size]
    gen = torch.Generator().manual_seed(seed + 1)
    batches = [torch.randint(0, s.vocab, (s.batch, s.seq), generator=gen).to(device) for _ in range(steps)]
    norms = own_norms(template)
    if compile:
        _raise_recompile_limit(8 * (len(impls) + 4))

    def trainer(impl=None, compiled=compile):
        model, report = variant_model(template, impl)
        norm_params = [p for name in norms for p in model.get_submodule(name).parameters()]
        forward = torch.compile(model) if compiled else model
        return Trainer(model, forward, batches, device, norm_params=norm_params), report

    t0 = time.perf_counter()
    # the model's own norms (this copy is also the one timed), and the controls that calibrate the
    # tolerance (uncompiled)
    before = _allocated(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    own_tr, _ = trainer()
    own = own_tr.run()
    resident = _allocated(device) - before
    transient = (torch.cuda.max_memory_allocated() if device == "cuda" else 0) - _allocated(device)
    _log(f"{tag} own norms: loss {own['loss'][0]:.4f} -> {own['loss'][-1]:.4f} over {steps} steps ({time.perf_counter() - t0:.1f} s)")
    own_plain = own
    if compile:
        plain, _ = trainer(compiled=False)
        own_plain = plain.run()
        del plain
    controls = []
    for c in CONTROL_SEEDS:
        ctl, _ = trainer(compiled=False)
        with perturbed_norms([ctl.model.get_submodule(n) for n in norms], seed=1000 + c, device=device):
            controls.append(rel_diffs(ctl.run(), own_plain))
        del ctl
    if compile:
        # compiling the model moves these quantities too (Inductor's fusions round otherwise): its
        # own norms compiled against the same uncompiled run is a control of its own, for the
        # compiled variants are compared with the compiled model
        controls.append(rel_diffs(own, own_plain))
    _release(device)
    tol = tolerances(controls, tdtype)
    _log(f"{tag} tolerance (x{SAFETY:g} the controls): " + ", ".join(f"{k} {v:.2e}" for k, v in tol.items()))

    results, queue = [], []
    for impl in impls:
        r = {"impl": impl.name, "dsl": impl.dsl, "external": impl.external, "status": "skip", "reason": ""}
        results.append(r)
        why = impl.unavailable(device) or (
            f"does not provide {', '.join(m)}" if (m := missing_ops(template, impl)) else None
        )
        if why:
            r["reason"] = why
            _log(f"{tag} {impl.name}: skipped ({why})")
        else:
            queue.append((impl, r))
    per_group = group_size(device, len(queue), resident, transient, group) if trials else max(len(queue), 1)
    chunks = [queue[i : i + per_group] for i in range(0, len(queue), per_group)] or [[]]
    if trials and len(chunks) > 1:
        _log(f"{tag} timed in {len(chunks)} groups of up to {per_group} implementations beside the own norms "
             f"(a copy holds {resident / 2**30:.1f} GiB, a step needs {transient / 2**30:.1f} GiB more)")  # fmt: skip
    swap_reports = {}
    timed: dict[str, list[float]] = {}
    own_groups, failed, recompiled, group_of = [], {}, {}, {}
    for g, chunk in enumerate(chunks):
        runners = {"own": own_tr}
        for impl, r in chunk:
            t1 = time.perf_counter()
            breaks = _dynamo_count("graph_break")
            try:
                tr, report = trainer(impl)
                run = tr.run()
            except Exception as e:  # one failing implementation must not stop the others
                r.update(status="error", reason=describe_error(e))
                _log(f"{tag} {impl.name}: error ({r['reason']})")
                tr = None
                _release(device)
                continue
            d = rel_diffs(run, own)
            ok = verdict(d, tol)
            swap_reports[impl.name] = report
            r.update(status="pass" if ok else "fail", **run, rel_diff=d, swapped=report.counts(), unknown=report.unknown,
                     norms_run_as=IMPL_COMPILED if compile else IMPL_EAGER, seconds=round(time.perf_counter() - t1, 2))  # fmt: skip
            if compile:
                r["graph_breaks"] = _dynamo_count("graph_break") - breaks
            worst = _worst(d, tol)
            _log(f"{tag} {impl.name}: {r['status']} (worst {worst} {d[worst]:.2e} vs tolerance {tol[worst]:.2e}; {r['seconds']} s)")
            if ok and trials:
                runners[impl.name] = tr
            del tr
        if trials:
            label = f" group {g + 1}/{len(chunks)}" if len(chunks) > 1 else ""
            per, fail, rec = _time_group(runners, trials, steps_per_trial or steps, tag + label)
            own_groups.append(per["own"])
            for name, secs in per.items():
                if name != "own":
                    timed[name], group_of[name] = secs, g
                recompiled[name] = recompiled.get(name, 0) + rec[name]
            failed.update(fail)
        del runners
        _release(device)

    timing = None
    if trials:
        timing = _timing_report(own_groups, timed, group_of, failed, recompiled, s.batch * s.seq, trials,
                                steps_per_trial or steps, per_group if len(chunks) > 1 else None, resident, transient)  # fmt: skip
    first = next(iter(swap_reports.values()), None)
    return {
        "mode": "train",
        "arch": arch,
        "size": size,
        "size_config": asdict(s),
        "model_class": type(template).__name__,
        "attn_implementation": getattr(template.config, "_attn_implementation", None),
        "params": sum(p.numel() for p in template.parameters()),
        "tokens_per_step": s.batch * s.seq,
        "dtype": dtype,
        "device": device,
        "compile": compile,
        "steps": steps,
        "lr": LR,
        "seed": seed,
        "norms": norms,
        "own_norms_run_as": OWN_COMPILED if compile else OWN_EAGER,
        "not_fused": first.not_fused if first else [],
        "tolerance": {"safety": SAFETY, "floor_ulps": FLOOR_ULPS, "controls": controls, "tol": tol},
        "own": own,
        "own_uncompiled": own_plain if compile else None,
        "results": results,
        "timing": timing,
    }


def _time_group(runners: dict, trials: int, steps: int, tag: str):
    """Warm-up steps of every variant in ``runners`` (name -> Trainer), then ``trials`` trials of
    ``steps`` steps each in rotated order. Returns (seconds per step of each trial, failures, graphs
    compiled inside timed steps) per variant."""
    per = {n: [] for n in runners}
    failed: dict[str, str] = {}
    # graphs torch.compile built inside timed steps (the warm-up should absorb every compilation; a
    # count here means a timing includes compilation)
    recompiled = {n: 0 for n in runners}
    for name, tr in runners.items():
        try:
            tr.time_steps(WARMUP_STEPS)
        except Exception as e:  # recorded; the other variants go on
            failed[name] = describe_error(e)
    for t in range(trials):
        live = [n for n in runners if n not in failed]
        with _gc_paused():
            for name in rotated(live, t):
                graphs = _dynamo_count("unique_graphs")
                try:
                    per[name].append(runners[name].time_steps(steps))
                except Exception as e:
                    failed[name] = describe_error(e)
                    continue
                recompiled[name] += _dynamo_count("unique_graphs") - graphs
        _log(f"{tag} timing trial {t + 1}/{trials} done")
    return per, failed, recompiled


def _timing_report(
    own_groups, timed, group_of, failed, recompiled, tokens, trials, steps, per_group, resident, transient
) -> dict:
    """The timing section: per variant the median, trials, spread and noisy mark, and the speedup
    over the own norms of its group."""
    own_all = [x for g in own_groups for x in g]
    out = {}
    if own_all:
        extra = {"graphs_compiled_while_timed": recompiled.get("own", 0), "speedup_vs_own": 1.0}
        out["own"] = trial_summary(own_all, tokens) | extra
        if len(own_groups) > 1:
            out["own"]["groups"] = [trial_summary(g, tokens) for g in own_groups]
    for name, secs in timed.items():
        if name in failed or not secs:
            continue
        row = trial_summary(secs, tokens) | {"graphs_compiled_while_timed": recompiled.get(name, 0)}
        g = group_of[name]
        own_ms = trial_summary(own_groups[g], tokens)["step_ms"] if own_groups[g] else None
        row["speedup_vs_own"] = own_ms / row["step_ms"] if own_ms and row["step_ms"] else None
        if len(own_groups) > 1:
            row["group"] = g
        out[name] = row
    return {
        "method": "a deep copy of the initial model and an AdamW per variant; warm-up, then trials in rotated order",
        "trials": trials,
        "steps_per_trial": steps,
        "warmup_steps": WARMUP_STEPS,
        "noisy_above": NOISY_TRIAL_SPREAD,
        "groups": len(own_groups),
        "group_size": per_group,
        "copy_bytes": resident or None,
        "step_transient_bytes": transient or None,
        "variants": out,
        "failed": failed,
    }


# ---------------------------------------------------------------- reports
def report_name(rep: dict) -> str:
    tag = f"-{rep['tag']}" if rep.get("tag") else ""
    return f"{rep['arch']}-{rep['size']}-{'compiled' if rep['compile'] else 'eager'}{tag}.json"


def check_tag(tag: str | None) -> None:
    """--tag: a part of a file name (lower-case letters, digits, '-', '_')."""
    if tag is not None and not re.fullmatch(r"[a-z0-9][a-z0-9_-]{0,39}", tag):
        shown = "".join(c if c.isprintable() else "?" for c in tag[:40])
        raise ValueError(
            f"--tag must be 1-40 lower-case letters, digits, '-' or '_' (a part of the report's file name), got '{shown}'"
        )


def _fmt(x, spec=".2e"):
    return "–" if x is None else format(x, spec)


def markdown(reps: list[dict]) -> str:
    lines = ["# Models: a training step with each implementation's norms", ""]
    for rep in sorted(reps, key=lambda r: (r["size"], r["arch"], r["compile"], r.get("tag") or "")):
        mode = "torch.compile" if rep["compile"] else "eager"
        lines += [
            f"## {rep['arch']} ({rep['model_class']}), {rep['size']}, {rep['dtype']}, {mode}, {rep['device']}"
            + (f", {rep['tag']}" if rep.get("tag") else ""),
            "",
            f"{rep['params'] / 1e6:.1f} M parameters, {rep['tokens_per_step']} tokens per step, {rep['steps']} AdamW steps "
            f"(lr {rep['lr']}); norms: " + ", ".join(f"{n} x {c}" for c, n in _count(rep["norms"]).items()) + ".",
            "Agreement: relative difference from the model's own norms of the loss, the gradient norm (all parameters) "
            "and the norms' gradient norm, at step 1 and K, with its ratio to the tolerance; "
            f"tolerance {rep['tolerance']['safety']:g} x the largest difference of {_controls_text(rep)}: "
            + ", ".join(f"{k} {v:.1e}" for k, v in rep["tolerance"]["tol"].items()) + ".",
        ]
        if rep["compile"]:
            lines.append(f"Compiled: the model's own norms run as {rep.get('own_norms_run_as') or OWN_COMPILED}; "
                         f"every implementation's as a {IMPL_COMPILED}.")  # fmt: skip
        lines += _timing_lines(rep.get("timing"))
        lines += [
            "",
            "| implementation | agrees | worst difference (x tolerance) | step ms | trial spread | tokens/s | vs own |",
            "|---|---|---|---|---|---|---|",
        ]
        timing = (rep.get("timing") or {}).get("variants", {})
        t = timing.get("own")
        own_label = "model's own norms" + (" (Inductor's)" if rep["compile"] else "")
        tps = _fmt(t and t["tokens_per_s"], ",.0f")
        lines.append(f"| {own_label} | – | – | {_ms(t)} | {_spread(t)} | {tps} | 1.00x |")
        tol = rep["tolerance"]["tol"]
        for r in rep["results"]:
            if r["status"] in ("skip", "error"):
                lines.append(f"| {r['impl']} | {r['status']}: {r['reason']} | | | | | |")
                continue
            d, t = r["rel_diff"], timing.get(r["impl"])
            worst = _worst(d, tol)
            speed = _fmt(t and t["speedup_vs_own"], ".2f") + ("x" if t else "")
            name = r["impl"] + (f" ({r['graph_breaks']} graph breaks)" if r.get("graph_breaks") else "")
            lines.append(
                f"| {name} | {'yes' if r['status'] == 'pass' else '**no**'} | {worst} {_fmt(d[worst])} ({d[worst] / tol[worst]:.2f}x) | "
                f"{_ms(t)} | {_spread(t)} | {_fmt(t and t['tokens_per_s'], ',.0f')} | {speed} |"
            )
        if not timing:
            lines += ["", "Not timed (step times are measured on a GPU, or with --trials)."]
        for name, why in ((rep.get("timing") or {}).get("failed") or {}).items():
            lines += ["", f"Timing of {name} failed: {why}"]
        lines.append("")
    return "\n".join(lines)


def _timing_lines(timing) -> list[str]:
    if not timing:
        return []
    method = (
        "one deep copy of the initial model and one AdamW per variant" if timing.get("method") else "one model instance"
    )
    groups = ""
    if (timing.get("groups") or 1) > 1:
        groups = f", in {timing['groups']} groups (the own norms in each; speedups against its group's)"
    text = (
        f"Timing: {method}; {timing['warmup_steps']} warm-up steps, then {timing['trials']} trials of "
        f"{timing['steps_per_trial']} steps in rotated order{groups}; median step time, trial spread (max - min) / min, "
        f"noisy above {timing.get('noisy_above', 0.05):.0%}."
    )
    return [text]


def _controls_text(rep: dict) -> str:
    n = len(rep["tolerance"]["controls"])
    perturbed = min(n, len(CONTROL_SEEDS))
    text = f"{perturbed} control runs whose norm outputs were moved by up to the error `normbench check` allows"
    if rep.get("compile") and n > perturbed:  # reports from before the compiled model was a control
        text += " and of the compiled model with its own norms against the uncompiled one"
    return text


def _spread(t) -> str:
    return "–" if not t else f"{t['spread']:.1%}"


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


def write_reports(out: Path, rep: dict, command: str, name: str | None = None, rebuild=None) -> Path:
    """``rep`` as ``out/name`` (default: ``report_name``), with its command and environment, then
    the folder's Markdown rebuilt (``rebuild``, default: ``write_markdown``)."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / (name or report_name(rep))
    path.write_text(json.dumps({"command": command, "environment": environment(rep["device"]), **rep}, indent=1))
    (rebuild or write_markdown)(out)
    return path


def write_markdown(out: Path) -> Path:
    """models.md rebuilt from every report JSON in ``out``."""
    reps = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    trained = [r for r in reps if "arch" in r and "results" in r and r.get("mode", "train") == "train"]
    (out / "models.md").write_text(markdown(trained))
    return out / "models.md"


# ---------------------------------------------------------------- entry point (harness.cli calls it)
def check_selection(archs: list[str], size: str) -> None:
    """transformers importable, every architecture and the size known (a ValueError otherwise):
    what `normbench model` checks before it builds anything, in training and decode mode."""
    why = transformers_missing()
    if why:
        raise ValueError(why)
    bad = [a for a in archs if a not in ARCHS]
    if bad or not archs:
        raise ValueError(f"unknown --arch '{','.join(bad)}'; choose from {', '.join(ARCHS)}")
    if size not in SIZES:
        raise ValueError(f"unknown --size '{size}'; choose from {', '.join(SIZES)}")


def run(archs: list[str], size: str, impls: list[Implementation], *, device: str, steps: int, compile: bool,
        trials: int | None, out: Path | None, dtype: str = "bf16", seed: int = 0, command: str | None = None,
        gpu_id: str | None = None, steps_per_trial: int | None = None, group: int | None = None,
        tag: str | None = None) -> int:  # fmt: skip
    """`normbench model`: exit status 0 when every implementation that ran agrees, 1 otherwise.
    ``gpu_id`` (default: ``environment.gpu_id``) is recorded in every report JSON."""
    check_selection(archs, size)
    if dtype not in ("bf16", "fp32"):
        raise ValueError(f"--dtype must be bf16 or fp32 (fp16 training needs a loss scaler), got '{dtype}'")
    if steps < 1:
        raise ValueError(f"--steps must be >= 1, got {steps}")
    if trials is None:
        trials = TRIALS_CUDA if device == "cuda" else 0
    if trials < 0:
        raise ValueError(f"--trials must be >= 0, got {trials}")
    if steps_per_trial is not None and steps_per_trial < 1:
        raise ValueError(f"--steps-per-trial must be >= 1, got {steps_per_trial}")
    check_tag(tag)
    if group is not None and group < 2:
        raise ValueError(f"--group must be >= 2 (the model's own norms and at least one implementation), got {group}")
    if out is None:
        out = default_model_dir(device)
    _output_folder(Path(out))
    why = {i.name: i.unavailable(device) for i in impls}
    if impls and all(why.values()):  # known before any model is built
        _nothing_compared(device, why)
        return 1
    command = command or "normbench " + " ".join(shlex.quote(x) for x in sys.argv[1:])
    gpu_id = gpu_id if gpu_id is not None else environment_gpu_id(device)
    status = 0
    for arch in archs:
        rep = run_arch(arch, size, impls, device=device, dtype=dtype, steps=steps, compile=compile, trials=trials, seed=seed,
                       steps_per_trial=steps_per_trial, group=group)  # fmt: skip
        rep["gpu_id"] = gpu_id
        rep["tag"] = tag
        path = write_reports(out, rep, command)
        if any(r["status"] in ("fail", "error") for r in rep["results"]):
            status = 1
        _log(f"wrote {path} and {out / 'models.md'}")
        if all(r["status"] == "skip" for r in rep["results"]):  # as `check`: a run that compared nothing fails
            _nothing_compared(device, {r["impl"]: r["reason"] for r in rep["results"]}, arch)
            status = 1
    return status


def default_model_dir(device: str) -> Path:
    """``runs/<gpu>/<date>/models`` (``harness.run.bench.default_out_dir``)."""
    return default_out_dir(torch.cuda.get_device_name(0) if device == "cuda" else "cpu") / "models"


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
