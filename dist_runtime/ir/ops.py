"""Every op of the seed's tag table, as a payload class plus one ``OpSpec`` entry.

Each op is declared once, here, with the machinery of ``payload.py``::

    @op(26, inputs=(2, 2), doc="Rotary position embedding (HF rotate-half).")
    class Rope(OpPayload):
        head_dim: U32
        rope_dim: U32
        base: F32

The class fields are the payload, in wire order, with their wire type (``U8``, ``U32``, ``I32``,
``F32``, ``Bool``, ``Ints``, ``DTypeTag``...) in the annotation.  From that single declaration the
binary codec, the TOML form, validation of input/output counts, the generated docs and the
kernel registry all work; ``shape_rules.py`` adds each op's shape rule to its ``OpSpec``.  Tags
are the seed's and never change (``tests/test_tags.py`` pins them).  Payload semantics are
documented in docs/ops.md.
"""

from __future__ import annotations

import math

from ..dtypes import DType
from .payload import (ALONG_DIM, INDEPENDENT, OPS_BY_NAME, OPS_BY_TAG, PER_SESSION, POSITIONAL, Bool, DTypeTag, F32,
                      Field, I32, Ints, OpPayload, OpSpec, U8, U32, op)
INF = math.inf

# -- 0..19: arithmetic and layout ----------------------------------------------------------------
@op(0, inputs=(2, 2), rows=INDEPENDENT, weight_inputs=(1,),
    doc="Matrix product. transpose_b: y = a @ b^T with b stored [N, K] (HF/GGML weight layout).")
class Matmul(OpPayload):
    transpose_b: Bool = True


@op(1, inputs=(2, 2), rows=INDEPENDENT, doc="Elementwise a + b with numpy broadcasting.")
class Add(OpPayload):
    pass


@op(2, inputs=(2, 2), rows=INDEPENDENT, doc="Elementwise a * b with numpy broadcasting.")
class Mul(OpPayload):
    pass


@op(3, inputs=(2, 2), rows=INDEPENDENT, doc="Elementwise a - b with numpy broadcasting.")
class Sub(OpPayload):
    pass


@op(4, inputs=(2, 2), rows=INDEPENDENT, doc="Elementwise a / b with numpy broadcasting.")
class Div(OpPayload):
    pass


@op(5, inputs=(1, 1), doc="Swap two dims (torch.transpose).")
class Transpose(OpPayload):
    dim0: I32 = -2
    dim1: I32 = -1


@op(6, inputs=(1, 1),
    doc="Reshape; one -1 is inferred, 0 copies the input dim at that index (ONNX Reshape).")
class Reshape(OpPayload):
    shape: Ints = ()


@op(7, inputs=(1, 1), doc="Permute dims (torch.permute / ONNX Transpose).")
class Permute(OpPayload):
    perm: Ints = ()


@op(8, inputs=(1, 2**32 - 1), rows=ALONG_DIM, doc="Concatenate inputs along dim.")
class Concat(OpPayload):
    dim: I32 = -1


@op(9, inputs=(1, 1), rows=ALONG_DIM, outputs="sizes",
    doc="Split along dim into pieces of the given sizes; one output per size.")
class Split(OpPayload):
    dim: I32 = -1
    sizes: Ints = ()


@op(10, inputs=(1, 1), rows=ALONG_DIM, outputs="chunks",
    doc="Split along dim into `chunks` equal pieces (the dim must divide evenly).")
class Chunk(OpPayload):
    dim: I32 = -1
    chunks: U32 = 2


@op(11, inputs=(1, 1), rows=INDEPENDENT, doc="Clamp to [min, max] (±inf for no bound).")
class Clamp(OpPayload):
    min: F32 = -INF
    max: F32 = INF


@op(12, inputs=(1, 1), rows=INDEPENDENT, doc="Replace NaN and ±inf (torch.nan_to_num).")
class NanToNum(OpPayload):
    nan: F32 = 0.0
    posinf: F32 = 3.4028234663852886e38
    neginf: F32 = -3.4028234663852886e38


# -- 20..39: attention and positions ------------------------------------------------------------
@op(20, inputs=(3, 4), rows=PER_SESSION,
    doc="Scaled dot-product attention, grouped-query; optional additive mask as 4th input.")
class Sdpa(OpPayload):
    num_heads: U32
    kv_heads: U32
    head_dim: U32
    causal: Bool = False


@op(21, inputs=(3, 4), rows=PER_SESSION,
    doc="Cross attention: queries from one sequence, keys/values from another; never causal.")
class SdpaCross(OpPayload):
    num_heads: U32
    kv_heads: U32
    head_dim: U32


@op(22, inputs=(3, 4), rows=PER_SESSION,
    doc="Sliding-window attention: each query sees at most `window` keys ending at itself "
        "(causal); non-causal: keys less than `window` away on either side.")
