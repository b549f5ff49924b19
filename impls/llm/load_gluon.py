"""Entry module of the llm-gluon records (see impls/llm/__init__.py for why each DSL has its own)."""

from .samples import load_module


def load(sample: str, variant: str):
    """The module holding one variant of an LLM-generated gluon sample (imported on first call)."""
    return load_module(sample, variant)
