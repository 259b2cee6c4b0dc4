"""Convolution and pooling kernels (kernels/conv.py) against independent references.

1. PyTorch: tests/fixtures/kernels/conv.npz, written by tests/fixtures/make_conv_fixtures.py
   (F.conv1d/2d/3d, conv_transpose2d, max_pool1d/2d, avg_pool1d/2d(count_include_pad=False)),
   fed through the registered kernels.
2. docs/ops.md's formulas written out as plain loops over output (or input) positions on tiny
   random shapes, called through the public maths functions.
3. Run-time facts the shapes could not show raise KernelError (a DistRuntimeError).
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

import dist_runtime.kernels.conv as kc
from dist_runtime.errors import DistRuntimeError
from dist_runtime.ir import ops
from kernel_cases import load_cases, run_one as run
from dist_runtime.kernels._common import KernelError

CASES = load_cases(Path(__file__).parent / "fixtures" / "kernels" / "conv.npz")


# -- 1. PyTorch fixtures -------------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_matches_torch(case):
    y = run(case.op, *case.inputs)
    assert y.dtype == case.inputs[0].dtype  # f32 stays f32 (NEP 50), f16/bf16 rounded back
    assert y.shape == case.expected.shape
    assert y.flags.c_contiguous
    np.testing.assert_allclose(y.astype(np.float64), case.expected, equal_nan=True, **case.tolerance)


def test_chunked_paths_match_torch(monkeypatch):
    """Large inputs are processed in chunks (im2col rows, depthwise channel blocks, transposed-conv
    input rows); tiny budgets force many chunks on the fixture shapes."""
    monkeypatch.setattr(kc, "_COLS_BUDGET", 7)
    monkeypatch.setattr(kc, "_CACHE_ELEMENTS", 3)
    for case in CASES:
        if not isinstance(case.op, ops.Pool):
            y = run(case.op, *case.inputs)
            np.testing.assert_allclose(y.astype(np.float64), case.expected, err_msg=case.name,
                                       **case.tolerance)


def test_fixtures_cover_every_op_and_dtype():
    seen = {(type(c.op).__name__, c.dtype) for c in CASES}
    for name in ("Conv1d", "Conv2d", "Conv3d", "ConvTranspose2d", "CausalConv1d", "DepthwiseConv", "Pool"):
        assert (name, "f32") in seen and (name, "f16") in seen, name
    assert {d for _, d in seen} == {"f32", "f16", "bf16", "f64"}


# -- 2. the ops.md formulas as loops -------------------------------------------------------------
def loop_conv(x, w, b, stride, padding, dilation, groups):
    """y[n, o, l] = bias[o] + sum_{c, u} x_pad[n, g*C/groups + c, l*st + u*d] * w[o, c, u]."""
    x, w = x.astype(np.float64), w.astype(np.float64)
    n, _, *length = x.shape
    o, cg, *k = w.shape
    out = [(L + 2 * p - d * (kk - 1) - 1) // s + 1
           for L, kk, s, p, d in zip(length, k, stride, padding, dilation)]
    y = np.zeros((n, o, *out))
    for nn, oo, *pos in itertools.product(range(n), range(o), *map(range, out)):
        g = oo // (o // groups)
        acc = 0.0 if b is None else float(b[oo])
        for c, *u in itertools.product(range(cg), *map(range, k)):
            src = [p_ * s - pad + uu * d for p_, s, pad, uu, d in zip(pos, stride, padding, u, dilation)]
            if all(0 <= i < L for i, L in zip(src, length)):
                acc += x[(nn, g * cg + c, *src)] * w[(oo, c, *u)]
        y[(nn, oo, *pos)] = acc
    return y


def loop_conv_transpose(x, w, b, stride, padding, output_padding, dilation, groups):
    """Every x[n, c, i] scatters x * w[c, o', u] to output i*st - p + u*d of channel g*O/groups + o'."""
    x, w = x.astype(np.float64), w.astype(np.float64)
    n, c, *length = x.shape
    _, og, *k = w.shape
    out = [(L - 1) * s - 2 * p + d * (kk - 1) + e + 1
           for L, kk, s, p, e, d in zip(length, k, stride, padding, output_padding, dilation)]
    y = np.zeros((n, og * groups, *out))
    for nn, cc, *pos in itertools.product(range(n), range(c), *map(range, length)):
        g = cc // (c // groups)
        for oo, *u in itertools.product(range(og), *map(range, k)):
            dst = [i * s - p + uu * d for i, s, p, uu, d in zip(pos, stride, padding, u, dilation)]
            if all(0 <= j < L for j, L in zip(dst, out)):
                y[(nn, g * og + oo, *dst)] += x[(nn, cc, *pos)] * w[(cc, oo, *u)]
    if b is not None:
        y += b.astype(np.float64).reshape(-1, *(1,) * len(k))
    return y


def loop_pool(x, mode, kernel, stride, padding):
    """The max / mean of each window's in-bounds elements (floor mode)."""
    n, c, *length = x.shape
    out = [(L + 2 * p - k) // s + 1 for L, k, s, p in zip(length, kernel, stride, padding)]
    y = np.zeros((n, c, *out))
    for nn, cc, *pos in itertools.product(range(n), range(c), *map(range, out)):
        ranges = [range(max(o * s - p, 0), min(o * s - p + k, L))
                  for o, s, p, k, L in zip(pos, stride, padding, kernel, length)]
        vals = [x[(nn, cc, *i)] for i in itertools.product(*ranges)]
        y[(nn, cc, *pos)] = np.max(vals) if mode == "max" else np.mean(vals)
    return y


def random_conv_params(seed: int):
    """Tiny random shapes with every knob: rank 1-3, stride, padding, dilation, groups."""
    rng = np.random.default_rng(seed)
    s = 1 + seed % 3
    groups = int(rng.choice([1, 2, 3]))
    c, o = groups * int(rng.integers(1, 3)), groups * int(rng.integers(1, 3))
    k = tuple(int(v) for v in rng.integers(1, 4, s))
    stride = tuple(int(v) for v in rng.integers(1, 4, s))
    dilation = tuple(int(v) for v in rng.integers(1, 3, s))
    padding = tuple(int(v) for v in rng.integers(0, 3, s))
    size = (6, 5, 4)[s - 1]
    length = tuple(max(1, d * (kk - 1) + 1 - 2 * p) + int(rng.integers(0, size))
                   for kk, d, p in zip(k, dilation, padding))
    x = rng.standard_normal((int(rng.integers(1, 3)), c, *length)).astype(np.float32)
    w = rng.standard_normal((o, c // groups, *k)).astype(np.float32)
    b = rng.standard_normal(o).astype(np.float32) if seed % 2 else None
    return x, w, b, dict(stride=stride, padding=padding, dilation=dilation, groups=groups)


@pytest.mark.parametrize("seed", range(24))
def test_conv_matches_loops(seed):
    x, w, b, p = random_conv_params(seed)
    y = kc.conv(x, w, b, **p)
    assert y.dtype == np.float32 and y.flags.c_contiguous
    np.testing.assert_allclose(y, loop_conv(x, w, b, **p), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("seed", range(16))
def test_conv_transpose_matches_loops(seed):
    rng = np.random.default_rng(1000 + seed)
    groups = int(rng.choice([1, 2]))
    c, og = groups * int(rng.integers(1, 3)), int(rng.integers(1, 3))
    k, stride, dilation = ([int(v) for v in rng.integers(1, hi, 2)] for hi in (4, 4, 3))
    output_padding = [int(rng.integers(0, max(s, d))) for s, d in zip(stride, dilation)]
    length = [int(v) for v in rng.integers(1, 5, 2)]
    full = [(L - 1) * s + d * (kk - 1) + 1 for L, s, d, kk in zip(length, stride, dilation, k)]
    padding = [int(rng.integers(0, (f + e - 1) // 2 + 1)) for f, e in zip(full, output_padding)]
    x = rng.standard_normal((2, c, *length)).astype(np.float32)
    w = rng.standard_normal((c, og, *k)).astype(np.float32)
    b = rng.standard_normal(og * groups).astype(np.float32) if seed % 2 else None
    p = dict(stride=stride, padding=padding, output_padding=output_padding, dilation=dilation, groups=groups)
    np.testing.assert_allclose(kc.conv_transpose(x, w, b, **p), loop_conv_transpose(x, w, b, **p),
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("mode", ["max", "avg"])
def test_pool_matches_loops(seed, mode):
    rng = np.random.default_rng(2000 + seed)
    s = 1 + seed % 2
    kernel = [int(v) for v in rng.integers(1, 5, s)]
    stride = [int(v) for v in rng.integers(1, 4, s)]
    padding = [int(rng.integers(0, k // 2 + 1)) for k in kernel]
    length = [k + int(rng.integers(0, 5)) for k in kernel]
    x = rng.standard_normal((2, 2, *length)).astype(np.float32)
    y = kc.pool(x, mode=mode, kernel=kernel, stride=stride, padding=padding)
    np.testing.assert_allclose(y, loop_pool(x, mode, kernel, stride, padding), rtol=1e-5, atol=1e-6)


def test_causal_conv_is_left_padded_conv():
    """ops.md: output step l sees inputs l - (kernel-1-u)*dilation; the future never leaks."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, 4, 7)).astype(np.float32)
    w = rng.standard_normal((4, 2, 3)).astype(np.float32)
    y = kc.causal_conv1d(x, w, dilation=2, groups=2)
    padded = np.concatenate([np.zeros((1, 4, 4), np.float32), x], axis=2)
    ref = loop_conv(padded, w, None, (1,), (0,), (2,), 2)
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-6)
    x2 = x.copy()
    x2[..., 5:] = 100.0  # changing steps >= 5 leaves outputs < 5 alone
    np.testing.assert_array_equal(kc.causal_conv1d(x2, w, dilation=2, groups=2)[..., :5], y[..., :5])


# -- dtypes, empty batches, run-time errors ------------------------------------------------------
def test_mixed_dtypes_follow_x():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((1, 2, 5, 5)).astype(np.float32)
    w = rng.standard_normal((3, 2, 3, 3))
    op = ops.Conv2d(kernel_h=3, kernel_w=3)
    assert run(op, x, w.astype(np.float16)).dtype == np.float32
    assert run(op, x.astype(np.float16), w.astype(np.float32)).dtype == np.float16
    y64 = run(op, x, w)  # an F64 weight: computed in f64, output still x's dtype
    assert y64.dtype == np.float32


@pytest.mark.parametrize("op, x_shape, w_shape", [
    (ops.Conv1d(kernel=3, padding=1), (0, 2, 5), (4, 2, 3)),
    (ops.Conv2d(kernel_h=3, kernel_w=3, groups=2), (0, 2, 5, 5), (4, 1, 3, 3)),
    (ops.Conv3d(kernel_d=1, kernel_h=2, kernel_w=2), (0, 2, 3, 3, 3), (4, 2, 1, 2, 2)),
    (ops.ConvTranspose2d(kernel_h=2, kernel_w=2, stride_h=2, stride_w=2), (0, 2, 3, 3), (2, 4, 2, 2)),
    (ops.CausalConv1d(kernel=4), (0, 2, 5), (4, 2, 4)),
    (ops.DepthwiseConv(kernel_h=3, kernel_w=3), (0, 2, 5, 5), (4, 1, 3, 3)),
])
def test_empty_batch(op, x_shape, w_shape):
    y = run(op, np.zeros(x_shape, np.float32), np.ones(w_shape, np.float32))
    assert y.shape[:2] == (0, 4) and y.size == 0 and y.dtype == np.float32


def test_empty_batch_pool():
    op = ops.Pool(mode=1, kernel_h=2, kernel_w=2, stride_h=2, stride_w=2)
    y = run(op, np.zeros((0, 3, 4, 4), np.float32))
    assert y.shape == (0, 3, 2, 2)


@pytest.mark.parametrize("op, x_shape, w_shape, match", [
    # a spatial dim unknown at load time turned out too short for the kernel
    (ops.Conv1d(kernel=5), (1, 2, 3), (4, 2, 5), "output length"),
    (ops.Conv2d(kernel_h=3, kernel_w=3, dilation_h=3), (1, 2, 6, 6), (4, 2, 3, 3), "output length"),
    (ops.ConvTranspose2d(kernel_h=1, kernel_w=1, padding_h=1), (1, 2, 1, 3), (2, 2, 1, 1), "output length"),
    # a channel count unknown at load time does not fit the weight
    (ops.Conv2d(kernel_h=1, kernel_w=1, groups=2), (1, 3, 2, 2), (4, 1, 1, 1), "groups=2"),
    (ops.Conv1d(kernel=1), (1, 3, 2), (4, 2, 1), "weight"),
    (ops.DepthwiseConv(kernel_h=1, kernel_w=1), (1, 3, 2, 2), (4, 1, 1, 1), "C\\*m"),
    (ops.ConvTranspose2d(kernel_h=1, kernel_w=1), (1, 3, 2, 2), (2, 4, 1, 1), "weight"),
    # a weight computed at run time whose taps are not the payload's kernel
    (ops.Conv1d(kernel=3), (1, 2, 5), (4, 2, 2), "kernel"),
])
def test_run_time_shape_errors(op, x_shape, w_shape, match):
    with pytest.raises(KernelError, match=match) as info:
        run(op, np.zeros(x_shape, np.float32), np.zeros(w_shape, np.float32))
    assert isinstance(info.value, DistRuntimeError)
    assert str(info.value).startswith(type(op).__name__)


def test_bias_length_error():
    with pytest.raises(KernelError, match="bias"):
        run(ops.Conv1d(kernel=1), np.zeros((1, 2, 3), np.float32), np.zeros((4, 2, 1), np.float32),
            np.zeros(3, np.float32))


def test_pool_too_short_input():
    with pytest.raises(KernelError, match="output length"):
        run(ops.Pool(mode=0, kernel_h=1, kernel_w=5), np.zeros((1, 1, 3), np.float32))
