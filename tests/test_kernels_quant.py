"""Weight formats and quantization kernels (kernels/quant.py) against independent references.

* The ``gguf`` package (GGML's reference codecs in numpy, a CI dependency): our encoders must give
  the same bytes as ``gguf.quants.quantize`` and our decoders the same f32 bits as
  ``gguf.quants.dequantize``, on random data and on the blocks where codecs go wrong (all zero,
  all equal, ties for the largest magnitude, exact halves for the rounding, huge and tiny scales).
* ONNX's reference evaluator for QuantizeLinear / DequantizeLinear, through
  tests/fixtures/kernels/quant_linear.npz (tests/fixtures/make_matmul_fixtures.py).
* Closed forms: numpy/ml_dtypes casts for F16/BF16 (round to nearest even), every f16 bit pattern
  for the f16 decoder, per-format error bounds for ``quant_matmul`` against the unquantized
  weight (derived below), and memory bounds (tracemalloc) for "never a full f32 copy".
"""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import gguf.quants
import ml_dtypes
import numpy as np
import pytest
from gguf import GGMLQuantizationType

import dist_runtime.kernels.quant as Q
from dist_runtime.dtypes import DType
from dist_runtime.errors import DistRuntimeError
from dist_runtime.ir import ops
from dist_runtime.tensor import QuantizedArray
from kernel_cases import run_kernel as run

LEGACY = [DType.Q4_0, DType.Q4_1, DType.Q5_0, DType.Q5_1, DType.Q8_0]
K_QUANTS = [DType.Q2_K, DType.Q3_K, DType.Q4_K, DType.Q5_K, DType.Q6_K]
#: byte offsets of the f16 scale fields in a block (GGML's block_q*_K / block_q*_*)
F16_FIELDS = {DType.Q4_0: (0,), DType.Q4_1: (0, 2), DType.Q5_0: (0,), DType.Q5_1: (0, 2), DType.Q8_0: (0,),
              DType.Q2_K: (80, 82), DType.Q3_K: (108,), DType.Q4_K: (0, 2), DType.Q5_K: (0, 2),
              DType.Q6_K: (208,)}


def gg(dtype: DType) -> GGMLQuantizationType:
    return GGMLQuantizationType[dtype.name]


def oracle_encode(x: np.ndarray, dtype: DType) -> np.ndarray:
    return gguf.quants.quantize(np.ascontiguousarray(x, np.float32), gg(dtype))


def oracle_decode(q: QuantizedArray) -> np.ndarray:
    return gguf.quants.dequantize(q.data, gg(q.dtype))


def assert_same_bits(a: np.ndarray, b: np.ndarray) -> None:
    assert a.dtype == b.dtype == np.float32 and a.shape == b.shape
    np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


def hard_rows(rng) -> np.ndarray:
    """Rows of 64 (two blocks each) where block codecs tend to go wrong."""
    n = rng.standard_normal(64).astype(np.float32)
    halves = np.concatenate([[127.0], np.arange(-15, 16) + 0.5]).astype(np.float32)  # d = 1: x/d exact halves
    rows = [
        n, n * 1e-3, n * 1e3, n * 1e4,  # random at several magnitudes
        n * 1e-6,  # scales that are f16 subnormals
        np.zeros(64), np.full(64, 3.0), np.full(64, -3.0),  # all zero; all equal (Q4_1/Q5_1: d = 0)
        np.tile([2.0, -2.0], 32), np.tile([-2.0, 2.0], 32),  # ties for the largest magnitude: first wins
        np.where(np.arange(64) % 32 == 7, 50.0, n),  # one spike per block
        np.concatenate([halves, -halves]),  # roundf: half away from zero, not to even
        np.concatenate([[127.0, 0.49999997, -0.49999997, 1.4999999], np.zeros(28), n[:32]]),  # just below .5
        np.full(64, 8.2e6 / 127 * 127),  # Q8_0 scale amax/127 near f16's max
    ]
    return np.stack(rows).astype(np.float32)


