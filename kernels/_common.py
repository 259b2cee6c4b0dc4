"""Helpers every kernel family shares: the compute dtype, widening and rounding back, axes, errors.

docs/ops.md, "Computation": kernels compute in f32 (f64 when an input is F64); F16 and BF16 inputs
are widened to f32 and the result is rounded once to the output dtype (the first input's).
"""

from __future__ import annotations

import numpy as np

from dist_runtime.errors import KernelError

F32 = np.dtype(np.float32)
F64 = np.dtype(np.float64)


def fail(op_name: str, message: str) -> KernelError:
    """The error to raise: ``raise fail("Concat", "...")``."""
    return KernelError(f"{op_name}: {message}")


def compute_dtype(*arrays) -> np.dtype:
    """f64 when any input is F64, else f32 (None entries, absent optional inputs, are skipped)."""
    for a in arrays:
        if a is not None and a.dtype == F64:
            return F64
    return F32


def as_compute(x: np.ndarray, dtype: np.dtype = F32) -> np.ndarray:
    """``x`` in the compute dtype; no copy when it already is (the f32 fast path)."""
    return x.astype(dtype, copy=False)


def cast_back(y, like) -> np.ndarray:
    """``y`` rounded once (to nearest even) to the dtype of ``like`` (an array or a dtype).

    Always an ndarray: a ufunc on 0-d arrays returns a numpy scalar, which this wraps.
    """
    return np.asarray(y, dtype=getattr(like, "dtype", like))


def axis(op_name: str, dim: int, rank: int) -> int:
    """Normalise a possibly negative axis to ``0 <= axis < rank`` (docs/ops.md, "Axes")."""
    if not -rank <= dim < rank:
        raise fail(op_name, f"dim={dim} is out of range for rank {rank}")
    return dim % rank


def finfo_max(dtype: np.dtype) -> float:
    """The largest finite value of a float dtype (BF16 included, through ml_dtypes)."""
    dtype = np.dtype(dtype)
    if dtype.name == "bfloat16":
        import ml_dtypes

        return float(ml_dtypes.finfo(dtype).max)
    return float(np.finfo(dtype).max)


def check_vector(op_name: str, p: np.ndarray | None, n: int, what: str) -> None:
    """An optional per-feature parameter must be ``[n]`` (a dim unknown at load time may differ)."""
    if p is not None and p.shape != (n,):
        raise fail(op_name, f"{what} has shape {list(p.shape)}, expected [{n}]")


def check_broadcastable_to(op_name: str, p: np.ndarray, shape: tuple[int, ...], what: str) -> None:
    """``p`` must stretch to ``shape`` (ONNX unidirectional broadcasting), not widen it."""
    if p.ndim > len(shape) or any(d != 1 and d != t for d, t in zip(p.shape[::-1], shape[::-1])):
        raise fail(op_name, f"{what} {list(p.shape)} is not broadcastable to {list(shape)}")
