"""Swap a model's norms for normbench's: ``swap_norms(model, impl="triton") -> SwapReport``.

    from harness.integrate.swap import swap_norms
    report = swap_norms(model, impl="triton")      # in place; the model trains and saves as before
    print(report.summary())

What is swapped, and by what:

* ``torch.nn.RMSNorm`` -> ``harness.integrate.autograd.RMSNorm``; ``torch.nn.LayerNorm`` (GPT-2, BERT and most
  encoder models use it directly) -> ``harness.integrate.autograd.LayerNorm``. Exact classes only: a subclass
  may have changed the math.
* The Hugging Face RMSNorm classes listed in ``HF_RMSNORMS``, each checked against its definition in
  transformers: Llama, Mistral, Qwen2 and Qwen3 (eps stored as ``variance_epsilon``; Qwen3's q_norm
  and k_norm normalize over head_dim) and Gemma, Gemma2 and Gemma3, which scale by ``(1 + w)`` in fp32
  and store ``eps``: their replacement gets ``weight_offset=1.0``, so the same parameter (zeros at
  init) means the same function.
* normbench norms already in the model get the new implementation: their ops are replaced in
  place (``set_impl``), so the module runs the new kernels, as a copy of it would. An ``AddRMSNorm``
  (whose forward takes a residual: nothing else can stand in for it) meeting an implementation
  without add_rmsnorm is a ValueError naming both, raised before anything is changed.

Design decisions:

* The replacement holds the *same* ``Parameter`` objects, so the state_dict keys and values, an
  optimizer built before the swap and tied or shared parameters all stay as they were; no weight is
  copied.
* A class is recognised by its name and then checked for the structure its forward relies on (one
  1-D weight, a float eps, nothing else): a renamed or extended class with the same name is listed
  as unknown rather than swapped for something that computes another function.
* Every module whose class name ends in "Norm" and that is not swapped is listed (returned and
  warned), with the reason: a norm left running the model's own code must never pass unnoticed.
* Rounding: Llama-style norms round ``xhat`` to the activation dtype and then multiply by the weight
  (two roundings); normbench's kernels round once. The outputs differ by at most one ulp per element,
  which is what `normbench model`'s tolerance is built from.

The residual add is not fused. In every supported decoder layer (``LlamaDecoderLayer`` and the
Mistral / Qwen2 / Qwen3 / Gemma3 ones) the add is an expression inside the layer's forward,
``hidden_states = residual + hidden_states``, followed by ``residual = hidden_states`` and the next
norm; no module sees both operands, so a module swap cannot fuse it. Fusing within a layer (the
attention output's add into ``post_attention_layernorm``) needs a replacement ``forward`` for the
decoder layer, which must repeat the attention call with exactly the keyword arguments of the
installed transformers version (they changed between 4.x and 5.x); fusing the MLP output's add into
the next layer's ``input_layernorm`` needs the layer to return two tensors, which changes the model's
layer loop. Both are left out; ``SwapReport.not_fused`` names the layers concerned.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch

from harness.integrate import autograd
from harness.registry import get
from harness.spec.contract import Implementation


@dataclass(frozen=True)
class NormClass:
    """How to read a norm class's eps and what scale it applies."""

    op: str  # rmsnorm | layernorm
    eps_attr: str
    weight_offset: float = 0.0


_LLAMA_STYLE = NormClass("rmsnorm", "variance_epsilon")
_GEMMA_STYLE = NormClass("rmsnorm", "eps", weight_offset=1.0)
# Hugging Face classes, by name (transformers 4.56 - 5.23): y = xhat * w (Llama style) or
# y = xhat * (1 + w) in fp32 (Gemma style)
HF_RMSNORMS: dict[str, NormClass] = {
    "LlamaRMSNorm": _LLAMA_STYLE,
    "MistralRMSNorm": _LLAMA_STYLE,
    "Qwen2RMSNorm": _LLAMA_STYLE,
    "Qwen3RMSNorm": _LLAMA_STYLE,
    "GemmaRMSNorm": _GEMMA_STYLE,
    "Gemma2RMSNorm": _GEMMA_STYLE,
    "Gemma3RMSNorm": _GEMMA_STYLE,
}
# decoder layers whose residual adds are inline in forward (see the module docstring)
INLINE_RESIDUAL_LAYERS = ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer",
                          "GemmaDecoderLayer", "Gemma2DecoderLayer", "Gemma3DecoderLayer")  # fmt: skip
NOT_FUSED_REASON = (
    "residual add is inline in the layer's forward (hidden_states = residual + hidden_states); "
    "fusing it needs a replacement layer forward: not done"
)


@dataclass
class SwapReport:
    impl: str
    swapped: list[dict] = field(default_factory=list)  # name, class, op, n, eps, weight_offset
    unknown: list[dict] = field(default_factory=list)  # name, class, reason
    not_fused: list[dict] = field(default_factory=list)  # name, class, reason

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in self.swapped:
            out[s["class"]] = out.get(s["class"], 0) + 1
        return out

    def ops(self) -> set[str]:
        return {s["op"] for s in self.swapped}

    def summary(self) -> str:
        parts = [f"{n} x {c}" for c, n in sorted(self.counts().items())]
        text = f"swapped to '{self.impl}': " + (", ".join(parts) or "nothing")
        if self.unknown:
            text += "; left as they were: " + ", ".join(f"{u['name']} ({u['class']}: {u['reason']})" for u in self.unknown)
        return text

    def as_dict(self) -> dict:
        return {"impl": self.impl, "swapped": self.swapped, "unknown": self.unknown, "not_fused": self.not_fused}


