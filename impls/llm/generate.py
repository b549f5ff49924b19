"""`normbench generate`: LLM-generated kernels from a committed prompt, stored with their provenance.

    normbench generate --prompt prompts/triton-rmsnorm.v1.md --endpoint http://localhost:8000 \\
        --model facebook/KernelLLM [--samples K] [--temperature T] [--max-tokens N] [--timeout S]

sends the prompt file, verbatim, as the single user message of a chat completion to an
OpenAI-compatible server (vLLM, SGLang, ...). The URL posted to is ``--endpoint`` itself when it
already ends in ``/chat/completions``, ``{endpoint}/chat/completions`` when it ends in ``/v1``, and
``{endpoint}/v1/chat/completions`` otherwise. If ``$OPENAI_API_KEY`` (or the variable named by
``--api-key-env``) is set it is sent as a bearer token; it is never stored. Only the standard library
talks to the server, so this needs no new dependency.

Each answer's ```python code block becomes a sample folder ``impls/llm/<dsl>-<op>-<model>-<date>-<k>/``
(format: ``impls.llm.samples``), written into a hidden temporary folder and renamed into place only
when complete, so a failure never leaves a half-written sample. The sample is then checked in a
fresh Python process (a generated kernel may crash or hang; a new process also sidesteps the
registry's cached discovery and each DSL's import-time interpreter switch): fwd and bwd on the
smoke shapes in bf16, on the GPU if there is one, else on the CPU through the DSL's interpreter.
A CuTe DSL or Gluon sample has no CPU path: without a GPU it is stored and reported as not checked.

Other modes, for kernels produced outside this command and for human fixes:

    normbench generate --store-completion ANSWER.md --prompt PROMPT --model NAME [--date YYYY-MM-DD]
    normbench generate --add-fix SAMPLE_DIR --fixed FIXED.py --reason "one line"
    normbench generate --check SAMPLE_DIR

and from Python: ``store_sample``, ``add_fix``, ``check_sample``.

Exit status: 0 when every checked sample passes (or cannot be checked on this machine), 1 when one
fails or errors (including code that does not import), 2 for bad input and for endpoint errors
(unreachable, non-200, timeout, an answer without a code block), with one line on stderr.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from impls.llm.patches import make_patch, split_lines
from impls.llm.samples import (
    FORMAT,
    REPO_ROOT,
    SAMPLES_ROOT,
    parse_prompt_name,
    read_sample,
    repo_relative,
    sha256_file,
    sha256_text,
)

DEFAULT_CHECK_SHAPES = "smoke"
DEFAULT_CHECK_DTYPES = "bf16"


# ==================================================================================== the endpoint
@dataclass
class Completion:
    text: str
    finish_reason: str | None = None
    usage: dict = field(default_factory=dict)
    model: str | None = None  # the model name the server reports (may differ from the one asked for)


def chat_completions_url(endpoint: str) -> str:
    """The URL to POST to: see the module docstring."""
    url = endpoint.rstrip("/")
    if not re.match(r"^https?://", url):
        raise ValueError(f"--endpoint must be an http(s) URL, got '{endpoint}'")
    if url.endswith("/chat/completions"):
        return url
    if url.endswith("/v1"):
        return url + "/chat/completions"
    return url + "/v1/chat/completions"


def request_completion(
    endpoint: str,
    model: str,
    prompt_text: str,
    sampling: dict,
    timeout: float,
    api_key: str | None = None,
) -> Completion:
    """One chat completion; ValueError with a one-line reason for every way it can fail."""
    url = chat_completions_url(endpoint)
    body = {"model": model, "messages": [{"role": "user", "content": prompt_text}], "n": 1, "stream": False, **sampling}
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    try:
        # timeout bounds the connection and each read; a chat server answers nothing until it is done
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            payload = resp.read()
    except urllib.error.HTTPError as e:
        detail = _first_line(e.read().decode(errors="replace")) if e.fp else ""
        raise ValueError(f"{url} answered HTTP {e.code} {e.reason}" + (f": {detail}" if detail else "")) from None
    except TimeoutError:  # socket.timeout is TimeoutError since Python 3.10
        raise ValueError(f"{url} did not answer within {timeout:g} s (raise --timeout)") from None
    except urllib.error.URLError as e:
        if isinstance(e.reason, TimeoutError):
            raise ValueError(f"{url} did not answer within {timeout:g} s (raise --timeout)") from None
        raise ValueError(f"cannot reach {url}: {e.reason}") from None
    except (ConnectionError, OSError) as e:  # e.g. the server closed the connection mid-answer
        raise ValueError(f"lost the connection to {url}: {e}") from None
    try:
        data = json.loads(payload)
        choice = data["choices"][0]
        text = choice["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise ValueError(
            f"{url} answered 200 but not with a chat completion: {_first_line(payload.decode(errors='replace'))}"
        ) from None
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{url} answered an empty completion (finish_reason={choice.get('finish_reason')})")
    return Completion(text, choice.get("finish_reason"), data.get("usage") or {}, data.get("model"))


def _first_line(text: str, limit: int = 200) -> str:
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    return line[:limit] + ("..." if len(line) > limit else "")


# ==================================================================================== the code block
_FENCE = re.compile(r"^[ \t]*(`{3,}|~{3,})[ \t]*([\w+.-]*)[^\n]*$", re.M)
_PYTHON_TAGS = ("python", "py", "python3")


def extract_code_block(text: str) -> tuple[str, int]:
    """The first ```python block of ``text`` (its lines verbatim, without the fences) and how many
    python blocks there were. Reasoning that some servers return inline (<think>...</think>) is
    skipped first. ValueError if there is none, or it is never closed (a truncated answer)."""
    text = re.sub(r"<think>.*?</think>", "", text, flags=re.S)
    blocks = []
    pos = 0
    while True:
        opening = _FENCE.search(text, pos)
        if not opening:
            break
        fence, tag = opening[1], opening[2].lower()
        # the closing fence: the same character, at least as long, alone on its line
        closing = re.compile(r"^[ \t]*" + re.escape(fence[0]) + "{" + str(len(fence)) + r",}[ \t]*$", re.M)
        end = closing.search(text, opening.end())
        if end is None:
            if tag in _PYTHON_TAGS and not blocks:
                raise ValueError("the answer's ```python block is never closed: it was cut off (raise --max-tokens)")
            break
        if tag in _PYTHON_TAGS:
            blocks.append(text[opening.end() + 1 : end.start()])
        pos = end.end()
    if not blocks:
        start = _first_line(text, 80)
        raise ValueError(f"the answer has no ```python code block ({len(text)} characters, starting '{start}')")
    if not blocks[0].strip():
        raise ValueError("the answer's first ```python code block is empty")
    return blocks[0], len(blocks)


