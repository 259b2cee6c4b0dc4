"""ONNX resampling: Resize (and Upsample), DepthToSpace and SpaceToDepth."""

from __future__ import annotations

import math

import numpy as np

from ...ir import ops
from .node import NodeBuilder, checked_axis, ints
from .registry import converter


def _onnx_source(mode: str, n_in: int, n_out: int, scale: float) -> np.ndarray:
    """ONNX Resize's source coordinate of every output index along one axis (float64)."""
    y = np.arange(n_out, dtype=np.float64)
    out_f = scale * n_in
    if mode == "half_pixel":
        return (y + 0.5) / scale - 0.5
    if mode == "pytorch_half_pixel":
        return np.full(n_out, -0.5) if out_f == 1 else (y + 0.5) / scale - 0.5
    if mode == "align_corners":
        return np.zeros(n_out) if out_f == 1 else y * (n_in - 1) / (out_f - 1)
    if mode == "asymmetric":
        return y / scale
    if mode == "half_pixel_symmetric":
        offset = n_in / 2 * (1 - n_out / out_f)
        return offset + (y + 0.5) / scale - 0.5
    raise ValueError(mode)


def _onnx_nearest(x: np.ndarray, nearest_mode: str, n_in: int) -> np.ndarray:
    whole = x == np.floor(x)
    if nearest_mode == "round_prefer_floor":
        idx = np.ceil(x - 0.5)
    elif nearest_mode == "round_prefer_ceil":
        idx = np.floor(x + 0.5)
    elif nearest_mode == "floor":
        idx = np.floor(x)
    elif nearest_mode == "ceil":
        idx = np.ceil(x)
    else:
        raise ValueError(nearest_mode)
    idx = np.where(whole, x, idx)
    return np.clip(idx, 0, n_in - 1).astype(np.int64)


def _our_ratio(n_in: int, n_out: int, scale: float | None, align_corners: bool) -> float:
    """Interpolate's coordinate step (docs/ops.md) in f32: 1/scale when the size came from the
    scale, in/out when given, (in-1)/(out-1) with align_corners."""
    if align_corners:
        return float(np.float32(n_in - 1) / np.float32(n_out - 1)) if n_out > 1 else 0.0
    if scale is not None:
        return float(np.float32(1.0 / scale))
    return float(np.float32(n_in) / np.float32(n_out))


def _our_nearest(n_in: int, n_out: int, scale: float | None) -> np.ndarray:
    dst = np.arange(n_out)
    if n_out == n_in:
        return dst
    if n_out == 2 * n_in:
        return dst // 2
    ratio = np.float32(_our_ratio(n_in, n_out, scale, False))
    return np.minimum(np.floor(dst.astype(np.float32) * ratio).astype(np.int64), n_in - 1)


def _our_source(mode: int, align_corners: bool, n_in: int, n_out: int, scale: float | None) -> np.ndarray:
    """Interpolate's source coordinate (bilinear: clamped at 0; an unchanged length is copied)."""
    dst = np.arange(n_out, dtype=np.float64)
    if mode == 1 and n_out == n_in:
        return dst
    ratio = _our_ratio(n_in, n_out, scale, align_corners)
    src = ratio * dst if align_corners else ratio * (dst + 0.5) - 0.5
    return np.maximum(src, 0.0) if mode == 1 else src


def _resize_axis(b: NodeBuilder, mode: int, ctm: str, nearest_mode: str, n_in: int, n_out: int,
                 scale: float, exact_scale: bool, axis: str) -> tuple[dict[str, int | float], set[bool]]:
    """The payload fields (``out_<axis>`` or ``scale_<axis>``) and the ``align_corners`` values with
    which our Interpolate samples exactly ONNX's source positions along one axis."""
    candidates = [{f"out_{axis}": n_out}]
    s32 = float(np.float32(scale))
    if s32 > 0 and math.floor(n_in * s32) == n_out:
        candidates.insert(0 if exact_scale else 1, {f"scale_{axis}": s32})
    ref = _onnx_source(ctm, n_in, n_out, scale)
    for fields in candidates:
        from_scale = fields.get(f"scale_{axis}")
        if mode == 0:
            if np.array_equal(_onnx_nearest(ref, nearest_mode, n_in), _our_nearest(n_in, n_out, from_scale)):
                return fields, {False}
            continue
        theirs = np.clip(ref, 0, n_in - 1) if mode == 1 else ref
        aligns = set()
        for align in (False, True):
            ours = _our_source(mode, align, n_in, n_out, from_scale)
            if mode == 1:
                ours = np.clip(ours, 0, n_in - 1)
            if np.allclose(ours, theirs, rtol=0, atol=1e-5):
                aligns.add(align)
        if aligns:
            return fields, aligns
    what = f"nearest_mode={nearest_mode}" if mode == 0 else ("linear" if mode == 1 else "cubic")
    raise b.fail(f"coordinate_transformation_mode={ctm} ({what}) along an axis of {n_in} -> {n_out} "
                 f"(scale {scale:.7g}) samples positions our Interpolate does not")