# -- encoders and decoders vs gguf -------------------------------------------------------------
@pytest.mark.parametrize("dtype", LEGACY, ids=lambda d: d.name)
def test_quantize_is_bit_exact_with_gguf(dtype):
    rng = np.random.default_rng(1)
    x = hard_rows(rng)
    if dtype is not DType.Q8_0:
        x = x[:-1]  # 8.2e6 overflows the f16 scale of the 4/5-bit formats (inf, as in GGML)
    q = Q.quantize(x, dtype)
    assert isinstance(q, QuantizedArray) and q.dtype is dtype and q.shape == x.shape
    np.testing.assert_array_equal(q.data, oracle_encode(x, dtype))
    x3 = rng.standard_normal((2, 3, 96)).astype(np.float32)  # rank 3: blocks along the last dim
    np.testing.assert_array_equal(Q.quantize(x3, dtype).data, oracle_encode(x3, dtype).reshape(2, 3, -1))


@pytest.mark.parametrize("dtype,block,code,by_division", [
    (DType.Q8_0, ["0x1.739382p+1", "0x1.b3f198p+0"], 75, 74),  # x * id is 74.5, x / d 74.49999
    (DType.Q4_0, ["0x1.1c70dap+1", "-0x1.3ffef2p+0"], 4, 5),  # q - 8; x * id + 8.5 < 13 <= x / d + 8.5
], ids=["Q8_0", "Q4_0"])
def test_codes_use_the_reciprocal_of_d(dtype, block, code, by_division):
    """GGML computes codes from x * (1/d), and x / d rounds differently on these blocks (found by
    a random search): the code of element 1 tells which one an encoder used."""
    x = np.zeros((1, 32), np.float32)
    x[0, :2] = [float.fromhex(v) for v in block]
    q = Q.quantize(x, dtype)
    np.testing.assert_array_equal(q.data, oracle_encode(x, dtype))
    d16 = q.data[0, :2].view("<f2").astype(np.float32)[0]
    assert Q.dequantize(q)[0, 1] / d16 == code  # q * d16 is exact in f32 (7 + 11 bits)
    d = x[0, 0] / np.float32(127 if dtype is DType.Q8_0 else -8)
    naive = np.floor(x[0, 1] / d + 0.5) if dtype is DType.Q8_0 else np.trunc(x[0, 1] / d + 8.5) - 8
    assert naive == by_division


@pytest.mark.parametrize("dtype", [DType.Q8_0, DType.Q4_0], ids=lambda d: d.name)
@pytest.mark.parametrize("src", [np.float16, ml_dtypes.bfloat16, np.float64], ids=lambda t: np.dtype(t).name)
def test_quantize_widens_other_float_inputs_to_f32(dtype, src):
    x = np.random.default_rng(2).standard_normal((3, 64)).astype(src)
    np.testing.assert_array_equal(Q.quantize(x, dtype).data, oracle_encode(x.astype(np.float32), dtype))


@pytest.mark.parametrize("dtype", LEGACY, ids=lambda d: d.name)
def test_dequantize_is_bit_exact_with_gguf(dtype):
    rng = np.random.default_rng(3)
    x = hard_rows(rng)[:-1]
    q = QuantizedArray(oracle_encode(x, dtype), dtype, x.shape)
    assert_same_bits(Q.dequantize(q), oracle_decode(q))


def random_blocks(rng, dtype: DType, rows: int, blocks: int) -> QuantizedArray:
    """Arbitrary codes (including ones no encoder makes, e.g. Q8_0's -128) with finite f16 scales."""
    data = rng.integers(0, 256, (rows, blocks, dtype.block_bytes), dtype=np.uint8)
    for at in F16_FIELDS[dtype]:
        data[..., at : at + 2] = (rng.standard_normal((rows, blocks, 1)) * 0.1).astype("<f2").view(np.uint8)
    return QuantizedArray(data.reshape(rows, -1), dtype, (rows, blocks * dtype.block_size))


