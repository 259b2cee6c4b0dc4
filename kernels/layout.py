"""Layout kernels: Transpose, Reshape, Permute, Concat, Split, Chunk.

docs/ops.md, "Arithmetic and layout".  They move elements of any non-block dtype (integers and
BOOL included) without converting them.  Results are row-major (C-contiguous), as every tensor of
the runtime: a transposed view is materialised, a piece of a split is copied only when it is not
already contiguous (``np.asarray(order="C")``, which, unlike ``np.ascontiguousarray``, keeps a 0-d
array 0-d).  Dims that were unknown at load time are checked here.
"""

from __future__ import annotations

import math

import numpy as np

from dist_runtime.ir.ops import Chunk, Concat, Permute, Reshape, Split, Transpose

from ._common import axis, fail
from .registry import register


def transpose(x: np.ndarray, *, dim0: int = -2, dim1: int = -1) -> np.ndarray:
    """``x.swapaxes(dim0, dim1)`` in row-major order (torch.transpose)."""
    d0, d1 = axis("Transpose", dim0, x.ndim), axis("Transpose", dim1, x.ndim)
    return np.asarray(np.swapaxes(x, d0, d1), order="C")


def reshape(x: np.ndarray, *, shape: tuple[int, ...]) -> np.ndarray:
    """ONNX Reshape with ``allowzero=0``: a 0 copies the input dim, one -1 is inferred."""
    if any(d < -1 for d in shape) or shape.count(-1) > 1:
        raise fail("Reshape", f"shape {list(shape)} may hold dims >= 0 and at most one -1")
    if any(d == 0 for d in shape[x.ndim:]):
        raise fail("Reshape", f"shape {list(shape)} copies a dim (a 0) beyond the rank of x {list(x.shape)}")
    target = tuple(x.shape[i] if d == 0 else d for i, d in enumerate(shape))
    known = math.prod(d for d in target if d != -1)
    if -1 in target:
        ok = known > 0 and x.size % known == 0
    else:
        ok = known == x.size
    if not ok:
        raise fail("Reshape", f"x {list(x.shape)} ({x.size} elements) cannot be reshaped to "
                              f"{list(shape)} (resolved {list(target)})")
    return np.asarray(x, order="C").reshape(target)


def permute(x: np.ndarray, *, perm: tuple[int, ...]) -> np.ndarray:
    """``numpy.transpose(x, perm)`` in row-major order (torch.permute)."""
    axes = [axis("Permute", p, x.ndim) for p in perm]
    if sorted(axes) != list(range(x.ndim)):
        raise fail("Permute", f"perm {list(perm)} is not a permutation of the dims of x {list(x.shape)}")
    return np.asarray(np.transpose(x, axes), order="C")


def concat(xs, *, dim: int = -1) -> np.ndarray:
    """The inputs' slices in order along ``dim`` (torch.cat)."""
    first = xs[0]
    ax = axis("Concat", dim, first.ndim)
    others = [j for j in range(first.ndim) if j != ax]
    for i, x in enumerate(xs[1:], 1):
        if x.ndim != first.ndim or any(x.shape[j] != first.shape[j] for j in others):
            raise fail("Concat", f"input {i} {list(x.shape)} differs from input 0 {list(first.shape)} "
                                 f"outside dim {ax}")
    return np.concatenate(xs, axis=ax)


def pieces(x: np.ndarray, ax: int, sizes) -> list[np.ndarray]:
    """Views of consecutive pieces of ``x`` of the given lengths along axis ``ax``; the caller checks
    that they fit."""
    lead = (slice(None),) * ax
    out, start = [], 0
    for size in sizes:
        out.append(x[lead + (slice(start, start + size),)])
        start += size
    return out


def split(x: np.ndarray, *, sizes: tuple[int, ...], dim: int = -1) -> tuple[np.ndarray, ...]:
    """Pieces of the given lengths along ``dim`` (torch.split with a list of sizes)."""
    ax = axis("Split", dim, x.ndim)
    if not sizes or any(s < 0 for s in sizes) or sum(sizes) != x.shape[ax]:
        raise fail("Split", f"sizes {list(sizes)} do not add up to dim {ax} of x {list(x.shape)}")
    return tuple(np.asarray(p, order="C") for p in pieces(x, ax, sizes))


def chunk(x: np.ndarray, *, chunks: int, dim: int = -1) -> tuple[np.ndarray, ...]:
    """``chunks`` equal pieces along ``dim``; the dim must divide evenly (unlike torch.chunk)."""
    ax = axis("Chunk", dim, x.ndim)
    if chunks < 1 or x.shape[ax] % chunks:
        raise fail("Chunk", f"dim {ax} of x {list(x.shape)} does not split into {chunks} equal pieces")
    return split(x, sizes=(x.shape[ax] // chunks,) * chunks, dim=ax)


@register(Transpose)
def _transpose(op, inputs, ctx):
    return (transpose(inputs[0], dim0=op.dim0, dim1=op.dim1),)


@register(Reshape)
def _reshape(op, inputs, ctx):
    return (reshape(inputs[0], shape=op.shape),)


@register(Permute)
def _permute(op, inputs, ctx):
    return (permute(inputs[0], perm=op.perm),)


@register(Concat)
def _concat(op, inputs, ctx):
    return (concat(list(inputs), dim=op.dim),)


@register(Split)
def _split(op, inputs, ctx):
    return split(inputs[0], sizes=op.sizes, dim=op.dim)


@register(Chunk)
def _chunk(op, inputs, ctx):
    return chunk(inputs[0], chunks=op.chunks, dim=op.dim)
