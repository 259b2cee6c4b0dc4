"""Shape rules (dist_runtime/ir/shape_rules.py) against hand-written expectations and numpy.

* ``VALID``: for every op, inputs and the exact output (shape, dtype) list, worked out by hand
  from the op's maths in docs/ops.md -- never computed by the rule under test.
* ``INVALID``: the important violations; each must raise ``ShapeError`` whose message starts with
  the op's name and contains the given fragments (input index, shapes, the numbers involved).
* Property tests (hypothesis, derandomized): the rules agree with numpy wherever numpy defines
  the shape (broadcasting, matmul, reshape, transpose, permute, concat, split, kron, sliding
  windows, pixel shuffle as reshape + transpose).
* Unknown dims: hiding any dims of a valid case as -1 never makes it fail.
* Robustness (seeded random fuzz, and mutations of the valid cases): no input -- rank 0, zero
  dims, any dtype, zero / negative / nan payload values -- makes a rule raise anything but
  ``ShapeError``.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from dist_runtime.dtypes import DType
from dist_runtime.ir import ops
from dist_runtime.ir.graph import TensorSpec
from dist_runtime.ir.ops import (AdaLN, Argmax, BatchNorm, CausalConv1d, Chunk, Clamp, Concat,
                                 Conv1d, Conv2d, Conv3d, ConvTranspose2d, Dequantize,
                                 DepthwiseConv, FlashAttention, FlowStep, FusedNormMatmul,
                                 FusedSkipNorm, FusedSwiGlu, Gelu, GeGlu, Glu, GroupNorm,
                                 InstanceNorm, Interpolate, KvCache, KvCompress, KvDecompress,
                                 Kron, LayerNorm, LeakyRelu, LoraApply, Matmul, MatrixInverse,
                                 NanToNum, NoiseSchedule, PatchEmbed, Permute, PixelShuffle,
                                 PixelUnshuffle, Pool, PosEmbed, PRelu, Quantize,
                                 RelativePosEmbedding, Relu, Reshape, RmsNorm, Rope, Sample, Sdpa,
                                 SdpaCross, SdpaWindow, Sigmoid, Silu, SinusoidalEmbed, Softmax,
                                 Split, SwiGlu, Tanh, TokenEmbed, Transpose, Unpatchify, Add, Div,
                                 Mul, Sub)
from dist_runtime.ir.shape_rules import ShapeError

F32, F16, BF16, F64 = DType.F32, DType.F16, DType.BF16, DType.F64
I8, U8, I32, I64 = DType.I8, DType.U8, DType.I32, DType.I64
Q8, Q4, Q4K = DType.Q8_0, DType.Q4_0, DType.Q4_K


def t(*shape: int, dtype: DType = F32) -> TensorSpec:
    return TensorSpec(shape, dtype)


def f16(*shape): return t(*shape, dtype=F16)
def i64(*shape): return t(*shape, dtype=I64)
def i32(*shape): return t(*shape, dtype=I32)
def q8(*shape): return t(*shape, dtype=Q8)
def q4(*shape): return t(*shape, dtype=Q4)


def infer(op, inputs) -> list[tuple[tuple[int, ...], DType]]:
    """Run the op's shape rule as the validator does: arity first, output count after."""
    lo, hi = op.spec.inputs
    assert lo <= len(inputs) <= hi, f"test case gives {len(inputs)} inputs to {op}"
    out = op.spec.shape(op, list(inputs))
    assert len(out) == op.spec.num_outputs(op)
    assert all(o.offset is None and o.size is None for o in out)
    return [(o.shape, o.dtype) for o in out]


