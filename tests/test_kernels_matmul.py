"""The product kernels (kernels/matmul.py) against independent references.

* PyTorch, through tests/fixtures/kernels/matmul.npz (written by tests/fixtures/make_matmul_fixtures.py:
  ``F.linear`` / ``torch.matmul``, PEFT's LoRA formula, ``torch.kron``, ``torch.linalg.inv``,
  LlamaRMSNorm + ``F.linear``, ``F.silu`` gating; torch computes in f64 from the exact inputs).
* The ``gguf`` package for block-quantized weights: the reference multiplies by
  ``gguf.quants.dequantize`` of the same blocks, in f64.
* The unfused composition of registered kernels for the fused ops.

Tolerances are error bounds derived per op, not fixed constants: an f32 dot product of length K
(any summation order) is within ``gamma(K) * sum_k |a_k b_k|`` of the exact one, with
``gamma(n) = n u / (1 - n u)`` and ``u = 2^-24`` (Higham, "Accuracy and Stability of Numerical
Algorithms", 3.1); rounding the result once to the output dtype adds ``u_out * |y|`` (2^-24 f32,
2^-11 f16, 2^-8 bf16).  A BLAS on another machine sums in another order and still passes.
"""

from __future__ import annotations

from pathlib import Path

import gguf.quants
import ml_dtypes
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from kernel_cases import load_cases, run_kernel as run, stored_inputs

import dist_runtime.kernels.matmul as MM
from dist_runtime.dtypes import DType
from dist_runtime.errors import DistRuntimeError
from dist_runtime.ir import ops
from dist_runtime.tensor import QuantizedArray
from dist_runtime.kernels.registry import kernel_for

FIXTURE = Path(__file__).parent / "fixtures" / "kernels" / "matmul.npz"
CASES = load_cases(FIXTURE)
OPS = ["Matmul", "LoraApply", "Kron", "MatrixInverse", "FusedNormMatmul", "FusedSwiGlu"]

#: unit roundoff of the compute dtype (f32, or f64 for F64 inputs) and of the output dtype
U_COMPUTE = {"f32": 2.0**-24, "f16": 2.0**-24, "bf16": 2.0**-24, "f64": 2.0**-53}
U_OUT = {"f32": 2.0**-24, "f16": 2.0**-11, "bf16": 2.0**-8, "f64": 2.0**-53}
#: below f16's normal range its rounding error is absolute: half its smallest subnormal
ATOL_OUT = {"f32": 0.0, "f16": 2.0**-25, "bf16": 0.0, "f64": 0.0}


def gamma(n: int, u: float) -> float:
    return n * u / (1 - n * u)


def f64(a) -> np.ndarray:
    return np.asarray(a, np.float64)


def matmul_abs(a, b, transpose_b: bool) -> np.ndarray:
    """``|a| @ |B|`` with Matmul's operand rules: the scale of the rounding errors."""
    a, b = np.abs(f64(a)), np.abs(f64(b))
    if transpose_b and b.ndim > 1:
        b = np.swapaxes(b, -1, -2)
    return np.matmul(a, b)


def rms_normed(x, weight, eps) -> np.ndarray:
    x = f64(x)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + float(np.float32(eps))) * f64(weight)


def silu(g: np.ndarray) -> np.ndarray:
    return g / (1.0 + np.exp(-g))


