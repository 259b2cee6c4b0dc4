"""Products: Matmul, LoraApply, Kron, MatrixInverse and the fused FusedNormMatmul, FusedSwiGlu.

docs/ops.md, "Matmul", "Linear algebra" and "Fused ops".  A weight operand (Matmul ``b``, ``W``,
``W_gate``, ``W_up``) may be F32, F16, BF16, F64 or GGML blocks: a 2-D one goes through
``quant_matmul``, which converts it in cache-sized bands (never a full float copy per call) or, for
a weight of the compute dtype, hands the stored array to BLAS as a transposed view.
"""

from __future__ import annotations

import numpy as np

from dist_runtime.dtypes import DType
from dist_runtime.ir.ops import FusedNormMatmul, FusedSwiGlu, Kron, LoraApply, Matmul, MatrixInverse
from dist_runtime.tensor import Array, QuantizedArray, dtype_of

from ._common import F64, as_compute, cast_back, compute_dtype, fail
from .elementwise import swiglu
from .norms import rms_norm
from .quant import quant_matmul, quant_matmul_kn, to_float
from .registry import register


def _compute_dtype(*arrays: Array | None) -> np.dtype:
    """f64 when a float input is F64, else f32 (block weights decode to f32)."""
    return compute_dtype(*(None if isinstance(a, QuantizedArray) else a for a in arrays))


def linear(x: np.ndarray, w: Array) -> np.ndarray:
    """``x @ w^T`` for ``x [..., K]`` and a weight ``w [N, K]``, in the compute dtype (not rounded
    back: the fused ops round once, at their end)."""
    return quant_matmul(as_compute(x, _compute_dtype(x, w)), w)


def _is_weight(b: Array) -> bool:
    """A ``b`` to convert in bands rather than widen whole: blocks, or a 2-D F16/BF16 matrix (a
    stored weight: widening it per call would copy it)."""
    return isinstance(b, QuantizedArray) or (b.ndim == 2 and dtype_of(b) in (DType.F16, DType.BF16))


def _batched_weight(a: np.ndarray, b: QuantizedArray, transpose_b: bool) -> np.ndarray:
    """``a @ b^T`` (or ``a @ b``) for block-quantized ``b [..., N, K]`` with batch dims: one banded
    product per matrix of ``b``, on the rows of ``a`` that broadcast against it."""
    batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    n = b.shape[-2] if transpose_b else b.shape[-1]
    b_batch = (1,) * (len(batch) - len(b.shape[:-2])) + b.shape[:-2]
    a_full = np.broadcast_to(a, batch + a.shape[-2:])
    y = np.empty(batch + (a.shape[-2], n), a.dtype)
    for idx in np.ndindex(*b.shape[:-2]):
        at = (0,) * (len(batch) - len(idx)) + idx  # idx of b, aligned on the right with batch
        where = tuple(slice(None) if size == 1 else i for size, i in zip(b_batch, at))
        w = QuantizedArray(b.data[idx], b.dtype, b.shape[len(idx):])
        y[where] = quant_matmul(a_full[where], w) if transpose_b else quant_matmul_kn(a_full[where], w)
    return y


def matmul(a: np.ndarray, b: Array, *, transpose_b: bool = True) -> np.ndarray:
    """numpy ``matmul(a, b^T)`` (``transpose_b``, ``b`` stored ``[..., N, K]``) or ``matmul(a, b)``;
    a 1-D ``b`` is a vector ``[K]`` whatever ``transpose_b``.  Result in ``a``'s dtype."""
    ct = _compute_dtype(a, b)
    ac = as_compute(a, ct)
    if b.ndim == 1:
        return cast_back(np.matmul(ac, to_float(b, ct)), a)
    if _is_weight(b):
        a2 = ac if a.ndim > 1 else ac[None]  # numpy's rule: a vector a is one row, removed after
        if b.ndim > 2:
            y = _batched_weight(a2, b, transpose_b)
        else:
            y = quant_matmul(a2, b) if transpose_b else quant_matmul_kn(a2, b)
        return cast_back(y if a.ndim > 1 else y[..., 0, :], a)
    bc = as_compute(b, ct)
    if transpose_b:
        if b.ndim == 2 and a.ndim > 1:  # one BLAS call on a transposed view, whatever a's batch
            return cast_back(quant_matmul(ac, bc), a)
        bc = np.swapaxes(bc, -1, -2)
    return cast_back(np.matmul(ac, bc), a)


