"""Resampling and patch kernels (kernels/resample.py) against independent references.

1. PyTorch: tests/fixtures/kernels/resample.npz, written by tests/fixtures/make_resample_fixtures.py
   (F.interpolate nearest / bilinear / bicubic with and without align_corners, sizes and scale
   factors; F.pixel_shuffle / pixel_unshuffle; timm's PatchEmbed as conv2d + flatten + transpose;
   DiT's unpatchify), fed through the registered kernels.
2. docs/ops.md's index formulas written out as loops over output positions.
3. Run-time facts the shapes could not show raise KernelError (a DistRuntimeError).
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np
import pytest

import dist_runtime.kernels.resample as kr
from dist_runtime.ir import ops
from kernel_cases import load_cases, run_one as run
from dist_runtime.kernels._common import KernelError

CASES = load_cases(Path(__file__).parent / "fixtures" / "kernels" / "resample.npz")
BY_NAME = {c.name: c for c in CASES}


# -- 1. PyTorch fixtures -------------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_matches_torch(case):
    y = run(case.op, *case.inputs)
    assert y.dtype == case.inputs[0].dtype
    assert y.shape == case.expected.shape
    assert y.flags.c_contiguous
    np.testing.assert_allclose(y.astype(np.float64), case.expected, **case.tolerance)


def test_fixtures_cover_every_op_and_dtype():
    seen = {(type(c.op).__name__, c.dtype) for c in CASES}
    for name in ("Interpolate", "PixelShuffle", "PixelUnshuffle", "PatchEmbed", "Unpatchify"):
        assert (name, "f32") in seen and (name, "f16") in seen, name
    modes = {(c.op.mode, c.op.align_corners, bool(c.op.out_h))
             for c in CASES if isinstance(c.op, ops.Interpolate)}
    assert modes >= {(0, False, True), (0, False, False)} | {
        (m, a, s) for m in (1, 2) for a in (False, True) for s in (False, True)}


@pytest.mark.parametrize("name", ["bicubic_size", "nearest_x1.5", "bilinear_x2_align"])
def test_interpolate_any_leading_dims(name):
    """Interpolate resizes the last two dims of any rank >= 2: same numbers as the 4-D fixture."""
    case = BY_NAME[name]
    x, expected = case.inputs[0], case.expected
    for plane, want in zip(x.reshape(-1, *x.shape[-2:]), expected.reshape(-1, *expected.shape[-2:])):
        np.testing.assert_allclose(run(case.op, plane), want, **case.tolerance)  # rank 2
    y = run(case.op, x.reshape(1, -1, 1, *x.shape[-2:]))  # rank 5
    np.testing.assert_allclose(y, expected.reshape(1, -1, 1, *expected.shape[-2:]), **case.tolerance)


# -- 2. the ops.md formulas as loops -------------------------------------------------------------
def coord_scale(n_in, n_out, size_given, scale, align_corners):
    if align_corners:
        return (n_in - 1) / (n_out - 1) if n_out > 1 else 0.0
    return n_in / n_out if size_given else 1.0 / scale


def keys(d, a=-0.75):
    """Keys' cubic convolution kernel at distance d."""
    d = abs(d)
    if d <= 1:
        return (a + 2) * d**3 - (a + 3) * d**2 + 1
    if d < 2:
        return a * d**3 - 5 * a * d**2 + 8 * a * d - 4 * a
    return 0.0