def error_bound(case) -> np.ndarray:
    """How far the kernel's output may be from the exact result, per element (see the docstring)."""
    op, ins, uc = case.op, case.inputs, U_COMPUTE[case.dtype]
    rounding = U_OUT[case.dtype] * np.abs(case.expected) + ATOL_OUT[case.dtype]
    if isinstance(op, ops.Matmul):
        k = ins[0].shape[-1]
        return gamma(k, uc) * matmul_abs(ins[0], ins[1], op.transpose_b) + rounding
    if isinstance(op, ops.LoraApply):
        x, w, a, b = ins
        low_rank = matmul_abs(matmul_abs(x, a, True), b, True) * abs(op.scale)
        return gamma(x.shape[-1] + a.shape[0] + 2, uc) * (matmul_abs(x, w, True) + low_rank) + rounding
    if isinstance(op, ops.Kron):  # one product each, exact in f64, rounded once
        return rounding + uc * np.abs(case.expected)
    if isinstance(op, ops.MatrixInverse):  # f64 LU on both sides: well conditioned cases, cond < 20
        return rounding + 1e-12 * np.abs(case.expected).max(initial=0.0)
    if isinstance(op, ops.FusedNormMatmul):  # normed rows: mean of K squares, sqrt, div, 2 muls
        x, nw, w = ins
        k = x.shape[-1]
        return gamma(2 * k + 8, uc) * matmul_abs(np.abs(rms_normed(x, nw, op.eps)), w, True) + rounding
    if isinstance(op, ops.FusedSwiGlu):  # |silu'| <= 1.1; silu itself: exp, add, div, mul
        x, wg, wu = ins
        g, up = (matmul_abs(x, w, True) for w in (wg, wu))  # scales of |x| |W|^T
        gate, value = (np.matmul(f64(x), f64(w).T) for w in (wg, wu))
        dg, du = gamma(x.shape[-1], uc) * g, gamma(x.shape[-1], uc) * up
        silu_rounding = 8 * uc * np.abs(case.expected)
        return 1.1 * dg * (np.abs(value) + du) + np.abs(silu(gate)) * du + silu_rounding + rounding
    raise AssertionError(type(op))


def assert_within(y: np.ndarray, expected: np.ndarray, bound: np.ndarray) -> None:
    err = np.abs(f64(y) - expected)
    bound = np.broadcast_to(bound, err.shape)
    if not np.all(err <= bound):
        i = np.unravel_index(np.argmax(err - bound), err.shape)
        raise AssertionError(f"error {err[i]:.3g} > bound {bound[i]:.3g} at {i}: "
                             f"got {y[i]}, want {expected[i]}")


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_against_torch(case):
    before = [a.copy() for a in case.inputs]
    (y,) = run(case.op, *case.inputs)
    assert isinstance(y, np.ndarray) and y.dtype == case.inputs[0].dtype  # f32 stays f32 (NEP 50)
    assert y.shape == case.expected.shape
    assert_within(y, case.expected, error_bound(case))
    for a, b in zip(case.inputs, before):  # kernels never write into their inputs
        np.testing.assert_array_equal(a, b)


def test_every_op_has_cases_and_a_kernel():
    assert {type(c.op).__name__ for c in CASES} == set(OPS)
    for name in OPS:
        kernel_for(getattr(ops, name))


def test_bf16_inputs_are_stored_exactly():
    """bf16 inputs are stored as f32 values: one that bf16 cannot hold would be rounded before the
    kernel sees it, while the reference was computed from the unrounded value."""
    stored = stored_inputs(FIXTURE, "bf16")
    assert len(stored) >= len(OPS)  # every op has a bf16 case
    inexact = [name for name, a in stored.items()
               if not np.array_equal(a.astype(ml_dtypes.bfloat16).astype(a.dtype), a)]
    assert inexact == []


# -- block-quantized and half-precision weights -------------------------------------------------
def blocks(w: np.ndarray, dtype: DType) -> QuantizedArray:
    """``w`` quantized by the gguf package (the oracle, not our encoder)."""
    data = gguf.quants.quantize(np.ascontiguousarray(w, np.float32), GGMLQuantizationType[dtype.name])
    return QuantizedArray(data, dtype, w.shape)


def exact_values(w) -> np.ndarray:
    """A weight's values in f64: ``gguf.quants.dequantize`` for blocks."""
    if isinstance(w, QuantizedArray):
        return f64(gguf.quants.dequantize(w.data, GGMLQuantizationType[w.dtype.name]))
    return f64(w)


WEIGHT_DTYPES = [DType.F32, DType.F16, DType.BF16, DType.Q8_0, DType.Q4_0, DType.Q4_1, DType.Q5_0, DType.Q5_1]


def weight(rng, shape, dtype: DType):
    w = rng.standard_normal(shape).astype(np.float32)
    if dtype.is_quantized:
        return blocks(w, dtype)
    return w.astype(dtype.numpy)


def check_product(y, x, w_values, transpose_b=True, k=None):
    expected = np.matmul(f64(x), np.swapaxes(w_values, -1, -2) if transpose_b else w_values)
    scale = matmul_abs(x, w_values, transpose_b)
    assert_within(y, expected, gamma(k or x.shape[-1], 2.0**-24) * scale + 2.0**-24 * np.abs(expected))


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("x_shape", [(64,), (1, 64), (3, 64), (2, 5, 64)],
                         ids=lambda s: "x" + "x".join(map(str, s)))