@pytest.mark.parametrize("dtype", LEGACY + K_QUANTS, ids=lambda d: d.name)
def test_dequantize_arbitrary_blocks_is_bit_exact_with_gguf(dtype):
    q = random_blocks(np.random.default_rng(4), dtype, rows=5, blocks=3)
    y = Q.dequantize(q)
    assert_same_bits(y, oracle_decode(q))
    # bands and gathers of rows decode only those rows, to the same values
    assert_same_bits(Q.dequantize(q, slice(1, 4)), y[1:4])
    assert_same_bits(Q.dequantize(q, np.array([4, 0, 4])), y[[4, 0, 4]])


def test_dequantize_q8_k_closed_form():
    """Q8_K (no gguf decoder): f32 d, int8 qs[256], int16 bsums[16]; x = d * q."""
    rng = np.random.default_rng(5)
    d = np.array([0.5, -0.125], np.float32)
    qs = rng.integers(-128, 128, (2, 256), dtype=np.int8)
    bsums = np.zeros((2, 32), np.uint8)  # unused by decoding
    data = np.concatenate([d.view(np.uint8).reshape(2, 4), qs.view(np.uint8), bsums], axis=1)
    y = Q.dequantize(QuantizedArray(data, DType.Q8_K, (2, 256)))
    np.testing.assert_array_equal(y, qs.astype(np.float32) * d[:, None])


def test_all_zero_blocks_decode_to_zeros():
    for dtype in LEGACY:
        q = Q.quantize(np.zeros((2, 64), np.float32), dtype)
        np.testing.assert_array_equal(Q.dequantize(q), np.zeros((2, 64), np.float32))


def test_empty_shapes():
    for dtype in (DType.Q8_0, DType.Q4_0):
        q = Q.quantize(np.zeros((0, 64), np.float32), dtype)
        assert q.data.shape == (0, 2 * dtype.block_bytes) and Q.dequantize(q).shape == (0, 64)
        q = Q.quantize(np.zeros((3, 0), np.float32), dtype)
        assert q.data.shape == (3, 0) and Q.dequantize(q).shape == (3, 0)


def test_every_block_type_decodes_and_encoders_are_named():
    assert {d for d in DType if d.is_quantized} == set(LEGACY + K_QUANTS + [DType.Q8_K])  # all tested above
    with pytest.raises(DistRuntimeError, match="Q6_K"):
        Q.quantize(np.zeros((1, 256), np.float32), DType.Q6_K)


# -- float formats -------------------------------------------------------------------------------
def test_f16_decoder_on_every_bit_pattern():
    bits = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    got = Q.f16_bits_to_f32(bits.reshape(256, 256))
    want = bits.view(np.float16).astype(np.float32).reshape(256, 256)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))  # NaN payloads, -0, subnormals
    assert Q.f16_bits_to_f32(np.zeros((0,), np.uint16)).shape == (0,)


def test_half_precision_rounds_to_nearest_even():
    """f16 keeps 10 fraction bits (ulp 2^-10 at 1), bf16 7 (ulp 2^-7): a value halfway between two
    neighbours goes to the one with an even last bit."""
    x = np.array([1 + 2**-11, 1 + 3 * 2**-11, 1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8)], np.float32)
    np.testing.assert_array_equal(Q.quantize(x, DType.F16).astype(np.float32),
                                  [1, 1 + 2**-9, 1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8)])
    np.testing.assert_array_equal(Q.quantize(x, DType.BF16).astype(np.float32), [1, 1, 1, 1 + 2**-6, -1])
    assert Q.quantize(x, DType.BF16).dtype == ml_dtypes.bfloat16


