"""The compiled products (``dist_runtime.backends.compiled.linear``) for every stored type,
against dequantize-then-matmul in float64 (``kernels.quant.dequantize`` is bit-exact with GGML's
``dequantize_row_*``: tests/test_kernels_quant.py holds it against the ``gguf`` package), and
batch-invariant: a row's result is bitwise the same alone or among any others, on any thread count.
"""

from __future__ import annotations

import numpy as np
import pytest

numba = pytest.importorskip("numba")

from dist_runtime.backends import compiled  # noqa: E402
from dist_runtime.backends.compiled import PRODUCTS, linear, set_threads  # noqa: E402
from dist_runtime.dtypes import DType  # noqa: E402
from dist_runtime.kernels.quant import dequantize, quantize  # noqa: E402
from dist_runtime.tensor import QuantizedArray  # noqa: E402

#: What the issue asks for: the types of F32/F16/BF16 checkpoints and of Q8_0 / Q4_K_M / Q5_K_M files.
REQUIRED = [DType.F32, DType.F16, DType.BF16, DType.Q8_0, DType.Q4_0, DType.Q4_1, DType.Q5_0,
            DType.Q4_K, DType.Q5_K, DType.Q6_K]
#: Where each K-quant block keeps its f16 super-block scales (byte offsets): d, then dmin if any.
K_SCALES = {DType.Q4_K: (0, 2), DType.Q5_K: (0, 2), DType.Q6_K: (208,)}


