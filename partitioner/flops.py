"""FLOPs of one node from its op and its (fully resolved) input and output shapes, and the
scratch memory an op holds while it runs beyond its inputs and outputs.

The partitioner needs relative work, not a cycle-accurate model: a multiply-add is 2 FLOPs, the
contractions (Matmul, attention, convolutions) are counted exactly from shapes, and elementwise
ops cost a small constant per output element.  Layout ops that only reinterpret memory cost 0.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

from dist_runtime.attention_pieces import workspace_bytes

Shape = tuple[int, ...]


def numel(shape: Shape) -> int:
    return math.prod(shape)


def _matmul(op, ins, outs):  # y[..., M, N] = a[..., M, K] @ b: one multiply-add per (y, k)
    return 2 * numel(outs[0]) * (ins[0][-1] if ins[0] else 1)


def _attention(op, ins, outs):
    # Scores q.k^T and the weighted sum of v: 2 * 2 multiply-adds per (query row, key, feature),
    # plus a softmax (~5 per score).  q is [..., Tq, H*hd], k is [..., Tk, KV*hd].
    q, k = ins[0], ins[1]
    keys = k[-2] if len(k) >= 2 else 1
    if hasattr(op, "window"):
        keys = min(keys, op.window)
    rows = numel(q) // max(q[-1], 1)  # batch * Tq
    scores = rows * op.num_heads * keys
    return 4 * numel(q) * keys + 5 * scores


def _conv(op, ins, outs):  # each output element: C_in/groups * kernel multiply-adds
    out_channels = ins[1][0] if ins[1] else 1
    return 2 * numel(outs[0]) * (numel(ins[1]) // max(out_channels, 1))


def _conv_transpose(op, ins, outs):  # each input element scatters into O/g * kernel outputs
    in_channels = ins[1][0] if ins[1] else 1
    return 2 * numel(ins[0]) * (numel(ins[1]) // max(in_channels, 1))


def _pool(op, ins, outs):
    return numel(outs[0]) * op.kernel_h * op.kernel_w


def _lora(op, ins, outs):  # x @ W^T + (x @ A^T) @ B^T
    x, w, a = ins[0], ins[1], ins[2]
    rows = numel(x) // max(x[-1], 1)
    rank = a[0] if a else 0
    return 2 * numel(outs[0]) * x[-1] + 2 * rows * rank * (x[-1] + w[0]) + numel(outs[0])


def _fused_norm_matmul(op, ins, outs):
    return 4 * numel(ins[0]) + _matmul(op, ins, outs)


def _fused_swiglu(op, ins, outs):
    return 2 * 2 * numel(outs[0]) * ins[0][-1] + 5 * numel(outs[0])


def _inverse(op, ins, outs):
    n = ins[0][-1] if ins[0] else 1
    return 2 * numel(ins[0]) * n  # ~2n^3 per matrix


def _per_output(factor: int) -> Callable:
    return lambda op, ins, outs: factor * sum(numel(o) for o in outs)


def _per_input(factor: int) -> Callable:
    return lambda op, ins, outs: factor * numel(ins[0])


_FREE = lambda op, ins, outs: 0  # noqa: E731 -- views and reinterpretations

RULES: dict[str, Callable] = {
    "Matmul": _matmul,
    "Sdpa": _attention, "SdpaCross": _attention, "SdpaWindow": _attention, "FlashAttention": _attention,
    "Conv1d": _conv, "Conv2d": _conv, "Conv3d": _conv, "CausalConv1d": _conv, "DepthwiseConv": _conv,
    "PatchEmbed": _conv, "ConvTranspose2d": _conv_transpose,
    "Pool": _pool, "LoraApply": _lora, "FusedNormMatmul": _fused_norm_matmul,
    "FusedSwiGlu": _fused_swiglu, "MatrixInverse": _inverse,
    "Reshape": _FREE, "Chunk": _FREE, "Split": _FREE,
    # ~constant work per element:
    "RmsNorm": _per_output(4), "LayerNorm": _per_output(8), "BatchNorm": _per_output(4),
    "GroupNorm": _per_output(8), "InstanceNorm": _per_output(8), "AdaLN": _per_output(10),
    "FusedSkipNorm": _per_output(3), "Softmax": _per_output(5), "Rope": _per_output(6),
    "Silu": _per_output(4), "Gelu": _per_output(8), "Sigmoid": _per_output(4), "Tanh": _per_output(4),
    "SwiGlu": _per_output(5), "GeGlu": _per_output(9), "Glu": _per_output(5),
    "Quantize": _per_output(4), "Dequantize": _per_output(2), "KvCompress": _per_output(4),
    "KvDecompress": _per_output(2), "Interpolate": _per_output(4), "NoiseSchedule": _per_output(4),
    "FlowStep": _per_output(3), "SinusoidalEmbed": _per_output(8),
    "KvCache": lambda op, ins, outs: sum(numel(i) for i in ins),  # appends the new rows
    "Sample": _per_input(5), "Argmax": _per_input(1),
}


def flops(op, inputs: Sequence[Shape], outputs: Sequence[Shape]) -> int:
    """FLOPs of ``op`` with resolved input and output shapes (default: one per output element)."""
    rule = RULES.get(type(op).__name__)
    if rule is None:
        return sum(numel(o) for o in outputs)
    return int(rule(op, inputs, outputs))


def workspace(op, inputs: Sequence[Shape], itemsize: int) -> int:
    """Bytes an op allocates while it runs besides its outputs, as the kernel that runs it does.
    Sdpa and SdpaWindow on 2-D rows without a mask run on the compiled attention, which cuts each
    query row's keys into pieces (:func:`dist_runtime.attention_pieces.workspace_bytes`: no
    [rows, keys] score matrix); the CPU library's attention materialises its scores and
    probabilities ``[..., heads, Tq, Tk]`` (FlashAttention only one key block of them), in the
    query's element size.  The other ops work in their outputs."""
    name = type(op).__name__
    if name not in ("Sdpa", "SdpaCross", "SdpaWindow", "FlashAttention"):
        return 0
    q, k = inputs[0], inputs[1]
    keys = k[-2] if len(k) >= 2 else 1
    rows = numel(q) // max(q[-1], 1)  # batch * Tq
    if name in ("Sdpa", "SdpaWindow") and len(inputs) == 3 and len(q) == len(k) == 2:
        seen = min(keys, 2 * op.window + 1) if name == "SdpaWindow" else keys
        return workspace_bytes(rows, seen, op.num_heads, op.head_dim)
    if name == "FlashAttention":
        keys = min(keys, op.block)
    return 2 * rows * op.num_heads * keys * itemsize
