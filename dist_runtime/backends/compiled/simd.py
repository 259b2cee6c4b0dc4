"""LLVM vector IR for the kernels' ``@intrinsic`` code generators: loads that widen stored floats to
``<lanes x float>``, multiply-add, and a horizontal sum in one fixed order.

``path`` is :data:`cpu.PATH`.  On ``"avx2"`` a multiply-add is one ``llvm.fma`` (one rounding) and
F16 widens with ``fpext`` (F16C's ``vcvtph2ps``); on ``"portable"`` a multiply-add is ``fmul`` then
``fadd`` and F16 widens with integer operations, so the IR needs no FMA, no F16C and no runtime
library call on any CPU.  Neither path sets fast-math flags: LLVM may not reorder a sum, which is
what keeps every kernel batch-invariant.

numba's on-disk cache checks only the file of the jitted function, not this one: the kernels'
cache directory is named by a digest of every source, this one included (:mod:`.cache`).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.np import numpy_support

F32 = ir.FloatType()
I16 = ir.IntType(16)
I32 = ir.IntType(32)


def vector(ty: ir.Type, lanes: int) -> ir.VectorType:
    return ir.VectorType(ty, lanes)


def splat(ty: ir.Type, value, lanes: int) -> ir.Constant:
    return ir.Constant(vector(ty, lanes), [value] * lanes)


def load(builder: ir.IRBuilder, ptr: ir.Value, fmt: str, lanes: int, path: str) -> ir.Value:
    """``lanes`` consecutive stored elements at ``ptr`` (f32 or u16 pointer) as ``<lanes x float>``."""
    if fmt == "f32":
        return builder.load(builder.bitcast(ptr, vector(F32, lanes).as_pointer()), align=4)
    bits = builder.load(builder.bitcast(ptr, vector(I16, lanes).as_pointer()), align=2)
    if fmt == "bf16":  # a bf16 is the high half of the f32 with the same bits
        wide = builder.shl(builder.zext(bits, vector(I32, lanes)), splat(I32, 16, lanes))
        return builder.bitcast(wide, vector(F32, lanes))
    if path == "avx2":
        return builder.fpext(builder.bitcast(bits, vector(ir.HalfType(), lanes)), vector(F32, lanes))
    return _widen_f16(builder, bits, lanes)


def _widen_f16(builder: ir.IRBuilder, bits: ir.Value, lanes: int) -> ir.Value:
    """IEEE half -> float with integer operations, exact for every input (zeros, subnormals, inf,
    NaN payloads): move exponent and mantissa into place, rebias the exponent, and renormalise
    subnormals by one exact float subtraction."""
    def c(v):
        return splat(I32, v, lanes)

    h = builder.zext(bits, vector(I32, lanes))
    shifted = builder.shl(builder.and_(h, c(0x7FFF)), c(13))
    exponent = builder.and_(shifted, c(0x7C00 << 13))
    rebiased = builder.add(shifted, c((127 - 15) << 23))
    special = builder.icmp_unsigned("==", exponent, c(0x7C00 << 13))  # inf / NaN: exponent all ones
    rebiased = builder.select(special, builder.add(rebiased, c((128 - 16) << 23)), rebiased)
    floats = vector(F32, lanes)
    subnormal = builder.fsub(builder.bitcast(builder.add(rebiased, c(1 << 23)), floats),
                             builder.bitcast(c(113 << 23), floats))
    tiny = builder.icmp_unsigned("==", exponent, c(0))
    magnitude = builder.select(tiny, builder.bitcast(subnormal, vector(I32, lanes)), rebiased)
    sign = builder.shl(builder.and_(h, c(0x8000)), c(16))
    return builder.bitcast(builder.or_(magnitude, sign), floats)


def fma(builder: ir.IRBuilder, a: ir.Value, b: ir.Value, c: ir.Value, path: str) -> ir.Value:
    """``a * b + c`` on floats or float vectors (fused on ``"avx2"``)."""
    if path != "avx2":
        return builder.fadd(builder.fmul(a, b), c)
    suffix = f"v{a.type.count}f32" if isinstance(a.type, ir.VectorType) else "f32"
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(a.type, [a.type] * 3),
                                        f"llvm.fma.{suffix}")
    return builder.call(fn, [a, b, c])


#: Bytes ahead of a weight stream's loads at which the kernels prefetch it, into L1 (near) and L2
#: (far).  The hardware prefetcher alone left every product's rows waiting on memory here.  Measured
#: on the F32 products (floats.py) and on the block products: Q4_K with Q8_K activations, weights
#: out of cache (24 x 4096 x 4096), 1 / 2 threads, 4.4 / 7.5 GB/s without, 10.2 / 15.1-18.2 with
#: near 256-1024 B and far 4-64 KB alike; Q8_0 with f32 activations 6.3 / 11.5 without, 10.9 / 21.2
#: with 512 B / 16 KB.
PREFETCH_NEAR, PREFETCH_FAR = 512, 16384


def prefetch(builder: ir.IRBuilder, ptr: ir.Value, offset, locality: int) -> None:
    """A read hint for the line at byte ``offset`` (an ``ir.Value`` or int) of ``ptr`` (an i8*):
    into L1 (``locality`` 3) or L2 (2).  A hint never faults, past the end of an array too."""
    i8p = ir.IntType(8).as_pointer()
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p] + [I32] * 3),
                                        "llvm.prefetch.p0i8")
    at = ir.Constant(ir.IntType(64), offset) if isinstance(offset, int) else offset
    builder.call(fn, [builder.gep(builder.bitcast(ptr, i8p), [at]), *(ir.Constant(I32, v) for v in (0, locality, 1))])


def prefetch_ahead(builder: ir.IRBuilder, ptr: ir.Value, offset, span: int, far: bool = True,
                   near: bool = True) -> None:
    """Prefetch the ``span`` bytes at byte ``offset`` (an ``ir.Value`` or int) of ``ptr``,
    (``near``) :data:`PREFETCH_NEAR` ahead into L1 and (``far``) :data:`PREFETCH_FAR` ahead into L2,
    one hint a 64-byte line (a stream read in order: the lines between hints are the previous call's)."""
    i64 = ir.IntType(64)
    base = ir.Constant(i64, offset) if isinstance(offset, int) else offset
    hints = ((PREFETCH_NEAR, 3),) * near + ((PREFETCH_FAR, 2),) * far
    for ahead, locality in hints:
        for line in range(0, span, 64):
            prefetch(builder, ptr, builder.add(base, ir.Constant(i64, ahead + line)), locality)


def pairwise(builder: ir.IRBuilder, values: list) -> ir.Value:
    """``values`` (a power of two of them, scalars or vectors) added pairwise in order,
    ``((v0 + v1) + (v2 + v3)) + ...``: one fixed order."""
    while len(values) > 1:
        values = [builder.fadd(values[i], values[i + 1]) for i in range(0, len(values), 2)]
    return values[0]


def fold(builder: ir.IRBuilder, v: ir.Value, combine) -> ir.Value:
    """The lanes of ``v`` combined halves at a time (lane i with lane i + n/2, ``combine(low,
    high)`` on the two half vectors) down to one: a fixed order."""
    n = v.type.count
    while n > 1:
        n //= 2
        low = builder.shuffle_vector(v, v, ir.Constant(vector(I32, n), list(range(n))))
        high = builder.shuffle_vector(v, v, ir.Constant(vector(I32, n), list(range(n, 2 * n))))
        v = combine(low, high)
    return builder.extract_element(v, ir.Constant(I32, 0))


def hsum(builder: ir.IRBuilder, v: ir.Value) -> ir.Value:
    """The lanes' sum, halves added pairwise (lane i + lane i + n/2) down to one: a fixed order."""
    return fold(builder, v, builder.fadd)


#: Element types and dimensions of the empty arrays a :class:`Choice` passes: one pair per value.
_DTYPES = tuple(np.dtype(t) for t in (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32,
                                      np.uint64, np.float32, np.float64, np.complex64, np.complex128, np.bool_))
_NDIMS = 3
CHOICES = len(_DTYPES) * _NDIMS


class Choice:
    """A compile-time choice among ``values``, passed to a jitted driver as an argument: an empty
    array whose element type and number of dimensions stand for the value, so a driver compiles
    (and caches) once per value and an ``@intrinsic`` reads it with :meth:`of` while generating
    code.  An array because numba types an ndarray argument in its C fast path: an object of a
    type of our own went through numba's Python ``typeof``, 2.6 us a call (0.3 us for the array),
    ~0.2 ms a token over a 125M model's F32 products; ``numba.literally`` re-resolved each call
    (~20 ms)."""

    def __init__(self, values):
        self.values = tuple(values)
        if len(self.values) > CHOICES:
            raise ValueError(f"a Choice holds at most {CHOICES} values")
        self._arrays = {v: np.empty((0,) * (1 + i // len(_DTYPES)), _DTYPES[i % len(_DTYPES)])
                        for i, v in enumerate(self.values)}

    def __call__(self, value) -> np.ndarray:
        """The argument that stands for ``value``."""
        return self._arrays[value]

    def of(self, ty: types.Array):
        """The value the numba type ``ty`` of such an argument stands for."""
        return self.values[(ty.ndim - 1) * len(_DTYPES) + _DTYPES.index(numpy_support.as_dtype(ty.dtype))]
