"""``torch``: the matmul family on PyTorch's CPU kernels, when torch is installed (hint ``TORCH``).

Takes what numpy-blas takes (:class:`dist_runtime.backends.blas.MatmulFamilyBackend`) -- Matmul
with a 2-D ``b``, FusedNormMatmul, FusedSwiGlu, LoraApply, on F32/F16 activations and weights --
and computes it with ``torch.nn.functional.linear`` in F32.  Arrays cross zero-copy (``torch.from_numpy`` in,
``Tensor.numpy()`` out); a weight is wrapped once per node (an F16 weight widened to F32 once,
as a device backend uploads it) and reused on every run.  Results are rounded once to the
activation's dtype, so they agree with the CPU library within float rounding.

torch is not a dependency of the project (CI does not install it): importing this module without
torch raises ``ImportError``, and ``make_backends(["torch"])`` names the missing package.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
import torch.nn.functional as F

from ..ir.hints import BackendHint
from ..ir.ops import FusedNormMatmul, FusedSwiGlu, LoraApply, Matmul
from . import BoundKernel, register_backend
from .blas import MatmulFamilyBackend, PackCache, family_table

F32 = np.dtype(np.float32)


def _tensor(a: np.ndarray) -> torch.Tensor:
    """``a`` as an F32 torch tensor: zero-copy for F32, one widening copy for F16.

    Read-only arrays (weights mapped from a ``.model`` file) are shared too: this backend never
    writes into its inputs, so torch's warning about non-writable arrays is silenced.
    """
    if a.dtype != F32:
        a = a.astype(F32)
    if a.flags.writeable:
        return torch.from_numpy(a)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a)


def _out(y: torch.Tensor, like: np.ndarray) -> np.ndarray:
    return y.numpy().astype(like.dtype, copy=False)


def _matmul(op: Matmul, packed: PackCache) -> BoundKernel:
    def run(inputs, ctx):
        a, b = inputs
        w = packed(1, b)
        y = F.linear(_tensor(a), w) if op.transpose_b else torch.matmul(_tensor(a), w)
        return (_out(y, a),)
    return run


def _norm_matmul(op: FusedNormMatmul, packed: PackCache) -> BoundKernel:
    def run(inputs, ctx):
        x, norm_w, w = inputs
        xt = _tensor(x)
        normed = xt * torch.rsqrt(xt.square().mean(-1, keepdim=True) + float(op.eps))
        normed.mul_(packed(1, norm_w))
        return (_out(F.linear(normed, packed(2, w)), x),)
    return run


def _swiglu(op: FusedSwiGlu, packed: PackCache) -> BoundKernel:
    def run(inputs, ctx):
        x, w_gate, w_up = inputs
        xt = _tensor(x)
        gate = F.silu(F.linear(xt, packed(1, w_gate)), inplace=True)
        return (_out(gate.mul_(F.linear(xt, packed(2, w_up))), x),)
    return run


def _lora(op: LoraApply, packed: PackCache) -> BoundKernel:
    def run(inputs, ctx):
        x, w, a, b = inputs
        xt = _tensor(x)
        low = F.linear(F.linear(xt, packed(2, a)), packed(3, b))
        return (_out(F.linear(xt, packed(1, w)).add_(low, alpha=float(op.scale)), x),)
    return run


class TorchBackend(MatmulFamilyBackend):
    """The matmul family through ``torch.nn.functional.linear`` (see the module docstring)."""

    name = "torch"
    hint = BackendHint.TORCH
    ops = family_table({Matmul: _matmul, FusedNormMatmul: _norm_matmul, FusedSwiGlu: _swiglu, LoraApply: _lora})
    pack = staticmethod(_tensor)

    def __init__(self, threads: int | None = None) -> None:
        if threads is not None:
            torch.set_num_threads(threads)

    def float_matmul(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return _out(F.linear(_tensor(x), _tensor(w)), x)


register_backend("torch", TorchBackend)
