"""Implementations. Each subpackage lists ``IMPLEMENTATIONS`` (harness.spec.contract.Implementation
records) in its ``__init__``, which must import without its DSL installed; the kernels live in
modules the records point to and are imported only when used."""
