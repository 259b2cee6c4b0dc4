"""numpy kernels for every op of the Graph IR: the CPU library backend that is always present.

Importing this package imports every family module, which registers its kernels with
``registry.register``; ``kernel_for(op_class)`` then finds them.
"""

from . import (attention, conv, elementwise, generation, layout, matmul, norms, positions,  # noqa: F401
               quant, resample)
from .registry import KernelContext, kernel_for, register, registered

__all__ = ["KernelContext", "kernel_for", "register", "registered"]
