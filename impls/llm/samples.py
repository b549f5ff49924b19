"""One LLM-generated sample on disk, and how its code becomes a module.

A sample is a folder ``impls/llm/<sample_id>/``::

    raw.py            the code block of the model's first answer, verbatim: never edited
    completion.md     the whole answer, verbatim (prose and all), when it was recorded
    metadata.json     provenance: prompt file and its sha256, generator, sampling, date, attempts,
                      fixes (each {"patch": "patches/NN-slug.patch", "reason": "one line"}),
                      and optionally known_failures ({op: why}: a failure of the verbatim code
                      found and explained later, which the tests then expect)
    patches/NN-<slug>.patch   unified diffs, each against the version the fixes before it left

Two variants of a sample can be loaded: "first-shot" (raw.py as it is) and "after-fix" (raw.py with
every patch of ``metadata["fixes"]`` applied, in order). Nothing here imports a DSL; the code itself
is imported only by ``load_module``, every sample record's entry point.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .patches import apply_patch

FORMAT = 1  # metadata.json format version
DSLS = ("triton", "helion", "cute", "gluon")
OPS = ("rmsnorm", "layernorm", "add_rmsnorm")
VARIANTS = ("first-shot", "after-fix")
REPO_ROOT = Path(__file__).resolve().parent.parent.parent  # the folder holding impls/ and prompts/
SAMPLES_ROOT = Path(__file__).resolve().parent  # the default home of samples: impls/llm/


class SampleError(ValueError):
    """A sample folder that is malformed (bad metadata, missing raw.py, a patch that does not apply)."""


class GeneratedCodeError(ImportError):
    """The generated code (one variant of a sample) raised while being imported."""


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def sha256_file(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def repo_relative(path: Path) -> str:
    """``path`` relative to the repository root when it lies inside it (what metadata stores), else absolute."""
    path = Path(path).resolve()
    try:
        return path.relative_to(REPO_ROOT).as_posix()
    except ValueError:
        return str(path)


def resolve_repo_path(stored: str) -> Path:
    """The inverse of ``repo_relative``."""
    p = Path(stored)
    return p if p.is_absolute() else REPO_ROOT / p


# the dash separates dsl from op, and an op name may hold underscores (add_rmsnorm)
PROMPT_NAME = re.compile(r"^(?P<dsl>[a-z]+)-(?P<op>[a-z][a-z_]*)\.v(?P<version>\d+)\.md$")


def parse_prompt_name(path: Path | str) -> tuple[str, str]:
    """(dsl, op) from a prompt file name '<dsl>-<op>.v<N>.md', e.g. 'triton-rmsnorm.v1.md'."""
    name = Path(path).name
    m = PROMPT_NAME.match(name)
    if not m or m["dsl"] not in DSLS or m["op"] not in OPS:
        raise ValueError(
            f"prompt file name '{name}' does not say its target: expected <dsl>-<op>.v<N>.md with dsl in "
            f"{', '.join(DSLS)} and op in {', '.join(OPS)} (e.g. triton-rmsnorm.v1.md)"
        )
    return m["dsl"], m["op"]


@dataclass(frozen=True)
class Sample:
    folder: Path
    metadata: dict

    @property
    def sample_id(self) -> str:
        return self.folder.name

    @property
    def dsl(self) -> str:
        return self.metadata["dsl"]

    @property
    def op(self) -> str:
        return self.metadata["op"]

    @property
    def raw_path(self) -> Path:
        return self.folder / "raw.py"

    @property
    def fixes(self) -> list[dict]:
        return list(self.metadata.get("fixes", []))

    def raw_source(self) -> str:
        return self.raw_path.read_text()

    def prompt_hash_ok(self) -> bool | None:
        """Does the prompt file still hash to what the sample was generated from? None: file gone."""
        path = resolve_repo_path(self.metadata["prompt"])
        if not path.is_file():
            return None
        return sha256_file(path) == self.metadata["prompt_sha256"]

    def source(self, variant: str, upto: int | None = None) -> str:
        """The code of ``variant``; for "after-fix", raw.py with the first ``upto`` fixes (default: all)."""
        if variant not in VARIANTS:
            raise ValueError(f"unknown variant '{variant}'; choose from {', '.join(VARIANTS)}")
        text = self.raw_source()
        if variant == "first-shot":
            return text
        for fix in self.fixes[:upto]:
            patch_path = self.folder / fix["patch"]
            if not patch_path.is_file():
                raise SampleError(f"{self.sample_id}: {fix['patch']} is listed in metadata.json but missing")
            text = apply_patch(text, patch_path.read_text(), what=f"{self.sample_id}/{fix['patch']}")
        return text


def read_sample(folder: Path | str) -> Sample:
    """Read and validate a sample folder's metadata (cheap: no code is read or imported)."""
    folder = Path(folder).resolve()
    meta_path = folder / "metadata.json"
    if not meta_path.is_file():
        raise SampleError(f"{folder.name}: no metadata.json")
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as e:
        raise SampleError(f"{folder.name}: metadata.json is not valid JSON ({e})") from None
    if not isinstance(meta, dict):
        raise SampleError(f"{folder.name}: metadata.json must hold an object")
    missing = [k for k in ("dsl", "op", "prompt", "prompt_sha256", "generator", "date") if k not in meta]
    if missing:
        raise SampleError(f"{folder.name}: metadata.json lacks {', '.join(missing)}")
    if meta["dsl"] not in DSLS:
        raise SampleError(f"{folder.name}: unknown dsl '{meta['dsl']}' (expected one of {', '.join(DSLS)})")
    if meta["op"] not in OPS:
        raise SampleError(f"{folder.name}: unknown op '{meta['op']}' (expected one of {', '.join(OPS)})")
    if not isinstance(meta["generator"], dict) or "model" not in meta["generator"]:
        raise SampleError(f"{folder.name}: metadata.json 'generator' must be an object with 'model'")
    if not (folder / "raw.py").is_file():
        raise SampleError(f"{folder.name}: no raw.py")
    fixes = meta.get("fixes", [])
    if not isinstance(fixes, list) or any(
        not isinstance(f, dict) or not f.get("patch") or not f.get("reason") for f in fixes
    ):
        raise SampleError(f"{folder.name}: every entry of 'fixes' needs a 'patch' and a one-line 'reason'")
    listed = {f["patch"] for f in fixes}
    unlisted = sorted(
        p.relative_to(folder).as_posix()
        for p in (folder / "patches").glob("*.patch")
        if p.relative_to(folder).as_posix() not in listed
    )
    if unlisted:
        raise SampleError(
            f"{folder.name}: {', '.join(unlisted)} not listed in metadata.json 'fixes' (each fix needs a reason)"
        )
    return Sample(folder, meta)