@converter("Resize", "Upsample", targets=("Interpolate",), constants=(1, 2, 3))
def convert_resize(node, opset, inputs):
    """Resize of the last two dims, when our Interpolate samples the same source positions.

    The converter computes ONNX's source coordinate of every output index (and, for nearest, the
    rounded index) and picks the Interpolate payload (size or scale, align_corners) whose positions
    are identical (nearest) or equal within 1e-5 pixel (linear, cubic); otherwise it refuses.
    Antialiased downsampling, tf_crop_and_resize, exclude_outside and a cubic coefficient other
    than -0.75 have no counterpart.
    """
    b = NodeBuilder(node, opset, inputs, ("antialias", "axes", "coordinate_transformation_mode", "cubic_coeff_a",
                                     "exclude_outside", "extrapolation_value", "keep_aspect_ratio_policy",
                                     "mode", "nearest_mode", "scales", "height_scale", "width_scale"))
    b.floats(0)
    shape = b.shape(0)
    rank = len(shape)
    mode_name = b.attr("mode", "nearest")
    modes = {"nearest": 0, "linear": 1, "bilinear": 1, "cubic": 2}
    if mode_name not in modes:
        raise b.fail(f"mode={mode_name!r}")
    mode = modes[mode_name]
    if node.op_type == "Upsample":
        if opset < 7:
            raise b.fail("Upsample before opset 7 (height_scale/width_scale attributes)")
        scales = b.attr("scales") if opset < 9 else _ints_or_floats(b.const(1, "scales"))
        ctm, nearest_mode, sizes, policy = "asymmetric", "floor", None, "stretch"
    else:
        if opset < 11:
            raise b.fail("Resize-10's coordinate mapping and rounding are unspecified")
        ctm = b.attr("coordinate_transformation_mode", "half_pixel")
        nearest_mode = b.attr("nearest_mode", "round_prefer_floor")
        policy = b.attr("keep_aspect_ratio_policy", "stretch")
        if ctm == "tf_crop_and_resize":
            raise b.fail("tf_crop_and_resize (a crop and extrapolation values)")
        if ctm not in ("half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric",
                       "half_pixel_symmetric"):
            raise b.fail(f"coordinate_transformation_mode={ctm!r}")
        if mode == 2 and float(b.attr("cubic_coeff_a", -0.75)) != -0.75:
            raise b.fail(f"cubic_coeff_a={b.attr('cubic_coeff_a')}: our bicubic uses -0.75 (torch)")
        if mode == 2 and b.attr("exclude_outside", 0):
            raise b.fail("exclude_outside=1 renormalises the cubic weights at the border; ours replicates "
                         "the edge")
        scales = _ints_or_floats(b.const(2, "scales")) if b.has(2) and b.info(2).shape != (0,) else None
        sizes = ints(b.const(3, "sizes")) if b.has(3) else None
        if (scales is None) == (sizes is None):
            raise b.fail("exactly one of scales and sizes must be given")
    axes = list(b.attr("axes", range(rank)))
    axes = [checked_axis(b, a, rank, "axes") for a in axes]
    given = scales if scales is not None else sizes
    if len(given) != len(axes):
        raise b.fail(f"{len(given)} scales/sizes for {len(axes)} axes")
    full_scale = [1.0] * rank
    out = list(shape)
    if scales is not None:
        for a, s in zip(axes, scales):
            full_scale[a] = float(s)
            out[a] = int(math.floor(float(s) * shape[a]))
        exact = True
    else:
        for a, n in zip(axes, sizes):
            full_scale[a], out[a] = n / shape[a], int(n)
        if policy in ("not_larger", "not_smaller"):
            pick = min if policy == "not_larger" else max
            common = pick(full_scale[a] for a in axes)
            for a in axes:
                full_scale[a], out[a] = common, int(common * shape[a] + 0.5)
        elif policy != "stretch":
            raise b.fail(f"keep_aspect_ratio_policy={policy!r}")
        exact = False
    if b.attr("antialias", 0) and any(s < 1 for s in full_scale):
        raise b.fail("antialias=1 when downsampling: our Interpolate has no antialiasing filter")
    if rank < 2:
        raise b.fail("our Interpolate resizes the last two dims of a tensor of rank >= 2")
    for a in range(rank - 2):
        if out[a] != shape[a] or full_scale[a] != 1.0:
            raise b.fail(f"axis {a} is resized: our Interpolate resizes the last two dims only")
    fields: dict[str, object] = {"mode": mode}
    aligns = {False, True}
    for a, ax in ((rank - 2, "h"), (rank - 1, "w")):
        got, ok = _resize_axis(b, mode, ctm, nearest_mode, shape[a], out[a], full_scale[a], exact, ax)
        fields.update(got)
        aligns &= ok
    if not aligns:
        raise b.fail("the two axes need different align_corners settings")
    fields["align_corners"] = min(aligns)  # False when both work
    b.emit(ops.Interpolate(**fields), [b.name(0)], b.out(0))
    return b.done()


