"""Every op of the tag table has the four things an op needs: a numpy kernel, a shape rule that runs
on a valid example, a binary codec round trip, and a conformance test against a reference: ONNX
cases that pass through our converters (tests/onnx_conformance.py), or a tests/test_kernels_*.py
module that uses the op (``Op(`` in its source, or a case of a fixture npz it loads).

The test fails listing every op that lacks any of them; ``EXAMPLES`` must name every op, so a new
op cannot be added without an example.
"""

from __future__ import annotations

import onnx_conformance as oc
from dist_runtime.dtypes import DType
from dist_runtime.ir import decode_graph, encode_graph
from dist_runtime.ir.graph import Graph, Node, TensorSpec
from dist_runtime.ir.ops import OPS_BY_NAME
from dist_runtime.kernels.registry import kernel_for

F, Q8, I32, I64 = DType.F32, DType.Q8_0, DType.I32, DType.I64

_ATTN_IN = [((1, 3, 8), F), ((1, 5, 4), F), ((1, 5, 4), F)]
_HEADS = dict(num_heads=2, kv_heads=1, head_dim=4)

#: op -> (payload fields, [(shape, dtype) of each input]): one valid example per op.
EXAMPLES: dict[str, tuple[dict, list[tuple[tuple[int, ...], DType]]]] = {
    "Matmul": ({}, [((2, 4), F), ((3, 4), F)]),
    "Add": ({}, [((2, 3), F), ((3,), F)]),
    "Mul": ({}, [((2, 3), F), ((3,), F)]),
    "Sub": ({}, [((2, 3), F), ((3,), F)]),
    "Div": ({}, [((2, 3), F), ((3,), F)]),
    "Transpose": ({}, [((2, 3), F)]),
    "Reshape": (dict(shape=(3, 2)), [((2, 3), F)]),
    "Permute": (dict(perm=(1, 0)), [((2, 3), F)]),
    "Concat": (dict(dim=0), [((2, 3), F), ((1, 3), F)]),
    "Split": (dict(sizes=(1, 2)), [((2, 3), F)]),
    "Chunk": (dict(dim=0, chunks=2), [((2, 3), F)]),
    "Clamp": (dict(min=0.0, max=1.0), [((2, 3), F)]),
    "NanToNum": ({}, [((2, 3), F)]),
    "Sdpa": (dict(_HEADS, causal=True), _ATTN_IN),
    "SdpaCross": (_HEADS, _ATTN_IN),
    "SdpaWindow": (dict(_HEADS, window=2), _ATTN_IN),
    "KvCache": ({}, [((1, 3, 4), F), ((1, 3, 4), F)]),
    "KvCompress": (dict(dtype=Q8), [((2, 32), F)]),
    "KvDecompress": (dict(dtype=F), [((2, 32), Q8)]),
    "Rope": (dict(head_dim=4, rope_dim=4), [((3, 8), F), ((1,), F)]),
    "SinusoidalEmbed": (dict(dim=8), [((3,), F)]),
    "RelativePosEmbedding": ({}, [((3, 4), F), ((5, 4), F), ((32, 2), F)]),
    "RmsNorm": ({}, [((2, 4), F), ((4,), F)]),
    "LayerNorm": ({}, [((2, 4), F), ((4,), F), ((4,), F)]),
    "BatchNorm": ({}, [((2, 3, 4), F)] + [((3,), F)] * 4),
    "GroupNorm": (dict(num_groups=2), [((2, 4, 3), F), ((4,), F), ((4,), F)]),
    "InstanceNorm": ({}, [((2, 3, 4), F), ((3,), F), ((3,), F)]),
    "AdaLN": ({}, [((2, 3, 4), F), ((2, 1, 4), F), ((2, 1, 4), F)]),
    "Silu": ({}, [((2, 3), F)]),
    "Gelu": (dict(approximate=True), [((2, 3), F)]),
    "GeGlu": ({}, [((2, 6), F)]),
    "SwiGlu": ({}, [((2, 6), F), ((2, 6), F)]),
    "Glu": (dict(dim=0), [((2, 6), F)]),
    "Relu": ({}, [((2, 3), F)]),
    "LeakyRelu": (dict(alpha=0.2), [((2, 3), F)]),
    "PRelu": ({}, [((2, 3), F), ((3,), F)]),
    "Sigmoid": ({}, [((2, 3), F)]),
    "Tanh": ({}, [((2, 3), F)]),
    "Softmax": (dict(dim=0), [((2, 3), F)]),
    "Conv1d": (dict(kernel=3, padding=1), [((1, 2, 8), F), ((4, 2, 3), F), ((4,), F)]),
    "Conv2d": (dict(kernel_h=3, kernel_w=3, stride_h=2), [((1, 2, 8, 8), F), ((4, 2, 3, 3), F)]),
    "Conv3d": (dict(kernel_d=2, kernel_h=2, kernel_w=2), [((1, 2, 4, 4, 4), F), ((3, 2, 2, 2, 2), F)]),
    "ConvTranspose2d": (dict(kernel_h=3, kernel_w=3, stride_h=2, stride_w=2),
                        [((1, 2, 4, 4), F), ((2, 3, 3, 3), F)]),
    "CausalConv1d": (dict(kernel=3, groups=2), [((1, 2, 8), F), ((2, 1, 3), F)]),
    "DepthwiseConv": (dict(kernel_h=3, kernel_w=3), [((1, 2, 8, 8), F), ((4, 1, 3, 3), F)]),
    "Pool": (dict(mode=1, kernel_h=2, kernel_w=2, stride_h=2, stride_w=2), [((1, 2, 8, 8), F)]),
    "Interpolate": (dict(mode=1, out_h=6, out_w=6), [((1, 2, 4, 4), F)]),
    "PixelShuffle": (dict(upscale=2), [((1, 8, 3, 3), F)]),
    "PixelUnshuffle": (dict(downscale=2), [((1, 2, 6, 6), F)]),
    "PatchEmbed": (dict(patch_h=2, patch_w=2), [((1, 3, 4, 4), F), ((8, 3, 2, 2), F), ((8,), F)]),
    "Unpatchify": (dict(patch_h=2, patch_w=2, channels=3, grid_h=2, grid_w=2), [((1, 4, 12), F)]),
    "TokenEmbed": ({}, [((5,), I32), ((10, 4), F)]),
    "PosEmbed": (dict(offset=2), [((1, 3, 4), F), ((8, 4), F)]),
    "NoiseSchedule": ({}, [((1, 4), F), ((1, 4), F), ((), I64), ((), I64)]),
    "FlowStep": (dict(shift=3.0), [((1, 4), F), ((1, 4), F), ((), F), ((), F)]),
    "Quantize": (dict(dtype=Q8), [((2, 32), F)]),
    "Dequantize": (dict(dtype=F), [((2, 32), Q8)]),
    "Sample": (dict(method=2, k=3), [((2, 10), F)]),
    "LoraApply": (dict(scale=0.5), [((2, 8), F), ((6, 8), F), ((2, 8), F), ((6, 2), F)]),
    "Kron": ({}, [((2, 2), F), ((3, 3), F)]),
    "MatrixInverse": ({}, [((3, 3), F)]),
    "FusedNormMatmul": ({}, [((2, 8), F), ((8,), F), ((6, 8), F)]),
    "FusedSkipNorm": ({}, [((2, 8), F), ((2, 8), F), ((8,), F)]),
    "FusedSwiGlu": ({}, [((2, 8), F), ((6, 8), F), ((6, 8), F)]),
    "FlashAttention": (dict(_HEADS, block=2), _ATTN_IN),
    "Argmax": ({}, [((2, 5), F)]),
}