# -- valid cases: (op, inputs, expected outputs), by hand ---------------------------------------
V = pytest.param
VALID = [
    # Matmul: numpy matmul; transpose_b stores b as [N, K]
    V(Matmul(), [t(-1, 4096), q8(1024, 4096)], [((-1, 1024), F32)], id="matmul-linear-q8"),
    V(Matmul(transpose_b=False), [t(2, 3, 4), t(4, 5)], [((2, 3, 5), F32)], id="matmul-kn"),
    V(Matmul(), [t(2, 1, 3, 4), t(5, 6, 4)], [((2, 5, 3, 6), F32)], id="matmul-batch-bcast"),
    V(Matmul(), [t(4), t(4)], [((), F32)], id="matmul-vec-vec"),
    V(Matmul(), [t(4), t(3, 4)], [((3,), F32)], id="matmul-vec-mat"),
    V(Matmul(transpose_b=False), [t(2, 3, 4), t(4)], [((2, 3), F32)], id="matmul-mat-vec"),
    V(Matmul(), [f16(7, 64), q4(32, 64)], [((7, 32), F16)], id="matmul-f16-q4"),
    V(Matmul(), [t(-1, -1, 64), t(-1, 64)], [((-1, -1, -1), F32)], id="matmul-unknown"),
    V(Matmul(transpose_b=False), [t(0, 3), t(3, 0)], [((0, 0), F32)], id="matmul-zero"),
    # elementwise binary ops: numpy broadcasting
    V(Add(), [t(2, 1, 4), t(3, 1)], [((2, 3, 4), F32)], id="add-bcast"),
    V(Add(), [t(), t(5)], [((5,), F32)], id="add-scalar"),
    V(Add(), [t(-1, 4), t(4)], [((-1, 4), F32)], id="add-unknown-known"),
    V(Add(), [t(4), t(-1)], [((-1,), F32)], id="add-4-with-unknown"),
    V(Add(), [t(1, 3), t(-1, 1)], [((-1, 3), F32)], id="add-1-with-unknown"),
    V(Add(), [t(0, 3), t(1, 3)], [((0, 3), F32)], id="add-zero"),
    V(Mul(), [f16(2, 3), t(3)], [((2, 3), F16)], id="mul-first-dtype"),
    V(Sub(), [t(5, 1), t(1, 6)], [((5, 6), F32)], id="sub"),
    V(Div(), [t(2, 3), t()], [((2, 3), F32)], id="div"),
    # layout
    V(Transpose(), [t(2, 3, 4)], [((2, 4, 3), F32)], id="transpose-default"),
    V(Transpose(dim0=0, dim1=-1), [i64(2, 3, 4)], [((4, 3, 2), I64)], id="transpose-neg"),
    V(Transpose(dim0=0, dim1=0), [t(5)], [((5,), F32)], id="transpose-same"),
    V(Reshape(shape=(0, -1)), [t(2, 3, 4)], [((2, 12), F32)], id="reshape-copy-infer"),
    V(Reshape(shape=(0, 0, 32, 128)), [t(-1, -1, 4096)], [((-1, -1, 32, 128), F32)],
      id="reshape-split-heads"),
    V(Reshape(shape=(0, 0, -1)), [t(-1, -1, 32, 128)], [((-1, -1, 4096), F32)],
      id="reshape-merge-heads-unknown-batch"),
    V(Reshape(shape=(-1, 32, 128)), [t(-1, 4096)], [((-1, 32, 128), F32)], id="reshape-unknown"),
    V(Reshape(shape=(2, 3)), [t(6)], [((2, 3), F32)], id="reshape-plain"),
    V(Reshape(shape=()), [t(1, 1)], [((), F32)], id="reshape-to-scalar"),
    V(Reshape(shape=(-1,)), [t()], [((1,), F32)], id="reshape-scalar-infer"),
    V(Reshape(shape=(-1, 2)), [t(0, 4)], [((0, 2), F32)], id="reshape-empty-infer"),
    V(Reshape(shape=(0, 5)), [t(0, 4)], [((0, 5), F32)], id="reshape-copied-zero"),
    V(Permute(perm=(2, 0, 1)), [t(2, 3, 4)], [((4, 2, 3), F32)], id="permute"),
    V(Permute(perm=(-1, 0, -2)), [t(2, 3, 4)], [((4, 2, 3), F32)], id="permute-neg"),
    V(Permute(perm=()), [t()], [((), F32)], id="permute-scalar"),
    V(Concat(dim=-1), [t(2, 3), t(2, 5)], [((2, 8), F32)], id="concat"),
    V(Concat(dim=1), [t(-1, 3), t(2, -1)], [((2, -1), F32)], id="concat-unknown"),
    V(Concat(dim=0), [i64(1, 4), i64(2, 4), i64(0, 4)], [((3, 4), I64)], id="concat-three"),
    V(Split(dim=-1, sizes=(3, 7)), [t(2, 10)], [((2, 3), F32), ((2, 7), F32)], id="split"),
    V(Split(dim=0, sizes=(1, 2)), [t(-1, 4)], [((1, 4), F32), ((2, 4), F32)], id="split-unknown"),
    V(Split(dim=1, sizes=(0, 10)), [t(2, 10)], [((2, 0), F32), ((2, 10), F32)], id="split-zero"),
    V(Chunk(dim=-1, chunks=3), [t(4, 6)], [((4, 2), F32)] * 3, id="chunk"),
    V(Chunk(dim=0, chunks=2), [t(-1)], [((-1,), F32)] * 2, id="chunk-unknown"),
    V(Clamp(min=-1.0, max=1.0), [f16(2, 3)], [((2, 3), F16)], id="clamp"),
    V(NanToNum(), [t()], [((), F32)], id="nan_to_num-scalar"),
    # attention
    V(Sdpa(num_heads=4, kv_heads=1, head_dim=64, causal=True),
      [t(1, 5, 256), t(1, 9, 64), t(1, 9, 64)], [((1, 5, 256), F32)], id="sdpa-gqa-causal"),
    V(Sdpa(num_heads=2, kv_heads=2, head_dim=32),
      [t(2, 5, 64), t(2, 5, 64), t(2, 5, 64), t(2, 1, 1, 5)], [((2, 5, 64), F32)],
      id="sdpa-bert-padding-mask"),
    V(Sdpa(num_heads=4, kv_heads=2, head_dim=16, causal=True),
      [t(-1, 64), t(-1, 32), t(-1, 32)], [((-1, 64), F32)], id="sdpa-after-kvcache"),
    V(Sdpa(num_heads=2, kv_heads=1, head_dim=8), [t(3, 16), t(1, 4, 8), t(4, 8), t(2, 3, 4)],
      [((1, 3, 16), F32)], id="sdpa-batch-bcast-mask-heads"),
    V(SdpaCross(num_heads=8, kv_heads=8, head_dim=64),
      [t(2, 7, 512), t(2, 20, 512), t(2, 20, 512)], [((2, 7, 512), F32)], id="sdpa-cross"),
    V(SdpaCross(num_heads=1, kv_heads=1, head_dim=4), [t(9, 4), t(3, 4), t(3, 4)],
      [((9, 4), F32)], id="sdpa-cross-tq-gt-tk"),
    V(SdpaWindow(num_heads=4, kv_heads=4, head_dim=8, window=3),
      [f16(6, 32), f16(10, 32), f16(10, 32)], [((6, 32), F16)], id="sdpa-window"),
    V(FlashAttention(num_heads=4, kv_heads=2, head_dim=8, causal=True, block=2),
      [t(1, 3, 32), t(1, 7, 16), t(1, 7, 16), t(3, 7)], [((1, 3, 32), F32)], id="flash"),
    V(KvCache(), [t(3, 128), t(3, 128)], [((-1, 128), F32), ((-1, 128), F32)], id="kvcache"),
    V(KvCache(max_seq=16), [t(2, 3, 64), t(-1, 3, 32)],
      [((2, -1, 64), F32), ((2, -1, 32), F32)], id="kvcache-batch-mla-widths"),
    V(KvCache(), [q8(1, 64), f16(1, 64)], [((-1, 64), Q8), ((-1, 64), F16)], id="kvcache-q8"),
    V(KvCompress(dtype=Q8), [t(4, 64)], [((4, 64), Q8)], id="kvcompress-q8"),
    V(KvCompress(dtype=BF16), [t(4, 3)], [((4, 3), BF16)], id="kvcompress-bf16"),
    V(KvDecompress(), [q8(-1, 64)], [((-1, 64), F32)], id="kvdecompress-q8"),
    V(KvDecompress(), [f16(5, 3)], [((5, 3), F32)], id="kvdecompress-f16"),
    V(Rope(head_dim=16, rope_dim=8), [t(5, 64), t(1)], [((5, 64), F32)], id="rope-partial"),
    V(Rope(head_dim=64, rope_dim=64, base=5e5), [f16(1, 32, -1, 64), i64()],
      [((1, 32, -1, 64), F16)], id="rope-split-heads-int-pos"),
    V(SinusoidalEmbed(dim=320), [i64(4)], [((4, 320), F32)], id="sinusoidal"),
    V(SinusoidalEmbed(dim=7, downscale_freq_shift=0.0), [f16()], [((7,), F32)],
      id="sinusoidal-scalar-odd"),
    V(RelativePosEmbedding(), [t(1, 5, 512), t(1, 7, 512), t(32, 8)], [((8, 5, 7), F32)],
      id="relpos"),
    V(RelativePosEmbedding(num_buckets=2, max_distance=8, bidirectional=False),
      [t(1, 512), t(-1, 512), t(2, 8), t(1)], [((8, 1, -1), F32)], id="relpos-decoder-pos"),
    # norms
    V(RmsNorm(), [t(2, 5, 64), t(64)], [((2, 5, 64), F32)], id="rmsnorm"),
    V(RmsNorm(), [f16(-1, 64), t(64)], [((-1, 64), F16)], id="rmsnorm-f16"),
    V(LayerNorm(), [t(3, 8)], [((3, 8), F32)], id="layernorm-plain"),
    V(LayerNorm(), [t(3, 8), t(8), t(8)], [((3, 8), F32)], id="layernorm-affine"),
    V(BatchNorm(), [t(2, 3, 4, 4)] + [t(3)] * 4, [((2, 3, 4, 4), F32)], id="batchnorm"),
    V(BatchNorm(), [t(2, 3)] + [t(3)] * 4, [((2, 3), F32)], id="batchnorm-2d"),
    V(GroupNorm(num_groups=8), [t(2, 32, 8, 8), t(32), t(32)], [((2, 32, 8, 8), F32)],
      id="groupnorm"),
    V(GroupNorm(num_groups=4), [t(-1, -1, 5)], [((-1, -1, 5), F32)], id="groupnorm-unknown"),
    V(InstanceNorm(), [t(2, 3, 10), t(3), t(3)], [((2, 3, 10), F32)], id="instancenorm"),
    V(AdaLN(), [t(2, 16, 64), t(2, 1, 64), t(2, 1, 64)], [((2, 16, 64), F32)], id="adaln"),
    V(AdaLN(), [t(2, 16, 64), t(64), t()], [((2, 16, 64), F32)], id="adaln-bcast"),
    # activations
    V(Silu(), [t(3)], [((3,), F32)], id="silu"),
    V(Gelu(approximate=True), [t(2, 0, dtype=BF16)], [((2, 0), BF16)], id="gelu-empty"),
    V(Relu(), [t()], [((), F32)], id="relu-scalar"),
    V(LeakyRelu(alpha=0.2), [t(-1, 3)], [((-1, 3), F32)], id="leaky-relu"),
    V(Sigmoid(), [f16(4)], [((4,), F16)], id="sigmoid"),
    V(Tanh(), [t(1, 2, 3)], [((1, 2, 3), F32)], id="tanh"),
    V(GeGlu(), [t(2, 10)], [((2, 5), F32)], id="geglu-one-input"),
    V(GeGlu(), [t(2, 5), t(1, 5)], [((2, 5), F32)], id="geglu-two-inputs"),
    V(SwiGlu(), [t(-1, 22016)], [((-1, 11008), F32)], id="swiglu-one-input"),
    V(SwiGlu(), [t(-1, 11008), t(-1, 11008)], [((-1, 11008), F32)], id="swiglu-two-inputs"),
    V(Glu(dim=0), [t(4, 6)], [((2, 6), F32)], id="glu"),
    V(PRelu(), [t(2, 3, 4, 4), t(3, 1, 1)], [((2, 3, 4, 4), F32)], id="prelu"),
    V(Softmax(dim=-1), [t(2, 3)], [((2, 3), F32)], id="softmax"),
    V(Softmax(dim=0), [t(0)], [((0,), F32)], id="softmax-empty"),
    # convolution and pooling: out = (L + 2p - d*(k-1) - 1)//s + 1
    V(Conv1d(kernel=3, stride=2, padding=1, groups=2), [t(1, 4, 10), t(8, 2, 3)],
      [((1, 8, 5), F32)], id="conv1d"),  # (10 + 2 - 2 - 1)//2 + 1 = 5
    V(Conv2d(kernel_h=7, kernel_w=7, stride_h=2, stride_w=2, padding_h=3, padding_w=3),
      [t(1, 3, 224, 224), t(64, 3, 7, 7), t(64)], [((1, 64, 112, 112), F32)], id="conv2d-resnet"),
    V(Conv2d(kernel_h=3, kernel_w=3, dilation_h=2, dilation_w=2), [t(1, 3, 10, 10), t(4, 3, 3, 3)],
      [((1, 4, 6, 6), F32)], id="conv2d-dilation"),
    V(Conv2d(kernel_h=3, kernel_w=1), [t(-1, 3, -1, 9), t(4, 3, 3, 1)], [((-1, 4, -1, 9), F32)],
      id="conv2d-unknown"),
    V(Conv2d(kernel_h=1, kernel_w=1), [t(0, 0, 1, 1), t(0, 0, 1, 1)], [((0, 0, 1, 1), F32)],
      id="conv2d-zero-channels"),
    V(Conv3d(kernel_d=2, kernel_h=3, kernel_w=3, stride_d=2), [t(1, 2, 4, 8, 8), t(4, 2, 2, 3, 3)],
      [((1, 4, 2, 6, 6), F32)], id="conv3d"),
    V(ConvTranspose2d(kernel_h=3, kernel_w=3, stride_h=2, stride_w=2, padding_h=1, padding_w=1,
                      output_padding_h=1, output_padding_w=1),
      [t(1, 8, 5, 5), t(8, 4, 3, 3), t(4)], [((1, 4, 10, 10), F32)], id="conv-transpose"),
    V(ConvTranspose2d(kernel_h=4, kernel_w=2, groups=2), [t(1, 8, 3, 3), t(8, 2, 4, 2)],
      [((1, 4, 6, 4), F32)], id="conv-transpose-groups"),  # (3-1)+3+1 = 6, (3-1)+1+1 = 4
    V(CausalConv1d(kernel=4, groups=4), [t(2, 4, 10), t(4, 1, 4), t(4)], [((2, 4, 10), F32)],
      id="causal-conv1d"),
    V(DepthwiseConv(kernel_h=3, kernel_w=3, padding_h=1, padding_w=1),
      [t(1, 8, 16, 16), t(16, 1, 3, 3)], [((1, 16, 16, 16), F32)], id="depthwise"),
    V(Pool(mode=0, kernel_h=2, kernel_w=2, stride_h=2, stride_w=2), [t(1, 3, 8, 8)],
      [((1, 3, 4, 4), F32)], id="maxpool"),
    V(Pool(mode=1, kernel_h=3, kernel_w=3, padding_h=1, padding_w=1), [t(1, 3, 8, 8)],
      [((1, 3, 8, 8), F32)], id="avgpool-same"),
    V(Pool(mode=0, kernel_h=2, kernel_w=2, stride_h=2, stride_w=2), [t(1, 1, 7, 7)],
      [((1, 1, 3, 3), F32)], id="pool-floor"),
    V(Pool(mode=1, kernel_h=1, kernel_w=3, stride_w=2), [t(2, 4, 10)], [((2, 4, 4), F32)],
      id="pool-1d"),
    # resampling and patches
    V(Interpolate(mode=0, scale_h=2.0, scale_w=2.0), [t(1, 3, 8, 8)], [((1, 3, 16, 16), F32)],
      id="interp-nearest-x2"),
    V(Interpolate(mode=1, out_h=5, out_w=7, align_corners=True), [t(1, 3, 8, 8)],
      [((1, 3, 5, 7), F32)], id="interp-bilinear-size"),
    V(Interpolate(mode=2, scale_h=0.5, scale_w=0.5), [t(1, 3, 7, -1)], [((1, 3, 3, -1), F32)],
      id="interp-bicubic-floor"),
    V(PixelShuffle(upscale=2), [t(1, 12, 4, 5)], [((1, 3, 8, 10), F32)], id="pixel-shuffle"),
    V(PixelUnshuffle(downscale=2), [t(1, 3, 8, 10)], [((1, 12, 4, 5), F32)], id="pixel-unshuffle"),
    V(PatchEmbed(patch_h=16, patch_w=16), [t(2, 3, 224, 224), t(768, 3, 16, 16), t(768)],
      [((2, 196, 768), F32)], id="patch-embed"),
    V(Unpatchify(patch_h=2, patch_w=2, channels=4, grid_h=16, grid_w=8), [t(2, 128, 16)],
      [((2, 4, 32, 16), F32)], id="unpatchify"),
    # embeddings
    V(TokenEmbed(), [i32(-1), q8(32000, 4096)], [((-1, 4096), F32)], id="token-embed-q8"),
    V(TokenEmbed(), [i64(2, 5), f16(100, 8)], [((2, 5, 8), F16)], id="token-embed-f16"),
    V(PosEmbed(), [t(1, 5, 768), t(1024, 768)], [((5, 768), F32)], id="pos-embed"),
    V(PosEmbed(offset=2), [i64(5, 1), t(7, 16), t(1)], [((5, 16), F32)], id="pos-embed-opt"),
    # generation, schedulers, quantization
    V(NoiseSchedule(), [t(1, 4, 64, 64), t(1, 4, 64, 64), i64(1), i64()],
      [((1, 4, 64, 64), F32)], id="ddim"),
    V(FlowStep(shift=3.0), [f16(1, 16, -1), f16(1, 16, 32), t(1), t(1)], [((1, 16, 32), F16)],
      id="flow-step"),
    V(Quantize(dtype=Q8), [t(4, 64)], [((4, 64), Q8)], id="quantize-q8"),
    V(Quantize(dtype=I8), [t(4, 3), t(), t(dtype=I8)], [((4, 3), I8)], id="quantize-i8"),
    V(Quantize(dtype=U8, axis=0), [t(4, 3), t(4)], [((4, 3), U8)], id="quantize-per-axis"),
    V(Dequantize(), [q4(4, 64)], [((4, 64), F32)], id="dequantize-q4"),
    V(Dequantize(), [t(2, 256, dtype=Q4K)], [((2, 256), F32)], id="dequantize-q4k"),
    V(Dequantize(axis=-1), [t(4, 3, dtype=U8), t(3), t(3, dtype=U8)], [((4, 3), F32)],
      id="dequantize-u8-per-axis"),
    V(Sample(), [t(1, 32000)], [((1,), I64)], id="sample-greedy"),
    V(Sample(method=3, temperature=0.7, p=0.9), [t(32000), i64(1)], [((), I64)], id="sample-top-p"),
    # linear algebra
    V(LoraApply(scale=2.0), [t(2, 5, 64), q8(128, 64), t(8, 64), t(128, 8)],
      [((2, 5, 128), F32)], id="lora"),
    V(Kron(), [t(2, 3), t(4, 5)], [((8, 15), F32)], id="kron"),
    V(Kron(), [t(2), t(3, 4)], [((3, 8), F32)], id="kron-rank-pad"),
    V(Kron(), [t(-1, 2), t(0, 3)], [((0, 6), F32)], id="kron-unknown-times-zero"),
    V(MatrixInverse(), [t(3, 4, 4)], [((3, 4, 4), F32)], id="inverse"),
    V(MatrixInverse(), [t(-1, 4)], [((4, 4), F32)], id="inverse-unknown"),
    # fused
    V(FusedNormMatmul(), [t(2, 64), t(64), q4(256, 64)], [((2, 256), F32)], id="fused-norm-mm"),
    V(FusedSkipNorm(), [t(2, 5, 64), t(2, -1, 64), t(64)], [((2, 5, 64), F32)] * 2,
      id="fused-skip-norm"),
    V(FusedSwiGlu(), [t(5, 64), q8(128, 64), q8(128, 64)], [((5, 128), F32)], id="fused-swiglu"),
    V(Argmax(), [t(2, 10)], [((2,), I64)], id="argmax"),
    V(Argmax(), [t(7)], [((), I64)], id="argmax-vector"),
]


