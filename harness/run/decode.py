"""`normbench model --mode decode`: what the norms cost a generated token.

    normbench model --mode decode --arch llama,qwen3,gemma3,gpt2 --size 1b --impl eager,triton,cute --device cuda

Training hides a norm's host cost behind thousands of tokens per call; decoding does not: a step of
a 1 B model at batch 1 moves a few kilobytes through each of its 33 norm calls, and the host's time
per call is most of the step. For each architecture (the models of ``harness.run.models``, random
weights from a seed), Hugging Face ``generate`` decodes seeded random prompts greedily with a KV
cache, with the model's own norms and with each implementation's swapped in, each variant a deep
copy of the same initial model. Reported per batch size and path: the time per generated token,
tokens/s, the prefill, and the generated tokens against the own norms'.

Paths (``--paths``):

* ``eager``: ``generate`` as a user calls it, a dynamic cache, every op launched from Python.
* ``cuda-graphs``: a static cache (one per variant, reset before each call) and the decode steps
  compiled with ``torch.compile(mode="reduce-overhead", dynamic=False)`` through ``generate``'s
  ``compile_config``: Inductor's CUDA graphs replay a whole step, so host cost per op is gone; the
  prefill stays eager. With the model's own norms, the norms are Inductor's (fused with their
  neighbours); with an implementation's, a custom op inside the graph. Graph breaks and the graphs
  Inductor declined to capture (``cudagraph_skips``) are recorded per variant. A CUDA device only:
  on the CPU the path is reported as skipped, with that reason.

Timing: every variant first runs ``WARMUP_GENERATES`` untimed ``generate`` calls (compilation, graph
capture; the first one records the tokens and each step's top-two logits), then ``--trials`` trials
in an order rotated by one per trial, Python's garbage collector paused inside a trial. In a trial a
variant generates 1 token (the prefill and its first token: T1) and then N tokens (TN), each between
device synchronisations; the time per token is (TN - T1) / (N - 1), tokens/s is batch * (N - 1) /
(TN - T1), the prefill is T1. Per variant: the medians, the trials' spread of the time per token
(``models.spread``), noisy above ``models.NOISY_TRIAL_SPREAD``, and the speedup over the own norms.

Tokens: greedy decoding of the same prompts. A correct kernel rounds differently from the model's
own norm (``harness.integrate.swap``), the difference travels through the layers into the logits,
and where the top two logits of a step are closer than that, the argmax flips and the sequences part
for good. Reported per variant: how many rows are identical, the first step where any row parts
(``same_first``), and per parted row the step and the own norms' top-two margin there, in logits and
in ulps of the model's dtype at that logit: a margin of a few ulps is a near-tie that rounding broke,
a wide one a wrong kernel. The timed calls' tokens are checked against the first call's
(``repeatable``).

Reports: ``<arch>-<size>-decode-b<batch>-<path>.json`` and ``models-decode.md`` rebuilt from every
decode JSON of the folder (``--out``, default ``runs/<gpu>/<date>/models``, as training's).
"""

from __future__ import annotations

import json
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from harness.run import models
from harness.run.environment import gpu_id as environment_gpu_id
from harness.run.models import (
    IMPL_COMPILED,
    IMPL_EAGER,
    NOISY_TRIAL_SPREAD,
    OWN_EAGER,
    SIZES,
    _dynamo_count,
    _gc_paused,
    _log,
    _nothing_compared,
    _output_folder,
    _raise_recompile_limit,
    _release,
    _sync,
    build_model,
    check_selection,
    check_tag,
    default_model_dir,
    missing_ops,
    own_norms,
    rotated,
    spread,
    variant_model,
)
from harness.spec.contract import DTYPES, Implementation
from harness.spec.errors import describe_error
from harness.spec.tolerances import ulp

PATHS = ("eager", "cuda-graphs")
WARMUP_GENERATES = 2
TRIALS = {"cuda": 5, "cpu": 2}
OWN_GRAPHS = "Inductor: the model's own norm modules compiled into the CUDA-graphed decode step"
PATH_DETAIL = {
    "eager": "Hugging Face generate, dynamic KV cache, eager PyTorch",
    "cuda-graphs": "Hugging Face generate, static KV cache, decode steps under torch.compile(mode='reduce-overhead', "
    "dynamic=False) (CUDA graphs), prefill eager",
}
NO_GRAPHS_OFF_CUDA = "CUDA graphs need a CUDA device (--device cuda); this run is on the CPU"


