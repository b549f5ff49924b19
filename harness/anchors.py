"""External baselines: Quack (quack-kernels) and Liger-Kernel, when installed.

They are third-party libraries, not kernels written here: every table marks them external. Their
wrappers live in ``harness/anchor_kernels.py`` (imported only when one is used)."""

from .contract import Implementation, capability, cuda, package

IMPLEMENTATIONS = [
    Implementation(
        name="quack",
        dsl="external",
        entry="harness.anchor_kernels:quack",
        description="Quack (quack-kernels): CuTe DSL kernels by Tri Dao et al. [external baseline]",
        requires=(cuda(), capability(9, 0), package("quack")),
        external=True,
        handles_no_affine=False,
    ),
    Implementation(
        name="liger",
        dsl="external",
        entry="harness.anchor_kernels:liger",
        description="Liger-Kernel: Triton kernels by LinkedIn [external baseline]",
        requires=(cuda(), package("liger_kernel")),
        external=True,
        handles_no_affine=False,
    ),
]