@pytest.mark.parametrize("op, inputs, expected", VALID)
def test_valid(op, inputs, expected):
    assert infer(op, inputs) == expected


def test_every_op_has_a_valid_case():
    covered = {type(p.values[0]).__name__ for p in VALID}
    assert covered == set(ops.OPS_BY_NAME)


# -- invalid cases: (op, inputs, message fragments) ---------------------------------------------
X = pytest.param
INVALID = [
    X(Matmul(), [t(-1, 4096), t(1024, 4095)],
      ["Matmul: inner dims disagree: input 0 (a) f32[-1,4096] has K=4096, "
       "input 1 (b) f32[1024,4095] (transpose_b) has K=4095"], id="matmul-inner"),
    X(Matmul(transpose_b=False), [t(2, 4), t(5, 3)], ["input 1 (b) f32[5,3] has K=5"],
      id="matmul-inner-kn"),
    X(Matmul(), [t(2, 3, 4), t(3, 5, 4)], ["cannot broadcast", "batch dims", "2 vs 3"],
      id="matmul-batch"),
    X(Matmul(), [t(), t(4, 4)], ["input 0 (a) f32[] must have rank >= 1"], id="matmul-rank0"),
    X(Matmul(), [q8(4, 32), t(4, 32)], ["input 0 (a) q8_0[4,32] must be a float type"],
      id="matmul-quantized-activation"),
    X(Matmul(), [t(4, 100), q8(8, 100)], ["input 1 (b)", "Q8_0 packs 32", "100"],
      id="matmul-q8-last-dim"),
    X(Matmul(), [i64(4, 4), t(4, 4)], ["input 0 (a) i64[4,4] must be a float type"],
      id="matmul-int"),
    X(Add(), [t(2, 3), t(4)], ["cannot broadcast input 0 (a) f32[2,3]", "input 1 (b) f32[4]",
                               "3 vs 4"], id="add-bcast"),
    X(Mul(), [t(2), i64(2)], ["input 1 (b) i64[2] must be a float type"], id="mul-int"),
    X(Sub(), [t(2), q8(32)], ["input 1 (b)", "float type"], id="sub-quantized"),
    X(Transpose(dim0=0, dim1=2), [t(2, 3)], ["dim1=2 is out of range", "f32[2,3] (rank 2)"],
      id="transpose-range"),
    X(Transpose(), [t()], ["dim0=-2 is out of range", "rank 0"], id="transpose-rank0"),
    X(Transpose(), [q8(2, 32)], ["block-quantized"], id="transpose-quantized"),
    X(Reshape(shape=(4,)), [t(2, 3)], ["f32[2,3] cannot be reshaped to [4]", "6", "4"],
      id="reshape-count"),
    X(Reshape(shape=(-1, -1)), [t(4)], ["at most one -1"], id="reshape-two-infer"),
    X(Reshape(shape=(2, -3)), [t(6)], ["at most one -1"], id="reshape-negative"),
    X(Reshape(shape=(0, 0)), [t(4)], ["copies dim 1", "rank 1"], id="reshape-copy-range"),
    X(Reshape(shape=(-1, 3)), [t(10)], ["cannot be reshaped to [-1,3]", "10"],
      id="reshape-indivisible"),
    X(Reshape(shape=(0, -1)), [t(0, 3)], ["cannot infer the -1"], id="reshape-infer-zero"),
    X(Reshape(shape=(0, 0, 32, 100)), [t(-1, -1, 4096)], ["4096", "3200", "copied"],
      id="reshape-heads-mismatch"),
    X(Permute(perm=(0, 0, 1)), [t(2, 3, 4)], ["not a permutation"], id="permute-dup"),
    X(Permute(perm=(1, 0)), [t(2, 3, 4)], ["2 entries", "rank 3"], id="permute-length"),
    X(Permute(perm=(0, 3)), [t(2, 3)], ["perm entry=3 is out of range"], id="permute-range"),
    X(Concat(dim=1), [t(2, 3), t(3, 3)], ["input 1 (x1) f32[3,3] differs", "dim 0"],
      id="concat-other-dim"),
    X(Concat(), [t(2, 3), f16(2, 3)], ["input 1 (x1) f16[2,3] must have the dtype and rank"],
      id="concat-dtype"),
    X(Concat(), [t(2, 3), t(3)], ["must have the dtype and rank"], id="concat-rank"),
    X(Concat(), [t(), t()], ["input 0 (x0) f32[] must have rank >= 1"], id="concat-rank0"),
    X(Split(dim=1, sizes=(3, 6)), [t(2, 10)], ["sum to 9", "f32[2,10] has 10 at dim 1"],
      id="split-sum"),
    X(Split(sizes=()), [t(4)], ["non-empty"], id="split-empty"),
    X(Split(sizes=(5, -1)), [t(4)], ["sizes >= 0"], id="split-negative"),
    X(Chunk(chunks=2), [t(7)], ["f32[7]: dim 0 is 7, not a multiple of 2"], id="chunk-odd"),
    X(Chunk(chunks=0), [t(4)], ["chunks=0 must be >= 1"], id="chunk-zero"),
    X(Clamp(), [i64(3)], ["must be a float type"], id="clamp-int"),
    # attention
    X(Sdpa(num_heads=4, kv_heads=1, head_dim=64), [t(5, 255), t(5, 64), t(5, 64)],
      ["input 0 (q) f32[5,255]", "num_heads*head_dim = 4*64", "must be 256, got 255"],
      id="sdpa-q-width"),
    X(Sdpa(num_heads=4, kv_heads=2, head_dim=16), [t(5, 64), t(5, 32), t(5, 16)],
      ["input 2 (v) f32[5,16]", "kv_heads*head_dim = 2*16", "must be 32"], id="sdpa-v-width"),
    X(Sdpa(num_heads=6, kv_heads=4, head_dim=8), [t(5, 48), t(5, 32), t(5, 32)],
      ["num_heads=6 is not a multiple of kv_heads=4"], id="sdpa-gqa-ratio"),
    X(Sdpa(num_heads=1, kv_heads=1, head_dim=4), [t(5, 4), t(6, 4), t(7, 4)],
      ["input 1 (k) f32[6,4] and input 2 (v) f32[7,4]", "sequence length"], id="sdpa-tk"),
    X(Sdpa(num_heads=1, kv_heads=1, head_dim=4, causal=True), [t(6, 4), t(5, 4), t(5, 4)],
      ["causal attention needs Tq <= Tk", "Tq=6", "Tk=5"], id="sdpa-causal-tq-gt-tk"),
    X(Sdpa(num_heads=2, kv_heads=2, head_dim=4), [t(1, 5, 8), t(1, 9, 8), t(1, 9, 8),
                                                   t(1, 1, 5, 8)],
      ["input 3 (mask) f32[1,1,5,8] is not broadcastable to the scores", "= [1,2,5,9]", "8 vs 9"],
      id="sdpa-mask"),
    X(Sdpa(num_heads=2, kv_heads=2, head_dim=4), [t(5, 8), t(5, 8), t(5, 8), t(2, 1, 5, 5)],
      ["more dims than the scores"], id="sdpa-mask-rank"),
    X(Sdpa(num_heads=1, kv_heads=1, head_dim=4), [t(5, 4), t(5, 4), t(5, 4), i64(5, 5)],
      ["input 3 (mask) i64[5,5] must be a float type"], id="sdpa-mask-dtype"),
    X(Sdpa(num_heads=1, kv_heads=1, head_dim=0), [t(5, 0), t(5, 0), t(5, 0)],
      ["head_dim=0 must be >= 1"], id="sdpa-head-dim-0"),
    X(Sdpa(num_heads=1, kv_heads=1, head_dim=4), [t(4), t(5, 4), t(5, 4)],
      ["input 0 (q) f32[4] must have rank >= 2"], id="sdpa-q-rank"),
    X(SdpaWindow(num_heads=1, kv_heads=1, head_dim=4, window=0), [t(5, 4), t(5, 4), t(5, 4)],
      ["window=0 must be >= 1"], id="sdpa-window-0"),
    X(FlashAttention(num_heads=1, kv_heads=1, head_dim=4, block=0), [t(5, 4), t(5, 4), t(5, 4)],
      ["block=0 must be >= 1"], id="flash-block-0"),
    X(KvCache(), [t(3, 64), t(4, 64)], ["input 0 (k_new) f32[3,64] and input 1 (v_new) f32[4,64]"],
      id="kvcache-t"),
    X(KvCache(), [t(64), t(64)], ["input 0 (k_new) f32[64] must have rank >= 2"],
      id="kvcache-rank"),
    X(KvCache(), [q8(3, 48), q8(3, 48)], ["Q8_0 packs 32", "48"], id="kvcache-q8-width"),
    X(KvCache(), [i64(3, 4), t(3, 4)], ["input 0 (k_new) i64[3,4] must be a float type", "Q8_0 or Q4_0"],
      id="kvcache-int"),
    X(KvCompress(dtype=I8), [t(4, 64)], ["dtype=I8 is not a KV storage type"], id="kvcompress-i8"),
    X(KvCompress(dtype=Q4), [t(4, 48)], ["input 0 (x) f32[4,48]: Q4_0 packs 32", "48"],
      id="kvcompress-width"),
    X(KvDecompress(dtype=I8), [q8(4, 64)], ["dtype=I8 must be a float type"],
      id="kvdecompress-dtype"),
    X(KvDecompress(), [t(4, 64, dtype=I8)], ["input 0 (x) i8[4,64] must be a float type", "Q8_0 or Q4_0, got I8"],
      id="kvdecompress-input"),
    X(Rope(head_dim=16, rope_dim=32), [t(5, 64), t(1)], ["rope_dim=32", "head_dim=16"],
      id="rope-dim-gt-head"),
    X(Rope(head_dim=16, rope_dim=7), [t(5, 64), t(1)], ["rope_dim=7 must be even"],
      id="rope-dim-odd"),
    X(Rope(head_dim=48, rope_dim=48), [t(5, 64), t(1)],
      ["input 0 (x) f32[5,64]: dim -1 is 64, not a multiple of 48"], id="rope-width"),
    X(Rope(head_dim=16, rope_dim=16), [t(5, 64), t(2)], ["input 1 (pos) f32[2] must be a scalar"],
      id="rope-pos"),
    X(Rope(head_dim=16, rope_dim=16, base=0.0), [t(5, 64), t(1)], ["base=0 must be"], id="rope-base"),
    X(Rope(head_dim=16, rope_dim=16), [t(64), t(1)], ["must have rank >= 2"], id="rope-rank"),
    X(SinusoidalEmbed(dim=0), [t(4)], ["dim=0 must be >= 1"], id="sinusoidal-dim"),
    X(SinusoidalEmbed(dim=8), [t(4, 1)], ["input 0 (timesteps) f32[4,1] must have rank 0..1"],
      id="sinusoidal-rank"),
    X(SinusoidalEmbed(dim=2, downscale_freq_shift=1.0), [t(4)], ["differ from dim//2=1"],
      id="sinusoidal-shift"),
    X(RelativePosEmbedding(), [t(5, 8), t(7, 8), t(16, 8)],
      ["input 2 (table) f32[16,8]", "must be 32, got 16"], id="relpos-table"),
    X(RelativePosEmbedding(num_buckets=3), [t(5, 8), t(7, 8), t(3, 8)], ["num_buckets=3"],
      id="relpos-buckets"),
    X(RelativePosEmbedding(num_buckets=32, max_distance=8), [t(5, 8), t(7, 8), t(32, 8)],
      ["max_distance=8 must exceed the exact range 8"], id="relpos-distance"),
    # norms
    X(RmsNorm(), [t(2, 64), t(63)], ["input 1 (weight) f32[63]", "must be 64, got 63"],
      id="rmsnorm-weight"),
    X(RmsNorm(), [t(2, 64), t(1, 64)], ["input 1 (weight) f32[1,64] must have rank 1"],
      id="rmsnorm-weight-rank"),
    X(RmsNorm(), [t(), t(1)], ["input 0 (x) f32[] must have rank >= 1"], id="rmsnorm-rank0"),
    X(LayerNorm(), [t(2, 8), t(8), t(7)], ["input 2 (bias) f32[7]"], id="layernorm-bias"),
    X(BatchNorm(), [t(2, 3, 4)] + [t(3)] * 3 + [t(4)], ["input 4 (var) f32[4]", "must be 3"],
      id="batchnorm-var"),
    X(BatchNorm(), [t(3)] * 5, ["input 0 (x) f32[3] must have rank >= 2"], id="batchnorm-rank"),
    X(GroupNorm(num_groups=32), [t(1, 48, 4, 4)], ["dim 1 is 48, not a multiple of 32"],
      id="groupnorm-groups"),
    X(GroupNorm(num_groups=0), [t(1, 48, 4, 4)], ["num_groups=0 must be >= 1"],
      id="groupnorm-zero"),
    X(InstanceNorm(), [t(2, 3)], ["must have rank >= 3"], id="instancenorm-rank"),
    X(AdaLN(), [t(2, 16, 64), t(2, 64), t(64)],
      ["input 1 (shift) f32[2,64] is not broadcastable to input 0 (x) f32[2,16,64]", "2 vs 16"],
      id="adaln-shift"),
    # activations
    X(GeGlu(), [t(2, 9)], ["dim 1 is 9, not a multiple of 2"], id="geglu-odd"),
    X(SwiGlu(), [t(2, 5), t(2, 4)], ["cannot broadcast", "5 vs 4"], id="swiglu-two"),
    X(SwiGlu(), [t()], ["must have rank >= 1"], id="swiglu-rank0"),
    X(Glu(dim=0), [t(3, 4)], ["dim 0 is 3, not a multiple of 2"], id="glu-odd"),
    X(Glu(dim=2), [t(3, 4)], ["dim=2 is out of range"], id="glu-range"),
    X(PRelu(), [t(2, 3), t(4)], ["input 1 (slope) f32[4] is not broadcastable"], id="prelu"),
    X(Softmax(dim=-3), [t(2, 3)], ["dim=-3 is out of range", "rank 2"], id="softmax-range"),
    X(Softmax(), [t()], ["out of range", "rank 0"], id="softmax-rank0"),
    X(Gelu(), [i32(3)], ["input 0 (x) i32[3] must be a float type"],
      id="gelu-int"),
    # convolution and pooling
    X(Conv2d(kernel_h=3, kernel_w=3), [t(1, 4, 8, 8), t(8, 3, 3, 3)],
      ["input 1 (weight) f32[8,3,3,3]", "C/groups", "must be 4, got 3"], id="conv-channels"),
    X(Conv2d(kernel_h=3, kernel_w=3, groups=3), [t(1, 4, 8, 8), t(6, 1, 3, 3)],
      ["input 0 (x) f32[1,4,8,8]: dim 1 is 4, not a multiple of 3"], id="conv-groups"),
    X(Conv1d(kernel=3, groups=2), [t(1, 4, 8), t(5, 2, 3)], ["dim 0 is 5, not a multiple of 2"],
      id="conv-out-groups"),
    X(Conv2d(kernel_h=3, kernel_w=3), [t(1, 3, 8, 8), t(8, 3, 3, 5)],
      ["dim 3 (the kernel size) must be 3, got 5"], id="conv-kernel"),
    X(Conv2d(kernel_h=5, kernel_w=5), [t(1, 3, 4, 8), t(8, 3, 5, 5)],
      ["dim 2 of length 4 gives an output length 0 < 1"], id="conv-too-small"),
    X(Conv2d(kernel_h=3, kernel_w=3), [t(1, 3, 8, 8), t(8, 3, 3, 3), t(7)],
      ["input 2 (bias) f32[7]", "must be 8"], id="conv-bias"),
    X(Conv2d(kernel_h=3, kernel_w=3, stride_w=0), [t(1, 3, 8, 8), t(8, 3, 3, 3)],
      ["stride_w=0 must be >= 1"], id="conv-stride-0"),
    X(Conv2d(kernel_h=3, kernel_w=3), [t(3, 8, 8), t(8, 3, 3, 3)],
      ["input 0 (x) f32[3,8,8] must have rank 4, got rank 3"], id="conv-rank"),
    X(Conv3d(kernel_d=1, kernel_h=1, kernel_w=1), [t(1, 2, 3, 3, 3), t(4, 2, 1, 1)],
      ["input 1 (weight) f32[4,2,1,1] must have rank 5"], id="conv3d-weight-rank"),
    X(DepthwiseConv(kernel_h=3, kernel_w=3), [t(1, 8, 8, 8), t(8, 2, 3, 3)],
      ["dim 1 (one input channel per group) must be 1, got 2"], id="depthwise-dim1"),
    X(DepthwiseConv(kernel_h=3, kernel_w=3), [t(1, 8, 8, 8), t(12, 1, 3, 3)],
      ["dim 0 is 12, not a multiple of 8"], id="depthwise-multiplier"),
    X(ConvTranspose2d(kernel_h=3, kernel_w=3, stride_h=2, stride_w=2, output_padding_h=2),
      [t(1, 8, 5, 5), t(8, 4, 3, 3)], ["output_padding_h=2 must be smaller than stride_h=2"],
      id="conv-transpose-outpad"),
    X(ConvTranspose2d(kernel_h=3, kernel_w=3), [t(1, 8, 5, 5), t(4, 8, 3, 3)],
      ["input 1 (weight) f32[4,8,3,3]: dim 0", "must be 8, got 4"], id="conv-transpose-weight"),
    X(CausalConv1d(kernel=4), [t(2, 4, 10), t(4, 4, 3)], ["must be 4, got 3"],
      id="causal-conv-kernel"),
    X(Pool(mode=0, kernel_h=2, kernel_w=2), [t(1, 4, 10)],
      ["input 0 (x) f32[1,4,10] is pooled along its last dim only"], id="pool-1d-h"),
    X(Pool(mode=0, kernel_h=2, kernel_w=2, padding_h=2), [t(1, 1, 8, 8)],
      ["padding_h=2 must be at most half of kernel_h=2"], id="pool-padding"),
    X(Pool(mode=2, kernel_h=2, kernel_w=2), [t(1, 1, 8, 8)], ["mode=2 is not one of 0 max, 1 avg"],
      id="pool-mode"),
    X(Pool(mode=1, kernel_h=2, kernel_w=2), [t(1, 1, 1, 8)], ["output length 0 < 1"],
      id="pool-too-small"),
    X(Pool(mode=1, kernel_h=2, kernel_w=2), [t(1, 8, 8)], ["pooled along its last dim only"],
      id="pool-rank3-kernel-h"),
    X(Pool(mode=1, kernel_h=2, kernel_w=2), [t(1, 1, 1, 8, 8)], ["must have rank 3..4"],
      id="pool-rank5"),
    # resampling and patches
    X(Interpolate(mode=0, align_corners=True, scale_h=2.0, scale_w=2.0), [t(1, 1, 4, 4)],
      ["align_corners applies to bilinear and bicubic only"], id="interp-nearest-corners"),
    X(Interpolate(scale_h=0.0), [t(1, 1, 4, 4)], ["scale_h=0 must be a finite number > 0"],
      id="interp-scale-0"),
    X(Interpolate(scale_w=math.inf), [t(1, 1, 4, 4)], ["scale_w=inf must be a finite number > 0"], id="interp-scale-inf"),
    X(Interpolate(scale_h=0.2), [t(1, 1, 4, 4)], ["length 4 times scale_h=0.2 is 0 < 1"],
      id="interp-too-small"),
    X(PixelShuffle(upscale=2), [t(1, 6, 4, 4)], ["dim -3 is 6, not a multiple of 4"],
      id="pixel-shuffle"),
    X(PixelShuffle(upscale=0), [t(1, 6, 4, 4)], ["upscale=0 must be >= 1"], id="pixel-shuffle-0"),
    X(PixelUnshuffle(downscale=2), [t(1, 3, 5, 4)], ["dim -2 is 5, not a multiple of 2"],
      id="pixel-unshuffle"),
    X(PatchEmbed(patch_h=16, patch_w=16), [t(1, 3, 100, 96), t(8, 3, 16, 16)],
      ["dim 2 is 100, not a multiple of 16"], id="patch-embed-divisible"),
    X(PatchEmbed(patch_h=16, patch_w=16), [t(1, 3, 96, 96), t(8, 4, 16, 16)],
      ["input 1 (weight) f32[8,4,16,16]", "must be 3, got 4"], id="patch-embed-channels"),
    X(PatchEmbed(patch_h=16, patch_w=16), [t(1, 3, 96, 96), t(8, 3, 8, 8)], ["(patch_h)"],
      id="patch-embed-kernel"),
    X(Unpatchify(patch_h=2, patch_w=2, channels=4, grid_h=16, grid_w=8), [t(2, 127, 16)],
      ["grid_h*grid_w = 16*8", "must be 128, got 127"], id="unpatchify-grid"),
    X(Unpatchify(patch_h=2, patch_w=2, channels=4, grid_h=16, grid_w=8), [t(2, 128, 8)],
      ["patch_h*patch_w*channels = 2*2*4", "must be 16, got 8"], id="unpatchify-patch"),
    # embeddings
    X(TokenEmbed(), [t(5), t(10, 4)], ["input 0 (ids) f32[5] must be an integer type"],
      id="token-embed-float-ids"),
    X(TokenEmbed(), [i64(5), i64(10, 4)], ["input 1 (table) i64[10,4] must be a float type"],
      id="token-embed-int-table"),
    X(TokenEmbed(), [i64(5), q8(10, 100)], ["Q8_0 packs 32", "100"], id="token-embed-q8"),
    X(TokenEmbed(), [i64(5), t(10)], ["input 1 (table) f32[10] must have rank 2"],
      id="token-embed-rank"),
    X(PosEmbed(offset=2), [t(1, 6, 16), t(7, 16)], ["rows 2..7", "input 1 (table) f32[7,16]"],
      id="pos-embed-range"),
    X(PosEmbed(), [t(1, 6, 16), t(7, 16), t(3)], ["input 2 (pos) f32[3] must be a scalar"],
      id="pos-embed-pos"),
    # generation, schedulers, quantization
    X(NoiseSchedule(), [t(1, 4, 8, 8), t(1, 4, 8, 9), i64(1), i64(1)],
      ["input 1 (model_output) f32[1,4,8,9] must have the shape of input 0 (sample)"],
      id="ddim-shape"),
    X(NoiseSchedule(beta_schedule=3), [t(4), t(4), i64(1), i64(1)], ["beta_schedule=3"],
      id="ddim-schedule"),
    X(NoiseSchedule(), [t(4), t(4), i64(2), i64(1)], ["input 2 (t) i64[2] must be a scalar"],
      id="ddim-t"),
    X(FlowStep(shift=0.0), [t(4), t(4), t(1), t(1)], ["shift=0 must be"], id="flow-shift"),
    X(FlowStep(), [t(4), t(4), t(1), t(2, 2)], ["input 3 (t_next) f32[2,2] must be a scalar"],
      id="flow-t-next"),
    X(Quantize(dtype=I8), [t(4, 3)], ["needs a scale (input 1)"], id="quantize-no-scale"),
    X(Quantize(dtype=Q8), [t(4, 32), t()], ["Q8_0 blocks carry their own scales"],
      id="quantize-q8-scale"),
    X(Quantize(dtype=F16), [t(4, 32)], ["dtype=F16: Quantize produces Q8_0, Q4_0, I8 or U8"],
      id="quantize-dtype"),
    X(Quantize(dtype=I8), [t(4, 3), t(), t(dtype=U8)], ["input 2 (zero_point) u8[] must have "
                                                        "dtype I8"], id="quantize-zp-dtype"),
    X(Quantize(dtype=I8, axis=1), [t(4, 3), t(4)], ["input 1 (scale) f32[4]", "must be 3"],
      id="quantize-per-axis"),
    X(Quantize(dtype=I8), [t(4, 3), t(1, 3)], ["must have rank 0..1"], id="quantize-scale-rank"),
    X(Quantize(dtype=Q4), [t(4, 40)], ["Q4_0 packs 32", "40"], id="quantize-q4-width"),
    X(Dequantize(), [t(4, 3)], ["input 0 (x) f32[4,3] must be a GGML block type, I8 or U8"],
      id="dequantize-float"),
    X(Dequantize(dtype=I8), [q8(4, 32)], ["dtype=I8 must be a float type"],
      id="dequantize-dtype"),
    X(Dequantize(), [q8(4, 32), t()], ["Q8_0 blocks carry their own scales"],
      id="dequantize-q8-scale"),
    X(Sample(method=1, temperature=0.0), [t(10)], ["temperature=0 must be a finite number > 0"], id="sample-temp"),
    X(Sample(method=2, k=0), [t(10)], ["k=0 must be >= 1"], id="sample-k"),
    X(Sample(method=3, p=1.5), [t(10)], ["p=1.5 must be in [0, 1]"], id="sample-p"),
    X(Sample(method=5), [t(10)], ["method=5 is not one of"], id="sample-method"),
    X(Sample(), [t(10), t(1)], ["input 1 (seed) f32[1] must be an integer type"],
      id="sample-seed"),
    X(Sample(), [t()], ["input 0 (logits) f32[] must have rank >= 1"], id="sample-rank0"),
    # linear algebra
    X(LoraApply(), [t(2, 64), t(128, 64), t(8, 60), t(128, 8)],
      ["input 2 (A) f32[8,60] ([N, K]) has K=60"], id="lora-a"),
    X(LoraApply(), [t(2, 64), t(128, 64), t(8, 64), t(128, 4)],
      ["input 3 (B) f32[128,4]", "(r, dim 0 of input 2 (A)", "must be 8, got 4"], id="lora-b-r"),
    X(LoraApply(), [t(2, 64), t(128, 64), t(8, 64), t(100, 8)], ["must be 128, got 100"],
      id="lora-b-n"),
    X(LoraApply(), [t(2, 64), t(128, 64), q8(8, 64), t(128, 8)], ["input 2 (A)", "float type"],
      id="lora-a-quantized"),
    X(Kron(), [i64(2, 2), t(2, 2)], ["must be a float type"], id="kron-int"),
    X(MatrixInverse(), [t(3, 4)], ["input 0 (x) f32[3,4] must hold square matrices"],
      id="inverse-square"),
    X(MatrixInverse(), [t(3)], ["must have rank >= 2"], id="inverse-rank"),
    # fused
    X(FusedNormMatmul(), [t(2, 64), t(32), t(8, 64)], ["input 1 (norm_weight) f32[32]"],
      id="fused-norm-w"),
    X(FusedNormMatmul(), [t(2, 64), t(64), t(8, 32)],
      ["inner dims disagree", "input 2 (W) f32[8,32] ([N, K]) has K=32"], id="fused-norm-k"),
    X(FusedSkipNorm(), [t(2, 64), t(3, 64), t(64)],
      ["input 1 (residual) f32[3,64] must have the shape of input 0 (x)"], id="fused-skip"),
    X(FusedSwiGlu(), [t(2, 64), t(128, 64), t(96, 64)],
      ["input 1 (W_gate) f32[128,64] and input 2 (W_up) f32[96,64]"], id="fused-swiglu-f"),
    X(FusedSwiGlu(), [t(2, 64), t(128, 64), t(128, 32)], ["has K=32"], id="fused-swiglu-k"),
    X(Argmax(), [t()], ["must have rank >= 1"], id="argmax-rank0"),
    X(Argmax(), [i64(3)], ["must be a float type"], id="argmax-int"),
    # any rule: dims below -1 are not shapes
    X(Relu(), [t(2, -2)], ["input 0 (x) f32[2,-2] has a negative dim"], id="negative-dim"),
]