@dataclass(frozen=True)
class DecodeShape:
    batches: tuple[int, ...]
    prompt: int
    new_tokens: int


# tiny: the CPU tests; the others: a short chat turn (512 tokens in, 128 out) alone and in a batch of 32
DECODE_SHAPES = {
    "tiny": DecodeShape(batches=(1, 2), prompt=16, new_tokens=8),
    "small": DecodeShape(batches=(1, 32), prompt=512, new_tokens=128),
    "1b": DecodeShape(batches=(1, 32), prompt=512, new_tokens=128),
}


# ---------------------------------------------------------------- one variant's generate
def _top2_recorder():
    """A logits processor that keeps, per step, each row's top logit and its margin over the second."""
    from transformers import LogitsProcessor

    class Top2(LogitsProcessor):
        def __init__(self):
            self.steps: list[torch.Tensor] = []

        def __call__(self, input_ids, scores):
            top = scores.topk(2, dim=-1).values
            self.steps.append(torch.stack([top[:, 0], top[:, 0] - top[:, 1]], dim=-1))
            return scores

        def result(self) -> torch.Tensor:
            """(steps, rows, 2) on the CPU: the top logit and the top-two margin."""
            return torch.stack(self.steps).float().cpu()

    return Top2()


class Decoder:
    """Greedy ``generate`` of ``new_tokens`` tokens after ``ids`` with one variant's model, on a path."""

    def __init__(self, model, ids: torch.Tensor, new_tokens: int, path: str, device: str):
        self.model, self.ids, self.n, self.device = model, ids, new_tokens, device
        self.mask = torch.ones_like(ids)
        self.kwargs: dict = {"disable_compile": True}
        self.cache = None
        if path == "cuda-graphs":
            from transformers import CompileConfig, StaticCache

            # one cache per variant and batch, reset before each call: its tensors keep their
            # addresses, so the captured graphs replay instead of being captured again
            self.cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + new_tokens)
            self.kwargs = {"compile_config": CompileConfig(mode="reduce-overhead", fullgraph=False, dynamic=False)}

    def generate(self, n: int, processor=None) -> torch.Tensor:
        """The ``n`` new tokens of every row, (batch, n)."""
        kwargs = dict(self.kwargs)
        if self.cache is not None:
            self.cache.reset()
            kwargs["past_key_values"] = self.cache
        if processor is not None:
            from transformers import LogitsProcessorList

            kwargs["logits_processor"] = LogitsProcessorList([processor])
        out = self.model.generate(self.ids, attention_mask=self.mask, max_new_tokens=n, min_new_tokens=n,
                                  do_sample=False, use_cache=True, **kwargs)  # fmt: skip
        return out[:, self.ids.shape[1] :]

    def timed(self, n: int) -> tuple[float, torch.Tensor]:
        _sync(self.device)
        t0 = time.perf_counter()
        tokens = self.generate(n)
        _sync(self.device)
        return time.perf_counter() - t0, tokens


# ---------------------------------------------------------------- tokens
def compare_tokens(own: torch.Tensor, other: torch.Tensor, own_top: torch.Tensor | None, dtype: torch.dtype) -> dict:
    """Where ``other``'s greedy tokens part from ``own``'s ((rows, steps) each). ``own_top``: the own
    run's (steps, rows, 2) top logit and top-two margin, which says how close the choice was there."""
    rows, steps = own.shape
    differs = (own.cpu() != other.cpu()).tolist()
    first = [row.index(True) if True in row else None for row in differs]
    splits = []
    for r, s in enumerate(first):
        if s is None:
            continue
        entry = {"row": r, "step": s, "own_token": int(own[r, s]), "token": int(other[r, s])}
        if own_top is not None:
            top, margin = own_top[s, r].tolist()
            entry["own_margin"] = margin
            entry["own_margin_ulps"] = margin / float(ulp(torch.tensor([top]), dtype)[0])
        splits.append(entry)
    return {
        "rows": rows,
        "new_tokens": steps,
        "identical_rows": first.count(None),
        "same_first": min((s for s in first if s is not None), default=steps),
        "first_split": first,
        "splits": splits,
    }


