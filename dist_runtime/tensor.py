"""Weights as the runtime holds them.

A weight of a plain type (F32, F16, BF16, integers) is an ``np.ndarray`` with its real shape and
dtype.  A weight of a block type (Q8_0, Q4_0, ...) is a :class:`QuantizedArray`: its raw GGML
blocks as a ``uint8`` array of shape ``(*shape[:-1], shape[-1] // block_size * block_bytes)`` (one
row of blocks per row of the logical tensor), plus the logical shape and the ``DType``.  Both may be
zero-copy views into a memory-mapped ``.model`` file.

A :class:`Deferred` weight is one not made yet: a converter's promise of a tensor of a known type
and shape, made when :func:`~.model.save_model` writes it and let go right after, so that a
conversion holds one tensor at a time whatever the model's size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Union

import numpy as np

from .dtypes import DType


@dataclass(frozen=True, eq=False)
class QuantizedArray:
    """Raw GGML blocks of a quantized tensor (quantization runs along the last dim)."""

    data: np.ndarray  # uint8, shape (*shape[:-1], shape[-1] // block_size * block_bytes)
    dtype: DType
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        expect = (*self.shape[:-1], self.shape[-1] // self.dtype.block_size * self.dtype.block_bytes)
        if self.data.dtype != np.uint8 or self.data.shape != expect or not self.dtype.is_quantized:
            raise ValueError(
                f"QuantizedArray {self.dtype.name}{list(self.shape)} needs uint8 blocks of shape "
                f"{list(expect)}, got {self.data.dtype}{list(self.data.shape)}"
            )

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    @property
    def ndim(self) -> int:
        return len(self.shape)


Array = Union[np.ndarray, QuantizedArray]


@dataclass(frozen=True, eq=False)
class Deferred:
    """A weight of ``dtype`` and ``shape`` that ``make()`` returns when it is written; ``done()``
    (if given) is called once it has been written, to give back what making it took (the pages
    of the source file it was read from)."""

    dtype: DType
    shape: tuple[int, ...]
    make: Callable[[], Array]
    done: Optional[Callable[[], None]] = None

    @property
    def nbytes(self) -> int:
        return self.dtype.nbytes(self.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)


def dtype_of(a: Array | Deferred) -> DType:
    return a.dtype if isinstance(a, (QuantizedArray, Deferred)) else DType.from_numpy(a.dtype)
