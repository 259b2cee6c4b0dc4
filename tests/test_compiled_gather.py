"""TokenEmbed's compiled gather of a block-quantized table (dist_runtime/backends/compiled/gather.py):
the same bits as ``gguf``'s numpy reference codecs (GGML's ``dequantize_row_*``) and as the CPU
library's ``dequantize`` on every byte pattern, and the numba backend's TokenEmbed on such a table
in place of the CPU library's, with its errors.
"""

from __future__ import annotations

import numpy as np
import pytest

from dist_runtime.backends.compiled import gather
from dist_runtime.backends.cpu import CpuBackend
from dist_runtime.backends.numba import NumbaBackend
from dist_runtime.dtypes import DType
from dist_runtime.ir import Node, TensorSpec
from dist_runtime.ir.ops import TokenEmbed
from dist_runtime.kernels._common import KernelError
from dist_runtime.kernels.quant import dequantize, quantize
from dist_runtime.kernels.registry import KernelContext
from dist_runtime.tensor import QuantizedArray
from test_kernels_quant import F16_FIELDS, oracle_decode

RNG = np.random.default_rng(5)
TYPES = sorted(gather.DECODERS, key=lambda d: d.name)


def random_table(dtype: DType, rows: int, blocks: int, finite: bool) -> QuantizedArray:
    """Random bytes as a table: every code and scale bit pattern (``finite``: the f16 scales
    redrawn as finite values, so most results are numbers rather than NaN and inf)."""
    data = RNG.integers(0, 256, (rows, blocks, dtype.block_bytes), dtype=np.uint8)
    if finite:
        for at in F16_FIELDS[dtype]:
            scales = (RNG.standard_normal((rows, blocks)) * 0.01).astype(np.float16)
            data[..., at:at + 2] = scales[..., None].view(np.uint8)
    return QuantizedArray(data.reshape(rows, -1), dtype, (rows, blocks * dtype.block_size))


def assert_same_bits(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == want.dtype == np.float32 and got.shape == want.shape
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got.view(np.uint32)[~nan], want.view(np.uint32)[~nan])


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # the reference's NaN scales
@pytest.mark.parametrize("dtype", TYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("finite", [True, False], ids=["finite-scales", "any-bytes"])
def test_rows_are_the_cpu_librarys_bits(dtype, finite):
    table = random_table(dtype, rows=23, blocks=3, finite=finite)
    ids = np.array([0, 22, 5, 5, 17, 1])
    got = gather.rows(table, ids)
    picked = QuantizedArray(table.data[ids], dtype, (len(ids), table.shape[1]))
    with np.errstate(invalid="ignore", over="ignore"):  # gguf's decoders on NaN / inf scales
        assert_same_bits(got, oracle_decode(picked))
    assert_same_bits(got, dequantize(table, ids))


@pytest.mark.parametrize("dtype", [DType.Q8_0, DType.Q4_0, DType.Q5_1], ids=lambda d: d.name)
def test_rows_of_a_quantized_float_table(dtype):
    """A table made by our own quantizer (the blocks a Q8_0 model file holds), one block a row."""
    x = RNG.standard_normal((40, 32)).astype(np.float32)
    table = quantize(x, dtype)
    ids = RNG.integers(0, 40, 9)
    assert_same_bits(gather.rows(table, ids), dequantize(table, ids))


def test_no_ids_give_no_rows():
    table = random_table(DType.Q4_K, rows=3, blocks=1, finite=True)
    assert gather.rows(table, np.array([], np.int64)).shape == (0, 256)


def test_rows_refuses_what_it_does_not_decode():
    table = random_table(DType.Q4_K, rows=3, blocks=1, finite=True)
    flat = QuantizedArray(table.data.reshape(-1), DType.Q4_K, (3 * 256,))
    with pytest.raises(ValueError, match="2-D"):
        gather.rows(flat, np.array([0]))


def embed_node() -> Node:
    return Node(0, TokenEmbed(), ["ids", "table"], ["h"])


@pytest.mark.parametrize("dtype", [DType.Q4_K, DType.Q6_K, DType.Q8_0], ids=lambda d: d.name)
def test_the_numba_backend_takes_token_embed_on_a_block_table(dtype):
    numba, cpu = NumbaBackend(), CpuBackend()
    table = random_table(dtype, rows=50, blocks=2, finite=True)
    specs = [TensorSpec((-1,), DType.I64), TensorSpec(table.shape, dtype)]
    assert numba.supports(TokenEmbed(), specs)
    assert not numba.supports(TokenEmbed(), [specs[0], TensorSpec(table.shape, DType.F32)])  # a plain gather
    assert not numba.supports(TokenEmbed(), [TensorSpec((-1,), DType.F32), specs[1]])
    ids = np.array([[3, 49], [0, 3]])
    got = numba.bind(embed_node())([ids, table], KernelContext())
    want = cpu.bind(embed_node())([ids, table], KernelContext())
    assert got[0].shape == (2, 2, table.shape[1])
    assert_same_bits(got[0], want[0])


def test_the_numba_backends_token_embed_errors_as_the_cpu_library():
    table = random_table(DType.Q4_K, rows=10, blocks=1, finite=True)
    for backend in (NumbaBackend(), CpuBackend()):
        with pytest.raises(KernelError, match=r"token id 10 at index \(1,\) .* vocab size of 10"):
            backend.bind(embed_node())([np.array([2, 10]), table], KernelContext())


def test_an_f32_table_off_the_plan_is_the_cpu_librarys():
    table = RNG.standard_normal((6, 8)).astype(np.float32)
    got = NumbaBackend().bind(embed_node())([np.array([4, 1]), table], KernelContext())
    np.testing.assert_array_equal(got[0], table[[4, 1]])
