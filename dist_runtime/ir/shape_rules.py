"""Shape rules: for each op, output TensorSpecs from the payload and the input TensorSpecs.

(Being written: each rule below is filled in with the op's maths from docs/ops.md.)
"""

from __future__ import annotations

from ..errors import GraphValidationError


class ShapeError(GraphValidationError):
    """A shape rule rejected its inputs; the validator adds the node and its neighbours."""


def ada_ln(op, inputs):
    raise NotImplementedError


def argmax(op, inputs):
    raise NotImplementedError


def broadcast(op, inputs):
    raise NotImplementedError


def causal_conv1d(op, inputs):
    raise NotImplementedError


def chunk(op, inputs):
    raise NotImplementedError


def concat(op, inputs):
    raise NotImplementedError


def conv(op, inputs):
    raise NotImplementedError


def conv_transpose(op, inputs):
    raise NotImplementedError


def dequantize(op, inputs):
    raise NotImplementedError


def fused_norm_matmul(op, inputs):
    raise NotImplementedError


def fused_skip_norm(op, inputs):
    raise NotImplementedError


def fused_swiglu(op, inputs):
    raise NotImplementedError


def gated(op, inputs):
    raise NotImplementedError


def glu(op, inputs):
    raise NotImplementedError


def interpolate(op, inputs):
    raise NotImplementedError


def kron(op, inputs):
    raise NotImplementedError


def kv_cache(op, inputs):
    raise NotImplementedError


def kv_compress(op, inputs):
    raise NotImplementedError


def kv_decompress(op, inputs):
    raise NotImplementedError


def lora_apply(op, inputs):
    raise NotImplementedError


def matmul(op, inputs):
    raise NotImplementedError


def matrix_inverse(op, inputs):
    raise NotImplementedError


def norm_channels(op, inputs):
    raise NotImplementedError


def norm_last(op, inputs):
    raise NotImplementedError


def patch_embed(op, inputs):
    raise NotImplementedError


def permute(op, inputs):
    raise NotImplementedError


def pixel_shuffle(op, inputs):
    raise NotImplementedError


def pixel_unshuffle(op, inputs):
    raise NotImplementedError


def pool(op, inputs):
    raise NotImplementedError


def pos_embed(op, inputs):
    raise NotImplementedError


def prelu(op, inputs):
    raise NotImplementedError


def quantize(op, inputs):
    raise NotImplementedError


def relative_pos_embedding(op, inputs):
    raise NotImplementedError


def reshape(op, inputs):
    raise NotImplementedError


def rope(op, inputs):
    raise NotImplementedError


def sample(op, inputs):
    raise NotImplementedError


def scheduler_step(op, inputs):
    raise NotImplementedError


def sdpa(op, inputs):
    raise NotImplementedError


def sinusoidal_embed(op, inputs):
    raise NotImplementedError


def softmax(op, inputs):
    raise NotImplementedError


def split(op, inputs):
    raise NotImplementedError


def token_embed(op, inputs):
    raise NotImplementedError


def transpose(op, inputs):
    raise NotImplementedError


def unary(op, inputs):
    raise NotImplementedError


def unpatchify(op, inputs):
    raise NotImplementedError

