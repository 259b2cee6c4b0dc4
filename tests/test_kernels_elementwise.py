"""The elementwise kernels (kernels/elementwise.py) against independent references.

* PyTorch, through tests/fixtures/kernels/elementwise.npz (written by
  tests/fixtures/make_elementwise_fixtures.py; torch computes in f64 from the exact inputs).
* libm's ``math.erfc`` for the erfc the exact GELU is built on, and a scalar-loop softmax.
* Closed forms for the dtype rules (mixed input dtypes, bounds rounded to the output dtype) and
  the run-time errors.
"""

from __future__ import annotations

import math
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_cases import load_cases, run_one as run

import dist_runtime.kernels.elementwise as E
from dist_runtime.errors import DistRuntimeError
from dist_runtime.ir import ops
from dist_runtime.kernels.registry import kernel_for

# IEEE specials (x / 0, inf - inf, 0 * inf) are part of the cases: numpy's RuntimeWarning about
# them is expected, the kernels deliberately do not pay for np.errstate on every call.
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

CASES = load_cases(Path(__file__).parent / "fixtures" / "kernels" / "elementwise.npz")
BF16 = np.dtype(ml_dtypes.bfloat16)
OPS = ["Add", "Sub", "Mul", "Div", "Clamp", "NanToNum", "Relu", "LeakyRelu", "PRelu", "Sigmoid", "Tanh",
       "Silu", "Gelu", "GeGlu", "SwiGlu", "Glu", "Softmax", "Argmax"]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_against_torch(case):
    before = [a.copy() for a in case.inputs]
    y = run(case.op, *case.inputs)
    want_dtype = np.int64 if isinstance(case.op, ops.Argmax) else case.inputs[0].dtype
    assert isinstance(y, np.ndarray) and y.dtype == want_dtype  # f32 stays f32 (NEP 50)
    assert y.shape == case.expected.shape
    np.testing.assert_allclose(y.astype(np.float64), case.expected, equal_nan=True, **case.tolerance)
    for a, b in zip(case.inputs, before):  # kernels never write into their inputs
        np.testing.assert_array_equal(a.astype(np.float64), b.astype(np.float64))


def test_every_op_has_cases_and_a_kernel():
    covered = {type(c.op).__name__ for c in CASES}
    assert covered == set(OPS)
    for name in OPS:
        kernel_for(getattr(ops, name))


# -- erfc, the heart of the exact GELU ---------------------------------------------------------
def test_erfc_matches_libm_in_f64_and_f32():
    z = np.concatenate([np.linspace(-30, 30, 6001), [0.46875, -0.46875, 4.0, -4.0, 1e-20, -1e-20, 26.0]])
    want = np.array([math.erfc(v) for v in z])
    np.testing.assert_allclose(E.erfc(z), want, rtol=5e-15, atol=0)  # Cody: f64 accuracy
    z32 = z.astype(np.float32)
    want32 = np.array([math.erfc(float(v)) for v in z32])
    got32 = E.erfc(z32)
    assert got32.dtype == np.float32
    # Relative accuracy, tail included: a few f32 ulp near 0, then the rounding of z^2 in f32
    # (z^2 * 6e-8); beyond |z| = 9 erfc is below 1e-36 and GELU's result is x or 0.
    for limit, rtol in ((1.0, 1e-6), (4.0, 3e-6), (9.0, 1.5e-5)):
        near = np.abs(z32) <= limit
        np.testing.assert_allclose(got32[near], want32[near], rtol=rtol, atol=0)
    np.testing.assert_allclose(got32, want32, rtol=0, atol=4e-7)  # ~1 ulp of f32 near 2


def test_erfc_specials():
    got = E.erfc(np.array([np.inf, -np.inf, np.nan, 0.0]))
    np.testing.assert_array_equal(got, [0.0, 2.0, np.nan, 1.0])
    assert E.erfc(np.array(0.5)).shape == ()


# -- softmax against a scalar loop ---------------------------------------------------------------
def loop_softmax(x: np.ndarray, dim: int) -> np.ndarray:
    moved = np.moveaxis(x.astype(np.float64), dim, -1)
    out = np.empty_like(moved)
    for idx in np.ndindex(moved.shape[:-1]):
        row = [float(v) for v in moved[idx]]
        top = max(row)
        exps = [math.exp(v - top) for v in row]
        out[idx] = [e / sum(exps) for e in exps]
    return np.moveaxis(out, -1, dim)