def test_f64_input_is_rounded_once():
    """Just above a tie, an f64 value must round up; rounding to f32 first lands on the tie, which
    then goes to even (ml_dtypes' own f64 -> bf16 cast does that)."""
    x = np.array([1 + 2**-8 + 2**-30, -(1 + 2**-8 + 2**-30), 1 + 2**-8, np.inf, np.nan, 1e300])
    y = Q.quantize(x, DType.BF16).astype(np.float64)
    np.testing.assert_array_equal(y, [1 + 2**-7, -(1 + 2**-7), 1, np.inf, np.nan, np.inf])
    x = np.array([1 + 2**-11 + 2**-40, 1 + 2**-11])
    np.testing.assert_array_equal(Q.quantize(x, DType.F16).astype(np.float64), [1 + 2**-10, 1])
    (c,) = run(ops.KvCompress(dtype=DType.BF16), np.array([[1 + 2**-8 + 2**-30]]))
    assert c.dtype == ml_dtypes.bfloat16 and float(c[0, 0]) == 1 + 2**-7


def test_to_float_gives_f32_for_every_weight():
    rng = np.random.default_rng(6)
    w = rng.standard_normal((4, 64)).astype(np.float32)
    assert Q.to_float(w) is w  # no copy of an f32 weight
    for stored in (w.astype(np.float16), w.astype(ml_dtypes.bfloat16), Q.quantize(w, DType.Q8_0)):
        y = Q.to_float(stored)
        assert y.dtype == np.float32 and y.shape == (4, 64)


# -- quant_matmul vs the unquantized weight --------------------------------------------------------
def element_error_bound(w: np.ndarray, dtype: DType) -> np.ndarray:
    """Largest |dequantized - w| per element of ``w``, from the encoders' definitions.

    Q8_0: q = round(x/d), d = amax/127: |x - q d| <= d/2 (plus 2^-23 relative slop for x * (1/d)
    in f32), and storing d as f16 moves q d by at most |q| |d| 2^-11 <= 127 d 2^-11.
    Q4_0/Q5_0: d = m/-8 (m/-16) for the element m of largest magnitude; q = trunc(x/d + 8.5) is
    x/d rounded up at halves, except that the opposite of m (x/d = 8) is clipped to 7: |d| at worst;
    plus 8 |d| 2^-11 (16 |d| 2^-11) for the f16 d.
    Q4_1/Q5_1: d = (max - min)/15 (31), rounding: d/2; f16 d and min: 15 d 2^-11 + |min| 2^-11.
    F16/BF16: half an ulp, |w| 2^-11 / 2^-8 (normal range).
    """
    b = w.reshape(*w.shape[:-1], -1, 32)
    amax = np.abs(b).max(-1, keepdims=True)
    lo, hi = b.min(-1, keepdims=True), b.max(-1, keepdims=True)
    u16 = 2.0**-11
    bound = {
        DType.Q8_0: lambda: amax / 127 * (0.5 + 1e-4 + 127 * u16),
        DType.Q4_0: lambda: amax / 8 * (1 + 8 * u16) * (1 + 1e-5),
        DType.Q5_0: lambda: amax / 16 * (1 + 16 * u16) * (1 + 1e-5),
        DType.Q4_1: lambda: (hi - lo) / 15 * (0.5 + 1e-4 + 15 * u16) + np.abs(lo) * u16,
        DType.Q5_1: lambda: (hi - lo) / 31 * (0.5 + 1e-4 + 31 * u16) + np.abs(lo) * u16,
        DType.F16: lambda: np.abs(b) * u16,
        DType.BF16: lambda: np.abs(b) * 2.0**-8,
    }[dtype]()
    return np.broadcast_to(bound, b.shape).reshape(w.shape)


@pytest.mark.parametrize("dtype", [DType.Q8_0, DType.Q4_0, DType.Q4_1, DType.Q5_0, DType.Q5_1, DType.F16,
                                   DType.BF16], ids=lambda d: d.name)