def loop_resize_1d(row, n_out, mode, align_corners, size_given, scale):
    """One axis of ops.md's Interpolate numerics (in f64), written per output position."""
    n_in = len(row)
    r = coord_scale(n_in, n_out, size_given, scale, align_corners)
    out = np.zeros(n_out)
    for dst in range(n_out):
        if mode == "nearest":
            # torch's shortcuts: same length copies, twice the length repeats
            if n_out == n_in:
                out[dst] = row[dst]
            elif n_out == 2 * n_in:
                out[dst] = row[dst // 2]
            else:
                out[dst] = row[min(math.floor(dst * r), n_in - 1)]
            continue
        src = dst * r if align_corners else (dst + 0.5) * r - 0.5
        if mode == "bilinear":
            if n_out == n_in:
                out[dst] = row[dst]
                continue
            src = max(src, 0.0)
            i0 = min(math.floor(src), n_in - 1)
            lam = min(src - i0, 1.0)
            out[dst] = (1 - lam) * row[i0] + lam * row[min(i0 + 1, n_in - 1)]
        else:
            i0 = math.floor(src)
            out[dst] = sum(keys(src - i) * row[min(max(i, 0), n_in - 1)] for i in range(i0 - 1, i0 + 3))
    return out


@pytest.mark.parametrize("mode, align_corners", [("nearest", False), ("bilinear", False), ("bilinear", True),
                                                 ("bicubic", False), ("bicubic", True)])
@pytest.mark.parametrize("h, w, out_h, out_w, scale_h, scale_w", [
    (4, 5, 7, 3, 1.0, 1.0),  # sizes, up and down
    (3, 6, 0, 0, 2.5, 0.75),  # scales
    (5, 3, 0, 8, 1.25, 1.0),  # one of each
    (1, 4, 3, 1, 1.0, 1.0),  # a length-1 input, a length-1 output
    (6, 4, 0, 0, 1.1, 2.1),  # scales whose floors give out == in and out == 2*in
])
def test_interpolate_matches_loops(mode, align_corners, h, w, out_h, out_w, scale_h, scale_w):
    x = np.random.default_rng(h * 10 + w).standard_normal((2, h, w)).astype(np.float32)
    y = kr.interpolate(x, mode=mode, align_corners=align_corners, out_h=out_h, out_w=out_w,
                       scale_h=scale_h, scale_w=scale_w)
    oh, ow = out_h or math.floor(h * np.float32(scale_h)), out_w or math.floor(w * np.float32(scale_w))
    assert y.shape == (2, oh, ow)
    sh, sw = float(np.float32(scale_h)), float(np.float32(scale_w))  # the payload's f32 values
    ref = np.empty((2, h, ow))
    for n, i in itertools.product(range(2), range(h)):
        ref[n, i] = loop_resize_1d(x[n, i].astype(np.float64), ow, mode, align_corners, bool(out_w), sw)
    ref2 = np.empty((2, oh, ow))
    for n, j in itertools.product(range(2), range(ow)):
        ref2[n, :, j] = loop_resize_1d(ref[n, :, j], oh, mode, align_corners, bool(out_h), sh)
    np.testing.assert_allclose(y, ref2, rtol=1e-4, atol=1e-5)


def test_interpolate_properties():
    x = np.random.default_rng(0).standard_normal((1, 3, 4)).astype(np.float32)
    # integer nearest upsampling repeats each element
    np.testing.assert_array_equal(kr.interpolate(x, scale_h=3.0, scale_w=2.0), x.repeat(3, 1).repeat(2, 2))
    # align_corners keeps the corners; the weights sum to 1, so a constant image stays constant
    for mode in ("bilinear", "bicubic"):
        y = kr.interpolate(x, mode=mode, align_corners=True, out_h=7, out_w=9)
        corners = (Ellipsis, [0, 0, -1, -1], [0, -1, 0, -1])
        np.testing.assert_allclose(y[corners], x[corners], rtol=1e-6)
        c = kr.interpolate(np.full((2, 5), 3.5, np.float32), mode=mode, out_h=4, out_w=11)
        np.testing.assert_allclose(c, 3.5, rtol=1e-6)
    # bilinear with align_corners reproduces a linear ramp exactly
    ramp = np.arange(5, dtype=np.float32)[None, :] * np.ones((2, 1), np.float32)
    np.testing.assert_allclose(kr.interpolate(ramp, mode="bilinear", align_corners=True, out_h=2, out_w=9),
                               np.linspace(0, 4, 9)[None, :].repeat(2, 0), atol=1e-6)


def test_pixel_shuffle_index_formula():
    r, c, h, w = 3, 2, 2, 4
    x = np.random.default_rng(1).standard_normal((2, c * r * r, h, w)).astype(np.float32)
    y = kr.pixel_shuffle(x, upscale=r)
    for n, cc, hh, ww, i, j in itertools.product(range(2), range(c), range(h), range(w), range(r), range(r)):
        assert y[n, cc, hh * r + i, ww * r + j] == x[n, cc * r * r + i * r + j, hh, ww]
    np.testing.assert_array_equal(kr.pixel_unshuffle(y, downscale=r), x)


def test_patch_embed_formula():
    """y[n, i*(W/pw) + j, d] = bias[d] + sum_{c,u,v} x[n, c, i*ph + u, j*pw + v] * w[d, c, u, v]."""
    rng = np.random.default_rng(2)
    ph, pw, gh, gw = 2, 3, 3, 2
    x = rng.standard_normal((2, 3, gh * ph, gw * pw)).astype(np.float32)
    w = rng.standard_normal((4, 3, ph, pw)).astype(np.float32)
    b = rng.standard_normal(4).astype(np.float32)
    y = kr.patch_embed(x, w, b, patch_h=ph, patch_w=pw)
    ref = np.empty((2, gh * gw, 4))
    for n, i, j, d in itertools.product(range(2), range(gh), range(gw), range(4)):
        patch = x[n, :, i * ph:(i + 1) * ph, j * pw:(j + 1) * pw].astype(np.float64)
        ref[n, i * gw + j, d] = b[d] + (patch * w[d]).sum()
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-6)


