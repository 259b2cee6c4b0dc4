"""Weights as the runtime holds them.

A weight of a plain type (F32, F16, BF16, integers) is an ``np.ndarray`` with its real shape and
dtype.  A weight of a block type (Q8_0, Q4_0, ...) is a :class:`QuantizedArray`: its raw GGML
blocks as a ``uint8`` array of shape ``(*shape[:-1], shape[-1] // block_size * block_bytes)`` (one
row of blocks per row of the logical tensor), plus the logical shape and the ``DType``.  Both may be
zero-copy views into a memory-mapped ``.model`` file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

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


def dtype_of(a: Array) -> DType:
    return a.dtype if isinstance(a, QuantizedArray) else DType.from_numpy(a.dtype)