class SdpaWindow(OpPayload):
    num_heads: U32
    kv_heads: U32
    head_dim: U32
    window: U32
    causal: Bool = True


@op(23, inputs=(2, 2), rows=PER_SESSION, outputs=2,
    doc="Append K_new, V_new rows to this node's per-session accumulators; output the full K, V.")
class KvCache(OpPayload):
    max_seq: U32 = 0  # capacity hint for preallocation; 0 = grow as needed


@op(24, inputs=(1, 1), rows=INDEPENDENT,
    doc="Quantize a K or V tensor row-wise to `dtype` (Q8_0, Q4_0, F16, BF16) for storage.")
class KvCompress(OpPayload):
    dtype: DTypeTag = DType.Q8_0


@op(25, inputs=(1, 1), rows=INDEPENDENT,
    doc="Dequantize a compressed K or V tensor back to `dtype` (F32).")
class KvDecompress(OpPayload):
    dtype: DTypeTag = DType.F32


@op(26, inputs=(2, 2), rows=POSITIONAL,
    doc="Rotary embedding, HF rotate-half, first rope_dim dims of each head rotated; inputs x, pos.")
class Rope(OpPayload):
    head_dim: U32
    rope_dim: U32
    base: F32 = 10000.0


@op(27, inputs=(1, 1), rows=INDEPENDENT,
    doc="Sinusoidal timestep embedding (diffusers get_timestep_embedding).")
class SinusoidalEmbed(OpPayload):
    dim: U32
    max_period: F32 = 10000.0
    flip_sin_to_cos: Bool = True
    downscale_freq_shift: F32 = 1.0


@op(28, inputs=(3, 4), rows=POSITIONAL,
    doc="T5 bucketed relative position bias [heads, Tq, Tk] from q, k and the bucket table.")
class RelativePosEmbedding(OpPayload):
    num_buckets: U32 = 32
    max_distance: U32 = 128
    bidirectional: Bool = True


# -- 40..59: normalisation ----------------------------------------------------------------------
@op(40, inputs=(2, 2), rows=INDEPENDENT, doc="RMS norm over the last dim, times weight.")
class RmsNorm(OpPayload):
    eps: F32 = 1e-6


@op(41, inputs=(1, 3), rows=INDEPENDENT,
    doc="Layer norm over the last dim; optional weight and bias.")
class LayerNorm(OpPayload):
    eps: F32 = 1e-5


@op(42, inputs=(5, 5),
    doc="Batch norm (inference) over channel dim 1: inputs x, scale, bias, mean, var.")
class BatchNorm(OpPayload):
    eps: F32 = 1e-5
    momentum: F32 = 0.9


@op(43, inputs=(1, 3),
    doc="Group norm over channel dim 1 split into num_groups; optional weight and bias.")
class GroupNorm(OpPayload):
    eps: F32 = 1e-5
    num_groups: U32 = 32


@op(44, inputs=(1, 3),
    doc="Instance norm: per sample and channel over the spatial dims; optional weight and bias.")
class InstanceNorm(OpPayload):
    eps: F32 = 1e-5


@op(45, inputs=(3, 3),
    doc="Adaptive layer norm (DiT): LayerNorm(x) * (1 + scale) + shift; inputs x, shift, scale.")
class AdaLN(OpPayload):
    eps: F32 = 1e-6


# -- 60..79: activations ------------------------------------------------------------------------
@op(60, inputs=(1, 1), rows=INDEPENDENT, doc="x * sigmoid(x).")
class Silu(OpPayload):
    pass


@op(61, inputs=(1, 1), rows=INDEPENDENT, doc="GELU; approximate: false = erf, true = tanh.")
class Gelu(OpPayload):
    approximate: Bool = False


@op(62, inputs=(1, 2), rows=INDEPENDENT,
    doc="GEGLU: a * gelu(b); one input is split in half along the last dim, or inputs a, b.")
class GeGlu(OpPayload):
    approximate: Bool = False


@op(63, inputs=(1, 2), rows=INDEPENDENT,
    doc="SwiGLU: silu(gate) * up; one input is split in half (gate first), or inputs gate, up.")
class SwiGlu(OpPayload):
    pass


@op(64, inputs=(1, 1), rows=ALONG_DIM, doc="GLU: a * sigmoid(b), halves along dim (torch GLU).")
class Glu(OpPayload):
    dim: I32 = -1


@op(65, inputs=(1, 1), rows=INDEPENDENT, doc="max(x, 0).")
class Relu(OpPayload):
    pass


@op(66, inputs=(1, 1), rows=INDEPENDENT, doc="x if x >= 0 else alpha * x.")
class LeakyRelu(OpPayload):
    alpha: F32 = 0.01


@op(67, inputs=(2, 2), rows=INDEPENDENT, doc="x if x >= 0 else slope * x (ONNX PRelu).")
class PRelu(OpPayload):
    pass