@pytest.mark.parametrize("m", [1, 3, Q.BLOCK_DOT_MAX_ROWS, Q.BLOCK_DOT_MAX_ROWS + 1])  # both paths
def test_quant_matmul_error_vs_f32_weight(dtype, m):
    """|x @ dequant(W)^T - x @ W^T| <= sum_k |x_k| e_k, e_k the per-element bound above, plus the
    f32 accumulation error gamma(K) sum_k |x_k w_k| (generously: 2 K u)."""
    rng = np.random.default_rng(7 + m)
    k, n = 256, 48
    w = rng.standard_normal((n, k)).astype(np.float32) * rng.uniform(0.01, 10, (n, 1)).astype(np.float32)
    x = rng.standard_normal((m, k)).astype(np.float32)
    y = Q.quant_matmul(x, Q.quantize(w, dtype))
    assert y.dtype == np.float32 and y.shape == (m, n)
    exact = x.astype(np.float64) @ w.astype(np.float64).T
    bound = np.abs(x).astype(np.float64) @ element_error_bound(w, dtype).T
    bound += 2 * k * 2.0**-24 * (np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64).T)
    assert np.all(np.abs(y - exact) <= bound)
    assert np.abs(y - exact).max() > 0.01 * bound.max()  # the bound is not vacuous


