"""normbench: RMSNorm and LayerNorm kernels across GPU DSLs, checked against fp64 and ranked
against the memory roofline. See README.md."""

from .contract import DTYPES, OPS, Implementation
from .registry import all_implementations, get, select

__all__ = ["DTYPES", "OPS", "Implementation", "all_implementations", "get", "select"]
