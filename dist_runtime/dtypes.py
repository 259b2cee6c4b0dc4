"""Tensor element types, tagged with GGML's type ids.

Using GGML's ids (``ggml_type`` in ggml.h, ``GGMLQuantizationType`` in the ``gguf`` package) means a
GGUF tensor maps to ours with no conversion, and the quantized formats keep GGML's exact block
layouts.  GGML's Q8_1 (id 9) is left out on purpose: it is GGML's internal format for
activations, never stored in model files, and its size differs between GGML (36 bytes) and the
``gguf`` package's table (40).  GGML has no unsigned-byte or boolean type; we add them as
project extensions in a range GGML does not use (200 and up).

Quantized (block) types group ``block_size`` consecutive elements of the *last* dimension (the
contiguous one) into ``block_bytes`` bytes, so a tensor of such a type needs its last dimension to
be a multiple of ``block_size``.  See docs/format.md, "Element types".
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from .errors import ModelFormatError


@dataclass(frozen=True)
class _Layout:
    block_size: int  # elements per block (1 for plain scalar types)
    block_bytes: int  # bytes per block
    numpy: str | None  # numpy dtype string for plain types, None for block formats


class DType(enum.IntEnum):
    """Element type of a tensor.  The value is the on-disk ``u8 dtype_tag``."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    BF16 = 30
    # Project extensions (not GGML types).
    U8 = 200
    BOOL = 201

    # -- layout --------------------------------------------------------------------------------
    @property
    def block_size(self) -> int:
        return _LAYOUTS[self].block_size

    @property
    def block_bytes(self) -> int:
        return _LAYOUTS[self].block_bytes

    @property
    def is_quantized(self) -> bool:
        return _LAYOUTS[self].block_size > 1

    @property
    def is_float(self) -> bool:
        return self in (DType.F32, DType.F16, DType.BF16, DType.F64)

    @property
    def is_integer(self) -> bool:
        return self in (DType.I8, DType.I16, DType.I32, DType.I64, DType.U8)

    @property
    def numpy(self) -> np.dtype:
        """The numpy dtype that holds this type's elements (BF16 via ml_dtypes when installed).

        Block formats have no element dtype: their bytes are handled as ``uint8`` blocks.
        """
        name = _LAYOUTS[self].numpy
        if self is DType.BF16:
            import ml_dtypes  # optional: only needed when a BF16 tensor is materialised

            return np.dtype(ml_dtypes.bfloat16)
        if name is None:
            raise TypeError(f"{self.name} is a block format; it has no numpy element dtype")
        return np.dtype(name)

    def nbytes(self, shape: tuple[int, ...] | list[int]) -> int:
        """Bytes that a tensor of this type and a fully known ``shape`` occupies.

        Raises ``ModelFormatError`` for a negative dimension or, for block formats, a last
        dimension that is not a multiple of the block size.
        """
        count = 1
        for d in shape:
            if d < 0:
                raise ModelFormatError(f"shape {list(shape)} has an unresolved or negative dimension")
            count *= d
        bs = self.block_size
        if bs > 1:
            last = shape[-1] if len(shape) else 1
            if last % bs:
                raise ModelFormatError(
                    f"{self.name} packs {bs} elements per block, but the last dimension of shape "
                    f"{list(shape)} is {last}, not a multiple of {bs}"
                )
            return count // bs * self.block_bytes
        return count * self.block_bytes

    @classmethod
    def from_tag(cls, tag: int, where: str = "") -> DType:
        try:
            return cls(tag)
        except ValueError:
            known = ", ".join(f"{d.name}={d.value}" for d in cls)
            raise ModelFormatError(f"unknown dtype tag {tag}{where}; known tags: {known}") from None

    @classmethod
    def from_name(cls, name: str, where: str = "") -> DType:
        try:
            return cls[name.upper()]
        except (KeyError, AttributeError):
            known = ", ".join(d.name.lower() for d in cls)
            raise ModelFormatError(f"unknown dtype {name!r}{where}; known: {known}") from None

    @classmethod
    def from_numpy(cls, dtype: np.dtype) -> DType:
        found = _FROM_NUMPY.get(dtype)  # hot: every matmul asks, so a dict lookup first
        if found is not None:
            return found
        dtype = np.dtype(dtype)
        if dtype.name == "bfloat16":
            return DType.BF16
        for d, lay in _LAYOUTS.items():
            if lay.numpy is not None and np.dtype(lay.numpy) == dtype:
                _FROM_NUMPY[dtype] = d
                return d
        raise TypeError(f"numpy dtype {dtype} has no DType")


_LAYOUTS: dict[DType, _Layout] = {
    DType.F32: _Layout(1, 4, "<f4"),
    DType.F16: _Layout(1, 2, "<f2"),
    DType.Q4_0: _Layout(32, 18, None),  # f16 scale + 16 bytes of nibbles
    DType.Q4_1: _Layout(32, 20, None),  # f16 scale, f16 min + 16 bytes of nibbles
    DType.Q5_0: _Layout(32, 22, None),  # f16 scale + 4 bytes of high bits + 16 bytes of nibbles
    DType.Q5_1: _Layout(32, 24, None),  # f16 scale, f16 min + 4 + 16
    DType.Q8_0: _Layout(32, 34, None),  # f16 scale + 32 int8
    DType.Q2_K: _Layout(256, 84, None),
    DType.Q3_K: _Layout(256, 110, None),
    DType.Q4_K: _Layout(256, 144, None),
    DType.Q5_K: _Layout(256, 176, None),
    DType.Q6_K: _Layout(256, 210, None),
    DType.Q8_K: _Layout(256, 292, None),
    DType.I8: _Layout(1, 1, "i1"),
    DType.I16: _Layout(1, 2, "<i2"),
    DType.I32: _Layout(1, 4, "<i4"),
    DType.I64: _Layout(1, 8, "<i8"),
    DType.F64: _Layout(1, 8, "<f8"),
    DType.BF16: _Layout(1, 2, None),
    DType.U8: _Layout(1, 1, "u1"),
    DType.BOOL: _Layout(1, 1, "?"),
}

_FROM_NUMPY: dict[np.dtype, DType] = {}


def kv_dtype(name: str | None, declared: str | None = None) -> DType:
    """The element type KV caches are kept in: ``name`` (``--kv-dtype``), else ``declared`` (the
    model's ``kv_dtype`` metadata), else the default (F32, F16 or Q8_0); ValueError naming the
    choices."""
    from .scheduling_defaults import DEFAULT_KV_DTYPE, KV_DTYPE_NAMES

    name = name or declared or DEFAULT_KV_DTYPE
    if name not in KV_DTYPE_NAMES:
        raise ValueError(f"--kv-dtype {name!r} is not one of {', '.join(KV_DTYPE_NAMES)}")
    return DType[name.upper()]
