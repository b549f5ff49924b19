"""The kernel files `normbench new` copies into a new ``impls/<name>/`` (harness.tools.new): each
defines the six contract functions and passes ``normbench check --device cpu`` as it is."""