def test_matmul_weight_formats(dtype, x_shape):
    rng = np.random.default_rng(hash((dtype.name, x_shape)) % 2**32)
    x = rng.standard_normal(x_shape).astype(np.float32)
    w = weight(rng, (24, 64), dtype)
    (y,) = run(ops.Matmul(transpose_b=True), x, w)
    assert y.dtype == np.float32 and y.shape == x_shape[:-1] + (24,)
    check_product(y, x, exact_values(w))


@pytest.mark.parametrize("dtype", [DType.Q8_0, DType.Q4_0, DType.F16, DType.BF16], ids=lambda d: d.name)
def test_matmul_kn_with_blocks_along_n(dtype):
    """transpose_b false: b is stored [K, N], so its blocks run along N."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 3, 40)).astype(np.float32)
    w = weight(rng, (40, 64), dtype)
    (y,) = run(ops.Matmul(transpose_b=False), x, w)
    assert y.shape == (2, 3, 64) and y.dtype == np.float32
    check_product(y, x, exact_values(w), transpose_b=False)


@pytest.mark.parametrize("transpose_b", [True, False])
def test_matmul_batched_blocks_broadcast(transpose_b):
    rng = np.random.default_rng(4)
    b_shape = (2, 24, 32) if transpose_b else (2, 16, 32)
    w = weight(rng, b_shape, DType.Q8_0)
    for a_shape in [(3, 1, 4, b_shape[-1] if transpose_b else 16), (b_shape[-1] if transpose_b else 16,)]:
        a = rng.standard_normal(a_shape).astype(np.float32)
        (y,) = run(ops.Matmul(transpose_b=transpose_b), a, w)
        check_product(y, a, exact_values(w), transpose_b)


def test_matmul_f16_activation_and_f64_weight():
    """f16 a: computed in f32, rounded once to f16; an F64 weight makes the product f64."""
    rng = np.random.default_rng(5)
    a = rng.standard_normal((3, 32)).astype(np.float16)
    w = rng.standard_normal((8, 32)).astype(np.float32)
    for b in (w.astype(ml_dtypes.bfloat16), blocks(w, DType.Q8_0)):
        (y,) = run(ops.Matmul(), a, b)
        expected = f64(a) @ exact_values(b).T
        assert y.dtype == np.float16
        assert_within(y, expected, gamma(32, 2.0**-24) * matmul_abs(a, exact_values(b), True)
                      + 2.0**-11 * np.abs(expected) + 2.0**-25)
    (y,) = run(ops.Matmul(), a.astype(np.float32), w.astype(np.float64))
    assert y.dtype == np.float32
    np.testing.assert_allclose(y, (f64(a) @ f64(w).T).astype(np.float32), rtol=2.0**-23)


def test_matmul_k0_with_blocks_gives_zeros():
    x = np.ones((2, 0), np.float32)
    w = QuantizedArray(np.zeros((3, 0), np.uint8), DType.Q8_0, (3, 0))
    (y,) = run(ops.Matmul(), x, w)
    np.testing.assert_array_equal(y, np.zeros((2, 3), np.float32))


# -- LoRA and the fused ops on quantized weights -------------------------------------------------
@pytest.mark.parametrize("dtype", [DType.Q4_0, DType.Q8_0, DType.F16], ids=lambda d: d.name)
def test_lora_apply_with_quantized_base(dtype):
    rng = np.random.default_rng(6)
    x = rng.standard_normal((2, 3, 64)).astype(np.float32)
    w = weight(rng, (16, 64), dtype)
    a = rng.standard_normal((4, 64)).astype(np.float32)
    b = rng.standard_normal((16, 4)).astype(np.float32)
    (y,) = run(ops.LoraApply(scale=0.5), x, w, a, b)
    wv = exact_values(w)
    expected = f64(x) @ wv.T + 0.5 * ((f64(x) @ f64(a).T) @ f64(b).T)
    scale = matmul_abs(x, wv, True) + 0.5 * matmul_abs(matmul_abs(x, a, True), b, True)
    assert_within(y, expected, gamma(64 + 4 + 2, 2.0**-24) * scale + 2.0**-24 * np.abs(expected))


@pytest.mark.parametrize("w_dtype", [DType.F32, DType.Q8_0, DType.Q4_0, DType.BF16], ids=lambda d: d.name)
def test_fused_ops_equal_the_unfused_graph_f32(w_dtype):
    """FusedNormMatmul = RmsNorm then Matmul; FusedSwiGlu = two Matmuls then SwiGlu (the registered
    kernels).  In f32 both sides are the same operations in the same order: equal bits."""
    rng = np.random.default_rng(7)
    x, nw = rng.standard_normal((2, 3, 64)).astype(np.float32), rng.standard_normal(64).astype(np.float32)
    w, wg, wu = (weight(rng, (32, 64), w_dtype) for _ in range(3))
    (fused,) = run(ops.FusedNormMatmul(eps=1e-6), x, nw, w)
    (unfused,) = run(ops.Matmul(), run(ops.RmsNorm(eps=1e-6), x, nw)[0], w)
    np.testing.assert_array_equal(fused, unfused)
    (fused,) = run(ops.FusedSwiGlu(), x, wg, wu)
    (unfused,) = run(ops.SwiGlu(), run(ops.Matmul(), x, wg)[0], run(ops.Matmul(), x, wu)[0])
    np.testing.assert_array_equal(fused, unfused)


@pytest.mark.parametrize("w_dtype", [DType.F32, DType.Q8_0, DType.F16], ids=lambda d: d.name)
def test_fused_ops_match_the_unfused_graph_f16(w_dtype):
    """With an f16 x the unfused graph also rounds its intermediates (normed rows; gate and up) to
    f16, 2^-11 relative each, and both sides round their result (2^-11 |y| each): that bounds the
    difference, besides f32 accumulation (gamma(K) per product)."""
    rng = np.random.default_rng(8)
    x, nw = rng.standard_normal((2, 3, 64)).astype(np.float16), rng.standard_normal(64).astype(np.float16)
    w, wg, wu = (weight(rng, (32, 64), w_dtype) for _ in range(3))
    h, g64 = 2.0**-11, gamma(64, 2.0**-24)

    (fused,) = run(ops.FusedNormMatmul(eps=1e-6), x, nw, w)
    (unfused,) = run(ops.Matmul(), run(ops.RmsNorm(eps=1e-6), x, nw)[0], w)
    scale = matmul_abs(rms_normed(x, nw, 1e-6), exact_values(w), True)
    assert fused.dtype == np.float16
    assert_within(fused, f64(unfused), (h + 2 * g64) * 1.01 * scale + 2 * h * np.abs(f64(unfused)) + 2.0**-24)

    (fused,) = run(ops.FusedSwiGlu(), x, wg, wu)
    gate, up = (run(ops.Matmul(), x, m)[0] for m in (wg, wu))
    (unfused,) = run(ops.SwiGlu(), gate, up)
    dg, du = (h * np.abs(f64(v)) + 2 * g64 * matmul_abs(x, exact_values(m), True)
              for v, m in ((gate, wg), (up, wu)))
    bound = 1.1 * dg * (np.abs(f64(up)) + du) + np.abs(silu(f64(gate))) * du
    assert fused.dtype == np.float16
    assert_within(fused, f64(unfused), bound + 2 * h * np.abs(f64(unfused)) + 2.0**-24)


# -- errors ---------------------------------------------------------------------------------------
def test_singular_matrix_is_a_clear_error():
    x = np.stack([np.eye(3), [[1.0, 2.0, 3.0], [2.0, 4.0, 6.0], [0.0, 1.0, 1.0]]]).astype(np.float32)
    with pytest.raises(DistRuntimeError, match=r"MatrixInverse: .*batch index \[1\].* singular"):
        run(ops.MatrixInverse(), x)
    with pytest.raises(DistRuntimeError, match="singular"):
        run(ops.MatrixInverse(), np.zeros((2, 2), np.float32))


def test_kron_is_callable_on_its_own():
    y = MM.kron(np.array([1.0, 2.0], np.float32), np.array([[1.0], [10.0]], np.float32))
    np.testing.assert_array_equal(y, [[1.0, 2.0], [10.0, 20.0]])