# ---------------------------------------------------------------- one report: an architecture, a batch, a path
@dataclass
class Variant:
    name: str
    impl: Implementation | None
    model: torch.nn.Module | None
    row: dict


def _cudagraph_skips() -> int:
    try:
        from torch._dynamo.utils import counters

        return counters["inductor"]["cudagraph_skips"]
    except Exception:  # counters moved: recorded as none
        return 0


def measure(variants: list[Variant], ids: torch.Tensor, new_tokens: int, path: str, trials: int, device: str,
            dtype: torch.dtype, tag: str) -> tuple[list[dict], dict, list]:  # fmt: skip
    """Warm-up, reference tokens and rotated trials of every live variant; (rows, failures, own tokens)."""
    rows = {v.name: dict(v.row) for v in variants}
    live = {v.name: Decoder(v.model, ids, new_tokens, path, device) for v in variants if v.row["status"] == "ok"}
    failed: dict[str, str] = {}
    tokens, tops = {}, {}
    for name, dec in live.items():
        t0 = time.perf_counter()
        breaks, skips = _dynamo_count("graph_break"), _cudagraph_skips()
        try:
            rec = _top2_recorder()
            tokens[name] = dec.generate(new_tokens, processor=rec).cpu()
            tops[name] = rec.result()
            for _ in range(WARMUP_GENERATES - 1):
                dec.generate(new_tokens)
            dec.generate(1)
        except Exception as e:  # one failing variant must not stop the others
            failed[name] = describe_error(e)
            _log(f"{tag} {name}: error ({failed[name]})")
            continue
        if path == "cuda-graphs":
            rows[name].update(
                graph_breaks=_dynamo_count("graph_break") - breaks, cudagraph_skips=_cudagraph_skips() - skips
            )
        _log(f"{tag} {name}: warmed up ({time.perf_counter() - t0:.1f} s)")
    per: dict[str, list[tuple[float, float]]] = {n: [] for n in live}
    repeatable = {n: True for n in live}
    compiled = {n: 0 for n in live}
    for t in range(trials):
        order = [n for n in live if n not in failed]
        with _gc_paused():
            for name in rotated(order, t):
                graphs = _dynamo_count("unique_graphs")
                try:
                    t1, _ = live[name].timed(1)
                    tn, toks = live[name].timed(new_tokens)
                except Exception as e:
                    failed[name] = describe_error(e)
                    continue
                per[name].append((t1, tn))
                repeatable[name] &= torch.equal(toks.cpu(), tokens[name])
                compiled[name] += _dynamo_count("unique_graphs") - graphs
        _log(f"{tag} timing trial {t + 1}/{trials} done")
    batch = ids.shape[0]
    for name in live:
        row = rows[name]
        if name in failed:
            row.update(status="error", reason=failed[name])
            continue
        row.update(
            _timing(per[name], batch, new_tokens),
            repeatable=repeatable[name],
            graphs_compiled_while_timed=compiled[name],
        )
        if name != "own" and "own" in tokens and name in tokens:
            row["tokens"] = compare_tokens(tokens["own"], tokens[name], tops.get("own"), dtype)
    own_ms = rows.get("own", {}).get("per_token_ms")
    for row in rows.values():
        if row.get("per_token_ms"):
            row["speedup_vs_own"] = own_ms / row["per_token_ms"] if own_ms else None
    own_tokens = tokens["own"].tolist() if "own" in tokens else None
    return list(rows.values()), failed, own_tokens


