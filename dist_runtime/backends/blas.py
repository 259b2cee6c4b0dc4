"""``numpy-blas``: a second backend for the matmul family, on numpy's BLAS, with weights packed once.

It takes Matmul (2-D weight ``b``), FusedNormMatmul, FusedSwiGlu and LoraApply when the activation
and every weight are F32 or F16; everything else (norms, attention, block-quantized or BF16
weights, F64) it declines, and :func:`dist_runtime.backends.assign.assign_backends` sends those
nodes to the CPU library.  What it does differently from the CPU library is what a device backend does when
it uploads weights: an F16 weight is widened to F32 *once*, on the node's first run, and kept (the
CPU library converts it in cache-sized bands on every call: less memory, more work per token).
F32 weights are used as stored, as transposed views: no copy.  Results are computed in F32 and
rounded once to the activation's dtype, as docs/ops.md prescribes, so they agree with the CPU
library within float rounding.

It is always available (numpy only), so CI exercises backend selection -- hints, the default,
fallbacks, the plan's reasons -- with a backend that computes real results.  Its ``hint`` is set
per instance (``NumpyBlasBackend(hint=BackendHint.WGPU)`` serves the nodes hinted ``wgpu``); the
default, ``CPU``, makes it a default-only backend, since a node hinted ``cpu`` asks for the numpy
kernel library itself.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import numpy as np

from ..dtypes import DType
from ..ir.graph import Node, TensorSpec
from ..ir.hints import BackendHint
from ..ir.ops import FusedNormMatmul, FusedSwiGlu, LoraApply, Matmul, OpPayload
from . import BoundKernel, OpEntry, TableBackend, register_backend

F32 = np.dtype(np.float32)

#: The element types this backend family computes with (activations and weights).
PLAIN = frozenset({DType.F32, DType.F16})

#: Which inputs of each op are matrices used as ``x @ W^T`` (packed once, by slot).
WEIGHT_SLOTS: dict[type, tuple[int, ...]] = {
    Matmul: (1,), FusedNormMatmul: (2,), FusedSwiGlu: (1, 2), LoraApply: (1, 2, 3),
}


def matmul_family_supports(op: OpPayload, input_specs: Sequence[TensorSpec]) -> bool:
    """The matmul-family ops with 2-D weights (their element types are the backend's to check).

    Matmul: ``b`` a 2-D matrix (a stored weight, or any 2-D operand), either ``transpose_b``;
    a batched ``b`` (attention-style products) is left to the CPU library.
    """
    kind = type(op)
    if kind not in WEIGHT_SLOTS or not input_specs:
        return False
    if any(len(input_specs[i].shape) != 2 for i in WEIGHT_SLOTS[kind] if i < len(input_specs)):
        return False
    return len(input_specs[0].shape) >= 1


#: ``binder(op, packed) -> BoundKernel``: one matmul-family op, its weights packed by ``packed``.
FamilyBinder = Callable[[OpPayload, "PackCache"], BoundKernel]


def family_table(binders: Mapping[type, FamilyBinder]) -> dict[type, OpEntry]:
    """A matmul-family backend's op table: every op it binds, taken as :func:`matmul_family_supports` says."""
    return {kind: OpEntry(matmul_family_supports, bind) for kind, bind in binders.items()}


class PackCache:
    """One packed copy per (node, slot), rebuilt when a different array arrives in that slot.

    A stored weight is the same object on every run, so it is packed once; an operand that
    changes each run is repacked each time and never accumulates.
    """

    def __init__(self, pack: Callable[[np.ndarray], object]) -> None:
        self._pack = pack
        self._slots: dict[int, tuple[np.ndarray, object]] = {}

    def __call__(self, slot: int, w: np.ndarray):
        hit = self._slots.get(slot)
        if hit is None or hit[0] is not w:
            hit = self._slots[slot] = (w, self._pack(w))
        return hit[1]


def _f32(w: np.ndarray) -> np.ndarray:
    """An F32 view (F32 as stored) or a widened contiguous copy (F16)."""
    return w if w.dtype == F32 else np.ascontiguousarray(w, F32)


def _rms_numpy(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RmsNorm in F32: ``x / sqrt(mean(x^2) + eps) * weight``."""
    ms = np.einsum("...k,...k->...", x, x)[..., None]
    ms /= max(x.shape[-1], 1)
    ms += float(eps)
    y = x / np.sqrt(ms)
    y *= weight
    return y


def _lin(packed: PackCache, x: np.ndarray, slot: int, w: np.ndarray) -> np.ndarray:
    """``x @ W^T`` with the weight in ``slot`` packed once."""
    return x @ packed(slot, w).T


def _silu_mul_numpy(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """``silu(g) * u`` in place in ``g`` (both fresh F32 products)."""
    with np.errstate(over="ignore"):
        d = np.exp(-g)
    d += 1.0
    g /= d
    g *= u
    return g


class MatmulFamilyBackend(TableBackend):
    """What a matmul-family backend has (numpy-blas, or one on a device library): binders that take
    the op and a :class:`PackCache` of ``pack`` (one per node), and block-quantized weights left to
    the CPU library's kernel."""

    dtypes = PLAIN
    pack: Callable[[np.ndarray], object]  # a weight as the binders use it, made once per node and slot

    def bind(self, node: Node) -> BoundKernel:
        return self.entry(node).bind(node.op, PackCache(self.pack))


def _matmul(op: Matmul, packed: PackCache) -> BoundKernel:
    def run(inputs, ctx):
        a, b = inputs
        w = packed(1, b)
        y = _f32(a) @ (w.T if op.transpose_b else w)
        return (y.astype(a.dtype, copy=False),)
    return run


def _norm_matmul(op: FusedNormMatmul, packed: PackCache) -> BoundKernel:
    def run(inputs, ctx):
        x, norm_w, w = inputs
        return (_lin(packed, _rms_numpy(_f32(x), _f32(norm_w), op.eps), 2, w).astype(x.dtype, copy=False),)
    return run


def _swiglu(op: FusedSwiGlu, packed: PackCache) -> BoundKernel:
    def run(inputs, ctx):
        x, w_gate, w_up = inputs
        xf = _f32(x)
        return (_silu_mul_numpy(_lin(packed, xf, 1, w_gate), _lin(packed, xf, 2, w_up)).astype(x.dtype, copy=False),)
    return run


def _lora(op: LoraApply, packed: PackCache) -> BoundKernel:
    def run(inputs, ctx):
        x, w, a, b = inputs
        xf = _f32(x)
        y = _lin(packed, xf, 1, w)
        low = _lin(packed, _lin(packed, xf, 2, a), 3, b)
        low *= float(op.scale)
        y += low
        return (y.astype(x.dtype, copy=False),)
    return run


class NumpyBlasBackend(MatmulFamilyBackend):
    """The matmul family on numpy/BLAS in F32, F16 weights widened once (see the module docstring)."""

    name = "numpy-blas"
    batch_invariant = False  # BLAS blocks a product by its rows
    ops = family_table({Matmul: _matmul, FusedNormMatmul: _norm_matmul, FusedSwiGlu: _swiglu, LoraApply: _lora})

    pack = staticmethod(_f32)

    def __init__(self, hint: BackendHint = BackendHint.CPU) -> None:
        self.hint = BackendHint(hint)



register_backend("numpy-blas", NumpyBlasBackend)
