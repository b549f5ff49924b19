"""normbench: RMSNorm and LayerNorm kernels across GPU DSLs, checked against fp64 and ranked
against the memory roofline. See README.md."""

from harness.registry import all_implementations, get, select
from harness.spec.contract import DTYPES, OPS, Implementation

__all__ = ["DTYPES", "OPS", "Implementation", "all_implementations", "get", "select"]