def _timing(trials: list[tuple[float, float]], batch: int, new_tokens: int) -> dict:
    """Per trial (t1, tn): the seconds of a 1-token and of an N-token generate. A token after the
    first costs (tn - t1) / (N - 1); a trial whose N-token generate was not the slower says only that
    the run's noise exceeded the decoding (a loaded CPU): it gives no per-token time (``dropped``),
    never a time of 0."""
    per_token = [(tn - t1) / (new_tokens - 1) * 1e3 for t1, tn in trials if tn > t1]
    prefill = [t1 * 1e3 for t1, _ in trials]
    whole = [tn * 1e3 for _, tn in trials]
    dropped = len(trials) - len(per_token)
    if not per_token:
        return {"per_token_ms": None, "dropped_trials": dropped, "noisy": bool(trials)}
    ms = statistics.median(per_token)
    s = spread(per_token)
    return {
        "per_token_ms": ms,
        "trial_per_token_ms": per_token,
        "dropped_trials": dropped,
        "spread": s,
        "noisy": s > NOISY_TRIAL_SPREAD or dropped > 0,
        "tokens_per_s": batch / (ms / 1e3) if ms else None,
        "prefill_ms": statistics.median(prefill),
        "trial_prefill_ms": prefill,
        "generate_ms": statistics.median(whole),
        "end_to_end_tokens_per_s": batch * new_tokens / (statistics.median(whole) / 1e3),
    }


def decode_arch(arch: str, size: str, impls: list[Implementation], *, device: str, dtype: str, batches: list[int],
                prompt: int, new_tokens: int, paths: list[str], trials: int, seed: int, write) -> list[dict]:  # fmt: skip
    """Every report of ``arch``: one per batch size and path, each handed to ``write`` when done."""
    tdtype = DTYPES[dtype]
    template = build_model(arch, size, device, tdtype, seed, positions=prompt + new_tokens).eval()
    template.config.use_cache = True
    gen_config = template.generation_config
    # every row decodes exactly N tokens: no end-of-sequence stop (a random model may draw it)
    gen_config.eos_token_id, gen_config.pad_token_id, gen_config.cache_implementation = None, 0, None
    norms = own_norms(template)
    s = SIZES[size]
    base = {"arch": arch, "size": size, "size_config": asdict(s), "model_class": type(template).__name__,
            "attn_implementation": getattr(template.config, "_attn_implementation", None),
            "params": sum(p.numel() for p in template.parameters()), "dtype": dtype, "device": device,
            "prompt": prompt, "new_tokens": new_tokens, "seed": seed, "trials": trials,
            "warmup_generates": WARMUP_GENERATES, "noisy_above": NOISY_TRIAL_SPREAD, "norms": norms}  # fmt: skip
    variants = [
        Variant("own", None, variant_model(template)[0], {"impl": "own", "dsl": None, "status": "ok", "reason": ""})
    ]
    for impl in impls:
        row = {"impl": impl.name, "dsl": impl.dsl, "external": impl.external, "status": "skip", "reason": ""}
        why = impl.unavailable(device) or (
            f"does not provide {', '.join(m)}" if (m := missing_ops(template, impl)) else None
        )
        model = None
        if why:
            row["reason"] = why
            _log(f"[{arch} {size} decode] {impl.name}: skipped ({why})")
        else:
            try:
                model, report = variant_model(template, impl)
                row.update(status="ok", swapped=report.counts(), unknown=report.unknown)
            except Exception as e:
                row.update(status="error", reason=describe_error(e))
                _log(f"[{arch} {size} decode] {impl.name}: error ({row['reason']})")
        variants.append(Variant(impl.name, impl, model, row))
    del template
    if "cuda-graphs" in paths and device == "cuda":
        _raise_recompile_limit(8 * (len(variants) + 2) * len(batches))
    reports = []
    for batch in batches:
        gen = torch.Generator().manual_seed(seed + 2 + batch)
        ids = torch.randint(0, s.vocab, (batch, prompt), generator=gen).to(device)
        for path in paths:
            tag = f"[{arch} {size} decode b{batch} {path}]"
            rep = dict(base, mode="decode", batch=batch, path=path, path_detail=PATH_DETAIL[path], skipped=None)
            graphs = path == "cuda-graphs"
            for v in variants:
                v.row["norms_run_as"] = (
                    (OWN_GRAPHS if graphs else OWN_EAGER)
                    if v.impl is None
                    else (IMPL_COMPILED if graphs else IMPL_EAGER)
                )
            if graphs and device != "cuda":
                rep.update(skipped=NO_GRAPHS_OFF_CUDA, variants=[], failed={}, own_tokens=None)
                _log(f"{tag} skipped: {NO_GRAPHS_OFF_CUDA}")
            else:
                rows, failed, own_tokens = measure(variants, ids, new_tokens, path, trials, device, tdtype, tag)
                rep.update(variants=rows, failed=failed, own_tokens=own_tokens)
                for row in rows:
                    if row.get("per_token_ms"):
                        tok = row.get("tokens")
                        same = f", same tokens for the first {tok['same_first']} of {tok['new_tokens']}" if tok else ""
                        _log(f"{tag} {row['impl']}: {row['per_token_ms']:.3f} ms/token (spread {row['spread']:.1%}), "
                             f"{row['tokens_per_s']:,.0f} tokens/s{same}")  # fmt: skip
            write(rep)
            reports.append(rep)
            _release(device)
    return reports