def _classify(mod: torch.nn.Module) -> tuple[NormClass | None, str]:
    """(how to read it, '') for a module swap_norms replaces; (None, why not) otherwise."""
    cls = type(mod)
    if isinstance(mod, autograd.AddRMSNorm):
        return NormClass("add_rmsnorm", "eps"), ""
    if isinstance(mod, (autograd.RMSNorm, autograd.LayerNorm)):
        return NormClass("rmsnorm" if isinstance(mod, autograd.RMSNorm) else "layernorm", "eps"), ""
    if cls in (torch.nn.RMSNorm, torch.nn.LayerNorm):
        if len(mod.normalized_shape) != 1:
            return None, f"normalizes over {len(mod.normalized_shape)} dimensions; normbench normalizes the last only"
        return NormClass("rmsnorm" if cls is torch.nn.RMSNorm else "layernorm", "eps"), ""
    spec = HF_RMSNORMS.get(cls.__name__)
    if spec is None:
        return None, "not a class normbench knows"
    params = dict(mod.named_parameters(recurse=False))
    weight = params.get("weight")
    eps = getattr(mod, spec.eps_attr, None)
    if set(params) != {"weight"} or weight.dim() != 1 or list(mod.buffers()) or list(mod.children()):
        return None, "not the structure of the transformers class of that name (one 1-D weight)"
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        return None, f"no float eps in '{spec.eps_attr}'"
    return spec, ""


def _replacement(mod: torch.nn.Module, spec: NormClass, impl: Implementation) -> torch.nn.Module:
    """A normbench module holding ``mod``'s own Parameter objects."""
    weight = getattr(mod, "weight", None)
    if spec.op == "layernorm":
        bias = getattr(mod, "bias", None)
        new = autograd.LayerNorm(
            mod.normalized_shape, mod.eps, weight is not None, bias is not None, device="meta", impl=impl
        )
        if bias is not None:
            new.bias = bias
    else:
        n = mod.normalized_shape if hasattr(mod, "normalized_shape") else weight.shape
        eps = getattr(mod, spec.eps_attr)
        new = autograd.RMSNorm(
            n, None if eps is None else float(eps), weight is not None, device="meta", impl=impl,
            weight_offset=getattr(mod, "weight_offset", spec.weight_offset),
        )  # fmt: skip
    if weight is not None:
        new.weight = weight
    new.train(mod.training)
    return new


def _entry(name: str, mod: torch.nn.Module) -> dict:
    return {"name": name, "class": type(mod).__name__}


def swap_norms(model: torch.nn.Module, impl: str | Implementation = "eager", *, warn: bool = True) -> SwapReport:
    """Replace, in place, every norm of ``model`` that normbench provides by its normbench
    equivalent running ``impl``'s kernels (see the module docstring). Returns what was swapped,
    what was not (also warned), and which residual adds stay unfused.

    A norm whose op ``impl`` does not provide (e.g. a LayerNorm-only implementation meeting an
    RMSNorm) is listed as not swapped, with that reason; an AddRMSNorm is a ValueError instead (see
    the module docstring)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(impl, str):
        impl = get(impl)
    if not isinstance(impl, Implementation):
        raise TypeError(f"impl must be an implementation name or record, got {type(impl).__name__}")
    report = SwapReport(impl.name)
    plan = []
    for name, mod in model.named_modules():
        cls_name = type(mod).__name__
        if cls_name in INLINE_RESIDUAL_LAYERS:
            report.not_fused.append({**_entry(name, mod), "reason": NOT_FUSED_REASON})
        spec, why = _classify(mod)
        if spec is not None and spec.op not in impl.ops:
            if spec.op == "add_rmsnorm":
                where = f"module '{name}'" if name else "the model"
                raise ValueError(
                    f"{where} is an AddRMSNorm, and implementation '{impl.name}' does not provide "
                    f"add_rmsnorm (it provides {', '.join(impl.ops)})"
                )
            spec, why = None, f"'{impl.name}' does not provide {spec.op}"
        if spec is not None:
            plan.append((name, mod, spec))
        elif cls_name.endswith("Norm"):
            report.unknown.append({**_entry(name, mod), "reason": why})
    for name, mod, spec in plan:
        if isinstance(mod, (autograd.RMSNorm, autograd.LayerNorm)):
            mod.set_impl(impl)
        else:
            _set_submodule(model, name, _replacement(mod, spec, impl))
        eps = getattr(mod, spec.eps_attr)
        report.swapped.append(
            {**_entry(name, mod), "op": spec.op, "n": int(mod.weight.shape[0]) if getattr(mod, "weight", None) is not None else None,
             "eps": eps, "weight_offset": getattr(mod, "weight_offset", spec.weight_offset)}
        )  # fmt: skip
    if warn and report.unknown:
        warnings.warn("swap_norms left these norms as they were: " + "; ".join(
            f"{u['name']} ({u['class']}): {u['reason']}" for u in report.unknown), stacklevel=2)  # fmt: skip
    return report


def _set_submodule(model: torch.nn.Module, name: str, new: torch.nn.Module) -> None:
    if not name:
        raise ValueError("the model itself is a norm: wrap it in a module to swap it")
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, new)