def sample_folders(root: Path | str) -> list[Path]:
    """The sample folders under ``root``: every subfolder except hidden ones (a sample being written
    lives in a hidden temporary folder until it is complete) and Python's caches."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith((".", "_")))


# ---------------------------------------------------------------- the code as a module
def cache_dir() -> Path:
    """Where after-fix sources are written to be imported (NORMBENCH_LLM_CACHE, else a temp folder).
    They must be real files: Triton, Helion and CuTe DSL read a kernel's source back with inspect."""
    env = os.environ.get("NORMBENCH_LLM_CACHE")
    uid = os.getuid() if hasattr(os, "getuid") else "user"
    return Path(env) if env else Path(tempfile.gettempdir()) / f"normbench-llm-{uid}"


def materialize(sample: Sample, variant: str) -> Path:
    """A file holding the code of ``variant``: raw.py itself for first-shot; for after-fix, a file in
    ``cache_dir()`` named by the content's hash (so a stale file is never reused and concurrent
    processes write identical bytes; os.replace makes each write atomic)."""
    if variant == "first-shot":
        return sample.raw_path
    text = sample.source(variant)
    folder = cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{sample.sample_id}.after-fix.{sha256_text(text)[:12]}.py"
    if not path.is_file() or path.read_text() != text:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    return path


def module_name(sample: Sample, variant: str) -> str:
    ident = re.sub(r"\W", "_", sample.sample_id)
    return f"normbench_llm__{ident}__{variant.replace('-', '_')}"


def load_module(sample: str, variant: str):
    """Import one variant of the sample in folder ``sample`` as a fresh module; GeneratedCodeError
    if the code raises."""
    sample = read_sample(sample)
    path = materialize(sample, variant)
    name = module_name(sample, variant)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # some DSLs look their kernel's module up by name
    try:
        spec.loader.exec_module(module)
    except KeyboardInterrupt:
        sys.modules.pop(name, None)
        raise
    except BaseException as e:  # SystemExit too: generated code that calls exit() at import failed
        sys.modules.pop(name, None)
        where = ""
        tb = e.__traceback__
        while tb is not None:  # the innermost frame in the generated file says where it broke
            if tb.tb_frame.f_code.co_filename == str(path):
                where = f" (line {tb.tb_lineno})"
            tb = tb.tb_next
        if isinstance(e, SyntaxError) and e.lineno:
            where = f" (line {e.lineno})"
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise GeneratedCodeError(
            f"the {variant} code of {sample.sample_id} does not import{where}: {type(e).__name__}: {msg}"
        ) from e
    return module
