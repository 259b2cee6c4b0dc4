"""Resampling and patches: Interpolate, PixelShuffle, PixelUnshuffle, PatchEmbed, Unpatchify.

docs/ops.md, "Resampling and patches".  Interpolate is separable: each of the two resized axes is
one weighted gather, ``y = sum_t take(x, index[:, t]) * weight[:, t]`` with 1 tap (nearest), 2
(bilinear) or 4 (bicubic) per output position; indices and weights follow torch's CPU kernels
(``UpSample.h``) step by step, in the compute dtype, so the results match torch's rounding too.
PatchEmbed is the convolution core of ``kernels.conv`` with kernel = stride = patch.
"""

from __future__ import annotations

import math

import numpy as np

from dist_runtime.ir.ops import Interpolate, PatchEmbed, PixelShuffle, PixelUnshuffle, Unpatchify

from ._common import as_compute, cast_back, compute_dtype, fail
from .conv import conv_nd
from .registry import register

_MODES = {0: "nearest", 1: "bilinear", 2: "bicubic"}
_CUBIC_A = -0.75  # torch's (and OpenCV's) Keys coefficient


# -- Interpolate -------------------------------------------------------------------------------
def interpolate(x: np.ndarray, *, mode: str = "nearest", align_corners: bool = False, out_h: int = 0,
                out_w: int = 0, scale_h: float = 1.0, scale_w: float = 1.0) -> np.ndarray:
    """Resize the last two dims of ``x`` ``[..., H, W]`` like ``torch.nn.functional.interpolate``.

    An axis takes ``out_*`` when non-zero, else ``floor(length * scale_*)``; ``mode`` is
    ``nearest`` (torch's legacy asymmetric floor), ``bilinear`` or ``bicubic`` (A = -0.75).
    """
    if mode not in _MODES.values():
        raise fail("Interpolate", f"mode {mode!r} is not one of {', '.join(_MODES.values())}")
    if mode == "nearest" and align_corners:
        raise fail("Interpolate", "align_corners applies to bilinear and bicubic only")
    y = as_compute(x, compute_dtype(x))
    # W first, then H: torch's bicubic kernel blends each row before the rows (rounding order).
    for axis, size, scale in ((-1, out_w, scale_w), (-2, out_h, scale_h)):
        index, weight = _taps(mode, align_corners, y.shape[axis], size, scale, y.dtype)
        if index is not None:
            y = _gather(y, axis, index, weight)
    return cast_back(y, x)


def _taps(mode: str, align_corners: bool, n_in: int, size: int, scale: float, dtype) -> tuple:
    """Source indices ``[out, T]`` and weights ``[out, T]`` (None for nearest) along one axis;
    ``(None, None)`` when the axis is copied unchanged."""
    n_out = _out_length(n_in, size, scale)
    from_scale = None if size else scale
    if n_out == n_in and mode != "bicubic":  # torch copies the axis, whatever the scale said
        return None, None
    dst = np.arange(n_out)
    if mode == "nearest":
        return _nearest_index(dst, n_in, n_out, from_scale)[:, None], None
    ratio = _coord_scale(n_in, n_out, from_scale, align_corners, dtype)
    src = ratio * dst.astype(dtype) if align_corners else ratio * (dst.astype(dtype) + 0.5) - 0.5
    if mode == "bilinear":
        src = np.maximum(src, 0.0)
        i0 = np.minimum(np.floor(src).astype(np.int64), n_in - 1)
        lam = np.clip(src - i0.astype(dtype), 0.0, 1.0)
        index = np.stack([i0, np.minimum(i0 + 1, n_in - 1)], axis=1)
        return index, np.stack([1.0 - lam, lam], axis=1)
    i0 = np.floor(src).astype(np.int64)  # bicubic: unclamped source, edge-replicated taps
    t = src - i0.astype(dtype)
    index = np.clip(i0[:, None] + np.arange(-1, 3), 0, n_in - 1)
    return index, _keys_weights(t)