def test_unpatchify_index_formula():
    ph, pw, c, gh, gw = 2, 3, 2, 2, 3
    x = np.random.default_rng(3).standard_normal((1, gh * gw, ph * pw * c)).astype(np.float32)
    y = kr.unpatchify(x, patch_h=ph, patch_w=pw, channels=c, grid_h=gh, grid_w=gw)
    for cc, i, j, p, q in itertools.product(range(c), range(gh), range(gw), range(ph), range(pw)):
        assert y[0, cc, i * ph + p, j * pw + q] == x[0, i * gw + j, (p * pw + q) * c + cc]


# -- empty batches, run-time errors --------------------------------------------------------------
def test_empty_batch():
    z = np.zeros
    assert run(ops.Interpolate(mode=2, out_h=3, out_w=5), z((0, 2, 4, 4), np.float32)).shape == (0, 2, 3, 5)
    assert run(ops.PixelShuffle(upscale=2), z((0, 8, 2, 2), np.float32)).shape == (0, 2, 4, 4)
    assert run(ops.PatchEmbed(patch_h=2, patch_w=2), z((0, 3, 4, 4), np.float32),
               z((5, 3, 2, 2), np.float32)).shape == (0, 4, 5)


@pytest.mark.parametrize("op, shapes, match", [
    (ops.Interpolate(scale_h=0.5), [(1, 1, 1, 4)], "< 1"),  # floor(1 * 0.5) = 0 rows
    (ops.Interpolate(out_h=2, out_w=2), [(1, 1, 0, 4)], "length 0"),
    (ops.PixelShuffle(upscale=2), [(1, 6, 2, 2)], "multiple"),
    (ops.PixelUnshuffle(downscale=2), [(1, 1, 4, 5)], "multiples"),
    (ops.PatchEmbed(patch_h=2, patch_w=2), [(1, 3, 4, 5), (4, 3, 2, 2)], "patches"),
    (ops.PatchEmbed(patch_h=2, patch_w=2), [(1, 2, 4, 4), (4, 3, 2, 2)], "weight"),
    (ops.Unpatchify(patch_h=2, patch_w=2, channels=1, grid_h=2, grid_w=2), [(1, 3, 4)], "grid_h"),
])
def test_run_time_shape_errors(op, shapes, match):
    """Dims unknown at load time (H, W, a token count) that turn out not to fit raise KernelError."""
    with pytest.raises(KernelError, match=match) as info:
        run(op, *(np.zeros(s, np.float32) for s in shapes))
    assert str(info.value).startswith(type(op).__name__)