# ==================================================================================== storing
def model_slug(model: str) -> str:
    """'Qwen/Qwen2.5-Coder-32B-Instruct' -> 'qwen2-5-coder-32b-instruct' (the part after the last '/')."""
    slug = re.sub(r"[^a-z0-9]+", "-", model.rsplit("/", 1)[-1].lower()).strip("-")[:48].strip("-")
    if not slug:
        raise ValueError(f"model name '{model}' has no letters or digits to name a sample folder by")
    return slug


def _date(date: str | None) -> str:
    if date is None:
        return _dt.date.today().isoformat()
    try:
        return _dt.date.fromisoformat(date).isoformat()
    except ValueError:
        raise ValueError(f"--date must be YYYY-MM-DD, got '{date}'") from None


def _next_sample_dir(out_root: Path, prefix: str) -> Path:
    taken = [
        int(m[1]) for p in out_root.glob(f"{prefix}-*") if (m := re.fullmatch(re.escape(prefix) + r"-(\d+)", p.name))
    ]
    return out_root / f"{prefix}-{max(taken, default=0) + 1}"


def store_sample(
    prompt_path: str | Path,
    completion_text: str,
    model: str,
    sampling: dict | None = None,
    out_root: str | Path | None = None,
    date: str | None = None,
    attempts: int = 1,
    endpoint: str | None = None,
    tool: str = "store_sample",
    finish_reason: str | None = None,
    usage: dict | None = None,
) -> Path:
    """Store one model answer as a new sample folder and return its path.

    ``completion_text`` is the whole answer (its first ```python block becomes raw.py, verbatim; the
    answer itself is kept as completion.md). ``sampling`` records the generation settings as given
    (e.g. {"temperature": 0.0, "max_tokens": 16384}; {} when unknown). ``attempts`` is how many
    answers were asked for to get this one (1: the first answer was kept). ``date``: YYYY-MM-DD
    (default today). The folder is ``<out_root>/<dsl>-<op>-<model slug>-<YYYYMMDD>-<k>`` with the next
    free k; it appears complete or not at all. ValueError for an answer without a code block.
    """
    prompt_path = Path(prompt_path)
    if not prompt_path.is_file():
        raise ValueError(f"prompt file '{prompt_path}' does not exist")
    dsl, op = parse_prompt_name(prompt_path)
    if not isinstance(attempts, int) or attempts < 1:
        raise ValueError(f"attempts must be a positive integer, got {attempts!r}")
    code, n_blocks = extract_code_block(completion_text)
    date = _date(date)
    out_root = Path(out_root) if out_root is not None else SAMPLES_ROOT
    out_root.mkdir(parents=True, exist_ok=True)
    prefix = f"{dsl}-{op}-{model_slug(model)}-{date.replace('-', '')}"
    metadata = {
        "format": FORMAT,
        "dsl": dsl,
        "op": op,
        "prompt": repo_relative(prompt_path),
        "prompt_sha256": sha256_file(prompt_path),
        "generator": {"model": model, **({"endpoint": endpoint} if endpoint else {}), "tool": tool},
        "sampling": dict(sampling or {}),
        "date": date,
        "attempts": attempts,
        "raw_sha256": sha256_text(code),
        "completion": {
            "file": "completion.md",
            "sha256": sha256_text(completion_text),
            "python_blocks": n_blocks,  # raw.py is the first one
            **({"finish_reason": finish_reason} if finish_reason else {}),
            **({"usage": usage} if usage else {}),
        },
        "fixes": [],
    }
    # Write everything into a hidden folder beside the target (same file system, so the final
    # rename is atomic, and the loader skips hidden folders), then rename it into place.
    tmp = Path(tempfile.mkdtemp(prefix=f".{prefix}-", dir=out_root))
    try:
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it private; a sample is an ordinary folder
        (tmp / "raw.py").write_text(code)
        (tmp / "completion.md").write_text(completion_text)
        (tmp / "metadata.json").write_text(json.dumps(metadata, indent=2) + "\n")
        for _ in range(100):  # another writer may take the same k between the look and the rename
            final = _next_sample_dir(out_root, prefix)
            if final.exists():
                continue
            try:
                os.rename(tmp, final)  # fails if final appeared meanwhile and is not empty
                return final
            except OSError:
                if not final.exists():
                    raise
        raise ValueError(f"could not find a free sample folder name for {prefix} in {out_root}")
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _write_atomically(path: Path, text: str):
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def add_fix(sample_dir: str | Path, fixed_source_text: str, reason: str, slug: str | None = None) -> Path:
    """Record a human fix of a sample: the unified diff from its current after-fix source (raw.py
    with every earlier fix applied) to ``fixed_source_text`` becomes ``patches/NN-<slug>.patch``,
    listed with its one-line ``reason`` in metadata.json. Returns the patch's path. raw.py is never
    touched. ValueError if the reason is not one line, or the text equals the current version."""
    sample = read_sample(sample_dir)
    reason = (reason or "").strip()
    if not reason or "\n" in reason:
        raise ValueError("a fix needs a one-line reason (e.g. 'grid: launched N programs instead of M')")
    current = sample.source("after-fix")
    if fixed_source_text == current:
        raise ValueError(f"{sample.sample_id}: the fixed source is identical to the current version: nothing to record")
    number = len(sample.fixes) + 1
    slug = re.sub(r"[^a-z0-9]+", "-", (slug or reason).lower()).strip("-")[:40].strip("-") or "fix"
    rel = f"patches/{number:02d}-{slug}.patch"
    patch = make_patch(current, fixed_source_text, "raw.py", header=reason)
    patch_path = sample.folder / rel
    patch_path.parent.mkdir(exist_ok=True)
    if patch_path.exists():
        raise ValueError(f"{patch_path} already exists")
    metadata = dict(sample.metadata, fixes=sample.fixes + [{"patch": rel, "reason": reason}])
    _write_atomically(patch_path, patch)
    try:
        _write_atomically(sample.folder / "metadata.json", json.dumps(metadata, indent=2) + "\n")
        # The stored patch must reproduce exactly the text it was made from.
        if read_sample(sample.folder).source("after-fix") != fixed_source_text:
            raise RuntimeError("the recorded patch does not reproduce the fixed source")
    except BaseException:
        _write_atomically(sample.folder / "metadata.json", json.dumps(sample.metadata, indent=2) + "\n")
        patch_path.unlink(missing_ok=True)
        raise
    return patch_path