@op(68, inputs=(1, 1), rows=INDEPENDENT, doc="1 / (1 + exp(-x)).")
class Sigmoid(OpPayload):
    pass


@op(69, inputs=(1, 1), rows=INDEPENDENT, doc="tanh(x).")
class Tanh(OpPayload):
    pass


@op(70, inputs=(1, 1), rows=ALONG_DIM, doc="Softmax along dim (negative counts from the end).")
class Softmax(OpPayload):
    dim: I32 = -1


# -- 80..99: convolution and pooling ------------------------------------------------------------
@op(80, inputs=(2, 3), doc="1-D convolution, input [N, C, L], weight [O, C/g, k].")
class Conv1d(OpPayload):
    kernel: U32
    stride: U32 = 1
    padding: U32 = 0
    dilation: U32 = 1
    groups: U32 = 1


@op(81, inputs=(2, 3),
    doc="2-D convolution, input [N, C, H, W], weight [O, C/g, kh, kw].")
class Conv2d(OpPayload):
    kernel_h: U32
    kernel_w: U32
    stride_h: U32 = 1
    stride_w: U32 = 1
    padding_h: U32 = 0
    padding_w: U32 = 0
    dilation_h: U32 = 1
    dilation_w: U32 = 1
    groups: U32 = 1


@op(82, inputs=(2, 3),
    doc="3-D convolution, input [N, C, D, H, W], weight [O, C/g, kd, kh, kw].")
class Conv3d(OpPayload):
    kernel_d: U32
    kernel_h: U32
    kernel_w: U32
    stride_d: U32 = 1
    stride_h: U32 = 1
    stride_w: U32 = 1
    padding_d: U32 = 0
    padding_h: U32 = 0
    padding_w: U32 = 0
    dilation_d: U32 = 1
    dilation_h: U32 = 1
    dilation_w: U32 = 1
    groups: U32 = 1


@op(83, inputs=(2, 3),
    doc="2-D transposed convolution, weight [C, O/g, kh, kw] (torch ConvTranspose2d).")
class ConvTranspose2d(OpPayload):
    kernel_h: U32
    kernel_w: U32
    stride_h: U32 = 1
    stride_w: U32 = 1
    padding_h: U32 = 0
    padding_w: U32 = 0
    output_padding_h: U32 = 0
    output_padding_w: U32 = 0
    dilation_h: U32 = 1
    dilation_w: U32 = 1
    groups: U32 = 1


@op(84, inputs=(2, 3),
    doc="Causal 1-D convolution: left padding (kernel-1)*dilation, stride 1 (Mamba, WaveNet).")
class CausalConv1d(OpPayload):
    kernel: U32
    dilation: U32 = 1
    groups: U32 = 1


@op(85, inputs=(2, 3),
    doc="Depthwise 2-D convolution: groups = C, weight [C*m, 1, kh, kw].")
class DepthwiseConv(OpPayload):
    kernel_h: U32
    kernel_w: U32
    stride_h: U32 = 1
    stride_w: U32 = 1
    padding_h: U32 = 0
    padding_w: U32 = 0
    dilation_h: U32 = 1
    dilation_w: U32 = 1


@op(86, inputs=(1, 1),
    doc="Max/avg pooling over H, W of [N, C, H, W] (or L of [N, C, L]); avg excludes padding.")
class Pool(OpPayload):
    mode: U8  # 0 = max, 1 = avg
    kernel_h: U32
    kernel_w: U32
    stride_h: U32 = 1
    stride_w: U32 = 1
    padding_h: U32 = 0
    padding_w: U32 = 0


# -- 100..119: resampling and patches -----------------------------------------------------------
@op(100, inputs=(1, 1),
    doc="Resize the last two dims; mode 0 nearest, 1 bilinear, 2 bicubic (torch interpolate).")
class Interpolate(OpPayload):
    mode: U8 = 0
    align_corners: Bool = False
    out_h: U32 = 0  # 0: use scale_h
    out_w: U32 = 0
    scale_h: F32 = 1.0
    scale_w: F32 = 1.0


@op(101, inputs=(1, 1), doc="[N, C*r*r, H, W] -> [N, C, H*r, W*r].")
class PixelShuffle(OpPayload):
    upscale: U32


@op(102, inputs=(1, 1), doc="[N, C, H*r, W*r] -> [N, C*r*r, H, W].")
class PixelUnshuffle(OpPayload):
    downscale: U32


@op(103, inputs=(2, 3),
    doc="ViT patch embedding: image [N, C, H, W], weight [D, C, ph, pw] -> [N, (H/ph)(W/pw), D].")
class PatchEmbed(OpPayload):
    patch_h: U32
    patch_w: U32