def _out_length(n_in: int, size: int, scale: float) -> int:
    """``size`` if non-zero, else ``floor(n_in * scale)`` in double (torch's size rule), >= 1."""
    if n_in < 1:
        raise fail("Interpolate", f"cannot resize an axis of length {n_in}")
    if size:
        return size
    if not (math.isfinite(scale) and scale > 0):
        raise fail("Interpolate", f"scale {scale} must be finite and > 0")
    n_out = math.floor(n_in * scale)
    if n_out < 1:
        raise fail("Interpolate", f"an axis of length {n_in} times scale {scale:.7g} gives {n_out} < 1 "
                                  f"output positions")
    return n_out


def _nearest_index(dst: np.ndarray, n_in: int, n_out: int, from_scale) -> np.ndarray:
    """torch's legacy ``nearest``: ``min(floor(dst * scale), in - 1)`` with the scale in f32.

    torch keeps two backward-compatible shortcuts that win over the scale: an output as long as
    the input copies it (see :func:`_taps`), one twice as long repeats each element (``dst >> 1``).
    """
    if n_out == 2 * n_in:
        return dst >> 1
    ratio = np.float32(1.0 / from_scale) if from_scale else np.float32(n_in) / np.float32(n_out)
    return np.minimum(np.floor(dst.astype(np.float32) * ratio).astype(np.int64), n_in - 1)


def _coord_scale(n_in: int, n_out: int, from_scale, align_corners: bool, dtype):
    """torch's ``area_pixel_compute_scale``: output step in input pixels, in the compute dtype."""
    if align_corners:
        return dtype.type(n_in - 1) / dtype.type(n_out - 1) if n_out > 1 else dtype.type(0.0)
    if from_scale:
        return dtype.type(1.0 / from_scale)  # torch: 1/scale in double, then rounded
    return dtype.type(n_in) / dtype.type(n_out)


def _keys_weights(t: np.ndarray) -> np.ndarray:
    """Keys' cubic convolution weights ``[out, 4]`` of the taps at distances 1+t, t, 1-t, 2-t."""
    a = _CUBIC_A

    def near(d):  # |d| <= 1
        return ((a + 2.0) * d - (a + 3.0)) * d * d + 1.0

    def far(d):  # 1 < |d| < 2
        return ((a * d - 5.0 * a) * d + 8.0 * a) * d - 4.0 * a

    return np.stack([far(t + 1.0), near(t), near(1.0 - t), far(2.0 - t)], axis=1)


def _gather(x: np.ndarray, axis: int, index: np.ndarray, weight) -> np.ndarray:
    """``sum_t take(x, index[:, t], axis) * weight[:, t]`` (weights broadcast along ``axis``)."""
    if weight is None:
        return np.take(x, index[:, 0], axis=axis)
    bcast = (slice(None),) + (None,) * (-1 - axis)  # [out] for the last axis, [out, 1] for -2
    y = np.take(x, index[:, 0], axis=axis) * weight[:, 0][bcast]
    for t in range(1, index.shape[1]):
        y += np.take(x, index[:, t], axis=axis) * weight[:, t][bcast]
    return y