def weight(dtype: DType, n: int, k: int, seed: int = 0):
    """A weight of ``dtype`` [n, k] with O(1) values."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, k)).astype(np.float32)
    if dtype == DType.F32:
        return x
    if dtype in (DType.F16, DType.BF16):
        return x.astype(dtype.numpy)
    if dtype in K_SCALES:  # no reference encoder for K-quants: random codes with sane scales
        data = rng.integers(0, 256, (n, k // 256 * dtype.block_bytes), dtype=np.uint8)
        blocks = data.reshape(n, k // 256, dtype.block_bytes)
        for at in K_SCALES[dtype]:
            scale = rng.uniform(0.002, 0.02, blocks.shape[:2]).astype(np.float16)
            blocks[..., at:at + 2] = scale.view(np.uint8).reshape(*blocks.shape[:2], 2)
        return QuantizedArray(data, dtype, (n, k))
    return quantize(x, dtype)


def reference(x: np.ndarray, w) -> np.ndarray:
    wf = dequantize(w) if isinstance(w, QuantizedArray) else np.asarray(w, np.float32)
    return x.astype(np.float64) @ wf.astype(np.float64).T


def test_every_required_type_has_a_kernel():
    assert sorted(REQUIRED) == sorted(d for d in PRODUCTS if d in REQUIRED)


@pytest.mark.parametrize("dtype", REQUIRED, ids=lambda d: d.name)
@pytest.mark.parametrize("m, n, k", [(1, 1, 256), (1, 67, 512), (3, 40, 768), (17, 33, 256)])
def test_matches_dequantize_then_matmul(dtype, m, n, k):
    if dtype not in PRODUCTS:
        pytest.skip(f"no kernel for {dtype.name} yet")
    w = weight(dtype, n, k)
    x = np.random.default_rng(1).standard_normal((m, k)).astype(np.float32)
    want = reference(x, w)
    got = linear(x, w)
    assert got.dtype == np.float32 and got.shape == (m, n)
    assert np.max(np.abs(got - want)) <= 1e-5 * max(np.max(np.abs(want)), 1.0)


@pytest.mark.parametrize("dtype, activations", [(d, a) for d in REQUIRED for a in ("f32", "q8_0")[:1 + d.is_quantized]],
                         ids=lambda v: getattr(v, "name", v))
def test_rows_are_batch_invariant(dtype, activations):
    """Row m alone and among M - 1 others (M from 1 to 256), on 1 and 2 threads: bitwise equal,
    with f32 activations and (block types) quantized ones."""
    if dtype not in PRODUCTS:
        pytest.skip(f"no kernel for {dtype.name} yet")
    rng = np.random.default_rng(2)
    w = weight(dtype, 96, 512, seed=3)
    xs = rng.standard_normal((256, 512)).astype(np.float32)
    alone = np.concatenate([linear(xs[i:i + 1], w, activations=activations) for i in range(256)])
    try:
        for threads, m in [(1, 2), (2, 3), (2, 8), (1, 33), (2, 64), (2, 256), *((2, int(v)) for v in rng.integers(1, 257, 4))]:
            set_threads(threads)
            start = int(rng.integers(0, 256 - m + 1))
            got = linear(xs[start:start + m], w, activations=activations)
            assert np.array_equal(got.view(np.uint32), alone[start:start + m].view(np.uint32)), (threads, m)
    finally:
        set_threads(numba.config.NUMBA_NUM_THREADS)


@pytest.mark.parametrize("dtype", REQUIRED, ids=lambda d: d.name)
def test_edges_empty_rows_nan_inf_non_contiguous_read_only(dtype):
    if dtype not in PRODUCTS:
        pytest.skip(f"no kernel for {dtype.name} yet")
    w = weight(dtype, 8, 256)
    assert linear(np.zeros((0, 256), np.float32), w).shape == (0, 8)
    x = np.random.default_rng(4).standard_normal((4, 512)).astype(np.float32)[:, ::2]  # a strided view
    x.flags.writeable = False
    assert np.array_equal(linear(x, w), linear(np.ascontiguousarray(x), w))
    bad = np.array(x)
    bad[1, 3], bad[2, 5] = np.nan, np.inf
    y = linear(bad, w)
    assert np.isnan(y[1]).all() and not np.isfinite(y[2]).any() and np.isfinite(y[[0, 3]]).all()


@pytest.mark.parametrize("dtype", [DType.F32, DType.F16, DType.BF16, DType.Q4_0, DType.Q4_K], ids=lambda d: d.name)
def test_linear_many_gives_each_products_bits(dtype):
    """One launch for several weights (of one family's joint kernel; four: one call each): for
    every weight exactly ``linear``'s bits, with weights large enough to be threaded, on 1 and 2
    threads, odd row counts of the weights (1, 0: the launch's chunks follow the rows) and of
    ``x``."""
    ws = [weight(dtype, n, 512, seed=s) for s, n in enumerate((700, 1, 250, 0))]
    rng = np.random.default_rng(6)
    try:
        for threads in (2, 1):
            set_threads(threads)
            for group in (ws[:2], ws[:3], [ws[2], ws[3], ws[0]], ws):  # four: one call each
                for m in (1, 3, 9):
                    x = rng.standard_normal((m, 512)).astype(np.float32)
                    for act in ("f32", "q8_0"):
                        got = compiled.linear_many(x, group, activations=act)
                        for y, w in zip(got, group, strict=True):
                            assert np.array_equal(y.view(np.uint32), linear(x, w, activations=act).view(np.uint32))
        assert [y.shape for y in compiled.linear_many(np.zeros((0, 512), np.float32), ws[:2])] == [(0, 700), (0, 1)]
        assert compiled.linear_many(x, []) == []
    finally:
        set_threads(numba.config.NUMBA_NUM_THREADS)
    with pytest.raises(ValueError, match="columns differ"):
        compiled.linear_many(x, [ws[0], weight(dtype, 4, 256)])


@pytest.mark.parametrize("dtypes", [(DType.Q4_K, DType.Q4_K, DType.Q6_K), (DType.Q5_K, DType.Q6_K),
                                    (DType.Q8_0, DType.Q4_0, DType.Q5_1), (DType.Q4_K, DType.Q8_0, DType.F32)],
                         ids=lambda ds: "+".join(d.name for d in ds))
def test_linear_many_mixes_the_types_of_one_family(dtypes):
    """A Q4_K_M layer's q, k and v (Q4_K, Q4_K, Q6_K) share one launch, as do the legacy block
    types; across families each product runs alone.  Every product's bits are linear's."""
    ws = [weight(d, n, 512, seed=s) for s, (d, n) in enumerate(zip(dtypes, (900, 300, 301)))]
    rng = np.random.default_rng(7)
    try:
        for threads in (2, 1):
            set_threads(threads)
            for m in (1, 5):
                x = rng.standard_normal((m, 512)).astype(np.float32)
                for act in ("f32", "q8_0"):
                    for y, w in zip(compiled.linear_many(x, ws, activations=act), ws, strict=True):
                        assert np.array_equal(y.view(np.uint32), linear(x, w, activations=act).view(np.uint32))
    finally:
        set_threads(numba.config.NUMBA_NUM_THREADS)


def test_bad_arguments_are_refused():
    w = weight(DType.F32, 4, 64)
    with pytest.raises(ValueError, match="does not match"):
        linear(np.zeros((2, 32), np.float32), w)
    with pytest.raises(ValueError, match="activations must be"):
        linear(np.zeros((2, 64), np.float32), w, activations="q4")


def test_the_package_documents_its_threading_layer():
    assert "workqueue" in compiled.__doc__
