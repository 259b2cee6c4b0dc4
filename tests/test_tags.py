"""The {op name: tag} table is a wire contract: a tag is never renumbered or reused.

This literal is copied from the seed's "Op tags" table (shared/spec/graph-ir.seed.txt).  New ops
append here with a new tag; an existing line never changes.
"""

from dist_runtime.ir import ops

SEED_TAGS = {
    "Matmul": 0, "Add": 1, "Mul": 2, "Sub": 3, "Div": 4, "Transpose": 5, "Reshape": 6,
    "Permute": 7, "Concat": 8, "Split": 9, "Chunk": 10, "Clamp": 11, "NanToNum": 12,
    "Sdpa": 20, "SdpaCross": 21, "SdpaWindow": 22, "KvCache": 23, "KvCompress": 24,
    "KvDecompress": 25, "Rope": 26, "SinusoidalEmbed": 27, "RelativePosEmbedding": 28,
    "RmsNorm": 40, "LayerNorm": 41, "BatchNorm": 42, "GroupNorm": 43, "InstanceNorm": 44,
    "AdaLN": 45,
    "Silu": 60, "Gelu": 61, "GeGlu": 62, "SwiGlu": 63, "Glu": 64, "Relu": 65, "LeakyRelu": 66,
    "PRelu": 67, "Sigmoid": 68, "Tanh": 69, "Softmax": 70,
    "Conv1d": 80, "Conv2d": 81, "Conv3d": 82, "ConvTranspose2d": 83, "CausalConv1d": 84,
    "DepthwiseConv": 85, "Pool": 86,
    "Interpolate": 100, "PixelShuffle": 101, "PixelUnshuffle": 102, "PatchEmbed": 103,
    "Unpatchify": 104,
    "TokenEmbed": 120, "PosEmbed": 121,
    "NoiseSchedule": 140, "FlowStep": 141, "Quantize": 142, "Dequantize": 143, "Sample": 144,
    "LoraApply": 160, "Kron": 161, "MatrixInverse": 162,
    "FusedNormMatmul": 180, "FusedSkipNorm": 181, "FusedSwiGlu": 182, "FlashAttention": 183,
    "Argmax": 199,
}


def test_tag_table_is_exactly_the_seeds():
    assert {name: spec.tag for name, spec in ops.OPS_BY_NAME.items()} == SEED_TAGS


def test_tags_unique_and_classes_named_after_ops():
    assert len(ops.OPS_BY_TAG) == len(SEED_TAGS)
    for tag, spec in ops.OPS_BY_TAG.items():
        assert spec.tag == tag and spec.cls.__name__ == spec.name
        assert getattr(ops, spec.name) is spec.cls


def test_seed_payload_layouts():
    """The payloads the seed spells out keep its field order and wire types."""
    def layout(name):
        return [(f.name, f.wire.name) for f in ops.OPS_BY_NAME[name].fields]

    assert layout("Rope") == [("head_dim", "u32"), ("rope_dim", "u32"), ("base", "f32")]
    for norm in ("RmsNorm", "LayerNorm", "InstanceNorm"):
        assert layout(norm) == [("eps", "f32")]
    assert layout("GroupNorm") == [("eps", "f32"), ("num_groups", "u32")]
    assert layout("BatchNorm") == [("eps", "f32"), ("momentum", "f32")]
    assert layout("Sdpa") == [("num_heads", "u32"), ("kv_heads", "u32"), ("head_dim", "u32"), ("causal", "bool")]
    assert layout("Pool") == [("mode", "u8")] + [(f, "u32") for f in (
        "kernel_h", "kernel_w", "stride_h", "stride_w", "padding_h", "padding_w")]
    assert layout("Conv1d") == [(f, "u32") for f in ("kernel", "stride", "padding", "dilation", "groups")]
    assert layout("Conv2d") == [(f, "u32") for f in (
        "kernel_h", "kernel_w", "stride_h", "stride_w", "padding_h", "padding_w",
        "dilation_h", "dilation_w", "groups")]
    assert layout("Softmax") == [("dim", "i32")]
    assert layout("Sample") == [("method", "u8"), ("temperature", "f32"), ("p", "f32"), ("k", "u32")]
    for empty in ("Add", "Mul", "Sub", "Div", "Silu", "Relu", "Sigmoid", "Tanh", "Argmax", "Kron", "MatrixInverse"):
        assert layout(empty) == []