# -- pixel shuffles ----------------------------------------------------------------------------
def pixel_shuffle(x: np.ndarray, *, upscale: int) -> np.ndarray:
    """``[..., C*r*r, H, W]`` -> ``[..., C, H*r, W*r]``: ``y[c, h*r+i, w*r+j] = x[c*r*r + i*r + j, h, w]``."""
    r = upscale
    *lead, crr, h, w = x.shape
    if r < 1 or crr % (r * r):
        raise fail("PixelShuffle", f"input {list(x.shape)}: dim -3 ({crr}) is not a multiple of "
                                   f"upscale**2 = {r * r}")
    n = len(lead)
    y = x.reshape(*lead, crr // (r * r), r, r, h, w)
    y = y.transpose(*range(n), n, n + 3, n + 1, n + 4, n + 2)  # c, h, i, w, j
    return np.ascontiguousarray(y).reshape(*lead, crr // (r * r), h * r, w * r)


def pixel_unshuffle(x: np.ndarray, *, downscale: int) -> np.ndarray:
    """``[..., C, H*r, W*r]`` -> ``[..., C*r*r, H, W]``, the inverse of :func:`pixel_shuffle`."""
    r = downscale
    *lead, c, hr, wr = x.shape
    if r < 1 or hr % r or wr % r:
        raise fail("PixelUnshuffle", f"input {list(x.shape)}: dims -2, -1 ({hr}, {wr}) are not "
                                     f"multiples of downscale={r}")
    n = len(lead)
    y = x.reshape(*lead, c, hr // r, r, wr // r, r)
    y = y.transpose(*range(n), n, n + 2, n + 4, n + 1, n + 3)  # c, i, j, h, w
    return np.ascontiguousarray(y).reshape(*lead, c * r * r, hr // r, wr // r)


# -- patches -----------------------------------------------------------------------------------
def patch_embed(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None = None, *, patch_h: int,
                patch_w: int) -> np.ndarray:
    """ViT patch embedding ``[N, C, H, W]`` -> ``[N, (H/ph)*(W/pw), D]``: a Conv2d with kernel =
    stride = patch, then ``flatten(2).transpose(1, 2)`` (patch (i, j) is token ``i*(W/pw) + j``)."""
    n, _, h, wd = x.shape
    if h % patch_h or wd % patch_w or tuple(w.shape[2:]) != (patch_h, patch_w):
        raise fail("PatchEmbed", f"input {list(x.shape)} and weight {list(w.shape)} do not tile into "
                                 f"{patch_h}x{patch_w} patches")
    y = conv_nd(x, w, bias, stride=(patch_h, patch_w), pads=[(0, 0), (0, 0)], dilation=(1, 1),
                groups=1, name="PatchEmbed")  # [N, D, H/ph, W/pw]
    tokens = y.reshape(n, w.shape[0], -1 if n else (h // patch_h) * (wd // patch_w)).transpose(0, 2, 1)
    return cast_back(np.ascontiguousarray(tokens), x)


def unpatchify(x: np.ndarray, *, patch_h: int, patch_w: int, channels: int, grid_h: int,
               grid_w: int) -> np.ndarray:
    """DiT's unpatchify: ``[N, gh*gw, ph*pw*C]`` -> ``[N, C, gh*ph, gw*pw]``."""
    n, tokens, features = x.shape
    if tokens != grid_h * grid_w or features != patch_h * patch_w * channels:
        raise fail("Unpatchify", f"input {list(x.shape)} is not [N, grid_h*grid_w = {grid_h * grid_w}, "
                                 f"patch_h*patch_w*channels = {patch_h * patch_w * channels}]")
    y = x.reshape(n, grid_h, grid_w, patch_h, patch_w, channels).transpose(0, 5, 1, 3, 2, 4)
    return np.ascontiguousarray(y).reshape(n, channels, grid_h * patch_h, grid_w * patch_w)


# -- registered kernels ------------------------------------------------------------------------
@register(Interpolate)
def _interpolate(op, inputs, ctx):
    (x,) = inputs
    return (interpolate(x, mode=_MODES.get(op.mode, op.mode), align_corners=op.align_corners,
                        out_h=op.out_h, out_w=op.out_w, scale_h=op.scale_h, scale_w=op.scale_w),)


@register(PixelShuffle)
def _pixel_shuffle(op, inputs, ctx):
    return (pixel_shuffle(inputs[0], upscale=op.upscale),)


@register(PixelUnshuffle)
def _pixel_unshuffle(op, inputs, ctx):
    return (pixel_unshuffle(inputs[0], downscale=op.downscale),)


@register(PatchEmbed)
def _patch_embed(op, inputs, ctx):
    x, w, *bias = inputs
    return (patch_embed(x, w, *bias, patch_h=op.patch_h, patch_w=op.patch_w),)


@register(Unpatchify)
def _unpatchify(op, inputs, ctx):
    (x,) = inputs
    return (unpatchify(x, patch_h=op.patch_h, patch_w=op.patch_w, channels=op.channels,
                       grid_h=op.grid_h, grid_w=op.grid_w),)
