"""The K-quant kernels (``dist_runtime.backends.compiled.kquants``) beyond the shared harness
(tests/test_compiled_linear.py): against ``gguf``'s decoder (independent of ours), on both paths
in one process (the AVX2 path's IR compiles on any CPU, so both always run here), with the f16
scales where decoders go wrong (subnormal, zero, negative, the largest), many super-blocks, and the
Q8_K activation path (``activations="q8_0"``) against a numpy ``quantize_row_q8_K_ref``, and the
threaded drivers against the serial ones.
"""

from __future__ import annotations

import numpy as np
import pytest

numba = pytest.importorskip("numba")
gguf_quants = pytest.importorskip("gguf.quants")

from gguf import GGMLQuantizationType  # noqa: E402
from test_compiled_linear import K_SCALES, reference, weight  # noqa: E402

from dist_runtime.backends.compiled import kquants, linear, registry, set_threads  # noqa: E402
from dist_runtime.dtypes import DType  # noqa: E402
from dist_runtime.tensor import QuantizedArray  # noqa: E402

TYPES = list(K_SCALES)
KIND = {DType.Q4_K: 4, DType.Q5_K: 5, DType.Q6_K: 6}
PATHS = {"avx2": True, "portable": False}
#: f16 bit patterns for d / dmin: subnormals (smallest, largest), zero, negative, the largest normal.
SPECIAL_F16 = np.array([0x0001, 0x03FF, 0x0000, 0x8000, 0xA3D7, 0x7BFF, 0x1400], np.uint16)


def on_path(x: np.ndarray, w: QuantizedArray, vec: bool) -> np.ndarray:
    out = np.empty((x.shape[0], w.shape[0]), np.float32)
    kquants.linear_k(np.ascontiguousarray(x, np.float32), w.data, out, KIND[w.dtype], vec)
    return out


def close(got: np.ndarray, want: np.ndarray) -> bool:
    return bool(np.max(np.abs(got - want)) <= 1e-5 * max(np.max(np.abs(want)), 1.0))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", TYPES, ids=lambda d: d.name)
def test_matches_gguf_dequantize_then_matmul(dtype, path):
    w = weight(dtype, 37, 1024, seed=5)
    x = np.random.default_rng(6).standard_normal((6, 1024)).astype(np.float32)
    wf = gguf_quants.dequantize(w.data, GGMLQuantizationType[dtype.name]).reshape(37, 1024)
    assert close(on_path(x, w, PATHS[path]), x.astype(np.float64) @ wf.astype(np.float64).T)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", TYPES, ids=lambda d: d.name)
def test_special_f16_scales(dtype, path):
    """Weight row ``n``'s d (and dmin) is ``SPECIAL_F16[n % 7]`` in every super-block: the kernels
    decode f16 with integer operations, so subnormals and signs must come out as numpy's cast has
    them (each output column checked against its own scale)."""
    n = 2 * len(SPECIAL_F16)
    w = weight(dtype, n, 768, seed=7)
    blocks = w.data.reshape(n, 3, dtype.block_bytes)
    bits = np.resize(SPECIAL_F16, n)[:, None].repeat(3, axis=1)
    for at in K_SCALES[dtype]:
        blocks[..., at:at + 2] = bits.view(np.uint8).reshape(n, 3, 2)
    x = np.random.default_rng(9).standard_normal((5, 768)).astype(np.float32)
    want = reference(x, w)
    got = on_path(x, w, PATHS[path])
    for col in range(n):
        assert np.max(np.abs(got[:, col] - want[:, col])) <= 1e-5 * np.max(np.abs(want[:, col])), col


@pytest.mark.parametrize("dtype", TYPES, ids=lambda d: d.name)
def test_portable_path_is_batch_invariant(dtype):
    """The shared harness checks the path this CPU takes; this one the other (portable) path."""
    w = weight(dtype, 40, 512, seed=10)
    xs = np.random.default_rng(11).standard_normal((70, 512)).astype(np.float32)
    alone = np.concatenate([on_path(xs[i:i + 1], w, False) for i in range(70)])
    try:
        for threads, m0, m in [(1, 0, 70), (2, 5, 9), (2, 33, 4)]:
            set_threads(threads)
            got = on_path(xs[m0:m0 + m], w, False)
            assert np.array_equal(got.view(np.uint32), alone[m0:m0 + m].view(np.uint32)), (threads, m)
    finally:
        set_threads(numba.config.NUMBA_NUM_THREADS)


