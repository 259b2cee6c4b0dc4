"""F32 values stored as F16 in compiled code, bit for bit as numpy's ``astype(np.float16)`` stores
them: a KV cache kept in F16 (``--kv-dtype f16``) holds the same bits whether numpy or the compiled
program wrote a row, so a session's tokens do not depend on which did.

:func:`f16_bits` is numpy's own conversion (``npy_floatbits_to_halfbits``) in integer operations:
round to nearest, ties to even; beyond +-65504 an infinity; under the smallest subnormal a signed
zero; a NaN keeps the top of its payload.  Integer operations give the same bits on the vector and
the portable paths (a hardware conversion, F16C's, would need the CPU to have it and would quiet a
signalling NaN).  :func:`kept` is a value as a buffer of either type keeps it, chosen when the
caller compiles.
"""

from __future__ import annotations

import numpy as np
from numba import types
from numba.extending import intrinsic, overload

from .cache import jit

_jit = jit(nogil=True)


@intrinsic
def _bits(typingctx, x):
    """The bits of f32 ``x`` as a uint32."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], context.get_value_type(types.uint32))
    return types.uint32(types.float32), codegen


@_jit
def f16_bits(x):
    """F32 ``x`` as the bits of the F16 numpy's ``astype`` rounds it to (see the module docstring)."""
    f = np.uint32(_bits(np.float32(x)))
    sign = np.uint32((f & np.uint32(0x80000000)) >> np.uint32(16))
    exp = f & np.uint32(0x7F800000)
    if exp >= np.uint32(0x47800000):  # overflow, inf or NaN
        sig = f & np.uint32(0x007FFFFF)
        if exp == np.uint32(0x7F800000) and sig != 0:
            nan = np.uint32(0x7C00) + (sig >> np.uint32(13))
            return np.uint16(sign + (nan + np.uint32(1) if nan == np.uint32(0x7C00) else nan))
        return np.uint16(sign + np.uint32(0x7C00))
    if exp <= np.uint32(0x38000000):  # a subnormal half, or a signed zero
        if exp < np.uint32(0x33000000):
            return np.uint16(sign)
        e = exp >> np.uint32(23)
        sig = (np.uint32(0x00800000) + (f & np.uint32(0x007FFFFF))) >> (np.uint32(113) - e)
        if (sig & np.uint32(0x3FFF)) != np.uint32(0x1000) or (f & np.uint32(0x7FF)) != 0:
            sig += np.uint32(0x1000)
        return np.uint16(sign + (sig >> np.uint32(13)))
    half_exp = (exp - np.uint32(0x38000000)) >> np.uint32(13)
    sig = f & np.uint32(0x007FFFFF)
    if (sig & np.uint32(0x3FFF)) != np.uint32(0x1000):
        sig += np.uint32(0x1000)
    return np.uint16(sign + (((sig >> np.uint32(13)) + half_exp) & np.uint32(0xFFFF)))


def kept(x, buf):
    """F32 ``x`` as ``buf`` keeps it: itself in an F32 buffer, :func:`f16_bits` in a uint16 one
    (compiled callers only: the choice is made by ``buf``'s type when the caller compiles)."""
    raise NotImplementedError("kept() is for compiled code")


@overload(kept, jit_options={"nogil": True})
def _kept(x, buf):
    if isinstance(buf, types.Array) and buf.dtype == types.uint16:
        return lambda x, buf: f16_bits(x)
    return lambda x, buf: x
