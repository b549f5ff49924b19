"""The contract functions of the Helion implementation (the record's entry point)."""

from .layernorm import layernorm_bwd, layernorm_fwd
from .rmsnorm import add_rmsnorm_bwd, add_rmsnorm_fwd, rmsnorm_bwd, rmsnorm_fwd

__all__ = ["rmsnorm_fwd", "rmsnorm_bwd", "layernorm_fwd", "layernorm_bwd", "add_rmsnorm_fwd", "add_rmsnorm_bwd"]