def q8_k(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's ``quantize_row_q8_K_ref`` in numpy: per 256 elements, ``max`` the first
    element of largest magnitude, ``iscale = -127 / max`` (f32), codes ``min(127, rint(iscale x))``
    and ``d = 1 / iscale`` (an all-zero block: d = 0, codes 0).  Returns codes [M, K / 256, 256]
    and d [M, K / 256]."""
    blocks = x.reshape(x.shape[0], -1, 256)
    big = np.take_along_axis(blocks, np.abs(blocks).argmax(-1)[..., None], -1)[..., 0]
    safe = np.where(big == 0, np.float32(1), big)
    iscale = np.float32(-127) / safe
    codes = np.minimum(np.rint(iscale[..., None] * blocks), 127)
    d = np.float32(1) / iscale
    return np.where(big[..., None] == 0, 0, codes), np.where(big == 0, np.float32(0), d)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", TYPES, ids=lambda d: d.name)
def test_q8_activations_are_llama_cpps_numerics(dtype, path):
    """``activations="q8_0"`` on K-quants quantizes ``x`` to Q8_K (llama.cpp's
    ``vec_dot_q*_K_q8_K``): the result is the decoded weight times the *decoded activations*
    (within f32 rounding), and within the quantization's bound of the f32 product."""
    w = weight(dtype, 29, 1024, seed=14)
    x = np.random.default_rng(15).standard_normal((7, 1024)).astype(np.float32)
    x[3, 256:512] = 0.0  # an all-zero activation block
    codes, d = q8_k(x)
    wf = gguf_quants.dequantize(w.data, GGMLQuantizationType[dtype.name]).reshape(29, -1, 256).astype(np.float64)
    want = np.einsum("mbk,nbk,mb->mn", codes.astype(np.float64), wf, d.astype(np.float64))
    out = np.empty((7, 29), np.float32)
    kquants.linear_k(x, w.data, out, KIND[dtype], PATHS[path], q8=True)
    assert close(out, want)
    # |x - d q| <= |d| / 2 per element (rint), so |y_q8 - y| <= sum_b |d_b| / 2 * sum |w_b|.
    bound = np.einsum("mb,nb->mn", np.abs(d.astype(np.float64)) / 2, np.abs(wf).sum(-1))
    assert (np.abs(out - reference(x, w)) <= bound * (1 + 1e-4) + 1e-6).all()


@pytest.mark.parametrize("dtype", TYPES, ids=lambda d: d.name)
def test_q8_paths_agree_and_are_batch_invariant(dtype):
    """The integer sums are exact, so both paths give the same bits; rows alone or together too."""
    w = weight(dtype, 40, 512, seed=16)
    xs = np.random.default_rng(17).standard_normal((37, 512)).astype(np.float32)
    alone = np.concatenate([linear(xs[i:i + 1], w, activations="q8_0") for i in range(37)])
    assert np.array_equal(linear(xs, w, activations="q8_0").view(np.uint32), alone.view(np.uint32))
    portable = np.empty_like(alone)
    kquants.linear_k(xs, w.data, portable, KIND[dtype], False, q8=True)
    assert np.array_equal(portable.view(np.uint32), alone.view(np.uint32))


@pytest.mark.parametrize("dtype", TYPES, ids=lambda d: d.name)
def test_long_rows(dtype):
    """K = 4096: 16 super-blocks a row."""
    w = weight(dtype, 5, 4096, seed=12)
    x = np.random.default_rng(13).standard_normal((9, 4096)).astype(np.float32)
    assert close(linear(x, w), reference(x, w))


@pytest.mark.parametrize("dtype", TYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("activations", ["f32", "q8_0"])
def test_the_threaded_driver_gives_the_serial_bits(dtype, activations, monkeypatch):
    """Small products run on the calling thread alone (``SERIAL_BYTES``): here the pool's driver
    (which prepares ``x`` itself) runs them too, and must give the same bits."""
    w = weight(dtype, 203, 512, seed=12)
    x = np.random.default_rng(13).standard_normal((6, 512)).astype(np.float32)
    alone = linear(x, w, activations=activations)
    monkeypatch.setattr(registry, "SERIAL_BYTES", 0)
    try:
        set_threads(2)
        got = linear(x, w, activations=activations)
    finally:
        set_threads(numba.config.NUMBA_NUM_THREADS)
    assert np.array_equal(got.view(np.uint32), alone.view(np.uint32))


@pytest.mark.parametrize("dtype", TYPES, ids=lambda d: d.name)
def test_q8_activations_nan_and_inf_reach_their_rows(dtype):
    """A NaN in a block of x made no code bigger and went unseen (a finite wrong answer); an inf
    divided by zero (ZeroDivisionError).  Both now give their row NaN, the other rows untouched."""
    w = weight(dtype, 8, 512)
    x = np.random.default_rng(9).standard_normal((4, 512)).astype(np.float32)
    x[1, 300], x[2, 3] = np.nan, -np.inf
    y = linear(x, w, activations="q8_0")
    assert np.isnan(y[[1, 2]]).all() and np.isfinite(y[[0, 3]]).all()


def test_q8_k_quantizer_is_the_reference_bit_for_bit():
    """The compiled Q8_K quantizer against :func:`q8_k` (and its sums of 16 and 32 codes), with
    blocks where both signs reach the largest magnitude (the first must win), one where only the
    last element does, a negative largest, -0.0 and an all-zero block."""
    x = np.random.default_rng(16).standard_normal((3, 2048)).astype(np.float32)
    x[0, 10], x[0, 200] = 9.0, -9.0  # +9 first
    x[0, 256 + 5], x[0, 256 + 100] = -9.0, 9.0  # -9 first
    x[1, 255] = -7.5  # the last element, negative
    x[1, 256:512] = 0.0
    x[1, 300] = -0.0
    x[2, 512:768] = -0.0
    q, d, sums, sums16 = kquants._quantize_q8_k(x)
    codes, want_d = q8_k(x)
    assert np.array_equal(q.reshape(codes.shape), codes) and np.array_equal(d.reshape(want_d.shape), want_d)
    assert np.array_equal(sums16, codes.reshape(3, -1, 16).sum(-1).ravel())
    assert np.array_equal(sums, codes.reshape(3, -1, 32).sum(-1).ravel())