@pytest.mark.parametrize("op, inputs, fragments", INVALID)
def test_invalid(op, inputs, fragments):
    with pytest.raises(ShapeError) as err:
        infer(op, inputs)
    message = str(err.value)
    assert message.startswith(f"{type(op).__name__}: "), message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


def test_every_op_has_an_invalid_case():
    covered = {type(p.values[0]).__name__ for p in INVALID}
    missing = set(ops.OPS_BY_NAME) - covered
    # Elementwise ops without a distinct rule: covered by their shared rule's cases.
    assert missing <= {"Div", "NanToNum", "Silu", "LeakyRelu", "Sigmoid", "Tanh", "SdpaCross"}, \
        missing


def test_shape_error_is_a_graph_validation_error():
    from dist_runtime.errors import GraphValidationError
    assert issubclass(ShapeError, GraphValidationError)


# -- properties against numpy -------------------------------------------------------------------
SETTINGS = settings(derandomize=True, max_examples=60, deadline=None,
                    suppress_health_check=list(HealthCheck))
small_shape = hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=4)


def shape_of(result) -> tuple[int, ...]:
    ((shape, _),) = result
    return shape


@SETTINGS
@given(st.data())
def test_broadcast_matches_numpy(data):
    a = data.draw(small_shape)
    b = data.draw(st.one_of(small_shape, hnp.broadcastable_shapes(a, min_side=0, max_side=4)))
    try:
        expected = np.broadcast_shapes(a, b)
    except ValueError:
        with pytest.raises(ShapeError, match="cannot broadcast"):
            infer(Add(), [t(*a), t(*b)])
    else:
        assert infer(Mul(), [t(*a), t(*b)]) == [(expected, F32)]