@op(104, inputs=(1, 1),
    doc="DiT unpatchify: [N, gh*gw, ph*pw*C] -> [N, C, gh*ph, gw*pw].")
class Unpatchify(OpPayload):
    patch_h: U32
    patch_w: U32
    channels: U32
    grid_h: U32
    grid_w: U32


# -- 120..139: embeddings -----------------------------------------------------------------------
@op(120, inputs=(2, 2), rows=INDEPENDENT, weight_inputs=(1,),
    doc="Row lookup: ids [...], table [V, D] -> [..., D].")
class TokenEmbed(OpPayload):
    pass


@op(121, inputs=(2, 3), rows=POSITIONAL,
    doc="Learned positions: rows offset+pos .. offset+pos+T-1 of table [P, D] for x [..., T, *].")
class PosEmbed(OpPayload):
    offset: U32 = 0


# -- 140..159: generation, schedulers, quantization ---------------------------------------------
@op(140, inputs=(4, 4),
    doc="DDIM step (eta=0) of a discrete noise schedule: sample, model_output, t, t_prev.")
class NoiseSchedule(OpPayload):
    num_train_timesteps: U32 = 1000
    beta_start: F32 = 0.0001
    beta_end: F32 = 0.02
    beta_schedule: U8 = 0  # 0 linear, 1 scaled_linear, 2 squaredcos_cap_v2
    prediction_type: U8 = 0  # 0 epsilon, 1 v_prediction, 2 sample


@op(141, inputs=(4, 4),
    doc="Flow-matching Euler step: sample, velocity, t, t_next (shifted sigmas).")
class FlowStep(OpPayload):
    shift: F32 = 1.0


@op(142, inputs=(1, 3),
    doc="Quantize to `dtype`: GGML blocks (Q8_0, Q4_0) or linear int8/uint8 with scale, zero point.")
class Quantize(OpPayload):
    dtype: DTypeTag = DType.Q8_0
    axis: I32 = -1


@op(143, inputs=(1, 3),
    doc="Dequantize to `dtype` (F32): GGML blocks, or linear (x - zero_point) * scale.")
class Dequantize(OpPayload):
    dtype: DTypeTag = DType.F32
    axis: I32 = -1


@op(144, inputs=(1, 2), rows=PER_SESSION,
    doc="Pick a token id from logits [..., V]; optional seed input. method 0 greedy .. 4 min-p.")
class Sample(OpPayload):
    method: U8 = 0  # 0 greedy, 1 temperature, 2 top-k, 3 top-p, 4 min-p
    temperature: F32 = 1.0
    p: F32 = 1.0
    k: U32 = 0


# -- 160..179: linear algebra -------------------------------------------------------------------
@op(160, inputs=(4, 4), rows=INDEPENDENT, weight_inputs=(1,),
    doc="x @ W^T + scale * (x @ A^T) @ B^T; inputs x, W [N, K], A [r, K], B [N, r].")
class LoraApply(OpPayload):
    scale: F32 = 1.0


@op(161, inputs=(2, 2), doc="Kronecker product of two matrices (torch.kron).")
class Kron(OpPayload):
    pass


@op(162, inputs=(1, 1), doc="Inverse of square matrices [..., n, n].")
class MatrixInverse(OpPayload):
    pass


# -- 180..198: fused ops ------------------------------------------------------------------------
@op(180, inputs=(3, 3), rows=INDEPENDENT, weight_inputs=(2,),
    doc="RmsNorm(x) * norm_weight, then @ W^T; inputs x, norm_weight, W.")
class FusedNormMatmul(OpPayload):
    eps: F32 = 1e-6


@op(181, inputs=(3, 3), rows=INDEPENDENT, outputs=2,
    doc="s = x + residual; outputs s and RmsNorm(s) * weight; inputs x, residual, weight.")
class FusedSkipNorm(OpPayload):
    eps: F32 = 1e-6


@op(182, inputs=(3, 3), rows=INDEPENDENT, weight_inputs=(1, 2),
    doc="silu(x @ W_gate^T) * (x @ W_up^T); inputs x, W_gate, W_up.")
class FusedSwiGlu(OpPayload):
    pass


@op(183, inputs=(3, 4), rows=PER_SESSION,
    doc="Sdpa computed in key blocks with an online softmax (same result, bounded memory).")
class FlashAttention(OpPayload):
    num_heads: U32
    kv_heads: U32
    head_dim: U32
    causal: Bool = False
    block: U32 = 256


# -- 199 ----------------------------------------------------------------------------------------
@op(199, inputs=(1, 1), rows=INDEPENDENT, doc="Index of the max along the last dim, as i64.")
class Argmax(OpPayload):
    pass


# What callers take from here besides the 66 payload classes: the table and its types.
__all__ = ["OPS_BY_NAME", "OPS_BY_TAG", "Field", "OpPayload", "OpSpec", *OPS_BY_NAME]