def lora_apply(x: np.ndarray, w: Array, a: np.ndarray, b: np.ndarray, *, scale: float) -> np.ndarray:
    """``x @ W^T + scale * ((x @ A^T) @ B^T)`` (PEFT ``lora.Linear``, not merged)."""
    ct = _compute_dtype(x, w, a, b)
    xc = as_compute(x, ct)
    y = quant_matmul(xc, w)
    low_rank = (xc @ as_compute(a, ct).T) @ as_compute(b, ct).T
    low_rank *= float(scale)
    y += low_rank
    return cast_back(y, x)


def kron(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``torch.kron``: the lower-rank operand gets leading 1s; ``y[i * b.shape + j] = a[i] * b[j]``."""
    ct = compute_dtype(a, b)
    rank = max(a.ndim, b.ndim)
    sa = (1,) * (rank - a.ndim) + a.shape
    sb = (1,) * (rank - b.ndim) + b.shape
    # a on the even axes, b on the odd ones of a [a0, b0, a1, b1, ...] outer product
    ai = as_compute(a, ct).reshape([d for s in sa for d in (s, 1)])
    bi = as_compute(b, ct).reshape([d for s in sb for d in (1, s)])
    return cast_back((ai * bi).reshape([p * q for p, q in zip(sa, sb)]), a)


def matrix_inverse(x: np.ndarray) -> np.ndarray:
    """The inverse of each matrix ``[..., n, n]``: LAPACK ``gesv`` (LU with partial pivoting) in
    f64, rounded to ``x``'s dtype; a singular matrix is a ``KernelError`` naming its index."""
    x64 = x.astype(F64)
    try:
        return cast_back(np.linalg.inv(x64), x)
    except np.linalg.LinAlgError:
        pass
    for idx in np.ndindex(*x.shape[:-2]):  # find which one, for the message
        try:
            np.linalg.inv(x64[idx])
        except np.linalg.LinAlgError:
            where = f" at batch index {list(idx)}" if idx else ""
            raise fail("MatrixInverse", f"the {x.shape[-1]}x{x.shape[-1]} matrix{where} of x "
                                        f"{list(x.shape)} is singular: it has no inverse") from None
    raise AssertionError("numpy.linalg.inv failed on the batch but on no single matrix")


def fused_norm_matmul(x: np.ndarray, norm_weight: np.ndarray, w: Array, *, eps: float) -> np.ndarray:
    """``RmsNorm(x, norm_weight, eps) @ W^T``, the normed rows kept in the compute dtype."""
    normed = rms_norm(as_compute(x, _compute_dtype(x, norm_weight, w)), norm_weight, eps=eps)
    return cast_back(linear(normed, w), x)


def fused_swiglu(x: np.ndarray, w_gate: Array, w_up: Array) -> np.ndarray:
    """``silu(x @ W_gate^T) * (x @ W_up^T)`` (the Llama MLP before ``down_proj``)."""
    return cast_back(swiglu(linear(x, w_gate), linear(x, w_up)), x)


# -- kernels ------------------------------------------------------------------------------------
@register(Matmul)
def _matmul(op, inputs, ctx):
    a, b = inputs
    return (matmul(a, b, transpose_b=op.transpose_b),)


@register(LoraApply)
def _lora_apply(op, inputs, ctx):
    x, w, a, b = inputs
    return (lora_apply(x, w, a, b, scale=op.scale),)


@register(Kron)
def _kron(op, inputs, ctx):
    a, b = inputs
    return (kron(a, b),)


@register(MatrixInverse)
def _matrix_inverse(op, inputs, ctx):
    (x,) = inputs
    return (matrix_inverse(x),)


@register(FusedNormMatmul)
def _fused_norm_matmul(op, inputs, ctx):
    x, norm_weight, w = inputs
    return (fused_norm_matmul(x, norm_weight, w, eps=op.eps),)


@register(FusedSwiGlu)
def _fused_swiglu(op, inputs, ctx):
    x, w_gate, w_up = inputs
    return (fused_swiglu(x, w_gate, w_up),)