@SETTINGS
@given(st.data())
def test_broadcast_with_unknown_dims_never_fails_what_numpy_accepts(data):
    """Hiding dims (as -1) keeps every numpy-valid case valid and the known output dims right."""
    a, b = data.draw(hnp.mutually_broadcastable_shapes(num_shapes=2, min_side=0, max_side=4)).input_shapes
    expected = np.broadcast_shapes(a, b)
    hide = data.draw(st.lists(st.booleans(), min_size=len(a) + len(b), max_size=len(a) + len(b)))
    ha = tuple(-1 if h else d for d, h in zip(a, hide))
    hb = tuple(-1 if h else d for d, h in zip(b, hide[len(a):]))
    got = shape_of(infer(Sub(), [t(*ha), t(*hb)]))
    assert len(got) == len(expected)
    assert all(g in (-1, e) for g, e in zip(got, expected))


@SETTINGS
@given(st.data())
def test_matmul_matches_numpy(data):
    batch_a, batch_b = data.draw(hnp.mutually_broadcastable_shapes(
        num_shapes=2, min_dims=0, max_dims=2, min_side=0, max_side=3)).input_shapes
    m, k, n = (data.draw(st.integers(0, 3)) for _ in range(3))
    a_vec, b_vec = data.draw(st.booleans()), data.draw(st.booleans())
    transpose_b = data.draw(st.booleans())
    a = (k,) if a_vec else batch_a + (m, k)
    b = (k,) if b_vec else batch_b + ((n, k) if transpose_b else (k, n))
    b_math = b if b_vec or not transpose_b else b[:-2] + (k, n)
    expected = np.matmul(np.zeros(a), np.zeros(b_math)).shape  # shapes only: zeros, not garbage that warns
    assert infer(Matmul(transpose_b=transpose_b), [t(*a), t(*b)]) == [(expected, F32)]