@settings(max_examples=40, deadline=None)
@given(shape=st.lists(st.integers(1, 5), min_size=1, max_size=4), data=st.data())
def test_softmax_matches_a_scalar_loop(shape, data):
    dim = data.draw(st.integers(-len(shape), len(shape) - 1))
    scale = data.draw(st.sampled_from([1.0, 30.0, 1e4]))
    x = (np.random.default_rng(len(shape) * 7 + dim).standard_normal(shape) * scale).astype(np.float32)
    y = E.softmax(x, dim=dim)
    assert y.dtype == np.float32
    np.testing.assert_allclose(y, loop_softmax(x, dim), rtol=1e-5, atol=1e-7)


def test_softmax_of_a_strided_view():
    x = np.random.default_rng(1).standard_normal((4, 6)).astype(np.float32)
    np.testing.assert_allclose(E.softmax(x.T, dim=-1), loop_softmax(x.T, -1), rtol=1e-5, atol=1e-7)


# -- dtype rules -------------------------------------------------------------------------------
def test_mixed_dtypes_compute_wide_and_round_to_the_first_input():
    a = np.array([1.0, 2048.0], np.float16)
    b = np.array([3e-4, 1.0], np.float32)
    y = E.add(a, b)
    assert y.dtype == np.float16
    np.testing.assert_array_equal(y, (a.astype(np.float64) + b).astype(np.float16))
    # an F64 operand makes the computation f64, the output keeps a's dtype
    a32, b64 = np.array([1.0], np.float32), np.array([1e-9], np.float64)
    assert E.sub(E.add(a32, b64).astype(np.float64), a32)[0] == np.float32(1.0 + 1e-9) - 1.0
    assert E.add(a32, b64).dtype == np.float32
    assert E.mul(b64, a32).dtype == np.float64


def test_bf16_stays_bf16_through_every_unary():
    x = np.array([-2.0, 0.5, 3.0], BF16)
    for fn in (E.relu, E.sigmoid, E.tanh, E.silu, E.gelu):
        assert fn(x).dtype == BF16
    assert E.softmax(x).dtype == BF16 and E.argmax(x).dtype == np.int64


def test_clamp_bounds_are_rounded_to_the_output_dtype():
    x = np.array([0.0, 0.05, 1.0, 60000.0], np.float16)
    y = E.clamp(x, min=0.1, max=1e5)  # 1e5 is inf in f16: no upper bound
    np.testing.assert_array_equal(y, np.array([0.1, 0.1, 1.0, 60000.0], np.float16))
    assert y.dtype == np.float16


def test_nan_to_num_clamps_replacements_to_the_dtype_range():
    x = np.array([np.nan, np.inf, -np.inf, 1.5], np.float16)
    y = E.nan_to_num(x, nan=1e6, posinf=1e6, neginf=-1e9)
    np.testing.assert_array_equal(y, np.array([65504, 65504, -65504, 1.5], np.float16))
    x = np.array([np.inf, -np.inf], BF16)
    y = E.nan_to_num(x, nan=0.0, posinf=3.4028234663852886e38, neginf=-3.4028234663852886e38)
    assert y.dtype == BF16 and float(y[0]) == float(ml_dtypes.finfo(BF16).max) == -float(y[1])


def test_scalar_inputs_give_0d_arrays():
    a = np.array(2.0, np.float32)
    for y in (E.add(a, a), E.relu(a), E.gelu(a), E.clamp(a, min=0.0, max=1.0), E.argmax(np.ones(3, np.float32))):
        assert isinstance(y, np.ndarray) and y.shape == ()


# -- run-time errors -----------------------------------------------------------------------------
@pytest.mark.parametrize("op, inputs, message", [
    (ops.Add(), [np.ones((2, 3), np.float32), np.ones((4,), np.float32)], "Add: cannot broadcast"),
    (ops.Div(), [np.ones((3,), np.float32), np.ones((2,), np.float32)], "Div: cannot broadcast"),
    (ops.PRelu(), [np.ones((2, 1), np.float32), np.ones((3,), np.float32)], "PRelu: slope [3]"),
    (ops.GeGlu(), [np.ones((2, 5), np.float32)], "GeGlu: dim 1 of x [2, 5] is 5, not even"),
    (ops.SwiGlu(), [np.ones((2, 3), np.float32), np.ones((2, 4), np.float32)], "SwiGlu: cannot broadcast"),
    (ops.Glu(dim=0), [np.ones((3, 2), np.float32)], "Glu: dim 0"),
    (ops.Argmax(), [np.ones((3, 0), np.float32)], "Argmax: x [3, 0] has nothing to choose from"),
    (ops.Softmax(dim=2), [np.ones((3, 2), np.float32)], "Softmax: dim=2 is out of range"),
])
def test_run_time_violations_raise_a_runtime_error(op, inputs, message):
    with pytest.raises(DistRuntimeError) as err:
        run(op, *inputs)
    assert str(err.value).startswith(message)