# ==================================================================================== checking
@dataclass
class Verdict:
    name: str  # the record's name
    variant: str
    status: str  # pass | fail | error | skip
    message: str
    counts: dict = field(default_factory=dict)  # pass / fail / error / total

    def line(self) -> str:
        word = {"pass": "PASS", "fail": "FAIL", "error": "ERROR", "skip": "NOT CHECKED"}[self.status]
        return f"{self.name} ({self.variant}): {word}: {self.message}"


def check_sample(
    sample_dir: str | Path,
    device: str | None = None,
    shapes: str = DEFAULT_CHECK_SHAPES,
    dtypes: str = DEFAULT_CHECK_DTYPES,
    timeout: float = 900,
) -> list[Verdict]:
    """Check every variant of a sample (fwd and bwd) in a fresh Python process; one Verdict each."""
    sample = read_sample(sample_dir)
    args = ["--check-worker", str(sample.folder), "--shapes", shapes, "--dtypes", dtypes]
    if device:
        args += ["--device", device]
    with tempfile.TemporaryDirectory(prefix="normbench-check-") as tmp:
        out = Path(tmp) / "verdicts.json"
        env = dict(os.environ)
        root = str(REPO_ROOT)
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        cmd = [sys.executable, "-m", "impls.llm.generate", *args, "--json-out", str(out)]
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return [Verdict(sample.sample_id, "all", "error", f"the check did not finish within {timeout:g} s")]
        if not out.is_file():
            why = f"killed by signal {-proc.returncode}" if proc.returncode < 0 else f"exit status {proc.returncode}"
            tail = _first_line("\n".join(reversed(proc.stderr.strip().splitlines())))
            return [Verdict(sample.sample_id, "all", "error", f"the check process died ({why}): {tail}")]
        return [Verdict(**v) for v in json.loads(out.read_text())]