def stored(rng, dtype: DType, n: int, k: int):
    """A random ``[n, k]`` weight stored as ``dtype`` (K-quants: arbitrary blocks)."""
    if dtype in K_QUANTS:
        return random_blocks(rng, dtype, rows=n, blocks=k // 256)
    w = rng.standard_normal((n, k)).astype(np.float32)
    return Q.quantize(w, dtype) if dtype is not DType.F32 else w


def assert_product(y, x, w_values):
    """``y == x @ w_values^T`` up to f32 accumulation: gamma(K) sum_k |x_k w_k| (any order)."""
    x64, w64 = x.astype(np.float64), w_values.astype(np.float64)
    k = x.shape[-1]
    bound = k * 2.0**-24 / (1 - k * 2.0**-24) * (np.abs(x64) @ np.abs(w64).T) + 2.0**-24 * np.abs(x64 @ w64.T)
    assert y.shape == x.shape[:-1] + (w_values.shape[0],) and y.dtype == np.float32
    assert np.all(np.abs(y - x64 @ w64.T) <= bound)


@pytest.mark.parametrize("dtype", [DType.Q8_0, DType.Q4_0, DType.Q5_1, DType.Q4_K, DType.F16, DType.BF16,
                                   DType.F32], ids=lambda d: d.name)
def test_quant_matmul_bands_and_shapes(dtype, monkeypatch):
    """Bands of a few rows (and a shorter last band), leading dims, M = 0 and N = 0 all give the
    product with the decoded weight (gguf's decoder: an independent check of the fast paths)."""
    monkeypatch.setattr(Q, "BAND_BYTES", 3 * 256 * 4)  # about 3 rows of 256 per band
    rng = np.random.default_rng(8)
    w = stored(rng, dtype, 13, 256)
    values = oracle_decode(w) if isinstance(w, QuantizedArray) else np.asarray(w, np.float32)
    for x_shape in [(1, 256), (2, 256), (2, 3, 256), (5, 256), (0, 256), (Q.BLOCK_DOT_MAX_ROWS + 1, 256)]:
        x = rng.standard_normal(x_shape).astype(np.float32)
        assert_product(Q.quant_matmul(x, w), x, values)
    none = w[:0] if isinstance(w, np.ndarray) else QuantizedArray(w.data[:0], w.dtype, (0, 256))
    assert Q.quant_matmul(np.ones((2, 256), np.float32), none).shape == (2, 0)


def test_quant_matmul_f64_activations():
    rng = np.random.default_rng(9)
    w = Q.quantize(rng.standard_normal((8, 64)).astype(np.float32), DType.Q8_0)
    x = rng.standard_normal((2, 64))
    y = Q.quant_matmul(x, w)
    assert y.dtype == np.float64
    np.testing.assert_allclose(y, x @ oracle_decode(w).astype(np.float64).T, rtol=1e-12, atol=1e-12)


def peak_bytes(fn) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("dtype", [DType.F32, DType.F16, DType.BF16, DType.Q8_0, DType.Q4_0],
                         ids=lambda d: d.name)
def test_quant_matmul_never_copies_the_whole_weight(dtype):
    """A decode-step product on a 2048 x 2048 weight (16 MiB as f32) allocates at most a few
    cache-sized bands, and nothing weight-sized at all for an f32 weight (BLAS on a view)."""
    rng = np.random.default_rng(10)
    w32 = rng.standard_normal((2048, 2048)).astype(np.float32)
    w = w32 if dtype is DType.F32 else Q.quantize(w32, dtype)
    x = rng.standard_normal((1, 2048)).astype(np.float32)
    peak = peak_bytes(lambda: Q.quant_matmul(x, w))
    limit = 64 * 1024 if dtype is DType.F32 else 4 * Q.BAND_BYTES
    assert peak <= limit, f"{dtype.name}: peak {peak} bytes > {limit}"


# -- the Quantize / Dequantize / KvCompress / KvDecompress kernels ---------------------------------
def load_linear_cases():
    with np.load(Path(__file__).parent / "fixtures" / "kernels" / "quant_linear.npz") as z:
        entries = {k: z[k] for k in z.files}
    cases: dict[str, dict[str, np.ndarray]] = {}
    for key, value in entries.items():
        name, field = key.rsplit("/", 1)
        cases.setdefault(name, {})[field] = value
    return sorted(cases.items())


LINEAR_CASES = load_linear_cases()


@pytest.mark.parametrize("name,case", LINEAR_CASES, ids=[n for n, _ in LINEAR_CASES])
def test_linear_quantization_against_onnx(name, case):
    meta = json.loads(str(case["meta"]))
    inputs = [case["x"], case["scale"]] + ([case["zero_point"]] if "zero_point" in case else [])
    dtype = DType.from_numpy(np.dtype(meta["dtype"]))
    if meta["op"] == "QuantizeLinear":
        (y,) = run(ops.Quantize(dtype=dtype, axis=meta["axis"]), *inputs)
    else:
        (y,) = run(ops.Dequantize(axis=meta["axis"]), *inputs)
    assert y.dtype == case["expected"].dtype and y.shape == case["expected"].shape
    np.testing.assert_array_equal(y, case["expected"])  # integer codes, or one f32 multiply


def test_linear_quantize_f16_input_and_dequantize_to_f16():
    x = np.array([[0.5, 1.5, -2.5, 300.0]], np.float16)
    (q,) = run(ops.Quantize(dtype=DType.I8), x, np.array(1.0, np.float32))
    np.testing.assert_array_equal(q, np.array([[0, 2, -2, 127]], np.int8))
    (y,) = run(ops.Dequantize(dtype=DType.F16), q, np.array([0.5], np.float32), np.array([1], np.int8))
    assert y.dtype == np.float16
    np.testing.assert_array_equal(y, np.array([[-0.5, 0.5, -1.5, 63.0]], np.float16))


@pytest.mark.parametrize("dtype", [DType.Q8_0, DType.Q4_0], ids=lambda d: d.name)
def test_block_quantize_dequantize_kernels(dtype):
    x = np.random.default_rng(11).standard_normal((2, 3, 64)).astype(np.float32)
    (q,) = run(ops.Quantize(dtype=dtype), x)
    np.testing.assert_array_equal(q.data, oracle_encode(x, dtype).reshape(2, 3, -1))
    (y,) = run(ops.Dequantize(), q)
    assert_same_bits(y, oracle_decode(q))
    (y16,) = run(ops.Dequantize(dtype=DType.F16), q)
    np.testing.assert_array_equal(y16, oracle_decode(q).astype(np.float16))


@pytest.mark.parametrize("store", [DType.Q8_0, DType.Q4_0, DType.F16, DType.BF16], ids=lambda d: d.name)
@pytest.mark.parametrize("src", [np.float32, np.float16], ids=lambda t: np.dtype(t).name)
def test_kv_compress_and_decompress(store, src):
    x = np.random.default_rng(12).standard_normal((2, 5, 64)).astype(src)
    (c,) = run(ops.KvCompress(dtype=store), x)
    (y,) = run(ops.KvDecompress(dtype=DType.F32), c)
    assert y.dtype == np.float32 and y.shape == x.shape
    if store.is_quantized:
        assert isinstance(c, QuantizedArray) and c.shape == x.shape
        np.testing.assert_array_equal(c.data, oracle_encode(x.astype(np.float32), store).reshape(2, 5, -1))
        assert_same_bits(y, oracle_decode(c))
    else:  # round to nearest even from the f32 value; decompression is exact
        assert c.dtype == store.numpy
        np.testing.assert_array_equal(c, x.astype(np.float32).astype(store.numpy))
        np.testing.assert_array_equal(y, c.astype(np.float32))


def test_kv_compress_all_zero_block():
    (c,) = run(ops.KvCompress(dtype=DType.Q8_0), np.zeros((1, 32), np.float32))
    assert c.data[0, :2].view("<f2")[0] == 0.0
    np.testing.assert_array_equal(run(ops.KvDecompress(), c)[0], np.zeros((1, 32), np.float32))


# -- TokenEmbed -----------------------------------------------------------------------------------
@pytest.mark.parametrize("table_dtype", [DType.F32, DType.F16, DType.BF16, DType.Q8_0, DType.Q4_0,
                                         DType.Q6_K], ids=lambda d: d.name)
def test_token_embed(table_dtype):
    rng = np.random.default_rng(13)
    vocab, width = 10, 256
    if table_dtype is DType.Q6_K:
        table = random_blocks(rng, table_dtype, rows=vocab, blocks=1)
    else:
        t32 = rng.standard_normal((vocab, width)).astype(np.float32)
        table = Q.quantize(t32, table_dtype) if table_dtype.is_quantized else t32.astype(table_dtype.numpy)
    values = oracle_decode(table) if isinstance(table, QuantizedArray) else table
    for ids in [np.array([[3, 0, 9], [9, 9, 1]], np.int64), np.array(4, np.int32), np.zeros((0,), np.int64),
                np.array([7, 2], np.uint8), np.array([[5]], np.int8), np.array([1, 8], np.int16)]:
        (y,) = run(ops.TokenEmbed(), ids, table)
        assert y.dtype == (np.float32 if table_dtype.is_quantized else table_dtype.numpy)
        assert y.shape == ids.shape + (width,)
        np.testing.assert_array_equal(y, values[ids])


@pytest.mark.parametrize("bad", [10, -1, 2**40])
def test_token_embed_out_of_range_names_the_id_and_vocab(bad):
    table = np.zeros((10, 4), np.float32)
    ids = np.array([[1, 2], [bad, 3]], np.int64)
    message = rf"TokenEmbed: token id {bad} at index \(1, 0\).*vocab size of 10"
    with pytest.raises(DistRuntimeError, match=message):
        run(ops.TokenEmbed(), ids, table)


def test_token_embed_decodes_only_the_gathered_rows():
    table = Q.quantize(np.random.default_rng(14).standard_normal((4096, 256)).astype(np.float32), DType.Q8_0)
    ids = np.array([5, 4000, 17])
    peak = peak_bytes(lambda: run(ops.TokenEmbed(), ids, table))
    assert peak < 64 * 1024, peak  # the whole table as f32 would be 4 MiB
