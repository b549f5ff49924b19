"""The contract an implementation is written against, and everything it is checked with: the op
records, the implementation record, fp64 references, tolerances, shapes, inputs and the bytes model.
An implementer reads this package only."""

from harness.spec.contract import (  # noqa: F401
    DTYPES,
    OPS,
    Implementation,
    capability,
    contract_functions,
    cuda,
    package,
)
