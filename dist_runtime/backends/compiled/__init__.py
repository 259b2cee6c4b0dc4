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

Each weight type's route -- its family (``floats``, ``legacy``, ``kquants``), rows kernel, joint
kernel and tile -- is a row of the product table, :data:`.products.PRODUCTS`.

The kernels are cached per user and machine, by the sources' contents and the CPU path
(:mod:`.cache`).  Importing this package changes no process state.  :func:`init` does, once,
before compiled code first runs: it chooses numba's threading layer (:mod:`.threads`) and marks
the cache directory used, removing those of other sources left unused for a month.
:func:`linear`, :func:`linear_many` and the numba backend call it; so may any caller, any number of
times.
"""

from __future__ import annotations

import numpy as np

from ...dtypes import DType
from ...tensor import Array, QuantizedArray
from . import cache, cpu, threads
from .products import ACTIVATIONS, PRODUCTS, route  # noqa: F401  (the package's table)

_ready = False


def init() -> str:
    """Ready this process for compiled code (idempotent): the threading layer chosen and set
    before numba's first parallel launch, the cache directory marked used and old ones pruned.
    Returns what was chosen and why (``inspect --plan`` shows it)."""
    global _ready
    if not _ready:
        threads.init()
        cache.prune()
        _ready = True
    return f"{cpu.REASON}; {threads.REASON}"


def set_threads(n: int) -> None:
    """Threads the kernels split ``N`` over (the stage's CPU share; at most the cores numba saw)."""
    import numba

    init()
    numba.set_num_threads(max(1, min(int(n), numba.config.NUMBA_NUM_THREADS)))


def supports(w: Array) -> bool:
    """Whether :func:`linear` takes this weight (2-D, a type of the product table)."""
    dtype = w.dtype if isinstance(w, QuantizedArray) else _float_dtype(w)
    data = w.data if isinstance(w, QuantizedArray) else w
    return dtype in PRODUCTS and len(w.shape) == 2 and data.flags.c_contiguous


def _float_dtype(w: np.ndarray) -> DType | None:
    try:
        return DType.from_numpy(w.dtype)
    except (KeyError, ValueError):
        return None


def stored(w: Array) -> tuple[DType | None, np.ndarray]:
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
    init()
    n, k = w.shape
    x = _activations(x, k, activations)
    dtype, data = stored(w)
    kernel = route(dtype, activations).rows
    out = np.empty((x.shape[0], n), np.float32)
    if x.shape[0] and n:
        kernel(x, data, out)
    return out


def linear_many(x: np.ndarray, ws: list[Array], *, activations: str = "f32") -> list[np.ndarray]:
    """``[linear(x, w) for w in ws]``, the same bits, in one threaded launch where the weights'
    routes share one joint kernel (each float format its own, the legacy block types together,
    the K-quants together): the threads then never wait between the products (a 125M model's
    gate and up products, 2 threads, from memory: 539 against 607 us as two launches)."""
    if not ws:
        return []
    init()
    k = ws[0].shape[1]
    if any(w.shape[1] != k for w in ws):
        raise ValueError(f"linear_many: the weights' columns differ ({[list(w.shape) for w in ws]})")
    x = _activations(x, k, activations)
    kept = [stored(w) for w in ws]
    routes = [route(d, activations) for d, _ in kept]
    if any(r.joint is not routes[0].joint for r in routes) or not x.shape[0]:
        return [linear(x, w, activations=activations) for w in ws]
    outs = [np.empty((x.shape[0], w.shape[0]), np.float32) for w in ws]
    routes[0].joint(x, [data for _, data in kept], outs, [r.code for r in routes])
    return outs