def check_points(shapes: str, dtypes: str) -> tuple[list, list[str]]:
    """The shapes and dtypes a check covers; ValueError for an unknown set, shape or dtype."""
    from harness.spec.contract import DTYPES
    from harness.spec.shapes import SHAPE_SETS, parse_shape

    shape_list = []
    for name in (s.strip() for s in shapes.split(",") if s.strip()):
        shape_list += SHAPE_SETS[name] if name in SHAPE_SETS else [parse_shape(name)]
    dtype_list = [d.strip() for d in dtypes.split(",") if d.strip()]
    bad = [d for d in dtype_list if d not in DTYPES]
    if bad or not dtype_list:
        raise ValueError(f"unknown dtype '{','.join(bad) or dtypes}'; choose from {', '.join(DTYPES)}")
    if not shape_list:
        raise ValueError(f"no shapes to check in '{shapes}'")
    return shape_list, dtype_list


def _check_worker(sample_dir: str, device: str | None, shapes: str, dtypes: str) -> list[Verdict]:
    """In the fresh process: check each variant's records through harness.run.checker.run_check."""
    import torch

    from harness.run.checker import run_check
    from harness.spec.contract import DIRECTIONS
    from impls.llm import records_for

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    shape_list, dtype_list = check_points(shapes, dtypes)
    verdicts = []
    for impl in records_for(sample_dir):
        variant = impl.meta["variant"]
        why = impl.unavailable(device)
        if why:
            verdicts.append(Verdict(impl.name, variant, "skip", f"cannot be checked here (on {device}): {why}"))
            continue
        try:  # a module that does not import is the first thing to report, once
            impl.kernels(device)
        except Exception as e:
            verdicts.append(Verdict(impl.name, variant, "error", f"{type(e).__name__}: {_first_line(str(e), 300)}"))
            continue
        results = [
            run_check(impl, op, direction, shape, dtype, device)
            for op in impl.ops
            for direction in DIRECTIONS
            for dtype in dtype_list
            for shape in shape_list
        ]
        counts = {s: sum(r.status == s for r in results) for s in ("pass", "fail", "error", "skip")}
        counts["total"] = len(results)
        scope = f"{'+'.join(impl.ops)} fwd+bwd, {','.join(dtype_list)}, {shapes} on {device}"
        bad = [r for r in results if r.status in ("fail", "error")]
        if not bad:
            status, message = "pass", f"{counts['pass']}/{len(results)} passed ({scope})"
        else:
            first = bad[0]
            status = "error" if counts["error"] and not counts["fail"] else "fail"
            message = (
                f"{counts['pass']}/{len(results)} passed ({scope}); first: {first.direction} {first.dtype} "
                f"{first.shape}: {first.status} {first.summary()}"
            )
        verdicts.append(Verdict(impl.name, variant, status, message[:600], counts))
    return verdicts