@SETTINGS
@given(small_shape, st.lists(st.sampled_from([-1, 0, 1, 2, 3, 4, 6]), max_size=4))
def test_reshape_matches_numpy(shape, target):
    """ONNX Reshape (allowzero=0) is numpy reshape after copying the 0 entries."""
    x = np.empty(shape)
    try:
        if target.count(-1) > 1 or any(i >= len(shape) for i, d in enumerate(target) if d == 0):
            raise ValueError
        expected = x.reshape([shape[i] if d == 0 else d for i, d in enumerate(target)]).shape
    except ValueError:
        with pytest.raises(ShapeError):
            infer(Reshape(shape=tuple(target)), [t(*shape)])
    else:
        assert infer(Reshape(shape=tuple(target)), [t(*shape)]) == [(expected, F32)]


@SETTINGS
@given(st.data())
def test_transpose_and_permute_match_numpy(data):
    shape = data.draw(hnp.array_shapes(min_dims=1, max_dims=5, min_side=0, max_side=4))
    rank = len(shape)
    d0, d1 = (data.draw(st.integers(-rank, rank - 1)) for _ in range(2))
    assert shape_of(infer(Transpose(dim0=d0, dim1=d1), [t(*shape)])) == \
        np.swapaxes(np.empty(shape), d0, d1).shape
    perm = data.draw(st.permutations(range(rank)))
    perm = [p - rank if data.draw(st.booleans()) else p for p in perm]  # some negative
    assert shape_of(infer(Permute(perm=tuple(perm)), [t(*shape)])) == \
        np.transpose(np.empty(shape), [p % rank for p in perm]).shape


