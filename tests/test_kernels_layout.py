"""The layout kernels (kernels/layout.py) against element-by-element references written here.

Each reference moves elements one index at a time with Python loops (``np.ndindex``), independently
of numpy's swapaxes / transpose / reshape / concatenate / split, over float, integer, BOOL and BF16
tensors, zero-size and size-1 dims, negative axes and non-contiguous inputs.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from dist_runtime.errors import DistRuntimeError
from dist_runtime.ir import ops
from dist_runtime.kernels import layout  # noqa: F401  (registers the kernels)
from kernel_cases import run_kernel as run

BF16 = np.dtype(ml_dtypes.bfloat16)


def sample(shape, dtype=np.float32, seed=0) -> np.ndarray:
    """Distinct-ish values of any dtype (BOOL alternates), so a misplaced element shows."""
    values = np.arange(int(np.prod(shape)), dtype=np.int64) * 7 % 251 - 60
    if np.dtype(dtype) == np.bool_:
        return (values % 2 == 0).reshape(shape)
    return values.astype(dtype).reshape(shape)


def check(y: np.ndarray, want: np.ndarray, like: np.ndarray) -> None:
    assert y.dtype == like.dtype and y.shape == want.shape
    assert y.flags.c_contiguous  # every tensor of the runtime is row-major
    np.testing.assert_array_equal(y.astype(np.float64), want.astype(np.float64))


def loop_permute(x: np.ndarray, perm) -> np.ndarray:
    perm = [p % x.ndim for p in perm]
    out = np.empty(tuple(x.shape[p] for p in perm), x.dtype)
    for o in np.ndindex(out.shape):
        i = [0] * x.ndim
        for j, p in enumerate(perm):  # output dim j is input dim perm[j]
            i[p] = o[j]
        out[o] = x[tuple(i)]
    return out


def row_major(x: np.ndarray) -> list:
    """The elements of ``x`` in row-major order, by index."""
    return [x[i] for i in np.ndindex(x.shape)]


DTYPES = [np.float32, np.float16, BF16, np.float64, np.int64, np.int8, np.uint8, np.bool_]


# -- Transpose, Permute ------------------------------------------------------------------------
@pytest.mark.parametrize("shape, dim0, dim1", [
    ((3, 4), -2, -1), ((2, 3, 4, 5), 0, 2), ((2, 3, 4), -1, 0), ((5,), 0, -1), ((2, 3), 1, 1),
    ((0, 3), 0, 1), ((1, 4, 1), 0, 2), ((2, 0, 3), -3, -2),
])
@pytest.mark.parametrize("dtype", [np.float32, BF16, np.int32, np.bool_])
def test_transpose(shape, dim0, dim1, dtype):
    x = sample(shape, dtype)
    perm = list(range(len(shape)))
    perm[dim0 % len(shape)], perm[dim1 % len(shape)] = perm[dim1 % len(shape)], perm[dim0 % len(shape)]
    (y,) = run(ops.Transpose(dim0=dim0, dim1=dim1), x)
    check(y, loop_permute(x, perm), x)


@pytest.mark.parametrize("shape, perm", [
    ((2, 3, 4), (2, 0, 1)), ((2, 3, 4), (-1, -3, -2)), ((2, 3, 4, 5), (0, 2, 1, 3)), ((4,), (0,)),
    ((), ()), ((0, 2, 3), (2, 0, 1)), ((1, 5, 1, 2), (3, 2, 1, 0)),
])
@pytest.mark.parametrize("dtype", DTYPES)
def test_permute(shape, perm, dtype):
    x = sample(shape, dtype)
    (y,) = run(ops.Permute(perm=perm), x)
    check(y, loop_permute(x, perm), x)


def test_transpose_and_permute_of_a_strided_view():
    x = sample((4, 6, 5))[:, ::2, 1:]  # non-contiguous input
    (y,) = run(ops.Permute(perm=(1, 2, 0)), x)
    check(y, loop_permute(x, (1, 2, 0)), x)
    (y,) = run(ops.Transpose(dim0=0, dim1=-1), x)
    check(y, loop_permute(x, (2, 1, 0)), x)


# -- Reshape -----------------------------------------------------------------------------------
@pytest.mark.parametrize("shape, target, want", [
    ((2, 3, 4), (6, 4), (6, 4)),
    ((2, 3, 4), (0, -1), (2, 12)),  # 0 copies dim 0
    ((2, 12), (0, 3, 4), (2, 3, 4)),
    ((4, 6, 8), (0, 0, 2, 4), (4, 6, 2, 4)),  # [-1, -1, 8] -> [0, 0, 2, 4]: heads split
    ((2, 3, 4), (-1,), (24,)),
    ((2, 3, 4), (4, -1, 2), (4, 3, 2)),
    ((1, 1, 1), (), ()),  # one element to a scalar
    ((), (1, 1), (1, 1)),
    ((0, 3), (0, 3, 1), (0, 3, 1)),  # the copied dim is 0: empty, no -1
    ((3, 0), (0, 0, 5), (3, 0, 5)),
])
@pytest.mark.parametrize("dtype", [np.float32, BF16, np.int16, np.bool_])
def test_reshape(shape, target, want, dtype):
    x = sample(shape, dtype)
    (y,) = run(ops.Reshape(shape=target), x)
    assert y.shape == want and y.dtype == x.dtype
    assert [float(v) for v in row_major(y)] == [float(v) for v in row_major(x)]


def test_reshape_of_a_strided_view_keeps_logical_order():
    x = sample((4, 6))[:, ::2].T  # (3, 4), non-contiguous
    (y,) = run(ops.Reshape(shape=(-1,)), x)
    assert y.tolist() == [float(v) for v in row_major(x)]


# -- Concat ------------------------------------------------------------------------------------
def loop_concat(xs, dim: int) -> np.ndarray:
    axis = dim % xs[0].ndim
    shape = list(xs[0].shape)
    shape[axis] = sum(x.shape[axis] for x in xs)
    out = np.empty(shape, xs[0].dtype)
    offset = 0
    for x in xs:
        for i in np.ndindex(x.shape):
            o = list(i)
            o[axis] += offset
            out[tuple(o)] = x[i]
        offset += x.shape[axis]
    return out


@pytest.mark.parametrize("shapes, dim", [
    ([(2, 3), (2, 5)], -1), ([(1, 3, 4), (2, 3, 4), (3, 3, 4)], 0), ([(2, 3, 4), (2, 0, 4), (2, 2, 4)], -2),
    ([(4, 2)], 1), ([(0, 2), (0, 2)], 1), ([(3,), (0,), (1,)], 0), ([(2, 1, 2), (2, 1, 2)], 1),
])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int64, np.bool_])
def test_concat(shapes, dim, dtype):
    xs = [sample(s, dtype) + (np.ones((), dtype) if dtype != np.bool_ else False) * i for i, s in enumerate(shapes)]
    (y,) = run(ops.Concat(dim=dim), *xs)
    check(y, loop_concat(xs, dim), xs[0])


# -- Split, Chunk ------------------------------------------------------------------------------
def loop_split(x: np.ndarray, sizes, dim: int) -> list[np.ndarray]:
    axis = dim % x.ndim
    pieces, start = [], 0
    for size in sizes:
        shape = list(x.shape)
        shape[axis] = size
        piece = np.empty(shape, x.dtype)
        for i in np.ndindex(piece.shape):
            src = list(i)
            src[axis] += start
            piece[i] = x[tuple(src)]
        pieces.append(piece)
        start += size
    return pieces


@pytest.mark.parametrize("shape, sizes, dim", [
    ((2, 10), (3, 7), -1), ((6, 4), (1, 2, 3), 0), ((2, 9, 3), (4, 0, 5), 1), ((5,), (5,), 0),
    ((3, 4, 6), (2, 2, 2), -1), ((0, 4), (0,), 0), ((2, 0), (0, 0), -1),
])
@pytest.mark.parametrize("dtype", [np.float32, BF16, np.int32, np.bool_])
def test_split(shape, sizes, dim, dtype):
    x = sample(shape, dtype)
    outputs = run(ops.Split(dim=dim, sizes=sizes), x)
    assert len(outputs) == len(sizes)
    for y, want in zip(outputs, loop_split(x, sizes, dim)):
        check(y, want, x)


@pytest.mark.parametrize("shape, chunks, dim", [
    ((2, 12), 3, -1), ((4, 5), 2, 0), ((3, 4, 6), 1, 1), ((2, 0, 3), 4, 1), ((1, 8, 2), 8, -2),
])
@pytest.mark.parametrize("dtype", [np.float32, np.int8, np.bool_])
def test_chunk(shape, chunks, dim, dtype):
    x = sample(shape, dtype)
    outputs = run(ops.Chunk(dim=dim, chunks=chunks), x)
    assert len(outputs) == chunks
    for y, want in zip(outputs, loop_split(x, [shape[dim] // chunks] * chunks, dim)):
        check(y, want, x)


# -- run-time errors (dims unknown at load time) ------------------------------------------------
@pytest.mark.parametrize("op, inputs, message", [
    (ops.Reshape(shape=(5, -1)), [sample((2, 3))], "Reshape: x [2, 3] (6 elements) cannot be reshaped to [5, -1]"),
    (ops.Reshape(shape=(4, 2)), [sample((2, 3))], "Reshape: x [2, 3] (6 elements) cannot be reshaped"),
    (ops.Reshape(shape=(0, -1)), [sample((0, 3))], "Reshape: x [0, 3] (0 elements) cannot be reshaped"),
    (ops.Reshape(shape=(2, 0, 0)), [sample((6, 1))], "Reshape: shape [2, 0, 0] copies a dim"),
    (ops.Concat(dim=0), [sample((2, 3)), sample((2, 4))], "Concat: input 1 [2, 4] differs from input 0 [2, 3]"),
    (ops.Split(dim=-1, sizes=(2, 2)), [sample((3, 5))], "Split: sizes [2, 2] do not add up to dim 1 of x [3, 5]"),
    (ops.Chunk(dim=0, chunks=2), [sample((3, 5))], "Chunk: dim 0 of x [3, 5] does not split into 2"),
    (ops.Transpose(dim0=0, dim1=2), [sample((3, 5))], "Transpose: dim=2 is out of range for rank 2"),
])
def test_run_time_violations_raise_a_runtime_error(op, inputs, message):
    with pytest.raises(DistRuntimeError) as err:
        run(op, *inputs)
    assert str(err.value).startswith(message)


def test_reshape_is_a_view_of_contiguous_data():
    """docs/ops.md: Reshape has no numerics; it does not copy a row-major input."""
    x = sample((4, 6))
    (y,) = run(ops.Reshape(shape=(0, 2, 3)), x)
    assert np.shares_memory(x, y)
