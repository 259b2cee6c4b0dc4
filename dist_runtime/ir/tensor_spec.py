"""The IR's leaf types: ``TensorSpec``, ``AttrValue`` and the ``pos`` name.

They depend on dtypes and errors only, so that the graph, the op table and the shape rules can
all build on them without importing one another in a circle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from ..dtypes import DType
from ..errors import GraphValidationError

#: The name the executor injects before each run: the position of the first new token, as f32[1].
POS = "pos"

#: A free-form hint value (the seed's ``AttrValue``): Int, Float, String, Ints, Floats or Bool.
AttrValue = Union[bool, int, float, str, tuple[int, ...], tuple[float, ...]]


@dataclass(frozen=True)
class TensorSpec:
    """Shape (``-1`` for a dynamic dim), element type and, for weights, placement in the weights
    section (``offset`` relative to the section's start, ``size`` in bytes)."""

    shape: tuple[int, ...]
    dtype: DType
    offset: int | None = None
    size: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        object.__setattr__(self, "dtype", DType(self.dtype))
        if (self.offset is None) != (self.size is None):
            raise GraphValidationError("a TensorSpec has both offset and size, or neither")

    @property
    def is_static(self) -> bool:
        return all(d >= 0 for d in self.shape)

    def nbytes(self) -> int:
        """Bytes for the fully known shape (``ModelFormatError`` if a dim is dynamic)."""
        return self.dtype.nbytes(self.shape)

    def __str__(self) -> str:
        return f"{self.dtype.name.lower()}[{','.join(map(str, self.shape))}]"