@SETTINGS
@given(st.data())
def test_concat_split_chunk_match_numpy(data):
    shape = data.draw(hnp.array_shapes(min_dims=1, max_dims=4, min_side=0, max_side=4))
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    lengths = data.draw(st.lists(st.integers(0, 4), min_size=1, max_size=4))
    parts = [np.empty(shape[:axis % len(shape)] + (n,) + shape[axis % len(shape) + 1:])
             for n in lengths]
    expected = np.concatenate(parts, axis=axis).shape
    assert shape_of(infer(Concat(dim=axis), [t(*p.shape) for p in parts])) == expected

    whole = np.empty(expected)
    pieces = np.split(whole, np.cumsum(lengths)[:-1], axis=axis)
    got = infer(Split(dim=axis, sizes=tuple(lengths)), [t(*expected)])
    assert [s for s, _ in got] == [p.shape for p in pieces]

    chunks = len(lengths)
    if expected[axis] % chunks == 0:
        got = infer(Chunk(dim=axis, chunks=chunks), [t(*expected)])
        assert [s for s, _ in got] == [p.shape for p in np.split(whole, chunks, axis=axis)]
    else:
        with pytest.raises(ShapeError, match="not a multiple"):
            infer(Chunk(dim=axis, chunks=chunks), [t(*expected)])


