"""What a run records about where it ran: versions, GPU, driver, host and the checkout's commit."""

from __future__ import annotations

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
    env["git_commit"] = git_commit()
    return env


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


def slug(text: str) -> str:
    return "".join(c.lower() if c.isalnum() else "-" for c in text).strip("-").replace("--", "-")
