"""Every implementation inside PyTorch: custom ops, differentiable functions and nn modules, and
``swap_norms`` for Hugging Face models."""