@SETTINGS
@given(small_shape, small_shape)
def test_kron_matches_numpy(a, b):
    assert infer(Kron(), [t(*a), t(*b)]) == [(np.kron(np.empty(a), np.empty(b)).shape, F32)]


@SETTINGS
@given(st.integers(0, 12), st.integers(1, 5), st.integers(1, 4), st.integers(0, 3),
       st.integers(1, 3))
def test_conv_and_pool_lengths_match_numpy_sliding_windows(length, kernel, stride, pad, dil):
    """Output length = number of dilated windows of the zero-padded input, every stride-th."""
    padded = np.pad(np.empty(length), pad)
    span = dil * (kernel - 1) + 1
    count = (np.lib.stride_tricks.sliding_window_view(padded, span)[::stride].shape[0]
             if span <= padded.shape[0] else 0)
    conv = Conv1d(kernel=kernel, stride=stride, padding=pad, dilation=dil)
    inputs = [t(1, 2, length), t(3, 2, kernel)]
    if count == 0:
        with pytest.raises(ShapeError, match="output length"):
            infer(conv, inputs)
    else:
        assert infer(conv, inputs) == [((1, 3, count), F32)]
    if dil == 1 and 2 * pad <= kernel:
        pool = Pool(mode=1, kernel_h=1, kernel_w=kernel, stride_w=stride, padding_w=pad)
        if count == 0:
            with pytest.raises(ShapeError, match="output length"):
                infer(pool, [t(1, 2, length)])
        else:
            assert infer(pool, [t(1, 2, length)]) == [((1, 2, count), F32)]
            pool2d = Pool(mode=0, kernel_h=kernel, kernel_w=kernel, stride_h=stride,
                          stride_w=stride, padding_h=pad, padding_w=pad)
            assert infer(pool2d, [t(1, 2, length, length)]) == [((1, 2, count, count), F32)]


@SETTINGS
@given(st.integers(0, 3), st.integers(1, 3), st.integers(1, 3), st.integers(0, 3),
       st.integers(0, 3))
def test_pixel_shuffle_matches_reshape_transpose(n, c, r, h, w):
    """torch PixelShuffle = ONNX DepthToSpace CRD: reshape, transpose, reshape (and back)."""
    x = np.empty((n, c * r * r, h, w))
    y = x.reshape(n, c, r, r, h, w).transpose(0, 1, 4, 2, 5, 3).reshape(n, c, h * r, w * r)
    assert infer(PixelShuffle(upscale=r), [t(*x.shape)]) == [(y.shape, F32)]
    z = y.reshape(n, c, h, r, w, r).transpose(0, 1, 3, 5, 2, 4).reshape(n, c * r * r, h, w)
    assert infer(PixelUnshuffle(downscale=r), [t(*y.shape)]) == [(z.shape, F32)]


# -- robustness: any input gives outputs or a ShapeError, never another exception ---------------
# A seeded plain-random fuzz (much cheaper per case than hypothesis): ranks 0..5, zero and unknown
# dims, every dtype, payload values including 0, negative axes, nan and inf.
DIMS = [-1, 0, 1, 2, 3, 4, 8, 32, 64]
DTYPES = [F32] * 8 + list(DType)


def random_field(rng: random.Random, wire: str):
    return {
        "u8": lambda: rng.randint(0, 5),
        "u32": lambda: rng.choice([0, 1, 2, 3, 4, 8, 32, 64]),
        "i32": lambda: rng.randint(-6, 6),
        "bool": lambda: rng.random() < 0.5,
        "dtype": lambda: rng.choice(list(DType)),
        "f32": lambda: rng.choice([-1.0, 0.0, 0.5, 1.0, 2.0, 1e4, math.inf, -math.inf]),  # NaN: refused
        "i64[]": lambda: tuple(rng.choice([-2, -1, 0, 1, 2, 3, 8]) for _ in range(rng.randint(0, 5))),
    }[wire]()


@pytest.mark.parametrize("name", sorted(ops.OPS_BY_NAME))
def test_rules_only_raise_shape_error(name):
    op_spec = ops.OPS_BY_NAME[name]
    rng = random.Random(op_spec.tag)
    lo, hi = op_spec.inputs
    for _ in range(400):
        op = op_spec.cls(**{f.name: random_field(rng, f.wire.name) for f in op_spec.fields})
        inputs = [TensorSpec(tuple(rng.choice(DIMS) for _ in range(rng.randint(0, 5))),
                             rng.choice(DTYPES)) for _ in range(rng.randint(lo, min(hi, lo + 3)))]
        try:
            out = op_spec.shape(op, inputs)
        except ShapeError as err:
            assert str(err).startswith(f"{name}: ")
        else:
            assert len(out) == op_spec.num_outputs(op), (op, inputs)
            assert all(isinstance(o, TensorSpec) and min(o.shape, default=0) >= -1 for o in out)


def _hide(spec: TensorSpec, mask) -> TensorSpec:
    """Make the masked dims unknown; a 0 dim stays, as rules assume unknown dims are non-zero."""
    return TensorSpec(tuple(-1 if h and d else d for d, h in zip(spec.shape, mask)), spec.dtype)


@pytest.mark.parametrize("op, inputs, expected", VALID)
def test_unknown_dims_never_fail_a_valid_case(op, inputs, expected):
    """Hiding input dims as -1 keeps a valid case valid; each output dim stays or becomes -1."""
    rng = random.Random(repr(op))
    masks = [[[True] * len(s.shape) for s in inputs]]  # everything unknown
    masks += [[[rng.random() < 0.5 for _ in s.shape] for s in inputs] for _ in range(15)]
    for mask in masks:
        got = infer(op, [_hide(s, m) for s, m in zip(inputs, mask)])
        assert [d for _, d in got] == [d for _, d in expected]
        for (shape, _), (want, _) in zip(got, expected):
            assert len(shape) == len(want) and all(g in (-1, w) for g, w in zip(shape, want)), \
                (mask, got, expected)


@pytest.mark.parametrize("op, inputs, expected", VALID)
def test_mutated_valid_cases_only_raise_shape_error(op, inputs, expected):
    """Near-valid inputs (one dim, rank or dtype changed) reach deep into each rule."""
    rng = random.Random(repr(op) + "mutate")
    for _ in range(30):
        mutated = list(inputs)
        i = rng.randrange(len(mutated))
        shape, dtype = list(mutated[i].shape), mutated[i].dtype
        kind = rng.randrange(3)
        if kind == 0 and shape:
            shape[rng.randrange(len(shape))] = rng.choice([-1, 0, 1, 2, 3, 5, 7, 64])
        elif kind == 1:
            shape = shape[1:] if shape and rng.random() < 0.5 else [rng.choice([0, 1, 2])] + shape
        else:
            dtype = rng.choice(list(DType))
        mutated[i] = TensorSpec(tuple(shape), dtype)
        try:
            out = op.spec.shape(op, mutated)
        except ShapeError as err:
            assert str(err).startswith(f"{type(op).__name__}: ")
        else:
            assert len(out) == op.spec.num_outputs(op)
