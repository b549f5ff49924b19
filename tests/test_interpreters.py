"""The CPU interpreters in one process: a Helion-interpreted implementation used first must not
leave Triton (which Helion imports) compiled-only for the Triton implementations after it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU interpreters are what is tested")
def test_helion_first_then_triton_in_one_check():
    pytest.importorskip("helion")
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "HELION_INTERPRET")}
    cmd = [sys.executable, "-m", "harness", "check", "--impl", "helion-layernorm-claude-20261122-1,triton-rmsnorm-claude-20261122-1",
           "--device", "cpu", "--shapes", "4x64", "--dtype", "fp32", "--quiet"]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "Cannot call @triton.jit" not in out.stdout + out.stderr
