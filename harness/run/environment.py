"""What a run records about where it ran: versions, GPU, driver, host and the checkout's commit."""

from __future__ import annotations

import functools
import os
import platform
import subprocess
from pathlib import Path

import torch


def _version(mod: str):
    try:
        from importlib.metadata import version

        return version(mod)
    except Exception:
        return None


def environment(device: str = "cuda") -> dict:
    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "versions": {
            p: _version(p)
            for p in ("triton", "helion", "nvidia-cutlass-dsl", "quack-kernels", "liger-kernel", "tritonbench")
        },
        "host": platform.node(),
    }
    if device == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(
            gpu=props.name,
            sm_count=props.multi_processor_count,
            capability=f"{props.major}.{props.minor}",
            memory_gib=round(props.total_memory / 2**30, 1),
        )
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True, timeout=20
            )
            env["driver"] = out.stdout.strip().splitlines()[0] if out.stdout.strip() else None
        except Exception:
            env["driver"] = None
    else:
        env["gpu"] = "cpu"
    env["aten_rms_norm"] = aten_rms_norm(device)
    env["git_commit"] = git_commit()
    return env


# ATen's fused RMSNorm, forward and backward: what F.rms_norm and its autograd run
RMS_NORM_OPS = ("_fused_rms_norm", "_fused_rms_norm_backward")


@functools.cache
def _native_registry():
    """torch._native's registry, or None with a torch that has none. Looked up once: eager's kernels
    ask on every call, and a failed import searches every path entry again (tens of µs a call)."""
    try:
        from torch._native import registry
    except ImportError:
        return None
    return registry


def rms_norm_overrides(dispatch_key: str) -> dict[str, list[str]]:
    """{ATen op: the DSLs whose kernels torch routes it to} at ``dispatch_key`` ("CUDA", "CPU"), for
    ATen's RMSNorm ops that torch overrides now. torch 2.13 registers CuTe DSL kernels (its vendored
    Quack, ``torch._vendor.quack``) for both at CUDA when a CUDA build finds an nvidia-cutlass-dsl
    version it accepts (``torch._native``); each call then runs Quack where its condition holds
    (sm_90 or sm_100, the weight in x's dtype, ...) and ATen's own kernel otherwise. Empty when
    nothing overrides them, or with a torch that has no such overrides."""
    registry = _native_registry()
    if registry is None:
        return {}
    graphs = getattr(registry, "_graphs", {})
    out = {}
    for op in RMS_NORM_OPS:
        dsls = [node.dsl_name for node in graphs.get((op, dispatch_key), ()) if getattr(node, "active", False)]
        if dsls:
            out[op] = dsls
    return out


def aten_rms_norm(device: str = "cuda") -> dict:
    """Which kernel ATen's RMSNorm (F.rms_norm) runs in this process on ``device``: {"kernel":
    "native" | "vendored quack" | "<dsl> override", "why": ...}. The ``eager`` implementation calls
    ATen's native kernels either way (impls/eager/kernels.py)."""
    key = "CUDA" if device == "cuda" else "CPU"
    overrides = rms_norm_overrides(key)
    if overrides:
        dsls = sorted({d for ds in overrides.values() for d in ds})
        kernel = "vendored quack" if dsls == ["cutedsl"] else " and ".join(f"{d} override" for d in dsls)
        cutlass = _version("nvidia-cutlass-dsl")
        here = ""
        if key == "CUDA" and torch.cuda.is_available():
            here = " (this GPU: sm_{}{})".format(*torch.cuda.get_device_capability())
        return {
            "kernel": kernel,
            "why": f"torch {torch.__version__} routes aten.{' and aten.'.join(overrides)} at {key} to torch._native's "
            f"{', '.join(dsls)} kernels (nvidia-cutlass-dsl {cutlass}): on sm_90/sm_100 GPUs{here}, for a weight of x's dtype "
            "and an N that allows 32- to 128-bit copies; ATen's native kernels elsewhere. The eager implementation "
            "calls ATen's native kernels all the same",
        }
    return {"kernel": "native", "why": _why_native(key)}


def _why_native(key: str) -> str:
    """Why torch does not route ATen's RMSNorm at ``key`` to a DSL kernel here."""
    try:
        from torch._native import cutedsl_utils
    except ImportError:
        return f"torch {torch.__version__} has no DSL overrides of ATen ops (torch._native)"
    if key != "CUDA":
        return f"torch {torch.__version__} overrides ATen's RMSNorm on CUDA only"
    if os.environ.get("TORCH_DISABLE_NATIVE_JIT") == "1":
        return "TORCH_DISABLE_NATIVE_JIT=1 switched torch's DSL overrides off"
    if not torch.backends.cuda.is_built():
        return f"torch {torch.__version__} is a CPU build"
    cutlass, ffi = _version("nvidia-cutlass-dsl"), _version("apache-tvm-ffi")
    if cutlass is None or ffi is None:
        return "torch's vendored Quack needs nvidia-cutlass-dsl and apache-tvm-ffi, and one is not installed"
    accepted = sorted(str(v) for v in getattr(cutedsl_utils, "_CUTEDSL_REQUIRED_VERSIONS", ()))
    if accepted and cutlass not in accepted and os.environ.get("TORCH_NATIVE_SKIP_VERSION_CHECK") != "1":
        return (
            f"torch {torch.__version__} routes it to its vendored Quack only with nvidia-cutlass-dsl "
            f"{', '.join(accepted)} (or TORCH_NATIVE_SKIP_VERSION_CHECK=1); {cutlass} is installed"
        )
    return f"torch {torch.__version__} registered no override of ATen's RMSNorm in this process"


def git_commit() -> str | None:
    """The checkout's commit (``-dirty`` with uncommitted changes); NORMBENCH_COMMIT where the tree
    is a copy without git history (as on the lent GPU machine)."""
    if os.environ.get("NORMBENCH_COMMIT"):
        return os.environ["NORMBENCH_COMMIT"]
    root = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        commit = out.stdout.strip()
        if out.returncode != 0 or not all(c in "0123456789abcdef" for c in commit) or len(commit) < 7:
            return None
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, timeout=10)
        return f"{commit}{'-dirty' if dirty.stdout.strip() else ''}" if commit else None
    except Exception:
        return os.environ.get("NORMBENCH_COMMIT")


def gpu_id(device: str = "cuda") -> str | None:
    """Which GPU of its host runs this process's points: what a fan-out's launcher named it
    (``NORMBENCH_GPU_ID``: the host's index, with the node's name under SLURM), else the first entry
    of ``CUDA_VISIBLE_DEVICES``, else "0"; None on the CPU."""
    if os.environ.get("NORMBENCH_GPU_ID"):
        return os.environ["NORMBENCH_GPU_ID"]
    if device != "cuda":
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return visible or "0"


def slug(text: str) -> str:
    return "".join(c.lower() if c.isalnum() else "-" for c in text).strip("-").replace("--", "-")
