"""Normalisation kernels: RmsNorm, LayerNorm, BatchNorm, GroupNorm, InstanceNorm, AdaLN, FusedSkipNorm.

docs/ops.md, "Normalisation" and "FusedSkipNorm".  Statistics are computed in f32 (f64 for F64
inputs) with a two-pass biased variance, as torch's layer/group norm; the result is rounded once to
``x``'s dtype.
"""

from __future__ import annotations

import math

import numpy as np

from dist_runtime.ir.ops import AdaLN, BatchNorm, FusedSkipNorm, GroupNorm, InstanceNorm, LayerNorm, RmsNorm

from ._common import as_compute, cast_back, check_broadcastable_to, check_vector, compute_dtype, fail
from .registry import register


# -- helpers -----------------------------------------------------------------------------------
def _mean(x: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
    """Mean over ``axes`` (kept as size-1 dims); 0 over an empty slice, not a warning and NaN."""
    n = math.prod(x.shape[a] for a in axes)
    return x.sum(axis=axes, keepdims=True) / max(n, 1)


def _standardize(x: np.ndarray, axes: tuple[int, ...], eps: float) -> np.ndarray:
    """``(x - mean) / sqrt(var + eps)`` over ``axes``, biased variance, ``x`` in compute dtype."""
    centered = x - _mean(x, axes)
    rstd = 1.0 / np.sqrt(_mean(np.square(centered), axes) + float(eps))
    centered *= rstd
    return centered


def _per_channel(p: np.ndarray, rank: int, dtype: np.dtype) -> np.ndarray:
    """A ``[C]`` parameter shaped ``[C, 1, ..., 1]`` to act on dim 1 of a rank-``rank`` tensor."""
    return as_compute(p, dtype).reshape((-1,) + (1,) * (rank - 2))


def _affine(y: np.ndarray, weight, bias, expand) -> np.ndarray:
    """``y * weight + bias`` for the parameters that are given, each passed through ``expand``;
    in place: ``y`` is a fresh array of the output's shape."""
    if weight is not None:
        y *= expand(weight)
    if bias is not None:
        y += expand(bias)
    return y


# -- the maths ---------------------------------------------------------------------------------
def rms_norm(x: np.ndarray, weight: np.ndarray, *, eps: float) -> np.ndarray:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dim (Hugging Face LlamaRMSNorm)."""
    check_vector("RmsNorm", weight, x.shape[-1], "weight")
    ct = compute_dtype(x, weight)
    xc = as_compute(x, ct)
    y = xc * (1.0 / np.sqrt(_mean(np.square(xc), (-1,)) + float(eps)))
    y *= as_compute(weight, ct)
    return cast_back(y, x)


def layer_norm(x: np.ndarray, weight: np.ndarray | None = None, bias: np.ndarray | None = None, *,
               eps: float) -> np.ndarray:
    """Layer norm over the last dim, optional elementwise affine (torch F.layer_norm)."""
    for name, p in (("weight", weight), ("bias", bias)):
        check_vector("LayerNorm", p, x.shape[-1], name)
    ct = compute_dtype(x, weight, bias)
    y = _standardize(as_compute(x, ct), (-1,), eps)
    return cast_back(_affine(y, weight, bias, lambda p: as_compute(p, ct)), x)


def batch_norm(x: np.ndarray, scale: np.ndarray, bias: np.ndarray, mean: np.ndarray,
               var: np.ndarray, *, eps: float) -> np.ndarray:
    """Inference batch norm over channel dim 1 with the given statistics (ONNX BatchNormalization)."""
    for name, p in (("scale", scale), ("bias", bias), ("mean", mean), ("var", var)):
        check_vector("BatchNorm", p, x.shape[1], name)
    ct = compute_dtype(x, scale, bias, mean, var)
    scale, bias, mean, var = (_per_channel(p, x.ndim, ct) for p in (scale, bias, mean, var))
    # Per-channel factor first: one pass fewer over x than dividing then scaling.
    factor = scale / np.sqrt(var + float(eps))
    y = as_compute(x, ct) - mean
    y *= factor
    y += bias
    return cast_back(y, x)


def _grouped_norm(op_name: str, x: np.ndarray, weight, bias, groups: int, eps: float) -> np.ndarray:
    """Statistics per sample over each group of C/G channels and all trailing dims."""
    n, c = x.shape[:2]
    if groups < 1 or c % groups:
        raise fail(op_name, f"num_groups={groups} does not divide the {c} channels of x {list(x.shape)}")
    for name, p in (("weight", weight), ("bias", bias)):
        check_vector(op_name, p, c, name)
    ct = compute_dtype(x, weight, bias)
    # Explicit sizes, not -1: numpy cannot infer a -1 when the tensor is empty.
    grouped = as_compute(x, ct).reshape(n, groups, math.prod(x.shape[1:]) // groups)
    y = _standardize(grouped, (2,), eps).reshape(x.shape)
    return cast_back(_affine(y, weight, bias, lambda p: _per_channel(p, x.ndim, ct)), x)


def group_norm(x: np.ndarray, weight: np.ndarray | None = None, bias: np.ndarray | None = None, *,
               num_groups: int, eps: float) -> np.ndarray:
    """Group norm over channel dim 1 split into ``num_groups`` (torch nn.GroupNorm)."""
    return _grouped_norm("GroupNorm", x, weight, bias, num_groups, eps)


def instance_norm(x: np.ndarray, weight: np.ndarray | None = None, bias: np.ndarray | None = None,
                  *, eps: float) -> np.ndarray:
    """Instance norm: group norm with one channel per group (statistics over the spatial dims)."""
    return _grouped_norm("InstanceNorm", x, weight, bias, max(x.shape[1], 1), eps)


def ada_ln(x: np.ndarray, shift: np.ndarray, scale: np.ndarray, *, eps: float) -> np.ndarray:
    """DiT's ``modulate(LayerNorm(x), shift, scale) = LN(x) * (1 + scale) + shift``."""
    for name, p in (("shift", shift), ("scale", scale)):
        check_broadcastable_to("AdaLN", p, x.shape, name)
    ct = compute_dtype(x, shift, scale)
    y = _standardize(as_compute(x, ct), (-1,), eps)
    y *= 1.0 + as_compute(scale, ct)
    y += as_compute(shift, ct)
    return cast_back(y, x)


def fused_skip_norm(x: np.ndarray, residual: np.ndarray, weight: np.ndarray, *,
                    eps: float) -> tuple[np.ndarray, np.ndarray]:
    """``(x + residual, RmsNorm(x + residual))``, the norm taken from the unrounded sum."""
    if x.shape != residual.shape:
        raise fail("FusedSkipNorm", f"residual {list(residual.shape)} must have the shape of "
                                    f"x {list(x.shape)}")
    ct = compute_dtype(x, residual, weight)
    total = as_compute(x, ct) + as_compute(residual, ct)
    return cast_back(total, x), cast_back(rms_norm(total, weight, eps=eps), x)


# -- kernels -----------------------------------------------------------------------------------
@register(RmsNorm)
def _rms_norm(op, inputs, ctx):
    x, weight = inputs
    return (rms_norm(x, weight, eps=op.eps),)


@register(LayerNorm)
def _layer_norm(op, inputs, ctx):
    return (layer_norm(*inputs, eps=op.eps),)


@register(BatchNorm)
def _batch_norm(op, inputs, ctx):
    return (batch_norm(*inputs, eps=op.eps),)


@register(GroupNorm)
def _group_norm(op, inputs, ctx):
    return (group_norm(*inputs, num_groups=op.num_groups, eps=op.eps),)


@register(InstanceNorm)
def _instance_norm(op, inputs, ctx):
    return (instance_norm(*inputs, eps=op.eps),)


@register(AdaLN)
def _ada_ln(op, inputs, ctx):
    x, shift, scale = inputs
    return (ada_ln(x, shift, scale, eps=op.eps),)


@register(FusedSkipNorm)
def _fused_skip_norm(op, inputs, ctx):
    x, residual, weight = inputs
    return fused_skip_norm(x, residual, weight, eps=op.eps)
