"""The kernel table: op payload class -> numpy kernel.

A kernel is called as ``kernel(op, inputs, ctx)`` and returns a tuple of output arrays, one per
output name of the node.  ``op`` is the node's payload (its fields are the op's parameters),
``inputs`` the input arrays in node order (weights may be :class:`QuantizedArray`), and ``ctx``
carries what a pure function cannot: the per-node, per-session state of a stateful op (KvCache)
and the random generator of Sample.

Each op family lives in its own module with the pure maths function beside a thin registered
wrapper, as in ONNX's reference evaluator::

    def rms_norm(x, weight, *, eps):           # the maths, usable on its own
        ...

    @register(RmsNorm)
    def _rms_norm(op, inputs, ctx):
        x, weight = inputs
        return (rms_norm(x, weight, eps=op.eps),)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from dist_runtime.tensor import Array


@dataclass
class KernelContext:
    """What a kernel may need beyond its inputs."""

    state: Any = None  # the per-node, per-session state object of a stateful op (KvCache)
    rng: np.random.Generator | None = None  # Sample's generator (seedable)
    pos: int = 0  # the session's past_seq_len before this run: where KvCache writes its rows


Kernel = Callable[[Any, Sequence[Array], KernelContext], tuple]

_KERNELS: dict[type, Kernel] = {}


def register(op_class: type) -> Callable[[Kernel], Kernel]:
    """Register the decorated function as the numpy kernel of ``op_class``."""

    def wrap(fn: Kernel) -> Kernel:
        if op_class in _KERNELS:
            raise AssertionError(f"a kernel for {op_class.__name__} is already registered")
        _KERNELS[op_class] = fn
        return fn

    return wrap


def kernel_for(op_class: type) -> Kernel:
    """The kernel of ``op_class``; ``KeyError`` listing the registered ops if there is none."""
    try:
        return _KERNELS[op_class]
    except KeyError:
        known = ", ".join(sorted(c.__name__ for c in _KERNELS))
        raise KeyError(f"no numpy kernel for {getattr(op_class, '__name__', op_class)}; registered: {known}") from None


def registered() -> dict[type, Kernel]:
    return dict(_KERNELS)