def _ints_or_floats(values) -> list[float]:
    return [float(v) for v in np.asarray(values).reshape(-1)]


def _nhwc_channel_swap(b: NodeBuilder, x: str, first: int | None, second: int | None, out: str | None) -> str:
    """Reorder the channels of [N, A*B, H, W] from (a, b) to (b, a) order (A = first or inferred,
    B = second or inferred), through NHWC: Permute, Reshape, Permute, Reshape, Permute."""
    y = b.emit(ops.Permute(perm=(0, 2, 3, 1)), [x])
    split = (-1 if first is None else first, -1 if second is None else second)
    y = b.emit(ops.Reshape(shape=(0, 0, 0) + split), [y])
    y = b.emit(ops.Permute(perm=(0, 1, 2, 4, 3)), [y])
    y = b.emit(ops.Reshape(shape=(0, 0, 0, -1)), [y])
    return b.emit(ops.Permute(perm=(0, 3, 1, 2)), [y], out)


def _block_node(node, opset, inputs) -> tuple[NodeBuilder, int, str]:
    """The reader of a DepthToSpace / SpaceToDepth node ([N, C, H, W] floats), its block size and mode."""
    b = NodeBuilder(node, opset, inputs, ("blocksize", "mode"))
    b.floats(0)
    if b.rank(0) != 4:
        raise b.fail("input must be [N, C, H, W]")
    return b, int(b.attr("blocksize")), b.attr("mode", "DCR")


@converter("DepthToSpace", targets=("PixelShuffle",))
def convert_depth_to_space(node, opset, inputs):
    """CRD is our PixelShuffle; DCR (the default) first reorders the channels to CRD."""
    b, r, mode = _block_node(node, opset, inputs)
    x = b.name(0)
    if mode == "DCR":
        x = _nhwc_channel_swap(b, x, r * r, None, None)
    elif mode != "CRD":
        raise b.fail(f"mode={mode!r}")
    b.emit(ops.PixelShuffle(upscale=r), [x], b.out(0))
    return b.done()


@converter("SpaceToDepth", targets=("PixelUnshuffle",))
def convert_space_to_depth(node, opset, inputs):
    """Our PixelUnshuffle orders the output channels CRD (``c*r*r + i*r + j``); ONNX's default DCR
    order (``(i*r + j)*C + c``) follows with a channel permutation (docs/ops.md, PixelUnshuffle)."""
    b, r, mode = _block_node(node, opset, inputs)
    if mode == "CRD":
        b.emit(ops.PixelUnshuffle(downscale=r), [b.name(0)], b.out(0))
    elif mode == "DCR":
        y = b.emit(ops.PixelUnshuffle(downscale=r), [b.name(0)])
        _nhwc_channel_swap(b, y, None, r * r, b.out(0))
    else:
        raise b.fail(f"mode={mode!r}")
    return b.done()