# ==================================================================================== the command
class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit status 2 through the CLI, not argparse's usage dump
        raise ValueError(f"normbench generate: {message}")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="normbench generate",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--store-completion", metavar="FILE", help="store a model answer produced elsewhere (needs --prompt, --model)"
    )
    mode.add_argument(
        "--add-fix", metavar="SAMPLE_DIR", help="record a fix of a stored sample (needs --fixed, --reason)"
    )
    mode.add_argument("--check", metavar="SAMPLE_DIR", help="check a stored sample (every variant)")
    mode.add_argument("--check-worker", metavar="SAMPLE_DIR", help=argparse.SUPPRESS)
    p.add_argument("--prompt", metavar="FILE", help="the prompt file, prompts/<dsl>-<op>.v<N>.md")
    p.add_argument(
        "--endpoint",
        metavar="URL",
        help="OpenAI-compatible server, e.g. http://localhost:8000; posts to URL/v1/chat/completions "
        "(to URL itself if it ends in /chat/completions, to URL/chat/completions if it ends in /v1)",
    )
    p.add_argument("--model", help="model name, sent to the endpoint and recorded")
    p.add_argument("--samples", type=int, default=1, metavar="K", help="independent answers to ask for (default 1)")
    p.add_argument("--temperature", type=float, help="sampling temperature (default: the server's)")
    p.add_argument("--max-tokens", type=int, help="answer length limit (default: the server's)")
    p.add_argument("--top-p", type=float, help="nucleus sampling (default: the server's)")
    p.add_argument("--seed", type=int, help="sampling seed, for servers that honour it")
    p.add_argument(
        "--timeout", type=float, default=600, metavar="S", help="seconds to wait for each answer (default 600)"
    )
    p.add_argument(
        "--api-key-env",
        default="OPENAI_API_KEY",
        metavar="VAR",
        help="environment variable holding a bearer token, if any",
    )
    p.add_argument(
        "--out-root", default=str(SAMPLES_ROOT), metavar="DIR", help="where sample folders go (default impls/llm)"
    )
    p.add_argument("--date", help="YYYY-MM-DD recorded for --store-completion (default today)")
    p.add_argument(
        "--attempts", type=int, default=1, help="--store-completion: answers asked for to get this one (default 1)"
    )
    p.add_argument("--sampling", metavar="JSON", help="--store-completion: generation settings as a JSON object")
    p.add_argument("--fixed", metavar="FILE", help="--add-fix: the fixed source file")
    p.add_argument("--reason", help="--add-fix: one line saying what the fix fixes")
    p.add_argument("--slug", help="--add-fix: short name for the patch file (default: from the reason)")
    p.add_argument("--no-check", action="store_true", help="store only; do not run the check")
    p.add_argument("--device", choices=("cpu", "cuda"), help="where to check (default: cuda if available)")
    p.add_argument(
        "--shapes", default=DEFAULT_CHECK_SHAPES, help=f"shape sets or MxN to check (default {DEFAULT_CHECK_SHAPES})"
    )
    p.add_argument("--dtypes", default=DEFAULT_CHECK_DTYPES, help=f"dtypes to check (default {DEFAULT_CHECK_DTYPES})")
    p.add_argument(
        "--check-timeout", type=float, default=900, metavar="S", help="seconds the check of one sample may take"
    )
    p.add_argument("--json-out", help=argparse.SUPPRESS)
    return p