def _example(name: str):
    fields, inputs = EXAMPLES[name]
    op = OPS_BY_NAME[name].cls(**fields)
    return op, [TensorSpec(shape, dtype) for shape, dtype in inputs]


def _has_kernel(name: str) -> bool:
    try:
        kernel_for(OPS_BY_NAME[name].cls)
    except KeyError:
        return False
    return True


def _shape_rule_runs(name: str) -> bool:
    op, specs = _example(name)
    outs = op.spec.shape(op, specs)
    return len(outs) == op.spec.num_outputs(op) and all(isinstance(s, TensorSpec) for s in outs)


def _codec_round_trips(name: str) -> bool:
    op, specs = _example(name)
    inputs = [f"in{i}" for i in range(len(specs))]
    outputs = [f"out{i}" for i in range(op.spec.num_outputs(op))]
    graph = Graph([Node(7, op, inputs, outputs, backend_hint=0)], specs, outputs, {})
    return decode_graph(encode_graph(graph)) == graph


def _conformance(name: str) -> list[str]:
    """Where the op is checked against a reference: ONNX cases that pass, kernel test modules."""
    onnx_passed = sum(1 for o in oc.outcomes().values() if o.status == "passed" and name in o.ops)
    found = [f"{onnx_passed} ONNX cases"] if onnx_passed else []
    return found + oc.kernel_test_mentions().get(name, [])


def test_every_op_has_an_example():
    assert set(EXAMPLES) == set(OPS_BY_NAME), (
        f"EXAMPLES lacks {sorted(set(OPS_BY_NAME) - set(EXAMPLES))}, names unknown ops "
        f"{sorted(set(EXAMPLES) - set(OPS_BY_NAME))}")


def test_every_op_has_a_kernel_a_shape_rule_a_codec_round_trip_and_a_conformance_test():
    missing: dict[str, list[str]] = {}
    for name in sorted(OPS_BY_NAME):
        lacks = []
        if not _has_kernel(name):
            lacks.append("a registered kernel")
        if name not in EXAMPLES:
            lacks.append("an example (so no shape rule or codec check)")
        else:
            try:
                ok = _shape_rule_runs(name)
            except Exception as e:  # noqa: BLE001
                ok, detail = False, f": {e}"
            else:
                detail = ""
            if not ok:
                lacks.append(f"a shape rule that runs on a valid example{detail}")
            if not _codec_round_trips(name):
                lacks.append("a codec round trip")
        if not _conformance(name):
            lacks.append("a conformance test (no passing ONNX case, no tests/test_kernels_*.py using it)")
        if lacks:
            missing[name] = lacks
    assert not missing, "ops lacking coverage:\n" + "\n".join(
        f"  {name}: {', '.join(lacks)}" for name, lacks in missing.items())

