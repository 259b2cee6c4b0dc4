"""Compiled products ``y = x @ W^T`` on weights as they are stored, many rows at once.

``linear(x, w)`` takes ``x`` f32 ``[M, K]`` (``M`` = 1 for a decode step, up to a few hundred
for a batched step or a prefill chunk) and ``W [N, K]`` stored as F32, F16, BF16 or GGML blocks
(Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q5_K, Q6_K) and returns f32 ``[M, N]``.  Every kernel:

- reads the stored blocks in place: no dequantized copy of a weight, ever;
- loads each weight block once per call and uses it for all ``M`` rows;
- splits the output rows ``N`` over threads (numba's TBB layer when installed, else its
  ``workqueue``: :mod:`.threads`; as many threads as the stage's CPU share: :func:`set_threads`),
  never the reduction over ``K``;
- is **batch-invariant**: row ``m`` of the result is bitwise what the same row gives alone, for
  any ``M`` and thread count, because every ``(m, n)`` is the same fixed sequence of operations
  (block by block in order; within a block, fixed lanes combined in a fixed order).

Numerics (docs/ops.md, "Matmul"): by default the activations stay f32, and the result equals
dequantize-then-matmul within 1e-5 of the output's scale.  ``activations="q8_0"`` quantizes each
32-element block of ``x`` to int8 first, as llama.cpp's ``vec_dot_*_q8_0`` do (its numerics,
integer dot products): faster, and what the GGUF tests compare with llama.cpp.

Each element type's kernel lives in its family's module (``floats``, ``legacy``, ``kquants``) and
registers itself in :data:`KERNELS` with :func:`kernel` (both in :mod:`.registry`).
"""

from __future__ import annotations

import os

import numpy as np

from .freshness import SOURCES, STAMP, refresh

# Before any module below loads its cached code: a change to a file whose code others compile in
# (registry.py, simd*.py) clears theirs too (.freshness).
refresh(SOURCES, STAMP)

# Before numba compiles anything parallel: the layer of .threads (TBB when installed, else
# numba's own workqueue; never OpenMP's spinning pool).
from .threads import LAYER  # noqa: E402

os.environ.setdefault("NUMBA_THREADING_LAYER", LAYER)

import numba  # noqa: E402

# numba reads the variable when first imported, which another module (backends/numba.py, a
# script) may have done without it: then set the layer itself, which counts until the first
# parallel launch.
if numba.config.THREADING_LAYER == "default":
    numba.config.THREADING_LAYER = LAYER

from ...dtypes import DType  # noqa: E402
from ...tensor import Array, QuantizedArray  # noqa: E402
from .registry import JOINT, KERNELS, kernel  # noqa: E402,F401  (the family modules register there)

#: The activation modes of :func:`linear`.
ACTIVATIONS = ("f32", "q8_0")


def set_threads(n: int) -> None:
    """Threads the kernels split ``N`` over (the stage's CPU share; at most the cores numba saw)."""
    numba.set_num_threads(max(1, min(int(n), numba.config.NUMBA_NUM_THREADS)))


def supports(w: Array) -> bool:
    """Whether :func:`linear` takes this weight (2-D, a registered type)."""
    dtype = w.dtype if isinstance(w, QuantizedArray) else _float_dtype(w)
    data = w.data if isinstance(w, QuantizedArray) else w
    return dtype in KERNELS and len(w.shape) == 2 and data.flags.c_contiguous


def _float_dtype(w: np.ndarray) -> DType | None:
    try:
        return DType.from_numpy(w.dtype)
    except (KeyError, ValueError):
        return None


def _stored(w: Array) -> tuple[DType | None, np.ndarray]:
    """The weight's element type and the array its kernel reads (F16/BF16 as u16)."""
    if isinstance(w, QuantizedArray):
        return w.dtype, w.data
    dtype = _float_dtype(w)
    return dtype, (w.view(np.uint16) if dtype in (DType.F16, DType.BF16) else w)


def _activations(x: np.ndarray, k: int, activations: str) -> np.ndarray:
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {ACTIVATIONS}, got {activations!r}")
    if x.ndim != 2 or x.shape[1] != k:
        raise ValueError(f"linear: x {list(x.shape)} does not match the weight's {k} columns")
    return np.ascontiguousarray(x, np.float32)


def linear(x: np.ndarray, w: Array, *, activations: str = "f32") -> np.ndarray:
    """``x [M, K] @ W[N, K]^T`` as f32 ``[M, N]`` (see the module docstring)."""
    n, k = w.shape
    x = _activations(x, k, activations)
    dtype, data = _stored(w)
    out = np.empty((x.shape[0], n), np.float32)
    if x.shape[0] and n:
        KERNELS[dtype](x, data, out, activations == "q8_0")
    return out


def linear_many(x: np.ndarray, ws: list[Array], *, activations: str = "f32") -> list[np.ndarray]:
    """``[linear(x, w) for w in ws]``, the same bits, in one threaded launch where the weights'
    types share one joint kernel (:data:`registry.JOINT`: the float types each, the legacy block
    types together, the K-quants together): the threads then never
    wait between the products (a 125M model's gate and up products, 2 threads, from memory: 539
    against 607 us as two launches)."""
    if not ws:
        return []
    k = ws[0].shape[1]
    if any(w.shape[1] != k for w in ws):
        raise ValueError(f"linear_many: the weights' columns differ ({[list(w.shape) for w in ws]})")
    x = _activations(x, k, activations)
    stored = [_stored(w) for w in ws]
    joint = JOINT.get(stored[0][0])
    if joint is None or any(JOINT.get(d) is not joint for d, _ in stored) or not x.shape[0]:
        return [linear(x, w, activations=activations) for w in ws]
    outs = [np.empty((x.shape[0], w.shape[0]), np.float32) for w in ws]
    joint(x, [data for _, data in stored], outs, activations == "q8_0", [d for d, _ in stored])
    return outs


from . import floats, kquants, legacy  # noqa: E402,F401  (each registers its kernels)