def _require(a, *names: str, mode: str):
    missing = ["--" + n.replace("_", "-") for n in names if getattr(a, n) in (None, "")]
    if missing:
        raise ValueError(f"normbench generate{' ' + mode if mode else ''} needs {' and '.join(missing)}")


def _sampling_args(a) -> dict:
    sampling = {"temperature": a.temperature, "max_tokens": a.max_tokens, "top_p": a.top_p, "seed": a.seed}
    return {k: v for k, v in sampling.items() if v is not None}


def _report(sample_dir: Path, a) -> int:
    """Check a stored sample; print one verdict line per variant; return the exit status."""
    verdicts = check_sample(sample_dir, a.device, a.shapes, a.dtypes, a.check_timeout)
    for v in verdicts:
        print(v.line())
    return 1 if any(v.status in ("fail", "error") for v in verdicts) else 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--"]:  # `normbench generate -- --prompt ...`: what harness.cli passes through
        argv = argv[1:]
    a = build_parser().parse_args(argv)

    if not a.no_check:  # bad check options are bad input: found before anything is asked or stored
        check_points(a.shapes, a.dtypes)

    if a.check_worker:
        verdicts = _check_worker(a.check_worker, a.device, a.shapes, a.dtypes)
        Path(a.json_out).write_text(json.dumps([v.__dict__ for v in verdicts]))
        return 0

    if a.check:
        return _report(read_sample(a.check).folder, a)

    if a.add_fix:
        _require(a, "fixed", "reason", mode="--add-fix")
        fixed = Path(a.fixed)
        if not fixed.is_file():
            raise ValueError(f"--fixed file '{fixed}' does not exist")
        patch = add_fix(a.add_fix, fixed.read_text(), a.reason, a.slug)
        print(f"recorded {repo_relative(patch)}")
        return 0 if a.no_check else _report(Path(a.add_fix), a)

    if a.store_completion:
        _require(a, "prompt", "model", mode="--store-completion")
        answer = Path(a.store_completion)
        if not answer.is_file():
            raise ValueError(f"completion file '{answer}' does not exist")
        sampling = _sampling_args(a)
        if a.sampling:
            try:
                extra = json.loads(a.sampling)
            except json.JSONDecodeError as e:
                raise ValueError(f"--sampling is not valid JSON: {e}") from None
            if not isinstance(extra, dict):
                raise ValueError("--sampling must be a JSON object")
            sampling.update(extra)
        folder = store_sample(
            a.prompt,
            answer.read_text(),
            a.model,
            sampling,
            a.out_root,
            a.date,
            a.attempts,
            tool="normbench generate --store-completion",
        )
        print(f"stored {repo_relative(folder)}")
        return 0 if a.no_check else _report(folder, a)

    # ---- ask the endpoint
    _require(a, "prompt", "endpoint", "model", mode="")
    prompt = Path(a.prompt)
    if not prompt.is_file():
        raise ValueError(f"prompt file '{prompt}' does not exist")
    parse_prompt_name(prompt)
    if a.samples < 1:
        raise ValueError(f"--samples must be >= 1, got {a.samples}")
    if a.timeout <= 0:
        raise ValueError(f"--timeout must be > 0, got {a.timeout:g}")
    chat_completions_url(a.endpoint)  # a malformed URL is bad input before anything is sent
    prompt_text = prompt.read_text()
    sampling = _sampling_args(a)
    status = 0
    for k in range(1, a.samples + 1):
        where = f"sample {k} of {a.samples}: " if a.samples > 1 else ""
        try:
            answer = request_completion(
                a.endpoint, a.model, prompt_text, sampling, a.timeout, os.environ.get(a.api_key_env)
            )
            folder = store_sample(
                prompt, answer.text, a.model, sampling, a.out_root, date=None, attempts=1,
                endpoint=a.endpoint, tool="normbench generate", finish_reason=answer.finish_reason, usage=answer.usage,
            )  # fmt: skip
        except ValueError as e:
            raise ValueError(where + str(e)) from None
        n_lines = len(split_lines((folder / "raw.py").read_text()))
        print(f"stored {repo_relative(folder)} (finish_reason={answer.finish_reason}, {n_lines} lines of code)")
        if not a.no_check:
            status = max(status, _report(folder, a))
    return status


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ValueError as e:
        if os.environ.get("NORMBENCH_DEBUG"):
            raise
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
