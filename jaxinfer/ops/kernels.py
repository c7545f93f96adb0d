"""The kernel modules of this process's platform, imported before a step program is loaded
from disk (`import_platform_kernels`).

A program loaded from disk, never traced in this process, calls into its kernels' runtimes:
importing Mosaic GPU loads the host symbols its kernels launch through
(`mosaic_gpu_launch_kernel`); without them XLA could not load such a program and it
compiled again. The registries name their kernels without importing them (`KernelModule`),
so this module, above every registry, is what imports them all.
"""

from __future__ import annotations

from jaxinfer.ops import attention_registry, grouped_matmul_registry, linear_registry
from jaxinfer.ops.registry import kernel_modules

# The registries whose kernels there are (importing them names their KernelModules).
REGISTRIES = (attention_registry.REGISTRY, grouped_matmul_registry.REGISTRY,
              linear_registry.REGISTRY)


def import_platform_kernels() -> list[str]:
    """Imports the kernel modules of this process's platform; returns their names."""
    from jaxinfer.ops.platform import platform  # at call time, as the registries ask it

    here = platform()
    return [k.name for k in kernel_modules() if k.platform == here and k.module() is not None]