# ---------------------------------------------------------------- reports
def report_name(rep: dict) -> str:
    tag = f"-{rep['tag']}" if rep.get("tag") else ""
    return f"{rep['arch']}-{rep['size']}-decode-b{rep['batch']}-{rep['path']}{tag}.json"


def _num(x, spec: str) -> str:
    return "–" if x is None else format(x, spec)


def _parts(tok: dict | None) -> str:
    if not tok:
        return "–"
    if tok["identical_rows"] == tok["rows"]:
        return "never"
    first = min(tok["splits"], key=lambda e: e["step"])
    where = f"token {first['step'] + 1} (row {first['row']}"
    if "own_margin" in first:
        where += f"; own top-2 margin {first['own_margin']:.3g} = {first['own_margin_ulps']:.1f} ulp"
    return where + ")"


def markdown(reps: list[dict]) -> str:
    lines = ["# Models: decoding with each implementation's norms", ""]
    for rep in sorted(
        reps, key=lambda r: (r["size"], r["arch"], r["batch"], PATHS.index(r["path"]), r.get("tag") or "")
    ):
        head = (
            f"## {rep['arch']} ({rep['model_class']}), {rep['size']}, {rep['dtype']}, batch {rep['batch']}, "
            f"{rep['prompt']} + {rep['new_tokens']} tokens, {rep['path']}, {rep['device']}"
            + (f", {rep['tag']}" if rep.get("tag") else "")
        )
        lines += [head, ""]
        if rep.get("skipped"):
            lines += [f"Skipped: {rep['skipped']}.", ""]
            continue
        method = (
            f"{rep['params'] / 1e6:.1f} M parameters; {rep['path_detail']}. Greedy; {rep['warmup_generates']} warm-up "
            f"calls, then {rep['trials']} trials in rotated order; ms per token = (T(N) - T(1)) / (N - 1), median of "
            f"the trials, spread (max - min) / min, noisy above {rep['noisy_above']:.0%}. Same tokens: rows identical "
            "to the own norms' over all new tokens; parts at: the first new token that differs in any row."
        )
        lines += [
            method,
            "",
            "| norms | runs as | ms per token | trial spread | tokens/s | vs own | prefill ms | same tokens | parts at |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for row in rep["variants"]:
            name = "model's own norms" if row["impl"] == "own" else row["impl"]
            if row["status"] != "ok":
                lines.append(f"| {name} | {row['status']}: {row['reason']} | | | | | | | |")
                continue
            flags = [f for f, on in (("noisy", row.get("noisy")), (f"{row.get('dropped_trials')} trial{'' if row.get('dropped_trials') == 1 else 's'} dropped", row.get("dropped_trials")),
                                     ("recompiled", row.get("graphs_compiled_while_timed")),
                                     ("not repeatable", row.get("repeatable") is False),
                                     (f"{row.get('cudagraph_skips')} cudagraph skips", row.get("cudagraph_skips")),
                                     (f"{row.get('graph_breaks')} graph breaks", row.get("graph_breaks"))) if on]  # fmt: skip
            tok = row.get("tokens")
            same = f"{tok['identical_rows']}/{tok['rows']}" if tok else "–"
            speed = _num(row.get("speedup_vs_own"), ".2f") + ("x" if row.get("speedup_vs_own") else "")
            ms = _num(row.get("per_token_ms"), ".3f") + (f" ({', '.join(flags)})" if flags else "")
            runs_as = (
                "Inductor"
                if row["norms_run_as"] == OWN_GRAPHS
                else ("custom op" if row["norms_run_as"] == IMPL_COMPILED else "eager")
            )
            lines.append(
                f"| {name} | {runs_as} | {ms} | {_num(row.get('spread'), '.1%')} | {_num(row.get('tokens_per_s'), ',.0f')} | "
                f"{speed} | {_num(row.get('prefill_ms'), '.1f')} | {same} | {_parts(tok)} |"
            )
        lines.append("")
    return "\n".join(lines)


def write_reports(out: Path, rep: dict, command: str) -> Path:
    return models.write_reports(out, rep, command, report_name(rep), write_markdown)


def write_markdown(out: Path) -> Path:
    """models-decode.md rebuilt from every decode report JSON in ``out`` (also after the reports of
    several runs were gathered into one folder)."""
    reps = [json.loads(p.read_text()) for p in sorted(Path(out).glob("*-decode-*.json"))]
    path = Path(out) / "models-decode.md"
    path.write_text(markdown([r for r in reps if r.get("mode") == "decode"]))
    return path


# ---------------------------------------------------------------- entry point (harness.cli calls it)
def run(archs: list[str], size: str, impls: list[Implementation], *, device: str, dtype: str = "bf16",
        batches: list[int] | None = None, prompt: int | None = None, new_tokens: int | None = None,
        paths: list[str] | None = None, trials: int | None = None, out: Path | None = None, seed: int = 0,
        command: str | None = None, gpu_id: str | None = None, tag: str | None = None) -> int:  # fmt: skip
    """`normbench model --mode decode`: exit status 0 when every variant that ran decoded, 1 when one
    raised or nothing was compared."""
    check_selection(archs, size)
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got '{dtype}'")
    shape = DECODE_SHAPES[size]
    batches = list(shape.batches if batches is None else batches)
    prompt = shape.prompt if prompt is None else prompt
    new_tokens = shape.new_tokens if new_tokens is None else new_tokens
    paths = list(PATHS if paths is None else paths)
    if not batches or any(b < 1 for b in batches):
        raise ValueError(f"--batch must be sizes >= 1, got {','.join(map(str, batches)) or 'none'}")
    if prompt < 1:
        raise ValueError(f"--prompt must be >= 1 token, got {prompt}")
    if new_tokens < 2:
        raise ValueError(f"--new-tokens must be >= 2 (the time per token is (T(N) - T(1)) / (N - 1)), got {new_tokens}")
    if not paths or any(p not in PATHS for p in paths):
        raise ValueError(f"unknown --paths '{','.join(paths)}'; choose from {', '.join(PATHS)}")
    if paths == ["cuda-graphs"] and device != "cuda":
        raise ValueError(f"--paths cuda-graphs alone measures nothing here: {NO_GRAPHS_OFF_CUDA}")
    check_tag(tag)
    trials = TRIALS["cuda" if device == "cuda" else "cpu"] if trials is None else trials
    if trials < 1:
        raise ValueError(f"--trials must be >= 1 in decode mode, got {trials}")
    out = Path(out) if out is not None else default_model_dir(device)
    _output_folder(out)
    why = {i.name: i.unavailable(device) for i in impls}
    if impls and all(why.values()):  # known before any model is built
        _nothing_compared(device, why)
        return 1
    command = command or "normbench " + " ".join(shlex.quote(x) for x in sys.argv[1:])
    gpu_id = gpu_id if gpu_id is not None else environment_gpu_id(device)
    status = 0

    def write(rep: dict) -> None:
        rep["gpu_id"], rep["tag"] = gpu_id, tag
        path = write_reports(out, rep, command)
        _log(f"wrote {path} and {out / 'models-decode.md'}")

    for arch in archs:
        reps = decode_arch(arch, size, impls, device=device, dtype=dtype, batches=batches, prompt=prompt,
                           new_tokens=new_tokens, paths=paths, trials=trials, seed=seed, write=write)  # fmt: skip
        rows = [r for rep in reps for r in rep["variants"] if r["impl"] != "own"]
        if any(r["status"] == "error" for rep in reps for r in rep["variants"]):
            status = 1
        if impls and rows and all(r["status"] == "skip" for r in rows):
            _nothing_compared(device, {r["impl"]: r["reason"] for r in rows}, arch)
            status = 1
    return status
